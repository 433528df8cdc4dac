#!/bin/bash
# Session 24's last device call: ncu of the landed d 64 tile at 16384@0, then L_DEFER and
# MAX_TREE (reports/wip/session24/l-defer-max-tree.patch) in an A/B, each under a timeout.
export PYTHONPATH=.
timeout 110 ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section SourceCounters \
    --section SchedulerStats --section InstructionStats -k gqa_flash_prefill -s 2 -c 1 -o $OUT/ncu16k \
    python3 scripts/ncu_profile.py gptoss-16384@0 --config wgmma_m16_b64 > $OUT/ncu.log 2>&1
ncu -i $OUT/ncu16k.ncu-rep > $OUT/ncu-details.txt 2>&1
ncu -i $OUT/ncu16k.ncu-rep --page source --csv --print-source sass > $OUT/ncu-source.csv 2>&1
rm -f $OUT/ncu16k.ncu-rep
mkdir -p /tmp/exp && cp -r hipkernel /tmp/exp/ && (cd /tmp/exp && patch -p1 < $OLDPWD/reports/wip/session24/l-defer-max-tree.patch)
timeout 80 python -m hipkernel.ab --passes 2 --variant base=.@wgmma_m16_b64 --variant ld=/tmp/exp@wgmma_m16_b64+L_DEFER=1 \
    --variant mt=/tmp/exp@wgmma_m16_b64+MAX_TREE=1 --variant both=/tmp/exp@wgmma_m16_b64+L_DEFER=1+MAX_TREE=1 \
    --shape gptoss-16384@0 --shape gptoss-512@8192 --json $OUT/ldmt.json
grep -E "Duration|Issued Warp|Eligible Warps|L1/TEX Cache|Compute \(SM\)" $OUT/ncu-details.txt
