"""GPU records: what a run of the kernel on real hardware showed, committed under
``reports/gpu/`` so that "works on GPU" is always backed by a run of the code as it is.

Every record is a JSON object carrying ``kernel_source_hash`` (``api.source_hash()``, over the
kernel and its launch code, at the time of the run; a record of the torch entry point
``api.torch_source_hash()``), ``device``, ``date``, and ``ok``. CI has no GPU; it runs
``python -m hipkernel.record --check reports/gpu`` which fails when any record's hash
differs from the current kernel source (stale) or when a record says it failed, and when a
bench record timed no peer (torch did not import: hipkernel alone says nothing against SDPA,
cuDNN or Flex).

Record kinds (field ``kind``): ``matrix`` (case matrix: per-case outcome, relL2, max-abs,
time, autotune choices), ``mutants`` (GPU kill matrix), ``measure`` (timings the issues ask
to record), ``bench`` (peer benchmark), ``reliability`` (determinism, sanitizer, fuzzing),
``mma_check`` (kill matrices with each tensor-core config forced, and their kernel-only
times), ``torch`` (the torch entry point: its case matrix, stream, graph and compile checks,
host path timings), ``scaling`` (the GPU tests on one GPU and on two).

Every kind but ``scaling`` must be a run of the kernel source as it is: those records say
what this kernel does on the GPU. A ``scaling`` record says how the test harness spreads over
GPUs (pytest-xdist workers pinned one a GPU); it needs a machine with two GPUs, which is not
always at hand. A kernel edit therefore *carries* the last scaling record forward: it stays,
labelled with the kernel it ran (:func:`freshness` gives ``"carried"``), and must still be
``ok``. So a kernel change lands on the one-GPU records, and no kernel change waits on a
machine that cannot be had; ``--check`` names every carried record.

``python -m hipkernel.record --collect RECORDS RELIABILITY [SCALING]`` turns the outputs of
``scripts/hipkernel_records.sh`` (its ``rec/`` and ``rel/`` folders, and, on a machine with
two GPUs, ``python -m hipkernel.scaling``) into ``reports/gpu/``: it checks
that every one is a run of the kernel source as it is here and passed, and writes nothing
otherwise. Without SCALING the committed scaling record is kept as it is.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path

from hipkernel.api import source_hash, torch_source_hash
from refattn import records, schema
from refattn.records import CARRIED_KINDS, carried_note  # noqa: F401 - re-exported
from refattn.fileio import atomic_write_text

SCHEMA = 1


# Registry names of this package's kernels whose records carry a hash other than
# ``api.source_hash()``, and that hash.
_OWN_HASHES = {"hipkernel-torch": torch_source_hash}


def hash_of(kernel: str) -> str:
    """The source hash a record of ``kernel`` (a registry name) is stamped with and judged
    against: ``api.source_hash()``, or the torch entry point's (``api.torch_source_hash``)."""
    return _OWN_HASHES.get(kernel, source_hash)()


def _current(rec, default: str) -> str:
    """The hash ``rec`` is judged against: its own kernel's (``hash_of``), else ``default``."""
    spec = records.record_spec(rec) if isinstance(rec, dict) else None
    return hash_of(spec) if spec in _OWN_HASHES else default


def stamp(kind: str, device: str, body: dict, ok: bool, kernel: str = "hipkernel") -> dict:
    """Wrap a result body into a record carrying the kernel source hash and the registry name
    of the kernel it is the hash of (``refattn.records``)."""
    return {
        "schema": SCHEMA,
        "kind": kind,
        "kernel_spec": kernel,
        "kernel_source_hash": hash_of(kernel),
        "device": device,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "ok": bool(ok),
        **body,
    }


def freshness(rec: dict, current_hash: str) -> str:
    """``"fresh"`` (a run of ``current_hash``), ``"carried"`` (a CARRIED_KINDS record of an
    earlier kernel source) or ``"stale"`` (any other record of another kernel source):
    ``refattn.records.freshness`` against this package's own hash."""
    return records.freshness(rec, current_hash)


