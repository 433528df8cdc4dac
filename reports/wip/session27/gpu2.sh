#!/bin/bash
# Session 27, call 2: the TMA producer (wgmma_m8_b128_ws, kernel in the working tree): the
# case matrix with it forced, then a same-process A/B against the landed cp.async producer
# (base: HEAD's kernel files) and the same source with TMA=0.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HIPKERNEL_CACHE_DIR=/tmp/hkcache
B=reports/wip/session27/base
timeout 200 python scripts/mma_check.py --out $OUT/mc --sections matrix --configs wgmma_m8_b128_ws > $OUT/mc.log 2>&1
echo "mma_check rc $?"; grep -E "passed|FAIL|fail|error" $OUT/mc.log | tail -8
timeout 300 python -m hipkernel.ab --variant base=$B@wgmma_m8_b128_ws \
    --variant tma=.@wgmma_m8_b128_ws --variant tma0=.@wgmma_m8_b128_ws+TMA=0 \
    --shape d128-16384@0 --shape d128-512@8192 --shape d128-4096@8192-w128 --shape d128-2048@100-w100 \
    --passes 2 --json $OUT/ab-tma.json --hang-s 60 > $OUT/ab-tma.log 2>&1
echo "ab rc $?" >> $OUT/ab-tma.log
tail -20 $OUT/ab-tma.log
