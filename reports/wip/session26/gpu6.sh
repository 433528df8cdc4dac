#!/bin/bash
# Session 26, call 6: the bench record with interleaved rounds (kernel b4bdd5e4, the
# default --rounds 3, as the records call runs it), after one run with --rounds 1 (the old
# order) for comparison.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HIPKERNEL_CACHE_DIR=/tmp/hkcache
timeout 200 python -m refattn bench --rounds 1 --json $OUT/bench-rounds1.json > $OUT/bench-rounds1.log 2>&1
echo "rounds1 rc $?" >> $OUT/bench-rounds1.log
mkdir -p $OUT/rel
timeout 300 python -m hipkernel.gpu_session --out $OUT/rel --only bench > $OUT/rel/session.log 2>&1
echo "gpu_session rc $?" >> $OUT/rel/session.log
tail -45 $OUT/rel/session.log
