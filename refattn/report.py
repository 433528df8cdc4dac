"""`refattn report`: one readable report of everything the harness knows, and a baseline diff.

    refattn report [--in DIR] [--out DIR] [--baseline PATH] [--check] [--update-baseline]

The story, top to bottom:

1. **Collect** (:func:`collect`) what is in ``--in`` (default ``reports/``):
   ``run-*.json`` (``refattn run --report``: one kernel over cases, ``MatrixResult.to_json``),
   ``mutants-*.json`` (``refattn mutants --json``: a kill matrix, ``KillMatrix.to_json``),
   ``fuzz-*.json`` and ``determinism-*.json`` (``refattn fuzz`` / ``refattn determinism
   --json``) and the GPU records ``gpu/*.json`` that a kernel package writes (kinds
   ``matrix``, ``mutants``, ``measure``, ``bench``, ``reliability``, ...). Each document is checked against the schema of
   its kind when it is read (``refattn.schema``, and ``_KILL_READ`` / ``_GPU_READ`` /
   ``_GPU_KIND_READ`` here for the few fields only this module reads); one that cannot be
   read (not JSON, not UTF-8, nested too deep) or has a field of the wrong shape (``"results":
   5``, a hash given as a number, a GPU record without ``kernel_source_hash``, ``"rel_l2":
   Infinity``: every number read must be finite) is a failure ``unreadable input: FILE:
   FIELD: why`` and is left out, so nothing after this step sees a bad file and nothing here
   crashes on one. No run file is a failure too: a check over nothing is no pass. Kill
   matrices, fuzz and determinism runs and GPU records are optional (a kernel may implement
   no mutants and have no GPU records): their absence is noted, and one that the baseline
   has and this report lacks is *coverage lost* (below). An ``--in`` that does not exist
   ends the command (exit 1) before anything is written or created.
2. **Build** (:func:`build`) the document ``latest.json`` (``"schema": 1``): a summary, one
   row per (kernel, suite, case), the kill matrices, the fuzz and determinism runs, the GPU
   records, the GPU per-call timings and the benchmark table with ratios to peers. Every
   input is labelled with the kernel it ran and carries its own stamp: its recorded
   ``kernel_source_hash`` against the ``source_hash()`` of the kernel it names, asked now
   (``refattn.records``: fresh, carried, stale or unknown). No input is judged against
   another kernel's source.
3. **Diff** (:func:`diff`) it against the committed baseline (``--baseline``, default
   ``<in>/baseline.json``, same schema). A *regression* is one of

   * a case that was ``pass`` and now is not (``fail``, ``error``, ``contract-violation``,
     or ``declined``: a kernel that stops computing a case loses coverage);
   * a relL2 that grew by more than :data:`REL_L2_GROWTH` (2x); compared only where both
     the baseline's and the current relL2 are > 0 (a case at 0 that moves beyond its derived
     gate is already a failure);
   * a mutant that was killed and now survives (unless marked ``equivalent``: a bug that no
     fp16 output can show, see ``refattn.mutants``);
   * a GPU record that is stale (hash mismatch) or failing (needs no baseline); a *carried*
     record (``refattn.records``: a two-GPU scaling run of an earlier kernel source, kept
     across kernel edits) is listed as such and must still pass;
   * a benchmark ratio (peer time / our time, higher is better) that dropped by more than
     :data:`BENCH_WORSE` (15 %);
   * *coverage lost* (:func:`_coverage_lost`): a case, mutant, GPU record or timed bench
     ratio of the baseline that this report no longer has (a suite no longer run, a record
     deleted, a peer left out), one line per source file of the baseline; the entries of a
     file that is unreadable now are not listed again (the file is a failure of its own).

   A *failure* is the current state alone, baseline or not: a case not ``pass``/``declined``,
   a surviving mutant (not ``equivalent``), a clean kernel that fails its own matrix, a
   fuzz run that found a failing case, a determinism run whose outputs differ, a stale CPU
   input, a GPU record whose freshness is unknown (its kernel cannot be built here to ask),
   an unreadable or missing input, and a baseline that is missing (a typo in ``--baseline``),
   malformed or empty (nothing to compare against). ``--check`` exits 1 when there is any of
   either and prints one line for each; without ``--check`` the same lines are printed and
   written, and the exit status is 0. With ``--update-baseline`` a missing or empty
   baseline is no failure: that is how the first one is made.

   CI (``.ci/run``) writes ``reports/mutants-model.json`` (``refattn mutants --json``) and
   ``reports/run-model.json`` (``refattn run --report reports``), then runs ``refattn report
   --check``: ``--in`` and ``--out`` are ``reports/``, the baseline is the committed
   ``reports/baseline.json``, the GPU records the committed ``reports/gpu/``. A step of
   that sequence that wrote nothing, or less than before, fails the check.
4. **Render** ``latest.md`` (summary line first, then tables; GitHub-readable) and, when
   matplotlib is importable (``pip install refattn[plot]``), PNG plots in ``<out>/plots/``:
   relL2 per case on a log axis with both gates, GPU per-call time against past_len (full vs
   windowed), an error heatmap (head x row) of the case with the largest relL2 (re-run on
   the CPU by the very kernel its run file names, and only when that kernel runs on a CPU
   and the case costs under :data:`HEATMAP_MAX_FLOPS`; never by another kernel), and each kill-matrix grid.
   Both texts are made before either is written, then written together
   (:func:`_write_together`: each to a hidden file beside its target, then both renamed), so
   a failure while rendering or writing (a full disk: one line on stderr, exit 1) leaves both
   as they were and the two never disagree. Each plot is rendered in memory and written
   through a temporary file and a rename, so a plot that fails leaves no truncated PNG.
5. **Print** the summary line (and the findings) to stdout for the CI log.
   ``--update-baseline`` copies the new ``latest.json`` to the baseline path, atomically;
   nothing else ever writes the baseline. It refuses (one line on stderr, exit 1, the
   baseline untouched) when an input is unreadable or missing or the report holds no case,
   kill matrix or GPU record: such a baseline would stop comparing what it left out. With
   ``--check`` the check is against the old baseline, and the new one is written even when
   the check fails: accepting the current state is what updating means.

Benchmark records (``kind: "bench"``): ``refattn bench`` writes ``"kernel": NAME`` and
``"shapes": [{"name", "geometry": {"sink", ...}, "results": {adapter name: {"role": "kernel" |
"peer", "sink": {"status", "ms", ...}, "nosink": {...}}}}]``; the kernel's time is the one in
the shape's own sink mode, and each timed peer's ratio is peer ms / kernel ms in the peer's
mode. Records of the engine before it (``"shapes": [{"name", "hipkernel": {"sink": {"ms",
"tflops"}, "nosink": {...}}, "peers": {name: {"status", "ms", "sink"}}}]``) are read alike.
Other writers may use the simpler body::

    "rows": [{"case": "gptoss-past8192-w128", "kernel_ms": 0.11, "tflops": 152.0,
              "peers": {"torch-sdpa": 0.25, "flex": {"ms": 0.19}}}]

(``results``/``cases`` for ``rows``, ``name`` for ``case``, ``ms``/``time_ms``/``median_ms``
for ``kernel_ms`` and a list ``[{"peer"|"name": ..., "ms": ...}]`` for ``peers`` are accepted
too). ratio = peer ms / kernel ms, so > 1 means our kernel is faster.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import io
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from refattn import records, schema
from refattn.cli import EXIT_FAIL, EXIT_OK, UsageError, _safe_name
from refattn.fileio import atomic_write_bytes, atomic_write_text, check_output_dir, check_output_file, json_text
from refattn.metrics import SEED_GATE_REL_L2
from refattn.runner import ACCEPTABLE

SCHEMA = 1
REL_L2_GROWTH = 2.0  # a relL2 more than 2x its baseline value is a regression
BENCH_WORSE = 0.15  # a peer ratio more than 15 % below its baseline value is a regression
HEATMAP_MAX_FLOPS = 5e9  # re-run a case for the heatmap only below this (a few s on a CPU)
PLOTS_MISSING = "plots skipped: matplotlib not installed (pip install refattn[plot])"


# --------------------------------------------------------------------------- small helpers

def _num(x) -> float | None:
    """A JSON-safe float: None for missing, non-numeric or NaN."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    x = float(x)
    return None if math.isnan(x) else x


def _e(x) -> str:
    return "-" if x is None else f"{x:.2e}"


def _ms(x) -> str:
    return "-" if x is None else f"{x:.4g} ms"


