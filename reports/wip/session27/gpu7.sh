#!/bin/bash
# Session 27, call 7: the window tile with a staged epilogue (epi/: STAGED_EPI, stmatrix into
# 2 KiB of shared memory a warp, 16-byte stores of whole rows; reports/wip/session27/
# staged-epilogue.patch), same process against the landed tile, bit for bit.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HIPKERNEL_CACHE_DIR=/tmp/hkcache
E=reports/wip/session27/epi
timeout 200 python -m hipkernel.ab --variant span=.@wgspan_m4_b136_p8_q4 \
    --variant epi=$E@wgspan_m4_b136_p8_q4+STAGED_EPI=1+SMEM_PLUS=8192 \
    --shape gptoss-16384@0-w128 --shape gptoss-4096@8192-w128 --shape gptoss-1000@37-w128 \
    --passes 3 --json $OUT/ab-epi.json --hang-s 60 > $OUT/ab-epi.log 2>&1
echo "ab rc $?" >> $OUT/ab-epi.log; tail -20 $OUT/ab-epi.log
