"""Re-enacted bugs of public attention kernels, as NumPy adapters (docs/adapters.md).

The fused kernel of this repository declines softcap and has one KV walk, so these classes of
bug cannot be mutants of it (refattn/mutants.py); here each is a small NumPy kernel that makes
the one mistake, for the case matrix to catch. ``CleanAttention`` is the same kernel without
a mistake: an fp32 attention in the steps a fused kernel takes (scores, scale, softcap, mask,
softmax with the sink in the denominator, P.V), each step a method that one bug overrides.

Semantics (docs/semantics.md): query head h reads KV head h // G; row i sits at position
past_len + i and sees keys j <= p, and under a window of W keys j >= p - W + 1; the logit is
softcap * tanh(scale * q.k / softcap) (scale * q.k without a softcap); invisible keys get -inf
after the softcap; the sink (per head, natural-log units, neither scaled nor softcapped; 0 for
smooth softmax) joins the denominator only.
"""

from __future__ import annotations

import numpy as np

_F32 = np.float32


class CleanAttention:
    """fp32 attention with every option the case format has: the baseline the bugs below
    depart from, one step each."""

    name = "numpy-reenacted-clean"

    def supports(self, case) -> bool:
        return True

    def run(self, x):
        k, v = x.clean_kv()
        B, Sq, Hq, d = x.q.shape
        Hkv, skv = k.shape[1], k.shape[2]
        G = Hq // Hkv
        scale = _F32(x.scale if x.scale is not None else d ** -0.5)
        q = x.q.astype(_F32).transpose(0, 2, 1, 3)  # (B, Hq, Sq, d)
        kh = np.repeat(k.astype(_F32), G, axis=1)  # (B, Hq, skv, d): query head h -> KV head h // G
        vh = np.repeat(v.astype(_F32), G, axis=1)
        pos, key = x.past_len + np.arange(Sq)[:, None], np.arange(skv)[None, :]
        vis = key <= pos
        if x.window > 0:
            vis &= key >= pos - x.window + 1
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            s = self.logits(q, kh, scale, _F32(x.softcap), vis)
            o = self.softmax_pv(s, vh, self.sink_logits(x, Hq, Hkv))
        x.out[...] = o.transpose(0, 2, 1, 3)
        return 0, x.out

    def dots(self, q, k):
        """q.k of every row and key, fp32: (B, Hq, Sq, skv)."""
        return q @ k.swapaxes(-1, -2)

    def logits(self, q, k, scale, softcap, vis):
        """Scale, then softcap, then the mask by assignment."""
        s = self.dots(q, k) * scale
        if softcap > 0:
            s = softcap * np.tanh(s / softcap)
        return np.where(vis, s, -np.inf).astype(_F32)

    def sink_logits(self, x, Hq: int, Hkv: int):
        """(Hq,) sink logits of the denominator, or None."""
        if x.smooth_softmax:
            return np.zeros(Hq, _F32)
        return None if x.sink is None else x.sink.astype(_F32)

    def softmax_pv(self, s, v, sink):
        """softmax(s) . v with the sink in the denominator, the max taken over it too."""
        m = s.max(axis=-1, keepdims=True)
        if sink is not None:
            m = np.maximum(m, sink[None, :, None, None])
        p = np.exp(s - m)
        l = p.sum(axis=-1, keepdims=True)
        if sink is not None:
            l = l + np.exp(sink[None, :, None, None] - m)
        return (p @ v) / l


class SoftcapAfterMask(CleanAttention):
    """Softcap applied after the mask: a masked key's logit -inf becomes
    c * tanh(-inf / c) = -c, a finite logit, so every invisible key (the causal future, keys
    left of the window) leaks weight e^(-c - m) into its row. Small caps (2 to 5, whose
    visible logits lie within c of each other) make it large."""

    name = "numpy-softcap-after-mask"

    def logits(self, q, k, scale, softcap, vis):
        s = np.where(vis, self.dots(q, k) * scale, -np.inf).astype(_F32)
        if softcap > 0:
            s = softcap * np.tanh(s / softcap)
        return s


