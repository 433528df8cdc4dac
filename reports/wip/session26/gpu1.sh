#!/bin/bash
# Session 26, call 1: the wgspan tile at 4 blocks an SM (Q in shared memory, the next
# step's Q loaded after the last P.V is issued), against the landed tile.
export PYTHONPATH=.
X=reports/wip/session26/qs
timeout 400 python -m hipkernel.ab --variant base=.@wgspan_m4_b136_p8_q4 \
    --variant qs3l=$X@wgspan_m4_b136_p8_q4+QSMEM=1+QLATE=1+SMEM_PLUS=8192 \
    --variant qs4=$X@wgspan_m4_b136_p8_q4+QSMEM=1+SMEM_PLUS=8192+MIN_BLOCKS=4 \
    --variant qs4l=$X@wgspan_m4_b136_p8_q4+QSMEM=1+QLATE=1+SMEM_PLUS=8192+MIN_BLOCKS=4 \
    --variant qs4l_q2=$X@wgspan_m4_b136_p8_q2+QSMEM=1+QLATE=1+SMEM_PLUS=8192+MIN_BLOCKS=4 \
    --shape gptoss-16384@0-w128 --shape gptoss-4096@8192-w128 --shape gptoss-512@8209-w128 \
    --passes 2 --json $OUT/ab-qs4.json --hang-s 60 > $OUT/ab-qs4.log 2>&1
echo "ab rc $?" >> $OUT/ab-qs4.log
tail -40 $OUT/ab-qs4.log
