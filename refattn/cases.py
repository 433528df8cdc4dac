"""The case matrix: TOML case files, their validation, and deterministic inputs.

A *case* is one attention call described as data (STYLE 6): geometry, options and a one-line
``why`` saying which bug it exists to catch. Cases live in ``cases/<suite>.toml``::

    description = "what this suite is for"      # optional
    complete = true                             # optional: the suite alone hits every
                                                # required cell of refattn.coverage

    [defaults]                                  # optional, merged into every case
    Hq = 64
    Hkv = 8
    d = 64

    [[case]]
    name = "gptoss-sink-past8192-w128"
    sq = 512
    past_len = 8192
    window = 128
    sink = "per_head"
    why = "whole KV tiles must be skipped, not masked; the skip must keep the sink exact"

A suite may instead (or as well) be *derived* from other suites: the same cases with some
keys set, each renamed with a suffix, so the variant can never drift from its source::

    description = "seed and extended in bf16"
    [derive]
    from = ["seed", "extended"]                 # suites (names in the same directory)
    set = { dtype = "bf16" }                    # keys given to every case
    suffix = "-bf16"                            # appended to every name

Keys (``name``, ``Hq``, ``Hkv``, ``d``, ``sq`` and ``why`` are required):

    name           ``^[a-z0-9][a-z0-9.-]*$``, unique over every suite loaded together
    Hq, Hkv, d     query heads, KV heads (Hq % Hkv == 0), head dim
    B, sq          batch (default 1), query rows of this chunk (of every sequence; a ragged
                   batch right-pads its sequences to sq rows)
    past_len       keys already in the cache before the chunk (default 0); a list of B
                   integers makes the batch ragged: sequence b's row i sits at past_len[b] + i
    q_len          a list of B integers 0 <= q_len[b] <= sq (ragged): the valid query rows of
                   each sequence, right-padded to sq; padded rows must come back as zeros
                   (default: sq rows each)
    window         -1 (none, default) or W >= 1 keys, self included (ORT convention)
    sink           "none" (default) | "per_head" | "smooth"
    dtype          "fp16" (default) | "bf16" | "fp32": what the inputs are rounded through
    seed           numpy ``default_rng`` seed (default 0)
    scale          logit scale (default 1/sqrt(d))
    softcap        0 (off, default) or > 0
    config         kernel tile config, keys ``m_tiles`` (>= 1) and ``bkv`` (32 | 64)
    spare          rows of NaN canaries after the cache's skv keys (default: 64 to 127, so
                   the allocation ends on a multiple of 64; 0: a tight cache, where a read
                   past skv leaves the allocation, which compute-sanitizer sees)
    cache_fill     what the cache holds at the key slots no row of the chunk can see
                   because they lie left of every row's window: "clean" (default, the
                   drawn numbers), "nan-outside-window" (NaN) or "inf-outside-window"
                   (+inf at even slots, -inf at odd ones); needs a window that cuts the cache
    logit_offset   a common shift of every logit (default 0), built into q and k (below)
    q_spike        one q component this large (default 0: off), against k = 2 there, so
                   the raw q.k passes the fp16 range before the scale when |2 q_spike| > 65504
    seed_contract  "decline": the seed kernel declined this case (recorded, not enforced)
    why            one line: the bug this case exists to catch

Every violation raises :class:`CaseError` naming the file, the case and the key.

Inputs (:func:`make_inputs`) are a pure function of the case. ``q``, ``k``, ``v`` ~ N(0, 1)
and, for ``sink = "per_head"``, sink logits ~ U(-2, 4) (the range gpt-oss's learned sinks
occupy, so a sink sometimes dominates a row and sometimes vanishes), drawn from
``default_rng(seed)`` in that order. The sink is drawn last, so cases that differ only in
the sink see identical q/k/v. Everything is rounded through the case dtype before anyone sees
it (the sink through fp16, as the kernel ABI carries it), so kernel and reference get the same
numbers (docs/semantics.md, Semantics). The KV cache carries spare capacity filled with NaN canaries, and the
output buffer is pre-filled with a NaN canary bit pattern, so reads past ``skv`` and writes
on a decline are both visible.

Input modes (docs/semantics.md, Coverage model), applied after the draw, so the drawn numbers
are those of the same case without them:

* ``logit_offset = T``: component 0 of every q row is ``a`` and of every key ``b``,
  with ``a = round(sqrt(|T| / scale))`` and ``b = round(T / (scale * a))`` rounded through the
  case dtype, so every logit gains exactly ``scale * a * b`` (within a rounding of ``T``);
* ``q_spike = S``: component 0 (1 under an offset) of every q row is ``round(S)`` and of
  every key 2, so every
  logit gains ``2 * scale * round(S)`` and the raw q.k exceeds ``2 |S|`` minus the rest;
* per-head sinks move with the logits: ``sigma_h = fp16(u_h + shift)`` (``u_h ~ U(-2, 4)``,
  ``shift`` the sum of both gains, :func:`logit_shift`), so a sink stays comparable to the
  logits it competes with; a smooth softmax's zero logit does not move;
* ``cache_fill``: key slots ``j < past_len - W + 1`` (left of the first row's window, so of
  every row's) hold NaN or +-inf in ``k`` and ``v``; slots some rows see stay finite. In a
  ragged batch each sequence's own ``past_len[b]`` decides its slots.

A ragged batch (docs/semantics.md, Ragged batches) carries NaN canaries in every slot a
sequence must not read: its cache from its own length ``past_len[b] + q_len[b]`` to the end
of the allocation, and its padded query rows ``i >= q_len[b]``.
"""

