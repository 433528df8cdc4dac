#!/bin/bash
# Session 29, call 3: on the d 64 tile with l on the tensor cores (ROWSUM_MMA=1), P.V left in
# flight across the loop (PV_DEFER=1: waited for with the next Q K^T, its stage released a tile
# later), with 6 and 7 stages. Bit-identical to m16r expected (same sums, same order).
export PYTHONPATH=. PYTHONUNBUFFERED=1 HIPKERNEL_CACHE_DIR=/tmp/hkcache
timeout 400 python -m hipkernel.ab --variant m16r=.@wgmma_m16_b64+ROWSUM_MMA=1 \
    --variant defer=.@wgmma_m16_b64+ROWSUM_MMA=1+PV_DEFER=1 \
    --variant defer7=.@wgmma_m16_b64+ROWSUM_MMA=1+PV_DEFER=1+KV_STAGES=7 \
    --variant defer7l2=.@wgmma_m16_b64+ROWSUM_MMA=1+PV_DEFER=1+KV_STAGES=7+LOOKAHEAD=2 \
    --variant m16=.@wgmma_m16_b64 \
    --shape gptoss-16384@0 --shape gptoss-512@8192 --shape gptoss-4096@8192 \
    --passes 3 --json $OUT/ab-defer-d64.json --hang-s 60 > $OUT/ab-defer-d64.log 2>&1
echo "ab rc $?" >> $OUT/ab-defer-d64.log; grep -v HOST-BOUND $OUT/ab-defer-d64.log | tail -60
