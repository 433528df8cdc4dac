"""Edge semantics of docs/semantics.md (Semantics), each checked twice: the reference against
the mpmath oracle, and the fused kernel's CPU model against the reference.

``impl = "reference"``: the fp64 reference (``refattn.attention``) against
``refattn.oracle.attention_mp``, gate relL2 <= 1e-12, or max-abs <= 1e-12 where the oracle's
output is ~0 (a dominating sink: relL2 of a ~0 vector means nothing).

``impl = "model"`` / ``"model-mma"``: ``hipkernel.model.attention`` (the scalar path's
default config / the tensor-core path's, which rounds P to fp16 before P.V) on fp16 inputs
(cache padded with NaN canaries) against the fp64 reference of the same fp16 values under the
derived gate
(``refattn.metrics.compare`` with ``refattn.reference.attention_with_baseline``,
docs/semantics.md, Tolerance model). It is skipped, with the reason, where the kernel's
contract declines (``hipkernel.api.decline_reason``: d in {64, 128}, fp16, no softcap).

Inputs are fp16 values, so the oracle, the reference and the model see identical numbers.
Where the edge has a closed form (a sink that zeroes the output, a window of one key, equal
logits) it is asserted too, exactly where the arithmetic is exact. The same edges' algebraic
properties for the reference alone (window >= Skv, chunking, GQA = repeated MHA, ...) are in
test_reference_properties.py; the model's mutants and unseen-storage canaries in
test_model.py. The last section extends those canaries to the ``model`` adapter: a NaN-filled
output buffer is fully written on success and byte-identical after a decline.
"""

from __future__ import annotations

import numpy as np
import pytest

from hipkernel import api, model
from hipkernel.config import DEFAULT, MMA_DEFAULT
from hipkernel.config import config_from_name
from refattn.cases import OUT_CANARY_BITS, Case, make_inputs
from refattn.kernels import get_kernel
from refattn.metrics import compare
from refattn.oracle import attention_mp
from refattn.reference import attention, attention_with_baseline
from tests.oracle_gate import assert_matches_oracle

D = 64  # a head dim the kernel compiles, so both impls run
IMPLS = ["reference", "model", "model-mma"]
PAD = 40  # NaN rows past skv in the model's cache


# --------------------------------------------------------------------------- checks


