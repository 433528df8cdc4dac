"""Where a kernel's warps spend their time, instruction by instruction, from Nsight Compute's
warp stall sampling. Reads the SASS listing of a report taken with the source-level sections,

    ncu --clock-control none --section WarpStateStats --section SourceCounters \\
        -k gqa_flash_prefill -s 2 -c 1 -o REP python3 scripts/ncu_profile.py SHAPE --config C
    ncu --import REP.ncu-rep --page source --csv --print-source sass > REP-sass.csv

(``OUT=dir SOURCE=1 bash scripts/ncu_h200.sh "SHAPE CONFIG"`` does both) and prints the share of
the stall samples by stall reason and by opcode, and, with ``--phase``, by stretches of the
listing:

    python scripts/ncu_sass_stalls.py REP-sass.csv
    python scripts/ncu_sass_stalls.py REP-sass.csv --lines 3e6        # the hot lines, indexed
    python scripts/ncu_sass_stalls.py REP-sass.csv --phase exp2=1140-1206 --phase max=980-1068

A phase is NAME=FIRST-LAST, line indices of the listing as ``--lines`` prints them (both
included): the stretches of a loop (its wgmma issue, its exp2, ...) are read off that listing.
Every share is of all the samples of the kernel, its producer warps' included. ``--json PATH``
also writes the numbers.

Two kernels side by side, per unit of work: ``--per OPCODE=N`` counts the units as the
executions of OPCODE over N (``--per MUFU.EX2=66``: a warp's KV tile of 64 scores and two
alphas), and ``--against OTHER.csv`` prints each opcode's executions a unit and stall
samples in both listings (the other's units by the same rule):

    python scripts/ncu_sass_stalls.py ours-sass.csv --against fa4-sass.csv --per MUFU.EX2=66

The comparison also prints the samples of each stall reason in both listings, and with
``--reason NAME`` (repeatable: ``wait``, ``math``, ...) the opcodes by that reason's samples
in both: where one kernel's warps wait that the other's do not.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
_PHASE = re.compile(r"(?P<name>[\w.-]+)=(?P<first>\d+)-(?P<last>\d+)\Z")


@dataclass
class Line:
    index: int
    source: str
    samples: int
    executed: int
    stalls: dict = field(default_factory=dict)  # reason (without "stall_") -> samples

    @property
    def opcode(self) -> str:
        """The opcode without its predicate and modifiers: ``@!P0 MUFU.EX2 R4, R4`` -> MUFU."""
        words = self.source.split()
        if words and words[0].startswith("@"):
            words = words[1:]
        return words[0].split(".")[0] if words else "?"


def _int(text: str) -> int:
    text = text.strip().replace(",", "")
    return int(float(text)) if text not in ("", "-") else 0


def read(path) -> list[Line]:
    """The SASS lines of an ``ncu --page source --csv --print-source sass`` export, in order;
    ValueError naming the file when it has no such listing."""
    path = Path(path)
    try:
        rows = list(csv.reader(path.open(newline="")))
    except OSError as e:
        raise ValueError(f"csv: cannot read {path}: {e.strerror}") from None
    at = next((i for i, r in enumerate(rows) if r[:2] == ["Address", "Source"]), None)
    if at is None or SAMPLES not in rows[at] or EXECUTED not in rows[at]:
        raise ValueError(f"csv: {path} is not a SASS listing with warp stall sampling (export it "
                         f"with: ncu --import REP.ncu-rep --page source --csv --print-source sass)")
    header = rows[at]
    col = {name: i for i, name in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "(Not Issued)" not in h]
    lines = []
    for row in rows[at + 1:]:
        if len(row) < len(header):
            continue
        lines.append(Line(len(lines), row[col["Source"]].strip(), _int(row[col[SAMPLES]]),
                          _int(row[col[EXECUTED]]),
                          {r[len("stall_"):]: _int(row[col[r]]) for r in reasons}))
    if not lines:
        raise ValueError(f"csv: {path} lists no SASS lines")
    return lines


def parse_phase(spec: str) -> tuple[str, int, int]:
    m = _PHASE.match(spec.strip())
    if m is None or int(m["first"]) > int(m["last"]):
        raise ValueError(f"phase: expected NAME=FIRST-LAST (line indices, FIRST <= LAST), got {spec!r}")
    return m["name"], int(m["first"]), int(m["last"])


def summary(lines: list[Line], phases=()) -> dict:
    """Samples by stall reason, by opcode and by phase, each with its share of the total."""
    total = sum(x.samples for x in lines)

    def share(n: int) -> float:
        return n / total if total else 0.0

    reasons: dict[str, int] = {}
    opcodes: dict[str, dict] = {}
    for x in lines:
        for r, n in x.stalls.items():
            reasons[r] = reasons.get(r, 0) + n
        o = opcodes.setdefault(x.opcode, {"samples": 0, "executed": 0, "stalls": {}})
        o["samples"] += x.samples
        o["executed"] += x.executed
        for r, n in x.stalls.items():
            o["stalls"][r] = o["stalls"].get(r, 0) + n
    for o in opcodes.values():
        o["wait"] = o["stalls"].get("wait", 0)
        o["share"], o["wait_share"] = share(o["samples"]), share(o["wait"])
    out_phases = {}
    for name, first, last in phases:
        if last >= len(lines):
            raise ValueError(f"phase: {name}={first}-{last} is past the listing's last line "
                             f"{len(lines) - 1}")
        n = sum(x.samples for x in lines[first:last + 1])
        out_phases[name] = {"first": first, "last": last, "samples": n, "share": share(n)}
    return {"samples": total, "lines": len(lines),
            "reasons": {r: {"samples": n, "share": share(n)}
                        for r, n in sorted(reasons.items(), key=lambda kv: -kv[1])},
            "opcodes": dict(sorted(opcodes.items(), key=lambda kv: -kv[1]["samples"])),
            "phases": out_phases}


_PER = re.compile(r"(?P<op>[A-Z0-9_.]+)=(?P<n>\d+(\.\d+)?)\Z")


def parse_per(spec: str) -> tuple[str, float]:
    """``OPCODE=N`` (an opcode, with modifiers where given: ``MUFU.EX2=66``) -> (opcode, N)."""
    m = _PER.match(spec.strip())
    if m is None or float(m["n"]) <= 0:
        raise ValueError(f"per: expected OPCODE=N (an opcode as the listing spells it, N > 0), got {spec!r}")
    return m["op"], float(m["n"])


def _mnemonic(x: Line) -> str:
    """The opcode with its modifiers, without the predicate: ``@P1 MUFU.EX2 R4, R4`` -> MUFU.EX2."""
    words = x.source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0] if words else "?"


def units(lines: list[Line], per: tuple[str, float]) -> float:
    """The units of work of a listing: the executions of ``per``'s opcode (the whole mnemonic
    where it names modifiers, else the opcode) over its N; ValueError when none ran."""
    op, n = per
    count = sum(x.executed for x in lines if (_mnemonic(x) if "." in op else x.opcode) == op)
    if count == 0:
        raise ValueError(f"per: no {op} was executed in this listing")
    return count / n


def compare(lines: list[Line], other: list[Line], per: tuple[str, float], reasons=()) -> dict:
    """Opcode by opcode, executions a unit of work (``units``) and stall samples of two
    listings, the opcodes with the most samples in both first; the samples of every stall
    reason in both; and for each of ``reasons``, the opcodes by that reason's samples in both
    (most first)."""
    a, b = summary(lines), summary(other)
    ua, ub = units(lines, per), units(other, per)
    ops = sorted(set(a["opcodes"]) | set(b["opcodes"]),
                 key=lambda o: -(a["opcodes"].get(o, {}).get("samples", 0) + b["opcodes"].get(o, {}).get("samples", 0)))
    rows = {}
    for o in ops:
        x, y = a["opcodes"].get(o, {}), b["opcodes"].get(o, {})
        rows[o] = {"per_unit": [x.get("executed", 0) / ua, y.get("executed", 0) / ub],
                   "samples": [x.get("samples", 0), y.get("samples", 0)]}
    both = sorted(set(a["reasons"]) | set(b["reasons"]),
                  key=lambda r: -(a["reasons"].get(r, {}).get("samples", 0) + b["reasons"].get(r, {}).get("samples", 0)))
    by_reason = {}
    for r in reasons:
        if r not in both:
            raise ValueError(f"reason: no stall reason {r!r} in either listing (they have: {', '.join(both)})")
        n = {o: [a["opcodes"].get(o, {}).get("stalls", {}).get(r, 0),
                 b["opcodes"].get(o, {}).get("stalls", {}).get(r, 0)] for o in ops}
        by_reason[r] = dict(sorted(((o, v) for o, v in n.items() if any(v)), key=lambda kv: -sum(kv[1])))
    return {"per": {"opcode": per[0], "n": per[1]}, "units": [ua, ub],
            "samples": [a["samples"], b["samples"]],
            "executed_per_unit": [sum(x.executed for x in lines) / ua, sum(x.executed for x in other) / ub],
            "opcodes": rows,
            "reasons": {r: [a["reasons"].get(r, {}).get("samples", 0), b["reasons"].get(r, {}).get("samples", 0)]
                        for r in both},
            "by_reason": by_reason}


def hot_lines(lines: list[Line], min_executed: float) -> list[Line]:
    return [x for x in lines if x.executed >= min_executed]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", help="ncu --import REP.ncu-rep --page source --csv --print-source sass")
    ap.add_argument("--phase", action="append", default=[], metavar="NAME=FIRST-LAST",
                    help="a stretch of the listing (line indices, both included); repeatable")
    ap.add_argument("--lines", type=float, default=None, metavar="N",
                    help="also list the lines executed at least N times, with their index")
    ap.add_argument("--top", type=int, default=15, help="opcodes and reasons listed (default 15)")
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    ap.add_argument("--per", default=None, metavar="OPCODE=N",
                    help="a unit of work: N executions of OPCODE (e.g. MUFU.EX2=66); with --against")
    ap.add_argument("--against", type=Path, default=None, metavar="OTHER.csv",
                    help="another kernel's listing: executions a unit and samples, opcode by opcode")
    ap.add_argument("--reason", action="append", default=[], metavar="NAME",
                    help="with --against: the opcodes by this stall reason's samples in both (e.g. "
                         "wait, math); repeatable")
    args = ap.parse_args(argv)
    if (args.per is None) != (args.against is None):
        print("ncu_sass_stalls: error: --per and --against go together (the unit of work the two "
              "listings are compared by)", file=sys.stderr)
        return 2
    if args.reason and args.against is None:
        print("ncu_sass_stalls: error: --reason compares two listings: give --against and --per",
              file=sys.stderr)
        return 2
    try:
        lines = read(args.csv)
        phases = [parse_phase(p) for p in args.phase]
        doc = summary(lines, phases)
        if args.against is not None:
            doc["against"] = {"csv": str(args.against),
                              **compare(lines, read(args.against), parse_per(args.per), args.reason)}
    except ValueError as e:
        print(f"ncu_sass_stalls: error: {e}", file=sys.stderr)
        return 2
    print(f"{args.csv}: {doc['samples']} samples over {doc['lines']} SASS lines")
    print("by stall reason:")
    for r, v in list(doc["reasons"].items())[:args.top]:
        print(f"  {r:20s} {v['samples']:9d} {100 * v['share']:5.1f} %")
    print("by opcode (samples, of them 'wait', executed):")
    for o, v in list(doc["opcodes"].items())[:args.top]:
        print(f"  {o:12s} {100 * v['share']:5.1f} % {100 * v['wait_share']:5.1f} % {v['executed']:14,d}")
    if doc["phases"]:
        print("by phase:")
        for name, v in doc["phases"].items():
            print(f"  {name:20s} lines {v['first']}-{v['last']}: {v['samples']:9d} {100 * v['share']:5.1f} %")
    if "against" in doc:
        c = doc["against"]
        unit = f"{c['per']['n']:g} {c['per']['opcode']}"
        print(f"against {args.against}: {c['samples'][0]} samples against {c['samples'][1]} "
              f"({c['samples'][0] / max(c['samples'][1], 1):.3f}x); a unit = {unit}: "
              f"{c['units'][0]:,.0f} units against {c['units'][1]:,.0f}")
        print(f"  {'opcode':12s} {'executed a unit':>21s} {'stall samples':>19s}")
        print(f"  {'(all)':12s} {c['executed_per_unit'][0]:10.1f} {c['executed_per_unit'][1]:10.1f}")
        for o, v in list(c["opcodes"].items())[:args.top]:
            print(f"  {o:12s} {v['per_unit'][0]:10.1f} {v['per_unit'][1]:10.1f} "
                  f"{v['samples'][0]:9d} {v['samples'][1]:9d}")
        print("  by stall reason (samples in each):")
        for r, (x, y) in list(c["reasons"].items())[:args.top]:
            print(f"  {r:20s} {x:12d} {y:9d}")
        for r, rows in c["by_reason"].items():
            print(f"  opcodes by '{r}' samples:")
            for o, (x, y) in list(rows.items())[:args.top]:
                print(f"  {o:20s} {x:12d} {y:9d}")
    if args.lines is not None:
        print(f"lines executed at least {args.lines:g} times (index, executed, samples, top reasons):")
        for x in hot_lines(lines, args.lines):
            top = " ".join(f"{r}:{n}" for r, n in sorted(x.stalls.items(), key=lambda kv: -kv[1])[:3] if n)
            print(f"  {x.index:5d} {x.executed:12,d} {x.samples:7d}  {x.source[:64]:64s} {top}")
    if args.json is not None:
        try:
            args.json.write_text(json.dumps({"csv": str(args.csv), **doc}, indent=1) + "\n")
        except OSError as e:
            print(f"ncu_sass_stalls: error: --json: cannot write {args.json}: {e.strerror}",
                  file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # its output piped into head, which closed early
        sys.stdout = None
        sys.exit(0)
