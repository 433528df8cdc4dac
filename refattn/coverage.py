"""The coverage model: which inputs the case matrix produces, as data (docs/semantics.md,
Coverage model).

An *axis* is one property of a case (the KV group size G, the window relative to the tiles,
the cache contents outside the visible keys, ...) with named *values* and a predicate
``case -> set of values`` (a case can hit several values of an axis: skv = 255 is one less
than a multiple of 16, 32, 64 and 128 at once). A *cell* is one (axis, value). Some cells
are REQUIRED: the places where documented bugs of public attention kernels hide, which a
matrix must reach. Some axis PAIRS interact (a small softcap under a window, a logit offset
with a sink): for those, required pair cells name the value combinations a single case must
hit together. Values marked ``future`` name inputs the case format cannot express yet.

Tile sizes: the Sq, skv and window axes are relative to the query-row and key tiles of the
kernels under test. Every function takes ``tiles = {"q": [...], "kv": [...]}``; the default
is :data:`DEFAULT_TILES`, 16 to 128 for both, the tiles the kernels of this repository use.

:func:`coverage` maps cases to the cells they hit; :func:`unhit_required` lists the
required cells (and pair cells) a case list leaves unhit; ``refattn cases --coverage``
prints the table.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from refattn.cases import SINK_HIGH, SINK_LOW, Case, logit_shift

DEFAULT_TILES: dict[str, tuple[int, ...]] = {"q": (16, 32, 64, 128), "kv": (16, 32, 64, 128)}
FP16_MAX = 65504.0
LARGE_SOFTCAP = 20.0  # softcaps at or above this leak at most e^-20 through a masked key
SMALL_SOFTCAP = (2.0, 5.0)  # Gemma-style small caps, where a leaked masked key shows


@dataclass(frozen=True)
class Axis:
    """One property of a case: its values (in order), the required ones, the ones the case
    format cannot express yet, and the predicate ``(case, tiles) -> values hit``."""

    name: str
    values: tuple[str, ...]
    predicate: Callable[[Case, Mapping[str, Sequence[int]]], set[str]]
    required: tuple[str, ...] = ()
    future: tuple[str, ...] = ()
    doc: str = ""

    def hits(self, case: Case, tiles: Mapping[str, Sequence[int]] | None = None) -> set[str]:
        got = self.predicate(case, _tiles(tiles))
        unknown = got - set(self.values)
        if unknown:  # a predicate may only name its own values
            raise ValueError(f"axis {self.name}: predicate returned unknown values "
                             f"{sorted(unknown)}")
        return got


@dataclass(frozen=True)
class Pair:
    """Two interacting axes and the value combinations a case must hit together."""

    a: str
    b: str
    required: tuple[tuple[str, str], ...]
    doc: str = ""

    @property
    def name(self) -> str:
        return f"{self.a} x {self.b}"


def _tiles(tiles: Mapping[str, Sequence[int]] | None) -> dict[str, tuple[int, ...]]:
    if tiles is None:
        return dict(DEFAULT_TILES)
    out = {}
    for key in ("q", "kv"):
        vals = tuple(int(t) for t in tiles.get(key, DEFAULT_TILES[key]))
        if not vals or any(t < 2 for t in vals):
            raise ValueError(f"tiles[{key!r}]: expected tile sizes >= 2, got {vals}")
        out[key] = tuple(sorted(set(vals)))
    return out


def tile_values(tiles: Sequence[int]) -> tuple[str, ...]:
    """The values of a length axis relative to ``tiles``: per tile t, ``t*k`` (an exact
    multiple), ``t*k-1`` and ``t*k+1`` (k >= 1), and ``prime``."""
    out = []
    for t in tiles:
        out += [f"{t}k", f"{t}k-1", f"{t}k+1"]
    return tuple(out) + ("prime",)


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    return all(n % f for f in range(3, math.isqrt(n) + 1, 2))


def _lengths(c: Case, tiles) -> set[str]:
    if not c.ragged:
        return {"uniform"}
    got = {"ragged"}
    if len(set(c.past_lens)) > 1:
        got.add("past-differs")
    if any(n < c.sq for n in c.q_lens):
        got.add("padded-rows")
    if 0 in c.q_lens:
        got.add("fully-padded")
    if any(p == 0 and n > 0 for p, n in zip(c.past_lens, c.q_lens)) and max(c.past_lens) > 0:
        got.add("empty-cache-beside")
    return got


def _each_length(lengths, tiles: Sequence[int]) -> set[str]:
    """:func:`_length_hits` of every non-zero length (a ragged batch's sequences each end
    where their own length does)."""
    got = set()
    for n in set(lengths):
        if n > 0:
            got |= _length_hits(n, tiles)
    return got


def _length_hits(n: int, tiles: Sequence[int]) -> set[str]:
    got = set()
    for t in tiles:
        if n >= t and n % t == 0:
            got.add(f"{t}k")
        if n >= t - 1 and n % t == t - 1:
            got.add(f"{t}k-1")
        if n > t and n % t == 1:
            got.add(f"{t}k+1")
    if n > 2 and _is_prime(n):
        got.add("prime")
    return got


# --------------------------------------------------------------------------- predicates

def _g(c: Case, tiles) -> set[str]:
    G, got = c.G, set()
    if G == 1:
        got.add("1")
    elif G & (G - 1) == 0:
        got.add("pow2")
    else:
        got.add("non-pow2")
    if G > 16:
        got.add(">16")
    if c.Hkv == 1 and c.Hq > 1:
        got.add("=Hq")
    return got


def _window(c: Case, tiles) -> set[str]:
    W, kv = c.window, tiles["kv"]
    if W < 0:
        return {"none"}
    got = set()
    if W == 1:
        got.add("1")
    elif W < min(kv):
        got.add("<tile")
    if W in kv:
        got.add("=tile")
    elif W > min(kv) and all(W % t for t in kv):
        got.add("not-tile-multiple")
    if W >= c.skv:
        got.add("no-op")
    if c.hidden_slots > 0:
        got.add("cuts-cache")
    if c.hidden_slots >= 2 * max(kv):
        got.add("cuts-whole-tiles")
    return got


def _visible_counts(c: Case) -> tuple[int, int]:
    """Visible keys of the chunk's first and last rows (ragged: the fewest any sequence's
    first row sees, the most any sequence's last row sees)."""
    live = [(p, n) for p, n in zip(c.past_lens, c.q_lens) if n > 0]
    first, last = min(p for p, _ in live) + 1, max(p + n for p, n in live)
    if c.window > 0:
        first, last = min(first, c.window), min(last, c.window)
    return first, last


