"""`refattn bench`: a kernel against its peers, each checked against the reference, then timed
in one process on the same inputs.

    refattn bench --kernel K [--peers sdpa,cudnn,flex,fa4] [--shapes FILE|NAMES] [--json PATH]

Implementations
===============

The kernel under test (``--kernel``) and every peer (``--peers``) are adapters
(``refattn.kernels``): a registered name, an import path ``package.module:Class``, or for a
peer one of the short names ``sdpa``, ``cudnn``, ``flex``, ``fa4`` (the torch peers of
``refattn.adapters.torch_peers``). Each must have ``prepare(inputs)``: an adapter without it is refused
(exit 2, one line naming the missing member). ``prepare`` returns a callable that launches on
device-resident copies of the inputs, with no host copy and no synchronize inside; the
adapter's ``synchronize()`` waits for it (torch's device synchronize stands in where an
adapter has none and torch sees a GPU; elsewhere the launch is taken to be synchronous).
The callable may also have ``output()`` (the last launch's output as a NumPy ``(B, Sq, Hq,
d)`` array), ``close()`` (free the device copies) and ``variant`` (which way of computing it
took): ``refattn.timing.Prepared`` has all three. The first call of a prepared launch
(where a kernel autotunes or a peer compiles) is never timed.

Shapes file
===========

Shapes and targets are data: ``benchmarks/shapes.toml`` of the source tree by default
(looked for beside the refattn package and under the working directory), or the file given
as ``--shapes path/to/file.toml``. It declares head-geometry families (``[families.NAME]``:
B, Hq, Hkv, d, whether their shapes carry a per-head sink), the shapes (``[[shape]]``:
family, sq, past_len, window, sink, and optionally ``target_ms``), ragged shapes
(``[[ragged]]``, below), flatness groups (``[[flat]]``: shapes whose kernel times must stay
within ``max / min <= limit``), the data types every shape is benched in (``dtypes``) and
the bf16 target (``bf16_within``) and the peer target (``[peer_within]``, below). A shape is
named ``FAMILY-SQ@PAST[-wW]``:
``gptoss-512@8192-w128`` is a 512-token chunk over an 8192-token cache with W = 128.
``--shapes`` also takes names: shapes of the file (bf16 and ragged rows included), a family
of it (its shapes), ``all``, or any ``FAMILY-SQ@PAST[-wW][-bf16]`` of one of its families
(no target). Every violation of the file's format is an error naming the file, the entry and
the key (exit 2).

Data types
==========

``dtypes = ["fp16", "bf16"]`` (default ``["fp16"]``) benches every shape once per listed
dtype, in that order, each shape's rows side by side. The bf16 row is named with the suffix
``-bf16`` (``gptoss-512@8192-w128-bf16``); its inputs are the shape's case with
``dtype = "bf16"`` (bf16 values, held in float32 on the host), and its check uses the bf16
baseline (``lowp = "bf16"``: P and the output rounded through bf16, docs/semantics.md,
Tolerance model). ``target_ms`` applies to the fp16 row only. ``bf16_within = F`` (optional;
needs both dtypes) adds a target to every shape: the kernel's bf16 time must not exceed F
times its fp16 time on the same shape, both in the shape's sink mode; a shape whose fp16 row
was not run or not timed is not judged.

Peer target
===========

``[peer_within]`` (optional): ``peer`` (the name of a peer adapter), ``factor`` (a number >
0) and ``why``. It adds a target to every row of the file (fp16, bf16 and ragged): the
kernel's time must not exceed ``factor`` times the peer's, both in the shape's sink mode and
timed in the same run. A row where the peer was not requested, could not run that mode or
failed its check is not judged (reported as such, not as a hit).

Ragged shapes
=============

A ``[[ragged]]`` table is one call over a batch of sequences of their own lengths
(docs/semantics.md, Ragged batches): ``name`` (required, ``^[a-z0-9][a-z0-9.@-]*$``, not of
the form ``FAMILY-SQ@PAST[-wW]`` and not ending in ``-bf16``), ``family``, ``past_len`` (a
list of B integers: B comes from the list, not from the family), ``q_len`` (optional, B
integers in [0, sq]: each sequence's valid query rows, right-padded to ``sq``; default sq
each), ``sq``, ``window``, ``sink``, ``target_ms`` and ``why`` as for a shape. Only adapters
that declare ``ragged = True`` run it (the others are ``n/a``, as in ``refattn run``).

Sink modes
==========

A shape with a sink is run in two modes: ``sink`` (the per-head sink of the inputs) and
``nosink`` (the same q/k/v, no sink). The kernel under test is timed in every mode it
supports; a peer in the first mode it supports (``sink``, else ``nosink``: a peer without a
sink is timed in the no-sink mode on a sink shape). A shape without a sink has the one mode
``nosink``. The ratio kernel / best peer takes the kernel in the best peer's mode (like for
like); the target is judged on the kernel in the shape's own mode (with the sink on a sink
shape).

Checked before timed
====================

Each shape's inputs are built once (the shape as a ``refattn.cases.Case``,
``refattn.cases.make_inputs``, fp16 or bf16, seed 0; read-only). Each implementation is
prepared, launched once, and its output read back (``output()`` of the prepared call: the
very launch that is timed; an adapter whose callable has none runs ``run(inputs)`` instead)
and judged against the fp64 reference (``refattn.reference``) under the derived gate of
``refattn.metrics.compare`` (with the baseline of the row's dtype), never against another
kernel. The full fp64 reference of a long shape is too slow on the host (16k rows x 16k keys
x 64 heads), so the check samples row blocks: the first, a middle and the last
:data:`CHECK_ROWS` rows (every row of a chunk of at most three blocks). The reference of rows
[i, i + r) of a chunk at ``past_len`` equals the reference of the chunk ``q[:, i:i+r]`` at
``past_len + i`` over the cache cut to ``past_len + i + r`` keys (row i sees the keys up to
its own position, and no others), so each block's reference and low-precision baseline are
computed on their own and the comparison is made over the blocks together. An
implementation that fails the check is ``mismatch`` (its relL2 and gate recorded) and is not
timed; one that raises is ``n/a`` with the reason; one that does not support the case
(``supports(case)`` is False) is ``n/a``.

A ragged shape is checked per sequence: for each sequence b with ``q_len[b] > 0``, the same
blocks of its ``q_len[b]`` valid rows, each against the reference of sequence b alone (the
uniform call over its own cache of ``past_len[b] + q_len[b]`` keys), the blocks of all
sequences compared together; and every padded row (``i >= q_len[b]``) of the output must be
exactly 0. The check's blocks are recorded as ``[i0, i1]`` (``[b, i0, i1]`` for a ragged
shape).

The inputs of a ragged shape are ``make_inputs``'s with the NaN canaries it puts in every
cache slot at or past a sequence's own length and in its padded query rows replaced by
zeros. The bench times, on inputs every implementation may load: a kernel may read whole
tiles past a sequence's end and mask the scores afterwards, where a NaN would still reach
P.V (0 x NaN is NaN), and a peer is not under test for that. Catching a read of those slots
is the case matrix's job (``refattn run`` on ``cases/ragged.toml`` keeps the canaries).

Timing
======

``refattn.timing``: device events (``torch.cuda.Event``) around each call, the calls queued
behind a GPU sleep so that the events bracket device work only; without a CUDA device the
host clock around each call and its synchronize. ``--reps`` timed calls (>= 20) of each
implementation, split over ``--rounds`` interleaved rounds in the orders of a
carryover-balanced (Williams) design, ``--warmup`` untimed calls before each round's; the
median over all of an implementation's calls. Calls run back to back on the same inputs, so
K/V may be L2-resident; that holds for every implementation alike. Ceilings measured in the
same run (torch): fp16 GEMM (``torch.mm``, 8192^3, 2 n^3 FLOPs) and device-to-device copy (1
GiB, bytes read + bytes written).

FLOPs (useful work only, what FlashAttention's benchmarks count)::

    FLOPs = 4 * d * Hq * B * sum_rows(visible keys of the row)

a visible (query, key) pair costs a d-long dot product for the score and a d-long
multiply-add for P.V, 2 FLOPs per element each. Row i (position p = past_len + i) sees
``p + 1`` keys, or ``min(p + 1, W)`` under a window. A ragged shape counts each sequence's
own pairs (``refattn.cases.Case.flops``): row i of sequence b at ``p = past_len[b] + i``, its
``q_len[b]`` valid rows only, so a batch costs what its sequences cost, not B times the
longest. TF/s = FLOPs / time.

Output
======

A table per shape (the kernel's time and TF/s, its no-sink time, each peer, the best peer,
the ratio kernel / best peer in the best peer's sink mode: < 1 means the kernel is faster,
the target and its verdict: ``target_ms`` on an fp16 row, ``<=Fx`` the bf16_within target on
a bf16 row), the targets, and a JSON record (``--json``) of kind ``bench``:
``kernel`` (its name), ``kernel_spec`` (the name it was built from, ``--kernel``),
``kernel_source_hash`` (the adapter's ``source_hash()``; null, with
``kernel_source_hash_note`` saying why, when it has none: the record is then tied to no
source and its freshness is unknown), ``peers_available``, ``dtypes`` and ``bf16_within``
(of the shapes file), ``shapes``, each with its ``geometry`` (``dtype``, ``ragged``, the
per-sequence ``past_len`` and ``q_len`` of a ragged shape) and ``results`` keyed by adapter
name: ``{"role": "kernel" | "peer", "sink": R, "nosink": R}``, R the result of one mode
(``status`` ok / mismatch / n/a, ``ms``, ``tflops``, ``variant``, ``rel_l2`` and the gate,
``reason``) or null where the mode was not run; and ``targets``: ``hits``, ``misses`` and
``untimed`` (``target_ms``), ``flat``, and ``bf16_within`` (per bf16 row: ``shape``,
``fp16_shape``, ``factor``, ``mode``, ``bf16_ms``, ``fp16_ms``, ``ratio`` = bf16 / fp16,
``hit``: null where not judged), and ``peer_within`` (per row, with ``[peer_within]``:
``shape``, ``peer``, ``factor``, ``mode``, ``kernel_ms``, ``peer_ms``, ``ratio`` = kernel /
peer, ``hit``: null where not judged); the file's ``[peer_within]`` is in the record as
``peer_within``.

``--judge RECORD`` times nothing: it judges the times of an earlier run's record against the
targets of the shapes file (``--shapes FILE``, default the default file), prints the table,
and with ``--json`` writes the record with the new ``target``, ``bf16_within``, ``targets``,
``shapes_file`` and ``peer_within``, and ``judged`` (``date``, ``record``, ``shapes_file``,
``how``, ``unlisted``: rows of the record the file has no shape for, judged by no target);
the run's own fields (times, checks, ``date``, ``kernel_source_hash``) are kept. A changed
target is judged on the times it was not known to, without a GPU.

Exit status: 0 every check of the kernel passed and every target was hit; 1 the kernel
failed its check or raised on a shape, or a target (``target_ms``, a flatness group,
``bf16_within``, ``peer_within``) was missed; 2 a usage error (a bad flag or shapes file, an unknown or
unavailable kernel, an adapter without ``prepare``).
Peers that mismatch or cannot run are reported, not failures.

refattn imports torch lazily, only when the benchmark runs.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import platform
import re
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from refattn.lowp import lowp_of
from refattn.ragged import PerSequence
from refattn.timing import (Call, make_timer, measure_ceilings, probe_torch, time_interleaved,
                            timing_result)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2

FLOP_FORMULA = ("FLOPs = 4 * d * Hq * B * sum_rows(visible keys of the row); row i at position "
                "p = past_len + i sees p + 1 keys, min(p + 1, W) under a window of W keys "
                "(2 FLOPs per multiply-add, d-long q.k and p.v per visible pair); a ragged "
                "batch sums its sequences' own rows: row i of sequence b at p = past_len[b] + i, "
                "its q_len[b] valid rows only")
CHECK_ROWS = 32  # rows per sampled block of the check against the reference
CHECK_METHOD = ("each implementation's output (the prepared launch's read-back, else run()) "
                "against the fp64 reference under refattn.metrics.compare's derived gate (the "
                "bf16 baseline for a bf16 row), on sampled row blocks (the first, a middle and "
                "the last CHECK_ROWS rows; every row of a shorter chunk): the reference of rows "
                "[i, i+r) is that of the chunk q[:, i:i+r] at past_len + i over the cache cut to "
                "past_len + i + r keys; a ragged batch: those blocks of each sequence's valid "
                "rows against the reference of that sequence alone, and every padded row "
                "exactly 0")
MIN_REPS = 20
DEFAULT_REPS, DEFAULT_WARMUP = 30, 5
DEFAULT_ROUNDS = 10
DEFAULT_PEERS = ("sdpa", "cudnn", "flex", "fa4")
MODES = ("sink", "nosink")
DTYPES = ("fp16", "bf16")  # what a shapes file's dtypes may list
BF16_SUFFIX = "-bf16"  # the name of a shape's bf16 row: its name and this
SHAPES_FILE = Path("benchmarks") / "shapes.toml"


class ShapesError(ValueError):
    """A shapes file or a ``--shapes`` value that cannot be used; the message says where."""


# --------------------------------------------------------------------------- shapes

_NAME_RE = re.compile(r"(?P<family>[a-z0-9]+)-(?P<sq>\d+)@(?P<past>\d+)(?:-w(?P<w>\d+))?\Z")
_FAMILY_RE = re.compile(r"[a-z0-9]+\Z")
_RAGGED_NAME_RE = re.compile(r"[a-z0-9][a-z0-9.@-]*")  # fullmatch


def visible_pairs(sq: int, past_len: int, window: int) -> int:
    """Sum over the rows of a chunk of the keys each sees (closed form): row i at position
    p = past_len + i sees p + 1 keys, min(p + 1, W) under a window of W keys."""
    p0, p1 = past_len, past_len + sq - 1
    if window < 0:
        return (p0 + 1 + p1 + 1) * sq // 2
    k = max(0, min(p1, window - 1) - p0 + 1)  # rows with p + 1 <= W
    return (p0 + 1 + p0 + k) * k // 2 + (sq - k) * window


@dataclass(frozen=True)
class Family:
    """A head geometry: ``B``, ``Hq`` query heads over ``Hkv`` KV heads, head dim ``d``."""

    name: str
    B: int
    Hq: int
    Hkv: int
    d: int
    sink: bool = False
    why: str = ""


@dataclass(frozen=True)
class Shape(PerSequence):
    """One prefill call: ``q (B, Sq, Hq, d)``, ``k, v (B, Hkv, skv, d)``, skv = past_len + Sq.
    A ragged shape (``past_len`` a tuple of B ints, ``q_len`` None or B ints) is named by
    ``label``; its skv is the longest sequence's ``past_len[b] + q_len[b]``."""

    family: str
    B: int
    Hq: int
    Hkv: int
    d: int
    sq: int
    past_len: int | tuple[int, ...] = 0
    window: int = -1  # -1: causal only; W >= 1: W keys visible, self included
    sink: bool = False
    target_ms: float | None = None
    why: str = ""
    q_len: tuple[int, ...] | None = None  # valid query rows per sequence (ragged); None: sq each
    label: str = ""  # a ragged shape's name ([[ragged]] name)
    dtype: str = "fp16"  # "fp16" | "bf16"
    bf16_within: float | None = None  # a bf16 row's target: at most this times its fp16 row's time

    @property
    def fp16_name(self) -> str:
        """The name of the shape's fp16 row: ``FAMILY-SQ@PAST[-wW]``, or a ragged shape's label."""
        if self.label:
            return self.label
        w = f"-w{self.window}" if self.window > 0 else ""
        return f"{self.family}-{self.sq}@{self.past_len}{w}"

    @property
    def name(self) -> str:
        return self.fp16_name + (BF16_SUFFIX if self.dtype == "bf16" else "")

    @property
    def geometry(self) -> dict:
        return {"B": self.B, "Hq": self.Hq, "Hkv": self.Hkv, "d": self.d}

    @property
    def skv(self) -> int:
        if self.ragged:
            return max(p + n for p, n in zip(self.past_lens, self.q_lens))
        return self.past_len + self.sq

    @property
    def modes(self) -> tuple[str, ...]:
        """The sink modes it runs in: ("sink", "nosink") with a sink, else ("nosink",)."""
        return MODES if self.sink else ("nosink",)

    @property
    def main_mode(self) -> str:
        return self.modes[0]

    def flops(self) -> float:
        """Useful FLOPs (module docstring): a ragged shape's sequences each count their own."""
        if self.ragged:
            pairs = sum(visible_pairs(n, p, self.window) for p, n in zip(self.past_lens, self.q_lens) if n)
            return 4.0 * self.d * self.Hq * pairs
        return 4.0 * self.d * self.Hq * self.B * visible_pairs(self.sq, self.past_len, self.window)

    def case(self, sink: bool):
        """The shape as a :class:`refattn.cases.Case` (its dtype, seed 0), with or without the sink."""
        from refattn.cases import Case

        return Case(name=self.name.replace("@", "-at-") + ("" if sink else "-nosink"), suite="bench",
                    Hq=self.Hq, Hkv=self.Hkv, d=self.d, sq=self.sq, B=self.B, past_len=self.past_len,
                    q_len=self.q_len, window=self.window, sink="per_head" if sink else "none",
                    dtype=self.dtype, why=self.why or f"refattn bench shape {self.name}")

    def to_dict(self) -> dict:
        past = list(self.past_len) if isinstance(self.past_len, tuple) else self.past_len
        return {"name": self.name, "family": self.family, **self.geometry, "sq": self.sq,
                "past_len": past, "q_len": None if self.q_len is None else list(self.q_len),
                "skv": self.skv, "window": self.window, "sink": self.sink, "dtype": self.dtype,
                "ragged": self.ragged}


