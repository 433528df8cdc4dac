"""Host side of the kernel API, testable without a GPU: the decline decision is made before
any device call, a decline leaves `out` byte-identical, bad arguments raise ValueError
naming the argument, and a supported call with no GPU says which backends were tried."""

import struct

import numpy as np
import pytest

import hipkernel
from hipkernel import api
from tests.fake_backend import RecordingBackend


def _inputs(d=64, dtype=np.float16, Sq=8, Hq=4, Hkv=2, past=4, cap_pad=0):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, Sq, Hq, d)).astype(dtype)
    k = rng.standard_normal((1, Hkv, past + Sq + cap_pad, d)).astype(dtype)
    v = rng.standard_normal((1, Hkv, past + Sq + cap_pad, d)).astype(dtype)
    return q, k, v, past


@pytest.mark.parametrize("kw, dtype, d", [
    ({}, np.float16, 80),            # head dim not compiled
    ({}, np.float16, 256),
    ({"softcap": 30.0}, np.float16, 64),
    ({}, np.float32, 64),            # dtype not implemented
    ({}, np.float64, 128),
])
def test_decline_touches_nothing(kw, dtype, d):
    q, k, v, past = _inputs(d=d, dtype=dtype)
    out = np.full(q.shape, np.float16(-7.25))
    before = out.tobytes()
    be = RecordingBackend()
    status, res = hipkernel.attention(q, k, v, past_len=past, out=out, backend=be, **kw)
    assert status == -1 and res is out
    assert out.tobytes() == before
    assert be.calls == []  # no allocation, copy, compile or launch


def test_decline_at_device_level_calls_nothing():
    be = RecordingBackend()
    assert api.flash_prefill_v3(be, 0x100, 0x200, 0x300, 0, 0x500, B=1, Sq=4, Hq=4, Hkv=2, d=96, S_cap=8, past_len=4) == -1
    assert api.flash_prefill_v3(be, 0x100, 0x200, 0x300, 0, 0x500, B=1, Sq=4, Hq=4, Hkv=2, d=64, S_cap=8, past_len=4,
                                dtype="fp32") == -1
    assert be.calls == []


def test_supported_call_launches_once_per_call(monkeypatch):
    monkeypatch.setenv("HIPKERNEL_TUNE", "0")
    q, k, v, past = _inputs(cap_pad=16)  # cache with spare capacity is accepted
    be = RecordingBackend()
    status, out = hipkernel.attention(q, k, v, past_len=past, sink=np.zeros(4, np.float16), backend=be)
    assert status == 0 and out.shape == q.shape and out.dtype == np.float16
    launches = [c for c in be.calls if c[0] == "launch"]
    assert len(launches) == 1
    assert launches[0][1]["args"][8] == k.shape[2]  # S_cap passed through
    allocs = sum(1 for c in be.calls if c[0] == "alloc")
    frees = sum(1 for c in be.calls if c[0] == "free")
    assert allocs == frees == 5  # q, k, v, sink, out: nothing leaks


def test_v2_is_v3_without_sink_or_window(monkeypatch):
    monkeypatch.setenv("HIPKERNEL_TUNE", "0")
    be = RecordingBackend()
    assert api.flash_prefill_v2(be, 0x100, 0x200, 0x300, 0x500, B=1, Sq=4, Hq=4, Hkv=2, d=64, S_cap=8, past_len=4) == 0
    args = be.launches[0]["args"]
    assert args[3] == 0 and args[10] == -1 and args[11] == 0


@pytest.mark.parametrize("change, name", [
    (dict(past_len=-1), "past_len"),
    (dict(window=0), "window"),
    (dict(window=-3), "window"),
    (dict(scale=float("nan")), "scale"),
    (dict(sink=np.zeros(3, np.float16)), "sink"),
    (dict(out=np.zeros((1, 8, 4, 64), np.float32)), "out"),
    (dict(out=np.zeros((1, 8, 4, 32), np.float16)), "out"),
    (dict(config={"tiles": 2}), "config"),
])
def test_bad_arguments_raise_naming_them(change, name):
    q, k, v, past = _inputs()
    kw = dict(past_len=past, backend=RecordingBackend())
    kw.update(change)
    with pytest.raises(ValueError, match=f"^{name}"):
        hipkernel.attention(q, k, v, **kw)


