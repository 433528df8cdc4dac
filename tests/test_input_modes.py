"""The input modes of the case format (refattn.cases: cache_fill, logit_offset, q_spike): the
inputs are what each mode claims, the reference stays exact under it, and the derived gate
passes correct kernels (the CPU model, the fp32 reference, a correct NumPy kernel) while the
broken kernels of tests/adapters/coverage_bugs.py fail where their bug shows."""

from __future__ import annotations

import numpy as np
import pytest

from refattn import kernels as K
from refattn.cases import (Case, CaseError, case_from_text, case_to_inline, load_suite,
                           logit_shift, make_inputs, offset_components, spike_component)
from refattn.oracle import attention_mp
from refattn.reference import attention, attention_with_baseline
from refattn.runner import run_case
from tests.oracle_gate import FP64_GATE

BUGS = "tests.adapters.coverage_bugs"


def _case(**kw) -> Case:
    base = dict(name="t", Hq=8, Hkv=2, d=64, sq=16, why="w")
    return Case(**{**base, **kw})


def _kernel(name: str):
    return K.get_kernel(name if ":" in name or name in ("model", "reference") else f"{BUGS}:{name}")


# ------------------------------------------------------------------ the inputs

@pytest.mark.parametrize("fill", ["nan-outside-window", "inf-outside-window"])
def test_cache_fill_is_non_finite_exactly_where_no_row_can_see(fill):
    c = _case(sq=24, past_len=100, window=20, cache_fill=fill, B=2)
    x = make_inputs(c)
    hidden = c.past_len - c.window + 1  # the first row's window starts here
    assert c.hidden_slots == hidden == 81
    # the first row (position past_len) sees keys [past_len - W + 1, past_len]: all finite
    for arr in (x.k, x.v):
        assert np.isfinite(arr[:, :, hidden:c.skv]).all()
        assert not np.isfinite(arr[:, :, :hidden]).any()
        assert np.isnan(arr[:, :, c.skv:]).all()  # the canaries past skv stay
    if fill == "nan-outside-window":
        assert np.isnan(x.k[:, :, :hidden]).all() and np.isnan(x.v[:, :, :hidden]).all()
    else:
        assert (x.k[:, :, 0:hidden:2] == np.inf).all() and (x.k[:, :, 1:hidden:2] == -np.inf).all()
        assert (x.v[:, :, 0:hidden:2] == np.inf).all() and (x.v[:, :, 1:hidden:2] == -np.inf).all()
    # the slot just right of the hidden ones is seen by the first row only
    seen = [p for p in range(c.past_len, c.skv) if p - c.window + 1 <= hidden <= p]
    assert seen == [c.past_len]
    # everything else is the clean case's data
    clean = make_inputs(_case(sq=24, past_len=100, window=20, B=2))
    assert np.array_equal(clean.k[:, :, hidden:], x.k[:, :, hidden:], equal_nan=True)
    assert np.array_equal(clean.q, x.q)


def test_cache_fill_needs_slots_no_row_can_see():
    for kw in (dict(), dict(window=40, past_len=39), dict(window=8)):
        with pytest.raises(CaseError, match="cache_fill: .* needs key slots no row can see"):
            _case(cache_fill="nan-outside-window", **kw)
    with pytest.raises(CaseError, match="cache_fill: expected one of"):
        _case(cache_fill="garbage", window=1, past_len=4)
    assert _case(cache_fill="nan-outside-window", window=40, past_len=40).hidden_slots == 1


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("d", [64, 128])
def test_logit_offset_shifts_every_logit_by_one_constant(dtype, d):
    c = _case(d=d, dtype=dtype, sq=8, past_len=8, logit_offset=-5e4, sink="per_head")
    x = make_inputs(c)
    a, b = offset_components(c)
    assert (x.q[..., 0] == a).all() and (x.k[:, :, :c.skv, 0] == b).all()
    shift = logit_shift(c)
    assert shift == pytest.approx(c.scale_value * a * b, rel=1e-15)
    assert abs(shift + 5e4) < 0.01 * 5e4
    plain = make_inputs(_case(d=d, dtype=dtype, sq=8, past_len=8, sink="per_head"))
    assert np.array_equal(plain.q[..., 1:], x.q[..., 1:])
    # the logits are the plain case's (without component 0) plus the shift, for every pair
    q = x.q.astype(np.float64)[0, :, 0, :]
    k = x.k.astype(np.float64)[0, 0, :c.skv, :]
    s = c.scale_value * q @ k.T
    rest = c.scale_value * q[:, 1:] @ k[:, 1:].T
    assert np.allclose(s - rest, shift, rtol=0, atol=1e-9)
    # per-head sinks move with the logits and stay comparable to them (fp16 sinks)
    u = x.sink.astype(np.float64) - shift
    assert np.all(np.abs(u) < 6) and np.isfinite(x.sink).all()


