"""Kernel adapters: the one seam between the harness and any kernel under test.

An adapter wraps a kernel behind three required members (docs/adapters.md):

    name: str
    supports(case) -> bool                       the contract it declares
    run(inputs) -> (status, out)                 0 and the output, or -1 when it declines

and optional ones, each of which unlocks a check (:data:`OPTIONAL`):

    available() -> (bool, reason)                can it run here at all? (default: yes)
    requires_gpu = True                          pytest marks its cases ``gpu`` (a class
                                                 attribute; a static variant_requires_gpu(v)
                                                 answers per variant where variants differ)
    prepare(inputs) -> callable                  a device-resident launch, for ``refattn bench``
    synchronize()                                wait for what ``prepare``'s callable enqueued
    variants(case) -> [name, ...]                code paths to force one by one (``name@VARIANT``)
    mutants = frozenset({...})                   catalogue mutants it implements (class attribute;
                                                 the factory takes ``mutants=`` to switch them on)
    source_hash() -> str                         what records are stamped with
    unsupported_reason(case) -> str | None       why it declines a case, shown beside it
    tile_sizes() -> {"q": [...], "kv": [...]}  its query-row and key tile sizes (callable on
                                                 the class), the coverage axes' reference
    facts() -> {str: str | number | bool | list} what the run JSON records of it: versions,
                                                 providers, the device it ran on
    peer = True                                  an implementation others ship, compared against
                                                 (never the default kernel of ``refattn run``)
    needs_variant = True                         it is named only as ``name:variant`` (a library
                                                 path, a spec file): never the default either
    ragged = True                                it takes ragged batches (``inputs.past_len`` and
                                                 ``inputs.q_len`` arrays); without it the runner
                                                 never gives it a ragged case

``run`` gets a :class:`refattn.cases.Inputs`; it writes into ``inputs.out`` and returns it,
or returns its own array (the reference does, to keep fp32). On a decline it must not touch
``inputs.out``.

Adapters are found by name in the entry-point group ``refattn.kernels``. Running from a
source tree that is not installed, the entry points declared in that tree's
``pyproject.toml`` stand in for the installed ones. A name may carry a variant after a colon
(``name:variant``), passed to the factory as ``variant=``, and a forced code path after an
``@`` (``name@VARIANT``), passed as ``config=``. Any class can also be named by import path,
``package.module:Class`` (or ``package.module:Class:variant``), which is how a user's own
kernel and the tests' deliberately broken kernels plug in without being registered.

refattn imports no kernel package by name: every factory is imported lazily, from the
string its entry point gives, and one that fails to import is listed with the reason rather
than breaking the registry.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

GROUP = "refattn.kernels"
SOURCE_ROOT = Path(__file__).resolve().parent.parent  # the tree refattn was imported from

# The optional members of an adapter and the check each one unlocks (docs/adapters.md).
OPTIONAL = {
    "available": "every command: a kernel that cannot run here is refused with its reason",
    "requires_gpu": "pytest marks its cases gpu; --gpus N shards them over GPUs",
    "prepare": "refattn bench: a device-resident launch to time",
    "synchronize": "refattn bench: the end of a timed launch",
    "variants": "refattn determinism and refattn sanitize: each code path forced in turn",
    "mutants": "refattn mutants: the kill matrix",
    "source_hash": "records and reports: a result is tied to the source it ran",
    "unsupported_reason": "refattn run: each declined case carries the kernel's reason",
    "facts": "refattn run: the run JSON records the versions and devices it names",
    "tile_sizes": "refattn cases --coverage --tiles-of: the Sq and skv axes against its tiles",
    "peer": "refattn run picks it only when named: it is a peer to compare against",
    "needs_variant": "refattn run picks it only when named with its variant (a library, a spec)",
    "ragged": "refattn run: ragged cases (per-sequence lengths) run on it instead of being declined",
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

def _import_module(module: str):
    """``module`` imported by name, or loaded from a file when it ends in ``.py``. A module
    not found on ``sys.path`` is looked for in the working directory too, as ``python -m``
    would find it: ``refattn run --kernel mykernels:K`` works from the directory holding
    ``mykernels.py`` or a ``mykernels`` package."""
    if module.endswith(".py"):
        path = Path(module).resolve()
        if not path.is_file():
            raise ModuleNotFoundError(f"no file {module}")
        name = f"_refattn_adapter_{path.stem}_{abs(hash(str(path))):x}"
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            del sys.modules[name]
            raise
        return mod
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        cwd = str(Path.cwd())
        if e.name != module.split(".")[0] or cwd in sys.path:
            raise
        sys.path.insert(0, cwd)
        try:
            return importlib.import_module(module)
        except ModuleNotFoundError:
            sys.path.remove(cwd)
            raise e from None


def _import_target(target: str):
    module, _, attr = target.partition(":")
    obj = _import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass
class KernelEntry:
    """A registered kernel: calling it builds an adapter (``entry(variant=...)``)."""

    name: str
    target: str  # "module:attr"
    origin: str  # "entry point" | "source tree" | "built-in" | "import path"
    factory: object | None = None
    error: str | None = None  # why it could not be imported

    @property
    def importable(self) -> bool:
        return self.factory is not None

    @property
    def requires_gpu(self) -> bool:
        """Whether its cases are ``gpu`` tests: the factory's ``requires_gpu`` attribute (False
        when it has none or cannot be imported)."""
        return bool(getattr(self.factory, "requires_gpu", False))

    def requires_gpu_for(self, variant: str | None) -> bool:
        """:attr:`requires_gpu` of one variant: a factory whose variants differ (a C entry
        point on host or on device memory) answers through its static
        ``variant_requires_gpu(variant)``; any other falls back to the class attribute."""
        fn = getattr(self.factory, "variant_requires_gpu", None)
        if variant is not None and callable(fn):
            try:
                return bool(fn(variant))
            except Exception:  # noqa: BLE001 - a bad spec is reported when the kernel is built
                return self.requires_gpu
        return self.requires_gpu

    @property
    def peer(self) -> bool:
        """Whether it is a peer (an implementation others ship): never the default kernel."""
        return bool(getattr(self.factory, "peer", False))

    @property
    def mutants(self) -> frozenset[str]:
        """The catalogue mutants the factory declares it implements (:func:`declared_mutants`)."""
        return declared_mutants(self.factory)

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


def _tree_entry_points() -> dict[str, str]:
    """``name -> "module:attr"`` of the ``refattn.kernels`` entry points declared in the
    ``pyproject.toml`` of the source tree refattn was imported from, or {} when refattn is
    installed (no such file beside the package) or the file cannot be read."""
    path = SOURCE_ROOT / "pyproject.toml"
    if not path.is_file() or not (SOURCE_ROOT / "refattn" / "kernels.py").is_file():
        return {}
    try:
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover - python 3.10
            import tomli as tomllib
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    eps = doc.get("project", {}).get("entry-points", {}).get(GROUP, {})
    return {str(k): str(v) for k, v in eps.items() if isinstance(v, str)} if isinstance(eps, dict) else {}


def _registry() -> dict[str, KernelEntry]:
    entries: dict[str, KernelEntry] = {}
    try:
        eps = importlib.metadata.entry_points(group=GROUP)
    except Exception:  # noqa: BLE001 - broken metadata must not hide the source tree's kernels
        eps = ()
    for ep in eps:
        entries[ep.name] = KernelEntry(ep.name, ep.value, "entry point")
    for name, target in _tree_entry_points().items():
        entries.setdefault(name, KernelEntry(name, target, "source tree"))
    entries.setdefault("reference", KernelEntry("reference", "refattn.kernels:ReferenceKernel", "built-in"))
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
    """Resolve ``name``, ``name:variant``, ``module:Class`` or ``module:Class:variant`` (the
    module a dotted name, or a file ``path/to/file.py``), each optionally forced to a config
    with ``@CONFIG`` (:func:`split_config`; ignored here)."""
    if not isinstance(spec, str) or not spec.strip():
        raise KernelError(f"kernel: expected a kernel name, got {spec!r}")
    spec = split_config(spec.strip())[0]
    entries = _registry()
    base, _, variant = spec.partition(":")
    if base in entries:
        return entries[base], (variant or None)
    if ":" in spec and (base.endswith(".py") or base.replace(".", "").replace("_", "").isalnum()):
        module, _, rest = spec.partition(":")
        attr, _, variant = rest.partition(":")
        if attr:
            target = f"{module}:{attr}"
            return KernelEntry(target, target, "import path"), (variant or None)
    known = ", ".join(sorted(entries))
    raise KernelError(f"kernel: unknown kernel {spec!r}; known: {known} "
                      f"(or an import path, package.module:Class or path/to/file.py:Class)")


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


def declared_mutants(obj) -> frozenset[str]:
    """The names in ``obj.mutants`` (an adapter class or factory: the catalogue mutants it
    implements), as a frozenset; empty when it declares none. A name that is not in the
    catalogue (``refattn.mutants``) is a :class:`KernelError`."""
    from refattn.mutants import MUTANTS

    raw = getattr(obj, "mutants", None) if obj is not None else None
    if raw is None:
        return frozenset()
    if isinstance(raw, str) or not hasattr(raw, "__iter__"):
        raise KernelError(f"kernel: {getattr(obj, '__name__', obj)!r}.mutants must be a set of "
                          f"mutant names, got {type(raw).__name__}")
    names = frozenset(str(m) for m in raw)
    unknown = sorted(names - {m.name for m in MUTANTS})
    if unknown:
        raise KernelError(f"kernel: {getattr(obj, '__name__', obj)!r} declares mutants the "
                          f"catalogue does not have: {', '.join(unknown)}")
    return names


def kernel_source_hash(adapter) -> str | None:
    """``adapter.source_hash()`` as a non-empty string, or None when it has none. One that
    raises or returns something else is a :class:`KernelError`: a record must not be stamped
    with a hash that was not computed."""
    fn = getattr(adapter, "source_hash", None)
    if fn is None:
        return None
    try:
        h = fn()
    except Exception as e:  # noqa: BLE001
        raise KernelError(f"kernel: {getattr(adapter, 'name', adapter)!r}: source_hash() raised "
                          f"{type(e).__name__}: {e}") from e
    if not isinstance(h, str) or not h.strip():
        raise KernelError(f"kernel: {getattr(adapter, 'name', adapter)!r}: source_hash() must "
                          f"return a non-empty string, got {h!r}")
    return h.strip()


def kernel_tile_sizes(factory) -> dict[str, tuple[int, ...]] | None:
    """``factory.tile_sizes()`` (on the class or an adapter) as ``{"q": (...), "kv": (...)}``,
    sorted and without repeats, or None when it has none. Anything but positive whole
    numbers under both keys is a :class:`KernelError`."""
    fn = getattr(factory, "tile_sizes", None)
    if fn is None:
        return None
    who = getattr(factory, "name", factory)
    try:
        got = fn()
        tiles = {key: tuple(sorted({int(t) for t in got[key]})) for key in ("q", "kv")}
        bad = [t for key in tiles for t in tiles[key] if t < 2] + [
            t for key in ("q", "kv") for t in got[key] if isinstance(t, bool) or int(t) != t]
    except Exception as e:  # noqa: BLE001
        raise KernelError(f"kernel: {who!r}: tile_sizes() must return {{'q': [...], 'kv': [...]}} "
                          f"of whole numbers >= 2 ({type(e).__name__}: {e})") from e
    if bad or not tiles["q"] or not tiles["kv"]:
        raise KernelError(f"kernel: {who!r}: tile_sizes() must return whole numbers >= 2 under "
                          f"'q' and 'kv', got {got!r}"[:300])
    return tiles


def kernel_facts(adapter) -> dict | None:
    """``adapter.facts()``: a dict of str keys to strings, numbers, booleans or lists of them,
    or None when the adapter has none. Anything else, or one that raises, is a
    :class:`KernelError`: a run must not record facts that were not obtained."""
    fn = getattr(adapter, "facts", None)
    if fn is None:
        return None
    who = getattr(adapter, "name", adapter)
    try:
        facts = fn()
    except Exception as e:  # noqa: BLE001
        raise KernelError(f"kernel: {who!r}: facts() raised {type(e).__name__}: {e}") from e
    scalar = (str, int, float, bool)
    if not isinstance(facts, dict) or not all(
            isinstance(k, str) and (isinstance(v, scalar) or
                                    (isinstance(v, list) and all(isinstance(i, scalar) for i in v)))
            for k, v in facts.items()):
        raise KernelError(f"kernel: {who!r}: facts() must return a dict of str to strings, numbers, "
                          f"booleans or lists of them, got {facts!r}"[:400])
    return dict(facts)


def kernel_variants(adapter, case) -> list[str]:
    """``adapter.variants(case)``: the code paths to force one by one on ``case`` (each a name
    that ``name@VARIANT`` accepts), in order and without repeats; [] when the adapter has no
    ``variants``. One that raises or returns anything but strings is a :class:`KernelError`."""
    fn = getattr(adapter, "variants", None)
    if fn is None:
        return []
    try:
        got = list(fn(case))
    except Exception as e:  # noqa: BLE001
        raise KernelError(f"kernel: {getattr(adapter, 'name', adapter)!r}: variants() raised "
                          f"{type(e).__name__}: {e}") from e
    bad = [v for v in got if not isinstance(v, str) or not v.strip() or "@" in v]
    if bad:
        raise KernelError(f"kernel: {getattr(adapter, 'name', adapter)!r}: variants() must give "
                          f"names without '@', got {bad[0]!r}")
    return list(dict.fromkeys(v.strip() for v in got))


def best_kernel() -> tuple[str, str]:
    """The kernel ``refattn run`` uses when none is named, and why: the first registered
    kernel (in name order) that needs a GPU and reports itself available here; else the
    first other registered kernel that is available (a CPU model of a GPU kernel); else the
    reference, which checks only the harness. Peers (``peer = True``: torch's kernels, ONNX
    Runtime) are compared against, never picked; nor is a kernel that ``needs_variant`` (a C
    entry point, named with its library)."""
    entries = available_kernels()
    skipped = []
    for gpu in (True, False):
        for name in sorted(entries):
            e = entries[name]
            if (name == "reference" or not e.importable or e.peer or e.requires_gpu != gpu
                    or getattr(e.factory, "needs_variant", False)):
                continue
            try:
                ok, reason = kernel_available(e())
            except KernelError as err:
                ok, reason = False, str(err)
            if ok:
                kind = "a GPU kernel" if gpu else "no GPU kernel is available here"
                why = (f"{kind}, available: {reason}" if gpu else
                       f"{kind}{' (' + '; '.join(skipped) + ')' if skipped else ''}; {reason or 'available'}")
                return name, why
            skipped.append(f"{name}: {' '.join(reason.split())[:400] or 'not available'}")
    return "reference", "no other kernel is registered and available" + (
        f" ({'; '.join(skipped)})" if skipped else "")
