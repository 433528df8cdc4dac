"""Error metrics and the tolerance model (docs/semantics.md, Tolerance model).

A kernel's output is judged against the fp64 reference by three numbers:

* relL2 = ||actual - expected||_2 / ||expected||_2 (the plain L2 norm of the difference when
  ``expected`` is all zeros);
* max-abs error, with its location decoded to ``(b, h, row, col)`` and both values there;
* a NaN/Inf census of ``actual`` where ``expected`` is finite. Non-finite values are checked
  first: any one fails the comparison, whatever the norms say.

The gate is *derived*, the way FlashAttention's tests derive theirs: a low-precision baseline
(the fp64 reference with P rounded to fp16 before P.V and the output rounded to fp16, see
``refattn.reference.attention_with_baseline``) shows how much error an honest fp16 kernel
makes on these very inputs. A kernel passes iff

    relL2(kernel)  <= 2 * relL2(baseline)  + FLOOR_REL
    maxabs(kernel) <= 2 * maxabs(baseline) + FLOOR_ABS * max|expected|

The floors only matter when the baseline is exact (e.g. window = 1, where P is 0 or 1);
they are one rounding step of the baseline's format (fp16; bf16 for a bf16 kernel, whose
baseline rounds P and the output through bf16, ``lowp``), so a correct kernel still fits. The seed harness's fixed gate
(relL2 <= 0.01) is reported next to it; the mutant kill matrix shows what it lets through.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from refattn.lowp import EPS, check_lowp

FP16_EPS = EPS["fp16"]  # spacing of fp16 numbers in [1, 2)
FLOOR_REL = FP16_EPS / 8  # ~1.2e-4: below the relL2 of one fp16 rounding of random data
FLOOR_ABS = FP16_EPS / 2  # half an ulp at the output's largest magnitude


def floors(lowp: str = "fp16") -> tuple[float, float]:
    """The gate's (relative, absolute) floors for a baseline in ``lowp``: an eighth and a half
    of that format's spacing in [1, 2) (FLOOR_REL and FLOOR_ABS for fp16)."""
    eps = EPS[check_lowp(lowp)]
    return eps / 8, eps / 2
SEED_GATE_REL_L2 = 0.01  # the original harness's fixed threshold


def _norm(x: np.ndarray) -> float:
    """The L2 norm by NumPy's pairwise summation: the same bits whatever the host's BLAS
    thread count (``np.linalg.norm`` goes through BLAS ``dot``, whose threads split the sum
    differently, so a sharded run and a local one differed in the last bit)."""
    return float(np.sqrt(np.sum(x * x)))


def rel_l2(actual, expected) -> float:
    """||actual - expected|| / ||expected|| in float64 (absolute norm if expected is 0)."""
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    if a.shape != e.shape:
        raise ValueError(f"actual: shape {a.shape} does not match expected {e.shape}")
    num = _norm((a - e).ravel())
    den = _norm(e.ravel())
    return num / den if den > 0 else num


def _bhrc(flat_index: int, shape) -> tuple[int, int, int, int]:
    """Decode a flat index of a (B, Sq, Hq, d) array to (b, h, row, col)."""
    b, row, h, col = np.unravel_index(flat_index, shape)
    return int(b), int(h), int(row), int(col)


@dataclass
class ErrorStats:
    rel_l2: float
    max_abs: float
    max_abs_at: tuple[int, int, int, int] | None  # (b, h, row, col)
    actual_at: float | None
    expected_at: float | None
    n_nan: int
    n_inf: int
    first_nonfinite: tuple[int, int, int, int] | None

    @property
    def finite(self) -> bool:
        return self.n_nan == 0 and self.n_inf == 0


def error_stats(actual, expected) -> ErrorStats:
    """relL2, located max-abs and the NaN/Inf census of ``actual: (B, Sq, Hq, d)``."""
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    if a.shape != e.shape:
        raise ValueError(f"actual: shape {a.shape} does not match expected {e.shape}")
    if a.ndim != 4:
        raise ValueError(f"actual: expected rank 4 (B, Sq, Hq, d), got shape {a.shape}")
    bad_nan = np.isnan(a) & np.isfinite(e)
    bad_inf = np.isinf(a) & np.isfinite(e)
    n_nan, n_inf = int(bad_nan.sum()), int(bad_inf.sum())
    first = None
    if n_nan or n_inf:
        first = _bhrc(int(np.flatnonzero((bad_nan | bad_inf).ravel())[0]), a.shape)
        return ErrorStats(math.nan, math.nan, None, None, None, n_nan, n_inf, first)
    diff = np.abs(a - e)
    i = int(np.argmax(diff))
    return ErrorStats(
        rel_l2=rel_l2(a, e),
        max_abs=float(diff.ravel()[i]),
        max_abs_at=_bhrc(i, a.shape),
        actual_at=float(a.ravel()[i]),
        expected_at=float(e.ravel()[i]),
        n_nan=0,
        n_inf=0,
        first_nonfinite=None,
    )