def test_q_spike_passes_the_fp16_range_before_the_scale():
    c = _case(sq=8, past_len=8, q_spike=4e4, sink="per_head")
    x = make_inputs(c)
    assert spike_component(c) == 4e4 and (x.q[..., 0] == 4e4).all()
    assert (x.k[:, :, :c.skv, 0] == 2).all()
    q4 = x.q.astype(np.float64)[:, :, :4]  # the heads of KV head 0
    raw = np.einsum("bqhd,bkd->bqhk", q4, x.k[:, 0, :c.skv].astype(np.float64))
    assert np.all(np.abs(raw) > 65504)  # every raw dot product, not just one
    assert logit_shift(c) == c.scale_value * 2 * 4e4
    # both modes at once: the offset takes component 0, the spike component 1
    both = make_inputs(_case(sq=8, past_len=8, q_spike=4e4, logit_offset=-5e4))
    assert (both.q[..., 1] == 4e4).all() and (both.k[:, :, :16, 1] == 2).all()


def test_mode_values_are_validated():
    with pytest.raises(CaseError, match="q_spike: .* beyond the fp16 range"):
        _case(q_spike=7e4)
    assert _case(q_spike=7e4, dtype="fp32").q_spike == 7e4
    with pytest.raises(CaseError, match="logit_offset: expected a finite number"):
        _case(logit_offset=float("nan"))
    with pytest.raises(CaseError, match="logit_offset: .* not finite non-zero fp16"):
        _case(logit_offset=-1e12)
    with pytest.raises(CaseError, match="per-head sinks move with the logits"):
        _case(logit_offset=-6.55e4, sink="per_head")
    with pytest.raises(CaseError, match="d >= 2"):
        _case(d=1, logit_offset=-10.0, q_spike=10.0)


def test_modes_round_trip_through_the_command_line_form():
    c = _case(window=4, past_len=20, cache_fill="inf-outside-window", logit_offset=-5e4,
              q_spike=4e4)
    back = case_from_text(case_to_inline(c))
    assert (back.cache_fill, back.logit_offset, back.q_spike) == (c.cache_fill, -5e4, 4e4)
    assert "fill=inf-outside-window offset=-50000 spike=40000" in c.describe()
    assert hash(c) != hash(_case(window=4, past_len=20))


# ------------------------------------------------------------------ the reference is exact

@pytest.mark.parametrize("kw", [
    dict(logit_offset=-5e4, sink="per_head"),
    dict(q_spike=4e4, sink="smooth"),
    dict(window=3, past_len=6, cache_fill="nan-outside-window", sink="per_head"),
    dict(window=2, past_len=5, cache_fill="inf-outside-window"),
    dict(logit_offset=-5e4, window=3, past_len=6, cache_fill="nan-outside-window", dtype="fp32"),
])
def test_the_fp64_reference_matches_the_oracle_under_each_mode(kw):
    """Exact to fp64's resolution of the logits: FP64_GATE for unit logits, and where a
    common shift makes them large, a few fp64 ulps of the shift (|s| * 2^-52 at |s| = 5e4 is
    1.1e-11 relative in P), eight orders of magnitude under what fp32 resolves there."""
    c = Case(name="t", Hq=4, Hkv=2, d=8, sq=5, why="w", **kw)
    x = make_inputs(c)
    k, v = x.clean_kv()
    ref = attention(x.q, k, v, dtype=np.float64, **x.reference_kwargs())
    mp = attention_mp(x.q, k, v, **x.reference_kwargs())
    assert np.isfinite(ref).all()
    tol = FP64_GATE + 4 * abs(logit_shift(c)) * 2.0**-52
    err = np.linalg.norm(ref - mp) / np.linalg.norm(mp)
    assert err <= tol, (err, tol)
    f32 = attention(x.q, k, v, dtype=np.float32, **x.reference_kwargs())
    assert np.isfinite(f32).all()


