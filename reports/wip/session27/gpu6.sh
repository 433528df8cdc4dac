#!/bin/bash
# Session 27, call 6: the GPU records of the landed kernel (scripts/h200_records_one_call.sh),
# then, in the time left, the landed d128 tile against the cp.async producer it replaced
# (base/: the kernel files of c500283), same process.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HIPKERNEL_CACHE_DIR=/tmp/hkcache
t0=$(date +%s)
OUT=$OUT timeout 540 bash scripts/h200_records_one_call.sh
echo "records done after $(( $(date +%s) - t0 )) s"
left=$(( 585 - ($(date +%s) - t0) ))
if [ $left -gt 40 ]; then
  timeout $left python -m hipkernel.ab --variant base=reports/wip/session27/base@wgmma_m8_b128_ws \
      --variant landed=.@wgmma_m8_b128_ws --shape d128-16384@0 --shape d128-512@8192 \
      --passes 2 --json $OUT/ab-final-d128.json --hang-s 30 > $OUT/ab-final-d128.log 2>&1
  echo "ab rc $?"; tail -9 $OUT/ab-final-d128.log
fi
