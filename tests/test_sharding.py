"""Several GPUs through pytest-xdist (refattn/sharding.py, tests/conftest.py, ``refattn run --gpus``).

Unit tests of the pure logic (device lists, worker -> device, group keys, result rows), then
real runs on the CPU: ``pytest -n 2 --dist loadgroup`` over a few small matrix cases of the
``model`` kernel with two simulated GPUs (``REFATTN_FAKE_GPUS``), ``-n auto`` with a GPU kernel
selected, and ``refattn run --gpus 2`` against the in-process run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from refattn import cli
from refattn import sharding as S
from refattn.cases import Case, load_suites
from refattn.runner import run_case
from tests import helpers_kernels as H

ROOT = Path(__file__).resolve().parent.parent

UUID_A = "GPU-8f3b6a2e-1c4d-4e5f-9a0b-1c2d3e4f5a6b"
UUID_B = "GPU-0a1b2c3d-4e5f-6a7b-8c9d-0e1f2a3b4c5d"
MIG_A = "MIG-4c9d2f1e-7a8b-5c6d-9e0f-1a2b3c4d5e6f"

SMI_TWO = f"""GPU 0: NVIDIA H200 (UUID: {UUID_A})
GPU 1: NVIDIA H200 (UUID: {UUID_B})
"""
SMI_MIG = f"""GPU 0: NVIDIA H200 (UUID: {UUID_A})
  MIG 3g.71gb     Device  0: (UUID: {MIG_A})
  MIG 3g.71gb     Device  1: (UUID: MIG-ffffffff-0000-1111-2222-333333333333)