def check_record(rec: dict, current_hash: str | None = None) -> list[str]:
    """Problems with one record (empty list = fresh or carried, and passing)."""
    current_hash = current_hash or _current(rec, source_hash())
    problems = schema.gpu_common_problems(rec)  # hash, kind, device and ok, typed
    if problems:
        return problems
    if freshness(rec, current_hash) == "stale":
        problems.append(f"stale: recorded hash {rec['kernel_source_hash'][:12]} != current "
                        f"kernel source {current_hash[:12]} (re-run on the GPU)")
    shape = schema.gpu_kind_problems(rec) or _kill_matrices_problems(rec)  # what is read below
    if shape:
        return problems + shape
    if not rec["ok"]:
        problems.append("the recorded run failed: " + _failure_detail(rec))
    if rec["kind"] == "bench":
        problems += _bench_problems(rec)
    return problems


def _bench_problems(rec: dict) -> list[str]:
    """A committed bench record must hold at least one peer timed in the same run: without
    torch the bench still times the kernel alone (on the host clock, launch overhead inside,
    ``refattn.bench``), which says nothing against SDPA, cuDNN, Flex or FlashAttention. A
    record of ``refattn.bench`` (shapes with ``results``) must also have timed a peer on some
    shape: peers available but each n/a or mismatched on every shape compare nothing."""
    avail = rec.get("peers_available")
    if not isinstance(avail, dict):
        return ["missing field 'peers_available' (which peers the bench could run)"]
    if not any(isinstance(p, dict) and p.get("available") for p in avail.values()):
        reasons = sorted({" ".join(str(p.get("reason", "?")).split())
                          for p in avail.values() if isinstance(p, dict)})
        return ["no peer ran in this bench (" + "; ".join(reasons or ["no peers listed"]) + "): "
                "re-run it where torch imports and sees the GPU"]
    rows = [r for r in rec.get("shapes") or [] if isinstance(r, dict) and isinstance(r.get("results"), dict)]
    if not rows:
        return []  # a record of the engine before refattn.bench, or the simpler "rows" body
    for r in rows:
        for entry in r["results"].values():
            if not isinstance(entry, dict) or entry.get("role") != "peer":
                continue
            for mode in ("sink", "nosink"):
                res = entry.get(mode)
                if isinstance(res, dict) and res.get("status") == "ok" and res.get("ms") is not None:
                    return []
    why = sorted({f"{name}: {res.get('status')}: {' '.join(str(res.get('reason', '')).split())[:120]}"
                  for r in rows for name, entry in r["results"].items()
                  if isinstance(entry, dict) and entry.get("role") == "peer"
                  for res in (entry.get("sink"), entry.get("nosink")) if isinstance(res, dict)})
    return ["no peer was timed on any shape of this bench (" + "; ".join(why[:6] or ["no peer results"])
            + "): a ratio needs a peer that passed its check"]


# An mma_check record's kill matrices (config name -> kill matrix), as _failure_detail reads
# them; refattn.schema checks only that each is an object.
_MMA_MATRIX = {"mutants": schema.Opt([schema.MUTANT]), "clean_ok": schema.Opt(bool)}


def _kill_matrices_problems(rec: dict) -> list[str]:
    """The problems of an mma_check record's kill matrices: there must be some (the record
    says how each tensor-core config kills the mutants), each of the shape read below."""
    if rec["kind"] != "mma_check":
        return []
    mutants = rec.get("mutants")
    if mutants is None:
        return ["mutants: missing" if "mutants" not in rec else "mutants: expected an object, got null"]
    return schema.problems(mutants, schema.Map(_MMA_MATRIX), "mutants") if isinstance(mutants, dict) else []


def _kill_matrices(rec: dict) -> list[tuple[str, dict]]:
    """(config, kill matrix) of a record: one unnamed for a ``mutants`` record, one a config
    for an ``mma_check`` record (or one unnamed, where it holds a plain list of mutants), none
    for the other kinds, whose fields say nothing about mutants."""
    if rec["kind"] == "mutants":
        return [("", rec)]
    if rec["kind"] == "mma_check":
        mutants = rec["mutants"]
        return list(mutants.items()) if isinstance(mutants, dict) else [("", {"mutants": mutants})]
    return []


def _failure_detail(rec: dict) -> str:
    """What failed in a record that says it failed, from the fields of its kind (checked)."""
    bad = [r["case"] + ":" + r["outcome"] for r in rec.get("results") or []
           if r["outcome"] not in ("pass", "declined")]
    parts = []
    if bad:
        parts.append("cases " + ", ".join(bad[:10]))
    for cfg, km in _kill_matrices(rec):
        where = f" ({cfg})" if cfg else ""
        survivors = [m["name"] for m in km.get("mutants") or []
                     if not m["killed"] and not m.get("equivalent")]
        if survivors:
            parts.append(f"surviving mutants{where} " + ", ".join(survivors))
        if km.get("clean_ok") is False:
            parts.append(f"the clean kernel failed{where}")
    return "; ".join(parts) or "ok is false"


