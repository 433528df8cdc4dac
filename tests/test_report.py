"""`refattn report`: latest.json / latest.md / plots from real results, and the baseline diff.

The inputs are real: the CPU model is run over three small cases of the extended suite and
one contract case, and a small kill matrix is run on it (a few seconds). The GPU records are
stamped with the real kernel source hash by ``hipkernel.record.stamp``; their bodies reuse
the CPU run (matrix) or are written out by hand (measure, bench), since CI has no GPU.

Then a baseline is made from a clean report, and each regression the report must catch is
made by editing one input file; ``--check`` must fail naming it, and only it.
"""

from __future__ import annotations

import json
import shutil
import struct
import sys
import zlib
from pathlib import Path

import pytest

from refattn import report
from refattn.cases import load_suites
from refattn.cli import main
from refattn.kernels import get_kernel
from refattn.killmatrix import run_kill_matrix
from refattn.runner import run_matrix

CASES = ("ext-sink-sq1-past0", "ext-nosink-sq3-past37", "ext-sink-sq64-past1000-w1", "contract-d80")
MUTANTS = ("sink_ignored", "past_len_ignored", "gqa_modulo")
FIXTURE_DEVICE = "test fixture (CPU model run, not a GPU)"


def _write(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")


def _edit(path: Path, fn) -> None:
    doc = json.loads(path.read_text())
    fn(doc)
    _write(path, doc)


@pytest.fixture(scope="module")
def inputs_dir(tmp_path_factory) -> Path:
    """reports/-like directory from real runs: run-model.json, mutants-model.json, gpu/*.json."""
    from hipkernel import record

    d = tmp_path_factory.mktemp("reports")
    cases = [c for c in load_suites(["extended", "contracts"]) if c.name in CASES]
    assert len(cases) == len(CASES)
    m = run_matrix(get_kernel("model"), cases)
    assert m.ok, [r.summary for r in m.results]
    m.kernel_spec, m.kernel_source_hash = "model", record.source_hash()
    _write(d / "run-model.json", m.to_json())

    computed = [c for c in cases if c.suite == "extended"]
    km = run_kill_matrix(lambda mutants: get_kernel("model", mutants=mutants), computed, names=MUTANTS)
    assert km.ok, [(x.name, x.killed) for x in km.mutants]
    _write(d / "mutants-model.json", km.to_json())

    body = {"backend": "cuda", "arch": "sm_90", "suites": ["extended", "contracts"],
            "results": m.to_json()["results"], "autotune": {}}
    _write(d / "gpu" / "h200.json", record.stamp("matrix", FIXTURE_DEVICE, body, m.ok))
    per_call = [{"sq": 512, "past_len": p, "window": w, "sink": "per_head", "ms": ms, "tflops": 1.0}
                for p, w, ms in [(512, 128, 0.050), (8192, 128, 0.051), (15872, 128, 0.052),
                                 (8192, -1, 0.400), (15872, -1, 0.760)]]
    _write(d / "gpu" / "measure-h200.json", record.stamp("measure", FIXTURE_DEVICE, {
        "backend": "cuda", "per_call": per_call, "window128_flat_within_10pct": True,
        "window128_spread": 1.04}, True))
    _write(d / "gpu" / "bench-h200.json", record.stamp("bench", FIXTURE_DEVICE, {
        "rows": [{"case": "gptoss-past8192-w128", "kernel_ms": 0.05, "tflops": 150.0,
                  "peers": {"torch-sdpa": 0.10, "flex": {"ms": 0.075}}}]}, True))
    return d


@pytest.fixture
def no_matplotlib(monkeypatch):
    """Make ``import matplotlib`` fail, as on a machine without the plot extra."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def _report(capsys, in_dir: Path, *extra: str) -> tuple[int, str, dict]:
    rc = main(["report", "--in", str(in_dir), "--out", str(in_dir / "out"), *extra])
    out = capsys.readouterr().out
    doc = json.loads((in_dir / "out" / "latest.json").read_text())
    return rc, out, doc


@pytest.fixture
def with_baseline(inputs_dir, tmp_path, capsys, no_matplotlib) -> Path:
    """A copy of the inputs whose baseline.json is the clean report of those inputs."""
    d = tmp_path / "reports"
    shutil.copytree(inputs_dir, d)
    rc, out, _ = _report(capsys, d, "--update-baseline")
    assert rc == 0, out
    assert (d / "baseline.json").is_file()
    return d


# --------------------------------------------------------------------------- the clean report

def test_clean_report_summarises_real_results(inputs_dir, tmp_path, capsys, no_matplotlib):
    d = tmp_path / "reports"
    shutil.copytree(inputs_dir, d)
    assert _report(capsys, d, "--update-baseline")[0] == 0
    rc, out, doc = _report(capsys, d, "--check")
    line = doc["summary"]["line"]
    assert line == ("report: model extended 3/3 pass, contracts 1 declined; kill matrix (model) 3/3 killed; "
                    "GPU records 3 fresh; 0 regressions"), line
    assert out.splitlines()[0] == line
    assert rc == 0, out
    assert doc["schema"] == 1
    md = (d / "out" / "latest.md").read_text()
    assert md.splitlines()[0] == line
    row = next(r for r in doc["cases"] if r["case"] == "ext-nosink-sq3-past37" and r["kernel"] == "model")
    assert row["outcome"] == "pass" and 0 < row["rel_l2"] <= row["gate"]
    assert len(row["max_abs_at"]) == 4 and row["seed_gate_pass"] is True and row["time_s"] > 0
    at = "(" + ",".join(map(str, row["max_abs_at"])) + ")"
    assert f"| ext-nosink-sq3-past37 | pass | {row['rel_l2']:.2e} | {row['max_abs']:.2e} @ {at} |" in md
    assert "| contract-d80 | declined | - |" in md
    gpu = {g["file"]: g for g in doc["gpu_records"]}
    assert set(gpu) == {"gpu/h200.json", "gpu/measure-h200.json", "gpu/bench-h200.json"}
    assert all(g["freshness"] == "fresh" and g["device"] == FIXTURE_DEVICE for g in gpu.values())
    assert {r["kernel"] for r in doc["cases"]} == {"model", "hipkernel:cuda@h200"}
    ratios = {p["peer"]: p["ratio"] for p in doc["bench"][0]["rows"][0]["peers"]}
    assert ratios == pytest.approx({"torch-sdpa": 2.0, "flex": 1.5})
    assert "| gptoss-past8192-w128 | 0.05 ms | 150.0 | torch-sdpa | 0.1 ms | 2.00x |" in md
    assert [m["name"] for m in doc["kill_matrices"][0]["mutants"]] == list(MUTANTS)


def test_clean_baseline_passes_check(with_baseline, capsys, no_matplotlib):
    rc, out, doc = _report(capsys, with_baseline, "--check")
    assert rc == 0, out
    assert doc["baseline"]["present"] and doc["findings"] == []
    assert doc["summary"]["line"].endswith("; 0 regressions")


# --------------------------------------------------------------------------- regressions

def _case_failed(d: Path):
    def fn(doc):
        r = next(r for r in doc["results"] if r["case"] == "ext-nosink-sq3-past37")
        r["outcome"], doc["ok"] = "fail", False
    _edit(d / "run-model.json", fn)
    return "regression: case no longer passes: model extended/ext-nosink-sq3-past37: pass (relL2 "


def _rel_l2_tripled(d: Path):
    def fn(doc):
        r = next(r for r in doc["results"] if r["case"] == "ext-sink-sq1-past0")
        r["rel_l2"] *= 3
    _edit(d / "run-model.json", fn)
    return "regression: relL2 grew 3.0x: model extended/ext-sink-sq1-past0: "


def _mutant_survives(d: Path):
    def fn(doc):
        m = next(m for m in doc["mutants"] if m["name"] == "sink_ignored")
        m["killed"], m["killed_by"], m["killed_by_seed_gate"], doc["ok"] = False, [], [], False
    _edit(d / "mutants-model.json", fn)
    return "regression: mutant survives: kill matrix model / sink_ignored: killed by "


def _gpu_stale(d: Path):
    _edit(d / "gpu" / "h200.json", lambda doc: doc.update(kernel_source_hash="0" * 64))
    return (f"regression: GPU record stale: gpu/h200.json (matrix, {FIXTURE_DEVICE}): "
            "recorded for kernel source 000000000000 -> current kernel source ")


def _bench_worse(d: Path):
    _edit(d / "gpu" / "bench-h200.json", lambda doc: doc["rows"][0]["peers"].update({"torch-sdpa": 0.08}))
    return ("regression: bench ratio worse by 20%: gpu/bench-h200.json gptoss-past8192-w128 vs torch-sdpa: "
            "2.00x -> 1.60x")


def _gpu_failing(d: Path):
    def fn(doc):
        doc["ok"] = False
        doc["results"][0]["outcome"] = "fail"
    _edit(d / "gpu" / "h200.json", fn)
    return ["regression: GPU record failing: gpu/h200.json (matrix, ",
            "regression: case no longer passes: hipkernel:cuda@h200 extended/ext-sink-sq1-past0: pass "]


def _case_declined(d: Path):
    def fn(doc):
        r = next(r for r in doc["results"] if r["case"] == "ext-sink-sq64-past1000-w1")
        r.update(outcome="declined", rel_l2=None, note="declined (status -1), output buffer untouched")
    _edit(d / "run-model.json", fn)
    return ("regression: case no longer passes: model extended/ext-sink-sq64-past1000-w1: pass (relL2 ",
            "-> declined (declined (status -1), output buffer untouched)")


@pytest.mark.parametrize("regress", [_case_failed, _rel_l2_tripled, _mutant_survives, _gpu_stale,
                                     _bench_worse, _gpu_failing, _case_declined],
                         ids=lambda f: f.__name__.strip("_"))
def test_check_names_each_regression(with_baseline, capsys, no_matplotlib, regress):
    expected = regress(with_baseline)
    expected = expected if isinstance(expected, list) else [expected]
    rc, out, doc = _report(capsys, with_baseline, "--check")
    assert rc == 1, out
    lines = [line.strip() for line in out.splitlines() if line.startswith("  ")]
    for want in expected:
        if isinstance(want, tuple):  # (start, end) of one line
            assert any(line.startswith(want[0]) and line.endswith(want[1]) for line in lines), out
        else:
            assert any(line.startswith(want) for line in lines), f"expected {want!r} in:\n{out}"
    regressions = [f for f in doc["findings"] if f["kind"] == "regression"]
    assert len(regressions) == len(expected) and len(doc["findings"]) == len(expected), doc["findings"]
    n = len(expected)
    assert f"; {n} regression{'s' * (n > 1)}" in doc["summary"]["line"]
    md = (with_baseline / "out" / "latest.md").read_text()
    for f in regressions:
        assert f"- {f['line']}" in md


def test_an_equivalent_mutant_may_survive(with_baseline, capsys, no_matplotlib):
    def fn(doc):
        m = next(m for m in doc["mutants"] if m["name"] == "sink_ignored")
        m.update(killed=False, killed_by=[], killed_by_seed_gate=[], equivalent="no fp16 output can show it")
    _edit(with_baseline / "mutants-model.json", fn)
    rc, out, doc = _report(capsys, with_baseline, "--check")
    assert rc == 0, out
    assert "kill matrix (model) 2/2 killed, 1 equivalent" in doc["summary"]["line"]
    md = (with_baseline / "out" / "latest.md").read_text()
    assert "| sink_ignored | equivalent | misses |" in md


def test_small_changes_are_not_regressions(with_baseline, capsys, no_matplotlib):
    def slower_but_within(doc):
        r = next(r for r in doc["results"] if r["case"] == "ext-sink-sq1-past0")
        r["rel_l2"] *= 1.9  # below the 2x growth limit
    _edit(with_baseline / "run-model.json", slower_but_within)
    # ratio 2.0 -> 1.8: 10 % worse, below the 15 % limit
    _edit(with_baseline / "gpu" / "bench-h200.json",
          lambda doc: doc["rows"][0]["peers"].update({"torch-sdpa": 0.09}))
    rc, out, doc = _report(capsys, with_baseline, "--check")
    assert rc == 0, out
    assert doc["findings"] == []


def test_without_check_regressions_are_reported_but_exit_zero(with_baseline, capsys, no_matplotlib):
    _gpu_stale(with_baseline)
    rc, out, doc = _report(capsys, with_baseline)
    assert rc == 0
    assert "regression: GPU record stale" in out
    assert "GPU records 2 fresh, 1 stale" in doc["summary"]["line"]


def test_a_scaling_record_of_an_earlier_kernel_is_carried_and_must_still_pass(
        with_baseline, capsys, no_matplotlib):
    """A two-GPU scaling record outlives a kernel edit (hipkernel.record.CARRIED_KINDS): it is
    reported as carried, not stale; a failing one is still a regression."""
    from hipkernel import record

    path = with_baseline / "gpu" / "scaling-h200x2.json"
    rec = record.stamp("scaling", "2x " + FIXTURE_DEVICE, {"runs": []}, True)
    rec["kernel_source_hash"] = "0" * 64
    _write(path, rec)
    rc, out, doc = _report(capsys, with_baseline, "--check")
    assert rc == 0, out
    assert "GPU records 3 fresh, 1 carried" in doc["summary"]["line"]
    g = next(g for g in doc["gpu_records"] if g["file"] == "gpu/scaling-h200x2.json")
    assert (g["freshness"], g["problems"]) == ("carried", [])
    md = (with_baseline / "out" / "latest.md").read_text()
    assert "| gpu/scaling-h200x2.json | scaling | 2x " in md and "| 000000000000 | carried |" in md
    _edit(path, lambda doc: doc.update(ok=False))
    rc, out, doc = _report(capsys, with_baseline, "--check")
    assert rc == 1
    assert "regression: GPU record failing: gpu/scaling-h200x2.json (scaling, 2x " in out


# --------------------------------------------------------------------------- no baseline, bad inputs

def test_a_record_whose_kernel_cannot_be_built_here_is_unverifiable(with_baseline, capsys, monkeypatch,
                                                                    no_matplotlib):
    """Freshness comes from the record's own kernel: where it cannot be built (not installed),
    the record cannot be told fresh from stale, and --check says so instead of passing it."""
    for mod in ("hipkernel.adapter", "hipkernel.api"):
        monkeypatch.setitem(sys.modules, mod, None)  # as where hipkernel is not installed
    rc, out, doc = _report(capsys, with_baseline, "--check")
    assert rc == 1, out
    assert {g["freshness"] for g in doc["gpu_records"]} == {"unknown"}
    assert all(g["current_source_hash"] is None for g in doc["gpu_records"])
    assert "GPU records 0 fresh, 3 unknown" in doc["summary"]["line"]
    assert "failure: GPU record unverifiable: gpu/h200.json: freshness unknown: kernel hipkernel" in out


def test_without_baseline_the_check_fails_and_lists_the_current_failures(inputs_dir, tmp_path, capsys,
                                                                       no_matplotlib):
    """No baseline is no pass: a typo in --baseline must not turn --check green. The current
    failures are still listed; a relL2 change is not (there is nothing to compare it with)."""
    d = tmp_path / "reports"
    shutil.copytree(inputs_dir, d)
    _rel_l2_tripled(d)
    rc, out, doc = _report(capsys, d, "--check")
    assert rc == 1, out
    assert f"failure: baseline missing: {d / 'baseline.json'}: no such file (make one with --update-baseline)" in out
    assert "no baseline at" in out and "no baseline" in doc["summary"]["line"]
    assert doc["summary"]["line"].endswith("0 regressions (no baseline), 1 failure")
    _case_failed(d)
    rc, out, doc = _report(capsys, d, "--check")
    assert rc == 1
    assert "failure: case fails: model extended/ext-nosink-sq3-past37: no baseline -> fail (relL2 " in out
    assert doc["summary"]["line"].endswith("0 regressions (no baseline), 2 failures")


def test_missing_inputs_are_reported_and_fail_the_check(tmp_path, capsys, no_matplotlib):
    rc, out, doc = _report(capsys, tmp_path, "--check")
    assert rc == 1, out
    assert doc["summary"]["line"] == ("report: no CPU runs; no kill matrix; no GPU records; "
                                      "0 regressions (no baseline), 2 failures")
    assert "  failure: input missing: CPU run files: no" in out and "failure: baseline missing" in out
    md = (tmp_path / "out" / "latest.md").read_text()
    assert "missing: CPU run files: no" in md
    for what in ("not present: kill matrices: no", "not present: GPU records: no", "not present: fuzz runs: no"):
        assert what in md  # optional: a kernel may implement no mutants; the baseline guards them


def test_unreadable_input_is_a_failure(inputs_dir, tmp_path, capsys, no_matplotlib):
    d = tmp_path / "reports"
    shutil.copytree(inputs_dir, d)
    (d / "run-broken.json").write_text("{not json")
    (d / "gpu" / "notes.json").write_text('{"hello": 1}')
    rc, out, doc = _report(capsys, d, "--check")
    assert rc == 1
    assert "failure: unreadable input: run-broken.json: JSONDecodeError" in out
    assert "failure: unreadable input: gpu/notes.json: not a GPU record (no 'kind' field)" in out
    assert "model extended 3/3 pass" in doc["summary"]["line"]  # the readable files still count


def test_baseline_is_updated_only_on_request(inputs_dir, tmp_path, capsys, no_matplotlib):
    d = tmp_path / "reports"
    shutil.copytree(inputs_dir, d)
    base = tmp_path / "elsewhere" / "baseline.json"
    rc, out, _ = _report(capsys, d, "--baseline", str(base))
    assert rc == 0 and not base.exists()
    rc, out, _ = _report(capsys, d, "--baseline", str(base), "--update-baseline")
    assert rc == 0
    assert f"report: baseline updated: copied {d / 'out' / 'latest.json'} to {base}" in out
    assert base.read_bytes() == (d / "out" / "latest.json").read_bytes()


def test_a_baseline_of_another_schema_is_a_usage_error(inputs_dir, tmp_path, capsys, no_matplotlib):
    d = tmp_path / "reports"
    shutil.copytree(inputs_dir, d)
    (d / "baseline.json").write_text('{"schema": 2}')
    assert main(["report", "--in", str(d), "--out", str(d / "out")]) == 2
    assert "not a schema-1 report" in capsys.readouterr().err


# --------------------------------------------------------------------------- plots

def test_renders_without_matplotlib_and_says_so(inputs_dir, tmp_path, capsys, no_matplotlib):
    d = tmp_path / "reports"
    shutil.copytree(inputs_dir, d)
    (d / "out" / "plots").mkdir(parents=True)
    (d / "out" / "plots" / "rel_l2-model.png").write_bytes(b"stale plot of an earlier run")
    rc, out, doc = _report(capsys, d)
    assert rc == 0
    md = (d / "out" / "latest.md").read_text()
    assert "plots skipped: matplotlib not installed (pip install refattn[plot])" in md
    assert "plots skipped: matplotlib not installed" in out
    assert doc["plots"]["written"] == [] and not list((d / "out" / "plots").glob("*.png"))


def _assert_png(path: Path) -> None:
    """A complete PNG: signature, a valid IHDR with nonzero size, chunk CRCs, IEND last."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name}: not a PNG"
    pos, chunks = 8, []
    while pos < len(data):
        (n,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body, crc = data[pos + 8:pos + 8 + n], data[pos + 8 + n:pos + 12 + n]
        assert struct.unpack(">I", crc)[0] == zlib.crc32(kind + body), f"{path.name}: bad CRC in {kind}"
        chunks.append((kind, body))
        pos += 12 + n
    assert chunks[0][0] == b"IHDR" and chunks[-1][0] == b"IEND", f"{path.name}: truncated"
    w, h = struct.unpack(">II", chunks[0][1][:8])
    assert w > 100 and h > 100, f"{path.name}: {w}x{h}"
    assert sum(len(b) for k, b in chunks if k == b"IDAT") > 1000, f"{path.name}: nearly empty"


def test_plots_are_valid_pngs(inputs_dir, tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the plot extra (pip install refattn[plot]) is not installed")
    d = tmp_path / "reports"
    shutil.copytree(inputs_dir, d)
    rc, out, doc = _report(capsys, d)
    assert rc == 0
    plots = d / "out" / "plots"
    worst = max((r for r in doc["cases"] if r["kernel"] == "model" and r["rel_l2"] is not None),
                key=lambda r: r["rel_l2"])
    want = {"rel_l2-model.png", "rel_l2-hipkernel_cuda_h200.png", "time_vs_past-measure-h200.png",
            f"error_heatmap-{worst['case']}.png", "kill_matrix-model.png"}
    assert {p.name for p in plots.glob("*.png")} == want, doc["plots"]
    for p in plots.glob("*.png"):
        _assert_png(p)
    md = (d / "out" / "latest.md").read_text()
    for name in want:
        assert f"(plots/{name})" in md
    assert "plots skipped" not in md


def test_heatmap_is_skipped_for_an_expensive_case():
    case = next(c for c in load_suites(["seed"]) if c.name == "gptoss-nosink-past8192")
    assert case.flops > report.HEATMAP_MAX_FLOPS
    params = {**case.to_dict(), "describe": case.describe()}
    row = {"kernel": "model", "case": case.name, "rel_l2": 2e-4}
    err, _, note = report.heatmap_error(row, params)
    assert err is None
    assert note.startswith(f"error heatmap skipped: the largest relL2 is gptoss-nosink-past8192 "
                           f"({case.flops:.1e} FLOPs >= 5e+09)")


def test_report_is_a_refattn_subcommand(capsys):
    assert main(["report", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--in", "--out", "--baseline", "--check", "--update-baseline", "exit status"):
        assert option in out


def test_a_torch_entry_record_adds_its_cases_and_its_host_path(inputs_dir, tmp_path, capsys, no_matplotlib):
    """hipkernel.torch_bench's record (kind torch): its case matrix joins the cases under its
    own kernel label, and its checks and host-path timings get a section."""
    from hipkernel import record

    d = tmp_path / "reports"
    shutil.copytree(inputs_dir, d)
    matrix = json.loads((d / "gpu" / "h200.json").read_text())
    host = [{"sq": 512, "past_len": 8192, "window": 128, "sink": "per_head", "kernel_ms": 0.0124,
             "burst_ms_per_call": 0.0131, "host_overhead_us": 0.7, "host_enqueue_us": 9.0,
             "target_us": 10.0, "hit": True},
            {"sq": 1, "past_len": 8192, "window": -1, "sink": "per_head", "kernel_ms": 0.004,
             "burst_ms_per_call": 0.0168, "host_overhead_us": 12.8, "host_enqueue_us": 16.0,
             "target_us": 10.0, "hit": False}]
    body = {"backend": "cuda", "results": matrix["results"],
            "checks": {"stream": {"ok": True}, "graph": {"ok": True}, "compile": {"ok": False}},
            "host": host, "chunked_16k": {"warm_over_kernels": 1.08, "target_over_kernels": 1.15,
                                          "cold_over_warm": 1.3, "target_cold_over_warm": 1.1}}
    _write(d / "gpu" / "torch-h200.json", record.stamp("torch", FIXTURE_DEVICE, body, False,
                                                        kernel="hipkernel-torch"))
    rc, out, doc = _report(capsys, d)
    assert "hipkernel-torch:cuda@torch-h200" in {r["kernel"] for r in doc["cases"]}
    (h,) = doc["host_path"]
    assert h["checks"] == {"stream": True, "graph": True, "compile": False}
    assert [r["overhead_us"] for r in h["host"]] == [0.7, 12.8]
    md = (d / "out" / "latest.md").read_text()
    assert "checks: stream ok, graph ok, compile **FAILED**" in md
    assert "| 512 | 8192 | 128 | 0.0124 ms | 0.0131 ms | 0.7 us | <= 10 us: hit |" in md
    assert "| 1 | 8192 | full | 0.004 ms | 0.0168 ms | 12.8 us | <= 10 us: **miss** |" in md
    assert "Chunked 16k prefill: 1.080x the sum of its kernels (target 1.15), cold 1.300x warm (target 1.1)." in md
    g = next(g for g in doc["gpu_records"] if g["file"] == "gpu/torch-h200.json")
    assert g["ok"] is False and g["freshness"] == "fresh"
