"""Autotuning of the kernel's compile-time config (path, ``M_TILES``, ``BKV``).

The first call for a key sweeps every candidate and keeps the fastest; later calls with the
same key reuse the winner. The candidates depend on the target (``config.candidates(arch)``:
the mma path only on NVIDIA sm_80+), so the caller passes them per call; the key holds the
arch, so a cached winner is always one of its target's candidates.

Key = (d, sq, Hq, G, window, dtype, arch, ragged). ``skv``/``past_len`` are deliberately NOT
in the key: keyed on them, a chunked 16k prefill (32 chunks of 512) would run 32 sweeps; keyed
this way it runs one, at the first chunk. The window IS in the key: it caps
the number of KV tiles a block walks, a different work profile that can change the winner.
``ragged`` (per-sequence past_len / q_len) is in the key, the lengths are not: a ragged call
cannot run the configs that copy with TMA (``KernelConfig.tma``), so its candidates differ
and its winner must not be a uniform call's. It is timed as the uniform call of its
geometry (``api.flash_prefill_v3``).

The KV length does change the winner where it is short (the H200 measured it: at 512 rows
past 0 the grid's size decides, at past 8192 the work per KV tile does; see
``api.TUNE_MIN_KV``). So the sweep does not time the first call's own cache when it is
short: ``api.TuningCache`` times every candidate on a zeroed scratch cache of
``api.TUNE_MIN_KV`` keys, the regime a chunked prefill spends its time in.

Environment:
    HIPKERNEL_TUNE=0         no sweep; every key gets the default config (the caller's
                             ``default``, else ``config.DEFAULT``; deterministic runs)
    HIPKERNEL_TUNE_DEBUG=1   log each candidate's median time to stderr
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Callable, Iterable

from hipkernel.config import CANDIDATES, DEFAULT, KernelConfig


def tune_key(*, d: int, sq: int, Hq: int, G: int, window: int, dtype: str, arch: str,
             ragged: bool = False) -> tuple:
    """The config-cache key. No skv / past_len / q_len (see the module docstring)."""
    return (int(d), int(sq), int(Hq), int(G), int(window), str(dtype), str(arch), bool(ragged))


class Autotuner:
    """A per-process config cache with a sweep on miss.

    ``measure(config)`` launches the kernel with ``config`` and returns its times in ms (a
    float or a list; the median is used). It is supplied by the caller, so tests inject a
    fake one and the API supplies a device-event timer.
    """

    def __init__(self, candidates: Iterable[KernelConfig] = CANDIDATES,
                 default: KernelConfig = DEFAULT, log: Callable[[str], None] | None = None):
        self.candidates = tuple(candidates)
        if not self.candidates:
            raise ValueError("candidates: expected at least one KernelConfig")
        self.default = default
        self.cache: dict[tuple, KernelConfig] = {}
        self.timings: dict[tuple, dict[str, float]] = {}
        self.sweeps = 0
        self._log = log or (lambda msg: print(msg, file=sys.stderr))

    @staticmethod
    def enabled() -> bool:
        return os.environ.get("HIPKERNEL_TUNE", "1") != "0"

    @staticmethod
    def debug() -> bool:
        return os.environ.get("HIPKERNEL_TUNE_DEBUG", "0") not in ("", "0")

    def choose(self, key: tuple, measure: Callable[[KernelConfig], float | list],
               candidates: Iterable[KernelConfig] | None = None,
               default: KernelConfig | None = None) -> KernelConfig:
        """The config for ``key``: ``default`` (else this tuner's) when tuning is off, the
        cached winner on a hit, else the fastest of ``candidates`` (else this tuner's)."""
        if not self.enabled():
            return default or self.default
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        cands = self.candidates if candidates is None else tuple(candidates)
        if not cands:
            raise ValueError("candidates: expected at least one KernelConfig")
        self.sweeps += 1
        times = {}
        for cfg in cands:
            t = measure(cfg)
            times[cfg.name] = float(statistics.median(t) if isinstance(t, (list, tuple)) else t)
            if self.debug():
                self._log(f"hipkernel tune {key}: {cfg.name} {times[cfg.name]:.4f} ms")
        best = min(cands, key=lambda c: times[c.name])
        if self.debug():
            self._log(f"hipkernel tune {key}: chose {best.name}")
        self.cache[key] = best
        self.timings[key] = times
        return best

    def choices(self) -> list[dict]:
        """What was chosen per key (recorded in GPU reports)."""
        names = ("d", "sq", "Hq", "G", "window", "dtype", "arch", "ragged")
        return [dict(zip(names, key), config=cfg.name, times_ms=self.timings.get(key, {}))
                for key, cfg in self.cache.items()]

    def clear(self) -> None:
        self.cache.clear()
        self.timings.clear()
        self.sweeps = 0


TUNER = Autotuner()
