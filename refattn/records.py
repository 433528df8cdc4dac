"""Freshness of a stamped result: is it a run of the kernel source as it is now?

Every document a check writes for a kernel (``refattn run``, ``fuzz``, ``determinism``,
``mutants``, ``bench``, and a kernel package's GPU records) carries ``kernel_spec`` (the
name the kernel was built from, ``name[:variant]``) and ``kernel_source_hash`` (what its
adapter's ``source_hash()`` returned then). The current hash comes from the same adapter
now (:func:`current_hash`), so each record is judged against its own kernel's source, never
against another kernel's:

* ``fresh``: the hashes agree;
* ``carried``: a record of a :data:`CARRIED_KINDS` kind of an earlier source. Those kinds
  measure the harness rather than the kernel (``scaling``: how the matrix spreads over the
  GPUs of a host, which needs a machine with two GPUs), so a kernel edit does not void
  them; they are listed as carried and must still pass;
* ``stale``: any other record of an earlier source (re-run it);
* ``unknown``: no hash, no kernel named, or a kernel that cannot be built here to ask.
"""

from __future__ import annotations

CARRIED_KINDS = ("scaling",)


def record_spec(rec: dict) -> str | None:
    """The kernel a record names: ``kernel_spec``, else ``kernel`` (a name or an import path,
    with any ``@CONFIG`` or ``+mutant`` suffix dropped), else None."""
    spec = rec.get("kernel_spec") or rec.get("kernel")
    if not isinstance(spec, str) or not spec.strip():
        return None
    return spec.strip().split("@", 1)[0].split("+", 1)[0]


def current_hash(spec: str | None, cache: dict | None = None) -> str | None:
    """``source_hash()`` of the adapter ``spec`` builds here now, or None when it cannot be
    built or has no ``source_hash``; ``cache`` (spec -> hash) saves asking twice."""
    if not spec:
        return None
    if cache is not None and spec in cache:
        return cache[spec]
    from refattn.kernels import KernelError, get_kernel, kernel_source_hash

    try:
        h = kernel_source_hash(get_kernel(spec))
    except KernelError:
        h = None
    if cache is not None:
        cache[spec] = h
    return h


def freshness(rec: dict, current: str | None) -> str:
    """``"fresh"``, ``"carried"``, ``"stale"`` or ``"unknown"`` (module docstring) of ``rec``
    against the ``current`` hash of its kernel."""
    h = rec.get("kernel_source_hash")
    if isinstance(h, str) and h and h == current:
        return "fresh"
    if rec.get("kind") in CARRIED_KINDS and isinstance(h, str) and h:
        return "carried"
    if not isinstance(h, str) or not h or current is None:
        return "unknown"
    return "stale"


def carried_note(rec: dict) -> str:
    """What a carried record says about itself, for the checks' output and the report."""
    return (f"carried: a {rec.get('kind')} run of kernel source "
            f"{str(rec.get('kernel_source_hash'))[:12]} ({rec.get('device')}, "
            f"{rec.get('date', 'undated')}); not re-run since")


__all__ = ["CARRIED_KINDS", "carried_note", "current_hash", "freshness", "record_spec"]
