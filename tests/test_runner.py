"""The runner's verdicts on kernels with known behaviour, the reference cache, the registry."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from refattn import kernels as K
from refattn.cases import Case, make_inputs
from refattn.runner import InputCache, ReferenceCache, run_case, run_matrix
from tests import helpers_kernels as H


def _case(name="t-sink", **kw):
    base = dict(name=name, Hq=4, Hkv=2, d=16, sq=40, past_len=24, sink="per_head", why="test")
    base.update(kw)
    return Case(**base)


SINK = _case()
PLAIN = _case("t-plain", sink="none", window=9)
BF16 = _case("t-bf16", dtype="bf16")


# ------------------------------------------------------------------ verdicts

def test_correct_kernel_passes_with_every_field_filled():
    r = run_case(H.CorrectKernel(), SINK)
    assert r.outcome == "pass" and r.acceptable and r.status == 0 and r.supported
    assert 0 < r.rel_l2 <= r.gate and r.max_abs <= r.gate_max_abs
    assert r.seed_gate_pass and r.baseline_rel_l2 > 0 and r.n_nan == 0
    assert len(r.max_abs_at) == 4 and r.time_s >= 0 and r.note == ""
    assert r.summary.startswith("PASS") and r.comparison.passed
    assert r.params["describe"] == SINK.describe() and r.params["sink"] == "per_head"


def test_ignoring_the_sink_fails_with_a_located_message():
    r = run_case(H.WrongSinkKernel(), SINK)
    assert r.outcome == "fail" and not r.acceptable
    assert r.rel_l2 > r.gate
    msg = r.failure_message()
    assert "adhoc/t-sink" in msg and "Mismatched elements" in msg
    assert "(b, h, row, col)" in msg and "relL2" in msg and "seed gate" in msg
    # the same bug is invisible on a case without a sink: the case matrix must have one
    assert run_case(H.WrongSinkKernel(), PLAIN).outcome == "pass"


def test_reading_the_cache_padding_hits_the_nan_canaries():
    r = run_case(H.TailReadingKernel(), SINK)
    assert r.outcome == "fail" and r.n_nan > 0
    assert "nan/inf location mismatch" in r.failure_message()


def test_polite_decline_is_declined():
    r = run_case(H.PoliteDecliner(), SINK)
    assert r.outcome == "declined" and r.acceptable and r.status == -1 and r.supported is False
    assert r.rel_l2 is None and r.comparison is None


def test_decliner_that_touches_the_buffer_violates_the_contract():
    r = run_case(H.TouchyDecliner(), SINK)
    assert r.outcome == "contract-violation" and not r.acceptable
    assert "touched the output buffer" in r.note


def test_returning_zero_on_an_unsupported_case_violates_the_contract():
    r = run_case(H.LiarKernel(), SINK)
    assert r.outcome == "contract-violation"
    assert "returned 0 on a case it declares unsupported" in r.note and "wrote the output buffer" in r.note


def test_declining_a_supported_case_fails():
    r = run_case(H.ReluctantKernel(), SINK)
    assert r.outcome == "fail" and r.note == "declined a case it claims to support"


def test_exceptions_are_errors_with_the_text():
    r = run_case(H.RaisingKernel(), SINK)
    assert r.outcome == "error" and not r.acceptable
    assert "RuntimeError: boom: device lost" in r.note and "boom" in r.failure_message()


def test_wrong_shape_and_unknown_status():
    r = run_case(H.WrongShapeKernel(), SINK)
    assert r.outcome == "fail" and "(1, 40, 4, 16)" in r.note and "(1, 4, 40, 16)" in r.note
    r = run_case(H.StatusTwoKernel(), SINK)
    assert r.outcome == "contract-violation" and "status 2" in r.note


def test_unsupported_dtype_is_declined_by_a_fp16_kernel():
    assert run_case(H.CorrectKernel(), BF16).outcome == "declined"


def test_seed_contract_is_recorded_and_the_case_compared():
    c = _case("t-d128", d=128, seed_contract="decline")
    r = run_case(H.CorrectKernel(), c)
    assert r.outcome == "pass" and r.seed_contract == "decline"
    assert "seed kernel declined" in r.note


def test_reference_kernel_passes_and_keeps_fp32():
    ref = K.get_kernel("reference")
    r = run_case(ref, SINK)
    assert r.outcome == "pass" and r.rel_l2 < 1e-6
    assert run_case(ref, BF16).outcome == "pass"  # the reference supports every case
    from refattn.cases import make_inputs

    status, out = ref.run(make_inputs(SINK))
    assert status == 0 and out.dtype == np.float32
    assert K.get_kernel("reference:fp64").run(make_inputs(SINK))[1].dtype == np.float64


# ------------------------------------------------------------------ matrix and JSON

def test_matrix_result_ok_progress_and_json_shape():
    calls = []
    m = run_matrix(H.CorrectKernel(), [SINK, PLAIN, BF16],
                   progress=lambda i, n, case, res: calls.append((i, n, case.name, res and res.outcome)))
    assert m.ok and m.kernel == "correct" and m.suites == ["adhoc"]
    assert calls == [(0, 3, "t-sink", None), (0, 3, "t-sink", "pass"), (1, 3, "t-plain", None),
                     (1, 3, "t-plain", "pass"), (2, 3, "t-bf16", None), (2, 3, "t-bf16", "declined")]
    doc = json.loads(json.dumps(m.to_json(), allow_nan=False))
    assert doc["schema"] == 1 and doc["kernel"] == "correct" and doc["ok"] is True
    assert {"suites", "started", "elapsed_s", "host", "counts"} <= set(doc)
    assert [r["case"] for r in doc["results"]] == ["t-sink", "t-plain", "t-bf16"]
    first = doc["results"][0]
    for key in ("outcome", "rel_l2", "max_abs", "max_abs_at", "gate", "gate_max_abs",
                "seed_gate_pass", "baseline_rel_l2", "n_nan", "time_s", "note", "summary"):
        assert key in first, key
    assert isinstance(first["rel_l2"], float) and len(first["max_abs_at"]) == 4
    assert doc["results"][2]["rel_l2"] is None and doc["counts"]["declined"] == 1


def test_matrix_not_ok_when_one_case_fails_and_nan_is_json_null():
    m = run_matrix(H.TailReadingKernel(), [SINK, BF16])
    assert not m.ok and [r.outcome for r in m.results] == ["fail", "declined"]
    assert [r.case for r in m.failures()] == ["t-sink"]
    doc = json.loads(json.dumps(m.to_json(), allow_nan=False))
    assert doc["ok"] is False and doc["results"][0]["rel_l2"] is None and doc["results"][0]["n_nan"] > 0


# ------------------------------------------------------------------ reference cache

def test_reference_is_computed_once_per_case():
    cache = ReferenceCache()
    for kern in (H.CorrectKernel(), H.WrongSinkKernel(), H.CorrectKernel()):
        run_case(kern, SINK, cache=cache)
    assert (cache.misses, cache.hits, len(cache)) == (1, 2, 1)
    run_case(H.PoliteDecliner(), PLAIN, cache=cache)  # a decline needs no reference
    assert cache.misses == 1
    ref, base = cache.get(SINK)
    assert ref.dtype == np.float64 and base.dtype == np.float16
    assert not ref.flags.writeable and not base.flags.writeable


def test_reference_cache_evicts_to_its_byte_budget():
    one = 40 * 4 * 16 * (8 + 2)  # fp64 reference + fp16 baseline of one case
    cache = ReferenceCache(budget_bytes=one)
    cache.get(SINK)
    cache.get(_case("t-other"))
    assert len(cache) == 1 and cache.nbytes == one
    cache.get(SINK)
    assert cache.misses == 3


class _InputWriter(H.CorrectKernel):
    """Scales q in place before computing (a kernel that treats its inputs as scratch)."""

    name = "input-writer"

    def compute(self, inputs):
        inputs.q *= 2
        return super().compute(inputs)


def test_inputs_are_built_once_a_case_and_no_kernel_can_change_them():
    inputs, refs = InputCache(), ReferenceCache()
    kernels = (H.CorrectKernel(), _InputWriter(), H.WrongSinkKernel(), H.CorrectKernel())
    results = [run_case(k, SINK, cache=refs, input_cache=inputs) for k in kernels]
    assert [r.outcome for r in results] == ["pass", "error", "fail", "pass"]
    assert "read-only" in results[1].note  # the write raised; the next kernels saw clean q
    assert results[3].rel_l2 == results[0].rel_l2
    assert (inputs.misses, inputs.hits, len(inputs)) == (1, 3, 1)
    a, b = inputs.get(SINK), inputs.get(SINK)
    assert a.q is b.q and not a.q.flags.writeable and not a.k.flags.writeable
    assert a.out is not b.out and a.out.flags.writeable and a.out_intact()
    fresh = make_inputs(SINK)
    for name in ("q", "k", "v", "sink"):  # the cached arrays are make_inputs', bit for bit
        assert getattr(a, name).tobytes() == getattr(fresh, name).tobytes()


def test_input_cache_evicts_to_its_byte_budget():
    one = (40 * 4 * 16 + 2 * 2 * SINK.s_cap * 16) * 2 + 4 * 2  # q, k, v (fp16) and sink
    cache = InputCache(budget_bytes=one)
    cache.get(SINK)
    assert len(cache) == 1 and cache.nbytes == one
    cache.get(_case("t-other"))
    assert len(cache) == 1 and cache.nbytes == one
    cache.get(SINK)
    assert cache.misses == 3


@pytest.mark.parametrize("cls, env", [(ReferenceCache, "REFATTN_REF_CACHE_MB"),
                                      (InputCache, "REFATTN_INPUT_CACHE_MB")], ids=["ref", "input"])
def test_cache_budgets_are_checked(monkeypatch, cls, env):
    for bad in ("1GB", "-1", "nan", "inf"):
        monkeypatch.setenv(env, bad)
        with pytest.raises(ValueError, match=rf"^{env}: expected a number of MB >= 0 .*got '{bad}'"):
            cls()
    monkeypatch.setenv(env, "0.5")
    assert cls().budget == 2**19
    monkeypatch.setenv(env, "0")  # keeps nothing: every get builds anew
    cache = cls()
    cache.get(SINK), cache.get(SINK)
    assert (cache.misses, len(cache)) == (2, 0)
    with pytest.raises(ValueError, match=r"^budget_bytes: expected an int >= 0, got -1"):
        cls(budget_bytes=-1)


def test_cli_reports_a_bad_cache_budget_in_one_line(tmp_path):
    """A fresh process (the caches are built when refattn.runner is imported): exit 2, one
    line on stderr, no traceback, nothing run."""
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from refattn.cli import main; sys.exit(main())",
         "run", "--kernel", "reference", "--suite", "seed", "-k", "gptoss-sink-past0",
         "--json", str(tmp_path / "r.json")],
        cwd=root, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(root), "REFATTN_INPUT_CACHE_MB": "1GB"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "refattn run: error: REFATTN_INPUT_CACHE_MB: expected a number of MB >= 0 (0: keep "
        "nothing), got '1GB'"]
    assert not (tmp_path / "r.json").exists()


# ------------------------------------------------------------------ registry

def test_registry_lists_the_tree_entry_points():
    """From a source tree the pyproject's entry points stand in for installed ones."""
    entries = K.available_kernels()
    assert {"reference", "model", "hipkernel"} <= set(entries)
    assert entries["reference"].importable and entries["reference"].error is None
    assert entries["hipkernel"].requires_gpu and not entries["reference"].requires_gpu


