"""The committed GPU records (reports/gpu/) must match the current kernel source and pass.

CI has no GPU: this is how "works on GPU" stays backed by a run of the code as it is. A
kernel edit without a fresh H200 run makes this test fail with the stale file named."""

import copy
import json
from pathlib import Path

import pytest

from hipkernel import record

GPU_DIR = Path(__file__).resolve().parent.parent / "reports" / "gpu"


def test_committed_gpu_records_are_fresh_and_passing():
    problems = record.check_dir(GPU_DIR, require=("h200.json", "mutants-h200.json"))
    assert not problems, "GPU records:\n" + "\n".join(problems)


def test_matrix_record_holds_every_case():
    rec = json.loads((GPU_DIR / "h200.json").read_text())
    cases = {r["case"] for r in rec["results"]}
    assert {"gptoss-sink-past8192-w128", "gptoss-nosink-past512-w1"} <= cases
    assert all(r["outcome"] in ("pass", "declined") for r in rec["results"])
    assert all(r["rel_l2"] is not None for r in rec["results"] if r["outcome"] == "pass")


def test_checker_flags_stale_and_failing_records():
    rec = json.loads((GPU_DIR / "h200.json").read_text())
    stale = copy.deepcopy(rec)
    stale["kernel_source_hash"] = "0" * 64
    assert any("stale" in p for p in record.check_record(stale))
    failing = copy.deepcopy(rec)
    failing["ok"] = False
    failing["results"][0]["outcome"] = "fail"
    assert any("failed" in p and failing["results"][0]["case"] in p for p in record.check_record(failing))
    assert record.check_record({"kind": "matrix"})  # missing fields


def test_a_torch_entry_record_is_judged_against_the_entry_points_hash(tmp_path):
    """A record of hipkernel-torch is fresh for the kernel, the launch code and torch.py
    together (api.torch_source_hash), in record.check_record and record.check_dir alike; one
    stamped with the kernel's hash alone is stale."""
    from hipkernel import api

    rec = record.stamp("torch", "dev", {"results": [], "checks": {}}, True, kernel="hipkernel-torch")
    assert rec["kernel_source_hash"] == api.torch_source_hash()
    assert record.freshness(rec, record._current(rec, api.source_hash())) == "fresh"
    assert not any("stale" in p for p in record.check_record(rec))
    old = dict(rec, kernel_source_hash=api.source_hash())
    assert any("stale" in p for p in record.check_record(old))
    (tmp_path / "torch-h200.json").write_text(json.dumps(old))
    assert any("torch-h200.json: stale" in p for p in record.check_dir(tmp_path, require=()))


def test_a_bench_record_without_any_peer_is_flagged():
    """The committed bench must compare: a run whose torch did not import (torch not importable in
    the timing process) times hipkernel alone and is refused. (Checked against the record's own
    hash: its freshness is the test above.)"""
    rec = json.loads((GPU_DIR / "bench-h200.json").read_text())
    own = rec["kernel_source_hash"]
    assert record.check_record(rec, own) == []
    assert any(p["available"] for p in rec["peers_available"].values())
    alone = copy.deepcopy(rec)
    why = "torch not importable: RuntimeError: expected ident but found ')' here:\n  annotate"
    alone["peers_available"] = {n: {"available": False, "reason": why} for n in ("sdpa", "flex")}
    (problem,) = record.check_record(alone, own)
    assert problem.startswith("no peer ran in this bench (torch not importable: RuntimeError: "
                              "expected ident but found ')' here: annotate)")
    del alone["peers_available"]
    assert record.check_record(alone, own) == [
        "missing field 'peers_available' (which peers the bench could run)"]
    not_asked = {**rec, "peers_available": {"sdpa": {"available": False,
                                                     "reason": "not requested (--peers)"}}}
    assert "not requested (--peers)" in record.check_record(not_asked, own)[0]


def _engine_record(tmp_path, monkeypatch, peers: str) -> dict:
    """A bench record of refattn.bench: NumPy adapters on tiny shapes, a fake timer."""
    from refattn import bench, cli
    from tests.test_bench_cli import TINY, FakeTimer

    monkeypatch.setattr(bench, "make_timer", lambda T: FakeTimer({"sink-peer": 2.0}))
    shapes, out = tmp_path / "tiny.toml", tmp_path / "bench.json"
    shapes.write_text(TINY.replace("target_ms = 0.5", "target_ms = 5.0"))
    assert cli.main(["bench", "--kernel", "tests.test_bench_cli:FakeKernel", "--peers", peers,
                     "--shapes", str(shapes), "--json", str(out), "-q", "--reps", "20"]) == 0
    return json.loads(out.read_text())


