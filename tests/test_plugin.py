"""refattn's pytest plugin (refattn/pytest_plugin.py, refattn/matrix_tests.py) and the packaging
that lets another repository use it: ``pytest --refattn-kernel SPEC`` in a directory that is
not this tree, the ids, the verdicts, the skips and marks, inertness without the option, and
this repository's own matrix running the same test with the same ids.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from refattn import cases as C
from refattn import pytest_plugin as P
from refattn.cases import load_suites
from refattn.runner import run_case
from refattn.sharding import MATRIX_NODEID, MATRIX_TESTS
from tests import helpers_kernels as H

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = ["-p", "refattn.pytest_plugin", "-p", "no:cacheprovider"]
CORRECT = "tests.helpers_kernels:CorrectKernel"
CONTRACTS = [c.name for c in load_suites(["contracts"])]

OFFLINE = '''
class Offline:
    name = "offline"
    requires_gpu = True

    def available(self):
        return False, "needs the frobnicator"

    def supports(self, case):
        return True

    def run(self, x):
        raise AssertionError("an unavailable kernel must not run")
'''


@pytest.fixture
def clean(monkeypatch):
    """No matrix-related environment from the calling run."""
    for var in ("REFATTN_CASES_DIR", "REFATTN_RESULTS_DIR", "PYTEST_ADDOPTS"):
        monkeypatch.delenv(var, raising=False)


def _ids(result) -> list[str]:
    return [line.strip() for line in result.outlines if "::test_case[" in line]


# ------------------------------------------------------------------ in a foreign directory

def test_one_test_per_kernel_and_case_with_kernel_case_ids(pytester, clean):
    r = pytester.runpytest(*PLUGIN, "--refattn-kernel", CORRECT, "--refattn-suite", "contracts",
                           "--collect-only", "-q")
    assert r.ret == 0, r.stdout.str()
    assert _ids(r) == [f"{MATRIX_NODEID}::test_case[{CORRECT}-{n}]" for n in CONTRACTS]
    # two kernels: every (kernel, case) pair, in kernel order
    r = pytester.runpytest(*PLUGIN, "--refattn-kernel", CORRECT, "--refattn-kernel", "reference",
                           "--refattn-suite", "contracts", "--collect-only", "-q")
    assert [i.split("[", 1)[1][:-1] for i in _ids(r)] == [
        f"{k}-{n}" for k in (CORRECT, "reference") for n in CONTRACTS]


def test_correct_kernel_passes_and_k_narrows(pytester, clean):
    r = pytester.runpytest(*PLUGIN, "--refattn-kernel", CORRECT, "--refattn-suite", "contracts")
    r.assert_outcomes(passed=len(CONTRACTS))
    r = pytester.runpytest(*PLUGIN, "--refattn-kernel", CORRECT, "--refattn-suite", "contracts",
                           "--refattn-suite", "extended", "-k", "contract-d80 or ext-sink-sq1-past0")
    r.assert_outcomes(passed=2)


def test_wrong_kernel_fails_with_the_cases_message(pytester, clean):
    case = next(c for c in load_suites(["extended"]) if c.name == "ext-sink-sq1-past0")
    want = run_case(H.WrongSinkKernel(), case)
    assert want.outcome == "fail"
    r = pytester.runpytest(*PLUGIN, "--refattn-kernel", "tests.helpers_kernels:WrongSinkKernel",
                           "--refattn-suite", "extended", "-k", "ext-sink-sq1-past0")
    r.assert_outcomes(failed=1)
    out = r.stdout.str()
    for line in want.failure_message().splitlines():
        assert line in out, line
    assert "Max absolute difference" in out
    assert "def test_case" not in out and "run_case(" not in out  # pytrace=False: no traceback


def test_unavailable_kernel_is_skipped_with_its_reason_and_gpu_marked(pytester, clean):
    pytester.makepyfile(offline_kernel_a=OFFLINE)
    pytester.syspathinsert()
    spec = "offline_kernel_a:Offline"
    r = pytester.runpytest(*PLUGIN, "--refattn-kernel", spec, "--refattn-suite", "contracts", "-rs")
    r.assert_outcomes(skipped=len(CONTRACTS))
    r.stdout.fnmatch_lines([f"SKIPPED [[]{len(CONTRACTS)}[]] *{spec} is not available here: "
                            f"needs the frobnicator"])
    # requires_gpu: every case carries the gpu marker
    r = pytester.runpytest(*PLUGIN, "--refattn-kernel", spec, "--refattn-suite", "contracts",
                           "-m", "not gpu")
    r.assert_outcomes(deselected=len(CONTRACTS))


def test_a_kernel_named_by_file_path(pytester, clean):
    path = pytester.makepyfile(offline_kernel_b=OFFLINE)
    r = pytester.runpytest(*PLUGIN, "--refattn-kernel", f"{path}:Offline", "--refattn-suite",
                           "contracts", "-k", "contract-d80")
    r.assert_outcomes(skipped=1)


def test_inert_without_the_option(pytester, clean):
    pytester.makepyfile(test_mine="""
        import os

        def test_mine(request):
            assert "gpu" not in request.config.getini("markers")
            assert not any(m.startswith("xdist_group(name): keep these tests on one pytest-xdist "
                                        "worker under --dist loadgroup (one autotune")
                           for m in request.config.getini("markers"))
    """)
    r = pytester.runpytest(*PLUGIN, "-v")
    r.assert_outcomes(passed=1)
    assert "matrix_tests" not in r.stdout.str() and "refattn:" not in r.stdout.str()
    empty = pytester.mkdir("empty")
    r = pytester.runpytest(*PLUGIN, str(empty))
    assert r.ret == pytest.ExitCode.NO_TESTS_COLLECTED


def test_inert_under_xdist_pins_nothing(pytester, clean):
    """``pytest -n 2`` in a repository that does not use the matrix: no header line, no
    device pin, no thread cap on the workers, even with (simulated) GPUs visible."""
    pytest.importorskip("xdist")
    pytester.makepyfile(test_env="""
        import os

        def test_env():
            assert os.environ.get("PYTEST_XDIST_WORKER")
            assert os.environ.get("CUDA_VISIBLE_DEVICES") == "4,5"
            assert "HIPKERNEL_DEVICE" not in os.environ and "REFATTN_THREADS" not in os.environ
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "REFATTN_"))
           and k not in ("HIPKERNEL_DEVICE", "HIP_VISIBLE_DEVICES")}
    env.update(CUDA_VISIBLE_DEVICES="4,5", PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "pytest", *PLUGIN, "-n", "2", "-p", "no:benchmark",
                        "-p", "no:hypothesispytest"], cwd=pytester.path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "1 passed" in p.stdout and "refattn:" not in p.stdout


