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

The sweep is pruned twice, so that a cold call costs little more than a warm one:

1. By a model of the work (:func:`prune_by_model`). On an NVIDIA target with tensor cores
   the scalar path does both products of every KV tile on the FMA units, an order of
   magnitude below the mma units' rate, so it cannot win: its configs are not timed. The
   H200 sweeps of the committed matrix record bear it out (reports/gpu/h200.json,
   "autotune": in every one of its keys the fastest scalar config took at least 3.3x the
   winner; tests/test_autotune.py checks the record).
2. By a short probe. Every remaining candidate is timed with one short burst
   (``probe(config)``); only those within :data:`PROBE_KEEP` of the fastest probe, at most
   :data:`PROBE_MAX` of them, are timed in full (``measure(config)``), and the fastest of
   those wins.

Environment:
    HIPKERNEL_TUNE=0         no sweep; every key gets the default config (the caller's
                             ``default``, else ``config.DEFAULT``; deterministic runs)
    HIPKERNEL_TUNE=full      no pruning: every candidate timed in full. The GPU matrix
                             record is tuned so, and its sweeps are what the model's
                             pruning is checked against.
    HIPKERNEL_TUNE_DEBUG=1   log each candidate's median time to stderr
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Callable, Iterable

from hipkernel.config import CANDIDATES, DEFAULT, KernelConfig, has_mma

PROBE_KEEP = 1.25  # a candidate whose probe is within this of the fastest probe is timed in full
PROBE_MAX = 4  # and at most this many of them


def prune_by_model(candidates: Iterable[KernelConfig], arch: str) -> tuple[KernelConfig, ...]:
    """``candidates`` less those a model of the work rules out on ``arch``: the scalar
    path's configs where the target has NVIDIA tensor cores (``config.has_mma``) and a
    tensor-core config is among them (module docstring). Elsewhere, and under
    ``HIPKERNEL_TUNE=full``, unchanged."""
    cands = tuple(candidates)
    if not has_mma(arch) or Autotuner.full():
        return cands
    tensor = tuple(c for c in cands if c.path != "scalar")
    return tensor or cands


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
        self.timings: dict[tuple, dict[str, float]] = {}  # the finalists' full timings
        self.probes: dict[tuple, dict[str, float]] = {}  # every candidate's probe
        self.sweeps = 0
        self._log = log or (lambda msg: print(msg, file=sys.stderr))

    @staticmethod
    def enabled() -> bool:
        return os.environ.get("HIPKERNEL_TUNE", "1") != "0"

    @staticmethod
    def full() -> bool:
        """``HIPKERNEL_TUNE=full``: sweeps time every candidate in full, unpruned."""
        return os.environ.get("HIPKERNEL_TUNE", "1") == "full"

    @staticmethod
    def debug() -> bool:
        return os.environ.get("HIPKERNEL_TUNE_DEBUG", "0") not in ("", "0")

    def choose(self, key: tuple, measure: Callable[[KernelConfig], float | list],
               candidates: Iterable[KernelConfig] | None = None,
               default: KernelConfig | None = None,
               probe: Callable[[KernelConfig], float | list] | None = None) -> KernelConfig:
        """The config for ``key``: ``default`` (else this tuner's) when tuning is off, the
        cached winner on a hit, else the fastest of ``candidates`` (else this tuner's) by
        ``measure``. With ``probe``, every candidate is probed first and only the fastest
        probes (within :data:`PROBE_KEEP`, at most :data:`PROBE_MAX`) are measured."""
        if not self.enabled():
            return default or self.default
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        cands = self.candidates if candidates is None else tuple(candidates)
        if not cands:
            raise ValueError("candidates: expected at least one KernelConfig")
        self.sweeps += 1
        finalists, probes = cands, {}
        if probe is not None and len(cands) > 1 and not self.full():
            for cfg in cands:
                probes[cfg.name] = _ms(probe(cfg))
                if self.debug():
                    self._log(f"hipkernel tune {key}: probe {cfg.name} {probes[cfg.name]:.4f} ms")
            ranked = sorted(cands, key=lambda c: probes[c.name])
            fastest = probes[ranked[0].name]
            finalists = tuple(c for c in ranked[:PROBE_MAX] if probes[c.name] <= PROBE_KEEP * fastest)
        times = {}
        for cfg in finalists:
            times[cfg.name] = _ms(measure(cfg))
            if self.debug():
                self._log(f"hipkernel tune {key}: {cfg.name} {times[cfg.name]:.4f} ms")
        best = min(finalists, key=lambda c: times[c.name])
        if self.debug():
            self._log(f"hipkernel tune {key}: chose {best.name}")
        self.cache[key] = best
        self.timings[key] = times
        self.probes[key] = probes
        return best

    def choices(self) -> list[dict]:
        """What was chosen per key (recorded in GPU reports)."""
        names = ("d", "sq", "Hq", "G", "window", "dtype", "arch", "ragged")
        return [dict(zip(names, key), config=cfg.name, times_ms=self.timings.get(key, {}),
                     probe_ms=self.probes.get(key, {}))
                for key, cfg in self.cache.items()]

    def clear(self) -> None:
        self.cache.clear()
        self.timings.clear()
        self.probes.clear()
        self.sweeps = 0


def _ms(t) -> float:
    return float(statistics.median(t) if isinstance(t, (list, tuple)) else t)


TUNER = Autotuner()
