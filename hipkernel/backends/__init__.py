"""GPU backends: compile, load, launch and copy, for the HIP kernel on AMD and NVIDIA.

One kernel source, two runtimes that map almost one-to-one (STYLE item 8):

    ============================  =====================================
    ``hip.py`` (hip-python)       ``cuda.py`` (cuda-bindings)
    ============================  =====================================
    hiprtcCompileProgram          nvrtcCompileProgram
    hipModuleLoadData             cuModuleLoadData
    hipModuleLaunchKernel         cuLaunchKernel
    (no opt-in on AMD)            cuFuncSetAttribute (dynamic shared > 48 KiB)
    (no TMA on AMD)               cuTensorMapEncodeTiled (the ws producer's maps)
    hipMalloc / hipMemcpy         cuMemAlloc / cuMemcpyHtoD / DtoH
    hipEventElapsedTime           cuEventElapsedTime
    ============================  =====================================

Everything the two have in common lives here, in :class:`Backend`: the compile cache
(in-process, then on disk, see ``_cache.py``), the kernel-argument packing
(:class:`KernelArgs`), allocation bookkeeping and bounds checks, launch-geometry checks and
event timing. A backend module only supplies the primitives (``_compile``, ``_load``,
``_launch``, ``_alloc``, ...), each a direct call of its runtime through its own ``_check``.

Selecting a backend::

    be = get_backend()            # "cuda", then "hip"; RuntimeError naming why each failed
    kern = be.compile(src, {"HEAD_DIM": 64}, "gqa_flash_prefill")
    be.launch(kern, grid, block, [(ctypes.c_void_p, q_ptr), (ctypes.c_int32, Sq), ...])

The argument list is declared once by the caller with explicit widths; pointers are
``c_void_p`` (0 for nullptr), integers ``c_int32``, floats ``c_float``, a TMA tensor map
:class:`TensorMap` (its 128 bytes, from ``Backend.tensor_map``; CUDA sm_90 only). Both backends
pass it as a ``void**`` array of pointers to the values, so there is no per-backend
translation.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import math
import numbers
import operator
import os
import re
import statistics
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field

from hipkernel.backends._cache import DiskCache, cache_key

BACKEND_NAMES = ("cuda", "hip")  # the order get_backend() tries them in
# Dynamic shared memory a CUDA kernel may take without cuFuncSetAttribute (AMD: its whole
# LDS, 64 KiB, with no opt-in)
DEFAULT_DYNAMIC_SHARED = 48 * 1024


# --------------------------------------------------------------------------- errors

class BackendError(RuntimeError):
    """A runtime or compiler call failed. ``call`` is the API function, ``code`` the numeric
    error, ``error_name`` the decoded name (e.g. ``CUDA_ERROR_INVALID_IMAGE``), ``log`` the
    whole compiler log for compile errors."""

    def __init__(self, backend: str, call: str, code: int, error_name: str, log: str = ""):
        self.backend, self.call, self.code, self.error_name, self.log = (
            backend, call, code, error_name, log)
        msg = f"{backend}: {call} failed: {error_name} ({code})"
        if log.strip():
            msg += "\n--- compiler log ---\n" + log.rstrip() + "\n--- end of log ---"
        super().__init__(msg)

    def __reduce__(self):  # picklable across processes (hipkernel.build's workers)
        return type(self), (self.backend, self.call, self.code, self.error_name, self.log)


class CompileError(BackendError):
    """Compilation failed; the message carries the full program log."""


class BackendUnavailable(RuntimeError):
    """The backend cannot run here (bindings not importable, no driver, no device)."""


def error_text(x) -> str:
    """Text out of whatever a binding returned for a string: ``bytes`` (cuda-bindings),
    ``CStr`` (hip-python), ``str``; NULs and trailing blanks stripped."""
    if isinstance(x, (bytes, bytearray)):
        x = bytes(x).decode("utf-8", "replace")
    return str(x).split("\0", 1)[0].rstrip()


def split_result(result) -> tuple:
    """``(err, values)`` from a binding's return: both bindings return ``(err, *values)``;
    some hip-python calls return a bare value."""
    if isinstance(result, tuple):
        if not result:
            raise TypeError("empty result tuple")
        return result[0], result[1:]
    return result, ()


def unwrap(values: tuple):
    """None, the single value, or the tuple of values."""
    return None if not values else values[0] if len(values) == 1 else values


# --------------------------------------------------------------------------- compile results

@dataclass
class CompileResult:
    """What a compiler gave for one source + defines + target.

    ``regs``: registers per thread (NVIDIA) or VGPRs (AMD); ``spills``: NVIDIA spill bytes
    (stores + loads) or AMD spilled registers (VGPR + SGPR); ``smem``: static shared memory /
    LDS bytes per block. ``details`` holds the rest per kernel (``sgprs``, ``stack``,
    ``scratch``, ``occupancy``, ...). Fields are None when the compiler did not report them
    (e.g. PTX, which ptxas has not seen).
    """

    log: str
    binary: bytes
    regs: int | None = None
    spills: int | None = None
    smem: int | None = None
    target: str = ""
    kind: str = ""  # "cubin" | "ptx" | "hsaco"
    details: dict = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        """Serialised for the disk cache: 4-byte length, JSON metadata, binary."""
        meta = asdict(self)
        meta.pop("binary")
        head = json.dumps(meta).encode()
        return struct.pack("<I", len(head)) + head + self.binary

    @classmethod
    def from_bytes(cls, blob: bytes) -> CompileResult:
        (n,) = struct.unpack_from("<I", blob)
        meta = json.loads(blob[4:4 + n].decode())
        return cls(binary=bytes(blob[4 + n:]), **meta)


def summarize_usage(per_kernel: dict[str, dict], kernel_name: str | None, *, regs: str,
                    smem: str, spill_keys: Sequence[str]):
    """``(regs, spills, smem, details)`` out of a parsed per-function resource report:
    registers and shared memory of ``kernel_name`` (of the function using the most
    registers when the name is absent), spills summed over every function in the module (a
    spill in a callee is still a spill). All None when nothing was reported."""
    entries = {k: v for k, v in per_kernel.items() if regs in v}
    if not entries:
        return None, None, None, {}
    u = entries.get(kernel_name) if kernel_name else None
    if u is None:
        u = max(entries.values(), key=lambda x: x[regs])
    spills = sum(v.get(k) or 0 for v in per_kernel.values() for k in spill_keys)
    return u.get(regs), spills, u.get(smem), dict(u)


_DEFINE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def define_flags(defines: dict) -> list[str]:
    """``-DNAME=VALUE`` flags in sorted order. ``True`` gives ``-DNAME=1``; ``None`` or
    ``False`` leave the macro undefined; values must be ints, finite floats or plain
    tokens (no spaces or quotes: they go to a compiler argv unquoted)."""
    flags = []
    for name in sorted(defines):
        value = defines[name]
        if not isinstance(name, str) or not _DEFINE_NAME.match(name):
            raise ValueError(f"defines: invalid macro name {name!r}")
        if value is None or value is False:
            continue
        if value is True:
            value = 1
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"defines: {name}={value!r} is not finite")
        text = str(value)
        if not text or re.search(r"[\s\"'\\]", text):
            raise ValueError(f"defines: {name}={value!r} is not a single token")
        flags.append(f"-D{name}={text}")
    return flags


# --------------------------------------------------------------------------- kernel arguments

_INT_TYPES = {ctypes.c_int8: 8, ctypes.c_int16: 16, ctypes.c_int32: 32, ctypes.c_int64: 64}
_UINT_TYPES = {ctypes.c_uint8: 8, ctypes.c_uint16: 16, ctypes.c_uint32: 32, ctypes.c_uint64: 64}
_FLOAT_TYPES = (ctypes.c_float, ctypes.c_double)


class TensorMap(ctypes.Structure):
    """A kernel argument holding a TMA tensor map (CUtensorMap, 128 opaque bytes), passed by
    value: the value of the ``(TensorMap, bytes)`` pair is what ``Backend.tensor_map``
    returns."""

    _fields_ = [("opaque", ctypes.c_uint64 * 16)]


TENSOR_MAP_BYTES = ctypes.sizeof(TensorMap)


def _pack(i: int, ctype, value):
    """One kernel argument as a ctypes object, with its declared width enforced (ctypes
    itself would silently wrap 2**31 to a negative c_int32)."""
    where = f"args[{i}]"
    if ctype is ctypes.c_void_p:
        addr = 0 if value is None else operator.index(value)
        if not 0 <= addr < 2 ** 64:
            raise ValueError(f"{where}: pointer {addr:#x} out of range")
        return ctypes.c_void_p(addr)
    if ctype in _INT_TYPES or ctype in _UINT_TYPES:
        if type(value) is not int and (isinstance(value, bool)
                                       or not isinstance(value, numbers.Integral)):
            raise TypeError(f"{where}: {ctype.__name__} needs an int, got {value!r}")
        v = int(value)
        if ctype in _INT_TYPES:
            bits = _INT_TYPES[ctype]
            lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        else:
            lo, hi = 0, 2 ** _UINT_TYPES[ctype] - 1
        if not lo <= v <= hi:
            raise ValueError(f"{where}: {v} does not fit {ctype.__name__}")
        return ctype(v)
    if ctype in _FLOAT_TYPES:
        if type(value) is not float and (isinstance(value, bool)
                                         or not isinstance(value, numbers.Real)):
            raise TypeError(f"{where}: {ctype.__name__} needs a real number, got {value!r}")
        return ctype(float(value))
    if ctype is TensorMap:
        if not isinstance(value, (bytes, bytearray)) or len(value) != TENSOR_MAP_BYTES:
            raise TypeError(f"{where}: TensorMap needs the {TENSOR_MAP_BYTES} bytes of an encoded "
                            f"map (Backend.tensor_map), got {value!r:.60}")
        return TensorMap.from_buffer_copy(value)
    raise TypeError(f"{where}: unsupported argument type {ctype!r} (use c_void_p, c_int32, "
                    f"c_uint32, c_int64, c_float, c_double, TensorMap)")


class KernelArgs:
    """A kernel's argument list, declared once as ``[(ctype, value), ...]``, packed into the
    ``void** kernelParams`` array that cuLaunchKernel and hipModuleLaunchKernel both take.
    ``address`` is that array's address (0 for no arguments); the object must stay alive
    until the launch call returns (both runtimes copy the values at launch)."""

    def __init__(self, args: Iterable[tuple]):
        self.values = []
        self.pairs: list[tuple] = []  # the declared (ctype, value) pairs, as given
        for i, item in enumerate(args):
            try:
                ctype, value = item
            except (TypeError, ValueError):
                raise TypeError(
                    f"args[{i}]: expected a (ctype, value) pair, got {item!r}") from None
            self.values.append(_pack(i, ctype, value))
            self.pairs.append((ctype, value))
        n = len(self.values)
        self._ptrs = (ctypes.c_void_p * max(n, 1))(*[ctypes.addressof(v) for v in self.values])
        self.address = ctypes.addressof(self._ptrs) if n else 0

    def set(self, i: int, value) -> None:
        """Replace argument ``i``'s value in place, checked against its declared type as at
        construction: the ``void**`` array keeps pointing at the same slot, so a launch
        prepared once (:meth:`Backend.prepare`) takes new buffers without repacking."""
        ctype = self.pairs[i][0]
        if ctype is ctypes.c_void_p and type(value) is int and 0 <= value < 2 ** 64:
            self.values[i].value = value  # the common case, a device address, without a new object
            self.pairs[i] = (ctype, value)
            return
        packed = _pack(i, ctype, value)
        if ctype is TensorMap:
            ctypes.memmove(ctypes.addressof(self.values[i]), ctypes.addressof(packed),
                           TENSOR_MAP_BYTES)
        else:
            self.values[i].value = packed.value
        self.pairs[i] = (ctype, value)

    def __len__(self) -> int:
        return len(self.values)

    def __iter__(self):
        """The declared ``(ctype, value)`` pairs, so a packed list can stand wherever the
        plain list is accepted."""
        return iter(self.pairs)


# --------------------------------------------------------------------------- device objects

class PreparedLaunch:
    """A kernel launch checked and packed once (``Backend.prepare``): calling it enqueues
    the kernel on ``stream`` (a runtime stream handle as an int, None for the backend's
    default stream) with one runtime call, no checks and no packing, which is what a
    per-call host cost of microseconds needs. ``args`` is the :class:`KernelArgs` it
    passes; ``args.set(i, value)`` changes argument ``i`` of every later launch."""

    __slots__ = ("backend", "kernel", "grid", "block", "shared_mem", "args", "_enqueue")

    def __init__(self, backend, kernel, grid, block, shared_mem: int, args: KernelArgs):
        self.backend, self.kernel, self.grid, self.block = backend, kernel, grid, block
        self.shared_mem, self.args = shared_mem, args
        self._enqueue = backend._launch

    def __call__(self, stream: int | None = None) -> None:
        self._enqueue(self.kernel.function, self.grid, self.block, self.shared_mem,
                      self.args.address, stream)


class DevicePtr(int):
    """A device allocation: an ``int`` (the device address) that remembers its size and its
    backend. ``ptr.free()`` releases it (same as ``backend.free(ptr)``)."""

    nbytes: int
    backend: Backend

    def __new__(cls, address: int, nbytes: int, backend: Backend):
        self = super().__new__(cls, address)
        self.nbytes = nbytes
        self.backend = backend
        return self

    def free(self) -> None:
        self.backend.free(self)

    def __repr__(self) -> str:
        return f"DevicePtr({int(self):#x}, nbytes={self.nbytes}, backend={self.backend.name})"


@dataclass
class Kernel:
    """A loaded kernel function. ``function`` is the runtime handle (CUfunction /
    hipFunction_t); ``info`` the compile result without its binary (registers, spills...)."""

    name: str
    function: object
    module: object
    key: str
    info: CompileResult
    from_disk: bool = False
    # dynamic shared memory a launch may pass without an opt-in first: CUDA's 48 KiB less
    # the function's static shared memory (compile() sets it), then what it was opted in to
    shared_mem_allowed: int = DEFAULT_DYNAMIC_SHARED


def median(xs: Iterable[float]) -> float:
    return float(statistics.median(list(xs)))


def _dims(name: str, dims) -> tuple[int, int, int]:
    if isinstance(dims, numbers.Integral):
        dims = (dims,)
    dims = tuple(dims)
    if not 1 <= len(dims) <= 3:
        raise ValueError(f"{name}: expected 1 to 3 dimensions, got {dims!r}")
    out = []
    for x in dims + (1,) * (3 - len(dims)):
        if isinstance(x, bool) or not isinstance(x, numbers.Integral) or not 1 <= x < 2 ** 31:
            raise ValueError(f"{name}: dimensions must be ints in [1, 2**31), got {dims!r}")
        out.append(int(x))
    return tuple(out)


def _host_array(name: str, arr, writable: bool):
    import numpy as np

    if not isinstance(arr, np.ndarray):
        raise TypeError(f"{name}: expected a numpy array, got {type(arr).__name__}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array (numpy.ascontiguousarray)")
    if writable and not arr.flags.writeable:
        raise ValueError(f"{name}: array is read-only")
    return arr


# --------------------------------------------------------------------------- the backend base

# A hold: one GPU thread spinning on the SM clock for a given number of cycles. Queued before
# timed work, it keeps the stream busy while the host enqueues that work, so that events
# around each call bracket device time only, however slow the host's launches are
# (refattn.timing does the same with torch.cuda._sleep). One source for NVRTC and hiprtc.
HOLD_SOURCE = """extern "C" __global__ void hk_hold(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {
    }
}
"""
HOLD_KERNEL = "hk_hold"
HOLD_CALIBRATION_CYCLES = 1_000_000  # about 0.5 ms at 2 GHz
HOLD_MAX_MS = 1000.0
HOLD_MARGIN = 1.5  # a hold outlasts the host's enqueueing of the timed calls this many times
HOLD_BASE_MS = 0.5  # and this much more


def hold_ms_for(host_ms: float, calls: int, cap_ms: float = HOLD_MAX_MS) -> float:
    """How long to hold the GPU before ``calls`` timed calls that take the host ``host_ms``
    each to enqueue, so that all of them are queued before the first runs: HOLD_MARGIN times
    their host time plus HOLD_BASE_MS, at most ``cap_ms``. The tuner's sweep
    (``api.tune_times_ms``) and the bench's torch timer (``refattn.timing``) size theirs so."""
    return min(cap_ms, HOLD_MARGIN * calls * host_ms + HOLD_BASE_MS)


