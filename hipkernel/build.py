"""Offline compile check of the fused kernel, on a machine with no GPU.

    python -m hipkernel.build [--targets sm_90,sm_80,gfx90a,gfx1030,gfx1151,gfx942]
                              [--json PATH] [--require-all] [--mutants]
                              [--configs m4_b64,...] [--head-dims 64,128]
                              [--dtypes fp16,bf16] [--jobs N]

compiles the kernel (as ``hipkernel.api`` compiles it: headers inlined, the same ``-D``
macros) for every target x head dim (``config.HEAD_DIMS``) x tile config x dtype (fp16, and
bf16: ``-DHK_BF16=1``; ``config.DTYPES``) and prints registers, spills and shared memory per
compile. The scalar path
(``kernels/gqa_flash_prefill.hip``, ``config.CANDIDATES``) is checked on every target; the
tensor-core path (``kernels/gqa_flash_prefill_mma.hip``, ``config.MMA_CANDIDATES`` and, at
d = 64, ``config.MMA_WIDE_CANDIDATES``; names ``mma_m4_b64``, ``mma_m8_b64_w2`` ...) only on
NVIDIA sm_80+ targets, the only ones it is written for:

    ==========  =========================================  ===================================
    target      compiler                                   resource report read from
    ==========  =========================================  ===================================
    sm_90/80    NVRTC (``backends.cuda.compile_offline``)  ptxas ``-v`` in the program log
    gfx90a/1030 hiprtc (``backends.hip.compile_offline``)  the code object's metadata note
    gfx1151/942 clang-19 ``-x hip --offload-device-only``  ``-Rpass-analysis=kernel-resource-usage``
    ==========  =========================================  ===================================

(ROCm 5.2's hiprtc, through its old comgr, aborts on gfx11xx, hence clang there.) A target
may be forced to a compiler with ``target@tool`` (``gfx90a@clang``).

Exit status: 1 on any compile error or any register spill, else 0. A target whose compiler is
missing is reported ``skipped: <reason>``; it fails the run only under ``--require-all``.

clang is first run bare (``-nogpuinc -nogpulib``: the kernel's ``portable.h`` needs no HIP
header and no device library). A kernel that does need them is retried with the ROCm HIP
headers, then against a private copy of the system's device libraries with the
``oclc_isa_version_<gfx>.bc`` that ROCm 5.2 lacks generated into it (a one-line OpenCL
constant ``__oclc_ISA_version``, :func:`isa_version`; see :class:`ClangHip`).

Each compile runs in a worker process (one per CPU), slowest compiler first (NVRTC, whose
ptxas dominates); a process also isolates a compiler that crashes. The whole default matrix
(6 targets x 2 head dims x 6 scalar configs, plus 2 sm targets x 2 head dims x 4 mma configs)
takes about a minute on two cores.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hipkernel.backends import (BackendUnavailable, CompileError, CompileResult, define_flags,
                                summarize_usage)

DEFAULT_TARGETS = ("sm_90a", "sm_90", "sm_80", "gfx90a", "gfx1030", "gfx1151", "gfx942")
TOOLS = ("nvrtc", "hiprtc", "clang")
AMD_SPILL_KEYS = ("vgpr_spill", "sgpr_spill")


def default_tool(target: str) -> str:
    """The compiler that checks ``target`` by default."""
    if target.startswith(("sm_", "compute_")):
        return "nvrtc"
    if target.startswith(("gfx11", "gfx12", "gfx94", "gfx95")):
        return "clang"  # ROCm 5.2's comgr/hiprtc does not know (or crashes on) these
    return "hiprtc"


def parse_target(spec: str) -> tuple[str, str]:
    """``"gfx90a"`` -> ``("gfx90a", "hiprtc")``; ``"gfx90a@clang"`` -> ``("gfx90a", "clang")``."""
    target, _, tool = spec.strip().partition("@")
    if not re.fullmatch(r"(sm|compute)_\d+[a-z]?|gfx[0-9a-f]+(:[a-z+-]+)*", target):
        raise ValueError(f"targets: {target!r} is not an sm_XY or gfxNNN target")
    tool = tool or default_tool(target)
    if tool not in TOOLS:
        raise ValueError(f"targets: unknown compiler {tool!r} in {spec!r} (have {TOOLS})")
    if (tool == "nvrtc") != target.startswith(("sm_", "compute_")):
        raise ValueError(f"targets: {tool} cannot compile for {target}")
    return target, tool


# --------------------------------------------------------------------------- clang (AMD)

_REMARK = re.compile(r"remark:\s+(?P<key>[A-Za-z][A-Za-z ]*?(?: \[[^\]]*\])?): (?P<val>\S+)"
                     r"(?: \[-Rpass-analysis=kernel-resource-usage\])?\s*$")
_REMARK_KEYS = {
    "SGPRs": "sgprs", "VGPRs": "vgprs", "AGPRs": "agprs",
    "ScratchSize [bytes/lane]": "scratch", "Dynamic Stack": "dynamic_stack",
    "Occupancy [waves/SIMD]": "occupancy", "SGPRs Spill": "sgpr_spill",
    "VGPRs Spill": "vgpr_spill", "LDS Size [bytes/block]": "lds",
}


def parse_resource_remarks(text: str) -> dict[str, dict]:
    """Per function, what clang's ``-Rpass-analysis=kernel-resource-usage`` remarks say:
    ``vgprs``, ``sgprs``, ``agprs``, ``scratch`` (bytes/lane), ``dynamic_stack``,
    ``occupancy`` (waves/SIMD), ``vgpr_spill``, ``sgpr_spill``, ``lds`` (bytes/block). The
    same keys as ``backends.hip.code_object_usage``."""
    out: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        m = _REMARK.search(line)
        if not m:
            continue
        key, val = m.group("key").strip(), m.group("val")
        if key == "Function Name":
            current = val
            out.setdefault(current, {})
        elif current is not None and key in _REMARK_KEYS:
            out[current][_REMARK_KEYS[key]] = (
                val == "True" if val in ("True", "False") else int(val) if val.isdigit() else val)
    return out


def isa_version(arch: str) -> int:
    """``__oclc_ISA_version`` of a gfx target: major * 1000 + minor * 100 + stepping, the
    last two being hex digits (gfx90a -> 9010, gfx1030 -> 10300, gfx942 -> 9402,
    gfx1151 -> 11501), as ROCm's ``oclc_isa_version_*.bc`` define it."""
    m = re.fullmatch(r"gfx(\d{1,2})([0-9a-f])([0-9a-f])", arch.split(":")[0])
    if not m:
        raise ValueError(f"arch: cannot derive the ISA version of {arch!r}")
    return int(m.group(1)) * 1000 + int(m.group(2), 16) * 100 + int(m.group(3), 16)


