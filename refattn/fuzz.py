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
  or 1-130 rows;
* for a kernel that takes ragged batches (``ragged = True``, and its ``supports()`` accepts
  one), a quarter of the time a ragged batch: B 2-4, each sequence its own ``past_len``
  (0, an edge, or 0..3000) and ``q_len`` (0..sq, often sq), not all empty.

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
reproducible (no example database is read or written, and hypothesis's constants taken from
the modules a process has loaded are left out: the same seed draws the same cases from a
source tree, from a wheel, in a test process and in a worker of ``--gpus``).

Limits: ``--examples`` cases at most, ``--max-seconds`` for the search and
``--shrink-seconds`` for the shrinking; the JSON says which limit ended the run.

Several GPUs
============

``--gpus N`` (N > 1) runs N worker processes, each pinned to a device of its own exactly as
``refattn run --gpus`` pins its pytest-xdist workers (:func:`refattn.sharding.visible_devices`
finds the devices, :func:`refattn.sharding.worker_environment` pins worker ``i`` to the
``i``-th: ``CUDA_VISIBLE_DEVICES`` or ``HIP_VISIBLE_DEVICES``, ``HIPKERNEL_DEVICE=0`` and its
share of the CPUs in ``$REFATTN_THREADS``). N more than the devices visible is a usage error,
for a CPU kernel too (its workers are pinned to the devices the environment names, so
``CUDA_VISIBLE_DEVICES=0,1`` or ``$REFATTN_FAKE_GPUS`` simulate two). Worker ``i`` of ``N``
fuzzes its share (:func:`plan_shares`): ``E // N`` of the ``E`` examples, one more for each of
the first ``E % N`` workers, drawn with the seed ``S * N + i`` (:func:`worker_seed`; ``S`` is
``--seed``), so worker ``i`` draws exactly what ``refattn fuzz --seed S*N+i --examples E_i``
draws on one device. A worker stops at its own first failure and shrinks it; the others run
their shares to the end, so the run does not depend on which worker finishes first. The
parent merges the workers' documents (:func:`merge_workers`): the examples summed, the
failure of the lowest-numbered failing worker with its minimal case, and a ``workers`` list
(device, seed, examples, elapsed time, ok, and the cases drawn with their verdicts, the same
list :func:`share_cases` gives for a share run in one process). ``--gpus 1`` is the plain run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from contextlib import contextmanager
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
        "ragged": (False,) + ((True,) if getattr(kernel, "ragged", False)
                              and _probe(kernel, **{**b0, "B": 2, "past_len": [16, 3],
                                                    "q_len": [16, 5]}) else ()),
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
        if max(c.past_lens) > 64:
            halved = tuple(p // 2 for p in c.past_lens)
            c = replace(c, past_len=halved if c.ragged else halved[0])
        elif c.sq > 16:
            q_len = None if c.q_len is None else tuple(min(n, c.sq // 2) for n in c.q_len)
            if q_len is not None and not any(q_len):
                q_len = (1,) + q_len[1:]
            c = replace(c, sq=c.sq // 2, q_len=q_len)
        elif c.B > 1 and not c.ragged:
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
        q_len = None
        if draw(rarely(axes.get("ragged", (False,)))):
            B = draw(st.integers(2, 4))
            past = draw(st.lists(st.one_of(st.just(0), edge_or(0, 3000)), min_size=B, max_size=B))
            q_len = draw(st.lists(st.one_of(st.just(sq), st.integers(0, sq)), min_size=B, max_size=B))
            if not any(q_len):
                q_len[0] = sq
        c = Case(name="fuzz", suite="fuzz", Hq=Hkv * G, Hkv=Hkv, d=d, sq=sq, B=B, past_len=past,
                 q_len=q_len, window=window, sink=sink, dtype=dtype, seed=seed, scale=scale,
                 softcap=softcap, spare=spare, why="drawn by refattn fuzz")
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
    cases: list = field(default_factory=list)  # case_record() of each example of the search

    @property
    def ok(self) -> bool:
        return self.minimal is None


@contextmanager
def _no_local_constants():
    """Draw without hypothesis's pool of "local constants": hypothesis mixes into drawn
    integers the literals of every module loaded from outside site-packages, so one seed drew
    different cases in a source tree and from a wheel, or in a process that had imported
    other modules (a test run, a worker of ``--gpus``). With the pool empty a seed's cases
    depend on the seed and the kernel's axes alone; hypothesis's built-in constants stay."""
    try:
        from hypothesis.internal.conjecture import providers
        from hypothesis.internal.constants_ast import Constants

        get, cache = providers._get_local_constants, providers.CONSTANTS_CACHE
    except (ImportError, AttributeError):  # a hypothesis without the pool
        yield
        return
    empty = Constants()
    providers._get_local_constants = lambda: empty
    cache.cache.clear()  # values cached with the pool
    try:
        yield
    finally:
        providers._get_local_constants = get
        cache.cache.clear()


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
            run.cases.append(case_record(case, r))
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
        with _no_local_constants():
            found = find(case_strategy(axes, max_cost), fails, settings=conf,
                         random=random.Random(seed))
    except (NoSuchExample, Unsatisfiable):
        found = None
    run.elapsed_s = time.perf_counter() - t0
    if found is not None:
        run.minimal = found
        run.minimal_result = failing.get(found) or run_case(kernel, found, cache=cache, input_cache=inputs)
    return run


def case_record(case: Case, result) -> dict:
    """One drawn case as the JSON of a sharded run lists it: its description, its input seed
    (the two name the case) and its verdict."""
    return {"case": case.describe(), "seed": int(case.seed), "outcome": result.outcome}


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
    p.add_argument("--gpus", metavar="N", type=_count_of("GPU", "GPUs"), default=1,
                   help="fuzz in N worker processes, each pinned to a visible device of its own "
                        "as refattn run --gpus pins its workers; worker i of N draws its share of "
                        "--examples with seed S*N+i (S = --seed) and shrinks its own first "
                        "failure; the JSON adds a workers list. Default 1: in-process")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.epilog = ("examples:\n  refattn fuzz --kernel model --examples 300\n"
                "  refattn fuzz --kernel examples/numpy_kernel.py:NumpyKernel --max-seconds 120 --json fuzz.json\n"
                "  refattn fuzz --kernel hipkernel --examples 2000 --gpus 2  # a worker per GPU\n\n"
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
    if getattr(args, "gpus", 1) > 1:  # each worker checks the kernel on its own device
        return _run_sharded(args, kernel)
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


# --------------------------------------------------------------------------- several GPUs

# What a worker process runs: the JSON of its spec is its one argument (see worker_main).
WORKER_CODE = ("import sys; from refattn.fuzz import worker_main; "
               "sys.exit(worker_main(sys.argv[1:]))")
WORKER_TAIL_LINES = 40  # of a worker's output, kept for the message when it fails to finish


@dataclass(frozen=True)
class Share:
    """What worker ``index`` of a sharded run fuzzes: up to ``examples`` cases drawn with
    ``seed``, the same draw as ``refattn fuzz --seed SEED --examples EXAMPLES`` on one device."""

    index: int
    seed: int
    examples: int


def worker_seed(seed: int, index: int, workers: int) -> int:
    """The seed worker ``index`` of ``workers`` draws with under ``--seed seed``:
    ``seed * workers + index``. One worker keeps ``seed``; the workers of one run draw with
    distinct seeds, and at one worker count no two base seeds share a worker seed (over two
    workers ``--seed 0`` draws with 0 and 1, ``--seed 1`` with 2 and 3)."""
    if not 0 <= index < workers:
        raise ValueError(f"index: expected 0 <= index < {workers}, got {index}")
    return seed * workers + index


def split_examples(examples: int, workers: int) -> list[int]:
    """``examples`` over ``workers``: ``examples // workers`` each and one more for each of the
    first ``examples % workers`` (10 over 4: 3, 3, 2, 2)."""
    if workers < 1:
        raise ValueError(f"workers: expected at least 1, got {workers}")
    q, r = divmod(examples, workers)
    return [q + (i < r) for i in range(workers)]


def plan_shares(seed: int, examples: int, workers: int) -> list[Share]:
    """The :class:`Share` of each worker (:func:`worker_seed`, :func:`split_examples`). Every
    worker draws at least one example: ``examples < workers`` is a ValueError."""
    if examples < workers:
        raise ValueError(f"--examples {examples}: fewer than --gpus {workers}; each worker draws "
                         f"at least one example")
    return [Share(i, worker_seed(seed, i, workers), n)
            for i, n in enumerate(split_examples(examples, workers))]


def share_cases(kernel, share: Share, **options) -> list[dict]:
    """The cases ``share`` draws, each with its verdict (:func:`case_record`), fuzzed in this
    process: what its worker lists in a sharded run's JSON. ``options`` go to :func:`fuzz`
    (``max_cost``, ``input_modes``, ...)."""
    return fuzz(kernel, examples=share.examples, seed=share.seed, **options).cases


def _worker_entry(w: dict) -> dict:
    r = w["run"]
    m = r.get("minimal")
    return {"index": w["index"], "device": w.get("device"), "var": w.get("var"),
            "threads": w.get("threads"), "seed": w["seed"], "max_examples": w["max_examples"],
            "examples": r["examples"], "shrink_steps": r["shrink_steps"],
            "declined_draws": r["declined_draws"], "stopped": r["stopped"],
            "elapsed_s": r["elapsed_s"], "ok": r["ok"],
            "minimal": None if m is None else {"describe": m["describe"], "command": m["command"]},
            "cases": w.get("cases", [])}


def failing_worker(workers: list[dict]) -> dict | None:
    """The worker whose failure a sharded run reports: the lowest-numbered one that failed
    (never the first to finish, which depends on timing); None when all passed."""
    failed = [w for w in workers if not w["run"]["ok"]]
    return min(failed, key=lambda w: w["index"]) if failed else None


def merge_workers(workers: list[dict], kernel_spec: str, seed: int, *, elapsed_s: float,
                  source_hash: str | None) -> dict:
    """One ``refattn fuzz --json`` document from the workers' documents (as
    :func:`worker_main` writes them, in any order): the schema of a one-device run (examples,
    declined draws summed; the minimal case, shrink steps and limit of :func:`failing_worker`)
    plus ``workers``, one entry per worker in index order."""
    workers = sorted(workers, key=lambda w: w["index"])
    runs = [w["run"] for w in workers]
    chosen = failing_worker(workers)
    if chosen is not None:
        stopped = chosen["run"]["stopped"]
    else:
        stopped = "time" if any(r["stopped"] == "time" for r in runs) else "examples"
    return {"schema": SCHEMA, "kind": "fuzz", "kernel": runs[0]["kernel"],
            "kernel_spec": kernel_spec, "kernel_source_hash": source_hash, "ok": chosen is None,
            "seed": seed, "examples": sum(r["examples"] for r in runs),
            "shrink_steps": 0 if chosen is None else chosen["run"]["shrink_steps"],
            "declined_draws": sum(r["declined_draws"] for r in runs), "stopped": stopped,
            "elapsed_s": round(elapsed_s, 3), "axes": runs[0]["axes"],
            "minimal": None if chosen is None else chosen["run"]["minimal"],
            "workers": [_worker_entry(w) for w in workers]}


def worker_main(argv: list[str]) -> int:
    """A worker process of ``refattn fuzz --gpus``, started with its environment already pinned
    (:func:`refattn.sharding.worker_environment`). ``argv[0]`` is the JSON of its spec: the
    kernel, its :class:`Share`, the fuzz options, and the file to write its document to (the
    one-device JSON under ``run``, where it ran, the cases it drew). Progress and errors go
    to stderr. Exit status: 0 no failure, 1 a failure found and shrunk, 2 the kernel cannot
    run here or the options are refused."""
    from refattn.kernels import KernelError, get_kernel, kernel_available, kernel_source_hash
    from refattn.reference import THREADS_ENV

    spec = json.loads(argv[0])
    var = spec.get("var")
    device = os.environ.get(var) if var else None
    where = f"worker {spec['index']}" + (f" ({var}={device})" if var else "")
    try:
        kernel = get_kernel(spec["kernel_spec"])
    except KernelError as e:
        print(f"{e} (on {where})", file=sys.stderr, flush=True)
        return 2
    ok, reason = kernel_available(kernel)
    if not ok:
        print(f"kernel: {spec['kernel_spec']!r} is not available on {where}: {reason}",
              file=sys.stderr, flush=True)
        return 2
    try:
        run = fuzz(kernel, examples=spec["examples"], seed=spec["seed"],
                   max_seconds=spec.get("max_seconds"), shrink_seconds=spec["shrink_seconds"],
                   max_cost=spec["max_cost"], progress=_progress(bool(spec.get("quiet"))),
                   input_modes=tuple(spec["input_modes"]))
    except (ValueError, CaseError) as e:
        print(str(e), file=sys.stderr, flush=True)
        return 2
    doc = {"index": spec["index"], "device": device, "var": var,
           "threads": os.environ.get(THREADS_ENV), "seed": spec["seed"],
           "max_examples": spec["examples"],
           "run": to_json(run, spec["kernel_spec"], kernel_source_hash(kernel)),
           "cases": run.cases,
           "failure_message": None if run.ok else run.minimal_result.failure_message()}
    out = Path(spec["out"])
    tmp = out.with_name(out.name + ".part")
    tmp.write_text(json.dumps(doc), encoding="utf-8")
    tmp.replace(out)
    return 0 if run.ok else 1


@dataclass
class _Worker:
    share: Share
    device: str | None
    proc: subprocess.Popen
    out: Path
    tail: deque
    relay: threading.Thread


def _start_worker(share: Share, workers: int, devices, tmp: Path, spec: dict, quiet: bool,
                  log) -> _Worker:
    from refattn.sharding import worker_environment

    env, dev = worker_environment(share.index, workers, devices, tmp)
    out = tmp / f"worker{share.index}.json"
    full = {**spec, "index": share.index, "seed": share.seed, "examples": share.examples,
            "var": devices.var, "out": str(out), "quiet": quiet}
    proc = subprocess.Popen([sys.executable, "-c", WORKER_CODE, json.dumps(full)], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace")
    tail: deque = deque(maxlen=WORKER_TAIL_LINES)

    def relay() -> None:
        for line in proc.stdout:
            tail.append(line.rstrip("\n"))
            if not quiet:
                log(f"[worker {share.index}] {line.rstrip()}")

    t = threading.Thread(target=relay, daemon=True)
    t.start()
    return _Worker(share, dev, proc, out, tail, t)


def _stop(workers: list[_Worker]) -> None:
    for w in workers:
        if w.proc.poll() is None:
            w.proc.terminate()
    for w in workers:
        try:
            w.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()


def run_workers(kernel_spec: str, shares: list[Share], devices, *, spec: dict,
                quiet: bool = False, log=None, poll_s: float = 0.1) -> list[dict]:
    """Run one worker process per share, worker ``i`` pinned to device ``i`` of ``devices``,
    relaying their progress lines to ``log`` (``[worker i] ...``), and return their documents
    in index order. ``spec``: the options of :func:`fuzz` as :func:`worker_main` reads them.
    Raises :class:`refattn.sharding.ShardError` when a worker cannot run the kernel (its
    message) or ends without a document (its exit status and last lines); the other workers
    are stopped then."""
    from refattn.sharding import ShardError

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    spec = {**spec, "kernel_spec": kernel_spec}
    with tempfile.TemporaryDirectory(prefix="refattn-fuzz-") as tmp:
        started: list[_Worker] = []
        docs: dict[int, dict] = {}
        try:
            for sh in shares:
                started.append(_start_worker(sh, len(shares), devices, Path(tmp), spec, quiet,
                                             log))
                if not quiet:
                    pin = f"{devices.var}={started[-1].device}" if devices.var else "not pinned"
                    log(f"fuzz: worker {sh.index}: {pin}, seed {sh.seed}, "
                        f"up to {sh.examples} examples")
            pending = list(started)
            while pending:
                for w in list(pending):
                    rc = w.proc.poll()
                    if rc is None:
                        continue
                    pending.remove(w)
                    w.relay.join(timeout=5)
                    if rc in (0, 1) and w.out.is_file():
                        docs[w.share.index] = json.loads(w.out.read_text(encoding="utf-8"))
                        if not quiet:
                            log(_done_line(docs[w.share.index]))
                        continue
                    _stop(pending)
                    last = "\n".join(w.tail)
                    if rc == 2 and w.tail:  # the worker's own message (worker_main)
                        raise ShardError(last.strip())
                    raise ShardError(f"--gpus: worker {w.share.index} exited with status {rc} "
                                     f"and no result\n--- its output (tail) ---\n{last}")
                if pending:
                    time.sleep(poll_s)
        except BaseException:
            _stop(started)
            raise
    return [docs[sh.index] for sh in shares]


def _done_line(doc: dict) -> str:
    r = doc["run"]
    what = ("none failing" if r["ok"] else
            f"example {r['examples']} failed, shrunk in {r['shrink_steps']} steps to "
            f"{r['minimal']['describe']}")
    return (f"fuzz: worker {doc['index']} done: {r['examples']} examples, {what}, in "
            f"{r['elapsed_s']:.1f} s")


def _share_command(args, share: Share) -> str:
    """``refattn fuzz`` on one device that draws what ``share``'s worker drew."""
    extra = "" if args.max_cost == DEFAULT_MAX_COST else f" --max-cost {args.max_cost}"
    extra += " --clean-inputs" if args.clean_inputs else ""
    return (f"refattn fuzz --kernel {args.kernel} --seed {share.seed} "
            f"--examples {share.examples}{extra}")


def _run_sharded(args, kernel) -> int:
    """``refattn fuzz --gpus N`` (module docstring, Several GPUs)."""
    from refattn import sharding
    from refattn.cli import EXIT_FAIL, EXIT_OK, UsageError, _console, write_outputs
    from refattn.fileio import json_text
    from refattn.kernels import kernel_source_hash

    devices = sharding.visible_devices()
    try:
        sharding.require_devices(args.gpus, devices)
        shares = plan_shares(args.seed, args.examples, args.gpus)
    except (sharding.ShardError, ValueError) as e:
        raise UsageError(str(e)) from None
    name = getattr(kernel, "name", args.kernel)
    if not args.quiet:
        print(f"fuzz: kernel {name}, up to {args.examples} examples on {args.gpus} workers, "
              f"seed {args.seed}; {len(devices)} device(s) visible ({devices.source})",
              file=sys.stderr, flush=True)
    spec = {"max_seconds": args.max_seconds, "shrink_seconds": args.shrink_seconds,
            "max_cost": args.max_cost,
            "input_modes": [] if args.clean_inputs else list(DEFAULT_INPUT_MODES)}
    t0 = time.perf_counter()
    try:
        workers = run_workers(args.kernel, shares, devices, spec=spec, quiet=args.quiet)
    except sharding.ShardError as e:
        raise UsageError(str(e)) from None
    doc = merge_workers(workers, args.kernel, args.seed, elapsed_s=time.perf_counter() - t0,
                        source_hash=kernel_source_hash(kernel))
    written = write_outputs(json_text(doc), [Path(args.json)] if args.json else [], "fuzz")
    out = _console()
    limit = {"examples": "", "time": f" (stopped at --max-seconds {args.max_seconds})",
             "shrink time": f" (shrinking stopped at --shrink-seconds {args.shrink_seconds:g})"
             }[doc["stopped"]]
    if doc["ok"]:
        out.print(f"OK: kernel {doc['kernel']}: {doc['examples']} examples over {args.gpus} "
                  f"workers, none failing, in {doc['elapsed_s']:.1f} s{limit}", markup=False)
        return EXIT_OK if written else EXIT_FAIL
    w = failing_worker(workers)
    pin = f"{w['var']}={w['device']}, " if w.get("var") else ""
    m = doc["minimal"]
    out.print(f"FAILED: kernel {doc['kernel']}: worker {w['index']} ({pin}seed {w['seed']}): "
              f"example {w['run']['examples']} of its share failed; shrunk in "
              f"{doc['shrink_steps']} steps to {m['describe']}{limit} ({doc['examples']} "
              f"examples over {args.gpus} workers)\n", markup=False)
    others = [x["index"] for x in workers if not x["run"]["ok"] and x is not w]
    if others:
        out.print(f"workers {', '.join(map(str, others))} failed too: their minimal cases are "
                  f"in the JSON's workers list\n", markup=False)
    out.print((w.get("failure_message") or "") + "\n", markup=False, highlight=False)
    out.print("paste into a case file:\n\n" + m["toml"], markup=False, highlight=False)
    out.print("reproduce:\n\n  " + m["command"], markup=False, highlight=False)
    share = shares[w["index"]]
    out.print("\nthe worker's search alone, on one device:\n\n  " + _share_command(args, share),
              markup=False, highlight=False)
    return EXIT_FAIL
