#!/bin/bash
# Session 29, call 5: the 16k one-shot shapes timed with more, shorter interleaved rounds
# (refattn bench --rounds 3 / 15 / 30 of the same 30 timed calls, then 3 again), to see
# whether the order within a round (hipkernel without the sink right after it with the sink)
# moves the times.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HIPKERNEL_CACHE_DIR=/tmp/hkcache
i=0
for r in 3 15 30 3; do
  i=$((i + 1))
  timeout 150 python -m refattn bench --shapes gptoss-16384@0,d128-16384@0 --rounds $r --no-ceilings \
      --json $OUT/bench-$i-r$r.json > $OUT/bench-$i-r$r.log 2>&1
  echo "run $i rounds $r rc $?"
done
