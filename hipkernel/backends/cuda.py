"""NVIDIA backend: NVRTC compiles the HIP source, cuda-bindings loads, launches and copies.

The mirror of ``hip.py``, call for call (``nvrtc*`` <-> ``hiprtc*``, ``cu*`` <-> ``hip*``).
Every binding call returns ``(err, *values)`` and goes through :func:`_check`, which raises
with the decoded error name (``cuGetErrorName`` / ``nvrtcGetErrorString``) and, for a failed
compile, the whole program log.

``compile_offline`` needs only NVRTC (the ``nvidia-cuda-nvrtc`` wheel), no driver and no
GPU: CI uses it to compile the kernel for sm_90/sm_80 and read registers, spills and shared
memory from ptxas (``--ptxas-options=-v``, which reports only when compiling to CUBIN).
"""

from __future__ import annotations

import functools
import os
import re
import struct
from collections.abc import Sequence
from pathlib import Path

from hipkernel.config import WGMMA_SM
from hipkernel.backends import (Backend, BackendError, BackendUnavailable, CompileError,
                                CompileResult, define_flags, device_from_environment,
                                error_text, split_result, summarize_usage, unwrap)

try:  # cuda-bindings >= 12.6 ...
    from cuda.bindings import driver, nvrtc
    IMPORT_ERROR = None
except ImportError as _e:
    try:  # ... and older cuda-python releases
        from cuda import cuda as driver, nvrtc  # type: ignore[no-redef]
        IMPORT_ERROR = None
    except ImportError:
        driver = nvrtc = None
        IMPORT_ERROR = _e

NAME = "cuda"
BASE_OPTIONS = ("-std=c++17", "-default-device", "-lineinfo")
SPILL_KEYS = ("spill_stores", "spill_loads")  # bytes, from ptxas


# --------------------------------------------------------------------------- errors

def _error_name(err) -> str:
    """``CUDA_ERROR_...`` / ``NVRTC_ERROR_...`` for an error code, asking the library
    first and falling back on the enum's own name."""
    try:
        if type(err).__name__ == "nvrtcResult":
            _, text = split_result(nvrtc.nvrtcGetErrorString(err))
        else:
            _, text = split_result(driver.cuGetErrorName(err))
        text = error_text(text[0]) if text else ""
        if text:
            return text
    except Exception:  # noqa: BLE001 - decoding must never hide the original error
        pass
    return getattr(err, "name", None) or str(err)


def _check(result, call: str = "?", log: str = ""):
    """Raise :class:`BackendError` (a :class:`CompileError` for NVRTC compile failures,
    carrying ``log``) unless ``result[0]`` is success; return the remaining values."""
    err, values = split_result(result)
    if int(err) != 0:  # CUDA_SUCCESS and NVRTC_SUCCESS are both 0
        cls = CompileError if call.startswith("nvrtc") and log else BackendError
        raise cls(NAME, call, int(err), _error_name(err), log)
    return unwrap(values)


def _call(fn, *args):
    return _check(fn(*args), getattr(fn, "__name__", "?"))


def _require_nvrtc() -> None:
    if nvrtc is None:
        raise BackendUnavailable(f"cuda-bindings is not importable ({IMPORT_ERROR}); "
                                 f"pip install cuda-bindings nvidia-cuda-nvrtc")


# --------------------------------------------------------------------------- compile (no GPU)

_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_BARRIERS = re.compile(r"used (\d+) barriers")


def parse_ptxas_log(log: str) -> dict[str, dict]:
    """Per function, what ``--ptxas-options=-v`` reported: ``regs``, ``smem`` (static
    shared bytes), ``barriers`` for entry functions; ``stack``, ``spill_stores``,
    ``spill_loads`` (bytes) for every function with a properties line."""
    out: dict[str, dict] = {}
    entry = props = None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            entry = m.group(1)
            out.setdefault(entry, {})
        elif m := _PROPS.search(line):
            props = m.group(1)
        elif (m := _FRAME.search(line)) and props is not None:
            out.setdefault(props, {}).update(
                stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif (m := _USED.search(line)) and entry is not None:
            u = out[entry]
            u["regs"] = int(m.group(1))
            sm = _SMEM.search(line)
            u["smem"] = int(sm.group(1)) if sm else 0
            if bm := _BARRIERS.search(line):
                u["barriers"] = int(bm.group(1))
    return out


@functools.lru_cache(maxsize=1)
def cuda_include_dirs() -> tuple[str, ...]:
    """A directory with the CUDA headers (``cuda_fp16.h``), when one is installed: NVRTC
    has no built-in copy. From cuda-pathfinder, ``$CUDA_HOME``/``$CUDA_PATH``, or
    /usr/local/cuda. Empty when there is none."""
    candidates = []
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        candidates.append(find_nvidia_header_directory("cudart"))
    except Exception:  # noqa: BLE001 - optional helper of newer cuda-python releases
        pass
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "include"))
    candidates.append("/usr/local/cuda/include")
    for d in candidates:
        if d and (Path(d) / "cuda_fp16.h").is_file():
            return (str(d),)
    return ()


