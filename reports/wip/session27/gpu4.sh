#!/bin/bash
# Session 27, call 4: the landed d128 tile (TMA + OVERLAP, commit 3 of the session) against
# the cp.async producer it replaces (base/: the kernel files of c500283); then timing probes
# for what comes next (outputs wrong by design): the d64 self-loading tile without its
# copies after the first round (PROBE_NOLOAD), the window tile without its mask
# (PROBE_NOMASK, 32 bytes spilled) and writing step 0's rows only (PROBE_NOEPI).
export PYTHONPATH=. PYTHONUNBUFFERED=1 HIPKERNEL_CACHE_DIR=/tmp/hkcache
B=reports/wip/session27/base
X=reports/wip/session27/probe2
timeout 150 python -m hipkernel.ab --variant base=$B@wgmma_m8_b128_ws --variant landed=.@wgmma_m8_b128_ws \
    --shape d128-16384@0 --shape d128-512@8192 --shape d128-2048@100-w100 \
    --passes 3 --json $OUT/ab-landed-d128.json --hang-s 60 > $OUT/ab-landed-d128.log 2>&1
echo "ab rc $?" >> $OUT/ab-landed-d128.log; tail -19 $OUT/ab-landed-d128.log
timeout 120 python -m hipkernel.ab --variant m16=.@wgmma_m16_b64 --variant noload=$X@wgmma_m16_b64+PROBE_NOLOAD=1 \
    --shape gptoss-16384@0 --shape gptoss-512@8192 \
    --passes 2 --json $OUT/ab-probe-d64.json --hang-s 60 > $OUT/ab-probe-d64.log 2>&1
echo "ab rc $?" >> $OUT/ab-probe-d64.log; tail -9 $OUT/ab-probe-d64.log
timeout 120 python -m hipkernel.ab --variant span=.@wgspan_m4_b136_p8_q4 \
    --variant noepi=$X@wgspan_m4_b136_p8_q4+PROBE_NOEPI=1 --variant nomask=$X@wgspan_m4_b136_p8_q4+PROBE_NOMASK=1 \
    --shape gptoss-16384@0-w128 --shape gptoss-4096@8192-w128 \
    --passes 2 --json $OUT/ab-probe-span.json --hang-s 60 > $OUT/ab-probe-span.log 2>&1
echo "ab rc $?" >> $OUT/ab-probe-span.log; tail -13 $OUT/ab-probe-span.log
