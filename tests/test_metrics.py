"""The tolerance model: located errors, non-finite census first, derived gate vs seed gate."""

import math

import numpy as np
import pytest

from refattn import attention_with_baseline
from refattn.metrics import FLOOR_REL, SEED_GATE_REL_L2, assert_close, compare, error_stats, rel_l2


def _case(seed=0, B=1, Sq=40, Hq=4, Hkv=2, d=16, past=24, window=-1):
    rng = np.random.default_rng(seed)
    f16 = lambda *s: rng.standard_normal(s).astype(np.float16)
    q, k, v = f16(B, Sq, Hq, d), f16(B, Hkv, past + Sq, d), f16(B, Hkv, past + Sq, d)
    sink = rng.uniform(-2, 4, Hq).astype(np.float16)
    ref, base = attention_with_baseline(q, k, v, past_len=past, window=window, sink=sink)
    return ref, base


def test_rel_l2_basic():
    e = np.array([3.0, 4.0])
    assert rel_l2(e, e) == 0
    assert rel_l2(np.array([3.0, 5.0]), e) == pytest.approx(1 / 5)
    assert rel_l2(np.array([1.0, 0.0]), np.zeros(2)) == 1.0  # absolute when expected is 0


def test_max_abs_location_is_b_h_row_col():
    e = np.zeros((2, 5, 3, 4))
    a = e.copy()
    a[1, 4, 2, 3] = 0.5  # b=1, row=4, h=2, col=3
    st = error_stats(a, e)
    assert st.max_abs_at == (1, 2, 4, 3)
    assert st.actual_at == 0.5 and st.expected_at == 0.0


def test_nan_checked_first():
    ref, base = _case()
    a = ref.copy()
    a[0, 7, 1, 2] = np.nan
    c = compare(a, ref, base)
    assert not c.passed and not c.seed_passed
    assert c.n_nan == 1 and c.first_nonfinite == (0, 1, 7, 2)
    assert "nan/inf" in c.failure_message() and "(0, 1, 7, 2)" in c.failure_message()
    assert math.isnan(c.rel_l2) and c.to_dict()["rel_l2"] is None


def test_fp16_rounded_reference_passes_derived_gate():
    ref, base = _case(1)
    c = compare(ref.astype(np.float16), ref, base)
    assert c.passed, c.failure_message()
    assert c.baseline_rel_l2 > 0 and c.gate_rel_l2 >= FLOOR_REL


def test_small_systematic_error_passes_seed_gate_but_fails_derived_gate():
    """A 0.5% bias: the seed's fixed relL2 <= 0.01 lets it through, the derived gate does not."""
    ref, base = _case(2)
    a = (ref * 1.005).astype(np.float16)
    c = compare(a, ref, base)
    assert c.seed_passed and c.rel_l2 < SEED_GATE_REL_L2
    assert not c.passed
    with pytest.raises(AssertionError, match="Mismatched elements"):
        assert_close(a, ref, base)


def test_summary_is_one_line():
    ref, base = _case(3, window=5)
    c = compare(ref.astype(np.float16), ref, base)
    assert "\n" not in c.summary() and c.summary().startswith("PASS")


def test_shape_mismatch_names_argument():
    with pytest.raises(ValueError, match="^actual"):
        rel_l2(np.zeros(3), np.zeros(4))


def test_rel_l2_does_not_depend_on_the_blas_thread_count():
    """A sharded run (workers hold BLAS to their share of the CPUs) and a local one must
    report the same bits; BLAS dot splits its sum by thread count, NumPy's sum does not."""
    from threadpoolctl import threadpool_limits

    from refattn.metrics import rel_l2

    rng = np.random.default_rng(3)
    e = rng.standard_normal(2_000_003)
    a = e + 1e-3 * rng.standard_normal(e.size)
    results = set()
    for n in (1, 2, 4):
        with threadpool_limits(n):
            results.add(rel_l2(a, e))
    assert len(results) == 1
    assert results.pop() == pytest.approx(np.linalg.norm(a - e) / np.linalg.norm(e), rel=1e-12)


@pytest.mark.parametrize("make,message", [
    (lambda a: a.astype(np.complex128) + 1e-3j, "actual: expected real numbers (a float array), got dtype complex128"),
    (lambda a: np.ma.masked_array(a, mask=a > 0), "actual: expected a plain array, got a masked array"),
    (lambda a: a.astype(object), "actual: expected real numbers (a float array), got dtype object"),
], ids=["complex", "masked", "object"])
def test_compare_refuses_what_it_cannot_judge(make, message):
    """A complex output used to be judged by its real part alone (with only a ComplexWarning),
    and a masked one by the values its mask hides."""
    e = np.linspace(-1, 1, 2 * 3 * 4 * 8).reshape(2, 3, 4, 8)
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        compare(make(e), e, e.astype(np.float16))
