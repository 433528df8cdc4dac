"""Properties of the reference that follow from docs/semantics.md (Semantics) alone, checked
with hypothesis.

Each property compares the reference with itself under a transformation that must not change
the answer (a window wider than the sequence, a chunk split, repeated KV heads, ...), with
a closed form (window 1, all-equal logits, a dominating sink), or, for huge logits, with the
mpmath oracle. Corners are pinned with ``@example``: a single query row,
G = Hq, window 1 far into a cache, a window equal to Skv, huge logits, a dominating sink.

Tolerances: a transformation that leaves the computation unchanged up to BLAS summation
order is held to fp64 rtol 1e-12 (a few ulps times the softmax's amplification); where the
transformation cannot change a single floating-point operation the test asserts equality.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from refattn import attention
from refattn.oracle import attention_mp

SETTINGS = settings(max_examples=40, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
RTOL64 = 1e-12


@dataclass(frozen=True)
class Geom:
    """One tiny attention call: shapes, past_len, window (-1 = none) and an input seed."""

    B: int
    Sq: int
    Hq: int
    Hkv: int
    d: int
    past_len: int
    window: int
    seed: int

    @property
    def G(self) -> int:
        return self.Hq // self.Hkv

    @property
    def skv(self) -> int:
        return self.past_len + self.Sq


@st.composite
def geoms(draw, window=True, min_sq=1, max_sq=8, max_past=10, max_d=8):
    Hkv = draw(st.integers(1, 3))
    G = draw(st.integers(1, 3))
    Sq = draw(st.integers(min_sq, max_sq))
    past = draw(st.integers(0, max_past))
    W = draw(st.one_of(st.just(-1), st.integers(1, past + Sq + 2))) if window else -1
    return Geom(B=draw(st.integers(1, 2)), Sq=Sq, Hq=Hkv * G, Hkv=Hkv, d=draw(st.integers(1, max_d)),
                past_len=past, window=W, seed=draw(st.integers(0, 2**32 - 1)))


SINK_MODES = st.sampled_from(["none", "sink", "smooth"])


def make(g: Geom, dtype=np.float64):
    """q: (B, Sq, Hq, d), k, v: (B, Hkv, Skv, d), sink: (Hq,) with the occasional -inf."""
    rng = np.random.default_rng(g.seed)
    q = rng.standard_normal((g.B, g.Sq, g.Hq, g.d)).astype(dtype)
    k = rng.standard_normal((g.B, g.Hkv, g.skv, g.d)).astype(dtype)
    v = rng.standard_normal((g.B, g.Hkv, g.skv, g.d)).astype(dtype)
    sink = rng.uniform(-3, 3, g.Hq)
    sink[rng.random(g.Hq) < 0.2] = -np.inf
    return q, k, v, sink.astype(dtype)


def sink_kwargs(mode: str, sink) -> dict:
    return {"none": {}, "sink": {"sink": sink}, "smooth": {"smooth_softmax": True}}[mode]


def sigma_of(mode: str, sink, Hq: int) -> np.ndarray:
    """The per-head sink logit as docs/semantics.md (Semantics) defines it; -inf stands for
    'no sink term'."""
    return {"none": np.full(Hq, -np.inf), "sink": np.asarray(sink, np.float64),
            "smooth": np.zeros(Hq)}[mode]


def per_query_head(kv, G: int) -> np.ndarray:
    """(B, Hkv, S, d) -> (B, S, Hq, d): each query head's view of its KV head."""
    return np.repeat(kv, G, axis=1).transpose(0, 2, 1, 3)


def ref64(q, k, v, g: Geom, **kw):
    return attention(q, k, v, past_len=g.past_len, window=g.window, dtype=np.float64, **kw)


def assert_close(actual, expected, rtol=RTOL64, atol=1e-14):
    __tracebackhide__ = True
    assert np.isfinite(actual).all(), f"non-finite output at {np.argwhere(~np.isfinite(actual))[:3].tolist()}"
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


# --- windows -----------------------------------------------------------------------------

@SETTINGS
@given(g=geoms(window=False), extra=st.integers(0, 4), mode=SINK_MODES)
@example(g=Geom(1, 1, 1, 1, 1, 0, -1, 0), extra=0, mode="none")   # one key, W = Skv = 1
@example(g=Geom(2, 8, 6, 2, 4, 10, -1, 1), extra=0, mode="sink")  # W == Skv exactly
def test_window_at_least_skv_is_no_window(g, extra, mode):
    q, k, v, sink = make(g)
    kw = sink_kwargs(mode, sink)
    assert_close(attention(q, k, v, past_len=g.past_len, window=g.skv + extra, dtype=np.float64, **kw),
                 attention(q, k, v, past_len=g.past_len, window=-1, dtype=np.float64, **kw))


