#!/usr/bin/env bash
# Install the offline kernel compilers that `python -m hipkernel.build` uses on a CPU-only
# Debian 12 CI machine (root, network to Debian and PyPI). Idempotent; safe to re-run.
#
#   .ci/install-amd.sh [VENV_DIR | PYTHON]     (default: the python3 on PATH)
#
#   apt   clang-19 lld-19                      gfx1151 / gfx942 through clang -x hip
#         clang-tools-19                       clang-offload-bundler, which clang -x hip runs
#                                              (only a Recommends of clang-19)
#         libamdhip64-dev libamd-comgr2        ROCm 5.2: hiprtc (inside libamdhip64.so.5),
#         rocm-device-libs                     comgr, HIP headers, device bitcode libraries
#   shim  /opt/rocm-shim/lib/{libhiprtc.so,libamdhip64.so} -> libamdhip64.so.5  (it exports hiprtc)
#   pip   hip-python==10.0.0.0.1.2             gfx90a / gfx1030 through hiprtc
#         cuda-bindings, nvidia-cuda-nvrtc     sm_90 / sm_80 through NVRTC
#         nvidia-cuda-nvdisasm                 the SASS of those builds (hipkernel.sass,
#                                              tests/test_sass.py)
#
# hip-python pin: 10.x is the first release whose loader honours $ROCM_PATH; 6.2 and 7.2 also
# compile with ROCm 5.2's hiprtc but dlopen the bare name libhiprtc.so (LD_LIBRARY_PATH
# needed). See hipkernel/backends/hip.py.
#
# Nothing here fails the run: a step that cannot be done (no apt, no network) prints a
# warning, and hipkernel.build then reports the targets it could not check as "skipped".
# The last line printed is the ROCM_PATH to export (hipkernel.backends.hip also finds
# /opt/rocm-shim by itself).
set -uo pipefail

HIP_PYTHON_PIN="hip-python==10.0.0.0.1.2"
CUDA_PIP=("cuda-bindings>=12.6" "nvidia-cuda-nvrtc")
SASS_PIP=("nvidia-cuda-nvdisasm")  # on its own: without it only tests/test_sass.py skips
APT_PACKAGES=(clang-19 clang-tools-19 lld-19 libamdhip64-dev libamd-comgr2 rocm-device-libs)
SHIM=/opt/rocm-shim

warn() { echo "install-amd: WARNING: $*" >&2; }
info() { echo "install-amd: $*" >&2; }

# ---- which python ---------------------------------------------------------------------
if [[ $# -ge 1 && -d "$1" ]]; then
    PY="$1/bin/python"
elif [[ $# -ge 1 ]]; then
    PY="$1"
else
    PY="$(command -v python3 || command -v python || true)"
fi

# ---- apt ------------------------------------------------------------------------------
missing=()
for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [[ ${#missing[@]} -eq 0 ]]; then
    info "apt packages already installed"
elif ! command -v apt-get >/dev/null 2>&1; then
    warn "apt-get not available; not installing ${missing[*]}"
elif [[ $(id -u) -ne 0 ]]; then
    warn "not root; not installing ${missing[*]}"
else
    info "apt-get install ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}"; } >&2; then
        warn "apt-get install failed; the AMD targets will be reported as skipped"
    fi
fi

# ---- the hiprtc shim ------------------------------------------------------------------
find_lib() {  # newest match of a glob in the usual library directories
    local d f
    for d in /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib /usr/local/lib; do
        f=$(ls -1 "$d"/$1 2>/dev/null | sort -V | tail -n 1)
        [[ -n "$f" ]] && { echo "$f"; return 0; }
    done
    return 1
}
amdhip=$(find_lib 'libamdhip64.so.[0-9]') || amdhip=""
if [[ -z "$amdhip" ]]; then
    warn "libamdhip64.so.N not found; hiprtc (gfx90a, gfx1030) will be skipped"
else
    hiprtc=$(find_lib 'libhiprtc.so.[0-9]') || hiprtc="$amdhip"  # ROCm 5.x: inside libamdhip64
    if mkdir -p "$SHIM/lib" 2>/dev/null \
        && ln -sfn "$hiprtc" "$SHIM/lib/libhiprtc.so" \
        && ln -sfn "$amdhip" "$SHIM/lib/libamdhip64.so"; then
        info "shim $SHIM/lib: libhiprtc.so -> $hiprtc, libamdhip64.so -> $amdhip"
    else
        warn "cannot write $SHIM; hipkernel.backends.hip makes a private shim instead"
    fi
fi

# ---- pip ------------------------------------------------------------------------------
if [[ -z "$PY" || ! -x "$PY" ]]; then
    warn "no python interpreter (${PY:-none}); not installing $HIP_PYTHON_PIN ${CUDA_PIP[*]}"
else
    info "$PY -m pip install $HIP_PYTHON_PIN ${CUDA_PIP[*]}"
    if ! "$PY" -m pip install -q "$HIP_PYTHON_PIN" "${CUDA_PIP[@]}" >&2; then
        warn "pip install failed; hiprtc / NVRTC targets may be reported as skipped"
    fi
    info "$PY -m pip install ${SASS_PIP[*]}"
    if ! "$PY" -m pip install -q "${SASS_PIP[@]}" >&2; then
        warn "pip install failed; the SASS checks (tests/test_sass.py) will be skipped"
    fi
fi

if [[ -e "$SHIM/lib/libhiprtc.so" ]]; then
    echo "export ROCM_PATH=$SHIM"
else
    warn "no $SHIM; leaving ROCM_PATH unset"
fi
exit 0