def _kernel_package_references(path) -> list[str]:
    """Where the module at ``path`` imports hipkernel, or holds a string naming one of its
    modules (``"hipkernel.api"``, ``"hipkernel.adapter:HipKernel"``) outside a docstring."""
    import ast
    import re

    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import) and any(a.name.split(".")[0] == "hipkernel" for a in n.names):
            found.append(f"{path.name}:{n.lineno}: import")
        elif isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "hipkernel":
            found.append(f"{path.name}:{n.lineno}: from-import")
        elif (isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
              and re.search(r"\bhipkernel\.[a-z_]+", n.value)):
            found.append(f"{path.name}:{n.lineno}: {n.value[:60]!r}")
    return found


def test_refattn_imports_no_kernel_package():
    """refattn finds every kernel through entry points: none of its modules imports
    hipkernel, by name or by a module path in a string."""
    import pathlib

    pkg = pathlib.Path(K.__file__).parent
    assert [r for f in sorted(pkg.rglob("*.py")) for r in _kernel_package_references(f)] == []


def _only(monkeypatch, tree: dict) -> None:
    """The registry sees exactly ``tree`` (name -> target) besides the built-in reference."""
    monkeypatch.setattr(K.importlib.metadata, "entry_points", lambda group: ())
    monkeypatch.setattr(K, "_tree_entry_points", lambda: dict(tree))


