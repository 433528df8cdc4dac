"""`refattn bench`: the fused kernel against its peers, timed in one process on the same inputs.

What is timed
=============

A *shape* is one prefill call (docs/semantics.md, Semantics): a chunk of ``Sq`` queries at
absolute positions ``past_len .. past_len + Sq - 1`` over a KV cache of
``skv = past_len + Sq`` keys, causal bottom-right, optionally a sliding window of ``W`` keys
(self included). Shapes are named ``FAMILY-SQ@PAST[-wW]``: ``gptoss-512@8192-w128`` is a
512-token chunk over an 8192-token cache with W = 128, at gpt-oss geometry (``gptoss``: Hq = 64, Hkv = 8, d = 64;
``d128``: Hq = 32, Hkv = 8, d = 128; B = 1, fp16).

For each shape, on the same fp16 arrays (timed in interleaved rounds, below):

* **hipkernel**, with a per-head sink (the gpt-oss case, the one the targets are for) and
  without one (to compare with the peers that have no sink), on the device-resident inputs
  of ``hipkernel.timing.Resident``. Its first launch autotunes; that launch is not timed.
* **peers**, on torch copies of the very same host arrays (``Resident.host``):

  - ``sdpa``: ``F.scaled_dot_product_attention`` held to its FlashAttention-2 backend
    (``sdpa_kernel(SDPBackend.FLASH_ATTENTION)``); no sink.
  - ``cudnn``: the same held to cuDNN (``SDPBackend.CUDNN_ATTENTION``); no sink.
  - ``flex``: ``torch.compile(flex_attention)`` with a block mask for causal bottom-right
    (+ the window), and the sink applied exactly: ``out * sigmoid(lse - sink)`` with a
    natural-log LSE. This is the sink identity ``Z / (Z + e^sink) = sigmoid(log Z - sink)``.

How each peer is configured (and checked)
=========================================

* **Causal alignment.** torch's ``is_causal=True`` is top-left aligned, and its flash
  backend refuses ``is_causal`` when ``Sq != skv`` (``check_flash_causal_non_square_seqlens``
  in ATen's ``sdp_utils.cpp``). So for a chunk over a cache SDPA gets
  ``torch.nn.attention.bias.causal_lower_right(Sq, skv)``: under the flash backend torch
  dispatches it to the flash op with that op's own (bottom-right) causal flag; under cuDNN
  it becomes a dense boolean mask. cuDNN is first tried with plain ``is_causal=True``, which
  is kept only if its output matches (i.e. if cuDNN aligns it bottom-right); that attempt
  is reported either way. When ``Sq == skv`` the alignments coincide and ``is_causal=True``
  is used.
* **GQA.** ``enable_gqa=True`` first (flash and cuDNN read Hkv < Hq heads natively); if a
  backend refuses, the KV heads are repeated (``repeat_interleave(G, dim=1)``: query head h
  reads KV head h // G), outside the timed region. The peer's ``variant`` says which.
* **Windows.** SDPA has no sliding-window kernel (a dense mask would still compute the
  whole causal band), so windowed shapes are ``n/a`` for ``sdpa`` and ``cudnn``.
* **Flex.** Compiled once per process (``torch.compile(..., dynamic=False)``, recompiled by
  dynamo once per shape); the block mask is built once per shape, outside the timed region.
  The LSE is requested with ``return_aux=AuxRequest(lse=True)`` (``return_lse=True`` before
  torch 2.9). Flex's kernel works in base 2 and its Python API converts the LSE to natural
  log (``lse * ln 2``); a probe against ``torch.logsumexp`` at start-up confirms the base
  and picks the conversion, recorded as ``flex_lse_base`` in the JSON.
* **Checked before timed.** Every peer's output is compared with hipkernel's (with sink for
  ``flex``, without for SDPA): relL2 < 2e-3, or the peer is reported (``mismatch``, with
  the relL2) instead of timed. A backend that raises is ``n/a`` with its reason.

Timing
======

Device events around each call, ``--warmup`` calls first, then the **median** of ``--reps``
(>= 20) calls. Before the timed calls are enqueued, the stream is held by a GPU sleep
(``torch.cuda._sleep``, sized from the measured host cost of one call) so that every call
is already queued when the GPU reaches it: the events then bracket device work only, not
the host's launch overhead (the blocking-kernel technique of NVIDIA's nvbench). hipkernel
is timed through ``hipkernel.api.flash_prefill_v3`` minus the device synchronize it ends
with (its contract: the output is ready on return), which would otherwise put a host round
trip inside every timed call. ``Resident.time_ms`` (per call, launch overhead and
synchronize included) is recorded next to it as ``resident_time_ms``. Without torch the
backend's own events time hipkernel (launch overhead included) and the peers are skipped.
Calls run back to back on the same inputs, so K/V may be L2-resident; that holds for every
implementation alike.

**Interleaved rounds.** The ``--reps`` timed calls of each implementation are split over
``--rounds`` rounds (default 10); each round times every implementation in turn (hipkernel
with and without the sink and each peer that passed its check), and the median is taken over
all of an implementation's calls. The rounds' orders are a carryover-balanced (Williams)
design (``carryover_orders``): over 2n rounds (n for an even number n of implementations)
each implementation runs first equally often and right after every other one equally often,
so none always follows the same one. The order matters: an implementation timed right after
a heavier one meets a hotter, slower clock. With the order only rotated a place a round,
hipkernel without the sink, timed right after it with the sink in two rounds of three, took
d128 16384@0 6.5 % longer than with it in the bench record of kernel ``12c05f25`` (3.806
against 3.574 ms; 8.4 % in another record, 1.6-6.9 % in four more benches), although the
kernel does not depend on the sink mode (in the same process, bursts of back-to-back
launches: 3.97-3.98 ms either way); with the balanced order the two were 3.827 and 3.825
ms. An H200 running a long full-attention shape
back to back sits at its power cap, and its SM clock drifts over seconds (sampled at
1860-1875 MHz with dips to 1620, against 1980 idle): timed one after another in one burst
each, the implementations met different clocks. In the bench record of kernel ``b4bdd5e4``
(one burst each), hipkernel's d128 16384@0 took 4.129 ms with the sink and 4.575 without,
for nearly the same work, and cuDNN's time on that shape moved from 3.469 ms in the record
before to 4.063. ``--rounds 1`` is that order (one burst each).

FLOPs (useful work only, what FlashAttention's benchmarks count)::

    FLOPs = 4 * d * Hq * B * sum_rows(visible keys of the row)

(``hipkernel.timing.flops``): a visible (query, key) pair costs a d-long dot product for
the score and a d-long multiply-add for P.V, 2 FLOPs per element each. Row i (position
p = past_len + i) sees ``p + 1`` keys, or ``min(p + 1, W)`` under a window. TF/s =
FLOPs / time. Ceilings measured in the same run: fp16 GEMM (``torch.mm``, 8192^3, 2 n^3
FLOPs) and device-to-device copy (1 GiB, bytes read + bytes written).

Output: a table (time, TF/s, the no-sink time, each peer, the best peer and the ratio
hipkernel / best peer, taken in the best peer's sink mode; < 1 means hipkernel is faster),
the performance targets (``TARGETS_MS``) with hit/miss, and a GPU record
(``hipkernel.record.stamp("bench", ...)``) written to ``--json`` (default
``reports/gpu/bench-h200.json`` on an H200).

This is the one ``refattn`` module that drives hipkernel directly (its resident buffers and
its record stamp); it imports hipkernel and torch lazily, only when the benchmark runs, so
``refattn`` keeps importing on machines that have neither.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2

FLOP_FORMULA = ("FLOPs = 4 * d * Hq * B * sum_rows(visible keys of the row); row i at position "
                "p = past_len + i sees p + 1 keys, min(p + 1, W) under a window of W keys "
                "(2 FLOPs per multiply-add, d-long q.k and p.v per visible pair)")
MATCH_REL_L2 = 2e-3  # a peer whose output is further than this from hipkernel's is not timed
MIN_REPS = 20
DEFAULT_REPS, DEFAULT_WARMUP = 30, 5
DEFAULT_ROUNDS = 10  # interleaved rounds: one whole balanced design of 5 implementations (module docstring)
LN2 = math.log(2.0)  # flex's kernel keeps the LSE in base 2: ln Z = log2 Z * ln 2

# Head geometries, B = 1, fp16.
FAMILIES = {
    "gptoss": dict(B=1, Hq=64, Hkv=8, d=64),   # gpt-oss-20b attention
    "d128": dict(B=1, Hq=32, Hkv=8, d=128),    # the kernel's other compiled head dim
}

# The performance targets for hipkernel with a per-head sink (ms per call), and its flatness
# requirement: the windowed 512-token chunk must cost the same wherever it sits in the cache.
TARGETS_MS = {
    "gptoss-512@8192": 0.25,
    "gptoss-512@15872": 0.46,
    "gptoss-512@512-w128": 0.03,
    "gptoss-512@8192-w128": 0.03,
    "gptoss-512@15872-w128": 0.03,
    "gptoss-16384@0": 5.0,
    "gptoss-16384@0-w128": 0.15,
}
FLAT_GROUP = ("gptoss-512@512-w128", "gptoss-512@8192-w128", "gptoss-512@15872-w128")
FLAT_LIMIT = 1.10  # max / min over FLAT_GROUP ("flat within ±10%", as hipkernel.gpu_session)

DEFAULT_SHAPE_NAMES = (
    "gptoss-512@8192", "gptoss-512@15872",
    "gptoss-512@512-w128", "gptoss-512@8192-w128", "gptoss-512@15872-w128",
    "gptoss-16384@0", "gptoss-16384@0-w128",
    "d128-512@8192", "d128-16384@0",
)

PEERS = ("sdpa", "cudnn", "flex")
PEER_SINK = {"sdpa": False, "cudnn": False, "flex": True}  # does the peer compute the sink?
KERNELS = ("hipkernel", "hipkernel:cuda")  # torch shares the CUDA primary context with it


class BenchUnavailable(RuntimeError):
    """The benchmark cannot run here (no GPU backend for the kernel)."""


# --------------------------------------------------------------------------- shapes

_SHAPE_RE = re.compile(r"(?P<family>[a-z0-9]+)-(?P<sq>\d+)@(?P<past>\d+)(?:-w(?P<w>\d+))?\Z")


@dataclass(frozen=True)
class Shape:
    """One prefill call: ``q (B, Sq, Hq, d)``, ``k, v (B, Hkv, skv, d)``, skv = past_len + Sq."""

    family: str
    sq: int
    past_len: int
    window: int = -1  # -1: causal only; W >= 1: W keys visible, self included

    @property
    def geometry(self) -> dict:
        return dict(FAMILIES[self.family])

    @property
    def name(self) -> str:
        w = f"-w{self.window}" if self.window > 0 else ""
        return f"{self.family}-{self.sq}@{self.past_len}{w}"

    @property
    def skv(self) -> int:
        return self.past_len + self.sq

    @property
    def target_ms(self) -> float | None:
        return TARGETS_MS.get(self.name)

    def flops(self) -> float:
        """Useful FLOPs (module docstring): ``hipkernel.timing.flops``."""
        from hipkernel.timing import flops

        g = self.geometry
        return flops(g["B"], self.sq, g["Hq"], g["d"], self.past_len, self.window)

    def to_dict(self) -> dict:
        return {"name": self.name, "family": self.family, **self.geometry, "sq": self.sq,
                "past_len": self.past_len, "skv": self.skv, "window": self.window,
                "dtype": "fp16"}


def parse_shape(name: str) -> Shape:
    """``FAMILY-SQ@PAST[-wW]`` -> :class:`Shape`; ValueError saying what is wrong."""
    m = _SHAPE_RE.match(name.strip())
    if not m:
        raise ValueError(f"{name!r} is not a shape name (expected FAMILY-SQ@PAST[-wW], e.g. "
                         f"gptoss-512@8192-w128)")
    family = m["family"]
    if family not in FAMILIES:
        raise ValueError(f"{name!r}: unknown family {family!r} (have {', '.join(FAMILIES)})")
    sq, past = int(m["sq"]), int(m["past"])
    if sq < 1:
        raise ValueError(f"{name!r}: Sq must be >= 1")
    window = -1
    if m["w"] is not None:
        window = int(m["w"])
        if window < 1:
            raise ValueError(f"{name!r}: the window must be W >= 1 keys")
    return Shape(family, sq, past, window)


def default_shapes() -> list[Shape]:
    return [parse_shape(n) for n in DEFAULT_SHAPE_NAMES]


def parse_shapes(text: str) -> list[Shape]:
    """``--shapes``: comma-separated shape names, family names (their default shapes) or
    ``all``. Duplicates are dropped, order kept. Raises ArgumentTypeError (argparse then
    names the flag and exits 2)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list of shape names")
    out: dict[str, Shape] = {}
    for item in items:
        if item == "all":
            picked = default_shapes()
        elif item in FAMILIES:
            picked = [s for s in default_shapes() if s.family == item]
        else:
            try:
                picked = [parse_shape(item)]
            except ValueError as e:
                raise argparse.ArgumentTypeError(
                    f"{e}; the default shapes are {', '.join(DEFAULT_SHAPE_NAMES)}") from None
        for s in picked:
            out.setdefault(s.name, s)
    return list(out.values())


