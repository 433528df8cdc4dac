"""`refattn bench` on a CPU: the generic engine driven by NumPy adapters (their ``prepare``
returns NumPy callables) and a fake timer. Covered: the FLOP count, the shapes file and its
errors, the flags, the refusal of an adapter without ``prepare``, the check against the fp64
reference on sampled rows (a wrong peer is ``mismatch``, a raising one ``n/a``), the sink
modes and the like-for-like ratio, the record and its stamp, the balanced order of the
rounds, bf16 rows (the bf16 baseline, the bf16_within target), ragged shapes (their FLOPs,
the per-sequence check, the zero padded rows, finite inputs), what the torch peers declare
without torch, and hipkernel's ``prepare`` on a backend whose launches run the model. The
timing itself needs a GPU (benchmarks/test_bench_kernels.py)."""

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from refattn import bench, cli, timing, visible
from refattn.cases import Case, make_inputs
from refattn.lowp import round_bf16
from refattn.reference import attention, attention_with_baseline
from refattn.timing import Prepared

ROOT = Path(__file__).resolve().parent.parent
HERE = "tests.test_bench_cli"


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# --------------------------------------------------------------------------- fake adapters

def _rounded(out, dtype: str) -> np.ndarray:
    """An fp32 result as a kernel of ``dtype`` returns it: fp16, or float32 holding bf16."""
    return round_bf16(out) if dtype == "bf16" else out.astype(np.float16)


def _reference16(x) -> np.ndarray:
    k, v = x.clean_kv()
    return _rounded(attention(x.q, k, v, **x.reference_kwargs()), x.dtype)


class FakeKernel:
    """A correct NumPy "kernel": prepare() computes once per launch into a held output. It
    takes ragged batches and bf16 (output float32 holding bf16 values)."""

    name = "fake-kernel"
    ragged = True
    launches = 0

    def supports(self, case):
        return case.softcap == 0

    def source_hash(self):
        return "fake-source-0123456789abcdef"

    def run(self, x):
        x.out[...] = _reference16(x)
        return 0, x.out

    def _out(self, x):
        return _reference16(x)

    def prepare(self, x):
        box = {}

        def launch():
            type(self).launches += 1
            box["out"] = self._out(x)
        return Prepared(launch, output=lambda: box["out"], close=box.clear, variant="numpy fp32",
                        extra={"dtype": x.dtype})

    def synchronize(self):
        pass


class NoSinkPeer(FakeKernel):
    """A peer without a sink, a window or ragged batches (like SDPA)."""

    name = "nosink-peer"
    ragged = False

    def supports(self, case):
        return case.sink == "none" and case.window < 0


class SinkPeer(FakeKernel):
    name = "sink-peer"


class WrongPeer(FakeKernel):
    """Off by 0.05 in one row of the middle sampled block of a 120-row chunk."""

    name = "wrong-peer"
    row = 60

    def _out(self, x):
        out = _reference16(x).astype(np.float32)
        if self.row < out.shape[1]:
            out[:, self.row] += 0.05
        return out.astype(np.float16)


class WrongUnsampledPeer(WrongPeer):
    """Off only in row 40, between the sampled blocks (0-32, 44-76, 88-120)."""

    name = "wrong-unsampled-peer"
    row = 40


class RaisingPeer(FakeKernel):
    name = "raising-peer"

    def prepare(self, x):
        raise RuntimeError("no kernel image for this device")


class NoPrepare:
    name = "no-prepare"

    def supports(self, case):
        return True

    def run(self, x):
        return FakeKernel().run(x)


class NoHashKernel(FakeKernel):
    name = "no-hash"
    source_hash = None


class RunCheckedKernel(FakeKernel):
    """prepare() returns a bare callable: the check goes through run()."""

    name = "run-checked"

    def prepare(self, x):
        return lambda: None


class WrongKernel(WrongPeer):
    name = "wrong-kernel"
    row = 0


class PaddedRowPeer(FakeKernel):
    """Right on every valid row; one element of a padded row left non-zero."""

    name = "padded-row-peer"

    def _out(self, x):
        out = _reference16(x)
        if x.q_len is not None and x.q_len.min() < out.shape[1]:
            out[int(np.argmin(x.q_len)), -1, 0, 0] = 1e-3  # the last row: padding there
        return out


class PaddedRowKernel(PaddedRowPeer):
    name = "padded-row-kernel"


class LongestPastPeer(FakeKernel):
    """Every sequence of a ragged batch at the batch's longest past_len (the kernel bug of
    one diagonal for the batch)."""

    name = "longest-past-peer"

    def _out(self, x):
        if x.q_len is None:
            return _reference16(x)
        B, sq = x.q.shape[:2]
        p = int(x.past_len.max())
        kw = {**x.reference_kwargs(), "past_len": np.full(B, p), "q_len": x.q_len}
        return _rounded(attention(x.q, x.k[:, :, :p + sq], x.v[:, :, :p + sq], **kw), x.dtype)


class Fp16OutPeer(FakeKernel):
    """On bf16 inputs, the reference rounded to fp16: closer than any bf16 kernel comes."""

    name = "fp16-out-peer"

    def _out(self, x):
        k, v = x.clean_kv()
        return attention(x.q, k, v, **x.reference_kwargs()).astype(np.float16)


class FakeTimer:
    """Each burst: the call launched once (so a failure shows), then ``reps`` times of
    ``ms["NAME|MODE|DTYPE"]``, else ``ms["NAME|MODE"]``, else ``ms["NAME"]`` (default 1 ms;
    the dtype from the prepared call's ``extra``, where the fakes put it). Records (call
    name, warmup, reps)."""

    method = "fake timer"

    def __init__(self, ms=None):
        self.ms, self.bursts = dict(ms or {}), []

    def __call__(self, call, *, warmup, reps):
        call.fn()
        call.sync()
        self.bursts.append((call.name, warmup, reps))
        name, _, mode = call.name.rpartition("|")
        dtype = (getattr(call.fn, "extra", None) or {}).get("dtype")
        return [self.ms.get(f"{call.name}|{dtype}", self.ms.get(call.name, self.ms.get(name, 1.0)))] * reps


TINY = """
description = "tiny shapes for CPU tests"

[families.tiny]
Hq = 4
Hkv = 2
d = 16
sink = true
why = "small"

[families.plain]
Hq = 4
Hkv = 4
d = 16

[[shape]]
family = "tiny"
sq = 8
past_len = 4
target_ms = 2.0

[[shape]]
family = "tiny"
sq = 120
past_len = 50
window = 16
target_ms = 0.5

[[shape]]
family = "plain"
sq = 20
past_len = 3

[[flat]]
shapes = ["tiny-8@4", "tiny-120@50-w16"]
limit = 1.2
why = "test"
"""


@pytest.fixture
def shapes_file(tmp_path):
    p = tmp_path / "tiny.toml"
    p.write_text(TINY)
    return p


@pytest.fixture
def fake_timer(monkeypatch):
    """The fake timer, and no torch (also where torch and a GPU are present): the fakes are
    NumPy adapters, and the ceilings need torch."""
    t = FakeTimer()
    monkeypatch.setattr(bench, "make_timer", lambda T: t)
    monkeypatch.setattr(bench, "probe_torch", lambda: (None, "torch left out by the test"))
    return t


def bench_json(capsys, shapes_file, *argv, kernel=f"{HERE}:FakeKernel", peers=None):
    args = ["bench", "--kernel", kernel, "--shapes", str(shapes_file), "--json", "-", "-q",
            "--reps", "20", "--rounds", "2"]
    if peers is not None:
        args += ["--peers", peers]
    code, out, err = run_cli(capsys, *args, *argv)
    return code, (json.loads(out) if out.strip() else None), err


# --------------------------------------------------------------------------- FLOPs

def brute_force_flops(shape: bench.Shape) -> float:
    """4 * d * Hq * B * (number of visible (query, key) pairs), counted pair by pair."""
    p = shape.past_len + np.arange(shape.sq)[:, None]
    j = np.arange(shape.skv)[None, :]
    return 4.0 * shape.d * shape.Hq * shape.B * int(visible(p, j, shape.window).sum())


@pytest.mark.parametrize("name", [
    "gptoss-1@0", "gptoss-7@0", "gptoss-7@5", "gptoss-7@5-w1", "gptoss-7@5-w3", "gptoss-7@0-w3",
    "gptoss-16@32-w8", "gptoss-9@2-w100", "d128-33@17-w16", "d128-64@0",
])
def test_flops_match_a_brute_force_count(name):
    s = bench.parse_shape(name)
    assert s.flops() == brute_force_flops(s) == s.case(True).flops


