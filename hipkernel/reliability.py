"""Reliability of the fused kernel on a GPU: is it deterministic, does it survive random
geometries, and is it clean under compute-sanitizer?

Kernel calls go through :func:`run_kernel`: ``hipkernel.attention`` with the device output
buffer primed with the NaN canary, so an element the kernel never writes is seen (the plain
API copies back a fresh device allocation, which hides it).

Every function takes a backend object ``be`` (``hipkernel.backends.get_backend()``, or any
object with the same compile/alloc/htod/dtoh/launch/synchronize/time_ms interface) and
returns a JSON-able dict with an ``ok`` field, so ``hipkernel.gpu_session`` can stamp it into
a ``reliability`` record (``hipkernel.record``):

* :func:`determinism` runs each case ``runs`` times with one explicit config (the case's, or
  the one the autotuner picks; ``HIPKERNEL_TUNE=0`` means the tuner's default; or each of a
  given list) and asks whether the outputs are bitwise identical. A kernel without atomics or split-KV reductions
  has no reason to differ; one that does would make every other GPU record irreproducible.
* :func:`fuzz` draws ``n`` random geometries (:func:`random_geometry`), runs the kernel on
  each with a NaN-prefilled output buffer, and judges it against the fp64 reference under
  the derived gate (docs/semantics.md, Tolerance model): ``metrics.compare`` against
  ``reference.attention_with_baseline``. Each failure carries its :class:`Geometry`, and
  ``run_one(be, Geometry(**failure["geometry"]))`` reproduces it.
* ``python -m hipkernel.reliability --sanitize-target`` (:func:`sanitize_target`) is the
  process to wrap in ``compute-sanitizer``: the case matrix once, ``HIPKERNEL_TUNE=0`` (every
  launch config the cases use, no tuning sweep), exit status 0 or 1.
  :func:`sanitizer_commands` gives the command lines and :func:`parse_sanitizer_summary`
  reads the tool's final summary lines back.

Nothing here imports a GPU runtime at module level: the pure parts (geometry sampling,
summary parsing, the bookkeeping of :func:`determinism` and :func:`fuzz`) run in CI on
``tests.fake_backend``-style backends.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace

import numpy as np

from hipkernel import api
from hipkernel.autotune import tune_key
from hipkernel.config import (CANDIDATES, DEFAULT, HEAD_DIMS, MMA_DEFAULT, MMA_PACK_CANDIDATES,
                              MMA_WALK_CANDIDATES, MMA_WIDE_CANDIDATES, WGMMA_TILES,
                              WGSPAN_CANDIDATES, WGSPAN_HEAD_DIMS, WIDE_HEAD_DIMS, KernelConfig,
                              candidates, config_from_name, has_mma, has_wgmma)
from refattn.args import check_attention_args
from refattn.cases import OUT_CANARY_BITS, Case, canary_out, load_suites, make_inputs
from refattn.fileio import atomic_write_text
from refattn.metrics import compare
from refattn.sanitize import SANITIZER_TOOLS, parse_sanitizer_summary, stopped_clean  # noqa: F401
from refattn.reference import attention_with_baseline

# Reference cost cap for one fuzz example: B * Hq * Sq * (keys a row block touches), the
# number of (row, key) score pairs the fp64 reference computes. At 2**21 pairs and d = 128
# the reference (scores, P.V and the baseline's P.V, fp64) is ~1.6 GFLOP; measured over
# random_geometry's mix, inputs plus reference average ~55 ms an example on 2 cores, so 500
# examples cost well under a minute of host time.
DEFAULT_MAX_COST = 2**21
MAX_FAILURES_KEPT = 50  # failures listed in a fuzz report (all are counted)
FUZZ_HQ_HKV = tuple((hkv * g, hkv) for hkv in (1, 2, 4, 8) for g in (1, 2, 4, 8))


def _finite(x) -> float | None:
    """A JSON-safe float (records are written with ``allow_nan=False``)."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _unwritten(out: np.ndarray) -> int:
    """Elements of ``out`` that still hold the canary bit pattern (never written)."""
    return int((out.view(np.uint16) == OUT_CANARY_BITS).sum())


