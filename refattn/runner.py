"""Run kernels over cases: one adapter x a list of cases -> judged results.

For each case the runner builds the inputs (``refattn.cases.make_inputs``), asks the kernel
whether it supports the case, runs it, and judges what came back:

=====================  ==========================================================
outcome                when
=====================  ==========================================================
``pass``               supported, status 0, the output passes the derived gate
``fail``               supported, but the output fails the gate, has the wrong
                       shape, or the kernel declined (status -1) anyway
``declined``           not supported, status -1, output buffer byte-identical
``contract-violation`` not supported, but status 0 or the output buffer was
                       written; or a status other than 0 / -1
``error``              the kernel (or the reference) raised
=====================  ==========================================================

A ragged case (sequences with their own lengths) is only run on an adapter that declares
``ragged = True``; any other is reported ``declined`` without being called.

Only ``pass`` and ``declined`` are acceptable. The kernel is judged against the fp64
reference and the low-precision baseline of the same clean inputs
(``refattn.reference.attention_with_baseline``, ``refattn.metrics.compare``). Both depend
only on the case, so they are cached in-process: the mutant matrix runs a dozen kernels over
the same cases and computes each reference once. The reference is computed before the kernel
runs, from inputs the kernel has not yet seen, and only for supported cases. The inputs are
built once a case as well and kept read-only, so no kernel can change what the next one (or
the reference) sees; each run gets a fresh canary output buffer.
"""

from __future__ import annotations

import math
import os
import platform
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace

import numpy as np

from refattn.args import parse_megabytes
from refattn.cases import Case, Inputs, make_inputs
from refattn.metrics import Comparison, compare
from refattn.reference import attention_with_baseline

OUTCOMES = ("pass", "fail", "declined", "contract-violation", "error")
ACCEPTABLE = ("pass", "declined")
SCHEMA = 1


# --------------------------------------------------------------------------- caches

class _CaseLRU:
    """LRU map ``case -> value`` bounded in bytes; ``budget_bytes`` defaults to the
    environment variable ``env`` in MB, else ``default_mb``. Counts hits and misses."""

    def __init__(self, budget_bytes: int | None, env: str, default_mb: int):
        if budget_bytes is None:
            raw = os.environ.get(env, "")
            mb = parse_megabytes(env, raw) if raw.strip() else default_mb
            budget_bytes = int(mb * 2**20)
        elif not (isinstance(budget_bytes, int) and budget_bytes >= 0):
            raise ValueError(f"budget_bytes: expected an int >= 0, got {budget_bytes!r}")
        self.budget = budget_bytes
        self._data: OrderedDict[Case, tuple[object, int]] = OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0

    def _lookup(self, case: Case):
        hit = self._data.get(case)
        if hit is None:
            self.misses += 1
            return None
        self.hits += 1
        self._data.move_to_end(case)
        return hit[0]

    def _store(self, case: Case, value, size: int) -> None:
        """Keep ``value`` (``size`` bytes) unless it alone exceeds the budget; evict the least
        recently used entries down to the budget."""
        if size > self.budget:
            return
        self._data[case] = (value, size)
        self.nbytes += size
        while self.nbytes > self.budget:
            _, (_, old) = self._data.popitem(last=False)
            self.nbytes -= old

    def clear(self) -> None:
        self._data.clear()
        self.nbytes = self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._data)


class ReferenceCache(_CaseLRU):
    """LRU cache of ``case -> (fp64 reference, low-precision baseline)``, bounded in bytes.

    The baseline is rounded to fp16 (bf16 for a bf16 case) by construction, so it is stored
    as float16 (float32 for bf16), losslessly.
    Cached arrays are read-only. Budget: ``$REFATTN_REF_CACHE_MB`` (default 2048 MB; the seed
    suite needs about 0.5 GB)."""

    def __init__(self, budget_bytes: int | None = None):
        super().__init__(budget_bytes, "REFATTN_REF_CACHE_MB", 2048)

    def get(self, case: Case, inputs: Inputs | None = None) -> tuple[np.ndarray, np.ndarray]:
        hit = self._lookup(case)
        if hit is not None:
            return hit
        inputs = inputs if inputs is not None else make_inputs(case)
        k, v = inputs.clean_kv()
        ref, base = attention_with_baseline(inputs.q, k, v, lowp=case.lowp,
                                            **inputs.reference_kwargs())
        base = base.astype(np.float16 if case.lowp == "fp16" else np.float32)
        for a in (ref, base):
            a.flags.writeable = False
        self._store(case, (ref, base), ref.nbytes + base.nbytes)
        return ref, base


