#!/bin/bash
# Session 25, fourth device call: the wgspan tile with the block-wise mask and the fresh first
# chunk, A/B against the tuner's window-128 pick; then its forced matrix.
export PYTHONPATH=.
timeout 200 python -m hipkernel.ab --variant base=.@mma_m4_b32_p8_q4 \
    --variant s4q2=.@wgspan_m4_b136_p8_q2 --variant s4q4=.@wgspan_m4_b136_p8_q4 --variant s4q8=.@wgspan_m4_b136_p8_q8 \
    --shape gptoss-16384@0-w128 --shape gptoss-4096@8192-w128 \
    --passes 2 --json $OUT/ab.json --hang-s 60 > $OUT/ab.log 2>&1
echo "ab rc $?" >> $OUT/ab.log
timeout 200 python scripts/mma_check.py --sections matrix \
    --configs wgspan_m4_b136_p8_q4,wgspan_m8_b72_p4_q2 --out $OUT/chk > $OUT/chk.log 2>&1
echo "matrix rc $?" >> $OUT/chk.log