class Backend:
    """Device-level API shared by the CUDA and HIP backends (see the module docstring).

    Subclasses set ``name``, ``arch``, ``device_name``, ``compiler_version`` in ``__init__``
    and implement the underscore primitives; all checking and caching is done here.
    """

    name: str = "?"
    arch: str = "?"
    device_name: str = "?"
    compiler_version: str = "?"

    def __init__(self, cache: DiskCache | None = None):
        self.disk_cache = cache if cache is not None else DiskCache()
        self._kernels: dict[tuple[str, str], Kernel] = {}
        self._loaded: dict[tuple, Kernel] = {}  # (source, defines, kernel name) -> kernel
        self._modules: dict[str, object] = {}
        self._results: dict[str, CompileResult] = {}
        self._live: dict[int, int] = {}  # device address -> nbytes
        self.compiles = 0  # compiler invocations (cache misses), for tests and logs
        self._hold_cycles_per_ms: float | None = None

    # ---- primitives a backend implements -------------------------------------------------
    def _compile(self, source: str, defines: dict, include_dirs: Sequence[str]) -> CompileResult:
        raise NotImplementedError

    def _compile_options(self, defines: dict, include_dirs: Sequence[str]) -> list[str]:
        """Every compiler option, for the cache key."""
        raise NotImplementedError

    def _load(self, binary: bytes) -> object:
        """Load a compiled binary as a module."""
        raise NotImplementedError

    def _get_function(self, module, kernel_name: str):
        raise NotImplementedError

    def _launch(self, function, grid, block, shared_mem: int, params_address: int,
                stream: int | None = None) -> None:
        """Enqueue ``function`` on ``stream`` (a runtime handle as an int; None: the
        backend's default stream)."""
        raise NotImplementedError

    def _tensor_map(self, address: int, dims, strides, box) -> bytes:
        """Encode a TMA tensor map of fp16 elements (``tensor_map``); only where TMA exists."""
        raise BackendError(self.name, "tensor_map", 0, "NOT_SUPPORTED",
                           "TMA tensor maps need an NVIDIA sm_90 device (the CUDA backend)")

    def _allow_dynamic_shared(self, function, nbytes: int, static: int) -> None:
        """Let ``function`` (``static`` bytes of static shared memory) launch with ``nbytes``
        of dynamic shared memory, more than it may take without an opt-in
        (``Kernel.shared_mem_allowed``); ValueError when a block of the device cannot have
        both."""
        raise NotImplementedError

    def _alloc(self, nbytes: int) -> int:
        raise NotImplementedError

    def _free(self, address: int) -> None:
        raise NotImplementedError

    def _htod(self, address: int, host_address: int, nbytes: int) -> None:
        raise NotImplementedError

    def _dtoh(self, host_address: int, address: int, nbytes: int) -> None:
        raise NotImplementedError

    def _memset(self, address: int, byte: int, nbytes: int) -> None:
        raise NotImplementedError

    def _synchronize(self) -> None:
        raise NotImplementedError

    def _event_create(self):
        raise NotImplementedError

    def _event_record(self, event) -> None:
        raise NotImplementedError

    def _event_elapsed_ms(self, start, end) -> float:
        raise NotImplementedError

    def _event_destroy(self, event) -> None:
        raise NotImplementedError

    # ---- compile + load --------------------------------------------------------------------
    def compile(self, source: str, defines: dict | None, kernel_name: str,
                include_dirs: Sequence[str | os.PathLike] = ()) -> Kernel:
        """Compile ``source`` with ``-D`` ``defines`` for this device and load
        ``kernel_name``. Cached in-process and on disk (key: source, headers, options,
        arch, backend, compiler version). Raises :class:`CompileError` with the full log."""
        defines = dict(defines or {})
        include_dirs = [str(d) for d in include_dirs]
        # A kernel loaded before from this source and these defines is found without its
        # cache key (options, headers, a sha256 of the source), which is most of a new
        # launch plan's host time. Not with include dirs: their headers can change between
        # calls, and the key's digest of them notices.
        memo = None
        if not include_dirs:
            try:
                memo = (source, tuple(sorted(defines.items())), kernel_name)
                hit = self._loaded.get(memo)
            except TypeError:  # a define value that cannot be hashed: the keyed path names it
                memo = hit = None
            if hit is not None:
                return hit
        options = self._compile_options(defines, include_dirs)
        key = cache_key(source=source, options=options, arch=self.arch, backend=self.name,
                        compiler_version=self.compiler_version, include_dirs=include_dirs)
        hit = self._kernels.get((key, kernel_name))
        if hit is not None:
            return hit
        from_disk = False
        module = self._modules.get(key)
        if module is None:
            result, from_disk = self._cached_compile(key, source, defines, include_dirs)
            try:
                module = self._load(result.binary)
            except BackendError:
                if not from_disk:
                    raise
                # A stored binary the driver rejects (say, a newer driver) is recompiled once.
                self.disk_cache.discard(key)
                result, from_disk = self._cached_compile(key, source, defines, include_dirs)
                module = self._load(result.binary)
            self._modules[key] = module
            self._results[key] = result
        result = self._results[key]
        info = CompileResult(**{**asdict(result), "binary": b""})
        # static and dynamic shared memory share CUDA's no-opt-in 48 KiB
        kern = Kernel(kernel_name, self._get_function(module, kernel_name), module, key, info,
                      from_disk, max(0, DEFAULT_DYNAMIC_SHARED - (info.smem or 0)))
        self._kernels[(key, kernel_name)] = kern
        if memo is not None:
            self._loaded[memo] = kern
        return kern

    def _cached_compile(self, key, source, defines, include_dirs) -> tuple[CompileResult, bool]:
        def build() -> bytes:
            self.compiles += 1
            return self._compile(source, defines, include_dirs).to_bytes()

        blob, hit = self.disk_cache.get_or_compile(key, build)
        try:
            return CompileResult.from_bytes(blob), hit
        except (ValueError, KeyError, TypeError, struct.error, UnicodeDecodeError):
            # An entry whose checksum matches but whose layout is not ours: recompile.
            self.disk_cache.discard(key)
            blob = build()
            self.disk_cache.store(key, blob)
            return CompileResult.from_bytes(blob), False

    # ---- memory ---------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> DevicePtr:
        nbytes = operator.index(nbytes)
        if nbytes < 0:
            raise ValueError(f"nbytes: expected >= 0, got {nbytes}")
        addr = self._alloc(max(nbytes, 1))
        self._live[addr] = nbytes
        return DevicePtr(addr, nbytes, self)

    def free(self, ptr) -> None:
        addr = int(ptr)
        if addr not in self._live:
            raise ValueError(f"free: {addr:#x} is not a live allocation of this backend")
        del self._live[addr]
        self._free(addr)

    def _span(self, what: str, ptr, nbytes: int) -> int:
        addr = int(ptr)
        if addr == 0:
            raise ValueError(f"{what}: null device pointer")
        size = self._live.get(addr)
        if size is not None and nbytes > size:
            raise ValueError(f"{what}: {nbytes} bytes do not fit the {size}-byte allocation")
        return addr

    def htod(self, ptr, arr) -> None:
        """Copy host array ``arr`` to device memory at ``ptr`` (synchronous)."""
        arr = _host_array("htod", arr, writable=False)
        addr = self._span("htod", ptr, arr.nbytes)
        if arr.nbytes:
            self._htod(addr, arr.ctypes.data, arr.nbytes)

    def dtoh(self, arr, ptr) -> None:
        """Copy device memory at ``ptr`` into host array ``arr`` (synchronous)."""
        arr = _host_array("dtoh", arr, writable=True)
        addr = self._span("dtoh", ptr, arr.nbytes)
        if arr.nbytes:
            self._dtoh(arr.ctypes.data, addr, arr.nbytes)

    def memset(self, ptr, byte: int, nbytes: int) -> None:
        if not 0 <= byte <= 255:
            raise ValueError(f"byte: expected 0..255, got {byte}")
        addr = self._span("memset", ptr, nbytes)
        if nbytes:
            self._memset(addr, byte, nbytes)

    # ---- launch + timing ------------------------------------------------------------------
    def prepare(self, kernel: Kernel, grid, block, args, shared_mem: int = 0) -> PreparedLaunch:
        """``kernel`` with its launch geometry and arguments checked and packed once: the
        returned :class:`PreparedLaunch` enqueues it with one runtime call. ``args``:
        ``[(ctype, value), ...]`` or a :class:`KernelArgs` (kept, not copied: its
        :meth:`KernelArgs.set` changes what later launches pass); ``shared_mem``: bytes of
        dynamic shared memory (when they and the kernel's static shared memory are over
        DEFAULT_DYNAMIC_SHARED, the kernel is opted in to them here, once)."""
        grid, block = _dims("grid", grid), _dims("block", block)
        if block[0] * block[1] * block[2] > 1024:
            raise ValueError(f"block: {block} has more than 1024 threads")
        if (isinstance(shared_mem, bool) or not isinstance(shared_mem, numbers.Integral)
                or shared_mem < 0):
            raise ValueError(f"shared_mem: expected an int >= 0 (bytes), got {shared_mem!r}")
        shared_mem = int(shared_mem)
        params = args if isinstance(args, KernelArgs) else KernelArgs(args)
        if shared_mem > kernel.shared_mem_allowed:
            self._allow_dynamic_shared(kernel.function, shared_mem, kernel.info.smem or 0)
            kernel.shared_mem_allowed = shared_mem
        return PreparedLaunch(self, kernel, grid, block, shared_mem, params)

    def launch(self, kernel: Kernel, grid, block, args, shared_mem: int = 0,
               stream: int | None = None) -> None:
        """Launch ``kernel`` (``prepare``, then one enqueue) on ``stream``: a runtime stream
        handle as an int (CUstream / hipStream_t), or None for the default stream.
        Asynchronous: errors from the kernel itself show at the next ``synchronize()``."""
        self.prepare(kernel, grid, block, args, shared_mem)(stream)

    def synchronize(self) -> None:
        self._synchronize()

    def tensor_map(self, ptr, dims: Sequence[int], strides: Sequence[int], box: Sequence[int]) -> bytes:
        """A TMA tensor map (the 128 bytes of a ``TensorMap`` kernel argument) of the fp16
        tensor at device pointer ``ptr``: ``dims`` its sizes in elements, the contiguous
        dimension first; ``strides`` the byte strides of dims 1.. (multiples of 16); ``box``
        the elements one copy moves a dimension, the first 64 (128 bytes: one row of the
        128-byte swizzle the map lays the box out in). Elements of a box outside ``dims``
        read as zeros. CUDA on sm_90 only (elsewhere a ``BackendError``)."""
        dims, strides, box = (tuple(operator.index(x) for x in seq) for seq in (dims, strides, box))
        if not 1 <= len(dims) <= 5 or len(strides) != len(dims) - 1 or len(box) != len(dims):
            raise ValueError(f"dims: {len(dims)} dims need {len(dims) - 1} strides and {len(dims)} "
                             f"box sizes, got {len(strides)} and {len(box)}")
        if any(not 1 <= n <= 2 ** 32 for n in dims):
            raise ValueError(f"dims: each in [1, 2^32], got {dims}")
        if any(s % 16 or not 0 < s < 2 ** 40 for s in strides):
            raise ValueError(f"strides: multiples of 16 bytes under 2^40, got {strides}")
        if box[0] != 64 or any(not 1 <= b <= 256 for b in box):
            raise ValueError(f"box: 64 elements first (a 128-byte swizzle row), each in [1, 256], got {box}")
        addr = operator.index(ptr)
        if addr % 16:
            raise ValueError(f"ptr: {addr:#x} is not 16-byte aligned")
        blob = self._tensor_map(addr, dims, strides, box)
        if len(blob) != TENSOR_MAP_BYTES:
            raise BackendError(self.name, "tensor_map", 0, "BAD_SIZE", f"{len(blob)} bytes")
        return blob

    def hold(self, ms: float) -> None:
        """Queue a GPU spin of about ``ms`` milliseconds on the default stream (see
        HOLD_SOURCE); the clock rate is measured with events at the first call."""
        if not 0 <= ms <= HOLD_MAX_MS:
            raise ValueError(f"ms: expected a hold in [0, {HOLD_MAX_MS}] ms, got {ms!r}")
        kern = self.compile(HOLD_SOURCE, None, HOLD_KERNEL)
        spin = lambda cycles: self.launch(kern, 1, 1, [(ctypes.c_int64, int(cycles))])  # noqa: E731
        if self._hold_cycles_per_ms is None:
            t = statistics.median(self.time_ms(lambda: spin(HOLD_CALIBRATION_CYCLES), warmup=1, reps=3))
            if not t > 0:
                raise BackendError(self.name, "hold", 0, "CALIBRATION",
                                   f"a {HOLD_CALIBRATION_CYCLES}-cycle spin timed {t!r} ms")
            self._hold_cycles_per_ms = HOLD_CALIBRATION_CYCLES / t
        spin(ms * self._hold_cycles_per_ms)

    def time_ms(self, fn: Callable[[], None], warmup: int = 3, reps: int = 10,
                hold_ms: float = 0.0) -> list[float]:
        """Device time of ``fn()`` (which launches work on the default stream), measured
        with a pair of events around each of ``reps`` calls after ``warmup`` calls. Returns
        the per-call times in ms; take ``median()`` of them. ``hold_ms`` > 0 queues a
        :meth:`hold` that long before the first timed call: sized to outlast the host's
        enqueueing of all ``reps`` calls, it keeps host launch time out of the events."""
        for _ in range(warmup):
            fn()
        if hold_ms > 0:
            self.hold(hold_ms)
        events = []
        try:
            for _ in range(reps):
                start, end = self._event_create(), self._event_create()
                events.append((start, end))
                self._event_record(start)
                fn()
                self._event_record(end)
            self._synchronize()
            return [self._event_elapsed_ms(s, e) for s, e in events]
        finally:
            for pair in events:
                for ev in pair:
                    self._event_destroy(ev)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.device_name} ({self.arch})>"


