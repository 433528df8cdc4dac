"""The ``refattn`` command line: listing, running, JSON output and exit codes."""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from refattn import cli

ROOT = Path(__file__).resolve().parent.parent

TINY = """
[defaults]
Hq = 4
Hkv = 2
d = 16
sq = 24
past_len = 40

[[case]]
name = "tiny-sink"
sink = "per_head"
why = "a sink on a tiny shape"

[[case]]
name = "tiny-plain-w5"
window = 5
why = "a window on a tiny shape"
"""


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cases_json_lists_the_shipped_suites(capsys, monkeypatch):
    monkeypatch.delenv("REFATTN_CASES_DIR", raising=False)
    code, out, _ = run_cli(capsys, "cases", "--json")
    assert code == 0
    doc = json.loads(out)
    assert {"seed", "extended", "contracts"} <= set(doc["suites"])
    seed = [c for c in doc["cases"] if c["suite"] == "seed"]
    assert len(seed) == 23 and all(c["why"] for c in seed)
    code, out, _ = run_cli(capsys, "cases", "--suite", "seed")
    assert code == 0 and "gptoss-sink-past8192-w128" in out and "23 cases" in out
    code, out, _ = run_cli(capsys, "cases", "--suite", "seed", "contracts", "--json")
    assert code == 0 and set(json.loads(out)["suites"]) == {"seed", "contracts"}


def test_run_reference_on_one_case_json_to_stdout(capsys, monkeypatch):
    monkeypatch.delenv("REFATTN_CASES_DIR", raising=False)
    code, out, err = run_cli(capsys, "run", "--kernel", "reference", "--suite", "extended",
                             "-k", "ext-nosink-sq3-past37", "--json", "-")
    assert code == 0, err
    doc = json.loads(out)  # stdout holds only the JSON; the table went to stderr
    assert doc["schema"] == 1 and doc["kernel"] == "reference" and doc["ok"] is True
    assert doc["suites"] == ["extended"] and doc["elapsed_s"] >= 0 and doc["host"]["numpy"]
    (r,) = doc["results"]
    assert r["case"] == "ext-nosink-sq3-past37" and r["outcome"] == "pass"
    assert isinstance(r["rel_l2"], float) and isinstance(r["max_abs"], float) and isinstance(r["gate"], float)
    assert "ext-nosink-sq3-past37" in err and "OK: kernel reference" in err


def test_run_table_report_dir_and_plain_progress(capsys, suite_dir, tmp_path):
    suite_dir("tiny", TINY)
    code, out, err = run_cli(capsys, "run", "--kernel", "tests.helpers_kernels:CorrectKernel",
                             "--suite", "tiny", "--report", str(tmp_path / "rep"))
    assert code == 0, err
    assert "tiny-sink" in out and "tiny-plain-w5" in out and "pass" in out and "@ (0," in out
    assert "[1/2] pass" in err and "[2/2] pass" in err  # stderr is not a TTY here
    doc = json.loads((tmp_path / "rep" / "run-correct.json").read_text())
    assert doc["ok"] and len(doc["results"]) == 2


def test_failing_kernel_exits_1_with_the_failure_message(capsys, suite_dir, tmp_path):
    suite_dir("tiny", TINY)
    code, out, err = run_cli(capsys, "run", "--kernel", "tests.helpers_kernels:WrongSinkKernel",
                             "--suite", "tiny", "--json", str(tmp_path / "r.json"), "-q")
    assert code == 1
    assert "FAILED" in out and "Mismatched elements" in out and "tiny/tiny-sink" in out
    assert err == ""  # -q: no progress lines
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["ok"] is False
    assert [r["outcome"] for r in doc["results"]] == ["fail", "pass"]


def test_contract_violation_exits_1(capsys, suite_dir):
    suite_dir("tiny", TINY)
    code, out, _ = run_cli(capsys, "run", "--kernel", "tests.helpers_kernels:TouchyDecliner",
                           "--suite", "tiny", "-k", "tiny-sink", "-q")
    assert code == 1 and "contract-violation" in out and "touched the output buffer" in out


@pytest.mark.parametrize("argv, words", [
    (["run", "--kernel", "nope"], ["kernel: unknown kernel 'nope'", "reference"]),
    (["run", "--kernel", "tests.helpers_kernels:UnavailableKernel"],
     ["not available here", "no device in this test"]),
    (["run", "--kernel", "reference", "--suite", "nosuch"], ["unknown suite 'nosuch'"]),
    (["run", "--kernel", "reference", "-k", "no-such-case"], ["-k: no case name contains 'no-such-case'"]),
    (["run", "--frobnicate"], ["unrecognized arguments: --frobnicate"]),
    (["frobnicate"], ["invalid choice: 'frobnicate'"]),
    ([], ["the following arguments are required: command"]),
])
def test_usage_errors_exit_2_with_a_message(capsys, argv, words, monkeypatch):
    monkeypatch.delenv("REFATTN_CASES_DIR", raising=False)
    code, _, err = run_cli(capsys, *argv)
    assert code == 2
    for w in words:
        assert w in err, err
    assert "Traceback" not in err


