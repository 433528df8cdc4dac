"""`refattn fuzz`: random cases within a kernel's ``supports()``, each judged against the fp64
reference under the derived gate, and a failure shrunk to a minimal failing case.

What is drawn
=============

A case (:class:`refattn.cases.Case`) over these axes, each drawn from values that matter and
from a range (:func:`case_strategy`):

* ``Hkv`` in 1, 2, 3, 4, 8 and ``G = Hq / Hkv`` in 1, 2, 3, 4, 5, 6, 8, 12, 16, 24 (non-powers
  of two and G > 16 included: a head mapping that assumes a power of two, or tiles heads in
  16s, is caught);
* the head dim ``d``, the dtype, the sink mode and the softcap, each from the values the
  kernel supports on a plain case (:func:`supported_axes`: ``supports()`` asked once per
  value; a combination it declines is not drawn);
* ``sq`` and ``past_len`` often one of :data:`EDGES` (a tile size of 16 to 128 keys, one
  less, one more), else anywhere in 1..300 and 0..3000, and sometimes ``past_len`` chosen so
  that ``skv`` is one of :data:`SKV_EDGES` (one off a multiple of every tile, or prime);
  ``window`` none, 1-8 keys (rows that see almost nothing), an edge, or 1..600;
* the input modes of the coverage model (docs/semantics.md, Coverage model) that the kernel
  supports on a plain case, a quarter of the time each: a common ``logit_offset`` near -5e4,
  a ``q_spike`` past the fp16 range, and NaN or infinities in the cache slots left of every
  window (``cache_fill``; ``--clean-inputs`` draws none of these);
* ``B`` 1-2, a custom ``scale`` sometimes (0.5 or 2: a sharp softmax), the input seed, and
  the spare cache capacity: the default 64-127 rows of NaN canaries, none (a tight cache),
  or 1-130 rows.

A drawn case whose fp64 reference would cost more than ``--max-cost`` (query-key pairs a
row block touches, ``B * Hq * sq * keys``) is cut down deterministically: past_len halved,
then sq, then the heads, until it fits. The kernel is run through
:func:`refattn.runner.run_case`, exactly as ``refattn run`` runs a case file: a kernel that
declines a case it claims to support, raises, writes NaN or fails the gate fails the example.

Shrinking
=========

The search is ``hypothesis.find``: the first failing case is shrunk by hypothesis (smaller
integers, earlier values of each axis) while it keeps failing. The minimal case is printed
as a ``[[case]]`` table to paste into a case file and as a ``refattn run --case ...``
command that reproduces it, and both go to the JSON. ``--seed`` makes the draw
reproducible (no example database is read or written).

Limits: ``--examples`` cases at most, ``--max-seconds`` for the search and
``--shrink-seconds`` for the shrinking; the JSON says which limit ended the run.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from refattn.cases import Case, CaseError, case_to_inline, case_to_toml

SCHEMA = 1
DEFAULT_EXAMPLES = 200
DEFAULT_MAX_COST = 2**21  # query-key pairs of the fp64 reference: ~55 ms an example on 2 cores
EDGES = (1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129)
SKV_EDGES = (127, 129, 255, 257, 383, 385, 509, 521)  # 128k +- 1 (so 16k, 32k, 64k +- 1), primes
HKV_VALUES = (1, 2, 3, 4, 8)
G_VALUES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24)
D_VALUES = (64, 128, 32, 16, 80, 96, 256)  # the first are the commonest head dims
DTYPE_VALUES = ("fp16", "bf16", "fp32")
SINK_VALUES = ("none", "per_head", "smooth")
SOFTCAP_VALUES = (0.0, 30.0, 5.0, 2.0)
LOGIT_OFFSET_VALUES = (0.0, -5e4, -2e4)
Q_SPIKE_VALUES = (0.0, 4e4)
CACHE_FILL_VALUES = ("clean", "nan-outside-window", "inf-outside-window")
INPUT_MODES = ("logit_offset", "q_spike", "cache_fill")
DEFAULT_INPUT_MODES = INPUT_MODES  # each drawn where the kernel's supports() accepts it
PROGRESS_EVERY_S = 5.0


def _probe(kernel, **kw) -> bool:
    try:
        return bool(kernel.supports(Case(name="probe", suite="fuzz", why="probe", **kw)))
    except Exception:  # noqa: BLE001 - a supports() that raises on a value excludes it
        return False


def supported_axes(kernel, input_modes=DEFAULT_INPUT_MODES) -> dict[str, tuple]:
    """The values of each per-case axis (d, dtype, sink, softcap and the ``input_modes``
    among logit_offset, q_spike, cache_fill) that ``kernel.supports()`` accepts on a plain
    case (Hq 8, Hkv 2, sq 16, past 16, d 64 unless d is the axis; a 4-key window for
    cache_fill). A mode not in ``input_modes`` keeps only its off value."""
    unknown = set(input_modes) - set(INPUT_MODES)
    if unknown:
        raise ValueError(f"input_modes: unknown {sorted(unknown)}; known: {', '.join(INPUT_MODES)}")
    base = dict(Hq=8, Hkv=2, d=64, sq=16, past_len=16)
    ds = tuple(d for d in D_VALUES if _probe(kernel, **{**base, "d": d}))
    d0 = ds[0] if ds else 64
    b0 = {**base, "d": d0}

    def mode(name: str, values: tuple, **extra) -> tuple:
        if name not in input_modes:
            return values[:1]
        return values[:1] + tuple(x for x in values[1:]
                                  if _probe(kernel, **b0, **extra, **{name: x}))

    return {
        "d": ds,
        "dtype": tuple(x for x in DTYPE_VALUES if _probe(kernel, **{**b0, "dtype": x})),
        "sink": tuple(x for x in SINK_VALUES if _probe(kernel, **{**b0, "sink": x})),
        "softcap": tuple(x for x in SOFTCAP_VALUES if _probe(kernel, **{**b0, "softcap": x})),
        "logit_offset": mode("logit_offset", LOGIT_OFFSET_VALUES),
        "q_spike": mode("q_spike", Q_SPIKE_VALUES),
        "cache_fill": mode("cache_fill", CACHE_FILL_VALUES, window=4),
    }


def reference_cost(c: Case) -> int:
    """Query-key pairs the fp64 reference computes: under a window a block of rows touches
    about sq + W keys, not all of them."""
    keys = c.skv if c.window < 0 else min(c.skv, c.window + c.sq)
    return c.B * c.Hq * c.sq * keys


def fit_cost(c: Case, max_cost: int) -> Case:
    """``c`` cut down until :func:`reference_cost` <= ``max_cost``: past_len halved, then sq,
    then B, then Hkv (G kept), then G."""
    while reference_cost(c) > max_cost:
        if c.past_len > 64:
            c = replace(c, past_len=c.past_len // 2)
        elif c.sq > 16:
            c = replace(c, sq=c.sq // 2)
        elif c.B > 1:
            c = replace(c, B=1)
        elif c.Hkv > 1:
            c = replace(c, Hq=c.Hq // c.Hkv, Hkv=1)
        elif c.Hq > 1:
            c = replace(c, Hq=max(1, c.Hq // 2))
        else:
            break
    return c


def case_strategy(axes: dict[str, tuple], max_cost: int = DEFAULT_MAX_COST):
    """The hypothesis strategy of a fuzz case (the module docstring says what is drawn).
    Every ``sampled_from`` lists its simplest value first: that is where shrinking goes."""
    from hypothesis import strategies as st

    def edge_or(lo: int, hi: int):
        return st.one_of(st.sampled_from([e for e in EDGES if lo <= e <= hi]), st.integers(lo, hi))

    def rarely(values: tuple):  # the off value three times in four: shrinking goes there
        off = st.just(values[0])
        return st.one_of(off, off, off, st.sampled_from(values)) if len(values) > 1 else off

    @st.composite
    def draw_case(draw):
        Hkv = draw(st.sampled_from(HKV_VALUES))
        G = draw(st.sampled_from(G_VALUES))
        d = draw(st.sampled_from(axes["d"]))
        sq = draw(edge_or(1, 300))
        past = draw(st.one_of(st.just(0), edge_or(0, 3000)))
        skv = draw(st.one_of(st.none(), st.sampled_from(SKV_EDGES)))
        if skv is not None and skv > sq:
            past = skv - sq
        window = draw(st.one_of(st.just(-1), st.integers(1, 8), edge_or(1, 600)))
        sink = draw(st.sampled_from(axes["sink"]))
        softcap = draw(st.sampled_from(axes["softcap"]))
        dtype = draw(st.sampled_from(axes["dtype"]))
        B = draw(st.integers(1, 2))
        scale = draw(st.one_of(st.none(), st.sampled_from([0.5, 2.0])))
        spare = draw(st.one_of(st.none(), st.just(0), st.integers(1, 130)))
        seed = draw(st.integers(0, 2**31 - 1))
        offset = draw(rarely(axes.get("logit_offset", (0.0,))))
        spike = draw(rarely(axes.get("q_spike", (0.0,))))
        fill = draw(rarely(axes.get("cache_fill", ("clean",))))
        c = Case(name="fuzz", suite="fuzz", Hq=Hkv * G, Hkv=Hkv, d=d, sq=sq, B=B, past_len=past,
                 window=window, sink=sink, dtype=dtype, seed=seed, scale=scale, softcap=softcap,
                 spare=spare, why="drawn by refattn fuzz")
        c = fit_cost(c, max_cost)
        # the input modes last: fit_cost may have cut the window's hidden slots away, and a
        # mode the case's dtype cannot represent (CaseError) is left off
        for key, value in (("logit_offset", offset), ("q_spike", spike), ("cache_fill", fill)):
            if value not in (0.0, "clean"):
                try:
                    c = replace(c, **{key: value})
                except CaseError:
                    pass
        return c

    return draw_case()


@dataclass
class FuzzRun:
    """What a fuzz run saw: examples judged, the first and the smallest failing result."""

    kernel: str
    seed: int
    examples: int = 0  # judged before the first failure
    shrink_steps: int = 0  # judged after it
    declined_draws: int = 0  # drawn cases the kernel does not support (not judged)
    stopped: str = "examples"  # "examples" | "time" | "shrink time"
    first: object = None  # runner.Result of the first failing case
    minimal: Case | None = None
    minimal_result: object = None
    elapsed_s: float = 0.0
    axes: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.minimal is None


def fuzz(kernel, *, examples: int = DEFAULT_EXAMPLES, seed: int = 0, max_seconds: float | None = None,
         shrink_seconds: float = 300.0, max_cost: int = DEFAULT_MAX_COST, progress=None,
         input_modes=DEFAULT_INPUT_MODES) -> FuzzRun:
    """Draw up to ``examples`` cases within ``kernel.supports()``, judge each with
    :func:`refattn.runner.run_case`, and shrink the first failure (module docstring).
    ``progress(run, phase, case, result)`` is called after every judged case, ``phase``
    ``"search"`` or ``"shrink"``. ``input_modes``: which of :data:`INPUT_MODES` to draw."""
    from hypothesis import HealthCheck, Verbosity, assume, find, settings
    from hypothesis.errors import NoSuchExample, Unsatisfiable

    from refattn.runner import InputCache, ReferenceCache, run_case

    axes = supported_axes(kernel, input_modes)
    empty = [k for k, v in axes.items() if not v]
    if empty:
        raise ValueError(f"--kernel: {getattr(kernel, 'name', kernel)!r} supports no value of "
                         f"{', '.join(empty)} on a plain case (Hq 8, Hkv 2, sq 16, past 16): nothing to draw")
    name = str(getattr(kernel, "name", type(kernel).__name__))
    run = FuzzRun(kernel=name, seed=seed, axes={k: list(v) for k, v in axes.items()})
    cache, inputs = ReferenceCache(256 * 2**20), InputCache(128 * 2**20)
    t0 = time.perf_counter()
    shrink_t0 = [None]
    failing: dict[Case, object] = {}

    def fails(case: Case) -> bool:
        now = time.perf_counter()
        if shrink_t0[0] is None:
            if max_seconds is not None and now - t0 > max_seconds:
                run.stopped = "time"
                return False
        elif now - shrink_t0[0] > shrink_seconds:
            run.stopped = "shrink time"
            return False
        if not kernel.supports(case):
            run.declined_draws += 1
            assume(False)
        r = run_case(kernel, case, cache=cache, input_cache=inputs)
        bad = not r.acceptable
        if shrink_t0[0] is None:
            run.examples += 1
            if bad:
                shrink_t0[0] = time.perf_counter()
                run.first = r
        else:
            run.shrink_steps += 1
        if bad:
            failing[case] = r
        if progress is not None:
            progress(run, "search" if shrink_t0[0] is None or (bad and run.shrink_steps == 0) else "shrink",
                     case, r)
        return bad

    conf = settings(max_examples=examples, deadline=None, database=None, verbosity=Verbosity.quiet,
                    suppress_health_check=list(HealthCheck))
    try:
        found = find(case_strategy(axes, max_cost), fails, settings=conf, random=random.Random(seed))
    except (NoSuchExample, Unsatisfiable):
        found = None
    run.elapsed_s = time.perf_counter() - t0
    if found is not None:
        run.minimal = found
        run.minimal_result = failing.get(found) or run_case(kernel, found, cache=cache, input_cache=inputs)
    return run


# --------------------------------------------------------------------------- output

def named_minimal(run: FuzzRun, kernel_spec: str) -> Case:
    """The minimal failing case with a name and a ``why`` saying where it came from."""
    r = run.minimal_result
    how = " ".join((r.outcome + (f": {r.note}" if r.note else "")).split())
    return replace(run.minimal, name=f"fuzz-seed{run.seed}",
                   why=f"found by refattn fuzz --kernel {kernel_spec} --seed {run.seed} ({how})"[:300])


def repro_command(kernel_spec: str, case: Case) -> str:
    """A one-line ``refattn run`` that reproduces ``case`` on ``kernel_spec``."""
    inline = case_to_inline(case).replace("'", "'\\''")
    return f"refattn run --kernel {kernel_spec} --case '{inline}'"


def to_json(run: FuzzRun, kernel_spec: str, source_hash: str | None) -> dict:
    doc = {"schema": SCHEMA, "kind": "fuzz", "kernel": run.kernel, "kernel_spec": kernel_spec,
           "kernel_source_hash": source_hash, "ok": run.ok, "seed": run.seed,
           "examples": run.examples, "shrink_steps": run.shrink_steps,
           "declined_draws": run.declined_draws, "stopped": run.stopped,
           "elapsed_s": round(run.elapsed_s, 3), "axes": run.axes, "minimal": None}
    if not run.ok:
        case = named_minimal(run, kernel_spec)
        doc["minimal"] = {"case": case.to_dict(), "describe": case.describe(),
                          "toml": case_to_toml(case), "command": repro_command(kernel_spec, case),
                          "result": run.minimal_result.to_dict(),
                          "first": run.first.to_dict() if run.first is not None else None}
    return doc


def add_arguments(p: argparse.ArgumentParser) -> None:
    from refattn.cli import _count_of

    p.add_argument("--kernel", required=True, metavar="NAME",
                   help="the kernel to fuzz: a registered name or an import path package.module:Class "
                        "or path/to/file.py:Class (refattn kernels lists the registered ones)")
    p.add_argument("--examples", type=_count_of("example", "examples"), default=DEFAULT_EXAMPLES,
                   metavar="N", help=f"cases to draw at most (default {DEFAULT_EXAMPLES})")
    p.add_argument("--seed", type=_count_of("seed", "seed values", minimum=0), default=0, metavar="S",
                   help="seed of the draw (default 0): the same seed draws the same cases")
    p.add_argument("--max-seconds", type=_seconds, default=None, metavar="T",
                   help="stop drawing after T seconds (default: no limit)")
    p.add_argument("--shrink-seconds", type=_seconds, default=300.0, metavar="T",
                   help="stop shrinking a failure after T seconds (default 300)")
    p.add_argument("--max-cost", type=_count_of("pair", "pairs"), default=DEFAULT_MAX_COST, metavar="PAIRS",
                   help=f"largest fp64 reference of a case, in query-key pairs (default {DEFAULT_MAX_COST})")
    p.add_argument("--clean-inputs", action="store_true",
                   help="draw none of the input modes (a logit offset, a q spike, NaN / +-inf "
                        "in the cache slots left of every window): unit N(0,1) inputs only")
    p.add_argument("--json", metavar="PATH", help="write the run (and the minimal failing case) as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.epilog = ("examples:\n  refattn fuzz --kernel model --examples 300\n"
                "  refattn fuzz --kernel examples/numpy_kernel.py:NumpyKernel --max-seconds 120 --json fuzz.json\n\n"
                "On a failure it prints the minimal failing case as a [[case]] table and a\n"
                "`refattn run --case ...` command that reproduces it.\n\n"
                "exit status: 0 no failing case found, 1 a failing case found (or the JSON could not "
                "be written), 2 usage error")


def _seconds(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}") from None
    if not x > 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, got {text}")
    return x


def _progress(quiet: bool):
    last = [0.0]

    def show(run: FuzzRun, phase: str, case: Case, result) -> None:
        now = time.perf_counter()
        bad = not result.acceptable
        if quiet or (not bad and now - last[0] < PROGRESS_EVERY_S):
            return
        last[0] = now
        if phase == "search" and not bad:
            print(f"fuzz: {run.examples} examples, none failing", file=sys.stderr, flush=True)
        elif run.shrink_steps == 0:
            print(f"fuzz: example {run.examples} fails ({result.outcome}): {case.describe()}; shrinking",
                  file=sys.stderr, flush=True)
        elif bad:
            print(f"fuzz: shrinking, step {run.shrink_steps}: still fails at {case.describe()}",
                  file=sys.stderr, flush=True)
    return show


def run(args) -> int:
    from refattn.cli import EXIT_FAIL, EXIT_OK, UsageError, _console, check_outputs, write_outputs
    from refattn.fileio import json_text
    from refattn.kernels import get_kernel, kernel_available, kernel_source_hash

    check_outputs(args, ("json",))
    kernel = get_kernel(args.kernel)
    ok, reason = kernel_available(kernel)
    if not ok:
        raise UsageError(f"kernel: {args.kernel!r} is not available here: {reason}")
    if not args.quiet:
        print(f"fuzz: kernel {getattr(kernel, 'name', args.kernel)}, up to {args.examples} examples, "
              f"seed {args.seed}", file=sys.stderr, flush=True)
    try:
        result = fuzz(kernel, examples=args.examples, seed=args.seed, max_seconds=args.max_seconds,
                      shrink_seconds=args.shrink_seconds, max_cost=args.max_cost,
                      progress=_progress(args.quiet),
                      input_modes=() if args.clean_inputs else DEFAULT_INPUT_MODES)
    except (ValueError, CaseError) as e:
        raise UsageError(str(e)) from None
    doc = to_json(result, args.kernel, kernel_source_hash(kernel))
    written = write_outputs(json_text(doc), [Path(args.json)] if args.json else [], "fuzz")
    out = _console()
    limit = {"examples": "", "time": f" (stopped at --max-seconds {args.max_seconds})",
             "shrink time": f" (shrinking stopped at --shrink-seconds {args.shrink_seconds:g})"}[result.stopped]
    if result.ok:
        out.print(f"OK: kernel {result.kernel}: {result.examples} examples, none failing, in "
                  f"{result.elapsed_s:.1f} s{limit}", markup=False)
        return EXIT_OK if written else EXIT_FAIL
    m = doc["minimal"]
    out.print(f"FAILED: kernel {result.kernel}: example {result.examples} of the search failed; "
              f"shrunk in {result.shrink_steps} steps to {m['describe']}{limit}\n", markup=False)
    out.print(result.minimal_result.failure_message() + "\n", markup=False, highlight=False)
    out.print("paste into a case file:\n\n" + m["toml"], markup=False, highlight=False)
    out.print("reproduce:\n\n  " + m["command"], markup=False, highlight=False)
    return EXIT_FAIL
