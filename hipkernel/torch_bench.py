"""The GPU record of the torch entry point (``hipkernel.torch``): what it computes, and what
its host path costs.

    PYTHONPATH=. python -m hipkernel.torch_bench --out DIR     # -> DIR/torch-h200.json

In one process, on torch's current CUDA device:

* ``results``: the case matrix (``--suites``) through the ``hipkernel-torch`` adapter,
  judged by the harness's gate like any kernel.
* ``checks``, each ok or not with what it saw:
  * ``stream``: on a side stream held by a 50 ms GPU sleep, a call returns before its
    kernel has run (no synchronize), the default stream stays idle (the launch went to the
    current stream), and the output equals a call on the default stream byte for byte;
  * ``graph``: a call captured in a ``torch.cuda.CUDAGraph`` after one eager call, replayed
    on new contents of its static q, equals the eager call on them byte for byte;
  * ``compile``: ``torch.compile(fullgraph=True)`` of a function calling it (the custom op
    with its fake) equals the eager function byte for byte.
* ``host``: per geometry, the kernel's device time (events behind a GPU hold), the time per
  call of a burst of back-to-back calls (host clock, synchronized at both ends), and their
  difference, the host overhead per call (target <= 10 us). Timed first, before anything
  else ran in the process.
* ``host_parts``: the host's time per call of the first host geometry and of its parts
  (the output's allocation, the prepared launch), at the start, after the matrix and after
  the checks.
* ``chunked_16k``: a 32 x 512 chunked prefill of 16384 tokens on a resident cache: its wall
  time against the sum of its 32 kernels' device times (target <= 1.15x), and cold (tuner,
  prepared launches and geometries forgotten; the modules stay loaded) against warm (target
  <= 1.1x), each the median of COLD_RUNS runs, with the first call's time to return and,
  timed apart, a cold first call's host time split into its parts.

Targets are measurements, not pass conditions: ``ok`` is the matrix and the checks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

GPTOSS = dict(B=1, Hq=64, Hkv=8, d=64)
HOST_GEOMETRIES = [  # (Sq, past_len, window)
    (512, 8192, 128), (512, 512, 128), (512, 8192, -1), (1, 8192, -1),
]
HOST_OVERHEAD_US = 10.0
CHUNKED_OVER_KERNELS = 1.15
COLD_OVER_WARM = 1.10
COLD_RUNS = 5  # cold and warm prefills timed, the median of each taken


def _tensors(T, *, Sq, past, B=1, Hq=64, Hkv=8, d=64, S_cap=None, seed=0):
    g = T.Generator(device="cuda").manual_seed(seed)
    S_cap = S_cap or past + Sq
    q = T.randn(B, Sq, Hq, d, device="cuda", generator=g).half()
    k = T.randn(B, Hkv, S_cap, d, device="cuda", generator=g).half()
    v = T.randn(B, Hkv, S_cap, d, device="cuda", generator=g).half()
    sink = (T.rand(Hq, device="cuda", generator=g) * 6 - 2).half()
    return q, k, v, sink


def check_stream(T, ht) -> dict:
    q, k, v, sink = _tensors(T, Sq=4096, past=12288)
    ht.attention(q, k, v, past_len=12288, sink=sink)  # tunes, prepares
    T.cuda.synchronize()
    side = T.cuda.Stream()
    cycles = int(50 * _cycles_per_ms(T))
    with T.cuda.stream(side):
        T.cuda._sleep(cycles)
        t0 = time.perf_counter()
        out = ht.attention(q, k, v, past_len=12288, sink=sink)
        call_ms = (time.perf_counter() - t0) * 1e3
        side_busy = not side.query()
    default_idle = T.cuda.default_stream().query()
    side.synchronize()
    ref = ht.attention(q, k, v, past_len=12288, sink=sink)
    T.cuda.synchronize()
    equal = bool(T.equal(out, ref))
    return {"ok": side_busy and default_idle and equal, "call_returned_ms": call_ms,
            "side_stream_busy_after_call": side_busy, "default_stream_idle": default_idle,
            "equal_to_default_stream_call": equal, "geometry": "4096@12288, Hq 64, Hkv 8, d 64, sink"}


def check_graph(T, ht) -> dict:
    q, k, v, sink = _tensors(T, Sq=512, past=8192, seed=1)
    ht.attention(q, k, v, past_len=8192, window=128, sink=sink)  # the eager call before capture
    T.cuda.synchronize()
    graph = T.cuda.CUDAGraph()
    with T.cuda.graph(graph):
        out = ht.attention(q, k, v, past_len=8192, window=128, sink=sink)
    q.copy_(T.randn_like(q.float()).half())
    graph.replay()
    T.cuda.synchronize()
    ref = ht.attention(q, k, v, past_len=8192, window=128, sink=sink)
    T.cuda.synchronize()
    equal = bool(T.equal(out, ref))
    return {"ok": equal, "replay_equal_to_eager": equal,
            "geometry": "512@8192 window 128, Hq 64, Hkv 8, d 64, sink"}


def check_compile(T, ht) -> dict:
    q, k, v, sink = _tensors(T, Sq=256, past=1024, seed=2)

    def f(q, k, v, sink):
        return ht.attention(q, k, v, past_len=1024, sink=sink) * 2.0

    eager = f(q, k, v, sink)
    compiled = T.compile(f, fullgraph=True)(q, k, v, sink)
    T.cuda.synchronize()
    equal = bool(T.equal(eager, compiled))
    return {"ok": equal, "fullgraph": True, "equal_to_eager": equal,
            "geometry": "256@1024, Hq 64, Hkv 8, d 64, sink"}


_CYCLES: list = []


def _cycles_per_ms(T) -> float:
    if not _CYCLES:
        from refattn.timing import TorchEventTimer

        _CYCLES.append(TorchEventTimer(T).cycles_per_ms or 1.5e6)
    return _CYCLES[0]


def _device_ms(T, fn, reps: int = 30) -> float:
    """The median device time of ``fn()`` (events around each call, behind a GPU hold)."""
    from refattn.timing import Call, TorchEventTimer

    return statistics.median(TorchEventTimer(T)(Call("hipkernel-torch", fn, T.cuda.synchronize),
                                                warmup=3, reps=reps))


def _enqueue_us(T, fn, n: int = 500) -> float:
    """The host's time per call of ``n`` calls of ``fn`` queued behind a GPU hold, so that
    none waits for the GPU (us, median of 5)."""
    runs = []
    for _ in range(5):
        T.cuda.synchronize()
        T.cuda._sleep(int(min(1000.0, n * 0.2) * _cycles_per_ms(T)))
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) * 1e6 / n)
        T.cuda.synchronize()
    return statistics.median(runs)


def enqueue_breakdown(T, ht) -> dict:
    """Where the host time of a warm call of the first host geometry goes, each part timed
    on its own behind a GPU hold: the whole call, the output's allocation, and the
    prepared launch as the warm call makes it (``api.PreparedCall.enqueue``, the driver's
    enqueue included) with the call's pointers."""
    Sq, past, window = HOST_GEOMETRIES[0]
    q, k, v, sink = _tensors(T, Sq=Sq, past=past, seed=3)
    out = T.empty_like(q)
    ht.attention(q, k, v, past_len=past, window=window, sink=sink)
    call = ht._geometry(q, k, v, sink, window, False, None, None).call
    ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), sink.data_ptr(), out.data_ptr(), past,
            ht.RUNTIME.stream_of(q.device.index))
    return {"call_us": _enqueue_us(T, lambda: ht.attention(q, k, v, past_len=past, window=window, sink=sink)),
            "call_with_out_us": _enqueue_us(T, lambda: ht.attention(q, k, v, past_len=past, window=window,
                                                                    sink=sink, out=out)),
            "empty_like_us": _enqueue_us(T, lambda: T.empty_like(q)),
            "prepared_launch_us": _enqueue_us(T, lambda: call.enqueue(*ptrs))}