def _md(text) -> str:
    """A Markdown table cell: pipes escaped, newlines flattened."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_md(c) for c in r) + " |" for r in rows]
    return out


# --------------------------------------------------------------------------- 1. collect

@dataclass
class Collected:
    """Everything read from ``--in``: each document with its path relative to ``--in``."""

    in_dir: Path
    runs: list[tuple[str, dict]] = field(default_factory=list)  # (file, MatrixResult json)
    kill: list[tuple[str, dict]] = field(default_factory=list)  # (file, KillMatrix json)
    gpu: list[tuple[str, dict]] = field(default_factory=list)  # (file, GPU record)
    checks: list[tuple[str, dict]] = field(default_factory=list)  # (file, fuzz / determinism run)
    missing: list[str] = field(default_factory=list)  # a failure: no run file, no --in
    absent: list[str] = field(default_factory=list)  # a note: inputs a kernel may not have
    unreadable: list[tuple[str, str]] = field(default_factory=list)  # (file, why)


# Fields this module reads beyond what ``refattn.schema`` checks: the parts of a GPU record's
# kernel label, the lists a kill matrix (file or record) copies into latest.json and joins
# into text, and the per-call keys the measure table and plot sort by.
_KILL_READ = {"clean_failures": schema.Opt([str]), "cases": schema.Opt([str])}
_GPU_READ = {"kernel": schema.Opt(str), "backend": schema.Opt(str)}
_GPU_KIND_READ = {
    "mutants": _KILL_READ,
    "measure": {"per_call": schema.Opt([{"sq": schema.Opt(int), "past_len": schema.Opt(int),
                                         "window": schema.Opt(int), "sink": schema.Opt(str)}])},
    "torch": {"host": schema.Opt([{"sq": schema.Opt(int), "past_len": schema.Opt(int),
                                   "window": schema.Opt(int), "kernel_ms": schema.Opt(schema.NUM),
                                   "burst_ms_per_call": schema.Opt(schema.NUM),
                                   "host_overhead_us": schema.Opt(schema.NUM),
                                   "target_us": schema.Opt(schema.NUM), "hit": schema.Opt(bool)}]),
              "chunked_16k": schema.Opt({"warm_over_kernels": schema.Opt(schema.NUM),
                                         "cold_over_warm": schema.Opt(schema.NUM),
                                         "target_over_kernels": schema.Opt(schema.NUM),
                                         "target_cold_over_warm": schema.Opt(schema.NUM)})},
}


def _kill_problems(doc: dict) -> list[str]:
    """A kill matrix file's problems: ``refattn.schema``'s, then those of ``_KILL_READ``."""
    return schema.problems(doc, schema.KILL_MATRIX) or schema.problems(doc, _KILL_READ)


def _gpu_problems(rec: dict) -> list[str]:
    """A GPU record's problems: ``refattn.schema``'s (common fields, then its kind's), then
    those of the fields only this module reads."""
    return (schema.gpu_record_problems(rec) or schema.problems(rec, _GPU_READ)
            or schema.problems(rec, _GPU_KIND_READ.get(rec["kind"], {})))


def _first_line(e: BaseException) -> str:
    """An exception's message on one line (a finding is one line)."""
    return " ".join(str(e).split())[:300]


def _shape_problems(problems: list[str]) -> str:
    """The first problem of a document, and how many more there are."""
    more = len(problems) - 1
    return problems[0] + (f" (and {more} more)" if more > 0 else "")


def _read_json(path: Path, root: Path, col: Collected, need: str, what: str, check) -> dict | None:
    """The document at ``path``, or None with the reason in ``col.unreadable``: it cannot be
    read, is not JSON, is not ``what`` (no ``need`` field), or ``check(doc)`` (the
    ``refattn.schema`` check of its kind) finds a field of the wrong shape."""
    name = path.relative_to(root).as_posix()
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # ValueError: JSON, UTF-8, a huge integer
        col.unreadable.append((name, f"{type(e).__name__}: {_first_line(e)}"))
        return None
    if not isinstance(doc, dict):  # "(top level): expected an object, got a list"
        col.unreadable.append((name, schema.problems(doc, dict)[0]))
        return None
    if need not in doc:
        col.unreadable.append((name, f"not {what} (no {need!r} field)"))
        return None
    found = check(doc)
    if found:
        col.unreadable.append((name, _shape_problems(found)))
        return None
    return doc


def collect(in_dir) -> Collected:
    """Read the run files, kill matrices, fuzz and determinism runs and GPU records in
    ``in_dir``. No run file is a failure (a report of nothing); the others are optional, as
    a kernel may implement no mutants or have no GPU records: their absence is noted, and
    one that the baseline has and this report lacks is *coverage lost*."""
    root = Path(in_dir)
    col = Collected(root)
    if not root.is_dir():
        col.missing.append(f"{root}/: no such directory")
        return col
    for pattern, need, into, what, label, how, spec, required in (
            ("run-*.json", "results", col.runs, "a run file", "CPU run files", "refattn run --report DIR",
             schema.RUN, True),
            ("mutants-*.json", "mutants", col.kill, "a kill matrix", "kill matrices",
             "refattn mutants --json PATH", None, False),
            ("fuzz-*.json", "kind", col.checks, "a fuzz run", "fuzz runs",
             "refattn fuzz --json PATH", schema.FUZZ, False),
            ("determinism-*.json", "kind", col.checks, "a determinism run", "determinism runs",
             "refattn determinism --json PATH", schema.DETERMINISM, False)):
        files = sorted(root.glob(pattern))
        if not files:
            (col.missing if required else col.absent).append(f"{label}: no {root}/{pattern} ({how})")
        for f in files:
            check = _kill_problems if spec is None else (lambda d, spec=spec: schema.problems(d, spec))
            doc = _read_json(f, root, col, need, what, check)
            if doc is not None:
                into.append((f.relative_to(root).as_posix(), doc))
    gpu_files = sorted((root / "gpu").glob("*.json"))
    if not gpu_files:
        col.absent.append(f"GPU records: no {root}/gpu/*.json")
    for f in gpu_files:
        doc = _read_json(f, root, col, "kind", "a GPU record", _gpu_problems)
        if doc is not None:
            col.gpu.append((f.relative_to(root).as_posix(), doc))
    return col


# --------------------------------------------------------------------------- 2. build

def _case_rows(doc: dict, kernel: str, source: str, origin: str, params: dict) -> list[dict]:
    rows = []
    spec = doc.get("kernel_spec") if origin == "run" else None  # what the heatmap may re-run
    for r in doc.get("results") or []:
        if not isinstance(r, dict):
            continue
        row = {
            "kernel": kernel, "suite": str(r.get("suite") or "?"), "case": str(r.get("case") or "?"),
            "outcome": str(r.get("outcome") or "?"), "rel_l2": _num(r.get("rel_l2")),
            "max_abs": _num(r.get("max_abs")), "max_abs_at": r.get("max_abs_at"),
            "gate": _num(r.get("gate")), "gate_max_abs": _num(r.get("gate_max_abs")),
            "seed_gate_pass": r.get("seed_gate_pass"), "baseline_rel_l2": _num(r.get("baseline_rel_l2")),
            "n_nan": r.get("n_nan"), "n_inf": r.get("n_inf"), "time_s": _num(r.get("time_s")),
            "note": str(r.get("note") or ""), "describe": (r.get("params") or {}).get("describe", ""),
            "source": source, "origin": origin, "kernel_spec": spec,
        }
        rows.append(row)
        if isinstance(r.get("params"), dict):
            params[(kernel, row["suite"], row["case"])] = r["params"]
    return rows


def _equivalent(m: dict) -> str | None:
    """Why mutant ``m`` cannot show in an fp16 output (so surviving is no failure), or None.
    Files written before kill matrices carried ``equivalent`` fall back to the catalogue."""
    if "equivalent" in m:
        return m["equivalent"] or None
    from refattn.mutants import by_name

    try:
        return by_name(m.get("name")).equivalent
    except (ValueError, AttributeError):
        return None


def _kill_entry(doc: dict, label: str, source: str, origin: str) -> dict:
    mutants = [{"name": str(m.get("name", "?")), "breaks": str(m.get("breaks", "")),
                "killed": bool(m.get("killed")), "killed_by": list(m.get("killed_by") or []),
                "killed_by_seed_gate": list(m.get("killed_by_seed_gate") or []),
                "equivalent": _equivalent(m)}
               for m in doc.get("mutants") or [] if isinstance(m, dict)]
    clean_ok = doc.get("clean_ok") is not False
    return {"kernel": label, "source": source, "origin": origin, "clean_ok": clean_ok,
            "clean_failures": list(doc.get("clean_failures") or []),
            "cases": list(doc.get("cases") or []), "mutants": mutants,
            "ok": clean_ok and all(m["killed"] or m["equivalent"] for m in mutants)}


def _gpu_kernel(rec: dict, source: str) -> str:
    """Label of a GPU record's kernel: ``<kernel>[:<backend>]@<file stem>``."""
    k = rec.get("kernel") or rec.get("kernel_spec") or "unnamed kernel"
    if rec.get("backend") and not rec.get("kernel") and ":" not in k:
        k = f"{k}:{rec['backend']}"  # a record of one backend of its kernel: hipkernel:cuda
    return f"{k}@{Path(source).stem}"


_HASHES: dict = {}  # spec -> current source hash, for one report (emptied by build)


def _freshness(rec: dict) -> tuple[str, str | None, str]:
    """(freshness, current hash, the record's kernel) of a stamped document, against the
    source of the kernel it names (``refattn.records``)."""
    spec = records.record_spec(rec)
    current = records.current_hash(spec, _HASHES)
    return records.freshness(rec, current), current, spec or "?"


def _source_entry(source: str, doc: dict, kind: str) -> dict:
    """One input document's kernel and hashes, for the report's table of sources."""
    fresh, current, spec = _freshness(doc)
    h = doc.get("kernel_source_hash")
    return {"file": source, "kind": kind, "kernel": str(doc.get("kernel") or spec), "kernel_spec": spec,
            "kernel_source_hash": h if isinstance(h, str) else None, "current_source_hash": current,
            "freshness": fresh}


def _gpu_entry(source: str, rec: dict) -> dict:
    h = rec.get("kernel_source_hash")
    freshness, current, spec = _freshness(rec)
    problems = []  # the fields are there and typed (collect checked the record)
    if freshness == "stale":
        problems.append(f"stale: recorded hash {h[:12]} != current source {current[:12]} of {spec}")
    elif freshness == "unknown":
        problems.append(f"freshness unknown: kernel {spec} names no source_hash() that can be "
                        "asked here" if current is None else "freshness unknown")
    if rec.get("ok") is False:
        problems.append("the recorded run failed" + _gpu_failure_detail(rec))
    return {"file": source, "kind": str(rec.get("kind")), "device": rec.get("device"),
            "date": rec.get("date"), "backend": rec.get("backend"), "kernel": _gpu_kernel(rec, source),
            "kernel_source_hash": h, "current_source_hash": current,
            "ok": rec.get("ok"), "freshness": freshness, "problems": problems}


def _gpu_failure_detail(rec: dict) -> str:
    """What failed in a record, from the fields its kind has: the cases of any record
    (``results``, typed for every kind), the mutants of a kill-matrix record."""
    bad = [f"{r['case']}:{r['outcome']}" for r in rec.get("results") or []
           if r["outcome"] not in ACCEPTABLE]
    mutants = rec.get("mutants") if rec["kind"] == "mutants" else None
    survivors = [m["name"] for m in mutants or [] if not m["killed"] and not m.get("equivalent")]
    parts = (["cases " + ", ".join(bad[:5])] if bad else []) + \
            (["surviving mutants " + ", ".join(survivors)] if survivors else [])
    return ": " + "; ".join(parts) if parts else ""


def _measure_entry(source: str, rec: dict) -> dict:
    rows = [{"sq": r.get("sq"), "past_len": r.get("past_len"), "window": r.get("window"),
             "sink": r.get("sink"), "ms": _num(r.get("ms")), "tflops": _num(r.get("tflops"))}
            for r in rec.get("per_call") or [] if isinstance(r, dict)]
    return {"source": source, "device": rec.get("device"), "per_call": rows,
            "window_spread": _num(rec.get("window128_spread")),
            "window_flat": rec.get("window128_flat_within_10pct"),
            "chunked_16k": rec.get("chunked_16k")}


def _host_entry(source: str, rec: dict) -> dict:
    """A torch-entry record (kind ``torch``, ``hipkernel.torch_bench``): its checks and its
    host-path timings."""
    rows = [{"sq": r.get("sq"), "past_len": r.get("past_len"), "window": r.get("window"),
             "kernel_ms": _num(r.get("kernel_ms")), "burst_ms": _num(r.get("burst_ms_per_call")),
             "overhead_us": _num(r.get("host_overhead_us")), "target_us": _num(r.get("target_us")),
             "hit": r.get("hit")}
            for r in rec.get("host") or [] if isinstance(r, dict)]
    ch = rec.get("chunked_16k") or {}
    return {"source": source, "device": rec.get("device"),
            "checks": {str(k): bool(v.get("ok")) for k, v in (rec.get("checks") or {}).items()},
            "host": rows,
            "chunked": {k: _num(ch.get(k)) for k in ("warm_over_kernels", "target_over_kernels",
                                                     "cold_over_warm", "target_cold_over_warm")}}


def _first(d: dict, keys):
    for k in keys:
        if k in d:
            return d[k]
    return None


def _bench_timed(entry, mode: str) -> float | None:
    """The ms of one implementation's result in ``mode`` of a refattn.bench record, when it
    was timed (status ok)."""
    res = entry.get(mode) if isinstance(entry, dict) else None
    return _num(res.get("ms")) if isinstance(res, dict) and res.get("status") == "ok" else None


def _bench_results_row(r: dict, kernel: str | None) -> dict:
    """One shape of a refattn.bench record (``results`` keyed by adapter name) as a row."""
    results = r["results"]
    mine = results.get(kernel) if kernel else None
    if not isinstance(mine, dict):
        mine = next((e for e in results.values() if isinstance(e, dict) and e.get("role") == "kernel"), {})
    main = "sink" if (r.get("geometry") or {}).get("sink") else "nosink"
    own = mine.get(main) if isinstance(mine.get(main), dict) else {}
    peers = []
    for name, entry in results.items():
        if not isinstance(entry, dict) or entry.get("role") != "peer":
            continue
        for mode in ("sink", "nosink"):
            ms = _bench_timed(entry, mode)
            if ms is None:
                continue
            ours = _bench_timed(mine, mode)
            peers.append({"peer": str(name), "ms": ms, "ratio": ms / ours if ours else None})
    return {"case": str(r.get("name") or "?"), "kernel_ms": _bench_timed(mine, main),
            "tflops": _num(own.get("tflops")) if _bench_timed(mine, main) is not None else None,
            "peers": peers}


def _bench_entry(source: str, rec: dict) -> dict:
    """The benchmark table of one bench record (tolerant; see the module docstring)."""
    rows = []
    kernel = rec.get("kernel") if isinstance(rec.get("kernel"), str) else None
    for r in rec.get("shapes") or []:  # refattn.bench's record, or the engine's before it
        if not isinstance(r, dict):
            continue
        if isinstance(r.get("results"), dict):
            rows.append(_bench_results_row(r, kernel))
            continue
        hk = r.get("hipkernel") or {}
        ours = _num((hk.get("sink") or {}).get("ms"))
        peers = []
        for name, p in (r.get("peers") or {}).items():
            if not isinstance(p, dict) or p.get("status") != "ok":
                continue
            mine = _num((hk.get("sink" if p.get("sink") else "nosink") or {}).get("ms"))
            ms = _num(p.get("ms"))
            peers.append({"peer": str(name), "ms": ms,
                          "ratio": ms / mine if ms is not None and mine else None})
        rows.append({"case": str(r.get("name") or "?"), "kernel_ms": ours,
                     "tflops": _num((hk.get("sink") or {}).get("tflops")), "peers": peers})
    if rows:
        return {"source": source, "device": rec.get("device"), "kernel": kernel, "rows": rows}
    for r in _first(rec, ("rows", "results", "cases", "benchmarks")) or []:
        if not isinstance(r, dict):
            continue
        ours = _num(_first(r, ("kernel_ms", "ms", "time_ms", "median_ms")))
        peers_raw = r.get("peers") or {}
        if isinstance(peers_raw, list):
            peers_raw = {str(p.get("peer") or p.get("name")): p for p in peers_raw if isinstance(p, dict)}
        peers = []
        for name, p in peers_raw.items() if isinstance(peers_raw, dict) else ():
            ms = _num(p) if not isinstance(p, dict) else _num(_first(p, ("ms", "time_ms", "median_ms")))
            ratio = _num(p.get("ratio")) if isinstance(p, dict) and "ratio" in p else None
            if ratio is None and ms is not None and ours:
                ratio = ms / ours
            peers.append({"peer": str(name), "ms": ms, "ratio": ratio})
        rows.append({"case": str(_first(r, ("case", "name")) or "?"), "kernel_ms": ours,
                     "tflops": _num(r.get("tflops")), "peers": peers})
    return {"source": source, "device": rec.get("device"), "kernel": kernel, "rows": rows}


def _check_entry(source: str, doc: dict) -> dict:
    """A fuzz or determinism run: its kernel, whether it passed, and what failed."""
    entry = {**_source_entry(source, doc, str(doc.get("kind"))), "ok": bool(doc.get("ok"))}
    if doc.get("kind") == "fuzz":
        m = doc.get("minimal") or {}
        entry["summary"] = (f"{doc.get('examples')} examples, none failing" if doc.get("ok") else
                            f"failing case {m.get('describe', '?')}: {m.get('command', '')}")
    else:
        bad = [r for r in doc.get("results") or [] if r.get("outcome") not in ("identical", "declined")]
        entry["summary"] = (f"{len(doc.get('results') or [])} (case, variant) pairs identical over "
                            f"{doc.get('runs')} runs" if not bad else
                            f"{len(bad)} not identical: " + ", ".join(
                                f"{r.get('case')}" + (f"@{r['variant']}" if r.get("variant") else "")
                                + f" {r.get('outcome')}" for r in bad[:3]))
    return entry


def build(col: Collected, *, params: dict | None = None) -> dict:
    """The ``latest.json`` document, before the diff (:func:`make_report` adds ``baseline``,
    ``findings``, ``summary`` and ``plots``). ``params`` is filled with
    ``(kernel, suite, case) -> case as data`` for re-running the heatmap case."""
    params = {} if params is None else params
    _HASHES.clear()
    cases, kill, gpu, measure, bench, host = [], [], [], [], [], []
    for source, doc in col.runs:
        cases += _case_rows(doc, str(doc.get("kernel") or Path(source).stem[4:]), source, "run", params)
    for source, doc in col.kill:
        kill.append(_kill_entry(doc, str(doc.get("kernel") or Path(source).stem[8:]), source, "run"))
    sources = [_source_entry(s, d, "run") for s, d in col.runs] + \
              [_source_entry(s, d, "mutants") for s, d in col.kill]
    checks = [_check_entry(s, d) for s, d in col.checks]
    for source, rec in col.gpu:
        gpu.append(_gpu_entry(source, rec))
        kind = rec.get("kind")
        if kind == "matrix":
            cases += _case_rows(rec, _gpu_kernel(rec, source), source, "gpu-record", params)
        elif kind == "mutants":
            kill.append(_kill_entry(rec, _gpu_kernel(rec, source), source, "gpu-record"))
        elif kind == "measure":
            measure.append(_measure_entry(source, rec))
        elif kind == "bench":
            bench.append(_bench_entry(source, rec))
        elif kind == "torch":  # the torch entry point's own case matrix, and its host path
            cases += _case_rows(rec, _gpu_kernel(rec, source), source, "gpu-record", params)
            host.append(_host_entry(source, rec))
    missing, absent = list(col.missing), list(col.absent)
    if col.gpu and not measure:
        absent.append("GPU measure record: none (per-call time vs past_len not available)")
    if col.gpu and not bench:
        absent.append("GPU bench record: none (no benchmark table)")
    return {
        "schema": SCHEMA,
        "generated": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "inputs": {"dir": str(col.in_dir), "runs": [s for s, _ in col.runs],
                   "kill_matrices": [s for s, _ in col.kill], "gpu": [s for s, _ in col.gpu],
                   "checks": [s for s, _ in col.checks], "missing": missing, "absent": absent,
                   "unreadable": [{"file": f, "why": w} for f, w in col.unreadable]},
        "sources": sources, "checks": checks,
        "cases": cases, "kill_matrices": kill, "gpu_records": gpu, "measure": measure,
        "bench": bench, "host_path": host,
    }


# --------------------------------------------------------------------------- 3. diff

@dataclass
class Finding:
    """One line of ``--check``: ``<kind>: <what>: <where>: <before> -> <after>``."""

    kind: str  # "regression" | "failure"
    what: str
    where: str
    before: str
    after: str
    key: tuple = ()

    def line(self) -> str:
        if not self.before:  # a state, not a change: "failure: unreadable input: FILE: FIELD: why"
            return f"{self.kind}: {self.what}: {self.where}: {self.after}"
        return f"{self.kind}: {self.what}: {self.where}: {self.before} -> {self.after}"

    def to_dict(self) -> dict:
        return {"kind": self.kind, "what": self.what, "where": self.where,
                "before": self.before, "after": self.after, "line": self.line()}


def _case_key(r: dict) -> tuple:
    return ("case", r.get("kernel"), r.get("suite"), r.get("case"))


def _case_where(r: dict) -> str:
    return f"{r.get('kernel')} {r.get('suite')}/{r.get('case')}"


def _outcome_text(r: dict) -> str:
    o = r.get("outcome")
    if r.get("n_nan") or r.get("n_inf"):
        return f"{o} ({r.get('n_nan') or 0} NaN, {r.get('n_inf') or 0} Inf)"
    if r.get("rel_l2") is not None:
        return f"{o} (relL2 {_e(r['rel_l2'])}, gate {_e(r.get('gate'))})"
    return f"{o} ({r['note']})" if r.get("note") else str(o)


def _bench_ratios(doc: dict) -> dict:
    return {("bench", b.get("source"), row.get("case"), p.get("peer")): p.get("ratio")
            for b in doc.get("bench") or [] for row in b.get("rows") or [] for p in row.get("peers") or []}


_LOST_WHAT = {"cases": "case", "mutants": "mutant", "GPU records": "GPU record",
              "bench ratios": "bench ratio"}  # each with its singular


def _coverage_lost(latest: dict, baseline: dict) -> list[Finding]:
    """What the baseline compared and ``latest`` no longer has, one regression per source file
    of the baseline: cases, kill-matrix mutants, GPU records and timed bench ratios. A file
    that is unreadable now is a failure of its own; its entries are not listed again."""
    unreadable = {str(u.get("file")) for u in (latest.get("inputs") or {}).get("unreadable") or []}
    lost: dict[str, dict[str, list[str]]] = {}  # source -> {what: [entries]}

    def gone(source, what: str, entry: str) -> None:
        source = str(source or "?")
        if source not in unreadable:
            lost.setdefault(source, {}).setdefault(what, []).append(entry)

    have = {_case_key(r) for r in latest.get("cases") or []}
    for r in baseline.get("cases") or []:
        if _case_key(r) not in have:
            gone(r.get("source"), "cases", _case_where(r))
    have = {(k.get("kernel"), m.get("name")) for k in latest.get("kill_matrices") or []
            for m in k.get("mutants") or []}
    for k in baseline.get("kill_matrices") or []:
        for m in k.get("mutants") or []:
            if (k.get("kernel"), m.get("name")) not in have:
                gone(k.get("source"), "mutants", f"{k.get('kernel')} / {m.get('name')}")
    have = {g.get("file") for g in latest.get("gpu_records") or []}
    for g in baseline.get("gpu_records") or []:
        if g.get("file") not in have:
            gone(g.get("file"), "GPU records", str(g.get("file")))
    have = {key for key, ratio in _bench_ratios(latest).items() if ratio is not None}
    for key, ratio in _bench_ratios(baseline).items():
        if ratio is not None and key not in have:
            gone(key[1], "bench ratios", f"{key[2]} vs {key[3]}")

    found = []
    for source, by_what in lost.items():
        counts = ", ".join(f"{len(v)} {w if len(v) != 1 else _LOST_WHAT[w]}" for w, v in by_what.items())
        entries = [e for v in by_what.values() for e in v]
        more = f" and {len(entries) - 3} more" if len(entries) > 3 else ""
        found.append(Finding("regression", "coverage lost", source, f"{counts} in the baseline",
                             "not in this report: " + ", ".join(entries[:3]) + more, ("lost", source)))
    return found


def diff(latest: dict, baseline: dict | None) -> list[Finding]:
    """Regressions of ``latest`` against ``baseline`` (None: no baseline) and the current
    failures, each once (a failure that is also a regression is listed as the regression)."""
    found: list[Finding] = []
    base_cases = {_case_key(r): r for r in (baseline or {}).get("cases") or []}
    for r in latest.get("cases") or []:
        b = base_cases.get(_case_key(r))
        if b is None:
            continue
        if b.get("outcome") == "pass" and r.get("outcome") != "pass":
            found.append(Finding("regression", "case no longer passes", _case_where(r),
                                 _outcome_text(b), _outcome_text(r), _case_key(r)))
            continue
        old, new = b.get("rel_l2"), r.get("rel_l2")
        if old is not None and new is not None and old > 0 and new > 0 and new > REL_L2_GROWTH * old:
            found.append(Finding("regression", f"relL2 grew {new / old:.1f}x", _case_where(r),
                                 _e(old), _e(new), ("rel_l2",) + _case_key(r)[1:]))

    base_kill = {("mutant", k.get("kernel"), m.get("name")): m
                 for k in (baseline or {}).get("kill_matrices") or [] for m in k.get("mutants") or []}
    for k in latest.get("kill_matrices") or []:
        for m in k.get("mutants") or []:
            key = ("mutant", k.get("kernel"), m.get("name"))
            b = base_kill.get(key)
            if b is not None and b.get("killed") and not m.get("killed") and not m.get("equivalent"):
                found.append(Finding("regression", "mutant survives", f"kill matrix {k.get('kernel')} / "
                                     f"{m.get('name')}", f"killed by {len(b.get('killed_by') or [])} cases",
                                     "survives every case", key))

    base_gpu = {g.get("file"): g for g in (baseline or {}).get("gpu_records") or []}
    for g in latest.get("gpu_records") or []:
        where = f"{g.get('file')} ({g.get('kind')}, {g.get('device')})"
        b = base_gpu.get(g.get("file")) or {}
        if g.get("freshness") == "stale":
            h, cur = g.get("kernel_source_hash") or "", g.get("current_source_hash") or ""
            found.append(Finding("regression", "GPU record stale", where,
                                 f"recorded for kernel source {h[:12]}",
                                 f"current kernel source {cur[:12]} (re-run on the GPU)",
                                 ("gpu-stale", g.get("file"))))
        if g.get("ok") is False:
            before = "ok" if b.get("ok") is True else ("failed" if b.get("ok") is False else "-")
            detail = next((p for p in g.get("problems") or [] if p.startswith("the recorded run failed")),
                          "the recorded run failed")
            found.append(Finding("regression", "GPU record failing", where, before,
                                 detail.replace("the recorded run ", ""), ("gpu-failing", g.get("file"))))

    base_ratio = _bench_ratios(baseline or {})
    for key, new in _bench_ratios(latest).items():
        old = base_ratio.get(key)
        if old is None or new is None or old <= 0:
            continue
        if new < (1.0 - BENCH_WORSE) * old:
            _, source, case, peer = key
            found.append(Finding("regression", f"bench ratio worse by {100 * (1 - new / old):.0f}%",
                                 f"{source} {case} vs {peer}", f"{old:.2f}x", f"{new:.2f}x", key))

    found += _coverage_lost(latest, baseline or {})
    seen = {f.key for f in found}
    base_known = baseline is not None

    def before_of(b) -> str:
        return "no baseline" if not base_known else ("not in baseline" if b is None else b)

    for r in latest.get("cases") or []:
        if r.get("outcome") not in ACCEPTABLE and _case_key(r) not in seen:
            b = base_cases.get(_case_key(r))
            found.append(Finding("failure", "case fails", _case_where(r),
                                 before_of(None if b is None else _outcome_text(b)),
                                 _outcome_text(r), _case_key(r)))
    for k in latest.get("kill_matrices") or []:
        if not k.get("clean_ok"):
            found.append(Finding("failure", "clean kernel fails its matrix", f"kill matrix {k.get('kernel')}",
                                 "-", "fails " + ", ".join(k.get("clean_failures") or ["?"])))
        for m in k.get("mutants") or []:
            key = ("mutant", k.get("kernel"), m.get("name"))
            if not m.get("killed") and not m.get("equivalent") and key not in seen:
                b = base_kill.get(key)
                found.append(Finding("failure", "mutant survives", f"kill matrix {k.get('kernel')} / "
                                     f"{m.get('name')}",
                                     before_of(None if b is None else ("killed" if b.get("killed") else "survived")),
                                     "survives every case", key))
    for g in latest.get("gpu_records") or []:
        if g.get("freshness") == "unknown":
            found.append(Finding("failure", "GPU record unverifiable", str(g.get("file")), "",
                                 next((p for p in g.get("problems") or [] if p.startswith("freshness")),
                                      "freshness unknown")))
    for src in latest.get("sources") or []:
        if src.get("freshness") == "stale":
            found.append(Finding("failure", "input stale", str(src.get("file")), "",
                                 f"a run of {src.get('kernel_spec')} source "
                                 f"{str(src.get('kernel_source_hash'))[:12]}, now "
                                 f"{str(src.get('current_source_hash'))[:12]} (re-run it)"))
    for c in latest.get("checks") or []:
        if not c.get("ok"):
            found.append(Finding("failure", f"{c.get('kind')} failed", f"{c.get('file')} ({c.get('kernel')})",
                                 "", str(c.get("summary"))))
        elif c.get("freshness") == "stale":
            found.append(Finding("failure", "input stale", str(c.get("file")), "",
                                 f"a run of {c.get('kernel_spec')} source "
                                 f"{str(c.get('kernel_source_hash'))[:12]}, now "
                                 f"{str(c.get('current_source_hash'))[:12]} (re-run it)"))
    inputs = latest.get("inputs") or {}
    for u in inputs.get("unreadable") or []:
        found.append(Finding("failure", "unreadable input", str(u.get("file")), "", str(u.get("why"))))
    for m in inputs.get("missing") or []:
        what, _, why = str(m).partition(": ")
        found.append(Finding("failure", "input missing", what, "", why or what))
    return found


# --------------------------------------------------------------------------- summary

def _suite_counts(rows: list[dict]) -> dict:
    """{kernel: {suite: {outcome: n, ..., "total": n}}} in order of appearance."""
    out: dict = {}
    for r in rows:
        c = out.setdefault(r["kernel"], {}).setdefault(r["suite"], {"total": 0})
        c[r["outcome"]] = c.get(r["outcome"], 0) + 1
        c["total"] += 1
    return out


def _suite_text(suite: str, c: dict) -> str:
    n, p, d = c["total"], c.get("pass", 0), c.get("declined", 0)
    bad = n - p - d
    if d == n:
        return f"{suite} {d} declined"
    extra = [f"{d} declined"] * bool(d) + [f"{bad} FAILED"] * bool(bad)
    return f"{suite} {p}/{n - d} pass" + (f" ({', '.join(extra)})" if extra else "")


def _kill_counts(k: dict) -> tuple[int, int, int]:
    """(killed, mutants that must be killed, equivalent mutants that survive): an equivalent
    mutant that is killed anyway counts as killed."""
    must = [m for m in k["mutants"] if m["killed"] or not m["equivalent"]]
    return sum(m["killed"] for m in must), len(must), len(k["mutants"]) - len(must)


def summarize(doc: dict, findings: list[Finding], baseline_note: str) -> dict:
    """The summary block of latest.json, with its one-line form under ``line``."""
    run_rows = [r for r in doc["cases"] if r.get("origin") == "run"]
    counts = _suite_counts(doc["cases"])
    parts = []
    for kernel, suites in _suite_counts(run_rows).items():
        parts.append(f"{kernel} " + ", ".join(_suite_text(s, c) for s, c in suites.items()))
    if not run_rows:
        parts.append("no CPU runs")
    kills = []
    for k in doc["kill_matrices"]:
        killed, n, eq = _kill_counts(k)
        kills.append({"kernel": k["kernel"], "killed": killed, "must_kill": n, "equivalent": eq,
                      "clean_ok": k["clean_ok"]})
        parts.append(f"kill matrix ({k['kernel']}) {killed}/{n} killed"
                     + (f", {eq} equivalent" if eq else "")
                     + ("" if k["clean_ok"] else ", clean kernel FAILS"))
    if not doc["kill_matrices"]:
        parts.append("no kill matrix")
    states = ("fresh", "carried", "stale", "unknown")
    g = {s: sum(r["freshness"] == s for r in doc["gpu_records"]) for s in states}
    g["failing"] = sum(r.get("ok") is False for r in doc["gpu_records"])
    g["total"] = len(doc["gpu_records"])
    if g["total"]:
        parts.append("GPU records " + ", ".join(f"{g[s]} {s}" for s in (*states, "failing")
                                                if g[s] or s == "fresh"))
    else:
        parts.append("no GPU records")
    n_reg = sum(f.kind == "regression" for f in findings)
    n_fail = sum(f.kind == "failure" for f in findings)
    tail = f"{n_reg} regression{'s' * (n_reg != 1)}"
    if baseline_note:
        tail += f" ({baseline_note})"
    if n_fail:
        tail += f", {n_fail} failure{'s' * (n_fail != 1)}"
    parts.append(tail)
    return {"line": "report: " + "; ".join(parts), "suites": counts, "kill_matrices": kills,
            "gpu_records": g, "regressions": n_reg, "failures": n_fail, "ok": not findings}


# --------------------------------------------------------------------------- 4. markdown

def _cell_maxabs(r: dict) -> str:
    if r.get("n_nan") or r.get("n_inf"):
        return f"{r.get('n_nan') or 0} NaN, {r.get('n_inf') or 0} Inf"
    at = r.get("max_abs_at")
    loc = "" if not at else " @ (" + ",".join(map(str, at)) + ")"
    return "-" if r.get("max_abs") is None else f"{r['max_abs']:.2e}{loc}"


def _seed_cell(r: dict) -> str:
    v = r.get("seed_gate_pass")
    return "-" if v is None else ("pass" if v else "fail")


def render_markdown(doc: dict, plots: dict) -> str:
    s = doc["summary"]
    inp = doc["inputs"]
    base = doc["baseline"]
    L = [s["line"], "", "# refattn report", "",
         f"Generated {doc['generated']} from `{inp['dir']}`. "
         f"Baseline: {base['note']}.", ""]

    L += ["## Regressions and failures", ""]
    if doc["findings"]:
        L += [f"- {_md(f['line'])}" for f in doc["findings"]]
    else:
        L.append("None.")
    L.append("")

    L += ["## Inputs", ""]
    read = inp["runs"] + inp["kill_matrices"] + inp.get("checks", []) + inp["gpu"]
    L.append("Read: " + (", ".join(f"`{f}`" for f in read) if read else "nothing") + ".")
    L += [""] + [f"- missing: {_md(m)}" for m in inp["missing"]]
    L += [f"- not present: {_md(m)}" for m in inp.get("absent", [])]
    L += [f"- unreadable: `{u['file']}`: {_md(u['why'])}" for u in inp["unreadable"]]
    L.append("")
    srcs = doc.get("sources", []) + doc.get("checks", []) + doc["gpu_records"]
    if srcs:
        L += ["Each input, the kernel it ran and the source it is a run of (recorded, and that "
              "kernel's `source_hash()` here now):", ""]
        L += _table(["file", "kernel", "recorded source", "current source", "freshness"],
                    [[f"`{x['file']}`", x.get("kernel") or "?", (x.get("kernel_source_hash") or "-")[:12],
                      (x.get("current_source_hash") or "-")[:12], x.get("freshness") or "?"] for x in srcs])
        L.append("")
    if doc.get("checks"):
        L += ["## Fuzz and determinism", ""]
        L += _table(["file", "check", "kernel", "result"],
                    [[f"`{c['file']}`", c["kind"], c["kernel"], ("ok: " if c["ok"] else "FAILED: ") + c["summary"]]
                     for c in doc["checks"]])
        L.append("")

    L += ["## Cases", "",
          "Derived gate: relL2 <= 2 x baseline relL2 + floor and max-abs <= 2 x baseline max-abs "
          f"+ floor (docs/semantics.md); the seed gate is relL2 <= {SEED_GATE_REL_L2}.", ""]
    groups: dict = {}
    for r in doc["cases"]:
        groups.setdefault((r["kernel"], r["suite"]), []).append(r)
    if not groups:
        L += ["No case results.", ""]
    for (kernel, suite), rows in groups.items():
        c = s["suites"][kernel][suite]
        L += [f"### {kernel}: {_suite_text(suite, c)}", "", f"From `{rows[0]['source']}`.", ""]
        L += _table(["case", "outcome", "relL2", "max-abs @ (b,h,row,col)", "derived gate relL2 / max-abs",
                     "seed gate", "time"],
                    [[r["case"], r["outcome"] if r["outcome"] in ACCEPTABLE else f"**{r['outcome']}**",
                      _e(r["rel_l2"]), _cell_maxabs(r),
                      "-" if r["gate"] is None else f"{_e(r['gate'])} / {_e(r['gate_max_abs'])}",
                      _seed_cell(r), "-" if r["time_s"] is None else f"{r['time_s']:.3f} s"]
                     for r in rows])
        L.append("")

    L += ["## Kill matrices", ""]
    if not doc["kill_matrices"]:
        L += ["No kill matrix.", ""]
    for k in doc["kill_matrices"]:
        killed, n, eq = _kill_counts(k)
        L += [f"### {k['kernel']}: {killed}/{n} mutants killed" + (f", {eq} equivalent" if eq else "")
              + f" over {len(k['cases'])} cases", "",
              f"From `{k['source']}`. Clean kernel: "
              + ("passes." if k["clean_ok"] else "**FAILS** " + ", ".join(k["clean_failures"]) + "."), ""]
        L += _table(["mutant", "derived gate", "seed gate", "killed by (derived gate)", "what it breaks"],
                    [[m["name"], f"killed ({len(m['killed_by'])})" if m["killed"] else
                      ("equivalent" if m["equivalent"] else "**SURVIVES**"),
                      f"killed ({len(m['killed_by_seed_gate'])})" if m["killed_by_seed_gate"] else "misses",
                      ", ".join(m["killed_by"][:3]) + (" ..." if len(m["killed_by"]) > 3 else ""),
                      m["breaks"] + (f" (equivalent at fp16 output: {m['equivalent']})"
                                     if m["equivalent"] and not m["killed"] else "")]
                     for m in k["mutants"]])
        L.append("")

    L += ["## GPU records", ""]
    if doc["gpu_records"]:
        L += _table(["file", "kind", "device", "date", "kernel source", "freshness", "ok", "problems"],
                    [[g["file"], g["kind"], g["device"] or "-", g["date"] or "-",
                      (g["kernel_source_hash"] or "-")[:12],
                      g["freshness"] if g["freshness"] != "stale" else "**stale**",
                      {True: "yes", False: "**no**"}.get(g["ok"], "-"), "; ".join(g["problems"]) or "-"]
                     for g in doc["gpu_records"]])
    else:
        L.append("No GPU records.")
    L.append("")

    for m in doc["measure"]:
        L += [f"## Per-call time on the GPU ({m['device']}, `{m['source']}`)", ""]
        L += _table(["sq", "past_len", "window", "sink", "time", "TF/s"],
                    [[r["sq"], r["past_len"], "full" if r["window"] in (None, -1) else r["window"],
                      r["sink"] or "-", _ms(r["ms"]), "-" if r["tflops"] is None else f"{r['tflops']:.1f}"]
                     for r in m["per_call"]])
        if m["window_spread"] is not None:
            L += ["", f"Windowed per-call time spread over past_len: {m['window_spread']:.3f}x "
                      f"({'flat' if m['window_flat'] else 'NOT flat'} within 10 %)."]
        L.append("")

    for h in doc.get("host_path") or []:
        L += [f"## Host path of the torch entry point ({h['device']}, `{h['source']}`)", "",
              "checks: " + (", ".join(f"{k} {'ok' if ok else '**FAILED**'}"
                                      for k, ok in h["checks"].items()) or "none"), ""]
        L += _table(["sq", "past_len", "window", "kernel", "burst / call", "overhead", "target"],
                    [[r["sq"], r["past_len"], "full" if r["window"] in (None, -1) else r["window"],
                      _ms(r["kernel_ms"]), _ms(r["burst_ms"]),
                      "-" if r["overhead_us"] is None else f"{r['overhead_us']:.1f} us",
                      "-" if r["target_us"] is None else
                      f"<= {r['target_us']:g} us: {'hit' if r['hit'] else '**miss**'}"]
                     for r in h["host"]])
        c = h["chunked"]
        if c["warm_over_kernels"] is not None:
            L += ["", f"Chunked 16k prefill: {c['warm_over_kernels']:.3f}x the sum of its kernels "
                      f"(target {c['target_over_kernels'] or '-'}), cold "
                      f"{'-' if c['cold_over_warm'] is None else format(c['cold_over_warm'], '.3f')}x "
                      f"warm (target {c['target_cold_over_warm'] or '-'})."]
        L.append("")

    for b in doc["bench"]:
        who = f": {_md(b['kernel'])}" if b.get("kernel") else ""
        L += [f"## Benchmark{who} ({b['device']}, `{b['source']}`)", "",
              "ratio = peer time / our time (> 1: ours is faster); our time is the kernel's in "
              "the shape's own sink mode, each ratio in the peer's.", ""]
        L += _table(["case", "ours", "TF/s", "peer", "peer time", "ratio"],
                    [[row["case"], _ms(row["kernel_ms"]),
                      "-" if row["tflops"] is None else f"{row['tflops']:.1f}", p["peer"], _ms(p["ms"]),
                      "-" if p["ratio"] is None else f"{p['ratio']:.2f}x"]
                     for row in b["rows"] for p in (row["peers"] or [{"peer": "-", "ms": None, "ratio": None}])])
        L.append("")

    L += ["## Plots", ""]
    L += [f"![{Path(p).stem}]({p})" for p in plots["written"]]
    L += [f"- {_md(n)}" for n in plots["notes"]]
    L.append("")
    return "\n".join(L)


# --------------------------------------------------------------------------- 5. plots

def _matplotlib():
    """pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _save_png(fig, path: Path) -> None:
    """The figure rendered in memory, then written atomically: a plot that fails halfway
    leaves no truncated PNG."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    atomic_write_bytes(path, buf.getvalue())


def _plot_rel_l2(plt, kernel: str, rows: list[dict], path: Path) -> None:
    rows = [r for r in rows if r["rel_l2"] is not None]
    floor = 1e-10  # relL2 of exactly 0 (e.g. window 1) is drawn at the bottom of the log axis
    x = list(range(len(rows)))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.32 * len(rows) + 2), 4.5))
    ok = [i for i, r in enumerate(rows) if r["outcome"] == "pass" and r["rel_l2"] > 0]
    zero = [i for i, r in enumerate(rows) if r["outcome"] == "pass" and r["rel_l2"] <= 0]
    bad = [i for i, r in enumerate(rows) if r["outcome"] != "pass"]
    y = [max(r["rel_l2"], floor) for r in rows]
    ax.scatter([x[i] for i in ok], [y[i] for i in ok], color="tab:blue", zorder=3, label="relL2 (pass)")
    if zero:
        ax.scatter([x[i] for i in zero], [floor] * len(zero), color="tab:blue", marker="v", zorder=3,
                   label=f"relL2 = 0 (pass), drawn at {floor:g}")
    if bad:
        ax.scatter([x[i] for i in bad], [y[i] for i in bad], color="tab:red", marker="X", s=60, zorder=3,
                   label="relL2 (fail)")
    gx = [i for i, r in enumerate(rows) if r["gate"] is not None]
    ax.scatter(gx, [max(rows[i]["gate"], floor) for i in gx], marker="_", s=200, color="tab:green",
               zorder=2, label="derived gate (per case)")
    ax.axhline(SEED_GATE_REL_L2, color="tab:orange", linestyle="--", label=f"seed gate {SEED_GATE_REL_L2}")
    ax.set_yscale("log")
    ax.set_xticks(x)
    ax.set_xticklabels([r["case"] for r in rows], rotation=75, ha="right", fontsize=7)
    ax.set_ylabel("relL2 vs fp64 reference")
    ax.set_title(f"{kernel}: relL2 per case")
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    _save_png(fig, path)
    plt.close(fig)


