"""Device-event timing of the kernel on resident buffers, and the chunked-prefill measurement.

FLOP count (written out, as the benchmark reports it): each visible (query, key) pair costs
a d-long dot product for the score and a d-long multiply-add for P.V, 2 FLOPs per element
each, so

    FLOPs = 4 * d * Hq * B * sum_rows(visible keys of the row)

which is what FlashAttention's benchmarks count (causal halves it; a window caps it).
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from hipkernel import api
from hipkernel.config import KernelConfig


def visible_pairs(Sq: int, past_len: int, window: int) -> int:
    """sum over query rows of the number of visible keys (exact, O(1))."""
    total = 0
    # row i (position p = past_len + i) sees min(p + 1, W) keys
    p0, p1 = past_len, past_len + Sq - 1
    if window < 0:
        return (p0 + 1 + p1 + 1) * Sq // 2
    # rows with p + 1 <= W see p + 1 keys, the rest see W
    k = max(0, min(p1, window - 1) - p0 + 1)  # rows with p + 1 <= W
    if k:
        total += (p0 + 1 + p0 + k) * k // 2
    total += (Sq - k) * window
    return total


def flops(B: int, Sq: int, Hq: int, d: int, past_len: int, window: int) -> float:
    return 4.0 * d * Hq * B * visible_pairs(Sq, past_len, window)


def burst_timing(be, kernel, grid, block, args, shared_mem=0, n=20, warmup=2, reps=5) -> tuple[float, float]:
    """Of one launch of a compiled kernel, in ms: the device time, the median over ``reps``
    of n back-to-back launches between two events, over n (no host synchronization in
    between, so launch overhead hides behind the kernels); and the host's time to enqueue
    it, the median of the same bursts on the host's clock. When the second reaches the
    first, the burst measured the host, not the kernel: the device waited between launches."""
    host = []

    def burst():
        t0 = time.perf_counter()
        for _ in range(n):
            be.launch(kernel, grid, block, args, shared_mem)
        host.append((time.perf_counter() - t0) * 1e3 / n)

    times = sorted(be.time_ms(burst, warmup=warmup, reps=reps))
    host = sorted(host[-len(times):])  # the timed bursts, not the warm-up
    return times[len(times) // 2] / n, host[len(host) // 2]


def burst_ms(be, kernel, grid, block, args, shared_mem=0, n=20, warmup=2, reps=5) -> float:
    """The device time of ``burst_timing``."""
    return burst_timing(be, kernel, grid, block, args, shared_mem, n, warmup, reps)[0]


class Resident:
    """Random fp16 inputs resident on the device for repeated launches."""

    def __init__(self, backend, *, B, Sq, Hq, Hkv, d, past_len, seed=0):
        self.be = backend
        self.geom = dict(B=B, Sq=Sq, Hq=Hq, Hkv=Hkv, d=d, S_cap=past_len + Sq, past_len=past_len)
        rng = np.random.default_rng(seed)
        host = {
            "q": rng.standard_normal((B, Sq, Hq, d)).astype(np.float16),
            "k": rng.standard_normal((B, Hkv, past_len + Sq, d)).astype(np.float16),
            "v": rng.standard_normal((B, Hkv, past_len + Sq, d)).astype(np.float16),
            "sink": rng.uniform(-2, 4, Hq).astype(np.float16),
        }
        self.host = host
        self.ptr = {}
        for name, arr in host.items():
            self.ptr[name] = backend.alloc(arr.nbytes)
            backend.htod(self.ptr[name], arr)
        self.ptr["out"] = backend.alloc(host["q"].nbytes)

    def launch(self, *, window=-1, sink_mode="per_head", config: KernelConfig | None = None) -> int:
        p = self.ptr
        return api.flash_prefill_v3(self.be, p["q"], p["k"], p["v"], p["sink"], p["out"],
                                    window=window, sink_mode=sink_mode, config=config, **self.geom)

    def time_ms(self, *, window=-1, sink_mode="per_head", config=None, warmup=20, reps=50) -> float:
        """Median device-event time of one launch (the config is tuned first if None)."""
        self.launch(window=window, sink_mode=sink_mode, config=config)
        times = self.be.time_ms(lambda: self.launch(window=window, sink_mode=sink_mode, config=config),
                                warmup=warmup, reps=reps)
        return float(statistics.median(times))

    def kernel_args(self, config: KernelConfig, window: int = -1, sink_mode: int = 1) -> list:
        """The kernel ABI's argument list of ``config`` on these buffers (``api.kernel_args``:
        a config with a producer takes its tensor maps too), for launching a compiled kernel
        directly (``Backend.launch``), scale 1 / sqrt(d)."""
        g, p = self.geom, self.ptr
        return api.kernel_args(self.be, config, q=p["q"], k=p["k"], v=p["v"], sink=p["sink"],
                               out=p["out"], window=window, sink_mode=sink_mode,
                               scale=g["d"] ** -0.5, **g)

    def output(self) -> np.ndarray:
        out = np.empty_like(self.host["q"])
        self.be.dtoh(out, self.ptr["out"])
        return out

    def free(self):
        for ptr in self.ptr.values():
            self.be.free(ptr)
        self.ptr = {}


def chunked_prefill_wall(backend, *, total=16384, chunk=512, Hq=64, Hkv=8, d=64, window=-1,
                         seed=0) -> float:
    """Wall time (s) of a chunked prefill through the NumPy-level ``hipkernel.attention``:
    ``total // chunk`` calls with past_len growing by ``chunk``, each on the cache so far."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((1, Hkv, total, d)).astype(np.float16)
    v = rng.standard_normal((1, Hkv, total, d)).astype(np.float16)
    q = rng.standard_normal((1, total, Hq, d)).astype(np.float16)
    sink = rng.uniform(-2, 4, Hq).astype(np.float16)
    t0 = time.perf_counter()
    for c in range(total // chunk):
        past = c * chunk
        kc = np.ascontiguousarray(k[:, :, : past + chunk])
        vc = np.ascontiguousarray(v[:, :, : past + chunk])
        status, _ = api.attention(np.ascontiguousarray(q[:, past: past + chunk]), kc, vc,
                                  past_len=past, window=window, sink=sink, backend=backend)
        if status != 0:
            raise RuntimeError(f"chunk {c}: kernel declined a supported call")
    return time.perf_counter() - t0
