#!/bin/bash
# Session 27, call 1: where the d 128 producer tile's time goes. Timing probes (outputs are
# garbage by design): PROBE_NOLOAD (the producer copies nothing after the first round of
# stages), PROBE_NOSM (no mask, no softmax: P = fp16(S c2)); and per-instruction stall
# sampling (ncu SourceCounters) of the landed d128 and window tiles.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HIPKERNEL_CACHE_DIR=/tmp/hkcache
X=reports/wip/session27/probe
timeout 300 python -m hipkernel.ab --variant base=.@wgmma_m8_b128_ws \
    --variant noload=$X@wgmma_m8_b128_ws+PROBE_NOLOAD=1 \
    --variant nosm=$X@wgmma_m8_b128_ws+PROBE_NOSM=1 \
    --variant both=$X@wgmma_m8_b128_ws+PROBE_NOLOAD=1+PROBE_NOSM=1 \
    --shape d128-16384@0 --shape d128-512@8192 \
    --passes 2 --json $OUT/ab-probe.json --hang-s 60 > $OUT/ab-probe.log 2>&1
echo "ab rc $?" >> $OUT/ab-probe.log
tail -14 $OUT/ab-probe.log
for spec in "d128-16384@0 wgmma_m8_b128_ws" "gptoss-16384@0-w128 wgspan_m4_b136_p8_q4"; do
  set -- $spec
  n=${1//@/_at_}
  timeout 120 ncu --clock-control none --section SourceCounters --section WarpStateStats --import-source no \
      -k gqa_flash_prefill -s 2 -c 1 -o $OUT/src-$n python3 scripts/ncu_profile.py "$1" --config "$2" > $OUT/src-$n.log 2>&1
  echo "ncu $n exit $?"
  timeout 60 ncu --import $OUT/src-$n.ncu-rep --page source --csv --print-source sass > $OUT/src-$n.csv 2> $OUT/src-$n.err
  echo "import exit $? $(wc -l < $OUT/src-$n.csv) lines"
done