def parse_peers(text: str) -> list[str]:
    """``--peers``: comma-separated subset of sdpa, cudnn, flex, or ``none``."""
    items = [t.strip().lower() for t in text.split(",") if t.strip()]
    if items == ["none"]:
        return []
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(PEERS)}, "
                                         f"or none")
    bad = [p for p in items if p not in PEERS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown peer {bad[0]!r} (have {', '.join(PEERS)}, or none)")
    return list(dict.fromkeys(items))


def _count(lo: int, why: str):
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
        if n < lo:
            raise argparse.ArgumentTypeError(f"expected an int >= {lo}{why}, got {n}")
        return n
    return parse


def _kernel_name(text: str) -> str:
    if text not in KERNELS:
        raise argparse.ArgumentTypeError(f"unsupported kernel {text!r}: the bench times "
                                         f"{' or '.join(KERNELS)} (torch peers need CUDA)")
    return text


# --------------------------------------------------------------------------- results (pure)

def peer_result(status: str, *, ms: float | None = None, flops: float | None = None,
                reason: str = "", variant: str = "", rel_l2: float | None = None,
                rejected: list[str] | None = None, sink: bool = False) -> dict:
    """One peer on one shape. ``status``: ``ok`` (its output matched hipkernel's; ``ms`` once
    timed), ``n/a`` (cannot run this shape, or not available), ``mismatch`` (ran, but its
    output is not hipkernel's: not timed)."""
    return {"status": status, "ms": ms,
            "tflops": flops / ms / 1e9 if ms and flops else None,
            "sink": sink, "variant": variant, "rel_l2": rel_l2, "reason": reason,
            "rejected": list(rejected or [])}


def timing_result(times: list[float], flops: float, **extra) -> dict:
    """Median of per-call times (ms) and the TF/s it gives."""
    ms = float(statistics.median(times))
    return {"ms": ms, "tflops": flops / ms / 1e9 if ms > 0 else None, "n": len(times),
            "min_ms": float(min(times)), "max_ms": float(max(times)), **extra}


def best_peer(peers: dict) -> str | None:
    """The fastest peer that was timed (status ``ok``), or None."""
    ok = {n: p for n, p in peers.items() if p.get("status") == "ok" and p.get("ms")}
    return min(ok, key=lambda n: ok[n]["ms"]) if ok else None


def shape_row(shape: Shape, flops: float, hk_sink: dict | None, hk_nosink: dict | None,
              peers: dict, *, error: str | None = None, config: str | None = None,
              resident_ms: float | None = None) -> dict:
    """One row of the report. ``hk_sink`` / ``hk_nosink``: :func:`timing_result` dicts (or
    None); ``peers``: name -> :func:`peer_result`. The ratio is hipkernel / best peer, with
    hipkernel in the best peer's sink mode (like for like); the target is judged on
    hipkernel with the sink."""
    best = best_peer(peers)
    ratio = basis = None
    if best is not None:
        hk = hk_sink if peers[best]["sink"] else hk_nosink
        basis = "sink" if peers[best]["sink"] else "no sink"
        if hk and hk.get("ms"):
            ratio = hk["ms"] / peers[best]["ms"]
    target = None
    if shape.target_ms is not None:
        ms = hk_sink["ms"] if hk_sink else None
        target = {"ms": shape.target_ms, "measured_ms": ms,
                  "ratio": None if ms is None else ms / shape.target_ms,
                  "hit": None if ms is None else ms <= shape.target_ms}
    return {"name": shape.name, "geometry": shape.to_dict(), "flops": flops,
            "hipkernel": {"sink": hk_sink, "nosink": hk_nosink, "config": config,
                          "resident_time_ms": resident_ms, "error": error},
            "peers": peers, "best_peer": best,
            "best_peer_ms": peers[best]["ms"] if best else None,
            "ratio": ratio, "ratio_basis": basis, "target": target}


def judge_targets(rows: list[dict]) -> dict:
    """Target verdicts over the rows: per-shape hits and misses, and the flatness of the
    windowed chunk across the cache (max / min <= FLAT_LIMIT over FLAT_GROUP)."""
    judged = [r for r in rows if r.get("target") and r["target"]["hit"] is not None]
    out = {"hits": [r["name"] for r in judged if r["target"]["hit"]],
           "misses": [r["name"] for r in judged if not r["target"]["hit"]],
           "flat": None}
    by_name = {r["name"]: r for r in rows}
    ms = [(by_name[n]["hipkernel"]["sink"] or {}).get("ms") if n in by_name else None
          for n in FLAT_GROUP]
    if all(m is not None for m in ms):
        spread = max(ms) / min(ms)
        out["flat"] = {"shapes": list(FLAT_GROUP), "ms": ms, "spread": spread,
                       "limit": FLAT_LIMIT, "hit": spread <= FLAT_LIMIT}
    return out


def make_body(rows: list[dict], *, ceilings: dict, peers_available: dict, timing: dict,
              meta: dict) -> dict:
    """The record body: ``{"shapes", "ceilings", "flop_formula", "peers_available",
    "targets", "timing", ...meta}``. Plain JSON (no NaN)."""
    return {**meta, "flop_formula": FLOP_FORMULA, "timing": timing, "ceilings": ceilings,
            "peers_available": peers_available, "shapes": rows, "targets": judge_targets(rows)}


def body_ok(body: dict) -> bool:
    """The run counts as failed only when hipkernel itself failed on a shape; missed targets
    and peers that cannot run are reported, not failures."""
    return all(not r["hipkernel"]["error"] for r in body["shapes"])


def default_json_path(device_name: str) -> Path:
    """``reports/gpu/bench-h200.json`` on an H200, ``reports/gpu/bench-<device>.json`` elsewhere."""
    slug = "h200" if "h200" in device_name.lower() else (
        re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "gpu")
    return Path("reports") / "gpu" / f"bench-{slug}.json"


# --------------------------------------------------------------------------- the table (pure)

def _ms(x) -> str:
    return "-" if x is None else (f"{x:.4f}" if x < 1 else f"{x:.3f}")


def _peer_cell(p: dict | None) -> str:
    if p is None:
        return "-"
    return _ms(p["ms"]) if p["status"] == "ok" else p["status"]


def format_report(body: dict, peers: list[str] | None = None) -> str:
    """The human-readable report of a record body (as printed by ``refattn bench``)."""
    peers = list(peers if peers is not None else PEERS)
    lines = [f"refattn bench: {body.get('kernel', '?')} on {body.get('device', '?')} "
             f"({body.get('arch', '?')}), torch {body.get('torch') or 'not importable'}",
             FLOP_FORMULA,
             f"timing: median of {body['timing'].get('reps')} calls after "
             f"{body['timing'].get('warmup')} warm-up calls"
             + (f", in {body['timing']['rounds']} interleaved rounds"
                if (body['timing'].get('rounds') or 1) > 1 else "")
             + f"; {body['timing'].get('method', '')}"]
    avail = body.get("peers_available") or {}
    if avail:
        lines.append("peers: " + "; ".join(f"{n} {'yes' if v['available'] else 'no'} ({v['reason']})"
                                          for n, v in avail.items()))
    c = body.get("ceilings") or {}
    if c.get("gemm_fp16"):
        g, cp = c["gemm_fp16"], c.get("copy") or {}
        lines.append(f"ceilings (same run): fp16 GEMM {g['n']}^3 {_ms(g['ms'])} ms = "
                     f"{g['tflops']:.0f} TF/s; device copy {cp.get('bytes', 0) / 2**30:.0f} GiB "
                     f"(read + write) {_ms(cp.get('ms'))} ms = {cp.get('tbps', 0):.2f} TB/s")
    elif c.get("reason"):
        lines.append(f"ceilings: not measured ({c['reason']})")
    gemm = (c.get("gemm_fp16") or {}).get("tflops")
    hdr = (f"{'shape':24} {'GFLOP':>8} {'hk ms':>8} {'TF/s':>6} {'%GEMM':>6} {'nosink':>8} "
           + " ".join(f"{p:>8}" for p in peers)
           + f" {'best':>6} {'ratio':>15} {'target':>7} {'verdict':>12}")
    lines += ["", "hk ms: hipkernel with a per-head sink; nosink: hipkernel without; peers in ms "
              "(sdpa/cudnn: no sink; flex: sink); ratio = hipkernel / best peer in the best "
              "peer's sink mode (< 1: hipkernel faster)", hdr, "-" * len(hdr)]
    notes = []
    for r in body["shapes"]:
        hk = r["hipkernel"]
        s, n = hk["sink"] or {}, hk["nosink"] or {}
        frac = f"{100 * s['tflops'] / gemm:5.1f}%" if gemm and s.get("tflops") else "-"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x ({r['ratio_basis']})"
        t = r["target"]
        tgt = "-" if not t else f"{t['ms']:g}"
        verdict = "-" if not t or t["hit"] is None else (
            f"{'hit' if t['hit'] else 'MISS'} {t['ratio']:.2f}x")
        if hk["error"]:
            verdict = "ERROR"
            notes.append(f"{r['name']} hipkernel: {hk['error']}")
        tf = f"{s['tflops']:.1f}" if s.get("tflops") else "-"
        lines.append(f"{r['name']:24} {r['flops'] / 1e9:8.2f} {_ms(s.get('ms')):>8} {tf:>6} "
                     f"{frac:>6} {_ms(n.get('ms')):>8} "
                     + " ".join(f"{_peer_cell(r['peers'].get(p)):>8}" for p in peers)
                     + f" {r['best_peer'] or '-':>6} {ratio:>15} {tgt:>7} {verdict:>12}")
        for p in peers:
            pr = r["peers"].get(p)
            if pr is None:
                continue
            run_wide = avail.get(p, {})  # unavailable for the whole run: said once, above
            if pr["status"] != "ok" and not (not run_wide.get("available", True)
                                             and pr["reason"] == run_wide.get("reason")):
                notes.append(f"{r['name']} {p}: {pr['status']}: {pr['reason']}")
            elif pr["rejected"]:
                notes.append(f"{r['name']} {p}: timed as {pr['variant']}; rejected first: "
                             + "; ".join(pr["rejected"]))
        ran = [pr["status"] for pr in r["peers"].values() if pr["status"] in ("ok", "mismatch")]
        if ran and set(ran) == {"mismatch"}:
            notes.append(f"{r['name']}: every peer that ran disagrees with hipkernel: suspect the "
                         f"kernel (refattn run --kernel hipkernel)")
    tg = body["targets"]
    lines += ["", f"targets (hipkernel with sink): {len(tg['hits'])} hit, {len(tg['misses'])} missed"
              + (f" ({', '.join(tg['misses'])})" if tg["misses"] else "")]
    if tg["flat"]:
        f = tg["flat"]
        lines.append(f"window 128 flat across the cache: max/min = {f['spread']:.3f} "
                     f"(limit {f['limit']:.2f}) {'hit' if f['hit'] else 'MISS'}: "
                     + ", ".join(f"{n} {_ms(m)} ms" for n, m in zip(f["shapes"], f["ms"])))
    if notes:
        lines += ["", "notes:"] + [f"  {n}" for n in _dedupe_notes(notes)]
    return "\n".join(lines)


def _dedupe_notes(notes: list[str]) -> list[str]:
    return list(dict.fromkeys(notes))


# --------------------------------------------------------------------------- environment

def open_backend(kernel: str):
    """The CUDA backend hipkernel runs on; raises :class:`BenchUnavailable` with the reason."""
    try:
        from hipkernel.backends import get_backend
    except Exception as e:  # noqa: BLE001 - any import failure is the reason
        raise BenchUnavailable(f"hipkernel is not importable: {type(e).__name__}: {e}") from None
    try:
        return get_backend("cuda")
    except Exception as e:  # noqa: BLE001
        raise BenchUnavailable(f"{kernel} cannot run here: {e}") from None


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


def peers_available(requested: list[str], torch, torch_reason: str | None) -> dict:
    """name -> ``{"available", "reason"}`` for every known peer: not requested, torch missing
    (the reason says why), or what will run."""
    out = {}
    for name in PEERS:
        if name not in requested:
            out[name] = {"available": False, "reason": "not requested (--peers)"}
        elif torch is None:
            out[name] = {"available": False, "reason": torch_reason or "torch not importable"}
        else:
            out[name] = _probe_peer(torch, name)
    return out


def _probe_peer(T, name: str) -> dict:
    try:
        if name == "sdpa":
            from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401

            flash = getattr(T.backends.cuda, "is_flash_attention_available", lambda: True)()
            if not flash:
                return {"available": False,
                        "reason": f"torch {T.__version__} built without flash attention"}
            return {"available": True,
                    "reason": f"torch {T.__version__} SDPA, flash backend (FlashAttention-2)"}
        if name == "cudnn":
            from torch.nn.attention import SDPBackend

            if not hasattr(SDPBackend, "CUDNN_ATTENTION"):
                return {"available": False, "reason": f"torch {T.__version__} has no cuDNN SDPA backend"}
            if not T.backends.cudnn.is_available():
                return {"available": False, "reason": "cuDNN is not available to torch"}
            return {"available": True,
                    "reason": f"torch {T.__version__} SDPA, cuDNN {T.backends.cudnn.version()}"}
        if name == "flex":
            from torch.nn.attention import flex_attention  # noqa: F401
            import triton

            return {"available": True, "reason": f"torch {T.__version__} FlexAttention (compiled), "
                                                 f"triton {triton.__version__}"}
    except Exception as e:  # noqa: BLE001
        return {"available": False, "reason": f"{type(e).__name__}: {e}"}
    raise ValueError(f"peer: unknown peer {name!r}")


# --------------------------------------------------------------------------- timing

class TorchEventTimer:
    """torch.cuda.Event pairs around each call, on the default stream (the one hipkernel's
    CUDA backend launches on). The timed calls are queued behind a GPU sleep, so the events
    bracket device work only (module docstring)."""

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

    def __call__(self, fn, *, warmup: int, reps: int) -> list[float]:
        T = self.T
        for _ in range(warmup):
            fn()
        T.cuda.synchronize()
        events = [(self._event(), self._event()) for _ in range(reps + 1)]
        s, e = events.pop()
        t0 = time.perf_counter()  # the host's cost of enqueueing one timed call sizes the sleep
        s.record()
        fn()
        e.record()
        host_ms = (time.perf_counter() - t0) * 1e3
        T.cuda.synchronize()
        if self.cycles_per_ms:
            from hipkernel.backends import hold_ms_for

            T.cuda._sleep(int(hold_ms_for(host_ms, reps) * self.cycles_per_ms))
        for s, e in events:
            s.record()
            fn()
            e.record()
        T.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in events]


