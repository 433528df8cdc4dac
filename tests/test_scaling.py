"""Multi-GPU scaling (``hipkernel.scaling``, target 1.8x on two GPUs) on the CPU: the host's
usable CPUs (cgroup quotas), the reference's ``REFATTN_THREADS`` pool, each pinned worker's
share of the CPUs, and ``python -m hipkernel.scaling`` (JUnit parsing, speed-up, the record)
with the GPU parts faked.

The timed runs themselves need two GPUs; ``hipkernel.scaling`` is what runs them there.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from hipkernel import api, record
from hipkernel import scaling as SC
from hipkernel.config import HEAD_DIMS, candidates
from refattn import reference
from refattn import sharding as S
from tests.fake_backend import RecordingBackend

ROOT = Path(__file__).resolve().parent.parent
PROBE_ENV = "REFATTN_TEST_PROBE_DIR"


# ------------------------------------------------------------------ cgroup CPU quotas

def test_cgroup_v2_cpu_max():
    assert S.parse_cpu_max("max 100000\n") is None
    assert S.parse_cpu_max("200000 100000\n") == 2.0
    assert S.parse_cpu_max("150000 100000") == 1.5
    assert S.parse_cpu_max("50000") == 0.5  # period left out: the kernel's default, 100 ms
    for bad in ("", "lots 100000", "200000 0", "1 2 3"):
        with pytest.raises(ValueError, match="cpu.max"):
            S.parse_cpu_max(bad)


def test_cgroup_v1_cfs_quota():
    assert S.parse_cfs_quota("-1\n", "100000\n") is None
    assert S.parse_cfs_quota("400000\n", "100000\n") == 4.0
    assert S.parse_cfs_quota("25000", "100000") == 0.25
    with pytest.raises(ValueError, match="cpu.cfs_quota_us"):
        S.parse_cfs_quota("x", "100000")


def test_proc_cgroup_lists_each_controllers_path():
    text = "12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/user.slice/job\n"
    paths = S.parse_proc_cgroup(text)
    assert paths == {"cpu": "/docker/abc", "cpuacct": "/docker/abc", "memory": "/docker/abc",
                     "": "/user.slice/job"}


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_limit_is_the_tightest_of_the_own_cgroup_and_its_ancestors(tmp_path):
    root, proc = tmp_path / "cgroup", tmp_path / "proc-cgroup"
    _write(proc, "0::/a/b\n")
    _write(root / "cpu.max", "max 100000\n")
    assert S.cgroup_cpu_limit(root, proc) is None
    _write(root / "a" / "b" / "cpu.max", "300000 100000\n")
    assert S.cgroup_cpu_limit(root, proc) == 3.0
    _write(root / "a" / "cpu.max", "150000 100000\n")  # the parent's quota binds the child
    assert S.cgroup_cpu_limit(root, proc) == 1.5
    _write(root / "a" / "cpu.max", "garbage\n")  # unreadable: ignored, not an error
    assert S.cgroup_cpu_limit(root, proc) == 3.0


def test_cgroup_v1_limit_under_the_cpu_mount(tmp_path):
    root, proc = tmp_path / "cgroup", tmp_path / "proc-cgroup"
    _write(proc, "3:cpu,cpuacct:/\n0::/\n")
    _write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1\n")
    _write(root / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    assert S.cgroup_cpu_limit(root, proc) is None
    _write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "250000\n")
    assert S.cgroup_cpu_limit(root, proc) == 2.5
    assert S.cgroup_cpu_limit(tmp_path / "absent", tmp_path / "absent-proc") is None


def test_usable_cpus_caps_the_affinity_by_the_quota(tmp_path):
    assert S.cap_cpus(8, None) == 8
    assert S.cap_cpus(8, 2.5) == 2  # a fraction of a CPU is not a thread's worth
    assert S.cap_cpus(8, 0.5) == 1
    assert S.cap_cpus(2, 4.0) == 2
    root, proc = tmp_path / "cgroup", tmp_path / "proc-cgroup"
    _write(proc, "0::/\n")
    assert S.usable_cpus(root, proc) == S.affinity_cpus()
    _write(root / "cpu.max", "100000 100000\n")
    assert S.usable_cpus(root, proc) == 1
    assert 1 <= S.usable_cpus() <= (os.cpu_count() or 1)


# ------------------------------------------------------------------ REFATTN_THREADS

def test_refattn_threads_parsing():
    assert reference.parse_threads("4") == 4 and reference.parse_threads(" 2\n") == 2
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(ValueError, match="REFATTN_THREADS"):
            reference.parse_threads(bad)
    assert reference.pool_threads({}) == reference._DEFAULT_THREADS
    assert reference.pool_threads({"REFATTN_THREADS": ""}) == reference._DEFAULT_THREADS
    assert reference.pool_threads({"REFATTN_THREADS": "3"}) == 3


class _PoolSizes:
    """Stands in for ThreadPoolExecutor in refattn.reference and records each pool's size."""

    def __init__(self):
        self.sizes: list[int] = []
        real = reference.ThreadPoolExecutor
        sizes = self.sizes

        class Recording(real):
            def __init__(self, max_workers=None, *a, **kw):
                sizes.append(max_workers)
                super().__init__(max_workers, *a, **kw)

        self.cls = Recording