def test_a_bench_record_of_refattn_bench_is_read_and_must_have_timed_a_peer(tmp_path, monkeypatch):
    """refattn.bench's record (results keyed by adapter name) passes the checker when a peer
    was timed, and is refused when every peer was n/a or mismatched on every shape."""
    rec = _engine_record(tmp_path, monkeypatch, "tests.test_bench_cli:SinkPeer")
    own = rec["kernel_source_hash"]
    assert record.check_record(rec, own) == []
    assert record.check_record(rec, "0" * 64)[0].startswith("stale: recorded hash fake-source-")
    rec = _engine_record(tmp_path, monkeypatch,
                         "tests.test_bench_cli:RaisingPeer,tests.test_bench_cli:WrongKernel")
    (problem,) = record.check_record(rec, own)
    assert problem.startswith("no peer was timed on any shape of this bench (")
    assert "raising-peer: n/a: RuntimeError: no kernel image for this device" in problem
    bad = copy.deepcopy(rec)
    bad["shapes"][0]["results"]["fake-kernel"]["sink"]["ms"] = "0.1"
    assert record.check_record(bad, own) == [
        "shapes[0].results.fake-kernel.sink.ms: expected a finite number, got a string"]
    bad["shapes"][0]["results"] = [1]
    assert record.check_record(bad, own) == ["shapes[0].results: expected an object, got a list"]


def test_the_report_reads_both_bench_formats(tmp_path, monkeypatch):
    """The report's bench table: from refattn.bench's record the kernel's time in the shape's
    own mode and each timed peer's ratio in the peer's mode; from a record of the engine before
    it, hipkernel's sink time and the same ratios."""
    from refattn import report

    rec = _engine_record(tmp_path, monkeypatch, "tests.test_bench_cli:SinkPeer,tests.test_bench_cli:NoSinkPeer")
    entry = report._bench_entry("gpu/bench.json", rec)
    assert entry["kernel"] == "fake-kernel"
    first = entry["rows"][0]
    assert first["case"] == "tiny-8@4" and first["kernel_ms"] == 1.0
    assert {p["peer"]: p["ratio"] for p in first["peers"]} == {"sink-peer": 2.0, "nosink-peer": 1.0}
    old = {"schema": 1, "kind": "bench", "kernel_source_hash": "ab" * 32, "device": "NVIDIA H200",
           "ok": True, "shapes": [{  # the shape of a record of the engine before refattn.bench
               "name": "gptoss-512@8192",
               "hipkernel": {"sink": {"ms": 0.1567, "tflops": 452.0}, "nosink": {"ms": 0.1569, "tflops": 452.0}},
               "peers": {"sdpa": {"status": "ok", "ms": 0.2470, "sink": False},
                         "cudnn": {"status": "ok", "ms": 0.2938, "sink": False},
                         "flex": {"status": "ok", "ms": 0.1969, "sink": True}}}]}
    entry = report._bench_entry("gpu/bench-old.json", old)
    row = entry["rows"][0]
    assert row["kernel_ms"] == 0.1567
    assert {p["peer"] for p in row["peers"]} == {"sdpa", "cudnn", "flex"}
    committed = json.loads((GPU_DIR / "bench-h200.json").read_text())  # refattn.bench's, with FA4
    entry = report._bench_entry("gpu/bench-h200.json", committed)
    assert {p["peer"] for p in entry["rows"][0]["peers"]} == {"sdpa", "cudnn", "flex", "fa4"}


def test_a_scaling_record_is_carried_across_kernel_edits_and_must_still_pass():
    """Only the two-GPU scaling record outlives a kernel edit (CARRIED_KINDS): every other
    kind of another kernel source is stale."""
    current = record.source_hash()
    scaling = record.stamp("scaling", "2x NVIDIA H200", {"runs": []}, True)
    assert record.freshness(scaling, current) == "fresh"
    scaling["kernel_source_hash"] = "ab" * 32
    assert record.freshness(scaling, current) == "carried"
    assert record.check_record(scaling, current) == []
    assert record.carried_note(scaling).startswith("carried: a scaling run of kernel source abababababab")
    assert record.check_record({**scaling, "ok": False}, current) == ["the recorded run failed: ok is false"]
    for kind in ("matrix", "mutants", "measure", "bench", "reliability", "mma_check"):
        rec = {**scaling, "kind": kind}
        assert record.freshness(rec, current) == "stale", kind
        assert any(p.startswith("stale: recorded hash abababababab") for p in
                   record.check_record(rec, current)), kind