class BackendEventTimer:
    """The kernel backend's own event timing (used when torch is not importable)."""

    method = "hipkernel backend events around each call (host launch overhead inside the events)"

    def __init__(self, be):
        self.be = be

    def __call__(self, fn, *, warmup: int, reps: int) -> list[float]:
        return list(self.be.time_ms(fn, warmup=warmup, reps=reps))


class _NoSync:
    """The backend minus ``synchronize``: ``flash_prefill_v3`` ends every call with one (its
    output is ready on return), which would put a host round trip inside each timed call."""

    def __init__(self, be):
        self._be = be

    def __getattr__(self, name):
        return getattr(self._be, name)

    def synchronize(self) -> None:
        pass


def measure_ceilings(T, timer, *, warmup: int, reps: int) -> dict:
    """fp16 GEMM TF/s (torch.mm 8192^3: 2 n^3 FLOPs) and device copy TB/s (1 GiB
    device-to-device, bytes read + written), timed like everything else."""
    n = 8192
    a = T.randn(n, n, device="cuda", dtype=T.float16)
    b = T.randn(n, n, device="cuda", dtype=T.float16)
    c = T.empty_like(a)
    ms = statistics.median(timer(lambda: T.mm(a, b, out=c), warmup=warmup, reps=reps))
    gemm = {"n": n, "flops": 2.0 * n ** 3, "ms": ms, "tflops": 2.0 * n ** 3 / ms / 1e9,
            "formula": "2 * n^3 FLOPs, torch.mm fp16"}
    del a, b, c
    nbytes = 1 << 30
    src = T.ones(nbytes // 2, device="cuda", dtype=T.float16)
    dst = T.empty_like(src)
    ms = statistics.median(timer(lambda: dst.copy_(src), warmup=warmup, reps=reps))
    copy = {"bytes": 2 * nbytes, "ms": ms, "tbps": 2 * nbytes / ms / 1e9,
            "formula": "bytes read + bytes written, Tensor.copy_ device to device"}
    del src, dst
    return {"gemm_fp16": gemm, "copy": copy}


# --------------------------------------------------------------------------- the run context

@dataclass
class Env:
    """What a run shares across shapes."""

    be: object
    kernel: str
    timer: object
    warmup: int
    reps: int
    requested: list[str]
    rounds: int = 1                            # interleaved rounds (bench_shape)
    torch: object = None
    torch_reason: str | None = None
    peers: dict = field(default_factory=dict)  # peers_available()
    _flex: object = None                       # FlexPeer (or why it cannot be built), on first use
    log: object = None                         # callable(str) for progress
    device: str = "cuda"                       # where the torch copies live

    def synchronize(self) -> None:
        if self.torch is not None and self.device.startswith("cuda"):
            self.torch.cuda.synchronize()

    def say(self, msg: str) -> None:
        if self.log:
            self.log(msg)

    def can_run(self, peer: str) -> bool:
        return peer in self.requested and self.peers.get(peer, {}).get("available", False)

    def flex(self):
        """The compiled Flex peer, built once; a failure to build is kept and re-raised."""
        if self._flex is None:
            try:
                self._flex = FlexPeer(self.torch, self.device)
            except Exception as e:  # noqa: BLE001 - every later shape reports the same reason
                self._flex = e
        if isinstance(self._flex, Exception):
            raise self._flex
        return self._flex


def make_env(be, *, kernel: str = "hipkernel", peers=PEERS, warmup: int = DEFAULT_WARMUP,
             reps: int = DEFAULT_REPS, rounds: int = DEFAULT_ROUNDS, log=None) -> Env:
    T, reason = probe_torch()
    timer = TorchEventTimer(T) if T is not None else BackendEventTimer(be)
    return Env(be=be, kernel=kernel, timer=timer, warmup=warmup, reps=reps, rounds=rounds,
               requested=list(peers), torch=T, torch_reason=reason,
               peers=peers_available(list(peers), T, reason), log=log)


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
                    times[name] += timer(calls[name].fn, warmup=warmup, reps=n_r)
            except Exception as e:  # noqa: BLE001 - the others go on; the caller reports it
                failed.add(name)
                if on_error is not None:
                    on_error(name, e)
    return {n: t for n, t in times.items() if n not in failed}


def _short(e: BaseException, caught=()) -> str:
    """One line for an exception, with the most telling torch warning caught alongside."""
    first = (str(e).strip().splitlines() or [""])[0]
    msg = f"{type(e).__name__}: {first}"[:200]
    why = [str(w.message).strip() for w in caught
           if "not used because" not in str(w.message) and str(w.message).strip()]
    if why:
        msg += f" ({why[0][:160]})"
    return msg


def _why_none_ran(rejected: list[str]) -> str:
    """``label: error`` lines grouped by error: "error (tried: label; label)"."""
    by_error: dict[str, list[str]] = {}
    for line in rejected:
        label, _, error = line.partition(": ")
        by_error.setdefault(error, []).append(label)
    return "; ".join(f"{error} (tried: {'; '.join(labels)})" for error, labels in by_error.items())


def _rel_l2(T, actual, expected) -> float:
    """||actual - expected|| / ||expected|| over the whole output, in fp32 on the device."""
    a, b = actual.float(), expected.float()
    return float(T.linalg.vector_norm(a - b) / T.linalg.vector_norm(b))


# --------------------------------------------------------------------------- flex

class FlexPeer:
    """``torch.compile``d FlexAttention with the sink applied exactly from its LSE."""

    def __init__(self, T, device: str = "cuda"):
        import torch._dynamo
        from torch.nn.attention import flex_attention as fa

        self.T, self.device = T, device
        try:
            from torch.nn.attention.flex_attention import AuxRequest
        except ImportError:  # torch < 2.9: only the (since deprecated) return_lse flag
            AuxRequest = None
        self.api = "return_aux=AuxRequest(lse=True)" if AuxRequest else "return_lse=True"
        self.create_block_mask, self.and_masks = fa.create_block_mask, fa.and_masks
        # One compile per shape (a new mask_mod and new sizes each time): keep dynamo from
        # giving up on the function after its default recompile limit of 8.
        cfg = torch._dynamo.config
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for knob in ("recompile_limit", "cache_size_limit"):
                if hasattr(cfg, knob):
                    setattr(cfg, knob, max(int(getattr(cfg, knob)), 64))

        if AuxRequest is not None:
            want_lse = AuxRequest(lse=True)

            def flex_lse(q, k, v, block_mask, scale):
                out, aux = fa.flex_attention(q, k, v, block_mask=block_mask, scale=scale,
                                             enable_gqa=True, return_aux=want_lse)
                return out, aux.lse
        else:
            def flex_lse(q, k, v, block_mask, scale):
                return fa.flex_attention(q, k, v, block_mask=block_mask, scale=scale,
                                         enable_gqa=True, return_lse=True)

        self._flex_lse = flex_lse
        self.lse_scale, self.lse_base = self._probe_lse_base()

        lse_scale = self.lse_scale

        def flex_sink(q, k, v, block_mask, scale, sink):
            out, lse = flex_lse(q, k, v, block_mask, scale)
            # out (B, Hq, Sq, d) is normalised by Z = sum_j exp(s_j); with the sink it is
            # normalised by Z + e^sink: scale by Z / (Z + e^sink) = sigmoid(ln Z - sink).
            gate = T.sigmoid(lse * lse_scale - sink[None, :, None])
            return (out.float() * gate[..., None]).to(out.dtype)

        self.eager_fn = flex_sink  # the same maths uncompiled (debugging; CPU checks)
        self.fn = T.compile(flex_sink, dynamic=False)

    def _probe_lse_base(self) -> tuple[float, str]:
        """Which log the returned LSE is in: compared with torch.logsumexp on a tiny problem."""
        T = self.T
        g = T.Generator(device=self.device).manual_seed(0)
        q, k, v = (T.randn(1, 1, 128, 16, device=self.device, generator=g) for _ in range(3))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, lse = self._flex_lse(q, k, v, None, 0.25)
        ref = T.logsumexp((q @ k.transpose(-1, -2)) * 0.25, dim=-1)
        if T.allclose(lse.float(), ref, rtol=1e-3, atol=1e-3):
            return 1.0, "natural"
        if T.allclose(lse.float() * LN2, ref, rtol=1e-3, atol=1e-3):
            return LN2, "log2 (converted: * ln 2)"
        raise RuntimeError(f"flex LSE is neither ln nor log2 of the logsumexp "
                           f"(max |lse - ref| = {float((lse - ref).abs().max()):.3g})")

    def block_mask(self, shape: Shape):
        """Causal bottom-right (key j visible iff j <= p, p = past_len + i), and j >= p - W + 1
        under a window: the visibility of docs/semantics.md (Semantics) as flex mask_mods."""
        past, W = shape.past_len, shape.window

        def causal(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + past

        def in_window(b, h, q_idx, kv_idx):
            return kv_idx >= q_idx + past - W + 1

        mask_mod = causal if W < 0 else self.and_masks(causal, in_window)
        return self.create_block_mask(mask_mod, None, None, shape.sq, shape.skv, device=self.device)


# --------------------------------------------------------------------------- one shape

@dataclass
class Call:
    """A timed callable and the context it must run in (an SDPA backend selection)."""

    fn: object
    context: object = contextlib.nullcontext


class ShapeBench:
    """hipkernel and the peers on one shape, on one set of inputs.

    ``setup()`` uploads the inputs and runs hipkernel once per sink mode (autotune + the
    reference outputs for the peers), ``hipkernel(mode)`` and ``peer(name)`` time, ``row()``
    assembles the report row, ``close()`` frees the device buffers."""

    def __init__(self, env: Env, shape: Shape, seed: int = 0):
        self.env, self.shape, self.seed = env, shape, seed
        self.flops = shape.flops()
        self.hk: dict[str, dict | None] = {"per_head": None, "none": None}
        self.peers: dict[str, dict] = {}
        self.calls: dict[str, Call] = {}
        self.error: str | None = None
        self.config: str | None = None
        self.resident_ms: float | None = None
        self.res = None
        self.t: dict = {}

    # ---- inputs and hipkernel ------------------------------------------------------------
    def setup(self) -> None:
        from hipkernel.timing import Resident

        s, g = self.shape, self.shape.geometry
        self.res = Resident(self.env.be, B=g["B"], Sq=s.sq, Hq=g["Hq"], Hkv=g["Hkv"], d=g["d"],
                            past_len=s.past_len, seed=self.seed)
        outs = {}
        for mode in ("per_head", "none"):  # the first launch autotunes (untimed)
            status = self.res.launch(window=s.window, sink_mode=mode)
            if status != 0:
                raise RuntimeError(f"hipkernel declined a supported call (status {status})")
            outs[mode] = self.res.output()
        self.config = self._tuned_config()
        nosync = _NoSync(self.env.be)
        for mode in ("per_head", "none"):
            self.calls[f"hipkernel:{mode}"] = Call(self._launcher(nosync, mode))
        T = self.env.torch
        if T is not None and any(self.env.can_run(p) for p in PEERS):
            h = self.res.host
            dev = lambda a: T.from_numpy(a).to(self.env.device)  # noqa: E731
            self.t = {
                "q": dev(h["q"]).transpose(1, 2).contiguous(),  # (B, Hq, Sq, d)
                "k": dev(h["k"]), "v": dev(h["v"]),             # (B, Hkv, skv, d)
                "sink": dev(h["sink"]).float(),                   # (Hq,), fp16 values
                # hipkernel's outputs, (B, Sq, Hq, d) -> (B, Hq, Sq, d), the peers' expected
                "out:per_head": dev(outs["per_head"]).transpose(1, 2),
                "out:none": dev(outs["none"]).transpose(1, 2),
            }

    def _launcher(self, backend, mode: str):
        from hipkernel import api

        p, geom, w = self.res.ptr, self.res.geom, self.shape.window

        def launch():
            api.flash_prefill_v3(backend, p["q"], p["k"], p["v"], p["sink"], p["out"],
                                 window=w, sink_mode=mode, **geom)
        return launch

    def _tuned_config(self) -> str:
        from hipkernel.autotune import TUNER, tune_key

        g, s = self.shape.geometry, self.shape
        key = tune_key(d=g["d"], sq=s.sq, Hq=g["Hq"], G=g["Hq"] // g["Hkv"], window=s.window,
                       dtype="fp16", arch=self.env.be.arch)
        cfg = TUNER.cache.get(key)
        return cfg.name if cfg is not None else "default (autotune off)"

    def hipkernel(self, mode: str) -> dict:
        """Time hipkernel with ``mode`` = ``per_head`` (sink) or ``none``, in one burst."""
        self._time([f"hipkernel:{mode}"], rounds=1)
        return self.hk[mode]

    def resident_time(self) -> float:
        """``Resident.time_ms`` as the measure records use it (launch + synchronize per call)."""
        self.resident_ms = self.res.time_ms(window=self.shape.window, sink_mode="per_head",
                                            warmup=self.env.warmup, reps=self.env.reps)
        return self.resident_ms

    # ---- peers -----------------------------------------------------------------------------
    def peer(self, name: str) -> dict:
        """Check ``name``'s output against hipkernel's, then time it in one burst; the result
        is kept."""
        if self.check_peer(name)["status"] == "ok":
            self._time([name], rounds=1)
        return self.peers[name]

    def time_all(self, names: list[str]) -> None:
        """hipkernel in both sink modes and the peers in ``names`` that passed their check
        (``check_peer``), timed in the env's interleaved rounds (``time_interleaved``)."""
        self._time(["hipkernel:per_head", "hipkernel:none"]
                   + [n for n in names if self.peers.get(n, {}).get("status") == "ok"],
                   rounds=self.env.rounds)

    def _time(self, names: list[str], rounds: int) -> None:
        """Time ``calls[name]`` for each name (``hipkernel:MODE`` or a checked peer) in
        ``rounds`` interleaved rounds and keep the results. A peer that raises while timed
        becomes ``n/a`` with the reason; hipkernel raising is an error of the shape."""
        errors: dict[str, str] = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            times = time_interleaved(self.env.timer, {n: self.calls[n] for n in names},
                                     warmup=self.env.warmup, reps=self.env.reps, rounds=rounds,
                                     on_error=lambda n, e: errors.__setitem__(n, _short(e)))
        for n in names:
            if n.startswith("hipkernel:"):
                if n in errors:
                    raise RuntimeError(f"{n} failed while timed: {errors[n]}")
                self.hk[n.partition(":")[2]] = timing_result(times[n], self.flops)
            elif n in errors:
                self.peers[n] = peer_result("n/a", sink=PEER_SINK[n],
                                            reason=f"failed while timed: {errors[n]}")
            else:
                r = timing_result(times[n], self.flops)
                self.peers[n] = {**self.peers[n], "ms": r["ms"], "tflops": r["tflops"]}

    def check_peer(self, name: str) -> dict:
        """Find the way of calling ``name`` whose output matches hipkernel's, without timing
        it: status ``ok`` (its call kept in ``calls``, ``ms`` still None), ``mismatch`` or
        ``n/a``; the result is kept."""
        sink = PEER_SINK[name]
        if not self.env.can_run(name):
            res = peer_result("n/a", reason=self.env.peers.get(name, {}).get("reason", "not available"),
                              sink=sink)
        elif name in ("sdpa", "cudnn") and self.shape.window > 0:
            res = peer_result("n/a", sink=sink, reason="SDPA has no sliding-window kernel (a dense "
                              "mask would still compute the whole causal band)")
        else:
            try:
                res = self._check(name, sink)
            except Exception as e:  # noqa: BLE001 - a peer's failure is a result, not a crash
                res = peer_result("n/a", sink=sink, reason=_short(e))
        self.peers[name] = res
        return res

    def _check(self, name: str, sink: bool) -> dict:
        T = self.env.torch
        expected = self.t["out:per_head" if sink else "out:none"]
        rejected, mismatch = [], None
        for label, call in self._attempts(name):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    with call.context():
                        got = call.fn()
                        self.env.synchronize()
                except Exception as e:  # noqa: BLE001 - this way of calling it cannot run
                    rejected.append(f"{label}: {_short(e, caught)}")
                    continue
            err = _rel_l2(T, got, expected)
            del got
            if not math.isfinite(err):
                rejected.append(f"{label}: output mismatch, NaN/Inf in the output")
                mismatch = mismatch if mismatch is not None else float("inf")
                continue
            if not err < MATCH_REL_L2:
                rejected.append(f"{label}: output mismatch, relL2 {err:.2e} vs hipkernel")
                mismatch = err if mismatch is None else min(mismatch, err)
                continue
            self.calls[name] = call
            return peer_result("ok", variant=label, rel_l2=err, rejected=rejected, sink=sink)
        if mismatch is not None:
            return peer_result("mismatch", rel_l2=mismatch if math.isfinite(mismatch) else None,
                               sink=sink, rejected=rejected,
                               reason=f"no configuration matched hipkernel (relL2 < "
                                      f"{MATCH_REL_L2:g}): " + "; ".join(rejected))
        return peer_result("n/a", sink=sink, rejected=rejected, reason=_why_none_ran(rejected))

    def _attempts(self, name: str):
        """(label, Call) in the order tried; the first that runs and matches is timed."""
        if name == "flex":
            yield from self._flex_attempts()
            return
        T, s, t = self.env.torch, self.shape, self.t
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.bias import causal_lower_right

        backend = SDPBackend.FLASH_ATTENTION if name == "sdpa" else SDPBackend.CUDNN_ATTENTION
        context = lambda: sdpa_kernel([backend])  # noqa: E731
        F = T.nn.functional
        scale = 1.0 / math.sqrt(s.geometry["d"])
        G = s.geometry["Hq"] // s.geometry["Hkv"]
        if s.sq == s.skv:  # top-left and bottom-right coincide
            masks = [("is_causal=True", dict(is_causal=True))]
        elif name == "sdpa":  # reaches the flash op with its own bottom-right causal flag
            masks = [("causal_lower_right(Sq, skv)", dict(attn_mask=causal_lower_right(s.sq, s.skv)))]
        else:
            # cuDNN: plain is_causal first, kept only if cuDNN aligns it bottom-right (the
            # output check decides); else an additive mask, built here, outside the timed
            # region: 0 where key j <= p = past_len + i, -inf elsewhere.
            dev = self.env.device
            visible = T.ones(s.sq, s.skv, dtype=T.bool, device=dev).tril(diagonal=s.past_len)
            bias = T.zeros(1, 1, s.sq, s.skv, dtype=t["q"].dtype, device=dev)
            bias.masked_fill_(~visible, float("-inf"))
            masks = [("is_causal=True", dict(is_causal=True)),
                     ("dense bottom-right mask (additive fp16)", dict(attn_mask=bias))]
        q = t["q"]
        for gqa in ("native GQA (enable_gqa=True)", f"KV heads repeated x{G}"):
            if gqa.startswith("native"):
                k, v, kw = t["k"], t["v"], dict(enable_gqa=True)
            else:
                k, v, kw = t["k"].repeat_interleave(G, dim=1), t["v"].repeat_interleave(G, dim=1), {}
            for label, mask in masks:
                def fn(q=q, k=k, v=v, mask=mask, kw=kw):
                    return F.scaled_dot_product_attention(q, k, v, scale=scale, **mask, **kw)
                yield f"{label}, {gqa}", Call(fn, context)

    def _flex_attempts(self):
        self.env.say(f"  flex: compiling for {self.shape.name} (block mask built once, untimed)")
        flex = self.env.flex()
        t, s = self.t, self.shape
        bm = flex.block_mask(s)
        scale = 1.0 / math.sqrt(s.geometry["d"])

        def fn():
            return flex.fn(t["q"], t["k"], t["v"], bm, scale, t["sink"])
        yield (f"block mask causal bottom-right{'' if s.window < 0 else f' + window {s.window}'}, "
               f"enable_gqa=True, {flex.api}, sink = out * sigmoid(lse - sink)"), Call(fn)

    # ---- the row ---------------------------------------------------------------------------
    def row(self) -> dict:
        return shape_row(self.shape, self.flops, self.hk["per_head"], self.hk["none"],
                         self.peers, error=self.error, config=self.config,
                         resident_ms=self.resident_ms)

    def close(self) -> None:
        self.t = {}
        self.calls = {}
        if self.res is not None:
            self.res.free()
            self.res = None


def bench_shape(env: Env, shape: Shape) -> dict:
    """Everything for one shape -> its report row: hipkernel's set-up (autotune, reference
    outputs), each requested peer checked against it, then hipkernel in both modes and the
    peers that matched timed in interleaved rounds (``ShapeBench.time_all``), then the
    resident figure. A hipkernel failure is recorded in the row, not raised."""
    sb = ShapeBench(env, shape)
    try:
        sb.setup()
        for name in PEERS:
            sb.check_peer(name)
        sb.time_all(list(PEERS))
        sb.resident_time()
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on with the next shape
        sb.error = f"{type(e).__name__}: {e}"
        env.say(traceback.format_exc())
        sb.close()
        return sb.row()
    try:
        hk = sb.hk["per_head"]
        env.say(f"  hipkernel ({sb.config}): sink {hk['ms']:.4f} ms = {hk['tflops']:.1f} TF/s, "
                f"no sink {sb.hk['none']['ms']:.4f} ms; Resident.time_ms {sb.resident_ms:.4f} ms")
        for name in PEERS:
            r = sb.peers[name]
            if env.can_run(name):
                env.say(f"  {name}: " + (f"{r['ms']:.4f} ms ({r['variant']}, relL2 {r['rel_l2']:.1e})"
                                         if r["status"] == "ok" else f"{r['status']}: {r['reason']}"))
        return sb.row()
    finally:
        sb.close()


# --------------------------------------------------------------------------- CLI

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Time the fused kernel and its torch peers (SDPA flash, SDPA cuDNN, FlexAttention)\n"
        "in one process on the same inputs, with device events (median of --reps calls);\n"
        "print time, TF/s and the ratio to the best peer, judge the performance targets, and\n"
        "write a GPU record. Work is counted as\n\n"
        "    FLOPs = 4 * d * Hq * B * sum_rows(visible keys of the row)\n\n"
        "where row i (position p = past_len + i) sees p + 1 keys, min(p + 1, W) under a\n"
        "window of W keys. Each peer's output is checked against hipkernel's (relL2 < 2e-3)\n"
        "before it is timed.")
    p.add_argument("--kernel", type=_kernel_name, default="hipkernel", metavar="NAME",
                   help="kernel to time: hipkernel or hipkernel:cuda (default hipkernel)")
    p.add_argument("--peers", type=parse_peers, default=list(PEERS), metavar="LIST",
                   help=f"comma-separated peers from {', '.join(PEERS)}, or none (default: all)")
    families = ", ".join(f"{k}: Hq={g['Hq']} Hkv={g['Hkv']} d={g['d']}" for k, g in FAMILIES.items())
    p.add_argument("--shapes", type=parse_shapes, default=None, metavar="NAME,...",
                   help=f"shape names FAMILY-SQ@PAST[-wW] ({families}; B=1, fp16), a family "
                        f"name, or all. Default: {', '.join(DEFAULT_SHAPE_NAMES)}")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="write the GPU record to PATH ('-' = stdout, the table then goes to "
                        "stderr). Default: reports/gpu/bench-h200.json on an H200, "
                        "reports/gpu/bench-<device>.json elsewhere")
    p.add_argument("--reps", type=_count(MIN_REPS, " (the median of at least 20 timed calls)"),
                   default=DEFAULT_REPS, metavar="N", help=f"timed calls per measurement "
                   f"(median; >= {MIN_REPS}, default {DEFAULT_REPS})")
    p.add_argument("--warmup", type=_count(0, ""), default=DEFAULT_WARMUP, metavar="N",
                   help=f"untimed calls before each measurement (default {DEFAULT_WARMUP})")
    p.add_argument("--rounds", type=_count(1, ""), default=DEFAULT_ROUNDS, metavar="N",
                   help=f"split each implementation's --reps timed calls over N rounds, each "
                        f"timing every implementation of the shape in turn, in the orders of a "
                        f"carryover-balanced design (each follows every other equally often), "
                        f"so that all meet the same clock drift; 1 = one burst each (default "
                        f"{DEFAULT_ROUNDS})")
    p.add_argument("--no-ceilings", dest="ceilings", action="store_false",
                   help="skip the fp16 GEMM and copy ceilings")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output on stderr")
    p.epilog = ("examples:\n"
                "  refattn bench                                   # every default shape, all peers\n"
                "  refattn bench --shapes gptoss-512@8192-w128 --peers flex\n"
                "  refattn bench --shapes d128 --peers sdpa,cudnn --json -\n"
                "  refattn bench --shapes gptoss-1024@4096-w128    # any FAMILY-SQ@PAST[-wW]\n"
                "\nexit status: 0 measured (targets missed are reported), 1 hipkernel failed on "
                "a shape (or a target missed with --strict), 2 usage error or no GPU")


