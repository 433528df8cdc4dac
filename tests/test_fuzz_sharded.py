"""``refattn fuzz --gpus N``: the fuzzer's examples shared out over N worker processes, each
pinned to its own device (refattn/fuzz.py, Several GPUs; refattn/sharding.py).

The pure parts first (worker seeds, the examples split, the merge of the workers' documents,
the pinned environment), then real sharded runs on the CPU with two simulated devices
(``CUDA_VISIBLE_DEVICES=5,7`` or ``$REFATTN_FAKE_GPUS``, which the devices counter reads
before any probe): each worker saw its own device, the cases each drew equal the cases its
share draws when run in this process, a broken kernel is caught and shrunk in the worker
that found it, and the usage errors name their option.
"""

from __future__ import annotations

import json
import os
import tomllib

import pytest

from examples.numpy_kernel import NumpyKernel
from refattn import cli
from refattn import fuzz as F
from refattn import sharding as S
from refattn.cases import Case
from refattn.kernels import get_kernel, kernel_available

EXAMPLE = "examples/numpy_kernel.py:NumpyKernel"
PLUS_ONE = "tests.adapters.numpy_window:WindowPlusOne"
CRASH = "tests.test_fuzz_sharded:ExitingKernel"
COST = 2**16  # query-key pairs: every example a few milliseconds
CHEAP = ["--max-cost", str(COST)]


