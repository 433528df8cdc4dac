"""Invalid arguments are rejected before any work, with a ValueError naming the argument.

The contract (docs/ARCHITECTURE.md, refattn.args): every invalid argument raises
``ValueError`` whose message starts with the argument's name. The same bad calls are made
against the reference (`refattn.attention`) and the oracle (`refattn.oracle.attention_mp`),
which share the validator. "Before any work" is checked two ways: the reference's compute
routine is replaced by a tripwire, and a huge (zero-memory, broadcast) but invalid call must
come back at once.
"""

from __future__ import annotations

import re
import time

import numpy as np
import pytest

from refattn import attention
from refattn.oracle import MAX_PAIRS, attention_mp

B, SQ, HQ, HKV, D, PAST = 2, 3, 4, 2, 8, 2


def valid_call() -> dict:
    rng = np.random.default_rng(0)
    return dict(
        q=rng.standard_normal((B, SQ, HQ, D)),
        k=rng.standard_normal((B, HKV, PAST + SQ, D)),
        v=rng.standard_normal((B, HKV, PAST + SQ, D)),
        past_len=PAST, window=-1, sink=None, smooth_softmax=False, softcap=0.0, scale=None,
    )


def _shape(name, shape):
    return lambda c: c | {name: np.zeros(shape)}


def _set(**kw):
    return lambda c: c | kw


def _dtype(name, dt):
    return lambda c: c | {name: c[name].astype(dt)}


class _Rank4Subclass(np.ndarray):
    """An ndarray subclass (as a third-party array type would be): refused, since numpy's
    kernels may not honour what the subclass adds."""


# (id, argument named in the message, how to break a valid call)
BAD = [
    # q, k, v: type, rank, dtype, empty dims, shapes
    ("q-list", "q", lambda c: c | {"q": c["q"].tolist()}),
    ("k-list", "k", lambda c: c | {"k": c["k"].tolist()}),
    ("v-none", "v", _set(v=None)),
    ("q-scalar", "q", _set(q=1.0)),
    ("q-rank3", "q", _shape("q", (B, SQ, HQ * D))),
    ("k-rank5", "k", _shape("k", (B, HKV, PAST + SQ, D, 1))),
    ("v-rank3", "v", _shape("v", (B, PAST + SQ, D))),
    ("q-int", "q", _dtype("q", np.int32)),
    ("k-int", "k", _dtype("k", np.int64)),
    ("v-uint8", "v", _dtype("v", np.uint8)),
    ("q-bool", "q", _dtype("q", np.bool_)),
    ("k-complex", "k", _dtype("k", np.complex128)),
    ("q-masked-array", "q", lambda c: c | {"q": np.ma.masked_array(c["q"])}),
    ("k-matrix-subclass", "k", lambda c: c | {"k": c["k"].view(_Rank4Subclass)}),
    ("q-empty-sq", "q", _shape("q", (B, 0, HQ, D))),
    ("q-empty-d", "q", _shape("q", (B, SQ, HQ, 0))),
    ("k-empty-hkv", "k", _shape("k", (B, 0, PAST + SQ, D))),
    ("v-shape-ne-k", "v", _shape("v", (B, HKV, PAST + SQ, D + 1))),
    ("v-heads-ne-k", "v", _shape("v", (B, HKV * 2, PAST + SQ, D))),
    ("kv-batch-ne-q", "k", lambda c: c | {"k": c["k"][:1], "v": c["v"][:1]}),
    ("kv-headdim-ne-q", "k", lambda c: c | {"k": c["k"][..., :4], "v": c["v"][..., :4]}),
    ("hq-not-multiple-of-hkv", "k",
     lambda c: c | {"k": np.zeros((B, 3, PAST + SQ, D)), "v": np.zeros((B, 3, PAST + SQ, D))}),
    ("hkv-gt-hq", "k",
     lambda c: c | {"k": np.zeros((B, 8, PAST + SQ, D)), "v": np.zeros((B, 8, PAST + SQ, D))}),
    # past_len
    ("past-negative", "past_len", _set(past_len=-1)),
    ("past-float", "past_len", _set(past_len=2.0)),
    ("past-str", "past_len", _set(past_len="2")),
    ("past-bool", "past_len", _set(past_len=True)),
    ("past-none", "past_len", _set(past_len=None)),
    ("past-too-small-for-k", "past_len", _set(past_len=PAST - 1)),
    ("past-too-large-for-k", "past_len", _set(past_len=PAST + 1)),
    ("past-zero-but-cache", "past_len", _set(past_len=0)),
    # window
    ("window-zero", "window", _set(window=0)),
    ("window-minus2", "window", _set(window=-2)),
    ("window-float", "window", _set(window=2.0)),
    ("window-str", "window", _set(window="4")),
    ("window-none", "window", _set(window=None)),
    ("window-bool", "window", _set(window=True)),
    ("window-beyond-int32", "window", _set(window=2**31)),
    ("window-beyond-int64", "window", _set(window=2**63)),
    # sink
    ("sink-short", "sink", _set(sink=np.zeros(HQ - 1))),
    ("sink-per-kv-head", "sink", _set(sink=np.zeros(HKV))),
    ("sink-2d", "sink", _set(sink=np.zeros((1, HQ)))),
    ("sink-nan", "sink", _set(sink=np.array([0.0, np.nan, 1.0, 2.0]))),
    ("sink-posinf", "sink", _set(sink=np.array([0.0, 1.0, np.inf, 2.0]))),
    ("sink-list", "sink", _set(sink=[0.0] * HQ)),
    ("sink-float", "sink", _set(sink=0.5)),
    ("sink-int-array", "sink", _set(sink=np.zeros(HQ, dtype=np.int64))),
    ("sink-masked-array", "sink", _set(sink=np.ma.masked_array(np.zeros(HQ), mask=[0, 1, 0, 0]))),
    # scale
    ("scale-nan", "scale", _set(scale=float("nan"))),
    ("scale-inf", "scale", _set(scale=float("inf"))),
    ("scale-zero", "scale", _set(scale=0.0)),
    ("scale-negative", "scale", _set(scale=-0.125)),
    ("scale-str", "scale", _set(scale="0.125")),
    ("scale-bool", "scale", _set(scale=True)),
    ("scale-beyond-fp32", "scale", _set(scale=1e39)),
    ("scale-below-fp32-normal", "scale", _set(scale=1e-39)),
    ("scale-int-beyond-float", "scale", _set(scale=10**400)),
    # softcap
    ("softcap-negative", "softcap", _set(softcap=-1.0)),
    ("softcap-nan", "softcap", _set(softcap=float("nan"))),
    ("softcap-inf", "softcap", _set(softcap=float("inf"))),
    ("softcap-str", "softcap", _set(softcap="30")),
    ("softcap-none", "softcap", _set(softcap=None)),
    ("softcap-beyond-fp32", "softcap", _set(softcap=1e39)),
    ("softcap-int-beyond-float", "softcap", _set(softcap=10**400)),
    # smooth_softmax
    ("smooth-int", "smooth_softmax", _set(smooth_softmax=1)),
    ("smooth-str", "smooth_softmax", _set(smooth_softmax="yes")),
]

