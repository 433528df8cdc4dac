#!/usr/bin/env bash
# Nsight Compute on the H200: what limits the autotuned configs on the bench shapes. One
# report per shape (the third launch of the config: two warm-ups).
#   OUT=dir bash scripts/ncu_h200.sh                       (the specs below)
#   OUT=dir bash scripts/ncu_h200.sh "gptoss-16384@0 wgmma_m16_b64" ...   (these only)
#   OUT=dir bash scripts/ncu_h200.sh "gptoss-16384@0 wgmma_m12_b128_ws" "gptoss-16384@0 peer:fa4"
#     (peer:NAME: a bench peer on the same shape, scripts/ncu_profile.py --peer; its kernels
#      are matched by PEER_KERNEL, default FlashAttention's forward, regex:(?i)flash)
# SOURCE=1 adds a third run per spec with the source-level sampling (WarpStateStats,
# SourceCounters), its SASS listing exported ($OUT/ncu-source-TAG-sass.csv) and summarized by
# scripts/ncu_sass_stalls.py (by stall reason and by opcode; --phase for stretches of a loop).
# A PYTHONPATH already set is kept after `.` (where a pip --target install of the peer lives).
set -u
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HIPKERNEL_CACHE_DIR=${HIPKERNEL_CACHE_DIR:-/tmp/hkcache}
: "${OUT:?set OUT to the output directory}"
mkdir -p "$OUT" || exit 2
SECTIONS="--section SpeedOfLight --section Occupancy --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section LaunchStats"
METRICS="--metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed,smsp__warp_issue_stalled_barrier_per_warp_active.pct,smsp__warp_issue_stalled_short_scoreboard_per_warp_active.pct,smsp__warp_issue_stalled_math_pipe_throttle_per_warp_active.pct,smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct,smsp__warp_issue_stalled_mio_throttle_per_warp_active.pct"
[ $# -gt 0 ] || set -- "gptoss-16384@0 wgmma_m16_b64" "gptoss-512@8192 wgmma_m16_b64" \
    "gptoss-16384@0-w128 wgspan_m4_b136_p8_q4" "d128-16384@0 wgmma_m8_b128_ws"
for spec in "$@"; do
  set -- $spec
  echo "== $1 $2"
  case "$2" in
    peer:*) KERNEL=${PEER_KERNEL:-"regex:(?i)flash"}; WHAT=(--peer "${2#peer:}"); TAG="${1//@/_at_}-${2#peer:}" ;;
    *) KERNEL=gqa_flash_prefill; WHAT=(--config "$2"); TAG="${1//@/_at_}" ;;
  esac
  timeout 100 ncu --clock-control none $SECTIONS -k "$KERNEL" -s 2 -c 1 \
      python3 scripts/ncu_profile.py "$1" "${WHAT[@]}" > "$OUT/ncu-$TAG.txt" 2>&1
  echo "ncu sections exit $?"
  timeout 100 ncu --clock-control none $METRICS -k "$KERNEL" -s 2 -c 1 \
      python3 scripts/ncu_profile.py "$1" "${WHAT[@]}" > "$OUT/ncu-metrics-$TAG.txt" 2>&1
  echo "ncu metrics exit $?"
  grep -E "Duration|Throughput|Achieved Occupancy|Registers Per|hmma|pipe_xu|mem_shared|stalled" \
      "$OUT/ncu-$TAG.txt" "$OUT/ncu-metrics-$TAG.txt" | sed 's/^[^:]*://' | head -24
  if [ "${SOURCE:-0}" = 1 ]; then
    REP="$OUT/ncu-source-$TAG"
    timeout 200 ncu --clock-control none --section WarpStateStats --section SourceCounters \
        -k "$KERNEL" -s 2 -c 1 -f -o "$REP" python3 scripts/ncu_profile.py "$1" "${WHAT[@]}" > "$REP.log" 2>&1
    echo "ncu source exit $?"
    ncu --import "$REP.ncu-rep" --page source --csv --print-source sass > "$REP-sass.csv" 2> "$REP-sass.err"
    python3 scripts/ncu_sass_stalls.py "$REP-sass.csv" --json "$REP-stalls.json" | head -24
  fi
done