class ScaleAfterSoftcap(CleanAttention):
    """The scale applied after the softcap, scale * c * tanh(q.k / c) instead of
    c * tanh(scale * q.k / c): the cap bites on the unscaled dot products (sqrt(d) times
    larger), so the logits saturate at +-scale * c. The same as the right order without a
    softcap, or with scale = 1."""

    name = "numpy-scale-after-softcap"

    def logits(self, q, k, scale, softcap, vis):
        s = self.dots(q, k)
        if softcap > 0:
            s = softcap * np.tanh(s / softcap)
        return np.where(vis, s * scale, -np.inf).astype(_F32)


class SplitKVCombineIgnoresMax(CleanAttention):
    """Split-KV (flash-decoding) whose combine ignores each split's max: split i of
    ``SPLIT`` keys computes its partial sums relative to its own max m_i, and the combine
    adds them at weight 1 instead of e^(m_i - M), as if every split had the same max. The
    sink enters the combine as one more partial (max sigma, sum 1, nothing in acc), so it is
    added at weight 1 too. Right only when a row's keys fall in one split (skv <= SPLIT) and
    there is no sink."""

    name = "numpy-split-kv-combine-ignores-max"
    SPLIT = 16

    def softmax_pv(self, s, v, sink):
        acc = np.zeros(s.shape[:-1] + v.shape[-1:], _F32)
        l = np.zeros(s.shape[:-1] + (1,), _F32)
        for j0 in range(0, s.shape[-1], self.SPLIT):
            sj = s[..., j0:j0 + self.SPLIT]
            m = sj.max(axis=-1, keepdims=True)
            p = np.exp(sj - np.where(np.isneginf(m), _F32(0), m))  # a split a row sees nothing of: p = 0
            acc += p @ v[..., j0:j0 + self.SPLIT, :]  # e^(m - M) left out
            l += p.sum(axis=-1, keepdims=True)
        if sink is not None:
            l += _F32(1)  # the sink's partial, e^(sigma - sigma), left at weight 1 as well
        return acc / l


class Fp16QKAccumulation(CleanAttention):
    """q.k accumulated in fp16, as a tensor-core MMA with an fp16 accumulator does it: each
    16-dim step's product sum is added to the running dot and rounded to fp16 (relative error
    2^-11 a step, of the dot's magnitude). Invisible at small logits; large logits (scale 1,
    long head dims) carry errors of a sizeable fraction of a unit into the exponent."""

    name = "numpy-fp16-qk-accumulation"

    def dots(self, q, k):
        acc = np.zeros(q.shape[:-1] + (k.shape[-2],), np.float16)
        for c0 in range(0, q.shape[-1], 16):
            part = q[..., c0:c0 + 16] @ k[..., c0:c0 + 16].swapaxes(-1, -2)
            acc = (acc.astype(_F32) + part).astype(np.float16)
        return acc.astype(_F32)


class SinkFromKVHead(CleanAttention):
    """The per-head sink read as sink[h % Hkv] (an index into a per-KV-head array, or a
    GQA index taken modulo the KV heads) instead of sink[h]: every query head past the
    first Hkv gets another head's sink. Right without GQA (Hq == Hkv) and without per-head
    sinks."""

    name = "numpy-sink-from-kv-head"

    def sink_logits(self, x, Hq, Hkv):
        sink = super().sink_logits(x, Hq, Hkv)
        if sink is None or x.smooth_softmax:
            return sink
        return sink[np.arange(Hq) % Hkv]


class SinkSoftcapped(CleanAttention):
    """The sink logit passed through the softcap with the scores, c * tanh(sigma / c): the
    sink is a learned logit of the denominator, neither scaled nor capped, so a small cap
    shrinks every sink toward 0. Right without a softcap, without a sink, and for smooth
    softmax (sigma = 0)."""

    name = "numpy-sink-softcapped"

    def sink_logits(self, x, Hq, Hkv):
        sink = super().sink_logits(x, Hq, Hkv)
        if sink is None or not x.softcap:
            return sink
        c = _F32(x.softcap)
        return c * np.tanh(sink / c)


REENACTED = (SoftcapAfterMask, ScaleAfterSoftcap, SplitKVCombineIgnoresMax, Fp16QKAccumulation,
             SinkFromKVHead, SinkSoftcapped)
