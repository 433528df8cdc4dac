#!/bin/bash
# Session 25, first device call: the wgspan kernel's forced case matrix, then an A/B
# against the tuner's window-128 pick.
export PYTHONPATH=.
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/smi.txt 2>&1
timeout 240 python scripts/mma_check.py --sections matrix \
    --configs wgspan_m8_b136_p8,wgspan_m4_b136_p8,wgspan_m4_b72_p8 --out $OUT/chk > $OUT/chk.log 2>&1
echo "matrix rc $?" >> $OUT/chk.log
timeout 300 python -m hipkernel.ab --variant base=.@mma_m4_b32_p8_q4 \
    --variant s8=.@wgspan_m8_b136_p8 --variant s8r=.@wgspan_m8_b136_p8+MIN_BLOCKS=1 \
    --variant s4=.@wgspan_m4_b136_p8 --variant s4r=.@wgspan_m4_b136_p8+MIN_BLOCKS=2 \
    --variant s4_72=.@wgspan_m4_b72_p8 \
    --shape gptoss-16384@0-w128 --shape gptoss-4096@8192-w128 --shape gptoss-512@8192-w128 \
    --passes 2 --json $OUT/ab.json --hang-s 60 > $OUT/ab.log 2>&1
echo "ab rc $?" >> $OUT/ab.log