def check_dir(path: Path, require: tuple[str, ...] = ("h200.json",)) -> list[str]:
    """Problems across every record in ``path``; required files must exist."""
    path = Path(path)
    problems = []
    for name in require:
        if not (path / name).exists():
            problems.append(f"{path / name}: missing (run the GPU matrix on the H200 and commit it)")
    current = source_hash()
    for f, rec, error in _read_dir(path):
        if error:
            problems.append(f"{f.name}: unreadable: {error}")
        else:
            problems += [f"{f.name}: {p}" for p in check_record(rec, _current(rec, current))]
    return problems


def carried_in(path: Path) -> list[str]:
    """One line for each carried record in ``path`` (see :func:`freshness`)."""
    current = source_hash()
    return [f"{f.name}: {carried_note(rec)}" for f, rec, error in _read_dir(Path(path))
            if not error and not schema.gpu_common_problems(rec)
            and freshness(rec, _current(rec, current)) == "carried"]


def _read_dir(path: Path):
    """(file, document, None) or (file, None, error) for each ``*.json`` in ``path``. The
    document is any JSON value: :func:`check_record` says what is wrong with its shape."""
    for f in sorted(path.glob("*.json")):
        try:
            yield f, json.loads(f.read_text(encoding="utf-8")), None
        except (OSError, ValueError, RecursionError) as e:  # ValueError: JSON, UTF-8, a huge integer
            yield f, None, f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


# Where each record of reports/gpu/ comes from. Both H200 scripts run the matrix, measure and
# bench sections; the reliability run's (the later, behind the sanitizers) are kept.
FROM_RECORDS = ("mutants-h200.json",)
FROM_RELIABILITY = ("h200.json", "measure-h200.json", "torch-h200.json", "bench-h200.json",
                    "reliability-h200.json")
# Collected when the run wrote it: the torch entry point's record is judged against its own
# hash (api.torch_source_hash), so a run of the kernel's records without it is complete; a
# committed one then stays as it is, and the check says whether it is still fresh.
OPTIONAL_FROM_RELIABILITY = ("torch-h200.json",)
SCALING_RECORD = "scaling-h200x2.json"
MMA_CHECK_RECORD = "mma-check-h200.json"
MMA_CHECK_COMMAND = ("GPUS=2 OUT=dir bash scripts/hipkernel_records.sh (GPU 1: python3 "
                     "scripts/mma_check.py --sections mutants,sweep)")
# On one GPU scripts/hipkernel_records.sh runs the kill matrices untimed beside the sanitizers
# and leaves the sweep out: its mma_check.json has no "sweep" section.
MMA_CHECK_COMMAND_ONE_CALL = ("GPUS=1 OUT=dir bash scripts/hipkernel_records.sh (python3 "
                              "scripts/mma_check.py --sections mutants, beside the sanitizers)")


def _load(path: Path, what: str) -> dict:
    if not path.is_file():
        raise ValueError(f"{what}: {path} is missing")
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # ValueError: JSON, UTF-8, a huge integer
        raise ValueError(f"{what}: {path} is unreadable: {type(e).__name__}: "
                         f"{' '.join(str(e).split())[:300]}") from None
    if not isinstance(rec, dict):
        raise ValueError(f"{what}: {path} is not a JSON object")
    return rec


def _kill_outcome(km: dict) -> tuple:
    """What a kill matrix of one config came to: ok, the clean run, and per mutant whether it
    was killed or counted equivalent (not which cases killed it, nor the times)."""
    mutants = km.get("mutants") if isinstance(km, dict) else None
    return (km.get("ok") if isinstance(km, dict) else None,
            km.get("clean_ok") if isinstance(km, dict) else None,
            sorted((str(m.get("name")), bool(m.get("killed")), bool(m.get("equivalent")))
                   for m in mutants or [] if isinstance(m, dict)))


def _kill_matrices_ok(mutants: dict) -> bool:
    """Whether every config's kill matrix in ``mutants`` (config name -> kill matrix) passed."""
    return all(isinstance(km, dict) and km.get("ok") is True for km in mutants.values())


