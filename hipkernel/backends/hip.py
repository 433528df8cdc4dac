"""AMD backend: hiprtc compiles the HIP source, hip-python loads, launches and copies.

The mirror of ``cuda.py``, call for call (``hiprtc*`` <-> ``nvrtc*``, ``hip*`` <-> ``cu*``).
Every binding call returns ``(err, *values)`` and goes through :func:`_check`, which raises
with the decoded error name (``hipGetErrorName`` / ``hiprtcGetErrorString``) and, for a
failed compile, the whole program log.

``compile_offline`` needs only hiprtc, no GPU: CI compiles the kernel for gfx90a/gfx1030 and
reads VGPRs, SGPRs, spills and LDS from the code object's AMDGPU metadata note (hiprtc's
log carries no resource report).

hip-python version (pin: ``hip-python==10.0.0.0.1.2``, also in ``.ci/install-amd.sh``).
hip-python dlopens the ROCm libraries at the first call, so its version need not match the
ROCm it runs on for the C API we use. Checked on Debian 12 with ROCm 5.2.3
(``libamdhip64.so.5``, which also exports hiprtc): 6.2.0.499.16, 7.2.2.562.43 and
10.0.0.0.1.2 all compile for gfx90a/gfx1030 there, but only 10.x (the ``rocm-bindings``
packaging) finds the library through ``$ROCM_PATH``; earlier releases dlopen the bare name
``libhiprtc.so`` and need ``LD_LIBRARY_PATH``, which must be set before Python starts.
Hence the pin, and :func:`_ensure_rocm_path` below, which points ``ROCM_PATH`` at a shim
directory (``lib/libhiprtc.so`` and ``lib/libamdhip64.so``, both links to
``libamdhip64.so.5``) when nothing else is configured. API differences between
the releases that matter here: ``hipGetDeviceProperties(dev)`` (10.x) vs
``hipGetDeviceProperties(props, dev)`` (6.x), and ``hiprtcGetErrorString`` returning
``(result, text)`` vs ``(text,)``; both are handled. hip-python 10 binds the ROCm 6 symbol
``hipGetDevicePropertiesR0600``, so a *GPU* on ROCm 5 needs hip-python 6.x (with
``LD_LIBRARY_PATH``); compiling, the CI use, works with 10.x.

ROCm 5.2's comgr crashes (abort, not an error) compiling for gfx11xx: ``compile_offline``
refuses those targets on a ROCm older than 6 instead; clang-19 covers them in
``hipkernel.build``.
"""

from __future__ import annotations

import glob
import os
import re
import struct
from collections.abc import Sequence

from hipkernel.backends import (Backend, BackendError, BackendUnavailable, CompileError,
                                CompileResult, define_flags, device_from_environment,
                                error_text, split_result, summarize_usage, unwrap)
from hipkernel.backends._cache import default_dir

NAME = "hip"
BASE_OPTIONS = ("-O3", "-std=c++17")
SPILL_KEYS = ("vgpr_spill", "sgpr_spill")  # registers spilled, from the metadata note
_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


def _ensure_rocm_path() -> str | None:
    """Point ``$ROCM_PATH`` at a directory whose ``lib/`` has ``libhiprtc.so`` and
    ``libamdhip64.so``, unless ROCm is configured or installed the standard way.

    Order: ``$ROCM_PATH``/``$ROCM_HOME`` as set; /opt/rocm; ``$HIPKERNEL_ROCM_SHIM`` or
    /opt/rocm-shim (made by ``.ci/install-amd.sh``); else, when a distribution's
    ``libamdhip64.so.N`` exists (Debian's ROCm 5.2), a private shim under the hipkernel cache
    directory whose links point at the distribution's libhiprtc, or at libamdhip64 itself,
    which exports hiprtc in ROCm 5.x. Returns the directory used, or None.
    """
    for var in ("ROCM_PATH", "ROCM_HOME"):
        if os.environ.get(var):
            return os.environ[var]
    if os.path.exists("/opt/rocm/lib/libamdhip64.so"):
        return None  # hip-python's default search finds it
    for shim in (os.environ.get("HIPKERNEL_ROCM_SHIM"), "/opt/rocm-shim"):
        if shim and os.path.exists(os.path.join(shim, "lib", "libhiprtc.so")):
            os.environ["ROCM_PATH"] = shim
            return shim

    def find(pattern: str) -> str | None:
        for d in _LIB_DIRS:
            hits = sorted(glob.glob(os.path.join(d, pattern)))
            if hits:
                return hits[-1]
        return None

    amdhip = find("libamdhip64.so.[0-9]")
    if amdhip is None:
        return None
    hiprtc_lib = find("libhiprtc.so.[0-9]") or amdhip
    shim = default_dir() / "rocm-shim"
    try:
        (shim / "lib").mkdir(parents=True, exist_ok=True)
        for link, target in (("libhiprtc.so", hiprtc_lib), ("libamdhip64.so", amdhip)):
            p = shim / "lib" / link
            if not p.is_symlink() or os.readlink(p) != target:
                tmp = p.with_name(f".{link}.{os.getpid()}")
                if tmp.is_symlink() or tmp.exists():
                    tmp.unlink()
                os.symlink(target, tmp)
                os.replace(tmp, p)
    except OSError:
        return None
    os.environ["ROCM_PATH"] = str(shim)
    return str(shim)


