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

1. By a model of the work (:func:`prune_by_model`), three rules, each checked against the
   unpruned sweeps of the committed matrix record (reports/gpu/h200.json, "autotune";
   tests/test_autotune.py):

   a. On an NVIDIA target with tensor cores the scalar path does both products of every KV
      tile on the FMA units, an order of magnitude below the mma units' rate: its configs
      are not timed (in every key of the record the fastest scalar config took at least 3x
      the winner).
   b. On sm_90, a uniform call under full attention (no window, or one of at least
      :data:`FULL_WINDOW` keys) at a head dim with wgmma tiles: the mma.sync configs are not
      timed. There every block walks many KV tiles, and wgmma's asynchronous products beat
      mma.sync's (in the record by 1.04x and more in every such key). Under a short window
      or in a ragged batch, where the TMA tiles are not offered, mma.sync configs do win
      some keys, so they stay.
   c. Under full attention (as in b), among the wgmma tiles (one block an SM, each), the one
      a model of the grid (:func:`grid_time`: the row x key products of each block's KV
      walk, spread over the SMs in waves) puts more than :data:`MODEL_KEEP` over the best is
      not timed: 512 rows at d 64 are two 256-row blocks a head, one wave of 128 blocks on
      132 SMs, against three 192-row blocks, two waves (at past_len 8192 modelled 1.45x, and
      measured on an H100 1.38x: 0.213 against 0.154 ms). Under a short window the blocks
      are short, their fixed costs decide, and the model misranked the tiles in 9 of the
      record's 27 windowed keys (by up to 1.16x): there both are timed.

   A key left with one candidate is not timed at all: a chunked 16k prefill at d 64 then
   costs cold what it costs warm.
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
from dataclasses import dataclass

from hipkernel.config import CANDIDATES, DEFAULT, KernelConfig, has_mma, has_wgmma

PROBE_KEEP = 1.25  # a candidate whose probe is within this of the fastest probe is timed in full
PROBE_MAX = 4  # and at most this many of them
MODEL_KEEP = 1.2  # a wgmma tile modelled within this of the best tile is timed (rule c)
FULL_WINDOW = 2048  # a window of at least this many keys counts as full attention (rule b)


@dataclass(frozen=True)
class Work:
    """The launch a sweep times, as the model of the work sees it: ``sq`` rows over ``skv``
    keys (the sweep's cache, ``api.TuningCache``) for ``Hq`` heads of ``B`` sequences
    under ``window`` (-1: none), whether the call is ragged, and the device's SMs (None:
    unknown, and rule c is not applied)."""

    sq: int
    skv: int
    Hq: int
    B: int
    window: int
    ragged: bool
    sm_count: int | None

    def as_dict(self) -> dict:
        return {"sq": self.sq, "skv": self.skv, "Hq": self.Hq, "B": self.B,
                "window": self.window, "ragged": self.ragged, "sm_count": self.sm_count}