def _eight_kv_heads():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 5, 16, 8)).astype(np.float16)
    k = rng.standard_normal((1, 8, 9, 8)).astype(np.float16)
    v = rng.standard_normal((1, 8, 9, 8)).astype(np.float16)
    return q, k, v


def test_reference_pool_takes_refattn_threads_at_call_time(monkeypatch):
    """Set after import, the variable sizes the next call's pool; the numbers do not move."""
    pools = _PoolSizes()
    monkeypatch.setattr(reference, "ThreadPoolExecutor", pools.cls)
    q, k, v = _eight_kv_heads()  # 8 (batch, KV head) jobs
    monkeypatch.setenv("REFATTN_THREADS", "3")
    three = reference.attention(q, k, v, past_len=4, dtype=np.float64)
    assert pools.sizes == [3]
    monkeypatch.setenv("REFATTN_THREADS", "1")
    one = reference.attention(q, k, v, past_len=4, dtype=np.float64)
    assert pools.sizes == [3]  # one thread: no pool at all
    monkeypatch.setenv("REFATTN_THREADS", "20")
    reference.attention(q, k, v, past_len=4, dtype=np.float64)
    assert pools.sizes == [3, 8]  # never more threads than jobs
    np.testing.assert_array_equal(three, one)
    monkeypatch.setenv("REFATTN_THREADS", "none")
    with pytest.raises(ValueError, match="REFATTN_THREADS"):
        reference.attention(q, k, v, past_len=4)


# ------------------------------------------------------------------ a pinned worker's share

def test_pin_gives_each_worker_its_share_of_the_cpus():
    devs = S.Devices("CUDA_VISIBLE_DEVICES", ("0", "1"))
    env = {}
    assert S.pin_environment("gw1", devs, env, workers=2, cpus=8) == "1"
    assert env == {"CUDA_VISIBLE_DEVICES": "1", "HIPKERNEL_DEVICE": "0", "REFATTN_THREADS": "4",
                   "OMP_NUM_THREADS": "4", "OPENBLAS_NUM_THREADS": "4", "MKL_NUM_THREADS": "4"}
    env = {"OMP_NUM_THREADS": "7"}
    S.pin_environment("gw0", devs, env, workers=1, cpus=32)
    assert env["REFATTN_THREADS"] == "8"  # capped at the reference's default cap
    assert env["OMP_NUM_THREADS"] == "7" and env["OPENBLAS_NUM_THREADS"] == "8"  # the user's stands
    env = {}
    S.pin_environment("gw0", devs, env, workers=3, cpus=8)
    assert env["REFATTN_THREADS"] == "2"
    env = {}
    S.pin_environment("gw0", devs, env, workers=4, cpus=2)
    assert env["REFATTN_THREADS"] == "1"  # never 0
    env = {"REFATTN_THREADS": "5"}
    S.pin_environment("gw0", devs, env, workers=2, cpus=8)
    assert env["REFATTN_THREADS"] == "5"  # the user's choice stands
    with pytest.raises(ValueError, match="^REFATTN_THREADS"):  # ... when it is a thread count
        S.pin_environment("gw0", devs, {"REFATTN_THREADS": "many"}, workers=2, cpus=8)
    env = {}
    S.pin_environment("gw0", devs, env)  # no worker count: as before, devices only
    assert "REFATTN_THREADS" not in env
    env = {}
    assert S.pin_environment("gw0", S.Devices(None, ()), env, workers=2, cpus=8) is None
    assert env == {}  # not pinned, nothing set
    with pytest.raises(ValueError, match="workers"):
        S.worker_threads(0, {}, cpus=8)