GPU 1: NVIDIA H200 (UUID: {UUID_B})
"""


def no_tool(argv):
    raise AssertionError(f"{argv[0]} must not run when the environment names the devices")


def tool(outputs: dict):
    def run(argv):
        return outputs.get(argv[0])
    return run


# ------------------------------------------------------------------ device lists

@pytest.mark.parametrize("value, want", [
    ("2,3", ["2", "3"]),
    (" 1 , 0 ", ["1", "0"]),
    (f"{UUID_A},{UUID_B}", [UUID_A, UUID_B]),
    (f"{MIG_A}", [MIG_A]),
    ("", []),
    (None, []),
    ("0,-1,1", ["0"]),          # the runtime stops at the first invalid entry
    ("0,1,0", ["0", "1"]),      # ... and at a repeat
    ("NoDevFiles", []),
    ("-1", []),
])
def test_parse_visible_devices(value, want):
    assert S.parse_visible_devices(value) == want


def test_nvidia_smi_list_gives_ordinals_or_mig_uuids():
    assert S.parse_nvidia_smi_list(SMI_TWO) == ["0", "1"]
    assert S.parse_nvidia_smi_list("") == []
    assert S.parse_nvidia_smi_list("No devices were found\n") == []
    # with MIG on, each instance is a device, addressed by UUID; a GPU without MIG by its UUID
    assert S.parse_nvidia_smi_list(SMI_MIG) == [MIG_A, "MIG-ffffffff-0000-1111-2222-333333333333",
                                                UUID_B]


def test_rocm_smi_list():
    text = ("============ ROCm System Management Interface ============\n"
            "GPU[0]\t\t: Device ID: 0x74a1\nGPU[0]\t\t: Device Rev: 0x00\n"
            "GPU[1]\t\t: Device ID: 0x74a1\n")
    assert S.parse_rocm_smi(text) == ["0", "1"]
    assert S.parse_rocm_smi("no GPU here") == []


def test_visible_devices_prefers_the_parents_list_and_never_probes_then():
    d = S.visible_devices({"CUDA_VISIBLE_DEVICES": "2,3"}, run_tool=no_tool)
    assert (d.var, d.devices, len(d)) == ("CUDA_VISIBLE_DEVICES", ("2", "3"), 2)
    d = S.visible_devices({"CUDA_VISIBLE_DEVICES": f"{UUID_B},{UUID_A}"}, run_tool=no_tool)
    assert d.devices == (UUID_B, UUID_A)
    d = S.visible_devices({"CUDA_VISIBLE_DEVICES": ""}, run_tool=no_tool)  # set but empty: none
    assert d.devices == () and d.var == "CUDA_VISIBLE_DEVICES"
    d = S.visible_devices({"HIP_VISIBLE_DEVICES": "1"}, run_tool=no_tool)
    assert (d.var, d.devices) == ("HIP_VISIBLE_DEVICES", ("1",))
    d = S.visible_devices({"ROCR_VISIBLE_DEVICES": "3,5"}, run_tool=no_tool)
    assert (d.var, d.devices) == ("HIP_VISIBLE_DEVICES", ("0", "1"))  # ordinals within ROCR's set
    d = S.visible_devices({"REFATTN_FAKE_GPUS": "3", "CUDA_VISIBLE_DEVICES": "7"}, run_tool=no_tool)
    assert (d.var, d.devices, d.source) == ("CUDA_VISIBLE_DEVICES", ("0", "1", "2"), "REFATTN_FAKE_GPUS")


def test_visible_devices_counts_with_nvidia_smi_then_kfd(tmp_path):
    absent = tmp_path / "no-kfd"
    d = S.visible_devices({}, run_tool=tool({"nvidia-smi": SMI_TWO}), kfd=absent)
    assert (d.var, d.devices, d.source) == ("CUDA_VISIBLE_DEVICES", ("0", "1"), "nvidia-smi -L")
    assert len(S.visible_devices({}, run_tool=tool({}), kfd=absent)) == 0
    assert S.visible_devices({}, run_tool=tool({}), kfd=absent).var is None

    kfd = tmp_path / "kfd"
    kfd.write_text("")
    topo = tmp_path / "nodes"
    for i, simds in enumerate((0, 104, 104, 0)):  # two CPU nodes, two GPU nodes
        (topo / str(i)).mkdir(parents=True)
        (topo / str(i) / "properties").write_text(f"cpu_cores_count 8\nsimd_count {simds}\n")
    d = S.visible_devices({}, run_tool=tool({}), kfd=kfd, kfd_topology=topo)
    assert (d.var, d.devices, d.source) == ("HIP_VISIBLE_DEVICES", ("0", "1"), "kfd topology")
    rocm = "GPU[0]\t: Device ID: 1\nGPU[1]\t: Device ID: 1\nGPU[2]\t: Device ID: 1\n"
    d = S.visible_devices({}, run_tool=tool({"rocm-smi": rocm}), kfd=kfd,
                          kfd_topology=tmp_path / "absent")
    assert (d.var, d.devices) == ("HIP_VISIBLE_DEVICES", ("0", "1", "2"))


# ------------------------------------------------------------------ workers

def test_worker_gets_the_nth_device_of_the_parents_list():
    devs = S.Devices("CUDA_VISIBLE_DEVICES", ("2", "3"))
    assert S.worker_index("gw0") == 0 and S.worker_index("gw12") == 12
    assert S.worker_index("master") is None and S.worker_index(None) is None
    assert S.device_for_worker("gw0", devs) == "2"
    assert S.device_for_worker("gw1", devs) == "3"
    assert S.device_for_worker("gw2", devs) == "2"  # more workers than devices: they share
    assert S.device_for_worker(None, devs) is None
    assert S.device_for_worker("gw1", S.Devices(None, ())) is None
    assert S.device_for_worker("gw1", [UUID_A, UUID_B]) == UUID_B


def test_pin_environment_sets_the_vendor_variable_and_device_zero():
    env = {"CUDA_VISIBLE_DEVICES": "2,3", "HIPKERNEL_DEVICE": "1"}
    devs = S.visible_devices(env, run_tool=no_tool)
    assert S.pin_environment("gw1", devs, env) == "3"
    assert env == {"CUDA_VISIBLE_DEVICES": "3", "HIPKERNEL_DEVICE": "0"}
    env = {}
    assert S.pin_environment("gw0", S.Devices("HIP_VISIBLE_DEVICES", ("1", "0")), env) == "1"
    assert env == {"HIP_VISIBLE_DEVICES": "1", "HIPKERNEL_DEVICE": "0"}
    env = {"X": "y"}
    assert S.pin_environment("gw0", S.Devices(None, ()), env) is None and env == {"X": "y"}
    assert S.pin_environment(None, S.Devices("CUDA_VISIBLE_DEVICES", ("0",)), env) is None
    assert env == {"X": "y"}


def test_auto_num_workers_is_the_gpu_count_for_gpu_kernels_only():
    two = S.Devices("CUDA_VISIBLE_DEVICES", ("0", "1"))
    assert S.auto_num_workers(True, two, {}) == 2
    assert S.auto_num_workers(False, two, {}) is None  # xdist's default: the CPU count
    assert S.auto_num_workers(True, S.Devices(None, ()), {}) is None
    assert S.auto_num_workers(True, two, {"PYTEST_XDIST_AUTO_NUM_WORKERS": "5"}) is None


# ------------------------------------------------------------------ groups

def _case(name="g", **kw):
    base = dict(name=name, Hq=8, Hkv=2, d=16, sq=24, past_len=40, why="test")
    base.update(kw)
    return Case(**base)


def test_group_key_is_the_autotune_key_without_the_arch():
    from hipkernel.autotune import tune_key

    a = _case()
    assert S.tune_group(a) == (16, 24, 8, 4, -1, "fp16")
    assert S.group_key(a) == "tune-d16-sq24-Hq8-G4-wnone-fp16"
    assert S.group_key(_case(window=7)) == "tune-d16-sq24-Hq8-G4-w7-fp16"
    # what does not change the tuned config does not change the group
    for same in (_case(past_len=4000), _case(sink="per_head"), _case(sink="smooth"),
                 _case(seed=3), _case(B=2), _case(config={"m_tiles": 1, "bkv": 32})):
        assert S.group_key(same) == S.group_key(a)
    for other in (_case(d=64), _case(sq=25), _case(Hq=16, Hkv=4), _case(Hkv=8), _case(window=5),
                  _case(dtype="bf16")):
        assert S.group_key(other) != S.group_key(a)
    for c in load_suites(["seed", "extended", "contracts"]):
        key = tune_key(d=c.d, sq=c.sq, Hq=c.Hq, G=c.G, window=c.window, dtype=c.dtype, arch="x")
        assert S.tune_group(c) == key[:6]
        assert "@" not in S.group_key(c)  # xdist splits the node id at '@'


# ------------------------------------------------------------------ result rows

def test_result_rows_round_trip_to_identical_json_and_messages(tmp_path):
    sink = _case("t-sink", sink="per_head")
    plain = _case("t-plain", window=9)
    bf16 = _case("t-bf16", dtype="bf16")
    originals = [run_case(H.WrongSinkKernel(), sink), run_case(H.CorrectKernel(), plain),
                 run_case(H.CorrectKernel(), bf16)]
    assert [r.outcome for r in originals] == ["fail", "pass", "declined"]
    for c, r in zip((sink, plain, bf16), originals):
        S.append_row(tmp_path, "gw1", S.result_row(r, kernel_spec="k", kernel_name="wrong-sink",
                                                   case=c, worker_id="gw1", device="3"))
    rows = S.read_rows(tmp_path)
    assert [row["device"] for row in rows] == ["3"] * 3
    back, skipped = S.merge_results([plain, bf16, sink], rows)  # in the order asked for
    assert skipped == {}
    assert [b.case for b in back] == ["t-plain", "t-bf16", "t-sink"]
    for b, r in zip(back, (originals[1], originals[2], originals[0])):
        assert json.dumps(b.to_dict()) == json.dumps(r.to_dict())
        assert b.failure_message() == r.failure_message() and b.summary == r.summary
        for f in ("outcome", "rel_l2", "max_abs", "max_abs_at", "gate", "gate_max_abs",
                  "seed_gate_pass", "n_nan", "n_inf", "time_s", "acceptable"):
            assert getattr(b, f) == getattr(r, f), f
    assert "Max absolute difference" in back[2].failure_message()


def test_merge_marks_missing_and_skipped_cases(tmp_path):
    a, b, c = _case("a"), _case("b"), _case("c")
    S.append_row(tmp_path, "gw0", S.result_row(run_case(H.CorrectKernel(), a), kernel_spec="k",
                                               kernel_name="correct", case=a, worker_id="gw0",
                                               device=None))
    S.append_row(tmp_path, "gw1", S.skip_row(kernel_spec="k", case=b, reason="k is not available "
                                             "here: no GPU", worker_id="gw1", device="1"))
    results, skipped = S.merge_results([a, b, c], S.read_rows(tmp_path))
    assert [r.outcome for r in results] == ["pass", "error", "error"]
    assert skipped == {b.id: "k is not available here: no GPU"}
    assert "not available" in results[1].note and results[2].note.startswith("no result")
    assert results[2].to_dict()["params"]["describe"] == c.describe()


def test_row_reader_returns_only_complete_lines(tmp_path):
    path = tmp_path / "gw0.1.jsonl"
    reader = S.RowReader(tmp_path)
    path.write_bytes(b'{"kind": "result", "n": 1}\n{"kind": "res')
    assert reader.poll() == [{"kind": "result", "n": 1}]
    assert reader.poll() == []
    with open(path, "ab") as f:
        f.write(b'ult", "n": 2}\n')
    assert reader.poll() == [{"kind": "result", "n": 2}]


def test_pytest_command_runs_exactly_the_cases_grouped():
    cases = load_suites(["extended"])[:2]
    cmd = S.pytest_command("hipkernel:cuda", ["extended", "extended"], cases, 2)
    assert cmd[cmd.index("-n") + 1] == "2" and cmd[cmd.index("--dist") + 1] == "loadgroup"
    assert "no:cacheprovider" in cmd and cmd.count("--refattn-suite") == 1
    assert cmd[cmd.index("--refattn-kernel") + 1] == "hipkernel:cuda"
    assert cmd[-2:] == [f"{S.MATRIX_TESTS}::test_case[hipkernel:cuda-{c.name}]" for c in cases]
    # the plugin and the test module shipped in the package; nothing of the tree it runs in
    assert cmd[cmd.index("-p") + 1] == "refattn.pytest_plugin" and "--noconftest" in cmd
    assert cmd[cmd.index("-c") + 1] == os.devnull
    assert S.MATRIX_TESTS == Path(S.__file__).resolve().with_name("matrix_tests.py")
    assert S.MATRIX_TESTS.is_file() and "tests" not in S.MATRIX_TESTS.parts[-2:]


# ------------------------------------------------------------------ real runs under xdist

SMALL = "sq1-past or sq3-past or contract or sq160"  # 11 cases, about a second of model time


def clean_env(**extra) -> dict:
    """The environment for a child pytest: nothing of this process's own xdist role or pin."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_XDIST", "REFATTN_"))
           and k not in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
                         "HIPKERNEL_DEVICE", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(extra)
    return env


