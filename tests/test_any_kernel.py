"""Every check on a kernel that is not this project's: the example NumPy adapter and its
broken copies (tests/adapters), plugged in by import path as a user's kernel would be."""

import json
import tomllib

import pytest

from refattn import cli
from refattn import kernels as K
from refattn.cases import Case, CaseError, case_from_text, case_to_inline, case_to_toml, make_inputs
from refattn.fuzz import case_strategy, fit_cost, reference_cost, supported_axes

EXAMPLE = "examples/numpy_kernel.py:NumpyKernel"
PLUS_ONE = "tests.adapters.numpy_window:WindowPlusOne"
NONDET = "tests.adapters.numpy_window:NondeterministicKernel"


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------ inline cases

def test_an_inline_case_round_trips_through_toml_and_the_command_line():
    c = Case(name="x", Hq=8, Hkv=2, d=64, sq=3, past_len=5, window=2, sink="per_head", scale=0.5,
             spare=0, why="a case")
    back = case_from_text(case_to_inline(c))
    assert back == Case(**{**c.to_dict(), "name": "inline", "suite": "inline", "why": "given on the command line"})
    table = tomllib.loads(case_to_toml(c))["case"][0]
    assert table == {"name": "x", "Hq": 8, "Hkv": 2, "d": 64, "sq": 3, "past_len": 5, "window": 2,
                     "sink": "per_head", "scale": 0.5, "spare": 0, "why": "a case"}


@pytest.mark.parametrize("text, words", [
    ("", "expected KEY = VALUE"),
    ("Hq = 8, Hkv = 2, d = 64, sq = 3, sink = per_head", "strings need quotes"),
    ("Hq = 8, Hkv = 2, d = 64, sqq = 3", "did you mean 'sq'"),
    ("Hq = 8, Hkv = 3, d = 64, sq = 3", "not a multiple"),
    ("Hq = 8, Hkv = 2, d = 64, sq = 3, spare = -1", "spare"),
])
def test_a_bad_inline_case_names_the_key(text, words):
    with pytest.raises(CaseError, match=words):
        case_from_text(text)


def test_spare_zero_is_a_tight_cache():
    c = case_from_text("Hq = 2, Hkv = 1, d = 8, sq = 3, past_len = 2, spare = 0")
    assert make_inputs(c).k.shape == (1, 1, 5, 8)
    assert make_inputs(case_from_text("Hq = 2, Hkv = 1, d = 8, sq = 3, spare = 7")).k.shape[2] == 10


def test_run_takes_an_inline_case(capsys):
    code, out, err = run_cli(capsys, "run", "--kernel", EXAMPLE, "--case",
                             "Hq = 4, Hkv = 2, d = 16, sq = 5, past_len = 3, window = 2, sink = \"smooth\"")
    assert code == 0, out + err
    assert "1 cases: 1 pass" in out and "kernel numpy-example (examples/numpy_kernel.py:NumpyKernel, named by --kernel)" in err
    code, out, err = run_cli(capsys, "run", "--kernel", PLUS_ONE, "--case",
                             "Hq = 1, Hkv = 1, d = 64, sq = 2, window = 1")
    assert code == 1 and "1 fail" in out
    code, _, err = run_cli(capsys, "run", "--kernel", EXAMPLE, "--case", "Hq = 4, d = 16, sq = 5")
    assert code == 2 and "--case" in err and "Hkv" in err


# ------------------------------------------------------------------ the protocol's readers

class _Declares:
    mutants = frozenset({"no_nan_guard"})

    def source_hash(self):
        return "abc"

    def variants(self, case):
        return ["p1", "p2", "p1"]