def _device_outputs(tmp_path: Path, *, hash_=None, mutants_ok=True) -> tuple[Path, Path, Path]:
    """What the three H200 commands leave behind, in miniature: stamped records of the
    current kernel source (or ``hash_``), scripts/mma_check.py's unstamped JSON, the scaling
    record."""
    h = hash_ or record.source_hash()
    rec_dir, rel_dir = tmp_path / "rec", tmp_path / "rel"
    rec_dir.mkdir(parents=True)
    rel_dir.mkdir()

    def put(path: Path, kind: str, **body):
        r = record.stamp(kind, "NVIDIA H200", body, True)
        r["kernel_source_hash"] = h
        path.write_text(json.dumps(r, indent=2) + "\n")

    for d in (rec_dir, rel_dir):  # both runs write the matrix, measure and bench records
        put(d / "h200.json", "matrix", results=[], run=d.name)
        put(d / "measure-h200.json", "measure", run=d.name)
        put(d / "bench-h200.json", "bench", run=d.name,
            peers_available={"sdpa": {"available": True, "reason": "torch SDPA"}})
    put(rec_dir / "mutants-h200.json", "mutants", mutants=[])
    put(rel_dir / "reliability-h200.json", "reliability")
    put(rel_dir / "torch-h200.json", "torch", results=[], checks={"stream": {"ok": True}})
    put(tmp_path / "scaling.json", "scaling")
    (rec_dir / "mma_check.json").write_text(json.dumps({
        "kernel_source_hash": h, "sweep": [],
        "mutants": {"wgmma_m16_b64": {"ok": True}, "mma_m4_b64": {"ok": mutants_ok}}}))
    return rec_dir, rel_dir, tmp_path / "scaling.json"


def test_collect_writes_the_records_of_the_runs(tmp_path):
    """--collect copies the reliability run's matrix, measure and bench records (the later
    run), the records run's kill matrix, the scaling record, and stamps mma_check.json as
    mma-check-h200.json; the result passes the CI check."""
    rec_dir, rel_dir, scaling = _device_outputs(tmp_path)
    out = tmp_path / "gpu"
    written = record.collect(rec_dir, rel_dir, scaling, out)
    assert written == sorted(["h200.json", "measure-h200.json", "bench-h200.json",
                              "reliability-h200.json", "torch-h200.json", "mutants-h200.json",
                              "scaling-h200x2.json", "mma-check-h200.json"])
    assert record.check_dir(out, require=tuple(written)) == []
    for name in ("h200.json", "measure-h200.json", "bench-h200.json", "reliability-h200.json",
                 "torch-h200.json"):
        assert (out / name).read_bytes() == (rel_dir / name).read_bytes(), name
    assert (out / "mutants-h200.json").read_bytes() == (rec_dir / "mutants-h200.json").read_bytes()
    assert (out / "scaling-h200x2.json").read_bytes() == scaling.read_bytes()
    mc = json.loads((out / "mma-check-h200.json").read_text())
    assert (mc["kind"], mc["ok"], mc["kernel_source_hash"]) == ("mma_check", True, record.source_hash())
    assert mc["run_of"] == json.loads((rec_dir / "h200.json").read_text())["date"]
    assert set(mc["mutants"]) == {"wgmma_m16_b64", "mma_m4_b64"} and mc["sweep"] == []
    # and through the command line, into an existing records folder
    assert record.main(["--check", str(tmp_path / "cli"), "--collect", str(rec_dir), str(rel_dir),
                        str(scaling)]) == 0
    assert sorted(p.name for p in (tmp_path / "cli").glob("*.json")) == written


def test_collect_without_a_torch_entry_record_writes_the_others_and_keeps_the_committed_one(tmp_path):
    """The torch entry point's record is collected when the run wrote it; without it the
    kernel's records are written and a committed torch record stays byte for byte (the check
    then judges it against its own hash). A missing required record still refuses."""
    rec_dir, rel_dir, scaling = _device_outputs(tmp_path)
    (rel_dir / "torch-h200.json").unlink()
    out = tmp_path / "gpu"
    out.mkdir()
    (out / "torch-h200.json").write_text("committed\n")
    written = record.collect(rec_dir, rel_dir, scaling, out)
    assert "torch-h200.json" not in written and "h200.json" in written
    assert (out / "torch-h200.json").read_text() == "committed\n"
    (rel_dir / "bench-h200.json").unlink()
    with pytest.raises(ValueError, match="bench-h200.json is missing"):
        record.collect(rec_dir, rel_dir, scaling, tmp_path / "again")


