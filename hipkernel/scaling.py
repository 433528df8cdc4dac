"""How the GPU test suite scales over several GPUs: ``pytest -n N --dist loadgroup``
timed at each worker count N, on a warm compile cache, next to the host facts that explain it.

    python -m hipkernel.scaling --out DIR [--workers 1,2] [--fuzz-shards 20] [--per-shard 100]
                                [--suites seed,extended,contracts] [--timeout S]

The target is a speed-up of at least 1.8x on two H200s (``TARGET_SPEEDUP``). Timed plainly (the
two-worker run first, on a cold cache), two H200s measured 1.06x; two confounds explain it,
which this tool removes or records:

* The compile cache. Whichever run goes first on a cold ``$HIPKERNEL_CACHE_DIR`` pays the
  NVRTC compiles that the other then reads from disk. So before any timed run one child
  process compiles every module the runs can need (each head dim of ``config.HEAD_DIMS`` x
  each config of ``config.candidates(arch)``) into the disk cache, and that warm-up is timed
  on its own. It runs in a child so that this process holds no GPU context during the runs.
* The host's CPUs. Every worker checks the kernel against the fp64 reference (a thread pool)
  and NumPy (OpenBLAS: by default one spinning thread per host CPU, in every worker).
  Pinned workers take ``REFATTN_THREADS = min(8, usable CPUs // N)`` and hold BLAS and
  OpenMP to the same share (``refattn.sharding.pin_environment``); the record keeps
  ``os.cpu_count``, the affinity mask, the cgroup quota, the load average and each run's
  thread count. Measured on 2 H200s (32 CPUs): with only the compile cache warmed, 1.20x
  and every test 1.62x slower in parallel; with the BLAS share as well, 1.84x and 1.03x.

Each run is a subprocess, ``python -m pytest tests/test_matrix.py tests/test_fuzz.py -m gpu
--kernel hipkernel --suite ... -n N --dist loadgroup --junitxml DIR/junit-nN.xml`` with
``REFATTN_FUZZ_SHARDS`` and ``REFATTN_FUZZ_PER_SHARD`` set, in the order ``--workers`` gives.
``-n 1`` still starts one xdist worker, so every run pays the same worker start-up. pytest's
output goes to ``DIR/pytest-nN.log``.

The record, ``DIR/scaling.json`` (``kind: "scaling"``, stamped by ``hipkernel.record``), holds
the host facts, the warm-up, every run (wall time, exit status, pytest's summary line and the
per-test durations of its JUnit XML), ``speedup = wall(n=1) / wall(n=max)``,
``per_test_time_ratio`` (the summed per-test time at n=max over n=1: above 1, the tests themselves
got slower in parallel, i.e. contention), ``target_speedup`` and ``target_met``. ``ok`` is
true when every run exited 0 and every test passed; a missed target is a finding, not a
failed record (``python -m hipkernel.record --check`` fails on ``ok: false``).

Exit status: 0 when ok, 1 when a run failed, 2 when the warm-up could not run (no GPU
backend, a compile error).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET_SPEEDUP = 1.8  # two H200s at least 1.8x faster than one
TEST_FILES = ("tests/test_matrix.py", "tests/test_fuzz.py")
DEFAULT_SUITES = ("seed", "extended", "contracts")
SLOWEST_KEPT = 5  # per run, the slowest tests named in the record


# --------------------------------------------------------------------------- arguments

def parse_workers(text: str) -> tuple[int, ...]:
    """``"1,2"`` -> ``(1, 2)``: worker counts >= 1, in the order the runs go."""
    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise ValueError(f"--workers: expected comma-separated ints >= 1, got {text!r}")
    return counts


def parse_suites(text: str) -> tuple[str, ...]:
    """``"seed,extended"`` -> ``("seed", "extended")``."""
    names = tuple(x.strip() for x in text.split(","))
    if not all(names):
        raise ValueError(f"--suites: expected comma-separated suite names, got {text!r}")
    return names


def _positive(kind=int):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m hipkernel.scaling",
        description="Time the GPU test suite (tests/test_matrix.py + tests/test_fuzz.py, -m gpu) "
                    "under pytest -n N --dist loadgroup for each N, after warming the compile "
                    "cache once, and write DIR/scaling.json (a 'scaling' GPU record with the "
                    f"host facts, per-run times and the speed-up; target {TARGET_SPEEDUP}x).",
        epilog="Exit status: 0 when every run passed (a missed speed-up target is recorded, "
               "not a failure), 1 when a run failed, 2 when the warm-up could not run.")
    ap.add_argument("--out", type=Path, required=True, metavar="DIR",
                    help="where scaling.json, junit-nN.xml and pytest-nN.log go")
    ap.add_argument("--workers", default="1,2", metavar="N,N",
                    help="xdist worker counts, run in this order (default: 1,2)")
    ap.add_argument("--fuzz-shards", type=_positive(), default=20, metavar="K",
                    help="REFATTN_FUZZ_SHARDS: GPU fuzz tests (default: 20)")
    ap.add_argument("--per-shard", type=_positive(), default=100, metavar="M",
                    help="REFATTN_FUZZ_PER_SHARD: geometries per fuzz shard (default: 100)")
    ap.add_argument("--suites", default=",".join(DEFAULT_SUITES), metavar="A,B",
                    help="case suites of the matrix (default: seed,extended,contracts)")
    ap.add_argument("--timeout", type=_positive(float), default=1800.0,
                    metavar="S", help="seconds allowed per run before it is killed (default: 1800)")
    return ap


# --------------------------------------------------------------------------- host facts

def host_facts(environ: Mapping[str, str] | None = None) -> dict:
    """CPUs as the OS counts them and as this process may use them, the load, the GPUs."""
    from refattn.reference import THREADS_ENV
    from refattn.sharding import affinity_cpus, cgroup_cpu_limit, usable_cpus, visible_devices

    environ = os.environ if environ is None else environ
    devices = visible_devices(environ)
    return {"cpu_count": os.cpu_count(), "affinity_cpus": affinity_cpus(),
            "cgroup_cpu_limit": cgroup_cpu_limit(), "usable_cpus": usable_cpus(),
            "loadavg": _loadavg(), "gpus": len(devices), "gpu_source": devices.source,
            "refattn_threads_env": environ.get(THREADS_ENV)}


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# --------------------------------------------------------------------------- compile cache

def warm_cache(backend=None) -> dict:
    """Compile every module the runs can need into the disk cache: each head dim of
    ``config.HEAD_DIMS`` x each config of ``config.candidates(arch)`` that fits it (what the
    tuner and the fuzz shards can launch), as ``hipkernel.api``
    compiles them. ``backend`` defaults to ``get_backend()``. Returns what it did."""
    from hipkernel import api
    from hipkernel.config import HEAD_DIMS, candidates

    if backend is None:
        from hipkernel.backends import get_backend

        backend = get_backend()
    before = getattr(backend, "compiles", None)
    t0 = time.perf_counter()
    kernels = [backend.compile(api.kernel_source(cfg.path), api.kernel_defines(d, cfg),
                               api.KERNEL_NAME)
               for d in HEAD_DIMS for cfg in candidates(backend.arch) if cfg.fits(d)]
    cache = getattr(backend, "disk_cache", None)
    return {"backend": backend.name, "arch": backend.arch, "device_name": backend.device_name,
            "modules": len(kernels), "seconds": round(time.perf_counter() - t0, 3),
            "compiled": None if before is None else backend.compiles - before,
            "from_disk": sum(bool(getattr(k, "from_disk", False)) for k in kernels),
            "cache_dir": None if cache is None else str(cache.directory),
            "cache_enabled": None if cache is None else bool(cache.enabled)}


def warm_in_child() -> dict:
    """:func:`warm_cache` in a fresh process (spawned, not forked), so this one never holds a
    GPU context while the timed runs use the GPUs."""
    from hipkernel.scaling import warm_cache as warm  # by module name, also under ``-m``

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(warm).result()


def device_label(gpus: int, device_name: str) -> str:
    """The record's ``device``: ``"2x NVIDIA H200"``, or the name alone for one GPU."""
    return f"{gpus}x {device_name}" if gpus > 1 else device_name


