"""Ragged batches (docs/semantics.md, Ragged batches): the reference against the mpmath oracle,
the reference against itself one sequence at a time, canaries in every slot a sequence must not
read, padded rows, the scalar path, argument errors, and the converters of `refattn.ragged`.

Gates as in tests/test_oracle_vs_reference.py (relL2 against the oracle): fp64 <= 1e-12,
fp32 <= 1e-5. Every input below is built with canaries: NaN in every cache slot its sequence
must not read (at or past its own length ``past_len[b] + q_len[b]``, and left of the window of
its first row, which no row of the chunk sees) and NaN in the padded query rows, so a read of
any of them shows as a non-finite output.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import pytest

import refattn.reference as reference
from refattn import ragged
from refattn.args import check_attention_args
from refattn.oracle import attention_mp
from refattn.reference import attention, attention_lowp, attention_with_baseline

FP64_GATE = 1e-12
FP32_GATE = 1e-5
SINK_CYCLE = (-np.inf, 0.7, -1.3, 2.5, 0.0, 4.0)  # as in tests/test_oracle_vs_reference.py


@dataclass(frozen=True)
class RCase:
    name: str
    past: tuple[int, ...]
    q_len: tuple[int, ...] | None = None  # None: every row valid (no q_len argument)
    Sq: int = 4
    Hq: int = 4
    Hkv: int = 2
    d: int = 8
    window: int = -1
    sink: bool = False
    smooth_softmax: bool = False
    softcap: float = 0.0
    scale: float | None = None
    spare: int = 3  # cache slots past the longest sequence
    scalar_past: bool = False  # pass past_len as an int (all entries of ``past`` equal)

    @property
    def B(self) -> int:
        return len(self.past)

    @property
    def rows(self) -> tuple[int, ...]:
        return (self.Sq,) * self.B if self.q_len is None else self.q_len

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(p + n for p, n in zip(self.past, self.rows))

    @property
    def s_cap(self) -> int:
        return max(self.lengths) + self.spare

    def hidden_left(self, b: int) -> int:
        """Slots [0, this) of sequence b lie left of every row's window."""
        return 0 if self.window < 0 else max(0, self.past[b] - self.window + 1)

    def kwargs(self, sink) -> dict:
        past = self.past[0] if self.scalar_past else np.array(self.past, dtype=np.int64)
        q_len = None if self.q_len is None else np.array(self.q_len, dtype=np.int32)
        return dict(past_len=past, q_len=q_len, window=self.window, sink=sink,
                    smooth_softmax=self.smooth_softmax, softcap=self.softcap, scale=self.scale)


CASES = [
    RCase("mixed-past", past=(0, 7, 3)),
    RCase("decode-next-to-prefill", past=(6, 0, 2), q_len=(1, 5, 5), Sq=5),
    RCase("empty-cache-next-to-long", past=(0, 21), Sq=3),
    RCase("fully-padded-sequence", past=(2, 4, 0), q_len=(3, 0, 2), Sq=3),
    RCase("scalar-past-ragged-q", past=(3, 3, 3), q_len=(1, 4, 2), scalar_past=True),
    # W = 6: sequence 0 (4 keys) is never cut, sequence 1 (past 12) loses its first 7 slots,
    # sequence 2 (5 keys) is cut only for no row; sequence 3 loses 1 slot
    RCase("window-cuts-some", past=(0, 12, 1, 6), window=6),
    RCase("window1-ragged-q", past=(0, 5, 2), q_len=(2, 4, 1), window=1),
    RCase("sinks-window", past=(0, 9, 4), q_len=(3, 4, 1), Hq=6, Hkv=3, window=3, sink=True),
    RCase("smooth", past=(5, 0, 1), q_len=(4, 2, 3), smooth_softmax=True),
    RCase("sink-and-smooth", past=(1, 6), sink=True, smooth_softmax=True),
    RCase("softcap-sink", past=(0, 8, 3), q_len=(4, 1, 3), softcap=1.5, scale=1.2, sink=True),
    RCase("gqa-g3", past=(4, 0), q_len=(2, 4), Hq=6, Hkv=2, window=4),
    RCase("mqa", past=(2, 10, 0), Hq=4, Hkv=1, smooth_softmax=True, window=5),
    RCase("mha-d1", past=(3, 0), Hq=2, Hkv=2, d=1),
    RCase("tight-cache", past=(0, 5, 2), q_len=(4, 2, 0), spare=0, sink=True),
    RCase("b8-everything", past=(0, 1, 5, 9, 2, 0, 13, 4), q_len=(3, 1, 0, 3, 2, 3, 1, 3), Sq=3,
          Hq=6, Hkv=2, window=4, sink=True, softcap=2.0),
    RCase("b8-smooth-causal", past=(7, 0, 3, 0, 1, 11, 2, 5), q_len=(2, 2, 1, 0, 2, 2, 2, 1),
          Sq=2, Hq=2, Hkv=1, smooth_softmax=True),
]


