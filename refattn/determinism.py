"""`refattn determinism`: run every case several times and check that the outputs are
bitwise identical, for the kernel as it is and for each of its variants forced in turn.

A kernel without atomics or split reductions has no reason to differ between two runs on
the same inputs; one that does makes every other result irreproducible (a failure seen
once may not come back, a record may not be re-made). Each run gets the same read-only
inputs (``refattn.runner.InputCache``) and a fresh canary output buffer; the outputs are
compared as bytes, so two NaNs of different payloads differ and -0.0 differs from 0.0.

Variants: an adapter with ``variants(case)`` (docs/adapters.md) names the code paths that
can run each case; every one is forced through ``NAME@VARIANT`` and checked on its own, as
a tuner that picks a path per case would otherwise check only the path it picks. A case
the kernel declines is listed as declined; a run that raises or declines a supported case
is a failure. Exit status 1 when any output differs or any run fails.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SCHEMA = 1
DEFAULT_RUNS = 3


@dataclass
class Repeat:
    """One (case, variant): the outcome of its repeated runs."""

    case: str
    variant: str | None  # None: the kernel as it is (its own choice of path)
    outcome: str  # "identical" | "differs" | "declined" | "error"
    runs: int = 0
    differing: int = 0  # elements that differ from the first run, in the worst run
    first_at: tuple | None = None  # (b, row, head, col) of the first differing element
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome in ("identical", "declined")

    def to_dict(self) -> dict:
        return {"case": self.case, "variant": self.variant, "outcome": self.outcome,
                "runs": self.runs, "differing": self.differing,
                "first_at": None if self.first_at is None else list(self.first_at), "note": self.note}


@dataclass
class DeterminismRun:
    kernel: str
    runs: int
    repeats: list[Repeat] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.repeats) and all(r.ok for r in self.repeats)


def _output(kernel, inputs):
    """``kernel.run(inputs)`` -> (status, a copy of the output) or raises."""
    status, out = kernel.run(inputs)
    return int(status), np.array(out, copy=True)


def repeat_case(kernel, case, runs: int, variant: str | None, input_cache) -> Repeat:
    """Run ``kernel`` on ``case`` ``runs`` times and compare the outputs byte for byte."""
    rep = Repeat(case.name, variant, "error")
    try:
        supported = bool(kernel.supports(case))
    except Exception as e:  # noqa: BLE001
        rep.note = f"supports() raised {type(e).__name__}: {e}"
        return rep
    if not supported:
        rep.outcome, rep.note = "declined", "not supported: not run"
        return rep
    first = None
    for i in range(runs):
        try:
            status, out = _output(kernel, input_cache.get(case))
        except Exception as e:  # noqa: BLE001 - a crash is a result
            rep.note = f"run {i + 1}: run() raised {type(e).__name__}: {e}"
            return rep
        rep.runs = i + 1
        if status != 0:
            rep.note = f"run {i + 1}: returned status {status} on a case it supports"
            return rep
        if first is None:
            first = out
            continue
        if out.shape != first.shape or out.dtype != first.dtype:
            rep.outcome = "differs"
            rep.note = f"run {i + 1}: {out.dtype} {out.shape} against {first.dtype} {first.shape}"
            return rep
        diff = first.view(np.uint8).reshape(first.shape + (-1,)) != out.view(np.uint8).reshape(out.shape + (-1,))
        diff = diff.any(axis=-1)
        n = int(diff.sum())
        if n > rep.differing:
            rep.differing = n
            rep.first_at = tuple(int(x) for x in np.argwhere(diff)[0])
            rep.note = f"run {i + 1}: {n} of {diff.size} elements differ from run 1"
    rep.outcome = "differs" if rep.differing else "identical"
    return rep


def determinism(spec: str, cases, *, runs: int = DEFAULT_RUNS, variants: bool = True,
                progress=None) -> DeterminismRun:
    """Every case of ``cases`` on the kernel ``spec``, ``runs`` times, as it is and (with
    ``variants``) forced to each variant its adapter names for the case.
    ``progress(i, n, repeat)`` after each (case, variant)."""
    from refattn.kernels import get_kernel, kernel_variants
    from refattn.runner import InputCache

    if not (isinstance(runs, int) and runs >= 2):
        raise ValueError(f"--runs: expected at least 2 runs to compare, got {runs!r}")
    kernel = get_kernel(spec)
    forced: dict[str, object] = {}
    inputs = InputCache(512 * 2**20)
    t0 = time.perf_counter()
    result = DeterminismRun(kernel=str(getattr(kernel, "name", spec)), runs=runs)
    plan = []
    for case in cases:
        plan.append((case, None))
        if variants:
            plan += [(case, v) for v in kernel_variants(kernel, case)]
    for i, (case, v) in enumerate(plan):
        if v is None:
            k = kernel
        else:
            if v not in forced:
                forced[v] = get_kernel(f"{spec}@{v}")
            k = forced[v]
        rep = repeat_case(k, case, runs, v, inputs)
        result.repeats.append(rep)
        if progress is not None:
            progress(i, len(plan), rep)
    result.elapsed_s = time.perf_counter() - t0
    return result


def to_json(run: DeterminismRun, spec: str, source_hash: str | None, suites) -> dict:
    counts = {}
    for r in run.repeats:
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
    return {"schema": SCHEMA, "kind": "determinism", "kernel": run.kernel, "kernel_spec": spec,
            "kernel_source_hash": source_hash, "ok": run.ok, "runs": run.runs, "suites": list(suites),
            "counts": counts, "elapsed_s": round(run.elapsed_s, 3),
            "results": [r.to_dict() for r in run.repeats]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from refattn.cli import _add_suite_option, _count_of

    p.add_argument("--kernel", required=True, metavar="NAME",
                   help="the kernel: a registered name or an import path package.module:Class "
                        "or path/to/file.py:Class")
    _add_suite_option(p, "Default: seed.")
    p.add_argument("-k", dest="match", action="append", metavar="SUBSTRING",
                   help="only cases whose name contains SUBSTRING (repeatable)")
    p.add_argument("--runs", type=_count_of("run", "runs"), default=DEFAULT_RUNS, metavar="N",
                   help=f"runs of each case (at least 2; default {DEFAULT_RUNS})")
    p.add_argument("--no-variants", dest="variants", action="store_false",
                   help="only the kernel as it is, not each variant its adapter names")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.epilog = ("examples:\n  refattn determinism --kernel model -k w128\n"
                "  refattn determinism --kernel hipkernel --suite seed --suite extended --json det.json\n\n"
                "exit status: 0 every output bitwise identical over its runs, 1 one differs or a run "
                "failed, 2 usage error")


def run(args) -> int:
    from refattn.cases import load_suites
    from refattn.cli import EXIT_FAIL, EXIT_OK, UsageError, _console, check_outputs, write_outputs
    from refattn.fileio import json_text
    from refattn.kernels import get_kernel, kernel_available, kernel_source_hash

    check_outputs(args, ("json",))
    if args.runs < 2:
        raise UsageError(f"--runs: expected at least 2 runs to compare, got {args.runs}")
    kernel = get_kernel(args.kernel)
    ok, reason = kernel_available(kernel)
    if not ok:
        raise UsageError(f"kernel: {args.kernel!r} is not available here: {reason}")
    suites = args.suite or ["seed"]
    cases = load_suites(suites)
    if args.match:
        cases = [c for c in cases if any(s in c.name for s in args.match)]
        if not cases:
            raise UsageError(f"-k: no case name contains {' or '.join(map(repr, args.match))}")

    def progress(i, n, rep):
        if not args.quiet:
            where = f"{rep.case}" + (f"@{rep.variant}" if rep.variant else "")
            print(f"[{i + 1}/{n}] {where}: {rep.outcome}" + (f" ({rep.note})" if rep.note and not rep.ok else ""),
                  file=sys.stderr, flush=True)

    res = determinism(args.kernel, cases, runs=args.runs, variants=args.variants, progress=progress)
    doc = to_json(res, args.kernel, kernel_source_hash(kernel), suites)
    written = write_outputs(json_text(doc), [Path(args.json)] if args.json else [], "determinism")
    out = _console()
    bad = [r for r in res.repeats if not r.ok]
    for r in bad:
        out.print(f"  {r.case}" + (f"@{r.variant}" if r.variant else "") + f": {r.outcome}: {r.note}",
                  markup=False)
    line = ", ".join(f"{n} {o}" for o, n in sorted(doc["counts"].items()))
    out.print(f"{'OK' if res.ok else 'FAILED'}: kernel {res.kernel}, {len(cases)} cases, "
              f"{len(res.repeats)} (case, variant) pairs x {res.runs} runs: {line} in {res.elapsed_s:.1f} s",
              markup=False)
    return EXIT_OK if res.ok and written else EXIT_FAIL