def test_registry_reports_an_entry_that_fails_to_import(monkeypatch):
    _only(monkeypatch, {"ghost": "refattn._no_such_module:Ghost"})
    entry = K.available_kernels()["ghost"]
    assert not entry.importable and "cannot import refattn._no_such_module:Ghost" in entry.error
    assert "ModuleNotFoundError" in entry.error and not entry.requires_gpu
    with pytest.raises(K.KernelError, match=r"kernel: 'ghost' is unavailable: cannot import"):
        K.get_kernel("ghost")


def test_unknown_kernel_names_the_argument_and_lists_known():
    with pytest.raises(ValueError, match=r"^kernel: unknown kernel 'nope'; known: .*model.*reference"):
        K.get_kernel("nope")
    with pytest.raises(K.KernelError, match=r"kernel: unknown reference variant 'fp8'"):
        K.get_kernel("reference:fp8")


def test_import_path_form_with_variant():
    k = K.get_kernel("tests.helpers_kernels:WrongSinkKernel")
    assert type(k).__name__ == "WrongSinkKernel" and k.name == "wrong-sink"
    k = K.get_kernel("tests.helpers_kernels:CorrectKernel:v2")
    assert k.variant == "v2" and k.name == "correct:v2"
    with pytest.raises(K.KernelError, match=r"cannot import tests.helpers_kernels:Nope"):
        K.get_kernel("tests.helpers_kernels:Nope")