@dataclass
class FlatGroup:
    shapes: list[str]
    limit: float
    why: str = ""


@dataclass(frozen=True)
class PeerWithin:
    """``[peer_within]``: the kernel's time on every row at most ``factor`` times ``peer``'s."""

    peer: str
    factor: float
    why: str = ""

    def to_dict(self) -> dict:
        return {"peer": self.peer, "factor": self.factor, "why": self.why}


@dataclass
class ShapeSpec:
    """A loaded shapes file."""

    path: Path
    description: str = ""
    families: dict[str, Family] = field(default_factory=dict)
    shapes: list[Shape] = field(default_factory=list)  # every row: each shape once per dtype
    flat: list[FlatGroup] = field(default_factory=list)
    dtypes: tuple[str, ...] = ("fp16",)
    bf16_within: float | None = None
    peer_within: PeerWithin | None = None

    def by_name(self) -> dict[str, Shape]:
        return {s.name: s for s in self.shapes}


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_keys(where: str, table: dict, known: tuple[str, ...], required: tuple[str, ...]) -> None:
    for key in table:
        if key not in known:
            raise ShapesError(f"{where}: {key}: unknown key (known: {', '.join(known)})")
    for key in required:
        if key not in table:
            raise ShapesError(f"{where}: {key}: required key is missing")


def _int(where: str, key: str, x, lo: int) -> int:
    if not _is_int(x) or x < lo:
        raise ShapesError(f"{where}: {key}: expected an integer >= {lo}, got {x!r}")
    return int(x)


def _bool(where: str, key: str, x) -> bool:
    if not isinstance(x, bool):
        raise ShapesError(f"{where}: {key}: expected true or false, got {x!r}")
    return x


def _str(where: str, key: str, x) -> str:
    if not isinstance(x, str):
        raise ShapesError(f"{where}: {key}: expected a string, got {x!r}")
    return x


def _window(where: str, x) -> int:
    if not _is_int(x) or x == 0 or x < -1:
        raise ShapesError(f"{where}: window: expected -1 (no window) or W >= 1 keys, got {x!r}")
    return int(x)


def _target(where: str, t: dict) -> float | None:
    target = t.get("target_ms")
    if target is not None and (not _is_num(target) or target <= 0):
        raise ShapesError(f"{where}: target_ms: expected a number of ms > 0, got {target!r}")
    return None if target is None else float(target)