# --------------------------------------------------------------------------- selection

_INSTANCES: dict[str, tuple[Backend | None, str]] = {}


DEVICE_ENV = "HIPKERNEL_DEVICE"


def device_from_environment(environ=None) -> int:
    """``$HIPKERNEL_DEVICE`` as a device index (default 0); EnvVarError naming it otherwise."""
    from refattn.args import EnvVarError

    raw = (os.environ if environ is None else environ).get(DEVICE_ENV, "").strip() or "0"
    try:
        device = int(raw)
    except ValueError:
        device = -1
    if device < 0:
        raise EnvVarError(f"{DEVICE_ENV}: expected a device index >= 0, got {raw!r}")
    return device


def _check_name(name: str) -> None:
    if name not in BACKEND_NAMES:
        raise ValueError(f"backend: unknown backend {name!r} (have {', '.join(BACKEND_NAMES)})")


def _try(name: str, refresh: bool = False) -> tuple[Backend | None, str]:
    _check_name(name)
    if refresh or name not in _INSTANCES:
        try:
            be = importlib.import_module(f"hipkernel.backends.{name}").create()
            _INSTANCES[name] = (be, f"{be.device_name} ({be.arch})")
        except Exception as e:  # noqa: BLE001 - every failure is a reason to report
            _INSTANCES[name] = (None, f"{type(e).__name__}: {e}")
    return _INSTANCES[name]


def available_backends(refresh: bool = False) -> list[tuple[str, Backend | None, str]]:
    """Each backend as ``(name, backend or None, reason)``: the device it runs on, or why it
    cannot run here (import error, no driver, no device, driver error). Results are kept
    for the process; ``refresh=True`` tries again."""
    return [(name, *_try(name, refresh)) for name in BACKEND_NAMES]


def get_backend(name: str | None = None) -> Backend:
    """The named backend, or the first that works ("cuda", then "hip"; ``$HIPKERNEL_BACKEND``
    picks one). Raises RuntimeError naming every backend tried and why it failed."""
    name = name or os.environ.get("HIPKERNEL_BACKEND") or None
    names = (name,) if name else BACKEND_NAMES
    failures = []
    for n in names:
        be, reason = _try(n)
        if be is not None:
            return be
        failures.append(f"  {n}: {reason}")
    raise RuntimeError("no GPU backend available; tried:\n" + "\n".join(failures))
