#!/usr/bin/env bash
# compute-sanitizer over seed + extended and the records that depend on the tuner, in one call
# on a 2-GPU H200 machine (the device tool's kind nvidia-h200-x2):
#   GPU 1  racecheck over every case, cheapest first, until RACE_LIMIT s   -> racecheck.log
#   GPU 0  memcheck (--leak-check full) over every case, cheapest first, until MEM_LIMIT s
#          -> memcheck.log; then hipkernel.gpu_session --only matrix,measure,bench
#   then   hipkernel.gpu_session --only reliability with both logs          -> reliability-h200.json
# A log cut by its limit with nothing wrong in it is recorded as sanitizer_incomplete, with
# the launches it checked (hipkernel.reliability.record_body).
#   OUT=dir bash scripts/h200x2_reliability.sh
#   ONE_GPU=1 OUT=dir bash scripts/h200x2_reliability.sh   (one H200)
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 HIPKERNEL_CACHE_DIR=${HIPKERNEL_CACHE_DIR:-/tmp/hkcache}
: "${OUT:?set OUT to the output directory}"
RACE_LIMIT=${RACE_LIMIT:-470}
MEM_LIMIT=${MEM_LIMIT:-360}
# ONE_GPU=1: a machine with one H200 (nvidia-h200): both sanitizers on GPU 0 at once, then
# the timed session alone.
ONE_GPU=${ONE_GPU:-0}
GPU_B=1
[ "$ONE_GPU" = 1 ] && GPU_B=0
TARGET="python3 -m hipkernel.reliability --sanitize-target --suites seed,extended --cheapest-first"
t0=$(date +%s)
python3 scripts/mma_check.py --sections records --prewarm-only > "$OUT/session.log" 2>&1
echo "prewarm done after $(( $(date +%s) - t0 )) s" >> "$OUT/session.log"
racecheck() {
    CUDA_VISIBLE_DEVICES=$GPU_B HIPKERNEL_TUNE=0 timeout -k 15 "$RACE_LIMIT" compute-sanitizer --tool racecheck \
        --error-exitcode 3 $TARGET > "$OUT/racecheck.log" 2>&1
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
if [ "$ONE_GPU" = 1 ]; then  # the sanitizers share GPU 0; the timed bench runs after both
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
