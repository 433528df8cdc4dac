#!/bin/bash
# Session 29, call 6: the landed kernel with and without its sink (+SINK_MODE=0, the same
# compiled kernel), same process, bursts of back-to-back launches, in both orders: the bench
# records have d128 16384@0 without the sink 4-8 % slower than with it.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HIPKERNEL_CACHE_DIR=/tmp/hkcache
timeout 200 python -m hipkernel.ab --variant sink=.@wgmma_m8_b128_ws --variant nosink=.@wgmma_m8_b128_ws+SINK_MODE=0 \
    --variant smooth=.@wgmma_m8_b128_ws+SINK_MODE=2 \
    --shape d128-16384@0 --shape d128-4096@8192 --passes 4 --json $OUT/ab-sinkmode-d128.json --hang-s 60 > $OUT/ab-sinkmode-d128.log 2>&1
echo "ab rc $?"; grep -v HOST-BOUND $OUT/ab-sinkmode-d128.log | tail -26
timeout 150 python -m hipkernel.ab --variant nosink=.@wgmma_m16_b64+SINK_MODE=0 --variant sink=.@wgmma_m16_b64 \
    --shape gptoss-16384@0 --passes 4 --json $OUT/ab-sinkmode-d64.json --hang-s 60 > $OUT/ab-sinkmode-d64.log 2>&1
echo "ab rc $?"; grep -v HOST-BOUND $OUT/ab-sinkmode-d64.log | tail -9
