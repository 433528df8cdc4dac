"""Third-party-style NumPy kernels for the coverage tests: one correct kernel and copies of it,
each with one documented bug of public attention kernels that the coverage model's inputs
exist to expose (docs/semantics.md, Coverage model). Plugged in by import path, e.g.
``tests.adapters.coverage_bugs:MaxFloor``.

Every kernel supports every case (softcap, any head dim and dtype included) and computes in
fp32, returning its own float32 array.
"""

from __future__ import annotations

import numpy as np

MAX_FLOOR = -1e4  # a finite "minus infinity" that kernels use to initialise the running max


class CorrectNumpy:
    """GQA attention in fp32 over the keys some row can see, ``[k_lo, skv)``: scores, softcap,
    then the mask by assignment (-inf), the max over visible keys and the sink, exp, P.V."""

    name = "numpy-coverage-correct"

    def supports(self, case) -> bool:
        return True

    # ---- the steps the broken copies override

    def key_range(self, x) -> tuple[int, int]:
        skv = x.past_len + x.q.shape[1]
        lo = max(0, x.past_len - x.window + 1) if x.window > 0 else 0
        return lo, skv

    def kv_head_of(self, Hq: int, Hkv: int) -> np.ndarray:
        return np.arange(Hq) // (Hq // Hkv)

    def dots(self, q: np.ndarray, k: np.ndarray) -> np.ndarray:
        """(B, H, Sq, d) x (B, H, n, d) -> (B, H, Sq, n) raw q.k in fp32."""
        return np.matmul(q.astype(np.float32), np.swapaxes(k.astype(np.float32), -1, -2))

    def cap_and_mask(self, s: np.ndarray, vis: np.ndarray, softcap: float) -> np.ndarray:
        if softcap:
            s = np.float32(softcap) * np.tanh(s / np.float32(softcap))
        return np.where(vis, s, np.float32(-np.inf))

    def row_max(self, s: np.ndarray) -> np.ndarray:
        return s.max(axis=-1, keepdims=True)

    def weights(self, s: np.ndarray, m: np.ndarray, vis: np.ndarray) -> np.ndarray:
        """P from the masked scores ``s`` and the row max ``m``."""
        return np.exp(s - m)

    # ----

    def run(self, x):
        B, Sq, Hq, d = x.q.shape
        Hkv = x.k.shape[1]
        lo, skv = self.key_range(x)
        kv = self.kv_head_of(Hq, Hkv)
        k = x.k[:, kv, lo:skv]  # (B, Hq, n, d)
        v = x.v[:, kv, lo:skv].astype(np.float32)
        q = np.swapaxes(x.q, 1, 2)  # (B, Hq, Sq, d)
        scale = np.float32(x.scale if x.scale is not None else d ** -0.5)
        with np.errstate(invalid="ignore", over="ignore"):
            s = self.dots(q, k) * scale
            pos = x.past_len + np.arange(Sq)[:, None]
            key = np.arange(lo, skv)[None, :]
            vis = key <= pos
            if x.window > 0:
                vis &= key >= pos - x.window + 1
            s = self.cap_and_mask(s, vis, x.softcap)
            m = self.row_max(s)
            sink = None
            if x.sink is not None:
                sink = x.sink.astype(np.float32)[None, :, None, None]
            elif x.smooth_softmax:
                sink = np.zeros((1, Hq, 1, 1), np.float32)
            if sink is not None:
                m = np.maximum(m, sink)
            p = self.weights(s, m, vis)
            l = p.sum(axis=-1, keepdims=True)
            if sink is not None:
                l = l + np.exp(sink - m)
            o = np.matmul(p, v) / np.where(l == 0, np.float32(1), l)
            o = np.where(l == 0, np.float32(0), o)
        return 0, np.ascontiguousarray(np.swapaxes(o, 1, 2))


class MaxFloor(CorrectNumpy):
    """The running max starts at a finite floor (-1e4) instead of -inf: a row whose logits
    all lie below it gets P = e^(s - floor) = 0, l = 0 and outputs 0."""

    name = "numpy-max-floor"

    def row_max(self, s):
        return np.maximum(super().row_max(s), np.float32(MAX_FLOOR))


class PTimesZero(CorrectNumpy):
    """The KV loop starts at key 0 instead of the window's first key, and masked keys are
    removed by multiplying P by 0 after the exp: a NaN (or an infinity) in ``k`` or ``v``
    left of the window leaks through 0 * NaN. The max is still taken over visible keys."""

    name = "numpy-p-times-zero"

    def key_range(self, x):
        return 0, x.past_len + x.q.shape[1]

    def cap_and_mask(self, s, vis, softcap):
        if softcap:
            s = np.float32(softcap) * np.tanh(s / np.float32(softcap))
        self._vis_max = np.where(vis, s, np.float32(-np.inf)).max(axis=-1, keepdims=True)
        return s  # unmasked: the mask is applied to P

    def row_max(self, s):
        return self._vis_max

    def weights(self, s, m, vis):
        return np.exp(s - m) * vis


class Fp16Dot(CorrectNumpy):
    """q.k accumulated in fp16 before the scale (one rounding to fp16 a multiply-add): a raw
    dot product past 65504 overflows to inf, and the softmax of an inf row is NaN."""

    name = "numpy-fp16-dot"

    def dots(self, q, k):
        q16 = q.astype(np.float16).astype(np.float32)
        k16 = k.astype(np.float16).astype(np.float32)
        acc = np.zeros(q.shape[:-1] + (k.shape[-2],), np.float16)
        for c in range(q.shape[-1]):
            prod = q16[..., c][..., :, None] * k16[..., c][..., None, :]
            acc = (acc.astype(np.float32) + prod).astype(np.float16)
        return acc.astype(np.float32)


class SoftcapAfterMask(CorrectNumpy):
    """The softcap is applied after the mask: a masked key gets c * tanh(-inf / c) = -c
    instead of -inf and leaks weight e^(-c) into its row."""

    name = "numpy-softcap-after-mask"

    def cap_and_mask(self, s, vis, softcap):
        s = np.where(vis, s, np.float32(-np.inf))
        if softcap:
            s = np.float32(softcap) * np.tanh(s / np.float32(softcap))
        return s


class HeadTile16(CorrectNumpy):
    """Query heads are processed in tiles of 16 and every head of a tile reads the KV head of
    the tile's first head: wrong wherever a KV group boundary falls inside a tile (G not a
    multiple of 16, and more than G heads)."""

    name = "numpy-head-tile16"

    def kv_head_of(self, Hq, Hkv):
        h = np.arange(Hq)
        return (h // 16 * 16) // (Hq // Hkv)