def test_the_optional_members_are_read_and_checked():
    assert K.declared_mutants(_Declares) == {"no_nan_guard"}
    assert K.declared_mutants(object) == frozenset()
    assert K.kernel_source_hash(_Declares()) == "abc" and K.kernel_source_hash(object()) is None
    assert K.kernel_variants(_Declares(), None) == ["p1", "p2"] and K.kernel_variants(object(), None) == []

    class Bad:
        mutants = {"not_a_mutant"}

        def source_hash(self):
            return ""

        def variants(self, case):
            return ["a@b"]

    with pytest.raises(K.KernelError, match="not_a_mutant"):
        K.declared_mutants(Bad)
    with pytest.raises(K.KernelError, match="non-empty string"):
        K.kernel_source_hash(Bad())
    with pytest.raises(K.KernelError, match="without '@'"):
        K.kernel_variants(Bad(), None)


def test_a_kernel_by_file_path_and_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "mykernels.py").write_text("from refattn.kernels import ReferenceKernel as K\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", str(tmp_path))])
    assert K.get_kernel("mykernels:K").name == "reference"
    assert K.get_kernel(str(tmp_path / "mykernels.py") + ":K").name == "reference"
    with pytest.raises(K.KernelError, match="no file"):
        K.get_kernel(str(tmp_path / "nope.py") + ":K")


def test_the_fused_kernels_declare_the_catalogue_variants_and_hash():
    from refattn.mutants import MUTANTS

    model = K.get_kernel("model")
    assert K.declared_mutants(type(model)) == {m.name for m in MUTANTS}
    case = case_from_text("Hq = 8, Hkv = 2, d = 64, sq = 16, window = 8")
    names = K.kernel_variants(model, case)
    assert "m4_b64" in names and any(n.startswith("mma_") for n in names)
    assert K.get_kernel(f"model@{names[-1]}").name == f"model@{names[-1]}"
    assert len(K.kernel_source_hash(model)) == 64
    assert K.kernel_variants(model, case_from_text("Hq = 8, Hkv = 2, d = 64, sq = 16, softcap = 5.0")) == []


# ------------------------------------------------------------------ mutants

def test_mutants_refuses_a_kernel_that_implements_none(capsys):
    code, out, err = run_cli(capsys, "mutants", "--kernel", PLUS_ONE)
    assert code == 2 and "declares no mutants" in err and err.count("\n") == 1


def test_mutants_refuses_a_mutant_the_kernel_does_not_implement(capsys, monkeypatch):
    monkeypatch.setattr("tests.adapters.numpy_window.WindowPlusOne.mutants", frozenset({"no_nan_guard"}),
                        raising=False)
    code, _, err = run_cli(capsys, "mutants", "--kernel", PLUS_ONE, "--mutant", "gqa_modulo")
    assert code == 2 and "does not implement gqa_modulo" in err


# ------------------------------------------------------------------ fuzz

def test_the_fuzz_draws_only_what_the_kernel_supports():
    from hypothesis import given, settings

    axes = supported_axes(K.get_kernel(EXAMPLE))
    assert axes["softcap"] == (0.0,) and 64 in axes["d"] and axes["sink"] == ("none", "per_head", "smooth")
    seen = []

    @settings(max_examples=60, deadline=None, database=None)
    @given(case_strategy(axes, max_cost=2**16))
    def draw(c):
        assert reference_cost(c) <= 2**16 and c.softcap == 0 and c.Hq % c.Hkv == 0
        seen.append(c)

    draw()
    assert len({c.G for c in seen}) > 3 and any(c.window > 0 for c in seen)


def test_fit_cost_cuts_a_case_down_to_the_limit():
    c = Case(name="x", Hq=64, Hkv=8, d=64, sq=300, past_len=3000, why="y")
    small = fit_cost(c, 2**16)
    assert reference_cost(small) <= 2**16 < reference_cost(c)
    # past_len halved to 46 first, then sq to 9; the heads were not needed
    assert (small.past_len, small.sq, small.Hq, small.Hkv) == (46, 9, 64, 8)
    tight = fit_cost(c, 2**12)  # then the KV heads go (G kept), then the query heads
    assert reference_cost(tight) <= 2**12 and tight.Hkv == 1