from __future__ import annotations

import difflib
import math
import numbers
import os
import re
import sys
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

from refattn.args import FP32_MAX, FP32_TINY, MAX_ELEMENTS
from refattn.lowp import lowp_of, round_bf16
from refattn.ragged import PerSequence

import numpy as np

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

SINK_MODES = ("none", "per_head", "smooth")
CACHE_FILLS = ("clean", "nan-outside-window", "inf-outside-window")
TOP_KEYS = ("case", "defaults", "description", "complete", "derive")  # a case file's top-level keys
DERIVE_KEYS = ("from", "set", "suffix")
SPIKE_K = 2.0  # the k component a q spike multiplies (exact in every dtype)
# The largest value of each dtype: a mode component must round to a finite value.
DTYPE_MAX = {"fp16": 65504.0, "bf16": 3.3895313892515355e38, "fp32": 3.4028234663852886e38}
DTYPES = ("fp16", "bf16", "fp32")
SEED_CONTRACTS = ("decline",)
CONFIG_KEYS = ("m_tiles", "bkv")
BKV_VALUES = (32, 64)  # the kernel ABI compiles BKV in {32, 64} (docs/ARCHITECTURE.md)
M_TILES_VALUES = (1, 2, 4, 8)  # 16-row groups per block the kernels are built for
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9.-]*$")
REQUIRED = ("name", "Hq", "Hkv", "d", "sq", "why")

SINK_LOW, SINK_HIGH = -2.0, 4.0  # per-head sink logits ~ U(SINK_LOW, SINK_HIGH)
KV_PAD_MIN = 64  # spare cache capacity is 64 + (-skv) % 64 rows: never zero, tile-aligned end
OUT_CANARY_BITS = 0x7E5A  # an fp16 quiet NaN with a recognisable payload
# A case whose run needs more host memory than this is refused at load, whatever the machine
# (:attr:`Case.host_bytes`); the runner also refuses one the host it runs on cannot hold.
MAX_CASE_BYTES = 2**35
CASES_DIR_ENV = "REFATTN_CASES_DIR"


class CaseError(ValueError):
    """An invalid case or case file. The message names the file, the case and the key."""

    def __init__(self, message: str, *, file=None, case: str | None = None, key: str | None = None):
        self.file, self.case, self.key, self.reason = file, case, key, message
        where = []
        if file is not None:
            where.append(str(file))
        if case is not None:
            where.append(f"case {case!r}")
        if key is not None:
            where.append(key)
        super().__init__(": ".join(where + [message]))

    def located(self, *, file=None, case: str | None = None) -> "CaseError":
        """The same error with the file (and case, when not yet known) filled in."""
        return CaseError(self.reason, file=file if file is not None else self.file,
                         case=self.case if self.case is not None else case, key=self.key)


# --------------------------------------------------------------------------- the Case

def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _as_float(x) -> float | None:
    """A real number as a float, or None (not a number, or an int beyond the float range)."""
    if not _is_real(x):
        return None
    try:
        return float(x)
    except OverflowError:
        return None


def _short(x) -> str:
    """``repr(x)``, cut to 40 characters (a TOML integer may have hundreds of digits)."""
    text = repr(x)
    return text if len(text) <= 40 else f"{text[:20]}...{text[-8:]} ({len(text)} characters)"


