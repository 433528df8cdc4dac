"""Kernel adapters: the one seam between the harness and any kernel under test.

An adapter wraps a kernel behind three members (docs/ARCHITECTURE.md, "Kernel adapters"):

    name: str
    supports(case) -> bool                       the contract it declares
    run(inputs) -> (status, out)                 0 and the output, or -1 when it declines

and optionally ``available() -> (bool, reason)`` (can it run here at all? default: yes) and a
class attribute ``requires_gpu = True`` (pytest marks its cases ``gpu``). ``run`` gets a
:class:`refattn.cases.Inputs`; it writes into ``inputs.out`` and returns it, or returns its
own array (the reference does, to keep fp32). On a decline it must not touch ``inputs.out``.

Adapters are found by name in the entry-point group ``refattn.kernels``; running from a source
tree without installation, the built-ins below stand in for the entry points. A name may carry
a variant after a colon (``hipkernel:cuda``), passed to the factory as ``variant=``. Any class
can also be named by import path, ``package.module:Class`` (or ``package.module:Class:variant``),
which is how tests plug in deliberately broken kernels without registering them.

refattn never imports hipkernel by name at module level: every factory is imported lazily,
from a string, and one that fails to import is listed with the reason rather than breaking
the registry.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

GROUP = "refattn.kernels"

# name -> (target, requires_gpu): what the pyproject entry points say, for uninstalled trees.
BUILTINS = {
    "reference": ("refattn.kernels:ReferenceKernel", False),
    "model": ("hipkernel.adapter:ModelKernel", False),
    "hipkernel": ("hipkernel.adapter:HipKernel", True),
}


class KernelError(ValueError):
    """An unknown kernel name, or a kernel that cannot be loaded here. Message starts with ``kernel:``."""


@runtime_checkable
class KernelAdapter(Protocol):
    name: str

    def supports(self, case) -> bool: ...

    def run(self, inputs) -> tuple[int, np.ndarray]: ...


class ReferenceKernel:
    """The refattn reference as a kernel: supports every case and computes it in fp32 (or in
    fp64 with variant ``fp64``). It returns its own array, so no precision is lost to the fp16
    output buffer. Running it through the matrix checks the harness itself."""

    requires_gpu = False

    def __init__(self, variant: str | None = None, mutants=frozenset()):
        if variant not in (None, "fp32", "fp64"):
            raise KernelError(f"kernel: unknown reference variant {variant!r} (have fp32, fp64)")
        if mutants:
            raise KernelError("kernel: the reference has no mutants")
        self.dtype = np.float64 if variant == "fp64" else np.float32
        self.name = "reference" + (f":{variant}" if variant else "")

    def available(self) -> tuple[bool, str]:
        return True, f"NumPy {np.dtype(self.dtype).name} reference"

    def supports(self, case) -> bool:
        return True

    def run(self, inputs) -> tuple[int, np.ndarray]:
        from refattn.reference import attention

        k, v = inputs.clean_kv()
        return 0, attention(inputs.q, k, v, dtype=self.dtype, **inputs.reference_kwargs())


# --------------------------------------------------------------------------- registry

def _import_target(target: str):
    module, _, attr = target.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass
class KernelEntry:
    """A registered kernel: calling it builds an adapter (``entry(variant=...)``)."""

    name: str
    target: str  # "module:attr"
    origin: str  # "entry point" | "built-in" | "import path"
    factory: object | None = None
    error: str | None = None  # why it could not be imported
    gpu_hint: bool = False

    @property
    def importable(self) -> bool:
        return self.factory is not None

    @property
    def requires_gpu(self) -> bool:
        """Whether its cases are ``gpu`` tests: the factory's ``requires_gpu`` attribute, else
        the registry's hint (so a GPU kernel that fails to import is still marked)."""
        if self.factory is not None and hasattr(self.factory, "requires_gpu"):
            return bool(self.factory.requires_gpu)
        return self.gpu_hint

    def load(self) -> "KernelEntry":
        if self.factory is None and self.error is None:
            try:
                self.factory = _import_target(self.target)
            except Exception as e:  # noqa: BLE001 - any import failure is reported, not raised
                self.error = f"cannot import {self.target}: {type(e).__name__}: {e}"
        return self

    def __call__(self, variant: str | None = None, **kw):
        self.load()
        if self.factory is None:
            raise KernelError(f"kernel: {self.name!r} is unavailable: {self.error}")
        return self.factory(variant=variant, **kw) if variant is not None else self.factory(**kw)