_DEVICE_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu/amdgcn/bitcode", "/opt/rocm/amdgcn/bitcode",
                    "/usr/lib/amdgcn/bitcode", "/usr/share/amdgcn/bitcode")
_NEEDS_HIP_HEADERS = re.compile(r"error: (use of undeclared identifier|unknown type name|"
                                r"'hip/[^']*' file not found)")
_NEEDS_DEVICE_LIBS = re.compile(r"undefined (hidden )?symbol: (__ockl_|__ocml_|__oclc_|"
                                r"__atomic_work_item_fence|__llvm_amdgcn)")


def find_clang() -> str | None:
    """``$HIPKERNEL_CLANG``, else clang-19, clang-18, clang-17 from PATH."""
    env = os.environ.get("HIPKERNEL_CLANG")
    if env:
        return shutil.which(env) or (env if os.path.exists(env) else None)
    for name in ("clang-19", "clang-18", "clang-17"):
        path = shutil.which(name)
        if path:
            return path
    return None


class ClangHip:
    """clang as an offline HIP device compiler, working in ``workdir``.

    Three environments, tried in order and remembered per arch once one works:

    1. ``-nogpuinc -nogpulib``: nothing but the source (``portable.h`` is written for this);
    2. ``-nogpulib -include hip/hip_runtime.h``: the ROCm HIP headers pre-included as hipcc
       and hiprtc do, taken when the bare compile reports undeclared HIP names
       (``threadIdx``, ``__global__``, ...);
    3. ``--rocm-device-lib-path``: a private copy of the system's device libs, plus a
       generated ``oclc_isa_version_<gfx>.bc`` where ROCm 5.2 lacks one, taken when the link
       reports device-library symbols (``__ockl_*``) undefined.
    """

    MODES = ("bare", "hip-headers", "device-libs")

    def __init__(self, clang: str, workdir: str | os.PathLike):
        self.clang = clang
        self.workdir = Path(workdir)
        self._devlibs: Path | None = None
        self._lock = threading.Lock()
        self._n = 0
        self._mode: dict[str, int] = {}  # arch -> index into MODES that worked

    def _run(self, args: Sequence[str]) -> subprocess.CompletedProcess:
        # clang finds the HIP headers through $ROCM_PATH when it is set; the hiprtc shim
        # that backends.hip may point it at has no headers, so hide such a ROCM_PATH.
        env = dict(os.environ)
        for var in ("ROCM_PATH", "ROCM_HOME"):
            if var in env and not os.path.isdir(os.path.join(env[var], "include", "hip")):
                del env[var]
        return subprocess.run([self.clang, *args], capture_output=True, text=True, timeout=900,
                              env=env)

    def device_libs(self, arch: str) -> Path:
        """A directory with the system's device libs plus ``oclc_isa_version_<arch>.bc``."""
        with self._lock:
            if self._devlibs is None:
                env = os.environ.get("HIPKERNEL_DEVICE_LIBS")
                src = next((Path(d) for d in ((env,) if env else _DEVICE_LIB_DIRS)
                            if d and (Path(d) / "ockl.bc").exists()), None)
                if src is None:
                    raise BackendUnavailable(
                        "the kernel calls device-library functions and no ROCm device libs "
                        "were found (apt-get install rocm-device-libs)")
                dst = Path(tempfile.mkdtemp(prefix="devlibs-", dir=self.workdir))
                for bc in src.glob("*.bc"):
                    os.symlink(bc, dst / bc.name)
                self._devlibs = dst
            base = arch.split(":")[0][3:]
            isa = self._devlibs / f"oclc_isa_version_{base}.bc"
            if not isa.exists():
                cl = self._devlibs / f"isa_{base}.cl"
                cl.write_text(f"const __constant int __oclc_ISA_version = {isa_version(arch)};\n")
                r = self._run(["-x", "cl", "-cl-std=CL2.0", "-target", "amdgcn-amd-amdhsa",
                               "-nogpulib", "-fvisibility=protected", "-emit-llvm", "-c",
                               str(cl), "-o", str(isa)])
                if r.returncode:
                    raise BackendUnavailable(f"cannot make {isa.name}: {r.stderr.strip()}")
            return self._devlibs

    def _mode_flags(self, mode: str, arch: str) -> list[str]:
        if mode == "bare":
            return ["-nogpuinc", "-nogpulib"]
        # as hipcc and hiprtc do, pre-include the HIP runtime header (threadIdx & co.)
        if mode == "hip-headers":
            return ["-nogpulib", "-include", "hip/hip_runtime.h"]
        return [f"--rocm-device-lib-path={self.device_libs(arch)}", "-include", "hip/hip_runtime.h"]

    def compile(self, source: str, defines: dict, arch: str,
                kernel_name: str | None = None) -> CompileResult:
        with self._lock:
            self._n += 1
            stem = self.workdir / f"k{os.getpid()}-{self._n}"
        src, out = stem.with_suffix(".hip"), stem.with_suffix(".co")
        src.write_text(source)
        base = ["-x", "hip", f"--offload-arch={arch}", "--offload-device-only", "-O3",
                "-std=c++17", *define_flags(defines), "-Rpass-analysis=kernel-resource-usage",
                "-c", str(src), "-o", str(out)]
        try:
            first = self._mode.get(arch, 0)
            for i in range(first, len(self.MODES)):
                r = self._run([*base, *self._mode_flags(self.MODES[i], arch)])
                if not r.returncode:
                    self._mode[arch] = i
                    break
                escalate = (_NEEDS_HIP_HEADERS if self.MODES[i] == "bare"
                            else _NEEDS_DEVICE_LIBS if self.MODES[i] == "hip-headers" else None)
                if escalate is None or not escalate.search(r.stderr):
                    break
            log = r.stderr
            if r.returncode:
                raise CompileError("clang", "clang -x hip", r.returncode, "compile failed", log)
            binary = out.read_bytes()
        finally:
            for p in (src, out):
                try:
                    p.unlink()
                except OSError:
                    pass
        regs, spills, smem, details = summarize_usage(
            parse_resource_remarks(log), kernel_name, regs="vgprs", smem="lds",
            spill_keys=AMD_SPILL_KEYS)
        details["clang_mode"] = self.MODES[self._mode[arch]]
        return CompileResult(log=log, binary=binary, regs=regs, spills=spills, smem=smem,
                             target=arch, kind="hsaco", details=details)