def compile_options(defines: dict, arch: str, include_dirs: Sequence[str] = ()) -> list[str]:
    """NVRTC options: ``sm_XY`` compiles to CUBIN (with ptxas' resource report),
    ``compute_XY`` to PTX."""
    opts = [f"--gpu-architecture={arch}", *BASE_OPTIONS]
    if arch.startswith("sm_"):
        opts.append("--ptxas-options=-v")
    opts += define_flags(defines)
    opts += [f"-I{d}" for d in (*include_dirs, *cuda_include_dirs())]
    return opts


def nvrtc_version() -> str:
    _require_nvrtc()
    major, minor = _call(nvrtc.nvrtcVersion)
    return f"nvrtc {major}.{minor}"


def supported_archs() -> list[int]:
    """Compute capabilities this NVRTC can compile for, e.g. ``[75, 80, ..., 120]``."""
    _require_nvrtc()
    if not hasattr(nvrtc, "nvrtcGetSupportedArchs"):
        return []
    return list(_call(nvrtc.nvrtcGetSupportedArchs))


def _program_log(prog) -> str:
    size = _call(nvrtc.nvrtcGetProgramLogSize, prog)
    buf = b" " * size
    _call(nvrtc.nvrtcGetProgramLog, prog, buf)
    return error_text(buf)


def compile_offline(source: str, defines: dict, arch: str, include_dirs: Sequence[str] = (),
                    kernel_name: str | None = None, name: str = "kernel.hip") -> CompileResult:
    """Compile ``source`` with NVRTC for ``arch`` (``sm_90``: CUBIN; ``compute_90``: PTX).
    Needs no driver or GPU. Raises :class:`CompileError` with the whole log on failure."""
    _require_nvrtc()
    if arch.startswith("sm_") and not hasattr(nvrtc, "nvrtcGetCUBIN"):
        arch = "compute_" + arch[3:]  # very old NVRTC: PTX only, the driver finishes it
    options = [o.encode() for o in compile_options(defines, arch, include_dirs)]
    prog = _call(nvrtc.nvrtcCreateProgram, source.encode(), name.encode(), 0, [], [])
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(options), options)
        log = _program_log(prog)
        _check((err,), "nvrtcCompileProgram", log=log or "(empty log)")
        if arch.startswith("sm_"):
            size = _call(nvrtc.nvrtcGetCUBINSize, prog)
            binary = b" " * size
            _call(nvrtc.nvrtcGetCUBIN, prog, binary)
            kind = "cubin"
        else:
            size = _call(nvrtc.nvrtcGetPTXSize, prog)
            binary = b" " * size
            _call(nvrtc.nvrtcGetPTX, prog, binary)
            kind = "ptx"
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    regs, spills, smem, details = summarize_usage(parse_ptxas_log(log), kernel_name, regs="regs",
                                                  smem="smem", spill_keys=SPILL_KEYS)
    return CompileResult(log=log, binary=bytes(binary), regs=regs, spills=spills, smem=smem,
                         target=arch, kind=kind, details=details)


# --------------------------------------------------------------------------- the device

def _attribute(dev, attr) -> int:
    return _call(driver.cuDeviceGetAttribute, attr, dev)