def test_collect_merges_a_kill_matrix_run_that_completed_a_cut_one(tmp_path, capsys):
    """A run of scripts/mma_check.py cut by its limit keeps the configs it finished and its
    plan; a second run of the rest, beside it as mma_check-2.json, completes it: the record
    holds both runs' kill matrices and says which file gave which. Without the second run the
    record lists the configs not run, and --check prints them. Runs of different sources, or
    two runs of one config, are refused."""
    rec_dir, rel_dir, scaling = _device_outputs(tmp_path)
    h = record.source_hash()
    plan = ["mma_m4_b64", "wgmma_m16_b64", "wgspan_m4_b136_p8_q4"]
    (rec_dir / "mma_check.json").write_text(json.dumps({
        "kernel_source_hash": h, "mutants_planned": plan,
        "mutants": {"mma_m4_b64": {"ok": True}, "wgmma_m16_b64": {"ok": True}}}))
    alone = tmp_path / "alone"
    record.collect(rec_dir, rel_dir, scaling, alone)
    mc = json.loads((alone / "mma-check-h200.json").read_text())
    assert mc["ok"] is True and mc["configs_not_run"] == ["wgspan_m4_b136_p8_q4"] and "runs" not in mc
    assert record.incomplete_in(alone) == [
        "mma-check-h200.json: not run: the kill matrices with wgspan_m4_b136_p8_q4 forced"]
    assert record.main(["--check", str(alone)]) == 0
    assert "not run: the kill matrices with wgspan_m4_b136_p8_q4 forced" in capsys.readouterr().out

    (rec_dir / "mma_check-2.json").write_text(json.dumps({
        "kernel_source_hash": h, "mutants_planned": ["wgspan_m4_b136_p8_q4"],
        "mutants": {"wgspan_m4_b136_p8_q4": {"ok": True}}}))
    both = tmp_path / "both"
    record.collect(rec_dir, rel_dir, scaling, both)
    mc = json.loads((both / "mma-check-h200.json").read_text())
    assert list(mc["mutants"]) == plan and mc["configs_not_run"] == [] and mc["ok"] is True
    assert mc["runs"] == [{"file": "mma_check.json", "configs": plan[:2]},
                          {"file": "mma_check-2.json", "configs": plan[2:]}]
    assert "mma_check-2.json completing it" in mc["note"] and record.incomplete_in(both) == []

    # a config run again: kept from the first run when the second came to the same outcome
    # (listed as repeated), refused when they disagree
    (rec_dir / "mma_check-3.json").write_text(json.dumps({
        "kernel_source_hash": h, "mutants": {"mma_m4_b64": {"ok": True, "clean_ok": True, "seen": 2}}}))
    (rec_dir / "mma_check.json").write_text(json.dumps({
        "kernel_source_hash": h, "mutants_planned": plan,
        "mutants": {"mma_m4_b64": {"ok": True, "clean_ok": True, "seen": 1}, "wgmma_m16_b64": {"ok": True}}}))
    again = tmp_path / "again3"
    record.collect(rec_dir, rel_dir, scaling, again)
    mc = json.loads((again / "mma-check-h200.json").read_text())
    assert mc["mutants"]["mma_m4_b64"]["seen"] == 1 and mc["configs_not_run"] == []
    assert mc["runs"][2] == {"file": "mma_check-3.json", "configs": [], "repeated": ["mma_m4_b64"]}
    (rec_dir / "mma_check-3.json").write_text(json.dumps({
        "kernel_source_hash": h, "mutants": {"mma_m4_b64": {"ok": True, "clean_ok": False}}}))
    with pytest.raises(ValueError, match="forces mma_m4_b64 again and comes to another outcome"):
        record.collect(rec_dir, rel_dir, scaling, tmp_path / "twice")
    (rec_dir / "mma_check-3.json").unlink()
    (rec_dir / "mma_check-2.json").write_text(json.dumps({
        "kernel_source_hash": "0" * 64, "mutants": {"wgspan_m4_b136_p8_q4": {"ok": True}}}))
    with pytest.raises(ValueError, match="mma_check-2.json is a run of kernel source 000000000000"):
        record.collect(rec_dir, rel_dir, scaling, tmp_path / "mixed")
    assert not (tmp_path / "twice").exists() and not (tmp_path / "mixed").exists()


