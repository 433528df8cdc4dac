#!/bin/bash
# Session 27, call 5: TMA in the self-loading four-warpgroup tile (wgmma_m16_b64, d 64): the
# case matrix with it and with the d128 producer tile forced, then a same-process A/B
# against the cp.async version (head3/: the kernel files of the session's second commit).
export PYTHONPATH=. PYTHONUNBUFFERED=1 HIPKERNEL_CACHE_DIR=/tmp/hkcache
H=reports/wip/session27/head3
timeout 200 python scripts/mma_check.py --out $OUT/mc --sections matrix --configs wgmma_m16_b64,wgmma_m8_b128_ws > $OUT/mc.log 2>&1
echo "mma_check rc $?"; grep -E "== matrix" $OUT/mc.log | tail -4
timeout 200 python -m hipkernel.ab --variant cpasync=$H@wgmma_m16_b64 --variant tma=.@wgmma_m16_b64 \
    --shape gptoss-16384@0 --shape gptoss-512@8192 --shape gptoss-2048@100-w100 --shape gptoss-4096@8192-w1000 \
    --passes 3 --json $OUT/ab-tma-d64.json --hang-s 60 > $OUT/ab-tma-d64.log 2>&1
echo "ab rc $?" >> $OUT/ab-tma-d64.log; tail -25 $OUT/ab-tma-d64.log