def _family_of(where: str, t: dict, spec: "ShapeSpec") -> Family:
    fam = spec.families.get(t["family"]) if isinstance(t["family"], str) else None
    if fam is None:
        raise ShapesError(f"{where}: family: unknown family {t['family']!r} (have "
                          f"{', '.join(spec.families)})")
    return fam


def _lengths(where: str, key: str, x, n: int | None, hi: int | None) -> tuple[int, ...]:
    """A list of per-sequence lengths: ``n`` entries (any number >= 1 when None), each an
    integer >= 0 (<= ``hi`` when given)."""
    if not isinstance(x, list) or not x:
        raise ShapesError(f"{where}: {key}: expected a list of one integer per sequence, got {x!r}")
    if n is not None and len(x) != n:
        raise ShapesError(f"{where}: {key}: expected one entry per sequence (B = {n} from "
                          f"past_len), got {len(x)}")
    for b, v in enumerate(x):
        if not _is_int(v) or v < 0 or (hi is not None and v > hi):
            want = "an integer >= 0" if hi is None else f"an integer in [0, sq = {hi}]"
            raise ShapesError(f"{where}: {key}[{b}]: expected {want}, got {v!r}")
    return tuple(int(v) for v in x)


def _ragged_shape(where: str, t: dict, spec: "ShapeSpec") -> Shape:
    """A ``[[ragged]]`` table (module docstring, "Ragged shapes")."""
    _check_keys(where, t, _RAGGED_KEYS, ("name", "family", "past_len", "sq"))
    name = t["name"]
    if not isinstance(name, str) or not _RAGGED_NAME_RE.fullmatch(name):
        raise ShapesError(f"{where}: name: expected a string matching ^{_RAGGED_NAME_RE.pattern}$, "
                          f"got {name!r}")
    if _NAME_RE.match(name):
        raise ShapesError(f"{where}: name: {name!r} has the form FAMILY-SQ@PAST[-wW] of a "
                          f"uniform shape; name a ragged shape otherwise")
    if name.endswith(BF16_SUFFIX):
        raise ShapesError(f"{where}: name: {name!r} ends in {BF16_SUFFIX}, the suffix of a bf16 row "
                          f"(dtypes makes those)")
    where = f"{where} ({name})"
    fam = _family_of(where, t, spec)
    sq = _int(where, "sq", t["sq"], 1)
    past = _lengths(where, "past_len", t["past_len"], None, None)
    q_len = None
    if "q_len" in t:
        q_len = _lengths(where, "q_len", t["q_len"], len(past), sq)
        if not any(q_len):
            raise ShapesError(f"{where}: q_len: every sequence has 0 rows: nothing to bench")
    return Shape(fam.name, len(past), fam.Hq, fam.Hkv, fam.d, sq=sq, past_len=past,
                 window=_window(where, t.get("window", -1)),
                 sink=_bool(where, "sink", t.get("sink", fam.sink)), target_ms=_target(where, t),
                 why=_str(where, "why", t.get("why", "")), q_len=q_len, label=name)


def _dtypes(where: str, doc: dict) -> tuple[tuple[str, ...], float | None]:
    """The file's ``dtypes`` and ``bf16_within``."""
    x = doc.get("dtypes", ["fp16"])
    if not isinstance(x, list) or not x or not all(isinstance(d, str) for d in x):
        raise ShapesError(f"{where}: dtypes: expected a non-empty list of "
                          f"{' and/or '.join(map(repr, DTYPES))}, got {x!r}")
    for d in x:
        if d not in DTYPES:
            raise ShapesError(f"{where}: dtypes: {d!r} is not one of {', '.join(map(repr, DTYPES))}")
        if x.count(d) > 1:
            raise ShapesError(f"{where}: dtypes: {d!r} is listed twice")
    within = doc.get("bf16_within")
    if within is not None:
        if not _is_num(within) or within <= 0:
            raise ShapesError(f"{where}: bf16_within: expected a number > 0 (bf16 time / fp16 "
                              f"time), got {within!r}")
        if set(x) != set(DTYPES):
            raise ShapesError(f"{where}: bf16_within: needs both 'fp16' and 'bf16' in dtypes "
                              f"(have {', '.join(map(repr, x))})")
        within = float(within)
    return tuple(x), within


def _peer_within(where: str, doc: dict) -> PeerWithin | None:
    """The file's ``[peer_within]`` table, or None."""
    t = doc.get("peer_within")
    if t is None:
        return None
    where = f"{where}: peer_within"
    if not isinstance(t, dict):
        raise ShapesError(f"{where}: expected a table [peer_within] (peer, factor, why), got {t!r}")
    _check_keys(where, t, _PEER_WITHIN_KEYS, ("peer", "factor"))
    peer = t["peer"]
    if not isinstance(peer, str) or not peer.strip():
        raise ShapesError(f"{where}: peer: expected a peer's name (e.g. \"fa4\"), got {peer!r}")
    factor = t["factor"]
    if not _is_num(factor) or factor <= 0:
        raise ShapesError(f"{where}: factor: expected a number > 0 (kernel time / peer time), "
                          f"got {factor!r}")
    return PeerWithin(peer.strip(), float(factor), _str(where, "why", t.get("why", "")))


_TOP_KEYS = ("description", "dtypes", "bf16_within", "peer_within", "families", "shape", "ragged",
             "flat")
_PEER_WITHIN_KEYS = ("peer", "factor", "why")
_FAMILY_KEYS = ("B", "Hq", "Hkv", "d", "sink", "why")
_SHAPE_KEYS = ("family", "sq", "past_len", "window", "sink", "target_ms", "why")
_RAGGED_KEYS = ("name", "family", "past_len", "q_len", "sq", "window", "sink", "target_ms", "why")
_FLAT_KEYS = ("shapes", "limit", "why")