def _sink(case: RCase):
    return np.array([SINK_CYCLE[h % len(SINK_CYCLE)] for h in range(case.Hq)]) if case.sink \
        else None


def _inputs(case: RCase, dtype, canary=np.nan, seed_extra: str = ""):
    """q, k, v, sink rounded to ``dtype``, ``canary`` in every slot a sequence must not read
    and in its padded query rows."""
    rng = np.random.default_rng(zlib.crc32((case.name + seed_extra).encode()))
    q = rng.standard_normal((case.B, case.Sq, case.Hq, case.d)) * 1.5
    k = rng.standard_normal((case.B, case.Hkv, case.s_cap, case.d))
    v = rng.standard_normal((case.B, case.Hkv, case.s_cap, case.d))
    fill_hidden(case, q, k, v, canary)
    sink = _sink(case)
    cast = (lambda a: None if a is None else a.astype(dtype))
    return cast(q), cast(k), cast(v), cast(sink)


def fill_hidden(case: RCase, q, k, v, value) -> None:
    """``value`` in the padded rows of q and in the slots of k, v no row of a sequence reads."""
    for b in range(case.B):
        q[b, case.rows[b]:] = value
        k[b, :, case.lengths[b]:] = value
        v[b, :, case.lengths[b]:] = value
        k[b, :, :case.hidden_left(b)] = value
        v[b, :, :case.hidden_left(b)] = value


@lru_cache(maxsize=None)
def _oracle(case: RCase, dtype_name: str) -> np.ndarray:
    q, k, v, sink = _inputs(case, np.dtype(dtype_name))
    kw = case.kwargs(sink)
    if case.sink and case.smooth_softmax:
        kw["smooth_softmax"] = False  # the sink wins: the oracle gets the semantics
    return attention_mp(q, k, v, **kw)


def rel_l2(actual, expected) -> float:
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def _check(case: RCase, actual, expected, gate: float, dtype) -> None:
    __tracebackhide__ = True
    assert actual.dtype == dtype and actual.shape == expected.shape
    bad = ~np.isfinite(actual)
    assert not bad.any(), f"{bad.sum()} non-finite outputs, first at {np.argwhere(bad)[0]}"
    assert_padded_rows_zero(case, actual)
    err = rel_l2(actual, expected)
    assert err <= gate, f"relL2 {err:.3e} > {gate:.0e}"
    # per sequence as well: a wrong small sequence must not hide behind a large one
    for b in range(case.B):
        n = case.rows[b]
        if n:
            e = rel_l2(actual[b, :n], expected[b, :n])
            assert e <= gate, f"sequence {b}: relL2 {e:.3e} > {gate:.0e}"


def assert_padded_rows_zero(case: RCase, out) -> None:
    __tracebackhide__ = True
    for b in range(case.B):
        pad = out[b, case.rows[b]:]
        assert np.array_equal(pad, np.zeros_like(pad)), f"sequence {b}: padded rows not 0"
        assert not np.signbit(pad).any(), f"sequence {b}: padded rows hold -0"


# ------------------------------------------------------------------- reference vs oracle