def host_overhead(T, ht, n: int = 500) -> list[dict]:
    rows = []
    for Sq, past, window in HOST_GEOMETRIES:
        q, k, v, sink = _tensors(T, Sq=Sq, past=past, seed=3)
        call = lambda: ht.attention(q, k, v, past_len=past, window=window, sink=sink)  # noqa: E731
        kernel_ms = _device_ms(T, call)
        bursts = []
        for _ in range(5):
            T.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                call()
            T.cuda.synchronize()
            bursts.append((time.perf_counter() - t0) * 1e3 / n)
        burst_ms = statistics.median(bursts)
        enqueue_us = _enqueue_us(T, call, n)  # the host's own cost per call
        over_us = (burst_ms - kernel_ms) * 1e3
        rows.append({"sq": Sq, "past_len": past, "window": window, "sink": "per_head",
                     "kernel_ms": kernel_ms, "burst_ms_per_call": burst_ms,
                     "host_overhead_us": over_us, "host_enqueue_us": enqueue_us,
                     "target_us": HOST_OVERHEAD_US, "hit": over_us <= HOST_OVERHEAD_US})
        print(f"  {Sq}@{past} w{window}: kernel {kernel_ms * 1e3:.1f} us, burst {burst_ms * 1e3:.1f} "
              f"us/call, overhead {over_us:.1f} us, enqueue {enqueue_us:.1f} us", flush=True)
    return rows