# --------------------------------------------------------------------------- the check

@dataclass
class Variant:
    """One compile of the kernel: head dim, config label, -D macros, the kernel path
    (``config.PATHS``) whose source it compiles ("mma" variants compile for sm_80+ only), and
    the dtype of q, k, v and out (``config.DTYPES``; bf16's macros have ``HK_BF16=1``)."""

    d: int
    config: str
    defines: dict
    path: str = "scalar"
    dtype: str = "fp16"


@dataclass
class Row:
    target: str
    tool: str
    d: int | None
    config: str
    status: str  # "ok" | "SPILL" | "ERROR" | "skipped: <reason>"
    regs: int | None = None
    spills: int | None = None
    smem: int | None = None
    details: dict = field(default_factory=dict)
    error: str = ""
    dtype: str = "fp16"

    @property
    def failed(self) -> bool:
        return self.status in ("ERROR", "SPILL")

    @property
    def skipped(self) -> bool:
        return self.status.startswith("skipped")


def kernel_variants(mutants: bool = False, dtypes: Sequence[str] | None = None) -> list[Variant]:
    """Every (head dim, candidate config) the API can launch, every path, in each of
    ``dtypes`` (default: ``config.DTYPES``, fp16 and bf16); with ``mutants``, also each path's
    default config with each mutant macro (so every ``#ifdef`` branch of every file
    compiles), in each dtype too."""
    from hipkernel import api
    from hipkernel.config import (DEFAULT, DTYPES, HEAD_DIMS, MFMA_CANDIDATES, MMA_DEFAULT,
                                  MMA_WIDE_CANDIDATES, WGMMA_BY_HEAD_DIM, WIDE_HEAD_DIMS,
                                  WMMA_CANDIDATES, compiled_variants)

    dtypes = DTYPES if dtypes is None else tuple(dtypes)
    out = [Variant(d, cfg.name, api.kernel_defines(d, cfg, dtype=dt), cfg.path, dt)
           for dt in dtypes for d, cfg in compiled_variants()]
    if mutants:
        from refattn.mutants import MUTANTS

        defaults = [(cfg, d) for cfg in (DEFAULT, MMA_DEFAULT) for d in HEAD_DIMS]
        defaults += [(cfg, d) for d, cfg in WGMMA_BY_HEAD_DIM.items()]  # the tile of each d
        defaults += [(MMA_WIDE_CANDIDATES[0], d) for d in WIDE_HEAD_DIMS]
        defaults += [(cfg, d) for cfg in (WMMA_CANDIDATES[0], MFMA_CANDIDATES[0]) for d in HEAD_DIMS]
        out += [Variant(d, f"{cfg.name}+{m.name}", api.kernel_defines(d, cfg, {m.name}, dt), cfg.path, dt)
                for dt in dtypes for cfg, d in defaults for m in MUTANTS]
    return out