class ExitingKernel(NumpyKernel):
    """Ends its process on the first case it runs (as a kernel that crashes the runtime would)."""

    name = "numpy-exiting"

    def run(self, x):
        os._exit(3)


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def two_devices(monkeypatch):
    """Two simulated devices named by the parent's CUDA_VISIBLE_DEVICES, 5 and 7."""
    for var in (S.FAKE_GPUS_ENV, S.HIP_VAR, S.ROCR_VAR, "REFATTN_THREADS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(S.CUDA_VAR, "5,7")
    return ("5", "7")


# ------------------------------------------------------------------ seeds and shares

def test_worker_seed_is_seed_times_workers_plus_index():
    assert [F.worker_seed(0, i, 2) for i in range(2)] == [0, 1]
    assert [F.worker_seed(1, i, 2) for i in range(2)] == [2, 3]
    assert [F.worker_seed(5, i, 3) for i in range(3)] == [15, 16, 17]
    assert F.worker_seed(42, 0, 1) == 42  # one worker draws with --seed itself
    for n in (2, 3, 8):  # distinct within a run, and no two base seeds share a worker seed
        seeds = [F.worker_seed(s, i, n) for s in range(50) for i in range(n)]
        assert len(set(seeds)) == len(seeds)
    with pytest.raises(ValueError, match="index"):
        F.worker_seed(0, 2, 2)


@pytest.mark.parametrize("examples, workers, want", [
    (10, 4, [3, 3, 2, 2]), (2000, 2, [1000, 1000]), (7, 3, [3, 2, 2]), (5, 5, [1] * 5),
    (25, 2, [13, 12]), (40, 1, [40]),
])
def test_examples_are_split_evenly_the_remainder_to_the_first_workers(examples, workers, want):
    assert F.split_examples(examples, workers) == want
    shares = F.plan_shares(3, examples, workers)
    assert [s.examples for s in shares] == want and sum(want) == examples
    assert [(s.index, s.seed) for s in shares] == [(i, 3 * workers + i) for i in range(workers)]


def test_every_worker_needs_an_example():
    with pytest.raises(ValueError, match=r"--examples 1: fewer than --gpus 2"):
        F.plan_shares(0, 1, 2)
    with pytest.raises(ValueError, match="workers"):
        F.split_examples(3, 0)


# ------------------------------------------------------------------ pinning

def test_worker_environment_pins_like_the_pytest_workers(tmp_path):
    devs = S.visible_devices({"CUDA_VISIBLE_DEVICES": "5,7"}, run_tool=lambda argv: None)
    parent = {"CUDA_VISIBLE_DEVICES": "5,7", "HIPKERNEL_DEVICE": "1", "X": "y"}
    envs = [S.worker_environment(i, 2, devs, tmp_path, parent) for i in range(2)]
    assert [dev for _, dev in envs] == ["5", "7"]
    for (env, dev), xdist_id in zip(envs, ("gw0", "gw1")):
        assert env["CUDA_VISIBLE_DEVICES"] == dev and env["HIPKERNEL_DEVICE"] == "0"
        assert env["X"] == "y" and env[S.RESULTS_DIR_ENV] == str(tmp_path)
        assert env["REFATTN_THREADS"] == S.worker_threads(2, parent)
        assert env["OMP_NUM_THREADS"] == env["REFATTN_THREADS"]
        # the very pin the plugin gives the pytest-xdist worker of the same index
        pinned = dict(parent)
        assert S.pin_environment(xdist_id, devs, pinned, workers=2) == dev
        assert {k: env[k] for k in pinned} == pinned
    assert parent["CUDA_VISIBLE_DEVICES"] == "5,7"  # the parent's own environment is untouched
    hip = S.Devices("HIP_VISIBLE_DEVICES", ("1", "0"))
    env, dev = S.worker_environment(0, 2, hip, tmp_path, {})
    assert dev == "1" and env["HIP_VISIBLE_DEVICES"] == "1" and "CUDA_VISIBLE_DEVICES" not in env


def test_require_devices_wants_one_device_per_worker():
    two = S.Devices("CUDA_VISIBLE_DEVICES", ("5", "7"), "CUDA_VISIBLE_DEVICES")
    S.require_devices(2, two)
    S.require_devices(1, two)
    with pytest.raises(S.ShardError, match=r"--gpus 3: 2 device\(s\) visible "
                                           r"\(CUDA_VISIBLE_DEVICES\)"):
        S.require_devices(3, two)
    with pytest.raises(S.ShardError, match=r"--gpus 2: 0 device\(s\) visible \(none\)"):
        S.require_devices(2, S.Devices(None, ()))


# ------------------------------------------------------------------ merging

def _worker_doc(index, *, examples, ok=True, declined=0, stopped="examples", shrink=0):
    minimal = None if ok else {"describe": f"case of worker {index}", "command": f"cmd {index}",
                               "toml": f"toml {index}", "case": {}, "result": {}, "first": None}
    run = {"schema": F.SCHEMA, "kind": "fuzz", "kernel": "k", "kernel_spec": "spec",
           "kernel_source_hash": None, "ok": ok, "seed": 10 + index, "examples": examples,
           "shrink_steps": shrink, "declined_draws": declined, "stopped": stopped,
           "elapsed_s": 1.5 + index, "axes": {"d": [64]}, "minimal": minimal}
    return {"index": index, "device": str(index), "var": "CUDA_VISIBLE_DEVICES",
            "threads": "4", "seed": 10 + index, "max_examples": 9, "run": run,
            "cases": [{"case": f"c{index}-{j}", "seed": j, "outcome": "pass"}
                      for j in range(examples)],
            "failure_message": None if ok else f"message {index}"}


def test_merge_reports_the_lowest_numbered_failing_worker_whatever_the_order():
    docs = [_worker_doc(2, examples=4, ok=False, shrink=7, stopped="shrink time"),
            _worker_doc(0, examples=9, declined=2),
            _worker_doc(1, examples=3, ok=False, shrink=5, declined=1)]
    for order in (docs, docs[::-1], docs[1:] + docs[:1]):
        m = F.merge_workers(list(order), "spec", 5, elapsed_s=3.21, source_hash="h")
        assert F.failing_worker(list(order))["index"] == 1
        assert not m["ok"] and m["minimal"]["describe"] == "case of worker 1"
        assert (m["examples"], m["declined_draws"], m["shrink_steps"]) == (16, 3, 5)
        assert m["stopped"] == "examples"  # worker 1's; worker 2 ran out of shrink time
        assert (m["seed"], m["elapsed_s"], m["kernel_source_hash"]) == (5, 3.21, "h")
        assert [w["index"] for w in m["workers"]] == [0, 1, 2]
        assert [w["examples"] for w in m["workers"]] == [9, 3, 4]
        assert [w["ok"] for w in m["workers"]] == [True, False, False]
        assert m["workers"][2]["minimal"] == {"describe": "case of worker 2", "command": "cmd 2"}
        assert m["workers"][0]["cases"][-1] == {"case": "c0-8", "seed": 8, "outcome": "pass"}
        for w in m["workers"]:
            assert {"device", "seed", "examples", "elapsed_s", "ok"} <= w.keys()


def test_merge_of_passing_workers():
    docs = [_worker_doc(0, examples=5), _worker_doc(1, examples=4, stopped="time")]
    m = F.merge_workers(docs, "spec", 0, elapsed_s=1.0, source_hash=None)
    assert m["ok"] and m["minimal"] is None and m["examples"] == 9 and m["shrink_steps"] == 0
    assert m["stopped"] == "time" and F.failing_worker(docs) is None
    m = F.merge_workers(docs[:1], "spec", 0, elapsed_s=1.0, source_hash=None)
    assert m["stopped"] == "examples"


# ------------------------------------------------------------------ sharded runs

def _sequential(spec, seed, examples, workers, **options):
    kernel = get_kernel(spec)
    return [F.share_cases(kernel, sh, max_cost=COST, **options)
            for sh in F.plan_shares(seed, examples, workers)]


def test_sharded_fuzz_pins_each_worker_and_draws_what_its_share_draws(capsys, tmp_path,
                                                                       two_devices):
    code, out, err = run_cli(capsys, "fuzz", "--kernel", EXAMPLE, "--examples", "25", "--seed",
                             "3", *CHEAP, "--gpus", "2", "--json", str(tmp_path / "f.json"))
    assert code == 0, out + err
    doc = json.loads((tmp_path / "f.json").read_text())
    assert doc["ok"] and doc["minimal"] is None and doc["kind"] == "fuzz"
    assert (doc["seed"], doc["examples"]) == (3, 25)
    ws = doc["workers"]
    assert [w["device"] for w in ws] == list(two_devices)  # each saw its own pin
    assert [w["var"] for w in ws] == ["CUDA_VISIBLE_DEVICES"] * 2
    assert [w["threads"] for w in ws] == [S.worker_threads(2)] * 2
    assert [(w["seed"], w["max_examples"], w["examples"]) for w in ws] == [(6, 13, 13),
                                                                            (7, 12, 12)]
    assert all(w["ok"] and w["elapsed_s"] > 0 for w in ws)
    assert "OK: kernel numpy-example: 25 examples over 2 workers, none failing" in out
    assert "2 device(s) visible (CUDA_VISIBLE_DEVICES)" in err
    assert "fuzz: worker 1: CUDA_VISIBLE_DEVICES=7, seed 7, up to 12 examples" in err
    assert "[worker 0] fuzz: " in err and "fuzz: worker 1 done: 12 examples" in err

    # case for case what the shares draw when run one after another in this process
    seq = _sequential(EXAMPLE, 3, 25, 2)
    assert [w["cases"] for w in ws] == seq
    assert len(seq[0]) == 13 and len({(c["case"], c["seed"]) for c in seq[0] + seq[1]}) > 20

    # the schema of a one-device run, plus the workers; worker 1 alone is that run
    code, _, _ = run_cli(capsys, "fuzz", "--kernel", EXAMPLE, "--examples", "12", "--seed", "7",
                         *CHEAP, "-q", "--json", str(tmp_path / "one.json"))
    one = json.loads((tmp_path / "one.json").read_text())
    assert code == 0 and set(doc) == set(one) | {"workers"}
    assert one["examples"] == ws[1]["examples"] and one["axes"] == doc["axes"]


def test_gpus_1_is_the_in_process_run(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv(S.CUDA_VAR, "")  # no device visible: --gpus 1 needs none
    args = ["fuzz", "--kernel", EXAMPLE, "--examples", "10", "--seed", "4", *CHEAP, "-q"]
    code, out, err = run_cli(capsys, *args, "--json", str(tmp_path / "a.json"))
    assert code == 0, out + err
    code, out1, err1 = run_cli(capsys, *args, "--gpus", "1", "--json", str(tmp_path / "b.json"))
    assert code == 0, out1 + err1
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert a.pop("elapsed_s") is not None and b.pop("elapsed_s") is not None
    assert a == b and "workers" not in a
    assert "[worker" not in err1 and "over 1 workers" not in out1


def test_sharded_fuzz_catches_a_broken_kernel_and_shrinks_it_in_its_worker(capsys, tmp_path,
                                                                           monkeypatch):
    monkeypatch.setenv(S.FAKE_GPUS_ENV, "2")
    monkeypatch.delenv("REFATTN_THREADS", raising=False)
    code, out, err = run_cli(capsys, "fuzz", "--kernel", PLUS_ONE, "--examples", "40", *CHEAP,
                             "--gpus", "2", "--json", str(tmp_path / "f.json"))
    assert code == 1, out + err
    doc = json.loads((tmp_path / "f.json").read_text())
    ws = doc["workers"]
    assert [w["device"] for w in ws] == ["0", "1"]  # REFATTN_FAKE_GPUS: ordinals 0 .. N-1
    failed = [w["index"] for w in ws if not w["ok"]]
    assert failed and not doc["ok"]
    w = ws[min(failed)]  # the lowest-numbered failing worker's case is the one reported
    m = doc["minimal"]
    assert m["describe"] == w["minimal"]["describe"] and m["command"] == w["minimal"]["command"]
    assert doc["shrink_steps"] == w["shrink_steps"] > 0
    assert doc["examples"] == sum(x["examples"] for x in ws)
    assert ws[min(failed)]["cases"][-1]["outcome"] == "fail"  # its search ended at a failure
    case = Case(suite="x", **{k: v for k, v in m["case"].items() if k != "suite"})
    assert case.name == f"fuzz-seed{w['seed']}" and case.sq <= 64 and case.window >= 1
    assert m["result"]["outcome"] == "fail"
    assert tomllib.loads(m["toml"])["case"][0]["window"] == case.window
    assert f"FAILED: kernel numpy-window-plus-one: worker {w['index']} " in out
    assert f"(CUDA_VISIBLE_DEVICES={w['device']}, seed {w['seed']})" in out
    assert "[[case]]" in out and m["command"] in out and "Max absolute difference" in out
    assert (f"refattn fuzz --kernel {PLUS_ONE} --seed {w['seed']} --examples 20 "
            f"--max-cost {COST}") in out
    assert f"[worker {w['index']}] fuzz: example " in err and "shrinking" in err

    # the same cases and verdicts as the shares run one after another here, and the same shrink
    assert [x["cases"] for x in ws] == _sequential(PLUS_ONE, 0, 40, 2)
    share = F.plan_shares(0, 40, 2)[w["index"]]
    alone = F.fuzz(get_kernel(PLUS_ONE), examples=share.examples, seed=share.seed, max_cost=COST)
    assert alone.minimal is not None and alone.minimal.describe() == m["describe"]
    assert alone.shrink_steps == w["shrink_steps"]

    # the printed command reproduces it, and the correct kernel passes it
    inline = m["command"].split("--case '", 1)[1].rstrip("'")
    assert run_cli(capsys, "run", "--kernel", PLUS_ONE, "--case", inline)[0] == 1
    assert run_cli(capsys, "run", "--kernel", EXAMPLE, "--case", inline)[0] == 0


def test_quiet_sharded_run_prints_no_progress(capsys, two_devices):
    code, out, err = run_cli(capsys, "fuzz", "--kernel", EXAMPLE, "--examples", "4", *CHEAP,
                             "--gpus", "2", "-q")
    assert code == 0 and "OK: kernel numpy-example: 4 examples over 2 workers" in out
    assert err == ""


# ------------------------------------------------------------------ usage errors

@pytest.mark.parametrize("argv, env, words", [
    (["--gpus", "0"], "5,7", "--gpus: expected at least 1 GPU, got 0"),
    (["--gpus", "two"], "5,7", "--gpus: expected a whole number of GPUs"),
    (["--gpus", "3"], "5,7", "--gpus 3: 2 device(s) visible (CUDA_VISIBLE_DEVICES)"),
    (["--gpus", "2"], "", "--gpus 2: 0 device(s) visible (CUDA_VISIBLE_DEVICES)"),
    (["--gpus", "2"], "4", "--gpus 2: 1 device(s) visible"),
    (["--gpus", "2", "--examples", "1"], "5,7", "--examples 1: fewer than --gpus 2"),
])
def test_usage_errors_name_the_option(capsys, monkeypatch, argv, env, words):
    monkeypatch.delenv(S.FAKE_GPUS_ENV, raising=False)
    monkeypatch.setenv(S.CUDA_VAR, env)
    code, out, err = run_cli(capsys, "fuzz", "--kernel", EXAMPLE, *argv)
    assert code == 2, out + err
    assert words in err and "[worker" not in err


def test_a_gpu_kernel_is_checked_on_each_workers_own_device(capsys, two_devices):
    kernel = get_kernel("hipkernel")
    if kernel_available(kernel)[0]:
        pytest.skip("a GPU backend works here: the kernel is available on every worker")
    code, out, err = run_cli(capsys, "fuzz", "--kernel", "hipkernel", "--examples", "4",
                             "--gpus", "2", "-q")
    assert code == 2, out + err
    assert "kernel: 'hipkernel' is not available on worker " in err
    assert "(CUDA_VISIBLE_DEVICES=5)" in err or "(CUDA_VISIBLE_DEVICES=7)" in err


def test_a_worker_that_dies_is_reported_with_its_status(capsys, two_devices):
    code, out, err = run_cli(capsys, "fuzz", "--kernel", CRASH, "--examples", "4", *CHEAP,
                             "--gpus", "2", "-q")
    assert code == 2, out + err
    assert "exited with status 3 and no result" in err and "OK:" not in out