def test_misuse_is_a_usage_error_naming_the_option(pytester, clean):
    r = pytester.runpytest(*PLUGIN, "--refattn-suite", "seed")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["ERROR: --refattn-suite: needs --refattn-kernel SPEC*"])
    r = pytester.runpytest(*PLUGIN, "--refattn-kernel", "nope")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["ERROR: --refattn-kernel: kernel: unknown kernel 'nope'; known: *"])
    r = pytester.runpytest(*PLUGIN, "--refattn-kernel", "no_such_module_x:K")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["ERROR: --refattn-kernel: kernel 'no_such_module_x:K': cannot import*"])
    r = pytester.runpytest(*PLUGIN, "--refattn-kernel", "reference", "--refattn-suite", "nosuch")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines([f"ERROR: --refattn-suite: *unknown suite 'nosuch' "
                            f"(known in {C.cases_dir()}: {', '.join(C.list_suites())})"])


def test_results_rows_are_written_for_results_and_skips(pytester, clean, monkeypatch, tmp_path):
    rows_dir = tmp_path / "rows"
    rows_dir.mkdir()
    monkeypatch.setenv("REFATTN_RESULTS_DIR", str(rows_dir))
    pytester.makepyfile(offline_kernel_c=OFFLINE)
    pytester.syspathinsert()
    r = pytester.runpytest(*PLUGIN, "--refattn-kernel", CORRECT, "--refattn-kernel",
                           "offline_kernel_c:Offline", "--refattn-suite", "contracts",
                           "-k", "contract-d80 or contract-bf16")
    r.assert_outcomes(passed=2, skipped=2)
    rows = [json.loads(line) for f in rows_dir.glob("*.jsonl") for line in f.read_text().splitlines()]
    got = sorted((row["kind"], row["kernel_spec"], row["case_id"].split("/")[-1]) for row in rows)
    assert got == sorted([("result", CORRECT, "contract-d80"), ("result", CORRECT, "contract-bf16"),
                          ("skipped", "offline_kernel_c:Offline", "contract-d80"),
                          ("skipped", "offline_kernel_c:Offline", "contract-bf16")])
    by = {(row["kind"], row["case_id"].split("/")[-1]): row for row in rows}
    assert by[("result", "contract-bf16")]["result"]["outcome"] == "declined"
    assert by[("result", "contract-d80")]["kernel"] == "correct"
    assert "needs the frobnicator" in by[("skipped", "contract-d80")]["reason"]
    assert by[("result", "contract-d80")]["nodeid"].startswith(f"{MATRIX_NODEID}::test_case[")


# ------------------------------------------------------------------ shared parametrisation