# --------------------------------------------------------------------------- runs

def pytest_argv(workers: int, suites: Sequence[str], junit: Path) -> list[str]:
    """The timed command: the GPU tests of the matrix and the fuzzers on ``workers`` workers."""
    argv = [sys.executable, "-m", "pytest", *TEST_FILES, "-m", "gpu", "-p", "no:cacheprovider",
            "-q", "--kernel", "hipkernel"]
    for s in suites:
        argv += ["--suite", s]
    return argv + ["-n", str(workers), "--dist", "loadgroup", f"--junitxml={junit}"]


def run_env(fuzz_shards: int, per_shard: int, environ: Mapping[str, str] | None = None) -> dict:
    """This process's environment plus the fuzz size of the runs."""
    env = dict(os.environ if environ is None else environ)
    env.update(REFATTN_FUZZ_SHARDS=str(fuzz_shards), REFATTN_FUZZ_PER_SHARD=str(per_shard))
    return env


def command_text(argv: Sequence[str], env: Mapping[str, str]) -> str:
    """The run as one shell line, fuzz variables first, ``python`` for the interpreter."""
    fuzz = " ".join(f"{k}={env[k]}" for k in ("REFATTN_FUZZ_SHARDS", "REFATTN_FUZZ_PER_SHARD"))
    return f"{fuzz} {shlex.join(['python', *argv[1:]])}"