@dataclass(frozen=True, kw_only=True)
class Case(PerSequence):
    """One attention call of the matrix. Construction validates (raises :class:`CaseError`)."""

    name: str
    suite: str = "adhoc"
    Hq: int
    Hkv: int
    d: int
    sq: int
    B: int = 1
    past_len: int | tuple[int, ...] = 0
    q_len: tuple[int, ...] | None = None
    window: int = -1
    sink: str = "none"
    dtype: str = "fp16"
    seed: int = 0
    scale: float | None = None
    softcap: float = 0.0
    config: dict | None = None
    spare: int | None = None
    cache_fill: str = "clean"
    logit_offset: float = 0.0
    q_spike: float = 0.0
    seed_contract: str | None = None
    why: str

    def __post_init__(self):
        name = self.name if isinstance(self.name, str) else None

        def bad(key: str, msg: str):
            raise CaseError(msg, case=name, key=key)

        if not isinstance(self.name, str) or not NAME_RE.match(self.name):
            bad("name", f"expected a string matching {NAME_RE.pattern}, got {self.name!r}")
        if not isinstance(self.suite, str) or not self.suite:
            bad("suite", f"expected a non-empty string, got {self.suite!r}")
        self._check_lengths(bad)
        for key, lo in (("Hq", 1), ("Hkv", 1), ("d", 1), ("sq", 1), ("B", 1), ("seed", 0)):
            x = getattr(self, key)
            if not _is_int(x):
                bad(key, f"expected an integer >= {lo}, got {type(x).__name__} {x!r}")
            if x < lo:
                bad(key, f"expected an integer >= {lo}, got {x}")
        if self.Hq % self.Hkv:
            bad("Hkv", f"Hq={self.Hq} query heads is not a multiple of Hkv={self.Hkv} KV heads")
        if self.spare is not None and (not _is_int(self.spare) or self.spare < 0):
            bad("spare", f"expected an integer >= 0 rows of canaries (or leave it out), got {self.spare!r}")

        q_elems = self.B * self.sq * self.Hq * self.d
        kv_elems = self.B * self.Hkv * self.skv * self.d
        if q_elems > MAX_ELEMENTS:
            bad("sq", f"q would hold B*sq*Hq*d = {q_elems} elements, over the limit of {MAX_ELEMENTS}")
        if kv_elems > MAX_ELEMENTS:
            bad("past_len", f"the cache would hold B*Hkv*skv*d = {kv_elems} elements, "
                            f"over the limit of {MAX_ELEMENTS}")
        need = self.host_bytes
        if need > MAX_CASE_BYTES:
            bad("sq", f"the run would need about {need / 2**30:.1f} GiB of host memory (inputs, "
                      f"output, fp64 reference), over the limit of {MAX_CASE_BYTES / 2**30:.0f} GiB")
        if not _is_int(self.window):
            bad("window", f"expected an integer, -1 (none) or W >= 1, got {self.window!r}")
        if self.window == 0 or self.window < -1:
            bad("window", f"expected -1 (no window) or W >= 1 keys, got {self.window}")
        if self.sink not in SINK_MODES:
            bad("sink", f"expected one of {', '.join(map(repr, SINK_MODES))}, got {self.sink!r}")
        if self.dtype not in DTYPES:
            bad("dtype", f"expected one of {', '.join(map(repr, DTYPES))}, got {self.dtype!r}")
        if self.scale is not None:
            x = _as_float(self.scale)
            if x is None or not math.isfinite(x) or x <= 0:
                bad("scale", f"expected a finite number > 0 (or leave it out), got {_short(self.scale)}")
            if not FP32_TINY <= x <= FP32_MAX:
                bad("scale", f"{x} is outside the normal float32 range the logits are computed in")
            object.__setattr__(self, "scale", x)
        x = _as_float(self.softcap)
        if x is None or not math.isfinite(x) or x < 0 or x > FP32_MAX:
            bad("softcap", f"expected a finite number >= 0 (0 = off), got {_short(self.softcap)}")
        object.__setattr__(self, "softcap", x)
        if self.config is not None:
            if not isinstance(self.config, dict):
                bad("config", f"expected a table with keys {', '.join(CONFIG_KEYS)}, got {self.config!r}")
            for k, x in self.config.items():
                if k not in CONFIG_KEYS:
                    bad(f"config.{k}", f"unknown key (known: {', '.join(CONFIG_KEYS)})")
                if not _is_int(x) or x < 1:
                    bad(f"config.{k}", f"expected an integer >= 1, got {x!r}")
            if "m_tiles" in self.config and self.config["m_tiles"] not in M_TILES_VALUES:
                bad("config.m_tiles", f"expected one of {M_TILES_VALUES}, got {self.config['m_tiles']}")
            if "bkv" in self.config and self.config["bkv"] not in BKV_VALUES:
                bad("config.bkv", f"expected one of {BKV_VALUES}, got {self.config['bkv']}")
            object.__setattr__(self, "config", dict(self.config))  # a private copy
        self._check_modes(bad)
        if self.seed_contract is not None and self.seed_contract not in SEED_CONTRACTS:
            bad("seed_contract", f"expected one of {SEED_CONTRACTS} or absent, got {self.seed_contract!r}")
        if not isinstance(self.why, str) or not self.why.strip() or "\n" in self.why.strip():
            bad("why", f"expected one non-empty line saying what bug this case catches, got {self.why!r}")

    def _check_lengths(self, bad) -> None:
        """``past_len`` (an int, or B ints) and ``q_len`` (None, or B ints in [0, sq]); lists
        are stored as tuples. Runs before the other checks: the sizes depend on them."""
        for key in ("B", "sq"):
            x = getattr(self, key)
            if not _is_int(x) or x < 1:
                bad(key, f"expected an integer >= 1, got {type(x).__name__} {x!r}")

        def per_sequence(key: str, value, hi: int | None) -> tuple[int, ...]:
            if not isinstance(value, (list, tuple)):
                bad(key, f"expected a list of B = {self.B} integers, got {type(value).__name__} "
                         f"{_short(value)}")
            if len(value) != self.B:
                bad(key, f"expected one entry per sequence, B = {self.B}, got {len(value)}")
            for b, x in enumerate(value):
                if not _is_int(x) or x < 0 or (hi is not None and x > hi):
                    want = f"an integer in [0, sq = {hi}]" if hi is not None else "an integer >= 0"
                    bad(f"{key}[{b}]", f"expected {want}, got {_short(x)}")
            return tuple(int(x) for x in value)

        if isinstance(self.past_len, (list, tuple)):
            object.__setattr__(self, "past_len", per_sequence("past_len", self.past_len, None))
        elif not _is_int(self.past_len) or self.past_len < 0:
            bad("past_len", f"expected an integer >= 0 or a list of B integers, got "
                            f"{type(self.past_len).__name__} {_short(self.past_len)}")
        if self.q_len is not None:
            object.__setattr__(self, "q_len", per_sequence("q_len", self.q_len, self.sq))
        if self.ragged and max(p + n for p, n in zip(self.past_lens, self.q_lens)) < 1:
            bad("q_len", "every sequence is empty (past_len + q_len = 0): there is no key at all")

    def _check_modes(self, bad) -> None:
        """The input modes: known values, and inputs that the case dtype can represent."""
        if self.cache_fill not in CACHE_FILLS:
            bad("cache_fill", f"expected one of {', '.join(map(repr, CACHE_FILLS))}, "
                              f"got {self.cache_fill!r}")
        if self.cache_fill != "clean" and self.hidden_slots == 0:
            bad("cache_fill", f"{self.cache_fill!r} needs key slots no row can see: a window "
                              f"W >= 1 with past_len - W + 1 > 0, got window={self.window}, "
                              f"past_len={_short(self.past_len)}")
        for key in ("logit_offset", "q_spike"):
            x = _as_float(getattr(self, key))
            if x is None or not math.isfinite(x):
                bad(key, f"expected a finite number (0 = off), got {_short(getattr(self, key))}")
            object.__setattr__(self, key, x)
        if self.logit_offset and self.q_spike and self.d < 2:
            bad("q_spike", "logit_offset and q_spike need two components: d >= 2")
        top = DTYPE_MAX[self.dtype]
        if abs(self.q_spike) > top:
            bad("q_spike", f"{self.q_spike:g} is beyond the {self.dtype} range (max {top:g})")
        if self.logit_offset:
            a, b = offset_components(self)
            if not (math.isfinite(a) and math.isfinite(b) and a and b):
                bad("logit_offset", f"{self.logit_offset:g} needs q and k components "
                                    f"{a:g} and {b:g}, not finite non-zero {self.dtype} values")
        shift = logit_shift(self)
        if not abs(shift) < FP32_MAX / 4:
            bad("logit_offset", f"the logits would be shifted by {shift:g}, beyond fp32")
        if self.sink == "per_head" and abs(shift) + max(-SINK_LOW, SINK_HIGH) > 65504:
            bad("logit_offset", f"the per-head sinks move with the logits ({shift:g}) and must "
                                f"stay within the fp16 range the kernel ABI carries them in")

    @property
    def seq_lens(self) -> tuple[int, ...]:
        """Each sequence's keys after the chunk: ``past_len[b] + q_len[b]``."""
        return tuple(p + n for p, n in zip(self.past_lens, self.q_lens))

    @property
    def hidden_slots_per_seq(self) -> tuple[int, ...]:
        """Per sequence, the key slots no row of its chunk can see: left of its first row's
        window, ``max(0, past_len[b] - W + 1)`` (0 without a window)."""
        if self.window < 0:
            return (0,) * self.B
        return tuple(max(0, p - self.window + 1) for p in self.past_lens)

    @property
    def hidden_slots(self) -> int:
        """Key slots of the cache that no row of the chunk can see: left of the first row's
        window, ``max(0, past_len - W + 1)`` (0 without a window); in a ragged batch the
        largest of :attr:`hidden_slots_per_seq`."""
        return max(self.hidden_slots_per_seq)

    @property
    def lowp(self) -> str:
        """The 16-bit format of the gate's baseline: bf16 for bf16 inputs, else fp16
        (``refattn.lowp.lowp_of``)."""
        return lowp_of(self.dtype)

    @property
    def scale_value(self) -> float:
        """The logit scale in force: ``scale``, or 1/sqrt(d)."""
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.d)

    def __hash__(self):  # config is a dict; hash its items (cases key the reference cache)
        cfg = None if self.config is None else tuple(sorted(self.config.items()))
        return hash(tuple(cfg if f.name == "config" else getattr(self, f.name) for f in fields(self)))

    @property
    def G(self) -> int:
        """Query heads per KV head."""
        return self.Hq // self.Hkv

    @property
    def skv(self) -> int:
        """Keys in the cache after this chunk is appended: past_len + sq (ragged: the longest
        sequence's ``past_len[b] + q_len[b]``)."""
        return max(self.seq_lens) if self.ragged else self.past_len + self.sq

    @property
    def s_cap(self) -> int:
        """Allocated cache rows: skv plus ``spare`` rows of NaN canaries (default 64..127)."""
        if self.spare is not None:
            return self.skv + self.spare
        return self.skv + KV_PAD_MIN + (-self.skv) % KV_PAD_MIN

    @property
    def host_bytes(self) -> int:
        """Host memory a run of this case takes at its peak, roughly: q, k and v drawn in fp32
        and rounded (with the canary rows), the canary output, and the fp64 reference with its
        fp16 baseline."""
        item = 2 if self.dtype == "fp16" else 4
        q = self.B * self.sq * self.Hq * self.d
        kv = self.B * self.Hkv * self.d
        return q * (4 + item + 2 + 8 + 2) + 2 * kv * (self.skv * 4 + self.s_cap * item)

    def _pairs(self, past: int, n: int) -> int:
        p = np.arange(past, past + n, dtype=np.int64)
        k = p + 1 if self.window < 0 else np.minimum(p + 1, self.window)
        return int(k.sum())

    @property
    def visible_pairs(self) -> int:
        """(query row, key) pairs that are visible, summed over the batch's sequences, per
        head: row i of sequence b sees min(p + 1, W) keys with p = past_len[b] + i (p + 1
        without a window); padded rows see none."""
        return sum(self._pairs(p, n) for p, n in zip(self.past_lens, self.q_lens))

    @property
    def flops(self) -> int:
        """Useful FLOPs: 4 * Hq * d * visible_pairs (2 per multiply-add, in S = QK^T and in
        O = PV; masked pairs and padded rows are not counted)."""
        return 4 * self.Hq * self.d * self.visible_pairs

    @property
    def id(self) -> str:
        return f"{self.suite}/{self.name}"

    def describe(self) -> str:
        """Geometry and options in one short line, e.g. ``Hq64/Hkv8 d64 B1 sq512 past8192 w128 sink``."""
        def lens(x) -> str:
            return ",".join(map(str, x)) if isinstance(x, tuple) else str(x)

        parts = [f"Hq{self.Hq}/Hkv{self.Hkv}", f"d{self.d}", f"B{self.B}", f"sq{self.sq}",
                 f"past{lens(self.past_len)}"]
        if self.q_len is not None:
            parts.append(f"qlen{lens(self.q_len)}")
        if self.window > 0:
            parts.append(f"w{self.window}")
        if self.sink != "none":
            parts.append(self.sink)
        if self.dtype != "fp16":
            parts.append(self.dtype)
        if self.scale is not None:
            parts.append(f"scale={self.scale:g}")
        if self.softcap:
            parts.append(f"softcap={self.softcap:g}")
        if self.config:
            parts.append(",".join(f"{k}={v}" for k, v in sorted(self.config.items())))
        if self.spare is not None:
            parts.append(f"spare={self.spare}")
        if self.cache_fill != "clean":
            parts.append(f"fill={self.cache_fill}")
        if self.logit_offset:
            parts.append(f"offset={self.logit_offset:g}")
        if self.q_spike:
            parts.append(f"spike={self.q_spike:g}")
        return " ".join(parts)

    def to_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------- case files

