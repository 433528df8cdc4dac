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
    assert out.count("  failure: input missing: ") == 3 and "failure: baseline missing" in out


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
