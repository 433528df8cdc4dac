"""GPU records: what a run of the kernel on real hardware showed, committed under
``reports/gpu/`` so that "works on GPU" is always backed by a run of the code as it is.

Every record is a JSON object carrying ``kernel_source_hash`` (``api.source_hash()`` at the
time of the run), ``device``, ``date``, and ``ok``. CI has no GPU; it runs
``python -m hipkernel.record --check reports/gpu`` which fails when any record's hash
differs from the current kernel source (stale) or when a record says it failed.

Record kinds (field ``kind``): ``matrix`` (case matrix: per-case outcome, relL2, max-abs,
time, autotune choices), ``mutants`` (GPU kill matrix), ``measure`` (timings the issues ask
to record), ``bench`` (peer benchmark), ``reliability`` (determinism, sanitizer, fuzzing).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path

from hipkernel.api import source_hash

SCHEMA = 1


def stamp(kind: str, device: str, body: dict, ok: bool) -> dict:
    """Wrap a result body into a record carrying the kernel source hash."""
    return {
        "schema": SCHEMA,
        "kind": kind,
        "kernel_source_hash": source_hash(),
        "device": device,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "ok": bool(ok),
        **body,
    }


def check_record(rec: dict, current_hash: str | None = None) -> list[str]:
    """Problems with one record (empty list = fresh and passing)."""
    current_hash = current_hash or source_hash()
    problems = []
    for key in ("schema", "kind", "kernel_source_hash", "device", "ok"):
        if key not in rec:
            problems.append(f"missing field {key!r}")
    if problems:
        return problems
    if rec["kernel_source_hash"] != current_hash:
        problems.append(f"stale: recorded hash {rec['kernel_source_hash'][:12]} != current "
                        f"kernel source {current_hash[:12]} (re-run on the GPU)")
    if not rec["ok"]:
        problems.append("the recorded run failed: " + _failure_detail(rec))
    return problems


def _failure_detail(rec: dict) -> str:
    bad = [r.get("case", "?") + ":" + str(r.get("outcome")) for r in rec.get("results", [])
           if r.get("outcome") not in ("pass", "declined")]
    survivors = [m["name"] for m in rec.get("mutants", [])
                 if not m.get("killed") and not m.get("equivalent")]
    parts = []
    if bad:
        parts.append("cases " + ", ".join(bad[:10]))
    if survivors:
        parts.append("surviving mutants " + ", ".join(survivors))
    if rec.get("clean_ok") is False:
        parts.append("the clean kernel failed")
    return "; ".join(parts) or "ok is false"


def check_dir(path: Path, require: tuple[str, ...] = ("h200.json",)) -> list[str]:
    """Problems across every record in ``path``; required files must exist."""
    path = Path(path)
    problems = []
    for name in require:
        if not (path / name).exists():
            problems.append(f"{path / name}: missing (run the GPU matrix on the H200 and commit it)")
    current = source_hash()
    for f in sorted(path.glob("*.json")):
        try:
            rec = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError) as e:
            problems.append(f"{f}: unreadable: {e}")
            continue
        problems += [f"{f.name}: {p}" for p in check_record(rec, current)]
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hipkernel.record",
                                 description="Check committed GPU records against the current kernel source.")
    ap.add_argument("--check", type=Path, default=Path("reports/gpu"), metavar="DIR",
                    help="directory of GPU records (default: reports/gpu)")
    args = ap.parse_args(argv)
    problems = check_dir(args.check)
    if problems:
        print("GPU records: FAIL", file=sys.stderr)
        for p in problems:
            print("  - " + p, file=sys.stderr)
        return 1
    n = len(list(args.check.glob("*.json")))
    print(f"GPU records: {n} fresh and passing (kernel source {source_hash()[:12]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