_SUMMARY = re.compile(r"\b\d+ (passed|failed|errors?|skipped|deselected|xfailed|xpassed)\b.* in ")


def summary_line(text: str) -> str | None:
    """pytest's last line, ``72 passed in 125.03s (0:02:05)``, without its ``=`` rule."""
    lines = [ln.strip(" =") for ln in text.splitlines() if _SUMMARY.search(ln)]
    return lines[-1] if lines else None


def timed_run(argv: Sequence[str], env: Mapping[str, str], timeout: float, log: Path) -> dict:
    """Run ``argv`` from the repository root with its output in ``log``; wall time, exit
    status, and pytest's summary line. Past ``timeout`` the run's whole process group (the
    xdist workers too) is killed."""
    t0 = time.perf_counter()
    timed_out = False
    with open(log, "w") as f:
        p = subprocess.Popen(list(argv), cwd=ROOT, env=dict(env), stdout=f,
                             stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            rc = _kill_group(p)
        except BaseException:
            _kill_group(p)
            raise
    return {"rc": rc, "wall_s": round(time.perf_counter() - t0, 3), "timed_out": timed_out,
            "pytest": summary_line(log.read_text(errors="replace")), "log": log.name}


def _kill_group(p: subprocess.Popen) -> int:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return p.wait()


def parse_junit(path: Path) -> dict:
    """Per-test durations and outcomes from pytest's JUnit XML: counts, summed and largest
    time, and the slowest tests."""
    rows = [(f"{c.get('classname', '')}::{c.get('name', '')}", float(c.get("time") or 0.0),
             _junit_outcome(c)) for c in ET.parse(path).getroot().iter("testcase")]
    counts = Counter(outcome for *_, outcome in rows)
    slowest = sorted(rows, key=lambda r: -r[1])[:SLOWEST_KEPT]
    return {"tests": len(rows), **{k: counts[k] for k in ("passed", "failed", "error", "skipped")},
            "sum_s": round(sum(t for _, t, _ in rows), 3),
            "max_s": round(max((t for _, t, _ in rows), default=0.0), 3),
            "slowest": [{"test": name, "time_s": round(t, 3)} for name, t, _ in slowest]}


def _junit_outcome(case: ET.Element) -> str:
    for tag, outcome in (("error", "error"), ("failure", "failed"), ("skipped", "skipped")):
        if case.find(tag) is not None:
            return outcome
    return "passed"


def run_workers(n: int, suites: Sequence[str], env: Mapping[str, str], out: Path,
                timeout: float, log=print) -> dict:
    """One timed run at ``n`` workers, with its JUnit durations."""
    from refattn.sharding import worker_threads

    junit = out / f"junit-n{n}.xml"
    junit.unlink(missing_ok=True)  # a stale file from an earlier run must not be read as this one's
    argv = pytest_argv(n, suites, junit)
    threads = worker_threads(n, env)
    log(f"n={n}: running {command_text(argv, env)} (REFATTN_THREADS={threads} per worker)")
    row = {"workers": n, "refattn_threads": threads, "loadavg_before": _loadavg(),
           "command": command_text(argv, env)}
    row.update(timed_run(argv, env, timeout, out / f"pytest-n{n}.log"))
    try:
        row["junit"] = parse_junit(junit)
    except (OSError, ET.ParseError) as e:
        row["junit"] = {"error": f"{type(e).__name__}: {e}"}
    log(f"n={n}: rc {row['rc']} in {row['wall_s']:.1f} s"
        + (" (timed out)" if row["timed_out"] else "") + f": {row['pytest'] or 'no summary'}")
    return row


# --------------------------------------------------------------------------- the record

def run_passed(run: Mapping) -> bool:
    """Exit status 0, not timed out, and every test of the JUnit XML passed."""
    j = run.get("junit") or {}
    return (run.get("rc") == 0 and not run.get("timed_out") and j.get("tests", 0) > 0
            and j.get("passed") == j.get("tests"))


def _finished(run: Mapping) -> bool:
    return not run.get("timed_out") and bool(run.get("wall_s"))


def _ends(runs: Sequence[Mapping]) -> tuple[Mapping, Mapping] | None:
    """The one-worker run and the run with the most workers, when both finished."""
    one = next((r for r in runs if r["workers"] == 1), None)
    top = max(runs, key=lambda r: r["workers"], default=None)
    if one is None or top is None or top["workers"] == 1:
        return None
    return (one, top) if _finished(one) and _finished(top) else None


def speedup(runs: Sequence[Mapping]) -> float | None:
    """``wall(n=1) / wall(n=max)``; None without a finished one-worker and multi-worker run."""
    ends = _ends(runs)
    return None if ends is None else ends[0]["wall_s"] / ends[1]["wall_s"]


def per_test_time_ratio(runs: Sequence[Mapping]) -> float | None:
    """Summed per-test time at n=max over n=1: 1.0 when parallel tests run as fast as alone."""
    ends = _ends(runs)
    sums = None if ends is None else [(r.get("junit") or {}).get("sum_s") for r in ends]
    return None if not sums or not all(sums) else sums[1] / sums[0]


# Targets of the runs from an installed wheel (scripts/scaling_fuzz.sh): the matrix over
# every shipped suite and the fuzzer, each on two GPUs against one.
WHEEL_TARGETS = {"run": 1.85, "fuzz": 1.9}


def compare_case_runs(one: Mapping, two: Mapping) -> dict:
    """Two ``refattn run --json`` documents of the same cases, on one GPU and on several.
    ``equal``: the merged run holds the same cases with the same outcomes (``differ`` names
    those that are missing on a side or differ). ``rel_l2_identical``: every case's relL2 is
    the same too; a tuned case may take another config on another run (timings decide), which
    changes its rounding, so those cases are listed (``rel_l2_differ``) but do not make the
    runs unequal. ``per_test_slowdown``: the median over the cases both timed of ``time_s``,
    several GPUs over one (above 1, the tests got slower side by side)."""
    def rows(doc):
        return {(r.get("suite"), r.get("case")): r for r in doc.get("results") or []
                if isinstance(r, Mapping)}

    a, b = rows(one), rows(two)
    both = set(a) & set(b)
    name = "{0[0]}/{0[1]}".format
    differ = sorted(name(k) for k in set(a) ^ set(b)) + sorted(
        name(k) for k in both if a[k].get("outcome") != b[k].get("outcome"))
    rel_differ = sorted(name(k) for k in both if a[k].get("outcome") == b[k].get("outcome")
                        and a[k].get("rel_l2") != b[k].get("rel_l2"))
    ratios = [b[k]["time_s"] / a[k]["time_s"] for k in both
              if isinstance(a[k].get("time_s"), (int, float)) and a[k]["time_s"] > 0
              and isinstance(b[k].get("time_s"), (int, float))]
    slowdown = statistics.median(ratios) if ratios else None
    return {"cases": len(a), "equal": bool(a) and not differ, "differ": differ[:20],
            "n_differ": len(differ), "rel_l2_identical": not differ and not rel_differ,
            "rel_l2_differ": rel_differ[:20], "per_test_slowdown": slowdown}


def wheel_runs_body(runs: Mapping[str, Mapping], docs: Mapping[str, Mapping], *, host: dict,
                    devices: str, suites: Sequence[str], examples: int,
                    targets: Mapping[str, float] = WHEEL_TARGETS) -> dict:
    """The body of scripts/scaling_fuzz.sh's ``scaling.json``. ``runs``: per command name
    (``<what>-gpus1``, ``<what>-gpus2``, what = fuzz, run, or run-<adapter>) its exit status
    and wall time; ``docs``: the JSON each wrote. Per ``what``: the speed-up (wall on one GPU
    over two), its target (``targets``, by the command's kind), whether it was met and, for a
    matrix run, the case-for-case comparison of the merged run with the one-GPU run.
    ``ok``: every command exited 0 and every matrix comparison is equal."""
    pairs = {}
    for name in runs:
        what, _, g = name.rpartition("-gpus")
        if g == "1" and f"{what}-gpus2" in runs:
            one, two = runs[name], runs[f"{what}-gpus2"]
            s = one["wall_s"] / two["wall_s"] if two.get("wall_s") else None
            target = targets.get(what.split("-")[0])
            pair = {"speedup": s, "target": target,
                    "target_met": None if s is None or target is None else s >= target}
            if what.startswith("run") and name in docs and f"{what}-gpus2" in docs:
                pair["merged_vs_one_gpu"] = compare_case_runs(docs[name], docs[f"{what}-gpus2"])
            pairs[what] = pair
    ok = (all(r.get("exit") == 0 for r in runs.values())
          and all(p.get("merged_vs_one_gpu", {}).get("equal", True) for p in pairs.values()))
    return {"kind": "scaling_fuzz", "devices": devices, "host": host, "suites": list(suites),
            "fuzz_examples": examples, "runs": dict(runs), "pairs": pairs,
            "speedup": {k: p["speedup"] for k, p in pairs.items()}, "ok": ok}


def record_body(*, host: dict, warmup: dict, runs: list[dict], suites: Sequence[str],
                fuzz_shards: int, per_shard: int,
                target: float = TARGET_SPEEDUP) -> tuple[dict, bool]:
    """``(body, ok)`` of the scaling record. ``ok``: every run passed; the target is only
    reported (``target_met``, None when there is no speed-up to compare)."""
    s = speedup(runs)
    body = {"tests": {"files": list(TEST_FILES), "marker": "gpu", "kernel": "hipkernel",
                      "suites": list(suites), "fuzz_shards": fuzz_shards,
                      "fuzz_per_shard": per_shard},
            "host": host, "warmup": warmup, "runs": runs, "speedup": s,
            "per_test_time_ratio": per_test_time_ratio(runs), "target_speedup": target,
            "target_met": None if s is None else s >= target}
    return body, bool(runs) and all(run_passed(r) for r in runs)


def verdict(body: Mapping, ok: bool) -> str:
    """One line for the end of the run."""
    s, target = body.get("speedup"), body.get("target_speedup")
    if s is None:
        told = "no speed-up (needs a 1-worker and a multi-worker run that finished)"
    else:
        told = f"speed-up {s:.2f}x (target {target}x: {'met' if body['target_met'] else 'missed'})"
    ratio = body.get("per_test_time_ratio")
    if ratio is not None:
        told += f"; per-test time x{ratio:.2f} in parallel"
    return f"scaling: {'ok' if ok else 'FAILED runs'}; {told}"


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, with ``--workers`` and ``--suites`` as tuples."""
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        args.workers, args.suites = parse_workers(args.workers), parse_suites(args.suites)
    except ValueError as e:
        ap.error(str(e))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from hipkernel import record

    args.out.mkdir(parents=True, exist_ok=True)
    host = host_facts()
    print(f"host: {host['cpu_count']} CPUs (os.cpu_count), {host['usable_cpus']} usable "
          f"(affinity {host['affinity_cpus']}, cgroup limit {host['cgroup_cpu_limit']}), "
          f"load {host['loadavg']}; {host['gpus']} GPU(s) from {host['gpu_source']}", flush=True)
    if 0 < host["gpus"] < max(args.workers):
        print(f"note: {max(args.workers)} workers on {host['gpus']} GPU(s): workers share GPUs",
              flush=True)
    print("warm-up: compiling every module into the disk cache ...", flush=True)
    try:
        warm = warm_in_child()
    except RuntimeError as e:  # no backend, a compile error, the child crashed
        print(f"scaling: the compile-cache warm-up failed: {e}", file=sys.stderr)
        return 2
    print(f"warm-up: {warm['modules']} modules in {warm['seconds']:.1f} s ({warm['compiled']} "
          f"compiled, {warm['from_disk']} from {warm['cache_dir']})", flush=True)
    if warm.get("cache_enabled") is False:
        print("note: HIPKERNEL_CACHE=0: the runs will compile again", flush=True)
    env = run_env(args.fuzz_shards, args.per_shard)
    runs = [run_workers(n, args.suites, env, args.out, args.timeout,
                        log=lambda m: print(m, flush=True)) for n in args.workers]
    body, ok = record_body(host=host, warmup=warm, runs=runs, suites=args.suites,
                           fuzz_shards=args.fuzz_shards, per_shard=args.per_shard)
    rec = record.stamp("scaling", device_label(host["gpus"], warm["device_name"]), body, ok)
    from refattn.fileio import atomic_write_text

    path = args.out / "scaling.json"
    atomic_write_text(path, json.dumps(rec, indent=2, allow_nan=False) + "\n")
    print(f"wrote {path}", flush=True)
    print(verdict(body, ok), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