_KEYS = tuple(f.name for f in fields(Case) if f.name != "suite")


# The suites ship twice: as ``cases/`` beside pyproject.toml in a source tree, and as the
# package data ``refattn/suites/`` of a wheel (pyproject maps the package onto ``cases/``).
SOURCE_CASES = Path(__file__).resolve().parent.parent / "cases"
PACKAGED_CASES = "suites"


def cases_dir() -> Path:
    """The directory holding ``<suite>.toml`` files: ``$REFATTN_CASES_DIR`` when set; else the
    source tree's ``cases/`` when refattn is imported from a source tree (a ``pyproject.toml``
    and a ``cases/`` directory beside the package); else the installed package data,
    ``refattn/suites/``. Whichever it is, a suite not found there is reported with it."""
    env = os.environ.get(CASES_DIR_ENV)
    if env:
        return Path(env)
    if SOURCE_CASES.is_dir() and (SOURCE_CASES.parent / "pyproject.toml").is_file():
        return SOURCE_CASES
    import importlib.resources

    data = importlib.resources.files(__package__ or "refattn").joinpath(PACKAGED_CASES)
    # A wheel installs unpacked, so this is a directory on disk; the suites are read as files
    # (a zipped import is not supported, and its path is then reported as not found).
    return data if isinstance(data, Path) else Path(str(data))