def _registry() -> dict[str, KernelEntry]:
    entries: dict[str, KernelEntry] = {}
    try:
        eps = importlib.metadata.entry_points(group=GROUP)
    except Exception:  # noqa: BLE001 - broken metadata must not hide the built-ins
        eps = ()
    for ep in eps:
        hint = BUILTINS.get(ep.name, (None, False))[1]
        entries[ep.name] = KernelEntry(ep.name, ep.value, "entry point", gpu_hint=hint)
    for name, (target, gpu) in BUILTINS.items():
        entries.setdefault(name, KernelEntry(name, target, "built-in", gpu_hint=gpu))
    return entries


def available_kernels(load: bool = True) -> dict[str, KernelEntry]:
    """Every registered kernel by name. With ``load`` each factory is imported; one that fails
    stays listed, with ``entry.error`` saying why."""
    entries = _registry()
    if load:
        for e in entries.values():
            e.load()
    return entries


def split_config(spec: str) -> tuple[str, str | None]:
    """``"hipkernel:hip@wmma_m4_b64"`` -> ``("hipkernel:hip", "wmma_m4_b64")``: a kernel name
    and the tile config it is forced to (``@CONFIG``), or None. An ``@`` with nothing after
    it is a :class:`KernelError`."""
    base, at, config = spec.partition("@")
    if at and not config.strip():
        raise KernelError(f"kernel: expected a config name after '@' in {spec!r}")
    return base, (config.strip() if at else None)


def parse_kernel_name(spec: str) -> tuple[KernelEntry, str | None]:
    """Resolve ``name``, ``name:variant``, ``module:Class`` or ``module:Class:variant``, each
    optionally forced to a config with ``@CONFIG`` (:func:`split_config`; ignored here)."""
    if not isinstance(spec, str) or not spec.strip():
        raise KernelError(f"kernel: expected a kernel name, got {spec!r}")
    spec = split_config(spec.strip())[0]
    entries = _registry()
    base, _, variant = spec.partition(":")
    if base in entries:
        return entries[base], (variant or None)
    if ":" in spec and base.replace(".", "").replace("_", "").isalnum():
        module, _, rest = spec.partition(":")
        attr, _, variant = rest.partition(":")
        if attr:
            target = f"{module}:{attr}"
            return KernelEntry(target, target, "import path"), (variant or None)
    known = ", ".join(sorted(entries))
    raise KernelError(f"kernel: unknown kernel {spec!r}; known: {known} "
                      f"(or an import path, package.module:Class)")


def get_kernel(spec: str, **kw):
    """Build the adapter named by ``spec`` (see :func:`parse_kernel_name`). Extra keywords go
    to the factory (``mutants=...``); ``@CONFIG`` goes as ``config=CONFIG``, which only the
    fused kernel's adapters (``model``, ``hipkernel``) take. Raises :class:`KernelError`
    when the name is unknown or the kernel cannot be imported or built."""
    entry, variant = parse_kernel_name(spec)
    config = split_config(spec.strip())[1]
    if config is not None:
        kw = {**kw, "config": config}
    try:
        adapter = entry(variant=variant, **kw)
    except KernelError:
        raise
    except TypeError as e:
        if config is not None and "config" in str(e):
            raise KernelError(f"kernel: {entry.name!r} takes no @CONFIG (got {spec!r})") from e
        raise KernelError(f"kernel: cannot build {spec!r}: {type(e).__name__}: {e}") from e
    except Exception as e:  # noqa: BLE001 - e.g. a ValueError for an unknown variant
        msg = str(e)
        raise KernelError(msg if msg.startswith("kernel:") else
                          f"kernel: cannot build {spec!r}: {type(e).__name__}: {msg}") from e
    for member in ("supports", "run"):
        if not callable(getattr(adapter, member, None)):
            raise KernelError(f"kernel: {spec!r} is not a kernel adapter (no {member}() method)")
    if not isinstance(getattr(adapter, "name", None), str):
        try:
            adapter.name = spec
        except AttributeError:
            pass
    return adapter


def kernel_available(adapter) -> tuple[bool, str]:
    """``adapter.available()`` normalised to ``(bool, reason)``; True when it has none."""
    fn = getattr(adapter, "available", None)
    if fn is None:
        return True, ""
    try:
        r = fn()
    except Exception as e:  # noqa: BLE001 - a probe that crashes means "not available"
        return False, f"available() raised {type(e).__name__}: {e}"
    if isinstance(r, tuple):
        ok, reason = (bool(r[0]), str(r[1]) if len(r) > 1 else "")
    else:
        ok, reason = bool(r), ""
    return ok, reason


def best_kernel() -> str:
    """``"hipkernel"`` when it imports and reports itself available (a working GPU backend),
    else ``"model"``, the CPU model of the same algorithm."""
    try:
        ok, _ = kernel_available(get_kernel("hipkernel"))
    except KernelError:
        ok = False
    return "hipkernel" if ok else "model"