def test_bad_case_file_exits_2_naming_file_case_and_key(capsys, suite_dir):
    p = suite_dir("tiny", TINY.replace("window = 5", "window = 0"))
    code, _, err = run_cli(capsys, "run", "--kernel", "reference", "--suite", "tiny")
    assert code == 2
    assert f"{p}: case 'tiny-plain-w5': window: expected -1 (no window) or W >= 1 keys, got 0" in err
    code, _, err = run_cli(capsys, "cases")
    assert code == 2 and "tiny-plain-w5" in err


def test_missing_plugin_subcommand_says_not_available(capsys, monkeypatch):
    monkeypatch.setitem(cli.SUBCOMMANDS, "bench", cli.Subcommand("b", module="refattn._no_such_bench"))
    code, _, err = run_cli(capsys, "bench", "--anything")
    assert code == 2 and "refattn bench: not available: cannot import refattn._no_such_bench" in err


def test_plugin_subcommand_is_imported_lazily_and_run(capsys, monkeypatch):
    mod = types.ModuleType("fake_report_plugin")
    mod.add_arguments = lambda p: p.add_argument("--out", required=True)
    mod.run = lambda args: print(f"wrote {args.out}") or 0
    monkeypatch.setitem(sys.modules, "fake_report_plugin", mod)
    monkeypatch.setitem(cli.SUBCOMMANDS, "report", cli.Subcommand("r", module="fake_report_plugin"))
    monkeypatch.setitem(cli.SUBCOMMANDS, "bench", cli.Subcommand("b", module="refattn._no_such_bench"))
    assert run_cli(capsys, "report", "--out", "x")[:2] == (0, "wrote x\n")  # bench never imported
    code, _, err = run_cli(capsys, "report")
    assert code == 2 and "--out" in err


def test_help_and_version(capsys):
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0 and "examples:" in out and "mutants" in out and "bench" in out
    code, out, _ = run_cli(capsys, "run", "--help")
    assert code == 0 and "--kernel" in out and "exit status" in out
    code, out, _ = run_cli(capsys, "--version")
    assert code == 0 and out.startswith("refattn ")


def test_kernels_lists_the_registry(capsys):
    code, out, _ = run_cli(capsys, "kernels", "--json")
    doc = json.loads(out)
    names = {k["name"]: k for k in doc["kernels"]}
    assert code == 0 and names["reference"]["available"] and doc["best"] in ("model", "hipkernel")


def test_python_dash_m_exit_codes(suite_dir):
    suite_dir("tiny", TINY)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ok = subprocess.run([sys.executable, "-m", "refattn", "run", "--kernel", "reference",
                         "--suite", "tiny", "--json", "-", "-q"],
                        cwd=ROOT, env=env, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["ok"] is True
    bad = subprocess.run([sys.executable, "-m", "refattn", "run", "--kernel", "nope"],
                         cwd=ROOT, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown kernel 'nope'" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # no_nan_guard's NaN
def test_mutants_in_processes_give_the_same_kill_matrix(tmp_path):
    """``refattn mutants --jobs 2`` (the clean kernel and each mutant in one of two spawned
    processes) writes the same JSON as one process."""
    docs = []
    for jobs in ("1", "2"):
        path = tmp_path / f"km{jobs}.json"
        code = cli.main(["mutants", "--suite", "seed", "-k", "gptoss-sink-past0", "-k",
                         "gptoss-nosink-past0-w128", "--jobs", jobs, "--json", str(path), "-q"])
        assert code == 1  # on two cases some mutants survive: the matrix is not ok
        docs.append(json.loads(path.read_text()))
    assert docs[0] == docs[1]
    killed = {m["name"] for m in docs[0]["mutants"] if m["killed"]}
    assert docs[0]["clean_ok"] and {"sink_ignored", "window_mask_off_by_one"} <= killed


def test_a_forced_config_runs_every_case_on_it(capsys, monkeypatch):
    """``--kernel model@CONFIG``: every case on that config (its pack cut to the case's G),
    the name in the JSON; the same in the kill matrix, in one process and in two."""
    from hipkernel import model
    from hipkernel.config import KernelConfig

    seen = []
    real = model.attention
    monkeypatch.setattr(model, "attention", lambda *a, config, **kw: (seen.append(config), real(*a, config=config, **kw))[1])
    code, out, err = run_cli(capsys, "run", "--kernel", "model@mma_m4_b32_p8", "--suite", "seed",
                             "-k", "gptoss-sink-past0", "-k", "gptoss-nosink-past512-w128", "--json", "-")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["kernel"] == "model@mma_m4_b32_p8" and [r["outcome"] for r in doc["results"]] == ["pass"] * 2
    assert seen and set(seen) == {KernelConfig(4, 32, "mma", pack=8)}  # G = 8 on both; the case's own tiles ignored
    monkeypatch.setattr(model, "attention", real)
    for jobs in ("1", "2"):
        code, out, err = run_cli(capsys, "mutants", "--kernel", "model@wmma_m4_b64", "--suite", "seed",
                                 "-k", "gptoss-nosink-past512-w128", "--mutant", "window_mask_off_by_one",
                                 "--jobs", jobs, "--json", "-", "-q")
        assert code == 0, err
        doc = json.loads(out)
        assert doc["kernel"] == "model@wmma_m4_b64" and doc["ok"] and doc["mutants"][0]["killed"]
