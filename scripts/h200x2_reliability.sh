#!/usr/bin/env bash
# compute-sanitizer over seed + extended and the records that depend on the tuner, in one run
# on a 2-GPU H200 machine:
#   GPU 1  racecheck over every case, cheapest first, until RACE_LIMIT s   -> racecheck.log
#   GPU 0  memcheck (--leak-check full) over every case, cheapest first, until MEM_LIMIT s
#          -> memcheck.log; then hipkernel.gpu_session --only matrix,measure,bench
#   then   hipkernel.gpu_session --only reliability with both logs          -> reliability-h200.json
# A log cut by its limit with nothing wrong in it is recorded as sanitizer_incomplete, with
# the launches it checked (hipkernel.reliability.record_body).
#   OUT=dir bash scripts/h200x2_reliability.sh
#   ONE_GPU=1 OUT=dir bash scripts/h200x2_reliability.sh   (one H200)
# On one H200 racecheck over every launch and the rest take more than 10 minutes: where a run
# has that limit, run racecheck alone first, then the rest with its log (carried into the
# tree, e.g. untracked under diag/):
#   PARTS=racecheck RACE_LIMIT=560 ONE_GPU=1 OUT=dir1 bash scripts/h200x2_reliability.sh
#   RACECHECK_LOG=diag/racecheck.log ONE_GPU=1 OUT=dir2 bash scripts/h200x2_reliability.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 HIPKERNEL_CACHE_DIR=${HIPKERNEL_CACHE_DIR:-/tmp/hkcache}
: "${OUT:?set OUT to the output directory}"
mkdir -p "$OUT" || exit 2
RACE_LIMIT=${RACE_LIMIT:-470}
MEM_LIMIT=${MEM_LIMIT:-360}
# ONE_GPU=1: a machine with one H200: both sanitizers on GPU 0 at once, then
# the timed gpu_session alone.
ONE_GPU=${ONE_GPU:-0}
GPU_B=1
[ "$ONE_GPU" = 1 ] && GPU_B=0
TARGET="python3 -m hipkernel.reliability --sanitize-target --suites seed,extended --cheapest-first"
t0=$(date +%s)
python3 scripts/mma_check.py --sections records --prewarm-only > "$OUT/session.log" 2>&1
echo "prewarm done after $(( $(date +%s) - t0 )) s" >> "$OUT/session.log"
KERNEL_LINE="kernel source $(python3 -c 'from hipkernel.api import source_hash; print(source_hash())')"
racecheck() {
    echo "$KERNEL_LINE" > "$OUT/racecheck.log"  # what RACECHECK_LOG checks in a later run
    CUDA_VISIBLE_DEVICES=$GPU_B HIPKERNEL_TUNE=0 timeout -k 15 "$RACE_LIMIT" compute-sanitizer --tool racecheck \
        --error-exitcode 3 $TARGET >> "$OUT/racecheck.log" 2>&1
    echo "racecheck exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/racecheck.log"
}
memcheck() {
    CUDA_VISIBLE_DEVICES=0 HIPKERNEL_TUNE=0 timeout -k 15 "$MEM_LIMIT" compute-sanitizer --tool memcheck \
        --leak-check full --error-exitcode 3 $TARGET > "$OUT/memcheck.log" 2>&1
    echo "memcheck exit $? after $(( $(date +%s) - t0 )) s" >> "$OUT/memcheck.log"
}
session() {
    CUDA_VISIBLE_DEVICES=0 python3 -m hipkernel.gpu_session --out "$OUT" --only matrix,measure,bench \
        >> "$OUT/session.log" 2>&1
    echo "gpu_session rc=$? after $(( $(date +%s) - t0 )) s" >> "$OUT/session.log"
}
PARTS=${PARTS:-all}
RACECHECK_LOG=${RACECHECK_LOG:-}
if [ "$PARTS" = racecheck ]; then  # racecheck alone, as long as RACE_LIMIT allows
    racecheck
    tail -n 2 "$OUT/racecheck.log"
    exit 0
elif [ "$PARTS" != all ]; then
    echo "PARTS: expected all or racecheck, got $PARTS" >&2
    exit 2
fi
if [ -n "$RACECHECK_LOG" ]; then  # an earlier run's racecheck of this tree: no second one
    if [ "$(head -n 1 "$RACECHECK_LOG")" != "$KERNEL_LINE" ]; then
        echo "RACECHECK_LOG: $RACECHECK_LOG is not a racecheck of this $KERNEL_LINE" >&2
        exit 2
    fi
    cp "$RACECHECK_LOG" "$OUT/racecheck.log" || exit 2
    memcheck
    session
elif [ "$ONE_GPU" = 1 ]; then  # the sanitizers share GPU 0; the timed bench runs after both
    racecheck &
    memcheck &
    wait
    session
else
    racecheck &
    (memcheck; session) &
    wait
fi
CUDA_VISIBLE_DEVICES=0 python3 -m hipkernel.gpu_session --out "$OUT" --only reliability \
    --sanitizer-logs "$OUT/memcheck.log" "$OUT/racecheck.log" >> "$OUT/session.log" 2>&1
echo "reliability rc=$? after $(( $(date +%s) - t0 )) s" >> "$OUT/session.log"
tail -n 2 "$OUT/memcheck.log" "$OUT/racecheck.log"; tail -n 4 "$OUT/session.log"