def _merge_kill_matrices(base: dict, more, what: str) -> dict:
    """``base`` (scripts/mma_check.py's JSON, or a kill-matrix record made of it) with the kill
    matrices of ``more``, ``(file name, mma_check JSON)`` runs of the same kernel source that
    force configs ``base`` does not hold. The plan is ``base``'s (``mutants_planned``, or what
    it ran and listed as not run) and each run's; ``configs_not_run`` is what no run reached,
    and ``runs`` says which file gave which configs. A config an earlier run already holds is
    kept from that run when the later one came to the same outcome (``_kill_outcome``), and
    ``runs`` lists it under ``repeated``. Raises ValueError (``what``: who asks) on an empty
    kill matrix, another source, or a config whose runs disagree (the disagreement is the
    finding: neither is kept)."""
    merged = dict(base)
    mutants = dict(base.get("mutants") or {})
    if not mutants:
        raise ValueError(f"{what}: the first run holds no kill matrix")
    planned = list(base.get("mutants_planned")
                   or ([*mutants, *base["configs_not_run"]] if base.get("configs_not_run") else []))
    runs = list(base.get("runs") or [{"file": "mma_check.json", "configs": list(mutants)}])
    for name, raw in more:
        km = raw.get("mutants")
        if not isinstance(km, dict) or not km:
            raise ValueError(f"{what}: {name} holds no kill matrix (its mutants section is {km!r})")
        if raw.get("kernel_source_hash") != base.get("kernel_source_hash"):
            raise ValueError(f"{what}: {name} is a run of kernel source "
                             f"{str(raw.get('kernel_source_hash'))[:12]}, the first of "
                             f"{str(base.get('kernel_source_hash'))[:12]}")
        twice = sorted(set(km) & set(mutants))
        differ = [c for c in twice if _kill_outcome(km[c]) != _kill_outcome(mutants[c])]
        if differ:
            raise ValueError(f"{what}: {name} forces {', '.join(differ)} again and comes to "
                             f"another outcome than the run before it: the runs disagree")
        new = {c: body for c, body in km.items() if c not in mutants}
        mutants.update(new)
        if planned or raw.get("mutants_planned"):
            planned += [c for c in [*km, *(raw.get("mutants_planned") or [])] if c not in planned]
        runs.append({"file": name, "configs": list(new), **({"repeated": twice} if twice else {})})
    merged["mutants"] = mutants
    if planned:
        merged["mutants_planned"] = planned
        merged["configs_not_run"] = [c for c in planned if c not in mutants]
    if len(runs) > 1:
        merged["runs"] = runs
    return merged


def _merged_mma_checks(records: Path) -> dict:
    """The kill matrices of every ``mma_check*.json`` in ``records`` as one: the first run's
    ``mma_check.json``, then runs that completed it (``mma_check-<n>.json``, made with
    ``--configs`` set to what it did not reach), merged by ``_merge_kill_matrices``."""
    more = sorted(records.glob("mma_check-*.json"))
    return _merge_kill_matrices(_load(records / "mma_check.json", "records"),
                                [(p.name, _load(p, "records")) for p in more], "records")


def _mma_check_record(raw: dict, matrix: dict, path: Path) -> dict:
    """scripts/mma_check.py's output as a record: stamped with the hash the run wrote, ok when
    every kill matrix in it passed. A config it planned and did not reach is listed in
    ``configs_not_run`` (and by ``--check``), not counted as passed."""
    raw = dict(raw)
    run_hash = raw.pop("kernel_source_hash", None)
    if run_hash is None:
        raise ValueError(f"records: {path} carries no kernel_source_hash (scripts/mma_check.py "
                         f"writes it; re-run it)")
    mutants = raw.get("mutants")
    if not isinstance(mutants, dict) or not mutants:
        raise ValueError(f"records: {path} holds no kill matrix (its mutants section is "
                         f"{mutants!r})")
    ok = _kill_matrices_ok(mutants)
    body = {"command": MMA_CHECK_COMMAND if "sweep" in raw else MMA_CHECK_COMMAND_ONE_CALL,
            "note": "stamped by python -m hipkernel.record --collect from the device run's "
                    "mma_check.json, whose kernel source hash it checked"
                    + (f", with {', '.join(r['file'] for r in raw['runs'][1:])} completing it"
                       if raw.get("runs") else ""),
            "run_of": matrix.get("date"), **raw}
    rec = stamp("mma_check", matrix.get("device", "?"), body, ok)
    rec["kernel_source_hash"] = run_hash
    return rec