def _plot_measure(plt, m: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    by_window: dict = {}
    for r in m["per_call"]:
        if r["ms"] is not None and r["past_len"] is not None:
            by_window.setdefault(r["window"], []).append((r["past_len"], r["ms"]))
    for w, pts in sorted(by_window.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)):
        pts.sort()
        label = "full attention" if w in (None, -1) else f"window {w} (should be flat)"
        ax.plot([p for p, _ in pts], [t for _, t in pts], marker="o", label=label)
    ax.set_xlabel("past_len (keys already in the cache)")
    ax.set_ylabel("per-call time (ms)")
    ax.set_title(f"per-call time vs past_len\n{m['device']} ({m['source']})", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save_png(fig, path)
    plt.close(fig)


def _plot_kill_grid(plt, k: dict, path: Path) -> None:
    import numpy as np

    cases, mutants = k["cases"], k["mutants"]
    grid = np.zeros((len(mutants), len(cases)))
    col = {c: j for j, c in enumerate(cases)}
    for i, m in enumerate(mutants):
        for c in m["killed_by"]:
            if c in col:
                grid[i, col[c]] = 1
        for c in m["killed_by_seed_gate"]:
            if c in col:
                grid[i, col[c]] = 2
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    colors = ["#f0f0f0", "#f5a623", "#d0021b"]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.3 * len(cases) + 3), 0.35 * len(mutants) + 2.5))
    ax.imshow(grid, cmap=ListedColormap(colors), vmin=0, vmax=2, aspect="auto", interpolation="nearest")
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels(cases, rotation=75, ha="right", fontsize=6)
    ax.set_yticks(range(len(mutants)))
    ax.set_yticklabels([m["name"] + ("" if m["killed"] else "  (equivalent)" if m["equivalent"] else "  (SURVIVES)")
                        for m in mutants], fontsize=7)
    ax.set_title(f"kill matrix {k['kernel']}: mutant x case")
    ax.legend(handles=[Patch(color=colors[1], label="killed by the derived gate only"),
                       Patch(color=colors[2], label="killed by the seed gate too"),
                       Patch(color=colors[0], label="not killed")],
              fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    _save_png(fig, path)
    plt.close(fig)


def heatmap_error(row: dict, params: dict) -> tuple[object, str, str]:
    """``(|out - ref| reduced to (Hq, Sq), kernel name, note)`` for one case row, re-run on the
    CPU; the array is None (and the note says why) when the case is too big or cannot run."""
    import numpy as np

    from refattn.cases import Case, make_inputs
    from refattn.kernels import get_kernel, kernel_available
    from refattn.reference import attention_with_baseline

    case = Case(**{k: v for k, v in params.items() if k != "describe"})
    if case.flops >= HEATMAP_MAX_FLOPS:
        return None, "", (f"error heatmap skipped: the largest relL2 is {row['case']} ({case.flops:.1e} FLOPs "
                          f">= {HEATMAP_MAX_FLOPS:.0e}), too slow to re-run on the CPU")
    spec = row.get("kernel_spec")  # the row's own kernel, never another in its place
    if not spec:
        return None, "", (f"error heatmap skipped: {row['case']} comes from {row['source']}, which "
                          "names no kernel that can be re-run here")
    try:
        kernel = get_kernel(spec)
    except Exception as e:  # noqa: BLE001 - a kernel not installed where the report is made
        return None, "", f"error heatmap skipped: cannot build {spec} here: {_first_line(e)}"
    if getattr(kernel, "requires_gpu", False) or not kernel_available(kernel)[0]:
        return None, "", f"error heatmap skipped: {spec} does not run on this CPU"
    inputs = make_inputs(case)
    k, v = inputs.clean_kv()
    ref, _ = attention_with_baseline(inputs.q, k, v, **inputs.reference_kwargs())
    status, out = kernel.run(inputs)
    if status != 0:
        return None, kernel.name, f"error heatmap skipped: {kernel.name} declined {row['case']}"
    err = np.abs(np.asarray(out, dtype=np.float64) - ref)  # (B, Sq, Hq, d)
    err = np.where(np.isnan(err), np.inf, err)
    b = int(np.unravel_index(int(np.argmax(err)), err.shape)[0])
    return err[b].max(axis=-1).T, kernel.name, ""  # (Hq, Sq): max over the head dim


def _plot_heatmap(plt, err, row: dict, kernel: str, path: Path) -> None:
    import numpy as np

    finite = np.where(np.isfinite(err), err, np.nan)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    im = ax.imshow(finite, aspect="auto", interpolation="nearest", cmap="magma")
    fig.colorbar(im, ax=ax, label="max over d of |out - ref|")
    if not np.isfinite(err).all():
        hh, rr = np.nonzero(~np.isfinite(err))
        ax.scatter(rr, hh, marker="s", s=4, color="cyan", label="NaN / Inf")
    h, i = np.unravel_index(int(np.argmax(err)), err.shape)
    ax.scatter([i], [h], marker="x", s=60, color="cyan", label=f"max at (h={h}, row={i})")
    ax.legend(fontsize=7, loc="upper right")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("query row")
    ax.set_ylabel("query head")
    ax.set_title(f"{row['case']} on {kernel}: error (relL2 {_e(row['rel_l2'])})", fontsize=9)
    fig.tight_layout()
    _save_png(fig, path)
    plt.close(fig)


def render_plots(doc: dict, params: dict, plot_dir: Path) -> dict:
    """Write the PNGs; ``{"written": [paths relative to out], "notes": [why something is missing]}``."""
    plots = {"written": [], "notes": []}
    plt = _matplotlib()
    if plot_dir.is_dir():
        for old in plot_dir.glob("*.png"):  # our own output: never leave stale plots behind
            old.unlink()
    if plt is None:
        plots["notes"].append(PLOTS_MISSING)
        return plots
    plot_dir.mkdir(parents=True, exist_ok=True)

    def attempt(name: str, fn, *a) -> None:
        path = plot_dir / f"{_safe_name(name)}.png"
        try:
            fn(plt, *a, path)
        except Exception as e:  # noqa: BLE001 - a broken plot must not lose the report
            plt.close("all")
            plots["notes"].append(f"plot {path.name} failed: {type(e).__name__}: {e}")
            return
        plots["written"].append(f"{plot_dir.name}/{path.name}")

    groups: dict = {}
    for r in doc["cases"]:
        groups.setdefault(r["kernel"], []).append(r)
    for kernel, rows in groups.items():
        if any(r["rel_l2"] is not None for r in rows):
            attempt(f"rel_l2-{kernel}", _plot_rel_l2, kernel, rows)
    for m in doc["measure"]:
        attempt(f"time_vs_past-{Path(m['source']).stem}", _plot_measure, m)
    if not doc["measure"]:
        plots["notes"].append("time vs past_len plot skipped: no GPU measure record")

    cpu = [r for r in doc["cases"] if r["origin"] == "run" and r["rel_l2"] is not None]
    worst = max(cpu, key=lambda r: r["rel_l2"], default=None)
    if worst is None:
        plots["notes"].append("error heatmap skipped: no CPU case with a relL2")
    else:
        p = params.get((worst["kernel"], worst["suite"], worst["case"]))
        err, kname, note = None, "", f"error heatmap skipped: {worst['case']} has no case parameters"
        try:
            if p:
                err, kname, note = heatmap_error(worst, p)
        except Exception as e:  # noqa: BLE001 - a case that cannot be re-run loses its plot only
            note = f"error heatmap skipped: re-running {worst['case']} raised {type(e).__name__}: {e}"
        if err is None:
            plots["notes"].append(note)
        else:
            attempt(f"error_heatmap-{worst['case']}", _plot_heatmap, err, worst, kname)

    for k in doc["kill_matrices"]:
        if k["mutants"] and k["cases"]:
            attempt(f"kill_matrix-{k['kernel']}", _plot_kill_grid, k)
    return plots


# --------------------------------------------------------------------------- the command

def load_baseline(path: Path) -> dict | None:
    """The baseline document, or None when the file does not exist. A file that exists but is
    not a schema-1 report is a usage error (exit 2), not a silent "no baseline"; one whose
    fields have the wrong shape is :func:`baseline_problems`' business."""
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # ValueError: JSON, UTF-8, a huge integer
        raise UsageError(f"baseline: cannot read {path}: {type(e).__name__}: {_first_line(e)}") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        got = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise UsageError(f"baseline: {path} is not a schema-{SCHEMA} report (schema {got!r})")
    return doc


def baseline_problems(baseline: dict | None, path: Path, *, updating: bool) -> list[Finding]:
    """What makes ``baseline`` unfit to diff against, as failures: missing (unless
    ``updating``: ``--update-baseline`` is how the first one is made), fields of the wrong
    shape, or nothing in it to compare (no cases, kill matrices or GPU records)."""
    if baseline is None:
        return [] if updating else [Finding("failure", "baseline missing", str(path), "",
                                            "no such file (make one with --update-baseline)")]
    found = schema.problems(baseline, schema.BASELINE)
    if found:
        return [Finding("failure", "unreadable input", str(path), "", _shape_problems(found))]
    if not (baseline["cases"] or baseline["kill_matrices"] or baseline["gpu_records"]) and not updating:
        return [Finding("failure", "baseline empty", str(path), "",
                        "no cases, kill matrices or GPU records to compare against")]
    return []


def make_report(in_dir: Path, out_dir: Path, baseline_path: Path, *, updating: bool = False) -> dict:
    """Collect, build, diff, render and write ``latest.json`` / ``latest.md`` / plots.
    Returns the document (its ``findings`` say what ``--check`` fails on). Both texts are
    made before either is written, and each is written atomically, so the two never
    disagree and a reader never sees half of one."""
    col = collect(in_dir)
    params: dict = {}
    doc = build(col, params=params)
    baseline = load_baseline(baseline_path)
    unfit = baseline_problems(baseline, baseline_path, updating=updating)
    if unfit and baseline is not None:
        baseline = None  # fields of the wrong shape: diff against nothing, and say so
    findings = unfit + diff(doc, baseline)
    if baseline is None:
        note = (f"no baseline at {baseline_path} yet; --update-baseline writes this report there"
                if updating and not baseline_path.exists()
                else f"no baseline at {baseline_path}; only current failures are checked")
        short = "no baseline"
    else:
        note = f"`{baseline_path}` (generated {baseline.get('generated', '?')})"
        short = ""
    doc["baseline"] = {"path": str(baseline_path), "present": baseline is not None, "note": note,
                       "generated": None if baseline is None else baseline.get("generated")}
    doc["findings"] = [f.to_dict() for f in findings]
    doc["summary"] = summarize(doc, findings, short)
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = render_plots(doc, params, out_dir / "plots")
    doc["plots"] = plots
    texts = {out_dir / "latest.json": json_text(doc), out_dir / "latest.md": render_markdown(doc, plots)}
    _write_together(texts)
    return doc


def _write_together(texts: dict[Path, str]) -> None:
    """Write several files so that none is replaced unless every one could be written: each
    text goes first to a hidden file beside its target (:func:`atomic_write_text`), then the
    hidden files are renamed over their targets, back to back. A failure before the renames
    (a full disk) leaves every target as it was, and no hidden file behind."""
    staged: list[tuple[Path, Path]] = []
    try:
        for path, text in texts.items():
            pending = path.with_name(f".{path.name}.pending")
            staged.append((pending, path))
            atomic_write_text(pending, text)
        for pending, path in staged:
            os.replace(pending, path)
    finally:
        for pending, _ in staged:
            try:
                pending.unlink()
            except FileNotFoundError:
                pass


def _baseline_refused(doc: dict) -> str:
    """Why the report ``doc`` must not become the baseline, or "": a baseline made while an
    input is unreadable or missing would leave that input's entries out and so stop comparing
    them, and one with no cases, kill matrices or GPU records compares nothing."""
    inputs = doc["inputs"]
    if inputs["unreadable"]:
        files = [u["file"] for u in inputs["unreadable"]]
        return (f"{', '.join(files)} {'is' if len(files) == 1 else 'are'} unreadable (a baseline "
                "without it would stop comparing what it holds)")
    if inputs["missing"]:
        return f"an input is missing: {inputs['missing'][0]}"
    if not (doc["cases"] or doc["kill_matrices"] or doc["gpu_records"]):
        return "the report has no cases, kill matrices or GPU records (a baseline of it compares nothing)"
    return ""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--in", dest="in_dir", type=Path, default=Path("reports"), metavar="DIR",
                   help="where run-*.json, mutants-*.json and gpu/*.json are (default: reports)")
    p.add_argument("--out", dest="out_dir", type=Path, default=None, metavar="DIR",
                   help="where latest.json, latest.md and plots/ go (default: reports)")
    p.add_argument("--baseline", type=Path, default=None, metavar="PATH",
                   help="the committed baseline report (default: <in>/baseline.json)")
    p.add_argument("--check", action="store_true",
                   help="exit 1 on any regression against the baseline or any current failure")
    p.add_argument("--update-baseline", action="store_true",
                   help="copy the new latest.json to the baseline path (after the check)")
    p.epilog = ("examples:\n  refattn report\n  refattn report --check\n"
                "  refattn report --update-baseline      # then commit reports/baseline.json\n\n"
                "exit status: 0 written (and, with --check, no regression or failure), 1 --check "
                "found one, --in does not exist, the report could not be written or "
                "--update-baseline refused, 2 usage error or unreadable baseline")