def test_threads_note_for_the_pytest_header():
    assert S.threads_note(2, {}, cpus=16) == \
        "REFATTN_THREADS=8 per worker (16 usable CPUs / 2 workers)"
    assert S.threads_note(2, {"REFATTN_THREADS": "3"}, cpus=16) == \
        "REFATTN_THREADS=3 per worker (set by the user)"


class _Config:
    def __init__(self):
        self.warnings = []

    def issue_config_time_warning(self, warning, stacklevel):
        self.warnings.append(warning)


def test_conftest_pin_worker_reads_xdists_worker_count(monkeypatch):
    conftest = importlib.import_module("tests.conftest")
    monkeypatch.setattr(conftest, "_PINNED", {})
    for var in ("REFATTN_THREADS", "CUDA_VISIBLE_DEVICES", "HIPKERNEL_DEVICE"):
        # set, then unset: monkeypatch records the original either way and restores it after
        # the pin has written the variable (a bare delenv of an absent one records nothing)
        monkeypatch.setenv(var, "placeholder")
        monkeypatch.delenv(var)
    monkeypatch.setenv("REFATTN_FAKE_GPUS", "2")
    native = []  # the BLAS/OpenMP limit, recorded: applied for real it would outlive this test
    monkeypatch.setattr(S, "limit_native_threads", lambda n, environ=None: native.append(n))
    conftest._pin_worker(_Config(), {"workerid": "gw1", "workercount": 2})
    share = S.worker_threads(2, {}, S.usable_cpus())
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    assert os.environ["REFATTN_THREADS"] == share and native == [int(share)]
    assert conftest._PINNED == {"worker": "gw1", "var": "CUDA_VISIBLE_DEVICES", "device": "1"}


def test_worker_probe():
    """Run only by the xdist test below: this worker's pin, as the tests see it."""
    out = os.environ.get(PROBE_ENV)
    if not out:
        pytest.skip(f"a probe for test_xdist_workers_get_refattn_threads (needs ${PROBE_ENV})")
    wid = os.environ["PYTEST_XDIST_WORKER"]
    Path(out, f"{wid}.json").write_text(json.dumps({
        "threads": os.environ.get("REFATTN_THREADS"), "pool": reference.pool_threads(),
        "device": os.environ.get("CUDA_VISIBLE_DEVICES")}))


def _child_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_XDIST", "REFATTN_"))
           and k not in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
                         "HIPKERNEL_DEVICE", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return {**env, **extra}


