#!/bin/bash
# Session 30, call 1: the wait for the owed P.V kept below the softmax under OVERLAP
# (overlap-pinned-wait.patch of session 29 applied: hk_wgmma_wait_all_after) against the landed
# kernel 7149d8c1 (base/ = git archive main hipkernel/kernels). A/B at d 128 (the producer tile,
# OVERLAP on by default) and at d 64 (m16 with OVERLAP=1, which the patch allows on the
# self-loading pipeline; and the TMA producer tile at d 64); matrix and kill matrix of the
# patched tree, and of a copy whose m16 config has OVERLAP on (/tmp/ov16).
export PYTHONPATH=. PYTHONUNBUFFERED=1 HIPKERNEL_CACHE_DIR=/tmp/hkcache
W=reports/wip/session30
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv > $OUT/smi.txt
timeout 170 python -m hipkernel.ab --variant base=$W/base@wgmma_m8_b128_ws --variant ov=.@wgmma_m8_b128_ws \
    --shape d128-16384@0 --shape d128-512@8192 \
    --passes 3 --json $OUT/ab-ov-d128.json --hang-s 60 > $OUT/ab-ov-d128.log 2>&1
echo "ab d128 rc $? at $(el) s"; grep -v HOST-BOUND $OUT/ab-ov-d128.log | tail -12
timeout 200 python -m hipkernel.ab --variant base=$W/base@wgmma_m16_b64 --variant ov16=.@wgmma_m16_b64+OVERLAP=1 \
    --variant m16=.@wgmma_m16_b64 --variant ws=.@wgmma_m8_b128_ws \
    --shape gptoss-16384@0 --shape gptoss-512@8192 \
    --passes 3 --json $OUT/ab-ov-d64.json --hang-s 60 > $OUT/ab-ov-d64.log 2>&1
echo "ab d64 rc $? at $(el) s"; grep -v HOST-BOUND $OUT/ab-ov-d64.log | tail -28
mkdir -p /tmp/ov16 && tar --exclude=./reports --exclude=./.venv -cf - . | tar -xf - -C /tmp/ov16
sed -i 's/^#define OVERLAP (WS \&\& TMA)$/#define OVERLAP ((WS \&\& TMA) || ROWSUM_MMA)/' /tmp/ov16/hipkernel/kernels/gqa_flash_prefill_wgmma.hip
grep -n "^#define OVERLAP" /tmp/ov16/hipkernel/kernels/gqa_flash_prefill_wgmma.hip
timeout 60 python scripts/mma_check.py --out $OUT/mc --sections matrix --configs wgmma_m16_b64,wgmma_m8_b128_ws > $OUT/mc.log 2>&1
echo "matrix rc $? at $(el) s"; grep -E "== matrix" $OUT/mc.log | tail -4
(cd /tmp/ov16 && timeout 60 python scripts/mma_check.py --out $OUT/mc16 --sections matrix --configs wgmma_m16_b64 > $OUT/mc16.log 2>&1)
echo "matrix ov16 rc $? at $(el) s"; grep -E "== matrix" $OUT/mc16.log | tail -4
left=$(( 560 - $(el) ))
(cd /tmp/ov16 && timeout $left python scripts/mma_check.py --out $OUT/mk16 --sections mutants --configs wgmma_m16_b64 --jobs 1 > $OUT/mk16.log 2>&1; echo "mutants ov16 rc $? at $(el) s") &
left2=$(( 560 - $(el) ))
(timeout $left2 python scripts/mma_check.py --out $OUT/mk --sections mutants --configs wgmma_m8_b128_ws --jobs 1 > $OUT/mk.log 2>&1; echo "mutants ws rc $? at $(el) s") &
wait
grep -E "survive|killed|==" $OUT/mk16.log $OUT/mk.log | tail -20