def run(argv, env, timeout=300):
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


FAST = ["-p", "no:cacheprovider", *S.NOT_NEEDED_PLUGINS]


def test_two_workers_pinned_to_their_own_device_and_each_group_on_one_worker(tmp_path):
    pytest.importorskip("xdist")
    rows_dir = tmp_path / "rows"
    rows_dir.mkdir()
    env = clean_env(REFATTN_FAKE_GPUS="2", REFATTN_RESULTS_DIR=str(rows_dir))
    p = run([sys.executable, "-m", "pytest", "tests/test_matrix.py", "-n", "2", "--dist",
             "loadgroup", *FAST, "--kernel", "model", "--suite", "extended", "--suite",
             "contracts", "-k", SMALL], env)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert "11 passed" in out, out
    assert "refattn: 2 device(s) from REFATTN_FAKE_GPUS; CUDA_VISIBLE_DEVICES: gw0->0, gw1->1" in out

    rows = S.read_rows(rows_dir)
    assert len(rows) == 11 and {r["kind"] for r in rows} == {"result"}
    assert {r["worker"] for r in rows} == {"gw0", "gw1"}  # both workers ran cases
    for r in rows:  # each saw its own pinned device, read from its os.environ at test time
        assert r["device"] == {"gw0": "0", "gw1": "1"}[r["worker"]], r
    workers_of: dict[str, set] = {}
    for r in rows:
        workers_of.setdefault(r["group"], set()).add(r["worker"])
    assert all(len(w) == 1 for w in workers_of.values()), workers_of
    sizes = [sum(r["group"] == g for r in rows) for g in workers_of]
    assert max(sizes) >= 2  # some group really had several cases to keep together
    assert {r["result"]["outcome"] for r in rows} == {"pass", "declined"}