def sink_range(c: Case) -> tuple[float, float] | None:
    """The sink logits of ``c`` relative to the common logit shift of its input modes:
    [U(-2, 4) bounds moved by the shift and rounded through fp16, minus the shift] for
    per-head sinks, the zero logit minus the shift for smooth softmax, None without a sink."""
    import numpy as np

    shift = logit_shift(c)
    if c.sink == "per_head":
        lo = float(np.float16(SINK_LOW + shift)) - shift
        hi = float(np.float16(SINK_HIGH + shift)) - shift
        return lo, hi
    if c.sink == "smooth":
        return -shift, -shift
    return None


def _sink_weight(c: Case, tiles) -> set[str]:
    """``dominant``: on the first row some head's sink outweighs all the row's keys (the
    keys' log-sum-exp about log(n) + v^2 / 2 for logits of variance v^2); ``small``: on the
    last row some head's sink weighs under e^-2 of the keys."""
    r = sink_range(c)
    if r is None:
        return set()
    unit = max(0, c.d - bool(c.logit_offset) - bool(c.q_spike))
    v2 = c.scale_value ** 2 * unit  # variance of a logit from the unit components
    first, last = _visible_counts(c)
    got = set()
    if r[1] > math.log(first) + v2 / 2:
        got.add("dominant")
    if r[0] < math.log(last) + v2 / 2 - 2:
        got.add("small")
    return got


def _softcap(c: Case, tiles) -> set[str]:
    cap = c.softcap
    if not cap:
        return {"off"}
    if cap >= LARGE_SOFTCAP:
        return {"large"}
    if SMALL_SOFTCAP[0] <= cap <= SMALL_SOFTCAP[1]:
        return {"small"}
    return {"other"}


