"""Timing of device-resident launches for ``refattn bench``: interleaved balanced rounds,
event timers, the GPU hold, the ceilings.

What is timed is a *call*: a zero-argument callable that enqueues one launch (what an
adapter's ``prepare(inputs)`` returns) and the ``synchronize`` that waits for it
(:class:`Call`). A timer turns a call into per-call times in ms::

    timer(call, warmup=W, reps=R) -> [ms, ...]      # R times, after W untimed calls

Two timers:

* :class:`TorchEventTimer` (torch sees a CUDA device): a ``torch.cuda.Event`` pair around
  each call on torch's current stream, the legacy default stream, on which every
  implementation here launches (torch's kernels, and a kernel launched through the CUDA
  driver on stream 0, in the CUDA primary context torch shares). Before the timed calls are
  enqueued the stream is held by a GPU sleep (``torch.cuda._sleep``, sized by
  :func:`hold_ms_for` from the measured host cost of one call), so every call is queued when
  the GPU reaches it: the events then bracket device work only, not the host's launch
  overhead (the blocking-kernel technique of NVIDIA's nvbench).
* :class:`HostTimer` (no CUDA device): the host clock around each call and its
  ``synchronize``, launch overhead included. It is what a CPU-only adapter can be timed by,
  and says so in the record.

**Interleaved rounds** (:func:`time_interleaved`). The timed calls of each implementation
are split over rounds (:func:`round_reps`); each round times every implementation in turn,
in the orders of a carryover-balanced (Williams) design (:func:`carryover_orders`): over
the design each implementation runs first equally often and right after every other one
equally often, so none always follows the same one. The order matters on a GPU running at
its power cap: an implementation timed right after a heavier one meets a hotter, slower
clock, and the SM clock drifts over seconds. The median is taken over all of an
implementation's calls (:func:`timing_result`).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field

HOLD_MARGIN = 1.5  # a hold outlasts the host's enqueueing of the timed calls this many times
HOLD_BASE_MS = 0.5  # and this much more
HOLD_MAX_MS = 1000.0


def hold_ms_for(host_ms: float, calls: int, cap_ms: float = HOLD_MAX_MS) -> float:
    """How long to hold the GPU before ``calls`` timed calls that take the host ``host_ms``
    each to enqueue, so that all of them are queued before the first runs: HOLD_MARGIN times
    their host time plus HOLD_BASE_MS, at most ``cap_ms``."""
    return min(cap_ms, HOLD_MARGIN * calls * host_ms + HOLD_BASE_MS)


def _no_sync() -> None:
    pass


@dataclass
class Call:
    """One implementation's timed launch: ``fn()`` enqueues it, ``sync()`` waits for it,
    ``context()`` is entered around each round of its calls. ``name`` labels it."""

    name: str
    fn: object
    sync: object = _no_sync
    context: object = contextlib.nullcontext


@dataclass
class Prepared:
    """What an adapter's ``prepare(inputs)`` may return: ``fn`` launches on device-resident
    copies of the inputs (no host copy, no synchronize inside); ``output()`` (optional)
    reads back the output of the last launch as a NumPy ``(B, Sq, Hq, d)`` array, which is
    how the bench checks the very launch it times; ``close()`` (optional) frees the device
    copies; ``variant`` says which way of computing it took (a tile config, a mask)."""

    fn: object
    output: object = None
    close: object = None
    variant: str = ""
    extra: dict = field(default_factory=dict)

    def __call__(self):
        return self.fn()


# --------------------------------------------------------------------------- the design

def round_reps(reps: int, rounds: int) -> list[int]:
    """``reps`` timed calls split over ``rounds`` rounds as evenly as they go, the larger
    shares first: ``round_reps(30, 4) == [8, 8, 7, 7]``."""
    if rounds < 1 or reps < rounds:
        raise ValueError(f"rounds: expected 1 <= rounds <= reps ({reps}), got {rounds}")
    return [reps // rounds + (1 if r < reps % rounds else 0) for r in range(rounds)]


def carryover_orders(n: int) -> list[list[int]]:
    """A Williams design for ``n`` implementations: orders of ``range(n)`` (n of them for an
    even n, 2n for an odd one) in which each one stands in each place equally often and
    follows each other one equally often (first-order carryover balanced). Row r is the first
    row (0, 1, n-1, 2, n-2, ...) plus r mod n; for an odd n the same rows reversed follow."""
    if n < 1:
        return [[]]
    first, lo, hi = [0], 1, n - 1
    for i in range(1, n):
        if i % 2:
            first.append(lo)
            lo += 1
        else:
            first.append(hi)
            hi -= 1
    rows = [[(x + r) % n for x in first] for r in range(n)]
    return rows + [row[::-1] for row in rows] if n % 2 else rows


def time_interleaved(timer, calls: dict, *, warmup: int, reps: int, rounds: int,
                     on_error=None) -> dict[str, list[float]]:
    """Time every ``calls[name]`` (a :class:`Call`) for ``reps`` calls in all, over ``rounds``
    rounds: round r times each in turn, in the order of row r (cyclically) of
    ``carryover_orders(len(calls))``, ``round_reps(reps, rounds)[r]`` calls after ``warmup``
    untimed ones. Returns each name's times in call order. A name whose timing raises is
    dropped from the later rounds and from the result; ``on_error(name, exc)`` is told."""
    names = list(calls)
    times: dict[str, list[float]] = {n: [] for n in names}
    failed: set[str] = set()
    orders = carryover_orders(len(names))
    for r, n_r in enumerate(round_reps(reps, rounds)):
        for name in (names[i] for i in orders[r % len(orders)]):
            if name in failed:
                continue
            try:
                with calls[name].context():
                    times[name] += list(timer(calls[name], warmup=warmup, reps=n_r))
            except Exception as e:  # noqa: BLE001 - the others go on; the caller reports it
                failed.add(name)
                if on_error is not None:
                    on_error(name, e)
    return {n: t for n, t in times.items() if n not in failed}


def timing_result(times: list[float], flops: float | None = None, **extra) -> dict:
    """Median of per-call times (ms) and the TF/s it gives."""
    ms = float(statistics.median(times))
    return {"ms": ms, "tflops": flops / ms / 1e9 if flops and ms > 0 else None, "n": len(times),
            "min_ms": float(min(times)), "max_ms": float(max(times)), **extra}


# --------------------------------------------------------------------------- timers

class HostTimer:
    """The host clock around each call and its synchronize (launch overhead included)."""

    method = ("host clock (time.perf_counter) around each call and its synchronize(); no CUDA "
              "device visible to torch, so launch overhead is inside every time")

    def __call__(self, call: Call, *, warmup: int, reps: int) -> list[float]:
        for _ in range(warmup):
            call.fn()
        call.sync()
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            call.fn()
            call.sync()
            out.append((time.perf_counter() - t0) * 1e3)
        return out


class TorchEventTimer:
    """torch.cuda.Event pairs around each call, the timed calls queued behind a GPU sleep so
    that the events bracket device work only (module docstring)."""

    def __init__(self, T):
        self.T = T
        self.cycles_per_ms = self._calibrate() if hasattr(T.cuda, "_sleep") else None
        self.method = ("torch.cuda.Event pair around each call; the timed calls are queued "
                       "behind a GPU sleep so host launch overhead is outside the events"
                       if self.cycles_per_ms else
                       "torch.cuda.Event pair around each call (no torch.cuda._sleep: host "
                       "launch overhead is inside the events)")

    def _event(self):
        return self.T.cuda.Event(enable_timing=True)

    def _calibrate(self) -> float | None:
        T = self.T
        T.cuda._sleep(1000)
        T.cuda.synchronize()
        n = 1_000_000  # ~0.5 ms at H200 clocks
        s, e = self._event(), self._event()
        s.record()
        T.cuda._sleep(n)
        e.record()
        e.synchronize()
        ms = s.elapsed_time(e)
        return n / ms if ms > 0 else None

    def __call__(self, call: Call, *, warmup: int, reps: int) -> list[float]:
        T, fn = self.T, call.fn
        for _ in range(warmup):
            fn()
        call.sync()
        T.cuda.synchronize()
        events = [(self._event(), self._event()) for _ in range(reps + 1)]
        s, e = events.pop()
        t0 = time.perf_counter()  # the host's cost of enqueueing one call sizes the sleep
        s.record()
        fn()
        e.record()
        host_ms = (time.perf_counter() - t0) * 1e3
        T.cuda.synchronize()
        if self.cycles_per_ms:
            T.cuda._sleep(int(hold_ms_for(host_ms, reps) * self.cycles_per_ms))
        for s, e in events:
            s.record()
            fn()
            e.record()
        call.sync()
        T.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in events]


def probe_torch():
    """``(torch, None)`` when torch imports and sees a CUDA device, else ``(None, reason)``."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return None, f"torch not importable: {type(e).__name__}: {e}"
    try:
        if not torch.cuda.is_available():
            return None, f"torch {torch.__version__} sees no CUDA device"
    except Exception as e:  # noqa: BLE001
        return None, f"torch {torch.__version__}: CUDA check failed: {e}"
    return torch, None