def _tables(path: Path, doc: dict, key: str) -> list[dict]:
    tables = doc.get(key, [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise ShapesError(f"{path}: {key}: expected [[{key}]] tables")
    return tables


def load_shapes(path) -> ShapeSpec:
    """Read and validate a shapes file (module docstring, "Shapes file"); :class:`ShapesError`
    naming the file, the entry and the key otherwise."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise ShapesError(f"{path}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ShapesError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ShapesError(f"{path}: not valid TOML: {e}") from None
    _check_keys(str(path), doc, _TOP_KEYS, ("families",))
    dtypes, within = _dtypes(str(path), doc)
    spec = ShapeSpec(path, description=_str(str(path), "description", doc.get("description", "")),
                     dtypes=dtypes, bf16_within=within,
                     peer_within=_peer_within(str(path), doc))
    fams = doc["families"]
    if not isinstance(fams, dict) or not fams:
        raise ShapesError(f"{path}: families: expected tables [families.NAME], got {fams!r}")
    for name, t in fams.items():
        where = f"{path}: families.{name}"
        if not _FAMILY_RE.match(name):
            raise ShapesError(f"{where}: a family name is lower-case letters and digits only")
        if not isinstance(t, dict):
            raise ShapesError(f"{where}: expected a table, got {t!r}")
        _check_keys(where, t, _FAMILY_KEYS, ("Hq", "Hkv", "d"))
        fam = Family(name, B=_int(where, "B", t.get("B", 1), 1), Hq=_int(where, "Hq", t["Hq"], 1),
                     Hkv=_int(where, "Hkv", t["Hkv"], 1), d=_int(where, "d", t["d"], 1),
                     sink=_bool(where, "sink", t.get("sink", False)), why=_str(where, "why", t.get("why", "")))
        if fam.Hq % fam.Hkv:
            raise ShapesError(f"{where}: Hkv: Hq={fam.Hq} is not a multiple of Hkv={fam.Hkv}")
        spec.families[name] = fam
    tables, ragged = _tables(path, doc, "shape"), _tables(path, doc, "ragged")
    if not tables and not ragged:
        raise ShapesError(f"{path}: shape: expected one or more [[shape]] tables (or [[ragged]] tables)")
    shapes: list[tuple[str, Shape]] = []
    for i, t in enumerate(tables):
        where = f"{path}: shape #{i + 1}"
        _check_keys(where, t, _SHAPE_KEYS, ("family", "sq"))
        fam = _family_of(where, t, spec)
        shapes.append((where, Shape(
            fam.name, fam.B, fam.Hq, fam.Hkv, fam.d, sq=_int(where, "sq", t["sq"], 1),
            past_len=_int(where, "past_len", t.get("past_len", 0), 0),
            window=_window(where, t.get("window", -1)),
            sink=_bool(where, "sink", t.get("sink", fam.sink)),
            target_ms=_target(where, t), why=_str(where, "why", t.get("why", "")))))
    for i, t in enumerate(ragged):
        where = f"{path}: ragged #{i + 1}"
        shapes.append((where, _ragged_shape(where, t, spec)))
    seen = set()
    for where, s in shapes:
        if s.name in seen:
            raise ShapesError(f"{where} ({s.name}): a shape of this name is listed already")
        seen.add(s.name)
        for dtype in dtypes:  # each shape's rows side by side
            spec.shapes.append(s if dtype == "fp16" else
                               replace(s, dtype=dtype, target_ms=None, bf16_within=within))
    names = {s.name for s in spec.shapes}
    for i, t in enumerate(_tables(path, doc, "flat")):
        where = f"{path}: flat #{i + 1}"
        _check_keys(where, t, _FLAT_KEYS, ("shapes", "limit"))
        group = t["shapes"]
        if not isinstance(group, list) or len(group) < 2 or not all(isinstance(n, str) for n in group):
            raise ShapesError(f"{where}: shapes: expected a list of two or more shape names, got {group!r}")
        missing = [n for n in group if n not in names]
        if missing:
            raise ShapesError(f"{where}: shapes: {missing[0]!r} is not a shape of this file")
        limit = t["limit"]
        if not _is_num(limit) or limit < 1:
            raise ShapesError(f"{where}: limit: expected a number >= 1 (max / min), got {limit!r}")
        spec.flat.append(FlatGroup(list(group), float(limit), _str(where, "why", t.get("why", ""))))
    return spec


def shapes_file_candidates() -> list[Path]:
    """Where the default shapes file is looked for: beside the refattn package's source tree,
    then under the working directory."""
    from refattn.kernels import SOURCE_ROOT

    out = [SOURCE_ROOT / SHAPES_FILE, Path.cwd() / SHAPES_FILE]
    return list(dict.fromkeys(p.resolve() for p in out))


def default_shapes_path() -> Path:
    """The default shapes file; :class:`ShapesError` saying where it looked when there is none."""
    candidates = shapes_file_candidates()
    for p in candidates:
        if p.is_file():
            return p
    raise ShapesError("no shapes file: looked for " + " and ".join(map(str, candidates))
                      + "; give one with --shapes path/to/shapes.toml")


_DEFAULT_SPEC: dict[Path, ShapeSpec] = {}


def default_spec() -> ShapeSpec:
    path = default_shapes_path()
    if path not in _DEFAULT_SPEC:
        _DEFAULT_SPEC[path] = load_shapes(path)
    return _DEFAULT_SPEC[path]


def _bf16_row(s: Shape) -> Shape:
    """The bf16 row of a shape that the file does not bench in bf16: no target."""
    return replace(s, dtype="bf16", target_ms=None, bf16_within=None)


def parse_shape(name: str, spec: ShapeSpec | None = None) -> Shape:
    """A shape name -> :class:`Shape`: a row of ``spec`` (default: the default shapes file) by
    name (its bf16 and ragged rows included), else ``FAMILY-SQ@PAST[-wW][-bf16]`` of one of
    its families (the family's sink, no target; the bf16 row of a shape of the file keeps its
    sink). ValueError (:class:`ShapesError`) saying what is wrong."""
    spec = spec or default_spec()
    text = name.strip() if isinstance(name, str) else ""
    rows = spec.by_name()
    if text in rows:
        return rows[text]
    bf16 = text.endswith(BF16_SUFFIX)
    base = text.removesuffix(BF16_SUFFIX)
    if bf16 and base in rows:
        return _bf16_row(rows[base])
    m = _NAME_RE.match(base)
    if not m:
        raise ShapesError(f"{name!r} is not a shape name (expected FAMILY-SQ@PAST[-wW][-bf16], e.g. "
                          f"gptoss-512@8192-w128, or a shape of the file)")
    fam = spec.families.get(m["family"])
    if fam is None:
        raise ShapesError(f"{name!r}: unknown family {m['family']!r} (have {', '.join(spec.families)} "
                          f"in {spec.path})")
    sq, past = int(m["sq"]), int(m["past"])
    if sq < 1:
        raise ShapesError(f"{name!r}: Sq must be >= 1")
    window = -1
    if m["w"] is not None:
        window = int(m["w"])
        if window < 1:
            raise ShapesError(f"{name!r}: the window must be W >= 1 keys")
    s = Shape(fam.name, fam.B, fam.Hq, fam.Hkv, fam.d, sq=sq, past_len=past, window=window, sink=fam.sink,
              dtype="bf16" if bf16 else "fp16")
    if s.name in rows:  # the same shape spelt otherwise (gptoss-0512@8192)
        return rows[s.name]
    if bf16 and s.fp16_name in rows:
        return _bf16_row(rows[s.fp16_name])
    return s


def resolve_shapes(text: str | None) -> tuple[ShapeSpec, list[Shape]]:
    """``--shapes``: a ``.toml`` file (all its shapes), or comma-separated names of the default
    file (shape names, bf16 and ragged rows included, family names, ``all``, any
    ``FAMILY-SQ@PAST[-wW][-bf16]`` of its families); None: every shape of the default file.
    Duplicates are dropped, order kept."""
    if text is None:
        spec = default_spec()
        return spec, list(spec.shapes)
    text = text.strip()
    if text.endswith(".toml") or (text and Path(text).is_file()):
        spec = load_shapes(text)
        return spec, list(spec.shapes)
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ShapesError("expected a shapes file (.toml) or a comma-separated list of shape names")
    spec = default_spec()
    out: dict[str, Shape] = {}
    for item in items:
        if item == "all":
            picked = spec.shapes
        elif item in spec.families:
            picked = [s for s in spec.shapes if s.family == item]
        else:
            try:
                picked = [parse_shape(item, spec)]
            except ShapesError as e:
                raise ShapesError(f"{e}; the shapes of {spec.path} are "
                                  f"{', '.join(s.name for s in spec.shapes)}") from None
        for s in picked:
            out.setdefault(s.name, s)
    return spec, list(out.values())


# --------------------------------------------------------------------------- implementations

@dataclass
class Impl:
    """One implementation of a run: an adapter, its role, whether it can run here."""

    name: str
    adapter: object
    role: str  # "kernel" | "peer"
    available: bool = True
    reason: str = ""
    source_hash: str | None = None
    sync: object = None  # set by the run (the adapter's synchronize, or a stand-in)


def parse_peer_list(text: str) -> list[str]:
    """``--peers``: comma-separated names, or ``none``. Short names are lower-cased."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if [i.lower() for i in items] == ["none"]:
        return []
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list of peers (sdpa, cudnn, "
                                         "flex, fa4, a registered kernel or package.module:Class), "
                                         "or none")
    return list(dict.fromkeys(i.lower() if i.lower() in _short_peers() else i for i in items))


def _short_peers() -> dict[str, str]:
    from refattn.adapters.torch_peers import PEERS

    return PEERS


def _missing_member(role: str, spec: str, adapter) -> None:
    from refattn.cli import UsageError

    if not callable(getattr(adapter, "prepare", None)):
        raise UsageError(f"--{role} {spec}: the adapter {getattr(adapter, 'name', spec)!r} has no "
                         f"prepare() member (refattn bench times the device-resident launch "
                         f"prepare(inputs) returns)")


def resolve_kernel(spec: str):
    """The adapter under test; UsageError (exit 2) when it has no ``prepare``."""
    from refattn.kernels import get_kernel

    adapter = get_kernel(spec)
    _missing_member("kernel", spec, adapter)
    return adapter


def resolve_peer(spec: str):
    """A peer's adapter: a short name of :mod:`refattn.adapters.torch_peers`, a registered kernel, or an
    import path. KernelError for an unknown one, UsageError without ``prepare``."""
    from refattn.kernels import KernelError, get_kernel

    target = _short_peers().get(spec.lower(), spec)
    try:
        adapter = get_kernel(target)
    except KernelError as e:
        raise KernelError(f"kernel: --peers: cannot use {spec!r} (the short names are "
                          f"{', '.join(_short_peers())}; or a registered kernel, or an import path "
                          f"package.module:Class): {str(e).removeprefix('kernel: ')}") from None
    _missing_member("peers", spec, adapter)
    return adapter


# --------------------------------------------------------------------------- the check

def check_row_blocks(sq: int, rows: int = CHECK_ROWS) -> list[tuple[int, int]]:
    """The row blocks ``[start, stop)`` the check compares: the first, a middle and the last
    ``rows`` rows, or every row when the chunk has at most three blocks of them."""
    if sq <= 3 * rows:
        return [(0, sq)]
    mid = (sq - rows) // 2
    return [(0, rows), (mid, mid + rows), (sq - rows, sq)]


def ragged_row_blocks(q_lens, rows: int = CHECK_ROWS) -> list[tuple[int, int, int]]:
    """The row blocks ``(b, start, stop)`` the check compares in a ragged batch: those of
    :func:`check_row_blocks` over each sequence's ``q_lens[b]`` valid rows (none for an empty
    sequence)."""
    return [(b, i0, i1) for b, n in enumerate(q_lens) if n > 0 for i0, i1 in check_row_blocks(n, rows)]


def check_blocks(shape: Shape) -> list[tuple[int, ...]]:
    """The check's blocks of ``shape``: ``(start, stop)`` over every sequence, or for a ragged
    shape ``(b, start, stop)`` of sequence b."""
    return ragged_row_blocks(shape.q_lens) if shape.ragged else check_row_blocks(shape.sq)


def bench_inputs(case):
    """``make_inputs(case)``, read-only. For a ragged case the NaN canaries in every cache slot
    at or past a sequence's own length and in its padded query rows are zeros instead (module
    docstring, "Checked before timed": what the bench times must be finite wherever an
    implementation may load)."""
    from refattn.cases import make_inputs

    x = make_inputs(case)
    if case.ragged:
        for b, (n, end) in enumerate(zip(case.q_lens, case.seq_lens)):
            x.k[b, :, end:] = 0
            x.v[b, :, end:] = 0
            x.q[b, n:] = 0
    for a in (x.q, x.k, x.v, x.sink, x.past_len, x.q_len):
        if isinstance(a, np.ndarray):
            a.flags.writeable = False
    return x


def sampled_reference(inputs, blocks) -> tuple[np.ndarray, np.ndarray]:
    """The fp64 reference and the low-precision baseline (of the inputs' dtype) of the rows
    in ``blocks`` of ``inputs``, concatenated along the row axis: each block [i, i + r)
    computed as the chunk ``q[:, i:i+r]`` at ``past_len + i`` over the cache cut to
    ``past_len + i + r`` keys. A ragged batch's blocks ``(b, i, i + r)`` are of sequence b
    alone (``q[b:b+1, i:i+r]`` at ``past_len[b] + i``, the uniform call over its own cache),
    so its result has one sequence: ``(1, rows, Hq, d)``."""
    from refattn.reference import attention_with_baseline

    kw = inputs.reference_kwargs()
    del kw["past_len"], kw["q_len"]
    refs, bases = [], []
    for block in blocks:
        if inputs.ragged:
            b, i0, i1 = block
            seqs, past = slice(b, b + 1), int(inputs.past_len[b])
        else:
            (i0, i1), seqs, past = block, slice(None), inputs.past_len
        ref, base = attention_with_baseline(
            np.ascontiguousarray(inputs.q[seqs, i0:i1]), inputs.k[seqs, :, :past + i1],
            inputs.v[seqs, :, :past + i1], past_len=past + i0, lowp=lowp_of(inputs.dtype), **kw)
        refs.append(ref)
        bases.append(base)
    return np.concatenate(refs, axis=1), np.concatenate(bases, axis=1)


def judge_output(out, expected_shape, blocks, ref, base, *, lowp: str = "fp16",
                 q_len=None) -> dict:
    """The check's verdict on ``out`` (the whole output): ``{"passed", "rel_l2", "gate_rel_l2",
    "max_abs", "gate_max_abs", "n_nan", "n_inf", "reason"}``, the gate's baseline in ``lowp``.
    With ``q_len`` (a ragged batch; ``blocks`` then ``(b, start, stop)``) also
    ``"padded_nonzero"``: the elements of padded rows (``i >= q_len[b]``) that are not
    exactly 0, any one of which fails it."""
    from refattn.metrics import compare

    a = np.asarray(out)
    if a.shape != tuple(expected_shape):
        return {"passed": False, "rel_l2": None, "gate_rel_l2": None, "max_abs": None,
                "gate_max_abs": None, "n_nan": None, "n_inf": None,
                "reason": f"output shape {a.shape}, expected {tuple(expected_shape)}"}
    if q_len is None:
        rows = np.concatenate([a[:, i0:i1] for i0, i1 in blocks], axis=1)
    else:
        rows = np.concatenate([a[b:b + 1, i0:i1] for b, i0, i1 in blocks], axis=1)
    c = compare(rows, ref, base, lowp=lowp)
    fin = lambda x: None if x is None or not math.isfinite(x) else float(x)  # noqa: E731
    res = {"passed": bool(c.passed), "rel_l2": fin(c.rel_l2), "gate_rel_l2": fin(c.gate_rel_l2),
           "max_abs": fin(c.max_abs), "gate_max_abs": fin(c.gate_max_abs), "n_nan": c.n_nan,
           "n_inf": c.n_inf, "reason": ""}
    reasons = [] if c.passed else ["does not match the fp64 reference: " + c.summary()]
    if q_len is not None:
        bad = [(b, int(n), int(np.count_nonzero(a[b, n:] != 0))) for b, n in enumerate(q_len)]
        bad = [x for x in bad if x[2]]
        res["padded_nonzero"] = sum(x[2] for x in bad)
        if bad:
            res["passed"] = False
            reasons.append(f"padded rows (i >= q_len[b]) are not 0: {res['padded_nonzero']} "
                           f"elements, in sequence {', '.join(str(b) for b, _, _ in bad)}")
    res["reason"] = "; ".join(reasons)
    return res


# --------------------------------------------------------------------------- results (pure)

def mode_result(status: str, *, reason: str = "", variant: str = "", check: dict | None = None,
                checked: str = "") -> dict:
    """One implementation in one sink mode on one shape. ``status``: ``ok`` (passed the check;
    ``ms`` once timed), ``mismatch`` (failed it: not timed), ``n/a`` (not supported, not
    available, or it raised: ``reason``)."""
    c = check or {}
    return {"status": status, "ms": None, "tflops": None, "n": None, "min_ms": None, "max_ms": None,
            "variant": variant, "rel_l2": c.get("rel_l2"), "gate_rel_l2": c.get("gate_rel_l2"),
            "max_abs": c.get("max_abs"), "gate_max_abs": c.get("gate_max_abs"),
            "checked": checked, "reason": reason}


def timed(results: dict, mode: str) -> float | None:
    """The ms of ``results[mode]`` when it was timed (status ok), else None."""
    r = (results or {}).get(mode) or {}
    return r.get("ms") if r.get("status") == "ok" else None


def best_peer(results: dict) -> tuple[str, str] | None:
    """(name, mode) of the fastest timed peer, or None."""
    best = None
    for name, entry in results.items():
        if entry.get("role") != "peer":
            continue
        for mode in MODES:
            ms = timed(entry, mode)
            if ms is not None and (best is None or ms < best[2]):
                best = (name, mode, ms)
    return None if best is None else best[:2]


def shape_row(shape: Shape, results: dict, kernel: str, *, blocks=None, error: str | None = None) -> dict:
    """One row of the report: ``results`` (name -> ``{"role", "sink", "nosink"}``), the best
    peer, the ratio kernel / best peer with the kernel in the best peer's mode, the target
    judged on the kernel in the shape's own mode."""
    target, within = row_targets(shape, results.get(kernel) or {})
    return {"name": shape.name, "geometry": shape.to_dict(), "flops": shape.flops(),
            "check_rows": [list(b) for b in (blocks or [])], "results": results,
            "kernel_error": error, **peer_ratio(results, kernel), "target": target,
            "bf16_within": within}


def peer_ratio(results: dict, kernel: str) -> dict:
    """A row's ``best_peer``, ``best_peer_mode``, ``best_peer_ms``, and ``ratio`` = the
    kernel's time / the best peer's, with the kernel in the best peer's mode
    (``ratio_basis``)."""
    bp = best_peer(results)
    ratio = basis = best_ms = None
    if bp is not None:
        best_ms = timed(results[bp[0]], bp[1])
        basis = "sink" if bp[1] == "sink" else "no sink"
        mine = timed(results.get(kernel) or {}, bp[1])
        if mine is not None:
            ratio = mine / best_ms
    return {"best_peer": None if bp is None else bp[0], "best_peer_mode": None if bp is None else bp[1],
            "best_peer_ms": best_ms, "ratio": ratio, "ratio_basis": basis}


def row_targets(shape: Shape, kernel_results: dict) -> tuple[dict | None, dict | None]:
    """A row's ``target`` (``target_ms`` judged on the kernel's results in the shape's own
    mode) and ``bf16_within`` (what judge_targets judges it by, with the fp16 row's time)."""
    target = None
    if shape.target_ms is not None:
        ms = timed(kernel_results, shape.main_mode)
        target = {"ms": shape.target_ms, "mode": shape.main_mode, "measured_ms": ms,
                  "ratio": None if ms is None else ms / shape.target_ms,
                  "hit": None if ms is None else ms <= shape.target_ms}
    within = None
    if shape.bf16_within is not None:
        within = {"factor": shape.bf16_within, "mode": shape.main_mode, "fp16_shape": shape.fp16_name}
    return target, within


def judge_targets(rows: list[dict], flat: list[FlatGroup], kernel: str,
                  peer_within: PeerWithin | None = None) -> dict:
    """Target verdicts: per-shape hits and misses (``target_ms``), each flatness group (max /
    min of the kernel's times in the shapes' own mode <= its limit; None when a shape was not
    timed), each bf16 row's ``bf16_within`` (its time / its fp16 row's, both in the
    shape's own mode, <= the factor; None when either was not timed or the fp16 row not run),
    and with ``peer_within`` every row's time against the peer's (both in the shape's own
    mode, <= the factor; None when either was not timed)."""
    judged = [r for r in rows if r.get("target") and r["target"]["hit"] is not None]
    out = {"hits": [r["name"] for r in judged if r["target"]["hit"]],
           "misses": [r["name"] for r in judged if not r["target"]["hit"]],
           "untimed": [r["name"] for r in rows if r.get("target") and r["target"]["hit"] is None],
           "flat": [], "bf16_within": [], "peer_within": []}
    for r in rows if peer_within else ():
        mode = "sink" if r["geometry"].get("sink") else "nosink"
        mine = timed(r["results"].get(kernel), mode)
        theirs = timed(r["results"].get(peer_within.peer), mode)
        ratio = mine / theirs if mine is not None and theirs else None
        out["peer_within"].append({"shape": r["name"], "peer": peer_within.peer,
                                   "factor": peer_within.factor, "mode": mode, "kernel_ms": mine,
                                   "peer_ms": theirs, "ratio": ratio,
                                   "hit": None if ratio is None else ratio <= peer_within.factor})
    by_name = {r["name"]: r for r in rows}
    for r in rows:
        w = r.get("bf16_within")
        if not w:
            continue
        fp16 = by_name.get(w["fp16_shape"])
        mine = timed(r["results"].get(kernel), w["mode"])
        theirs = timed(fp16["results"].get(kernel), w["mode"]) if fp16 else None
        ratio = mine / theirs if mine is not None and theirs else None
        out["bf16_within"].append({"shape": r["name"], "fp16_shape": w["fp16_shape"],
                                   "factor": w["factor"], "mode": w["mode"], "bf16_ms": mine,
                                   "fp16_ms": theirs, "ratio": ratio,
                                   "hit": None if ratio is None else ratio <= w["factor"]})
    for g in flat:
        ms = []
        for n in g.shapes:
            r = by_name.get(n)
            mode = "sink" if r and r["geometry"].get("sink") else "nosink"
            ms.append(timed(r["results"].get(kernel), mode) if r else None)
        entry = {"shapes": list(g.shapes), "ms": ms, "limit": g.limit, "spread": None, "hit": None,
                 "why": g.why}
        if all(m is not None for m in ms) and any(n in by_name for n in g.shapes):
            entry["spread"] = max(ms) / min(ms)
            entry["hit"] = entry["spread"] <= g.limit
        if any(n in by_name for n in g.shapes):
            out["flat"].append(entry)
    return out


def body_ok(rows: list[dict]) -> bool:
    """The run failed when the kernel under test failed its check or raised on a shape."""
    return all(not r.get("kernel_error") for r in rows)


def targets_missed(targets: dict) -> bool:
    return (bool(targets["misses"]) or any(f["hit"] is False for f in targets["flat"])
            or any(w["hit"] is False for w in targets["bf16_within"])
            or any(w["hit"] is False for w in targets.get("peer_within") or ()))


# --------------------------------------------------------------------------- one shape

class Run:
    """What the shapes of one run share: the implementations, the timer and its settings."""

    def __init__(self, kernel: Impl, peers: list[Impl], *, timer, warmup: int, reps: int,
                 rounds: int, log=None):
        self.kernel, self.peers = kernel, peers
        self.timer, self.warmup, self.reps, self.rounds = timer, warmup, reps, rounds
        self.log = log

    def say(self, msg: str) -> None:
        if self.log:
            self.log(msg)

    @property
    def impls(self) -> list[Impl]:
        return [self.kernel, *self.peers]


def _short(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first}"[:300]


def _unsupported(adapter, case) -> str:
    fn = getattr(adapter, "unsupported_reason", None)
    why = None
    if callable(fn):
        try:
            why = fn(case)
        except Exception:  # noqa: BLE001 - only a nicer message
            why = None
    return why or "supports(case) is False"


RAGGED_DECLINE = ("not run: a ragged batch, and the adapter does not declare ragged = True "
                  "(docs/adapters.md)")


def _plan(impl: Impl, shape: Shape, cases: dict) -> tuple[list[str], dict]:
    """The modes ``impl`` runs on ``shape`` and the n/a results of those it does not."""
    results = {}
    supported = []
    for mode in shape.modes:
        if shape.ragged and not getattr(impl.adapter, "ragged", False):
            # as in refattn run: an adapter written for one past_len is never given a ragged batch
            results[mode] = mode_result("n/a", reason=RAGGED_DECLINE)
            continue
        try:
            ok = bool(impl.adapter.supports(cases[mode]))
        except Exception as e:  # noqa: BLE001
            ok, results[mode] = False, mode_result("n/a", reason=f"supports() raised {_short(e)}")
        if ok:
            supported.append(mode)
        elif mode not in results:
            results[mode] = mode_result("n/a", reason=_unsupported(impl.adapter, cases[mode]))
    if impl.role == "peer":  # one mode: the first it supports (module docstring)
        supported = supported[:1]
        if supported:
            results = {}
        else:  # said once, under the no-sink mode every shape has
            reasons = [results[m]["reason"] for m in shape.modes]
            why = list(dict.fromkeys(f"{m}: {r}" if len(set(reasons)) > 1 else r
                                     for m, r in zip(shape.modes, reasons)))
            results = {"nosink": mode_result("n/a", reason="; ".join(why))}
    return supported, results


def _prepare_and_check(run: Run, impl: Impl, inputs, blocks, ref_base):
    """``(prepared or None, result)``: prepared, launched once, read back, judged."""
    p = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            p = impl.adapter.prepare(inputs)
            if not callable(p):
                raise TypeError(f"prepare() returned {type(p).__name__}, not a callable")
            p()  # the first call: autotune / compile, untimed
            impl.sync()
            output = getattr(p, "output", None)
            if callable(output):
                out, checked = output(), "prepared launch"
            else:
                status, out = impl.adapter.run(replace(inputs, out=inputs.fresh_out()))
                checked = "run()"
                if status != 0:
                    raise RuntimeError(f"run() returned status {status} on a case it supports")
        ref, base = ref_base()
        verdict = judge_output(out, inputs.q.shape, blocks, ref, base, lowp=lowp_of(inputs.dtype),
                               q_len=None if inputs.q_len is None else [int(n) for n in inputs.q_len])
    except Exception as e:  # noqa: BLE001 - an implementation's failure is a result
        _close(p)
        run.say(f"  {impl.name}: n/a: {_short(e)}")
        if run.log and impl.role == "kernel":
            run.say(traceback.format_exc())
        return None, mode_result("n/a", reason=_short(e))
    variant = str(getattr(p, "variant", "") or "")
    if not verdict["passed"]:
        _close(p)
        return None, mode_result("mismatch", reason=verdict["reason"], variant=variant,
                                 check=verdict, checked=checked)
    return p, mode_result("ok", variant=variant, check=verdict, checked=checked)


def _close(p) -> None:
    close = getattr(p, "close", None)
    if callable(close):
        try:
            close()
        except Exception:  # noqa: BLE001 - freeing must not hide the result
            pass


def bench_shape(run: Run, shape: Shape, cases: dict | None = None) -> dict:
    """Everything for one shape -> its report row (module docstring): inputs built once,
    each implementation checked against the reference on sampled rows, those that passed
    timed in interleaved rounds."""
    cases = cases or {m: shape.case(m == "sink") for m in shape.modes}
    base = bench_inputs(cases[shape.main_mode])
    inputs = {shape.main_mode: base}
    if shape.main_mode == "sink":
        inputs["nosink"] = replace(base, case=cases["nosink"], sink=None, out=base.fresh_out())
    blocks = check_blocks(shape)
    refs: dict = {}

    def ref_base(mode):
        def get():
            if mode not in refs:
                refs[mode] = sampled_reference(inputs[mode], blocks)
            return refs[mode]
        return get

    results: dict = {}
    attempted: dict = {}  # name -> the modes it was prepared and checked in
    prepared: dict = {}
    calls: dict = {}
    flops = shape.flops()
    try:
        for impl in run.impls:
            entry = {"role": impl.role, "sink": None, "nosink": None}
            results[impl.name] = entry
            modes, na = _plan(impl, shape, cases)
            entry.update(na)
            attempted[impl.name] = modes if impl.available else []
            for mode in modes:
                if not impl.available:
                    entry[mode] = mode_result("n/a", reason=impl.reason or "not available")
                    continue
                run.say(f"  {impl.name} ({mode}): prepare, launch once, check")
                p, res = _prepare_and_check(run, impl, inputs[mode], blocks, ref_base(mode))
                entry[mode] = res
                if p is not None:
                    key = f"{impl.name}|{mode}"
                    prepared[key] = p
                    calls[key] = Call(key, p, impl.sync)
        errors: dict[str, str] = {}
        if calls:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                times = time_interleaved(run.timer, calls, warmup=run.warmup, reps=run.reps,
                                         rounds=run.rounds,
                                         on_error=lambda n, e: errors.__setitem__(n, _short(e)))
        else:
            times = {}
        for key in calls:
            name, _, mode = key.rpartition("|")
            if key in errors:
                results[name][mode] = {**results[name][mode], "status": "n/a",
                                       "reason": f"failed while timed: {errors[key]}"}
            else:
                results[name][mode].update(timing_result(times[key], flops))
    finally:
        for p in prepared.values():
            _close(p)
    kernel = results[run.kernel.name]
    errs = [f"{m}: {kernel[m]['status']}: {kernel[m]['reason']}" for m in attempted.get(run.kernel.name, ())
            if kernel[m]["status"] != "ok"]
    for name, entry in results.items():
        for m in MODES:
            r = entry.get(m)
            if r:
                run.say(f"  {name} ({m}): " + (f"{r['ms']:.4f} ms ({r['variant'] or '-'})"
                                               if r["status"] == "ok" and r["ms"] is not None
                                               else f"{r['status']}: {r['reason']}"))
    return shape_row(shape, results, run.kernel.name, blocks=blocks, error="; ".join(errs) or None)


# --------------------------------------------------------------------------- the table (pure)

def _ms(x) -> str:
    return "-" if x is None else (f"{x:.4f}" if x < 1 else f"{x:.3f}")


def _cell(entry: dict | None) -> str:
    """A peer's cell: its time, or its status."""
    if not entry:
        return "-"
    for m in MODES:
        r = entry.get(m)
        if r:
            return _ms(r["ms"]) if r["status"] == "ok" else r["status"]
    return "-"


def format_report(body: dict) -> str:
    """The human-readable report of a record body (as printed by ``refattn bench``)."""
    kernel = body.get("kernel", "?")
    peers = list(body.get("peers_requested") or [])
    tm = body.get("timing") or {}
    h = body.get("kernel_source_hash")
    lines = [f"refattn bench: kernel {kernel} (source {h[:12] if h else 'unknown'}) on "
             f"{body.get('device', '?')}, torch {body.get('torch') or 'not importable'}",
             FLOP_FORMULA,
             f"timing: median of {tm.get('reps')} calls after {tm.get('warmup')} warm-up calls"
             + (f", in {tm['rounds']} interleaved rounds" if (tm.get("rounds") or 1) > 1 else "")
             + f"; {tm.get('method', '')}",
             f"check: {CHECK_METHOD}"]
    j = body.get("judged")
    if isinstance(j, dict):
        lines.append(f"targets: judged on {j.get('date')} against {j.get('shapes_file')}, from the "
                     f"times of the run of {body.get('date')}; nothing was timed again")
    avail = body.get("peers_available") or {}
    if avail:
        lines.append("peers: " + "; ".join(f"{n} {'yes' if v.get('available') else 'no'} "
                                          f"({v.get('reason', '')})" for n, v in avail.items()))
    c = body.get("ceilings") or {}
    if c.get("gemm_fp16"):
        g, cp = c["gemm_fp16"], c.get("copy") or {}
        lines.append(f"ceilings (same run): fp16 GEMM {g['n']}^3 {_ms(g['ms'])} ms = "
                     f"{g['tflops']:.0f} TF/s; device copy {cp.get('bytes', 0) / 2**30:.0f} GiB "
                     f"(read + write) {_ms(cp.get('ms'))} ms = {cp.get('tbps', 0):.2f} TB/s")
    elif c.get("reason"):
        lines.append(f"ceilings: not measured ({c['reason']})")
    gemm = (c.get("gemm_fp16") or {}).get("tflops")
    rows = body.get("shapes") or []
    with_sink = [p for p in peers if any((((r["results"].get(p) or {}).get("sink") or {}).get("status")
                                          == "ok") for r in rows)]
    width = max([8] + [len(p) for p in peers])
    nw = max([24] + [len(r["name"]) for r in rows])
    tg = body.get("targets") or {"hits": [], "misses": [], "flat": [], "bf16_within": [],
                                 "peer_within": []}
    within = {w["shape"]: w for w in tg.get("bf16_within") or []}
    hdr = (f"{'shape':{nw}} {'GFLOP':>8} {'ms':>8} {'TF/s':>6} {'%GEMM':>6} {'nosink':>8} "
           + " ".join(f"{p[:width]:>{width}}" for p in peers)
           + f" {'best':>{width}} {'ratio':>15} {'target':>7} {'verdict':>12}")
    lines += ["", f"ms, TF/s: {kernel} in the shape's sink mode (with the sink where the shape has "
              f"one); nosink: {kernel} without; peers in ms, each in the mode it computes (with the "
              f"sink on sink shapes: {', '.join(with_sink) or 'none'}); ratio = kernel / best peer "
              f"in the best peer's mode (< 1: the kernel is faster); target: ms per call, or "
              f"<=Fx on a bf16 row: at most F times the kernel's time on the shape's fp16 row "
              f"(bf16_within)", hdr, "-" * len(hdr)]
    notes = []
    for r in rows:
        k = r["results"].get(kernel) or {}
        main = "sink" if r["geometry"].get("sink") else "nosink"
        s = k.get(main) or {}
        ns = (k.get("nosink") or {}) if main == "sink" else {}
        frac = f"{100 * s['tflops'] / gemm:5.1f}%" if gemm and s.get("tflops") else "-"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x ({r['ratio_basis']})"
        t, w = r["target"], within.get(r["name"])
        if w:  # a bf16 row: the bf16_within target, its ratio to the fp16 row's time
            tgt, t = f"<={w['factor']:g}x", w
        else:
            tgt = "-" if not t else f"{t['ms']:g}"
        verdict = "-" if not t or t["hit"] is None else f"{'hit' if t['hit'] else 'MISS'} {t['ratio']:.2f}x"
        if r.get("kernel_error"):
            verdict = "ERROR"
            notes.append(f"{r['name']} {kernel}: {r['kernel_error']}")
        tf = f"{s['tflops']:.1f}" if s.get("tflops") else "-"
        ms = _ms(s.get("ms")) if s.get("status") == "ok" else (s.get("status") or "-")
        nms = _ms(ns.get("ms")) if ns.get("status") == "ok" else (ns.get("status") or "-")
        lines.append(f"{r['name']:{nw}} {r['flops'] / 1e9:8.2f} {ms:>8} {tf:>6} {frac:>6} {nms:>8} "
                     + " ".join(f"{_cell(r['results'].get(p)):>{width}}" for p in peers)
                     + f" {(r['best_peer'] or '-')[:width]:>{width}} {ratio:>15} {tgt:>7} {verdict:>12}")
        for p in peers:
            entry = r["results"].get(p) or {}
            run_wide = avail.get(p, {})
            for m in MODES:
                pr = entry.get(m)
                if not pr or pr["status"] == "ok":
                    continue
                if not run_wide.get("available", True) and pr["reason"] == run_wide.get("reason"):
                    continue  # unavailable for the whole run: said once, above
                notes.append(f"{r['name']} {p}: {pr['status']}: {pr['reason']}")
    lines += ["", f"targets ({kernel} in each shape's sink mode): {len(tg['hits'])} hit, "
              f"{len(tg['misses'])} missed" + (f" ({', '.join(tg['misses'])})" if tg["misses"] else "")
              + (f", {len(tg.get('untimed') or [])} not timed ({', '.join(tg['untimed'])})"
                 if tg.get("untimed") else "")]
    for f in tg.get("flat") or []:
        spread = "-" if f["spread"] is None else f"{f['spread']:.3f}"
        verdict = "not judged" if f["hit"] is None else ("hit" if f["hit"] else "MISS")
        lines.append(f"flat across the cache: max/min = {spread} (limit {f['limit']:.2f}) {verdict}: "
                     + ", ".join(f"{n} {_ms(m)} ms" for n, m in zip(f["shapes"], f["ms"])))
    if within:
        ws = list(within.values())
        hit = [w["shape"] for w in ws if w["hit"]]
        miss = [w["shape"] for w in ws if w["hit"] is False]
        unjudged = [w["shape"] for w in ws if w["hit"] is None]
        factors = "/".join(f"{f:g}" for f in dict.fromkeys(w["factor"] for w in ws))
        lines.append(f"bf16 within {factors}x of fp16 ({kernel} in each shape's sink mode): "
                     f"{len(hit)} hit, {len(miss)} missed" + (f" ({', '.join(miss)})" if miss else "")
                     + (f", {len(unjudged)} not judged ({', '.join(unjudged)})" if unjudged else ""))
    pw = tg.get("peer_within") or []
    if pw:
        miss = [f"{w['shape']} {w['ratio']:.2f}x" for w in pw if w["hit"] is False]
        unjudged = [w["shape"] for w in pw if w["hit"] is None]
        factors = "/".join(f"{f:g}" for f in dict.fromkeys(w["factor"] for w in pw))
        peer_names = "/".join(dict.fromkeys(w["peer"] for w in pw))
        lines.append(f"within {factors}x of {peer_names} ({kernel} against it, each in the shape's "
                     f"sink mode): {sum(w['hit'] is True for w in pw)} hit, {len(miss)} missed"
                     + (f" ({', '.join(miss)})" if miss else "")
                     + (f", {len(unjudged)} not judged ({', '.join(unjudged)})" if unjudged else ""))
    if notes:
        lines += ["", "notes:"] + [f"  {n}" for n in dict.fromkeys(notes)]
    return "\n".join(lines)


# --------------------------------------------------------------------------- CLI

def add_arguments(p: argparse.ArgumentParser) -> None:
    from refattn.cli import _count_of

    p.description = (
        "Time a kernel adapter and its peers (torch SDPA flash, SDPA cuDNN, FlexAttention,\n"
        "FlashAttention 4, or any adapters) in one process on the same inputs, each checked\n"
        "against the fp64 reference first (sampled row blocks, derived gate); print time, TF/s\n"
        "and the ratio to the best peer, judge the targets of the shapes file, and write a\n"
        "record. Every adapter needs prepare(inputs): a device-resident launch. Work is\n"
        "counted as\n\n"
        "    FLOPs = 4 * d * Hq * B * sum_rows(visible keys of the row)\n\n"
        "where row i (position p = past_len + i) sees p + 1 keys, min(p + 1, W) under a\n"
        "window of W keys; a ragged batch counts each sequence's own rows. Shapes, dtypes\n"
        "and targets: benchmarks/shapes.toml (or --shapes FILE).")
    p.add_argument("--kernel", metavar="NAME", default=None,
                   help="the kernel under test: a registered name (hipkernel, hipkernel:cuda) or an "
                        "import path package.module:Class. Default: the best available kernel, as "
                        "for refattn run")
    p.add_argument("--peers", type=parse_peer_list, default=None, metavar="LIST",
                   help=f"comma-separated peers: {', '.join(DEFAULT_PEERS)} (refattn.adapters.torch_peers), a "
                        f"registered kernel or an import path; or none (default: "
                        f"{','.join(DEFAULT_PEERS)})")
    p.add_argument("--shapes", default=None, metavar="FILE|NAMES",
                   help="a shapes file (.toml: all its shapes), or comma-separated names from the "
                        "default file benchmarks/shapes.toml: shape names FAMILY-SQ@PAST[-wW] "
                        "(-bf16 appended: the bf16 row), ragged shape names, family names, or "
                        "all. Default: every shape of the default file")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="write the record to PATH ('-' = stdout, the table then goes to stderr); "
                        "checked before any work")
    p.add_argument("--reps", type=_count_of("timed call", "timed calls", MIN_REPS),
                   default=DEFAULT_REPS, metavar="N",
                   help=f"timed calls per implementation (median; >= {MIN_REPS}, default {DEFAULT_REPS})")
    p.add_argument("--warmup", type=_count_of("warm-up call", "warm-up calls", 0), default=DEFAULT_WARMUP, metavar="N",
                   help=f"untimed calls before each round's timed ones (default {DEFAULT_WARMUP})")
    p.add_argument("--rounds", type=_count_of("round", "rounds"), default=DEFAULT_ROUNDS, metavar="N",
                   help=f"split each implementation's --reps timed calls over N rounds, each timing "
                        f"every implementation of the shape in turn, in the orders of a "
                        f"carryover-balanced design (each follows every other equally often), so "
                        f"that all meet the same clock drift; 1 = one burst each (default "
                        f"{DEFAULT_ROUNDS})")
    p.add_argument("--no-ceilings", dest="ceilings", action="store_false",
                   help="skip the fp16 GEMM and copy ceilings")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output on stderr")
    p.add_argument("--judge", metavar="RECORD", default=None,
                   help="time nothing: judge the times of a bench record (--json of an earlier "
                        "run) against the targets of the shapes file (--shapes FILE, default "
                        "benchmarks/shapes.toml), print its table, and with --json write the "
                        "record with those verdicts and a 'judged' field saying so")
    p.epilog = ("examples:\n"
                "  refattn bench --kernel hipkernel                  # every shape, all peers\n"
                "  refattn bench --kernel hipkernel --shapes gptoss-512@8192-w128 --peers flex,fa4\n"
                "  refattn bench --kernel hipkernel --shapes d128 --peers sdpa,cudnn --json -\n"
                "  refattn bench --kernel hipkernel --shapes gptoss-1024@4096-w128   # any FAMILY-SQ@PAST[-wW]\n"
                "  refattn bench --kernel hipkernel --shapes gptoss-512@8192,gptoss-512@8192-bf16\n"
                "  refattn bench --kernel mypkg.adapters:MyKernel --shapes my_shapes.toml --json b.json\n"
                "  refattn bench --judge b.json --shapes my_shapes.toml   # new targets, old times\n"
                "\nexit status: 0 every check of the kernel passed and every target was hit; 1 the "
                "kernel failed its check against the reference or raised on a shape, or a target "
                "was missed (peers that mismatch or cannot run are reported, not failures); 2 a "
                "usage error: a bad flag or shapes file, an unknown or unavailable kernel, an "
                "adapter without prepare()")


def _sync_for(adapter, T):
    fn = getattr(adapter, "synchronize", None)
    if callable(fn):
        return fn
    if T is not None:
        return T.cuda.synchronize
    return lambda: None


def _device_name(T) -> str:
    if T is not None:
        try:
            return str(T.cuda.get_device_name(0))
        except Exception:  # noqa: BLE001
            pass
    return f"host {platform.machine() or 'CPU'} (no CUDA device visible to torch)"


def _judge_options(args) -> None:
    """With --judge, the options that time or choose implementations are errors, not ignored."""
    from refattn.cli import UsageError

    given = [opt for opt, value, default in (
        ("--kernel", args.kernel, None), ("--peers", args.peers, None),
        ("--reps", args.reps, DEFAULT_REPS), ("--warmup", args.warmup, DEFAULT_WARMUP),
        ("--rounds", args.rounds, DEFAULT_ROUNDS), ("--no-ceilings", args.ceilings, True))
        if value != default]
    if given:
        raise UsageError(f"{given[0]}: not with --judge, which times nothing (the record names its "
                         f"kernel and peers)")
    if args.shapes is not None and not (args.shapes.strip().endswith(".toml")
                                        or Path(args.shapes.strip()).is_file()):
        raise UsageError(f"--shapes: with --judge, a shapes file (.toml) whose targets judge the "
                         f"record, got {args.shapes!r}")


def _read_bench_record(path: str) -> dict:
    """A bench record of this engine (``shapes`` with ``results`` per adapter), or UsageError
    naming the file and what is wrong with it."""
    import json

    from refattn import schema
    from refattn.cli import UsageError

    try:
        rec = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # ValueError: JSON, UTF-8
        raise UsageError(f"--judge: {path}: cannot read a JSON record: {type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}") from None
    if not isinstance(rec, dict) or rec.get("kind") != "bench":
        got = rec.get("kind") if isinstance(rec, dict) else type(rec).__name__
        raise UsageError(f"--judge: {path}: not a bench record (kind {got!r})")
    found = schema.gpu_record_problems(rec)
    rows = rec.get("shapes")
    if not found and not (isinstance(rec.get("kernel"), str) and isinstance(rows, list) and rows):
        found = ["expected 'kernel' and a non-empty list 'shapes' (the record of refattn bench)"]
    for i, r in enumerate(rows if not found else ()):
        if not (isinstance(r.get("name"), str) and isinstance(r.get("results"), dict)
                and isinstance(r.get("geometry"), dict) and _is_num(r.get("flops"))):
            found = [f"shapes[{i}]: expected 'name', 'geometry', 'flops' and 'results' (the "
                     f"record of refattn bench)"]
            break
    if found:
        raise UsageError(f"--judge: {path}: {found[0]}")
    return rec


def judge_record(args) -> int:
    """``--judge RECORD``: the record's times judged against the shapes file's targets (module
    docstring, Output); nothing is timed. Exit status as for a bench run."""
    from refattn.cli import UsageError
    from refattn.fileio import atomic_write_text, json_text

    _judge_options(args)
    rec = _read_bench_record(args.judge)
    try:
        spec, _ = resolve_shapes(args.shapes)
    except ShapesError as e:
        raise UsageError(f"--shapes: {e}") from None
    kernel, by_name, rows = rec["kernel"], spec.by_name(), []
    for r in rec["shapes"]:
        shape = by_name.get(r["name"])
        target, within = row_targets(shape, r["results"].get(kernel) or {}) if shape else (None, None)
        rows.append({**r, **peer_ratio(r["results"], kernel), "target": target, "bf16_within": within})
    body = {**rec, "shapes_file": str(spec.path), "bf16_within": spec.bf16_within,
            "peer_within": None if spec.peer_within is None else spec.peer_within.to_dict(),
            "shapes": rows, "targets": judge_targets(rows, spec.flat, kernel, spec.peer_within),
            "judged": {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                       "record": str(args.judge), "shapes_file": str(spec.path),
                       "how": "the record's times judged against the shapes file's targets; "
                              "nothing was timed again",
                       "unlisted": [r["name"] for r in rows if r["name"] not in by_name]}}
    out = sys.stderr if args.json == "-" else sys.stdout
    print(format_report(body), file=out, flush=True)
    if body["judged"]["unlisted"]:
        print(f"not in {spec.path} (no target): {', '.join(body['judged']['unlisted'])}", file=out)
    if args.json == "-":
        sys.stdout.write(json_text(body))
    elif args.json:
        atomic_write_text(Path(args.json), json_text(body))
        print(f"wrote {args.json} (judged against {spec.path})", file=out)
    return EXIT_FAIL if not rec["ok"] or targets_missed(body["targets"]) else EXIT_OK


def run(args) -> int:
    from refattn.cases import CaseError
    from refattn.cli import UsageError, check_outputs
    from refattn.fileio import atomic_write_text, json_text
    from refattn.kernels import best_kernel, kernel_available, kernel_source_hash

    check_outputs(args, ("json",))  # before the bench, not after minutes of it
    if args.judge is not None:
        return judge_record(args)
    if args.rounds > args.reps:
        raise UsageError(f"argument --rounds: at most --reps ({args.reps}) rounds, got {args.rounds}")
    t_start = time.perf_counter()
    log = None if args.quiet else (
        lambda m: print(f"[{time.perf_counter() - t_start:6.1f} s] {m}", file=sys.stderr, flush=True))
    try:
        spec, shapes = resolve_shapes(args.shapes)
        cases = [{m: s.case(m == "sink") for m in s.modes} for s in shapes]
    except (ShapesError, CaseError) as e:  # CaseError: a shape beyond the case limits
        raise UsageError(f"--shapes: {e}") from None

    kernel_name, why = (args.kernel, "named by --kernel") if args.kernel else best_kernel()
    adapter = resolve_kernel(kernel_name)
    ok, reason = kernel_available(adapter)
    if not ok:
        raise UsageError(f"kernel: {kernel_name!r} is not available here: {reason}")
    khash = kernel_source_hash(adapter)
    T, torch_reason = probe_torch()
    kernel = Impl(str(adapter.name), adapter, "kernel", True, reason, khash, _sync_for(adapter, T))
    peers: list[Impl] = []
    peers_available: dict = {}
    for spec_name in DEFAULT_PEERS if args.peers is None else args.peers:
        pa = resolve_peer(spec_name)
        name = str(pa.name)
        if name == kernel.name or any(p.name == name for p in peers):
            raise UsageError(f"--peers: {spec_name!r} is named {name!r}, as the kernel or another "
                             f"peer is: every implementation needs its own name")
        pok, preason = kernel_available(pa)
        phash = None
        if pok:
            try:
                phash = kernel_source_hash(pa)
            except Exception as e:  # noqa: BLE001 - a peer's version is information, not a gate
                phash = None
                preason += f" (source_hash() failed: {e})"
        peers.append(Impl(name, pa, "peer", pok, preason, phash, _sync_for(pa, T)))
        peers_available[name] = {"available": pok, "reason": preason, "source_hash": phash}
    timer = make_timer(T)
    bench = Run(kernel, peers, timer=timer, warmup=args.warmup, reps=args.reps, rounds=args.rounds,
                log=log)
    bench.say(f"refattn bench: kernel {kernel.name} ({why}{'; ' + reason if reason else ''}); "
              f"{len(shapes)} shapes from "
              f"{spec.path}; timer: {timer.method}; peers: "
              + ("; ".join(f"{n} {'yes' if v['available'] else 'no'} ({v['reason']})"
                           for n, v in peers_available.items()) or "none"))
    if T is None:
        ceilings = {"reason": torch_reason}
    elif not args.ceilings:
        ceilings = {"reason": "skipped (--no-ceilings)"}
    else:
        bench.say("ceilings: fp16 GEMM 8192^3 and a 1 GiB device copy")
        ceilings = measure_ceilings(T, timer, warmup=args.warmup, reps=args.reps)
    rows = []
    for i, (shape, cs) in enumerate(zip(shapes, cases)):
        bench.say(f"[{i + 1}/{len(shapes)}] {shape.name} ({', '.join(shape.modes)})")
        rows.append(bench_shape(bench, shape, cs))
    targets = judge_targets(rows, spec.flat, kernel.name, spec.peer_within)
    ok = body_ok(rows)
    body = {
        "schema": 1, "kind": "bench", "kernel": kernel.name, "kernel_spec": kernel_name,
        "kernel_source_hash": khash,
        "device": _device_name(T),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "ok": ok,
    }
    if khash is None:
        body["kernel_source_hash_note"] = (f"the adapter of {kernel.name} has no source_hash(): this "
                                           f"record is tied to no source, its freshness is unknown")
    body.update({
        "kernel_available": reason, "torch": getattr(T, "__version__", None),
        "peers_requested": [p.name for p in peers], "peers_available": peers_available,
        "shapes_file": str(spec.path), "dtypes": list(spec.dtypes), "bf16_within": spec.bf16_within,
        "peer_within": None if spec.peer_within is None else spec.peer_within.to_dict(),
        "flop_formula": FLOP_FORMULA,
        "timing": {"method": timer.method, "statistic": "median", "warmup": args.warmup,
                   "reps": args.reps, "rounds": args.rounds,
                   "order": ("one burst of --reps calls each, the kernel first" if args.rounds == 1 else
                             f"the reps split over {args.rounds} rounds, each timing every "
                             "implementation in turn after --warmup calls, in the orders of a "
                             "carryover-balanced (Williams) design, each implementation right after "
                             "every other equally often; the median over all of an "
                             "implementation's calls")},
        "check": {"method": CHECK_METHOD, "rows_per_block": CHECK_ROWS,
                  "gate": "refattn.metrics.compare (derived gate: 2x the low-precision baseline + floor)"},
        "ceilings": ceilings, "shapes": rows, "targets": targets,
        "elapsed_s": round(time.perf_counter() - t_start, 1),
    })
    text = json_text(body)
    out = sys.stderr if args.json == "-" else sys.stdout
    print(format_report(body), file=out, flush=True)
    if args.json == "-":
        sys.stdout.write(text)
    elif args.json:
        atomic_write_text(Path(args.json), text)
        print(f"wrote {args.json} (ok={ok}, {body['elapsed_s']} s)", file=out)
    else:
        print("no --json: the record was not written", file=out)
    if not ok or targets_missed(targets):
        return EXIT_FAIL
    return EXIT_OK


__all__ = ["CHECK_ROWS", "FLOP_FORMULA", "Family", "FlatGroup", "Impl", "PeerWithin", "Run", "Shape", "ShapeSpec",
           "ShapesError", "add_arguments", "bench_inputs", "bench_shape", "best_peer", "check_blocks",
           "check_row_blocks", "default_shapes_path", "format_report", "judge_output", "judge_targets",
           "load_shapes", "parse_shape", "ragged_row_blocks", "resolve_shapes", "run",
           "sampled_reference", "shape_row", "visible_pairs"]