def test_n_auto_is_the_gpu_count_when_a_gpu_kernel_is_selected():
    pytest.importorskip("xdist")
    env = clean_env(REFATTN_FAKE_GPUS="3")
    p = run([sys.executable, "-m", "pytest", "tests/test_matrix.py", "-n", "auto", *FAST,
             "--kernel", "hipkernel", "--suite", "contracts", "-k", "contract-d80"], env)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert "3 workers [1 item]" in out, out


def _json_run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_refattn_run_gpus_merges_into_the_in_process_json(capsys, monkeypatch):
    pytest.importorskip("xdist")
    monkeypatch.delenv("REFATTN_CASES_DIR", raising=False)
    select = ["--suite", "extended", "contracts", "-k", "sq1-past", "-k", "sq3-past",
              "-k", "contract", "-k", "sq160", "--json", "-"]
    code, out, _ = _json_run(capsys, "run", "--kernel", "model", *select)
    assert code == 0
    local = json.loads(out)

    env = clean_env(CUDA_VISIBLE_DEVICES="5,7")  # two "GPUs"; the model never touches them
    p = run([sys.executable, "-m", "refattn", "run", "--kernel", "model", "--gpus", "2", *select], env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "on 2 pytest-xdist workers; 2 device(s) visible (CUDA_VISIBLE_DEVICES)" in p.stderr
    assert "OK: kernel model, 11 cases: 6 pass, 5 declined" in p.stderr  # the table went to stderr
    sharded = json.loads(p.stdout)  # stdout is the JSON alone: pytest's output stays out of it

    assert sharded.keys() == local.keys()
    for k in ("schema", "kernel", "ok", "suites", "counts"):
        assert sharded[k] == local[k], k
    assert sharded["host"].keys() == local["host"].keys()
    assert [r["case"] for r in sharded["results"]] == [r["case"] for r in local["results"]]
    for a, b in zip(sharded["results"], local["results"]):
        assert a.keys() == b.keys()
        a, b = dict(a), dict(b)
        assert a.pop("time_s") is not None and b.pop("time_s") is not None
        assert a == b  # the same numbers, verdicts, locations and messages


def test_refattn_run_gpus_reports_failures_like_the_in_process_run(capsys):
    pytest.importorskip("xdist")
    select = ["--kernel", "tests.helpers_kernels:WrongSinkKernel", "--suite", "extended",
              "-k", "ext-sink-sq1-past0", "-k", "ext-nosink-sq3-past37", "--json", "-"]
    code, out, err = _json_run(capsys, "run", *select)
    assert code == 1
    local = json.loads(out)
    p = run([sys.executable, "-m", "refattn", "run", *select, "--gpus", "2", "-q"], clean_env())
    assert p.returncode == 1, p.stdout + p.stderr
    sharded = json.loads(p.stdout)
    assert sharded["counts"] == local["counts"] == {**{o: 0 for o in local["counts"]},
                                                    "pass": 1, "fail": 1}
    msg = next(r for r in sharded["results"] if r["outcome"] == "fail")["summary"]
    assert msg == next(r for r in local["results"] if r["outcome"] == "fail")["summary"]
    # the failure story printed after the table is the worker's, word for word
    story = err[err.index("extended/ext-sink-sq1-past0"):].strip()
    assert story in p.stderr
    assert "refattn run:" not in p.stderr  # -q: no progress or sharding note


# ------------------------------------------------------------------ --gpus without a source tree

def test_child_env_puts_the_source_tree_first_only_when_run_from_one(tmp_path, monkeypatch):
    env = S.child_env(tmp_path, {"PYTHONPATH": "/elsewhere", "X": "1"})
    assert env["REFATTN_RESULTS_DIR"] == str(tmp_path) and env["X"] == "1"
    assert env["PYTHONPATH"] == os.pathsep.join([str(ROOT), "/elsewhere"])  # this is a tree
    assert S.source_root() == ROOT
    monkeypatch.setattr(S, "ROOT", tmp_path)  # refattn as installed: no pyproject beside it
    assert S.source_root() is None
    assert S.child_env(tmp_path, {"PYTHONPATH": "/elsewhere"})["PYTHONPATH"] == "/elsewhere"
    assert "PYTHONPATH" not in S.child_env(tmp_path, {})


def _installed_layout(tmp_path) -> Path:
    """refattn as a wheel installs it: the package alone in a site directory, the suites as its
    package data ``refattn/suites``; no pyproject.toml, cases/ or tests/ anywhere near."""
    import shutil

    site = tmp_path / "site"
    shutil.copytree(ROOT / "refattn", site / "refattn",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (site / "refattn" / "suites").mkdir()
    for f in (ROOT / "cases").glob("*.toml"):
        shutil.copy(f, site / "refattn" / "suites" / f.name)
    return site


def test_refattn_run_gpus_from_an_installed_layout_equals_the_in_process_run(tmp_path):
    """``refattn run --gpus 2`` with refattn imported from an installed layout, run from an
    empty directory: the workers run the shipped test module through the plugin, each pinned
    to its own (simulated) device, and the merged JSON is the in-process run's, case for case."""
    pytest.importorskip("xdist")
    site = _installed_layout(tmp_path)
    work = tmp_path / "empty"
    work.mkdir()
    env = clean_env(CUDA_VISIBLE_DEVICES="5,7")
    env["PYTHONPATH"] = str(site)  # not the source tree
    where = subprocess.run(
        [sys.executable, "-c", "import refattn, refattn.cases as c, refattn.sharding as s; "
         "print(refattn.__file__); print(c.cases_dir()); print(s.source_root())"],
        cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert where.stdout.split() == [str(site / "refattn" / "__init__.py"),
                                    str(site / "refattn" / "suites"), "None"], where.stderr
    select = ["run", "--kernel", "reference", "--suite", "extended", "contracts",
              "-k", "sq1-past", "-k", "contract-d80", "-k", "contract-bf16", "--json", "-"]
    local = subprocess.run([sys.executable, "-m", "refattn", *select], cwd=work, env=env,
                           capture_output=True, text=True, timeout=300)
    assert local.returncode == 0, local.stderr
    p = subprocess.run([sys.executable, "-m", "refattn", *select, "--gpus", "2"], cwd=work,
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "on 2 pytest-xdist workers; 2 device(s) visible (CUDA_VISIBLE_DEVICES)" in p.stderr
    local, sharded = json.loads(local.stdout), json.loads(p.stdout)
    assert sharded["counts"] == local["counts"] and sharded["ok"] and local["ok"]
    assert [r["case"] for r in sharded["results"]] == [r["case"] for r in local["results"]]
    assert len(sharded["results"]) >= 4
    for a, b in zip(sharded["results"], local["results"]):
        a, b = dict(a), dict(b)
        assert a.pop("time_s") is not None and b.pop("time_s") is not None
        assert a == b


def test_workers_from_the_shipped_module_are_pinned_and_record_rows(tmp_path):
    """The sharded command itself (pytest_command) from an installed layout: each worker pinned
    to its own device, every row from the shipped module, every group on one worker."""
    pytest.importorskip("xdist")
    site = _installed_layout(tmp_path)
    work = tmp_path / "empty"
    work.mkdir()
    rows_dir = tmp_path / "rows"
    rows_dir.mkdir()
    env = clean_env(REFATTN_FAKE_GPUS="2", REFATTN_RESULTS_DIR=str(rows_dir))
    cases = [c for c in load_suites(["extended", "contracts"])
             if any(s in c.name for s in ("sq1-past", "sq3-past", "contract"))]
    test_file = site / "refattn" / "matrix_tests.py"
    cmd = S.pytest_command("model", ["extended", "contracts"], cases, 2, test_file)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT)])  # the model kernel's package
    p = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert f"{len(cases)} passed" in out, out
    rows = S.read_rows(rows_dir)
    assert len(rows) == len(cases) and {r["kind"] for r in rows} == {"result"}
    assert {r["worker"] for r in rows} == {"gw0", "gw1"}
    for r in rows:
        assert r["device"] == {"gw0": "0", "gw1": "1"}[r["worker"]], r
        assert r["nodeid"].startswith(f"{S.MATRIX_NODEID}::test_case[model-"), r
    workers_of: dict[str, set] = {}
    for r in rows:
        workers_of.setdefault(r["group"], set()).add(r["worker"])
    assert all(len(w) == 1 for w in workers_of.values()), workers_of
