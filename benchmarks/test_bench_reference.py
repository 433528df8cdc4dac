"""Benchmarks of the fp32 reference at gpt-oss-20b attention geometry, next to a peer:
ONNX Runtime's CPU ``com.microsoft::GroupQueryAttention`` on the same inputs.

Not collected by the default ``pytest`` run (testpaths = tests). Run with

    PYTHONPATH=. python -m pytest benchmarks -q            # all cases (~3 min on 2 cores)
    PYTHONPATH=. python -m pytest benchmarks -q -m "not slow"   # without the 16k prefill

Geometry (gpt-oss-20b): Hq = 64 query heads, Hkv = 8 KV heads (G = 8), d = 64, B = 1, a
learned sink per head, fp32. Cases:

    gptoss-past8192-full   a 512-token chunk over an 8192-token cache, causal
    gptoss-past8192-w128   the same chunk, sliding window W = 128 (gpt-oss's window layers)
    gptoss-prefill16k      a one-shot 16384-token prefill, causal (time and peak memory)

Work is counted as useful FLOPs over visible (query, key) pairs only:

    FLOPs = 4 * B * Hq * d * sum_i n_visible(i),   n_visible(i) = min(p_i + 1, W)

(2 for q.k and 2 for p.v per pair), so a kernel that computes masked work gets no credit.
Time is the median over rounds; peak memory is the tracemalloc high-water mark during the
call (NumPy reports its buffers to tracemalloc), excluding the inputs.

Targets (docs in benchmarks/README.md): full at least as fast as ORT, windowed >= 10x faster
than ORT, 16k one-shot peak <= 2 GiB. The memory target is asserted; a missed speed target
is reported as MISS in the summary, and fails the run only with REFATTN_BENCH_STRICT=1
(wall-clock on a shared machine is too noisy to gate CI on).
"""

from __future__ import annotations

import os
import time
import tracemalloc
from dataclasses import dataclass

import numpy as np
import pytest

from refattn import attention

HQ, HKV, D, B = 64, 8, 64, 1
GIB = 2**30
PEAK_TARGET = 2 * GIB
ORT_MATCH = 1e-4  # relL2 of ORT's fp32 output against the fp32 reference before timing
STRICT = os.environ.get("REFATTN_BENCH_STRICT") == "1"


@dataclass(frozen=True)
class Bench:
    name: str
    sq: int
    past_len: int
    window: int
    rounds: int
    ort_speedup_target: float | None  # reference must be this many times faster than ORT
    ort_skip: str | None = None  # why ORT is not run on this case

    @property
    def skv(self) -> int:
        return self.past_len + self.sq

    def visible_pairs(self) -> int:
        p = self.past_len + np.arange(self.sq, dtype=np.int64)
        n = p + 1 if self.window < 0 else np.minimum(p + 1, self.window)
        return int(n.sum())

    def flops(self) -> float:
        return 4.0 * B * HQ * D * self.visible_pairs()


CASES = [
    Bench("gptoss-past8192-full", 512, 8192, -1, rounds=3, ort_speedup_target=1.0),
    Bench("gptoss-past8192-w128", 512, 8192, 128, rounds=5, ort_speedup_target=10.0),
    Bench("gptoss-prefill16k", 16384, 0, -1, rounds=1, ort_speedup_target=None,
          ort_skip="ORT's CPU GroupQueryAttention materialises the (Hq, Sq, Skv) fp32 "
                   "probabilities: 64 GiB at 16k"),
]


@dataclass
class Inputs:
    case: Bench
    q: np.ndarray     # (B, Sq, Hq, d) fp32
    k: np.ndarray     # (B, Hkv, Skv, d) fp32
    v: np.ndarray
    sink: np.ndarray  # (Hq,) fp32
    ref_out: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.k.nbytes + self.v.nbytes + self.sink.nbytes

    def kwargs(self) -> dict:
        return dict(past_len=self.case.past_len, window=self.case.window, sink=self.sink)


@pytest.fixture(scope="module",
                params=[pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.sq > 4096 else [])
                        for c in CASES])