def run(args) -> int:
    in_dir = args.in_dir
    out_dir = args.out_dir if args.out_dir is not None else Path("reports")
    baseline_path = args.baseline if args.baseline is not None else in_dir / "baseline.json"
    if not in_dir.is_dir():  # nothing to report on: say so, and write (or create) nothing
        print(f"failure: input missing: {in_dir}: no such directory (--in)")
        return EXIT_FAIL
    check_output_dir("--out", out_dir)
    if args.update_baseline:
        check_output_file("--baseline", baseline_path)
    try:
        doc = make_report(in_dir, out_dir, baseline_path, updating=args.update_baseline)
    except OSError as e:  # a full disk, a directory removed meanwhile: nothing half-written
        print(f"report: error: cannot write the report into {out_dir}: {e.strerror or e}; "
              "latest.json and latest.md are as they were", file=sys.stderr)
        return EXIT_FAIL
    print(doc["summary"]["line"])
    for f in doc["findings"]:
        print("  " + f["line"])
    if not doc["baseline"]["present"]:
        print(f"report: {doc['baseline']['note']}")
    if doc["plots"]["notes"] and any(n == PLOTS_MISSING for n in doc["plots"]["notes"]):
        print(f"report: {PLOTS_MISSING}")
    print(f"report: wrote {out_dir / 'latest.json'}, {out_dir / 'latest.md'}"
          + (f", {len(doc['plots']['written'])} plots in {out_dir / 'plots'}" if doc["plots"]["written"] else ""))
    if args.update_baseline:
        refused = _baseline_refused(doc)
        if refused:
            print(f"report: baseline not updated: {refused}", file=sys.stderr)
            return EXIT_FAIL
        try:
            atomic_write_text(baseline_path, json_text(doc))  # the text of latest.json
        except OSError as e:
            print(f"report: error: baseline not updated: cannot write {baseline_path}: "
                  f"{e.strerror or e}", file=sys.stderr)
            return EXIT_FAIL
        print(f"report: baseline updated: copied {out_dir / 'latest.json'} to {baseline_path}")
    sys.stdout.flush()
    if args.check and doc["findings"]:
        return EXIT_FAIL
    return EXIT_OK