def _magnitude(c: Case, tiles) -> set[str]:
    got = set()
    if c.logit_offset:
        got.add("logit-offset")
    if c.q_spike and 2 * abs(c.q_spike) > FP16_MAX:
        got.add("q-spike")
    return got or {"unit"}


def _cache(c: Case, tiles) -> set[str]:
    got = set()
    if c.ragged and min(c.seq_lens) < c.skv:
        got.add("other-sequence-slots")  # a shorter sequence's slots up to the longest's
    if c.spare != 0:
        got.add("nan-past-skv")
    else:
        got.add("tight")
    if c.hidden_slots > 0:
        got.add({"clean": "clean-left-of-window", "nan-outside-window": "nan-left-of-window",
                 "inf-outside-window": "inf-left-of-window"}[c.cache_fill])
    return got


AXES: tuple[Axis, ...] = (
    Axis("G", ("1", "pow2", "non-pow2", ">16", "=Hq"), _g,
         required=("1", "pow2", "non-pow2", ">16", "=Hq"),
         doc="query heads per KV head: kernels tile heads in 16s; real models use G = 12, 24"),
    Axis("Hkv", ("1", ">1"), lambda c, t: {"1" if c.Hkv == 1 else ">1"}, required=("1", ">1"),
         doc="KV heads: with one, a wrong head map cannot show"),
    Axis("d", ("64", "128", "other"),
         lambda c, t: {str(c.d) if c.d in (64, 128) else "other"}, required=("64", "128", "other"),
         doc="head dim: compiled ones and one a kernel must decline or handle"),
    Axis("sq", tile_values(DEFAULT_TILES["q"]), lambda c, t: _each_length((c.sq,) + c.q_lens, t["q"]),
         required=tile_values(DEFAULT_TILES["q"]),
         doc="query rows relative to every query tile: the last Q tile full, one short, one over"),
    Axis("skv", tile_values(DEFAULT_TILES["kv"]), lambda c, t: _each_length(c.seq_lens, t["kv"]),
         required=tile_values(DEFAULT_TILES["kv"]),
         doc="keys relative to every KV tile: tiles ending at, one before, one after skv"),
    Axis("window", ("none", "1", "<tile", "=tile", "not-tile-multiple", "no-op", "cuts-cache",
                    "cuts-whole-tiles"), _window,
         required=("none", "1", "<tile", "=tile", "not-tile-multiple", "no-op", "cuts-cache",
                   "cuts-whole-tiles"),
         doc="window W against the tiles and the sequence; cuts-cache: key slots no row sees; "
             "cuts-whole-tiles: at least two of the largest KV tiles lie left of every window"),
    Axis("sink", ("none", "per_head", "smooth"), lambda c, t: {c.sink},
         required=("none", "per_head", "smooth"), doc="sink mode"),
    Axis("sink-weight", ("small", "dominant"), _sink_weight, required=("small", "dominant"),
         doc="the sink against the row's keys: negligible on a long row, dominant on a short one"),
    Axis("softcap", ("off", "large", "small", "other"), _softcap,
         required=("off", "large", "small"),
         doc="softcap: large (>= 20) hides a leaked masked key (e^-30); small (2-5) shows it"),
    Axis("scale", ("default", "custom"),
         lambda c, t: {"default" if c.scale is None else "custom"}, required=("default", "custom"),
         doc="logit scale 1/sqrt(d) or given"),
    Axis("magnitude", ("unit", "logit-offset", "q-spike"), _magnitude,
         required=("unit", "logit-offset", "q-spike"),
         doc="inputs N(0, 1); a common logit offset (every logit near -5e4); a q component whose "
             "raw q.k passes 65504 before the scale"),
    Axis("cache-outside", ("nan-past-skv", "tight", "clean-left-of-window", "nan-left-of-window",
                           "inf-left-of-window", "other-sequence-slots"), _cache,
         required=("nan-past-skv", "clean-left-of-window", "nan-left-of-window",
                   "inf-left-of-window", "other-sequence-slots"),
         doc="what the cache holds where no row may look: canaries past skv, evicted slots left "
             "of the window, a ragged batch's slots past a sequence's own length"),
    Axis("batch", ("1", ">1"), lambda c, t: {"1" if c.B == 1 else ">1"}, required=("1", ">1"),
         doc="batch size: per-batch offsets of q, out and the padded cache"),
    Axis("lengths", ("uniform", "ragged", "past-differs", "padded-rows", "fully-padded",
                     "empty-cache-beside"), _lengths,
         required=("uniform", "ragged", "past-differs", "padded-rows", "fully-padded",
                   "empty-cache-beside"),
         doc="one past_len for the batch, or per-sequence lengths: different caches, padded "
             "query rows, a sequence with no valid row, an empty cache beside full ones"),
    Axis("dtype", ("fp16", "fp32", "bf16"), lambda c, t: {c.dtype},
         required=("fp16", "fp32", "bf16"), doc="input dtype"),
)

