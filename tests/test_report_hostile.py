"""``refattn report`` and the GPU record checker on files of their own schema with a field
of the wrong shape, and ``--check`` on nothing: never a traceback, never a pass.

Every hostile document starts from a valid one (the fixture of tests/test_report.py: a real
run file, a kill matrix and three GPU records) with one field broken. The report must exit 1
under ``--check`` with a line ``failure: unreadable input: FILE: FIELD: why`` naming the file
and the field, leave the file out, and still report the others.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hipkernel import record
from refattn import report
from refattn.cli import main
from tests.test_report import _report, inputs_dir, no_matplotlib, with_baseline  # noqa: F401 - fixtures


def _set(path: list, value):
    """A change of one field (``path``: keys and list indexes) of a document."""
    def change(doc):
        node = doc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return change


def _drop(path: list):
    def change(doc):
        node = doc
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]
    return change


# (id, file, change, field named in the finding)
HOSTILE = [
    ("hash-int", "gpu/h200.json", _set(["kernel_source_hash"], 12345), "kernel_source_hash: expected a string, got an integer"),
    ("hash-missing", "gpu/h200.json", _drop(["kernel_source_hash"]), "kernel_source_hash: missing"),
    ("hash-empty", "gpu/h200.json", _set(["kernel_source_hash"], " "), "kernel_source_hash: empty"),
    ("ok-string", "gpu/h200.json", _set(["ok"], "yes"), "ok: expected true or false, got a string"),
    ("gpu-results-int", "gpu/h200.json", _set(["results"], 5), "results: expected a list, got an integer"),
    ("gpu-result-a-list", "gpu/h200.json", _set(["results", 0], [1, 2]), "results[0]: expected an object, got a list"),
    ("gpu-rel-l2-infinity", "gpu/h200.json", _set(["results", 0, "rel_l2"], float("inf")),
     "results[0].rel_l2: expected a finite number, got inf"),
    ("per-call-int", "gpu/measure-h200.json", _set(["per_call"], 5), "per_call: expected a list, got an integer"),
    ("per-call-ms-string", "gpu/measure-h200.json", _set(["per_call", 0, "ms"], "0.05"),
     "per_call[0].ms: expected a finite number, got a string"),
    ("bench-ms-string", "gpu/bench-h200.json", _set(["rows", 0, "kernel_ms"], "0.05"),
     "rows[0].kernel_ms: expected a finite number, got a string"),
    ("bench-peer-ratio-string", "gpu/bench-h200.json", _set(["rows", 0, "peers", "flex"], {"ms": 0.07, "ratio": "1.5"}),
     "rows[0].peers: expected an object or a list, got an object"),
    ("bench-shapes-an-object", "gpu/bench-h200.json", _set(["shapes"], {}), "shapes: expected a list, got an object"),
    ("run-results-int", "run-model.json", _set(["results"], 5), "results: expected a list, got an integer"),
    ("run-rel-l2-infinity", "run-model.json", _set(["results", 0, "rel_l2"], float("inf")),
     "results[0].rel_l2: expected a finite number, got inf"),
    ("run-outcome-null", "run-model.json", _set(["results", 1, "outcome"], None),
     "results[1].outcome: expected a string, got null"),
    ("run-max-abs-at-string", "run-model.json", _set(["results", 0, "max_abs_at"], "0,0,0,0"),
     "results[0].max_abs_at: expected a list, got a string"),
    ("run-params-list", "run-model.json", _set(["results", 0, "params"], [1]),
     "results[0].params: expected an object, got a list"),
    ("kill-mutants-null", "mutants-model.json", _set(["mutants"], None), "mutants: expected a list, got null"),
    ("kill-killed-string", "mutants-model.json", _set(["mutants", 0, "killed"], "true"),
     "mutants[0].killed: expected true or false, got a string"),
    ("kill-killed-by-int", "mutants-model.json", _set(["mutants", 0, "killed_by"], 3),
     "mutants[0].killed_by: expected a list, got an integer"),
]


@pytest.mark.parametrize("name,change,field", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_a_wrongly_typed_field_is_a_failure_naming_file_and_field(name, change, field, with_baseline, capsys):
    d = with_baseline
    path = d / name
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))  # Python's json writes inf as Infinity, as a hand edit might
    rc, out, latest = _report(capsys, d, "--check")
    assert rc == 1, out
    assert f"  failure: unreadable input: {name}: {field}" in out, out
    assert name not in latest["inputs"]["runs"] + latest["inputs"]["kill_matrices"] + latest["inputs"]["gpu"]


@pytest.mark.parametrize("name,change,field", [h[1:] for h in HOSTILE if h[1].startswith("gpu/")],
                         ids=[h[0] for h in HOSTILE if h[1].startswith("gpu/")])
def test_the_record_checker_names_file_and_field(name, change, field, inputs_dir, tmp_path, monkeypatch):
    d = tmp_path / "gpu"
    shutil.copytree(inputs_dir / "gpu", d)
    path = d / Path(name).name
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))
    problems = record.check_dir(d)
    assert f"{path.name}: {field}" in problems, problems


def test_a_record_without_a_hash_fails_the_record_checker(inputs_dir, tmp_path):
    d = tmp_path / "gpu"
    shutil.copytree(inputs_dir / "gpu", d)
    doc = json.loads((d / "h200.json").read_text())
    del doc["kernel_source_hash"]
    (d / "h200.json").write_text(json.dumps(doc))
    assert "h200.json: kernel_source_hash: missing" in record.check_dir(d)
    assert record.main(["--check", str(d)]) == 1


# --------------------------------------------------------------------------- --check on nothing

def test_check_fails_on_a_missing_in_directory_and_creates_nothing(tmp_path, capsys):
    missing = tmp_path / "nonexistent"
    rc = main(["report", "--in", str(missing), "--out", str(tmp_path / "out"), "--check"])
    out = capsys.readouterr().out
    assert rc == 1 and out.strip() == f"failure: input missing: {missing}: no such directory (--in)"
    assert not missing.exists() and not (tmp_path / "out").exists()


def test_check_fails_on_an_empty_in_directory(tmp_path, capsys, no_matplotlib):
    rc, out, _ = _report(capsys, tmp_path, "--check")
    assert rc == 1
    assert out.count("  failure: input missing: ") == 1 and "failure: baseline missing" in out


def test_check_fails_on_a_baseline_path_that_is_a_typo(with_baseline, capsys):
    rc, out, _ = _report(capsys, with_baseline, "--check", "--baseline", str(with_baseline / "basline.json"))
    assert rc == 1
    assert f"  failure: baseline missing: {with_baseline / 'basline.json'}: no such file" in out


def test_check_fails_on_a_baseline_with_nothing_in_it(with_baseline, capsys):
    (with_baseline / "baseline.json").write_text('{"schema": 1}')
    rc, out, _ = _report(capsys, with_baseline, "--check")
    assert rc == 1
    assert f"  failure: unreadable input: {with_baseline / 'baseline.json'}: cases: missing" in out
    (with_baseline / "baseline.json").write_text(
        '{"schema": 1, "cases": [], "kill_matrices": [], "gpu_records": []}')
    rc, out, _ = _report(capsys, with_baseline, "--check")
    assert rc == 1
    assert f"  failure: baseline empty: {with_baseline / 'baseline.json'}: no cases" in out


def test_a_baseline_field_of_the_wrong_shape_is_a_failure_not_a_traceback(with_baseline, capsys):
    path = with_baseline / "baseline.json"
    doc = json.loads(path.read_text())
    doc["cases"][0]["rel_l2"] = "big"
    path.write_text(json.dumps(doc))
    rc, out, _ = _report(capsys, with_baseline, "--check")
    assert rc == 1
    assert f"  failure: unreadable input: {path}: cases[0].rel_l2: expected a finite number, got a string" in out


def test_update_baseline_makes_the_first_baseline(inputs_dir, tmp_path, capsys, no_matplotlib):
    d = tmp_path / "reports"
    shutil.copytree(inputs_dir, d)
    rc, out, _ = _report(capsys, d, "--check", "--update-baseline")
    assert rc == 0, out
    assert (d / "baseline.json").is_file()
    rc, out, _ = _report(capsys, d, "--check")
    assert rc == 0, out


# --------------------------------------------------------------------------- writes

def test_latest_json_and_md_are_written_together_or_not_at_all(with_baseline, capsys, monkeypatch):
    """A failure while rendering the Markdown leaves both files as they were: latest.json is
    not rewritten beside a latest.md of the previous run."""
    out_dir = with_baseline / "out"
    before = {n: (out_dir / n).read_bytes() for n in ("latest.json", "latest.md")}

    def broken(doc, plots):
        raise RuntimeError("rendering failed")

    monkeypatch.setattr(report, "render_markdown", broken)
    with pytest.raises(RuntimeError):
        main(["report", "--in", str(with_baseline), "--out", str(out_dir)])
    assert {n: (out_dir / n).read_bytes() for n in before} == before
    assert sorted(p.name for p in out_dir.iterdir() if p.name.startswith(".")) == []


# --------------------------------------------------------------------------- every kind of record

def _stamped(kind: str, **body) -> dict:
    return record.stamp(kind, "test fixture (CPU, not a GPU)", body, True)


@pytest.fixture
def all_kinds(with_baseline, capsys) -> Path:
    """The inputs of ``with_baseline`` with a record of each further kind in gpu/: a GPU kill
    matrix, a reliability record, an mma_check record and a bench record of refattn.bench's
    own body (``shapes``). The report of them passes ``--check``."""
    gpu = with_baseline / "gpu"
    mutant = {"name": "sink_ignored", "breaks": "the sink is left out", "killed": True,
              "killed_by": ["ext-sink-sq1-past0"], "killed_by_seed_gate": [], "equivalent": None}
    kill = {"kernel": "hipkernel:cuda", "clean_ok": True, "clean_failures": [],
            "cases": ["ext-sink-sq1-past0"], "ok": True, "mutants": [mutant]}
    files = {
        "mutants-h200.json": _stamped("mutants", backend="cuda", **kill),
        "reliability-h200.json": _stamped("reliability", backend="cuda",
                                          determinism={"ok": True, "runs": 3},
                                          fuzz={"ok": True, "n": 10}),
        "mma-check-h200.json": _stamped("mma_check", mutants={"wgmma_m16_b64": kill}),
        "bench-shapes-h200.json": _stamped("bench", peers_available={"sdpa": {"available": True}}, shapes=[
            {"name": "gptoss-512@8192", "hipkernel": {"sink": {"ms": 0.16, "tflops": 450.0},
                                                       "nosink": {"ms": 0.15, "tflops": 460.0}},
             "peers": {"sdpa": {"status": "ok", "ms": 0.25, "sink": False},
                       "flex": {"status": "ok", "ms": 0.20, "sink": True}}}]),
    }
    for name, doc in files.items():
        (gpu / name).write_text(json.dumps(doc, indent=1) + "\n")
    _apply(gpu / "bench-h200.json", _set(["peers_available"], {"sdpa": {"available": True}}))
    rc, out, _ = _report(capsys, with_baseline, "--check")
    assert rc == 0, out
    assert record.check_dir(gpu) == []
    return with_baseline


# (id, file, change, field named in the finding); each is also read by the record checker
# when it is a GPU record field that the checker reads (``checker``)
MORE_HOSTILE = [
    ("backend-int", "gpu/h200.json", _set(["backend"], 5), "backend: expected a string, got an integer"),
    ("kernel-label-a-list", "gpu/h200.json", _set(["kernel"], ["cuda"]), "kernel: expected a string, got a list"),
    ("gpu-kill-cases-int", "gpu/mutants-h200.json", _set(["cases"], 5), "cases: expected a list, got an integer"),
    ("gpu-kill-clean-failures-int", "gpu/mutants-h200.json", _set(["clean_failures"], 5),
     "clean_failures: expected a list, got an integer"),
    ("kill-clean-failures-not-names", "mutants-model.json",
     lambda doc: doc.update(clean_ok=False, clean_failures=[1]),
     "clean_failures[0]: expected a string, got an integer"),
    ("per-call-window-string", "gpu/measure-h200.json", _set(["per_call", 0, "window"], "128"),
     "per_call[0].window: expected an integer, got a string"),
    ("per-call-past-len-float-inf", "gpu/measure-h200.json", _set(["per_call", 0, "past_len"], float("inf")),
     "per_call[0].past_len: expected an integer, got inf"),
    ("reliability-ok-null", "gpu/reliability-h200.json", _set(["ok"], None), "ok: expected true or false, got null"),
    ("reliability-hash-int", "gpu/reliability-h200.json", _set(["kernel_source_hash"], 12345),
     "kernel_source_hash: expected a string, got an integer"),
    ("reliability-top-level-list", "gpu/reliability-h200.json", lambda doc: [doc],
     "(top level): expected an object, got a list"),
    ("bench-shapes-peer-ms-string", "gpu/bench-shapes-h200.json", _set(["shapes", 0, "peers", "sdpa", "ms"], "0.25"),
     "shapes[0].peers.sdpa.ms: expected a finite number, got a string"),
    ("bench-shapes-row-null", "gpu/bench-shapes-h200.json", _set(["shapes", 0], None),
     "shapes[0]: expected an object, got null"),
    ("mma-check-matrices-null", "gpu/mma-check-h200.json", _set(["mutants"], None),
     "mutants: expected an object, got null"),
    ("mma-check-mutants-int", "gpu/mma-check-h200.json", _set(["mutants", "wgmma_m16_b64", "mutants"], 5),
     "mutants.wgmma_m16_b64.mutants: expected a list, got an integer"),
]
# fields only one of the two readers reads; every other field both read
_ONLY_THE_REPORT = {"backend-int", "kernel-label-a-list", "gpu-kill-cases-int", "gpu-kill-clean-failures-int",
                    "per-call-window-string", "per-call-past-len-float-inf"}
_ONLY_THE_CHECKER = {"mma-check-matrices-null", "mma-check-mutants-int"}  # its kill matrices


def _apply(path: Path, change) -> None:
    doc = json.loads(path.read_text())
    new = change(doc)
    path.write_text(json.dumps(doc if new is None else new))  # inf is written as Infinity


@pytest.mark.parametrize("ident,name,change,field", MORE_HOSTILE, ids=[h[0] for h in MORE_HOSTILE])
def test_a_wrongly_typed_field_of_any_kind_is_a_failure(ident, name, change, field, all_kinds, capsys):
    """Each kind of input, each field a reader uses: the reader that reads it (the report, the
    record checker or both) names file and field, and the report leaves the file out."""
    _apply(all_kinds / name, change)
    rc, out, latest = _report(capsys, all_kinds, "--check")
    if ident in _ONLY_THE_CHECKER:
        assert rc == 0, out
    else:
        assert rc == 1, out
        assert f"  failure: unreadable input: {name}: {field}" in out, out
        assert name not in latest["inputs"]["runs"] + latest["inputs"]["kill_matrices"] + latest["inputs"]["gpu"]
    if name.startswith("gpu/") and ident not in _ONLY_THE_REPORT:
        problems = record.check_dir(all_kinds / "gpu")
        assert f"{Path(name).name}: {field}" in problems, problems


@pytest.mark.parametrize("kind_file,extra", [
    ("reliability-h200.json", {"mutants": 5}),
    ("reliability-h200.json", {"results": None}),
    ("mma-check-h200.json", {"results": None}),
], ids=["reliability-mutants-int", "reliability-results-null", "mma-check-results-null"])
def test_a_failed_record_is_described_from_its_own_kinds_fields(kind_file, extra, all_kinds, capsys):
    """A field a kind does not have is not read, even to describe a failed run: the record
    is a failing GPU record, not a traceback."""
    _apply(all_kinds / "gpu" / kind_file, lambda doc: doc.update(ok=False, **extra))
    rc, out, _ = _report(capsys, all_kinds, "--check")
    assert rc == 1, out
    assert f"  failure: GPU record failing: gpu/{kind_file} (" in out or \
        f"  regression: GPU record failing: gpu/{kind_file} (" in out, out
    problems = record.check_dir(all_kinds / "gpu")
    assert any(p.startswith(f"{kind_file}: the recorded run failed") for p in problems), problems


@pytest.mark.parametrize("data", [b"[" * 100_000 + b"]" * 100_000, b'{"results": ' + b"7" * 5000 + b"}",
                                  b'{"results": [], "kernel": "\xff"}'],
                         ids=["nested-too-deep", "integer-too-long", "not-utf8"])
def test_a_file_that_json_cannot_read_is_a_failure(data, all_kinds, capsys):
    """JSON that Python's reader refuses with something other than a JSONDecodeError (too
    deep, an integer past its digit limit, bytes that are not UTF-8): a failure naming the
    file, in both readers."""
    for name in ("run-model.json", "gpu/h200.json"):
        (all_kinds / name).write_bytes(data)
    rc, out, _ = _report(capsys, all_kinds, "--check")
    assert rc == 1, out
    for name in ("run-model.json", "gpu/h200.json"):
        assert f"  failure: unreadable input: {name}: " in out, out
    assert any(p.startswith("h200.json: unreadable: ") for p in record.check_dir(all_kinds / "gpu"))


def test_a_baseline_that_json_cannot_read_is_a_usage_error(with_baseline, capsys):
    (with_baseline / "baseline.json").write_text("[" * 100_000 + "]" * 100_000)
    assert main(["report", "--in", str(with_baseline), "--out", str(with_baseline / "out"), "--check"]) == 2
    assert "baseline: cannot read" in capsys.readouterr().err


# --------------------------------------------------------------------------- --check on lost coverage

def _drop_suite(d: Path):
    _apply(d / "run-model.json", lambda doc: doc.update(results=[r for r in doc["results"]
                                                                 if r["suite"] != "extended"]))
    return ("regression: coverage lost: run-model.json: 3 cases in the baseline -> not in this report: "
            "model extended/")


def _delete_gpu_matrix(d: Path):
    (d / "gpu" / "h200.json").unlink()
    return ("regression: coverage lost: gpu/h200.json: 4 cases, 1 GPU record in the baseline -> "
            "not in this report: ")


def _drop_mutant(d: Path):
    _apply(d / "mutants-model.json", lambda doc: doc.update(mutants=doc["mutants"][1:]))
    return ("regression: coverage lost: mutants-model.json: 1 mutant in the baseline -> not in this report: "
            "model / sink_ignored")


def _drop_bench_peer(d: Path):
    _apply(d / "gpu" / "bench-h200.json", lambda doc: doc["rows"][0]["peers"].pop("flex") and None)
    return ("regression: coverage lost: gpu/bench-h200.json: 1 bench ratio in the baseline -> not in this "
            "report: gptoss-past8192-w128 vs flex")


@pytest.mark.parametrize("lose", [_drop_suite, _delete_gpu_matrix, _drop_mutant, _drop_bench_peer],
                         ids=["suite-dropped", "gpu-record-deleted", "mutant-dropped", "bench-peer-dropped"])
def test_check_fails_when_what_the_baseline_compared_is_gone(lose, with_baseline, capsys, no_matplotlib):
    """A check that compares less than its baseline did fails: a CI step that stopped
    running a suite, a deleted record, a mutant or a peer left out."""
    want = lose(with_baseline)
    rc, out, doc = _report(capsys, with_baseline, "--check")
    assert rc == 1, out
    lines = [line.strip() for line in out.splitlines() if line.startswith("  ")]
    assert any(line.startswith(want) for line in lines), f"expected {want!r} in:\n{out}"
    assert len(doc["findings"]) == 1, doc["findings"]


def test_lost_coverage_of_an_unreadable_file_is_not_repeated(with_baseline, capsys, no_matplotlib):
    _apply(with_baseline / "gpu" / "h200.json", _set(["results"], 5))
    rc, out, doc = _report(capsys, with_baseline, "--check")
    assert rc == 1
    assert [f["what"] for f in doc["findings"]] == ["unreadable input"], doc["findings"]


# --------------------------------------------------------------------------- --update-baseline

def test_update_baseline_refuses_a_baseline_that_compares_nothing(tmp_path, capsys, no_matplotlib):
    d = tmp_path / "reports"
    d.mkdir()
    rc = main(["report", "--in", str(d), "--out", str(d / "out"), "--update-baseline"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "report: baseline not updated: " in err and not (d / "baseline.json").exists()


def test_update_baseline_refuses_while_an_input_is_unreadable(with_baseline, capsys, no_matplotlib):
    """A baseline made without a broken file's rows would stop comparing them for good."""
    before = (with_baseline / "baseline.json").read_bytes()
    _apply(with_baseline / "run-model.json", _set(["results", 0, "rel_l2"], "x"))
    rc = main(["report", "--in", str(with_baseline), "--out", str(with_baseline / "out"), "--update-baseline"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "report: baseline not updated: run-model.json is unreadable" in err, err
    assert (with_baseline / "baseline.json").read_bytes() == before


# --------------------------------------------------------------------------- writes

def test_a_failed_write_of_latest_md_leaves_latest_json_as_it_was(with_baseline, capsys, monkeypatch,
                                                                  no_matplotlib):
    """latest.json and latest.md are replaced together: a write that fails (a full disk)
    replaces neither, leaves no temporary file, and is one line on stderr, exit 1."""
    import refattn.fileio

    out_dir = with_baseline / "out"
    before = {n: (out_dir / n).read_bytes() for n in ("latest.json", "latest.md")}
    real = refattn.fileio.atomic_write_text

    def full_disk(path, text):
        if "latest.md" in Path(path).name:
            raise OSError(28, "No space left on device")
        return real(path, text)

    monkeypatch.setattr(report, "atomic_write_text", full_disk)
    rc = main(["report", "--in", str(with_baseline), "--out", str(out_dir), "--check"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "No space left on device" in err and "Traceback" not in err
    assert {n: (out_dir / n).read_bytes() for n in before} == before
    assert [p.name for p in out_dir.iterdir() if p.name.startswith(".")] == []


def test_a_plot_that_fails_while_saving_leaves_no_partial_png(inputs_dir, tmp_path, capsys, monkeypatch):
    """Each PNG goes through a temporary file and a rename: a savefig that fails halfway
    leaves no truncated file in plots/, only a note."""
    pytest.importorskip("matplotlib", reason="the plot extra (pip install refattn[plot]) is not installed")
    from matplotlib.figure import Figure

    d = tmp_path / "reports"
    shutil.copytree(inputs_dir, d)

    def half_written(self, fname, *a, **k):
        data = b"\x89PNG\r\n\x1a\n half a plot"
        if hasattr(fname, "write"):
            fname.write(data)
        else:
            Path(fname).write_bytes(data)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", half_written)
    rc, out, doc = _report(capsys, d)
    assert rc == 0, out
    assert list((d / "out" / "plots").glob("*.png")) == [] and doc["plots"]["written"] == []
    assert any("No space left on device" in n for n in doc["plots"]["notes"]), doc["plots"]
    assert [p.name for p in (d / "out" / "plots").iterdir()] == []