def test_fuzz_passes_a_correct_adapter(capsys, tmp_path):
    code, out, err = run_cli(capsys, "fuzz", "--kernel", EXAMPLE, "--examples", "40", "--json",
                             str(tmp_path / "f.json"))
    assert code == 0, out + err
    doc = json.loads((tmp_path / "f.json").read_text())
    assert doc["ok"] and doc["examples"] == 40 and doc["minimal"] is None and doc["kind"] == "fuzz"


def test_fuzz_catches_a_window_off_by_one_and_shrinks_it(capsys, tmp_path):
    """W + 1 keys visible: found, shrunk to a small case, printed as a case table and a
    command that reproduces it."""
    code, out, err = run_cli(capsys, "fuzz", "--kernel", PLUS_ONE, "--examples", "100", "--json",
                             str(tmp_path / "f.json"))
    assert code == 1, out + err
    doc = json.loads((tmp_path / "f.json").read_text())
    m = doc["minimal"]
    case = Case(suite="x", **{k: v for k, v in m["case"].items() if k != "suite"})
    assert case.sq <= 64 and case.skv <= 256 and case.window >= 1
    assert m["result"]["outcome"] == "fail"
    assert "[[case]]" in out and m["command"] in out
    assert tomllib.loads(m["toml"])["case"][0]["window"] == case.window
    # the printed command reproduces it
    argv = m["command"].split(" ", 1)[1]
    inline = argv.split("--case '", 1)[1].rstrip("'")
    code, out, _ = run_cli(capsys, "run", "--kernel", PLUS_ONE, "--case", inline)
    assert code == 1 and "1 fail" in out
    code, _, _ = run_cli(capsys, "run", "--kernel", EXAMPLE, "--case", inline)
    assert code == 0


def test_fuzz_is_reproducible_by_seed():
    from refattn.fuzz import fuzz

    k = K.get_kernel(PLUS_ONE)
    a, b = fuzz(k, examples=30, seed=7), fuzz(k, examples=30, seed=7)
    assert a.minimal == b.minimal and a.examples == b.examples


def test_fuzz_usage_errors(capsys):
    assert run_cli(capsys, "fuzz")[0] == 2
    code, _, err = run_cli(capsys, "fuzz", "--kernel", EXAMPLE, "--examples", "0")
    assert code == 2 and "--examples" in err
    code, _, err = run_cli(capsys, "fuzz", "--kernel", EXAMPLE, "--max-seconds", "nan")
    assert code == 2 and "--max-seconds" in err


# ------------------------------------------------------------------ determinism

def test_determinism_passes_a_deterministic_adapter_and_catches_one_that_is_not(capsys, tmp_path):
    code, out, err = run_cli(capsys, "determinism", "--kernel", EXAMPLE, "--suite", "contracts",
                             "--json", str(tmp_path / "d.json"))
    assert code == 0, out + err
    doc = json.loads((tmp_path / "d.json").read_text())
    assert doc["ok"] and doc["counts"] == {"identical": 5, "declined": 1}
    code, out, _ = run_cli(capsys, "determinism", "--kernel", NONDET, "--suite", "contracts", "-q")
    assert code == 1 and "differs" in out


def test_determinism_checks_every_variant_of_an_adapter_that_names_them(capsys):
    code, out, err = run_cli(capsys, "determinism", "--kernel", "model", "--suite", "extended",
                             "-k", "ext-nosink-sq3-past37", "--runs", "2")
    assert code == 0, out + err
    n = len(K.kernel_variants(K.get_kernel("model"), __import__("refattn.cases", fromlist=["x"])
                              .load_suites(["extended"])[0]))
    assert "pairs x 2 runs" in out and n > 5
    lines = [line for line in err.splitlines() if line.startswith("[")]
    assert any("@mma_" in line for line in lines) and any("@m4_b64" in line for line in lines)


def test_determinism_usage_errors(capsys):
    code, _, err = run_cli(capsys, "determinism", "--kernel", EXAMPLE, "--runs", "1")
    assert code == 2 and "--runs" in err


# ------------------------------------------------------------------ report