def test_flops_of_the_default_shapes_in_closed_form():
    gpt = 4 * 64 * 64  # 4 * d * Hq * B
    assert bench.parse_shape("gptoss-512@8192").flops() == gpt * (8193 + 8704) * 512 // 2
    assert bench.parse_shape("gptoss-512@15872-w128").flops() == gpt * 512 * 128
    assert bench.parse_shape("gptoss-16384@0").flops() == gpt * 16384 * 16385 // 2
    w = bench.parse_shape("gptoss-16384@0-w128").flops()  # 127 warm-up rows, then 128 each
    assert w == gpt * (128 * 129 // 2 + (16384 - 128) * 128)
    assert bench.parse_shape("d128-512@8192").flops() == 4 * 128 * 32 * (8193 + 8704) * 512 // 2


def test_the_formula_is_written_out():
    assert bench.FLOP_FORMULA.startswith("FLOPs = 4 * d * Hq * B * sum_rows(visible keys of the row)")
    assert "FLOPs = 4 * d * Hq * B * sum_rows(visible keys of the row)" in bench.__doc__


# --------------------------------------------------------------------------- the shapes file

def test_the_default_shapes_and_targets_come_from_the_repos_file():
    spec, shapes = bench.resolve_shapes(None)
    assert spec.path == ROOT / "benchmarks" / "shapes.toml"
    assert spec.dtypes == ("fp16", "bf16") and spec.bf16_within == 1.05
    fp16 = [s.name for s in shapes if s.dtype == "fp16"]
    assert fp16 == [
        "gptoss-512@8192", "gptoss-512@15872", "gptoss-512@512-w128", "gptoss-512@8192-w128",
        "gptoss-512@15872-w128", "gptoss-16384@0", "gptoss-16384@0-w128", "gptoss-2048@14336",
        "gptoss-128@8192", "gptoss4-4096@4096", "d128-512@8192", "d128-16384@0",
        "gptoss-ragged8-512"]
    # each shape's bf16 row right after its fp16 row
    assert [s.name for s in shapes] == [n + suffix for n in fp16 for suffix in ("", "-bf16")]
    t = {s.name: s.target_ms for s in shapes}
    assert t["gptoss-512@8192"] == 0.25 and t["gptoss-512@15872"] == 0.46
    assert t["gptoss-512@512-w128"] == t["gptoss-512@8192-w128"] == t["gptoss-512@15872-w128"] == 0.03
    assert t["gptoss-16384@0"] == 5.0 and t["gptoss-16384@0-w128"] == 0.15
    assert t["d128-512@8192"] is None and t["d128-16384@0"] is None
    assert all(t[n] is None for n in ("gptoss-2048@14336", "gptoss-128@8192", "gptoss4-4096@4096",
                                      "gptoss-ragged8-512"))
    for s in shapes:  # target_ms on the fp16 row, bf16_within on the bf16 row
        assert (s.dtype, s.bf16_within) in (("fp16", None), ("bf16", 1.05))
        assert s.dtype == "fp16" or s.target_ms is None
    assert all(s.sink for s in shapes)
    b4 = bench.parse_shape("gptoss4-4096@4096")
    assert (b4.geometry, b4.skv) == (dict(B=4, Hq=64, Hkv=8, d=64), 8192)
    r = spec.by_name()["gptoss-ragged8-512"]
    assert r.ragged and r.geometry == dict(B=8, Hq=64, Hkv=8, d=64) and r.sq == 512
    assert r.past_lens == (128, 256, 512, 1024, 2048, 4096, 8192, 16384) and r.q_lens == (512,) * 8
    assert r.skv == 16384 + 512 and r.window == -1 and r.modes == ("sink", "nosink")
    assert "not 8x the longest" in r.why
    s = bench.parse_shape("d128-16384@0")
    assert (s.geometry, s.skv, s.window) == (dict(B=1, Hq=32, Hkv=8, d=128), 16384, -1)
    (flat,) = spec.flat
    assert flat.shapes == ["gptoss-512@512-w128", "gptoss-512@8192-w128", "gptoss-512@15872-w128"]
    assert flat.limit == 1.10


def test_shapes_by_name_family_all_and_a_file(shapes_file):
    names = lambda text: [s.name for s in bench.resolve_shapes(text)[1]]  # noqa: E731
    assert names("all") == names(None)
    assert names("d128") == ["d128-512@8192", "d128-512@8192-bf16", "d128-16384@0", "d128-16384@0-bf16"]
    assert names(" gptoss-0512@8192-w128 , gptoss-512@8192-w128,gptoss-1024@4096 ") == [
        "gptoss-512@8192-w128", "gptoss-1024@4096"]
    _, got = bench.resolve_shapes("gptoss-512@8192-w128,gptoss-1024@4096")
    assert got[0].target_ms == 0.03 and got[1].target_ms is None and got[1].sink
    spec, got = bench.resolve_shapes(str(shapes_file))
    assert spec.path == shapes_file and [s.name for s in got] == ["tiny-8@4", "tiny-120@50-w16", "plain-20@3"]
    assert [s.sink for s in got] == [True, True, False] and got[2].modes == ("nosink",)


@pytest.mark.parametrize("text, words", [
    ("nope", ["'nope' is not a shape name", "FAMILY-SQ@PAST[-wW]", "gptoss-512@8192"]),
    ("llama-512@0", ["unknown family 'llama'", "gptoss, gptoss4, d128"]),
    ("llama-512@0-bf16", ["unknown family 'llama'"]),
    ("gptoss-512@8192-bf17", ["is not a shape name", "FAMILY-SQ@PAST[-wW][-bf16]"]),
    ("gptoss-ragged9-512", ["is not a shape name", "gptoss-ragged8-512"]),
    ("gptoss-512@8192-w0", ["W >= 1"]),
    ("gptoss-0@10", ["Sq must be >= 1"]),
    (",", ["comma-separated list"]),
])
def test_bad_shape_names_are_rejected(text, words):
    with pytest.raises(bench.ShapesError) as e:
        bench.resolve_shapes(text)
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("edit, words", [
    (lambda t: t.replace("sq = 8\n", "sq = 0\n"), ["shape #1", "sq: expected an integer >= 1, got 0"]),
    (lambda t: t.replace("target_ms = 2.0", "target_ms = \"fast\""), ["shape #1", "target_ms: expected a number"]),
    (lambda t: t.replace("window = 16", "window = 0"), ["shape #2", "window: expected -1 (no window) or W >= 1"]),
    (lambda t: t.replace('family = "plain"', 'family = "llama"'), ["shape #3", "unknown family 'llama'"]),
    (lambda t: t.replace("past_len = 3", "past_len = 3\nwindw = 4"), ["shape #3", "windw: unknown key"]),
    (lambda t: t.replace("Hkv = 4", "Hkv = 3"), ["families.plain", "Hq=4 is not a multiple of Hkv=3"]),
    (lambda t: t.replace("sink = true", "sink = 1"), ["families.tiny", "sink: expected true or false"]),
    (lambda t: t.replace('"tiny-8@4", ', '"tiny-9@4", '), ["flat #1", "'tiny-9@4' is not a shape of this file"]),
    (lambda t: t.replace("limit = 1.2", "limit = 0.5"), ["flat #1", "limit: expected a number >= 1"]),
    (lambda t: t + '\n[[shape]]\nfamily = "tiny"\nsq = 8\npast_len = 4\n', ["shape #4 (tiny-8@4)", "listed already"]),
    (lambda t: t.replace("[families.tiny]", "[families.tiny"), ["not valid TOML"]),
    (lambda t: t.replace("[families.tiny]", "[familes.tiny]"), ["familes: unknown key"]),
])
def test_a_bad_shapes_file_is_an_error_naming_file_entry_and_key(tmp_path, edit, words):
    p = tmp_path / "bad.toml"
    p.write_text(edit(TINY))
    with pytest.raises(bench.ShapesError) as e:
        bench.load_shapes(p)
    assert str(e.value).startswith(str(p))
    for w in words:
        assert w in str(e.value), str(e.value)


def test_a_bad_shapes_file_exits_2_naming_it(capsys, tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text(TINY.replace("sq = 8\n", "sq = -1\n"))
    code, out, err = run_cli(capsys, "bench", "--kernel", f"{HERE}:FakeKernel", "--shapes", str(p))
    assert code == 2 and out == ""
    assert err.startswith(f"refattn bench: error: --shapes: {p}: shape #1: sq: expected") and "Traceback" not in err
    code, _, err = run_cli(capsys, "bench", "--kernel", f"{HERE}:FakeKernel", "--shapes", str(tmp_path / "none.toml"))
    assert code == 2 and "none.toml: cannot read" in err


def test_without_a_shapes_file_the_error_says_where_it_looked(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "shapes_file_candidates", lambda: [tmp_path / "a.toml", tmp_path / "b.toml"])
    bench._DEFAULT_SPEC.clear()
    code, _, err = run_cli(capsys, "bench", "--kernel", f"{HERE}:FakeKernel")
    assert code == 2
    assert f"no shapes file: looked for {tmp_path / 'a.toml'} and {tmp_path / 'b.toml'}" in err
    assert "--shapes path/to/shapes.toml" in err


# --------------------------------------------------------------------------- flags and refusals

@pytest.mark.parametrize("argv, words", [
    (["--peers", ""], ["argument --peers"]),
    (["--reps", "5"], ["argument --reps", "at least 20 timed calls"]),
    (["--reps", "many"], ["argument --reps", "expected a whole number"]),
    (["--warmup", "-1"], ["argument --warmup"]),
    (["--rounds", "0"], ["argument --rounds"]),
    (["--rounds", "31"], ["argument --rounds", "at most --reps (30)"]),
    (["--rounds", "21", "--reps", "20"], ["argument --rounds", "at most --reps (20)"]),
    (["--frobnicate"], ["unrecognized arguments: --frobnicate"]),
    (["--peers", "flash3"], ["--peers: cannot use 'flash3'", "sdpa, cudnn, flex, fa4"]),
    (["--kernel", "nope"], ["unknown kernel 'nope'"]),
])
def test_bad_flags_exit_2_naming_the_flag(capsys, argv, words):
    args = ["--kernel", f"{HERE}:FakeKernel", *argv] if "--kernel" not in argv else argv
    code, _, err = run_cli(capsys, "bench", *args)
    assert code == 2, err
    for w in words:
        assert w in err, err
    assert "Traceback" not in err


def test_an_adapter_without_prepare_is_refused_naming_the_member(capsys, shapes_file, fake_timer):
    code, out, err = run_cli(capsys, "bench", "--kernel", f"{HERE}:NoPrepare", "--shapes", str(shapes_file))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "--kernel tests.test_bench_cli:NoPrepare: the adapter 'no-prepare' has no prepare() member" in err
    code, out, err = run_cli(capsys, "bench", "--kernel", f"{HERE}:FakeKernel", "--peers",
                             f"{HERE}:NoPrepare", "--shapes", str(shapes_file))
    assert code == 2 and "--peers tests.test_bench_cli:NoPrepare: the adapter 'no-prepare' has no prepare()" in err
    assert fake_timer.bursts == []  # refused before any work


def test_the_cpu_model_is_refused_for_want_of_prepare(capsys):
    code, _, err = run_cli(capsys, "bench", "--kernel", "model")
    assert code == 2 and "the adapter 'model' has no prepare() member" in err


def test_a_peer_named_as_the_kernel_is_refused(capsys, shapes_file):
    code, _, err = run_cli(capsys, "bench", "--kernel", f"{HERE}:FakeKernel", "--peers",
                           f"{HERE}:FakeKernel", "--shapes", str(shapes_file))
    assert code == 2 and "every implementation needs its own name" in err


def test_help_shows_the_formula_the_examples_and_the_exit_status(capsys):
    code, out, _ = run_cli(capsys, "bench", "--help")
    assert code == 0
    for w in ("FLOPs = 4 * d * Hq * B", "--peers", "--shapes", "examples:", "exit status: 0",
              "benchmarks/shapes.toml", "prepare()"):
        assert w in out, w


def test_importing_bench_imports_neither_torch_nor_hipkernel():
    code = ("import sys, refattn.bench, refattn.adapters.torch_peers, refattn.timing; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'hipkernel', 'cuda', 'hip')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_a_json_path_that_cannot_be_written_is_refused_before_the_bench(capsys, tmp_path, fake_timer):
    code, out, err = run_cli(capsys, "bench", "--kernel", f"{HERE}:FakeKernel", "--json", str(tmp_path))
    assert code == 2 and err.strip().startswith(f"refattn bench: error: --json: {tmp_path} is a directory"), err
    assert fake_timer.bursts == []


# --------------------------------------------------------------------------- the check

def test_the_reference_of_sampled_rows_is_the_reference_of_those_rows():
    s = bench.Shape("t", 1, 4, 2, 16, sq=130, past_len=37, window=24, sink=True)
    x = make_inputs(s.case(True))
    blocks = bench.check_row_blocks(s.sq)
    assert blocks == [(0, 32), (49, 81), (98, 130)]
    k, v = x.clean_kv()
    full, full_base = attention_with_baseline(x.q, k, v, **x.reference_kwargs())
    ref, base = bench.sampled_reference(x, blocks)
    rows = np.r_[0:32, 49:81, 98:130]
    np.testing.assert_allclose(ref, full[:, rows], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(base, full_base[:, rows], rtol=0, atol=1e-3)  # fp16-rounded
    assert bench.check_row_blocks(96) == [(0, 96)] and bench.check_row_blocks(97)[1] == (32, 64)


def test_a_correct_run_records_every_implementation_by_name(capsys, shapes_file, fake_timer):
    fake_timer.ms = {"fake-kernel|sink": 0.4, "fake-kernel|nosink": 0.3, "nosink-peer": 2.0,
                     "sink-peer": 3.0}
    code, rec, err = bench_json(capsys, shapes_file, peers=f"{HERE}:NoSinkPeer,{HERE}:SinkPeer")
    assert code == 0, err
    assert rec["kind"] == "bench" and rec["ok"] is True and rec["kernel"] == "fake-kernel"
    assert rec["kernel_spec"] == f"{HERE}:FakeKernel"
    assert rec["kernel_source_hash"] == "fake-source-0123456789abcdef" and "kernel_source_hash_note" not in rec
    assert rec["peers_requested"] == ["nosink-peer", "sink-peer"]
    assert rec["peers_available"]["sink-peer"] == {"available": True, "reason": "",
                                                   "source_hash": "fake-source-0123456789abcdef"}
    assert rec["shapes_file"] == str(shapes_file) and rec["flop_formula"] == bench.FLOP_FORMULA
    assert rec["ceilings"]["reason"].startswith("torch")
    assert rec["check"]["rows_per_block"] == bench.CHECK_ROWS
    first, windowed, plain = rec["shapes"]
    res = first["results"]
    assert set(res) == {"fake-kernel", "nosink-peer", "sink-peer"}
    k = res["fake-kernel"]
    assert k["role"] == "kernel" and k["sink"]["status"] == k["nosink"]["status"] == "ok"
    assert (k["sink"]["ms"], k["nosink"]["ms"], k["sink"]["n"]) == (0.4, 0.3, 20)
    assert k["sink"]["checked"] == "prepared launch" and k["sink"]["variant"] == "numpy fp32"
    assert 0 < k["sink"]["rel_l2"] <= k["sink"]["gate_rel_l2"]
    assert k["sink"]["tflops"] == pytest.approx(first["flops"] / 0.4 / 1e9)
    # the peer without a sink is timed in the no-sink mode, the one with it in the sink mode
    assert res["nosink-peer"]["sink"] is None and res["nosink-peer"]["nosink"]["ms"] == 2.0
    assert res["sink-peer"]["nosink"] is None and res["sink-peer"]["sink"]["ms"] == 3.0
    # best peer 2.0 ms, no sink: the kernel's no-sink time over it
    assert (first["best_peer"], first["best_peer_mode"], first["ratio_basis"]) == ("nosink-peer", "nosink", "no sink")
    assert first["ratio"] == pytest.approx(0.3 / 2.0)
    assert first["target"] == {"ms": 2.0, "mode": "sink", "measured_ms": 0.4, "ratio": 0.2, "hit": True}
    assert first["check_rows"] == [[0, 8]] and windowed["check_rows"] == [[0, 32], [44, 76], [88, 120]]
    # the windowed sink shape: the no-window peer cannot run it in either mode
    na = windowed["results"]["nosink-peer"]
    assert na["sink"] is None and na["nosink"]["status"] == "n/a"
    assert windowed["best_peer"] == "sink-peer" and windowed["ratio"] == pytest.approx(0.4 / 3.0)
    # a shape without a sink has one mode
    assert plain["results"]["fake-kernel"]["sink"] is None
    assert plain["results"]["sink-peer"]["nosink"]["ms"] == 3.0
    assert rec["targets"]["hits"] == ["tiny-8@4", "tiny-120@50-w16"] and rec["targets"]["misses"] == []
    assert rec["targets"]["flat"][0]["hit"] is True
    assert "fake-kernel" in err and "tiny-8@4" in err  # the table on stderr with --json -


def test_a_missed_target_exits_1_and_the_flatness_is_judged(capsys, shapes_file, fake_timer):
    fake_timer.ms = {"fake-kernel|sink": 1.0}
    code, rec, err = bench_json(capsys, shapes_file, peers="none")
    assert code == 1 and rec["ok"] is True  # a miss fails the command, not the record
    assert rec["targets"]["hits"] == ["tiny-8@4"] and rec["targets"]["misses"] == ["tiny-120@50-w16"]
    (flat,) = rec["targets"]["flat"]
    assert flat["ms"] == [1.0, 1.0] and flat["spread"] == 1.0 and flat["hit"] is True
    assert "MISS 2.00x" in err and "1 hit, 1 missed (tiny-120@50-w16)" in err
    fake_timer.ms = {"fake-kernel|sink": 0.2}
    code, rec, _ = bench_json(capsys, shapes_file, peers="none")
    assert code == 0 and rec["targets"]["misses"] == []


def test_a_wrong_peer_is_a_mismatch_against_the_reference_and_not_timed(capsys, shapes_file, fake_timer):
    code, rec, err = bench_json(capsys, shapes_file, peers=f"{HERE}:WrongPeer,{HERE}:SinkPeer")
    first, windowed = rec["shapes"][:2]
    wrong = windowed["results"]["wrong-peer"]["sink"]  # row 60: in the middle block (44-76)
    assert wrong["status"] == "mismatch" and wrong["ms"] is None
    assert wrong["rel_l2"] > wrong["gate_rel_l2"] and "does not match the fp64 reference" in wrong["reason"]
    assert first["results"]["wrong-peer"]["sink"]["status"] == "ok"  # 8 rows: no row 60
    timed_names = {b[0] for b in fake_timer.bursts}
    assert "wrong-peer|sink" in timed_names  # on tiny-8@4 only
    assert sum(b[0] == "wrong-peer|sink" for b in fake_timer.bursts) == 2  # 2 rounds, 1 shape
    assert windowed["best_peer"] == "sink-peer"
    assert rec["ok"] is True  # a peer's mismatch is reported, not a failure of the run
    assert "tiny-120@50-w16 wrong-peer: mismatch: does not match the fp64 reference" in err


def test_the_check_samples_rows_a_peer_wrong_between_the_blocks_passes(capsys, shapes_file, fake_timer):
    """What the sampling costs: row 40 of 120 is in no sampled block (module docstring)."""
    code, rec, _ = bench_json(capsys, shapes_file, peers=f"{HERE}:WrongUnsampledPeer")
    assert rec["shapes"][1]["results"]["wrong-unsampled-peer"]["sink"]["status"] == "ok"
    assert rec["shapes"][0]["results"]["wrong-unsampled-peer"]["sink"]["status"] == "ok"  # 8 rows: no row 40


def test_a_raising_peer_is_n_a_with_the_reason(capsys, shapes_file, fake_timer):
    code, rec, err = bench_json(capsys, shapes_file, peers=f"{HERE}:RaisingPeer,{HERE}:SinkPeer")
    assert code == 1 and rec["ok"] is True  # exit 1 for the missed target of tiny-120 only
    r = rec["shapes"][0]["results"]["raising-peer"]["sink"]
    assert r["status"] == "n/a" and r["reason"] == "RuntimeError: no kernel image for this device"
    assert rec["shapes"][0]["best_peer"] == "sink-peer"


def test_a_peer_that_fails_while_timed_is_n_a(capsys, shapes_file, monkeypatch):
    class Flaky(FakeTimer):
        def __call__(self, call, *, warmup, reps):
            if call.name.startswith("sink-peer"):
                raise RuntimeError("device lost")
            return super().__call__(call, warmup=warmup, reps=reps)
    t = Flaky()
    monkeypatch.setattr(bench, "make_timer", lambda T: t)
    code, rec, _ = bench_json(capsys, shapes_file, "--rounds", "4", peers=f"{HERE}:SinkPeer")
    r = rec["shapes"][0]["results"]["sink-peer"]["sink"]
    assert r["status"] == "n/a" and r["reason"] == "failed while timed: RuntimeError: device lost"
    assert rec["shapes"][0]["results"]["fake-kernel"]["sink"]["n"] == 20


def test_a_kernel_that_fails_its_check_fails_the_run(capsys, shapes_file, fake_timer):
    code, rec, err = bench_json(capsys, shapes_file, kernel=f"{HERE}:WrongKernel", peers="none")
    assert code == 1 and rec["ok"] is False
    first = rec["shapes"][0]
    assert first["results"]["wrong-kernel"]["sink"]["status"] == "mismatch"
    assert first["kernel_error"].startswith("sink: mismatch: does not match the fp64 reference")
    assert "ERROR" in err


def test_a_kernel_without_source_hash_says_its_freshness_is_unknown(capsys, shapes_file, fake_timer):
    code, rec, _ = bench_json(capsys, shapes_file, "--shapes", str(shapes_file), kernel=f"{HERE}:NoHashKernel",
                              peers="none")
    assert rec["kernel_source_hash"] is None
    assert "has no source_hash()" in rec["kernel_source_hash_note"] and "freshness is unknown" in rec["kernel_source_hash_note"]


def test_a_prepared_call_without_output_is_checked_through_run(capsys, shapes_file, fake_timer):
    code, rec, _ = bench_json(capsys, shapes_file, kernel=f"{HERE}:RunCheckedKernel", peers="none")
    r = rec["shapes"][0]["results"]["run-checked"]["sink"]
    assert r["status"] == "ok" and r["checked"] == "run()"


def test_the_record_file_and_the_table(capsys, shapes_file, fake_timer, tmp_path):
    fake_timer.ms = {"nosink-peer": 2.0}
    path = tmp_path / "gpu" / "bench.json"
    code, out, err = run_cli(capsys, "bench", "--kernel", f"{HERE}:FakeKernel", "--peers",
                             f"{HERE}:NoSinkPeer", "--shapes", str(shapes_file), "--json", str(path),
                             "--reps", "20", "--rounds", "4")
    rec = json.loads(path.read_text())
    assert rec["timing"]["rounds"] == 4 and "carryover-balanced" in rec["timing"]["order"]
    assert f"wrote {path} (ok=True" in out and "in 4 interleaved rounds" in out
    line = next(x for x in out.splitlines() if x.startswith("tiny-8@4 "))
    assert "1.000" in line and "2.000" in line and "0.50x (no sink)" in line and "hit 0.50x" in line
    assert "nosink-peer" in out.splitlines()[next(i for i, x in enumerate(out.splitlines()) if x.startswith("shape"))]
    assert "[" in err and "tiny-8@4 (sink, nosink)" in err  # progress on stderr
    # 3 shapes: the kernel in 2, 2, 1 modes and the peer in 1, 0, 1 (tiny-120 has a window)
    per_shape = Counter(b[0] for b in fake_timer.bursts)
    assert per_shape["fake-kernel|sink"] == 8 and per_shape["fake-kernel|nosink"] == 12
    assert per_shape["nosink-peer|nosink"] == 8
    assert all(w == 5 for _, w, _ in fake_timer.bursts)
    assert [r for _, _, r in fake_timer.bursts[:3]] == [5, 5, 5]  # 20 reps over 4 rounds


# --------------------------------------------------------------------------- bf16 rows and ragged shapes

MIXED = """
description = "bf16 rows and ragged shapes for CPU tests"
dtypes = ["fp16", "bf16"]
bf16_within = 1.1

[families.tiny]
Hq = 4
Hkv = 2
d = 16
sink = true

[[shape]]
family = "tiny"
sq = 8
past_len = 4
target_ms = 2.0

[[ragged]]
name = "tiny-cb3"
family = "tiny"
past_len = [5, 3, 40]
q_len = [30, 0, 7]
sq = 30
target_ms = 3.0
why = "three sequences, one of them empty"

[[ragged]]
name = "tiny-cb2-w8"
family = "tiny"
past_len = [0, 17]
sq = 12
window = 8
"""


@pytest.fixture
def mixed_file(tmp_path):
    p = tmp_path / "mixed.toml"
    p.write_text(MIXED)
    return p


def test_dtypes_and_ragged_tables_are_read(mixed_file):
    spec = bench.load_shapes(mixed_file)
    assert spec.dtypes == ("fp16", "bf16") and spec.bf16_within == 1.1
    assert [s.name for s in spec.shapes] == ["tiny-8@4", "tiny-8@4-bf16", "tiny-cb3", "tiny-cb3-bf16",
                                             "tiny-cb2-w8", "tiny-cb2-w8-bf16"]
    by = spec.by_name()
    assert [(s.dtype, s.target_ms, s.bf16_within) for s in spec.shapes[:4]] == [
        ("fp16", 2.0, None), ("bf16", None, 1.1), ("fp16", 3.0, None), ("bf16", None, 1.1)]
    cb3 = by["tiny-cb3"]
    assert cb3.ragged and cb3.B == 3 and cb3.past_lens == (5, 3, 40) and cb3.q_lens == (30, 0, 7)
    assert cb3.skv == 47 and cb3.sink and cb3.modes == ("sink", "nosink") and cb3.fp16_name == "tiny-cb3"
    w8 = by["tiny-cb2-w8"]
    assert w8.q_len is None and w8.q_lens == (12, 12) and w8.skv == 29 and w8.window == 8
    c = by["tiny-cb3-bf16"].case(True)
    assert (c.dtype, c.past_len, c.q_len, c.B, c.lowp) == ("bf16", (5, 3, 40), (30, 0, 7), 3, "bf16")
    assert c.name == "tiny-cb3-bf16" and by["tiny-cb3"].case(False).sink == "none"
    g = by["tiny-cb3"].to_dict()
    assert (g["past_len"], g["q_len"], g["ragged"], g["dtype"], g["B"]) == ([5, 3, 40], [30, 0, 7], True, "fp16", 3)
    assert by["tiny-8@4-bf16"].to_dict()["dtype"] == "bf16" and by["tiny-8@4"].to_dict()["ragged"] is False
    # without dtypes a file benches fp16 only; a file of ragged shapes alone is a shapes file
    assert bench.load_shapes(write(mixed_file.parent / "a.toml", TINY)).dtypes == ("fp16",)
    only = MIXED.replace('[[shape]]\nfamily = "tiny"\nsq = 8\npast_len = 4\ntarget_ms = 2.0\n', "")
    assert [s.name for s in bench.load_shapes(write(mixed_file.parent / "b.toml", only)).shapes][0] == "tiny-cb3"


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def swap(old: str, new: str):
    """An edit of a shapes file's text: ``old`` replaced by ``new``."""
    return lambda t: t.replace(old, new)


DT = 'dtypes = ["fp16", "bf16"]'
R1 = "ragged #1 (tiny-cb3)"


@pytest.mark.parametrize("edit, words", [
    (swap(DT, 'dtypes = ["fp32"]'), ["dtypes: 'fp32' is not one of 'fp16', 'bf16'"]),
    (swap(DT, "dtypes = []"), ["dtypes: expected a non-empty list"]),
    (swap(DT, 'dtypes = "bf16"'), ["dtypes: expected a non-empty list"]),
    (swap(DT, 'dtypes = ["bf16", "bf16"]'), ["dtypes: 'bf16' is listed twice"]),
    (swap(DT, 'dtypes = ["fp16"]'), ["bf16_within: needs both 'fp16' and 'bf16' in dtypes"]),
    (swap("bf16_within = 1.1", 'bf16_within = "fast"'), ["bf16_within: expected a number > 0"]),
    (swap("bf16_within = 1.1", "bf16_within = 0"), ["bf16_within: expected a number > 0"]),
    (swap("bf16_within = 1.1", 'dtype = "bf16"'), ["dtype: unknown key"]),
    (swap('name = "tiny-cb3"\n', ""), ["ragged #1", "name: required key is missing"]),
    (swap("past_len = [5, 3, 40]\n", ""), ["ragged #1", "past_len: required key is missing"]),
    (swap('name = "tiny-cb3"', 'name = "Tiny"'),
     ["ragged #1", "name: expected a string matching ^[a-z0-9][a-z0-9.@-]*$, got 'Tiny'"]),
    (swap('name = "tiny-cb3"', 'name = "tiny-8@4"'), ["ragged #1", "name: 'tiny-8@4' has the form FAMILY-SQ@PAST[-wW]"]),
    (swap('name = "tiny-cb3"', 'name = "tiny-cb3-bf16"'), ["ragged #1", "name: 'tiny-cb3-bf16' ends in -bf16"]),
    (swap("past_len = [5, 3, 40]", "past_len = 5"), [f"{R1}: past_len: expected a list of one integer per sequence"]),
    (swap("past_len = [5, 3, 40]", "past_len = []"), [f"{R1}: past_len: expected a list"]),
    (swap("past_len = [5, 3, 40]", "past_len = [5, -3, 40]"), [f"{R1}: past_len[1]: expected an integer >= 0, got -3"]),
    (swap("past_len = [5, 3, 40]", "past_len = [5, 3, 4.5]"), [f"{R1}: past_len[2]: expected an integer >= 0, got 4.5"]),
    (swap("q_len = [30, 0, 7]", "q_len = [30, 0]"),
     [f"{R1}: q_len: expected one entry per sequence (B = 3 from past_len), got 2"]),
    (swap("q_len = [30, 0, 7]", "q_len = [31, 0, 7]"), [f"{R1}: q_len[0]: expected an integer in [0, sq = 30], got 31"]),
    (swap("q_len = [30, 0, 7]", "q_len = [0, 0, 0]"), [f"{R1}: q_len: every sequence has 0 rows"]),
    (swap("sq = 30", "sq = 0"), [f"{R1}: sq: expected an integer >= 1, got 0"]),
    (swap('family = "tiny"\npast_len = [5', 'family = "llama"\npast_len = [5'), [f"{R1}: family: unknown family 'llama'"]),
    (swap("q_len = [30, 0, 7]", "q_len = [30, 0, 7]\nB = 3"), ["ragged #1", "B: unknown key"]),
    (swap("target_ms = 3.0", "target_ms = -1"), [f"{R1}: target_ms: expected a number of ms > 0"]),
    (swap("window = 8", "window = 0"), ["ragged #2 (tiny-cb2-w8): window: expected -1 (no window) or W >= 1"]),
    (swap("window = 8", 'window = 8\nsink = "yes"'), ["ragged #2 (tiny-cb2-w8): sink: expected true or false"]),
    (swap('name = "tiny-cb2-w8"', 'name = "tiny-cb3"'), ["ragged #2 (tiny-cb3)", "listed already"]),
    (lambda t: t + '\n[[flat]]\nshapes = ["tiny-cb3", "tiny-cb9"]\nlimit = 1.5\n',
     ["flat #1", "'tiny-cb9' is not a shape of this file"]),
    (lambda t: t[:t.index("[[shape]]")], ["shape: expected one or more [[shape]] tables (or [[ragged]] tables)"]),
])
def test_a_bad_dtype_or_ragged_entry_is_an_error_naming_file_entry_and_key(tmp_path, edit, words):
    p = write(tmp_path / "bad.toml", edit(MIXED))
    with pytest.raises(bench.ShapesError) as e:
        bench.load_shapes(p)
    assert str(e.value).startswith(str(p))
    for w in words:
        assert w in str(e.value), str(e.value)


def test_a_ragged_shape_beyond_the_case_limits_exits_2_naming_the_key(capsys, tmp_path, fake_timer):
    p = write(tmp_path / "big.toml", MIXED.replace("past_len = [5, 3, 40]", "past_len = [5, 3, 4000000000]"))
    code, out, err = run_cli(capsys, "bench", "--kernel", f"{HERE}:FakeKernel", "--shapes", str(p))
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.startswith("refattn bench: error: --shapes: case 'tiny-cb3': past_len: the cache "
                          "would hold"), err
    assert fake_timer.bursts == []


def test_a_flat_group_may_name_bf16_and_ragged_rows(tmp_path):
    spec = bench.load_shapes(write(tmp_path / "f.toml", MIXED + '\n[[flat]]\nshapes = ["tiny-8@4-bf16", '
                                                                  '"tiny-cb3-bf16"]\nlimit = 2\n'))
    assert spec.flat[0].shapes == ["tiny-8@4-bf16", "tiny-cb3-bf16"]


def test_bf16_names_pick_the_bf16_row(tmp_path):
    got = {s.name: s for s in bench.resolve_shapes("gptoss-512@8192-w128-bf16,gptoss-0512@8192-bf16,"
                                                   "gptoss-1024@4096-bf16,gptoss-ragged8-512-bf16")[1]}
    assert list(got) == ["gptoss-512@8192-w128-bf16", "gptoss-512@8192-bf16", "gptoss-1024@4096-bf16",
                         "gptoss-ragged8-512-bf16"]
    w = got["gptoss-512@8192-w128-bf16"]
    assert (w.dtype, w.target_ms, w.bf16_within, w.fp16_name) == ("bf16", None, 1.05, "gptoss-512@8192-w128")
    adhoc = got["gptoss-1024@4096-bf16"]  # not in the file: no target of either kind
    assert (adhoc.dtype, adhoc.target_ms, adhoc.bf16_within, adhoc.sink) == ("bf16", None, None, True)
    assert got["gptoss-ragged8-512-bf16"].ragged and got["gptoss-ragged8-512-bf16"].dtype == "bf16"
    # a file that benches fp16 only: its shapes' bf16 rows by name, with the shape's sink, no target
    spec = bench.load_shapes(write(tmp_path / "t.toml", TINY.replace('family = "plain"\nsq = 20\npast_len = 3',
                                                                     'family = "tiny"\nsq = 20\npast_len = 3\nsink = false')))
    s = bench.parse_shape("tiny-20@3-bf16", spec)
    assert (s.name, s.dtype, s.sink, s.target_ms) == ("tiny-20@3-bf16", "bf16", False, None)
    assert bench.parse_shape("tiny-8@4-bf16", spec).target_ms is None
    spec = bench.load_shapes(write(tmp_path / "m.toml", MIXED.replace('dtypes = ["fp16", "bf16"]\nbf16_within = 1.1\n', "")))
    r = bench.parse_shape("tiny-cb3-bf16", spec)
    assert r.ragged and r.dtype == "bf16" and r.target_ms is None and r.past_lens == (5, 3, 40)


def brute_force_ragged_flops(shape: bench.Shape) -> float:
    """4 * d * Hq * (visible pairs of each sequence's valid rows over its own keys), pair by pair."""
    pairs = 0
    for past, n in zip(shape.past_lens, shape.q_lens):
        p = past + np.arange(n)[:, None]
        j = np.arange(past + n)[None, :]
        pairs += int(visible(p, j, shape.window).sum())
    return 4.0 * shape.d * shape.Hq * pairs


def test_ragged_flops_count_each_sequences_own_pairs(mixed_file):
    shapes = [s for s in bench.load_shapes(mixed_file).shapes if s.ragged]
    shapes += [bench.Shape("r", 4, 8, 2, 32, sq=40, past_len=(0, 7, 100, 33), q_len=(40, 1, 0, 17),
                           window=16, label="r"),
               bench.Shape("r", 2, 8, 2, 32, sq=5, past_len=(9, 0), window=1, label="r1")]
    for s in shapes:
        assert s.flops() == brute_force_ragged_flops(s) == s.case(True).flops, s.name
    r = bench.parse_shape("gptoss-ragged8-512")
    gpt = 4 * 64 * 64  # 4 * d * Hq
    expect = gpt * sum((p + 1 + p + 512) * 512 // 2 for p in r.past_lens)
    assert r.flops() == expect == r.case(True).flops
    assert r.flops() < 8 * bench.parse_shape("gptoss-512@16384").flops() / 2  # not 8x the longest


def test_ragged_row_blocks_are_each_sequences_own():
    assert bench.ragged_row_blocks([100, 0, 7]) == [(0, 0, 32), (0, 34, 66), (0, 68, 100), (2, 0, 7)]
    s = bench.Shape("r", 3, 4, 2, 16, sq=30, past_len=(5, 3, 40), q_len=(30, 0, 7), label="r")
    assert bench.check_blocks(s) == [(0, 0, 30), (2, 0, 7)]
    assert bench.check_blocks(bench.Shape("u", 2, 4, 2, 16, sq=130)) == [(0, 32), (49, 81), (98, 130)]


def test_the_reference_of_a_ragged_block_is_that_of_its_sequence_alone():
    case = Case(name="r", Hq=4, Hkv=2, d=16, sq=110, B=3, past_len=(5, 3, 40), q_len=(110, 0, 7),
                window=24, sink="per_head", why="test")
    x = bench.bench_inputs(case)
    blocks = bench.ragged_row_blocks(case.q_lens)
    ref, base = bench.sampled_reference(x, blocks)
    assert ref.shape == (1, 32 * 3 + 7, 4, 16)
    k, v = x.clean_kv()
    full, full_base = attention_with_baseline(x.q, k, v, **x.reference_kwargs())
    rows = np.concatenate([full[b:b + 1, i0:i1] for b, i0, i1 in blocks], axis=1)
    np.testing.assert_allclose(ref, rows, rtol=1e-12, atol=1e-14)
    # sequence 2 alone: the uniform call over its own 47 keys
    alone = attention_with_baseline(np.ascontiguousarray(x.q[2:3, :7]), x.k[2:3, :, :47], x.v[2:3, :, :47],
                                    past_len=40, window=24, sink=x.sink)[0]
    np.testing.assert_allclose(ref[:, -7:], alone, rtol=1e-12, atol=1e-14)


def test_ragged_bench_inputs_are_finite_where_the_case_matrix_puts_canaries():
    case = Case(name="r", Hq=4, Hkv=2, d=16, sq=30, B=3, past_len=(5, 3, 40), q_len=(30, 0, 7),
                sink="per_head", why="test")
    canaries, x = make_inputs(case), bench.bench_inputs(case)
    assert np.isnan(canaries.k).any() and np.isnan(canaries.q).any()
    for a in (x.q, x.k, x.v):
        assert np.isfinite(a).all() and not a.flags.writeable
    assert not x.past_len.flags.writeable and not x.q_len.flags.writeable
    for b, (n, end) in enumerate(zip(case.q_lens, case.seq_lens)):  # the same numbers where read
        np.testing.assert_array_equal(x.k[b, :, :end], canaries.k[b, :, :end])
        np.testing.assert_array_equal(x.q[b, :n], canaries.q[b, :n])
        assert not x.k[b, :, end:].any() and not x.v[b, :, end:].any() and not x.q[b, n:].any()
    # a uniform case keeps make_inputs' canaries past the cache (peers upload clean_kv())
    u = bench.bench_inputs(bench.Shape("u", 1, 4, 2, 16, sq=8, past_len=4).case(False))
    assert np.isnan(u.k[:, :, 12:]).all() and np.isfinite(u.q).all()


def test_the_ragged_check_passes_the_reference_and_catches_padding_and_one_diagonal(
        capsys, mixed_file, fake_timer):
    code, rec, err = bench_json(capsys, mixed_file, peers=f"{HERE}:PaddedRowPeer,{HERE}:LongestPastPeer,"
                                                           f"{HERE}:NoSinkPeer")
    assert rec["ok"] is True, err
    rows = {r["name"]: r for r in rec["shapes"]}
    cb3 = rows["tiny-cb3"]
    assert cb3["check_rows"] == [[0, 0, 30], [2, 0, 7]] and cb3["flops"] == bench.load_shapes(
        mixed_file).by_name()["tiny-cb3"].case(True).flops
    k = cb3["results"]["fake-kernel"]
    assert k["sink"]["status"] == k["nosink"]["status"] == "ok" and k["sink"]["ms"] == 1.0
    pad = cb3["results"]["padded-row-peer"]["sink"]
    assert pad["status"] == "mismatch" and pad["ms"] is None
    assert pad["reason"] == "padded rows (i >= q_len[b]) are not 0: 1 elements, in sequence 1"
    assert pad["rel_l2"] <= pad["gate_rel_l2"]  # every valid row is right
    diag = cb3["results"]["longest-past-peer"]["sink"]
    assert diag["status"] == "mismatch" and diag["reason"].startswith("does not match the fp64 reference")
    declined = cb3["results"]["nosink-peer"]
    assert declined["sink"] is None and declined["nosink"]["status"] == "n/a"
    assert declined["nosink"]["reason"] == bench.RAGGED_DECLINE  # said once for both modes
    assert rows["tiny-cb3"]["best_peer"] is None  # every peer failed or declined
    w8 = rows["tiny-cb2-w8"]  # no padded rows: every row of both sequences, under a window
    assert w8["check_rows"] == [[0, 0, 12], [1, 0, 12]]
    assert w8["results"]["padded-row-peer"]["sink"]["status"] == "ok"
    assert w8["results"]["longest-past-peer"]["sink"]["status"] == "mismatch"
    for r in rec["shapes"]:  # the uniform rows are untouched by the ragged peers
        if not r["geometry"]["ragged"]:
            assert r["results"]["longest-past-peer"]["sink"]["status"] == "ok"
            assert r["results"]["padded-row-peer"]["sink"]["status"] == "ok"
    assert rows["tiny-cb3"]["target"]["hit"] is True  # 1 ms against 3 ms


def test_a_kernel_that_leaves_a_padded_row_fails_the_run(capsys, mixed_file, fake_timer):
    code, rec, err = bench_json(capsys, mixed_file, kernel=f"{HERE}:PaddedRowKernel", peers="none")
    assert code == 1 and rec["ok"] is False
    rows = {r["name"]: r for r in rec["shapes"]}
    assert rows["tiny-cb3"]["kernel_error"].startswith("sink: mismatch: padded rows (i >= q_len[b]) are not 0")
    assert rows["tiny-cb3-bf16"]["kernel_error"] and rows["tiny-8@4"]["kernel_error"] is None


def test_judge_output_counts_nan_in_a_padded_row():
    case = Case(name="r", Hq=4, Hkv=2, d=16, sq=9, B=2, past_len=(3, 0), q_len=(9, 4), why="test")
    x = bench.bench_inputs(case)
    blocks = bench.ragged_row_blocks(case.q_lens)
    ref, base = bench.sampled_reference(x, blocks)
    out = _reference16(x)
    ok = bench.judge_output(out, x.q.shape, blocks, ref, base, q_len=[9, 4])
    assert ok["passed"] and ok["padded_nonzero"] == 0 and ok["reason"] == ""
    out[1, 6, 2, 3] = np.nan
    bad = bench.judge_output(out, x.q.shape, blocks, ref, base, q_len=[9, 4])
    assert not bad["passed"] and bad["padded_nonzero"] == 1 and "in sequence 1" in bad["reason"]
    assert bad["n_nan"] == 0  # the valid rows are clean: the padded row alone fails it


def test_bf16_rows_are_judged_with_the_bf16_baseline(capsys, mixed_file, fake_timer):
    code, rec, err = bench_json(capsys, mixed_file, peers=f"{HERE}:Fp16OutPeer")
    rows = {r["name"]: r for r in rec["shapes"]}
    for name in ("tiny-8@4", "tiny-cb3", "tiny-cb2-w8"):
        fp16, bf16 = rows[name]["results"]["fake-kernel"]["sink"], rows[name + "-bf16"]["results"]["fake-kernel"]["sink"]
        assert fp16["status"] == bf16["status"] == "ok", (name, bf16["reason"])
        assert rows[name + "-bf16"]["geometry"]["dtype"] == "bf16"
        # a bf16 kernel's error is about 8x an fp16 one's, past the fp16 gate, and so is the
        # gate it is held to
        assert bf16["rel_l2"] > 5 * fp16["rel_l2"] and bf16["rel_l2"] > 2 * fp16["gate_rel_l2"]
        assert bf16["gate_rel_l2"] > 4 * fp16["gate_rel_l2"]
    # the fp16 baseline's gate would fail the same correct bf16 output
    case = bench.load_shapes(mixed_file).by_name()["tiny-8@4-bf16"].case(True)
    x = bench.bench_inputs(case)
    assert x.dtype == "bf16" and x.q.dtype == np.float32 and np.array_equal(round_bf16(x.q), x.q)
    blocks = bench.check_row_blocks(case.sq)
    ref, base = bench.sampled_reference(x, blocks)
    k, v = x.clean_kv()
    np.testing.assert_array_equal(base, attention_with_baseline(x.q, k, v, lowp="bf16", **x.reference_kwargs())[1])
    out = _reference16(x)
    assert bench.judge_output(out, x.q.shape, blocks, ref, base, lowp="bf16")["passed"]
    base16 = attention_with_baseline(x.q, k, v, lowp="fp16", **x.reference_kwargs())[1]
    assert not bench.judge_output(out, x.q.shape, blocks, ref, base16, lowp="fp16")["passed"]


def test_the_bf16_within_target_hit_and_miss(capsys, mixed_file, fake_timer):
    fake_timer.ms = {"fake-kernel|sink|fp16": 1.0, "fake-kernel|sink|bf16": 1.05,
                     "fake-kernel|nosink|bf16": 5.0}
    code, rec, err = bench_json(capsys, mixed_file, peers="none")
    assert code == 0, err
    assert rec["dtypes"] == ["fp16", "bf16"] and rec["bf16_within"] == 1.1
    within = rec["targets"]["bf16_within"]
    assert [w["shape"] for w in within] == ["tiny-8@4-bf16", "tiny-cb3-bf16", "tiny-cb2-w8-bf16"]
    assert within[0] == {"shape": "tiny-8@4-bf16", "fp16_shape": "tiny-8@4", "factor": 1.1, "mode": "sink",
                         "bf16_ms": 1.05, "fp16_ms": 1.0, "ratio": pytest.approx(1.05), "hit": True}
    rows = {r["name"]: r for r in rec["shapes"]}
    assert rows["tiny-8@4-bf16"]["target"] is None and rows["tiny-8@4"]["target"]["hit"] is True
    assert rows["tiny-8@4-bf16"]["bf16_within"] == {"factor": 1.1, "mode": "sink", "fp16_shape": "tiny-8@4"}
    line = next(x for x in err.splitlines() if x.startswith("tiny-8@4-bf16 "))
    assert "<=1.1x" in line and "hit 1.05x" in line
    assert "bf16 within 1.1x of fp16 (fake-kernel in each shape's sink mode): 3 hit, 0 missed" in err
    fake_timer.ms["fake-kernel|sink|bf16"] = 1.2
    code, rec, err = bench_json(capsys, mixed_file, peers="none")
    assert code == 1 and rec["ok"] is True  # a missed target fails the command, not the record
    assert [w["hit"] for w in rec["targets"]["bf16_within"]] == [False] * 3
    assert rec["targets"]["misses"] == []  # target_ms: every fp16 row is within its ms
    assert "MISS 1.20x" in err and "3 missed (tiny-8@4-bf16, tiny-cb3-bf16, tiny-cb2-w8-bf16)" in err


def test_a_bf16_row_without_its_fp16_row_is_not_judged(mixed_file):
    spec = bench.load_shapes(mixed_file)
    bf16 = spec.by_name()["tiny-8@4-bf16"]
    results = {"k": {"role": "kernel", "sink": {"status": "ok", "ms": 1.0}, "nosink": None}}
    (w,) = bench.judge_targets([bench.shape_row(bf16, results, "k")], [], "k")["bf16_within"]
    assert w["fp16_ms"] is None and w["hit"] is None
    assert not bench.targets_missed({"misses": [], "flat": [], "bf16_within": [w]})
    body = {"kernel": "k", "shapes": [bench.shape_row(bf16, results, "k")],
            "targets": bench.judge_targets([bench.shape_row(bf16, results, "k")], [], "k")}
    assert "0 hit, 0 missed, 1 not judged (tiny-8@4-bf16)" in bench.format_report(body)


PEER_WITHIN = '\n[peer_within]\npeer = "PEER"\nfactor = 0.95\nwhy = "lead the peer by 5 %"\n'


def peer_within_file(tmp_path, peer: str) -> Path:
    """TINY with a ``[peer_within]`` table naming ``peer``, after the file's top-level keys."""
    head, rest = TINY.split("\n[families.tiny]", 1)
    return write(tmp_path / "peer.toml", head + PEER_WITHIN.replace("PEER", peer) + "\n[families.tiny]" + rest)


def test_the_peer_within_target_judges_every_row_in_its_sink_mode(capsys, tmp_path, fake_timer):
    fake_timer.ms = {"fake-kernel|sink": 0.45, "fake-kernel|nosink": 0.495, "sink-peer": 0.5}
    code, rec, err = bench_json(capsys, peer_within_file(tmp_path, "sink-peer"),
                                peers=f"{HERE}:SinkPeer")
    assert code == 1 and rec["ok"] is True, err  # a missed target fails the command, not the record
    assert rec["peer_within"] == {"peer": "sink-peer", "factor": 0.95, "why": "lead the peer by 5 %"}
    pw = {w["shape"]: w for w in rec["targets"]["peer_within"]}
    assert list(pw) == ["tiny-8@4", "tiny-120@50-w16", "plain-20@3"]
    assert pw["tiny-8@4"] == {"shape": "tiny-8@4", "peer": "sink-peer", "factor": 0.95, "mode": "sink",
                              "kernel_ms": 0.45, "peer_ms": 0.5, "ratio": pytest.approx(0.9), "hit": True}
    assert pw["tiny-120@50-w16"]["hit"] is True
    # the shape without a sink: both in the no-sink mode, 0.495 / 0.5 > 0.95
    assert (pw["plain-20@3"]["mode"], pw["plain-20@3"]["ratio"], pw["plain-20@3"]["hit"]) == (
        "nosink", pytest.approx(0.99), False)
    assert rec["targets"]["misses"] == []  # target_ms alone would have passed
    assert ("within 0.95x of sink-peer (fake-kernel against it, each in the shape's sink mode): "
            "2 hit, 1 missed (plain-20@3 0.99x)") in err
    fake_timer.ms["fake-kernel|nosink"] = 0.475  # at the factor is a hit
    code, rec, err = bench_json(capsys, peer_within_file(tmp_path, "sink-peer"),
                                peers=f"{HERE}:SinkPeer")
    assert code == 0, err
    assert [w["hit"] for w in rec["targets"]["peer_within"]] == [True, True, True]


def test_a_row_the_peer_did_not_time_is_not_judged(capsys, tmp_path, fake_timer):
    """The peer without a sink or a window times only the plain shape; a wrong peer is not
    timed; a peer the run was not given times nothing: those rows are not judged, not hits."""
    fake_timer.ms = {"fake-kernel": 0.5, "nosink-peer": 1.0, "wrong-peer": 1.0}
    code, rec, err = bench_json(capsys, peer_within_file(tmp_path, "nosink-peer"),
                                peers=f"{HERE}:NoSinkPeer")
    assert code == 0, err
    assert [(w["shape"], w["hit"]) for w in rec["targets"]["peer_within"]] == [
        ("tiny-8@4", None), ("tiny-120@50-w16", None), ("plain-20@3", True)]
    assert "1 hit, 0 missed, 2 not judged (tiny-8@4, tiny-120@50-w16)" in err
    code, rec, err = bench_json(capsys, peer_within_file(tmp_path, "wrong-peer"),
                                peers=f"{HERE}:WrongPeer")
    assert [(w["shape"], w["hit"]) for w in rec["targets"]["peer_within"]] == [
        ("tiny-8@4", True), ("tiny-120@50-w16", None), ("plain-20@3", True)]  # row 60 is wrong
    code, rec, err = bench_json(capsys, peer_within_file(tmp_path, "fa4"), peers="none")
    assert code == 0 and [w["hit"] for w in rec["targets"]["peer_within"]] == [None] * 3
    assert "0 hit, 0 missed, 3 not judged" in err


def test_without_peer_within_no_row_is_judged_against_a_peer(capsys, shapes_file, fake_timer):
    code, rec, _ = bench_json(capsys, shapes_file, peers=f"{HERE}:SinkPeer")
    assert rec["peer_within"] is None and rec["targets"]["peer_within"] == []


@pytest.mark.parametrize("table, words", [
    ('peer_within = 0.95', ["peer_within: expected a table [peer_within]"]),
    ('[peer_within]\nfactor = 0.95', ["peer_within: peer: required key is missing"]),
    ('[peer_within]\npeer = "fa4"', ["peer_within: factor: required key is missing"]),
    ('[peer_within]\npeer = ""\nfactor = 0.95', ["peer_within: peer: expected a peer's name"]),
    ('[peer_within]\npeer = 4\nfactor = 0.95', ["peer_within: peer: expected a peer's name"]),
    ('[peer_within]\npeer = "fa4"\nfactor = 0', ["peer_within: factor: expected a number > 0"]),
    ('[peer_within]\npeer = "fa4"\nfactor = "fast"', ["peer_within: factor: expected a number > 0"]),
    ('[peer_within]\npeer = "fa4"\nfactor = 0.9\nmode = "sink"', ["peer_within: mode: unknown key"]),
    ('[peer_within]\npeer = "fa4"\nfactor = 0.9\nwhy = 3', ["peer_within: why: expected a string"]),
])
def test_a_bad_peer_within_is_an_error_naming_the_key(tmp_path, table, words):
    head, rest = TINY.split("\n[families.tiny]", 1)
    p = write(tmp_path / "bad.toml", head + "\n" + table + "\n\n[families.tiny]" + rest)
    with pytest.raises(bench.ShapesError) as e:
        bench.load_shapes(p)
    assert str(e.value).startswith(str(p))
    for w in words:
        assert w in str(e.value), str(e.value)


# --------------------------------------------------------------------------- --judge: new targets, old times

def _record(capsys, tmp_path, fake_timer, shapes) -> Path:
    fake_timer.ms = {"fake-kernel|sink": 0.45, "fake-kernel|nosink": 0.495, "sink-peer": 0.5}
    code, rec, err = bench_json(capsys, shapes, peers=f"{HERE}:SinkPeer")
    path = tmp_path / "run.json"
    path.write_text(json.dumps(rec))
    return path


def test_judge_applies_the_files_targets_to_a_records_times_without_timing(capsys, tmp_path, fake_timer, shapes_file):
    run = _record(capsys, tmp_path, fake_timer, shapes_file)  # TINY: no peer target
    before = json.loads(run.read_text())
    assert before["targets"]["peer_within"] == [] and before["targets"]["misses"] == []
    fake_timer.bursts.clear()
    code, out, err = run_cli(capsys, "bench", "--judge", str(run), "--shapes",
                             str(peer_within_file(tmp_path, "sink-peer")), "--json", "-")
    assert fake_timer.bursts == []  # nothing timed
    assert code == 1, err  # plain-20@3 misses 0.95x sink-peer
    rec = json.loads(out)
    assert [(w["shape"], w["hit"]) for w in rec["targets"]["peer_within"]] == [
        ("tiny-8@4", True), ("tiny-120@50-w16", True), ("plain-20@3", False)]
    assert rec["peer_within"]["peer"] == "sink-peer"
    # the run's own fields are kept: times, checks, date, source hash
    for key in ("date", "kernel_source_hash", "device", "ok", "timing", "kernel", "peers_requested"):
        assert rec[key] == before[key], key
    assert [r["results"] for r in rec["shapes"]] == [r["results"] for r in before["shapes"]]
    j = rec["judged"]
    assert j["record"] == str(run) and j["shapes_file"].endswith("peer.toml") and j["unlisted"] == []
    assert "nothing was timed again" in err and "1 missed (plain-20@3 0.99x)" in err


def test_judge_with_the_runs_own_file_gives_the_runs_verdicts(capsys, tmp_path, fake_timer):
    shapes = peer_within_file(tmp_path, "sink-peer")
    run = _record(capsys, tmp_path, fake_timer, shapes)
    before = json.loads(run.read_text())
    code, out, _ = run_cli(capsys, "bench", "--judge", str(run), "--shapes", str(shapes), "--json", "-")
    assert code == 1 and json.loads(out)["targets"] == before["targets"]
    assert [r["target"] for r in json.loads(out)["shapes"]] == [r["target"] for r in before["shapes"]]


def test_judge_a_row_the_file_does_not_list_has_no_target(capsys, tmp_path, fake_timer, shapes_file):
    run = _record(capsys, tmp_path, fake_timer, shapes_file)
    smaller = write(tmp_path / "one.toml", TINY.split("[[shape]]")[0] + "[[shape]]\nfamily = \"tiny\"\n"
                                                                      "sq = 8\npast_len = 4\ntarget_ms = 0.4\n")
    out_path = tmp_path / "judged.json"
    code, out, err = run_cli(capsys, "bench", "--judge", str(run), "--shapes", str(smaller),
                             "--json", str(out_path))
    rec = json.loads(out_path.read_text())
    assert code == 1  # 0.45 ms against the new 0.4
    assert rec["targets"]["misses"] == ["tiny-8@4"] and rec["targets"]["hits"] == []
    assert rec["judged"]["unlisted"] == ["tiny-120@50-w16", "plain-20@3"]
    assert [r["target"] for r in rec["shapes"]][1:] == [None, None]
    assert "not in " in out and "(no target): tiny-120@50-w16, plain-20@3" in out


@pytest.mark.parametrize("extra, words", [
    (["--kernel", f"{HERE}:FakeKernel"], "--kernel: not with --judge"),
    (["--peers", "none"], "--peers: not with --judge"),
    (["--reps", "40"], "--reps: not with --judge"),
    (["--rounds", "3"], "--rounds: not with --judge"),
    (["--no-ceilings"], "--no-ceilings: not with --judge"),
    (["--shapes", "gptoss-512@8192"], "--shapes: with --judge, a shapes file (.toml)"),
])
def test_judge_refuses_the_options_of_a_timed_run(capsys, tmp_path, fake_timer, shapes_file, extra, words):
    run = _record(capsys, tmp_path, fake_timer, shapes_file)
    code, out, err = run_cli(capsys, "bench", "--judge", str(run), *extra)
    assert code == 2 and words in err and "Traceback" not in err, err


@pytest.mark.parametrize("text, words", [
    ("{", "cannot read a JSON record: JSONDecodeError"),
    ("[1]", "not a bench record (kind 'list')"),
    ('{"kind": "matrix"}', "not a bench record (kind 'matrix')"),
    ('{"kind": "bench", "schema": 1, "kernel_source_hash": "x", "device": "d", "ok": "yes"}',
     "ok: expected true or false, got a string"),
    ('{"kind": "bench", "schema": 1, "kernel_source_hash": "x", "device": "d", "ok": true}',
     "expected 'kernel' and a non-empty list 'shapes'"),
    ('{"kind": "bench", "schema": 1, "kernel_source_hash": "x", "device": "d", "ok": true, '
     '"kernel": "k", "shapes": [{"name": "a"}]}', "shapes[0]: expected 'name', 'geometry', 'flops' and 'results'"),
])
def test_judge_refuses_a_file_that_is_not_a_bench_record_naming_it(capsys, tmp_path, text, words):
    bad = write(tmp_path / "bad.json", text)
    code, out, err = run_cli(capsys, "bench", "--judge", str(bad))
    assert code == 2 and f"--judge: {bad}: " in err and words in err and "Traceback" not in err, err
    code, _, err = run_cli(capsys, "bench", "--judge", str(tmp_path / "none.json"))
    assert code == 2 and "cannot read a JSON record: FileNotFoundError" in err


# --------------------------------------------------------------------------- interleaved rounds

class DriftingTimer:
    """A device whose clock slows as it works: the k-th timed call of the run (any
    implementation) takes ``base[name] * (1 + drift * k)`` ms. Records each burst."""

    def __init__(self, base, drift=0.01):
        self.base, self.drift, self.k, self.bursts = base, drift, 0, []

    def __call__(self, call, *, warmup, reps):
        call.fn()
        self.bursts.append((call.name, warmup, reps))
        out = []
        for _ in range(reps):
            out.append(self.base[call.name] * (1 + self.drift * self.k))
            self.k += 1
        return out


def named(name, context=None):
    return timing.Call(name, lambda: None, context=context or timing.contextlib.nullcontext)


def test_round_reps_splits_evenly_larger_shares_first():
    assert timing.round_reps(30, 1) == [30]
    assert timing.round_reps(30, 4) == [8, 8, 7, 7]
    assert sum(timing.round_reps(23, 5)) == 23
    for bad in (0, 31):
        with pytest.raises(ValueError, match="rounds"):
            timing.round_reps(30, bad)


def test_carryover_orders_are_balanced():
    """Every order is a permutation; over the design each implementation stands in each place
    equally often and follows each other one equally often (n rows for an even n, 2n for an
    odd one)."""
    for n in range(1, 9):
        rows = timing.carryover_orders(n)
        assert len(rows) == (2 * n if n % 2 else n)
        assert all(sorted(r) == list(range(n)) for r in rows)
        places = Counter((i, x) for r in rows for i, x in enumerate(r))
        assert set(places.values()) == {len(rows) // n}
        follows = Counter((a, b) for r in rows for a, b in zip(r, r[1:]))
        assert len(follows) == n * (n - 1) and len(set(follows.values())) <= 1
    assert timing.carryover_orders(5)[0] == [0, 1, 4, 2, 3]


def test_rounds_time_every_implementation_in_turn_in_balanced_orders():
    timer = DriftingTimer({"a": 1.0, "b": 1.0, "c": 1.0})
    times = timing.time_interleaved(timer, {n: named(n) for n in "abc"}, warmup=5, reps=30, rounds=6)
    order = [b[0] for b in timer.bursts]
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b",
                     "c", "b", "a", "a", "c", "b", "b", "a", "c"]
    rounds = [order[i:i + 3] for i in range(0, 18, 3)]
    assert Counter((x, y) for r in rounds for x, y in zip(r, r[1:])) == \
        {(x, y): 2 for x in "abc" for y in "abc" if x != y}
    assert all(w == 5 and r == 5 for _, w, r in timer.bursts)
    assert {n: len(t) for n, t in times.items()} == {"a": 30, "b": 30, "c": 30}
    timer = DriftingTimer({"a": 1.0, "b": 1.0})  # more rounds than the design has rows
    timing.time_interleaved(timer, {n: named(n) for n in "ab"}, warmup=0, reps=20, rounds=3)
    assert [b[0] for b in timer.bursts] == ["a", "b", "b", "a", "a", "b"]


def test_rounds_share_a_drifting_clock_fairly():
    """Two implementations of the same speed under a clock that slows 1 % a call: timed in
    one burst each, the second looks a quarter slower; in 3 interleaved rounds, within 10 %."""
    base = {"a": 1.0, "b": 1.0}

    def ratio(rounds):
        t = timing.time_interleaved(DriftingTimer(base), {n: named(n) for n in base}, warmup=0,
                                    reps=30, rounds=rounds)
        ms = {n: timing.timing_result(v, 1e9)["ms"] for n, v in t.items()}
        return ms["b"] / ms["a"]

    assert ratio(1) == pytest.approx(1.445 / 1.145)  # medians at calls 44.5 and 14.5
    assert abs(ratio(3) - 1) < 0.1 and abs(ratio(3) - 1) < abs(ratio(1) - 1) / 3


def test_an_implementation_that_fails_while_timed_is_dropped_and_reported():
    timer = DriftingTimer({"a": 1.0, "c": 2.0})

    def boom():
        raise RuntimeError("peer fell over")
    errors = []
    times = timing.time_interleaved(timer, {"a": named("a"), "b": timing.Call("b", boom), "c": named("c")},
                                    warmup=1, reps=20, rounds=2,
                                    on_error=lambda n, e: errors.append((n, str(e))))
    assert set(times) == {"a", "c"} and len(times["a"]) == len(times["c"]) == 20
    assert errors == [("b", "peer fell over")]  # once: not tried again in round 2


def test_the_hold_is_sized_by_the_one_rule_hipkernel_uses():
    from hipkernel.backends import hold_ms_for

    for host_ms, calls in ((0.04, 5), (0.0, 30), (10.0, 30), (100.0, 30)):
        assert timing.hold_ms_for(host_ms, calls) == hold_ms_for(host_ms, calls)


def test_the_host_timer_synchronizes_each_call():
    seen = []
    t = timing.HostTimer()
    times = t(timing.Call("x", lambda: seen.append("fn"), lambda: seen.append("sync")), warmup=1, reps=2)
    assert seen == ["fn", "sync", "fn", "sync", "fn", "sync"] and len(times) == 2


# --------------------------------------------------------------------------- the torch peers

def test_the_peers_declare_their_contract_without_torch():
    from refattn.adapters import torch_peers as peers

    s = bench.parse_shape("gptoss-512@8192-w128")
    full = bench.parse_shape("gptoss-512@8192")
    sdpa, cudnn, flex, fa4 = peers.Sdpa(), peers.Cudnn(), peers.Flex(), peers.Fa4()
    for p in (sdpa, cudnn):
        assert p.supports(full.case(False)) and not p.supports(full.case(True))
        assert not p.supports(s.case(False)) and "sliding-window" in p.unsupported_reason(s.case(False))
    for p in (flex, fa4):
        assert p.supports(s.case(True)) and p.supports(full.case(False))
    assert all(p.requires_gpu for p in (sdpa, cudnn, flex, fa4))
    assert [p.name for p in (sdpa, cudnn, flex, fa4)] == ["sdpa", "cudnn", "flex", "fa4"]
    assert peers.PEERS == {"sdpa": "refattn.adapters.torch_peers:Sdpa", "cudnn": "refattn.adapters.torch_peers:Cudnn",
                           "flex": "refattn.adapters.torch_peers:Flex", "fa4": "refattn.adapters.torch_peers:Fa4"}
    assert bench.parse_peer_list("SDPA, flex,sdpa") == ["sdpa", "flex"] and bench.parse_peer_list("none") == []


def test_the_peers_take_bf16_and_flex_and_fa4_ragged_batches_without_torch():
    from refattn.adapters import torch_peers as peers

    sdpa, cudnn, flex, fa4 = peers.Sdpa(), peers.Cudnn(), peers.Flex(), peers.Fa4()
    full, w = bench.parse_shape("gptoss-512@8192-bf16"), bench.parse_shape("gptoss-512@8192-w128-bf16")
    for p in (sdpa, cudnn, flex, fa4):
        assert p.supports(full.case(False)) and p.unsupported_reason(full.case(False)) is None
        fp32 = Case(name="f", Hq=64, Hkv=8, d=64, sq=512, past_len=8192, dtype="fp32", why="t")
        assert p.unsupported_reason(fp32) == f"{p.name} is timed on fp16 and bf16 only (the case is fp32)"
        soft = Case(name="s", Hq=8, Hkv=2, d=64, sq=16, softcap=30.0, dtype="bf16", why="t")
        assert p.unsupported_reason(soft) == f"{p.name}: softcap is not configured"
    for p in (flex, fa4):
        assert p.supports(w.case(True))
    ragged = bench.parse_shape("gptoss-ragged8-512")
    assert flex.ragged is True and fa4.ragged is True
    assert not hasattr(sdpa, "ragged") and not hasattr(cudnn, "ragged")  # the runner and the bench decline
    for p in (flex, fa4):
        assert p.supports(ragged.case(True)) and p.supports(bench.parse_shape("gptoss-ragged8-512-bf16").case(False))
    for p in (sdpa, cudnn):
        assert p.unsupported_reason(ragged.case(False)) == f"{p.name}: no ragged batches (one past_len for every sequence)"


def test_peers_that_cannot_run_here_are_n_a_with_the_reason(capsys, shapes_file, fake_timer,
                                                            monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # torch not importable, installed or not
    code, rec, err = bench_json(capsys, shapes_file, peers="sdpa,cudnn,flex,fa4")
    assert set(rec["peers_available"]) == {"sdpa", "cudnn", "flex", "fa4"}
    assert all(not v["available"] and v["reason"].startswith("torch not importable")
               for v in rec["peers_available"].values())
    r = rec["shapes"][0]["results"]
    assert r["sdpa"]["nosink"]["status"] == "n/a" and r["flex"]["sink"]["status"] == "n/a"
    assert rec["shapes"][0]["best_peer"] is None and rec["shapes"][0]["ratio"] is None
    assert "peers: sdpa no (torch not importable" in err


# --------------------------------------------------------------------------- hipkernel

@pytest.fixture
def model_gpu(monkeypatch):
    """hipkernel's backend: one whose launches run the model (tests.test_fuzz), autotune off."""
    from tests.test_fuzz import ModelBackend

    be = ModelBackend(arch="sm_90")
    import hipkernel.backends as backends
    monkeypatch.setattr(backends, "get_backend", lambda name=None: be)
    monkeypatch.setenv("HIPKERNEL_TUNE", "0")
    return be


def test_hipkernel_prepare_uploads_once_and_launches_without_synchronize(model_gpu):
    from hipkernel import api
    from hipkernel.adapter import HipKernel

    s = bench.Shape("t", 1, 8, 2, 64, sq=40, past_len=24, window=16, sink=True)
    x = make_inputs(s.case(True))
    k = HipKernel()
    p = k.prepare(x)
    uploads = [c for c in model_gpu.calls if c[0] == "htod"]
    assert len(uploads) == 5  # q, k, v, out (the canaries), sink
    n = len(model_gpu.calls)
    p()
    p()
    later = [c[0] for c in model_gpu.calls[n:]]
    assert later.count("launch") == 2 and "synchronize" not in later and "htod" not in later
    k.synchronize()
    assert model_gpu.calls[-1] == ("synchronize",)
    blocks = bench.check_row_blocks(s.sq, 8)
    ref, base = bench.sampled_reference(x, blocks)
    assert bench.judge_output(p.output(), x.q.shape, blocks, ref, base)["passed"]
    assert p.variant == api.default_config(model_gpu.arch).name  # autotune off: the default runs
    p.close()
    assert not model_gpu._mem


def test_refattn_bench_of_hipkernel_on_a_model_backend(capsys, model_gpu, fake_timer, tmp_path):
    from hipkernel import api

    shapes = tmp_path / "s.toml"
    shapes.write_text('[families.g]\nHq = 8\nHkv = 2\nd = 64\nsink = true\n\n[[shape]]\nfamily = "g"\n'
                      'sq = 40\npast_len = 24\nwindow = 16\n')
    code, rec, err = bench_json(capsys, shapes, kernel="hipkernel", peers=f"{HERE}:SinkPeer")
    assert code == 0, err
    assert rec["kernel"] == "hipkernel" and rec["kernel_source_hash"] == api.source_hash()
    r = rec["shapes"][0]["results"]["hipkernel"]
    assert r["sink"]["status"] == r["nosink"]["status"] == "ok"
    assert r["sink"]["checked"] == "prepared launch"
    assert {launch["args"][11] for launch in model_gpu.launches} == {0, 1}  # both sink modes
    assert not model_gpu._mem  # every buffer freed



def _ragged_bf16_model_backend():
    """tests.test_fuzz's ModelBackend, also decoding the ABI's two length pointers (a ragged
    call: int32 arrays, possibly at an offset into one buffer) and the HK_BF16 define (q, k,
    v and out hold bf16 bit patterns)."""
    from hipkernel import model
    from hipkernel.config import KernelConfig
    from tests.fake_backend import RecordingBackend
    from tests.test_fuzz import ModelBackend

    class RaggedBf16ModelBackend(ModelBackend):
        def ints(self, ptr, n):
            base = max(b for b in self._mem if b <= ptr)
            return np.frombuffer(bytes(self._mem[base]), np.int32, n, ptr - base).astype(np.int64)

        def load(self, ptr, shape, bf16):
            if not bf16:
                return self.view(ptr, shape)
            bits = np.frombuffer(self._mem[ptr], dtype=np.uint16).reshape(shape)
            return (bits.astype(np.uint32) << 16).view(np.float32)

        def launch(self, kernel, grid, block, args, shared_mem=0, stream=None):
            RecordingBackend.launch(self, kernel, grid, block, args, shared_mem, stream)
            q, k, v, sink, out, Sq, Hq, Hkv, S_cap, past, window, mode, scale, plens, qlens = \
                [x for _, x in args][:15]
            d, B, bf16 = kernel["HEAD_DIM"], grid[2], bool(kernel.get("HK_BF16"))
            res = model.attention(
                self.load(q, (B, Sq, Hq, d), bf16), self.load(k, (B, Hkv, S_cap, d), bf16),
                self.load(v, (B, Hkv, S_cap, d), bf16),
                past_len=self.ints(plens, B) if plens else past, q_len=self.ints(qlens, B) if qlens else None,
                window=window, sink=self.view(sink, (Hq,)) if mode == 1 else None,
                smooth_softmax=mode == 2, scale=scale, dtype="bf16" if bf16 else "fp16",
                config=KernelConfig(kernel["M_TILES"], kernel["BKV"], kernel["PATH"], ws=bool(kernel.get("WS", 0)),
                                    pack=kernel.get("PACK", 1), walk=kernel.get("QWALK", 1)))
            if bf16:
                res = (np.ascontiguousarray(res).view(np.uint32) >> 16).astype(np.uint16)
                np.frombuffer(self._mem[out], dtype=np.uint16).reshape(res.shape)[...] = res
            else:
                self.store(out, res)

    return RaggedBf16ModelBackend(arch="sm_90")


def test_refattn_bench_of_hipkernel_on_ragged_and_bf16_rows(capsys, monkeypatch, fake_timer, tmp_path):
    import hipkernel.backends as backends

    be = _ragged_bf16_model_backend()
    monkeypatch.setattr(backends, "get_backend", lambda name=None: be)
    monkeypatch.setenv("HIPKERNEL_TUNE", "0")
    shapes = write(tmp_path / "s.toml", 'dtypes = ["fp16", "bf16"]\nbf16_within = 2.0\n\n'
                   '[families.g]\nHq = 8\nHkv = 2\nd = 64\nsink = true\n\n'
                   '[[ragged]]\nname = "g-cb3"\nfamily = "g"\npast_len = [24, 0, 7]\nq_len = [40, 9, 0]\n'
                   'sq = 40\nwindow = 16\n')
    code, rec, err = bench_json(capsys, shapes, kernel="hipkernel", peers=f"{HERE}:SinkPeer")
    assert code == 0, err
    assert [r["name"] for r in rec["shapes"]] == ["g-cb3", "g-cb3-bf16"]
    for r in rec["shapes"]:
        k = r["results"]["hipkernel"]
        assert k["sink"]["status"] == k["nosink"]["status"] == "ok", (r["name"], k)
        assert r["check_rows"] == [[0, 0, 40], [1, 0, 9]]
    assert [w["hit"] for w in rec["targets"]["bf16_within"]] == [True]
    assert {bool(launch["kernel"].get("HK_BF16")) for launch in be.launches} == {False, True}
    assert all(launch["args"][13] and launch["args"][14] for launch in be.launches)  # both length arrays
    assert not be._mem  # every buffer freed
