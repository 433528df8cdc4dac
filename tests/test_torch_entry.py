"""``hipkernel.torch.attention`` without a GPU: its argument checks, the stream it launches
on, no synchronize, a geometry prepared once and patched per call, the graph-capture rule,
ragged lengths, and the custom op's schema and fake implementation. The device side (torch's
current stream, a captured graph, torch.compile, numerics, host timings) runs on a GPU:
``python -m hipkernel.torch_bench``, gpu_session's torch section."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch entry point needs torch (pip install torch)")

from hipkernel import api  # noqa: E402
from hipkernel import torch as ht  # noqa: E402
from tests.fake_backend import RecordingBackend  # noqa: E402

STREAM = 0x5000


class FakeRuntime:
    """CPU tensors stand in for CUDA ones; a recording backend stands in for the device."""

    def __init__(self):
        self.be = RecordingBackend(arch="sm_80")
        self.capture = False
        self.uploads = []

    def accepts(self, t):
        return t.device.type in ("cpu", "meta")

    def backend(self, device):
        return self.be

    def stream(self, device):
        return STREAM

    def stream_of(self, index):
        return STREAM

    def capturing(self, device):
        return self.capture

    def upload(self, host, device):
        self.uploads.append(host.copy())
        return torch.from_numpy(host.copy())


@pytest.fixture
def rt(monkeypatch):
    monkeypatch.setenv("HIPKERNEL_TUNE", "0")
    fake = FakeRuntime()
    monkeypatch.setattr(ht, "RUNTIME", fake)
    ht.clear()
    api.PLANS.clear()
    yield fake
    ht.clear()
    api.PLANS.clear()


def _qkv(B=1, Sq=8, Hq=4, Hkv=2, d=64, S_cap=32, dtype=torch.float16):
    q = torch.randn(B, Sq, Hq, d).to(dtype)
    k = torch.randn(B, Hkv, S_cap, d).to(dtype)
    return q, k, torch.randn(B, Hkv, S_cap, d).to(dtype)


def _launches(be):
    return [c[1] for c in be.calls if c[0] == "launch"]


def test_a_call_launches_on_the_current_stream_without_a_synchronize(rt):
    q, k, v = _qkv()
    out = ht.attention(q, k, v, past_len=4, sink=torch.zeros(4))
    assert out.shape == q.shape and out.dtype == q.dtype
    (rec,) = _launches(rt.be)
    assert rec["stream"] == STREAM
    assert not any(c[0] in ("synchronize", "dtoh", "htod", "alloc") for c in rt.be.calls)
    a = rec["args"]
    assert (a[0], a[1], a[2], a[4]) == (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr())
    assert a[3] != 0 and a[9] == 4 and a[11] == 1  # the sink (fp16 on the device), per head


def test_a_geometry_is_prepared_once_then_patched(rt):
    q, k, v = _qkv()
    ht.attention(q, k, v, past_len=4)
    for past in (5, 6, 7):
        q2 = torch.randn_like(q)
        out = ht.attention(q2, k, v, past_len=past)
        assert _launches(rt.be)[-1]["args"][0] == q2.data_ptr()
        assert _launches(rt.be)[-1]["args"][4] == out.data_ptr()
        assert _launches(rt.be)[-1]["args"][9] == past
    assert rt.be.prepares == 1 and len(ht._GEOMETRIES) == 1
    assert sum(c[0] == "compile" for c in rt.be.calls) == 1
    sinks = [torch.zeros(4, dtype=torch.float16) for _ in range(3)]
    for past, sink in zip((3, 3, 2), sinks):  # the sink's buffer is patched per call too
        ht.attention(q, k, v, past_len=past, sink=sink)
        assert _launches(rt.be)[-1]["args"][3] == sink.data_ptr()
        assert _launches(rt.be)[-1]["args"][9] == past
    assert rt.be.prepares == 2 and len(ht._GEOMETRIES) == 2  # a per-head sink: its own geometry
    ht.attention(q, k, v, past_len=4, window=16)  # another geometry
    assert rt.be.prepares == 3 and len(ht._GEOMETRIES) == 3


def test_out_is_filled_when_given(rt):
    q, k, v = _qkv(dtype=torch.bfloat16)
    out = torch.empty_like(q)
    assert ht.attention(q, k, v, past_len=0, out=out) is out
    assert _launches(rt.be)[-1]["args"][4] == out.data_ptr()
    assert _launches(rt.be)[-1]["kernel"].get("HK_BF16") == 1


def test_a_warm_call_with_out_takes_the_fast_path(rt, monkeypatch):
    """Once its geometry ran, a call with a valid ``out`` skips the slow path's checks (they
    would cost a serving loop that reuses its output buffers microseconds a call) and
    launches into ``out``."""
    q, k, v = _qkv()
    ht.attention(q, k, v, past_len=0)
    monkeypatch.setattr(ht, "_check_tensor", lambda *a, **k: pytest.fail("slow path"))
    out = torch.empty_like(q)
    assert ht.attention(q, k, v, past_len=3, out=out) is out
    assert _launches(rt.be)[-1]["args"][4] == out.data_ptr()


def test_capture_needs_a_call_of_the_geometry_before_it(rt):
    q, k, v = _qkv()
    rt.capture = True
    with pytest.raises(RuntimeError, match="this geometry has not run before"):
        ht.attention(q, k, v, past_len=4)
    assert _launches(rt.be) == []
    rt.capture = False
    ht.attention(q, k, v, past_len=4)
    rt.capture = True
    ht.attention(q, k, v, past_len=9)  # the capture records this launch
    assert len(_launches(rt.be)) == 2 and _launches(rt.be)[-1]["args"][9] == 9
    ht.attention(q, k, v, past_len=[5])  # one sequence: its past_len is uniform
    q, k, v = _qkv(B=2)
    with pytest.raises(RuntimeError, match="a ragged call copies its host lengths"):
        ht.attention(q, k, v, past_len=[4, 5])
    assert len(_launches(rt.be)) == 3 and rt.uploads == []


def test_ragged_lengths_are_checked_on_the_host_and_copied_once(rt):
    q, k, v = _qkv(B=2, S_cap=40)
    ht.attention(q, k, v, past_len=[3, 30], q_len=[8, 2])
    (host,) = rt.uploads
    assert host.dtype == np.int32 and host.tolist() == [3, 30, 8, 2]
    rec = _launches(rt.be)[-1]
    assert rec["args"][13] != 0 and rec["args"][14] == rec["args"][13] + 8 and rec["args"][9] == 0
    ht.attention(q, k, v, past_len=torch.tensor([1, 2]))  # a CPU tensor is host integers
    assert rt.uploads[-1].tolist() == [1, 2]
    # a sequence whose past_len + Sq passes the cache but whose own rows end inside it
    ht.attention(q, k, v, past_len=[3, 36], q_len=[8, 2])
    assert rt.uploads[-1].tolist() == [3, 36, 8, 2]
    assert _launches(rt.be)[-1]["args"][9] == 0
    with pytest.raises(ValueError, match=r"^S_cap: cache capacity 40 < past_len\[b\] \+ q_len\[b\] = 41"):
        ht.attention(q, k, v, past_len=[3, 33])
    with pytest.raises(ValueError, match=r"^q_len: expected entries <= Sq = 8"):
        ht.attention(q, k, v, past_len=0, q_len=[9, 1])
    with pytest.raises(ValueError, match=r"^past_len: expected shape \(B,\) = \(2,\)"):
        ht.attention(q, k, v, past_len=[1, 2, 3])
    with pytest.raises(ValueError, match="^past_len: per-sequence lengths are host integers"):
        ht.attention(q, k, v, past_len=torch.tensor([1, 2], device="meta"))


def test_a_declined_call_raises_before_any_device_call(rt):
    q, k, v = _qkv(d=96)
    with pytest.raises(NotImplementedError, match="head dim 96 not compiled"):
        ht.attention(q, k, v, past_len=4)
    assert rt.be.calls == []


def _bad(rt):
    q, k, v = _qkv()
    return [
        (dict(q=q.float()), ValueError, "^q: expected float16 or bfloat16, got torch.float32"),
        (dict(k=k.to(torch.bfloat16)), ValueError, "^k: expected q's dtype"),
        (dict(q=q[0]), ValueError, r"^q: expected 4 dimensions, got shape \(8, 4, 64\)"),
        (dict(q=np.zeros((1, 8, 4, 64), np.float16)), ValueError, "^q: expected a torch.Tensor"),
        (dict(v=v[:, :, :16]), ValueError, "^v: expected k's shape"),
        (dict(k=torch.randn(1, 3, 32, 64).half(), v=torch.randn(1, 3, 32, 64).half()),
         ValueError, "^k: Hq = 4 query heads are not a multiple of Hkv = 3"),
        (dict(k=k.transpose(2, 3).contiguous().transpose(2, 3), v=v), ValueError,
         r"^k: expected a contiguous tensor \(use .contiguous\(\)\)"),
        (dict(q=torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)), ValueError,
         r"^q: data_ptr\(\) 0x[0-9a-f]+ is not 16-byte aligned"),
        (dict(sink=torch.zeros(3)), ValueError, r"^sink: expected a float tensor of shape \(Hq,\) = \(4,\)"),
        (dict(sink=torch.zeros(4), smooth_softmax=True), ValueError, "^sink: a per-head sink and smooth"),
        (dict(window=0), ValueError, "^window: expected -1"),
        (dict(scale=float("nan")), ValueError, "^scale: expected None or a finite float"),
        (dict(past_len=-1), ValueError, "^past_len: expected an int >= 0"),
        (dict(past_len=25), ValueError, r"^S_cap: cache capacity 32 < past_len \+ Sq = 33"),
        (dict(out=torch.empty(1, 8, 4, 32).half()), ValueError, "^out: expected a torch.float16 tensor"),
        (dict(config={"m_tiles": 3}), ValueError, "^config: "),
    ]


@pytest.mark.parametrize("i", range(16))
def test_bad_arguments_are_named(rt, i):
    q, k, v = _qkv()
    kw, exc, match = _bad(rt)[i]
    args = dict(q=q, k=k, v=v, past_len=4)
    args.update(kw)
    with pytest.raises(exc, match=match):
        ht.attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)
    assert _launches(rt.be) == []


def test_the_real_runtime_takes_cuda_tensors_only():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="^q: expected a CUDA tensor, got one on cpu"):
        ht.attention(q, k, v, past_len=4)


def test_the_custom_op_has_a_schema_and_a_fake_for_tracing():
    schema = str(torch.ops.hipkernel.attention.default._schema)
    assert schema.startswith("hipkernel::attention(Tensor q, Tensor k, Tensor v, Tensor? sink, ")
    q = torch.empty(2, 8, 4, 64, device="meta", dtype=torch.float16)
    k = torch.empty(2, 2, 32, 64, device="meta", dtype=torch.float16)
    res = torch.ops.hipkernel.attention(q, k, k, None, 4, -1, False, -1.0)
    assert res.device.type == "meta" and res.shape == q.shape and res.dtype == q.dtype


def test_under_compilation_the_entry_point_calls_the_op(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    q = torch.empty(1, 8, 4, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(1, 2, 32, 64, device="meta", dtype=torch.bfloat16)
    res = ht.attention(q, k, k, past_len=4, window=8)  # meta tensors reach the fake
    assert res.device.type == "meta" and res.shape == q.shape
    with pytest.raises(ValueError, match="under torch.compile takes an int past_len"):
        ht.attention(q, k, k, past_len=[4])


def test_the_harness_adapter_of_the_torch_entry_point():
    from hipkernel.adapter import TorchEntryKernel
    from refattn.kernels import get_kernel

    k = get_kernel("hipkernel-torch")
    assert isinstance(k, TorchEntryKernel) and k.name == "hipkernel-torch"
    assert k.mutants == frozenset() and k.ragged is True and k.requires_gpu
    ok, why = k.available()
    if not torch.cuda.is_available():
        assert not ok and why == f"torch {torch.__version__} sees no CUDA device"
    with pytest.raises(ValueError, match="^kernel: hipkernel-torch has no variants"):
        TorchEntryKernel("cuda")
    with pytest.raises(ValueError, match="^mutants: not in the catalogue: tail_unmasked"):
        TorchEntryKernel(mutants={"tail_unmasked"})
    # its records are judged against the kernel, the launch code and the entry point itself
    assert k.source_hash() == api.torch_source_hash() != api.source_hash()
    from hipkernel import record

    assert record.hash_of("hipkernel-torch") == k.source_hash()
    assert record.hash_of("hipkernel") == api.source_hash()


def test_the_torch_record_is_written_by_its_own_process_and_checked_by_kind():
    """gpu_session's torch section runs hipkernel.torch_bench in a subprocess; the record's
    kind has its schema (results, checks each with ok)."""
    from hipkernel import gpu_session, record
    from refattn import schema

    assert "torch" in gpu_session.SECTIONS and "torch-h200.json" in record.FROM_RELIABILITY
    rec = record.stamp("torch", "NVIDIA H200", {"results": [], "checks": {"graph": {"ok": "yes"}}}, True)
    assert schema.gpu_record_problems(rec) == ["checks.graph.ok: expected true or false, got a string"]


def _outcome(rt, fn):
    """What a call did: the exception it raised, or the arguments of its launch with the
    output pointer left out and the sink and length pointers as whether they are set (the
    output, a sink converted to fp16 and the lengths are new tensors each call)."""
    n = len(_launches(rt.be))
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the outcome is what is compared
        return (type(e).__name__, str(e).split(" 0x")[0])
    (rec,) = _launches(rt.be)[n:]
    return tuple(bool(a) if i in (3, 13, 14) else a for i, a in enumerate(rec["args"]) if i != 4) + (
        rec["stream"], rec["grid"])


def test_a_warm_call_does_what_a_cold_one_does(rt):
    """The fast path of a geometry that ran before skips the full checks: every call here,
    valid or not, must come out the same (the same launch, or the same error) warm as cold."""
    q, k, v = _qkv(S_cap=40)
    sink16, sink32 = torch.zeros(4).half(), torch.zeros(4)
    strided = torch.randn(1, 4, 8, 64).half().transpose(1, 2)  # q's shape, not contiguous
    offset = torch.empty(q.numel() + 8, dtype=q.dtype)[8:].view(q.shape)  # 16-byte aligned
    misaligned = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)
    variants = {
        "plain": lambda: ht.attention(q, k, v, past_len=4),
        "past at the end": lambda: ht.attention(q, k, v, past_len=32),
        "past past the end": lambda: ht.attention(q, k, v, past_len=33),
        "past negative": lambda: ht.attention(q, k, v, past_len=-1),
        "past numpy int": lambda: ht.attention(q, k, v, past_len=np.int64(4)),
        "past bool": lambda: ht.attention(q, k, v, past_len=True),
        "past float": lambda: ht.attention(q, k, v, past_len=4.0),
        "q_len": lambda: ht.attention(q, k, v, past_len=4, q_len=[5]),
        "fp16 sink": lambda: ht.attention(q, k, v, past_len=4, sink=sink16),
        "fp32 sink": lambda: ht.attention(q, k, v, past_len=4, sink=sink32),
        "strided q": lambda: ht.attention(strided, k, v, past_len=4),
        "offset q": lambda: ht.attention(offset, k, v, past_len=4),
        "misaligned q": lambda: ht.attention(misaligned, k, v, past_len=4),
        "window True": lambda: ht.attention(q, k, v, past_len=4, window=True),
        "window 1": lambda: ht.attention(q, k, v, past_len=4, window=1),
        "smooth 1": lambda: ht.attention(q, k, v, past_len=4, smooth_softmax=1),
        "out given": lambda: ht.attention(q, k, v, past_len=4, out=torch.empty_like(q)),
        "out strided": lambda: ht.attention(q, k, v, past_len=4, out=torch.empty_like(strided)),
        "out fp32": lambda: ht.attention(q, k, v, past_len=4, out=torch.empty(q.shape)),
        "out short": lambda: ht.attention(q, k, v, past_len=4, out=torch.empty_like(q[:, :-1])),
        "out misaligned": lambda: ht.attention(q, k, v, past_len=4, out=misaligned),
        "out offset": lambda: ht.attention(q, k, v, past_len=4, out=offset),
        "out a list": lambda: ht.attention(q, k, v, past_len=4, out=[0]),
    }
    cold = {}
    for name, fn in variants.items():
        ht.clear()
        api.PLANS.clear()
        cold[name] = _outcome(rt, fn)
    for name, fn in variants.items():  # every geometry warm now: each call twice
        warm = [_outcome(rt, fn), _outcome(rt, fn)]
        assert warm == [cold[name]] * 2, name
    assert cold["past past the end"][0] == "ValueError" and cold["past bool"][0] == "ValueError"
    assert cold["window True"][0] == "ValueError" and cold["smooth 1"][0] == "ValueError"
    assert cold["misaligned q"][0] == "ValueError" and cold["strided q"][0] == "ValueError"
    for name in ("out strided", "out fp32", "out short", "out misaligned", "out a list"):
        assert cold[name][0] == "ValueError", name


def test_torch_bench_times_the_call_it_is_given_on_the_event_timer(monkeypatch):
    """torch_bench's device time: the Call handed to refattn.timing.TorchEventTimer launches
    the function given and synchronizes through torch, and the median of the timer's samples
    comes back (a fake timer here: the GPU run is the record's)."""
    from hipkernel import torch_bench
    from refattn import timing

    seen = {}

    class FakeTimer:
        def __init__(self, T):
            seen["T"] = T

        def __call__(self, call, *, warmup, reps):
            seen.update(call=call, warmup=warmup, reps=reps)
            call.fn()
            return [3.0, 1.0, 2.0]

    monkeypatch.setattr(timing, "TorchEventTimer", FakeTimer)
    launched = []
    assert torch_bench._device_ms(torch, lambda: launched.append(1), reps=3) == 2.0
    assert launched == [1] and seen["T"] is torch and seen["reps"] == 3
    assert seen["call"].sync is torch.cuda.synchronize and seen["call"].name == "hipkernel-torch"


class _CpuTorch:
    """torch as hipkernel.torch_bench sees it, on the CPU: "cuda" tensors and generators are
    CPU ones, synchronize and the GPU sleep do nothing (the fake runtime launches nothing)."""

    def __init__(self):
        import types

        self.cuda = types.SimpleNamespace(synchronize=lambda: None, _sleep=lambda cycles: None)

    def Generator(self, device=None):  # noqa: N802 - torch's name
        return torch.Generator()

    def randn(self, *shape, device=None, generator=None):
        return torch.randn(*shape, generator=generator)

    def rand(self, *shape, device=None, generator=None):
        return torch.rand(*shape, generator=generator)

    empty_like = staticmethod(torch.empty_like)


def test_torch_bench_host_overhead_and_chunked_prefill_run_on_a_fake_device(rt, monkeypatch):
    """The host-timing half of torch_bench (host overhead per geometry, the chunked prefill
    cold and warm against its kernels) on the fake runtime and a fake event timer: every
    geometry is called, the rows carry their targets, and the results are JSON a record can
    hold (no NaN, no infinity). What it measures is the GPU run's."""
    import json

    from hipkernel import torch_bench
    from refattn import timing

    class FakeTimer:
        cycles_per_ms = 1.0e6

        def __init__(self, T):
            pass

        def __call__(self, call, *, warmup, reps):
            call.fn()
            return [0.010, 0.012, 0.011]

    monkeypatch.setattr(timing, "TorchEventTimer", FakeTimer)
    monkeypatch.setattr(torch_bench, "_CYCLES", [])
    monkeypatch.setattr(torch_bench, "HOST_GEOMETRIES", [(16, 32, 8), (1, 32, -1)])
    T = _CpuTorch()
    rows = torch_bench.host_overhead(T, ht, n=3)
    assert [(r["sq"], r["past_len"], r["window"]) for r in rows] == [(16, 32, 8), (1, 32, -1)]
    for r in rows:
        assert r["kernel_ms"] == 0.011 and r["target_us"] == torch_bench.HOST_OVERHEAD_US
        assert r["hit"] == (r["host_overhead_us"] <= torch_bench.HOST_OVERHEAD_US)
    keyword_calls = []  # the prepared launch is timed as the warm call makes it: enqueue
    monkeypatch.setattr(api.PreparedCall, "__call__",
                        lambda self, *a, _real=api.PreparedCall.__call__, **kw:
                        keyword_calls.append(1) or _real(self, *a, **kw))
    parts = torch_bench.enqueue_breakdown(T, ht)
    assert len(keyword_calls) <= 1  # at most the geometry's first call, on the slow path
    assert set(parts) == {"call_us", "call_with_out_us", "empty_like_us", "prepared_launch_us"}
    assert all(x > 0 for x in parts.values())
    wrapped = (ht._geometry, api.prepare_call, api.PreparedCall.__call__)
    res = torch_bench.chunked_prefill(T, ht, total=64, chunk=16)
    assert res["chunks"] == 4 and res["kernel_sum_s"] == pytest.approx(4 * 0.011e-3)
    assert res["warm_over_kernels"] == pytest.approx(res["warm_s"] / res["kernel_sum_s"])
    assert isinstance(res["hit_over_kernels"], bool) and isinstance(res["hit_cold_over_warm"], bool)
    first = res["cold_first_call_parts_us"]
    assert set(first) == {"call_us", "geometry_us", "prepare_call_us", "launch_us", "rest_us"}
    assert first["geometry_us"] > 0 and first["prepare_call_us"] > 0 and first["launch_us"] > 0
    assert first["call_us"] >= first["geometry_us"] + first["prepare_call_us"] + first["launch_us"]
    assert first["rest_us"] == pytest.approx(first["call_us"] - first["geometry_us"]
                                             - first["prepare_call_us"] - first["launch_us"])
    # the timing wrappers are taken off again
    assert (ht._geometry, api.prepare_call, api.PreparedCall.__call__) == wrapped
    json.dumps({"host": rows, "host_parts": parts, "chunked_16k": res}, allow_nan=False)
    assert rt.be.launches, "the fake runtime saw no launch"
