"""`refattn implementations`: which implementation holds the semantics on which features,
as a table rendered from recorded runs.

    refattn implementations [--in PATH ...] [--out FILE] [--check]

Every ``*.json`` of each PATH, a directory or a file (default: ``reports/implementations``
and the GPU matrix record ``reports/gpu/h200.json``), is a run record: the JSON of
``refattn run``, or a GPU matrix record of the same shape. Each becomes one row: the
implementation, the version it ran (the record's ``kernel_source_hash`` and ``kernel_facts``),
the device, and per feature what the record's cases with that feature came to:

* ``N pass``: every such case passed the derived gate;
* ``declined``: the implementation declined every such case (the reasons are listed under
  the table, once each);
* ``N pass, M declined``: some of each;
* ``FAIL k/N``: k cases failed the gate (or violated the contract);
* ``ERROR k/N``: k cases raised (the implementation could not run them).

A feature is a predicate over a case's parameters (:data:`FEATURES`); a cell with no such
case in the record is ``-`` (not run). The last columns are the decline behaviour (every
decline left the output untouched, or how many did not) and the worst ratio of a case's
relL2 to its gate. ``--out`` writes the Markdown; ``--check`` compares it with the file and
fails when the file is not what the records say (the table is never edited by hand).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

DEFAULT_IN = ("reports/implementations", "reports/gpu/h200.json")
DEFAULT_OUT = "docs/implementations.md"

def _longest_past(p: dict) -> int:
    """A result's past_len: the int, or a ragged batch's longest."""
    past = p.get("past_len", 0)
    return max(past) if isinstance(past, list) else int(past)


# name -> (column title, predicate over a result's "params")
FEATURES: dict[str, tuple[str, Callable[[dict], bool]]] = {
    "sink": ("per-head sink", lambda p: p.get("sink") == "per_head"),
    "smooth": ("smooth softmax", lambda p: p.get("sink") == "smooth"),
    "window": ("window (local_window_size)", lambda p: int(p.get("window", -1)) > 0),
    "chunked": ("chunk over a cache (past_len > 0)", lambda p: _longest_past(p) > 0),
    "gqa": ("GQA (Hq > Hkv)", lambda p: int(p.get("Hq", 1)) > int(p.get("Hkv", 1))),
    "batch_cache": ("B > 1 with a cache", lambda p: int(p.get("B", 1)) > 1 and _longest_past(p) > 0),
    "ragged": ("ragged batch (per-sequence lengths)",
               lambda p: isinstance(p.get("past_len"), list) or p.get("q_len") is not None),
    "softcap": ("softcap", lambda p: float(p.get("softcap") or 0) > 0),
    "evicted": ("NaN/inf in slots no row sees", lambda p: (p.get("cache_fill") or "clean") != "clean"),
    "offset": ("logit offset", lambda p: float(p.get("logit_offset") or 0) != 0),
    "fp16": ("fp16", lambda p: p.get("dtype") == "fp16"),
    "bf16": ("bf16", lambda p: p.get("dtype") == "bf16"),
    "fp32": ("fp32", lambda p: p.get("dtype") == "fp32"),
}


@dataclass
class Row:
    file: str
    kernel: str
    version: str
    device: str
    cells: dict[str, str]
    declines: str
    worst: str
    reasons: list[str]
    total: str


def _version(doc: dict) -> str:
    """The record's ``kernel_source_hash``: a version string as it is (``onnxruntime-1.32.0:
    CPUExecutionProvider``), a hex source hash by its head."""
    h = str(doc.get("kernel_source_hash") or "unstamped")
    if len(h) > 16 and all(c in "0123456789abcdef" for c in h):
        h = f"source {h[:12]}"
    return h


def _device(doc: dict) -> str:
    for where in (doc, doc.get("kernel_facts") or {}):
        if where.get("device"):
            return str(where["device"])
    facts = doc.get("kernel_facts") or {}
    if facts.get("memory") == "device":  # a C entry point on device memory
        return f"GPU, through {facts.get('device_runtime') or 'a device runtime'}"
    host = doc.get("host") or {}
    return "CPU" + (f" ({host['machine']})" if host.get("machine") else "")


def _cell(results: list[dict]) -> str:
    if not results:
        return "-"
    n = len(results)
    wrong = sum(r.get("outcome") in ("fail", "contract-violation") for r in results)
    raised = sum(r.get("outcome") == "error" for r in results)
    if wrong or raised:
        return ", ".join(([f"FAIL {wrong}/{n}"] if wrong else []) +
                         ([f"ERROR {raised}/{n}"] if raised else []))
    passed = sum(r.get("outcome") == "pass" for r in results)
    declined = n - passed
    if not passed:
        return "declined"
    return f"{passed} pass" + (f", {declined} declined" if declined else "")


def _reason(note: str) -> str:
    """The kernel's reason from a declined result's note (after the runner's own words)."""
    head = "declined (status -1), output buffer untouched"
    note = (note or "").strip()
    if note.startswith(head):
        note = note[len(head):].lstrip(": ").strip()
    return note.split("; the seed kernel declined")[0].strip() or "no reason given"


def row_of(path: Path) -> Row:
    """One record as a table row; ValueError naming the file when it is not a run record."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read a run record: {e}") from None
    results = doc.get("results") if isinstance(doc, dict) else None
    if not isinstance(results, list) or not all(isinstance(r, dict) and isinstance(r.get("params"), dict)
                                                for r in results):
        raise ValueError(f"{path}: not a run record (needs results with params)")
    cells = {k: _cell([r for r in results if pred(r["params"])]) for k, (_, pred) in FEATURES.items()}
    declined = [r for r in results if r.get("outcome") == "declined"]
    violations = sum(r.get("outcome") == "contract-violation" for r in results)
    declines = ("none" if not declined and not violations else
                f"{len(declined)} clean" + (f", {violations} VIOLATED" if violations else ""))
    ratios = [r["rel_l2"] / r["gate"] for r in results
              if r.get("outcome") in ("pass", "fail") and isinstance(r.get("rel_l2"), (int, float))
              and isinstance(r.get("gate"), (int, float)) and r["gate"] > 0]
    worst = f"{max(ratios):.3g}" if ratios else "-"
    reasons = sorted({_reason(r.get("note", "")) for r in declined})
    passed = sum(r.get("outcome") == "pass" for r in results)
    total = f"{passed}/{len(results)} pass, {len(declined)} declined"
    wrong = sum(r.get("outcome") in ("fail", "contract-violation") for r in results)
    raised = sum(r.get("outcome") == "error" for r in results)
    total += (f", {wrong} FAIL" if wrong else "") + (f", {raised} ERROR" if raised else "")
    return Row(path.name, str(doc.get("kernel") or doc.get("kernel_spec") or path.stem),
               _version(doc), _device(doc), cells, declines, worst, reasons, total)


def render(rows: list[Row], source: str) -> str:
    heads = ["implementation", "version", "device", "cases"] + [t for t, _ in FEATURES.values()] + [
        "declines", "worst relL2 / gate"]
    lines = [
        "# Implementations against the semantics",
        "",
        f"Rendered by `refattn implementations` from the run records in {source}; do not edit",
        "by hand (`refattn implementations --check` fails when this file and the records differ).",
        "Each cell counts that record's cases with the feature: `N pass`, `declined` (every such",
        "case declined, reason below), `FAIL k/N` (wrong output), `ERROR k/N` (raised), or `-`",
        "(no such case was run). The semantics are docs/semantics.md; each case is judged under",
        "its derived gate.",
        "",
        "| " + " | ".join(heads) + " |",
        "|" + "---|" * len(heads),
    ]
    for r in rows:
        cells = [r.kernel, f"`{r.version}`", r.device, r.total] + [r.cells[k] for k in FEATURES] + [
            r.declines, r.worst]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    lines += ["", "## Reasons given for declines", ""]
    for r in rows:
        if r.reasons:
            lines.append(f"* **{r.kernel}** (`{r.file}`):")
            lines += [f"  * {why}" for why in r.reasons]
    if not any(r.reasons for r in rows):
        lines.append("None.")
    return "\n".join(lines) + "\n"


def build(sources: list[Path]) -> str:
    """The Markdown table of every record in ``sources`` (directories and files)."""
    paths = []
    for src in sources:
        if src.is_dir():
            found = sorted(src.glob("*.json"))
            if not found:
                raise ValueError(f"--in: no run records (*.json) in {src}")
            paths += found
        elif src.is_file():
            paths.append(src)
        else:
            raise ValueError(f"--in: {src} is neither a directory nor a file")
    return render([row_of(p) for p in paths], ", ".join(f"`{s.as_posix()}`" for s in sources))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--in", dest="sources", action="append", metavar="PATH",
                   help="a directory of run records (*.json, one per implementation) or one "
                        f"record; repeatable (default: {' and '.join(DEFAULT_IN)})")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="FILE",
                   help=f"the Markdown table (default {DEFAULT_OUT}); - for stdout")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 when FILE is not what the records render to")
    p.epilog = ("examples:\n  refattn run --kernel ort:cpu --suite seed --json reports/implementations/ort-cpu.json\n"
                "  refattn implementations            # rewrites docs/implementations.md\n"
                "  refattn implementations --check    # CI: the table is the records'\n\n"
                "exit status: 0 written or up to date, 1 out of date (--check), 2 unreadable records")


def run(args) -> int:
    from refattn.cli import EXIT_FAIL, EXIT_OK, UsageError

    sources = [Path(s) for s in (args.sources or DEFAULT_IN)]
    where = " ".join(f"--in {s}" for s in sources)
    try:
        text = build(sources)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.check:
        out = Path(args.out)
        have = out.read_text(encoding="utf-8") if out.is_file() else None
        if have != text:
            print(f"implementations: {out} is not what the records render to; run "
                  f"`refattn implementations {where} --out {out}`", file=sys.stderr)
            return EXIT_FAIL
        print(f"implementations: {out} matches the records")
        return EXIT_OK
    if args.out == "-":
        sys.stdout.write(text)
        return EXIT_OK
    from refattn.fileio import atomic_write_text, check_output_file

    out = check_output_file("--out", Path(args.out))
    atomic_write_text(out, text)
    print(f"implementations: wrote {out}")
    return EXIT_OK