def _bf16_values(bits: np.ndarray) -> np.ndarray:
    """The float32 values of a buffer of bf16 bit patterns (any 16-bit dtype)."""
    return (bits.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _bits_for(case: Case, buf: np.ndarray) -> np.ndarray:
    """The canary buffer as :func:`run_kernel` takes it for ``case``: float16, or for a bf16
    case the same bits as uint16."""
    return buf.view(np.uint16) if case.dtype == "bf16" else buf


def _case_config(case: Case) -> KernelConfig | None:
    if not case.config:
        return None
    return KernelConfig(case.config.get("m_tiles", DEFAULT.m_tiles),
                        case.config.get("bkv", DEFAULT.bkv), case.config.get("path", DEFAULT.path))


def _supported(case: Case) -> bool:
    return api.decline_reason(d=case.d, softcap=case.softcap, dtype=case.dtype) is None


def run_kernel(be, q, k, v, *, out, past_len, q_len=None, window=-1, sink=None,
               smooth_softmax=False, softcap=0.0, scale=None, config=None, mutants=frozenset(),
               dtype: str = "fp16") -> int:
    """``hipkernel.attention`` with the device output buffer primed from ``out``.

    ``hipkernel.attention(out=...)`` allocates the device output buffer and copies it back
    whole, so an element the kernel never writes returns whatever that allocation held:
    zeros, or a previous call's output (freed memory is reused), never the host canary.
    Here the device buffer starts as a copy of ``out`` (the NaN canary), so an unwritten
    element comes back as the canary and is counted. Everything else is the same: host
    argument checks, the host-side decline (nothing launched, ``out`` untouched), and
    ``flash_prefill_v3`` on device buffers. Ragged ``past_len`` / ``q_len`` arrays are passed
    on. ``dtype="bf16"``: q, k, v float32 holding bf16 values, and ``out`` a uint16 array of
    bf16 bit patterns (primed with the canary bits, as the fp16 one). Returns the status (0
    or -1)."""
    a = check_attention_args(q, k, v, past_len=past_len, q_len=q_len, window=window, sink=sink,
                             smooth_softmax=smooth_softmax, softcap=softcap, scale=scale,
                             allow_cache_capacity=True, allow_ragged=True)
    want = np.uint16 if dtype == "bf16" else np.float16
    if not (isinstance(out, np.ndarray) and out.shape == q.shape and out.dtype == want
            and out.flags.c_contiguous and out.flags.writeable):
        raise ValueError(f"out: expected a writeable C-contiguous {np.dtype(want).name} array of "
                         f"shape {q.shape}")
    held = np.float32 if dtype == "bf16" else np.float16
    if not all(x.dtype == held for x in (q, k, v)):
        dtype = "mixed"
    if api.decline_reason(d=a.d, softcap=a.softcap, dtype=dtype) is not None:
        return -1
    if dtype == "bf16":  # the device holds the bit patterns: each float32's top half
        q, k, v = ((np.ascontiguousarray(x).view(np.uint32) >> 16).astype(np.uint16)
                   for x in (q, k, v))
    sink16 = np.asarray(sink, dtype=np.float16) if a.sink_mode == "per_head" else None
    past = a.past_len if not a.ragged else np.asarray(a.past_lens, dtype=np.int64)
    lens = None if not a.ragged else np.asarray(a.q_lens, dtype=np.int64)
    bufs = {}
    try:
        for name, arr in (("q", q), ("k", k), ("v", v), ("sink", sink16), ("out", out)):
            if arr is not None:
                arr = np.ascontiguousarray(arr)
                bufs[name] = be.alloc(arr.nbytes)
                be.htod(bufs[name], arr)
        status = api.flash_prefill_v3(
            be, bufs["q"], bufs["k"], bufs["v"], bufs.get("sink", 0), bufs["out"],
            B=a.B, Sq=a.Sq, Hq=a.Hq, Hkv=a.Hkv, d=a.d, S_cap=k.shape[2], past_len=past,
            q_len=lens, window=a.window, sink_mode=a.sink_mode, scale=a.scale,
            softcap=a.softcap, dtype=dtype, config=config, mutants=mutants)
        if status == 0:
            be.dtoh(out, bufs["out"])
        return status
    finally:
        for ptr in bufs.values():
            be.free(ptr)


# --------------------------------------------------------------------------- determinism

def resolve_config(be, case: Case) -> KernelConfig:
    """The config a plain call of ``case`` runs with: the case's own, else the autotuner's
    choice for its key (sweeping once if the key is new), else the tuner's default
    (``config.DEFAULT``) when ``HIPKERNEL_TUNE=0``."""
    cfg = _case_config(case)
    if cfg is not None:
        return cfg
    tuner = api.TUNER
    if not tuner.enabled():
        return tuner.default
    key = tune_key(d=case.d, sq=case.sq, Hq=case.Hq, G=case.G, window=case.window,
                   dtype=case.dtype, arch=be.arch, ragged=case.ragged)
    if key not in tuner.cache:
        inputs = make_inputs(case)
        api.attention(inputs.q, inputs.k, inputs.v, out=inputs.out if case.dtype == "fp16" else None,
                      backend=be, dtype=case.dtype,
                      **inputs.reference_kwargs())  # config=None: sweeps and caches the key
    return tuner.cache.get(key, tuner.default)


def determinism(be, cases, runs: int = 3, configs=None) -> dict:
    """Run each case ``runs`` times with one explicit config and compare the outputs bit for
    bit. The config is :func:`resolve_config`'s (the case's, the autotuned one, or the
    default under ``HIPKERNEL_TUNE=0``); with ``configs`` (e.g. ``config.candidates(be.arch)``)
    each case runs under each of those instead, one row per (case, config).

    Per row: ``identical`` (every run returned 0 and the runs are byte-equal), ``max_diff``
    (largest element-wise difference from the first run; None where NaN positions differ),
    and ``unwritten`` (most canary elements any run left; must be 0). Declined cases are run
    once and must return -1 with the buffer byte-identical (``declined_ok``)."""
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 2:
        raise ValueError(f"runs: expected an int >= 2, got {runs!r}")
    t0 = time.perf_counter()
    rows = []
    for case in cases:
        inputs = make_inputs(case)
        if not _supported(case):
            status = run_kernel(be, inputs.q, inputs.k, inputs.v, out=_bits_for(case, inputs.out),
                                config=_case_config(case), dtype=case.dtype,
                                **inputs.reference_kwargs())
            # Nothing to compare; the contract is checked instead: -1, buffer untouched.
            rows.append({"case": case.id, "describe": case.describe(), "declined": True,
                         "status": [int(status)],
                         "declined_ok": bool(status == -1 and inputs.out_intact())})
            continue
        # A ragged case runs under no config that copies with TMA (hipkernel.api refuses it).
        for cfg in ([resolve_config(be, case)] if configs is None
                    else [c for c in configs if not (case.ragged and c.tma)]):
            rows.append(_repeat(be, case, inputs, cfg, runs))
    ran = [r for r in rows if not r["declined"]]
    bad_declines = [r["case"] for r in rows if r["declined"] and not r["declined_ok"]]
    nondet = [f"{r['case']} {r['config']}" for r in ran if not r["identical"]]
    incomplete = [f"{r['case']} {r['config']}" for r in ran if r["unwritten"]]
    return {
        "kind": "determinism", "runs": runs, "tune": api.TUNER.enabled(),
        "n_rows": len(rows), "n_run": len(ran), "n_declined": len(rows) - len(ran),
        "n_identical": len(ran) - len(nondet), "nondeterministic": nondet,
        "incomplete": incomplete, "bad_declines": bad_declines,
        "ok": not nondet and not incomplete and not bad_declines,
        "wall_s": round(time.perf_counter() - t0, 3), "cases": rows,
    }


def _repeat(be, case: Case, inputs, cfg: KernelConfig, runs: int) -> dict:
    outs, statuses, unwritten = [], [], 0
    for _ in range(runs):
        out = inputs.fresh_out()
        status = run_kernel(be, inputs.q, inputs.k, inputs.v, out=_bits_for(case, out), config=cfg,
                            dtype=case.dtype, **inputs.reference_kwargs())
        statuses.append(int(status))
        unwritten = max(unwritten, _unwritten(out))
        outs.append(_bf16_values(out) if case.dtype == "bf16" else out)
    first = outs[0]
    identical = all(o.tobytes() == first.tobytes() for o in outs[1:])
    max_diff = None
    if all(np.array_equal(np.isnan(o), np.isnan(first)) for o in outs[1:]):
        f64 = first.astype(np.float64)
        max_diff = _finite(max(float(np.max(np.abs(np.where(np.isnan(f64), 0, o.astype(np.float64) - f64))))
                               for o in outs[1:]))
    return {"case": case.id, "describe": case.describe(), "declined": False, "config": cfg.name,
            "runs": runs, "status": statuses,
            "identical": bool(identical and all(s == 0 for s in statuses)),
            "max_diff": max_diff, "unwritten": unwritten}


# --------------------------------------------------------------------------- fuzzing

@dataclass(frozen=True)
class Geometry:
    """One fuzz example: the geometry, options, input seed and kernel config. Inputs come
    from ``refattn.cases.make_inputs`` of :meth:`case` (fp16 N(0, 1), per-head sinks
    U(-2, 4), NaN canaries in the cache padding). ``tight`` drops the padding: the cache is
    exactly ``past_len + Sq`` keys long, so a read past it leaves the allocation."""

    B: int
    Sq: int
    Hq: int
    Hkv: int
    d: int
    past_len: int
    window: int
    sink: str  # "none" | "per_head" | "smooth"
    seed: int
    config: str  # KernelConfig.name, e.g. "m4_b64"
    tight: bool = False
    scale: float | None = None

    @property
    def skv(self) -> int:
        return self.past_len + self.Sq

    @property
    def cost(self) -> int:
        """(row, key) score pairs the fp64 reference computes: under a window a block of
        rows touches about Sq + W keys, not all of them."""
        keys = self.skv if self.window < 0 else min(self.skv, self.window + self.Sq)
        return self.B * self.Hq * self.Sq * keys

    def kernel_config(self) -> KernelConfig:
        return config_from_name(self.config)

    def case(self) -> Case:
        """The inputs' recipe (the config is passed to the kernel explicitly, not via the case)."""
        return Case(name=f"fuzz-{self.seed}", suite="fuzz", Hq=self.Hq, Hkv=self.Hkv, d=self.d,
                    sq=self.Sq, B=self.B, past_len=self.past_len, window=self.window,
                    sink=self.sink, seed=self.seed, scale=self.scale, why="random geometry")

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return (f"B{self.B} sq{self.Sq} Hq{self.Hq}/Hkv{self.Hkv} d{self.d} past{self.past_len} "
                f"w{self.window} {self.sink} {self.config}" + (" tight" if self.tight else "")
                + ("" if self.scale is None else f" scale={self.scale:g}") + f" seed{self.seed}")


def random_geometry(rng: np.random.Generator, max_cost: int = DEFAULT_MAX_COST,
                    configs=CANDIDATES) -> Geometry:
    """A random kernel call: d in {64, 128}; (Hq, Hkv) with G and Hkv in {1, 2, 4, 8}; B 1-2;
    Sq 1-300 (often 1-16: ragged tails); past_len 0-3000 (often 0); window -1 or 1-600
    (often 1-8: rows that see almost nothing); sink none / per_head / smooth; a config drawn
    from ``configs``; sometimes a tight cache or a sharp scale. Shrunk (heads first, then past_len,
    then Sq) until :attr:`Geometry.cost` <= ``max_cost``."""
    Hq, Hkv = FUZZ_HQ_HKV[rng.integers(len(FUZZ_HQ_HKV))]
    d = int(rng.choice(HEAD_DIMS))
    Sq = int(rng.integers(1, 17) if rng.random() < 0.3 else rng.integers(1, 301))
    past = 0 if rng.random() < 0.3 else int(rng.integers(0, 3001))
    u = rng.random()
    window = -1 if u < 0.45 else int(rng.integers(1, 9) if u < 0.6 else rng.integers(1, 601))
    sink = str(rng.choice(["none", "per_head", "smooth"]))
    fitting = [c for c in configs if c.fits(d)]  # (a 128-key wgmma tile does not at d = 128)
    config = fitting[rng.integers(len(fitting))]
    tight = bool(rng.random() < 0.25)
    scale = None if rng.random() < 0.8 else float(rng.choice([0.5, 2.0]))  # sharp softmax
    g = fit_cost(Geometry(B=int(rng.integers(1, 3)), Sq=Sq, Hq=int(Hq), Hkv=int(Hkv), d=d,
                          past_len=past, window=window, sink=sink,
                          seed=int(rng.integers(0, 2**31)), config=config.name, tight=tight,
                          scale=scale), max_cost)
    # a packed config keeps the most of its packing that the shrunk G allows
    return replace(g, config=config.for_group(g.Hq // g.Hkv).name)


def fit_cost(g: Geometry, max_cost: int = DEFAULT_MAX_COST) -> Geometry:
    """``g`` shrunk until its reference cost is at most ``max_cost``: first the query heads
    per KV head, then the KV heads, the batch, past_len and finally Sq (each halved), so
    ragged lengths and windows survive and only the work shrinks."""
    g = asdict(g)
    while Geometry(**g).cost > max_cost:
        if g["Hq"] > g["Hkv"]:
            g["Hq"] = g["Hkv"] * ((g["Hq"] // g["Hkv"]) // 2)
        elif g["Hkv"] > 1:
            g["Hq"] //= 2
            g["Hkv"] //= 2
        elif g["B"] > 1:
            g["B"] = 1
        elif g["past_len"] > 0:
            g["past_len"] //= 2
        elif g["Sq"] > 1:
            g["Sq"] //= 2
        else:
            break
    return Geometry(**g)


def run_one(be, g: Geometry, *, mutants=frozenset()) -> dict:
    """Run the kernel on ``g`` into a NaN-prefilled buffer and judge it against the fp64
    reference under the derived gate. ``passed`` needs status 0, every element written,
    and the comparison passed."""
    inputs = make_inputs(g.case())
    k_clean, v_clean = inputs.clean_kv()
    if g.tight:
        k, v = np.ascontiguousarray(k_clean), np.ascontiguousarray(v_clean)
    else:
        k, v = inputs.k, inputs.v
    kw = inputs.reference_kwargs()
    t0 = time.perf_counter()
    ref, base = attention_with_baseline(inputs.q, k_clean, v_clean, **kw)
    t1 = time.perf_counter()
    out = canary_out(inputs.q.shape)
    status = run_kernel(be, inputs.q, k, v, out=out, config=g.kernel_config(), mutants=mutants, **kw)
    t2 = time.perf_counter()
    unwritten = _unwritten(out)
    row = {"geometry": g.to_dict(), "describe": g.describe(), "status": int(status),
           "unwritten": unwritten, "reference_s": t1 - t0, "kernel_s": t2 - t1}
    if status != 0:
        row.update(passed=False, summary=f"status {status}: the kernel declined a supported call")
        return row
    c = compare(out, ref, base)
    row.update(passed=bool(c.passed and unwritten == 0), rel_l2=_finite(c.rel_l2),
               max_abs=_finite(c.max_abs), gate_rel_l2=_finite(c.gate_rel_l2),
               gate_max_abs=_finite(c.gate_max_abs),
               summary=c.summary() + (f"; {unwritten} elements never written" if unwritten else ""))
    if not c.passed:
        row["failure_message"] = c.failure_message()
    return row


def fuzz(be, n: int = 500, seed: int = 0, *, max_cost: int = DEFAULT_MAX_COST,
         configs=None, mutants=frozenset(), progress=None) -> dict:
    """``n`` random geometries (:func:`random_geometry` from ``default_rng(seed)``), each run
    by :func:`run_one`. Explicit configs drawn from ``configs`` (default: the autotune
    candidates of ``be.arch``, so the mma path too where it exists): every compiled variant
    is fuzzed and no tuning sweep runs. Returns counts, the failures (with
    the geometry to reproduce them; the first ``MAX_FAILURES_KEPT``), the worst ratio of
    error to gate, and wall/kernel/reference time. ``progress(i, n, row)`` is called after
    each example."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n: expected an int >= 1, got {n!r}")
    configs = tuple(candidates(be.arch) if configs is None else configs)
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    passed = failed = 0
    failures, worst = [], None
    t_kernel = t_ref = 0.0
    for i in range(n):
        g = random_geometry(rng, max_cost, configs)
        try:
            row = run_one(be, g, mutants=mutants)
        except Exception as e:  # noqa: BLE001 - a crash on one geometry is a failure to report
            row = {"geometry": g.to_dict(), "describe": g.describe(), "passed": False,
                   "summary": f"raised {type(e).__name__}: {e}",
                   "traceback": traceback.format_exc(limit=4)}
        t_kernel += row.get("kernel_s", 0.0)
        t_ref += row.get("reference_s", 0.0)
        if row["passed"]:
            passed += 1
        else:
            failed += 1
            if len(failures) < MAX_FAILURES_KEPT:
                failures.append({k: v for k, v in row.items() if k not in ("kernel_s", "reference_s")})
        if row.get("rel_l2") is not None and row.get("gate_rel_l2"):
            ratio = max(row["rel_l2"] / row["gate_rel_l2"], row["max_abs"] / row["gate_max_abs"])
            if worst is None or ratio > worst["ratio"]:
                worst = {"ratio": ratio, "describe": row["describe"], "summary": row["summary"]}
        if progress is not None:
            progress(i, n, row)
    return {
        "kind": "fuzz", "n": n, "seed": seed, "max_cost": max_cost,
        "configs": [c.name for c in configs],
        "mutants": sorted(mutants), "passed": passed, "failed": failed,
        "ok": failed == 0, "worst": worst, "failures": failures,
        "wall_s": round(time.perf_counter() - t0, 3), "kernel_s": round(t_kernel, 3),
        "reference_s": round(t_ref, 3),
        "reproduce": "hipkernel.reliability.run_one(be, Geometry(**failure['geometry']))",
    }


# --------------------------------------------------------------------------- sanitizer



def sanitizer_commands(suites=("seed", "extended", "coverage", "ragged"), python: str = "python",
                       extra: str = "") -> dict[str, str]:
    """The command line per compute-sanitizer tool, run from the repository root with
    ``PYTHONPATH=.``. ``extra`` is appended to the target's arguments (e.g. ``-k w128``)."""
    target = (f"{python} -m hipkernel.reliability --sanitize-target --suites {','.join(suites)}"
              + (f" {extra}" if extra else ""))
    return {tool: f"compute-sanitizer {opts} {target}" for tool, opts in SANITIZER_TOOLS.items()}


def sanitizer_script(suites=("seed", "extended", "coverage", "ragged"), out_dir: str = "sanitizer",
                     tools=("memcheck", "racecheck"), python: str = "python") -> str:
    """A bash script that runs each tool over the target, keeps each log, and ends by parsing
    the logs into JSON (``--parse-sanitizer``, exit 0 iff every log is clean)."""
    cmds = sanitizer_commands(suites, python)
    lines = ["#!/usr/bin/env bash", "# compute-sanitizer over the case matrix "
             "(written by hipkernel.reliability.sanitizer_script)", "set -u",
             "export PYTHONPATH=.", f"mkdir -p {out_dir}"]
    for tool in tools:
        lines.append(f"{cmds[tool]} > {out_dir}/{tool}.log 2>&1; echo \"{tool}: exit $?\"")
    logs = " ".join(f"{out_dir}/{t}.log" for t in tools)
    lines.append(f"{python} -m hipkernel.reliability --parse-sanitizer {logs}")
    return "\n".join(lines) + "\n"


_now = time.monotonic  # the sanitize target's clock for its time budget


def case_cost(case: Case) -> int:
    """Visible (query, key) pairs of ``case`` over its heads and batch: what a sanitizer's
    run time grows with."""

    return case.visible_pairs * case.Hq


def sanitize_target(suites=("seed", "extended", "coverage", "ragged"), *, backend=None, match=None, cache: str = "tight",
                    all_configs: bool = False, judge: bool = False, cheapest_first: bool = False,
                    time_budget: float | None = None, out=None) -> int:
    """The case matrix once on the kernel, for compute-sanitizer. ``HIPKERNEL_TUNE=0``, so
    launches use the case configs and ``config.DEFAULT`` only (``all_configs``: every
    autotune candidate of ``be.arch`` too, the mma path included where it exists). ``cache="tight"`` hands the kernel a cache of exactly
    ``past_len + Sq`` keys, so a read past the end of the last head's cache leaves the
    allocation and memcheck sees it; ``"padded"`` is the matrix's NaN-canary layout;
    ``"both"`` runs both. ``cheapest_first`` orders the cases by :func:`case_cost`, so a
    run cut short by a time limit has checked as many cases as it could (each printed line is
    one launch that finished). A supported case must return 0, write every element and stay
    finite (``judge``: and pass the derived gate); a declined one must return -1 with the
    buffer byte-identical. On a target with tensor cores every supported case also runs
    the mma path's default config (and, at d = 64, its 32-rows-a-warp config; and where its
    G > 1, the packed config at the most packing G allows), and on sm_90 the wgmma tiles of
    its head dim (and at d = 64 the wgspan config, packed as G allows), so the sanitizer sees
    every kernel source and tile variant. ``time_budget`` (seconds): no case is started after
    it, and the target says how many it reached and exits as usual, so that a sanitizer run
    that would outlast its own limit still ends with the tool's summary over what ran (with
    ``cheapest_first``, as many cases as fit). Prints one line per launch; returns 0 if all is
    well, else 1."""
    out = out or sys.stdout
    saved = os.environ.get("HIPKERNEL_TUNE")
    os.environ["HIPKERNEL_TUNE"] = "0"
    try:
        return _sanitize_cases(suites, backend, match, cache, all_configs, judge, cheapest_first,
                               out, time_budget)
    finally:
        if saved is None:
            os.environ.pop("HIPKERNEL_TUNE", None)
        else:
            os.environ["HIPKERNEL_TUNE"] = saved


def _sanitize_cases(suites, backend, match, cache, all_configs, judge, cheapest_first, out,
                    time_budget=None) -> int:
    from hipkernel.backends import get_backend

    be = backend if backend is not None and not isinstance(backend, str) else get_backend(backend)
    variants = {"tight": ("tight",), "padded": ("padded",), "both": ("tight", "padded")}.get(cache)
    if variants is None:
        raise ValueError(f"cache: expected tight, padded or both, got {cache!r}")
    cases = load_suites(list(suites))
    if match:
        cases = [c for c in cases if any(s in c.name for s in match)]
    if cheapest_first:
        cases = sorted(cases, key=case_cost)
    print(f"sanitize target: {len(cases)} cases on {be.name} ({be.arch}), cache {cache}, "
          f"HIPKERNEL_TUNE=0", file=out, flush=True)
    bad = launches = 0
    t0 = _now()
    for i, case in enumerate(cases):
        if time_budget is not None and _now() - t0 >= time_budget:
            print(f"sanitize target: time budget of {time_budget:g} s reached after {i} of "
                  f"{len(cases)} cases ({launches} calls)", file=out, flush=True)
            break
        inputs = make_inputs(case)
        supported = _supported(case)
        configs = [_case_config(case)]  # None: the default config (HIPKERNEL_TUNE=0)
        G = case.Hq // case.Hkv
        if supported and has_mma(be.arch):
            configs.append(MMA_DEFAULT)  # the tensor-core paths the autotuner picks there
            if case.d in WIDE_HEAD_DIMS:
                configs.append(MMA_WIDE_CANDIDATES[0])
            packed = MMA_PACK_CANDIDATES[-1].for_group(G)  # the most packing G allows
            if packed.pack > 1:
                configs.append(packed)
            configs.append(MMA_WALK_CANDIDATES[-1].for_group(G))  # and walking Q tiles
            if has_wgmma(be.arch):
                configs += WGMMA_TILES[case.d]
                if case.d in WGSPAN_HEAD_DIMS:  # and the window tile
                    configs.append(WGSPAN_CANDIDATES[0].for_group(G))
        if all_configs and supported:
            configs += [c for c in candidates(be.arch, G=G) if c not in configs]
        if case.ragged:  # hipkernel.api refuses a config that copies with TMA on a ragged call
            configs = [c for c in configs if c is None or not c.tma]
        ref = None
        for variant in variants:
            if variant == "tight":
                k, v = (np.ascontiguousarray(x) for x in inputs.clean_kv())
            else:
                k, v = inputs.k, inputs.v
            bf16 = case.dtype == "bf16"
            for cfg in configs:
                buf = inputs.fresh_out()  # the canary bits; a bf16 kernel's buffer holds bits
                status = run_kernel(be, inputs.q, k, v, out=_bits_for(case, buf), config=cfg,
                                    dtype=case.dtype, **inputs.reference_kwargs())
                launches += 1
                if not supported:
                    ok = status == -1 and inputs.out_intact(buf)
                    note = "declined" if ok else f"status {status} or buffer touched on a decline"
                else:
                    unwritten = _unwritten(buf)
                    vals = _bf16_values(buf) if bf16 else buf
                    finite = bool(np.isfinite(vals).all())
                    ok = status == 0 and unwritten == 0 and finite
                    note = f"status {status}, {unwritten} unwritten, finite={finite}"
                    if ok and judge:
                        if ref is None:
                            kc, vc = inputs.clean_kv()
                            ref = attention_with_baseline(inputs.q, kc, vc, lowp=case.lowp,
                                                          **inputs.reference_kwargs())
                        c = compare(vals, *ref, case.lowp)
                        ok = c.passed
                        note = c.summary()
                name = "default" if cfg is None else cfg.name
                print(f"  {'ok ' if ok else 'BAD'} {case.id:<45} {variant:<6} {name:<8} {note}",
                      file=out, flush=True)
                bad += not ok
    be.synchronize()
    print(f"sanitize target: {launches} calls, {bad} bad", file=out, flush=True)
    return 0 if bad == 0 else 1


# --------------------------------------------------------------------------- records

def record_body(be, *, determinism: dict | None = None, fuzz: dict | None = None,
                sanitizer: dict | None = None) -> tuple[dict, bool]:
    """The body of a ``reliability`` record and its ``ok``: every section given must be ok.
    ``sanitizer`` maps a log name to :func:`parse_sanitizer_summary` output. A log that
    :func:`stopped_clean` goes to ``sanitizer_incomplete`` instead (with the launches it
    checked), where it is reported but neither passes nor fails the record. Stamp it with
    ``hipkernel.record.stamp("reliability", be.device_name, body, ok)``."""
    body = {"backend": be.name, "arch": be.arch}
    if sanitizer:
        incomplete = {k: v for k, v in sanitizer.items() if stopped_clean(v)}
        sanitizer = {k: v for k, v in sanitizer.items() if k not in incomplete} or None
        if incomplete:
            body["sanitizer_incomplete"] = incomplete
    oks = []
    for name, section in (("determinism", determinism), ("fuzz", fuzz), ("sanitizer", sanitizer)):
        if section is None:
            continue
        body[name] = section
        oks.append(all(s["ok"] for s in section.values()) if name == "sanitizer" else section["ok"])
    return body, bool(oks) and all(oks)


# --------------------------------------------------------------------------- command line

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m hipkernel.reliability", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Reliability of the fused kernel: the compute-sanitizer target, the "
                    "sanitizer log parser, and determinism + fuzzing on a GPU.",
        epilog="examples:\n"
               "  compute-sanitizer --tool memcheck --leak-check full --error-exitcode 3 \\\n"
               "      python -m hipkernel.reliability --sanitize-target --suites seed,extended,coverage,ragged\n"
               "  python -m hipkernel.reliability --parse-sanitizer memcheck.log racecheck.log\n"
               "  python -m hipkernel.reliability --run --fuzz-n 500 --out reports/gpu\n"
               "  python -m hipkernel.reliability --print-sanitizer-script\n")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--sanitize-target", action="store_true",
                      help="run the case matrix once with HIPKERNEL_TUNE=0 (wrap in compute-sanitizer)")
    mode.add_argument("--parse-sanitizer", nargs="+", metavar="LOG",
                      help="parse compute-sanitizer logs; print JSON; exit 0 iff all are clean")
    mode.add_argument("--run", action="store_true",
                      help="determinism over --suites and fuzzing; write a reliability record to --out")
    mode.add_argument("--print-sanitizer-script", action="store_true",
                      help="print a bash script running memcheck and racecheck over the target")
    ap.add_argument("--suites", default="seed,extended,coverage,ragged", help="comma-separated case suites")
    ap.add_argument("--backend", default=None, help="cuda or hip (default: first that works)")
    ap.add_argument("-k", dest="match", action="append", metavar="SUBSTRING",
                    help="only cases whose name contains SUBSTRING (repeatable)")
    ap.add_argument("--cache", default="tight", choices=("tight", "padded", "both"),
                    help="KV cache layout for --sanitize-target (default: tight)")
    ap.add_argument("--all-configs", action="store_true",
                    help="--sanitize-target: also run every autotune candidate config")
    ap.add_argument("--cheapest-first", action="store_true",
                    help="--sanitize-target: run the cases in order of cost (visible pairs x heads)")
    ap.add_argument("--time-budget", type=float, default=None, metavar="S",
                    help="--sanitize-target: start no case after S seconds, say how many ran, "
                         "and exit as usual (so the sanitizer prints its summary)")
    ap.add_argument("--judge", action="store_true",
                    help="--sanitize-target: also compare with the fp64 reference")
    ap.add_argument("--fuzz-n", type=int, default=500, help="--run: fuzz examples (default 500)")
    ap.add_argument("--seed", type=int, default=0, help="--run: fuzz seed")
    ap.add_argument("--fuzz-max-cost", type=int, default=DEFAULT_MAX_COST,
                    help=f"--run: reference cost cap per example (default {DEFAULT_MAX_COST})")
    ap.add_argument("--sanitizer-logs", nargs="*", default=(), metavar="LOG",
                    help="--run: parsed compute-sanitizer logs to include in the record")
    ap.add_argument("--out", default=None, help="--run: directory for reliability-h200.json")
    args = ap.parse_args(argv)
    if args.time_budget is not None and not args.time_budget > 0:
        ap.error(f"--time-budget: expected seconds > 0, got {args.time_budget:g}")
    suites = [s for s in args.suites.split(",") if s]

    if args.print_sanitizer_script:
        sys.stdout.write(sanitizer_script(suites))
        return 0
    if args.parse_sanitizer:
        parsed = {path: parse_sanitizer_summary(open(path, errors="replace").read())
                  for path in args.parse_sanitizer}
        print(json.dumps(parsed, indent=2))
        return 0 if all(p["ok"] for p in parsed.values()) else 1
    if args.sanitize_target:
        return sanitize_target(suites, backend=args.backend, match=args.match, cache=args.cache,
                               all_configs=args.all_configs, judge=args.judge,
                               cheapest_first=args.cheapest_first, time_budget=args.time_budget)

    from hipkernel import record
    from hipkernel.backends import get_backend

    be = get_backend(args.backend)
    cases = load_suites(suites)
    if args.match:
        cases = [c for c in cases if any(s in c.name for s in args.match)]
    det = determinism(be, cases)
    print(f"determinism: {det['n_identical']}/{det['n_run']} identical, ok={det['ok']}", flush=True)

    def progress(i, n, row):
        if not row["passed"] or (i + 1) % 50 == 0:
            print(f"  fuzz [{i + 1}/{n}] {'pass' if row['passed'] else 'FAIL'} {row['describe']}: "
                  f"{row['summary']}", flush=True)

    fz = fuzz(be, args.fuzz_n, args.seed, max_cost=args.fuzz_max_cost, progress=progress)
    print(f"fuzz: {fz['passed']}/{fz['n']} passed in {fz['wall_s']:.1f} s", flush=True)
    san = {os.path.basename(p): parse_sanitizer_summary(open(p, errors="replace").read())
           for p in args.sanitizer_logs} or None
    body, ok = record_body(be, determinism=det, fuzz=fz, sanitizer=san)
    rec = record.stamp("reliability", be.device_name, body, ok)
    text = json.dumps(rec, indent=2, allow_nan=False) + "\n"
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "reliability-h200.json")
        atomic_write_text(path, text)
        print(f"wrote {path}: ok={ok}", flush=True)
    else:
        sys.stdout.write(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