def test_kernel_available_normalises_the_probe():
    assert K.kernel_available(H.CorrectKernel()) == (True, "")
    assert K.kernel_available(H.UnavailableKernel()) == (False, "no device in this test")


def test_best_kernel_prefers_an_available_gpu_kernel_and_says_why(monkeypatch):
    _only(monkeypatch, {"gpuk": "tests.helpers_kernels:UnavailableGpuKernel",
                        "cpuk": "tests.helpers_kernels:CorrectKernel"})
    name, why = K.best_kernel()
    assert name == "cpuk" and "no GPU kernel is available here" in why and "no device in this test" in why
    _only(monkeypatch, {"gpuk": "tests.helpers_kernels:AvailableGpuKernel",
                        "cpuk": "tests.helpers_kernels:CorrectKernel"})
    name, why = K.best_kernel()
    assert name == "gpuk" and why.startswith("a GPU kernel")
    _only(monkeypatch, {})
    assert K.best_kernel()[0] == "reference"


def test_a_peer_is_never_the_default_kernel(monkeypatch):
    _only(monkeypatch, {"apeer": "tests.helpers_kernels:AvailableGpuPeer",
                        "cpuk": "tests.helpers_kernels:CorrectKernel"})
    assert K.available_kernels()["apeer"].peer and not K.available_kernels()["cpuk"].peer
    assert K.best_kernel()[0] == "cpuk"
    _only(monkeypatch, {"apeer": "tests.helpers_kernels:AvailableGpuPeer"})
    assert K.best_kernel()[0] == "reference"