def list_suites(directory: Path | None = None) -> list[str]:
    """Names of the suites in ``directory`` (default :func:`cases_dir`), sorted."""
    d = Path(directory) if directory is not None else cases_dir()
    return sorted(p.stem for p in d.glob("*.toml")) if d.is_dir() else []


def suite_path(name_or_path) -> Path:
    """A suite name (``seed``) resolved in :func:`cases_dir`, or a path to a ``.toml`` file."""
    s = str(name_or_path)
    if s.endswith(".toml") or os.sep in s or "/" in s:
        p = Path(s)
        if not p.is_file():
            raise CaseError("no such case file", file=p)
        return p
    p = cases_dir() / f"{s}.toml"
    if not p.is_file():
        known = ", ".join(list_suites()) or "none"
        raise CaseError(f"unknown suite {s!r} (known in {cases_dir()}: {known})", file=p)
    return p


def _unknown_key(key: str, known) -> str:
    near = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return f"unknown key{hint} (known: {', '.join(known)})"


def _read_toml(path: Path) -> dict:
    """A case file's TOML document; CaseError naming the file when it cannot be read, is not
    UTF-8, or is not TOML."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise CaseError(f"cannot read: {e.strerror or e}", file=path) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise CaseError(f"not UTF-8 text: byte {data[e.start]:#04x} at line {line}", file=path) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise CaseError(f"not valid TOML: {e}", file=path) from None


def load_suite(path, *, suite: str | None = None) -> list[Case]:
    """Load and validate one case file (a path or a suite name). The suite is the file's stem."""
    path = suite_path(path)
    suite = suite or path.stem
    doc = _read_toml(path)
    for key in doc:
        if key not in TOP_KEYS:
            raise CaseError(_unknown_key(key, TOP_KEYS), file=path, key=key)
    if "description" in doc and not isinstance(doc["description"], str):
        raise CaseError("expected a string", file=path, key="description")
    if "complete" in doc and not isinstance(doc["complete"], bool):
        raise CaseError("expected true or false", file=path, key="complete")
    defaults = doc.get("defaults", {})
    if not isinstance(defaults, dict):
        raise CaseError("expected a table [defaults]", file=path, key="defaults")
    for key in defaults:
        if key in ("name", "why"):
            raise CaseError("belongs to each case, not to [defaults]", file=path, case="defaults", key=key)
        if key not in _KEYS:
            raise CaseError(_unknown_key(key, _KEYS), file=path, case="defaults", key=key)
    tables = doc.get("case", [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise CaseError("expected an array of tables [[case]]", file=path, key="case")
    derived = _derived_cases(doc["derive"], path, suite) if "derive" in doc else []
    if not tables and not derived:
        raise CaseError("no [[case]] tables", file=path, key="case")

    cases, seen = [], set()
    for case in derived:
        if case.name in seen:
            raise CaseError("duplicate case name in this file", file=path, case=case.name, key="name")
        seen.add(case.name)
        cases.append(case)
    for i, table in enumerate(tables):
        raw = table.get("name")
        label = raw if isinstance(raw, str) else f"#{i + 1}"
        for key in table:
            if key not in _KEYS:
                raise CaseError(_unknown_key(key, _KEYS), file=path, case=label, key=key)
        merged = {**defaults, **table}
        for key in REQUIRED:
            if key not in merged:
                raise CaseError("required key is missing", file=path, case=label, key=key)
        try:
            case = Case(suite=suite, **merged)
        except CaseError as e:
            raise e.located(file=path, case=label) from None
        if case.name in seen:
            raise CaseError("duplicate case name in this file", file=path, case=case.name, key="name")
        seen.add(case.name)
        cases.append(case)
    return cases


def _derived_cases(derive, path: Path, suite: str) -> list[Case]:
    """The cases of a ``[derive]`` table: each case of the ``from`` suites (found beside
    ``path``) with the keys of ``set`` and its name suffixed."""
    if not isinstance(derive, dict):
        raise CaseError("expected a table [derive]", file=path, key="derive")
    for key in derive:
        if key not in DERIVE_KEYS:
            raise CaseError(_unknown_key(key, DERIVE_KEYS), file=path, key=f"derive.{key}")
    sources, setting = derive.get("from"), derive.get("set", {})
    suffix = derive.get("suffix")
    if not isinstance(sources, list) or not sources or not all(isinstance(x, str) for x in sources):
        raise CaseError("expected a non-empty list of suite names", file=path, key="derive.from")
    if not isinstance(setting, dict):
        raise CaseError("expected a table of case keys", file=path, key="derive.set")
    for key in setting:
        if key not in _KEYS or key in ("name", "why"):
            known = [k for k in _KEYS if k not in ("name", "why")]
            raise CaseError(_unknown_key(key, known), file=path, key=f"derive.set.{key}")
    if not isinstance(suffix, str) or not NAME_RE.match("x" + suffix):
        raise CaseError(f"expected a string of name characters ({NAME_RE.pattern}), got {suffix!r}",
                        file=path, key="derive.suffix")
    out = []
    for name in sources:
        source = path.parent / f"{name}.toml"
        if source.resolve() == path.resolve() or not source.is_file():
            why = "is this file" if source.is_file() else "is not a suite beside this file"
            raise CaseError(f"{name!r} {why}", file=path, key="derive.from")
        if "derive" in _read_toml(source):
            raise CaseError(f"{name!r} is itself derived; derive from the suites it derives from",
                            file=path, key="derive.from")
        for c in load_suite(source):
            fields_ = {**case_fields(c), **setting, "name": c.name + suffix}
            try:
                out.append(Case(suite=suite, **fields_))
            except CaseError as e:
                raise e.located(file=path, case=fields_["name"]) from None
    return out


INLINE_SUITE = "inline"


def case_from_text(text: str, *, name: str = "inline") -> Case:
    """A case given on the command line as the body of a TOML inline table, e.g.
    ``Hq = 8, Hkv = 2, d = 64, sq = 3, past_len = 5, window = 2, sink = "per_head"``
    (``name`` and ``why`` may be left out). :class:`CaseError` naming the key otherwise."""
    if not isinstance(text, str) or not text.strip():
        raise CaseError("expected KEY = VALUE pairs, e.g. 'Hq = 8, Hkv = 2, d = 64, sq = 16'", case=name)
    try:
        table = tomllib.loads(f"case = {{ {text.strip()} }}")["case"]
    except tomllib.TOMLDecodeError as e:
        raise CaseError(f"not a TOML inline table body ({e}); strings need quotes: "
                        "sink = \"per_head\"", case=name) from None
    for key in table:
        if key not in _KEYS:
            raise CaseError(_unknown_key(key, _KEYS), case=name, key=key)
    table = {"name": name, "why": "given on the command line", **table}
    for key in REQUIRED:
        if key not in table:
            raise CaseError("required key is missing", case=name, key=key)
    return Case(suite=INLINE_SUITE, **table)


def _toml_value(x) -> str:
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, str):
        return '"' + x.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(x, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in x.items()) + " }"
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in x) + "]"
    return repr(x)


