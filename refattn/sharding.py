"""Spreading the case matrix over several GPUs: one pytest-xdist worker per device.

``pytest -n N --dist loadgroup`` (or ``refattn run --gpus N``, which runs exactly that over
the test module shipped in the package, ``refattn/matrix_tests.py``) starts N worker
processes. The pytest plugin ``refattn.pytest_plugin`` pins each to its own device *before*
any GPU backend initialises: worker ``gwN`` gets ``CUDA_VISIBLE_DEVICES`` (NVIDIA) or
``HIP_VISIBLE_DEVICES`` (AMD) set to the N-th device of the controller's visible list, and
``HIPKERNEL_DEVICE=0`` (the one device it then sees). Cases carry
``pytest.mark.xdist_group(name=group_key(case))``, so ``--dist loadgroup`` sends every case of
one autotune key (``hipkernel.autotune.tune_key`` minus the arch, which is one per host) to
one worker, which then sweeps that key once.

This module holds the pure logic, importable without pytest or any GPU package:

* counting devices without initialising a runtime (:func:`visible_devices`): the parent's
  ``CUDA_VISIBLE_DEVICES`` / ``HIP_VISIBLE_DEVICES`` / ``ROCR_VISIBLE_DEVICES`` when set,
  else ``nvidia-smi -L``, else the KFD topology in sysfs (``/dev/kfd``) or ``rocm-smi``;
* the worker -> device map (:func:`device_for_worker`) and the group key (:func:`group_key`);
* the host's usable CPUs (:func:`usable_cpus`: the affinity mask capped by the cgroup CPU
  quota) and each pinned worker's share of them (:func:`worker_threads`), which
  :func:`pin_environment` puts in ``$REFATTN_THREADS`` so the workers' fp64 references do
  not oversubscribe the host (``refattn.reference.pool_threads`` reads it);
* the per-worker JSON-lines result files (``$REFATTN_RESULTS_DIR``) and their merge back into
  a :class:`refattn.runner.MatrixResult` (:func:`run_sharded`, behind ``refattn run --gpus``);
* for workers that are plain processes rather than pytest-xdist workers (``refattn fuzz
  --gpus``, :mod:`refattn.fuzz`): the check that each gets a device of its own
  (:func:`require_devices`) and its environment, pinned by :func:`pin_environment` exactly as
  the plugin pins ``gwN`` (:func:`worker_environment`).

``REFATTN_FAKE_GPUS=N`` makes the device counter report N devices (``0`` .. ``N-1`` through
``CUDA_VISIBLE_DEVICES``). It exists for the CPU-side tests of this machinery and should not
be set otherwise.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

RESULTS_DIR_ENV = "REFATTN_RESULTS_DIR"
FAKE_GPUS_ENV = "REFATTN_FAKE_GPUS"
CUDA_VAR, HIP_VAR, ROCR_VAR = "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"
ROW_SCHEMA = 1

ROOT = Path(__file__).resolve().parent.parent  # the source tree, or site-packages
# The matrix's test module ships in the package, so ``--gpus`` needs no source tree; its node
# id is the same from a wheel and from a source tree (refattn.pytest_plugin sets it).
MATRIX_TESTS = Path(__file__).resolve().with_name("matrix_tests.py")
MATRIX_NODEID = "refattn/matrix_tests.py"
PLUGIN = "refattn.pytest_plugin"


class ShardError(Exception):
    """``refattn run --gpus`` could not run or collect the sharded matrix (a usage error)."""


# --------------------------------------------------------------------------- devices

@dataclass(frozen=True)
class Devices:
    """The devices a worker may be pinned to: the values to put in ``var``, in order."""

    var: str | None  # CUDA_VISIBLE_DEVICES | HIP_VISIBLE_DEVICES | None (no device)
    devices: tuple[str, ...] = ()
    source: str = "none"  # where the list came from, for the pytest header and logs

    def __len__(self) -> int:
        return len(self.devices)

    def to_dict(self) -> dict:
        return {"var": self.var, "devices": list(self.devices), "source": self.source}

    @classmethod
    def from_dict(cls, d: Mapping) -> Devices:
        return cls(d.get("var"), tuple(str(x) for x in d.get("devices", ())), d.get("source", "?"))


_UUID_PREFIXES = ("GPU-", "MIG-")


def parse_visible_devices(value: str | None) -> list[str]:
    """The entries of a ``CUDA_VISIBLE_DEVICES``-style list, as the runtime reads it.

    Entries are comma-separated ordinals (``"2,3"``) or UUIDs (``GPU-...``, ``MIG-...``).
    Like the CUDA runtime, the list ends at the first entry that is neither (``"0,-1,1"``
    exposes only device 0) or that repeats one already seen; an empty value exposes nothing.
    ``None`` (unset) also gives ``[]``: the caller decides what "unset" means."""
    if value is None:
        return []
    out: list[str] = []
    for raw in value.split(","):
        entry = raw.strip()
        ok = entry.isdigit() or (entry.startswith(_UUID_PREFIXES) and len(entry) > 4)
        if not ok or entry in out:
            break
        out.append(entry)
    return out


_SMI_GPU = re.compile(r"^GPU\s+(\d+):.*?\(UUID:\s*(GPU-[^)\s]+)\)")
_SMI_MIG = re.compile(r"^\s+MIG\s.*\(UUID:\s*(MIG-[^)\s]+)\)")


def parse_nvidia_smi_list(text: str) -> list[str]:
    """Devices from ``nvidia-smi -L``: ordinals ``0 .. n-1`` for plain GPUs. When MIG is on,
    each MIG instance is its own device, named by its UUID (an ordinal cannot address it),
    and a GPU without MIG instances on such a host is named by its UUID too."""
    gpus: list[tuple[str, list[str]]] = []  # (gpu uuid, mig uuids)
    for line in text.splitlines():
        m = _SMI_GPU.match(line)
        if m:
            gpus.append((m.group(2), []))
            continue
        m = _SMI_MIG.match(line)
        if m and gpus:
            gpus[-1][1].append(m.group(1))
    if not any(migs for _, migs in gpus):
        return [str(i) for i in range(len(gpus))]
    return [x for uuid, migs in gpus for x in (migs or [uuid])]


def parse_rocm_smi(text: str) -> list[str]:
    """Ordinals from ``rocm-smi --showid`` (lines ``GPU[0] : ...``)."""
    ids = sorted({int(m.group(1)) for m in re.finditer(r"^GPU\[(\d+)\]", text, re.M)})
    return [str(i) for i in range(len(ids))]


def count_kfd_gpus(topology: Path = Path("/sys/class/kfd/kfd/topology/nodes")) -> int | None:
    """GPUs in the KFD topology (nodes with SIMDs; CPU nodes have none), or None if absent."""
    if not topology.is_dir():
        return None
    n = 0
    for props in topology.glob("*/properties"):
        try:
            m = re.search(r"^simd_count\s+(\d+)", props.read_text(), re.M)
        except OSError:
            continue
        n += bool(m and int(m.group(1)) > 0)
    return n


def _run_tool(argv: list[str], timeout: float = 15.0) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout if p.returncode == 0 else None


def visible_devices(env: Mapping[str, str] | None = None, *,
                    run_tool: Callable[[list[str]], str | None] = _run_tool,
                    kfd: Path = Path("/dev/kfd"),
                    kfd_topology: Path = Path("/sys/class/kfd/kfd/topology/nodes")) -> Devices:
    """The devices this process may hand to workers, found without initialising CUDA or HIP.

    In order: ``$REFATTN_FAKE_GPUS`` (tests only); ``CUDA_VISIBLE_DEVICES``, then
    ``HIP_VISIBLE_DEVICES`` when set (their entries, in order, are what a worker is pinned
    to); ``ROCR_VISIBLE_DEVICES`` (ordinals ``0 .. n-1`` of what it exposes); ``nvidia-smi -L``;
    ``/dev/kfd`` with the KFD topology or ``rocm-smi --showid``. None of these: no devices."""
    env = os.environ if env is None else env
    fake = env.get(FAKE_GPUS_ENV)
    if fake not in (None, ""):
        n = int(fake)
        return Devices(CUDA_VAR, tuple(str(i) for i in range(max(n, 0))), FAKE_GPUS_ENV)
    for var in (CUDA_VAR, HIP_VAR):
        if var in env:
            return Devices(var, tuple(parse_visible_devices(env[var])), var)
    if ROCR_VAR in env:
        n = len(parse_visible_devices(env[ROCR_VAR]))
        return Devices(HIP_VAR, tuple(str(i) for i in range(n)), ROCR_VAR)
    text = run_tool(["nvidia-smi", "-L"])
    if text is not None:
        found = parse_nvidia_smi_list(text)
        if found:
            return Devices(CUDA_VAR, tuple(found), "nvidia-smi -L")
    if kfd.exists():
        n = count_kfd_gpus(kfd_topology)
        if n:
            return Devices(HIP_VAR, tuple(str(i) for i in range(n)), "kfd topology")
        text = run_tool(["rocm-smi", "--showid"])
        found = parse_rocm_smi(text) if text is not None else []
        if found:
            return Devices(HIP_VAR, tuple(found), "rocm-smi --showid")
    return Devices(None, (), "none")


# --------------------------------------------------------------------------- CPUs

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def parse_cpu_max(text: str) -> float | None:
    """CPUs allowed by a cgroup v2 ``cpu.max`` (``"$QUOTA $PERIOD"`` in microseconds):
    ``"200000 100000"`` -> 2.0, ``"max 100000"`` -> None (no limit)."""
    fields = text.split()
    if len(fields) not in (1, 2):
        raise ValueError(f"cpu.max: expected '$QUOTA $PERIOD', got {text!r}")
    if fields[0] == "max":
        return None
    return _quota_cpus("cpu.max", fields[0], fields[1] if len(fields) == 2 else "100000")


def parse_cfs_quota(quota: str, period: str) -> float | None:
    """CPUs allowed by cgroup v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``: ``-1`` is no
    limit (None), else quota / period."""
    if quota.strip() == "-1":
        return None
    return _quota_cpus("cpu.cfs_quota_us", quota, period)


def _quota_cpus(name: str, quota: str, period: str) -> float:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        raise ValueError(f"{name}: expected integer quota and period, "
                         f"got {quota!r} {period!r}") from None
    if q <= 0 or p <= 0:
        raise ValueError(f"{name}: expected quota and period > 0, got {q} {p}")
    return q / p


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """``/proc/self/cgroup`` as controller -> cgroup path; the v2 hierarchy (``0::/path``)
    is under the key ``""``."""
    paths: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(","):
                paths[controller] = parts[2]
    return paths


def _up_to(base: Path, rel: str) -> list[Path]:
    """``base/rel`` and each of its parents up to ``base``: a limit on any of them applies."""
    here = base / rel.strip("/")
    return [here, *[p for p in here.parents if p == base or base in p.parents]]


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _limit(parse, *paths: Path) -> float | None:
    """``parse`` of the files' texts; None when a file is missing or unparsable."""
    texts = [_read(p) for p in paths]
    if any(t is None for t in texts):
        return None
    try:
        return parse(*texts)
    except ValueError:
        return None


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The tightest CPU quota on this process's cgroups, in CPUs (1.5 = one and a half), or
    None when there is none: cgroup v2 ``cpu.max`` and cgroup v1 ``cpu.cfs_quota_us`` of its
    own cgroup and every ancestor under ``root`` (in a container, ``root`` itself)."""
    own = parse_proc_cgroup(_read(proc_cgroup) or "")
    limits = [_limit(parse_cpu_max, d / "cpu.max") for d in _up_to(root, own.get("", "/"))]
    for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        for d in _up_to(root / mount, own.get("cpu", "/")):
            limits.append(_limit(parse_cfs_quota, d / "cpu.cfs_quota_us", d / "cpu.cfs_period_us"))
    found = [x for x in limits if x is not None]
    return min(found) if found else None


def affinity_cpus() -> int:
    """CPUs this process may be scheduled on (its affinity mask; ``os.cpu_count`` where the
    platform has no mask)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cap_cpus(cpus: int, limit: float | None) -> int:
    """``cpus`` capped by a quota of ``limit`` CPUs (rounded down, at least 1)."""
    return cpus if limit is None else max(1, min(cpus, int(limit)))