PAIRS: tuple[Pair, ...] = (
    Pair("softcap", "window", (("small", "cuts-cache"),),
         doc="a softcap applied after the mask leaks e^-c per masked key: visible at c = 2-5"),
    Pair("softcap", "sink", (("small", "per_head"),),
         doc="the sink is neither scaled nor softcapped, against capped logits"),
    Pair("window", "cache-outside", (("cuts-whole-tiles", "nan-left-of-window"),
                                     ("cuts-whole-tiles", "inf-left-of-window")),
         doc="a KV loop that starts at tile 0 and masks by P = 0 leaks NaN through 0 * NaN"),
    Pair("G", "Hkv", (("1", ">1"), ("pow2", ">1"), ("non-pow2", ">1"), (">16", ">1")),
         doc="a head map wrong across KV groups needs several KV heads to show"),
    Pair("magnitude", "sink", (("logit-offset", "none"), ("logit-offset", "per_head")),
         doc="a finite floor for the running max zeroes rows whose logits lie below it; the "
             "sink must follow the row max there"),
    Pair("sink", "window", (("per_head", "cuts-cache"), ("smooth", "cuts-cache")),
         doc="skipped tiles must neither drop nor repeat the sink term"),
    Pair("batch", "window", ((">1", "cuts-cache"),),
         doc="per-batch cache offsets under a window's start-tile clamp"),
    Pair("lengths", "window", (("past-differs", "cuts-cache"),),
         doc="a window that cuts some sequences' caches: each sequence's own start tile"),
    Pair("lengths", "dtype", (("padded-rows", "bf16"),),
         doc="the bf16 epilogue must write a ragged batch's padded rows as zeros too"),
)

AXIS_BY_NAME = {a.name: a for a in AXES}


def axes_for(tiles: Mapping[str, Sequence[int]] | None = None) -> tuple[Axis, ...]:
    """:data:`AXES` with the Sq and skv values (and required cells) of ``tiles``."""
    t = _tiles(tiles)
    out = []
    for ax in AXES:
        if ax.name in ("sq", "skv"):
            vals = tile_values(t["q" if ax.name == "sq" else "kv"])
            ax = Axis(ax.name, vals, ax.predicate, required=vals, doc=ax.doc)
        out.append(ax)
    return tuple(out)


# --------------------------------------------------------------------------- coverage

@dataclass
class Coverage:
    """Which cases hit which cells. ``cells[axis][value]`` and
    ``pairs[pair name][(value a, value b)]`` are lists of case ids (suite/name)."""

    tiles: dict[str, tuple[int, ...]]
    cases: list[str]
    cells: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    pairs: dict[str, dict[tuple[str, str], list[str]]] = field(default_factory=dict)
    per_case: dict[str, dict[str, list[str]]] = field(default_factory=dict)

    def unhit_required(self) -> list[str]:
        """The required cells and pair cells no case hits, as ``axis=value`` and
        ``a=x & b=y``, in table order."""
        out = []
        for ax in axes_for(self.tiles):
            out += [f"{ax.name}={v}" for v in ax.required if not self.cells[ax.name][v]]
        for p in PAIRS:
            out += [f"{p.a}={x} & {p.b}={y}" for x, y in p.required
                    if not self.pairs[p.name][(x, y)]]
        return out

    def to_json(self, limit: int | None = None) -> dict:
        """Machine-readable coverage: per axis value and pair cell, the count, the case ids
        (all, or the first ``limit``), whether required, hit, future."""
        axes = []
        for ax in axes_for(self.tiles):
            vals = []
            for v in ax.values:
                ids = self.cells[ax.name][v]
                vals.append({"value": v, "required": v in ax.required, "future": v in ax.future,
                             "count": len(ids), "cases": ids if limit is None else ids[:limit]})
            axes.append({"axis": ax.name, "doc": ax.doc, "values": vals})
        pairs = []
        for p in PAIRS:
            cells = []
            for (x, y), ids in self.pairs[p.name].items():
                cells.append({"a": x, "b": y, "required": (x, y) in p.required, "count": len(ids),
                              "cases": ids if limit is None else ids[:limit]})
            pairs.append({"pair": p.name, "a": p.a, "b": p.b, "doc": p.doc, "cells": cells})
        return {"tiles": {k: list(v) for k, v in self.tiles.items()}, "n_cases": len(self.cases),
                "axes": axes, "pairs": pairs, "unhit_required": self.unhit_required(),
                "complete": not self.unhit_required()}