def case_fields(case: Case) -> dict:
    """The keys of ``case`` that differ from their defaults, in field order (``name`` and
    ``why`` always): what a case file or ``--case`` needs to rebuild it."""
    out = {}
    for f in fields(Case):
        if f.name == "suite":
            continue
        v = getattr(case, f.name)
        if f.name in REQUIRED or f.default is MISSING or v != f.default:
            out[f.name] = v
    return out


def case_to_toml(case: Case) -> str:
    """``case`` as a ``[[case]]`` table, ready to paste into a case file."""
    return "[[case]]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in case_fields(case).items())


def case_to_inline(case: Case) -> str:
    """``case`` as the body of an inline table (:func:`case_from_text` reads it back),
    without ``name`` and ``why``."""
    return ", ".join(f"{k} = {_toml_value(v)}" for k, v in case_fields(case).items()
                     if k not in ("name", "why"))


def load_suites(names=None) -> list[Case]:
    """Load several suites (names or paths; default: every suite in :func:`cases_dir`).
    Case names must be unique across them all: they are pytest ids and report keys."""
    names = list_suites() if names is None else list(dict.fromkeys(str(n) for n in names))
    cases, where = [], {}
    for n in names:
        path = suite_path(n)
        for c in load_suite(path):
            if c.name in where:
                raise CaseError(f"duplicate case name (also in {where[c.name]})", file=path,
                                case=c.name, key="name")
            where[c.name] = path
            cases.append(c)
    return cases


