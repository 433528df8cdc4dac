"""Re-enacted bugs of public attention kernels (tests/adapters/reenacted.py) against the case
matrix: each fails the matrix on the inline cases that expose its class of bug, and passes
those where the bug cannot show, which the same kernel without the bug passes too."""

from __future__ import annotations

import pytest

from refattn.cases import case_from_text
from refattn.runner import run_matrix
from tests.adapters.reenacted import (REENACTED, CleanAttention, Fp16QKAccumulation,
                                      ScaleAfterSoftcap, SinkFromKVHead, SinkSoftcapped,
                                      SoftcapAfterMask, SplitKVCombineIgnoresMax)

# kernel -> (cases that expose the bug, cases where it cannot show), as `--case` bodies
CASES = {
    SoftcapAfterMask: (
        ['Hq = 4, Hkv = 2, d = 64, sq = 16, softcap = 5.0',  # the causal future leaks e^-5
         'Hq = 4, Hkv = 2, d = 64, sq = 1, past_len = 40, window = 8, softcap = 3.0',  # left of the window
         'Hq = 8, Hkv = 2, d = 64, sq = 32, past_len = 16, sink = "smooth", softcap = 3.0'],
        ['Hq = 4, Hkv = 2, d = 64, sq = 1, past_len = 40, softcap = 3.0',  # decode: nothing masked
         'Hq = 4, Hkv = 2, d = 64, sq = 32, past_len = 16, window = 8']),  # no softcap
    ScaleAfterSoftcap: (
        ['Hq = 4, Hkv = 2, d = 64, sq = 8, past_len = 8, softcap = 3.0, sink = "per_head"',
         'Hq = 8, Hkv = 2, d = 64, sq = 1, past_len = 40, softcap = 50.0, sink = "smooth"'],
        ['Hq = 4, Hkv = 2, d = 64, sq = 32, past_len = 16',  # no softcap
         'Hq = 4, Hkv = 2, d = 64, sq = 32, past_len = 16, softcap = 30.0, scale = 1.0']),  # scale 1
    SplitKVCombineIgnoresMax: (
        ['Hq = 4, Hkv = 2, d = 64, sq = 32, past_len = 16',  # 48 keys: 3 splits
         'Hq = 4, Hkv = 2, d = 64, sq = 8, past_len = 8, sink = "smooth"'],  # one split and a sink
        ['Hq = 4, Hkv = 2, d = 64, sq = 8, past_len = 8',  # 16 keys: one split
         'Hq = 4, Hkv = 2, d = 64, sq = 8, past_len = 8, softcap = 3.0, window = 4']),
    Fp16QKAccumulation: (
        ['Hq = 4, Hkv = 2, d = 128, sq = 32, past_len = 16, scale = 1.0',
         'Hq = 4, Hkv = 2, d = 256, sq = 32, past_len = 16, scale = 1.0'],
        ['Hq = 4, Hkv = 2, d = 16, sq = 32, past_len = 16',  # one 16-dim step: one rounding
         'Hq = 4, Hkv = 2, d = 16, sq = 32, past_len = 16, sink = "per_head", window = 8']),
    SinkFromKVHead: (
        ['Hq = 8, Hkv = 2, d = 64, sq = 32, past_len = 16, sink = "per_head"',
         'Hq = 4, Hkv = 2, d = 64, sq = 8, past_len = 8, softcap = 3.0, sink = "per_head"'],
        ['Hq = 4, Hkv = 4, d = 64, sq = 32, past_len = 16, sink = "per_head"',  # G = 1
         'Hq = 8, Hkv = 2, d = 64, sq = 32, past_len = 16, sink = "smooth"']),  # sigma = 0 everywhere
    SinkSoftcapped: (
        ['Hq = 8, Hkv = 2, d = 64, sq = 32, past_len = 16, sink = "per_head", softcap = 2.0',
         'Hq = 4, Hkv = 2, d = 64, sq = 8, past_len = 8, softcap = 3.0, sink = "per_head"'],
        ['Hq = 8, Hkv = 2, d = 64, sq = 32, past_len = 16, sink = "per_head"',  # no softcap
         'Hq = 8, Hkv = 2, d = 64, sq = 32, past_len = 16, sink = "smooth", softcap = 3.0']),  # tanh(0) = 0
}
ALL_CASES = sorted({t for kills, blind in CASES.values() for t in kills + blind})

# NaN-free but overflowing intermediates (exp of a masked -inf, tanh of large dots) are the
# kernels' own arithmetic
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _matrix(kernel, texts):
    return run_matrix(kernel, [case_from_text(t, name=f"c{i}") for i, t in enumerate(texts)])


def test_every_reenacted_bug_has_cases():
    assert set(CASES) == set(REENACTED)
    assert all(kernel.__doc__ and kernel.name.startswith("numpy-") for kernel in REENACTED)


def test_the_kernel_without_a_bug_passes_every_case():
    res = _matrix(CleanAttention(), ALL_CASES)
    assert res.ok, [(r.case, r.outcome, r.summary) for r in res.failures()]


@pytest.mark.parametrize("kernel", REENACTED, ids=lambda k: k.name)
def test_the_bug_fails_the_cases_that_expose_it(kernel):
    kills, _ = CASES[kernel]
    res = _matrix(kernel(), kills)
    assert [r.outcome for r in res.results] == ["fail"] * len(kills), kills


@pytest.mark.parametrize("kernel", REENACTED, ids=lambda k: k.name)
def test_the_bug_passes_where_it_cannot_show(kernel):
    _, blind = CASES[kernel]
    res = _matrix(kernel(), blind)
    assert res.ok, [(r.case, r.outcome, r.summary) for r in res.failures()]
