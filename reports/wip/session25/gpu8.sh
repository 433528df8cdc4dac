#!/bin/bash
# Session 25, last device call (after the records): how occupancy moves the wgspan tile
# (MIN_BLOCKS 2 / 4, 72-key chunks at 4 blocks), and the SM clock while 16384@0 runs.
export PYTHONPATH=.
timeout 150 python -m hipkernel.ab --variant base=.@wgspan_m4_b136_p8_q4 \
    --variant mb2=.@wgspan_m4_b136_p8_q4+MIN_BLOCKS=2 \
    --variant b72mb4=.@wgspan_m4_b72_p8_q4+KV_STAGES=2+MIN_BLOCKS=4 \
    --variant b72=.@wgspan_m4_b72_p8_q4+KV_STAGES=2 \
    --shape gptoss-16384@0-w128 --shape gptoss-4096@8192-w128 \
    --passes 2 --json $OUT/ab-occ.json --hang-s 60 > $OUT/ab-occ.log 2>&1
echo "ab rc $?" >> $OUT/ab-occ.log
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv -lms 100 > $OUT/clocks.csv 2>&1 &
SMI=$!
timeout 150 python -m hipkernel.ab --variant a=.@wgmma_m16_b64 --variant b=.@wgmma_m16_b64 \
    --shape gptoss-16384@0 --passes 4 --json $OUT/ab-16k.json --hang-s 60 > $OUT/ab-16k.log 2>&1
kill $SMI