def _compiles_for(v: Variant, target: str) -> bool:
    """Whether variant ``v`` is meant for ``target``: scalar everywhere, mma on sm_80+,
    wgmma on sm_90a only (the target the CUDA backend compiles for on an sm_90 device), wmma
    on gfx11 and mfma on gfx90a / gfx94x (their NVIDIA emulation is compiled when it runs)."""
    from hipkernel.config import WGMMA_PATHS, WGMMA_TARGET, has_mfma, has_mma, has_wmma

    if v.path in WGMMA_PATHS:
        return target == WGMMA_TARGET
    if v.path == "wmma":
        return has_wmma(target)
    if v.path == "mfma":
        return has_mfma(target)
    return v.path == "scalar" or has_mma(target)


# A trivial kernel, spelled without HIP or CUDA macros so that every compiler in every mode
# takes it: when it fails, the toolchain is missing something, not the kernel.
PROBE = 'extern "C" __attribute__((global)) void hipkernel_probe(float* p) { p[0] = 1.0f; }\n'
_TOOL_ORDER = {"nvrtc": 0, "hiprtc": 1, "clang": 2}  # slowest first (NVRTC + ptxas)
_CLANGS: dict[str, ClangHip] = {}  # per worker process, by work directory


def compile_with(tool: str, target: str, source: str, defines: dict, kernel_name: str | None,
                 workdir: str) -> CompileResult:
    """One compile with ``tool``, as run in a worker process; the result without its
    binary. Raises :class:`BackendUnavailable` when the tool cannot run here."""
    if tool == "nvrtc":
        from hipkernel.backends import cuda

        res = cuda.compile_offline(source, defines, target, kernel_name=kernel_name)
    elif tool == "hiprtc":
        from hipkernel.backends import hip

        res = hip.compile_offline(source, defines, target, kernel_name=kernel_name)
    else:
        clang = _CLANGS.get(workdir)
        if clang is None:
            path = find_clang()
            if path is None:
                raise BackendUnavailable("clang-19 not found (apt-get install clang-19 lld-19)")
            clang = _CLANGS[workdir] = ClangHip(path, workdir)
        res = clang.compile(source, defines, target, kernel_name)
    res.binary = b""
    return res


