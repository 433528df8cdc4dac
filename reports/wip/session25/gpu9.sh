#!/bin/bash
# Session 25, experiment after the records: Q through shared memory on the wgspan tile
# (reports/wip/session25/qsmem: QSMEM=1, wgmma with A by descriptor), at 3 and 4 blocks an SM.
export PYTHONPATH=.
Q=reports/wip/session25/qsmem
timeout 200 python -m hipkernel.ab --variant base=.@wgspan_m4_b136_p8_q4 \
    --variant q0=$Q@wgspan_m4_b136_p8_q4 \
    --variant q1=$Q@wgspan_m4_b136_p8_q4+QSMEM=1+SMEM_PLUS=8192 \
    --variant q1mb4=$Q@wgspan_m4_b136_p8_q4+QSMEM=1+SMEM_PLUS=8192+MIN_BLOCKS=4 \
    --variant mb4=.@wgspan_m4_b136_p8_q4+MIN_BLOCKS=4 \
    --shape gptoss-16384@0-w128 --shape gptoss-4096@8192-w128 \
    --passes 2 --json $OUT/ab-qsmem.json --hang-s 60 > $OUT/ab-qsmem.log 2>&1
echo "ab rc $?" >> $OUT/ab-qsmem.log