BAD_DTYPE = [
    ("float16", np.float16),
    ("int", int),
    ("int32", np.int32),
    ("complex128", np.complex128),
    ("str-bogus", "not-a-dtype"),
    ("none-object", object),
]


def assert_names(excinfo, name: str) -> None:
    __tracebackhide__ = True
    msg = str(excinfo.value)
    assert re.match(rf"{re.escape(name)}\b", msg), f"message should start with {name!r}: {msg!r}"


@pytest.mark.parametrize("name,mutate", [(b[1], b[2]) for b in BAD], ids=[b[0] for b in BAD])
def test_reference_rejects(name, mutate, tripwire):
    c = mutate(valid_call())
    with pytest.raises(ValueError) as e:
        attention(c.pop("q"), c.pop("k"), c.pop("v"), **c)
    assert_names(e, name)


@pytest.mark.parametrize("name,mutate", [(b[1], b[2]) for b in BAD], ids=[b[0] for b in BAD])
def test_oracle_rejects(name, mutate):
    c = mutate(valid_call())
    with pytest.raises(ValueError) as e:
        attention_mp(c.pop("q"), c.pop("k"), c.pop("v"), **c)
    assert_names(e, name)


@pytest.mark.parametrize("dtype", [d[1] for d in BAD_DTYPE], ids=[d[0] for d in BAD_DTYPE])
def test_reference_rejects_dtype(dtype, tripwire):
    c = valid_call()
    with pytest.raises(ValueError) as e:
        attention(c.pop("q"), c.pop("k"), c.pop("v"), dtype=dtype, **c)
    assert_names(e, "dtype")


