"""The oracle: GQA attention evaluated in mpmath, one query row at a time, straight from the
formula of docs/semantics.md (Semantics). It exists to validate `refattn.reference` and is only for tiny shapes.

For batch b, query row i (absolute position p = past_len + i), query head h reading KV head
h // G, with G = Hq // Hkv:

    s_j     = scale * sum_c q[b, i, h, c] * k[b, h // G, j, c]      scale defaults to 1/sqrt(d)
    s_j     = softcap * tanh(s_j / softcap)                          only when softcap > 0
    visible = j <= p  and  (W = -1  or  j >= p - W + 1)              W keys, self included
    m       = max(max_{visible j} s_j, sigma_h)                      sigma_h only with a sink
    out     = sum_{visible j} e^(s_j - m) v_j  /  (sum_{visible j} e^(s_j - m) + e^(sigma_h - m))

sigma_h is the given sink logit (unscaled, not softcapped; -inf means no sink for that head),
0 for every head under ``smooth_softmax`` alone, and absent when neither is given. A row with
no visible key outputs 0.

Ragged batches: with ``past_len`` an integer array (B,) sequence b's row i sits at
p = past_len[b] + i; with ``q_len`` (B,) only rows i < q_len[b] are computed and the others
are 0; sequence b's keys are j < past_len[b] + q_len[b] of its own cache, the rule above
applied to those only.

Every input element is a float and converts to an mpf exactly; all arithmetic (including the
default 1/sqrt(d), tanh and exp) runs at ``dps`` >= 40 significant digits, so the only
rounding visible at float64 is the final conversion. Nothing is shared with
`refattn.reference` except argument validation (`refattn.args`).
"""

from __future__ import annotations

import mpmath
import numpy as np

from refattn.args import check_attention_args

# Refuse more query-key pairs (B * Sq * Hq * Skv logits) than this: at ~dps 50 each pair costs
# d multiply-adds plus an exp, so this cap keeps one call to seconds, not hours.
MAX_PAIRS = 200_000
MIN_DPS = 40


def attention_mp(q, k, v, *, past_len, q_len=None, window=-1, sink=None, smooth_softmax=False,
                 softcap=0.0, scale=None, dps=50) -> np.ndarray:
    """GQA attention in mpmath. ``q: (B, Sq, Hq, d)``, ``k, v: (B, Hkv, past_len + Sq, d)``,
    ``sink: (Hq,)`` or None. Returns ``(B, Sq, Hq, d)`` float64 (each element the correctly
    rounded value of the high-precision result, up to the last few of ``dps`` digits).

    Ragged: ``past_len`` an integer array ``(B,)`` and/or ``q_len`` an integer array ``(B,)``;
    ``k, v`` hold at least ``max_b(past_len[b] + q_len[b])`` keys; padded rows are 0."""
    a = check_attention_args(q, k, v, past_len=past_len, q_len=q_len, window=window, sink=sink,
                             smooth_softmax=smooth_softmax, softcap=softcap, scale=scale,
                             allow_ragged=True)
    B, Sq = a.B, a.Sq
    # Per-sequence geometry, read from the arguments themselves (see below).
    pasts = [int(x) for x in past_len] if isinstance(past_len, np.ndarray) else [int(past_len)] * B
    rows = [Sq] * B if q_len is None else [int(x) for x in q_len]
    if a.ragged:
        pairs = a.Hq * sum(n * (p + n) for p, n in zip(pasts, rows))
        if pairs > MAX_PAIRS:
            raise ValueError(
                f"q: Hq * sum_b q_len[b] * (past_len[b] + q_len[b]) = {pairs} query-key pairs "
                f"exceeds the oracle's limit of {MAX_PAIRS}; the mpmath oracle is for tiny "
                f"shapes only")
    else:
        pairs = a.B * a.Sq * a.Hq * a.skv
        if pairs > MAX_PAIRS:
            raise ValueError(
                f"q: B*Sq*Hq*Skv = {a.B}*{a.Sq}*{a.Hq}*{a.skv} = {pairs} query-key pairs exceeds the "
                f"oracle's limit of {MAX_PAIRS}; the mpmath oracle is for tiny shapes only"
            )
    if isinstance(dps, bool) or not isinstance(dps, int) or dps < MIN_DPS:
        raise ValueError(f"dps: expected an int >= {MIN_DPS} significant digits, got {dps!r}")

    # Only the geometry is taken from the validated call; the options are read here, from
    # the arguments themselves, so the oracle does not share the reference's resolution.
    Hq, d, G = a.Hq, a.d, a.G
    W = int(window)
    out = np.zeros((B, Sq, Hq, d), dtype=np.float64)  # padded rows stay 0
    with mpmath.workdps(dps):
        mpf = mpmath.mpf
        to_mp = np.vectorize(lambda x: mpf(float(x)), otypes=[object])
        with np.errstate(invalid="ignore"):  # a NaN canary in a slot no row reads
            qm, km, vm = to_mp(q), to_mp(k), to_mp(v)  # exact: every float is an mpf
        # The default scale 1/sqrt(d) is taken exactly, not from its float64 rounding.
        sc = 1 / mpmath.sqrt(d) if scale is None else mpf(float(scale))
        cap = mpf(float(softcap))
        if sink is not None:  # a given sink wins over smooth_softmax; -inf stays -inf
            sigma = [mpf(float(x)) for x in sink]
        elif smooth_softmax:
            sigma = [mpf(0)] * Hq
        else:
            sigma = [None] * Hq
        for b in range(B):
            n_keys = pasts[b] + rows[b]  # sequence b's own keys; later slots are not its own
            for i in range(rows[b]):
                p = pasts[b] + i
                keys = [j for j in range(n_keys) if j <= p and (W < 0 or j >= p - W + 1)]
                for h in range(Hq):
                    out[b, i, h] = _row(qm[b, i, h], km[b, h // G], vm[b, h // G], keys, sc,
                                        cap, sigma[h], d)
    return out


def _row(qrow, kh, vh, keys, sc, cap, sigma, d):
    """One output row: ``qrow: (d,)`` mpf, ``kh, vh: (Skv, d)`` mpf, ``keys`` the visible j."""
    s = []
    for j in keys:
        x = sc * mpmath.fdot(qrow, kh[j])
        if cap > 0:
            x = cap * mpmath.tanh(x / cap)
        s.append(x)
    cands = s + ([] if sigma is None else [sigma])
    if not cands:
        return np.zeros(d)
    m = max(cands)
    if m == mpmath.ninf:  # no visible key and a -inf sink: an empty row
        return np.zeros(d)
    e = [mpmath.exp(x - m) for x in s]
    den = mpmath.fsum(e) + (0 if sigma is None else mpmath.exp(sigma - m))
    return np.array([float(mpmath.fsum(ej * vh[j][c] for ej, j in zip(e, keys)) / den)
                     for c in range(d)])