@SETTINGS
@given(g=geoms(window=False), mode=SINK_MODES, softcap=st.sampled_from([0.0, 0.5, 4.0]))
@example(g=Geom(1, 1, 4, 1, 2, 9, -1, 2), mode="sink", softcap=0.0)  # W=1 deep in the cache, G=Hq
@example(g=Geom(1, 5, 2, 2, 3, 0, -1, 3), mode="smooth", softcap=0.5)
def test_window_one_sees_only_itself(g, mode, softcap):
    """W = 1: row i at p = past_len + i sees key p alone, so with s = s_pp (scaled, softcapped)

        out = v_p e^s / (e^s + e^sigma) = v_p / (1 + e^(sigma - s))

    where e^sigma = 0 without a sink (out = v_p) and sigma = 0 under smooth softmax."""
    q, k, v, sink = make(g)
    kp, vp = per_query_head(k[:, :, g.past_len:], g.G), per_query_head(v[:, :, g.past_len:], g.G)
    s = np.einsum("bihc,bihc->bih", q, kp) / np.sqrt(g.d)
    if softcap > 0:
        s = softcap * np.tanh(s / softcap)
    with np.errstate(over="ignore"):  # sigma - s > 709: the row is all sink, out -> 0
        factor = 1 / (1 + np.exp(sigma_of(mode, sink, g.Hq)[None, None, :] - s))
    out = attention(q, k, v, past_len=g.past_len, window=1, softcap=softcap, dtype=np.float64,
                    **sink_kwargs(mode, sink))
    assert_close(out, factor[..., None] * vp)


# --- chunked prefill, GQA, sink equivalences -----------------------------------------------

@SETTINGS
@given(g=geoms(min_sq=2, max_sq=12), cut=st.floats(0, 1), mode=SINK_MODES)
@example(g=Geom(1, 2, 2, 1, 4, 0, -1, 4), cut=0.5, mode="sink")   # two one-row chunks
@example(g=Geom(2, 9, 4, 2, 3, 5, 3, 5), cut=0.4, mode="smooth")  # window spans the cut
@example(g=Geom(1, 6, 3, 3, 2, 0, 1, 6), cut=0.5, mode="none")
def test_two_chunks_equal_one_shot(g, cut, mode):
    """Prefill of [0, Sq) at past_len P equals chunk [0, c) at P (over the first P + c keys)
    followed by chunk [c, Sq) at P + c (over all keys)."""
    c = min(g.Sq - 1, max(1, round(cut * g.Sq)))
    q, k, v, sink = make(g)
    kw = dict(window=g.window, dtype=np.float64, **sink_kwargs(mode, sink))
    one_shot = attention(q, k, v, past_len=g.past_len, **kw)
    first = attention(q[:, :c], k[:, :, :g.past_len + c], v[:, :, :g.past_len + c],
                      past_len=g.past_len, **kw)
    second = attention(q[:, c:], k, v, past_len=g.past_len + c, **kw)
    assert_close(np.concatenate([first, second], axis=1), one_shot)


@SETTINGS
@given(g=geoms(), mode=SINK_MODES)
@example(g=Geom(1, 3, 6, 1, 4, 2, -1, 7), mode="sink")  # MQA: G = Hq
@example(g=Geom(2, 4, 6, 2, 2, 1, 2, 8), mode="none")
def test_gqa_equals_mha_with_repeated_kv(g, mode):
    q, k, v, sink = make(g)
    kw = sink_kwargs(mode, sink)
    assert_close(ref64(q, k, v, g, **kw),
                 ref64(q, np.repeat(k, g.G, axis=1), np.repeat(v, g.G, axis=1), g, **kw))


@SETTINGS
@given(g=geoms())
@example(g=Geom(1, 1, 1, 1, 1, 0, -1, 9))
def test_smooth_softmax_equals_zero_sink(g):
    q, k, v, _ = make(g)
    assert_close(ref64(q, k, v, g, smooth_softmax=True), ref64(q, k, v, g, sink=np.zeros(g.Hq)))


@SETTINGS
@given(g=geoms(), smooth=st.booleans())
@example(g=Geom(1, 4, 2, 1, 3, 3, 1, 10), smooth=True)  # a -inf sink wins over smooth too
def test_neginf_sink_equals_no_sink(g, smooth):
    q, k, v, _ = make(g)
    assert_close(ref64(q, k, v, g, sink=np.full(g.Hq, -np.inf), smooth_softmax=smooth),
                 ref64(q, k, v, g))