def test_xdist_workers_get_refattn_threads(tmp_path):
    """``pytest -n 2`` with two (fake) GPUs: each worker is pinned to its GPU and its reference
    pool to half the usable CPUs, and the header says so."""
    pytest.importorskip("xdist")
    env = _child_env(REFATTN_FAKE_GPUS="2", **{PROBE_ENV: str(tmp_path)})
    argv = [sys.executable, "-m", "pytest", "tests/test_scaling.py::test_worker_probe", "-n", "2",
            "--dist", "each", "-p", "no:cacheprovider", *S.NOT_NEEDED_PLUGINS]
    p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    share = max(1, S.usable_cpus() // 2)
    assert f"REFATTN_THREADS={share} per worker ({S.usable_cpus()} usable CPUs / 2 workers)" in out
    seen = {f.stem: json.loads(f.read_text()) for f in tmp_path.glob("gw*.json")}
    assert seen == {"gw0": {"threads": str(share), "pool": share, "device": "0"},
                    "gw1": {"threads": str(share), "pool": share, "device": "1"}}


# ------------------------------------------------------------------ hipkernel.scaling

def test_help_runs_without_a_gpu():
    p = subprocess.run([sys.executable, "-m", "hipkernel.scaling", "--help"], cwd=ROOT,
                       env=_child_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    for opt in ("--out", "--workers", "--fuzz-shards", "--per-shard", "--suites", "--timeout"):
        assert opt in p.stdout


def test_arguments():
    args = SC.parse_args(["--out", "d", "--workers", "2,1", "--suites", "seed,contracts"])
    assert args.workers == (2, 1) and args.suites == ("seed", "contracts")
    assert (args.fuzz_shards, args.per_shard) == (20, 100)
    with pytest.raises(ValueError, match="--workers"):
        SC.parse_workers("1,0")
    with pytest.raises(ValueError, match="--workers"):
        SC.parse_workers("two")
    with pytest.raises(ValueError, match="--suites"):
        SC.parse_suites("seed,")


def test_the_timed_command():
    junit = Path("/o/junit-n2.xml")
    argv = SC.pytest_argv(2, ("seed", "extended"), junit)
    assert argv[:3] == [sys.executable, "-m", "pytest"]
    assert argv[3:5] == ["tests/test_matrix.py", "tests/test_fuzz.py"]
    assert argv[5:7] == ["-m", "gpu"] and argv[argv.index("--kernel") + 1] == "hipkernel"
    assert argv[argv.index("-n") + 1] == "2" and argv[argv.index("--dist") + 1] == "loadgroup"
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--suite"] == ["seed", "extended"]
    assert argv[-1] == f"--junitxml={junit}"
    env = SC.run_env(20, 100, {"PATH": "/bin"})
    assert env == {"PATH": "/bin", "REFATTN_FUZZ_SHARDS": "20", "REFATTN_FUZZ_PER_SHARD": "100"}
    assert SC.command_text(argv, env).startswith(
        "REFATTN_FUZZ_SHARDS=20 REFATTN_FUZZ_PER_SHARD=100 python -m pytest tests/test_matrix.py")


def test_warm_up_compiles_every_head_dim_and_candidate():
    # the tensor-core configs only where the target has them; per head dim, every config the
    # runs can launch there: the tuner's candidates and what the fuzz shards draw from
    # candidates(arch) (the 32-rows-a-warp mma configs and both wgmma tiles at each head dim
    # they fit)
    for arch in ("sm_90", "sm_80", "gfx942"):
        be = RecordingBackend(arch=arch)
        paths = []  # the defines alone do not tell mma_m8_b64 from wgmma_m8_b64: the source does
        path_of = {api.kernel_source(p): p for p in api.KERNEL_FILES}
        compile_ = be.compile
        be.compile = lambda src, defines, name: (paths.append(path_of.get(src, "?")),
                                                 compile_(src, defines, name))[1]
        warm = SC.warm_cache(be)
        launchable = [(d, c) for d in HEAD_DIMS for c in candidates(arch) if c.fits(d)]
        assert all(c in candidates(arch) for d in HEAD_DIMS for c in candidates(arch, d))
        want = [api.kernel_defines(d, c) for d, c in launchable]
        assert [defines for _, defines in be.calls] == want
        assert paths == [c.path for _, c in launchable], arch
        assert warm["modules"] == len(want)
        assert warm["arch"] == arch and warm["backend"] == "recording"
    assert SC.device_label(2, "NVIDIA H200") == "2x NVIDIA H200"
    assert SC.device_label(1, "NVIDIA H200") == "NVIDIA H200"


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="1" tests="5" time="9.9">
<testcase classname="tests.test_fuzz" name="test_gpu_fuzz_shard[0]" time="6.250" />
<testcase classname="tests.test_fuzz" name="test_gpu_fuzz_shard[1]" time="7.500">
  <failure message="boom">assert False</failure></testcase>
<testcase classname="tests.test_matrix" name="test_case[hipkernel-a]" time="0.010">
  <skipped type="pytest.skip" message="no GPU">no GPU</skipped></testcase>
<testcase classname="tests.test_matrix" name="test_case[hipkernel-b]" time="0.500">
  <error message="fixture">setup failed</error></testcase>
<testcase classname="tests.test_matrix" name="test_case[hipkernel-c]" time="1.000" />
</testsuite></testsuites>
"""


def test_junit_durations_and_outcomes(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT)
    j = SC.parse_junit(path)
    assert {k: j[k] for k in ("tests", "passed", "failed", "error", "skipped")} == \
        {"tests": 5, "passed": 2, "failed": 1, "error": 1, "skipped": 1}
    assert j["sum_s"] == 15.26 and j["max_s"] == 7.5
    assert [s["test"] for s in j["slowest"][:2]] == ["tests.test_fuzz::test_gpu_fuzz_shard[1]",
                                                     "tests.test_fuzz::test_gpu_fuzz_shard[0]"]


def test_pytest_summary_line():
    text = "....\n========== 72 passed, 1 skipped in 125.03s (0:02:05) ==========\n"
    assert SC.summary_line(text) == "72 passed, 1 skipped in 125.03s (0:02:05)"
    assert SC.summary_line("72 passed in 1.00s\nlater: 3 failed, 69 passed in 2.00s") == \
        "later: 3 failed, 69 passed in 2.00s"
    assert SC.summary_line("INTERNALERROR") is None


def _run(workers, wall, *, rc=0, passed=72, tests=72, sum_s=100.0, timed_out=False):
    return {"workers": workers, "rc": rc, "wall_s": wall, "timed_out": timed_out,
            "junit": {"tests": tests, "passed": passed, "failed": tests - passed, "error": 0,
                      "skipped": 0, "sum_s": sum_s}}


def test_speedup_is_one_worker_over_the_most_workers_in_any_order():
    runs = [_run(2, 60.0, sum_s=130.0), _run(1, 120.0, sum_s=100.0)]
    assert SC.speedup(runs) == 2.0 and SC.speedup(runs[::-1]) == 2.0
    assert SC.per_test_time_ratio(runs) == 1.3
    assert SC.speedup([_run(1, 120.0), _run(2, 80.0), _run(4, 40.0)]) == 3.0
    assert SC.speedup([_run(2, 60.0)]) is None  # nothing to compare with
    assert SC.speedup([_run(1, 60.0), _run(1, 50.0)]) is None
    assert SC.speedup([_run(1, 120.0), _run(2, 600.0, timed_out=True)]) is None


def test_record_body_ok_is_the_runs_passing_and_the_target_only_reported():
    kw = dict(host={"gpus": 2}, warmup={"modules": 18}, suites=("seed",), fuzz_shards=20,
              per_shard=100)
    body, ok = SC.record_body(runs=[_run(2, 126.0), _run(1, 133.0)], **kw)
    assert ok and body["target_met"] is False and body["target_speedup"] == SC.TARGET_SPEEDUP
    assert body["speedup"] == pytest.approx(133.0 / 126.0)
    rec = record.stamp("scaling", "2x NVIDIA H200", body, ok)
    assert record.check_record(rec) == []  # a missed target is a fresh, passing record
    body, ok = SC.record_body(runs=[_run(2, 66.0), _run(1, 130.0)], **kw)
    assert ok and body["target_met"] is True
    for bad in (_run(2, 60.0, rc=1), _run(2, 60.0, passed=71), _run(2, 60.0, passed=0, tests=0),
                _run(2, 600.0, timed_out=True)):
        body, ok = SC.record_body(runs=[bad, _run(1, 130.0)], **kw)
        assert not ok
        problems = record.check_record(record.stamp("scaling", "x", body, ok))
        assert any("failed" in p for p in problems)
    assert SC.record_body(runs=[], **kw)[1] is False
    assert SC.record_body(runs=[_run(1, 1.0)], **kw)[0]["target_met"] is None


def _fake_timed_run(walls: dict, failed_on: int | None = None):
    """timed_run without pytest: writes the JUnit XML the command names and returns a row."""

    def timed_run(argv, env, timeout, log):
        n = int(argv[argv.index("-n") + 1])
        junit = Path(argv[-1].split("=", 1)[1])
        fail = '<failure message="x">x</failure>' if n == failed_on else ""
        junit.write_text(textwrap.dedent(f"""\
            <testsuites><testsuite>
            <testcase classname="t" name="a" time="{walls[n] / 2}" />
            <testcase classname="t" name="b" time="{walls[n] / 2}">{fail}</testcase>
            </testsuite></testsuites>"""))
        assert env["REFATTN_FUZZ_SHARDS"] == "3" and env["REFATTN_FUZZ_PER_SHARD"] == "4"
        return {"rc": 1 if n == failed_on else 0, "wall_s": walls[n], "timed_out": False,
                "pytest": "2 passed in 1.00s", "log": log.name}

    return timed_run


def _fake_gpu_host(monkeypatch):
    monkeypatch.setattr(SC, "host_facts", lambda: {
        "cpu_count": 64, "affinity_cpus": 64, "cgroup_cpu_limit": 16.0, "usable_cpus": 16,
        "loadavg": [0.1, 0.1, 0.1], "gpus": 2, "gpu_source": "nvidia-smi -L",
        "refattn_threads_env": None})
    monkeypatch.setattr(SC, "warm_in_child", lambda: {
        "backend": "cuda", "arch": "sm_90", "device_name": "NVIDIA H200", "modules": 18,
        "seconds": 40.0, "compiled": 18, "from_disk": 0, "cache_dir": "/c", "cache_enabled": True})


def test_main_writes_a_loadable_scaling_record(tmp_path, monkeypatch, capsys):
    _fake_gpu_host(monkeypatch)
    monkeypatch.delenv("REFATTN_THREADS", raising=False)
    monkeypatch.setattr(SC, "timed_run", _fake_timed_run({1: 120.0, 2: 100.0}))
    out = tmp_path / "out"
    assert SC.main(["--out", str(out), "--workers", "2,1", "--fuzz-shards", "3",
                    "--per-shard", "4"]) == 0
    rec = json.loads((out / "scaling.json").read_text())
    assert record.check_record(rec) == []
    assert rec["kind"] == "scaling" and rec["device"] == "2x NVIDIA H200" and rec["ok"]
    assert [r["workers"] for r in rec["runs"]] == [2, 1]  # in the order asked for
    assert rec["speedup"] == 1.2 and rec["target_met"] is False
    assert rec["runs"][0]["junit"]["tests"] == 2 and rec["runs"][0]["junit"]["sum_s"] == 100.0
    assert rec["runs"][0]["refattn_threads"] == str(max(1, S.usable_cpus() // 2))
    assert rec["warmup"]["modules"] == 18 and rec["host"]["cgroup_cpu_limit"] == 16.0
    text = capsys.readouterr().out
    assert "n=2: running REFATTN_FUZZ_SHARDS=3" in text and "speed-up 1.20x" in text
    assert "missed" in text


def test_main_fails_the_record_when_a_run_fails(tmp_path, monkeypatch):
    _fake_gpu_host(monkeypatch)
    monkeypatch.setattr(SC, "timed_run", _fake_timed_run({1: 120.0, 2: 60.0}, failed_on=2))
    assert SC.main(["--out", str(tmp_path), "--workers", "1,2", "--fuzz-shards", "3",
                    "--per-shard", "4"]) == 1
    rec = json.loads((tmp_path / "scaling.json").read_text())
    assert not rec["ok"] and rec["target_met"] is True
    assert rec["runs"][1]["junit"]["failed"] == 1


def test_main_stops_before_any_run_when_the_warm_up_fails(tmp_path, monkeypatch, capsys):
    _fake_gpu_host(monkeypatch)

    def no_gpu():
        raise RuntimeError("no GPU backend available")

    def never(*a, **kw):
        raise AssertionError("a timed run started without a warm cache")

    monkeypatch.setattr(SC, "warm_in_child", no_gpu)
    monkeypatch.setattr(SC, "timed_run", never)
    assert SC.main(["--out", str(tmp_path)]) == 2
    assert "warm-up failed: no GPU backend available" in capsys.readouterr().err
    assert not (tmp_path / "scaling.json").exists()


def _gone(pid: int, wait_s: float = 10.0) -> bool:
    """The process has exited (or is a zombie waiting for its new parent to reap it)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def test_timed_run_kills_the_whole_run_on_timeout(tmp_path):
    """A run past its time is killed with its children (xdist workers), and says so."""
    argv = [sys.executable, "-c", "import subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print('child', c.pid); print('3 passed in 0.10s', flush=True); time.sleep(60)"]
    row = SC.timed_run(argv, dict(os.environ), 2.0, tmp_path / "log")
    assert row["timed_out"] and row["rc"] != 0 and row["wall_s"] < 30
    assert row["pytest"] == "3 passed in 0.10s"
    child = int((tmp_path / "log").read_text().split("child ", 1)[1].split()[0])
    assert _gone(child), "the run's child process outlived the time-out"
    row = SC.timed_run([sys.executable, "-c", "print('1 failed in 0.01s')"], dict(os.environ),
                       30.0, tmp_path / "log2")
    assert (row["rc"], row["timed_out"], row["pytest"]) == (0, False, "1 failed in 0.01s")


def _run_doc(cases):
    """A ``refattn run --json`` document in miniature: (suite, case, outcome, rel_l2, time_s)."""
    return {"results": [{"suite": s, "case": c, "outcome": o, "rel_l2": r, "time_s": t}
                        for s, c, o, r, t in cases]}


def test_compare_case_runs_finds_every_case_that_differs_and_the_per_test_slowdown():
    one = _run_doc([("seed", "a", "pass", 1e-4, 1.0), ("seed", "b", "pass", 2e-4, 2.0),
                    ("ragged", "c", "declined", None, 0.5)])
    same = _run_doc([("ragged", "c", "declined", None, 0.6), ("seed", "b", "pass", 2e-4, 2.2),
                     ("seed", "a", "pass", 1e-4, 1.1)])
    res = SC.compare_case_runs(one, same)  # the merge's order is not the cases' identity
    assert res == {"cases": 3, "equal": True, "differ": [], "n_differ": 0,
                   "rel_l2_identical": True, "rel_l2_differ": [],
                   "per_test_slowdown": pytest.approx(1.1)}
    retuned = _run_doc([("seed", "a", "pass", 1.5e-4, 1.0), ("seed", "b", "pass", 2e-4, 2.0),
                        ("ragged", "c", "declined", None, 0.5)])
    res = SC.compare_case_runs(one, retuned)  # another tuned config: other rounding, same verdicts
    assert res["equal"] and not res["rel_l2_identical"] and res["rel_l2_differ"] == ["seed/a"]
    other = _run_doc([("seed", "a", "pass", 1.5e-4, 1.0), ("seed", "b", "fail", 2e-4, 2.0),
                      ("seed", "d", "pass", 0.0, 1.0)])
    res = SC.compare_case_runs(one, other)
    assert not res["equal"] and res["differ"] == ["ragged/c", "seed/d", "seed/b"]
    assert not SC.compare_case_runs(_run_doc([]), _run_doc([]))["equal"]  # nothing compared


def test_wheel_runs_body_pairs_each_command_with_its_target_and_compares_the_matrices():
    runs = {"fuzz-gpus1": {"exit": 0, "wall_s": 100.0}, "fuzz-gpus2": {"exit": 0, "wall_s": 52.0},
            "run-gpus1": {"exit": 0, "wall_s": 90.0}, "run-gpus2": {"exit": 0, "wall_s": 50.0},
            "run-third-gpus1": {"exit": 0, "wall_s": 40.0},
            "run-third-gpus2": {"exit": 0, "wall_s": 21.0}}
    doc = _run_doc([("seed", "a", "pass", 1e-4, 1.0)])
    docs = {n: doc for n in runs if n.startswith("run")}
    body = SC.wheel_runs_body(runs, docs, host={"cpu_count": 32}, devices="2 nvidia-smi",
                             suites=["seed"], examples=2000)
    assert body["ok"] and body["host"] == {"cpu_count": 32} and body["fuzz_examples"] == 2000
    assert body["pairs"]["fuzz"] == {"speedup": pytest.approx(100 / 52), "target": 1.9,
                                     "target_met": True}
    assert body["pairs"]["run"]["target"] == 1.85 and body["pairs"]["run"]["target_met"] is False
    assert body["pairs"]["run-third"]["target"] == 1.85 and body["pairs"]["run-third"]["target_met"]
    assert body["pairs"]["run"]["merged_vs_one_gpu"]["equal"] and "merged_vs_one_gpu" not in body["pairs"]["fuzz"]
    docs["run-third-gpus2"] = _run_doc([("seed", "a", "fail", 1e-4, 1.0)])
    assert not SC.wheel_runs_body(runs, docs, host={}, devices="", suites=[], examples=1)["ok"]
    runs["fuzz-gpus2"] = {"exit": 1, "wall_s": 52.0}
    assert not SC.wheel_runs_body(runs, {}, host={}, devices="", suites=[], examples=1)["ok"]
