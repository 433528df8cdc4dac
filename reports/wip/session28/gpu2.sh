#!/bin/bash
# Session 28, call 2: the staged epilogue's stores from one lane base at compile-time steps
# (and K/V pointers recomputed at each load, which took ptxas to 0 spills). The matrix with
# the window tile forced; same-process A/B against the landed tile (base/) and call 1's
# version (wip1/); ncu source counters of the new tile.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HIPKERNEL_CACHE_DIR=/tmp/hkcache
W=reports/wip/session28
timeout 120 python scripts/mma_check.py --out $OUT/mc --sections matrix --configs wgspan_m4_b136_p8_q4 > $OUT/mc.log 2>&1
echo "mma_check rc $?"; grep -E "== matrix" $OUT/mc.log | tail -3
timeout 200 python -m hipkernel.ab --variant old=$W/base@wgspan_m4_b136_p8_q4 \
    --variant call1=$W/wip1@wgspan_m4_b136_p8_q4 \
    --variant new=.@wgspan_m4_b136_p8_q4 \
    --shape gptoss-16384@0-w128 --shape gptoss-4096@8192-w128 --shape gptoss-1000@37-w128 \
    --passes 3 --json $OUT/ab-span.json --hang-s 60 > $OUT/ab-span.log 2>&1
echo "ab rc $?" >> $OUT/ab-span.log; grep -v HOST-BOUND $OUT/ab-span.log | tail -14
n=gptoss-16384_at_0-w128
timeout 120 ncu --clock-control none --section SourceCounters --section WarpStateStats --import-source no \
    -k gqa_flash_prefill -s 2 -c 1 -o $OUT/src-$n python3 scripts/ncu_profile.py gptoss-16384@0-w128 --config wgspan_m4_b136_p8_q4 > $OUT/src-$n.log 2>&1
echo "ncu exit $?"
timeout 60 ncu --import $OUT/src-$n.ncu-rep --page source --csv --print-source sass > $OUT/src-$n.csv 2> $OUT/src-$n.err
echo "import exit $? $(wc -l < $OUT/src-$n.csv) lines"; rm -f $OUT/src-$n.ncu-rep
