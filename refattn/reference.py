"""The reference: GQA attention with sinks, smooth softmax, sliding windows and chunked
prefill, in fp32 or fp64 NumPy.

Semantics (docs/semantics.md, ONNX Runtime GroupQueryAttention):

    p = past_len + i                                   absolute position of query row i
    s_j = scale * q . k_j   (then softcap * tanh(s_j / softcap) when softcap > 0)
    visible(p, j) = j <= p  and  (W < 0  or  j >= p - W + 1)      W keys, self included
    m = max(max_{visible j} s_j, sigma_h)
    out = sum_j e^(s_j - m) v_j / (sum_j e^(s_j - m) + e^(sigma_h - m))

The sink term is present only when a sink is given (``smooth_softmax`` alone means
sigma_h = 0; a given sink wins over it). A row with no visible key outputs 0 (the causal
rule always shows a row itself, so this only matters to callers that build their own masks).

Ragged batches (docs/semantics.md, Ragged batches): ``past_len`` may be an integer array of
shape (B,) and ``q_len`` an integer array of shape (B,). Sequence b is then computed exactly
as the uniform call on its own: rows ``[0, q_len[b])`` at positions ``past_len[b] + i`` over
keys ``[0, past_len[b] + q_len[b])`` of ``k[b]``, with the blocks and band of that call;
rows ``i >= q_len[b]`` are exact zeros, and no slot at or past the sequence's own length is
read.

How it is computed: blocked over query rows, batched over the G query heads that share a
KV head, one BLAS GEMM for the scores and one for P.V per block. A block of rows
[i0, i1) only touches keys [lo, hi) with hi = p(i1 - 1) + 1 and, under a window,
lo = p(i0) - W + 1, so work is O(Sq * W) under a window, not O(Sq * Skv). The mask is only
evaluated on the two triangles where it can bite (the causal edge and the window edge),
where it sets the scores of invisible keys to -inf after the softcap (an assignment: a NaN or
an infinity from ``k`` there never reaches a row that cannot see it); columns in between are
visible to every row of the block. No (Hq, Sq, Skv) tensor is ever built: peak scratch is
bounded by ``_SCRATCH_BYTES`` per block.

Threads: the (batch, KV head) pairs run on a thread pool of :func:`pool_threads` threads,
``$REFATTN_THREADS`` when set, else ``min(8, os.cpu_count())``. The variable is read at each
call, so a pytest-xdist worker that sets it after import (``refattn.sharding.pin_environment``
gives each GPU worker its share of the host's CPUs) still takes it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from threadpoolctl import threadpool_limits

from refattn.args import Attn, check_attention_args, check_dtype, parse_count
from refattn.lowp import check_lowp, round_lowp

# Scratch budget for one block's score matrix (G x rows x keys). Sets the query block size.
_SCRATCH_BYTES = 8 * 2**20
_MIN_ROWS, _MAX_ROWS = 16, 512
THREADS_ENV = "REFATTN_THREADS"
MAX_DEFAULT_THREADS = 8  # more threads than this cost more than they gain on these blocks
_DEFAULT_THREADS = max(1, min(MAX_DEFAULT_THREADS, os.cpu_count() or 1))


def parse_threads(value: str) -> int:
    """``$REFATTN_THREADS`` as a thread count: an int >= 1, else ValueError naming it."""
    return parse_count(THREADS_ENV, value)


def pool_threads(environ: Mapping[str, str] | None = None) -> int:
    """Threads the reference spreads heads over: ``$REFATTN_THREADS`` when set and not empty,
    else ``min(8, os.cpu_count())``. ``environ`` defaults to ``os.environ``, read now."""
    environ = os.environ if environ is None else environ
    value = environ.get(THREADS_ENV, "")
    return parse_threads(value) if value.strip() else _DEFAULT_THREADS


def visible(p, j, window: int):
    """Key ``j`` is visible from absolute query position ``p`` (broadcasting arrays).

    ORT convention: ``W`` keys are visible, self included, i.e. ``p - W + 1 <= j <= p``;
    ``window = -1`` means causal only.
    """
    causal = j <= p
    return causal if window < 0 else causal & (j >= p - window + 1)


def attention(q, k, v, *, past_len, q_len=None, window=-1, sink=None, smooth_softmax=False,
              softcap=0.0, scale=None, dtype=np.float32) -> np.ndarray:
    """GQA attention. ``q: (B, Sq, Hq, d)``, ``k, v: (B, Hkv, past_len + Sq, d)``,
    ``sink: (Hq,)`` or None. Returns ``(B, Sq, Hq, d)`` in ``dtype`` (float32 computes in
    fp32, float64 in fp64).

    Ragged: ``past_len`` an integer array ``(B,)`` and/or ``q_len`` an integer array ``(B,)``
    (valid rows per sequence, right-padded to Sq; default all Sq); ``k, v`` then hold at least
    ``max_b(past_len[b] + q_len[b])`` keys, and padded rows are 0."""
    dt = check_dtype(dtype)
    a = check_attention_args(q, k, v, past_len=past_len, q_len=q_len, window=window, sink=sink,
                             smooth_softmax=smooth_softmax, softcap=softcap, scale=scale,
                             allow_ragged=True)
    out, _ = _attention(a, q, k, v, dt, with_baseline=False)
    return out


def attention_with_baseline(q, k, v, *, past_len, q_len=None, window=-1, sink=None,
                            smooth_softmax=False, softcap=0.0, scale=None,
                            lowp: str = "fp16") -> tuple[np.ndarray, np.ndarray]:
    """The fp64 reference and, from the same scores, the low-precision baseline of the
    tolerance model (docs/semantics.md): P = e^(s - m) rounded to ``lowp`` (fp16, or bf16
    for a bf16 kernel) before P.V, the denominator from unrounded P, and the output rounded
    to ``lowp`` (returned as float64). Ragged arguments as in :func:`attention`; padded rows
    are 0 in both."""
    check_lowp(lowp)
    a = check_attention_args(q, k, v, past_len=past_len, q_len=q_len, window=window, sink=sink,
                             smooth_softmax=smooth_softmax, softcap=softcap, scale=scale,
                             allow_ragged=True)
    return _attention(a, q, k, v, np.dtype(np.float64), with_baseline=True, lowp=lowp)


def attention_lowp(q, k, v, **kw) -> np.ndarray:
    """Only the low-precision baseline of :func:`attention_with_baseline`."""
    return attention_with_baseline(q, k, v, **kw)[1]


def _rows_per_block(G: int, n_keys: int, itemsize: int, window: int) -> int:
    rows = _SCRATCH_BYTES // max(1, 2 * G * n_keys * itemsize)  # scores + one temporary
    if window > 0:
        # Under a window a block of R rows touches R + W - 1 keys for W useful ones per row:
        # R ~ W keeps the waste at 2x while keeping the number of BLAS calls low.
        rows = min(rows, max(64, window))
    return int(min(_MAX_ROWS, max(_MIN_ROWS, rows)))


def _attention(a: Attn, q, k, v, dt: np.dtype, with_baseline: bool, lowp: str = "fp16"):
    B, Sq, Hq, d, G = a.B, a.Sq, a.Hq, a.d, a.G
    W = a.window
    out = np.zeros((B, Sq, Hq, d), dtype=dt)
    base = np.zeros((B, Sq, Hq, d), dtype=np.float64) if with_baseline else None
    sink = None if a.sink is None else a.sink.astype(dt)

    def geometry(past: int, n: int) -> tuple[int, int, list[tuple[int, int]]]:
        """A sequence of n rows at past + i: its key band [k_lo, skv) (keys any of its rows
        can see) and its row blocks, as the uniform call of that geometry has them."""
        skv = past + n
        band = skv if W < 0 else min(skv, W + _MAX_ROWS)
        rows = _rows_per_block(G, band, dt.itemsize, W)
        k_lo = 0 if W < 0 else max(0, past - W + 1)
        return k_lo, skv, [(i0, min(n, i0 + rows)) for i0 in range(0, n, rows)]

    # A uniform call has one geometry; a ragged one, one per sequence (identical sequences
    # share it). A sequence with q_len = 0 has no blocks and leaves its rows 0.
    geo = {g: geometry(*g) for g in set(zip(a.past_lens, a.q_lens))}

    def head(b: int, h: int) -> None:
        past, n = a.past_lens[b], a.q_lens[b]
        k_lo, skv, blocks = geo[past, n]
        heads = slice(h * G, (h + 1) * G)
        # scale folded into q: s = (scale q) . k, one pass fewer over the scores
        qh = q[b, :n, heads, :].transpose(1, 0, 2).astype(dt) * dt.type(a.scale)  # (G, n, d)
        kh = np.asarray(k[b, h, k_lo:skv], dtype=dt)  # (skv - k_lo, d)
        vh = np.asarray(v[b, h, k_lo:skv], dtype=dt)
        sg = None if sink is None else sink[heads]
        for i0, i1 in blocks:
            o, ob = _block(a, past, qh[:, i0:i1], kh, vh, k_lo, sg, i0, i1, dt, with_baseline, lowp)
            out[b, i0:i1, heads, :] = o.transpose(1, 0, 2)
            if with_baseline:
                base[b, i0:i1, heads, :] = ob.transpose(1, 0, 2)

    jobs = [(b, h) for b in range(B) if a.q_lens[b] > 0 for h in range(a.Hkv)]
    # NumPy's ufuncs and BLAS release the GIL: heads run in parallel on the available cores.
    # BLAS is held to one thread meanwhile: its own threading on these mid-sized GEMMs costs
    # more than it gains (measured 15x slower on a loaded 2-core machine).
    workers = min(len(jobs), pool_threads())
    with threadpool_limits(1, user_api="blas"):
        if workers > 1:
            with ThreadPoolExecutor(workers) as pool:
                list(pool.map(lambda bh: head(*bh), jobs))
        else:
            for bh in jobs:
                head(*bh)
    return out, base


def _visible_block(p0: int, p1: int, c0: int, c1: int, W: int) -> np.ndarray:
    """:func:`visible` on rows p0..p1 x keys c0..c1-1, a (rows, keys) bool array."""
    p = np.arange(p0, p1 + 1)[:, None]
    j = np.arange(c0, c1)[None, :]
    return visible(p, j, W)


def _pv(P, vb):
    """P . V where a key a row cannot see (P = 0) never contributes, even if its value is
    NaN or Inf (0 * NaN would be NaN). Only blocks whose V band holds non-finite values take
    the slow path."""
    G, R, n = P.shape
    finite = np.isfinite(vb).all(axis=1)
    if finite.all():
        return (P.reshape(G * R, n) @ vb).reshape(G, R, -1)
    o = (P.reshape(G * R, n) @ np.where(finite[:, None], vb, 0)).reshape(G, R, -1)
    bad = np.flatnonzero(~finite)
    pb = P[:, :, bad, None]  # (G, R, nbad, 1)
    with np.errstate(invalid="ignore"):
        o += np.where(pb > 0, pb * vb[bad], 0).sum(axis=2)
    return o


# Where a row's largest logit (or its sink) exceeds this in magnitude, the low-precision
# baseline takes its logits from fp32 dot products (``_fp32_dots``): fp32 cannot resolve a
# logit better than |s| * 2^-24, which at |s| = 128 is 7.6e-6, under 2 % of the fp16
# rounding of P (2^-12 relative), and at |s| = 5e4 is 0.003, several times it.
FP32_LOGITS_ABOVE = 128.0


def _fp32_dots(qb, kb) -> np.ndarray:
    """``qb: (M, d) @ kb.T: (d, n)`` as fp32 dot products summed in component order, one
    fused multiply-add a component (the product exact, the sum rounded to fp32): what an
    fp32-accumulating kernel computes, in the order that rounds most when component 0 holds
    the largest term, as the input modes put it (``refattn.cases``)."""
    q = np.asarray(qb, dtype=np.float32).astype(np.float64)
    k = np.asarray(kb, dtype=np.float32).astype(np.float64)
    acc = np.zeros((q.shape[0], k.shape[0]), dtype=np.float32)
    for c in range(q.shape[1]):
        acc = (acc + np.multiply.outer(q[:, c], k[:, c])).astype(np.float32)
    return acc


def _masked_scores(a: Attn, qb, kb, p0: int, p1: int, lo: int, hi: int, dt, fp32_dots=False):
    """Scores of ``qb: (G, rows, d)`` (already scaled) against keys ``kb`` = [lo, hi), in
    ``dt`` (from :func:`_fp32_dots` with ``fp32_dots``), softcapped and masked: invisible
    keys are assigned -inf."""
    G, R, d = qb.shape
    W = a.window
    q2 = qb.reshape(G * R, d)
    s = (_fp32_dots(q2, kb) if fp32_dots else q2 @ kb.T).reshape(G, R, hi - lo)
    if a.softcap > 0:
        c = dt.type(a.softcap)
        s /= c
        np.tanh(s, out=s)
        s *= c
    # The mask can only bite on two column ranges: the causal edge (p0, p1] and, under a
    # window, the window edge [p0 - W + 1, p1 - W + 1). Everything else in [lo, hi) is
    # visible to every row of the block.
    edges = [(max(lo, p0 + 1), hi)]
    if W > 0:
        edges.append((lo, min(hi, max(lo, p1 - W + 1))))
    if len(edges) == 2 and edges[1][1] >= edges[0][0]:  # overlapping: one range
        edges = [(lo, hi)]
    for c0, c1 in edges:
        if c1 > c0:
            # Assigned, not added: a NaN or +inf score at a key a row cannot see (a non-finite
            # k there) must not survive the mask, and NaN + -inf is NaN. It comes after the
            # softcap, whose tanh keeps a NaN. copyto broadcasts the (rows, keys) mask over
            # the heads without the index arrays of a boolean assignment (3-4x slower).
            np.copyto(s[:, :, c0 - lo:c1 - lo], dt.type(-np.inf),
                      where=~_visible_block(p0, p1, c0, c1, W))
    return s


def _softmax_in_place(s, sink):
    """``s`` (masked scores) becomes P = e^(s - m); returns (l, empty rows, l made safe)."""
    m = s.max(axis=2)  # (G, R)
    if sink is not None:
        m = np.maximum(m, sink[:, None])
    empty = np.isneginf(m)
    m_safe = np.where(empty, 0, m)
    s -= m_safe[:, :, None]
    np.exp(s, out=s)
    l = s.sum(axis=2)
    if sink is not None:
        l += np.exp(sink[:, None] - m_safe)
    return m, empty, np.where(l > 0, l, 1)


def _block(a: Attn, past: int, qb, kh, vh, k_lo: int, sink, i0: int, i1: int, dt,
           with_baseline: bool, lowp: str = "fp16"):
    """Rows [i0, i1) of the G heads in ``qb: (G, rows, d)`` (already scaled), at positions
    ``past + i``, against their key band. ``kh, vh`` hold keys [k_lo, skv) of the sequence.

    The baseline (``with_baseline``) rounds P to ``lowp`` before P.V and the output to
    ``lowp``. Where
    a row's max logit exceeds :data:`FP32_LOGITS_ABOVE` in magnitude, the block's logits are
    fp32 dot products of the fp32-rounded scaled q and k (:func:`_fp32_dots`, the softcap in
    fp32 too): what an fp32-accumulating kernel can resolve there (docs/semantics.md,
    Coverage model)."""
    W = a.window
    p0, p1 = past + i0, past + i1 - 1  # first and last absolute positions
    lo = 0 if W < 0 else max(0, p0 - W + 1)
    hi = p1 + 1
    kb = kh[lo - k_lo:hi - k_lo]
    s = _masked_scores(a, qb, kb, p0, p1, lo, hi, dt)
    m, empty, l_safe = _softmax_in_place(s, sink)
    vb = vh[lo - k_lo:hi - k_lo]
    o = _pv(s, vb) / l_safe[:, :, None]
    o[empty] = 0
    ob = None
    if with_baseline:
        big = np.abs(m[~empty]).max(initial=0) > FP32_LOGITS_ABOVE
        if big:
            f32 = np.dtype(np.float32)
            s = _masked_scores(a, qb.astype(f32), kb, p0, p1, lo, hi, f32, fp32_dots=True)
            s = s.astype(np.float64)
            _, empty, l_safe = _softmax_in_place(s, sink)
        ob = _pv(round_lowp(s, lowp), vb) / l_safe[:, :, None]
        ob[empty] = 0
        ob = round_lowp(ob, lowp)
    return o, ob
