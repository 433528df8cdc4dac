#!/usr/bin/env bash
# Every GPU record of hipkernel that changes with the kernel source, in one run, on one or two
# H200s (GPUS, default: 2 when two are visible, else 1):
#   1. prewarm the disk cache (mma_check's records and mutants sections, the compiles)
#   2. untimed, all at once:
#        hipkernel.gpu_session --only matrix,mutants (no tuning)      -> rec/mutants-h200.json
#        scripts/mma_check.py --sections mutants (the kill matrices with each tensor-core
#          config forced; with two GPUs also the sweep of kernel-only times, on GPU 1 alone)
#                                                                      -> rec/mma_check.json
#        compute-sanitizer racecheck (GPU 1 of two) and memcheck (GPU 0), over seed +
#          extended + coverage + ragged cheapest first, racecheck's target stopping at
#          RACE_BUDGET so that its summary is printed                               -> rel/{race,mem}check.log
#   3. alone on GPU 0: hipkernel.gpu_session --only $TIMED (default matrix,measure,torch,bench: tunes,
#      then times), then --only reliability with the two logs         -> rel/
#      (TIMED=matrix,measure,torch leaves the bench to a run of its own:
#       python3 -m hipkernel.gpu_session --out rel --only bench, its record joining rel/)
#   4. rec/ and rel/ packed into one file, $OUT/records.tgz
# On one H200 the whole run takes about 420-480 s (under a 10-minute limit). On one GPU the kill
# matrices with each config forced share it with the rest of step 2 and may not all finish in
# LIMIT: rec/mma_check.json keeps the configs done and names the ones planned
# (mutants_planned). A later run on the same source completes them, its JSON beside the first:
#   python3 scripts/mma_check.py --sections mutants --configs REST --jobs 14 --out d2
#   cp d2/mma_check.json rec/mma_check-2.json
# (the collect below merges them; a config it never reached is listed as not run). Once the
# records are committed, `python -m hipkernel.record --add d2/mma_check.json` merges such a run
# into them, and `--add rel/torch-h200.json` (or bench, measure) adds a record of the same
# source that a later call made. Then, where the records are collected:
#   mkdir d && tar xzf records.tgz -C d && python -m hipkernel.record --collect d/rec d/rel
# (add the JSON of `python -m hipkernel.scaling` as a third argument when two GPUs ran it).
#   OUT=dir bash scripts/hipkernel_records.sh
#   GPUS=1 OUT=dir bash scripts/hipkernel_records.sh
# A PYTHONPATH already set is kept after `.`: a FlashAttention-4 installed with pip --target
# there joins the bench as its fa4 peer.
set -u
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HIPKERNEL_CACHE_DIR=${HIPKERNEL_CACHE_DIR:-/tmp/hkcache}
: "${OUT:?set OUT to the output directory}"
W=${WORK:-/tmp/records}
REC=$W/rec
REL=$W/rel
mkdir -p "$OUT" "$REC" "$REL" || exit 2
visible=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
GPUS=${GPUS:-$([ "${visible:-0}" -ge 2 ] && echo 2 || echo 1)}
case "$GPUS" in 1) B=0 ;; 2) B=1 ;; *) echo "GPUS: expected 1 or 2, got $GPUS" >&2; exit 2 ;; esac
LIMIT=${LIMIT:-300}            # each untimed part of step 2
RACE_LIMIT=${RACE_LIMIT:-240}
# racecheck covers fewer launches than its limit allows the whole matrix: its target stops
# starting cases after RACE_BUDGET seconds (cheapest first) and exits, so the tool prints its
# summary over what ran (the record's target_cases says how many)
RACE_BUDGET=${RACE_BUDGET:-$((RACE_LIMIT * 2 / 3))}
MEM_LIMIT=${MEM_LIMIT:-240}
MMA_JOBS=${MMA_JOBS:-8}
TIMED=${TIMED:-matrix,measure,torch,bench}
# with two GPUs GPU 1 also times every mma config (the sweep), after its kill matrices
MMA_SECTIONS=$([ "$GPUS" = 2 ] && echo mutants,sweep || echo mutants)
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
nvidia-smi --query-gpu=index,name,clocks.max.sm --format=csv > "$REC/gpus.csv"
python3 scripts/mma_check.py --sections records,mutants --prewarm-only > "$REC/mma.log" 2>&1
echo "prewarm: $(el) s, $GPUS GPU(s)" | tee -a "$REC/mma.log"
TARGET="python3 -m hipkernel.reliability --sanitize-target --suites seed,extended,coverage,ragged --cheapest-first"
echo "kernel source $(python3 -c 'from hipkernel.api import source_hash; print(source_hash())')" > "$REL/racecheck.log"
(CUDA_VISIBLE_DEVICES=0 HIPKERNEL_TUNE=0 timeout "$LIMIT" python3 -m hipkernel.gpu_session --out "$REC" \
    --only matrix,mutants --mutant-jobs "$MMA_JOBS" > "$REC/session.log" 2>&1; echo "gpu_session rc=$? after $(el) s" >> "$REC/session.log") &
(CUDA_VISIBLE_DEVICES=$B timeout "$LIMIT" python3 scripts/mma_check.py --no-prewarm --sections "$MMA_SECTIONS" \
    --jobs "$MMA_JOBS" --out "$REC" >> "$REC/mma.log" 2>&1; echo "mma_check rc=$? after $(el) s" >> "$REC/mma.log") &
(CUDA_VISIBLE_DEVICES=$B HIPKERNEL_TUNE=0 timeout -k 15 "$RACE_LIMIT" compute-sanitizer --tool racecheck \
    --error-exitcode 3 $TARGET --time-budget "$RACE_BUDGET" >> "$REL/racecheck.log" 2>&1; echo "racecheck exit $? after $(el) s" >> "$REL/racecheck.log") &
(CUDA_VISIBLE_DEVICES=0 HIPKERNEL_TUNE=0 timeout -k 15 "$MEM_LIMIT" compute-sanitizer --tool memcheck --leak-check full \
    --error-exitcode 3 $TARGET > "$REL/memcheck.log" 2>&1; echo "memcheck exit $? after $(el) s" >> "$REL/memcheck.log") &
wait
CUDA_VISIBLE_DEVICES=0 python3 -m hipkernel.gpu_session --out "$REL" --only "$TIMED" > "$REL/session.log" 2>&1
echo "gpu_session rc=$? after $(el) s" >> "$REL/session.log"
CUDA_VISIBLE_DEVICES=0 python3 -m hipkernel.gpu_session --out "$REL" --only reliability \
    --sanitizer-logs "$REL/memcheck.log" "$REL/racecheck.log" >> "$REL/session.log" 2>&1
echo "reliability rc=$? after $(el) s" >> "$REL/session.log"
tar czf "$OUT/records.tgz" -C "$W" rec rel
tail -n 2 "$REC/session.log" "$REC/mma.log" "$REL/memcheck.log" "$REL/racecheck.log"
tail -n 4 "$REL/session.log"
