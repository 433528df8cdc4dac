"""hipkernel.ab, the same-process A/B of kernel variants: its variant specs, its sources from
git revisions, and a whole run on the model backend (launches compute hipkernel.model), which
checks the launches it makes and the comparisons it reports."""

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from hipkernel import ab, api, timing
from refattn.bench import parse_shape
from hipkernel.config import KernelConfig
from tests.test_fuzz import ModelBackend


def test_parse_variant():
    v = ab.parse_variant("main@wgmma_m16_b64")
    assert (v.label, v.rev, v.config, v.macros) == ("main@wgmma_m16_b64", "main",
                                                    KernelConfig(16, 64, "wgmma"), {})
    v = ab.parse_variant("deep=wip/x~1@wgmma_m16_b64+KV_STAGES=4+LOOKAHEAD=1")
    assert (v.label, v.rev, v.macros) == ("deep", "wip/x~1", {"KV_STAGES": 4, "LOOKAHEAD": 1})
    assert v.defines(64) == {"HEAD_DIM": 64, "M_TILES": 16, "BKV": 64, "KV_STAGES": 4, "LOOKAHEAD": 1,
                              "RESCALE_LOG2": 8, "ROWSUM_MMA": 1}
    # KV_STAGES resizes the dynamic shared memory: 4 x (a 64-key K and V tile + 16 bytes),
    # and the row sums' 2 KiB of ones
    assert v.shared_mem(64) == 4 * (2 * 64 * 64 * 2 + 16) + 2048
    assert ab.parse_variant(".@wgmma_m16_b64").shared_mem(64) == KernelConfig(16, 64, "wgmma").dynamic_smem_bytes(64)
    assert ab.parse_variant(".@mma_m8_b64_w2+MIN_BLOCKS=1").shared_mem(64) == 0
    # SMEM_PLUS adds bytes to it; KV_STAGES on the wgspan path scales its round buffers
    span = KernelConfig(4, 136, "wgspan", pack=8, walk=4)
    assert ab.parse_variant(".@wgspan_m4_b136_p8_q4+SMEM_PLUS=8192").shared_mem(64) == span.dynamic_smem_bytes(64) + 8192
    # (and keeps the staged epilogue's 2 KiB a warp once)
    assert ab.parse_variant(".@wgspan_m4_b136_p8_q4+KV_STAGES=2").shared_mem(64) == 2 * span.smem_bytes(64) + 4 * 2048
    assert ab.parse_variant(".@wgmma_m16_b64+KV_STAGES=4+SMEM_PLUS=16").shared_mem(64) == 4 * (2 * 64 * 64 * 2 + 16) + 2048 + 16
    for bad, why in [("main", "expected"), ("main@", "expected"), ("main@nope_m4", "config"),
                     ("main@mma_m4_b64+SMEM_PLUS=64", "SMEM_PLUS"),
                     ("main@wgspan_m4_b136_p8_q4+SMEM_PLUS=-1", "bytes >= 0"),
                     ("main@mma_m4_b64+M_TILES=8", "M_TILES is fixed by the config"),
                     ("main@mma_m4_b64+KV_STAGES=2", "KV_STAGES is a wgmma-path macro"),
                     ("main@wgmma_m16_b64+KV_STAGES=0", "KV_STAGES"),
                     ("main@mma_m4_b64+X=y", "expected")]:
        with pytest.raises(ValueError, match="^variant") as e:
            ab.parse_variant(bad)
        assert why in str(e.value), (bad, str(e.value))


def test_source_at_the_worktree_and_a_revision():
    for path in api.KERNEL_FILES:
        assert ab.source_at(ab.WORKTREE, path) == api.kernel_source(path)
    try:
        clean = subprocess.run(["git", "-C", str(ab.ROOT), "diff", "--quiet", "HEAD", "--",
                                "hipkernel/kernels"]).returncode == 0
    except OSError:
        pytest.skip("git is not here")
    if not clean:
        pytest.skip("the kernel files differ from HEAD here")
    assert ab.source_at("HEAD", "wgmma") == api.kernel_source("wgmma")  # headers inlined alike
    with pytest.raises(ValueError, match=r"^variant: git cannot show .* at 'no-such-rev'"):
        ab.source_at("no-such-rev", "mma")


