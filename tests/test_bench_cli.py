"""`refattn bench` on a CPU: the FLOP count, shape and flag parsing, the no-GPU and no-torch
paths, the record's JSON shape, and the ratio / target logic. The timing itself needs a GPU
(benchmarks/test_bench_kernels.py); here a recording backend stands in for the device."""

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from hipkernel import bench
from refattn import cli, visible
from tests.fake_backend import RecordingBackend

ROOT = Path(__file__).resolve().parent.parent
NO_TORCH = "torch not importable: ModuleNotFoundError: No module named 'torch'"


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# --------------------------------------------------------------------------- FLOPs

def brute_force_flops(shape: bench.Shape) -> float:
    """4 * d * Hq * B * (number of visible (query, key) pairs), counted pair by pair."""
    g = shape.geometry
    p = shape.past_len + np.arange(shape.sq)[:, None]
    j = np.arange(shape.skv)[None, :]
    return 4.0 * g["d"] * g["Hq"] * g["B"] * int(visible(p, j, shape.window).sum())


@pytest.mark.parametrize("name", [
    "gptoss-1@0", "gptoss-7@0", "gptoss-7@5", "gptoss-7@5-w1", "gptoss-7@5-w3", "gptoss-7@0-w3",
    "gptoss-16@32-w8", "gptoss-9@2-w100", "d128-33@17-w16", "d128-64@0",
])
def test_flops_match_a_brute_force_count(name):
    s = bench.parse_shape(name)
    assert s.flops() == brute_force_flops(s)