def suite_description(name_or_path) -> str:
    """The optional top-level ``description`` of a case file ('' when absent)."""
    return str(_read_toml(suite_path(name_or_path)).get("description", ""))


def suite_complete(name_or_path) -> bool:
    """The optional top-level ``complete`` of a case file (False when absent): the suite
    claims to hit every required cell of the coverage model (``refattn.coverage``)."""
    value = _read_toml(suite_path(name_or_path)).get("complete", False)
    if not isinstance(value, bool):
        raise CaseError("expected true or false", file=suite_path(name_or_path), key="complete")
    return value


# --------------------------------------------------------------------------- inputs

def round_through(x, dtype: str) -> np.ndarray:
    """``x`` rounded through the case dtype: fp16 -> float16, bf16 -> float32 holding bf16
    values (NumPy has no bfloat16), fp32 -> float32."""
    if dtype == "fp16":
        return np.asarray(x).astype(np.float16)
    if dtype == "bf16":
        return round_bf16(x)
    if dtype == "fp32":
        return np.asarray(x).astype(np.float32)
    raise ValueError(f"dtype: expected one of {DTYPES}, got {dtype!r}")


_OFFSET_SEARCH = 64  # dtype steps of ``a`` either side of sqrt(|T| / scale) (offset_components)


def offset_components(case: Case) -> tuple[float, float]:
    """The q and k components ``(a, b)`` (component 0) that give every logit of
    ``case`` the common shift ``scale * a * b`` of its ``logit_offset`` T. The target is T16,
    the fp16 value nearest T (T itself beyond the fp16 range), so that a per-head sink moved
    by the shift keeps its place relative to the logits (the sink is fp16). ``a`` is one of
    the dtype values within 64 steps of ``sqrt(|T| / scale)``, ``b`` the dtype value nearest
    ``T16 / (scale * a)`` or one step either side; the pair whose shift lies nearest T16 is
    taken. ``(0, 0)`` when the offset is off."""
    T = case.logit_offset
    if not T:
        return 0.0, 0.0
    scale = case.scale_value
    with np.errstate(over="ignore", invalid="ignore"):
        a0 = round_through(np.float64(math.sqrt(abs(T) / scale)), case.dtype)
        if not np.isfinite(a0) or not a0:
            return float(a0), 0.0
        lo, hi = a0, a0
        cands = [a0]
        for _ in range(_OFFSET_SEARCH):
            lo = _next_value(lo, -1, case.dtype)
            hi = _next_value(hi, 1, case.dtype)
            cands += [lo, hi]
        target = float(np.float16(T)) if abs(T) <= 65504 else T
        best = None
        for a in cands:
            a = float(a)
            if not (math.isfinite(a) and a > 0):
                continue
            b0 = round_through(np.float64(target / (scale * a)), case.dtype)
            for b in (b0, _next_value(b0, -1, case.dtype), _next_value(b0, 1, case.dtype)):
                b = float(b)
                if not (math.isfinite(b) and b):
                    continue
                shift = scale * a * b
                key = (abs(shift - target), abs(shift - T), a)
                if best is None or key < best[0]:
                    best = (key, a, b)
    return (best[1], best[2]) if best else (float(a0), 0.0)


def _next_value(x, direction: int, dtype: str):
    """The next value of ``dtype`` after ``x`` towards +inf (``direction`` 1) or -inf."""
    if dtype == "fp16":
        return np.nextafter(np.float16(x), np.float16(direction * np.inf))
    if dtype == "fp32":
        return np.nextafter(np.float32(x), np.float32(direction * np.inf))
    u = np.asarray(x, dtype=np.float32).reshape(1).view(np.uint32)  # bf16: the top 16 bits
    step = np.uint32(1 << 16)
    u = u + step if (direction > 0) == (float(x) >= 0) else u - step
    return u.view(np.float32)[0]


def spike_index(case: Case) -> int:
    """The component a q spike sits in: 0, or 1 when the logit offset holds component 0."""
    return 1 if case.logit_offset else 0


def spike_component(case: Case) -> float:
    """The q component 0 of ``case`` under ``q_spike``: the spike rounded through the dtype."""
    if not case.q_spike:
        return 0.0
    return float(round_through(np.float64(case.q_spike), case.dtype))


def logit_shift(case: Case) -> float:
    """The common shift every logit of ``case`` gains from its input modes, in fp64:
    ``scale * (a * b + 2 * spike)`` (:func:`offset_components`, :func:`spike_component`)."""
    a, b = offset_components(case)
    return case.scale_value * (a * b + SPIKE_K * spike_component(case))