def test_source_from_a_copy_of_the_kernel_files(tmp_path):
    """A directory as REV: its hipkernel/kernels/ (what git archive would unpack), headers
    inlined from the same copy."""
    kernels = tmp_path / "hipkernel" / "kernels"
    kernels.mkdir(parents=True)
    for f in api.KERNEL_DIR.iterdir():
        if f.suffix in (".hip", ".h"):
            (kernels / f.name).write_text(f.read_text())
    assert ab.source_at(str(tmp_path), "wgmma") == api.kernel_source("wgmma")
    (kernels / "wgmma.h").write_text("// another wgmma.h\n")
    assert "// another wgmma.h" in ab.source_at(str(tmp_path), "wgmma")
    assert ab.parse_variant(f"old={tmp_path}@mma_m4_b64").rev == str(tmp_path)


def test_run_times_every_variant_on_the_same_inputs_and_compares_them():
    be = ModelBackend(arch="sm_90")
    variants = [ab.parse_variant(s) for s in (".@mma_m4_b64", "mb=.@mma_m4_b64+MIN_BLOCKS=2",
                                               "wg=.@wgmma_m16_b64+KV_STAGES=4", ".@mma_m4_b32")]
    shapes = [parse_shape("gptoss-20@12"), parse_shape("gptoss-33@40-w16")]
    lines = []
    doc = ab.run(be, variants, shapes, passes=2, n=3, reps=2, log=lines.append)
    assert [(c["variant"], c["shared_mem"]) for c in doc["compiled"]] == [
        (".@mma_m4_b64", 0), ("mb", 0), ("wg", 4 * (2 * 64 * 64 * 2 + 16) + 2048), (".@mma_m4_b32", 0)]
    assert doc["compiled"][1]["defines"]["MIN_BLOCKS"] == 2
    rows = doc["rows"]
    assert len(rows) == len(shapes) * len(variants) * 2
    by = {(r["shape"], r["variant"], r["pass"]): r for r in rows}
    for s in ("gptoss-20@12", "gptoss-33@40-w16"):
        assert by[(s, ".@mma_m4_b64", 0)]["bit_identical"] is None  # the baseline of bkv 64
        assert by[(s, ".@mma_m4_b32", 0)]["bit_identical"] is None  # the first of bkv 32
        assert by[(s, "mb", 0)]["bit_identical"] is True  # same tiles: same bits
        assert by[(s, ".@mma_m4_b64", 1)]["bit_identical"] is True
        for v in variants:
            r0 = by[(s, v.label, 0)]
            assert r0["finite"] and 0 <= r0["rel_l2"] < 2e-3, r0
            assert by[(s, v.label, 1)]["rel_l2"] is None  # compared once
    # each launch: the variant's grid, block and shared memory, the shape's ABI arguments
    timed = [l for l in be.launches if l["kernel"].get("KV_STAGES") == 4]
    assert timed and all(l["block"] == (512, 1, 1) and l["shared_mem"] == 65600 + 2048 for l in timed)
    assert {tuple(l["args"][5:12]) for l in timed} == {(20, 64, 8, 32, 12, -1, 1), (33, 64, 8, 73, 40, 16, 1)}
    assert len(lines) == len(doc["compiled"]) + len(rows)
    for r in rows:  # the model launches on the host: its enqueue time is its burst time
        assert r["host_ms"] > 0 and r["host_bound"] == (r["host_ms"] >= ab.HOST_BOUND * r["ms"])
    json.dumps(doc)  # the document is JSON as it is


def test_sink_mode_is_the_launches_not_a_define():
    """+SINK_MODE=m times the same kernel with sink_mode m: no -D of it, the launches carry
    it, the output is compared with the reference of that mode and bit for bit only with the
    variants of the same tile and mode."""
    v = ab.parse_variant("ns=.@mma_m4_b64+SINK_MODE=0")
    assert v.sink_mode == 0 and "SINK_MODE" not in v.defines(64)
    assert ab.parse_variant(".@mma_m4_b64").sink_mode == 1
    with pytest.raises(ValueError, match="SINK_MODE"):
        ab.parse_variant(".@mma_m4_b64+SINK_MODE=3")
    be = ModelBackend(arch="sm_90")
    variants = [ab.parse_variant(x) for x in (".@mma_m4_b64", "ns=.@mma_m4_b64+SINK_MODE=0",
                                               "sm=.@mma_m4_b64+SINK_MODE=2", "ns2=.@mma_m4_b64+SINK_MODE=0")]
    doc = ab.run(be, variants, [parse_shape("gptoss-20@12")], passes=1, n=2, reps=2, log=lambda _: None)
    by = {r["variant"]: r for r in doc["rows"]}
    assert [by[x]["sink_mode"] for x in (".@mma_m4_b64", "ns", "sm", "ns2")] == [1, 0, 2, 0]
    assert by["ns"]["bit_identical"] is None and by["sm"]["bit_identical"] is None  # firsts of their mode
    assert by["ns2"]["bit_identical"] is True
    assert all(0 <= r["rel_l2"] < 2e-3 for r in doc["rows"]), doc["rows"]
    assert {l["args"][11] for l in be.launches} == {0, 1, 2}  # the ABI's sink_mode


