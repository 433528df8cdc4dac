#!/usr/bin/env bash
# Session 22: the AMD matrix-core kernel (gqa_flash_prefill_amdmma.hip) on one H200, through
# its emulation (kernels/amd_mma.h): the case matrix (seed + extended) with the first config
# at the cases' own tiles and the others forced, then racecheck and memcheck of the forced
# configs on the windowed and ragged small cases.
#   OUT=dir bash reports/wip/session22/amd_check.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 HIPKERNEL_CACHE_DIR=${HIPKERNEL_CACHE_DIR:-/tmp/hk}
O=$OUT/amd; mkdir -p "$O"
CFGS=${CFGS:-wmma_m4_b64,mfma_m4_b64,wmma_m1_b16,mfma_m2_b32}
SAN_CFGS=${SAN_CFGS:-$CFGS}  # the configs the sanitizers run
t0=$(date +%s)
timeout "${MATRIX_LIMIT:-300}" python3 scripts/mma_check.py --configs "$CFGS" --sections matrix \
    --out "$O" > "$O/matrix.log" 2>&1
echo "matrix rc=$? after $(( $(date +%s) - t0 )) s" >> "$O/matrix.log"
cat > /tmp/amd_san.py <<'PY'
import sys
sys.path.insert(0, "scripts")
from mma_check import ForcedKernel
from hipkernel.reliability import config_from_name
from refattn.cases import load_suites
from refattn.runner import run_matrix
keys = ("past0-w128", "past512-w128", "w100-bkv32", "past512-w1", "sq1-", "sq239-past37-w77",
        "sq200-past300-w33", "gq-sink-d128-sq100")
cases = [c for c in load_suites(["seed", "extended"]) if any(k in c.name for k in keys)]
bad = 0
for name in sys.argv[1].split(","):
    m = run_matrix(ForcedKernel(config_from_name(name), respect_case=False), cases)
    print(name, [c.name for c in cases], m.counts(), flush=True)
    bad += sum(r.outcome not in ("pass", "declined") for r in m.results)
sys.exit(1 if bad else 0)
PY
for tool in racecheck memcheck; do
    extra=""; [ $tool = racecheck ] && extra="--racecheck-report hazard"
    timeout "${SAN_LIMIT:-120}" compute-sanitizer --tool $tool $extra --error-exitcode 3 \
        python3 /tmp/amd_san.py "$SAN_CFGS" > "$O/$tool.log" 2>&1
    echo "$tool rc=$? after $(( $(date +%s) - t0 )) s" >> "$O/$tool.log"
done
tail -n 4 "$O"/*.log