class InputCache(_CaseLRU):
    """LRU cache of ``case -> make_inputs(case)``, bounded in bytes: a kill matrix runs a
    dozen kernels over the same cases, and building their inputs (a pure function of the case)
    was most of its host time (one forced config's 14 passes over seed + extended on a CPU-only
    machine: 40 of 57 s).

    ``get`` returns a new :class:`Inputs` each time: the cached q, k, v and sink, read-only (a
    kernel that writes its inputs raises instead of corrupting the next kernel's), and a fresh
    canary output buffer. Budget: ``$REFATTN_INPUT_CACHE_MB`` (default 1024 MB; seed +
    extended need about 0.3 GB)."""

    def __init__(self, budget_bytes: int | None = None):
        super().__init__(budget_bytes, "REFATTN_INPUT_CACHE_MB", 1024)

    def get(self, case: Case) -> Inputs:
        inputs = self._lookup(case)
        if inputs is None:
            inputs = make_inputs(case)
            arrays = [a for a in (inputs.q, inputs.k, inputs.v, inputs.sink) if a is not None]
            for a in arrays:
                a.flags.writeable = False
            self._store(case, inputs, sum(a.nbytes for a in arrays))
        return replace(inputs, out=inputs.fresh_out(),
                       config=None if inputs.config is None else dict(inputs.config))


REFERENCE_CACHE = ReferenceCache()
INPUT_CACHE = InputCache()


