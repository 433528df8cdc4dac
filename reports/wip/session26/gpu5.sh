#!/bin/bash
# Session 26, call 5: the intra-warpgroup overlap at d 128 with Q in registers: the producer
# keeps fewer registers (PRODUCER_REGS 24 / 32: consumers 240 / 232) so that the owed P fits.
export PYTHONPATH=.
X=reports/wip/session26/ov
timeout 420 python -m hipkernel.ab --variant base=.@wgmma_m8_b128_ws \
    --variant ov24=$X@wgmma_m8_b128_ws+OVERLAP=1+PRODUCER_REGS=24 \
    --variant ov32=$X@wgmma_m8_b128_ws+OVERLAP=1+PRODUCER_REGS=32 \
    --variant ov24np=$X@wgmma_m8_b128_ws+OVERLAP=1+PRODUCER_REGS=24+PINGPONG=0 \
    --variant pr24=$X@wgmma_m8_b128_ws+PRODUCER_REGS=24 \
    --shape d128-16384@0 --shape d128-512@8192 \
    --passes 2 --json $OUT/ab-ovr.json --hang-s 60 > $OUT/ab-ovr.log 2>&1
echo "ab rc $?" >> $OUT/ab-ovr.log
tail -30 $OUT/ab-ovr.log
