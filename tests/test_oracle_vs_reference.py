"""The reference (`refattn.attention`, fp64 and fp32 paths) against the mpmath oracle.

A sweep of tiny shapes that switches on every feature of docs/semantics.md (Semantics) alone
and in combination: per-head sinks (with a -inf entry), smooth softmax, sink + smooth (the
sink wins), windows (1, mid, == Skv, > Skv), past_len 0 and > 0, G = 1, G = Hq, softcap,
batch 2.

Gates (relL2 = ||ref - oracle|| / ||oracle||):
    fp64  <= 1e-12   a few ulps of error per element, amplified by at most the softmax's
                      conditioning on O(1) logits; a masking or sink bug is O(1)
    fp32  <= 1e-5    fp32 inputs (rounded once, seen identically by both sides) computed in
                      fp32: ~1e-7 per element, with headroom for d-long dot products

The oracle's expected value is computed from the *semantic* options: where the reference is
given sink + smooth_softmax, the oracle is given the sink alone, so "the sink wins" is checked
rather than shared through the argument resolver.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import zlib
from functools import lru_cache

import numpy as np
import pytest

import refattn.reference as reference
from refattn import attention
from refattn.oracle import attention_mp

FP64_GATE = 1e-12
FP32_GATE = 1e-5

# Per-head sink logits, cycled over Hq: a -inf head (no sink), a dominating one, a negative
# one and one near the logits' range.
SINK_CYCLE = (-np.inf, 0.7, -1.3, 2.5, 0.0, 4.0)


@dataclass(frozen=True)
class Case:
    name: str
    B: int = 1
    Sq: int = 5
    Hq: int = 4
    Hkv: int = 2
    d: int = 8
    past_len: int = 0
    window: int = -1
    sink: str | None = None  # None | "mixed" (SINK_CYCLE) | "neginf" (all -inf) | "big"
    smooth_softmax: bool = False
    softcap: float = 0.0
    scale: float | None = None
    # options the oracle gets instead of the reference's (the expected semantics)
    oracle_overrides: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def skv(self) -> int:
        return self.past_len + self.Sq


CASES = [
    Case("mha-causal", Hq=2, Hkv=2),
    Case("gqa-g2-causal"),
    Case("g1-three-heads", Hq=3, Hkv=3),
    Case("mqa-g-eq-hq", Hq=4, Hkv=1),
    Case("past6-causal", Sq=4, past_len=6),
    Case("decode-sq1-past7", Sq=1, past_len=7),
    Case("batch2-past3", B=2, Sq=4, past_len=3),
    Case("d1", d=1, past_len=2),
    Case("scale-explicit", scale=0.9, past_len=2),
    # sinks
    Case("sink-mixed", sink="mixed"),
    Case("sink-mixed-past4", sink="mixed", past_len=4, Hq=6, Hkv=3),
    Case("sink-all-neginf", sink="neginf", past_len=2),
    Case("sink-dominating", sink="big", past_len=2),
    Case("smooth", smooth_softmax=True),
    Case("smooth-past5", smooth_softmax=True, past_len=5),
    Case("sink+smooth-sink-wins", sink="mixed", smooth_softmax=True, past_len=3,
         oracle_overrides={"smooth_softmax": False}),
    # windows
    Case("window1", window=1, past_len=3),
    Case("window1-past0", window=1),
    Case("window2-past4", window=2, past_len=4),
    Case("window3-past0", window=3, Sq=6),
    Case("window-eq-skv", window=9, past_len=4),
    Case("window-gt-skv", window=50, past_len=4),
    Case("window-mid-past8", window=4, Sq=6, past_len=8),
    Case("window2-sink-mixed", window=2, sink="mixed", past_len=3),
    Case("window1-smooth", window=1, smooth_softmax=True, past_len=2),
    # softcap
    Case("softcap", softcap=1.5, scale=2.0, past_len=2),
    Case("softcap-sink", softcap=0.8, sink="mixed", past_len=2),
    # everything at once
    Case("all-b2-g2-past5-w3-sink-softcap", B=2, Sq=4, Hq=4, Hkv=2, past_len=5, window=3,
         sink="mixed", softcap=2.0, scale=0.7),
    Case("all-b2-mqa-past6-w4-smooth-softcap", B=2, Sq=3, Hq=3, Hkv=1, past_len=6, window=4,
         smooth_softmax=True, softcap=3.0),
]


def _sink(case: Case) -> np.ndarray | None:
    if case.sink is None:
        return None
    if case.sink == "mixed":
        return np.array([SINK_CYCLE[h % len(SINK_CYCLE)] for h in range(case.Hq)])
    if case.sink == "neginf":
        return np.full(case.Hq, -np.inf)
    if case.sink == "big":
        return np.full(case.Hq, 6.0)
    raise AssertionError(case.sink)


def _inputs(case: Case, dtype) -> tuple[np.ndarray, ...]:
    """Deterministic inputs rounded to ``dtype`` (so both sides see identical numbers)."""
    rng = np.random.default_rng(zlib.crc32(case.name.encode()))
    q = rng.standard_normal((case.B, case.Sq, case.Hq, case.d)) * 1.5
    k = rng.standard_normal((case.B, case.Hkv, case.skv, case.d))
    v = rng.standard_normal((case.B, case.Hkv, case.skv, case.d))
    sink = _sink(case)
    cast = (lambda a: None if a is None else a.astype(dtype))
    return cast(q), cast(k), cast(v), cast(sink)


def _kwargs(case: Case, sink) -> dict:
    return dict(past_len=case.past_len, window=case.window, sink=sink,
                smooth_softmax=case.smooth_softmax, softcap=case.softcap, scale=case.scale)


@lru_cache(maxsize=None)
def _oracle(case: Case, dtype_name: str) -> np.ndarray:
    q, k, v, sink = _inputs(case, np.dtype(dtype_name))
    kw = _kwargs(case, sink) | case.oracle_overrides
    return attention_mp(q, k, v, **kw)


def rel_l2(actual, expected) -> float:
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def _check(actual: np.ndarray, expected: np.ndarray, gate: float, dtype) -> None:
    __tracebackhide__ = True
    assert actual.dtype == dtype, f"output dtype {actual.dtype}, expected {dtype}"
    assert actual.shape == expected.shape
    bad = ~np.isfinite(actual)
    assert not bad.any(), f"{bad.sum()} non-finite outputs, first at (b, i, h, c) = {np.argwhere(bad)[0]}"
    err = rel_l2(actual, expected)
    if err > gate:
        diff = np.abs(actual - expected)
        at = np.unravel_index(np.argmax(diff), diff.shape)
        pytest.fail(f"relL2 {err:.3e} > {gate:.0e}; max |diff| {diff[at]:.3e} at (b, i, h, c) = "
                    f"{tuple(int(x) for x in at)}: actual {actual[at]!r}, expected {expected[at]!r}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_fp64_matches_oracle(case):
    q, k, v, sink = _inputs(case, np.float64)
    out = attention(q, k, v, dtype=np.float64, **_kwargs(case, sink))
    _check(out, _oracle(case, "float64"), FP64_GATE, np.float64)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_fp32_matches_oracle(case):
    q, k, v, sink = _inputs(case, np.float32)
    out = attention(q, k, v, dtype=np.float32, **_kwargs(case, sink))
    _check(out, _oracle(case, "float32"), FP32_GATE, np.float32)


def test_sink_cases_are_not_trivial():
    """The sweep must exercise the sink: with sinks the output is not the no-sink output
    (otherwise a reference that ignored sinks would pass the sink cases)."""
    for case in CASES:
        if case.sink in ("mixed", "big") or case.smooth_softmax:
            q, k, v, sink = _inputs(case, np.float64)
            with_sink = _oracle(case, "float64")
            kw = _kwargs(case, None) | {"smooth_softmax": False}
            without = attention(q, k, v, dtype=np.float64, **kw)
            assert rel_l2(with_sink, without) > 1e-3, case.name


# --- blocked paths -----------------------------------------------------------------------
# The reference tiles query rows into blocks (>= 16 rows) and limits each block to its key
# band; the tiny cases above fit in one block. Here the block size is forced down to a few
# rows so that block edges, windows narrower and wider than a block, and a partial last
# block are all compared with the oracle, every row.

BLOCKED = [
    Case("blocked-r3-causal-past4", Sq=10, Hq=2, Hkv=1, d=4, past_len=4),
    Case("blocked-r3-w1", Sq=10, Hq=2, Hkv=1, d=4, past_len=2, window=1),
    Case("blocked-r3-w2-sink", Sq=10, Hq=2, Hkv=2, d=4, past_len=5, window=2, sink="mixed"),
    Case("blocked-r3-w5-smooth", Sq=11, Hq=4, Hkv=2, d=4, past_len=3, window=5,
         smooth_softmax=True),
    Case("blocked-r3-w7-softcap-b2", B=2, Sq=9, Hq=2, Hkv=1, d=4, past_len=6, window=7,
         softcap=1.0, sink="mixed"),
]


@pytest.mark.parametrize("dtype,gate", [(np.float64, FP64_GATE), (np.float32, FP32_GATE)],
                         ids=["fp64", "fp32"])
@pytest.mark.parametrize("case", BLOCKED, ids=lambda c: c.name)
def test_small_blocks_match_oracle(case, dtype, gate, monkeypatch):
    monkeypatch.setattr(reference, "_MIN_ROWS", 3)
    monkeypatch.setattr(reference, "_MAX_ROWS", 3)
    q, k, v, sink = _inputs(case, dtype)
    out = attention(q, k, v, dtype=dtype, **_kwargs(case, sink))
    _check(out, _oracle(case, np.dtype(dtype).name), gate, dtype)


@pytest.mark.parametrize("window", [-1, 100], ids=["causal", "w100"])
def test_real_block_boundaries_match_oracle(window):
    """Rows at the reference's real block edges (512-row blocks for this shape) of a
    1100-row chunk, checked against the oracle on just those rows: by the semantics, rows [a, b)
    of a chunk equal a chunk of q[a:b] over the first past_len + b keys at past_len + a."""
    rng = np.random.default_rng(7)
    B, Sq, Hq, Hkv, d, past = 1, 1100, 2, 1, 4, 30
    q = rng.standard_normal((B, Sq, Hq, d))
    k = rng.standard_normal((B, Hkv, past + Sq, d))
    v = rng.standard_normal((B, Hkv, past + Sq, d))
    sink = np.array([0.3, -np.inf])
    out = attention(q, k, v, past_len=past, window=window, sink=sink, dtype=np.float64)
    for r in (0, 511, 512, 1023, 1024, 1099):
        exp = attention_mp(q[:, r:r + 1], k[:, :, :past + r + 1], v[:, :, :past + r + 1],
                           past_len=past + r, window=window, sink=sink)
        _check(out[:, r:r + 1], exp, FP64_GATE, np.float64)