def test_sweep_covers_the_ragged_features():
    """The sweep holds what the semantics must be checked on; a case edited away fails here."""
    def some(pred):
        return any(pred(c) for c in CASES)

    assert some(lambda c: len(set(c.past)) > 1 and c.q_len is None)
    assert some(lambda c: 1 in c.rows and c.Sq in c.rows and c.Sq > 1)
    assert some(lambda c: 0 in c.past and max(c.past) >= 20)
    assert some(lambda c: 0 in c.rows)
    assert some(lambda c: c.scalar_past and c.q_len is not None)
    # a window that hides slots of some sequences and none of others
    assert some(lambda c: c.window > 0 and len({c.hidden_left(b) > 0 for b in range(c.B)}) == 2)
    assert some(lambda c: c.sink and c.window > 0)
    assert some(lambda c: c.smooth_softmax and not c.sink)
    assert some(lambda c: c.sink and c.smooth_softmax)
    assert some(lambda c: c.softcap > 0)
    assert some(lambda c: c.Hq // c.Hkv == 3 and c.Hkv > 1)
    assert some(lambda c: c.Hkv == 1)
    assert some(lambda c: c.B == 8)
    assert some(lambda c: c.spare == 0)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_fp64_matches_oracle(case):
    q, k, v, sink = _inputs(case, np.float64)
    out = attention(q, k, v, dtype=np.float64, **case.kwargs(sink))
    _check(case, out, _oracle(case, "float64"), FP64_GATE, np.float64)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_fp32_matches_oracle(case):
    q, k, v, sink = _inputs(case, np.float32)
    out = attention(q, k, v, dtype=np.float32, **case.kwargs(sink))
    _check(case, out, _oracle(case, "float32"), FP32_GATE, np.float32)


def test_oracle_is_not_blind_to_past_len():
    """The oracle's ragged result depends on each sequence's own past_len: shifting one
    sequence's past_len by one (same data) moves that sequence's rows and no other's."""
    case = CASES[0]
    q, k, v, _ = _inputs(case, np.float64, canary=0.0)
    base = attention_mp(q, k, v, **case.kwargs(None))
    kw = case.kwargs(None)
    kw["past_len"] = kw["past_len"] + np.array([0, 0, 1])
    moved = attention_mp(q, k, v, **kw)
    assert np.array_equal(base[:2], moved[:2])
    assert rel_l2(moved[2], base[2]) > 1e-3


# ------------------------------------------------------------------------- the baseline


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_baseline_is_finite_and_zero_on_padded_rows(case):
    q, k, v, sink = _inputs(case, np.float64)
    ref, base = attention_with_baseline(q, k, v, **case.kwargs(sink))
    for out in (ref, base):
        assert np.isfinite(out).all()
        assert_padded_rows_zero(case, out)
    assert rel_l2(base, ref) < 2e-3  # one fp16 rounding of P and of the output
    assert np.array_equal(attention_lowp(q, k, v, **case.kwargs(sink)), base)


def test_baseline_large_logits_path():
    """Logits above FP32_LOGITS_ABOVE take the baseline's fp32-dot path per sequence too:
    still finite, zero on padded rows, and equal to each sequence computed alone."""
    case = RCase("large-logits", past=(0, 6, 3), q_len=(4, 2, 0), window=3, sink=True)
    q, k, v, sink = _inputs(case, np.float64)
    q, k = q * 20, k * 20
    ref, base = attention_with_baseline(q, k, v, **case.kwargs(sink * 50))
    assert np.isfinite(base).all()
    assert_padded_rows_zero(case, base)
    for b in range(2):
        n, L = case.rows[b], case.lengths[b]
        r1, b1 = attention_with_baseline(q[b:b + 1, :n], k[b:b + 1, :, :L], v[b:b + 1, :, :L],
                                         past_len=case.past[b], window=3, sink=sink * 50)
        assert np.array_equal(b1, base[b:b + 1, :n]) and np.array_equal(r1, ref[b:b + 1, :n])


# ----------------------------------------------------------- one sequence at a time


def _per_sequence(case: RCase, q, k, v, sink, fn, **kw):
    """``fn`` on each sequence alone, as a uniform call: rows [0, q_len[b]) over keys
    [0, past_len[b] + q_len[b]) at past_len[b]."""
    outs = {}
    for b in range(case.B):
        n, L = case.rows[b], case.lengths[b]
        if n:
            outs[b] = fn(q[b:b + 1, :n], k[b:b + 1, :, :L], v[b:b + 1, :, :L],
                         past_len=case.past[b], window=case.window, sink=sink,
                         smooth_softmax=case.smooth_softmax, softcap=case.softcap,
                         scale=case.scale, **kw)
    return outs


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_ragged_equals_each_sequence_alone(case, dtype):
    """Bit for bit: a sequence of a ragged batch is computed as the uniform call over that
    sequence alone (its blocks and key band), whatever the other sequences hold."""
    q, k, v, sink = _inputs(case, dtype)
    out = attention(q, k, v, dtype=dtype, **case.kwargs(sink))
    for b, o in _per_sequence(case, q, k, v, sink, attention, dtype=dtype).items():
        np.testing.assert_array_equal(out[b:b + 1, :case.rows[b]], o, err_msg=f"sequence {b}")


@pytest.mark.parametrize("window", [-1, 7, 300])
def test_ragged_equals_each_sequence_alone_across_blocks(window, monkeypatch):
    """Sequences long enough for several row blocks (forced down to 5 rows), with partial
    last blocks of different lengths, and the same at the real block size over 600 rows."""
    case = RCase("blocks", past=(0, 40, 13, 3), q_len=(23, 17, 0, 9), Sq=23, Hq=4, Hkv=2,
                 d=4, window=window, sink=True)
    q, k, v, sink = _inputs(case, np.float64)
    with monkeypatch.context() as m:
        m.setattr(reference, "_MIN_ROWS", 5)
        m.setattr(reference, "_MAX_ROWS", 5)
        out = attention(q, k, v, dtype=np.float64, **case.kwargs(sink))
        assert np.isfinite(out).all()
        assert_padded_rows_zero(case, out)
        alone = _per_sequence(case, q, k, v, sink, attention, dtype=np.float64)
    for b, o in alone.items():
        np.testing.assert_array_equal(out[b:b + 1, :case.rows[b]], o, err_msg=f"sequence {b}")
    big = RCase("blocks-600", past=(0, 700, 31), q_len=(600, 513, 1), Sq=600, Hq=2, Hkv=1,
                d=4, window=window, sink=True)
    q, k, v, sink = _inputs(big, np.float32)
    out = attention(q, k, v, dtype=np.float32, **big.kwargs(sink))
    assert np.isfinite(out).all()
    assert_padded_rows_zero(big, out)
    for b, o in _per_sequence(big, q, k, v, sink, attention, dtype=np.float32).items():
        np.testing.assert_array_equal(out[b:b + 1, :big.rows[b]], o, err_msg=f"sequence {b}")


# --------------------------------------------------------------------------- canaries


@pytest.mark.parametrize("canary", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_unread_slots_do_not_matter(case, canary):
    """The slots a sequence must not read (and its padded query rows) change nothing: the
    output with canaries there is bit-identical to the output with other, finite data there."""
    q, k, v, sink = _inputs(case, np.float64, canary=canary)
    rng = np.random.default_rng(1)
    q2, k2, v2 = (np.where(np.isfinite(x), x, rng.standard_normal(x.shape)) for x in (q, k, v))
    assert not np.array_equal(k2, np.nan_to_num(k, nan=0, posinf=0, neginf=0))
    for dt in (np.float64, np.float32):
        a = attention(*(x.astype(dt) for x in (q, k, v)), dtype=dt, **case.kwargs(sink))
        b = attention(*(x.astype(dt) for x in (q2, k2, v2)), dtype=dt, **case.kwargs(sink))
        assert np.isfinite(a).all()
        np.testing.assert_array_equal(a, b)
    a = attention_with_baseline(q, k, v, **case.kwargs(sink))
    b = attention_with_baseline(q2, k2, v2, **case.kwargs(sink))
    assert all(np.isfinite(x).all() for x in a)
    np.testing.assert_array_equal(a[1], b[1])


def test_canaries_sit_where_the_rows_would_see_them():
    """The canaries are placed where a bug would read them: with every sequence's rows given
    the longest sequence's keys (a kernel reading past its own length), or a window ignored,
    NaN reaches the output."""
    case = next(c for c in CASES if c.name == "window-cuts-some")
    q, k, v, sink = _inputs(case, np.float64)
    kw = case.kwargs(sink)
    long = np.array(case.past) + (max(case.lengths) - np.array(case.lengths))
    with np.errstate(invalid="ignore"):
        assert np.isnan(attention(q, k, v, **(kw | {"past_len": long}))).any()
        assert np.isnan(attention(q, k, v, **(kw | {"window": -1}))).any()


# ---------------------------------------------------------------------- the scalar path


@pytest.mark.parametrize("window", [-1, 1, 5, 40])
def test_uniform_arrays_equal_the_scalar_path(window):
    """An array past_len of equal entries (and q_len = Sq each) over a cache with spare
    capacity is the scalar call over the exact cache, bit for bit, fp32, fp64 and baseline."""
    rng = np.random.default_rng(3)
    B, Sq, Hq, Hkv, d, P = 3, 37, 4, 2, 8, 29
    q = rng.standard_normal((B, Sq, Hq, d))
    k = rng.standard_normal((B, Hkv, P + Sq + 5, d))
    v = rng.standard_normal((B, Hkv, P + Sq + 5, d))
    k[:, :, P + Sq:] = v[:, :, P + Sq:] = np.nan
    sink = np.array([0.3, -np.inf, 1.0, 2.0])
    kw = dict(window=window, sink=sink, softcap=3.0)
    arr = dict(past_len=np.full(B, P), q_len=np.full(B, Sq, np.int16))
    kx, vx = k[:, :, :P + Sq], v[:, :, :P + Sq]
    for dt in (np.float32, np.float64):
        np.testing.assert_array_equal(attention(q, k, v, dtype=dt, **arr, **kw),
                                      attention(q, kx, vx, past_len=P, dtype=dt, **kw))
    for x, y in zip(attention_with_baseline(q, k, v, **arr, **kw),
                    attention_with_baseline(q, kx, vx, past_len=P, **kw)):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(attention_mp(q[:1, :3], k[:1, :, :P + 3], v[:1, :, :P + 3],
                                               past_len=np.array([P]), **kw),
                                  attention_mp(q[:1, :3], kx[:1, :, :P + 3], vx[:1, :, :P + 3],
                                               past_len=P, **kw))


def test_scalar_path_keeps_the_exact_cache_rule():
    """A scalar past_len without q_len keeps the equality rule (spare capacity refused); a
    ragged call accepts capacity."""
    q = np.zeros((2, 3, 2, 4))
    kv = np.zeros((2, 1, 9, 4))
    with pytest.raises(ValueError, match=r"^past_len: k.shape\[2\]=9 must equal"):
        attention(q, kv, kv, past_len=5)
    assert attention(q, kv, kv, past_len=np.array([5, 5])).shape == q.shape
    assert attention(q, kv, kv, past_len=5, q_len=np.array([3, 3])).shape == q.shape
    a = check_attention_args(q, kv, kv, past_len=6)  # 9 = 6 + 3
    assert (a.past_len, a.skv, a.past_lens, a.q_lens, a.ragged) == (6, 9, (6, 6), (3, 3), False)
    a = check_attention_args(q, kv, kv, past_len=np.array([0, 6]), q_len=np.array([2, 1]),
                             allow_ragged=True)
    assert (a.past_len, a.skv, a.past_lens, a.q_lens, a.ragged) == (None, 7, (0, 6), (2, 1), True)
    assert a.lengths == (2, 7)


def test_all_rows_padded_is_all_zero():
    q = np.ones((2, 3, 2, 4))
    kv = np.full((2, 1, 8, 4), np.nan)
    out = attention(q, kv, kv, past_len=np.array([5, 0]), q_len=np.array([0, 0]))
    assert np.array_equal(out, np.zeros_like(out))
    assert np.array_equal(attention_mp(q, kv, kv, past_len=np.array([5, 0]),
                                       q_len=np.array([0, 0])), np.zeros(q.shape))


# --------------------------------------------------------------------------- errors

B, SQ, HQ, HKV, D = 2, 3, 4, 2, 8
PAST = np.array([1, 4])
CAP = 6  # the longest sequence: 4 + 2


def valid_call() -> dict:
    rng = np.random.default_rng(0)
    return dict(q=rng.standard_normal((B, SQ, HQ, D)),
                k=rng.standard_normal((B, HKV, CAP, D)),
                v=rng.standard_normal((B, HKV, CAP, D)),
                past_len=PAST.copy(), q_len=np.array([3, 2]))


def _set(**kw):
    return lambda c: c | kw


BAD = [
    ("past-shape-3", "past_len", _set(past_len=np.array([1, 2, 3]))),
    ("past-shape-2d", "past_len", _set(past_len=np.array([[1, 2]]))),
    ("past-0d-array", "past_len", _set(past_len=np.array(2))),
    ("past-negative-entry", "past_len", _set(past_len=np.array([1, -1]))),
    ("past-negative-int", "past_len", _set(past_len=-1)),
    ("past-float-array", "past_len", _set(past_len=np.array([1.0, 2.0]))),
    ("past-bool-array", "past_len", _set(past_len=np.array([True, False]))),
    ("past-list", "past_len", _set(past_len=[1, 4])),
    ("past-float", "past_len", _set(past_len=1.0)),
    ("past-beyond-int32", "past_len", _set(past_len=np.array([0, 2**31]))),
    ("past-cache-too-short", "past_len", _set(past_len=np.array([1, 5]))),
    ("past-cache-too-short-scalar", "past_len", _set(past_len=5)),
    ("qlen-cache-too-short", "past_len", _set(q_len=np.array([3, 3]))),
    ("qlen-shape", "q_len", _set(q_len=np.array([3]))),
    ("qlen-2d", "q_len", _set(q_len=np.array([[3, 2]]))),
    ("qlen-negative", "q_len", _set(q_len=np.array([3, -1]))),
    ("qlen-over-sq", "q_len", _set(q_len=np.array([4, 2]))),
    ("qlen-float", "q_len", _set(q_len=np.array([3.0, 2.0]))),
    ("qlen-bool", "q_len", _set(q_len=np.array([True, True]))),
    ("qlen-list", "q_len", _set(q_len=[3, 2])),
    ("qlen-int", "q_len", _set(q_len=3)),
]


def assert_names(excinfo, name: str) -> None:
    __tracebackhide__ = True
    msg = str(excinfo.value)
    assert re.match(rf"{re.escape(name)}:", msg), f"message should start with {name!r}: {msg!r}"


def test_valid_call_is_valid():
    c = valid_call()
    for fn in (attention, attention_lowp, attention_mp):
        assert fn(**c).shape == (B, SQ, HQ, D)


@pytest.mark.parametrize("name,mutate", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_reference_rejects(name, mutate, tripwire):
    for fn in (attention, attention_lowp):
        with pytest.raises(ValueError) as e:
            fn(**mutate(valid_call()))
        assert_names(e, name)


@pytest.mark.parametrize("name,mutate", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_oracle_rejects(name, mutate):
    with pytest.raises(ValueError) as e:
        attention_mp(**mutate(valid_call()))
    assert_names(e, name)


def test_uniform_entry_points_refuse_ragged_arguments():
    """Without allow_ragged (the entry points that take one past_len for the batch), an
    array past_len or any q_len is refused, naming it."""
    c = valid_call()
    q, k, v = c["q"], c["k"], c["v"]
    with pytest.raises(ValueError) as e:
        check_attention_args(q, k, v, past_len=PAST)
    assert_names(e, "past_len")
    with pytest.raises(ValueError) as e:
        check_attention_args(q, k, v, past_len=4, q_len=np.array([3, 3]))
    assert_names(e, "q_len")
    with pytest.raises(ValueError) as e:
        check_attention_args(q, k, v, past_len=4, q_len=np.array([3, 3]),
                             allow_cache_capacity=True)
    assert_names(e, "q_len")


def test_oracle_pair_limit_counts_ragged_rows():
    """The oracle's size limit counts the pairs of valid rows only, and names q beyond it."""
    from refattn.oracle import MAX_PAIRS

    q = np.broadcast_to(np.zeros(()), (2, 400, 1, 1))
    kv = np.broadcast_to(np.zeros(()), (2, 1, 1000, 1))
    with pytest.raises(ValueError) as e:
        attention_mp(q, kv, kv, past_len=np.array([600, 0]), q_len=np.array([400, 1]))
    assert_names(e, "q")
    assert 400 * 1000 > MAX_PAIRS
    out = attention_mp(np.ones((2, 400, 1, 1)), np.ones((2, 1, 1000, 1)), np.ones((2, 1, 1000, 1)),
                       past_len=np.array([999, 0]), q_len=np.array([1, 0]), window=2)
    assert out[0, 0, 0, 0] == 1.0 and not out[0, 1:].any() and not out[1].any()


# ------------------------------------------------------------------- refattn.ragged


def test_ort_round_trip_first_prompt():
    past, q_len = np.zeros(3, np.int64), np.array([5, 1, 3])
    seqlens_k, total = ragged.to_ort(past, q_len, 5)
    assert seqlens_k.dtype == np.int32 and seqlens_k.tolist() == [4, 0, 2] and total == 5
    p2, q2 = ragged.from_ort(seqlens_k, total, 5)
    assert p2.tolist() == [0, 0, 0] and q2.tolist() == [5, 1, 3]


@pytest.mark.parametrize("past,Sq", [((4, 0, 9), 1), ((6,), 5), ((0, 0), 3)])
def test_ort_round_trip_full_chunks(past, Sq):
    past = np.array(past)
    seqlens_k, total = ragged.to_ort(past, None, Sq)
    assert seqlens_k.tolist() == (past + Sq - 1).tolist() and total == int((past + Sq).max())
    p2, q2 = ragged.from_ort(seqlens_k, total, Sq)
    assert p2.tolist() == past.tolist() and q2.tolist() == [Sq] * len(past)
    # and ORT's side round-trips through ours
    s3, t3 = ragged.to_ort(p2, q2, Sq)
    assert s3.tolist() == seqlens_k.tolist() and t3 == total


@pytest.mark.parametrize("past,q_len,Sq,name", [
    ((0, 0), (2, 0), 2, "q_len"),      # an empty sequence in a first prompt
    ((0, 0), (2, 1), 3, "q_len"),      # no sequence fills Sq = total_sequence_length
    ((3, 0), (2, 1), 2, "q_len"),      # padded rows after the first prompt
    ((3, 0), (2, 2), 2, "past_len"),   # a subsequent prompt of B > 1
])
def test_to_ort_refuses_what_ort_reads_differently(past, q_len, Sq, name):
    with pytest.raises(ValueError) as e:
        ragged.to_ort(np.array(past), np.array(q_len), Sq)
    assert_names(e, name)


@pytest.mark.parametrize("seqlens_k,total,Sq,name", [
    (np.array([3, 5], np.int32), 6, 2, "seqlens_k"),             # B = 2 subsequent prompt
    (np.array([3, 7], np.int32), 6, 1, "total_sequence_length"),  # a sequence beyond total
    (np.array([-1, 2], np.int32), 3, 3, "seqlens_k"),             # negative
    (np.array([1.0, 2.0]), 3, 3, "seqlens_k"),                    # not integers
    (np.array([0], np.int32), 4, 2, "seqlens_k"),                 # fewer keys than rows
    (np.array([0], np.int32), 0, 1, "total_sequence_length"),
])
def test_from_ort_refuses(seqlens_k, total, Sq, name):
    with pytest.raises(ValueError) as e:
        ragged.from_ort(seqlens_k, total, Sq)
    assert_names(e, name)


@pytest.mark.parametrize("appended", [True, False])
def test_cache_seqlens_round_trip(appended):
    past = np.array([0, 17, 4])
    cs = ragged.to_cache_seqlens(past, 3, appended=appended)
    assert cs.dtype == np.int32
    assert cs.tolist() == ((past + 3) if appended else past).tolist()
    assert ragged.from_cache_seqlens(cs, 3, appended=appended).tolist() == past.tolist()


def test_cache_seqlens_refuses_a_cache_shorter_than_the_chunk():
    with pytest.raises(ValueError) as e:
        ragged.from_cache_seqlens(np.array([5, 2], np.int32), 3)
    assert_names(e, "cache_seqlens")


def test_seqused_k_round_trip():
    past, q_len = np.array([0, 9, 2, 5]), np.array([3, 1, 0, 2])
    used = ragged.to_seqused_k(past, q_len)
    assert used.dtype == np.int32 and used.tolist() == [3, 10, 2, 7]
    assert ragged.from_seqused_k(used, q_len).tolist() == past.tolist()
    with pytest.raises(ValueError) as e:
        ragged.from_seqused_k(np.array([1, 1]), np.array([2, 1]))
    assert_names(e, "seqused_k")


def test_cu_seqlens_round_trip_and_errors():
    n = np.array([3, 0, 5, 1])
    cu = ragged.to_cu_seqlens(n)
    assert cu.dtype == np.int32 and cu.tolist() == [0, 3, 3, 8, 9]
    assert ragged.from_cu_seqlens(cu).tolist() == n.tolist()
    for bad in (np.array([1, 3]), np.array([0, 3, 2]), np.array([0]), np.array([0.0, 1.0])):
        with pytest.raises(ValueError) as e:
            ragged.from_cu_seqlens(bad)
        assert_names(e, "cu_seqlens")


def test_varlen_round_trip_and_errors():
    past, q_len = np.array([0, 9, 2, 5]), np.array([3, 1, 0, 2])
    cu_q, cu_k, max_q, max_k = ragged.to_varlen(past, q_len)
    assert cu_q.tolist() == [0, 3, 4, 4, 6] and cu_k.tolist() == [0, 3, 13, 15, 22]
    assert (max_q, max_k) == (3, 10)
    p2, q2 = ragged.from_varlen(cu_q, cu_k)
    assert p2.tolist() == past.tolist() and q2.tolist() == q_len.tolist()
    with pytest.raises(ValueError) as e:
        ragged.from_varlen(np.array([0, 3]), np.array([0, 2]))
    assert_names(e, "cu_seqlens_k")
    with pytest.raises(ValueError) as e:
        ragged.from_varlen(np.array([0, 3]), np.array([0, 3, 5]))
    assert_names(e, "cu_seqlens_k")


def test_lengths_errors_name_their_argument():
    for call, name in [
        (lambda: ragged.lengths(3, None, 4), "past_len"),
        (lambda: ragged.lengths(np.array([1, 2]), None), "Sq"),
        (lambda: ragged.lengths(np.array([1, 2]), np.array([5, 1]), 4), "q_len"),
        (lambda: ragged.lengths(np.array([1, 2]), np.array([1, 1, 1])), "q_len"),
        (lambda: ragged.lengths([1, 2], None, 4), "past_len"),
        (lambda: ragged.to_seqused_k(np.array([2**31 - 1]), np.array([1])), "seqused_k"),
    ]:
        with pytest.raises(ValueError) as e:
            call()
        assert_names(e, name)


def test_pack_unpack_rows_round_trip():
    rng = np.random.default_rng(5)
    q_len = np.array([3, 0, 1, 4])
    x = rng.standard_normal((4, 4, 2, 3))
    x[1, :] = x[0, 3:] = x[2, 1:] = np.nan  # padded rows: dropped by pack
    packed = ragged.pack_rows(x, q_len)
    assert packed.shape == (8, 2, 3) and np.isfinite(packed).all()
    cu = ragged.to_cu_seqlens(q_len)
    np.testing.assert_array_equal(packed[cu[3]:cu[4]], x[3])
    back = ragged.unpack_rows(packed, q_len, 4, fill=np.nan)
    np.testing.assert_array_equal(back, x)  # NaN in the same places
    zero = ragged.unpack_rows(packed, q_len, 4)
    assert not zero[1].any() and not zero[0, 3:].any()
    with pytest.raises(ValueError) as e:
        ragged.unpack_rows(packed[1:], q_len, 4)
    assert_names(e, "packed")
    with pytest.raises(ValueError) as e:
        ragged.pack_rows(x, np.array([5, 0, 1, 4]))
    assert_names(e, "q_len")


def test_pack_unpack_kv_round_trip():
    rng = np.random.default_rng(6)
    n = np.array([2, 7, 0])
    k = rng.standard_normal((3, 2, 9, 4))
    for b in range(3):
        k[b, :, n[b]:] = np.nan
    packed = ragged.pack_kv(k, n)
    assert packed.shape == (9, 2, 4) and np.isfinite(packed).all()
    np.testing.assert_array_equal(packed[2:9], k[1, :, :7].transpose(1, 0, 2))
    np.testing.assert_array_equal(ragged.unpack_kv(packed, n, 9, fill=np.nan), k)
    with pytest.raises(ValueError) as e:
        ragged.pack_kv(k, np.array([2, 10, 0]))
    assert_names(e, "seqlens")
    with pytest.raises(ValueError) as e:
        ragged.unpack_kv(packed, n, 6)
    assert_names(e, "S_cap")


def _varlen_attention(q, k, v, cu_q, cu_k, window, sink):
    """FlashAttention varlen semantics on packed q (total_q, Hq, d), k, v (total_k, Hkv, d):
    row i of sequence b sees key j of that sequence iff j <= len_k - len_q + i (bottom-right)
    and, under window W, j >= len_k - len_q + i - (W - 1). fp64, dense, no shared code."""
    Hq, d = q.shape[1:]
    G = Hq // k.shape[1]
    out = np.zeros_like(q)
    for b in range(len(cu_q) - 1):
        qb, kb, vb = q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]
        lq, lk = len(qb), len(kb)
        i, j = np.arange(lq)[:, None], np.arange(lk)[None, :]
        diag = lk - lq + i
        vis = (j <= diag) & ((window < 0) | (j >= diag - (window - 1)))
        for h in range(Hq):
            s = np.where(vis, qb[:, h] @ kb[:, h // G].T / np.sqrt(d), -np.inf)
            m = np.maximum(s.max(axis=1, initial=-np.inf), sink[h])[:, None]
            p = np.exp(s - m)
            out[cu_q[b]:cu_q[b + 1], h] = (p @ vb[:, h // G]) / (p.sum(1)[:, None]
                                                                  + np.exp(sink[h] - m))
    return out


@pytest.mark.parametrize("window", [-1, 3])
def test_varlen_layout_computes_the_same_attention(window):
    """The converters describe the reference's semantics: the padded ragged batch through
    the reference, packed, equals FlashAttention's varlen rule on the packed layout built by
    to_varlen / pack_rows / pack_kv."""
    case = RCase("varlen", past=(0, 9, 2, 5), q_len=(3, 1, 0, 4), Sq=4, Hq=4, Hkv=2,
                 window=window, sink=True)
    q, k, v, _ = _inputs(case, np.float64, canary=0.0)  # dense P.V below: no NaN slots
    sink = np.array([0.5, -1.0, 2.0, 0.0])
    past, q_len = np.array(case.past), np.array(case.q_len)
    out = attention(q, k, v, past_len=past, q_len=q_len, window=window, sink=sink,
                    dtype=np.float64)
    cu_q, cu_k, _, _ = ragged.to_varlen(past, q_len)
    lens = ragged.from_cu_seqlens(cu_k)
    got = _varlen_attention(ragged.pack_rows(q, q_len), ragged.pack_kv(k, lens),
                            ragged.pack_kv(v, lens), cu_q, cu_k, window, sink)
    np.testing.assert_allclose(ragged.pack_rows(out, q_len), got, rtol=1e-12, atol=1e-13)
    np.testing.assert_array_equal(ragged.unpack_rows(ragged.pack_rows(out, q_len), q_len, 4), out)
