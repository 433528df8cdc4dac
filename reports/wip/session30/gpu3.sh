#!/bin/bash
# Session 30, call 3: the landed kernel a4e2f531; how far the record's 16k lead over cuDNN
# holds across runs (refattn bench of the two 16k one shots, balanced rounds, four times),
# then Nsight Compute on the d 128 tile, whose softmax now runs under the owed P.V.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HIPKERNEL_CACHE_DIR=/tmp/hkcache
for i in 1 2 3 4; do
  timeout 120 python -m refattn bench --shapes gptoss-16384@0,d128-16384@0 --no-ceilings \
      --json $OUT/bench-$i.json > $OUT/bench-$i.log 2>&1
  echo "bench $i rc $?"
done
OUT=$OUT timeout 220 bash scripts/ncu_h200.sh "d128-16384@0 wgmma_m8_b128_ws"