def canary_out(shape) -> np.ndarray:
    """A float16 buffer of ``shape`` with every element set to the canary NaN 0x7E5A."""
    return np.full(shape, OUT_CANARY_BITS, dtype=np.uint16).view(np.float16)


@dataclass(eq=False)
class Inputs:
    """A case's arrays, as a kernel sees them.

    q: (B, Sq, Hq, d)      rounded through the case dtype
    k, v: (B, Hkv, S_cap, d)  rows [0, skv) are the cache, rows [skv, S_cap) NaN canaries
    sink: (Hq,) float16 or None
    out: (B, Sq, Hq, d) float16, every element the canary NaN 0x7E5A
    past_len: an int, or for a ragged case an int64 array (B,) of each sequence's past_len
    q_len: None, or for a ragged case an int64 array (B,) of each sequence's valid rows
    (then sequence b's cache holds NaN canaries from past_len[b] + q_len[b] on, and its
    padded rows of q are NaN)
    """

    case: Case
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    sink: np.ndarray | None
    smooth_softmax: bool
    past_len: int | np.ndarray
    window: int
    scale: float | None
    softcap: float
    config: dict | None
    dtype: str
    out: np.ndarray
    q_len: np.ndarray | None = None

    @property
    def ragged(self) -> bool:
        return self.q_len is not None

    @property
    def skv(self) -> int:
        """Keys of the cache (ragged: of the longest sequence)."""
        if self.q_len is not None:
            return int((self.past_len + self.q_len).max())
        return self.past_len + self.q.shape[1]

    def clean_kv(self) -> tuple[np.ndarray, np.ndarray]:
        """``k, v`` cut to ``skv`` rows (views, no canaries): what the reference sees."""
        return self.k[:, :, : self.skv], self.v[:, :, : self.skv]

    def fresh_out(self) -> np.ndarray:
        """A new canary-filled output buffer of the right shape."""
        return canary_out(self.q.shape)

    def out_intact(self, buf: np.ndarray | None = None) -> bool:
        """True iff ``buf`` (default ``self.out``) is byte-identical to a fresh canary buffer."""
        buf = self.out if buf is None else buf
        fresh = self.fresh_out()
        return buf.shape == fresh.shape and buf.dtype == fresh.dtype and buf.tobytes() == fresh.tobytes()

    def reference_kwargs(self) -> dict:
        """Keyword arguments for ``refattn.attention`` / ``attention_with_baseline``."""
        return dict(past_len=self.past_len, q_len=self.q_len, window=self.window, sink=self.sink,
                    smooth_softmax=self.smooth_softmax, softcap=self.softcap, scale=self.scale)


def make_inputs(case: Case) -> Inputs:
    """Deterministic inputs for ``case`` (a pure function of the case; see module docstring)."""
    rng = np.random.default_rng(case.seed)
    B, Sq, Hq, Hkv, d, skv = case.B, case.sq, case.Hq, case.Hkv, case.d, case.skv

    def normal(shape):
        return round_through(rng.standard_normal(shape, dtype=np.float32), case.dtype)

    q = normal((B, Sq, Hq, d))
    k_clean = normal((B, Hkv, skv, d))
    v_clean = normal((B, Hkv, skv, d))
    k = np.full((B, Hkv, case.s_cap, d), np.nan, dtype=q.dtype)
    v = np.full_like(k, np.nan)
    k[:, :, :skv] = k_clean
    v[:, :, :skv] = v_clean
    sink = None
    if case.sink == "per_head":
        u = rng.uniform(SINK_LOW, SINK_HIGH, Hq)
        shift = logit_shift(case)
        sink = (u + shift if shift else u).astype(np.float16)
    if case.logit_offset:
        a, b = offset_components(case)
        q[..., 0] = a
        k[:, :, :skv, 0] = b
    if case.q_spike:
        c = spike_index(case)
        q[..., c] = spike_component(case)
        k[:, :, :skv, c] = SPIKE_K
    for b, hidden in enumerate(case.hidden_slots_per_seq):
        if case.cache_fill == "nan-outside-window":
            k[b, :, :hidden] = np.nan
            v[b, :, :hidden] = np.nan
        elif case.cache_fill == "inf-outside-window":
            signs = np.where(np.arange(hidden) % 2 == 0, np.inf, -np.inf).astype(q.dtype)
            k[b, :, :hidden] = signs[:, None]
            v[b, :, :hidden] = signs[:, None]
    past_len, q_len = case.past_len, None
    if case.ragged:
        past_len = np.array(case.past_lens, dtype=np.int64)
        q_len = np.array(case.q_lens, dtype=np.int64)
        for b, (n, end) in enumerate(zip(case.q_lens, case.seq_lens)):
            k[b, :, end:] = np.nan  # slots past the sequence's own length
            v[b, :, end:] = np.nan
            q[b, n:] = np.nan  # padded rows
    return Inputs(
        case=case, q=q, k=k, v=v, sink=sink, smooth_softmax=case.sink == "smooth",
        past_len=past_len, window=case.window, scale=case.scale, softcap=case.softcap,
        config=None if case.config is None else dict(case.config), dtype=case.dtype,
        out=canary_out((B, Sq, Hq, d)), q_len=q_len,
    )
