"""A C entry point with the ``_v3`` ABI as a kernel adapter, called through ctypes.

The entry point (docs/c-abi.md has the full contract)::

    int f(const void *q, const void *k, const void *v, const void *sink, void *out,
          int B, int Sq, int Hq, int Hkv, int d, int S_cap, int past_len, int window,
          int sink_mode, float scale [, extra trailing arguments]);

returns 0 when it computed ``out`` and -1 when it declines (nothing written). The adapter is
named by one of two specs:

* ``cabi:/path/to/libfoo.so:symbol``: fp16 elements, host memory, no extra arguments;
* ``cabi:/path/to/foo.toml``: a small TOML file beside the library (:data:`TOML_KEYS`):
  ``library`` (relative to the TOML) and ``symbol``, or ``callable`` (``module:attr``, a
  ctypes function pointer a Python module exposes); ``dtype`` ``"fp16"`` | ``"fp32"``;
  ``memory`` ``"host"`` | ``"device"``; ``extra_args``; ``name``; ``device_runtime``.

The entry point's -1 is the source of truth for what it supports: ``supports(case)`` calls it
once per distinct argument list (everything the call carries; not the seed, which only
changes the data) on scratch buffers (zeros in, canaries out) and records whether it
declined. ``run(inputs)`` always calls it on the real inputs, so the runner judges what the
library does, not what the probe saw. What the ABI cannot carry (a softcap; bf16 or fp32
inputs for an fp16 library) the adapter declines itself, without a call, and says so.

Host memory: the library gets the addresses of private C-contiguous NumPy copies of the
inputs (checked afterwards: a library that writes its ``const`` inputs is an error) and of an
output buffer holding the canary bytes. Device memory: buffers come from a device runtime, an
object with ``alloc(nbytes)``, ``free(ptr)``, ``htod(ptr, ndarray)``, ``dtoh(ndarray, ptr)``,
``memset(ptr, byte, n)`` and ``synchronize()`` (the interface of the project's GPU backends),
named by the TOML's ``device_runtime`` or, when it has none, by the ``default`` entry of the
entry-point group :data:`RUNTIME_GROUP`. The canary output is uploaded, the call made,
the device synchronised and the output read back whatever the status, so a decline that
writes is seen byte for byte.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import math
import numbers
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from refattn.cases import OUT_CANARY_BITS, Case, Inputs
from refattn.kernels import SOURCE_ROOT, KernelError, _import_module, _import_target

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

SINK_MODES = {"none": 0, "per_head": 1, "smooth": 2}  # case.sink -> the ABI's sink_mode
DTYPES = {"fp16": np.float16, "fp32": np.float32}  # the TOML's dtype -> q/k/v/sink/out elements
MEMORIES = ("host", "device")
TOML_KEYS = ("library", "symbol", "callable", "dtype", "memory", "extra_args", "name",
             "device_runtime")
EXTRA_TYPES = {"int": ctypes.c_int, "int64": ctypes.c_int64, "uint32": ctypes.c_uint32,
               "uint64": ctypes.c_uint64, "float": ctypes.c_float, "double": ctypes.c_double,
               "pointer": ctypes.c_void_p}
ABI_ARGTYPES = (ctypes.c_void_p,) * 5 + (ctypes.c_int,) * 9 + (ctypes.c_float,)
INT_ARGS = ("B", "Sq", "Hq", "Hkv", "d", "S_cap", "past_len", "window", "sink_mode")
FP32_CANARY_BITS = 0x7FC07E5A  # an fp32 quiet NaN carrying the fp16 canary's payload
RUNTIME_GROUP = "refattn.device_runtimes"  # entry point "default": the runtime of device memory
RUNTIME_METHODS = ("alloc", "free", "htod", "dtoh", "memset", "synchronize")
DECLINED_BY_ENTRY_POINT = "the entry point returned -1 for this geometry"
_INT32 = (-(2**31), 2**31 - 1)


# --------------------------------------------------------------------------- the spec

@dataclass(frozen=True)
class CabiSpec:
    """What a ``cabi`` spec names: where the entry point is and how it is called."""

    spec: str  # the variant as given: "path:symbol" or the TOML's path
    library: Path | None  # the shared library (None for a callable)
    symbol: str | None
    callable: str | None  # "module:attr" of a ctypes function pointer
    dtype: str = "fp16"
    memory: str = "host"
    extra_args: tuple[tuple[str, object], ...] = ()  # (type name, value) after scale
    name: str | None = None
    device_runtime: str | None = None  # "module:function"; None: the registered default
    toml: Path | None = None


def _bad(where: str, msg: str) -> KernelError:
    return KernelError(f"kernel: {where}: {msg}")


def _check_target(where: str, value) -> str:
    if not isinstance(value, str) or value.count(":") < 1 or not all(value.split(":", 1)):
        raise _bad(where, f"expected an import path \"module:attr\", got {value!r}")
    return value


def _extra_args(where: str, raw) -> tuple[tuple[str, object], ...]:
    if not isinstance(raw, list):
        raise _bad(where, f"expected an array of tables {{type = ..., value = ...}}, got {raw!r}")
    out = []
    for i, item in enumerate(raw):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise _bad(at, f"expected a table {{type = ..., value = ...}}, got {item!r}")
        unknown = sorted(set(item) - {"type", "value"})
        if unknown:
            raise _bad(f"{at}.{unknown[0]}", "unknown key (known: type, value)")
        if "type" not in item or "value" not in item:
            raise _bad(at, "needs both type and value")
        kind, value = item["type"], item["value"]
        if kind not in EXTRA_TYPES:
            raise _bad(f"{at}.type", f"expected one of {', '.join(EXTRA_TYPES)}, got {kind!r}")
        if kind in ("float", "double"):
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise _bad(f"{at}.value", f"a {kind} needs a number, got {value!r}")
            value = float(value)
        else:
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise _bad(f"{at}.value", f"an {kind} needs an integer, got {value!r}")
            bits = {"int": 32, "int64": 64, "uint32": 32, "uint64": 64, "pointer": 64}[kind]
            lo, hi = ((0, 2**bits - 1) if kind in ("uint32", "uint64", "pointer")
                      else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1))
            if not lo <= value <= hi:
                raise _bad(f"{at}.value", f"{value} does not fit a {kind}")
            value = int(value)
        out.append((kind, value))
    return tuple(out)


def _load_toml(path: Path, spec: str) -> CabiSpec:
    where = str(path)
    if not path.is_file():
        raise _bad(where, "no such file")
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise _bad(where, f"cannot read: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise _bad(where, f"not valid TOML: {e}") from None
    for key in doc:
        if key not in TOML_KEYS:
            raise _bad(f"{where}: {key}", f"unknown key (known: {', '.join(TOML_KEYS)})")
    for key in ("library", "symbol", "callable", "dtype", "memory", "name", "device_runtime"):
        if key in doc and (not isinstance(doc[key], str) or not doc[key].strip()):
            raise _bad(f"{where}: {key}", f"expected a non-empty string, got {doc[key]!r}")
    library = symbol = target = None
    if "callable" in doc:
        for key in ("library", "symbol"):
            if key in doc:
                raise _bad(f"{where}: {key}", "give either library and symbol, or callable")
        target = _check_target(f"{where}: callable", doc["callable"])
    else:
        for key in ("library", "symbol"):
            if key not in doc:
                raise _bad(f"{where}: {key}", "required key is missing (or give callable)")
        library = (path.parent / doc["library"]).resolve()
        symbol = doc["symbol"]
    dtype = doc.get("dtype", "fp16")
    if dtype not in DTYPES:
        raise _bad(f"{where}: dtype", f"expected one of {', '.join(map(repr, DTYPES))}, "
                                      f"got {dtype!r}")
    memory = doc.get("memory", "host")
    if memory not in MEMORIES:
        raise _bad(f"{where}: memory", f"expected one of {', '.join(map(repr, MEMORIES))}, "
                                       f"got {memory!r}")
    runtime = doc.get("device_runtime")
    if runtime is not None:
        if memory != "device":
            raise _bad(f"{where}: device_runtime", 'only memory = "device" uses a device runtime')
        runtime = _check_target(f"{where}: device_runtime", runtime)
    extra = _extra_args(f"{where}: extra_args", doc.get("extra_args", []))
    return CabiSpec(spec=spec, library=library, symbol=symbol, callable=target, dtype=dtype,
                    memory=memory, extra_args=extra, name=doc.get("name"),
                    device_runtime=runtime, toml=path.resolve())


def parse_spec(variant: str | None) -> CabiSpec:
    """The :class:`CabiSpec` of a ``cabi`` variant: ``/path/to/lib.so:symbol`` or
    ``/path/to/spec.toml``. :class:`KernelError` naming the bad part otherwise."""
    if not isinstance(variant, str) or not variant.strip():
        raise KernelError("kernel: cabi: expected a library and symbol, "
                          "cabi:/path/to/libfoo.so:symbol, or a spec file, "
                          f"cabi:/path/to/libfoo.toml; got {variant!r}")
    variant = variant.strip()
    if variant.endswith(".toml"):
        return _load_toml(Path(variant).expanduser(), variant)
    path, colon, symbol = variant.rpartition(":")
    if not colon or not path or not symbol or "/" in symbol:
        raise KernelError(f"kernel: cabi: expected /path/to/libfoo.so:symbol or "
                          f"/path/to/libfoo.toml, got {variant!r}")
    return CabiSpec(spec=variant, library=Path(path).expanduser().resolve(), symbol=symbol,
                    callable=None)


def spec_requires_gpu(variant: str | None) -> bool:
    """Whether the adapter a ``cabi`` variant builds needs a GPU (device memory), read from
    the spec alone: no library is loaded. False for a spec that does not parse."""
    try:
        return parse_spec(variant).memory == "device"
    except KernelError:
        return False


def _tree_runtime_entry() -> str | None:
    """The ``default`` entry of :data:`RUNTIME_GROUP` in the source tree's pyproject.toml."""
    path = SOURCE_ROOT / "pyproject.toml"
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    eps = doc.get("project", {}).get("entry-points", {}).get(RUNTIME_GROUP, {})
    value = eps.get("default") if isinstance(eps, dict) else None
    return value if isinstance(value, str) else None