def _f64(kw: dict) -> dict:
    return {k: (v.astype(np.float64) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}


def run(impl: str, q, k, v, **kw) -> np.ndarray:
    """Check ``impl`` on fp16 ``q (B,Sq,Hq,d)``, ``k, v (B,Hkv,skv,d)`` (and an fp16 sink in
    ``kw``) and return its output: the fp64 reference (checked against the oracle) or the
    model's fp16 output (checked against the fp64 reference under the derived gate)."""
    __tracebackhide__ = True
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    kw64 = _f64(kw)
    if impl == "reference":
        out = attention(q64, k64, v64, dtype=np.float64, **kw64)
        assert_matches_oracle(out, attention_mp(q64, k64, v64, **kw64))
        return out
    reason = api.decline_reason(d=q.shape[3], softcap=kw.get("softcap", 0.0))
    if reason is not None:
        pytest.skip(f"the kernel declines this call ({reason}): nothing to check on the model")
    ref, base = attention_with_baseline(q64, k64, v64, **kw64)
    pad = np.full(k.shape[:2] + (PAD, k.shape[3]), np.nan, np.float16)
    cfg = MMA_DEFAULT if impl == "model-mma" else DEFAULT
    out = model.attention(q, np.concatenate([k, pad], 2), np.concatenate([v, pad], 2), config=cfg, **kw)
    c = compare(out, ref, base)
    assert c.passed, c.failure_message()
    return out


def normal(rng, shape, amp=1.0):
    return (rng.standard_normal(shape) * amp).astype(np.float16)


def qkv(seed=0, B=1, Sq=6, Hq=4, Hkv=2, d=D, past=5, amp=1.0):
    rng = np.random.default_rng(seed)
    return (normal(rng, (B, Sq, Hq, d), amp), normal(rng, (B, Hkv, past + Sq, d)),
            normal(rng, (B, Hkv, past + Sq, d)))


def as_ref_dtype(impl, x):
    """A closed form in the checked output's precision."""
    return x if impl == "reference" else x.astype(np.float16)


# --------------------------------------------------------------------------- sinks

@pytest.mark.parametrize("impl", IMPLS)
def test_sink_plus_1e4_zeroes_its_heads_exactly(impl):
    """sigma = +1e4 on heads 0 and 2 (0.5 on heads 1 and 3). m = max(max_j s_j, sigma) = 1e4,
    so every e^(s_j - m) underflows to 0 and out = 0 / (0 + e^0) = 0, exactly, in fp64 and in
    the model's fp32 exp2 space (sig2 = sigma log2 e; exp2(m - sig2) = 0). The other heads
    are ordinary: a sink indexed by the wrong head would zero them instead."""
    q, k, v = qkv(seed=1)
    sink = np.array([1e4, 0.5, 1e4, 0.5], np.float16)
    out = run(impl, q, k, v, past_len=5, sink=sink)
    assert not out[:, :, [0, 2]].any()
    assert np.abs(out[:, :, [1, 3]]).min(axis=-1).max() > 0


@pytest.mark.parametrize("sigma", [-1e4, -np.inf], ids=["minus-1e4", "minus-inf"])
@pytest.mark.parametrize("impl", IMPLS)
def test_vanishing_sink_equals_no_sink(impl, sigma):
    """sigma = -1e4 contributes e^(-1e4 - m) = 0 to the denominator (underflow), and -inf is
    the documented "no sink for this head": both give, bit for bit, the output without a
    sink. The model must neither turn -inf into NaN (exp2(-inf - -inf)) nor let the sink
    into the max."""
    q, k, v = qkv(seed=2)
    sink = np.full(4, sigma, np.float16)
    with_sink = run(impl, q, k, v, past_len=5, window=4, sink=sink)
    without = run(impl, q, k, v, past_len=5, window=4)
    assert with_sink.tobytes() == without.tobytes()


@pytest.mark.parametrize("impl", IMPLS)
def test_dominating_sink_drives_the_output_to_zero(impl):
    """sigma = 30 against logits of order 0.1: out = sum_j e^(s_j) v_j / (sum_j e^(s_j) + e^30)
    is ~1e-13 |v|. The reference must follow the oracle to 1e-12 absolute (relL2 of a ~0
    vector means nothing); the model's output rounds to fp16 zero."""
    q, k, v = qkv(seed=3, amp=0.1)
    out = run(impl, q, k, v, past_len=5, sink=np.full(4, 30.0, np.float16))
    if impl == "reference":
        assert 0 < np.abs(out).max() < 1e-11
    else:
        assert not out.any()


# --------------------------------------------------------------------------- logits

def near_fp16_max_logits(seed, *, step, spread):
    """Integer-valued fp16 q, k whose logits (scale 1) are 60000 + step * (integer offset):
    q = [60000, step, ..., step], k = [1, c_1, ..., c_63] with c in [-spread, spread]. Every
    product and partial sum is an integer below 2**24, so the dots are exact in fp32 and
    fp64 alike."""
    rng = np.random.default_rng(seed)
    B, Sq, Hq, Hkv, past = 1, 6, 4, 2, 5
    q = np.full((B, Sq, Hq, D), step, np.float16)
    q[..., 0] = 60000  # fp16 max is 65504
    k = rng.integers(-spread, spread + 1, (B, Hkv, past + Sq, D)).astype(np.float16)
    k[..., 0] = 1
    v = normal(rng, (B, Hkv, past + Sq, D))
    return q, k, v, past


@pytest.mark.parametrize("impl", IMPLS)
def test_logits_near_fp16_max(impl):
    """Logits 59848..60120 (steps of 8, so neighbours differ by e^-8): nothing may overflow.
    The max is subtracted before exp (the model: in exp2 space, fma(dot, c2, -m) where both
    terms are ~8.7e4), so P is finite and the output is a sharp but exact-enough mixture of v
    rows.
    A per-head sink of the same size (60032, 60000, 59968, -inf) competes with the keys."""
    q, k, v, past = near_fp16_max_logits(0, step=8, spread=1)
    logits = q[0, :, 0].astype(np.float64) @ k[0, 0].astype(np.float64).T
    assert 59_000 < logits.max() < 61_000
    run(impl, q, k, v, past_len=past, scale=1.0)
    run(impl, q, k, v, past_len=past, scale=1.0,
        sink=np.array([60032, 60000, 59968, -np.inf], np.float16))


@pytest.mark.parametrize("impl", IMPLS)
def test_logits_near_fp16_max_with_near_ties(impl):
    """Logits 60000 + (sum of 63 integers in [-2, 2]): many keys within a unit or two of the
    max, so every p_j matters. The reference is exact against the oracle. No path rounds the
    exp2-space logit c2 * dot on its own (its ulp at 8.7e4 is 2^-7, up to 0.27 % in p_j, which
    34 of seeds 0-199 failed when the scalar kernel did): p_j = exp2(fma(dot_j, c2, -m)) rounds
    once, and m's own rounding shifts every p_j of a row alike. (Over seeds 0-199 every model
    passes, and on the H200 m4_b64, mma_m4_b32 and wgmma_m16_b64. With m rounded to nearest the
    tensor-core paths failed 11; m rounded up keeps p_j <= 1, likely why: P rounded to fp16 in
    [1, 2), where a max key's p_j could land before, has twice the relative error it has below 1.)"""
    q, k, v, past = near_fp16_max_logits(26, step=1, spread=2)
    run(impl, q, k, v, past_len=past, scale=1.0)


@pytest.mark.parametrize("config", ["m4_b64", "mma_m4_b32", "wgmma_m16_b64"])
def test_finite_inputs_give_a_finite_output_at_logits_beyond_fp32_resolution(config):
    """Logits ~3.6e9 (q = [60000, 1, ...], k = [60000, c_1, ...]): no fp32 kernel resolves
    the offsets of a few units there (the dot itself rounds to 256), so no accuracy is asked,
    only that finite fp16 inputs give a finite output, as the fp64 reference does. The row max
    m is c2 * max_j dot_j rounded UP: rounded to nearest it sat up to ulp / 2 = 256 (in exp2
    units, ulp 512 at ~5.2e9) below a logit, p_j = exp2(256) = inf and out = inf / inf = NaN
    on every path of the model and on the H200's mma and wgmma kernels."""
    q, k, v, past = near_fp16_max_logits(0, step=1, spread=2)
    k[..., 0] = 60000
    ref = attention(*(x.astype(np.float64) for x in (q, k, v)), past_len=past, scale=1.0)
    assert np.isfinite(ref).all()
    with np.errstate(over="ignore", invalid="ignore"):
        out = model.attention(q, k, v, past_len=past, scale=1.0, config=config_from_name(config))
    assert np.isfinite(out).all(), f"{np.isnan(out).sum()} NaN of {out.size}"


@pytest.mark.parametrize("magnitude", [0.0, 60000.0], ids=["zero", "near-fp16-max"])
@pytest.mark.parametrize("impl", IMPLS)
def test_all_equal_logits_give_the_mean_of_visible_v(impl, magnitude):
    """Every visible key has the same logit (0, or 60000 at fp16's edge): softmax is uniform,
    so row p, seeing the n = min(p + 1, W) keys j in [p - W + 1, p], outputs
    sum_j v_j / (n + e^(sigma - s)) with smooth softmax's sigma = 0: 1 / (n + 1) of the sum
    at s = 0, the plain mean at s = 60000 (the sink vanishes)."""
    B, Sq, Hq, Hkv, past, W = 1, 7, 4, 2, 4, 3
    rng = np.random.default_rng(4)
    q = np.zeros((B, Sq, Hq, D), np.float16)
    k = np.zeros((B, Hkv, past + Sq, D), np.float16)
    q[..., 0], k[..., 0] = magnitude, 1
    v = normal(rng, (B, Hkv, past + Sq, D))
    out = run(impl, q, k, v, past_len=past, window=W, smooth_softmax=True, scale=1.0)
    want = np.empty((B, Sq, Hq, D))
    v64 = v.astype(np.float64)
    for i in range(Sq):
        p = past + i
        keys = v64[:, :, max(0, p - W + 1):p + 1]  # (B, Hkv, n, d)
        n = keys.shape[2]
        want[:, i] = np.repeat(keys.sum(axis=2) / (n + (1.0 if magnitude == 0 else 0.0)), Hq // Hkv, axis=1)
    if impl == "reference":
        np.testing.assert_allclose(out, want, rtol=1e-13, atol=1e-15)
    else:  # fp16 output: within one rounding of the closed form
        np.testing.assert_allclose(out.astype(np.float64), want, rtol=2**-10, atol=2**-24)


# --------------------------------------------------------------------------- geometry

@pytest.mark.parametrize("past", [0, 37], ids=["past0-one-key", "past37-decode"])
@pytest.mark.parametrize("impl", IMPLS)
def test_single_query_row(impl, past):
    """Sq = 1: one row at position past_len, the whole Q tile but one row empty. With
    past_len = 0 it sees one key, so out = v_0 e^(s_0) / (e^(s_0) + e^(sigma)) = v_0 / (1 +
    e^(sigma - s_0)) for its sink sigma; with past_len = 37 it is a decode step over a cache
    that ends mid-tile."""
    q, k, v = qkv(seed=5, Sq=1, Hq=8, Hkv=2, past=past)
    sink = np.array([-2, 0, 1, 3, -np.inf, 2, 0.5, -1], np.float16)
    out = run(impl, q, k, v, past_len=past, sink=sink)
    if past == 0:
        s0 = np.einsum("bhd,bhd->bh", q[:, 0].astype(np.float64),
                       np.repeat(k[:, :, 0], 4, axis=1).astype(np.float64)) / np.sqrt(D)
        want = np.repeat(v[:, :, 0], 4, axis=1).astype(np.float64) / (1 + np.exp(sink.astype(np.float64) - s0))[..., None]
        if impl == "reference":
            np.testing.assert_allclose(out[:, 0], want, rtol=1e-13)
        else:
            np.testing.assert_allclose(out[:, 0].astype(np.float64), want, rtol=2**-9, atol=2**-24)


@pytest.mark.parametrize("sink", ["none", "per_head"])
@pytest.mark.parametrize("impl", IMPLS)
def test_window_one_at_past_zero_sees_only_itself(impl, sink):
    """past_len = 0, W = 1: row i sees key i alone. Without a sink P = [1], so out_i = v_i
    exactly (the model too: exp2(0) = 1, l = 1); with a sink sigma, out_i = v_i / (1 +
    e^(sigma - s_ii)). A window one key too wide, or a start-tile clamp off by a tile, is
    visible in every row."""
    Sq, Hq, Hkv = 20, 4, 2
    q, k, v = qkv(seed=6, Sq=Sq, Hq=Hq, Hkv=Hkv, past=0)
    sig = np.array([0.5, -1, 2, -np.inf], np.float16) if sink == "per_head" else None
    out = run(impl, q, k, v, past_len=0, window=1, sink=sig)
    vv = np.repeat(v, Hq // Hkv, axis=1).transpose(0, 2, 1, 3)  # (B, Sq, Hq, d): v_i per head
    if sig is None:
        assert out.tobytes() == as_ref_dtype(impl, vv.astype(np.float64)).tobytes()
        return
    kk = np.repeat(k, Hq // Hkv, axis=1).transpose(0, 2, 1, 3).astype(np.float64)
    s = (q.astype(np.float64) * kk).sum(-1) / np.sqrt(D)
    want = vv.astype(np.float64) / (1 + np.exp(sig.astype(np.float64) - s))[..., None]
    if impl == "reference":
        np.testing.assert_allclose(out, want, rtol=1e-13)
    else:
        np.testing.assert_allclose(out.astype(np.float64), want, rtol=2**-9, atol=2**-24)


@pytest.mark.parametrize("impl", IMPLS)
def test_head_dim_outside_the_kernel_set(impl):
    """d = 8: the reference is exact as ever; the kernel declines d outside {64, 128}, so
    there is nothing to check on the model (a skip, with the reason)."""
    q, k, v = qkv(seed=7, d=8, past=3)
    run(impl, q, k, v, past_len=3, window=2, sink=np.full(4, 1.0, np.float16))


# --------------------------------------------------------------------------- canaries

def assert_model_adapter_passes(case: Case):
    """The ``model`` adapter (``refattn.kernels.get_kernel("model")``) on the case's inputs
    (NaN canaries in the cache padding and in every element of the output buffer) returns 0
    and the buffer itself, overwrites every element, and passes the derived gate against
    the fp64 reference."""
    __tracebackhide__ = True
    inputs = make_inputs(case)
    assert (inputs.out.view(np.uint16) == OUT_CANARY_BITS).all()
    k, v = inputs.clean_kv()
    ref, base = attention_with_baseline(inputs.q, k, v, **inputs.reference_kwargs())
    status, out = get_kernel("model").run(inputs)
    assert status == 0 and out is inputs.out
    unwritten = np.argwhere(out.view(np.uint16) == OUT_CANARY_BITS)
    assert len(unwritten) == 0, (f"{len(unwritten)} elements never written ({case.describe()}); "
                                 f"first at (b, row, h, col) = {tuple(unwritten[0])}")
    c = compare(out, ref, base)
    assert c.passed, f"{case.describe()}\n{c.failure_message()}"


def _case(**kw) -> Case:
    return Case(**({"name": "canary", "suite": "edge", "Hq": 4, "Hkv": 2, "d": 64, "sq": 16,
                    "why": "canary"} | kw))


WRITTEN = [
    _case(name="partial-q-tile", sq=45, past_len=77, sink="per_head"),
    _case(name="b2-d128-w9", B=2, d=128, sq=70, past_len=30, window=9, sink="smooth"),
    _case(name="w1-past0", sq=33, window=1, config={"m_tiles": 1, "bkv": 32}),
    _case(name="sq1-past100", sq=1, past_len=100, Hq=8, Hkv=1, sink="per_head"),
]


@pytest.mark.parametrize("case", WRITTEN, ids=lambda c: c.name)
def test_model_adapter_writes_every_element_of_a_nan_buffer(case):
    """Partial last Q tiles, B = 2, a window of one key, a single row: no element of the
    NaN-prefilled output may survive a successful call."""
    assert_model_adapter_passes(case)


DECLINED = [
    _case(name="d80", d=80),
    _case(name="d256", d=256, sink="per_head"),
    _case(name="softcap", softcap=30.0),
    _case(name="fp32", dtype="fp32", sink="smooth"),
]


@pytest.mark.parametrize("case", DECLINED, ids=lambda c: c.name)
def test_model_adapter_decline_leaves_the_buffer_byte_identical(case):
    """What the kernel does not implement is declined: status -1, the adapter's declared
    contract says so, and the output buffer is byte-identical to the fresh canary."""
    kernel = get_kernel("model")
    inputs = make_inputs(case)
    assert not kernel.supports(case)
    status, out = kernel.run(inputs)
    assert status == -1 and out is inputs.out and inputs.out_intact()