# --- extreme logits and sinks -----------------------------------------------------------------

def _int_inputs(g: Geom, amp: int):
    """Integer-valued q, k (|s| up to d * amp^2 with scale = 1) and sinks of the same size:
    every logit and every difference of logits is exact in fp32 and fp64, so the only error
    left is exp and the sums."""
    rng = np.random.default_rng(g.seed)
    q = rng.integers(-amp, amp + 1, (g.B, g.Sq, g.Hq, g.d)).astype(np.float64)
    k = rng.integers(-amp, amp + 1, (g.B, g.Hkv, g.skv, g.d)).astype(np.float64)
    v = rng.standard_normal((g.B, g.Hkv, g.skv, g.d))
    sink = rng.integers(-g.d * amp * amp, g.d * amp * amp + 1, g.Hq).astype(np.float64)
    return q, k, v, sink


def _oracle_gate(actual, expected, rtol, v):
    """relL2 <= rtol, with an absolute floor for rows that underflow: below fp32's normal
    range (1.2e-38) only absolute error is meaningful."""
    __tracebackhide__ = True
    assert np.isfinite(actual).all()
    err = np.linalg.norm(actual - expected)
    floor = 1e-37 * np.abs(v).max() * np.sqrt(actual.size)
    assert err <= rtol * np.linalg.norm(expected) + floor, (err, np.linalg.norm(expected))


@settings(max_examples=30, deadline=None, database=None)
@given(g=geoms(max_sq=5, max_past=5, max_d=4), amp=st.sampled_from([10, 50]),
       mode=SINK_MODES, dtype=st.sampled_from([np.float64, np.float32]))
@example(g=Geom(1, 4, 2, 1, 4, 2, -1, 11), amp=50, mode="sink", dtype=np.float32)
@example(g=Geom(1, 3, 2, 2, 4, 4, 2, 12), amp=50, mode="none", dtype=np.float64)
def test_huge_logits_are_finite_and_match_oracle(g, amp, mode, dtype):
    """Logits of magnitude up to 1e4 (amp = 50, d = 4): the max subtraction must keep every
    exponent <= 0; a missing or misplaced max overflows to inf/NaN."""
    q, k, v, sink = _int_inputs(g, amp)
    q, k, v, sink = (a.astype(dtype) for a in (q, k, v, sink))
    kw = dict(past_len=g.past_len, window=g.window, scale=1.0, **sink_kwargs(mode, sink))
    out = attention(q, k, v, dtype=dtype, **kw)
    rtol = 1e-12 if dtype == np.float64 else 1e-5
    _oracle_gate(out, attention_mp(q, k, v, **kw), rtol, v)


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("sigma", [50.0, 1e4], ids=["sink50", "sink1e4"])
@settings(max_examples=20, deadline=None, database=None)
@given(g=geoms())
@example(g=Geom(1, 1, 1, 1, 1, 0, -1, 13))
def test_dominating_sink_drives_output_to_zero(sigma, dtype, g):
    """|out_i| <= sum_j e^(s_j - sigma) |v_j| <= Skv * max|v| * e^(max s - sigma) when the
    sink logit sigma exceeds every logit; ignoring the sink (or scaling it) gives O(1)."""
    q, k, v, _ = make(g, dtype)
    out = attention(q, k, v, past_len=g.past_len, window=g.window,
                    sink=np.full(g.Hq, sigma, dtype), dtype=dtype)
    s_max = float(np.max(np.einsum("bihc,bjhc->bihj", q.astype(np.float64),
                                   per_query_head(k.astype(np.float64), g.G)))) / np.sqrt(g.d)
    bound = g.skv * np.abs(v).max() * np.exp(s_max - sigma)
    assert out.dtype == dtype and np.isfinite(out).all()
    assert np.abs(out).max() <= 2 * bound, (np.abs(out).max(), bound)