_ensure_rocm_path()  # before hip-python is imported: it reads ROCM_PATH at first call

try:
    from hip import hip, hiprtc
    IMPORT_ERROR = None
except ImportError as _e:
    hip = hiprtc = None
    IMPORT_ERROR = _e


# --------------------------------------------------------------------------- errors

def _error_name(err) -> str:
    """``hipError...`` / ``HIPRTC_ERROR_...`` for an error code, asking the library first
    and falling back on the enum's own name."""
    try:
        if type(err).__name__ == "hiprtcResult":
            status, text = split_result(hiprtc.hiprtcGetErrorString(err))
        else:
            status, text = split_result(hip.hipGetErrorName(err))
        # (result, text) in hip-python >= 10, (text,) before
        text = error_text(text[0]) if text else error_text(status)
        if text and not text.startswith("Invalid"):
            return text
    except Exception:  # noqa: BLE001 - decoding must never hide the original error
        pass
    return getattr(err, "name", None) or str(err)


def _check(result, call: str = "?", log: str = ""):
    """Raise :class:`BackendError` (a :class:`CompileError` for hiprtc compile failures,
    carrying ``log``) unless ``result[0]`` is success; return the remaining values."""
    err, values = split_result(result)
    if int(err) != 0:  # hipSuccess and HIPRTC_SUCCESS are both 0
        cls = CompileError if call.startswith("hiprtc") and log else BackendError
        raise cls(NAME, call, int(err), _error_name(err), log)
    return unwrap(values)


def _call(fn, *args):
    return _check(fn(*args), getattr(fn, "__name__", "?"))


def _require_hiprtc() -> None:
    if hiprtc is None:
        raise BackendUnavailable(f"hip-python is not importable ({IMPORT_ERROR}); "
                                 f"pip install hip-python==10.0.0.0.1.2")


# --------------------------------------------------------------------------- code objects