def test_matrix_params_marks_gpu_slow_and_the_autotune_group():
    from refattn.sharding import group_key

    cpu = P.matrix_params(P.Matrix(("reference",), ("seed",)))
    seed = load_suites(["seed"])
    assert [p.id for p in cpu] == [f"reference-{c.name}" for c in seed]
    slow = {p.id for p in cpu if any(m.name == "slow" for m in p.marks)}
    assert slow == {f"reference-{c.name}" for c in seed if c.flops > P.SLOW_FLOPS} != set()
    assert all(m.name != "gpu" for p in cpu for m in p.marks)
    for p, c in zip(cpu, seed):
        (group,) = [m for m in p.marks if m.name == "xdist_group"]
        assert group.kwargs == {"name": group_key(c)}
    gpu = P.matrix_params(P.Matrix(("hipkernel",), ("contracts",)))
    assert all({m.name for m in p.marks} == {"gpu", "xdist_group"} for p in gpu)
    with pytest.raises(pytest.UsageError, match=r"^--kernel: kernel: unknown kernel 'nope'"):
        P.matrix_params(P.Matrix(("nope",), ("seed",), kernel_option="--kernel"))
    with pytest.raises(pytest.UsageError, match=r"^--suite: .*unknown suite 'nosuch'"):
        P.matrix_params(P.Matrix(("reference",), ("nosuch",), suite_option="--suite"))
    # default (not named) kernels that cannot import are left to skip, named ones are refused
    P.matrix_params(P.Matrix(lambda: ["no_such_module_y:K"], ("contracts",)))
    with pytest.raises(pytest.UsageError, match=r"cannot import no_such_module_y:K"):
        P.matrix_params(P.Matrix(("no_such_module_y:K",), ("contracts",)))


def test_this_repos_matrix_is_the_plugins_test_with_the_same_ids(clean):
    """tests/test_matrix.py (--kernel/--suite) and the shipped module (--refattn-kernel) in one
    collection: the same test function, the same ids."""
    from tests import test_matrix
    from refattn import matrix_tests

    assert test_matrix.test_case is matrix_tests.test_case
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "REFATTN_"))}
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                        "no:cacheprovider", "tests/test_matrix.py", "--kernel", "model", "--suite",
                        "contracts", "--refattn-kernel", "model", "--refattn-suite", "contracts"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    ids = [line for line in p.stdout.splitlines() if "::test_case[" in line]
    repo = [i.split("::", 1)[1] for i in ids if i.startswith("tests/test_matrix.py::")]
    shipped = [i.split("::", 1)[1] for i in ids if i.startswith(f"{MATRIX_NODEID}::")]
    assert repo == shipped == [f"test_case[model-{n}]" for n in CONTRACTS]


# ------------------------------------------------------------------ packaging

def _pyproject() -> dict:
    try:
        import tomllib
    except ImportError:  # python 3.10
        import tomli as tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_pyproject_ships_every_package_the_suites_and_the_plugin():
    doc = _pyproject()
    st = doc["tool"]["setuptools"]
    listed = set(st["packages"])
    tree = {".".join(d.relative_to(ROOT).parts) for top in ("refattn", "hipkernel")
            for d in [ROOT / top, *(ROOT / top).rglob("*")] if d.is_dir()
            and d.name != "__pycache__" and any(f.is_file() for f in d.iterdir())}
    assert tree | {"refattn.suites"} == listed
    assert st["package-dir"] == {"refattn.suites": "cases"}
    assert st["package-data"]["refattn.suites"] == ["*.toml"]
    assert sorted(p.stem for p in (ROOT / "cases").glob("*.toml")) == C.list_suites(ROOT / "cases")
    # the entry point's name is the module's, so -p and the entry point are one plugin
    assert doc["project"]["entry-points"]["pytest11"] == {P.PLUGIN_NAME: P.PLUGIN_NAME}
    assert P.PLUGIN_NAME == P.__name__
    assert MATRIX_TESTS == Path(P.__file__).resolve().with_name("matrix_tests.py")
    assert MATRIX_TESTS.is_file()


def test_cases_dir_env_then_source_tree_then_package_data(monkeypatch, tmp_path):
    monkeypatch.delenv("REFATTN_CASES_DIR", raising=False)
    assert C.cases_dir() == ROOT / "cases"  # this source tree
    monkeypatch.setenv("REFATTN_CASES_DIR", str(tmp_path))
    assert C.cases_dir() == tmp_path
    monkeypatch.delenv("REFATTN_CASES_DIR")
    # not a source tree (no pyproject.toml beside the package): the installed package data
    monkeypatch.setattr(C, "SOURCE_CASES", tmp_path / "no-tree" / "cases")
    packaged = Path(C.__file__).resolve().parent / "suites"
    assert C.cases_dir() == packaged
    with pytest.raises(C.CaseError, match=rf"unknown suite 'seed' \(known in {packaged}: none\)"):
        C.suite_path("seed")