def default_device_runtime() -> str | None:
    """The import path of the device runtime used when a spec names none: the ``default``
    entry point of :data:`RUNTIME_GROUP` (installed, else the source tree's), or None."""
    try:
        for ep in importlib.metadata.entry_points(group=RUNTIME_GROUP):
            if ep.name == "default":
                return ep.value
    except Exception:  # noqa: BLE001 - broken metadata: fall back to the source tree
        pass
    return _tree_runtime_entry()


# --------------------------------------------------------------------------- helpers

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _canary(shape, dtype) -> np.ndarray:
    if np.dtype(dtype) == np.float16:
        return np.full(shape, OUT_CANARY_BITS, dtype=np.uint16).view(np.float16)
    return np.full(shape, FP32_CANARY_BITS, dtype=np.uint32).view(np.float32)


@dataclass(frozen=True)
class _Probe:
    status: int
    touched: bool  # the scratch output changed


# --------------------------------------------------------------------------- the adapter

class CabiKernel:
    """A ``_v3`` C entry point (module docstring; docs/c-abi.md). ``variant`` is the spec
    (``path:symbol`` or a TOML path); the adapter has no mutants.

    ``requires_gpu`` is False on the class (the registry reads it before any spec is known)
    and, on an instance, True exactly when its spec uses device memory;
    :func:`spec_requires_gpu` (also ``CabiKernel.variant_requires_gpu``) answers it from the
    spec alone."""

    requires_gpu = False
    peer = False
    needs_variant = True  # named with its library or spec only: never the default kernel
    variant_requires_gpu = staticmethod(spec_requires_gpu)  # the registry's per-variant answer

    def __init__(self, variant: str | None = None, mutants=frozenset()):
        if mutants:
            raise KernelError("kernel: cabi has no mutants: a library's bugs are compiled in "
                              "(build a faulty library and name it instead)")
        self.spec = spec = parse_spec(variant)
        self.dtype = DTYPES[spec.dtype]
        self.requires_gpu = spec.memory == "device"
        self._keep = None  # what must stay alive while the function pointer is used
        self._module = None  # the module of a callable
        self._fn = self._resolve(spec)
        self._runtime_obj = None
        self._probes: dict[tuple, _Probe] = {}
        if spec.name:
            self.name = spec.name
        elif spec.library is not None:
            self.name = f"cabi:{spec.library.name}:{spec.symbol}"
        else:
            self.name = f"cabi:{spec.callable}"

    # ---- resolution ------------------------------------------------------------------------
    def _prototype(self):
        extra = tuple(EXTRA_TYPES[kind] for kind, _ in self.spec.extra_args)
        return ctypes.CFUNCTYPE(ctypes.c_int, *ABI_ARGTYPES, *extra)

    def _resolve(self, spec: CabiSpec):
        proto = self._prototype()
        if spec.callable is not None:
            module_name, _, attr = spec.callable.partition(":")
            try:
                self._module = _import_module(module_name)
                obj = self._module
                for part in attr.split("."):
                    obj = getattr(obj, part)
            except Exception as e:  # noqa: BLE001 - any import failure names the key
                raise _bad("callable", f"cannot import {spec.callable}: "
                                       f"{type(e).__name__}: {e}") from e
            if isinstance(obj, ctypes._CFuncPtr):
                address = ctypes.cast(obj, ctypes.c_void_p).value
            elif isinstance(obj, numbers.Integral) and not isinstance(obj, bool):
                address = int(obj)
            else:
                raise _bad("callable", f"{spec.callable} is a {type(obj).__name__}, expected "
                                       f"a ctypes function pointer (ctypes.CFUNCTYPE) or an "
                                       f"address")
            if not address:
                raise _bad("callable", f"{spec.callable} is a NULL function pointer")
            self._keep = obj
            return proto(address)
        if not spec.library.is_file():
            raise _bad("library", f"no file {spec.library}")
        try:
            lib = ctypes.CDLL(str(spec.library))
        except OSError as e:
            raise _bad("library", f"cannot load {spec.library}: {e}") from None
        try:
            fn = getattr(lib, spec.symbol)
        except AttributeError:
            raise _bad("symbol", f"{spec.library} has no symbol {spec.symbol!r}") from None
        self._keep = lib
        return proto(ctypes.cast(fn, ctypes.c_void_p).value)

    def _runtime(self):
        """The device runtime object (device memory only), resolved at the first use."""
        if self._runtime_obj is None:
            target = self.spec.device_runtime or default_device_runtime()
            if target is None:
                raise _bad("device_runtime", f'memory = "device" needs device_runtime = '
                                             f'"module:function" in {self.spec.spec}, or a '
                                             f'"default" entry point in the group '
                                             f'{RUNTIME_GROUP} (docs/c-abi.md)')
            try:
                factory = _import_target(target)
                rt = factory()
            except Exception as e:  # noqa: BLE001
                raise _bad("device_runtime", f"{target}: {type(e).__name__}: {e}") from e
            missing = [m for m in RUNTIME_METHODS if not callable(getattr(rt, m, None))]
            if missing:
                raise _bad("device_runtime", f"{target}() gave {type(rt).__name__}, which has "
                                             f"no {', '.join(missing)}")
            self._runtime_obj = rt
        return self._runtime_obj

    # ---- the call --------------------------------------------------------------------------
    def _adapter_decline(self, case: Case) -> str | None:
        """Why the adapter declines ``case`` without calling: what the ABI cannot carry."""
        if case.softcap:
            return "the C ABI carries no softcap"
        if self.spec.dtype == "fp16" and case.dtype != "fp16":
            return (f"the library takes fp16 elements; the case's {case.dtype} inputs are not "
                    f"fp16 values")
        for name, x in zip(INT_ARGS, self._ints(case)):
            if not _INT32[0] <= x <= _INT32[1]:
                return f"{name} = {x} does not fit the ABI's int"
        return None

    @staticmethod
    def _ints(case: Case) -> tuple[int, ...]:
        return (case.B, case.sq, case.Hq, case.Hkv, case.d, case.s_cap, case.past_len,
                case.window, SINK_MODES[case.sink])

    @staticmethod
    def _scale(case: Case) -> float:
        return float(case.scale) if case.scale is not None else 1.0 / math.sqrt(case.d)

    def _geometry(self, case: Case) -> tuple:
        """Everything the call carries for ``case``: the key of the probe cache."""
        return self._ints(case) + (self._scale(case),)

    def _call(self, ptrs, geom: tuple) -> int:
        extra = [value for _, value in self.spec.extra_args]
        ptrs = [ctypes.c_void_p(int(p)) if p else None for p in ptrs]
        return int(self._fn(*ptrs, *geom[:9], ctypes.c_float(geom[9]), *extra))

    def _shapes(self, geom: tuple):
        B, Sq, Hq, Hkv, d, S_cap = geom[:6]
        return (B, Sq, Hq, d), (B, Hkv, S_cap, d), (Hq,)

    def _host_call(self, geom, q, k, v, sink, out) -> int:
        ptrs = [a.ctypes.data if a is not None else 0 for a in (q, k, v, sink, out)]
        return self._call(ptrs, geom)

    def _device_call(self, geom, q, k, v, sink, out, *, zeros: bool) -> int:
        """Upload (or, with ``zeros``, zero-fill) q, k, v and the sink and upload the canary
        ``out``; call; synchronise; read ``out`` back in place, whatever the status."""
        rt = self._runtime()
        bufs = []
        try:
            ptrs = []
            for a in (q, k, v, sink, out):
                if a is None:
                    ptrs.append(0)
                    continue
                ptr = rt.alloc(a.nbytes)
                bufs.append(ptr)
                if zeros and a is not out:
                    rt.memset(ptr, 0, a.nbytes)
                else:
                    rt.htod(ptr, a)
                ptrs.append(ptr)
            status = self._call(ptrs, geom)
            rt.synchronize()
            rt.dtoh(out, ptrs[4])
            return status
        finally:
            for ptr in bufs:
                rt.free(ptr)

    def _probe(self, case: Case) -> _Probe:
        geom = self._geometry(case)
        hit = self._probes.get(geom)
        if hit is not None:
            return hit
        qs, kvs, ss = self._shapes(geom)
        sink = np.zeros(ss, self.dtype) if geom[8] == 1 else None
        out = _canary(qs, self.dtype)
        fresh = out.tobytes()
        if self.spec.memory == "device":
            status = self._device_call(geom, np.zeros(qs, self.dtype), np.zeros(kvs, self.dtype),
                                       np.zeros(kvs, self.dtype), sink, out, zeros=True)
        else:
            status = self._host_call(geom, np.zeros(qs, self.dtype), np.zeros(kvs, self.dtype),
                                     np.zeros(kvs, self.dtype), sink, out)
        probe = _Probe(status=status, touched=out.tobytes() != fresh)
        self._probes[geom] = probe
        return probe

    # ---- the adapter protocol ----------------------------------------------------------------
    def available(self) -> tuple[bool, str]:
        where = (f"{self.spec.library}:{self.spec.symbol}" if self.spec.library is not None
                 else f"python:{self.spec.callable}")
        if self.spec.memory == "device":
            try:
                rt = self._runtime()
            except KernelError as e:
                return False, str(e)
            return True, f"{where}, {self.spec.dtype}, device memory ({type(rt).__name__})"
        return True, f"{where}, {self.spec.dtype}, host memory"

    def supports(self, case: Case) -> bool:
        """What the entry point said of this geometry when called on scratch buffers: False
        when it returned -1 (or the ABI cannot carry the case), True otherwise."""
        if self._adapter_decline(case) is not None:
            return False
        return self._probe(case).status != -1

    def unsupported_reason(self, case: Case) -> str | None:
        why = self._adapter_decline(case)
        if why is not None:
            return why
        probe = self._probe(case)
        if probe.status != -1:
            return None
        if probe.touched:
            return f"{DECLINED_BY_ENTRY_POINT}, and wrote its output buffer"
        return DECLINED_BY_ENTRY_POINT

    def run(self, inputs: Inputs):
        case = inputs.case
        if self._adapter_decline(case) is not None:
            return -1, inputs.out
        geom = self._geometry(case)
        sink_mode = geom[8]
        q, k, v = (np.array(a, dtype=self.dtype, order="C", copy=True)
                   for a in (inputs.q, inputs.k, inputs.v))
        sink = (np.array(inputs.sink, dtype=self.dtype, order="C", copy=True)
                if sink_mode == 1 else None)
        if self.dtype == np.float16:
            out = np.array(inputs.out, dtype=np.float16, order="C", copy=True)
        else:
            out = _canary(inputs.q.shape, self.dtype)
        fresh = out.tobytes()
        if self.spec.memory == "device":
            status = self._device_call(geom, q, k, v, sink, out, zeros=False)
        else:
            status = self._host_call(geom, q, k, v, sink, out)
            for name, mine, given in (("q", q, inputs.q), ("k", k, inputs.k), ("v", v, inputs.v),
                                      ("sink", sink, inputs.sink)):
                if mine is not None and mine.tobytes() != given.astype(self.dtype).tobytes():
                    raise RuntimeError(f"the entry point wrote its input {name}, which the ABI "
                                       f"passes as const")
        touched = out.tobytes() != fresh
        if status == 0 and self.dtype == np.float32:
            return 0, out
        if touched:  # what the library wrote is what the runner must see
            inputs.out[...] = out if self.dtype == np.float16 else out.astype(np.float16)
        elif status == -1 and self._probe(case).status == -1 and self._probe(case).touched:
            raise RuntimeError(f"{DECLINED_BY_ENTRY_POINT} and wrote its output buffer when "
                               f"called on scratch inputs; on the case's inputs it left it "
                               f"untouched")
        return status, inputs.out

    def facts(self) -> dict:
        s = self.spec
        facts = {"dtype": s.dtype, "memory": s.memory,
                 "extra_args": [f"{kind}={value}" for kind, value in s.extra_args]}
        if s.toml is not None:
            facts["spec"] = str(s.toml)
        if s.library is not None:
            facts.update(library=str(s.library), symbol=s.symbol,
                         library_bytes=s.library.stat().st_size,
                         library_sha256=_sha256(s.library))
        else:
            facts["callable"] = s.callable
            path = getattr(self._module, "__file__", None)
            if path:
                facts.update(callable_module=str(path), callable_module_sha256=_sha256(Path(path)))
        if s.memory == "device":
            facts["device_runtime"] = s.device_runtime or default_device_runtime() or ""
            name = getattr(self._runtime_obj, "device_name", None)  # once the runtime is up
            if name:
                facts["device"] = str(name)
        return facts

    def source_hash(self) -> str:
        """The library's sha256 (first 16 hex digits), so a rebuilt library makes earlier
        records stale. For a callable: the sha256 of its module's file and, when the module
        has a ``source_hash()`` function, of what that returns."""
        s = self.spec
        if s.library is not None:
            return _sha256(s.library)[:16]
        h = hashlib.sha256()
        path = getattr(self._module, "__file__", None)
        if path:
            h.update(Path(path).read_bytes())
        own = getattr(self._module, "source_hash", None)
        if callable(own):
            h.update(b"\0" + str(own()).encode())
        return h.hexdigest()[:16]


__all__ = ["CabiKernel", "CabiSpec", "DECLINED_BY_ENTRY_POINT", "default_device_runtime",
           "parse_spec", "spec_requires_gpu"]
