#!/usr/bin/env bash
# Every GPU record that changes with the kernel, on one H200, in one run of under 10 minutes
# (416 s measured; h200x2_records.sh and h200x2_reliability.sh with ONE_GPU=1 take 411 + 420 s
# as two runs):
#   1. prewarm the disk cache (mma_check's records and mutants sections)
#   2. untimed, all at once on the GPU:
#        hipkernel.gpu_session --only matrix,mutants (no tuning)  -> rec/mutants-h200.json
#        scripts/mma_check.py --sections mutants (the forced kill matrices; not the sweep
#          of kernel-only times, which must run alone)            -> rec/mma_check.json
#        compute-sanitizer racecheck and memcheck, each until its limit -> rel/*.log
#   3. alone: hipkernel.gpu_session --only matrix,measure,bench (tunes, then times), then
#      --only reliability with the two logs                        -> rel/
#   4. rec/ and rel/ packed into one file, $OUT/records.tgz
# Then, on the machine that collects the records:
#   mkdir d && tar xzf records.tgz -C d && python -m hipkernel.record --collect d/rec d/rel
#   OUT=dir bash scripts/h200_records_one_call.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 HIPKERNEL_CACHE_DIR=${HIPKERNEL_CACHE_DIR:-/tmp/hkcache}
: "${OUT:?set OUT to the output directory}"
W=${WORK:-/tmp/records}
REC=$W/rec
REL=$W/rel
mkdir -p "$OUT" "$REC" "$REL" || exit 2
LIMIT=${LIMIT:-300}            # each untimed part of step 2
RACE_LIMIT=${RACE_LIMIT:-240}
MEM_LIMIT=${MEM_LIMIT:-240}
MMA_JOBS=${MMA_JOBS:-8}
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
nvidia-smi --query-gpu=index,name,clocks.max.sm --format=csv > "$REC/gpus.csv"
python3 scripts/mma_check.py --sections records,mutants --prewarm-only > "$REC/mma.log" 2>&1
echo "prewarm: $(el) s" | tee -a "$REC/mma.log"
TARGET="python3 -m hipkernel.reliability --sanitize-target --suites seed,extended --cheapest-first"
echo "kernel source $(python3 -c 'from hipkernel.api import source_hash; print(source_hash())')" > "$REL/racecheck.log"
(HIPKERNEL_TUNE=0 timeout "$LIMIT" python3 -m hipkernel.gpu_session --out "$REC" --only matrix,mutants \
    > "$REC/session.log" 2>&1; echo "gpu_session rc=$? after $(el) s" >> "$REC/session.log") &
(timeout "$LIMIT" python3 scripts/mma_check.py --no-prewarm --sections mutants --jobs "$MMA_JOBS" \
    --out "$REC" >> "$REC/mma.log" 2>&1; echo "mma_check rc=$? after $(el) s" >> "$REC/mma.log") &
(HIPKERNEL_TUNE=0 timeout -k 15 "$RACE_LIMIT" compute-sanitizer --tool racecheck --error-exitcode 3 \
    $TARGET >> "$REL/racecheck.log" 2>&1; echo "racecheck exit $? after $(el) s" >> "$REL/racecheck.log") &
(HIPKERNEL_TUNE=0 timeout -k 15 "$MEM_LIMIT" compute-sanitizer --tool memcheck --leak-check full \
    --error-exitcode 3 $TARGET > "$REL/memcheck.log" 2>&1; echo "memcheck exit $? after $(el) s" >> "$REL/memcheck.log") &
wait
python3 -m hipkernel.gpu_session --out "$REL" --only matrix,measure,bench > "$REL/session.log" 2>&1
echo "gpu_session rc=$? after $(el) s" >> "$REL/session.log"
python3 -m hipkernel.gpu_session --out "$REL" --only reliability \
    --sanitizer-logs "$REL/memcheck.log" "$REL/racecheck.log" >> "$REL/session.log" 2>&1
echo "reliability rc=$? after $(el) s" >> "$REL/session.log"
tar czf "$OUT/records.tgz" -C "$W" rec rel
tail -n 2 "$REC/session.log" "$REC/mma.log" "$REL/memcheck.log" "$REL/racecheck.log"
tail -n 4 "$REL/session.log"
