#!/usr/bin/env bash
# The GPU records that change with the kernel, in one run on a 2-GPU H200 machine, both GPUs
# busy at once:
#   GPU 0  hipkernel.gpu_session --only matrix,mutants,measure,bench
#          -> h200.json, mutants-h200.json, measure-h200.json, bench-h200.json
#   GPU 1  scripts/mma_check.py --sections mutants,sweep (kill matrix with the mma configs
#          forced, 16 and 32 rows a warp; kernel-only times of every mma config) -> mma_check.json
# Every module both need is compiled first, in parallel, into one disk cache.
#   OUT=dir bash scripts/h200x2_records.sh        (each part under its own time limit)
#   ONE_GPU=1 OUT=dir bash scripts/h200x2_records.sh   (one H200: the parts in turn on GPU 0)
#   PARTS=session (or mma_check) ONE_GPU=1 OUT=dir ...  (one part only: where a run has a time
#          limit the two in turn outlast, run them one at a time into two dirs and merge them)
# On one H200 both parts take about 5 minutes: ONE_GPU=1 OUT=$OUT/rec ... took 308 s (prewarm
# 28 s, gpu_session 126 s, mma_check's seven kill matrices 116 s and sweep 37 s), then
# h200x2_reliability.sh runs after it.
# Both parts write 8 files to $OUT (gpus.csv, mma.log, session.log, 4 JSON and mma_check.json).
# Into reports/gpu/, with this script's, h200x2_reliability.sh's and hipkernel.scaling's outputs:
#   python -m hipkernel.record --collect REC_DIR REL_DIR SCALING_JSON
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 HIPKERNEL_CACHE_DIR=${HIPKERNEL_CACHE_DIR:-/tmp/hkcache}
: "${OUT:?set OUT to the output directory}"
mkdir -p "$OUT" || exit 2
LIMIT=${LIMIT:-450}
# MMA_JOBS: processes for mma_check's kill matrices, one forced config each, all on its GPU
# (they time nothing; one at a time five of them took 475 s, and more than 540 s on a later
# kernel; five at once 141 s; seven, two of them the emulated AMD kernel, 116 s at once).
# The sweep after them runs alone.
MMA_JOBS=${MMA_JOBS:-7}
# ONE_GPU=1: a machine with one H200 runs the two parts one after the other on
# GPU 0 (about twice the time; each part keeps its own LIMIT).
ONE_GPU=${ONE_GPU:-0}
GPU_B=1
[ "$ONE_GPU" = 1 ] && GPU_B=0
nvidia-smi --query-gpu=index,name,clocks.max.sm --format=csv > "$OUT/gpus.csv"
t0=$(date +%s)
python3 scripts/mma_check.py --sections records,mutants,sweep --prewarm-only > "$OUT/mma.log" 2>&1
echo "prewarm: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/mma.log"
session() {
    CUDA_VISIBLE_DEVICES=0 timeout "$LIMIT" python3 -m hipkernel.gpu_session --out "$OUT" \
        --only matrix,mutants,measure,bench > "$OUT/session.log" 2>&1
    echo "gpu_session rc=$? after $(( $(date +%s) - t0 )) s" >> "$OUT/session.log"
}
mma_check() {
    CUDA_VISIBLE_DEVICES=$GPU_B timeout "$LIMIT" python3 scripts/mma_check.py --no-prewarm \
        --sections mutants,sweep --jobs "$MMA_JOBS" --out "$OUT" >> "$OUT/mma.log" 2>&1
    echo "mma_check rc=$? after $(( $(date +%s) - t0 )) s" >> "$OUT/mma.log"
}
PARTS=${PARTS:-session,mma_check}
if [ "$PARTS" != session,mma_check ]; then  # one part, as asked
    case "$PARTS" in
        session) session ;;
        mma_check) mma_check ;;
        *) echo "PARTS: expected session, mma_check or session,mma_check, got $PARTS" >&2; exit 2 ;;
    esac
elif [ "$ONE_GPU" = 1 ]; then  # one after the other, so that neither's timings see the other
    session
    mma_check
else
    session &
    mma_check &
    wait
fi
tail -n 3 "$OUT/session.log" "$OUT/mma.log"