def devices_in(path: Path) -> str:
    """The devices the fresh records of ``path`` ran on, with how many each (their files
    keep the names the tools write, ``*-h200.json``, whichever card ran them)."""
    current = source_hash()
    seen: dict[str, int] = {}
    for f, rec, error in _read_dir(Path(path)):
        if not error and isinstance(rec, dict) and freshness(rec, _current(rec, current)) == "fresh":
            seen[str(rec.get("device"))] = seen.get(str(rec.get("device")), 0) + 1
    return ", ".join(f"{n} on {d}" for d, n in seen.items()) or "none fresh"


def incomplete_in(path: Path) -> list[str]:
    """One line for each record in ``path`` that names configs it planned and did not run
    (``configs_not_run`` of a kill-matrix record)."""
    return [f"{f.name}: not run: the kill matrices with {', '.join(map(str, rec['configs_not_run']))} forced"
            for f, rec, error in _read_dir(Path(path))
            if not error and isinstance(rec, dict) and rec.get("configs_not_run")]


def collect(records: Path, reliability: Path, scaling: Path | None, out: Path) -> list[str]:
    """Write the GPU records into ``out`` from the output folders of
    ``scripts/hipkernel_records.sh``, ``rec/`` (``records``) and ``rel/``
    (``reliability``), and the JSON of ``python -m hipkernel.scaling`` (``scaling``; None
    keeps the scaling record in ``out``, which the check then reports as carried). Files
    are copied byte for byte; mma_check.json, with any ``mma_check-<n>.json`` that completed
    it (``_merged_mma_checks``), becomes MMA_CHECK_RECORD. Raises ValueError,
    writing nothing, when one is missing, unreadable, not a run of the current kernel
    source, or failed; ``OPTIONAL_FROM_RELIABILITY`` records are collected only when present.
    Returns the names written."""
    records, reliability, out = Path(records), Path(reliability), Path(out)
    sources = ([(name, records / name, "records") for name in FROM_RECORDS]
               + [(name, reliability / name, "reliability") for name in FROM_RELIABILITY
                  if name not in OPTIONAL_FROM_RELIABILITY or (reliability / name).exists()]
               + ([(SCALING_RECORD, Path(scaling), "scaling")] if scaling is not None else []))
    staged = {name: _load(path, what) for name, path, what in sources}
    matrix_run = _load(records / "h200.json", "records")  # the run mma_check.json belongs to
    staged[MMA_CHECK_RECORD] = _mma_check_record(_merged_mma_checks(records), matrix_run,
                                                 records / "mma_check.json")
    current = source_hash()
    staged_runs = [*staged.items(), ("records/h200.json", matrix_run)]
    problems = [f"{name}: {p}" for name, rec in staged_runs
                for p in check_record(rec, _current(rec, current))]
    # what is collected is this run: nothing is carried in
    problems += [f"{name}: {carried_note(rec)}, not a run of the current kernel source "
                 f"{current[:12]}" for name, rec in staged_runs
                 if freshness(rec, _current(rec, current)) == "carried"]
    if problems:
        raise ValueError("nothing written:\n  " + "\n  ".join(problems))
    out.mkdir(parents=True, exist_ok=True)
    for name, path, _ in sources:  # byte for byte, each through a temporary file and a rename
        atomic_write_text(out / name, path.read_bytes().decode("utf-8"))
    atomic_write_text(out / MMA_CHECK_RECORD, json.dumps(staged[MMA_CHECK_RECORD], indent=1) + "\n")
    return sorted(staged)


# What --add takes on its own, beside the committed records of the same source: a record
# that no other record depends on.
ADDABLE = ("torch-h200.json", "bench-h200.json", "measure-h200.json")


