"""GPU benchmarks: the fused kernel (hipkernel) against torch's attention kernels and
FlashAttention 4, each checked against the fp64 reference, then timed in one process on the
same inputs. The pytest face of ``refattn bench`` (``refattn/bench.py`` holds the engine,
``refattn/adapters/torch_peers.py`` the peers, ``benchmarks/shapes.toml`` the shapes and targets; this file
only drives them).

Not collected by the default ``pytest`` run (testpaths = tests), and skipped, with the
reason, where hipkernel has no GPU backend or torch sees no CUDA device. Run on the GPU
machine from the repository root::

    PYTHONPATH=. python -m pytest benchmarks/test_bench_kernels.py -q
    PYTHONPATH=. python -m pytest benchmarks/test_bench_kernels.py -q -k "w128"         # windowed shapes
    PYTHONPATH=. python -m pytest benchmarks/test_bench_kernels.py -q -k "hipkernel or sdpa"
    REFATTN_BENCH_STRICT=1 PYTHONPATH=. python -m pytest benchmarks/test_bench_kernels.py -q

Per shape of the shapes file, ``refattn.bench.bench_shape`` runs once (a module-scoped
fixture): hipkernel with the sink and without, and the peers ``sdpa`` (FlashAttention-2
backend), ``cudnn`` (cuDNN backend), ``flex`` (compiled FlexAttention, the sink applied from
its LSE) and ``fa4`` (FlashAttention 4, the sink as its ``learnable_sink``), each first
checked against the fp64 reference on sampled row blocks, then timed in interleaved balanced
rounds. One test per implementation then reports what it measured: hipkernel failing its
check fails its test; a peer that cannot run the shape (or is not installed) is skipped with
the reason; a peer whose output does not match the reference fails (it is misconfigured).

Work is counted as useful FLOPs::

    FLOPs = 4 * d * Hq * B * sum_rows(visible keys of the row)

(row i at p = past_len + i sees p + 1 keys, min(p + 1, W) under a window; 2 FLOPs per
multiply-add for q.k and for p.v). The numbers are device-event medians (``--reps`` 30
calls after 5 warm-up calls a round, the launch queue held behind a GPU sleep so host launch
overhead is outside the events); each test records them as user properties (``ms``,
``tflops``), and the summary table printed at the end of the module has the fp16 GEMM and
copy ceilings of the same run, the ratio to the best peer and the targets. A missed target is
reported as MISS in the summary; with ``REFATTN_BENCH_STRICT=1`` it fails the hipkernel test
(wall-clock targets are not gated by default). The record to commit is ``refattn bench
--json``, not this file's output.
"""

from __future__ import annotations

import os

import pytest

from refattn import bench
from refattn.timing import make_timer, measure_ceilings, probe_torch

pytestmark = pytest.mark.gpu

STRICT = os.environ.get("REFATTN_BENCH_STRICT") == "1"
REPS, WARMUP, ROUNDS = bench.DEFAULT_REPS, bench.DEFAULT_WARMUP, bench.DEFAULT_ROUNDS
KERNEL = "hipkernel"
SPEC, SHAPES = bench.resolve_shapes(None)

_ROWS: dict[str, dict] = {}  # shape name -> report row, filled as each shape finishes
_STATE: dict = {"run": None, "ceilings": None, "torch": None}