@SETTINGS
@given(g=geoms(), mode=SINK_MODES, softcap=st.sampled_from([0.0, 2.0]))
@example(g=Geom(1, 6, 2, 1, 3, 7, 3, 14), mode="none", softcap=0.0)
@example(g=Geom(2, 5, 3, 3, 2, 0, -1, 15), mode="sink", softcap=2.0)
def test_equal_logits_give_mean_of_visible_v(g, mode, softcap):
    """q = 0 makes every logit 0 (softcapped or not), so with n visible keys

        out_i = sum_{visible j} v_j / (n + e^sigma)

    which without a sink is the mean of the visible V rows."""
    _, k, v, sink = make(g)
    q = np.zeros((g.B, g.Sq, g.Hq, g.d))
    out = attention(q, k, v, past_len=g.past_len, window=g.window, softcap=softcap,
                    dtype=np.float64, **sink_kwargs(mode, sink))
    e_sigma = np.exp(sigma_of(mode, sink, g.Hq))
    vq = per_query_head(v, g.G)  # (B, Skv, Hq, d)
    expected = np.empty_like(out)
    for i in range(g.Sq):
        p = g.past_len + i
        lo = 0 if g.window < 0 else max(0, p - g.window + 1)
        expected[:, i] = vq[:, lo:p + 1].sum(axis=1) / (p + 1 - lo + e_sigma)[None, :, None]
    assert_close(out, expected)


# --- dtype contract ----------------------------------------------------------------------------

@pytest.mark.parametrize("in_dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, "float32", np.dtype("float64")],
                         ids=["np.float32", "np.float64", "str-float32", "dtype-float64"])
def test_output_dtype_is_the_requested_dtype(in_dtype, dtype):
    g = Geom(1, 5, 4, 2, 8, 3, 2, 16)
    q, k, v, sink = make(g, in_dtype)
    out = attention(q, k, v, past_len=g.past_len, window=g.window, sink=sink, dtype=dtype)
    assert out.dtype == np.dtype(dtype)
    assert out.shape == (g.B, g.Sq, g.Hq, g.d)
    assert np.isfinite(out).all()


def test_default_dtype_is_float32_and_computes_in_fp32():
    """fp32 is computed in fp32, not rounded from an fp64 result; it is still close to fp64."""
    g = Geom(2, 16, 4, 2, 16, 5, -1, 17)
    q, k, v, sink = make(g)
    out32 = attention(q, k, v, past_len=g.past_len, sink=sink)
    out64 = attention(q, k, v, past_len=g.past_len, sink=sink, dtype=np.float64)
    assert out32.dtype == np.float32
    assert not np.array_equal(out32, out64.astype(np.float32))
    assert np.linalg.norm(out32 - out64) / np.linalg.norm(out64) < 1e-5


# --- the band: keys outside every window are never read -------------------------------------------

@st.composite
def windowed_geoms(draw):
    """A window with P - W + 1 > 0: keys j < P - W + 1 lie outside every query's window."""
    past = draw(st.integers(1, 12))
    g = draw(geoms(window=False))
    return Geom(g.B, g.Sq, g.Hq, g.Hkv, g.d, past, draw(st.integers(1, past)), g.seed)


@SETTINGS
@given(g=windowed_geoms(), poison=st.sampled_from([np.nan, np.inf, -1e300, 1e300]),
       mode=SINK_MODES, dtype=st.sampled_from([np.float64, np.float32]))
@example(g=Geom(1, 1, 2, 1, 2, 12, 1, 18), poison=np.nan, mode="sink", dtype=np.float32)
@example(g=Geom(1, 8, 4, 2, 4, 3, 3, 19), poison=np.inf, mode="none", dtype=np.float64)
def test_keys_outside_every_window_are_not_read(g, poison, mode, dtype):
    q, k, v, sink = make(g, dtype)
    clean = attention(q, k, v, past_len=g.past_len, window=g.window, dtype=dtype,
                      **sink_kwargs(mode, sink))
    dead = g.past_len - g.window + 1  # keys [0, dead) are visible to no query
    k2, v2 = k.copy(), v.copy()
    with np.errstate(over="ignore"):  # 1e300 overflows to inf in fp32; that is a poison too
        k2[:, :, :dead] = poison
        v2[:, :, :dead] = poison
    out = attention(q, k2, v2, past_len=g.past_len, window=g.window, dtype=dtype,
                    **sink_kwargs(mode, sink))
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out, clean)


@pytest.mark.parametrize("window", [-1, 2], ids=["causal-future-key", "w2-key-behind-window"])
def test_nonfinite_v_at_a_hidden_key_does_not_reach_the_row(window):
    q, k, v, _ = make(Geom(1, 4, 1, 1, 2, 0, window, 20))
    hidden = 3 if window < 0 else 0  # row 0 cannot see key 3; rows 2, 3 cannot see key 0 (W=2)
    v2 = v.copy()
    v2[:, :, hidden] = np.nan
    out = attention(q, k, v2, past_len=0, window=window, dtype=np.float64)
    clean = attention(q, k, v, past_len=0, window=window, dtype=np.float64)
    rows = [0] if window < 0 else [2, 3]
    np.testing.assert_array_equal(out[:, rows], clean[:, rows])
