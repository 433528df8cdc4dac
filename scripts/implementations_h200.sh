#!/usr/bin/env bash
# The run records of the implementations table (docs/implementations.md) that need a GPU, in
# one run on an H200: torch's SDPA, FlexAttention and FlashAttention-4 (when importable), ONNX
# Runtime on its CUDA execution provider (when this onnxruntime has it), and hipkernel driven
# through the C route (refattn.adapters.cabi, examples/c_v3/hipkernel_v3.toml). Each is
# `refattn run` over SUITES, under its own time limit, into $OUT/impl/<name>-h200.json; an
# implementation that is not available here is listed in $OUT/impl/skipped.txt with the
# reason. Then, where the records are collected:
#   cp $OUT/impl/*-h200.json reports/implementations/ && refattn implementations
#   OUT=dir bash scripts/implementations_h200.sh
set -u
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HIPKERNEL_CACHE_DIR=${HIPKERNEL_CACHE_DIR:-/tmp/hkcache}
: "${OUT:?set OUT to the output directory}"
SUITES=${SUITES:-"seed extended contracts coverage ragged bf16"}
LIMIT=${LIMIT:-150}                # seconds for each implementation
mkdir -p "$OUT/impl" || exit 2
suite_args=$(for s in $SUITES; do printf -- '--suite %s ' "$s"; done)
t0=$(date +%s)
one() {  # one NAME SPEC
    local name=$1 spec=$2
    why=$(python3 -c "import sys
from refattn.kernels import get_kernel, kernel_available
ok, why = kernel_available(get_kernel(sys.argv[1]))
print('' if ok else ' '.join(why.split()))" "$spec" 2>&1)
    if [ -n "$why" ]; then
        echo "$name ($spec): $why" >> "$OUT/impl/skipped.txt"; return
    fi
    timeout -k 10 "$LIMIT" python3 -m refattn run --kernel "$spec" $suite_args -q \
        --json "$OUT/impl/$name-h200.json" > "$OUT/impl/$name.log" 2>&1
    echo "$name ($spec): rc=$? after $(( $(date +%s) - t0 )) s: $(tail -n 1 "$OUT/impl/$name.log")"
}
one sdpa sdpa
one fa4 fa4
one flex flex
one ort-cuda ort:cuda
one cabi-hipkernel cabi:examples/c_v3/hipkernel_v3.toml
[ -f "$OUT/impl/skipped.txt" ] && cat "$OUT/impl/skipped.txt"
exit 0