@pytest.fixture(scope="module")
def run():
    """hipkernel, the peers (or why each cannot run), torch's event timer."""
    from refattn.kernels import KernelError, get_kernel, kernel_available, kernel_source_hash

    T, reason = probe_torch()
    if T is None:
        pytest.skip(f"needs torch with a CUDA device: {reason}")
    try:
        adapter = get_kernel(KERNEL)
    except KernelError as e:
        pytest.skip(f"needs {KERNEL}: {e}")
    ok, why = kernel_available(adapter)
    if not ok:
        pytest.skip(f"needs a GPU: {why}")
    kernel = bench.Impl(adapter.name, adapter, "kernel", True, why, kernel_source_hash(adapter),
                        adapter.synchronize)
    peers = []
    for name in bench.DEFAULT_PEERS:
        pa = bench.resolve_peer(name)
        pok, preason = kernel_available(pa)
        peers.append(bench.Impl(pa.name, pa, "peer", pok, preason, None, pa.synchronize))
    _STATE["torch"] = T
    _STATE["run"] = bench.Run(kernel, peers, timer=make_timer(T), warmup=WARMUP, reps=REPS,
                              rounds=ROUNDS)
    return _STATE["run"]


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: s.name)
def row(request, run):
    """One shape benched (checked, then timed in rounds). Module-scoped and parametrised:
    every test of a shape runs before the next shape is set up."""
    r = bench.bench_shape(run, request.param)
    _ROWS[request.param.name] = r
    return request.param, r


@pytest.fixture(scope="module", autouse=True)
def summary(pytestconfig):
    yield
    run = _STATE["run"]
    tr = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    capman = pytestconfig.pluginmanager.get_plugin("capturemanager")
    if run is None or not _ROWS or tr is None or capman is None:
        return
    T = _STATE["torch"]
    rows = list(_ROWS.values())
    body = {"kernel": run.kernel.name, "kernel_source_hash": run.kernel.source_hash,
            "device": T.cuda.get_device_name(0), "torch": T.__version__,
            "peers_requested": [p.name for p in run.peers],
            "peers_available": {p.name: {"available": p.available, "reason": p.reason} for p in run.peers},
            "timing": {"method": run.timer.method, "warmup": WARMUP, "reps": REPS, "rounds": ROUNDS},
            "ceilings": _STATE["ceilings"] or {"reason": "not measured in this run"},
            "shapes": rows,
            "targets": bench.judge_targets(rows, SPEC.flat, run.kernel.name, SPEC.peer_within)}
    with capman.global_and_fixture_disabled():  # teardown output is captured otherwise
        tr.write_line("")
        for line in bench.format_report(body).splitlines():
            tr.write_line(line)


def test_ceilings(run):
    """fp16 GEMM (torch.mm 8192^3) TF/s and device copy (1 GiB, read + write) TB/s."""
    c = measure_ceilings(_STATE["torch"], run.timer, warmup=WARMUP, reps=REPS)
    _STATE["ceilings"] = c
    assert c["gemm_fp16"]["tflops"] > 0 and c["copy"]["tbps"] > 0


@pytest.mark.parametrize("mode", bench.MODES, ids=["hipkernel-sink", "hipkernel-nosink"])
def test_hipkernel(row, mode, record_property):
    shape, r = row
    if mode not in shape.modes:
        pytest.skip(f"{shape.name} has no sink")
    res = r["results"][KERNEL][mode]
    assert res["status"] == "ok", f"{KERNEL} ({mode}) on {shape.name}: {res['status']}: {res['reason']}"
    for key in ("ms", "tflops", "variant", "rel_l2"):
        record_property(key, res[key])
    if STRICT and r["target"] and mode == r["target"]["mode"]:
        t = r["target"]
        assert t["hit"], (f"{shape.name}: {KERNEL} {t['measured_ms']:.4f} ms > target {t['ms']:g} ms "
                          f"({t['ratio']:.2f}x)")


@pytest.mark.parametrize("peer", bench.DEFAULT_PEERS)
def test_peer(row, peer, record_property):
    shape, r = row
    entry = r["results"][peer]
    res = entry.get("sink") or entry.get("nosink")
    if res["status"] == "n/a":
        pytest.skip(f"{peer} on {shape.name}: {res['reason']}")
    assert res["status"] == "ok", f"{peer} on {shape.name} is misconfigured: {res['reason']}"
    for key in ("ms", "tflops", "variant", "rel_l2"):
        record_property(key, res[key])
    record_property("sink", entry.get("sink") is not None)
