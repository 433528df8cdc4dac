"""The kernel's host side for ragged batches and bf16, without a GPU: argument checks (each bad
argument named), the decline table, the upload of the per-sequence lengths into the ABI's two
pointer slots, the TMA configs that a ragged call cannot use, the bf16 define, and, where
NVRTC is installed, every path compiled in both dtypes at both head dims with and without the
new mutant macros."""

from __future__ import annotations

import ctypes
import numpy as np
import pytest

import hipkernel
from hipkernel import api, build
from hipkernel.autotune import TUNER, tune_key
from hipkernel.backends import cuda as cuda_be
from hipkernel.config import (DEFAULT, HEAD_DIMS, MFMA_CANDIDATES, MMA_DEFAULT, WGMMA_BY_HEAD_DIM,
                              WGSPAN_CANDIDATES, WMMA_CANDIDATES, KernelConfig)
from refattn.mutants import by_name
from tests.fake_backend import RecordingBackend
from tests.test_build import _require_nvrtc_sm90a

NEW_MUTANTS = ("ragged_max_diag", "padded_row_next_seq", "padding_not_written", "bf16_p_as_fp16")
PTRS = (0x100, 0x200, 0x300, 0, 0x500)
GEOM = dict(B=3, Sq=24, Hq=8, Hkv=2, d=64, S_cap=160)
WS128 = {"path": "wgmma", "m_tiles": 8, "bkv": 128, "ws": True}


@pytest.fixture(autouse=True)
def fresh_tuner(monkeypatch):
    monkeypatch.setenv("HIPKERNEL_TUNE", "1")
    TUNER.clear()
    yield
    TUNER.clear()


def _v3(be, **kw):
    return api.flash_prefill_v3(be, *PTRS, **{**GEOM, **kw})