def grid_time(cfg: KernelConfig, work: Work) -> float:
    """The modelled time of ``cfg``'s launch of ``work``, in row x key products an SM (one
    block an SM at a time, as for every wgmma tile). A block computes its whole tile of
    ``block_positions`` rows against every key of the KV tiles it walks (the tiles its
    rows reach, from the window's first; the diagonal tile whole). The grid then takes the
    longest of: its total spread evenly over the SMs, its longest block, and its waves
    (``ceil(blocks / SMs)``) of its shortest block, the last bounding grids of near-equal
    blocks, which run in whole waves."""
    bp, bkv = cfg.block_positions, cfg.bkv
    past = work.skv - work.sq
    walks = []
    for i0 in range(0, work.sq, bp):
        p_first, p_last = past + i0, past + min(i0 + bp, work.sq) - 1
        start = max(0, p_first - work.window + 1) if work.window > 0 else 0
        walks.append(bp * bkv * (-(-(p_last + 1) // bkv) - start // bkv))
    _, gy, gz = cfg.grid(work.sq, work.Hq, work.B)  # a block a Q tile of a head of a sequence
    blocks, sms = len(walks) * gy * gz, work.sm_count or 1
    total = sum(walks) * gy * gz
    return float(max(total / sms, max(walks), -(-blocks // sms) * min(walks)))


def model_times(candidates: Iterable[KernelConfig], work: Work | None) -> dict[str, float]:
    """:func:`grid_time` of each wgmma tile among ``candidates``, over the best of them
    (rule c's numbers; recorded with each sweep). Empty without ``work``'s SM count."""
    tiles = [c for c in candidates if c.path == "wgmma"]
    if work is None or not work.sm_count or not tiles:
        return {}
    t = {c.name: grid_time(c, work) for c in tiles}
    best = min(t.values())
    return {name: x / best for name, x in t.items()}


def prune_by_model(candidates: Iterable[KernelConfig], arch: str, work: Work | None = None,
                   modelled: dict[str, float] | None = None) -> tuple[KernelConfig, ...]:
    """``candidates`` less those the model of the work rules out on ``arch`` for ``work``
    (module docstring, rules a-c; b and c need ``work``). Elsewhere, and under
    ``HIPKERNEL_TUNE=full``, unchanged. ``modelled``: ``model_times(candidates, work)``
    where the caller has computed it (rules a and b keep every wgmma tile, so rule c's
    ratios are the same before and after them)."""
    cands = tuple(candidates)
    if not has_mma(arch) or Autotuner.full():
        return cands
    cands = tuple(c for c in cands if c.path != "scalar") or cands  # a
    if work is None:
        return cands
    full = work.window < 0 or work.window >= FULL_WINDOW
    if has_wgmma(arch) and full and not work.ragged and any(c.path == "wgmma" for c in cands):
        cands = tuple(c for c in cands if c.path != "mma")  # b
    if not full:
        return cands
    if modelled is None:
        modelled = model_times(cands, work)
    return tuple(c for c in cands if modelled.get(c.name, 1.0) <= MODEL_KEEP)  # c


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
        self.notes: dict[tuple, dict] = {}  # what the caller's model saw (recorded)
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
               probe: Callable[[KernelConfig], float | list] | None = None,
               note: dict | None = None) -> KernelConfig:
        """The config for ``key``: ``default`` (else this tuner's) when tuning is off, the
        cached winner on a hit, else the fastest of ``candidates`` (else this tuner's) by
        ``measure``; a single candidate is taken untimed. With ``probe``, every candidate is
        probed first and only the fastest probes (within :data:`PROBE_KEEP`, at most
        :data:`PROBE_MAX`) are measured. ``note``: what the caller's pruning saw, kept with
        the choice (``choices``)."""
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
        for cfg in finalists if len(finalists) > 1 or self.full() else ():
            times[cfg.name] = _ms(measure(cfg))
            if self.debug():
                self._log(f"hipkernel tune {key}: {cfg.name} {times[cfg.name]:.4f} ms")
        best = min(finalists, key=lambda c: times[c.name]) if times else finalists[0]
        if self.debug():
            self._log(f"hipkernel tune {key}: chose {best.name}")
        self.cache[key] = best
        self.timings[key] = times
        self.probes[key] = probes
        self.notes[key] = dict(note or {})
        return best

    def choices(self) -> list[dict]:
        """What was chosen per key (recorded in GPU reports)."""
        names = ("d", "sq", "Hq", "G", "window", "dtype", "arch", "ragged")
        return [dict(zip(names, key), config=cfg.name, times_ms=self.timings.get(key, {}),
                     probe_ms=self.probes.get(key, {}), **self.notes.get(key, {}))
                for key, cfg in self.cache.items()]

    def clear(self) -> None:
        self.cache.clear()
        self.timings.clear()
        self.probes.clear()
        self.notes.clear()
        self.sweeps = 0


def _ms(t) -> float:
    return float(statistics.median(t) if isinstance(t, (list, tuple)) else t)


TUNER = Autotuner()
