"""The committed GPU records (reports/gpu/) must match the current kernel source and pass.

CI has no GPU: this is how "works on GPU" stays backed by a run of the code as it is. A
kernel edit without a fresh H200 run makes this test fail with the stale file named."""

import copy
import json
from pathlib import Path

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
