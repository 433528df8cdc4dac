#!/bin/bash
# Session 25, third device call: ncu of the walking wgspan tile at 16384@0 window 128.
export PYTHONPATH=.
timeout 150 ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section SourceCounters \
    --section SchedulerStats --section InstructionStats --section Occupancy --section MemoryWorkloadAnalysis \
    --section LaunchStats -k gqa_flash_prefill -s 2 -c 1 -o $OUT/ncuw \
    python3 scripts/ncu_profile.py gptoss-16384@0-w128 --config wgspan_m4_b136_p8_q4 > $OUT/ncu.log 2>&1
ncu -i $OUT/ncuw.ncu-rep > $OUT/ncu-details.txt 2>&1
ncu -i $OUT/ncuw.ncu-rep --page source --csv --print-source sass > $OUT/ncu-source.csv 2>&1
rm -f $OUT/ncuw.ncu-rep
