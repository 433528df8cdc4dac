"""ONNX Runtime's GroupQueryAttention through the case matrix (refattn/adapters/ort.py), on
the CPU provider: small cases of the shipped suites and inline cases, its derived declines
with ORT's own message, and deliberately wrong nodes that the matrix must fail."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

from refattn.adapters.ort import TRIAL_ROWS, Geometry, OrtKernel  # noqa: E402
from refattn.cases import case_from_text, load_suites, make_inputs  # noqa: E402
from refattn.kernels import KernelError, get_kernel  # noqa: E402
from refattn.runner import run_case, run_matrix  # noqa: E402

SPEC = "refattn.adapters.ort:OrtKernel:cpu"
ROOT = Path(__file__).resolve().parent.parent
BATCH_MSG = "batch_size must be 1 when sequence_length > 1 and past context is given"
DECLINED = "declined (status -1), output buffer untouched: "
# Shipped cases cheap enough for the fp64 reference on a 2-core machine (under ~0.1 s each).
SMALL_FLOPS = 3e7


@pytest.fixture(scope="module")
def kernel():
    k = get_kernel(SPEC)
    ok, why = k.available()
    if not ok:
        pytest.skip(why)
    return k


def case(text: str, name: str = "inline"):
    return case_from_text(text, name=name)


def judged(kernel, text: str):
    return run_case(kernel, case(text))


# ------------------------------------------------------------------ the shipped suites

def test_small_cases_of_the_shipped_suites_pass_or_decline_with_orts_reason(kernel):
    cases = [c for c in load_suites(["seed", "extended", "contracts"]) if c.flops < SMALL_FLOPS]
    assert {c.suite for c in cases} == {"seed", "extended", "contracts"}
    res = run_matrix(kernel, cases)
    bad = [r.failure_message() for r in res.failures()]
    assert not bad, "\n".join(bad)
    declined = {r.case for r in res.results if r.outcome == "declined"}
    assert declined == {"contract-bf16", "ext-batch2-sink-sq64-past100-w50"}, res.counts()
    for r in res.results:
        if r.outcome == "declined":  # the runner's words, then the adapter's reason
            assert r.note.startswith(DECLINED + f"onnxruntime {ort.__version__} "), r.note
    by_name = {r.case: r for r in res.results}
    # the CPU provider has no bf16 kernel: ORT says so when the session is created
    bf16 = by_name["contract-bf16"]
    assert bf16.outcome == "declined" and "session" in bf16.note
    assert "NOT_IMPLEMENTED" in bf16.note and "GroupQueryAttention" in bf16.note
    # B=2, sq=64 over a past: the CPU kernel's batch restriction, in ORT's words
    b2 = by_name["ext-batch2-sink-sq64-past100-w50"]
    assert b2.outcome == "declined" and BATCH_MSG in b2.note and "trial run (B=2 sq=64" in b2.note


def test_the_command_line_runs_it_by_import_path_and_records_orts_facts(tmp_path):
    out = tmp_path / "run.json"
    p = subprocess.run(
        [sys.executable, "-m", "refattn", "run", "--kernel", SPEC, "--json", str(out),
         "--case", 'Hq = 8, Hkv = 2, d = 64, sq = 5, past_len = 7, window = 3, sink = "per_head"',
         "--case", "B = 2, Hq = 8, Hkv = 2, d = 64, sq = 5, past_len = 7"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(out.read_text())
    assert doc["kernel"] == "ort:cpu" and doc["ok"]
    assert doc["kernel_source_hash"] == f"onnxruntime-{ort.__version__}:CPUExecutionProvider"
    facts = doc["kernel_facts"]
    assert facts["onnxruntime"] == ort.__version__ and facts["provider"] == "CPUExecutionProvider"
    assert facts["providers"] == ort.get_available_providers()
    assert isinstance(facts["opset_com_microsoft"], int) and facts["opset_com_microsoft"] >= 1
    assert [r["outcome"] for r in doc["results"]] == ["pass", "declined"]
    assert BATCH_MSG in doc["results"][1]["note"]


# ------------------------------------------------------------------ derived declines

def test_the_cpu_batch_restriction_is_declined_and_its_neighbours_pass(kernel):
    geo = "Hq = 8, Hkv = 2, d = 64, sq = 4, past_len = 9, sink = \"per_head\", window = 6"
    r = judged(kernel, f"B = 2, {geo}")
    assert r.outcome == "declined", r.note
    assert BATCH_MSG in r.note and "CPUExecutionProvider" in r.note
    assert kernel.unsupported_reason(case(f"B = 2, {geo}")).endswith(BATCH_MSG + ".")
    assert judged(kernel, f"B = 1, {geo}").outcome == "pass"
    # the restriction needs all three: a batch, several rows and a past
    assert judged(kernel, "B = 2, Hq = 8, Hkv = 2, d = 64, sq = 1, past_len = 9").outcome == "pass"
    assert judged(kernel, "B = 2, Hq = 8, Hkv = 2, d = 64, sq = 4, past_len = 0").outcome == "pass"


def test_a_head_size_orts_cpu_kernel_refuses_is_declined_with_its_message(kernel):
    r = judged(kernel, "Hq = 4, Hkv = 2, d = 60, sq = 3, past_len = 2")
    assert r.outcome == "declined" and "head_size must be a multiple of 8" in r.note
    assert judged(kernel, "Hq = 4, Hkv = 2, d = 56, sq = 3, past_len = 2").outcome == "pass"


def test_a_decline_runs_nothing_and_leaves_the_output_buffer_alone(kernel):
    c = case("B = 2, Hq = 8, Hkv = 2, d = 64, sq = 4, past_len = 9")
    x = make_inputs(c)
    before = x.out.tobytes()
    assert kernel.supports(c) is False
    status, out = kernel.run(x)
    assert status == -1 and out is x.out and x.out.tobytes() == before


class RecordsTrials(OrtKernel):
    """Records the geometry of every trial run."""

    def __init__(self, variant=None, mutants=frozenset()):
        super().__init__(variant, mutants)
        self.tried: list[Geometry] = []

    def _trial(self, g):
        self.tried.append(g)
        return super()._trial(g)


class RefusesSmall(RecordsTrials):
    """A provider that would refuse only the reduced trial geometry."""

    def _trial(self, g):
        self.tried.append(g)
        return "refused" if g.sq <= TRIAL_ROWS else OrtKernel._trial(self, g)


def test_the_cpu_trial_is_reduced_and_a_refusal_is_confirmed_on_the_real_geometry():
    k = RecordsTrials()
    refused = case("B = 2, Hq = 8, Hkv = 2, d = 64, sq = 40, past_len = 50, window = 30")
    g = Geometry.of(refused)
    assert g.trial() == g._replace(sq=TRIAL_ROWS, past=TRIAL_ROWS)
    assert not k.supports(refused)
    assert k.tried == [g.trial(), g]  # reduced first, then the real geometry confirms
    why = k.unsupported_reason(refused)
    assert "trial run (B=2 sq=40 Hq=8 Hkv=2 d=64 past=50 window=30 fp16)" in why
    assert why.endswith(BATCH_MSG + ".")
    assert len(k.tried) == 2  # the verdict is cached
    ok = case("B = 1, Hq = 8, Hkv = 2, d = 64, sq = 40, past_len = 50, window = 30")
    assert k.supports(ok) and k.tried[2:] == [Geometry.of(ok).trial()]
    # a refusal the real geometry does not confirm is no decline
    k = RefusesSmall()
    assert k.supports(ok) and k.tried == [Geometry.of(ok).trial(), Geometry.of(ok)]
    assert run_case(k, ok).outcome == "pass"
    # small cases are their own trial geometry
    tiny = Geometry.of(case("B = 2, Hq = 4, Hkv = 2, d = 64, sq = 3, past_len = 5"))
    assert tiny.trial() == tiny


def test_the_verdict_and_the_session_are_kept_per_geometry():
    k = OrtKernel()
    a = case("Hq = 4, Hkv = 2, d = 64, sq = 3, past_len = 2, seed = 1")
    b = case("Hq = 4, Hkv = 2, d = 64, sq = 3, past_len = 2, seed = 2, spare = 0")
    assert k.supports(a) and k.supports(b)
    assert len(k._verdicts) == 1 and len(k._sessions) == 1
    assert run_case(k, b).outcome == "pass"


# ------------------------------------------------------------------ semantics agree

@pytest.mark.parametrize("text", [
    "Hq = 8, Hkv = 2, d = 64, sq = 12, past_len = 20, window = 5",            # window, past
    "Hq = 8, Hkv = 2, d = 64, sq = 12, past_len = 0, window = 1",             # W = 1: self only
    "Hq = 8, Hkv = 2, d = 64, sq = 12, past_len = 0, window = 4",             # window, no past
    "Hq = 8, Hkv = 2, d = 64, sq = 12, past_len = 20, sink = \"per_head\"",
    "Hq = 8, Hkv = 2, d = 64, sq = 12, past_len = 20, sink = \"per_head\", window = 7",
    "Hq = 8, Hkv = 2, d = 64, sq = 12, past_len = 20, sink = \"smooth\"",
    "Hq = 8, Hkv = 2, d = 64, sq = 12, past_len = 20, sink = \"smooth\", window = 3",
    "Hq = 8, Hkv = 2, d = 64, sq = 12, past_len = 20, softcap = 5.0",
    "Hq = 8, Hkv = 2, d = 64, sq = 12, past_len = 20, scale = 0.5, sink = \"per_head\"",
    "Hq = 6, Hkv = 1, d = 32, sq = 1, past_len = 30, sink = \"per_head\", window = 9",  # decode
    "B = 3, Hq = 4, Hkv = 4, d = 128, sq = 1, past_len = 10, sink = \"smooth\"",
    "B = 2, Hq = 4, Hkv = 2, d = 64, sq = 7, past_len = 0, sink = \"per_head\", window = 3",
])
def test_orts_semantics_agree_with_the_reference(kernel, text):
    r = judged(kernel, text)
    assert r.outcome == "pass", r.failure_message()


def test_fp32_cases_run_with_fp32_io(kernel):
    c = case("Hq = 8, Hkv = 2, d = 64, sq = 12, past_len = 20, sink = \"per_head\", "
             "window = 6, dtype = \"fp32\"")
    x = make_inputs(c)
    status, out = kernel.run(x)
    assert status == 0 and out.dtype == np.float32 and out.shape == (1, 12, 8, 64)
    sess = kernel._session(Geometry.of(c))
    assert {i.type for i in sess.get_inputs() if i.name in ("query", "key", "head_sink")} == \
        {"tensor(float)"}
    assert sess.get_outputs()[0].type == "tensor(float)"
    r = run_case(kernel, c)
    assert r.outcome == "pass", r.failure_message()
    assert r.rel_l2 < 1e-5  # fp32 arithmetic, far below the fp16-derived gate


def test_the_node_carries_the_cases_geometry_and_attributes(kernel):
    import onnx

    c = case("Hq = 8, Hkv = 2, d = 64, sq = 3, past_len = 5, window = 4, sink = \"per_head\"")
    g = onnx.load_from_string(kernel._model(Geometry.of(c)).SerializeToString()).graph
    (node,) = g.node
    assert (node.op_type, node.domain) == ("GroupQueryAttention", "com.microsoft")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["num_heads"] == 8 and attrs["kv_num_heads"] == 2
    assert attrs["local_window_size"] == 4 and attrs["smooth_softmax"] == 0
    assert math.isclose(attrs["scale"], 1 / 8, rel_tol=1e-7)
    assert [n for n in node.input if n] == ["query", "key", "value", "past_key", "past_value",
                                            "seqlens_k", "total_sequence_length", "head_sink"]
    dims = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in g.input}
    assert dims["query"] == [1, 3, 512] and dims["key"] == [1, 3, 128]
    assert dims["past_key"] == [1, 2, 5, 64] and dims["head_sink"] == [8]
    # no past: the past inputs are left out
    c0 = case("Hq = 8, Hkv = 2, d = 64, sq = 3, sink = \"smooth\"")
    (node0,) = kernel._model(Geometry.of(c0)).graph.node
    assert "past_key" not in node0.input
    assert {a.name: onnx.helper.get_attribute_value(a) for a in node0.attribute}[
        "smooth_softmax"] == 1


# ------------------------------------------------------------------ wrong nodes fail

class WindowMinusOne(OrtKernel):
    """local_window_size = W - 1: one key too few."""

    def _attributes(self, attrs, g):
        if attrs["local_window_size"] > 1:
            attrs = {**attrs, "local_window_size": attrs["local_window_size"] - 1}
        return attrs


class WindowPlusOne(OrtKernel):
    """local_window_size = W + 1: one key too many (the classic sliding-window bug)."""

    def _attributes(self, attrs, g):
        if attrs["local_window_size"] > 0:
            attrs = {**attrs, "local_window_size": attrs["local_window_size"] + 1}
        return attrs


class DropsHeadSink(OrtKernel):
    """The per-head sink never reaches the node."""

    def _model(self, g):
        return super()._model(g._replace(sink="none") if g.sink == "per_head" else g)

    def _feeds(self, case, q, k, v, sink):
        return super()._feeds(case, q, k, v, None)


class NoSmoothSoftmax(OrtKernel):
    """smooth_softmax left at 0."""

    def _attributes(self, attrs, g):
        return {**attrs, "smooth_softmax": 0}


class DefaultScale(OrtKernel):
    """The scale attribute left out: ORT's 1/sqrt(d) instead of the case's."""

    def _attributes(self, attrs, g):
        return {k: v for k, v in attrs.items() if k != "scale"}


@pytest.mark.parametrize("broken, shows, hides", [
    (WindowMinusOne, "sq = 12, past_len = 20, window = 5", "sq = 12, past_len = 20"),
    (WindowPlusOne, "sq = 12, past_len = 20, window = 5", "sq = 12, past_len = 20"),
    (DropsHeadSink, "sq = 12, past_len = 20, sink = \"per_head\"", "sq = 12, past_len = 20"),
    (NoSmoothSoftmax, "sq = 12, past_len = 20, sink = \"smooth\"", "sq = 12, past_len = 20"),
    (DefaultScale, "sq = 12, past_len = 20, scale = 0.5", "sq = 12, past_len = 20"),
])
def test_a_wrong_node_fails_the_case_that_shows_it(broken, shows, hides):
    k = broken()
    geo = "Hq = 8, Hkv = 2, d = 64, "
    r = run_case(k, case(geo + shows))
    assert r.outcome == "fail", r.summary
    assert r.rel_l2 > r.gate
    assert run_case(k, case(geo + hides)).outcome == "pass"


def test_a_wrong_node_fails_a_matrix_of_shipped_cases():
    cases = [c for c in load_suites(["extended"]) if c.name == "ext-sink-sq64-past1000-w1"]
    assert len(cases) == 1
    for broken in (WindowPlusOne, DropsHeadSink):
        res = run_matrix(broken(), cases)
        assert not res.ok and res.counts()["fail"] == 1, res.results[0].failure_message()
    assert run_matrix(OrtKernel(), cases).ok


# ------------------------------------------------------------------ naming and availability

def test_variants_name_the_provider():
    assert OrtKernel().name == "ort:cpu" and OrtKernel("cpu").provider == "CPUExecutionProvider"
    assert OrtKernel("cuda").provider == "CUDAExecutionProvider"
    assert OrtKernel("cuda").name == "ort:cuda"
    assert OrtKernel("ROCMExecutionProvider").name == "ort:ROCMExecutionProvider"
    assert get_kernel("refattn.adapters.ort:OrtKernel").name == "ort:cpu"
    assert OrtKernel.peer is True and OrtKernel.requires_gpu is False
    assert not OrtKernel().requires_gpu and OrtKernel("cuda").requires_gpu
    assert OrtKernel.variant_requires_gpu("cuda") and OrtKernel.variant_requires_gpu("/x/libep.so")
    assert not OrtKernel.variant_requires_gpu(None) and not OrtKernel.variant_requires_gpu("CPU")


@pytest.mark.parametrize("kw, words", [
    ({"variant": "tpu"}, "unknown ort variant 'tpu'"),
    ({"variant": "Cpu Execution"}, "unknown ort variant"),
    ({"variant": 3}, "variant must be a string"),
    ({"mutants": frozenset({"sink_ignored"})}, "ort has no mutants"),
])
def test_a_bad_variant_or_mutant_is_a_kernel_error(kw, words):
    with pytest.raises(KernelError, match=words) as e:
        OrtKernel(**kw)
    assert str(e.value).startswith("kernel:")


def test_unknown_variant_through_the_registry_is_a_kernel_error():
    with pytest.raises(KernelError, match=r"^kernel: unknown ort variant 'npu'"):
        get_kernel("refattn.adapters.ort:OrtKernel:npu")


def test_a_provider_that_is_not_here_is_unavailable_with_the_reason():
    ok, why = OrtKernel("MIGraphXExecutionProvider").available()
    if "MIGraphXExecutionProvider" in ort.get_available_providers():
        pytest.skip("MIGraphX is available here")
    assert not ok and "MIGraphXExecutionProvider is not available" in why
    assert ", ".join(ort.get_available_providers()) in why
    k = OrtKernel("cuda")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        ok, why = k.available()
        assert not ok and "CUDAExecutionProvider is not available" in why
        c = case("Hq = 4, Hkv = 2, d = 64, sq = 3")
        assert not k.supports(c) and k.unsupported_reason(c).startswith("not available:")


def test_a_plugin_library_that_cannot_be_registered_is_unavailable_with_orts_message(tmp_path):
    ok, why = OrtKernel(str(tmp_path / "libnothing.so")).available()
    assert not ok and why.endswith("no such file")
    if not hasattr(ort, "register_execution_provider_library"):
        pytest.skip(f"onnxruntime {ort.__version__} has no plugin EP API")
    # a shared library that is not an execution provider: ORT names what it missed
    lib = Path(ort.__file__).parent / "capi" / "libonnxruntime_providers_shared.so"
    if not lib.is_file():
        pytest.skip(f"no {lib.name} in this onnxruntime")
    k = OrtKernel(str(lib))
    assert k.name == f"ort:{lib.resolve()}"
    ok, why = k.available()
    assert not ok
    assert why.startswith(f"onnxruntime {ort.__version__} could not register {lib.resolve()}")
    assert "CreateEpFactories" in why


# ------------------------------------------------------------------ what ONNX Runtime gets wrong

def _coverage_cases(pred):
    return [c for c in load_suites(["coverage"]) if pred(c)]


def test_ort_passes_the_coverage_cases_with_a_clean_cache():
    cases = _coverage_cases(lambda c: c.cache_fill == "clean")
    res = run_matrix(OrtKernel(), cases)
    assert res.ok, [(r.case, r.outcome, r.note) for r in res.failures()]
    assert {r.outcome for r in res.results} <= {"pass", "declined"}


@pytest.mark.xfail(strict=True, reason=(
    "onnxruntime's CPU GroupQueryAttention multiplies every probability of a row, the zeros of "
    "masked keys included, into V: a NaN or inf in v at a key no row can see (an evicted slot "
    "left of the window) makes every output row NaN, where the semantics give it no weight"))
@pytest.mark.parametrize("fill", ["nan-outside-window", "inf-outside-window"])
def test_ort_keeps_a_non_finite_v_no_row_sees_out_of_the_output(fill):
    cases = _coverage_cases(lambda c: c.cache_fill == fill)
    assert cases
    res = run_matrix(OrtKernel(), cases)
    assert res.ok, [(r.case, r.outcome, r.n_nan) for r in res.results]