def test_a_decline_carries_the_adapters_reason_on_one_line():
    from refattn.cases import case_from_text

    k = H.ReasonedDeclineKernel()
    m = run_matrix(k, [case_from_text("Hq = 2, Hkv = 1, d = 96, sq = 3"),
                       case_from_text("Hq = 2, Hkv = 1, d = 64, sq = 3")])
    declined, passed = m.results
    assert declined.outcome == "declined" and passed.outcome == "pass"
    assert declined.note == ("declined (status -1), output buffer untouched: head dim 96 is not "
                             "built (only 64)")
    assert passed.note == ""


def test_the_run_json_records_the_adapters_facts_and_refuses_bad_ones(capsys, tmp_path):
    from refattn import cli

    out = tmp_path / "run.json"
    code = cli.main(["run", "--kernel", "tests.helpers_kernels:ReasonedDeclineKernel", "-q",
                     "--case", "Hq = 2, Hkv = 1, d = 64, sq = 3", "--json", str(out)])
    assert code == 0, capsys.readouterr()
    doc = json.loads(out.read_text())
    assert doc["kernel_facts"] == {"library": "libreasoned 1.0", "threads": 2, "providers": ["cpu", "gpu"]}

    class Bad:
        name = "bad"

        def facts(self):
            return {"x": object()}

    with pytest.raises(K.KernelError, match="'bad': facts\\(\\) must return a dict"):
        K.kernel_facts(Bad())
    assert K.kernel_facts(object()) is None


def test_requires_gpu_is_answered_per_variant_where_a_factory_can():
    class PerVariant:
        requires_gpu = False

        @staticmethod
        def variant_requires_gpu(variant):
            return variant.endswith(".device")

    e = K.KernelEntry("pv", "x:PerVariant", "import path", factory=PerVariant)
    assert e.requires_gpu_for("spec.device") and not e.requires_gpu_for("spec.host")
    assert not e.requires_gpu_for(None)
    plain = K.KernelEntry("p", "x:P", "import path", factory=H.AvailableGpuKernel)
    assert plain.requires_gpu_for("anything") and plain.requires_gpu_for(None)


def test_tile_sizes_are_read_from_the_class_and_checked():
    class Tiled:
        name = "tiled"

        @staticmethod
        def tile_sizes():
            return {"q": [64, 16, 64], "kv": (128, 32)}

    assert K.kernel_tile_sizes(Tiled) == {"q": (16, 64), "kv": (32, 128)}
    assert K.kernel_tile_sizes(object) is None

    class Bad(Tiled):
        @staticmethod
        def tile_sizes():
            return {"q": [1.5], "kv": [32]}

    class Missing(Tiled):
        @staticmethod
        def tile_sizes():
            return {"q": [16]}

    for bad in (Bad, Missing):
        with pytest.raises(K.KernelError, match="'tiled': tile_sizes\\(\\) must return"):
            K.kernel_tile_sizes(bad)


def test_a_kernel_that_needs_a_variant_is_never_the_default_nor_named_as_skipped(monkeypatch):
    class NeedsSpec(H.CorrectKernel):
        needs_variant = True

        def __init__(self, variant=None):
            if variant is None:
                raise K.KernelError("kernel: needs a spec")
            super().__init__(variant)

    monkeypatch.setattr(H, "NeedsSpec", NeedsSpec, raising=False)
    _only(monkeypatch, {"aaa": "tests.helpers_kernels:NeedsSpec",
                        "cpuk": "tests.helpers_kernels:CorrectKernel"})
    name, why = K.best_kernel()
    assert name == "cpuk" and "aaa" not in why and "needs a spec" not in why