def usable_cpus(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """CPUs this process can really use: the affinity mask capped by the cgroup quota.
    ``os.cpu_count()`` counts the host's CPUs and ignores both."""
    return cap_cpus(affinity_cpus(), cgroup_cpu_limit(root, proc_cgroup))


# --------------------------------------------------------------------------- workers

def worker_index(worker_id: str | None) -> int | None:
    """``gw3`` -> 3; None for the controller or a plain (non-xdist) run."""
    m = re.fullmatch(r"gw(\d+)", worker_id or "")
    return int(m.group(1)) if m else None


def device_for_worker(worker_id: str | None, devices: Devices | Iterable[str]) -> str | None:
    """The device worker ``gwN`` is pinned to: entry ``N`` of the parent's visible list
    (``N mod len`` when there are more workers than devices, so they share). None when not a
    worker or when there is no device."""
    devs = list(devices.devices if isinstance(devices, Devices) else devices)
    i = worker_index(worker_id)
    if i is None or not devs:
        return None
    return devs[i % len(devs)]


def worker_threads(workers: int, environ: Mapping[str, str] | None = None,
                   cpus: int | None = None) -> str:
    """``$REFATTN_THREADS`` of a pinned worker: the user's value when set, else its share of
    the host, ``max(1, cpus // workers)`` with ``cpus`` = :func:`usable_cpus` by default,
    capped at the reference's default cap (8): on the 2-GPU H200 host (32 CPUs) one worker
    at 32 threads ran the GPU fuzz shards slower than at 8."""
    from refattn.reference import MAX_DEFAULT_THREADS, THREADS_ENV

    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers: expected an int >= 1, got {workers!r}")
    environ = os.environ if environ is None else environ
    if environ.get(THREADS_ENV, "").strip():
        return environ[THREADS_ENV]
    share = (usable_cpus() if cpus is None else cpus) // workers
    return str(max(1, min(MAX_DEFAULT_THREADS, share)))


def threads_note(workers: int, environ: Mapping[str, str] | None = None,
                 cpus: int | None = None) -> str:
    """The pytest header's account of :func:`worker_threads`, e.g.
    ``REFATTN_THREADS=4 per worker (8 usable CPUs / 2 workers)``."""
    from refattn.reference import THREADS_ENV

    environ = os.environ if environ is None else environ
    if environ.get(THREADS_ENV, "").strip():
        return f"{THREADS_ENV}={environ[THREADS_ENV]} per worker (set by the user)"
    cpus = usable_cpus() if cpus is None else cpus
    value = worker_threads(workers, environ, cpus)
    return f"{THREADS_ENV}={value} per worker ({cpus} usable CPUs / {workers} workers)"


def pin_environment(worker_id: str | None, devices: Devices,
                    environ: dict | None = None, *, workers: int | None = None,
                    cpus: int | None = None) -> str | None:
    """Pin this worker process: set ``devices.var`` to its device and ``HIPKERNEL_DEVICE=0``
    in ``environ`` (default ``os.environ``). Must run before a runtime initialises (CUDA and
    HIP read the variable once, at init). With ``workers`` (xdist's worker count) it also
    sets ``$REFATTN_THREADS`` to :func:`worker_threads` unless the user set it. Returns the
    device, or None (nothing changed)."""
    environ = os.environ if environ is None else environ
    dev = device_for_worker(worker_id, devices)
    if dev is None or devices.var is None:
        return None
    environ[devices.var] = dev
    environ["HIPKERNEL_DEVICE"] = "0"  # the only device the worker sees now
    if workers is not None:
        from refattn.reference import THREADS_ENV, parse_threads

        environ[THREADS_ENV] = worker_threads(workers, environ, cpus)
        limit_native_threads(parse_threads(environ[THREADS_ENV]), environ)
    return dev


NATIVE_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def limit_native_threads(n: int, environ: dict | None = None) -> None:
    """Hold BLAS/OpenMP pools of this worker to ``n`` threads: the variables for libraries
    not loaded yet (unless the user set them), threadpoolctl for those already loaded.
    Otherwise every worker's OpenBLAS starts one (spinning) thread per host CPU, and N
    workers oversubscribe the host N times over."""
    environ = os.environ if environ is None else environ
    for var in NATIVE_THREAD_VARS:
        environ.setdefault(var, str(n))
    if environ is os.environ:
        from threadpoolctl import threadpool_limits

        threadpool_limits(n)


def auto_num_workers(gpu_kernels: bool, devices: Devices, env: Mapping[str, str] | None = None) -> int | None:
    """What ``-n auto`` means: the device count when a GPU kernel is selected and a device is
    visible; None otherwise, leaving pytest-xdist's own default (the CPU count) in place.
    An explicit ``PYTEST_XDIST_AUTO_NUM_WORKERS`` always wins (None here)."""
    env = os.environ if env is None else env
    if env.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    return len(devices) if gpu_kernels and len(devices) else None


def require_devices(workers: int, devices: Devices, option: str = "--gpus") -> None:
    """Raise :class:`ShardError` (naming ``option``) unless ``devices`` holds a device for each
    of ``workers`` processes. ``refattn run --gpus`` lets workers share a device (or run
    unpinned where none is visible); ``refattn fuzz --gpus`` asks for one each, for a CPU
    kernel too: its workers are pinned to the devices the environment names, exactly as a GPU
    kernel's are (so ``CUDA_VISIBLE_DEVICES=0,1`` or ``$REFATTN_FAKE_GPUS`` simulate two)."""
    if len(devices) < workers:
        raise ShardError(f"{option} {workers}: {len(devices)} device(s) visible "
                         f"({devices.source}); each of the {workers} workers needs a device "
                         f"of its own")


def worker_environment(index: int, workers: int, devices: Devices,
                       results_dir: str | os.PathLike,
                       environ: Mapping[str, str] | None = None) -> tuple[dict, str | None]:
    """The environment of worker ``index`` of ``workers`` started as a plain process, and the
    device it is pinned to: :func:`child_env` (the source tree on ``PYTHONPATH`` when run
    from one) pinned by :func:`pin_environment` as worker ``gw<index>``: its device in
    ``devices.var``, ``HIPKERNEL_DEVICE=0``, its ``$REFATTN_THREADS`` share and the native
    thread pools' sizes, as the pytest plugin pins the workers of ``refattn run --gpus``."""
    env = child_env(results_dir, environ)
    dev = pin_environment(f"gw{index}", devices, env, workers=workers)
    return env, dev


# --------------------------------------------------------------------------- groups

def tune_group(case) -> tuple:
    """The case's autotune key without the arch: ``(d, sq, Hq, G, window, dtype)``."""
    return (int(case.d), int(case.sq), int(case.Hq), int(case.Hq // case.Hkv), int(case.window),
            str(case.dtype))


def group_key(case) -> str:
    """``xdist_group`` name of a case, e.g. ``tune-d64-sq512-Hq64-G8-wnone-fp16``. Cases with
    the same autotune key get the same name (and so the same worker under loadgroup)."""
    d, sq, hq, g, w, dtype = tune_group(case)
    return f"tune-d{d}-sq{sq}-Hq{hq}-G{g}-w{'none' if w < 0 else w}-{dtype}"


# --------------------------------------------------------------------------- result rows

def rows_path(results_dir: str | os.PathLike, worker_id: str | None) -> Path:
    """The JSON-lines file this process appends to (one per worker process)."""
    return Path(results_dir) / f"{worker_id or 'main'}.{os.getpid()}.jsonl"


def append_row(results_dir: str | os.PathLike, worker_id: str | None, row: dict) -> None:
    """Append one row (one line, written and flushed in one call)."""
    path = rows_path(results_dir, worker_id)
    line = json.dumps({"schema": ROW_SCHEMA, **row}) + "\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()


def result_row(result, *, kernel_spec: str, kernel_name: str, case, worker_id: str | None,
               device: str | None, nodeid: str = "") -> dict:
    """The row a worker writes for a judged case: the Result's JSON plus where it ran."""
    return {"kind": "result", "kernel_spec": kernel_spec, "kernel": kernel_name,
            "case_id": case.id, "group": group_key(case), "worker": worker_id,
            "device": device, "nodeid": nodeid, "summary": result.summary,
            "failure_message": result.failure_message(), "result": result.to_dict()}


def skip_row(*, kernel_spec: str, case, reason: str, worker_id: str | None,
             device: str | None, nodeid: str = "") -> dict:
    """The row a worker writes for a matrix case it skipped (kernel unavailable there)."""
    return {"kind": "skipped", "kernel_spec": kernel_spec, "case_id": case.id,
            "group": group_key(case), "worker": worker_id, "device": device, "nodeid": nodeid,
            "reason": reason}


class RowReader:
    """Reads the rows of every ``*.jsonl`` file in a directory incrementally (complete lines
    only), so the parent can report progress while the workers run."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self._offsets: dict[Path, int] = {}

    def poll(self) -> list[dict]:
        rows = []
        for path in sorted(self.directory.glob("*.jsonl")):
            start = self._offsets.get(path, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(start)
                    data = f.read()
            except OSError:
                continue
            end = data.rfind(b"\n") + 1
            if end <= 0:
                continue
            self._offsets[path] = start + end
            for line in data[:end].splitlines():
                if line.strip():
                    rows.append(json.loads(line))
        return rows


def read_rows(directory: str | os.PathLike) -> list[dict]:
    """Every row of every per-worker file in ``directory``."""
    return RowReader(directory).poll()


# --------------------------------------------------------------------------- back to Results

@functools.lru_cache(maxsize=None)
def _stored_result_class():
    from refattn.runner import Result

    @dataclass
    class StoredResult(Result):
        """A :class:`Result` read back from a worker's row: its JSON, summary and failure
        message are the worker's, byte for byte (no Comparison object crosses processes)."""

        stored: dict = field(default_factory=dict, repr=False)

        @property
        def summary(self) -> str:
            return self.stored.get("summary") or super().summary

        def failure_message(self) -> str:
            return self.stored.get("failure_message") or super().failure_message()

        def to_dict(self) -> dict:
            return json.loads(json.dumps(self.stored["result"]))

    return StoredResult


def result_from_row(row: dict):
    """A Result-shaped object from a worker's ``result`` row (see :func:`result_row`)."""
    cls = _stored_result_class()
    d = row["result"]
    at = d.get("max_abs_at")
    return cls(case=d["case"], suite=d["suite"], outcome=d["outcome"], note=d.get("note", ""),
               status=d.get("status"), supported=d.get("supported"), rel_l2=d.get("rel_l2"),
               max_abs=d.get("max_abs"), max_abs_at=None if at is None else tuple(at),
               gate=d.get("gate"), gate_max_abs=d.get("gate_max_abs"),
               seed_gate_pass=d.get("seed_gate_pass"), baseline_rel_l2=d.get("baseline_rel_l2"),
               n_nan=d.get("n_nan"), n_inf=d.get("n_inf"), time_s=d.get("time_s"),
               seed_contract=d.get("seed_contract"), params=d.get("params") or {},
               comparison=None, stored=row)


def merge_results(cases, rows: Iterable[dict]):
    """The Results of ``cases``, in case order, from the workers' rows. A case with no result
    row becomes an ``error`` Result saying so. Returns ``(results, skipped)`` where
    ``skipped`` maps a case id to the reason a worker skipped it."""
    from refattn.runner import Result

    by_id: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    for row in rows:
        if row.get("kind") == "result":
            by_id[row["case_id"]] = row
        elif row.get("kind") == "skipped":
            skipped[row["case_id"]] = row.get("reason", "")
    results = []
    for c in cases:
        row = by_id.get(c.id)
        if row is not None:
            results.append(result_from_row(row))
            continue
        params = c.to_dict()
        params["describe"] = c.describe()
        why = skipped.get(c.id)
        note = (f"skipped by the pytest worker: {why}" if why is not None else
                "no result from the pytest workers (a worker crashed, or the case was not "
                "collected); see the pytest output")
        results.append(Result(case=c.name, suite=c.suite, outcome="error", note=note,
                              seed_contract=c.seed_contract, params=params))
    return results, skipped


# --------------------------------------------------------------------------- refattn run --gpus

def matrix_node_ids(kernel_spec: str, cases, test_file: Path = MATRIX_TESTS) -> list[str]:
    """pytest arguments selecting ``cases`` of ``test_file`` (default the shipped
    ``refattn/matrix_tests.py``; ids ``<kernel>-<case name>``, unique because case names are
    unique across the suites loaded together)."""
    return [f"{test_file}::test_case[{kernel_spec}-{c.name}]" for c in cases]


# Plugins the matrix does not use, blocked in the workers of ``refattn run --gpus``: they
# only cost start-up time (hypothesis takes seconds to import) or warn under xdist.
NOT_NEEDED_PLUGINS = ("-p", "no:hypothesispytest", "-p", "no:benchmark")


def pytest_command(kernel_spec: str, suites: Iterable[str], cases, workers: int,
                   test_file: Path = MATRIX_TESTS) -> list[str]:
    """``python -m pytest -p refattn.pytest_plugin -n N --dist loadgroup ...`` over exactly
    ``cases``. The run is isolated from wherever it is started: no configuration file (``-c``
    the null device), no conftest.py, the rootdir the directory holding the ``refattn``
    package; the plugin's ``--refattn-kernel`` / ``--refattn-suite`` select the matrix."""
    cmd = [sys.executable, "-m", "pytest", "-p", PLUGIN, "--noconftest", "-c", os.devnull,
           "--rootdir", str(test_file.parent.parent), "-n", str(int(workers)), "--dist",
           "loadgroup", "-p", "no:cacheprovider", *NOT_NEEDED_PLUGINS, "-q",
           "--refattn-kernel", kernel_spec]
    for s in dict.fromkeys(suites):
        cmd += ["--refattn-suite", str(s)]
    return cmd + matrix_node_ids(kernel_spec, cases, test_file)


def source_root() -> Path | None:
    """The source tree refattn was imported from (a ``pyproject.toml`` beside the package),
    or None for an installed refattn."""
    tree = (ROOT / "pyproject.toml").is_file() and (ROOT / "refattn" / "sharding.py").is_file()
    return ROOT if tree else None


def child_env(results_dir: str | os.PathLike, environ: Mapping[str, str] | None = None) -> dict:
    """The environment of the sharded pytest: ``environ`` (default ``os.environ``) with
    ``$REFATTN_RESULTS_DIR`` and, run from a source tree, that tree first on ``PYTHONPATH``
    (its refattn, and the modules beside it such as ``tests.helpers_kernels``, are the ones
    the workers import). An installed refattn is found by the same interpreter as is."""
    env = dict(os.environ if environ is None else environ)
    env[RESULTS_DIR_ENV] = str(results_dir)
    root = source_root()
    if root is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(root)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def _tail(path: Path, n: int = 60) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def run_sharded(kernel_spec: str, suites: list[str], cases, workers: int, *, progress=None,
                log: Callable[[str], None] | None = None, test_file: Path = MATRIX_TESTS,
                poll_s: float = 0.2):
    """Run ``cases`` of ``kernel_spec`` through ``pytest -n workers --dist loadgroup`` and
    merge the workers' rows into a :class:`refattn.runner.MatrixResult` (the same document
    ``run_matrix`` gives). ``progress(i, n, case, result)`` as in ``run_matrix``, called as
    rows arrive. Raises :class:`ShardError` when pytest, pytest-xdist or the matrix tests are missing,
    when pytest itself fails (its output is in the message), or when the kernel is not
    available on the workers."""
    from refattn.runner import MatrixResult, host_info

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    cases = list(cases)
    for module, dist in (("pytest", "pytest"), ("xdist", "pytest-xdist")):
        if importlib.util.find_spec(module) is None:
            raise ShardError(f"--gpus needs {dist} (pip install {dist})")
    if not test_file.is_file():
        raise ShardError(f"--gpus runs the pytest matrix, {test_file}, which this install lacks "
                         f"(reinstall refattn)")
    by_id = {c.id: c for c in cases}
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="refattn-gpus-") as tmp:
        results_dir = Path(tmp) / "rows"
        results_dir.mkdir()
        pytest_log = Path(tmp) / "pytest.log"
        env = child_env(results_dir)
        cmd = pytest_command(kernel_spec, suites, cases, workers, test_file)
        reader, done = RowReader(results_dir), 0
        rows: list[dict] = []

        def consume():
            nonlocal done
            for row in reader.poll():
                rows.append(row)
                c = by_id.get(row.get("case_id"))
                if progress is not None and c is not None and row.get("kind") == "result":
                    progress(done, len(cases), c, None)
                    progress(done, len(cases), c, result_from_row(row))
                    done += 1

        with open(pytest_log, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    stdin=subprocess.DEVNULL)
            try:
                while proc.poll() is None:
                    consume()
                    time.sleep(poll_s)
            except BaseException:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                raise
        consume()
        rc = proc.returncode
        results, skipped = merge_results(cases, rows)
        if rc not in (0, 1):  # 0 all passed, 1 some failed; anything else is pytest trouble
            raise ShardError(f"pytest -n {workers} exited with status {rc}\n"
                             f"--- pytest output (tail) ---\n{_tail(pytest_log)}")
        if skipped:
            reason = next(iter(skipped.values()))
            raise ShardError(f"kernel: {reason}")
        if any(r.outcome == "error" and r.note.startswith("no result") for r in results):
            log(f"--- pytest output (tail) ---\n{_tail(pytest_log)}")
    names = [row.get("kernel") for row in rows if row.get("kind") == "result" and row.get("kernel")]
    suites_seen = list(dict.fromkeys(c.suite for c in cases))
    return MatrixResult(kernel=names[0] if names else kernel_spec, results=results,
                        suites=suites_seen, started=started, elapsed_s=time.perf_counter() - t0,
                        host=host_info())


__all__ = ["CUDA_VAR", "Devices", "FAKE_GPUS_ENV", "HIP_VAR", "RESULTS_DIR_ENV", "RowReader",
           "ShardError", "append_row", "auto_num_workers", "child_env", "device_for_worker",
           "group_key",
           "matrix_node_ids", "merge_results", "parse_nvidia_smi_list", "parse_rocm_smi",
           "parse_visible_devices", "pin_environment", "pytest_command", "read_rows",
           "require_devices", "result_from_row", "result_row", "run_sharded", "skip_row",
           "source_root", "tune_group", "visible_devices", "worker_environment", "worker_index"]
