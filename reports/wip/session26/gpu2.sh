#!/bin/bash
# Session 26, call 2: FlashAttention-3's intra-warpgroup overlap on the d 128 producer tile
# (OVERLAP), with Q in shared memory (QSMEM) so that the owed P fits, against the landed tile.
export PYTHONPATH=.
X=reports/wip/session26/ov
P=+SMEM_PLUS=33792
timeout 400 python -m hipkernel.ab --variant base=.@wgmma_m8_b128_ws \
    --variant qs=$X@wgmma_m8_b128_ws+QSMEM=1$P \
    --variant ov=$X@wgmma_m8_b128_ws+QSMEM=1+OVERLAP=1$P \
    --variant ov_np=$X@wgmma_m8_b128_ws+QSMEM=1+OVERLAP=1+PINGPONG=0$P \
    --shape d128-16384@0 --shape d128-512@8192 \
    --passes 2 --json $OUT/ab-ov.json --hang-s 60 > $OUT/ab-ov.log 2>&1
echo "ab rc $?" >> $OUT/ab-ov.log
tail -30 $OUT/ab-ov.log