class LoggingBackend(RecordingBackend):
    """RecordingBackend that keeps what was uploaded to a buffer after it is freed."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._mem_log = {}

    def htod(self, ptr, arr):
        super().htod(ptr, arr)
        self._mem_log[ptr] = bytes(self._mem[ptr])


# ------------------------------------------------------------------- argument checks

@pytest.mark.parametrize("kw, name", [
    (dict(past_len=[0, 1]), "past_len"),                       # wrong length
    (dict(past_len=[0, -1, 2]), "past_len"),                   # negative
    (dict(past_len=[0.0, 1.0, 2.0]), "past_len"),              # not integers
    (dict(past_len=[True, False, True]), "past_len"),          # bools are not lengths
    (dict(past_len=np.zeros((3, 1), np.int64)), "past_len"),   # wrong shape
    (dict(past_len=[0, 2**31, 0]), "past_len"),                # int32 overflow
    (dict(past_len=[0, 2**31 - 10, 0], S_cap=2**31 - 1), "past_len"),  # its last position
    (dict(past_len=4, q_len=[24, 1]), "q_len"),                # wrong length
    (dict(past_len=4, q_len=[24, -1, 3]), "q_len"),            # negative
    (dict(past_len=4, q_len=[24, 25, 3]), "q_len"),            # more rows than q holds
    (dict(past_len=4, q_len=[1.5, 2, 3]), "q_len"),            # not integers
    (dict(past_len=[0, 150, 3], q_len=[24, 11, 3]), "S_cap"),  # 150 + 11 keys > 160
    (dict(past_len=[0, 140, 3]), "S_cap"),                     # 140 + 24 keys > 160
])
def test_bad_lengths_raise_naming_them_before_any_device_call(kw, name):
    be = RecordingBackend(arch="sm_90")
    with pytest.raises(ValueError, match=f"^{name}"):
        _v3(be, **kw)
    assert be.calls == []


@pytest.mark.parametrize("change, name", [
    (dict(q_len=np.array([3])), "q_len"),
    (dict(q_len=np.array([3, 9])), "q_len"),                  # 9 > Sq = 8
    (dict(past_len=np.array([2, -1])), "past_len"),
    (dict(dtype="bf16", q_bits=True), "q"),                    # low 16 bits set
    (dict(dtype="bf16", k_bits=True), "k"),
    (dict(dtype="bf16", v_bits=True), "v"),
    (dict(dtype="bf16", as_fp16=True), "q"),                   # bf16 from float16 arrays
    (dict(dtype="fp16", as_fp32=True), "q"),                   # fp16 from float32 arrays
    (dict(dtype="bf16", out=np.zeros((2, 8, 4, 64), np.float16)), "out"),
    (dict(dtype=16), "dtype"),
])
def test_numpy_level_names_each_bad_argument(change, name):
    q, k, v = _bf16_arrays()
    change = dict(change)
    if change.pop("as_fp16", False):
        q, k, v = (x.astype(np.float16) for x in (q, k, v))
    change.pop("as_fp32", False)  # q, k, v are float32 already
    for arr, flag in ((q, "q_bits"), (k, "k_bits"), (v, "v_bits")):
        if change.pop(flag, False):
            arr.view(np.uint32)[0, 0, 0, 0] |= 1
    kw = dict(past_len=4, backend=RecordingBackend(arch="sm_90"))
    kw.update(change)
    be = kw["backend"]
    with pytest.raises(ValueError, match=f"^{name}"):
        hipkernel.attention(q, k, v, **kw)
    assert be.calls == []


def _bf16_arrays(B=2, Sq=8, Hq=4, Hkv=2, d=64, S=16, seed=0):
    """float32 q, k, v holding bf16 values (the low 16 bits of every word zero)."""
    rng = np.random.default_rng(seed)

    def bf16(shape):
        x = rng.standard_normal(shape).astype(np.float32)
        x.view(np.uint32)[...] &= 0xFFFF0000
        return x

    return bf16((B, Sq, Hq, d)), bf16((B, Hkv, S, d)), bf16((B, Hkv, S, d))


# ------------------------------------------------------------------- decline table

@pytest.mark.parametrize("dtype, declined", [("fp16", False), ("bf16", False), ("fp32", True),
                                             ("fp64", True), ("mixed", True)])
def test_decline_table(dtype, declined):
    assert api.SUPPORTED_DTYPES == ("fp16", "bf16")
    assert (api.decline_reason(d=64, dtype=dtype) is not None) == declined
    be = RecordingBackend(arch="sm_90")
    status = _v3(be, past_len=4, dtype=dtype, config={"path": "mma"})
    assert status == (-1 if declined else 0)
    assert (be.calls == []) == declined


def test_fp32_arrays_are_declined_and_touch_nothing():
    q, k, v = _bf16_arrays()
    be = RecordingBackend(arch="sm_90")
    out = np.full(q.shape, np.float16(-3.5))
    for kw in ({}, {"dtype": "fp32"}):
        status, res = hipkernel.attention(q, k, v, past_len=4, backend=be,
                                          out=None if kw else out, **kw)
        assert status == -1 and be.calls == []
    assert (out == np.float16(-3.5)).all()


def test_bf16_goes_to_the_device_as_the_top_halves_and_comes_back_as_float32():
    q, k, v = _bf16_arrays()
    be = LoggingBackend(arch="sm_90")
    status, out = hipkernel.attention(q, k, v, past_len=4, dtype="bf16", backend=be,
                                      config={"path": "mma"})
    assert status == 0 and out.dtype == np.float32 and out.shape == q.shape
    ups = [np.frombuffer(be._mem_log[c[1]], np.uint16) for c in be.calls if c[0] == "htod"]
    assert [u.tolist() for u in ups[:3]] == [(x.view(np.uint32).ravel() >> 16).tolist() for x in (q, k, v)]
    (launch,) = be.launches
    assert launch["kernel"]["HK_BF16"] == 1
    # no out given: the device output starts as NaN, which the fake kernel leaves there
    assert np.isnan(out).all() and (out.view(np.uint32) & 0xFFFF == 0).all()
    # an out given seeds the device output with its bf16 bits and gets the result back
    seed = q.copy()
    status, res = hipkernel.attention(q, k, v, past_len=4, dtype="bf16", backend=be, out=seed,
                                      config={"path": "mma"})
    assert status == 0 and res is seed and np.array_equal(seed, q)


# ------------------------------------------------------------------- the ABI

def test_uniform_args_are_the_old_thirteen_and_two_null_pointers():
    be = RecordingBackend(arch="sm_90")
    kw = dict(q=0x100, k=0x200, v=0x300, sink=0x400, out=0x500, B=2, Sq=40, Hq=8, Hkv=2, d=64,
              S_cap=96, past_len=24, window=-1, sink_mode=1, scale=0.125)
    got = api.kernel_args(be, KernelConfig(4, 64, "mma"), **kw)
    old = [(ctypes.c_void_p, 0x100), (ctypes.c_void_p, 0x200), (ctypes.c_void_p, 0x300),
           (ctypes.c_void_p, 0x400), (ctypes.c_void_p, 0x500), (ctypes.c_int32, 40),
           (ctypes.c_int32, 8), (ctypes.c_int32, 2), (ctypes.c_int32, 96), (ctypes.c_int32, 24),
           (ctypes.c_int32, -1), (ctypes.c_int32, 1), (ctypes.c_float, 0.125)]
    assert got == old + [(ctypes.c_void_p, 0), (ctypes.c_void_p, 0)]
    # the launch of a uniform call, and of one whose length arrays are uniform
    for lens in (dict(past_len=24), dict(past_len=[24, 24], q_len=[40, 40])):
        be = RecordingBackend(arch="sm_90")
        assert api.flash_prefill_v3(be, *PTRS, B=2, Sq=40, Hq=8, Hkv=2, d=64, S_cap=96,
                                    config={"path": "mma"}, **lens) == 0
        (launch,) = be.launches
        assert launch["args"][9] == 24 and launch["args"][13:] == [0, 0], lens
        assert not [c for c in be.calls if c[0] in ("alloc", "htod")]


@pytest.mark.parametrize("lens, want, slots", [
    (dict(past_len=[0, 130, 40], q_len=[24, 1, 0]), [0, 130, 40, 24, 1, 0], (0, 12)),
    (dict(past_len=[0, 130, 40]), [0, 130, 40], (0, None)),    # q_len None: Sq rows each
    (dict(past_len=7, q_len=[24, 3, 0]), [24, 3, 0], (None, 0)),  # one past_len for all
    (dict(past_len=np.array([5, 5, 9]), q_len=np.array([24, 24, 24])), [5, 5, 9], (0, None)),
])
def test_a_ragged_call_uploads_its_lengths_into_the_abi_slots(lens, want, slots):
    be = LoggingBackend(arch="sm_90")
    assert _v3(be, config={"path": "mma"}, **lens) == 0
    (launch,) = be.launches
    (buf,) = [c[1] for c in be.calls if c[0] == "htod"]
    assert np.frombuffer(be._mem_log[buf], np.int32).tolist() == want
    assert launch["args"][13:15] == [0 if s is None else buf + s for s in slots]
    assert launch["args"][9] == (lens["past_len"] if isinstance(lens["past_len"], int) else 0)
    assert [c[0] for c in be.calls] == ["alloc", "htod", "compile", "launch", "synchronize", "free"]
    assert [c for c in be.calls if c[0] == "free"] == [("free", buf)]  # after the synchronize


def test_numpy_level_ragged_call_passes_the_lengths():
    q, k, v = _bf16_arrays(B=3, S=40)
    q16, k16, v16 = (x.astype(np.float16) for x in (q, k, v))
    be = LoggingBackend(arch="sm_90")
    status, out = hipkernel.attention(q16, k16, v16, past_len=np.array([0, 32, 5]),
                                      q_len=np.array([8, 1, 0]), backend=be, config={"path": "mma"})
    assert status == 0 and out.dtype == np.float16
    (launch,) = be.launches
    buf = launch["args"][13]
    assert np.frombuffer(be._mem_log[buf], np.int32).tolist() == [0, 32, 5, 8, 1, 0]
    assert launch["args"][14] == buf + 12
    allocs = sum(c[0] == "alloc" for c in be.calls)
    assert allocs == sum(c[0] == "free" for c in be.calls) == 5  # q, k, v, out, lengths


# ------------------------------------------------------------------- TMA and tuning

def test_a_ragged_call_refuses_a_tma_config_before_any_device_call():
    be = RecordingBackend(arch="sm_90")
    with pytest.raises(ValueError, match=r"^config: wgmma_m8_b128_ws copies its K/V tiles with TMA"):
        _v3(be, d=128, past_len=[0, 9, 3], config=WS128)
    assert be.calls == []
    # the same config takes a uniform call, lengths given as arrays of one value included
    for lens in (dict(past_len=9), dict(past_len=[9, 9, 9], q_len=[24, 24, 24])):
        be = RecordingBackend(arch="sm_90")
        assert _v3(be, d=128, config=WS128, **lens) == 0
        assert len(be.launches[-1]["args"]) == 17 and be.launches[-1]["args"][13:15] == [0, 0]


def test_a_ragged_call_tunes_without_tma_under_its_own_key():
    """At d = 128 on sm_90 the uniform tuner offers the TMA tile; a ragged call times every
    other candidate as the uniform call of its geometry (no length pointers, past_len = the
    longest sequence's keys - Sq on the scratch cache) and launches its winner with them."""
    from hipkernel.autotune import prune_by_model
    from hipkernel.config import candidates

    fast = {(8, 128): 0.01}  # the TMA tile would win
    be = RecordingBackend(arch="sm_90", times=fast)
    assert _v3(be, d=128, past_len=[0, 100, 7], q_len=[24, 3, 0]) == 0
    tuning = [l for l in be.launches if l["tuning"]]
    final = [l for l in be.launches if not l["tuning"]]
    assert tuning and len(final) == 1
    assert not any(l["kernel"].get("WS") for l in be.launches)
    assert all(l["args"][13:15] == [0, 0] for l in tuning)
    assert all(l["args"][8] == api.TUNE_MIN_KV and l["args"][9] == api.TUNE_MIN_KV - 24 for l in tuning)
    assert final[0]["args"][13] != 0 and final[0]["args"][14] != 0
    ragged_key = tune_key(d=128, sq=24, Hq=8, G=4, window=-1, dtype="fp16", arch="sm_90", ragged=True)
    assert set(TUNER.cache) == {ragged_key}
    assert set(TUNER.probes[ragged_key]) == {c.name for c in prune_by_model(candidates("sm_90", 128, 4, -1), "sm_90")
                                             if not c.tma}
    # a uniform call of the same geometry sweeps its own key, TMA tile included, and takes it
    be = RecordingBackend(arch="sm_90", times=fast)
    assert _v3(be, d=128, past_len=7) == 0
    assert TUNER.sweeps == 2 and be.launches[-1]["kernel"].get("WS") == 1


def test_a_batch_shorter_than_sq_rows_tunes_on_a_scratch_cache_it_fits():
    """The uniform stand-in of a batch whose sequences are all shorter than Sq needs Sq keys,
    more than its cache holds: where the TUNE_MIN_KV scratch is over the byte cap, a scratch
    of just Sq keys."""
    be = RecordingBackend(arch="sm_90")
    big = dict(B=64, Hkv=16, d=128)  # 64 * 16 * 4096 keys * 256 bytes: 1 GiB
    with api.TuningCache(be, 0x200, 0x300, Sq=100, S_cap=50, past_len=0, **big) as kv:
        assert kv.get()[2:] == (100, 0)
    with api.TuningCache(be, 0x200, 0x300, Sq=100, S_cap=50, past_len=0, B=1, Hkv=1, d=64) as kv:
        assert kv.get()[2:] == (api.TUNE_MIN_KV, api.TUNE_MIN_KV - 100)
    with api.TuningCache(be, 0x200, 0x300, Sq=100, S_cap=9000, past_len=8000, **big) as kv:
        assert kv.get() == (0x200, 0x300, 9000, 8000)


# ------------------------------------------------------------------- the bf16 build

def test_the_bf16_build_adds_its_define_and_nothing_else():
    for d in HEAD_DIMS:
        for cfg in (DEFAULT, MMA_DEFAULT, WGMMA_BY_HEAD_DIM[d], WMMA_CANDIDATES[0], MFMA_CANDIDATES[0]):
            fp16 = api.kernel_defines(d, cfg)
            assert "HK_BF16" not in fp16 and fp16 == cfg.defines(d) == cfg.defines(d, "fp16")
            assert api.kernel_defines(d, cfg, dtype="bf16") == {**fp16, "HK_BF16": 1}
    with pytest.raises(ValueError, match="^dtype"):
        DEFAULT.defines(64, "fp8")
    be = RecordingBackend(arch="sm_90")
    assert _v3(be, past_len=4, dtype="bf16", config={"path": "mma"}) == 0
    assert be.calls[0] == ("compile", {**MMA_DEFAULT.defines(64), "HK_BF16": 1})


def test_build_matrix_has_both_dtypes_and_the_new_mutants():
    vs = build.kernel_variants(mutants=True)
    plain = {(v.dtype, v.d, v.config) for v in vs if "+" not in v.config}
    assert {(dt, d, c) for dt in ("fp16", "bf16") for _, d, c in plain} == plain
    for m in NEW_MUTANTS:
        macro = by_name(m).macro
        mutated = [v for v in vs if v.config.endswith(f"+{m}")]
        assert {v.dtype for v in mutated} == {"fp16", "bf16"}
        assert {v.path for v in mutated} >= {"scalar", "mma", "wgmma", "wmma", "mfma"}
        assert all(v.defines[macro] == 1 for v in mutated)
    assert {v.dtype for v in build.kernel_variants(dtypes=["bf16"])} == {"bf16"}


@pytest.mark.parametrize("name", NEW_MUTANTS)
def test_every_path_carries_the_new_mutant_macros(name):
    macro = by_name(name).macro
    for path in api.KERNEL_FILES:
        assert f"HIPKERNEL_MUTANT_{name.upper()}" == macro
        assert macro in api.kernel_source(path), (path, macro)


# ------------------------------------------------------------------- real compiles (NVRTC)



def _one_per_path(d: int) -> list[KernelConfig]:
    """Each path's shipped config at head dim ``d`` (wgspan where its tile fits)."""
    cfgs = [DEFAULT, MMA_DEFAULT, WGMMA_BY_HEAD_DIM[d], WMMA_CANDIDATES[0], MFMA_CANDIDATES[0]]
    return cfgs + [c for c in WGSPAN_CANDIDATES if c.fits(d)]


def _target(cfg: KernelConfig) -> str:
    return "sm_90a" if cfg.path in ("wgmma", "wgspan") else "sm_90"


def _compile(cfg: KernelConfig, d: int, dtype: str, mutants=frozenset(), arch: str | None = None):
    """One NVRTC compile of ``cfg`` (the AMD matrix-core paths: their NVIDIA emulation, which
    the offline build matrix leaves to its AMD targets)."""
    return cuda_be.compile_offline(api.kernel_source(cfg.path), api.kernel_defines(d, cfg, mutants, dtype),
                                   arch or _target(cfg), kernel_name=api.KERNEL_NAME)


def test_nvrtc_compiles_every_path_dtype_and_head_dim_for_sm90():
    """Every path (the AMD matrix-core file through its NVIDIA emulation) x fp16 / bf16 x
    d 64 / 128 compiles for sm_90 (the wgmma paths for sm_90a); the NVIDIA paths with no
    spill (the emulation, a check only, spills at d 128 in both dtypes, as before bf16)."""
    _require_nvrtc_sm90a()
    done = set()
    for d in HEAD_DIMS:
        for cfg in _one_per_path(d):
            for dt in ("fp16", "bf16"):
                res = _compile(cfg, d, dt)
                assert res.spills == 0 or cfg.path in ("wmma", "mfma"), (cfg.name, d, dt, res.spills)
                done.add((cfg.path, d, dt))
    paths = {"scalar", "mma", "wgmma", "wmma", "mfma"}
    assert {(p, d, dt) for p in paths for d in HEAD_DIMS for dt in ("fp16", "bf16")} <= done
    assert {("wgspan", 64, dt) for dt in ("fp16", "bf16")} <= done


def test_nvrtc_compiles_each_new_mutant_on_every_path():
    _require_nvrtc_sm90a()
    n = 0
    for cfg, d in ((DEFAULT, 128), (MMA_DEFAULT, 64), (WGMMA_BY_HEAD_DIM[64], 64),
                   (WGMMA_BY_HEAD_DIM[128], 128), (WGSPAN_CANDIDATES[0], 64),
                   (WMMA_CANDIDATES[0], 64), (MFMA_CANDIDATES[0], 64)):
        for m in NEW_MUTANTS:
            for dt in ("fp16", "bf16"):
                _compile(cfg, d, dt, {m})  # a CompileError fails the test with its log
                n += 1
    assert n == 7 * len(NEW_MUTANTS) * 2


def test_nvrtc_bf16_uses_the_bf16_instructions():
    """In a bf16 build the tensor-core products take bf16 operands and P and the output are
    converted with cvt.rn.bf16x2; the fp16 build keeps its f16 forms; the sink stays fp16."""
    _require_nvrtc_sm90a()
    for cfg, arch in ((MMA_DEFAULT, "compute_90"), (WGMMA_BY_HEAD_DIM[64], "compute_90a")):
        for dt, op, cvt in (("fp16", ".f16.f16", "cvt.rn.f16x2.f32"),
                            ("bf16", ".bf16.bf16", "cvt.rn.bf16x2.f32")):
            ptx = _compile(cfg, 64, dt, arch=arch).binary.decode(errors="ignore")
            mma = "wgmma.mma_async" if cfg.path == "wgmma" else "mma.sync.aligned.m16n8k16.row.col"
            lines = [ln for ln in ptx.splitlines() if mma in ln]
            assert lines and all(op in ln for ln in lines), (cfg.name, dt)
            assert cvt in ptx and "cvt.f32.f16" in ptx, (cfg.name, dt)