def test_valid_call_and_neginf_sink_are_accepted():
    """The base call of this file is valid (so each rejection above is due to its one change),
    and -inf is a legal sink logit (no sink for that head)."""
    c = valid_call()
    q, k, v = c.pop("q"), c.pop("k"), c.pop("v")
    sink = np.array([-np.inf, 0.5, -np.inf, -np.inf])
    for fn in (lambda **kw: attention(q, k, v, dtype=np.float64, **kw),
               lambda **kw: attention_mp(q, k, v, **kw)):
        assert fn(**c).shape == (B, SQ, HQ, D)
        out = fn(**(c | {"sink": sink, "window": 2, "softcap": 5.0, "scale": 0.3}))
        assert np.isfinite(out).all()


def test_bad_call_ids_are_unique():
    ids = [b[0] for b in BAD]
    assert len(ids) == len(set(ids))


# --- no work before validation ------------------------------------------------------------------

def _huge(shape, dtype=np.float32):
    """A read-only zero-stride view: any shape, no memory."""
    return np.broadcast_to(np.zeros((), dtype), shape)


# gpt-oss-like geometry at 1M tokens: a valid call would run for days.
HB, HSQ, HHQ, HHKV, HD = 1, 2**20, 64, 8, 64


@pytest.mark.parametrize("what,name", [
    pytest.param(w, n, id=w) for w, n in [
        ("window-zero", "window"), ("sink-nan", "sink"), ("scale-negative", "scale"),
        ("dtype-float16", "dtype"), ("past-mismatch", "past_len"), ("hq-not-multiple", "k")]
])
def test_reference_rejects_huge_invalid_call_at_once(what, name):
    q = _huge((HB, HSQ, HHQ, HD))
    kv = _huge((HB, HHKV if what != "hq-not-multiple" else 6, HSQ, HD))
    kw = dict(past_len=0, window=-1, sink=None, scale=None, dtype=np.float32)
    kw |= {
        "window-zero": {"window": 0},
        "sink-nan": {"sink": np.full(HHQ, np.nan)},
        "scale-negative": {"scale": -1.0},
        "dtype-float16": {"dtype": np.float16},
        "past-mismatch": {"past_len": 1},
        "hq-not-multiple": {},
    }[what]
    t = time.perf_counter()
    with pytest.raises(ValueError) as e:
        attention(q, kv, kv, **kw)
    assert time.perf_counter() - t < 1.0
    assert_names(e, name)


def test_absurd_size_is_refused():
    """Above refattn.args.MAX_ELEMENTS (2**34) elements an operand is refused up front."""
    q = _huge((1, 2**21, 2**8, 2**6))  # 2**35 elements
    kv = _huge((1, 1, 2**21, 2**6))
    with pytest.raises(ValueError) as e:
        attention(q, kv, kv, past_len=0)
    assert_names(e, "q")


def test_oracle_refuses_large_valid_shapes_at_once():
    """The oracle is for tiny shapes: a valid call over MAX_PAIRS query-key pairs is refused
    (naming q) before any conversion to mpmath."""
    q = _huge((HB, HSQ, HHQ, HD))
    kv = _huge((HB, HHKV, HSQ, HD))
    t = time.perf_counter()
    with pytest.raises(ValueError) as e:
        attention_mp(q, kv, kv, past_len=0)
    assert time.perf_counter() - t < 1.0
    assert_names(e, "q")
    # just over the limit, and just under it (a 1-row chunk over a cache of Skv keys)
    skv = MAX_PAIRS + 1
    with pytest.raises(ValueError) as e:
        attention_mp(_huge((1, 1, 1, 1)), _huge((1, 1, skv, 1)), _huge((1, 1, skv, 1)),
                     past_len=skv - 1)
    assert_names(e, "q")


def test_oracle_at_its_size_limit_runs():
    hq = 40
    skv = MAX_PAIRS // hq  # 1 row x 40 heads x skv keys = exactly MAX_PAIRS: allowed
    q = np.ones((1, 1, hq, 1))
    kv = np.ones((1, 1, skv, 1))
    out = attention_mp(q, kv, kv, past_len=skv - 1, window=3)
    np.testing.assert_allclose(out, 1.0, rtol=1e-15)


@pytest.mark.parametrize("dps", [39, 10, 40.0, "50", True], ids=str)
def test_oracle_rejects_low_or_non_int_dps(dps):
    c = valid_call()
    with pytest.raises(ValueError) as e:
        attention_mp(c.pop("q"), c.pop("k"), c.pop("v"), dps=dps, **c)
    assert_names(e, "dps")
