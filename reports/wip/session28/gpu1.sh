#!/bin/bash
# Session 28, call 1: the window tile with fewer instructions a step (the mask's inner blocks
# untested when the chunk's two end blocks hold every partial one; the step's row offsets
# once; the accumulator dead until the first P.V; the staged epilogue; one factor a row in the
# epilogue of every tensor-core path). The matrix with the changed tiles forced; same-process
# A/Bs against the landed kernels (base/) and with the old mask (oldmask/); ncu source
# counters of the new window tile.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HIPKERNEL_CACHE_DIR=/tmp/hkcache
W=reports/wip/session28
timeout 200 python scripts/mma_check.py --out $OUT/mc --sections matrix \
    --configs wgspan_m4_b136_p8_q4,mma_m4_b32_p8,wgmma_m16_b64,wgmma_m8_b128_ws,wmma_m4_b64,mfma_m4_b32 > $OUT/mc.log 2>&1
echo "mma_check rc $?"; grep -E "== matrix|passed|failed" $OUT/mc.log | tail -14
timeout 200 python -m hipkernel.ab --variant old=$W/base@wgspan_m4_b136_p8_q4 \
    --variant new=.@wgspan_m4_b136_p8_q4 \
    --variant lane=.@wgspan_m4_b136_p8_q4+STAGED_EPI=0 \
    --variant oldmask=$W/oldmask@wgspan_m4_b136_p8_q4 \
    --shape gptoss-16384@0-w128 --shape gptoss-4096@8192-w128 --shape gptoss-1000@37-w128 \
    --passes 3 --json $OUT/ab-span.json --hang-s 60 > $OUT/ab-span.log 2>&1
echo "ab rc $?" >> $OUT/ab-span.log; tail -22 $OUT/ab-span.log
timeout 100 python -m hipkernel.ab --variant old=$W/base@mma_m4_b32_p8 --variant new=.@mma_m4_b32_p8 \
    --variant d64old=$W/base@wgmma_m16_b64 --variant d64new=.@wgmma_m16_b64 \
    --shape gptoss-512@8192-w128 --shape gptoss-512@8192 \
    --passes 2 --json $OUT/ab-epi-fold.json --hang-s 60 > $OUT/ab-epi-fold.log 2>&1
echo "ab rc $?" >> $OUT/ab-epi-fold.log; tail -12 $OUT/ab-epi-fold.log
n=gptoss-16384_at_0-w128
timeout 120 ncu --clock-control none --section SourceCounters --section WarpStateStats --import-source no \
    -k gqa_flash_prefill -s 2 -c 1 -o $OUT/src-$n python3 scripts/ncu_profile.py gptoss-16384@0-w128 --config wgspan_m4_b136_p8_q4 > $OUT/src-$n.log 2>&1
echo "ncu exit $?"
timeout 60 ncu --import $OUT/src-$n.ncu-rep --page source --csv --print-source sass > $OUT/src-$n.csv 2> $OUT/src-$n.err
echo "import exit $? $(wc -l < $OUT/src-$n.csv) lines"; rm -f $OUT/src-$n.ncu-rep
