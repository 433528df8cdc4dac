#!/bin/bash
# Session 25, experiment for the next session (not landed): session 24's LOAD_RR patch on the
# d 64 wgmma tile, and PINGPONG=1 on the d 128 producer tile.
export PYTHONPATH=.
RR=reports/wip/session25/rr
timeout 200 python -m hipkernel.ab --variant base=.@wgmma_m16_b64 --variant rr=$RR@wgmma_m16_b64+LOAD_RR=1 \
    --shape gptoss-16384@0 --shape gptoss-512@8192 --passes 2 --json $OUT/ab-rr.json --hang-s 60 > $OUT/ab-rr.log 2>&1
echo "ab rc $?" >> $OUT/ab-rr.log
timeout 200 python -m hipkernel.ab --variant base=.@wgmma_m8_b128_ws --variant pp=.@wgmma_m8_b128_ws+PINGPONG=1 \
    --shape d128-16384@0 --shape d128-512@8192 --passes 2 --json $OUT/ab-pp.json --hang-s 60 > $OUT/ab-pp.log 2>&1
echo "ab rc $?" >> $OUT/ab-pp.log
