#!/bin/bash
# Session 29, call 4: the landed kernel (wgmma at d 64 with ROWSUM_MMA from its config, the
# d 128 and wgspan SASS unchanged) against the kernel before it (base/), then every GPU record
# of it in the same call (scripts/h200_records_one_call.sh).
export PYTHONPATH=. PYTHONUNBUFFERED=1 HIPKERNEL_CACHE_DIR=/tmp/hkcache
W=reports/wip/session29
timeout 70 python -m hipkernel.ab --variant base=$W/base@wgmma_m16_b64 --variant rowsum=.@wgmma_m16_b64 \
    --shape gptoss-16384@0 --shape gptoss-512@8192 \
    --passes 2 --json $OUT/ab-final-d64.json --hang-s 60 > $OUT/ab-final-d64.log 2>&1
echo "ab rc $?" >> $OUT/ab-final-d64.log; grep -v HOST-BOUND $OUT/ab-final-d64.log | tail -10
OUT=$OUT timeout 515 bash scripts/h200_records_one_call.sh > $OUT/records-call.log 2>&1
echo "records rc $?"; tail -12 $OUT/records-call.log