def add(paths, out: Path) -> list[str]:
    """Complete the committed records in ``out`` from a later run on the same source, without
    re-running the rest: each path is a stamped record named in ``ADDABLE`` (written as it
    is), or scripts/mma_check.py's JSON of the configs the committed kill-matrix record did
    not reach (merged into MMA_CHECK_RECORD: one source, configs it does not hold yet). Each
    must be a passing run of the current source. Raises ValueError, writing nothing, else.
    Returns the names written."""
    out = Path(out)
    staged: dict[str, dict] = {}
    for path in map(Path, paths):
        raw = _load(path, "add")
        if "kind" in raw:  # a stamped record
            if path.name not in ADDABLE:
                raise ValueError(f"add: {path.name} is not one of {', '.join(ADDABLE)} (the "
                                 f"others come together from one run: --collect)")
            problems = check_record(raw)
            if problems:
                raise ValueError(f"add: {path}: " + "; ".join(problems))
            staged[path.name] = raw
            continue
        committed = staged.get(MMA_CHECK_RECORD) or _load(out / MMA_CHECK_RECORD, "add")
        current = source_hash()
        if committed.get("kernel_source_hash") != current:
            raise ValueError(f"add: {MMA_CHECK_RECORD} is of kernel source "
                             f"{str(committed.get('kernel_source_hash'))[:12]}, the tree "
                             f"{current[:12]} (a new source needs --collect)")
        rec = _merge_kill_matrices(committed, [(path.name, raw)], "add")
        rec["ok"] = _kill_matrices_ok(rec["mutants"])
        if not rec["ok"]:
            raise ValueError(f"add: {path}: a kill matrix in it failed")
        staged[MMA_CHECK_RECORD] = rec
    out.mkdir(parents=True, exist_ok=True)
    for name, rec in staged.items():
        atomic_write_text(out / name, json.dumps(rec, indent=1) + "\n")
    return sorted(staged)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m hipkernel.record",
        description="Check committed GPU records against the current kernel source, or collect "
                    "them from the H200 runs' outputs.",
        epilog="examples:\n  python -m hipkernel.record --check reports/gpu\n"
               "  python -m hipkernel.record --collect d/rec d/rel d/scaling.json\n"
               "  python -m hipkernel.record --collect d/rec d/rel   # one GPU: scaling carried\n"
               "  python -m hipkernel.record --add d/torch-h200.json d2/mma_check.json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", type=Path, default=Path("reports/gpu"), metavar="DIR",
                    help="directory of GPU records (default: reports/gpu)")
    ap.add_argument("--collect", nargs="+", type=Path, metavar="DIR",
                    help="RECORDS RELIABILITY [SCALING]: write the records into the --check "
                         "directory from the rec/ and rel/ folders of scripts/hipkernel_records.sh "
                         "and, when it was run (two GPUs), the JSON "
                         "of python -m hipkernel.scaling (else the scaling record there is "
                         "carried), then check them")
    ap.add_argument("--add", nargs="+", type=Path, metavar="JSON",
                    help="complete the --check directory's records from a later run of the same "
                         "source: a torch, bench or measure record as it is, or the JSON of "
                         "scripts/mma_check.py for the configs the kill-matrix record did not "
                         "reach (merged into it); then check them")
    args = ap.parse_args(argv)
    if args.collect and args.add:
        ap.error("--collect and --add: one at a time (--collect writes a whole run's records)")
    if args.add:
        try:
            written = add(args.add, args.check)
        except ValueError as e:
            print(f"GPU records: not added: {e}", file=sys.stderr)
            return 1
        print(f"GPU records: wrote {', '.join(written)} into {args.check}")
    if args.collect:
        if len(args.collect) not in (2, 3):
            ap.error(f"--collect takes RECORDS RELIABILITY [SCALING], got {len(args.collect)} "
                     f"paths")
        records, reliability, *scaling = args.collect
        try:
            written = collect(records, reliability, scaling[0] if scaling else None,
                              out=args.check)
        except ValueError as e:
            print(f"GPU records: not collected: {e}", file=sys.stderr)
            return 1
        print(f"GPU records: wrote {', '.join(written)} into {args.check}")
    problems = check_dir(args.check)
    if problems:
        print("GPU records: FAIL", file=sys.stderr)
        for p in problems:
            print("  - " + p, file=sys.stderr)
        return 1
    carried = carried_in(args.check)
    n = len(list(args.check.glob("*.json")))
    print(f"GPU records: {n - len(carried)} fresh and passing (kernel source "
          f"{source_hash()[:12]}; {devices_in(args.check)})"
          + (f", {len(carried)} carried and passing" if carried else ""))
    for line in carried + incomplete_in(args.check):
        print("  - " + line)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # its output piped into head, which closed early
        sys.stdout = None
        sys.exit(0)
