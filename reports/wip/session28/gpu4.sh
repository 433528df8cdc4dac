#!/bin/bash
# Session 28, call 4: the wgmma tiles take their Q tiles heaviest first (HEAVY_FIRST: block x
# computes Q tile gridDim.x - 1 - x, so that a causal launch does not end on its longest
# blocks). The matrix with both wgmma tiles forced; same-process A/B against HEAVY_FIRST=0
# (the landed order), bit for bit.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HIPKERNEL_CACHE_DIR=/tmp/hkcache
timeout 100 python scripts/mma_check.py --out $OUT/mc --sections matrix --configs wgmma_m16_b64,wgmma_m8_b128_ws > $OUT/mc.log 2>&1
echo "mma_check rc $?"; grep -E "== matrix" $OUT/mc.log | tail -3
timeout 200 python -m hipkernel.ab --variant xorder=.@wgmma_m16_b64+HEAVY_FIRST=0 --variant heavy=.@wgmma_m16_b64 \
    --shape gptoss-16384@0 --shape gptoss-512@8192 --shape gptoss-4096@8192 \
    --passes 3 --json $OUT/ab-heavy-d64.json --hang-s 60 > $OUT/ab-heavy-d64.log 2>&1
echo "ab rc $?" >> $OUT/ab-heavy-d64.log; grep -v HOST-BOUND $OUT/ab-heavy-d64.log | tail -18
timeout 200 python -m hipkernel.ab --variant xorder=.@wgmma_m8_b128_ws+HEAVY_FIRST=0 --variant heavy=.@wgmma_m8_b128_ws \
    --shape d128-16384@0 --shape d128-512@8192 \
    --passes 3 --json $OUT/ab-heavy-d128.json --hang-s 60 > $OUT/ab-heavy-d128.log 2>&1
echo "ab rc $?" >> $OUT/ab-heavy-d128.log; grep -v HOST-BOUND $OUT/ab-heavy-d128.log | tail -12