class _InProcess:
    """The executor interface, running each call at once in this process (``jobs=0``)."""

    def submit(self, fn, *args) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn(*args))
        except Exception as e:  # noqa: BLE001 - delivered through the future
            fut.set_exception(e)
        return fut

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _first_line(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [""])[0]
    errors = [ln.strip() for ln in getattr(e, "log", "").splitlines() if "error" in ln]
    return f"{type(e).__name__}: {text}" + (f": {errors[0]}" if errors else "")


def check(targets: Iterable[str], source: str | Mapping[str, str], variants: Sequence[Variant],
          kernel_name: str, jobs: int | None = None) -> list[Row]:
    """Compile ``source`` for every target x variant: one :class:`Row` each, or one skipped
    row for a target whose compiler cannot compile a trivial kernel here. ``source`` is one
    text for every variant, or a mapping from ``Variant.path`` to its text; an mma variant
    is compiled only for sm_80+ targets (no row elsewhere).

    Compiles run in ``jobs`` worker processes (default: one per CPU), which isolates the
    compilers' global state and their crashes; ``jobs=0`` runs them in this process."""
    parsed = [parse_target(t) for t in targets]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="hipkernel-build-") as workdir:
        if jobs == 0:
            pool = _InProcess()
        else:
            pool = ProcessPoolExecutor(max_workers=jobs or os.cpu_count() or 1,
                                       mp_context=multiprocessing.get_context("spawn"))
        with pool:
            probes = [(t, tool, pool.submit(compile_with, tool, t, PROBE, {}, None, workdir))
                      for t, tool in parsed]
            ready = []
            for target, tool, fut in probes:
                try:
                    fut.result()
                    ready.append((target, tool))
                except BackendUnavailable as e:
                    rows.append(Row(target, tool, None, "*", f"skipped: {e}"))
                except Exception as e:  # noqa: BLE001 - no library, no linker, no headers
                    rows.append(Row(target, tool, None, "*", f"skipped: {tool} cannot compile "
                                    f"a trivial kernel for {target}: {_first_line(e)}"))
            work = [(t, tool, v) for t, tool in ready for v in variants if _compiles_for(v, t)]
            futures = {}
            for i in sorted(range(len(work)), key=lambda i: _TOOL_ORDER[work[i][1]]):
                t, tool, v = work[i]
                text = source if isinstance(source, str) else source[v.path]
                futures[i] = pool.submit(compile_with, tool, t, text, v.defines, kernel_name,
                                         workdir)
            for i, (target, tool, v) in enumerate(work):
                try:
                    res = futures[i].result()
                except BackendUnavailable as e:
                    rows.append(Row(target, tool, v.d, v.config, f"skipped: {e}", dtype=v.dtype))
                except BrokenProcessPool as e:
                    rows.append(Row(target, tool, v.d, v.config, "ERROR",
                                    error=f"the compiler's worker process died ({e})", dtype=v.dtype))
                except Exception as e:  # noqa: BLE001 - a compile error is a row, not a crash
                    rows.append(Row(target, tool, v.d, v.config, "ERROR",
                                    error=getattr(e, "log", "") or f"{type(e).__name__}: {e}",
                                    dtype=v.dtype))
                else:
                    rows.append(Row(target, tool, v.d, v.config,
                                    "SPILL" if res.spills else "ok", res.regs, res.spills,
                                    res.smem, res.details, dtype=v.dtype))
    order = {tt: i for i, tt in enumerate(parsed)}
    return sorted(rows, key=lambda r: order[(r.target, r.tool)])  # stable: variants keep order