class CudaBackend(Backend):
    """One CUDA device through its primary context, default stream."""

    name = NAME

    def __init__(self, device: int = 0, cache=None):
        super().__init__(cache)
        if driver is None:
            raise BackendUnavailable(f"cuda-bindings is not importable ({IMPORT_ERROR})")
        try:
            _call(driver.cuInit, 0)
        except BackendError as e:
            raise BackendUnavailable(f"cuInit failed: {e.error_name}") from e
        except Exception as e:  # noqa: BLE001 - e.g. the driver library is not installed
            raise BackendUnavailable(f"NVIDIA driver not loadable: {type(e).__name__}: {e}") from e
        count = _call(driver.cuDeviceGetCount)
        if count < 1:
            raise BackendUnavailable("no CUDA device")
        if not 0 <= device < count:
            raise BackendUnavailable(f"device {device} requested, {count} present")
        self._dev = _call(driver.cuDeviceGet, device)
        attr = driver.CUdevice_attribute
        major = _attribute(self._dev, attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        minor = _attribute(self._dev, attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
        self.sm_count = _attribute(self._dev, attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        self.device_name = error_text(_call(driver.cuDeviceGetName, 256, self._dev))
        self.arch = f"sm_{major}{minor}"
        self._ctx = _call(driver.cuDevicePrimaryCtxRetain, self._dev)
        _call(driver.cuCtxSetCurrent, self._ctx)
        self._stream = driver.CUstream(0)
        self.compiler_version = nvrtc_version() if nvrtc is not None else "nvrtc missing"
        self.target = self._target(major * 10 + minor)

    def _target(self, cc: int) -> str:
        """``sm_XY`` when this NVRTC knows the device (``sm_90a`` on compute capability 9.0:
        the arch-specific target that has wgmma, whose code runs on exactly that device);
        PTX for the newest arch it knows when the device is newer (the driver JIT-compiles
        it)."""
        archs = supported_archs()
        if not archs or cc in archs:
            return f"sm_{cc}a" if cc == WGMMA_SM else f"sm_{cc}"
        older = [a for a in archs if a <= cc]
        if not older:
            raise BackendUnavailable(f"NVRTC ({self.compiler_version}) cannot compile for "
                                     f"sm_{cc} (supports {archs})")
        return f"compute_{max(older)}"

    def _bind(self) -> None:
        # The context is current per thread; re-bind in case we are called from another one.
        _call(driver.cuCtxSetCurrent, self._ctx)

    # ---- compile + load
    def _compile_options(self, defines, include_dirs):
        return compile_options(defines, self.target, include_dirs)

    def _compile(self, source, defines, include_dirs):
        return compile_offline(source, defines, self.target, include_dirs)

    def _load(self, binary):
        self._bind()
        if not binary.startswith(b"\x7fELF") and not binary.endswith(b"\0"):
            binary += b"\0"  # PTX text must be NUL-terminated
        return _call(driver.cuModuleLoadData, binary)

    def _get_function(self, module, kernel_name):
        return _call(driver.cuModuleGetFunction, module, kernel_name.encode())

    def _launch(self, function, grid, block, shared_mem, params_address, stream=None):
        # Every launch's path, so the two driver calls are checked inline: _call's generic
        # unwrapping cost 0.7 us of a 4.7 us launch on an H100 host.
        err = driver.cuCtxSetCurrent(self._ctx)[0]
        if int(err):
            _check((err,), "cuCtxSetCurrent")
        err = driver.cuLaunchKernel(function, *grid, *block, shared_mem,
                                    self._stream if stream is None else driver.CUstream(stream),
                                    params_address, 0)[0]
        if int(err):
            _check((err,), "cuLaunchKernel")

    def _tensor_map(self, address, dims, strides, box):
        # fp16, no interleave, the 128-byte swizzle (the wgmma path's layout), L2 lines of 256
        # bytes, and out-of-bounds elements read as zeros (FLOAT_OOB_FILL_NONE)
        u32, u64 = driver.cuuint32_t, driver.cuuint64_t
        tmap = _call(driver.cuTensorMapEncodeTiled,
                     driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16, len(dims), address,
                     [u64(n) for n in dims], [u64(x) for x in strides], [u32(n) for n in box],
                     [u32(1)] * len(dims), driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
                     driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
                     driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                     driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
        return struct.pack("<16Q", *(int(x) for x in tmap.opaque))

    def _allow_dynamic_shared(self, function, nbytes, static):
        attr = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
        limit = _attribute(self._dev, attr)
        if nbytes + static > limit:
            raise ValueError(f"shared_mem: {nbytes} bytes of dynamic shared memory, over the "
                             f"{limit - static} a block of {self.device_name} may have next to "
                             f"its {static} static")
        self._bind()
        _call(driver.cuFuncSetAttribute, function,
              driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)

    # ---- memory
    def _alloc(self, nbytes):
        self._bind()
        return int(_call(driver.cuMemAlloc, nbytes))

    def _free(self, address):
        _call(driver.cuMemFree, driver.CUdeviceptr(address))

    def _htod(self, address, host_address, nbytes):
        _call(driver.cuMemcpyHtoD, driver.CUdeviceptr(address), host_address, nbytes)

    def _dtoh(self, host_address, address, nbytes):
        _call(driver.cuMemcpyDtoH, host_address, driver.CUdeviceptr(address), nbytes)

    def _memset(self, address, byte, nbytes):
        _call(driver.cuMemsetD8, driver.CUdeviceptr(address), byte, nbytes)

    def _synchronize(self):
        self._bind()
        _call(driver.cuCtxSynchronize)

    # ---- events
    def _event_create(self):
        return _call(driver.cuEventCreate, 0)  # CU_EVENT_DEFAULT: timing enabled

    def _event_record(self, event):
        _call(driver.cuEventRecord, event, self._stream)

    def _event_elapsed_ms(self, start, end):
        _call(driver.cuEventSynchronize, end)
        return float(_call(driver.cuEventElapsedTime, start, end))

    def _event_destroy(self, event):
        _call(driver.cuEventDestroy, event)


def create(device: int | None = None) -> CudaBackend:
    """The backend on ``device`` (default ``$HIPKERNEL_DEVICE`` or 0)."""
    if device is None:
        device = device_from_environment()
    return CudaBackend(device)