def test_run_fuzz_determinism_and_report_of_a_third_party_kernel(capsys, tmp_path, monkeypatch):
    """The whole path for a kernel outside the package: each file is labelled with the kernel
    it ran and its own stamp; a failing fuzz run fails the check."""
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    d = tmp_path / "r"
    assert run_cli(capsys, "run", "--kernel", EXAMPLE, "--suite", "contracts", "--report", str(d), "-q")[0] == 0
    assert run_cli(capsys, "fuzz", "--kernel", EXAMPLE, "--examples", "20", "-q",
                   "--json", str(d / "fuzz-numpy.json"))[0] == 0
    assert run_cli(capsys, "determinism", "--kernel", EXAMPLE, "--suite", "contracts", "-q",
                   "--json", str(d / "determinism-numpy.json"))[0] == 0
    run = json.loads((d / "run-numpy-example.json").read_text())
    assert run["kernel_spec"] == EXAMPLE and run["kernel_source_hash"] is None
    report = ["report", "--in", str(d), "--out", str(d / "out"), "--baseline", str(d / "baseline.json")]
    code, out, err = run_cli(capsys, *report, "--update-baseline")
    assert code == 0, out + err
    code, out, err = run_cli(capsys, *report, "--check")
    assert code == 0, out + err
    doc = json.loads((d / "out" / "latest.json").read_text())
    assert {r["kernel"] for r in doc["cases"]} == {"numpy-example"}
    assert [(c["kind"], c["kernel"], c["ok"]) for c in doc["checks"]] == [
        ("fuzz", "numpy-example", True), ("determinism", "numpy-example", True)]
    assert [s["kernel_spec"] for s in doc["sources"]] == [EXAMPLE]
    md = (d / "out" / "latest.md").read_text()
    assert "## Fuzz and determinism" in md and "| `run-numpy-example.json` | numpy-example |" in md

    assert run_cli(capsys, "fuzz", "--kernel", PLUS_ONE, "--examples", "60", "-q",
                   "--json", str(d / "fuzz-plus-one.json"))[0] == 1
    code, out, _ = run_cli(capsys, *report, "--check")
    assert code == 1 and "failure: fuzz failed: fuzz-plus-one.json (numpy-window-plus-one): failing case" in out


def test_the_heatmap_re_runs_only_the_reports_own_kernel(tmp_path):
    from refattn import report

    case = case_from_text("Hq = 2, Hkv = 1, d = 16, sq = 4, window = 2")
    params = {**case.to_dict(), "describe": case.describe()}
    row = {"kernel": "numpy-window-plus-one", "case": "inline", "source": "run-x.json", "kernel_spec": PLUS_ONE}
    err, name, note = report.heatmap_error(row, params)
    assert name == "numpy-window-plus-one" and note == "" and err.max() > 0.01
    err, _, note = report.heatmap_error({**row, "kernel_spec": None}, params)
    assert err is None and "names no kernel" in note
    err, _, note = report.heatmap_error({**row, "kernel_spec": "tests.adapters.numpy_window:Nope"}, params)
    assert err is None and "cannot build" in note


# ------------------------------------------------------------------ sanitize

FAKE_SANITIZER = """#!/bin/sh
# stands in for compute-sanitizer: drops the tool options, runs the target, prints a summary
tool=memcheck
while [ "${1#--}" != "$1" ]; do
  [ "$1" = "--tool" ] && tool=$2
  case "$1" in --leak-check|--tool|--error-exitcode) shift ;; esac
  shift
done
"$@"; rc=$?
if [ "$tool" = racecheck ]; then
  echo "========= RACECHECK SUMMARY: ${HAZARDS:-0} hazards displayed (${HAZARDS:-0} errors, 0 warnings)"
else
  echo "========= ERROR SUMMARY: 0 errors"
fi
[ $rc -ne 0 ] && echo "========= Target application returned an error"
exit $rc
"""