def _msgpack(buf: bytes, i: int = 0):
    """Decode one MessagePack value at ``buf[i:]``: ``(value, next_index)``. Enough of the
    format for AMDGPU code-object metadata (maps, arrays, strings, ints, bools, floats)."""
    b = buf[i]
    i += 1
    if b <= 0x7F:
        return b, i
    if b >= 0xE0:
        return b - 0x100, i
    if 0x80 <= b <= 0x8F or b in (0xDE, 0xDF):
        if b <= 0x8F:
            n = b & 0x0F
        else:
            fmt = ">H" if b == 0xDE else ">I"
            (n,) = struct.unpack_from(fmt, buf, i)
            i += struct.calcsize(fmt)
        out = {}
        for _ in range(n):
            k, i = _msgpack(buf, i)
            v, i = _msgpack(buf, i)
            out[k] = v
        return out, i
    if 0x90 <= b <= 0x9F or b in (0xDC, 0xDD):
        if b <= 0x9F:
            n = b & 0x0F
        else:
            fmt = ">H" if b == 0xDC else ">I"
            (n,) = struct.unpack_from(fmt, buf, i)
            i += struct.calcsize(fmt)
        out = []
        for _ in range(n):
            v, i = _msgpack(buf, i)
            out.append(v)
        return out, i
    if 0xA0 <= b <= 0xBF or b in (0xD9, 0xDA, 0xDB, 0xC4, 0xC5, 0xC6):
        if b <= 0xBF:
            n = b & 0x1F
        else:
            fmt = {0xD9: ">B", 0xDA: ">H", 0xDB: ">I", 0xC4: ">B", 0xC5: ">H", 0xC6: ">I"}[b]
            (n,) = struct.unpack_from(fmt, buf, i)
            i += struct.calcsize(fmt)
        raw = bytes(buf[i:i + n])
        return (raw if b in (0xC4, 0xC5, 0xC6) else raw.decode("utf-8", "replace")), i + n
    fixed = {0xCA: ">f", 0xCB: ">d", 0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q",
             0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q"}
    if b in fixed:
        (v,) = struct.unpack_from(fixed[b], buf, i)
        return v, i + struct.calcsize(fixed[b])
    if b in (0xC0, 0xC2, 0xC3):
        return {0xC0: None, 0xC2: False, 0xC3: True}[b], i
    raise ValueError(f"msgpack: unsupported type byte {b:#x} at {i - 1}")


_BUNDLE_MAGIC = b"__CLANG_OFFLOAD_BUNDLE__"
NT_AMDGPU_METADATA = 32


def _elf_from_bundle(blob: bytes) -> bytes:
    """The first AMDGPU code object inside a clang offload bundle (or ``blob`` itself)."""
    if not blob.startswith(_BUNDLE_MAGIC):
        return blob
    i = len(_BUNDLE_MAGIC)
    (n,) = struct.unpack_from("<Q", blob, i)
    i += 8
    for _ in range(n):
        off, size, idlen = struct.unpack_from("<QQQ", blob, i)
        i += 24
        ident = blob[i:i + idlen].decode("ascii", "replace")
        i += idlen
        if "amdgcn" in ident and size:
            return blob[off:off + size]
    raise ValueError("offload bundle has no amdgcn code object")


def amdgpu_metadata(binary: bytes) -> dict:
    """The AMDGPU metadata map (``amdhsa.kernels`` etc.) of a code object (ELF64, or a
    clang offload bundle holding one), decoded from its ``NT_AMDGPU_METADATA`` note."""
    elf = _elf_from_bundle(bytes(binary))
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise ValueError("not a little-endian ELF64 code object")
    (shoff,) = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    for s in range(shnum):
        sh_type, = struct.unpack_from("<I", elf, shoff + s * shentsize + 4)
        if sh_type != 7:  # SHT_NOTE
            continue
        off, size = struct.unpack_from("<QQ", elf, shoff + s * shentsize + 0x18)
        i, end = off, off + size
        while i + 12 <= end:
            namesz, descsz, ntype = struct.unpack_from("<III", elf, i)
            i += 12
            owner = elf[i:i + namesz].rstrip(b"\0")
            i += (namesz + 3) & ~3
            desc = elf[i:i + descsz]
            i += (descsz + 3) & ~3
            if owner == b"AMDGPU" and ntype == NT_AMDGPU_METADATA:
                return _msgpack(desc)[0]
    raise ValueError("code object has no AMDGPU metadata note")


def code_object_usage(binary: bytes) -> dict[str, dict]:
    """Per kernel: ``vgprs``, ``sgprs``, ``agprs``, ``vgpr_spill``, ``sgpr_spill``, ``lds``
    (LDS bytes, including arrays the compiler promoted there), ``scratch`` (private bytes per
    lane), ``wavefront_size``, ``dynamic_stack``, from the code object's metadata."""
    names = {".vgpr_count": "vgprs", ".sgpr_count": "sgprs", ".agpr_count": "agprs",
             ".vgpr_spill_count": "vgpr_spill", ".sgpr_spill_count": "sgpr_spill",
             ".group_segment_fixed_size": "lds", ".private_segment_fixed_size": "scratch",
             ".wavefront_size": "wavefront_size", ".uses_dynamic_stack": "dynamic_stack"}
    meta = amdgpu_metadata(binary)
    unified = re.search(r"gfx9(0a|4\d|5\d)", str(meta.get("amdhsa.target", ""))) is not None
    out = {}
    for k in meta.get("amdhsa.kernels", []):
        u = {v: k[m] for m, v in names.items() if m in k}
        if unified and "vgprs" in u and u.get("agprs"):
            # gfx90a/gfx94x count VGPRs and AGPRs in one file; report them apart, as clang's
            # remarks do (the total keeps the metadata's number).
            u["vgprs_total"] = u["vgprs"]
            u["vgprs"] -= u["agprs"]
        out[k.get(".name", "?")] = u
    return out


# --------------------------------------------------------------------------- compile (no GPU)

def compile_options(defines: dict, arch: str, include_dirs: Sequence[str] = ()) -> list[str]:
    """hiprtc options. ``arch`` may carry target features (``gfx90a:sramecc+:xnack-``, as
    ``gcnArchName`` reports it); hiprtc accepts them."""
    return [f"--offload-arch={arch}", *BASE_OPTIONS, *define_flags(defines),
            *[f"-I{d}" for d in include_dirs]]


def runtime_version() -> int:
    """HIP's version number, e.g. 50221153 for ROCm 5.2 (major * 10**7 + minor * 10**5)."""
    _require_hiprtc()
    return int(_call(hip.hipRuntimeGetVersion))


def hiprtc_version() -> str:
    _require_hiprtc()
    major, minor = _call(hiprtc.hiprtcVersion)
    return f"hiprtc {major}.{minor} hip {runtime_version()}"


def _program_log(prog) -> str:
    size = _call(hiprtc.hiprtcGetProgramLogSize, prog)
    if not size:
        return ""
    buf = bytearray(size)
    _call(hiprtc.hiprtcGetProgramLog, prog, buf)
    return error_text(buf)


def compile_offline(source: str, defines: dict, arch: str, include_dirs: Sequence[str] = (),
                    kernel_name: str | None = None, name: str = "kernel.hip") -> CompileResult:
    """Compile ``source`` with hiprtc for ``arch`` (``gfx90a``, ``gfx1030``, ...) into a code
    object. Needs no GPU. Raises :class:`CompileError` with the whole log on failure."""
    _require_hiprtc()
    base = arch.split(":")[0]
    if base.startswith(("gfx11", "gfx12")) and runtime_version() < 60_000_000:
        raise BackendUnavailable(f"hiprtc of HIP {runtime_version()} (ROCm < 6) aborts on "
                                 f"{base}; compile it with clang (python -m hipkernel.build)")
    options = [o.encode() for o in compile_options(defines, arch, include_dirs)]
    prog = _call(hiprtc.hiprtcCreateProgram, source.encode(), name.encode(), 0, [], [])
    try:
        (err,) = hiprtc.hiprtcCompileProgram(prog, len(options), options)
        log = _program_log(prog)
        _check((err,), "hiprtcCompileProgram", log=log or "(empty log)")
        size = _call(hiprtc.hiprtcGetCodeSize, prog)
        binary = bytearray(size)
        _call(hiprtc.hiprtcGetCode, prog, binary)
    finally:
        hiprtc.hiprtcDestroyProgram(prog.createRef())  # takes hiprtcProgram*: pass a ref
    try:
        usage = code_object_usage(bytes(binary))
    except (ValueError, struct.error, IndexError):
        usage = {}
    regs, spills, smem, details = summarize_usage(usage, kernel_name, regs="vgprs", smem="lds",
                                                  spill_keys=SPILL_KEYS)
    return CompileResult(log=log, binary=bytes(binary), regs=regs, spills=spills, smem=smem,
                         target=arch, kind="hsaco", details=details)


# --------------------------------------------------------------------------- the device

def _device_properties(device: int):
    try:
        return _call(hip.hipGetDeviceProperties, device)  # hip-python >= 10
    except TypeError:
        props = hip.hipDeviceProp_t()  # hip-python 6.x: (props, device)
        _call(hip.hipGetDeviceProperties, props, device)
        return props


class HipBackend(Backend):
    """One HIP device, null stream."""

    name = NAME

    def __init__(self, device: int = 0, cache=None):
        super().__init__(cache)
        if hip is None:
            raise BackendUnavailable(f"hip-python is not importable ({IMPORT_ERROR})")
        try:
            _call(hip.hipInit, 0)
            count = _call(hip.hipGetDeviceCount)
        except BackendError as e:
            raise BackendUnavailable(f"{e.call} failed: {e.error_name}") from e
        except Exception as e:  # noqa: BLE001 - e.g. libamdhip64 is not installed
            raise BackendUnavailable(f"HIP runtime not loadable: {type(e).__name__}: {e}") from e
        if count < 1:
            raise BackendUnavailable("no HIP device")
        if not 0 <= device < count:
            raise BackendUnavailable(f"device {device} requested, {count} present")
        self._device = device
        _call(hip.hipSetDevice, device)
        try:
            props = _device_properties(device)
        except BackendError:
            raise
        except Exception as e:  # noqa: BLE001 - hip-python 10 binds the ROCm 6 symbol
            raise BackendUnavailable(  # hipGetDevicePropertiesR0600, absent from ROCm 5
                f"hipGetDeviceProperties unavailable ({e}); with ROCm 5 use hip-python 6.x "
                f"and LD_LIBRARY_PATH=$ROCM_PATH/lib") from e
        self.device_name = error_text(props.name)
        self.target = error_text(props.gcnArchName)  # e.g. "gfx90a:sramecc+:xnack-"
        self.arch = self.target.split(":")[0]
        self.sm_count = int(props.multiProcessorCount)
        self.shared_per_block = int(props.sharedMemPerBlock)
        self._stream = None  # the null stream
        self.compiler_version = hiprtc_version()

    def _bind(self) -> None:
        _call(hip.hipSetDevice, self._device)

    # ---- compile + load
    def _compile_options(self, defines, include_dirs):
        return compile_options(defines, self.target, include_dirs)

    def _compile(self, source, defines, include_dirs):
        return compile_offline(source, defines, self.target, include_dirs)

    def _load(self, binary):
        self._bind()
        return _call(hip.hipModuleLoadData, binary)

    def _get_function(self, module, kernel_name):
        return _call(hip.hipModuleGetFunction, module, kernel_name.encode())

    def _launch(self, function, grid, block, shared_mem, params_address, stream=None):
        self._bind()
        _call(hip.hipModuleLaunchKernel, function, *grid, *block, shared_mem,
              self._stream if stream is None else hip.hipStream_t.fromObj(stream),
              params_address, None)

    def _allow_dynamic_shared(self, function, nbytes, static):
        # AMD has no opt-in: a workgroup may take LDS up to the device's limit
        if nbytes + static > self.shared_per_block:
            raise ValueError(f"shared_mem: {nbytes} bytes of dynamic shared memory, over the "
                             f"{self.shared_per_block - static} a block of {self.device_name} "
                             f"may have next to its {static} static")

    # ---- memory
    def _alloc(self, nbytes):
        self._bind()
        return int(_call(hip.hipMalloc, nbytes))

    def _free(self, address):
        _call(hip.hipFree, address)

    def _htod(self, address, host_address, nbytes):
        _call(hip.hipMemcpy, address, host_address, nbytes,
              hip.hipMemcpyKind.hipMemcpyHostToDevice)

    def _dtoh(self, host_address, address, nbytes):
        _call(hip.hipMemcpy, host_address, address, nbytes,
              hip.hipMemcpyKind.hipMemcpyDeviceToHost)

    def _memset(self, address, byte, nbytes):
        _call(hip.hipMemset, address, byte, nbytes)

    def _synchronize(self):
        self._bind()
        _call(hip.hipDeviceSynchronize)

    # ---- events
    def _event_create(self):
        return _call(hip.hipEventCreate)

    def _event_record(self, event):
        _call(hip.hipEventRecord, event, self._stream)

    def _event_elapsed_ms(self, start, end):
        _call(hip.hipEventSynchronize, end)
        return float(_call(hip.hipEventElapsedTime, start, end))

    def _event_destroy(self, event):
        _call(hip.hipEventDestroy, event)


def create(device: int | None = None) -> HipBackend:
    """The backend on ``device`` (default ``$HIPKERNEL_DEVICE`` or 0)."""
    if device is None:
        device = device_from_environment()
    return HipBackend(device)