def test_the_baseline_models_fp32_logits_only_where_they_matter():
    """Unit inputs: the baseline is the fp16-P baseline, bit for bit, whatever the modes'
    code path. An offset of -5e4: fp32 cannot resolve the logits better than ~0.004, so the
    baseline's error is that of fp32 dot products, not of fp16 P alone."""
    c = _case(sq=32, past_len=32)
    x = make_inputs(c)
    k, v = x.clean_kv()
    ref, base = attention_with_baseline(x.q, k, v, **x.reference_kwargs())
    p16_only = np.linalg.norm(base - ref) / np.linalg.norm(ref)
    assert 1e-4 < p16_only < 1e-3
    off = _case(sq=32, past_len=32, logit_offset=-5e4)
    xo = make_inputs(off)
    ko, vo = xo.clean_kv()
    ref_o, base_o = attention_with_baseline(xo.q, ko, vo, **xo.reference_kwargs())
    # the offset cancels in the fp64 reference: the same attention as the plain case with
    # component 0 replaced
    assert np.isfinite(ref_o).all() and np.abs(ref_o).max() > 0.1
    err = np.linalg.norm(base_o - ref_o) / np.linalg.norm(ref_o)
    assert err > 5 * p16_only


# ------------------------------------------------------------------ correct pass, broken fail

MODE_CASES = {
    "offset": _case(Hq=16, sq=64, past_len=64, logit_offset=-5e4),
    "offset-sink": _case(Hq=16, sq=48, past_len=200, window=100, sink="per_head",
                         logit_offset=-5e4),
    "spike": _case(Hq=16, sq=64, past_len=64, q_spike=4e4, sink="per_head"),
    "nan-left": _case(Hq=16, sq=32, past_len=400, window=100, cache_fill="nan-outside-window",
                      sink="per_head"),
    "inf-left": _case(Hq=16, sq=32, past_len=400, window=64, cache_fill="inf-outside-window"),
    "softcap3-window": _case(sq=40, past_len=100, window=5, softcap=3.0, sink="per_head"),
    "g12": _case(Hq=24, Hkv=2, sq=47, past_len=80),
}


@pytest.mark.parametrize("kernel", ["model", "reference", "CorrectNumpy"])
@pytest.mark.parametrize("mode", sorted(MODE_CASES))
def test_correct_kernels_pass_every_mode(kernel, mode):
    k, c = _kernel(kernel), MODE_CASES[mode]
    r = run_case(k, c)
    if kernel == "model" and c.softcap:
        assert r.outcome == "declined"
    else:
        assert r.outcome == "pass", r.failure_message()


@pytest.mark.parametrize("kernel, fails, passes", [
    ("MaxFloor", ["offset", "offset-sink"], ["spike", "nan-left", "g12"]),
    ("PTimesZero", ["nan-left", "inf-left"], ["offset", "spike", "softcap3-window", "g12"]),
    ("SoftcapAfterMask", ["softcap3-window"], ["offset", "nan-left", "g12"]),
    ("HeadTile16", ["g12"], []),
])
def test_each_broken_kernel_fails_where_its_bug_shows(kernel, fails, passes):
    k = _kernel(kernel)
    for mode in fails:
        assert run_case(k, MODE_CASES[mode]).outcome == "fail", (kernel, mode)
    for mode in passes:
        r = run_case(k, MODE_CASES[mode])
        assert r.outcome == "pass", (kernel, mode, r.failure_message())


def test_fp16_accumulation_overflows_only_under_the_spike():
    """A kernel that accumulates q.k in fp16 is merely imprecise on unit inputs (finite, over
    the gate); the spike makes its dot products overflow, and the output NaN."""
    k = _kernel("Fp16Dot")
    spike = run_case(k, MODE_CASES["spike"])
    assert spike.outcome == "fail" and spike.n_nan + spike.n_inf > 0
    plain = run_case(k, _case(Hq=16, sq=64, past_len=64, sink="per_head"))
    assert plain.n_nan == plain.n_inf == 0


def test_the_large_softcap_hides_the_leak_that_a_small_one_shows():
    """softcap after the mask leaks e^-c per masked key: at c = 30 under the gate, at c = 3
    far over it. The case format needed the small cap to show the bug."""
    k = _kernel("SoftcapAfterMask")
    big = _case(sq=40, past_len=100, window=5, softcap=30.0, sink="per_head")
    assert run_case(k, big).outcome == "pass"
    assert run_case(k, MODE_CASES["softcap3-window"]).outcome == "fail"


def test_the_coverage_suite_kills_every_broken_kernel(monkeypatch):
    monkeypatch.delenv("REFATTN_CASES_DIR", raising=False)
    cases = load_suite("coverage")
    want = {"MaxFloor": "cov-offset-5e4-nosink", "PTimesZero": "cov-nan-left-w100-past640",
            "SoftcapAfterMask": "cov-softcap3-w5-sink", "HeadTile16": "cov-g12-sq127-past128",
            "Fp16Dot": "cov-spike-4e4-sink"}
    by_name = {c.name: c for c in cases}
    for kernel, name in want.items():
        assert run_case(_kernel(kernel), by_name[name]).outcome == "fail", kernel
        assert run_case(_kernel("CorrectNumpy"), by_name[name]).outcome == "pass", name
