"""A kernel adapter in 20 lines: plain NumPy attention, verified by refattn.

    refattn run --kernel examples.numpy_kernel:NumpyKernel --suite seed
    refattn fuzz --kernel examples.numpy_kernel:NumpyKernel --examples 200

(from the repository root; elsewhere put this file's directory on PYTHONPATH). Swap the body
of ``run`` for a call into your own kernel, keep ``supports`` honest, and every check of
docs/adapters.md applies to it.
"""

import numpy as np


class NumpyKernel:
    name = "numpy-example"

    def supports(self, case):
        return not case.softcap  # the contract: run() declines (-1) exactly these

    def run(self, x):
        if x.softcap:
            return -1, x.out  # a decline leaves x.out as it was
        B, Sq, Hq, d = x.q.shape
        G, skv = Hq // x.k.shape[1], x.past_len + Sq
        lo = max(0, x.past_len - x.window + 1) if x.window > 0 else 0  # no row sees a key before lo
        k = np.repeat(x.k[:, :, lo:skv].astype(np.float32), G, axis=1)  # query head h -> KV head h // G
        v = np.repeat(x.v[:, :, lo:skv].astype(np.float32), G, axis=1)
        s = np.einsum("bqhd,bhkd->bhqk", x.q.astype(np.float32), k) * (x.scale or d ** -0.5)
        pos, key = x.past_len + np.arange(Sq)[:, None], np.arange(lo, skv)[None, :]
        s[..., (key > pos) | ((x.window > 0) & (key <= pos - x.window))] = -np.inf
        m = s.max(-1, keepdims=True)
        if x.sink is not None or x.smooth_softmax:  # the sink logit joins the denominator only
            sink = np.zeros(Hq) if x.sink is None else x.sink.astype(np.float32)
            m = np.maximum(m, sink[None, :, None, None])
        p = np.exp(s - m)
        z = p.sum(-1, keepdims=True) + (np.exp(sink[None, :, None, None] - m) if x.sink is not None or x.smooth_softmax else 0)
        x.out[...] = np.einsum("bhqk,bhkd->bqhd", p / z, v)
        return 0, x.out