def run(args) -> int:
    from refattn.cli import UsageError, check_outputs

    check_outputs(args, ("json",))  # before the bench, not after minutes of it
    if args.rounds > args.reps:
        raise UsageError(f"argument --rounds: at most --reps ({args.reps}) rounds, got {args.rounds}")
    t_start = time.perf_counter()
    shapes = args.shapes or default_shapes()
    log = None if args.quiet else (
        lambda m: print(f"[{time.perf_counter() - t_start:6.1f} s] {m}", file=sys.stderr, flush=True))
    try:
        be = open_backend(args.kernel)
    except BenchUnavailable as e:
        _, torch_reason = probe_torch()
        peers_note = f"\n(peers: {torch_reason})" if torch_reason else ""
        raise UsageError(f"needs a GPU: {e}{peers_note}") from None
    env = make_env(be, kernel=args.kernel, peers=args.peers, warmup=args.warmup, reps=args.reps,
                   rounds=args.rounds, log=log)
    env.say(f"refattn bench: {args.kernel} on {be.device_name} ({be.arch}); "
            f"{len(shapes)} shapes; peers: "
            + ", ".join(f"{n} {'yes' if v['available'] else 'no'} ({v['reason']})"
                        for n, v in env.peers.items()))
    T = env.torch
    if T is None:
        ceilings = {"reason": env.torch_reason}
    elif not args.ceilings:
        ceilings = {"reason": "skipped (--no-ceilings)"}
    else:
        env.say("ceilings: fp16 GEMM 8192^3 and a 1 GiB device copy")
        ceilings = measure_ceilings(T, env.timer, warmup=env.warmup, reps=env.reps)
    rows = []
    for i, shape in enumerate(shapes):
        env.say(f"[{i + 1}/{len(shapes)}] {shape.name}")
        rows.append(bench_shape(env, shape))
    flex = env._flex
    meta = {"kernel": args.kernel, "backend": getattr(be, "name", "?"), "arch": be.arch,
            "device": be.device_name, "torch": getattr(T, "__version__", None),
            "flex_lse_base": getattr(flex, "lse_base", None),
            "peers_requested": list(args.peers), "elapsed_s": None}
    timing = {"method": env.timer.method, "statistic": "median", "warmup": env.warmup,
              "reps": env.reps, "rounds": env.rounds,
              "order": ("one burst of --reps calls each, hipkernel first" if env.rounds == 1 else
                        f"the reps split over {env.rounds} rounds, each timing every "
                        "implementation in turn after --warmup calls, in the orders of a "
                        "carryover-balanced (Williams) design, each implementation right after "
                        "every other equally often; the median over all of an implementation's "
                        "calls"),
              "hipkernel_launch": "flash_prefill_v3 without its trailing "
              "synchronize; resident_time_ms = Resident.time_ms (synchronize per call)"}
    body = make_body(rows, ceilings=ceilings, peers_available=env.peers, timing=timing, meta=meta)
    body["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    from hipkernel import record
    from refattn.fileio import atomic_write_text

    rec = record.stamp("bench", be.device_name, body, ok=body_ok(body))
    text = json.dumps(rec, indent=2, allow_nan=False)
    out = sys.stderr if args.json == "-" else sys.stdout
    print(format_report(body), file=out, flush=True)
    if args.json == "-":
        sys.stdout.write(text + "\n")
    else:
        path = Path(args.json) if args.json else default_json_path(be.device_name)
        atomic_write_text(path, text + "\n")
        print(f"wrote {path} (ok={rec['ok']}, {body['elapsed_s']} s)", file=out)
    if not rec["ok"]:
        return EXIT_FAIL
    targets = body["targets"]
    if args.strict and (targets["misses"] or (targets["flat"] or {}).get("hit") is False):
        return EXIT_FAIL
    return EXIT_OK