def make_timer(T):
    """The timer for this machine: device events when ``T`` (torch with CUDA) is given, else
    the host clock."""
    return TorchEventTimer(T) if T is not None else HostTimer()


def measure_ceilings(T, timer, *, warmup: int, reps: int) -> dict:
    """fp16 GEMM TF/s (torch.mm 8192^3: 2 n^3 FLOPs) and device copy TB/s (1 GiB
    device-to-device, bytes read + written), timed like everything else."""
    n = 8192
    a = T.randn(n, n, device="cuda", dtype=T.float16)
    b = T.randn(n, n, device="cuda", dtype=T.float16)
    c = T.empty_like(a)
    sync = T.cuda.synchronize
    ms = statistics.median(timer(Call("gemm", lambda: T.mm(a, b, out=c), sync), warmup=warmup, reps=reps))
    gemm = {"n": n, "flops": 2.0 * n ** 3, "ms": ms, "tflops": 2.0 * n ** 3 / ms / 1e9,
            "formula": "2 * n^3 FLOPs, torch.mm fp16"}
    del a, b, c
    nbytes = 1 << 30
    src = T.ones(nbytes // 2, device="cuda", dtype=T.float16)
    dst = T.empty_like(src)
    ms = statistics.median(timer(Call("copy", lambda: dst.copy_(src), sync), warmup=warmup, reps=reps))
    copy = {"bytes": 2 * nbytes, "ms": ms, "tbps": 2 * nbytes / ms / 1e9,
            "formula": "bytes read + bytes written, Tensor.copy_ device to device"}
    del src, dst
    return {"gemm_fp16": gemm, "copy": copy}


__all__ = ["Call", "HostTimer", "Prepared", "TorchEventTimer", "carryover_orders", "hold_ms_for",
           "make_timer", "measure_ceilings", "probe_torch", "round_reps", "time_interleaved",
           "timing_result"]