def reference_for(case: Case, inputs: Inputs | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The fp64 reference ``(B, Sq, Hq, d)`` and the fp16 baseline of ``case`` (cached)."""
    return REFERENCE_CACHE.get(case, inputs)


# --------------------------------------------------------------------------- results

def _num(x) -> float | None:
    """A JSON-safe float: None for missing or NaN."""
    if x is None:
        return None
    x = float(x)
    return None if math.isnan(x) else x


@dataclass
class Result:
    """One kernel on one case."""

    case: str
    suite: str
    outcome: str
    note: str = ""
    status: int | None = None
    supported: bool | None = None
    rel_l2: float | None = None
    max_abs: float | None = None
    max_abs_at: tuple[int, int, int, int] | None = None  # (b, h, row, col)
    gate: float | None = None  # derived relL2 gate
    gate_max_abs: float | None = None
    seed_gate_pass: bool | None = None
    baseline_rel_l2: float | None = None
    n_nan: int | None = None
    n_inf: int | None = None
    time_s: float | None = None  # kernel run() wall time
    seed_contract: str | None = None
    params: dict = field(default_factory=dict)  # the case, as data
    comparison: Comparison | None = field(default=None, repr=False)

    @property
    def acceptable(self) -> bool:
        return self.outcome in ACCEPTABLE

    @property
    def summary(self) -> str:
        """One line: the comparison's summary, or what happened instead."""
        if self.comparison is not None:
            return self.comparison.summary()
        return f"{self.outcome.upper()}: {self.note}" if self.note else self.outcome.upper()

    def failure_message(self) -> str:
        """The full story for a pytest failure or a report: which case, which geometry, and
        the numpy.testing-style comparison (or the contract/error note)."""
        head = f"{self.suite}/{self.case} [{self.params.get('describe', '')}]: {self.outcome}"
        if self.comparison is not None and not self.comparison.passed:
            return f"{head}\n{self.comparison.failure_message()}"
        return f"{head}: {self.note}" if self.note else head

    def to_dict(self) -> dict:
        return {
            "case": self.case, "suite": self.suite, "outcome": self.outcome, "note": self.note,
            "status": self.status, "supported": self.supported,
            "rel_l2": _num(self.rel_l2), "max_abs": _num(self.max_abs),
            "max_abs_at": None if self.max_abs_at is None else list(self.max_abs_at),
            "gate": _num(self.gate), "gate_max_abs": _num(self.gate_max_abs),
            "seed_gate_pass": self.seed_gate_pass, "baseline_rel_l2": _num(self.baseline_rel_l2),
            "n_nan": self.n_nan, "n_inf": self.n_inf, "time_s": _num(self.time_s),
            "seed_contract": self.seed_contract, "summary": self.summary,
            "params": self.params,
            "comparison": None if self.comparison is None else self.comparison.to_dict(),
        }


@dataclass
class MatrixResult:
    """One kernel over a list of cases."""

    kernel: str
    results: list[Result]
    suites: list[str] = field(default_factory=list)
    started: str = ""
    elapsed_s: float = 0.0
    host: dict = field(default_factory=dict)
    kernel_spec: str | None = None  # the name it was built from (refattn.records)
    kernel_source_hash: str | None = None  # its adapter's source_hash(), when it has one
    kernel_facts: dict | None = None  # its adapter's facts(): versions, providers (kernels.kernel_facts)

    @property
    def ok(self) -> bool:
        """Every outcome is ``pass`` or ``declined``."""
        return all(r.acceptable for r in self.results)

    def counts(self) -> dict[str, int]:
        return {o: sum(r.outcome == o for r in self.results) for o in OUTCOMES}

    def failures(self) -> list[Result]:
        return [r for r in self.results if not r.acceptable]

    def to_json(self) -> dict:
        """The JSON document (a dict, ready for ``json.dump``), schema 1."""
        return {
            "schema": SCHEMA, "kernel": self.kernel, "kernel_spec": self.kernel_spec,
            "kernel_source_hash": self.kernel_source_hash, "kernel_facts": self.kernel_facts,
            "ok": self.ok, "suites": list(self.suites),
            "started": self.started, "elapsed_s": round(self.elapsed_s, 3), "host": self.host,
            "counts": self.counts(), "results": [r.to_dict() for r in self.results],
        }


def host_memory_bytes() -> int | None:
    """Physical memory of this host in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def host_info() -> dict:
    return {"python": platform.python_version(), "numpy": np.__version__,
            "platform": platform.platform(), "machine": platform.machine(),
            "cpus": os.cpu_count()}


# --------------------------------------------------------------------------- running

def _exception_note(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def run_case(kernel, case: Case, *, cache: ReferenceCache | None = None,
             input_cache: InputCache | None = None) -> Result:
    """Run ``kernel`` (an adapter) on ``case`` and judge the outcome (see the module docstring).
    ``cache`` / ``input_cache``: where the reference and the inputs are kept (default: the
    module's ``REFERENCE_CACHE`` and ``INPUT_CACHE``)."""
    cache = REFERENCE_CACHE if cache is None else cache
    input_cache = INPUT_CACHE if input_cache is None else input_cache
    params = case.to_dict()
    params["describe"] = case.describe()
    res = Result(case=case.name, suite=case.suite, outcome="error",
                 seed_contract=case.seed_contract, params=params)
    if case.ragged and not getattr(kernel, "ragged", False):
        # An adapter written for one past_len would read the lengths as a uniform batch's:
        # it is not run on a ragged case at all.
        res.outcome, res.supported = "declined", False
        res.note = ("not run: a ragged batch, and the adapter does not declare ragged = True "
                    "(docs/adapters.md)")
        return res
    need, have = case.host_bytes, host_memory_bytes()
    if have is not None and need > have:
        res.note = (f"needs about {need / 2**30:.1f} GiB of host memory (inputs, output, fp64 "
                    f"reference); this host has {have / 2**30:.1f} GiB")
        return res
    try:
        inputs = input_cache.get(case)
    except MemoryError:
        res.note = f"inputs failed: out of host memory (the case needs about {need / 2**30:.1f} GiB)"
        return res
    buf = inputs.out
    try:
        supported = bool(kernel.supports(case))
    except Exception as e:  # noqa: BLE001 - a crashing kernel is a result, not a crash
        res.note = f"supports() raised {_exception_note(e)}"
        return res
    res.supported = supported

    expected = baseline = None
    if supported:
        try:
            expected, baseline = cache.get(case, inputs)
        except Exception as e:  # noqa: BLE001
            res.note = f"reference failed: {_exception_note(e)}"
            return res

    t0 = time.perf_counter()
    try:
        ret = kernel.run(inputs)
    except Exception as e:  # noqa: BLE001
        res.time_s = time.perf_counter() - t0
        res.note = f"run() raised {_exception_note(e)}"
        return res
    res.time_s = time.perf_counter() - t0

    try:
        status, out = ret
        status = int(status)
    except (TypeError, ValueError):
        res.outcome = "contract-violation"
        res.note = f"run() must return (status, out), got {type(ret).__name__}"
        return res
    res.status = status

    if status not in (0, -1):
        res.outcome = "contract-violation"
        res.note = f"returned status {status}; only 0 (computed) and -1 (declined) are defined"
        return res

    if not supported:
        touched = inputs.out is not buf or not inputs.out_intact(buf)
        problems = []
        if status == 0:
            problems.append("returned 0 on a case it declares unsupported")
        if touched:
            problems.append("touched the output buffer while declining" if status == -1
                            else "wrote the output buffer")
        if problems:
            res.outcome = "contract-violation"
            res.note = "; ".join(problems)
        else:
            res.outcome = "declined"
            res.note = "declined (status -1), output buffer untouched"
            why = _decline_reason(kernel, case)
            if why:
                res.note += f": {why}"
        return res

    if status == -1:
        res.outcome = "fail"
        res.note = "declined a case it claims to support"
        return res

    want = (case.B, case.sq, case.Hq, case.d)
    arr = out if isinstance(out, np.ndarray) else None
    if arr is None or arr.shape != want or not np.issubdtype(arr.dtype, np.floating):
        res.outcome = "fail"
        got = "None" if out is None else (f"{arr.dtype} {arr.shape}" if arr is not None
                                          else type(out).__name__)
        res.note = f"returned {got}, expected a float array of shape {want} (B, Sq, Hq, d)"
        return res

    c = compare(arr, expected, baseline, case.lowp)
    res.comparison = c
    res.outcome = "pass" if c.passed else "fail"
    res.rel_l2, res.max_abs, res.max_abs_at = c.rel_l2, c.max_abs, c.max_abs_at
    res.gate, res.gate_max_abs = c.gate_rel_l2, c.gate_max_abs
    res.seed_gate_pass, res.baseline_rel_l2 = c.seed_passed, c.baseline_rel_l2
    res.n_nan, res.n_inf = c.n_nan, c.n_inf
    res.note = "" if c.passed else c.summary()
    if case.seed_contract == "decline":
        res.note = (res.note + "; " if res.note else "") + "the seed kernel declined this case"
    return res


def _decline_reason(kernel, case) -> str:
    """The adapter's ``unsupported_reason(case)``, one line, or "" when it has none (or it
    raises: the reason is a courtesy, the decline itself was already judged)."""
    fn = getattr(kernel, "unsupported_reason", None)
    if not callable(fn):
        return ""
    try:
        why = fn(case)
    except Exception as e:  # noqa: BLE001
        return f"(unsupported_reason() raised {type(e).__name__})"
    return " ".join(str(why).split())[:300] if why else ""


def run_matrix(kernel, cases, progress=None, *, cache: ReferenceCache | None = None) -> MatrixResult:
    """Run ``kernel`` over ``cases``. ``progress(i, n, case, result)`` is called before each
    case with ``result=None`` and after it with the :class:`Result` (i counts from 0)."""
    cases = list(cases)
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    t0 = time.perf_counter()
    results = []
    for i, case in enumerate(cases):
        if progress is not None:
            progress(i, len(cases), case, None)
        r = run_case(kernel, case, cache=cache)
        results.append(r)
        if progress is not None:
            progress(i, len(cases), case, r)
    suites = list(dict.fromkeys(c.suite for c in cases))
    return MatrixResult(kernel=str(getattr(kernel, "name", type(kernel).__name__)), results=results,
                        suites=suites, started=started, elapsed_s=time.perf_counter() - t0,
                        host=host_info())


__all__ = ["ACCEPTABLE", "INPUT_CACHE", "InputCache", "OUTCOMES", "MatrixResult", "REFERENCE_CACHE",
           "ReferenceCache", "Result", "reference_for", "run_case", "run_matrix"]