def _forget(ht) -> None:
    """A cold start: the tuner, the prepared launches and the torch geometries forgotten,
    the modules still loaded."""
    from hipkernel import api
    from hipkernel.autotune import TUNER

    TUNER.clear()
    api.PLANS.clear()
    ht.clear()


def cold_first_call_parts(T, ht, q, k, v, sink, runs: int = COLD_RUNS) -> dict:
    """The host time of a cold first call (the tuner, the prepared launches and the
    geometries forgotten, the modules loaded) split into its parts, us, those of the run of
    ``runs`` whose whole call is the median: the geometry's checks
    (``hipkernel.torch._geometry``), ``api.prepare_call`` (the plan, the tuner, the backend's
    preparation of the launch), the prepared call's launch, and the whole call; ``rest_us``
    is the whole less the three. Each part is timed by a wrapper put around it for this
    measurement only, and taken off after it."""
    from hipkernel import api

    names = ("geometry_us", "prepare_call_us", "launch_us")
    seen: dict[str, float] = {}

    def timed(name, fn):
        def part(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                seen[name] = seen.get(name, 0.0) + (time.perf_counter() - t0) * 1e6
        return part

    saved = ht._geometry, api.prepare_call, api.PreparedCall.__call__
    ht._geometry = timed("geometry_us", saved[0])
    api.prepare_call = timed("prepare_call_us", saved[1])
    api.PreparedCall.__call__ = timed("launch_us", saved[2])
    rows = []
    try:
        for _ in range(runs):
            _forget(ht)
            seen.clear()
            T.cuda.synchronize()
            t0 = time.perf_counter()
            ht.attention(q, k, v, past_len=0, sink=sink)
            whole = (time.perf_counter() - t0) * 1e6
            T.cuda.synchronize()
            rows.append({"call_us": whole, **{n: seen.get(n, 0.0) for n in names},
                         "rest_us": whole - sum(seen.get(n, 0.0) for n in names)})
    finally:
        ht._geometry, api.prepare_call, api.PreparedCall.__call__ = saved
    return sorted(rows, key=lambda r: r["call_us"])[len(rows) // 2]


def chunked_prefill(T, ht, total: int = 16384, chunk: int = 512) -> dict:
    from hipkernel.autotune import TUNER

    q, k, v, sink = _tensors(T, Sq=total, past=0, seed=4)
    chunks = [q[:, c:c + chunk].contiguous() for c in range(0, total, chunk)]

    def wall() -> tuple[float, float]:
        """The whole prefill's wall time, and its first call's time to return."""
        T.cuda.synchronize()
        t0 = time.perf_counter()
        for i, qc in enumerate(chunks):
            ht.attention(qc, k, v, past_len=i * chunk, sink=sink)
            if i == 0:
                t1 = time.perf_counter()
        T.cuda.synchronize()
        return time.perf_counter() - t0, t1 - t0

    wall()  # the modules loaded, every candidate's included
    colds = []
    for _ in range(COLD_RUNS):  # each a fresh start
        _forget(ht)
        colds.append(wall())
    warms = [wall() for _ in range(COLD_RUNS)]
    cold, cold_first = (statistics.median(x) for x in zip(*colds))
    warm, warm_first = (statistics.median(x) for x in zip(*warms))
    kernels = [_device_ms(T, lambda qc=qc, i=i: ht.attention(qc, k, v, past_len=i * chunk, sink=sink),
                          reps=10) for i, qc in enumerate(chunks)]
    kernel_sum_s = sum(kernels) / 1e3
    first_parts = cold_first_call_parts(T, ht, chunks[0], k, v, sink)
    res = {"chunks": total // chunk, "chunk": chunk, "geometry": GPTOSS, "sink": "per_head",
           "warm_s": warm, "kernel_sum_s": kernel_sum_s, "warm_over_kernels": warm / kernel_sum_s,
           "target_over_kernels": CHUNKED_OVER_KERNELS,
           "hit_over_kernels": warm / kernel_sum_s <= CHUNKED_OVER_KERNELS,
           "cold_s": cold, "cold_over_warm": cold / warm, "target_cold_over_warm": COLD_OVER_WARM,
           "cold_first_call_s": cold_first, "warm_first_call_s": warm_first,
           "cold_first_call_parts_us": first_parts,
           "cold_runs_s": [c for c, _ in colds], "warm_runs_s": [w for w, _ in warms],
           "hit_cold_over_warm": cold / warm <= COLD_OVER_WARM, "sweeps": TUNER.sweeps,
           "autotune": TUNER.choices(),
           "note": f"median of {COLD_RUNS} runs each; cold: the tuner, the prepared launches and "
                   "the geometries forgotten before each run, the "
                   "modules still loaded; the sweep is pruned (hipkernel.autotune)"}
    print(f"  chunked {total} ({total // chunk} x {chunk}): warm {warm * 1e3:.2f} ms, kernels "
          f"{kernel_sum_s * 1e3:.2f} ms ({res['warm_over_kernels']:.3f}x), cold {cold * 1e3:.2f} ms "
          f"({res['cold_over_warm']:.3f}x warm); first call cold {cold_first * 1e3:.3f} ms, warm "
          f"{warm_first * 1e3:.3f} ms", flush=True)
    print("  cold first call, us: " + ", ".join(f"{n} {x:.1f}" for n, x in first_parts.items()),
          flush=True)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hipkernel.torch_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="directory for torch-h200.json")
    ap.add_argument("--suites", default="seed,extended,ragged,bf16")
    args = ap.parse_args(argv)

    import torch as T

    from hipkernel import record
    from hipkernel import torch as ht
    from refattn.cases import load_suites
    from refattn.fileio import atomic_write_text
    from refattn.kernels import get_kernel
    from refattn.runner import run_matrix

    args.out.mkdir(parents=True, exist_ok=True)
    kernel = get_kernel("hipkernel-torch")
    ok, why = kernel.available()
    if not ok:
        print(f"hipkernel-torch is not available here: {why}", file=sys.stderr)
        return 2
    # The host path is timed first, in the process as a serving loop starts it; the part
    # timings are taken again after the matrix and after the checks (torch.compile among
    # them), so that the record shows whether what ran before changes it.
    host = host_overhead(T, ht)
    stages = {"start": enqueue_breakdown(T, ht)}
    m = run_matrix(kernel, load_suites(args.suites.split(",")))
    doc = m.to_json()
    print(f"  matrix: {sum(r['outcome'] == 'pass' for r in doc['results'])} pass of "
          f"{len(doc['results'])}, ok={m.ok}", flush=True)
    stages["after_matrix"] = enqueue_breakdown(T, ht)
    checks = {}
    for name, fn in (("stream", check_stream), ("graph", check_graph), ("compile", check_compile)):
        try:
            checks[name] = fn(T, ht)
        except Exception as e:  # noqa: BLE001 - a failed check is recorded, the rest still run
            checks[name] = {"ok": False, "error": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"}
        print(f"  check {name}: {checks[name]}", flush=True)
    stages["after_checks"] = enqueue_breakdown(T, ht)
    for stage, parts in stages.items():
        print(f"  host parts {stage}: " + ", ".join(f"{k} {x:.1f}" for k, x in parts.items()), flush=True)
    chunked = chunked_prefill(T, ht)
    be = ht.RUNTIME.backend(T.device("cuda", T.cuda.current_device()))
    body = {"backend": be.name, "arch": be.arch, "torch": T.__version__, "suites": args.suites.split(","),
            "results": doc["results"], "checks": checks, "host": host, "host_parts": stages,
            "chunked_16k": chunked}
    ok = m.ok and all(c.get("ok") for c in checks.values())
    rec = record.stamp("torch", be.device_name, body, ok, kernel="hipkernel-torch")
    path = args.out / "torch-h200.json"
    atomic_write_text(path, json.dumps(rec, indent=1, allow_nan=False) + "\n")
    print(f"wrote {path}: ok={ok}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