# --------------------------------------------------------------------------- report

def _regs_text(r: Row) -> str:
    if r.regs is None:
        return "-"
    if r.tool == "nvrtc":
        return str(r.regs)
    text = f"v{r.regs}"
    if r.details.get("agprs"):
        text += f" a{r.details['agprs']}"
    if r.details.get("sgprs") is not None:
        text += f" s{r.details['sgprs']}"
    return text


def _status_text(r: Row) -> str:
    notes = []
    if r.details.get("stack"):
        notes.append(f"stack {r.details['stack']} B")
    if r.details.get("scratch"):
        notes.append(f"scratch {r.details['scratch']} B/lane")
    if r.details.get("dynamic_stack"):
        notes.append("dynamic stack")
    if r.details.get("clang_mode") not in (None, "bare"):
        notes.append(r.details["clang_mode"])
    if r.details.get("occupancy"):
        notes.append(f"occ {r.details['occupancy']}")
    return r.status + (f" ({', '.join(notes)})" if notes else "")


def format_table(rows: Sequence[Row]) -> str:
    header = ("target", "compiler", "d", "dtype", "config", "regs", "spills", "smem", "status")
    body = [(r.target, r.tool, "-" if r.d is None else str(r.d), "-" if r.d is None else r.dtype,
             r.config, _regs_text(r),
             "-" if r.spills is None else str(r.spills), "-" if r.smem is None else str(r.smem),
             _status_text(r)) for r in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *body, strict=True)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
             for line in (header, tuple("-" * w for w in widths), *body)]
    return "\n".join(lines)