def test_flops_of_the_default_shapes_in_closed_form():
    gpt = 4 * 64 * 64  # 4 * d * Hq * B
    s = bench.parse_shape("gptoss-512@8192")  # rows see 8193 .. 8704 keys
    assert s.flops() == gpt * (8193 + 8704) * 512 // 2
    assert bench.parse_shape("gptoss-512@15872-w128").flops() == gpt * 512 * 128
    assert bench.parse_shape("gptoss-16384@0").flops() == gpt * 16384 * 16385 // 2
    w = bench.parse_shape("gptoss-16384@0-w128").flops()  # 127 warm-up rows, then 128 each
    assert w == gpt * (128 * 129 // 2 + (16384 - 128) * 128)
    assert bench.parse_shape("d128-512@8192").flops() == 4 * 128 * 32 * (8193 + 8704) * 512 // 2


def test_the_formula_is_written_out():
    assert bench.FLOP_FORMULA.startswith("FLOPs = 4 * d * Hq * B * sum_rows(visible keys of the row)")
    assert "FLOPs = 4 * d * Hq * B * sum_rows(visible keys of the row)" in bench.__doc__


# --------------------------------------------------------------------------- shapes and flags

def test_default_shapes_and_targets():
    names = [s.name for s in bench.default_shapes()]
    assert names == list(bench.DEFAULT_SHAPE_NAMES)
    assert {s.family for s in bench.default_shapes()} == {"gptoss", "d128"}
    t = {s.name: s.target_ms for s in bench.default_shapes()}
    assert t["gptoss-512@8192"] == 0.25 and t["gptoss-512@15872"] == 0.46
    assert t["gptoss-512@512-w128"] == t["gptoss-512@8192-w128"] == t["gptoss-512@15872-w128"] == 0.03
    assert t["gptoss-16384@0"] == 5.0 and t["gptoss-16384@0-w128"] == 0.15
    assert t["d128-512@8192"] is None and t["d128-16384@0"] is None
    s = bench.parse_shape("d128-16384@0")
    assert (s.geometry, s.skv, s.window) == (dict(B=1, Hq=32, Hkv=8, d=128), 16384, -1)


def test_parse_shapes_lists_families_all_and_dedupes():
    assert [s.name for s in bench.parse_shapes("all")] == list(bench.DEFAULT_SHAPE_NAMES)
    assert [s.name for s in bench.parse_shapes("d128")] == ["d128-512@8192", "d128-16384@0"]
    got = bench.parse_shapes(" gptoss-0512@8192-w128 , gptoss-512@8192-w128,gptoss-1024@4096 ")
    assert [s.name for s in got] == ["gptoss-512@8192-w128", "gptoss-1024@4096"]
    assert got[0].target_ms == 0.03 and got[1].target_ms is None


@pytest.mark.parametrize("text, words", [
    ("nope", ["'nope' is not a shape name", "FAMILY-SQ@PAST[-wW]"]),
    ("llama-512@0", ["unknown family 'llama'", "gptoss, d128"]),
    ("gptoss-512@8192-w0", ["W >= 1"]),
    ("gptoss-0@10", ["Sq must be >= 1"]),
    (",", ["comma-separated list"]),
])
def test_bad_shapes_are_rejected(text, words):
    with pytest.raises(Exception) as e:
        bench.parse_shapes(text)
    for w in words:
        assert w in str(e.value)


def test_parse_peers():
    assert bench.parse_peers("none") == []
    assert bench.parse_peers("FLEX, sdpa,flex") == ["flex", "sdpa"]
    assert bench.parse_peers("sdpa,cudnn,flex") == list(bench.PEERS)


@pytest.mark.parametrize("argv, words", [
    (["--shapes", "nope"], ["argument --shapes", "'nope' is not a shape name", "gptoss-512@8192"]),
    (["--shapes", "gptoss-512@8192,gptoss-1@1-w0"], ["argument --shapes", "W >= 1"]),
    (["--peers", "sdpa,flash3"], ["argument --peers", "unknown peer 'flash3'", "sdpa, cudnn, flex"]),
    (["--peers", ""], ["argument --peers"]),
    (["--reps", "5"], ["argument --reps", ">= 20"]),
    (["--reps", "many"], ["argument --reps", "expected an int"]),
    (["--warmup", "-1"], ["argument --warmup"]),
    (["--rounds", "0"], ["argument --rounds"]),
    (["--rounds", "31"], ["argument --rounds", "at most --reps (30)"]),
    (["--rounds", "21", "--reps", "20"], ["argument --rounds", "at most --reps (20)"]),
    (["--kernel", "model"], ["argument --kernel", "hipkernel"]),
    (["--frobnicate"], ["unrecognized arguments: --frobnicate"]),
])
def test_bad_flags_exit_2_naming_the_flag(capsys, argv, words):
    code, _, err = run_cli(capsys, "bench", *argv)
    assert code == 2, err
    for w in words:
        assert w in err, err
    assert "Traceback" not in err


def test_help_shows_the_formula_and_examples(capsys):
    code, out, _ = run_cli(capsys, "bench", "--help")
    assert code == 0
    assert "FLOPs = 4 * d * Hq * B" in out and "--peers" in out and "exit status" in out


def test_importing_bench_imports_neither_torch_nor_a_gpu_backend():
    code = ("import sys, hipkernel.bench; "
            "print(sorted(m for m in ('torch', 'hipkernel.backends', 'cuda', 'hip') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


# --------------------------------------------------------------------------- no GPU, no torch

def test_no_gpu_prints_the_reason_and_exits_2(capsys, monkeypatch):
    def no_gpu(kernel):
        raise bench.BenchUnavailable(f"{kernel} cannot run here: no GPU backend available; tried:\n"
                                     "  cuda: BackendUnavailable: cuInit failed: CUDA_ERROR_NO_DEVICE")
    monkeypatch.setattr(bench, "open_backend", no_gpu)
    monkeypatch.setattr(bench, "probe_torch", lambda: (None, NO_TORCH))
    code, out, err = run_cli(capsys, "bench", "--shapes", "gptoss-512@8192")
    assert code == 2 and out == ""
    assert "refattn bench: error: needs a GPU: hipkernel cannot run here" in err
    assert "CUDA_ERROR_NO_DEVICE" in err and NO_TORCH in err
    assert "Traceback" not in err


def test_no_gpu_here_for_real_exits_2(capsys):
    from hipkernel.backends import available_backends

    if any(be is not None for _, be, _ in available_backends()):
        pytest.skip("a GPU backend works here: `refattn bench` would run the real benchmark")
    code, out, err = run_cli(capsys, "bench", "--shapes", "gptoss-512@8192", "--json", "-")
    assert code == 2 and out == ""
    assert "refattn bench: error: needs a GPU" in err and "Traceback" not in err


def test_peers_without_torch_are_skipped_with_the_reason():
    avail = bench.peers_available(["sdpa", "flex"], None, NO_TORCH)
    assert avail["sdpa"] == avail["flex"] == {"available": False, "reason": NO_TORCH}
    assert avail["cudnn"] == {"available": False, "reason": "not requested (--peers)"}


@pytest.fixture
def fake_gpu(monkeypatch):
    """A recording backend as the device, and no torch: hipkernel is 'timed' by the backend's
    events (1 ms a call, as the fake reports), every peer is skipped with the reason."""
    be = RecordingBackend()
    monkeypatch.setattr(bench, "open_backend", lambda kernel: be)
    monkeypatch.setattr(bench, "probe_torch", lambda: (None, NO_TORCH))
    monkeypatch.setenv("HIPKERNEL_TUNE", "0")  # no autotune sweep on the fake
    return be


def test_without_torch_hipkernel_is_timed_and_peers_are_skipped(capsys, fake_gpu, tmp_path):
    path = tmp_path / "gpu" / "bench.json"
    code, out, err = run_cli(capsys, "bench", "--shapes", "gptoss-16@0,gptoss-16@32-w8",
                             "--json", str(path))
    assert code == 0, err
    rec = json.loads(path.read_text())
    assert rec["kind"] == "bench" and rec["ok"] is True and rec["device"] == "no device"
    assert {"shapes", "ceilings", "flop_formula", "peers_available", "kernel_source_hash"} <= set(rec)
    assert rec["flop_formula"] == bench.FLOP_FORMULA
    assert rec["ceilings"] == {"reason": NO_TORCH}
    assert all(v == {"available": False, "reason": NO_TORCH} for v in rec["peers_available"].values())
    assert "backend events" in rec["timing"]["method"] and rec["timing"]["reps"] == 30
    assert [r["name"] for r in rec["shapes"]] == ["gptoss-16@0", "gptoss-16@32-w8"]
    for r in rec["shapes"]:
        hk = r["hipkernel"]
        assert hk["sink"]["ms"] == hk["nosink"]["ms"] == 1.0 and hk["error"] is None
        assert hk["sink"]["tflops"] == pytest.approx(r["flops"] / 1e9 / 1.0)
        assert hk["resident_time_ms"] == 1.0 and hk["config"] == "default (autotune off)"
        assert {p["status"] for p in r["peers"].values()} == {"n/a"}
        assert r["best_peer"] is None and r["ratio"] is None and r["target"] is None
    # the launches were the kernel's, with and without the sink
    modes = {launch["args"][11] for launch in fake_gpu.launches}
    assert modes == {0, 1}
    assert "FLOPs = 4 * d * Hq * B" in out and "gptoss-16@32-w8" in out and f"wrote {path}" in out
    assert "peers: sdpa no" in err  # progress on stderr


def test_json_to_stdout_and_the_table_to_stderr(capsys, fake_gpu):
    code, out, err = run_cli(capsys, "bench", "--shapes", "gptoss-16@0", "--peers", "flex",
                             "--json", "-", "-q")
    assert code == 0, err
    rec = json.loads(out)
    assert rec["peers_requested"] == ["flex"]
    assert rec["peers_available"]["sdpa"]["reason"] == "not requested (--peers)"
    assert rec["shapes"][0]["peers"]["sdpa"]["reason"] == "not requested (--peers)"
    assert "gptoss-16@0" in err  # the table
    assert not any(line.startswith("[") for line in err.splitlines())  # no progress with -q


def test_a_missed_target_is_reported_and_fails_only_with_strict(capsys, fake_gpu, tmp_path):
    argv = ["bench", "--shapes", "gptoss-512@512-w128", "--json", str(tmp_path / "b.json"), "-q"]
    code, out, _ = run_cli(capsys, *argv)
    assert code == 0 and "MISS 33.33x" in out  # 1 ms measured by the fake, target 0.03 ms
    assert json.loads((tmp_path / "b.json").read_text())["shapes"][0]["target"]["hit"] is False
    code, _, _ = run_cli(capsys, *argv, "--strict")
    assert code == 1


def test_a_hipkernel_failure_is_recorded_and_exits_1(capsys, fake_gpu, tmp_path, monkeypatch):
    def broken(self):
        raise RuntimeError("kernel exploded")
    monkeypatch.setattr(bench.ShapeBench, "setup", broken)
    code, out, _ = run_cli(capsys, "bench", "--shapes", "gptoss-16@0", "--json",
                           str(tmp_path / "b.json"), "-q")
    rec = json.loads((tmp_path / "b.json").read_text())
    assert code == 1 and rec["ok"] is False
    assert rec["shapes"][0]["hipkernel"]["error"] == "RuntimeError: kernel exploded"
    assert "ERROR" in out and "kernel exploded" in out


def test_default_json_path():
    assert bench.default_json_path("NVIDIA H200") == Path("reports/gpu/bench-h200.json")
    assert bench.default_json_path("NVIDIA A100-SXM4-80GB") == Path(
        "reports/gpu/bench-nvidia-a100-sxm4-80gb.json")


# --------------------------------------------------------------------------- rows, ratio, targets

def hk(ms, shape):
    return bench.timing_result([ms * 1.1, ms, ms * 0.9], shape.flops())


def peers(**kw):
    """name=ms (timed) or name=status string."""
    out = {}
    for name in bench.PEERS:
        x = kw.get(name, "n/a")
        sink = bench.PEER_SINK[name]
        out[name] = (bench.peer_result("ok", ms=x, flops=1e9, variant="v", rel_l2=1e-4, sink=sink)
                     if isinstance(x, float) else bench.peer_result(x, reason=f"{name} {x}", sink=sink))
    return out


def test_timing_result_takes_the_median():
    r = bench.timing_result([3.0, 1.0, 2.0, 100.0, 2.5], flops=2e9)
    assert r["ms"] == 2.5 and r["tflops"] == pytest.approx(2e9 / 2.5 / 1e9)
    assert (r["n"], r["min_ms"], r["max_ms"]) == (5, 1.0, 100.0)


# --------------------------------------------------------------------------- interleaved rounds

class DriftingTimer:
    """A device whose clock slows as it works: the k-th timed call of the run (any
    implementation) takes ``base[name] * (1 + drift * k)`` ms. Records each burst."""

    def __init__(self, base, drift=0.01):
        self.base, self.drift, self.k, self.bursts = base, drift, 0, []

    def __call__(self, fn, *, warmup, reps):
        name = fn()
        self.bursts.append((name, warmup, reps))
        out = []
        for _ in range(reps):
            out.append(self.base[name] * (1 + self.drift * self.k))
            self.k += 1
        return out


def named(name, context=None):
    return bench.Call(lambda: name, context or bench.contextlib.nullcontext)


def test_round_reps_splits_evenly_larger_shares_first():
    assert bench.round_reps(30, 1) == [30]
    assert bench.round_reps(30, 3) == [10, 10, 10]
    assert bench.round_reps(30, 4) == [8, 8, 7, 7]
    assert sum(bench.round_reps(23, 5)) == 23
    for bad in (0, 31):
        with pytest.raises(ValueError, match="rounds"):
            bench.round_reps(30, bad)


def test_carryover_orders_are_balanced():
    """Every order is a permutation; over the design each implementation stands in each place
    equally often and follows each other one equally often (n rows for an even n, 2n for an
    odd one)."""
    for n in range(1, 9):
        rows = bench.carryover_orders(n)
        assert len(rows) == (2 * n if n % 2 else n)
        assert all(sorted(r) == list(range(n)) for r in rows)
        places = Counter((i, x) for r in rows for i, x in enumerate(r))
        assert set(places.values()) == {len(rows) // n}
        follows = Counter((a, b) for r in rows for a, b in zip(r, r[1:]))
        assert len(follows) == n * (n - 1) and len(set(follows.values())) <= 1
    assert bench.carryover_orders(5)[0] == [0, 1, 4, 2, 3]


def test_rounds_time_every_implementation_in_turn_in_balanced_orders():
    timer = DriftingTimer({"a": 1.0, "b": 1.0, "c": 1.0})
    fns = {n: named(n) for n in ("a", "b", "c")}
    times = bench.time_interleaved(timer, fns, warmup=5, reps=30, rounds=6)
    order = [b[0] for b in timer.bursts]
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b",
                     "c", "b", "a", "a", "c", "b", "b", "a", "c"]
    # within the rounds, each implementation follows each other one twice
    rounds = [order[i:i + 3] for i in range(0, 18, 3)]
    assert Counter((x, y) for r in rounds for x, y in zip(r, r[1:])) == \
        {(x, y): 2 for x in "abc" for y in "abc" if x != y}
    assert all(w == 5 and r == 5 for _, w, r in timer.bursts)
    assert {n: len(t) for n, t in times.items()} == {"a": 30, "b": 30, "c": 30}
    # more rounds than the design has rows: it starts over
    timer = DriftingTimer({"a": 1.0, "b": 1.0})
    bench.time_interleaved(timer, {n: named(n) for n in "ab"}, warmup=0, reps=20, rounds=3)
    assert [b[0] for b in timer.bursts] == ["a", "b", "b", "a", "a", "b"]


def test_rounds_share_a_drifting_clock_fairly():
    """Two implementations of the same speed under a clock that slows 1 % a call: timed in
    one burst each, the second looks a quarter slower; in 3 interleaved rounds, within 10 %."""
    base = {"a": 1.0, "b": 1.0}
    fns = {n: named(n) for n in base}

    def ratio(rounds):
        t = bench.time_interleaved(DriftingTimer(base), fns, warmup=0, reps=30, rounds=rounds)
        ms = {n: bench.timing_result(v, 1e9)["ms"] for n, v in t.items()}
        return ms["b"] / ms["a"]

    assert ratio(1) == pytest.approx(1.445 / 1.145)  # medians at calls 44.5 and 14.5
    assert abs(ratio(3) - 1) < 0.1 and abs(ratio(3) - 1) < abs(ratio(1) - 1) / 3


def test_an_implementation_that_fails_while_timed_is_dropped_and_reported():
    timer = DriftingTimer({"a": 1.0, "c": 2.0})

    def boom():
        raise RuntimeError("peer fell over")
    errors = []
    times = bench.time_interleaved(timer, {"a": named("a"), "b": bench.Call(boom), "c": named("c")},
                                   warmup=1, reps=20, rounds=2,
                                   on_error=lambda n, e: errors.append((n, str(e))))
    assert set(times) == {"a", "c"} and len(times["a"]) == len(times["c"]) == 20
    assert errors == [("b", "peer fell over")]  # once: not tried again in round 2
    # a Call runs inside its context, once a round
    entered = []

    class Ctx:
        def __enter__(self):
            entered.append(1)

        def __exit__(self, *a):
            return False
    bench.time_interleaved(DriftingTimer({"a": 1.0}), {"a": named("a", Ctx)}, warmup=0,
                           reps=20, rounds=4)
    assert len(entered) == 4


def test_a_peer_that_fails_while_timed_is_n_a_and_hipkernel_failing_is_raised():
    def boom():
        raise RuntimeError("cudnn fell over")
    env = bench.Env(be=None, kernel="hipkernel", timer=DriftingTimer({"hk": 1.0, "flex": 2.0}),
                    warmup=0, reps=20, requested=["sdpa", "flex"], rounds=2)
    sb = bench.ShapeBench(env, bench.parse_shape("gptoss-16@0"))
    sb.calls = {"hipkernel:per_head": named("hk"), "hipkernel:none": named("hk"),
                "sdpa": bench.Call(boom), "flex": named("flex")}
    sb.peers = {"sdpa": bench.peer_result("ok", variant="v"),
                "flex": bench.peer_result("ok", variant="f", sink=True),
                "cudnn": bench.peer_result("n/a", reason="not requested")}
    sb.time_all(["sdpa", "cudnn", "flex"])
    assert sb.peers["sdpa"]["status"] == "n/a" and "cudnn fell over" in sb.peers["sdpa"]["reason"]
    assert sb.peers["flex"]["status"] == "ok" and sb.peers["flex"]["variant"] == "f"
    assert sb.peers["flex"]["ms"] > 2.0 and sb.hk["per_head"]["ms"] < sb.peers["flex"]["ms"]
    assert sb.peers["cudnn"]["ms"] is None  # not checked ok: not timed
    sb.calls["hipkernel:none"] = bench.Call(boom)
    with pytest.raises(RuntimeError, match="hipkernel:none failed while timed"):
        sb.hipkernel("none")


def test_bench_times_hipkernel_in_rounds_and_records_them(capsys, fake_gpu, tmp_path):
    calls = []
    real = fake_gpu.time_ms

    def time_ms(fn, warmup=1, reps=3):
        calls.append((warmup, reps))
        return real(fn, warmup=warmup, reps=reps)
    fake_gpu.time_ms = time_ms
    path = tmp_path / "b.json"
    code, out, err = run_cli(capsys, "bench", "--shapes", "gptoss-16@0", "--rounds", "4",
                             "--json", str(path), "-q")
    assert code == 0, err
    rec = json.loads(path.read_text())
    assert rec["timing"]["rounds"] == 4 and "carryover-balanced" in rec["timing"]["order"]
    assert "in 4 interleaved rounds" in out
    # both sink modes, 4 rounds each of 8, 8, 7, 7 calls; then the resident figure (30)
    assert calls[:8] == [(5, 8), (5, 8), (5, 8), (5, 8), (5, 7), (5, 7), (5, 7), (5, 7)]
    assert rec["shapes"][0]["hipkernel"]["sink"]["n"] == 30


def test_best_peer_is_the_fastest_timed_one():
    assert bench.best_peer(peers(sdpa=0.2, cudnn=0.15, flex=0.3)) == "cudnn"
    assert bench.best_peer(peers(sdpa=0.2, cudnn="mismatch", flex=0.3)) == "sdpa"
    assert bench.best_peer(peers()) is None


def test_ratio_is_like_for_like_with_the_best_peer():
    s = bench.parse_shape("gptoss-512@8192")
    # best is cudnn (no sink): hipkernel's no-sink time over it
    row = bench.shape_row(s, s.flops(), hk(0.24, s), hk(0.20, s), peers(sdpa=0.25, cudnn=0.16, flex=0.4))
    assert row["best_peer"] == "cudnn" and row["ratio_basis"] == "no sink"
    assert row["ratio"] == pytest.approx(0.20 / 0.16) and row["best_peer_ms"] == 0.16
    # best is flex (sink): hipkernel's sink time over it
    row = bench.shape_row(s, s.flops(), hk(0.24, s), hk(0.20, s), peers(flex=0.30, sdpa="mismatch"))
    assert row["best_peer"] == "flex" and row["ratio_basis"] == "sink"
    assert row["ratio"] == pytest.approx(0.24 / 0.30)
    row = bench.shape_row(s, s.flops(), hk(0.24, s), hk(0.20, s), peers())
    assert row["best_peer"] is None and row["ratio"] is None and row["ratio_basis"] is None


def test_target_hit_and_miss_use_the_sink_time():
    s = bench.parse_shape("gptoss-512@8192")  # target 0.25 ms
    hit = bench.shape_row(s, s.flops(), hk(0.25, s), hk(0.30, s), peers())["target"]
    assert hit == {"ms": 0.25, "measured_ms": 0.25, "ratio": pytest.approx(1.0), "hit": True}
    miss = bench.shape_row(s, s.flops(), hk(0.30, s), hk(0.20, s), peers())["target"]
    assert miss["hit"] is False and miss["ratio"] == pytest.approx(1.2)
    failed = bench.shape_row(s, s.flops(), None, None, peers(), error="RuntimeError: x")["target"]
    assert failed["hit"] is None and failed["measured_ms"] is None
    d = bench.parse_shape("d128-512@8192")
    assert bench.shape_row(d, d.flops(), hk(1.0, d), hk(1.0, d), peers())["target"] is None


def window_rows(*ms):
    return [bench.shape_row(s, s.flops(), hk(m, s), hk(m, s), peers())
            for s, m in zip(map(bench.parse_shape, bench.FLAT_GROUP), ms)]


def test_window_flatness_across_the_cache():
    flat = bench.judge_targets(window_rows(0.020, 0.021, 0.0215))
    assert flat["flat"]["hit"] is True and flat["flat"]["spread"] == pytest.approx(1.075)
    assert flat["hits"] == list(bench.FLAT_GROUP) and flat["misses"] == []
    steep = bench.judge_targets(window_rows(0.020, 0.025, 0.031))
    assert steep["flat"]["hit"] is False and steep["flat"]["spread"] == pytest.approx(1.55)
    assert steep["misses"] == ["gptoss-512@15872-w128"]  # 0.031 > 0.03
    assert bench.judge_targets(window_rows(0.02, 0.02))["flat"] is None  # one shape not run


def fake_body():
    rows = window_rows(0.020, 0.021, 0.0215)
    s = bench.parse_shape("gptoss-512@8192")
    rows.append(bench.shape_row(s, s.flops(), hk(0.30, s), hk(0.28, s),
                                peers(sdpa=0.26, cudnn="mismatch", flex=0.5), config="m4_b64",
                                resident_ms=0.35))
    ceilings = {"gemm_fp16": {"n": 8192, "flops": 2.0 * 8192 ** 3, "ms": 1.5,
                              "tflops": 2.0 * 8192 ** 3 / 1.5 / 1e9, "formula": "2 * n^3"},
                "copy": {"bytes": 2 << 30, "ms": 0.514, "tbps": (2 << 30) / 0.514 / 1e9,
                         "formula": "read + write"}}
    avail = {p: {"available": True, "reason": f"{p} ok"} for p in bench.PEERS}
    timing = {"method": "events", "statistic": "median", "warmup": 5, "reps": 30}
    meta = {"kernel": "hipkernel", "device": "NVIDIA H200", "arch": "sm_90", "torch": "2.11.0"}
    return bench.make_body(rows, ceilings=ceilings, peers_available=avail, timing=timing, meta=meta)


def test_the_record_body_from_fake_timings():
    from hipkernel import record

    body = fake_body()
    rec = record.stamp("bench", "NVIDIA H200", body, ok=bench.body_ok(body))
    doc = json.loads(json.dumps(rec, allow_nan=False))
    assert doc["kind"] == "bench" and doc["ok"] is True and doc["device"] == "NVIDIA H200"
    assert record.check_record(doc) == []
    assert doc["flop_formula"] == bench.FLOP_FORMULA
    assert set(doc["ceilings"]) == {"gemm_fp16", "copy"}
    assert set(doc["peers_available"]) == set(bench.PEERS)
    row = doc["shapes"][-1]
    assert set(row) == {"name", "geometry", "flops", "hipkernel", "peers", "best_peer", "best_peer_ms",
                        "ratio", "ratio_basis", "target"}
    assert row["geometry"] == {"name": "gptoss-512@8192", "family": "gptoss", "B": 1, "Hq": 64, "Hkv": 8,
                               "d": 64, "sq": 512, "past_len": 8192, "skv": 8704, "window": -1,
                               "dtype": "fp16"}
    assert set(row["hipkernel"]) == {"sink", "nosink", "config", "resident_time_ms", "error"}
    assert set(row["hipkernel"]["sink"]) >= {"ms", "tflops", "n"}
    assert set(row["peers"]["sdpa"]) == {"status", "ms", "tflops", "sink", "variant", "rel_l2",
                                         "reason", "rejected"}
    assert row["best_peer"] == "sdpa" and row["ratio"] == pytest.approx(0.28 / 0.26)
    assert doc["targets"]["misses"] == ["gptoss-512@8192"] and doc["targets"]["flat"]["hit"] is True


def test_the_table_from_fake_timings():
    text = bench.format_report(fake_body())
    assert bench.FLOP_FORMULA in text
    assert "fp16 GEMM 8192^3 1.500 ms = 733 TF/s" in text and "4.18 TB/s" in text
    line = next(x for x in text.splitlines() if x.startswith("gptoss-512@8192 "))
    assert "0.3000" in line and "0.2800" in line and "0.2600" in line and "mismatch" in line
    assert "1.08x (no sink)" in line and "MISS 1.20x" in line
    assert "hit 0.67x" in next(x for x in text.splitlines() if x.startswith("gptoss-512@512-w128"))
    assert "targets (hipkernel with sink): 3 hit, 1 missed (gptoss-512@8192)" in text
    assert "max/min = 1.075 (limit 1.10) hit" in text
    assert "gptoss-512@8192 cudnn: mismatch: cudnn mismatch" in text


def test_when_every_peer_disagrees_the_kernel_is_the_suspect():
    s = bench.parse_shape("gptoss-512@8192")
    row = bench.shape_row(s, s.flops(), hk(0.2, s), hk(0.2, s), peers(sdpa="mismatch", flex="mismatch"))
    body = bench.make_body([row], ceilings={}, peers_available={}, timing={}, meta={})
    assert "every peer that ran disagrees with hipkernel: suspect the kernel" in bench.format_report(body)
    row = bench.shape_row(s, s.flops(), hk(0.2, s), hk(0.2, s), peers(sdpa=0.3, flex="mismatch"))
    body = bench.make_body([row], ceilings={}, peers_available={}, timing={}, meta={})
    assert "suspect the kernel" not in bench.format_report(body)


def test_why_no_configuration_ran_groups_the_errors():
    why = bench._why_none_ran(["a, native GQA: RuntimeError: no kernel",
                               "b, native GQA: RuntimeError: no kernel",
                               "a, KV heads repeated x8: ValueError: bad"])
    assert why == ("RuntimeError: no kernel (tried: a, native GQA; b, native GQA); "
                   "ValueError: bad (tried: a, KV heads repeated x8)")


def test_a_json_path_that_cannot_be_written_is_refused_before_the_bench(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "open_backend", lambda *a: (_ for _ in ()).throw(AssertionError("benched")))
    code, out, err = run_cli(capsys, "bench", "--shapes", "gptoss-512@8192", "--json", str(tmp_path))
    assert code == 2 and err.strip().startswith(f"refattn bench: error: --json: {tmp_path} is a directory"), err