def test_collect_names_the_command_that_made_the_kill_matrices(tmp_path):
    """mma-check-h200.json says how the script ran it: on two GPUs its mma_check has a
    sweep section, on one none (its kill matrices ran beside the
    sanitizers, and the timed sweep was left out)."""
    rec_dir, rel_dir, scaling = _device_outputs(tmp_path)
    record.collect(rec_dir, rel_dir, scaling, tmp_path / "two")
    two = json.loads((tmp_path / "two" / "mma-check-h200.json").read_text())
    assert two["command"] == record.MMA_CHECK_COMMAND and "GPUS=2" in two["command"]
    raw = json.loads((rec_dir / "mma_check.json").read_text())
    del raw["sweep"]
    (rec_dir / "mma_check.json").write_text(json.dumps(raw))
    record.collect(rec_dir, rel_dir, scaling, tmp_path / "one")
    one = json.loads((tmp_path / "one" / "mma-check-h200.json").read_text())
    assert "GPUS=1" in one["command"] and "sweep" not in one
    assert record.check_dir(tmp_path / "one", require=("mma-check-h200.json",)) == []


def test_collect_without_a_scaling_run_keeps_the_committed_one_carried(tmp_path, capsys):
    """One GPU only: --collect RECORDS RELIABILITY writes the seven one-GPU records and leaves
    the committed scaling record of an earlier kernel as it is; --check names it carried. A
    scaling JSON of an earlier kernel handed to --collect is refused: collected is this run."""
    rec_dir, rel_dir, _ = _device_outputs(tmp_path)
    out = tmp_path / "gpu"
    out.mkdir()
    old = record.stamp("scaling", "2x NVIDIA H200", {"runs": []}, True)
    old["kernel_source_hash"] = "cd" * 32
    (out / "scaling-h200x2.json").write_text(json.dumps(old) + "\n")
    before = (out / "scaling-h200x2.json").read_bytes()
    assert record.main(["--check", str(out), "--collect", str(rec_dir), str(rel_dir)]) == 0
    printed = capsys.readouterr().out
    assert "GPU records: 7 fresh and passing" in printed and "1 carried and passing" in printed
    assert "(kernel source " in printed and "; 7 on NVIDIA H200)" in printed  # the card that ran them
    assert record.devices_in(out) == "7 on NVIDIA H200" and record.devices_in(tmp_path / "none") == "none fresh"
    assert "scaling-h200x2.json: carried: a scaling run of kernel source cdcdcdcdcdcd" in printed
    assert (out / "scaling-h200x2.json").read_bytes() == before
    assert len(list(out.glob("*.json"))) == 8
    with pytest.raises(ValueError, match=r"scaling-h200x2\.json: carried: .* not a run of the "
                                         r"current kernel source"):
        record.collect(rec_dir, rel_dir, out / "scaling-h200x2.json", tmp_path / "other")
    assert not (tmp_path / "other").exists()
    with pytest.raises(SystemExit):
        record.main(["--collect", str(rec_dir)])
    assert "--collect takes RECORDS RELIABILITY [SCALING], got 1" in capsys.readouterr().err