def case_cells(case: Case, tiles: Mapping[str, Sequence[int]] | None = None) -> dict[str, set[str]]:
    """Per axis, the values ``case`` hits."""
    return {ax.name: ax.hits(case, tiles) for ax in axes_for(tiles)}


def coverage(cases: Iterable[Case], tiles: Mapping[str, Sequence[int]] | None = None) -> Coverage:
    """The cells (and pair cells) each of ``cases`` hits."""
    t = _tiles(tiles)
    axes = axes_for(t)
    cases = list(cases)
    cov = Coverage(tiles=t, cases=[c.id for c in cases])
    cov.cells = {ax.name: {v: [] for v in ax.values} for ax in axes}
    cov.pairs = {}
    for p in PAIRS:
        va, vb = AXIS_BY_NAME[p.a].values, AXIS_BY_NAME[p.b].values
        if p.a in ("sq", "skv") or p.b in ("sq", "skv"):  # pragma: no cover - none today
            raise ValueError("pairs over tile-relative axes are not supported")
        cov.pairs[p.name] = {(x, y): [] for x in va for y in vb}
    for c in cases:
        cells = {ax.name: ax.hits(c, t) for ax in axes}
        cov.per_case[c.id] = {
            k: sorted(got, key=_tile_order) if k in ("sq", "skv")
            else [v for v in AXIS_BY_NAME[k].values if v in got]
            for k, got in cells.items()}
        for name, got in cells.items():
            for v in got:
                cov.cells[name][v].append(c.id)
        for p in PAIRS:
            for x in cells[p.a]:
                for y in cells[p.b]:
                    cov.pairs[p.name][(x, y)].append(c.id)
    return cov


def _tile_order(v: str):
    if v == "prime":
        return (10**9, 0)
    t, rest = v.split("k", 1)
    return (int(t), {"": 0, "-1": 1, "+1": 2}[rest])


def unhit_required(cases: Iterable[Case],
                   tiles: Mapping[str, Sequence[int]] | None = None) -> list[str]:
    """The required cells (and pair cells) that ``cases`` leave unhit."""
    return coverage(cases, tiles).unhit_required()


# --------------------------------------------------------------------------- text

def _names(ids: list[str], limit: int) -> str:
    names = [i.split("/", 1)[1] if "/" in i else i for i in ids]
    text = ", ".join(names[:limit])
    return text + (f", ... (+{len(names) - limit})" if len(names) > limit else "")


def table_rows(cov: Coverage, limit: int = 4) -> list[tuple[str, str, str, str, str]]:
    """Rows ``(axis, value, mark, count, cases)`` of the coverage table: mark is ``required``,
    ``UNHIT`` (required and no case), ``future`` or empty."""
    rows = []
    for ax in axes_for(cov.tiles):
        for v in ax.values:
            ids = cov.cells[ax.name][v]
            mark = ("UNHIT" if not ids else "required") if v in ax.required else (
                "future" if v in ax.future else "")
            rows.append((ax.name, v, mark, str(len(ids)), _names(ids, limit)))
    for p in PAIRS:
        for x, y in p.required:
            ids = cov.pairs[p.name][(x, y)]
            rows.append((p.name, f"{x} & {y}", "UNHIT" if not ids else "required", str(len(ids)),
                         _names(ids, limit)))
    return rows