def test_sanitize_wraps_a_tight_run_of_any_kernel_and_reads_the_logs(capsys, tmp_path, monkeypatch):
    tool = tmp_path / "fake-sanitizer"
    tool.write_text(FAKE_SANITIZER)
    tool.chmod(0o755)
    monkeypatch.setenv("PYTHONPATH", str(__import__("pathlib").Path(__file__).resolve().parent.parent))
    base = ["sanitize", "--kernel", EXAMPLE, "--cpu-ok", "--suite", "contracts", "--sanitizer", str(tool),
            "--logs", str(tmp_path / "logs"), "-q"]
    code, out, err = run_cli(capsys, *base, "--json", str(tmp_path / "s.json"))
    assert code == 0, out + err
    doc = json.loads((tmp_path / "s.json").read_text())
    assert [t["tool"] for t in doc["tools"]] == ["memcheck", "racecheck"] and doc["ok"]
    assert "--spare 0" in doc["tools"][0]["command"] and (tmp_path / "logs" / "memcheck.log").is_file()
    monkeypatch.setenv("HAZARDS", "2")
    code, out, _ = run_cli(capsys, *base)
    assert code == 1 and "racecheck: FAILED: 2 error(s); 2 hazard(s)" in out
    monkeypatch.delenv("HAZARDS")
    suite = tmp_path / "tiny.toml"
    suite.write_text('[[case]]\nname = "w3"\nHq = 2\nHkv = 1\nd = 16\nsq = 8\nwindow = 3\nwhy = "a window"\n')
    code, out, _ = run_cli(capsys, "sanitize", "--kernel", PLUS_ONE, "--cpu-ok", "--suite", str(suite),
                           "--sanitizer", str(tool), "--tool", "memcheck", "-q")
    assert code == 1 and "the target application returned an error" in out  # a case failed under it


def test_sanitize_refuses_what_it_cannot_check(capsys):
    code, _, err = run_cli(capsys, "sanitize", "--kernel", EXAMPLE)
    assert code == 2 and "requires_gpu" in err
    code, _, err = run_cli(capsys, "sanitize", "--kernel", EXAMPLE, "--cpu-ok", "--sanitizer", "/nonexistent/cs")
    assert code == 2 and "--sanitizer" in err


# ------------------------------------------------------------------ record

def test_record_writes_every_check_a_kernel_unlocks_for_the_report(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    d = tmp_path / "r"
    code, out, err = run_cli(capsys, "record", "--kernel", EXAMPLE, "--out", str(d), "--suite", "contracts",
                             "--examples", "15", "-q")
    assert code == 0, out + err
    assert sorted(p.name for p in d.glob("*.json")) == [
        "determinism-numpy-example.json", "fuzz-numpy-example.json", "run-numpy-example.json"]
    assert "declares no mutants" not in err  # -q
    report = ["report", "--in", str(d), "--out", str(d / "out"), "--baseline", str(d / "baseline.json")]
    assert run_cli(capsys, *report, "--update-baseline")[0] == 0
    assert run_cli(capsys, *report, "--check")[0] == 0

    code, out, err = run_cli(capsys, "record", "--kernel", PLUS_ONE, "--out", str(d / "bad"),
                             "--suite", "contracts", "--examples", "60", "-q")
    assert code == 1 and "FAILED: fuzz" in out  # the checks after it still ran
    assert (d / "bad" / "determinism-numpy-window-plus-one.json").is_file()


def test_record_runs_the_kill_matrix_of_a_kernel_that_declares_mutants(capsys, tmp_path):
    """The model declares the catalogue; on the contracts suite it declines every case, so its
    kill matrix kills nothing and the record says that step failed."""
    from refattn.mutants import MUTANTS

    code, out, err = run_cli(capsys, "record", "--kernel", "model", "--out", str(tmp_path),
                             "--suite", "contracts", "--examples", "5", "-q")
    km = json.loads((tmp_path / "mutants-model.json").read_text())
    assert [m["name"] for m in km["mutants"]] == [m.name for m in MUTANTS] and km["kernel_spec"] == "model"
    assert code == 1 and "FAILED: mutants:" in out and "run 0, fuzz 0, determinism 0, mutants 1" in out