def test_collect_refuses_stale_failing_or_missing_outputs_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "gpu"
    out.mkdir()
    (out / "h200.json").write_text("the committed record\n")
    # a run of another kernel source: every file it wrote is named stale
    rec_dir, rel_dir, scaling = _device_outputs(tmp_path / "stale", hash_="0" * 64)
    with pytest.raises(ValueError, match=r"^nothing written:(.|\n)*bench-h200\.json: stale"):
        record.collect(rec_dir, rel_dir, scaling, out)
    # a kill matrix with a survivor: mma-check is a failed record
    rec_dir, rel_dir, scaling = _device_outputs(tmp_path / "failing", mutants_ok=False)
    with pytest.raises(ValueError, match=r"mma-check-h200\.json: the recorded run failed"):
        record.collect(rec_dir, rel_dir, scaling, out)
    # the bench of the reliability run (the one collected) timed no peer
    rec_dir, rel_dir, scaling = _device_outputs(tmp_path / "alone")
    bench = json.loads((rel_dir / "bench-h200.json").read_text())
    bench["peers_available"] = {"sdpa": {"available": False, "reason": "torch not importable"}}
    (rel_dir / "bench-h200.json").write_text(json.dumps(bench))
    with pytest.raises(ValueError, match=r"bench-h200\.json: no peer ran in this bench "
                                         r"\(torch not importable\)"):
        record.collect(rec_dir, rel_dir, scaling, out)
    # the scaling record not there; an mma_check.json from before it carried the hash
    rec_dir, rel_dir, scaling = _device_outputs(tmp_path / "partial")
    with pytest.raises(ValueError, match=r"^scaling: .*missing"):
        record.collect(rec_dir, rel_dir, scaling.with_name("none.json"), out)
    raw = json.loads((rec_dir / "mma_check.json").read_text())
    del raw["kernel_source_hash"]
    (rec_dir / "mma_check.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"^records: .*mma_check\.json carries no kernel_source_hash"):
        record.collect(rec_dir, rel_dir, scaling, out)
    assert record.main(["--check", str(out), "--collect", str(rec_dir), str(rel_dir), str(scaling)]) == 1
    assert "not collected: records:" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["h200.json"]
    assert (out / "h200.json").read_text() == "the committed record\n"


def test_add_completes_the_committed_records_from_a_later_run_of_the_same_source(tmp_path, capsys):
    """--add: a torch record of the current source is written as it is; mma_check's JSON of
    the configs the committed kill-matrix record did not reach is merged into it (configs_not_run
    shrinks, the run is listed). Another source's run, a config held already, a failing kill
    matrix or a record that comes with a whole run is refused, and nothing is written."""
    from hipkernel import api

    rec_dir, rel_dir, scaling = _device_outputs(tmp_path)
    h = record.source_hash()
    (rec_dir / "mma_check.json").write_text(json.dumps({
        "kernel_source_hash": h, "mutants_planned": ["mma_m4_b64", "wgspan_m4_b136_p8_q4"],
        "mutants": {"mma_m4_b64": {"ok": True}}}))
    (rel_dir / "torch-h200.json").unlink()
    out = tmp_path / "gpu"
    record.collect(rec_dir, rel_dir, scaling, out)
    assert record.incomplete_in(out)

    torch_rec = record.stamp("torch", "NVIDIA H200", {"results": [], "checks": {}}, True,
                             kernel="hipkernel-torch")
    assert torch_rec["kernel_source_hash"] == api.torch_source_hash()
    (tmp_path / "torch-h200.json").write_text(json.dumps(torch_rec))
    (tmp_path / "more.json").write_text(json.dumps({
        "kernel_source_hash": h, "mutants": {"wgspan_m4_b136_p8_q4": {"ok": True}}}))
    assert record.main(["--check", str(out), "--add", str(tmp_path / "torch-h200.json"),
                        str(tmp_path / "more.json")]) == 0
    assert "wrote mma-check-h200.json, torch-h200.json" in capsys.readouterr().out
    mc = json.loads((out / "mma-check-h200.json").read_text())
    assert list(mc["mutants"]) == ["mma_m4_b64", "wgspan_m4_b136_p8_q4"] and mc["configs_not_run"] == []
    assert [r["file"] for r in mc["runs"]] == ["mma_check.json", "more.json"] and mc["ok"]
    assert record.incomplete_in(out) == [] and (out / "torch-h200.json").exists()

    before = {p.name: p.read_bytes() for p in out.iterdir()}
    refused = [({"kernel_source_hash": "0" * 64, "mutants": {"x": {"ok": True}}}, "a run of kernel source 000000000000"),
               ({"kernel_source_hash": h, "mutants": {"mma_m4_b64": {"ok": True, "clean_ok": False}}},
                "forces mma_m4_b64 again and comes to another outcome"),
               ({"kernel_source_hash": h, "mutants": {"y": {"ok": False}}}, "a kill matrix in it failed")]
    for doc, words in refused:
        (tmp_path / "bad.json").write_text(json.dumps(doc))
        with pytest.raises(ValueError, match=words):
            record.add([tmp_path / "bad.json"], out)
    (tmp_path / "h200.json").write_text((out / "h200.json").read_text())
    with pytest.raises(ValueError, match="h200.json is not one of"):
        record.add([tmp_path / "h200.json"], out)
    stale = dict(torch_rec, kernel_source_hash=h)
    (tmp_path / "torch-h200.json").write_text(json.dumps(stale))
    with pytest.raises(ValueError, match="stale"):
        record.add([tmp_path / "torch-h200.json"], out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