def inputs(request) -> Inputs:
    c: Bench = request.param
    rng = np.random.default_rng(0)
    return Inputs(
        case=c,
        q=rng.standard_normal((B, c.sq, HQ, D), dtype=np.float32),
        k=rng.standard_normal((B, HKV, c.skv, D), dtype=np.float32),
        v=rng.standard_normal((B, HKV, c.skv, D), dtype=np.float32),
        sink=rng.uniform(-1, 3, HQ).astype(np.float32),
    )


# --- summary printed at the end of the module ----------------------------------------------

_ROWS: dict[tuple[str, str], dict] = {}


@pytest.fixture(scope="module", autouse=True)
def summary(pytestconfig):
    yield
    tr = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    capman = pytestconfig.pluginmanager.get_plugin("capturemanager")
    if tr is None or capman is None or not _ROWS:
        return
    with capman.global_and_fixture_disabled():  # teardown output is captured otherwise
        _write_summary(tr.write_line)


def _write_summary(w) -> None:
    w("")
    w("refattn reference vs ONNX Runtime (fp32, Hq=64 Hkv=8 d=64 B=1, per-head sink)")
    w(f"{'case':24} {'impl':10} {'median s':>9} {'GF/s':>7} {'peak MiB':>9}")
    for (name, impl), r in _ROWS.items():
        peak = f"{r['peak'] / 2**20:9.0f}" if r.get("peak") is not None else f"{'-':>9}"
        w(f"{name:24} {impl:10} {r['median']:9.3f} {r['gflops']:7.1f} {peak}")
    for c in CASES:
        ref, ort = _ROWS.get((c.name, "reference")), _ROWS.get((c.name, "ort"))
        if ref and ort and c.ort_speedup_target:
            speedup = ort["median"] / ref["median"]
            verdict = "ok" if speedup >= c.ort_speedup_target else "MISS"
            w(f"{c.name}: ORT / reference = {speedup:.2f}x "
              f"(target >= {c.ort_speedup_target:g}x) {verdict}")
        if ref and ref.get("peak") is not None and c.sq > 4096:
            total = ref["peak"] + ref["inputs"]
            w(f"{c.name}: peak {ref['peak'] / GIB:.2f} GiB during the call + "
              f"{ref['inputs'] / GIB:.2f} GiB inputs = {total / GIB:.2f} GiB "
              f"(target <= {PEAK_TARGET / GIB:g} GiB) {'ok' if total <= PEAK_TARGET else 'MISS'}")


def _timed(fn, times: list):
    def run():
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
        return out
    return run


def _rel_l2(a, b) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b.astype(np.float64)))


# --- the reference ---------------------------------------------------------------------