def test_non_contiguous_rejected():
    q, k, v, past = _inputs()
    qt = np.asfortranarray(q)
    with pytest.raises(ValueError, match="^q: expected a C-contiguous"):
        hipkernel.attention(qt, k, v, past_len=past, backend=RecordingBackend())
    with pytest.raises(ValueError, match="^k"):
        hipkernel.attention(q, k[:, :, ::-1], v, past_len=past, backend=RecordingBackend())


def test_hq_not_multiple_of_hkv_at_device_level():
    with pytest.raises(ValueError, match="^Hkv"):
        api.flash_prefill_v3(RecordingBackend(), 0x100, 0x200, 0x300, 0, 0x500, B=1, Sq=4, Hq=6, Hkv=4, d=64, S_cap=8, past_len=4)


def test_no_backend_names_each_tried(monkeypatch):
    """On this GPU-less machine a supported call must raise RuntimeError listing the backends."""
    from hipkernel import backends

    ok = [name for name, be, _ in backends.available_backends() if be is not None]
    if ok:
        pytest.skip(f"a GPU backend works here ({ok}); this test is for GPU-less machines")
    q, k, v, past = _inputs()
    with pytest.raises(RuntimeError) as e:
        hipkernel.attention(q, k, v, past_len=past)
    assert "cuda" in str(e.value) and "hip" in str(e.value)


def test_source_hash_is_stable_and_inlines_headers():
    src = api.kernel_source()
    assert '#include "portable.h"' not in src and "gqa_flash_prefill" in src
    assert api.source_hash() == api.source_hash() and len(api.source_hash()) == 64
    mma = api.kernel_source("mma")
    assert '#include "portable.h"' not in mma and "mma.sync.aligned.m16n8k16" in mma
    assert "mma.sync" not in src.split("---- end portable.h ----")[1]  # scalar body: no MMA
    amd = api.kernel_source("wmma")
    assert amd == api.kernel_source("mfma")  # one file, WAVE picks the instruction
    assert all(f"---- begin {h} ----" in amd for h in ("portable.h", "flash_common.h", "amd_mma.h"))
    assert "__builtin_amdgcn_wmma_f32_16x16x16_f16_w32" in amd
    assert "__builtin_amdgcn_mfma_f32_16x16x16f16" in amd
    with pytest.raises(ValueError, match="^path"):
        api.kernel_source("xmma")


def test_source_hash_covers_every_kernel_file(monkeypatch, tmp_path):
    """An edit of any path's file or of a shared header changes the hash."""
    import shutil

    for f in api.KERNEL_DIR.iterdir():
        if f.suffix in (".hip", ".h"):
            shutil.copy(f, tmp_path / f.name)
    monkeypatch.setattr(api, "KERNEL_DIR", tmp_path)
    base = api.source_hash()
    for name in ("gqa_flash_prefill.hip", "gqa_flash_prefill_mma.hip", "portable.h",
                 "gqa_flash_prefill_wgmma.hip", "wgmma.h", "flash_rows.h", "flash_common.h",
                 "gqa_flash_prefill_amdmma.hip", "amd_mma.h"):
        f = tmp_path / name
        text = f.read_text()
        f.write_text(text + "// edit\n")
        assert api.source_hash() != base, name
        f.write_text(text)
    assert api.source_hash() == base