@dataclass
class Comparison:
    """A kernel output judged against the fp64 reference and the low-precision baseline."""

    rel_l2: float
    max_abs: float
    max_abs_at: tuple[int, int, int, int] | None
    actual_at: float | None
    expected_at: float | None
    n_nan: int
    n_inf: int
    first_nonfinite: tuple[int, int, int, int] | None
    n_mismatch: int  # elements whose error exceeds the max-abs gate
    n_total: int
    baseline_rel_l2: float
    baseline_max_abs: float
    gate_rel_l2: float
    gate_max_abs: float
    passed: bool
    seed_passed: bool

    def summary(self) -> str:
        """One line: verdict, relL2 vs gate, max-abs vs gate and where, seed gate."""
        verdict = "PASS" if self.passed else "FAIL"
        seed = "pass" if self.seed_passed else "fail"
        if self.n_nan or self.n_inf:
            return (f"{verdict} non-finite output: {self.n_nan} NaN, {self.n_inf} Inf, first at "
                    f"(b,h,row,col)={self.first_nonfinite}; seed gate {seed}")
        return (f"{verdict} relL2 {self.rel_l2:.3e} (gate {self.gate_rel_l2:.3e}) "
                f"max-abs {self.max_abs:.3e} (gate {self.gate_max_abs:.3e}) at "
                f"(b,h,row,col)={self.max_abs_at}; seed gate {seed}")

    def failure_message(self) -> str:
        """numpy.testing-style report: non-finite positions first, then mismatches, location
        of the largest error with both values, and the norms against their gates."""
        lines = ["Kernel output does not match the fp64 reference under the derived gate"]
        if self.n_nan or self.n_inf:
            lines.append(f"x and y nan/inf location mismatch: {self.n_nan} NaN and {self.n_inf} Inf "
                         f"where the reference is finite; first at (b, h, row, col) = {self.first_nonfinite}")
        else:
            pct = 100.0 * self.n_mismatch / max(1, self.n_total)
            lines.append(f"Mismatched elements: {self.n_mismatch} / {self.n_total} ({pct:.3g}%) "
                         f"beyond max-abs gate {self.gate_max_abs:.3e}")
            lines.append(f"Max absolute difference: {self.max_abs:.6g} at (b, h, row, col) = "
                         f"{self.max_abs_at}: actual {self.actual_at:.6g}, expected {self.expected_at:.6g}")
            lines.append(f"relL2: {self.rel_l2:.6g} (gate {self.gate_rel_l2:.6g} = 2 x baseline "
                         f"{self.baseline_rel_l2:.3g} + floor)")
            lines.append(f"max-abs: {self.max_abs:.6g} (gate {self.gate_max_abs:.6g} = 2 x baseline "
                         f"{self.baseline_max_abs:.3g} + floor)")
        lines.append(f"seed gate (relL2 <= {SEED_GATE_REL_L2}): {'pass' if self.seed_passed else 'fail'}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        d = asdict(self)
        for key in ("max_abs_at", "first_nonfinite"):
            if d[key] is not None:
                d[key] = list(d[key])
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}


def _check_real(name: str, x) -> None:
    """``x`` must hold real numbers as a plain array: a complex array would be compared by its
    real part alone and a masked array by values its mask hides."""
    if isinstance(x, np.ma.MaskedArray):
        raise ValueError(f"{name}: expected a plain array, got a masked array (its mask would "
                         f"be ignored)")
    dt = np.asarray(x).dtype
    if not (np.issubdtype(dt, np.floating) or np.issubdtype(dt, np.integer)):
        raise ValueError(f"{name}: expected real numbers (a float array), got dtype {dt}")


def compare(actual, expected, baseline, lowp: str = "fp16") -> Comparison:
    """Judge ``actual`` against ``expected`` (fp64 reference) with the gate derived from
    ``baseline`` (the low-precision baseline on the same inputs, rounded through ``lowp``,
    which sets the floors). All ``(B, Sq, Hq, d)``."""
    floor_rel, floor_abs = floors(lowp)
    for name, x in (("actual", actual), ("expected", expected), ("baseline", baseline)):
        _check_real(name, x)
    e = np.asarray(expected, dtype=np.float64)
    if not np.isfinite(e).all():
        raise ValueError("expected: the reference output must be finite")
    base = error_stats(baseline, e)
    if not base.finite:
        raise ValueError("baseline: the low-precision baseline must be finite")
    scale = float(np.abs(e).max()) if e.size else 0.0
    gate_rel = 2.0 * base.rel_l2 + floor_rel
    gate_abs = 2.0 * base.max_abs + floor_abs * scale
    st = error_stats(actual, e)
    if st.finite:
        n_mismatch = int((np.abs(np.asarray(actual, dtype=np.float64) - e) > gate_abs).sum())
        passed = st.rel_l2 <= gate_rel and st.max_abs <= gate_abs
        seed_passed = st.rel_l2 <= SEED_GATE_REL_L2
    else:
        n_mismatch = st.n_nan + st.n_inf
        passed = seed_passed = False
    return Comparison(
        rel_l2=st.rel_l2, max_abs=st.max_abs, max_abs_at=st.max_abs_at, actual_at=st.actual_at,
        expected_at=st.expected_at, n_nan=st.n_nan, n_inf=st.n_inf,
        first_nonfinite=st.first_nonfinite, n_mismatch=n_mismatch, n_total=int(e.size),
        baseline_rel_l2=base.rel_l2, baseline_max_abs=base.max_abs,
        gate_rel_l2=gate_rel, gate_max_abs=gate_abs, passed=passed, seed_passed=seed_passed,
    )


def assert_close(actual, expected, baseline, lowp: str = "fp16") -> Comparison:
    """pytest helper: raise AssertionError with the full failure message unless it passes."""
    __tracebackhide__ = True
    c = compare(actual, expected, baseline, lowp)
    if not c.passed:
        raise AssertionError(c.failure_message())
    return c