class _Clocked:
    """A backend whose launches cost the host ``host_s`` each and the device ``device_ms``
    a launch (what its events would see)."""

    def __init__(self, host_s: float, device_ms: float):
        self.host_s, self.device_ms, self.launches = host_s, device_ms, 0

    def launch(self, *a):
        self.launches += 1
        time.sleep(self.host_s)

    def time_ms(self, fn, warmup=3, reps=10):
        for _ in range(warmup):
            fn()
        n0, out = self.launches, []
        for _ in range(reps):
            fn()
            out.append(self.device_ms * (self.launches - n0))
            n0 = self.launches
        return out


def test_burst_timing_tells_a_host_bound_burst():
    """timing.burst_timing gives the device time of a launch and the host's time to enqueue
    it, from the same timed bursts (warm-up left out): a burst whose host time reaches its
    device time timed the host."""
    launch = (None, (1, 1, 1), (32, 1, 1), ())
    slow_host = _Clocked(host_s=0.002, device_ms=0.001)
    ms, host = timing.burst_timing(slow_host, *launch, n=5, warmup=1, reps=3)
    assert ms == pytest.approx(0.001) and host >= 2.0 and slow_host.launches == 20
    assert host >= ab.HOST_BOUND * ms
    fast_host = _Clocked(host_s=0.0, device_ms=50.0)
    ms, host = timing.burst_timing(fast_host, *launch, n=5)
    assert ms == pytest.approx(50.0) and host < ab.HOST_BOUND * ms
    assert timing.burst_ms(fast_host, *launch, n=5) == ms


def test_run_checks_its_arguments():
    be = ModelBackend(arch="sm_90")
    v = ab.parse_variant(".@mma_m4_b64")
    with pytest.raises(ValueError, match="^variant: labels must differ"):
        ab.run(be, [v, v], [parse_shape("gptoss-8@0")])
    with pytest.raises(ValueError, match="^variants and shapes"):
        ab.run(be, [v], [])


def test_reference_comparison_is_skipped_over_the_limit():
    doc = ab.run(ModelBackend(arch="sm_90"), [ab.parse_variant(".@mma_m4_b64")],
                 [parse_shape("gptoss-16@0")], passes=1, n=1, reps=1, ref_max_pairs=10, log=lambda s: None)
    assert [r["rel_l2"] for r in doc["rows"]] == [None]
    assert np.isfinite(doc["rows"][0]["ms"])


def test_cli_names_a_bad_argument(capsys):
    with pytest.raises(SystemExit) as e:
        ab.main(["--variant", "main", "--shape", "gptoss-512@8192"])
    assert e.value.code == 2 and "variant: expected" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.main(["--variant", ".@mma_m4_b64", "--shape", "gptoss-512"])
    assert "not a shape name" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.main(["--variant", ".@mma_m4_b64", "--shape", "gptoss-8@0", "--passes", "0"])
    assert "passes: expected >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        ab.main(["--help"])
    assert e.value.code == 0 and "REV@CONFIG" in capsys.readouterr().out


def test_run_launches_a_ws_variant_with_its_producer_and_stages():
    """A ws config (a producer warpgroup): 128 more threads, -DWS=1, its 192 KiB of stages
    (and their barriers, and 16 bytes for the TMA first-tile barrier and the sink word), and
    the same bits as the plain tile it shares keys with (the producer only loads)."""
    be = ModelBackend(arch="sm_90")
    variants = [ab.parse_variant(s) for s in (".@wgmma_m8_b128_ws", "plain=.@wgmma_m8_b128")]
    doc = ab.run(be, variants, [parse_shape("d128-40@24")], passes=1, n=2, reps=1, log=lambda s: None)
    ws = [l for l in be.launches if l["kernel"].get("WS") == 1]
    assert ws and all(l["block"] == (384, 1, 1) and l["shared_mem"] == 3 * (64 * 1024 + 16) + 16 for l in ws)
    rows = {r["variant"]: r for r in doc["rows"]}
    assert rows["plain"]["bit_identical"] is True and rows[".@wgmma_m8_b128_ws"]["rel_l2"] < 2e-3


