#!/bin/bash
# Session 25, experiment for the next session: 72-key chunks at 4 blocks an SM, with Q in
# shared memory and the resident rounds in one contiguous buffer (reports/wip/session25/x72,
# the qsmem patch plus RES_ROUNDS), against the landed 136-key tile.
export PYTHONPATH=.
X=reports/wip/session25/x72
timeout 250 python -m hipkernel.ab --variant base=.@wgspan_m4_b136_p8_q4 \
    --variant b72=.@wgspan_m4_b72_p8_q4+KV_STAGES=2 \
    --variant x72=$X@wgspan_m4_b72_p8_q4+QSMEM=1+RES_ROUNDS=2+SMEM_PLUS=26624+MIN_BLOCKS=4 \
    --variant x72r=$X@wgspan_m4_b72_p8_q4+RES_ROUNDS=2+SMEM_PLUS=18432+MIN_BLOCKS=4 \
    --shape gptoss-16384@0-w128 --shape gptoss-4096@8192-w128 --shape gptoss-512@8209-w128 \
    --passes 2 --json $OUT/ab-x72.json --hang-s 60 > $OUT/ab-x72.log 2>&1
echo "ab rc $?" >> $OUT/ab-x72.log
