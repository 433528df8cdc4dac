"""`refattn implementations`: the table of which implementation holds which feature is
rendered from run records, and --check fails when the committed table is not theirs."""

import json
from pathlib import Path

import pytest

from refattn import cli
from refattn.implementations import FEATURES, build, row_of

ROOT = Path(__file__).resolve().parent.parent


def _record(tmp_path, name, kernel, *cases):
    out = tmp_path / "recs" / f"{name}.json"
    out.parent.mkdir(exist_ok=True)
    argv = ["run", "--kernel", kernel, "-q", "--json", str(out)]
    for c in cases:
        argv += ["--case", c]
    cli.main(argv)
    return out


def test_a_row_counts_each_feature_and_lists_the_reasons(tmp_path, capsys):
    p = _record(tmp_path, "reasoned", "tests.helpers_kernels:ReasonedDeclineKernel",
                "Hq = 4, Hkv = 2, d = 64, sq = 3, past_len = 5, window = 2",
                "Hq = 4, Hkv = 2, d = 96, sq = 3, sink = \"per_head\"")
    capsys.readouterr()
    row = row_of(p)
    assert row.cells["window"] == "1 pass" and row.cells["chunked"] == "1 pass"
    assert row.cells["sink"] == "declined" and row.cells["gqa"] == "1 pass, 1 declined"
    assert row.cells["bf16"] == "-" and row.declines == "1 clean"
    assert row.reasons == ["head dim 96 is not built (only 64)"]
    assert row.total == "1/2 pass, 1 declined"
    assert float(row.worst) > 0


def test_a_failing_kernel_is_a_fail_cell(tmp_path, capsys):
    p = _record(tmp_path, "plus1", "tests.adapters.numpy_window:WindowPlusOne",
                "Hq = 4, Hkv = 2, d = 16, sq = 9, past_len = 3, window = 2",
                "Hq = 4, Hkv = 2, d = 16, sq = 9")
    capsys.readouterr()
    row = row_of(p)
    assert row.cells["window"] == "FAIL 1/1" and row.cells["fp16"] == "FAIL 1/2"
    assert "1 FAIL" in row.total and float(row.worst) > 1


def test_check_fails_until_the_table_is_rendered_and_then_passes(tmp_path, capsys):
    _record(tmp_path, "reasoned", "tests.helpers_kernels:ReasonedDeclineKernel",
            "Hq = 2, Hkv = 1, d = 64, sq = 3")
    doc = tmp_path / "impl.md"
    recs = str(tmp_path / "recs")
    assert cli.main(["implementations", "--in", recs, "--out", str(doc), "--check"]) == 1
    assert not doc.exists()
    assert cli.main(["implementations", "--in", recs, "--out", str(doc)]) == 0
    assert cli.main(["implementations", "--in", recs, "--out", str(doc), "--check"]) == 0
    doc.write_text(doc.read_text().replace("1/1 pass", "2/2 pass"))
    assert cli.main(["implementations", "--in", recs, "--out", str(doc), "--check"]) == 1
    out, err = capsys.readouterr()
    assert "is not what the records" in err
    assert all(title in build([Path(recs)]) for title, _ in FEATURES.values())


def test_unreadable_or_missing_records_are_usage_errors(tmp_path, capsys):
    assert cli.main(["implementations", "--in", str(tmp_path / "nope")]) == 2
    (tmp_path / "empty").mkdir()
    assert cli.main(["implementations", "--in", str(tmp_path / "empty"), "--out", "-"]) == 2
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.json").write_text(json.dumps({"results": [{"case": "a"}]}))
    assert cli.main(["implementations", "--in", str(tmp_path / "bad"), "--out", "-"]) == 2
    assert "x.json: not a run record" in capsys.readouterr().err


def test_the_committed_table_is_what_the_committed_records_say(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the defaults: reports/implementations, reports/gpu/h200.json
    if not any((ROOT / "reports" / "implementations").glob("*.json")):
        pytest.fail("reports/implementations holds no run records")
    assert cli.main(["implementations", "--check"]) == 0, capsys.readouterr().err