def test_source_hash_covers_the_launch_code(monkeypatch, tmp_path):
    """An edit of the host code that tunes, compiles and launches the kernel (the NumPy level,
    a runtime) changes the hash too: a GPU record is fresh only for the code that ran it. The
    torch entry point changes only the hash of its own records; a file outside the launch
    path (the harness adapter) changes neither."""
    import shutil

    pkg = tmp_path / "hipkernel"
    shutil.copytree(api.PACKAGE_DIR, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(api, "PACKAGE_DIR", pkg)
    monkeypatch.setattr(api, "KERNEL_DIR", pkg / "kernels")
    base = api.source_hash()
    torch_base = api.torch_source_hash()
    assert torch_base != base
    for name in ("api.py", "autotune.py", "config.py", "backends/cuda.py",
                 "backends/hip.py", "backends/__init__.py", "kernels/wgmma.h"):
        f = pkg / name
        text = f.read_text()
        f.write_text(text + "# edit\n")
        assert api.source_hash() != base and api.torch_source_hash() != torch_base, name
        f.write_text(text)
    # the torch entry point: its own records' hash, not the kernel's
    f = pkg / "torch.py"
    text = f.read_text()
    f.write_text(text + "# edit\n")
    assert api.source_hash() == base and api.torch_source_hash() != torch_base
    f.write_text(text)
    (pkg / "adapter.py").write_text((pkg / "adapter.py").read_text() + "# edit\n")
    (pkg / "backends" / "notes.txt").write_text("not code\n")
    assert api.source_hash() == base and api.torch_source_hash() == torch_base


def test_mma_config_accepted_and_checked_against_the_target():
    from hipkernel.config import KernelConfig

    be = RecordingBackend(arch="sm_90")
    geom = dict(B=1, Sq=40, Hq=8, Hkv=2, d=64, S_cap=64, past_len=24)
    assert api.flash_prefill_v3(be, 0x100, 0x200, 0x300, 0, 0x500, config={"path": "mma", "bkv": 32},
                                **geom) == 0
    launch = be.launches[-1]
    assert launch["kernel"]["BKV"] == 32 and launch["block"] == (128, 1, 1)
    with pytest.raises(ValueError, match="^config: path"):
        api.flash_prefill_v3(be, 0x100, 0x200, 0x300, 0, 0x500, config={"path": "xmma"}, **geom)
    amd = RecordingBackend(arch="gfx1151")
    with pytest.raises(ValueError, match="^config: path 'mma' needs"):
        api.flash_prefill_v3(amd, 0x100, 0x200, 0x300, 0, 0x500,
                             config=KernelConfig(4, 64, "mma"), **geom)
    assert not amd.launches and not amd.calls  # refused before any device call


def test_amd_matrix_core_configs_launch_a_wave_per_16_rows_where_they_run():
    """wmma (wave32) runs on gfx11, mfma (wave64) on gfx90a / gfx94x, both on NVIDIA through
    the emulation; elsewhere they are refused before any device call, naming the path."""
    geom = dict(B=1, Sq=40, Hq=8, Hkv=2, d=64, S_cap=64, past_len=24)
    for arch, path, block in (("gfx1151", "wmma", 128), ("sm_90", "wmma", 128),
                              ("gfx942", "mfma", 256), ("gfx90a", "mfma", 256), ("sm_80", "mfma", 256)):
        be = RecordingBackend(arch=arch)
        assert api.flash_prefill_v3(be, 0x100, 0x200, 0x300, 0, 0x500,
                                    config={"path": path, "bkv": 32}, **geom) == 0
        launch = be.launches[-1]
        assert launch["kernel"]["WAVE"] == (32 if path == "wmma" else 64), (arch, path)
        assert launch["block"] == (block, 1, 1) and launch["grid"] == (1, 8, 1), (arch, path)
    for arch, path, need in (("gfx942", "wmma", "gfx11"), ("gfx1151", "mfma", "gfx90a"),
                             ("gfx1030", "wmma", "gfx11")):
        be = RecordingBackend(arch=arch)
        with pytest.raises(ValueError, match=f"^config: path '{path}' needs an AMD {need}"):
            api.flash_prefill_v3(be, 0x100, 0x200, 0x300, 0, 0x500, config={"path": path}, **geom)
        assert not be.launches and not be.calls


def test_packed_config_launches_its_grid_and_needs_heads_that_share_a_kv_head():
    """pack = 4 heads a block: -DPACK=4, grid (ceil(Sq / (BM / 4)), Hq / 4, B); a geometry whose
    G is not a multiple of pack is refused with a ValueError naming the config, before any
    device call, at the device level and at the NumPy level."""
    geom = dict(B=1, Sq=40, Hq=8, Hkv=2, d=64, S_cap=64, past_len=24)  # G = 4
    be = RecordingBackend(arch="sm_90")
    assert api.flash_prefill_v3(be, 0x100, 0x200, 0x300, 0, 0x500, window=16,
                                config={"path": "mma", "bkv": 32, "pack": 4}, **geom) == 0
    launch = be.launches[-1]
    assert launch["kernel"] == {"HEAD_DIM": 64, "M_TILES": 4, "BKV": 32, "PACK": 4}
    assert launch["grid"] == (3, 2, 1) and launch["block"] == (128, 1, 1)  # 16 positions a block
    for bad in (RecordingBackend(arch="sm_90"), RecordingBackend(arch="sm_80")):
        with pytest.raises(ValueError, match=r"^config: mma_m4_b32_p8 packs 8 query heads a "
                                             r"block.*G = Hq / Hkv = 4"):
            api.flash_prefill_v3(bad, 0x100, 0x200, 0x300, 0, 0x500,
                                 config={"path": "mma", "bkv": 32, "pack": 8}, **geom)
        assert not bad.calls
    q, k, v, past = _inputs()
    G = q.shape[2] // k.shape[1]
    be = RecordingBackend(arch="sm_90")
    with pytest.raises(ValueError, match=f"^config: .*G = Hq / Hkv = {G} is not a multiple"):
        hipkernel.attention(q, k, v, past_len=past, backend=be,
                            config={"path": "mma", "bkv": 32, "pack": 2 * G})
    assert be.calls == []
    with pytest.raises(ValueError, match="^config: pack: 4 heads a block needs path 'mma'"):
        api.flash_prefill_v3(be, 0x100, 0x200, 0x300, 0, 0x500, config={"pack": 4}, **geom)


def test_walking_config_launches_its_grid():
    """walk = 4 Q tiles a block: -DQWALK=4 and a grid of ceil(Q tiles / 4) blocks along x;
    mma only, refused with a ValueError naming walk before any device call."""
    geom = dict(B=1, Sq=40, Hq=8, Hkv=2, d=64, S_cap=64, past_len=24)  # G = 4
    be = RecordingBackend(arch="sm_90")
    assert api.flash_prefill_v3(be, 0x100, 0x200, 0x300, 0, 0x500, window=16,
                                config={"path": "mma", "bkv": 32, "pack": 4, "walk": 4}, **geom) == 0
    launch = be.launches[-1]
    assert launch["kernel"] == {"HEAD_DIM": 64, "M_TILES": 4, "BKV": 32, "PACK": 4, "QWALK": 4}
    assert launch["grid"] == (1, 2, 1) and launch["block"] == (128, 1, 1)  # 3 Q tiles, one block
    be = RecordingBackend(arch="sm_90")
    with pytest.raises(ValueError, match="^config: walk: 4 Q tiles a block needs path 'mma'"):
        api.flash_prefill_v3(be, 0x100, 0x200, 0x300, 0, 0x500, config={"walk": 4}, **geom)
    with pytest.raises(ValueError, match=r"^config: walk: expected one of \(1, 2, 4, 8\)"):
        api.flash_prefill_v3(be, 0x100, 0x200, 0x300, 0, 0x500,
                             config={"path": "mma", "walk": 3}, **geom)
    assert not be.calls


def test_wgmma_config_needs_an_sm90_target():
    """path "wgmma" runs on sm_90 (its kernels are compiled for sm_90a) only: elsewhere, the
    tensor-core sm_80 included, a ValueError naming the path before any device call; on
    sm_90 it launches the wgmma source with a warpgroup per 64 rows."""
    from hipkernel.config import KernelConfig

    geom = dict(B=1, Sq=40, Hq=8, Hkv=2, d=64, S_cap=64, past_len=24)
    for arch in ("sm_80", "sm_100", "gfx942"):
        be = RecordingBackend(arch=arch)
        with pytest.raises(ValueError, match="^config: path 'wgmma' needs an NVIDIA sm_90") as e:
            api.flash_prefill_v3(be, 0x100, 0x200, 0x300, 0, 0x500,
                                 config=KernelConfig(8, 64, "wgmma"), **geom)
        assert arch in str(e.value), f"the message does not name the target: {e.value}"
        assert not be.calls, f"{arch}: device calls before the error: {be.calls}"
    # the NumPy level refuses it before allocating too
    q, k, v, past = _inputs()
    sm80 = RecordingBackend(arch="sm_80")
    with pytest.raises(ValueError, match="^config: path 'wgmma'"):
        hipkernel.attention(q, k, v, past_len=past, backend=sm80,
                            config={"path": "wgmma", "m_tiles": 8, "bkv": 64})
    assert sm80.calls == [], f"device calls before the error: {sm80.calls}"
    # an impossible wgmma tile is refused by the config itself
    with pytest.raises(ValueError, match="^config: m_tiles: path 'wgmma'"):
        hipkernel.attention(q, k, v, past_len=past, backend=RecordingBackend(arch="sm_90"),
                            config={"path": "wgmma", "m_tiles": 2, "bkv": 64})
    for arch in ("sm_90", "sm_90a"):
        be = RecordingBackend(arch=arch)
        sources = []
        compile_ = be.compile
        be.compile = lambda src, defines, name: (sources.append(src), compile_(src, defines, name))[1]
        assert api.flash_prefill_v3(be, 0x100, 0x200, 0x300, 0, 0x500,
                                    config={"path": "wgmma", "m_tiles": 8, "bkv": 64}, **geom) == 0
        assert sources == [api.kernel_source("wgmma")], f"{arch}: not compiled from the wgmma source"
        launch = be.launches[-1]
        assert launch["kernel"] == {"HEAD_DIM": 64, "M_TILES": 8, "BKV": 64, "KV_STAGES": 6,
                                    "RESCALE_LOG2": 8, "ROWSUM_MMA": 1}
        assert launch["block"] == (256, 1, 1) and launch["grid"] == (1, 8, 1)
        # its K/V stages are dynamic shared memory, passed at launch: 6 x 16 KiB, the row
        # sums' 2 KiB of ones and 6 x 16 bytes of mbarriers
        assert launch["shared_mem"] == KernelConfig(8, 64, "wgmma").dynamic_smem_bytes(64) == 98400 + 2048
        # with a producer warpgroup (a config dict says ws): 128 more threads, -DWS=1, and
        # its own stage budget at d = 128 (3 x 64 KiB of 128-key tiles), lazy rescaling
        geom128 = {**geom, "d": 128}
        assert api.flash_prefill_v3(be, 0x100, 0x200, 0x300, 0, 0x500, **geom128,
                                    config={"path": "wgmma", "m_tiles": 8, "bkv": 128, "ws": True}) == 0
        launch = be.launches[-1]
        assert launch["kernel"] == {"HEAD_DIM": 128, "M_TILES": 8, "BKV": 128, "KV_STAGES": 3, "WS": 1,
                                    "RESCALE_LOG2": 8, "RESCALE_ROWS": 8}
        assert launch["block"] == (384, 1, 1) and launch["grid"] == (1, 8, 1)
        assert launch["shared_mem"] == 3 * 64 * 1024 + 3 * 16 + 16
    with pytest.raises(ValueError, match="^config: ws: "):  # a producer on the mma path
        api.flash_prefill_v3(RecordingBackend(arch="sm_90"), 0x100, 0x200, 0x300, 0, 0x500,
                             config={"path": "mma", "m_tiles": 8, "bkv": 64, "ws": True}, **geom)
    # the other paths' shared memory is static: none passed
    be = RecordingBackend(arch="sm_90")
    for cfg in ({"path": "mma", "m_tiles": 4, "bkv": 64}, {"m_tiles": 4, "bkv": 64}):
        assert api.flash_prefill_v3(be, 0x100, 0x200, 0x300, 0, 0x500, config=cfg, **geom) == 0
        assert be.launches[-1]["shared_mem"] == 0, cfg


def test_tma_configs_pass_their_kv_tensor_maps():
    """A config that copies with TMA (the wgmma tile with a producer warpgroup) takes two
    more arguments, the tensor maps of its copies: k then v as
    (d, skv, B * Hkv) with a box of (64, bkv, 1), byte strides 2 d and 2 d S_cap; under the
    tail_unmasked mutant the rows are the whole cache (S_cap), after the fifteen arguments of
    every path (the length arrays null: a uniform call). Every other config takes the fifteen
    and encodes no map."""
    geom = dict(B=2, Sq=40, Hq=8, Hkv=2, d=128, S_cap=96, past_len=24)
    for cfg in ({"path": "wgmma", "m_tiles": 8, "bkv": 128, "ws": True},
                {"path": "wgmma", "m_tiles": 8, "bkv": 64, "ws": True}):
        for mutants, rows in ((frozenset(), 64), (frozenset({"tail_unmasked"}), 96)):
            be = RecordingBackend(arch="sm_90")
            assert api.flash_prefill_v3(be, 0x100, 0x200, 0x300, 0, 0x500, config=cfg,
                                        mutants=mutants, **geom) == 0
            args = be.launches[-1]["args"]
            assert len(args) == 17 and args[:5] == [0x100, 0x200, 0x300, 0, 0x500]
            assert args[13:15] == [0, 0]
            for blob, ptr in zip(args[15:], (0x200, 0x300)):
                assert struct.unpack("<9Q", blob[:72]) == (ptr, 128, rows, 4, 256, 256 * 96, 64,
                                                           cfg["bkv"], 1), (cfg, mutants)
    be = RecordingBackend(arch="sm_90")
    for cfg in ({"path": "wgmma", "m_tiles": 8, "bkv": 64}, {"path": "wgmma", "m_tiles": 16, "bkv": 64},
                {"path": "mma", "m_tiles": 4, "bkv": 64}):
        assert api.flash_prefill_v3(be, 0x100, 0x200, 0x300, 0, 0x500, config=cfg, **geom) == 0
        assert len(be.launches[-1]["args"]) == 15, cfg
    assert not [c for c in be.calls if c[0] == "tensor_map"]


def test_wgmma_source_is_its_own_translation_unit():
    """The wgmma kernel inlines its headers (wgmma.h, flash_rows.h, portable.h) like the other
    paths, and only it carries wgmma instructions."""
    wg = api.kernel_source("wgmma")
    assert '#include "' not in wg and "gqa_flash_prefill" in wg
    assert "wgmma.mma_async" in wg
    assert all(f"---- begin {h} ----" in wg for h in ("wgmma.h", "flash_rows.h")), \
        "a header of the wgmma kernel is not inlined"
    assert "wgmma.mma_async" not in api.kernel_source("mma") + api.kernel_source("scalar")
    assert len({api.kernel_source(p) for p in api.KERNEL_FILES}) == 5  # wmma and mfma: one file


def test_misaligned_device_pointer_rejected():
    with pytest.raises(ValueError, match="^k: device pointer"):
        api.flash_prefill_v3(RecordingBackend(), 0x100, 0x208, 0x300, 0, 0x500, B=1, Sq=4, Hq=4, Hkv=2,
                             d=64, S_cap=8, past_len=4)


def test_hipkernel_adapter_with_a_forced_config():
    """``hipkernel:hip@wmma_m4_b64``: available only where its path runs (the reason names the
    config and the target), and then every case launches that config, untuned, its own tiles
    ignored."""
    from hipkernel.adapter import HipKernel
    from refattn.cases import load_suites, make_inputs

    k = HipKernel(config="wmma_m4_b64")
    k._backend = RecordingBackend(arch="gfx942")
    ok, why = k.available()
    assert not ok and "config wmma_m4_b64: path 'wmma' does not run on" in why and "gfx942" in why
    be = RecordingBackend(arch="gfx1151")
    k = HipKernel("hip", config="wmma_m4_b64")
    k._backend = be
    assert k.available()[0] and k.name == "hipkernel:hip@wmma_m4_b64"
    (case,) = [c for c in load_suites(["seed"]) if c.name == "gptoss-nosink-past512-w100-bkv32"]
    status, _ = k.run(make_inputs(case))  # the case asks for bkv 32; the forced config wins
    assert status == 0 and be.launches and not any(l["tuning"] for l in be.launches)
    assert {(l["kernel"]["WAVE"], l["kernel"]["M_TILES"], l["kernel"]["BKV"]) for l in be.launches} == {(32, 4, 64)}
