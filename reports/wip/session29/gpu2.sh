#!/bin/bash
# Session 29, call 2: d 64 tiles with a producer warpgroup (TMA, OVERLAP) against the
# self-loading m16 tile, each with l summed in fp32 registers and on the tensor cores
# (ROWSUM_MMA=1). Same process, same inputs (python -m hipkernel.ab).
export PYTHONPATH=. PYTHONUNBUFFERED=1 HIPKERNEL_CACHE_DIR=/tmp/hkcache
timeout 150 python scripts/mma_check.py --out $OUT/mc --sections matrix --configs wgmma_m8_b128_ws,wgmma_m8_b64_ws > $OUT/mc.log 2>&1
echo "mma_check rc $?"; grep -E "== matrix" $OUT/mc.log | tail -3
timeout 400 python -m hipkernel.ab --variant m16=.@wgmma_m16_b64 --variant m16r=.@wgmma_m16_b64+ROWSUM_MMA=1 \
    --variant w8b128=.@wgmma_m8_b128_ws --variant w8b128r=.@wgmma_m8_b128_ws+ROWSUM_MMA=1 \
    --variant w8b64=.@wgmma_m8_b64_ws --variant w8b64r=.@wgmma_m8_b64_ws+ROWSUM_MMA=1 \
    --shape gptoss-16384@0 --shape gptoss-512@8192 --shape gptoss-4096@8192 \
    --passes 3 --json $OUT/ab-ws-d64.json --hang-s 60 > $OUT/ab-ws-d64.log 2>&1
echo "ab rc $?" >> $OUT/ab-ws-d64.log; grep -v HOST-BOUND $OUT/ab-ws-d64.log | tail -60