def test_reference(benchmark, inputs):
    c = inputs.case
    benchmark.group = c.name
    peaks: list[int] = []

    def call():
        tracemalloc.start()
        try:
            return attention(inputs.q, inputs.k, inputs.v, **inputs.kwargs())
        finally:
            peaks.append(tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()

    times: list[float] = []
    out = benchmark.pedantic(_timed(call, times), rounds=c.rounds, iterations=1,
                             warmup_rounds=1 if c.rounds > 1 else 0)
    assert out.shape == (B, c.sq, HQ, D) and out.dtype == np.float32
    assert np.isfinite(out).all()
    inputs.ref_out = out
    median, peak = float(np.median(times[-c.rounds:])), max(peaks)  # warm-up round excluded
    gflops = c.flops() / median / 1e9
    benchmark.extra_info.update(gflops=gflops, peak_bytes=peak, useful_flops=c.flops())
    _ROWS[(c.name, "reference")] = dict(median=median, gflops=gflops, peak=peak,
                                        inputs=inputs.nbytes)
    if c.sq > 4096:
        assert peak + inputs.nbytes <= PEAK_TARGET, (
            f"peak {peak / GIB:.2f} GiB + inputs {inputs.nbytes / GIB:.2f} GiB > 2 GiB")


# --- the peer: ONNX Runtime com.microsoft::GroupQueryAttention --------------------------------

def _ort_session(c: Bench):
    """A one-node model: GroupQueryAttention with a past cache and a per-head sink.

    ORT's layout: query (B, Sq, Hq*d), key/value (B, Sq, Hkv*d) for the new chunk, past_key/
    past_value (B, Hkv, past_len, d) BNSH, seqlens_k = total length - 1, and
    local_window_size = W keys, self included (the convention of docs/semantics.md,
    Semantics; checked below against the reference before anything is timed)."""
    ort = pytest.importorskip("onnxruntime")
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    f32, i32 = TensorProto.FLOAT, TensorProto.INT32
    ins = [
        helper.make_tensor_value_info("query", f32, [B, c.sq, HQ * D]),
        helper.make_tensor_value_info("key", f32, [B, c.sq, HKV * D]),
        helper.make_tensor_value_info("value", f32, [B, c.sq, HKV * D]),
        helper.make_tensor_value_info("past_key", f32, [B, HKV, c.past_len, D]),
        helper.make_tensor_value_info("past_value", f32, [B, HKV, c.past_len, D]),
        helper.make_tensor_value_info("seqlens_k", i32, [B]),
        helper.make_tensor_value_info("total_sequence_length", i32, []),
        helper.make_tensor_value_info("head_sink", f32, [HQ]),
    ]
    # inputs 7..10 (cos_cache, sin_cache, position_ids, attention_bias) are omitted
    names = [i.name for i in ins[:7]] + ["", "", "", ""] + ["head_sink"]
    outs = ["output", "present_key", "present_value"]
    node = helper.make_node("GroupQueryAttention", names, outs, domain="com.microsoft",
                            num_heads=HQ, kv_num_heads=HKV, local_window_size=c.window)
    graph = helper.make_graph(
        [node], c.name, ins,
        [helper.make_tensor_value_info("output", f32, [B, c.sq, HQ * D]),
         helper.make_tensor_value_info("present_key", f32, None),
         helper.make_tensor_value_info("present_value", f32, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"]), ort.__version__


def _ort_feeds(x: Inputs) -> dict:
    c, P = x.case, x.case.past_len
    bsh = lambda a: np.ascontiguousarray(a[:, :, P:].transpose(0, 2, 1, 3)).reshape(B, c.sq, HKV * D)
    return dict(
        query=x.q.reshape(B, c.sq, HQ * D),
        key=bsh(x.k), value=bsh(x.v),
        past_key=np.ascontiguousarray(x.k[:, :, :P]), past_value=np.ascontiguousarray(x.v[:, :, :P]),
        seqlens_k=np.full(B, c.skv - 1, np.int32),
        total_sequence_length=np.array(c.skv, np.int32),
        head_sink=x.sink,
    )


def test_ort(benchmark, inputs):
    c = inputs.case
    if c.ort_skip:
        pytest.skip(c.ort_skip)
    sess, version = _ort_session(c)
    benchmark.group = c.name
    feeds = _ort_feeds(inputs)
    got = sess.run(["output"], feeds)[0].reshape(B, c.sq, HQ, D)  # also ORT's warm-up
    ref = inputs.ref_out
    if ref is None:  # the reference test was deselected
        ref = attention(inputs.q, inputs.k, inputs.v, **inputs.kwargs())
    err = _rel_l2(got, ref)
    assert err < ORT_MATCH, f"ORT {version} disagrees with the reference: relL2 {err:.2e}"

    times: list[float] = []
    benchmark.pedantic(_timed(lambda: sess.run(["output"], feeds), times), rounds=c.rounds,
                       iterations=1, warmup_rounds=1)
    median = float(np.median(times[-c.rounds:]))  # warm-up round excluded
    gflops = c.flops() / median / 1e9
    benchmark.extra_info.update(gflops=gflops, ort_version=version, rel_l2_vs_reference=err)
    _ROWS[(c.name, "ort")] = dict(median=median, gflops=gflops, peak=None)
    ref_row = _ROWS.get((c.name, "reference"))
    if STRICT and ref_row and c.ort_speedup_target:
        speedup = median / ref_row["median"]
        assert speedup >= c.ort_speedup_target, (
            f"reference is {speedup:.2f}x ORT, target >= {c.ort_speedup_target:g}x")