def summarize(rows: Sequence[Row], require_all: bool = False) -> tuple[bool, str]:
    n_ok = sum(r.status == "ok" for r in rows)
    n_spill = sum(r.status == "SPILL" for r in rows)
    n_err = sum(r.status == "ERROR" for r in rows)
    n_skip = sum(r.skipped for r in rows)
    ok = not n_spill and not n_err and not (require_all and n_skip)
    text = (f"{'OK' if ok else 'FAIL'}: {n_ok} compiled clean, {n_spill} spilled, "
            f"{n_err} failed to compile, {n_skip} skipped"
            + (" (--require-all: skipped targets fail)" if require_all and n_skip else ""))
    return ok, text


def error_report(rows: Sequence[Row], max_lines: int = 60) -> str:
    """Each distinct compile log once, naming the compiles that produced it."""
    seen: dict[str, list[str]] = {}
    for r in rows:
        if r.status == "ERROR":
            seen.setdefault(r.error, []).append(
                f"{r.target} d={r.d} {r.config}" + ("" if r.dtype == "fp16" else f" {r.dtype}"))
    parts = []
    for log, where in seen.items():
        lines = log.rstrip().splitlines()
        more = f"\n... ({len(lines) - max_lines} more lines)" if len(lines) > max_lines else ""
        parts.append(f"--- compile error in {', '.join(where)} ---\n"
                     + "\n".join(lines[:max_lines]) + more)
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hipkernel.build",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--targets", default=",".join(DEFAULT_TARGETS),
                    help="comma-separated targets, optionally target@nvrtc|hiprtc|clang "
                         f"(default: {','.join(DEFAULT_TARGETS)})")
    ap.add_argument("--json", type=Path, metavar="PATH", help="also write the rows as JSON")
    ap.add_argument("--require-all", action="store_true",
                    help="a target whose compiler is missing fails the run")
    ap.add_argument("--mutants", action="store_true",
                    help="also compile the default config with each mutant macro")
    ap.add_argument("--configs", metavar="NAMES",
                    help="only these configs, comma-separated (e.g. m4_b64; default: all)")
    ap.add_argument("--head-dims", metavar="DS", help="only these head dims, e.g. 64,128")
    ap.add_argument("--dtypes", metavar="DTS", default="fp16,bf16",
                    help="the dtypes to compile, comma-separated (default: fp16,bf16)")
    ap.add_argument("--jobs", type=int, default=None,
                    help="parallel compiler processes (default: one per CPU; 0: in this process)")
    args = ap.parse_args(argv)
    try:
        targets = ["@".join(parse_target(t)) for t in args.targets.split(",") if t.strip()]
    except ValueError as e:
        ap.error(str(e))

    from hipkernel import api
    from hipkernel.config import DTYPES

    dtypes = [x.strip() for x in args.dtypes.split(",") if x.strip()]
    bad = [x for x in dtypes if x not in DTYPES]
    if bad or not dtypes:
        ap.error(f"dtypes: expected a comma-separated subset of {','.join(DTYPES)}, got {args.dtypes!r}")
    variants = kernel_variants(args.mutants, dtypes)
    if args.configs:
        names = set(args.configs.split(","))
        variants = [v for v in variants if v.config.split("+")[0] in names]
    if args.head_dims:
        dims = {int(x) for x in args.head_dims.split(",")}
        variants = [v for v in variants if v.d in dims]
    if not variants:
        ap.error("no config / head dim left to compile (see --configs, --head-dims)")
    from hipkernel.config import PATHS

    sources = {path: api.kernel_source(path) for path in PATHS}
    rows = check(targets, sources, variants, api.KERNEL_NAME, jobs=args.jobs)
    print(format_table(rows))
    errors = error_report(rows)
    if errors:
        print(errors, file=sys.stderr)
    ok, summary = summarize(rows, args.require_all)
    print(summary)
    if args.json:
        payload = {"ok": ok, "summary": summary, "kernel_source_hash": api.source_hash(),
                   "rows": [asdict(r) for r in rows]}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