def test_a_variant_the_device_cannot_launch_is_skipped_before_anything_is_timed():
    """A variant whose shared memory the device's blocks cannot have (four K/V stages of the
    d 128 producer tile: 262,224 bytes on a 232,448-byte H100) is named with the backend's
    reason when it is compiled, and every other variant is still timed."""
    class Limited(ModelBackend):
        def prepare(self, kernel, grid, block, args, shared_mem=0):
            if shared_mem > 232448:
                raise ValueError(f"shared_mem: {shared_mem} bytes of dynamic shared memory, over "
                                 f"the 232448 a block may have")
            return super().prepare(kernel, grid, block, args, shared_mem)

    be = Limited(arch="sm_90")
    variants = [ab.parse_variant(s) for s in (".@wgmma_m8_b128_ws", "s4=.@wgmma_m8_b128_ws+KV_STAGES=4",
                                               "s2=.@wgmma_m8_b128_ws+KV_STAGES=2")]
    lines = []
    doc = ab.run(be, variants, [parse_shape("d128-40@24")], passes=2, n=2, reps=1, log=lines.append)
    skipped = {c["variant"]: c.get("skipped") for c in doc["compiled"]}
    assert skipped[".@wgmma_m8_b128_ws"] is None and skipped["s2"] is None
    assert "262224 bytes" in skipped["s4"]
    assert any(l.startswith("d128 s4:") and "skipped: shared_mem: 262224" in l for l in lines)
    assert sorted({r["variant"] for r in doc["rows"]}) == [".@wgmma_m8_b128_ws", "s2"]
    assert len(doc["rows"]) == 2 * 2
    assert not [l for l in be.launches if l["kernel"].get("KV_STAGES") == 4]


def test_checkpoints_name_the_variant_about_to_run_and_keep_every_row_done():
    """A hang must not lose the rows before it: the checkpoint sees the document before each
    timing, with ``running`` naming it and every earlier row in, and after each row."""
    seen = []
    variants = [ab.parse_variant(s) for s in (".@mma_m4_b64", "mb=.@mma_m4_b64+MIN_BLOCKS=2")]
    doc = ab.run(ModelBackend(arch="sm_90"), variants, [parse_shape("gptoss-16@8")], passes=2,
                 n=1, reps=1, log=lambda s: None,
                 checkpoint=lambda d: seen.append((d["running"], len(d["rows"]))))
    order = [(".@mma_m4_b64", 0), ("mb", 0), (".@mma_m4_b64", 1), ("mb", 1)]
    expected = []
    for i, (label, p) in enumerate(order):
        expected += [({"shape": "gptoss-16@8", "variant": label, "pass": p}, i), (None, i + 1)]
    assert seen == expected
    assert doc["running"] is None and len(doc["rows"]) == 4
    with pytest.raises(ValueError, match="^hang_s: expected > 0"):
        ab.run(ModelBackend(arch="sm_90"), variants[:1], [parse_shape("gptoss-8@0")], hang_s=0)


_HANGING_RUN = """
import sys, time
from hipkernel import ab
from refattn.bench import parse_shape
from tests.test_fuzz import ModelBackend

class Hangs(ModelBackend):  # a kernel built with -DHANG=1 never finishes
    def launch(self, kernel, *a, **k):
        if kernel.get("HANG") == 1:
            time.sleep(3600)
        return super().launch(kernel, *a, **k)

sys.argv = ["ab", "--variant", ".@mma_m4_b64", "--variant", "h=.@mma_m4_b64+HANG=1",
            "--shape", "gptoss-16@8", "--passes", "1", "--launches", "1", "--reps", "1",
            "--hang-s", "1", "--json", sys.argv[1]]
import hipkernel.backends
hipkernel.backends.get_backend = lambda name=None: Hangs(arch="sm_90")
sys.exit(ab.main())
"""


def test_cli_exits_on_a_hung_variant_with_the_rows_before_it_on_disk(tmp_path):
    """--hang-s: a variant whose timing never returns ends the process with status 1 and its
    stacks on stderr, well before any device call's limit; the JSON keeps the first
    variant's row and names the one that hung."""
    out = tmp_path / "ab.json"
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-c", _HANGING_RUN, str(out)], capture_output=True,
                         text=True, timeout=120, cwd=api.KERNEL_DIR.parents[1])
    assert res.returncode == 1 and "Timeout" in res.stderr and "burst_timing" in res.stderr
    assert time.monotonic() - t0 < 60
    doc = json.loads(out.read_text())
    assert [r["variant"] for r in doc["rows"]] == [".@mma_m4_b64"]
    assert doc["running"] == {"shape": "gptoss-16@8", "variant": "h", "pass": 0}
    assert doc["command"].startswith("python -m hipkernel.ab --variant .@mma_m4_b64")
