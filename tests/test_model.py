"""The CPU model of the fused kernel (hipkernel.model) against the fp64 reference, its NaN
canaries, and its mutants.

The model is the executable spec of gqa_flash_prefill.hip, so these tests pin down the
algorithm the GPU kernel must follow: tiles, start-tile clamp, masks, NaN guard, sink
epilogue. Inputs are fp16; the reference sees the same fp16 values in fp64.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest

from hipkernel import api, model
from hipkernel import config as config_module
from hipkernel.config import (CANDIDATES, DEFAULT, HEAD_DIMS, MMA_CANDIDATES, MMA_PACK_CANDIDATES,
                              MMA_WALK_CANDIDATES, MMA_WIDE_CANDIDATES, WGSPAN_CANDIDATES,
                              WGMMA_BY_HEAD_DIM, WGMMA_CANDIDATES, WGMMA_MAX_STAGES, WGMMA_TILES,
                              WGMMA_RESCALE_LOG2, WGMMA_SMEM_BUDGET, KernelConfig, candidates,
                              compiled_variants, default_config, has_mma, has_wgmma)
from refattn import reference
from refattn.mutants import MUTANTS, by_name

KERNEL_SOURCE = Path(model.__file__).parent / "kernels" / "gqa_flash_prefill.hip"
REL_L2_GATE = 2e-3  # fp16 output rounding alone gives ~3e-4


@dataclass(frozen=True)
class Shape:
    """One model call: q (B, Sq, Hq, d), k/v (B, Hkv, S_cap, d) with NaN past skv."""

    name: str
    B: int = 1
    Sq: int = 48
    Hq: int = 4
    Hkv: int = 2
    d: int = 64
    past: int = 0
    window: int = -1
    sink: str = "none"  # "none" | "per_head" | "smooth" | a float: every head's sink logit
    config: KernelConfig = DEFAULT
    pad: int = 40  # cache capacity past skv, filled with NaN
    q_scale: float = 1.0  # > 1 makes the softmax peakier
    seed: int = 0
    # k and v at the keys left of every row's window (j < past - W + 1), as a cache holds
    # evicted rows; None: the random keys
    left_fill: float | None = None
    # a common offset of every logit, in natural-log units (see make); 0: none
    logit_offset: float = 0.0

    @property
    def skv(self) -> int:
        return self.past + self.Sq


def make(s: Shape):
    """fp16 (q, k, v, sink) for ``s``; k and v carry NaN canaries in [skv, S_cap).

    With ``logit_offset``, q and k are rounded to quarters in [-2, 2] and dim 0 carries the
    offset: q = 256 there and k = offset * sqrt(d) / 256 (rounded to an integer), the same
    for every key, so the logits are the random ones plus one common offset. Every product
    is then a multiple of 1/16 and every dot product, below 2^20 in magnitude, exact in fp32:
    the offset costs the clean model no precision."""
    rng = np.random.default_rng(s.seed)
    q = rng.standard_normal((s.B, s.Sq, s.Hq, s.d)) * s.q_scale
    k = rng.standard_normal((s.B, s.Hkv, s.skv + s.pad, s.d))
    v = rng.standard_normal((s.B, s.Hkv, s.skv + s.pad, s.d)).astype(np.float16)
    if s.logit_offset:
        q, k = (np.clip(np.round(x * 4), -8, 8) / 4 for x in (q, k))
        q[..., 0] = 256
        k[..., 0] = np.round(s.logit_offset * np.sqrt(s.d) / 256)
    q, k = q.astype(np.float16), k.astype(np.float16)
    if s.left_fill is not None:
        lowest = s.past - s.window + 1  # the first key any row can see
        assert s.window > 0 and lowest > 0, s
        k[:, :, :lowest] = s.left_fill
        v[:, :, :lowest] = s.left_fill
    k[:, :, s.skv:] = np.nan
    v[:, :, s.skv:] = np.nan
    if s.sink == "per_head":
        sink = (rng.standard_normal(s.Hq) * 2 + 1).astype(np.float16)
    elif isinstance(s.sink, float):
        sink = np.full(s.Hq, s.sink, np.float16)
    else:
        sink = None
    return q, k, v, sink


def kwargs(s: Shape, sink):
    return dict(past_len=s.past, window=s.window, sink=sink, smooth_softmax=s.sink == "smooth")


def run_model(s: Shape, mutants=frozenset()):
    q, k, v, sink = make(s)
    return model.attention(q, k, v, config=s.config, mutants=mutants, **kwargs(s, sink))


def run_reference(s: Shape):
    q, k, v, sink = make(s)
    return reference.attention(q, k[:, :, :s.skv], v[:, :, :s.skv], dtype=np.float64,
                               **kwargs(s, sink))


def rel_l2(actual, expected) -> float:
    a, e = actual.astype(np.float64), expected.astype(np.float64)
    return float(np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-300))


def assert_close(actual, expected, gate=REL_L2_GATE):
    """NaN census first, then relL2, with the worst element decoded to (b, h, row, col)."""
    __tracebackhide__ = True
    assert actual.dtype == np.float16 and actual.shape == expected.shape
    bad = ~np.isfinite(actual)
    if bad.any():
        b, i, h, c = (int(x) for x in np.argwhere(bad)[0])
        pytest.fail(f"{int(bad.sum())} / {bad.size} non-finite outputs; first at "
                    f"(b={b}, h={h}, row={i}, col={c}): {actual[b, i, h, c]}")
    err = rel_l2(actual, expected)
    if err > gate:
        diff = np.abs(actual.astype(np.float64) - expected)
        b, i, h, c = np.unravel_index(int(np.argmax(diff)), diff.shape)
        pytest.fail(f"relL2 {err:.3g} > {gate:g}; max abs error {diff.max():.3g} at "
                    f"(b={b}, h={h}, row={i}, col={c}): actual {actual[b, i, h, c]}, "
                    f"expected {expected[b, i, h, c]:.6g}")


def killed(actual, expected) -> bool:
    """The mutant's output fails the gate the clean model passes."""
    return bool((~np.isfinite(actual)).any()) or rel_l2(actual, expected) > REL_L2_GATE


# ---- accuracy against the reference ----------------------------------------------------

M4B32, M4B64 = KernelConfig(4, 32), KernelConfig(4, 64)
SHAPES = [
    Shape("prefill-nosink"),
    Shape("prefill-sink", sink="per_head"),
    Shape("prefill-smooth", sink="smooth"),
    Shape("prefill-sink-dominates", sink=8.0),
    Shape("prefill-sink-neginf", sink=float("-inf")),
    Shape("past77-sq45-sink", Sq=45, past=77, sink="per_head"),
    Shape("past77-sq45-smooth-peaky", Sq=45, past=77, sink="smooth", q_scale=4.0),
    Shape("w1-past30", Sq=40, past=30, window=1, sink="per_head"),
    Shape("w37-past100", Sq=70, past=100, window=37, sink="per_head"),
    Shape("w100-b32-crosses-tiles", Sq=80, past=300, window=100, config=M4B32, sink="per_head"),
    Shape("w100-b64-crosses-tiles", Sq=80, past=300, window=100, config=M4B64, sink="smooth"),
    Shape("w8-bm64-b32-rows-see-nothing-early", Sq=64, window=8, config=M4B32),
    Shape("w-eq-skv", Sq=40, past=20, window=60, sink="smooth"),
    Shape("w-gt-skv", Sq=40, past=20, window=1000, sink="smooth"),
    Shape("w128-past1000-skips-tiles", Sq=64, past=1000, window=128, sink="per_head"),
    Shape("g1", Sq=33, Hq=3, Hkv=3, past=10, sink="per_head"),
    Shape("g-eq-hq", Sq=33, Hq=4, Hkv=1, past=10, window=16, sink="per_head"),
    Shape("batch2", B=2, Sq=50, past=60, window=24, sink="per_head"),
    Shape("d128-past77-w50-sink", d=128, Sq=45, past=77, window=50, sink="per_head"),
    Shape("d128-prefill-smooth", d=128, Sq=40, sink="smooth"),
] + [
    Shape(f"{cfg.name}-d{d}-past77-sq45-w50-sink", d=d, Sq=45, past=77, window=50,
          sink="per_head", config=cfg)
    for cfg in CANDIDATES + MMA_CANDIDATES for d in HEAD_DIMS
]


@pytest.mark.parametrize("s", SHAPES, ids=lambda s: s.name)
def test_model_matches_reference(s):
    assert_close(run_model(s), run_reference(s))


def test_window_at_least_skv_is_full_causal():
    s = Shape("w", Sq=40, past=20, window=60, sink="per_head")
    assert np.array_equal(run_model(s), run_model(replace(s, window=-1)))


# ---- NaN canaries: storage no row may see never reaches the output ---------------------

@pytest.mark.parametrize("cfg", CANDIDATES + MMA_CANDIDATES, ids=lambda c: c.name)
def test_unseen_storage_cannot_change_output(cfg):
    """Cache padding past skv and keys below every row's window hold NaN in one run and
    large finite garbage in the other; the outputs must be bitwise equal."""
    outs = canary_outputs(Shape("canary", Sq=70, past=100, window=20, sink="per_head", config=cfg))
    assert not np.isnan(outs[0]).any()
    assert np.array_equal(outs[0], outs[1])


def canary_outputs(s: Shape) -> list:
    """The model's output for ``s`` with the keys below every row's window and the cache
    padding past skv set to NaN, then to large finite garbage."""
    q, k, v, sink = make(s)
    lowest = s.past - s.window + 1  # the first key any row can see
    assert lowest > 0
    outs = []
    for fill in (np.nan, 3e4):
        kk, vv = k.copy(), v.copy()
        for x in (kk, vv):
            x[:, :, :lowest] = fill
            x[:, :, s.skv:] = fill
        outs.append(model.attention(q, kk, vv, config=s.config, **kwargs(s, sink)))
    return outs


# ---- mutants -----------------------------------------------------------------------------

# One purpose-built shape per mutant, on which the clean model passes and the mutant fails.
KILLERS = {
    # rows 40..63 of a 64-row Q tile see nothing in KV tile 0 while m = -inf
    "no_nan_guard": Shape("k", Sq=64, window=8, config=M4B32),
    "clamp_plus_one_tile": Shape("k", Sq=40, config=M4B32),
    # Q tile rows 100..163, W = 40: the first row needs tile 1, the last row's start is tile 3
    "clamp_from_last_row": Shape("k", Sq=64, past=100, window=40, config=M4B32),
    "window_mask_off_by_one": Shape("k", Sq=40, past=30, window=4),
    "sink_ignored": Shape("k", Sq=16, sink="per_head"),
    "sink_no_log2e": Shape("k", Sq=16, sink="per_head"),
    # 4 KV tiles walked: the sink term counted 4 times
    "sink_per_tile": Shape("k", Sq=32, past=96, sink=3.0, config=M4B32),
    "smooth_ignored": Shape("k", Sq=16, sink="smooth", q_scale=0.25),
    "past_len_ignored": Shape("k", Sq=32, past=50),
    "gqa_modulo": Shape("k", Sq=32, Hq=4, Hkv=2),
    # skv = 40: the last KV tile [32, 64) reads the NaN canaries at [40, 64)
    "tail_unmasked": Shape("k", Sq=40, pad=24, config=M4B32),
    "sink_unshifted": Shape("k", Sq=16, sink="per_head"),
    # G = 12: heads 12..15 of the 16-head tile [0, 16) read KV head 0 instead of 1
    "head_tile_crosses_group": Shape("k", Sq=32, Hq=24, Hkv=2),
    # keys [0, 81) hold NaN, evicted rows left of every row's window: the walk from key 0
    # multiplies p = 0 by them
    "window_skip_off": Shape("k", Sq=40, past=100, window=20, left_fill=float("nan")),
    # every logit 5e4 below the random ones (-7.2e4 in exp2 units): far below the floor
    "max_floor": Shape("k", Sq=32, logit_offset=-5e4),
}
SINK_MAX_SKIPPED_WHY = (
    "equivalent at fp16 output: m_fin = m differs from max(m, sig2) only by a common factor "
    "of acc and l unless exp2(sig2 - m) overflows fp32 (sig2 - m >= 128); then the correct "
    "output is at most max|v| * n_keys * 2^(m - sig2) <= 2^16 * n_keys * 2^-128, far below "
    "fp16's smallest subnormal 2^-24, so both round to 0"
)


def test_every_mutant_has_a_killer():
    from tests.test_ragged_bf16 import CASE_KILLERS  # the ragged and bf16 ones, as cases

    equivalent = {m.name for m in MUTANTS if m.equivalent}
    assert equivalent == {"sink_max_skipped"}
    assert set(KILLERS) | set(CASE_KILLERS) | equivalent == {m.name for m in MUTANTS}


@pytest.mark.parametrize("name", [m.name for m in MUTANTS if m.name in KILLERS])
def test_mutant_is_killed(name):
    s = KILLERS[name]
    expected = run_reference(s)
    assert_close(run_model(s), expected)
    assert killed(run_model(s, mutants={name}), expected), f"{name} survives {s}"


@pytest.mark.xfail(strict=True, reason=SINK_MAX_SKIPPED_WHY)
def test_sink_max_skipped_is_killed():
    """Try to make the overflow visible: huge sinks, and (smooth softmax, sigma = 0) very
    negative logits. The mutant must differ from the clean model by more than 1 fp16 ulp."""
    shapes = [Shape("k", Sq=16, sink=x) for x in (60.0, 88.0, 100.0, 1000.0, 60000.0)]
    shapes.append(Shape("k", Sq=16, sink="smooth"))
    for s in shapes:
        q, k, v, sink = make(s)
        scales = [None] if s.sink != "smooth" else [100.0, 1000.0]
        for scale in scales:
            kw = dict(kwargs(s, sink), scale=scale)
            clean = model.attention(q, k, v, config=s.config, **kw)
            mut = model.attention(q, k, v, config=s.config, mutants={"sink_max_skipped"}, **kw)
            if np.isnan(mut).any():
                return
            ulp = np.spacing(np.abs(clean.astype(np.float32)).astype(np.float16)).astype(np.float32)
            if (np.abs(mut.astype(np.float32) - clean.astype(np.float32)) > ulp).any():
                return
    pytest.fail("sink_max_skipped survives every shape tried")


def test_mutant_macros_are_wired_into_the_kernel():
    """Each mutant's macro is tested in the HIP source, and nothing else is."""
    src = KERNEL_SOURCE.read_text()
    used = set(re.findall(r"\b(HIPKERNEL_MUTANT_[A-Z0-9_]+)\b", src))
    assert used == {m.macro for m in MUTANTS}


def test_mutant_catalogue():
    assert [m.name for m in MUTANTS][:3] == ["no_nan_guard", "clamp_plus_one_tile", "clamp_from_last_row"]
    assert by_name("gqa_modulo").macro == "HIPKERNEL_MUTANT_GQA_MODULO"
    assert all(m.breaks and "\n" not in m.breaks for m in MUTANTS)
    with pytest.raises(ValueError, match="^mutant"):
        by_name("no_such_bug")


# ---- argument errors ---------------------------------------------------------------------

def _call(**over):
    s = Shape("args", Sq=16, sink="per_head")
    q, k, v, sink = make(s)
    args = dict(q=q, k=k, v=v, sink=sink, past_len=0)
    args.update(over)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    return model.attention(q, k, v, **args)


@pytest.mark.parametrize("arg", ["q", "k", "v", "sink"])
def test_non_fp16_input_is_rejected(arg):
    s = Shape("args", Sq=16, sink="per_head")
    q, k, v, sink = make(s)
    bad = dict(q=q, k=k, v=v, sink=sink)[arg].astype(np.float32)
    with pytest.raises(ValueError, match=f"^{arg}"):
        _call(**{arg: bad})


@pytest.mark.parametrize("mutants, pattern", [
    ({"no_such_bug"}, "no_such_bug"),
    ("no_nan_guard", "set of mutant names"),
])
def test_bad_mutants_are_rejected(mutants, pattern):
    with pytest.raises(ValueError, match=f"^mutants.*{pattern}"):
        _call(mutants=mutants)


def test_what_the_kernel_declines_is_rejected():
    with pytest.raises(ValueError, match="^softcap"):
        _call(softcap=30.0)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 8, 2, 32)).astype(np.float16)
    k = rng.standard_normal((1, 1, 8, 32)).astype(np.float16)
    with pytest.raises(ValueError, match="^q: head dim 32"):
        model.attention(q, k, k, past_len=0)
    with pytest.raises(ValueError, match="^config"):
        _call(config=(4, 64))


def test_shared_argument_checks_apply():
    with pytest.raises(ValueError, match="^window"):
        _call(window=0)
    with pytest.raises(ValueError, match="^past_len"):
        _call(past_len=1000)  # the cache holds fewer keys


# ---- configs -----------------------------------------------------------------------------

def test_config_geometry():
    c = KernelConfig(4, 64)
    assert (c.block_rows, c.threads, c.name) == (64, 128, "m4_b64")
    assert c.grid(Sq=65, Hq=64, B=2) == (2, 64, 2)
    assert c.defines(128) == {"HEAD_DIM": 128, "M_TILES": 4, "BKV": 64}
    assert all(cfg.smem_bytes(d) <= 48 * 1024 for cfg in CANDIDATES for d in HEAD_DIMS)


def test_mma_config_geometry_and_candidates():
    c = KernelConfig(4, 64, "mma")
    assert (c.block_rows, c.threads, c.name) == (64, 128, "mma_m4_b64")
    assert c.defines(64) == {"HEAD_DIM": 64, "M_TILES": 4, "BKV": 64}  # the file differs, not -D
    # two padded K/V stages where they fit in 48 KiB, one otherwise (as the .hip decides)
    assert (c.kv_stages(64), c.smem_bytes(64)) == (2, 2 * 2 * 64 * 72 * 2)
    assert (c.kv_stages(128), c.smem_bytes(128)) == (1, 2 * 64 * 136 * 2)
    assert all(cfg.smem_bytes(d) <= 48 * 1024 for cfg in MMA_CANDIDATES for d in HEAD_DIMS)
    with pytest.raises(ValueError, match="^bkv"):
        KernelConfig(4, 128, "mma").defines(128)
    assert candidates("gfx1151") == CANDIDATES == candidates("sm_75") == candidates("gfx942", 64)
    # packed heads where G allows them (G = None: every config); 1 and 2 allow none; walking
    # Q tiles (the packed tiles, walking 4) at d = 64 only, where the ring exists
    P, W = MMA_PACK_CANDIDATES, MMA_WALK_CANDIDATES
    assert candidates("sm_80", 128, 2) == CANDIDATES + MMA_CANDIDATES
    assert candidates("sm_80", 128, 4) == CANDIDATES + MMA_CANDIDATES + P[:1]
    assert candidates("sm_80", 64, 4) == CANDIDATES + MMA_CANDIDATES + MMA_WIDE_CANDIDATES + P[:1] + W[:1]
    assert candidates("sm_80", 64) == CANDIDATES + MMA_CANDIDATES + MMA_WIDE_CANDIDATES + P + W
    # sm_90 adds the wgmma tiles of the head dim (after the mma ones)
    assert candidates("sm_90", 128, 1) == CANDIDATES + MMA_CANDIDATES + (WGMMA_BY_HEAD_DIM[128],)
    assert WGMMA_TILES[128] == (WGMMA_BY_HEAD_DIM[128],)
    # ... and, at d = 64 for a window that spans one of its chunks (window None: any), the
    # wgspan tile
    assert candidates("sm_90", 64, 8, -1) == (CANDIDATES + MMA_CANDIDATES + MMA_WIDE_CANDIDATES
                                              + P + W + WGMMA_TILES[64])
    for window in (None, 1, 128, 129):
        assert candidates("sm_90", 64, 8, window) == candidates("sm_90", 64, 8, -1) + WGSPAN_CANDIDATES
    assert candidates("sm_90", 64, 8, 130) == candidates("sm_90", 64, 8, -1)  # 137 keys
    assert candidates("sm_90", 64, 4, 128) == candidates("sm_90", 64, 4, -1)  # pack 8 needs G % 8
    assert candidates("sm_90", 128, 8, 128) == candidates("sm_90", 128, 8, -1)
    assert not [c for c in candidates("sm_80", 64, 8, 128) if c.path == "wgspan"]
    # d=None: every runnable config, so every wgmma tile and the wgspan tile
    assert candidates("sm_90") == (CANDIDATES + MMA_CANDIDATES + MMA_WIDE_CANDIDATES + P + W
                                   + WGMMA_CANDIDATES + WGSPAN_CANDIDATES)
    assert candidates("sm_80") == candidates("sm_80", 64)
    assert default_config("sm_90").path == "mma" and default_config("gfx90a") == DEFAULT


def test_amd_matrix_core_config_geometry_and_candidates(monkeypatch):
    """wmma: a wave32 per 16 rows; mfma: a wave64 per 16 rows; WAVE passed to the compiler; one
    K tile and one transposed V tile of shared memory. The tuner offers them on their AMD
    targets only when $HIPKERNEL_AMD_MMA is 1, and never on NVIDIA (where they are emulated)."""
    from hipkernel.config import (AMD_MMA_ENV, MFMA_CANDIDATES, WMMA_CANDIDATES, amd_mma_enabled,
                                  compiled_variants, runs_path)

    w, f = KernelConfig(4, 64, "wmma"), KernelConfig(4, 32, "mfma")
    assert (w.block_rows, w.threads, w.name, w.kv_stages(64)) == (64, 128, "wmma_m4_b64", 1)
    assert (f.block_rows, f.threads, f.name) == (64, 256, "mfma_m4_b32")
    assert w.defines(128) == {"HEAD_DIM": 128, "M_TILES": 4, "BKV": 64, "WAVE": 32}
    assert f.defines(64)["WAVE"] == 64
    assert w.smem_bytes(64) == 2 * (64 * 72 + 64 * 72) and f.smem_bytes(128) == 2 * (32 * 136 + 128 * 40)
    assert all(c.fits(d) for c in WMMA_CANDIDATES + MFMA_CANDIDATES for d in HEAD_DIMS)
    for bad, match in ((dict(m_tiles=8, bkv=64, path="mfma"), "^m_tiles"),  # 4 waves at most
                       (dict(m_tiles=4, bkv=128, path="wmma"), "^bkv"),
                       (dict(m_tiles=4, bkv=64, path="wmma", pack=4), "^pack")):
        with pytest.raises(ValueError, match=match):
            KernelConfig(**bad)
    assert runs_path("wmma", "gfx1151") and runs_path("wmma", "gfx1100") and not runs_path("wmma", "gfx942")
    assert runs_path("mfma", "gfx942") and runs_path("mfma", "gfx90a") and not runs_path("mfma", "gfx1030")
    assert runs_path("wmma", "sm_90") and runs_path("mfma", "sm_80")  # emulated, for checking
    monkeypatch.delenv(AMD_MMA_ENV, raising=False)
    assert candidates("gfx1151") == CANDIDATES == candidates("gfx942", 64)
    monkeypatch.setenv(AMD_MMA_ENV, "1")
    assert candidates("gfx1151", 64) == CANDIDATES + WMMA_CANDIDATES
    assert candidates("gfx942:sramecc+:xnack-", 128) == CANDIDATES + MFMA_CANDIDATES
    assert candidates("gfx1030") == CANDIDATES  # no matrix cores this kernel uses
    assert not {c.path for c in candidates("sm_90")} & {"wmma", "mfma"}
    monkeypatch.setenv(AMD_MMA_ENV, "yes")
    from refattn.args import EnvVarError

    with pytest.raises(EnvVarError, match=f"^{AMD_MMA_ENV}: expected 0 or 1, got 'yes'"):
        candidates("gfx1151")
    assert amd_mma_enabled({AMD_MMA_ENV: "0"}) is False and amd_mma_enabled({}) is False
    built = {cfg.name for _, cfg in compiled_variants()}
    assert {c.name for c in WMMA_CANDIDATES + MFMA_CANDIDATES} <= built  # the build check compiles them


def test_wide_mma_config():
    """32 rows a warp: half the threads for the same tile, WARP_M passed to the compiler,
    mma only, and m_tiles a multiple of it."""
    c = KernelConfig(8, 64, "mma", 2)
    assert (c.block_rows, c.threads, c.name) == (128, 128, "mma_m8_b64_w2")
    assert c.defines(64) == {"HEAD_DIM": 64, "M_TILES": 8, "BKV": 64, "WARP_M": 2}
    assert c.grid(Sq=129, Hq=64, B=1) == (2, 64, 1)
    assert all(w.smem_bytes(64) <= 48 * 1024 for w in MMA_WIDE_CANDIDATES)
    for bad in (dict(m_tiles=4, bkv=64, path="scalar", warp_m=2),
                dict(m_tiles=1, bkv=64, path="mma", warp_m=2),
                dict(m_tiles=4, bkv=64, path="mma", warp_m=4)):
        with pytest.raises(ValueError, match="^warp_m"):
            KernelConfig(**bad)


def test_packed_mma_config():
    """pack heads a block: the same rows and threads, BM / pack positions a block, PACK passed
    to the compiler, a grid of Hq / pack head blocks; mma only; for_group cuts pack to what a
    geometry's G allows."""
    c = KernelConfig(4, 32, "mma", pack=8)
    assert (c.block_rows, c.block_positions, c.threads, c.name) == (64, 8, 128, "mma_m4_b32_p8")
    assert c.defines(64) == {"HEAD_DIM": 64, "M_TILES": 4, "BKV": 32, "PACK": 8}
    assert c.grid(Sq=17, Hq=64, B=2) == (3, 8, 2)
    assert KernelConfig(8, 64, "mma", 2, pack=4).name == "mma_m8_b64_w2_p4"
    assert [c.supports(G) for G in (1, 2, 4, 8, 16)] == [False, False, False, True, True]
    assert [c.for_group(G).pack for G in (1, 2, 4, 6, 8, 16)] == [1, 2, 4, 2, 8, 8]
    assert c.for_group(8) is c and c.for_group(4).name == "mma_m4_b32_p4"
    with pytest.raises(ValueError, match="^Hq: 12 query heads do not split into blocks of pack=8"):
        c.grid(Sq=16, Hq=12, B=1)
    for bad, field in ((dict(pack=3, path="mma"), "pack"), (dict(pack=16, path="mma"), "pack"),
                       (dict(pack=2), "pack"), (dict(pack=2, path="wgmma"), "pack")):
        with pytest.raises(ValueError, match=f"^{field}"):
            KernelConfig(4, 64, **bad)


def test_walking_mma_config():
    """walk Q tiles a block: the same Q tiles, rows and threads; QWALK passed to the compiler;
    a grid of ceil(Q tiles / walk) blocks along x (none empty); at d = 64 (64-row tiles of
    32 keys) a ring of 5 K + V tiles, 46080 bytes of the 48 KiB; at d = 128 two fill it, so
    it has the unwalked tile's 2 stages; mma only."""
    c = KernelConfig(4, 32, "mma", pack=4, walk=4)
    assert (c.block_rows, c.block_positions, c.threads, c.name) == (64, 16, 128, "mma_m4_b32_p4_q4")
    assert c.defines(64) == {"HEAD_DIM": 64, "M_TILES": 4, "BKV": 32, "PACK": 4, "QWALK": 4}
    for Sq in (1, 16, 17, 64, 65, 500, 16384):
        q_tiles = -(-Sq // 16)
        gx = c.grid(Sq=Sq, Hq=64, B=2)[0]
        assert gx * 4 >= q_tiles > (gx - 1) * 4, Sq  # every Q tile, and no block without one
    assert c.grid(Sq=500, Hq=64, B=2) == (8, 16, 2)
    assert (c.kv_slots(64), c.smem_bytes(64)) == (5, 5 * 2 * 32 * 72 * 2)
    assert (c.kv_slots(128), c.smem_bytes(128)) == (2, 2 * 2 * 32 * 136 * 2)
    assert replace(c, walk=1).smem_bytes(64) == 2 * 2 * 32 * 72 * 2
    assert c.for_group(2).name == "mma_m4_b32_p2_q4"
    assert all(w.walk == 4 and w.fits(64) for w in MMA_WALK_CANDIDATES)
    for bad in (dict(walk=3, path="mma"), dict(walk=16, path="mma"), dict(walk=2),
                dict(walk=2, path="wgmma")):
        with pytest.raises(ValueError, match="^walk"):
            KernelConfig(4, 64, **bad)


def _kv_spans(cfg: KernelConfig, Sq: int, window: int, past_len: int) -> list[int]:
    """Each Q tile's KV tiles as the kernel computes them: from the tile of its first row's
    first key max(0, p - W + 1) to the tile of its last row p_last (window >= 1)."""
    bp, bkv = cfg.block_positions, cfg.bkv
    spans = []
    for i0 in range(0, Sq, bp):
        p_first, p_last = past_len + i0, past_len + min(i0 + bp, Sq) - 1
        spans.append(-(-(p_last + 1) // bkv) - max(0, p_first - window + 1) // bkv)
    return spans


def test_ring_serves_exactly_the_launches_whose_spans_fit():
    """KernelConfig.ring_serves mirrors the kernel's test (one bound from the Q tiles' first
    positions mod BKV). It must be sound: where it says the ring serves, every Q tile's KV
    tiles fit in the ring (else the kernel would overwrite a tile still in use). And where it
    says no, some long enough launch at that alignment does not fit."""
    rng = np.random.default_rng(7)
    for cfg in (*MMA_WALK_CANDIDATES, KernelConfig(4, 32, "mma", pack=2, walk=2),
                KernelConfig(2, 32, "mma", walk=8), KernelConfig(4, 16, "mma", pack=8, walk=4)):
        slots = cfg.kv_slots(64)
        for _ in range(300):
            window, past = int(rng.integers(1, 200)), int(rng.integers(0, 3000))
            Sq = int(rng.integers(1, 400))
            spans = _kv_spans(cfg, Sq, window, past)
            # the same alignment (past mod BKV), far enough from 0 that no key is clamped
            far = past + cfg.bkv * -(-window // cfg.bkv)
            long = _kv_spans(cfg, 64 * cfg.block_positions, window, far)
            if cfg.ring_serves(64, window, past):
                assert max(spans) <= slots, (cfg.name, window, past, Sq)
            else:
                assert max(long) > slots, (cfg.name, window, past)
    # the bench's window-128 shapes (past multiples of 32) are served at 16 and 8 positions
    for c in MMA_WALK_CANDIDATES:
        assert all(c.ring_serves(64, 128, past) for past in (0, 512, 8192, 15872))
        assert not c.ring_serves(64, -1, 8192)  # full attention: no ring
        assert not c.ring_serves(128, 128, 8192)  # d = 128: no ring
        assert not replace(c, walk=1).ring_serves(64, 128, 8192)
    p4, p8 = MMA_WALK_CANDIDATES  # past 8209: the first key at offset 18 of its tile
    assert not p4.ring_serves(64, 128, 8209) and not p8.ring_serves(64, 128, 8209)


@pytest.mark.parametrize("s", [s for s in SHAPES if s.Hq % s.Hkv == 0 and s.Hq // s.Hkv > 1],
                         ids=lambda s: s.name)
def test_packed_model_matches_reference(s):
    """A packed block walks the KV tiles of its BM / pack positions: every shape with G > 1
    on the mma path at the most packing its G allows still matches the reference."""
    base = s.config if s.config.path == "mma" else KernelConfig(s.config.m_tiles, 32, "mma")
    cfg = replace(base, pack=8).for_group(s.Hq // s.Hkv)
    assert cfg.pack > 1
    assert_close(run_model(replace(s, config=cfg)), run_reference(s))


@pytest.mark.parametrize("name", [m.name for m in MUTANTS if m.name in KILLERS])
# no_nan_guard's exp2(-inf - -inf) is the bug itself (np.errstate would not reach the model's
# worker threads)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_mutant_is_killed_with_packed_heads(name):
    """Every killer shape, on the mma path with packed heads (the most its G allows, up to
    8), still kills its mutant: packing moves the block's start tile and its heads' KV head,
    which the clamp and GQA mutants act on."""
    s = KILLERS[name]
    cfg = KernelConfig(s.config.m_tiles, s.config.bkv, "mma", pack=8).for_group(s.Hq // s.Hkv)
    s = replace(s, config=cfg)
    expected = run_reference(s)
    assert_close(run_model(s), expected)
    assert killed(run_model(s, mutants={name}), expected), f"{name} survives {s}"


def test_mma_model_rounds_p_to_fp16():
    """path "mma" changes only the rounding of P before P.V: close to scalar, not equal."""
    s = Shape("mma", Sq=45, past=77, window=50, sink="per_head")
    scalar = run_model(s)
    mma = run_model(replace(s, config=KernelConfig(4, 64, "mma")))
    assert not np.array_equal(scalar, mma)
    assert rel_l2(mma, scalar) < 2e-3


def test_wgmma_config_geometry_and_shared_memory():
    """path "wgmma": a warpgroup (4 warps) per 64 rows, so 32 threads per 16 rows as on the
    mma path, up to four warpgroups (512 threads); K/V tiles unpadded (bkv x d halves each)
    in dynamic shared memory, as many stages as fit in WGMMA_SMEM_BUDGET, at most
    WGMMA_MAX_STAGES; the stage count is a -D of its own."""
    c = KernelConfig(8, 64, "wgmma")
    assert (c.block_rows, c.threads, c.name) == (128, 256, "wgmma_m8_b64")
    assert (KernelConfig(4, 32, "wgmma").threads, KernelConfig(4, 32, "wgmma").name) == (128, "wgmma_m4_b32")
    c16 = KernelConfig(16, 64, "wgmma")
    assert (c16.block_rows, c16.threads, c16.name) == (256, 512, "wgmma_m16_b64")
    assert c.grid(Sq=129, Hq=64, B=2) == (2, 64, 2) and c16.grid(Sq=257, Hq=64, B=1) == (2, 64, 1)
    assert (WGMMA_SMEM_BUDGET, WGMMA_MAX_STAGES) == (96 * 1024, 6)
    # 64-key tiles at d = 64: 16 KiB a stage, 6 stages = the whole 96 KiB budget
    assert c16.defines(64) == {"HEAD_DIM": 64, "M_TILES": 16, "BKV": 64, "KV_STAGES": 6,
                             "RESCALE_LOG2": 8, "ROWSUM_MMA": 1}
    # ... then at d = 64 the row sums' 2 KiB of ones, and two mbarriers a stage (16 bytes),
    # reserved on every wgmma tile
    assert (c16.kv_stages(64), c16.smem_bytes(64), c16.dynamic_smem_bytes(64)) == (6, 98304, 98304 + 2048 + 96)
    # 64-key tiles at d = 128: 32 KiB a stage, 3 stages
    assert (c.kv_stages(128), c.smem_bytes(128)) == (3, 3 * 2 * 64 * 128 * 2) == (3, 98304)
    assert c.dynamic_smem_bytes(128) == 98304 + 3 * 16
    # capped at 6 stages: 32-key tiles at d = 64 are 8 KiB a stage, 12 would fit
    c32 = KernelConfig(8, 32, "wgmma")
    assert (c32.kv_stages(64), c32.dynamic_smem_bytes(64)) == (6, 6 * 2 * 32 * 64 * 2 + 2048 + 6 * 16)
    # one 128-key stage is 32 KiB at d = 64 (3 stages) and 64 KiB at d = 128 (one)
    big = KernelConfig(8, 128, "wgmma")
    assert (big.kv_stages(64), big.smem_bytes(64), big.fits(64)) == (3, 98304, True)
    assert (big.kv_stages(128), big.smem_bytes(128), big.fits(128)) == (1, 65536, True)
    # four warpgroups run the mbarrier pipeline, which needs 2 stages: not 128 keys at d 128
    assert not KernelConfig(16, 128, "wgmma").fits(128) and KernelConfig(16, 128, "wgmma").fits(64)
    with pytest.raises(ValueError, match="^bkv: 128 keys at d=128 need 131072 bytes of dynamic"):
        KernelConfig(16, 128, "wgmma").defines(128)
    assert all(w.fits(d) for d, tiles in WGMMA_TILES.items() for w in tiles)
    assert WGMMA_CANDIDATES == (KernelConfig(16, 64, "wgmma"), KernelConfig(12, 128, "wgmma", ws=True),
                                KernelConfig(8, 128, "wgmma", ws=True))
    assert {d: w.name for d, w in WGMMA_BY_HEAD_DIM.items()} == {64: "wgmma_m16_b64",
                                                                 128: "wgmma_m8_b128_ws"}
    # three consumer warpgroups read Q from shared memory, after the barriers (1024-byte
    # aligned); its tiles come out of the stages' budget: 5 stages of 32 KiB at d = 64
    m12 = KernelConfig(12, 128, "wgmma", ws=True)
    assert m12.qsmem and m12.threads == 512 and m12.defines(64)["QSMEM"] == 1
    assert not any(c.qsmem for c in (c32, big, *WGMMA_BY_HEAD_DIM.values()))
    used = 5 * (32768 + 16) + 2048 + 16
    assert (m12.kv_stages(64), m12.dynamic_smem_bytes(64)) == (5, -(-used // 1024) * 1024 + 3 * 64 * 64 * 2)
    assert m12.dynamic_smem_bytes(64) <= 227 * 1024
    with pytest.raises(ValueError, match="^m_tiles: 12"):
        KernelConfig(12, 128, "wgmma")
    # the other paths: static shared memory, none passed at launch
    for other in (KernelConfig(4, 64), KernelConfig(4, 64, "mma"), KernelConfig(8, 64, "mma", 2)):
        assert other.dynamic_smem_bytes(64) == 0 and "KV_STAGES" not in other.defines(64)


def test_wgmma_shared_memory_over_the_budget_is_refused(monkeypatch):
    """A wgmma tile whose single K/V stage is over WGMMA_SMEM_BUDGET does not fit; defines()
    says so, naming bkv and the dynamic shared memory it would need."""
    from hipkernel import config as C
    monkeypatch.setattr(C, "WGMMA_SMEM_BUDGET", 48 * 1024)  # 128 keys x d 128 = 64 KiB a stage
    big = KernelConfig(8, 128, "wgmma")
    assert not big.fits(128) and big.fits(64)
    with pytest.raises(ValueError, match=r"^bkv: 128 keys at d=128 need 65536 bytes of "
                                         r"dynamic shared memory, over the 49152 byte limit"):
        big.defines(128)


def test_ws_config_geometry_and_shared_memory():
    """ws (a producer warpgroup): 128 more threads, the same rows a block, stages in its own
    192 KiB budget (6 of 32 KiB at d = 128 with 64-key tiles), on mbarriers (2 at least),
    -DWS=1, and a name that says so. The arithmetic is the config without it: same model."""
    c = KernelConfig(8, 64, "wgmma", ws=True)
    plain = KernelConfig(8, 64, "wgmma")
    assert (c.name, c.threads, c.block_rows) == ("wgmma_m8_b64_ws", 384, 128)
    assert c.grid(1000, 64, 2) == plain.grid(1000, 64, 2) == (8, 64, 2)
    assert (c.kv_stages(128), c.smem_bytes(128)) == (6, 6 * 2 * 64 * 128 * 2) == (6, 192 * 1024)
    assert c.dynamic_smem_bytes(128) == 192 * 1024 + 6 * 16 + 16  # + the TMA first-tile barrier, the sink word
    assert c.defines(128) == {"HEAD_DIM": 128, "M_TILES": 8, "BKV": 64, "KV_STAGES": 6, "WS": 1,
                              "RESCALE_LOG2": 8, "RESCALE_ROWS": 8}
    assert "WS" not in plain.defines(128) and plain.kv_stages(128) == 3
    # 128-key tiles at d = 128 (the tuner's ws tile) are 64 KiB a stage: three fit in 192 KiB
    # (plain: one in 96)
    big = KernelConfig(8, 128, "wgmma", ws=True)
    assert (big.kv_stages(128), big.fits(128), big.name) == (3, True, "wgmma_m8_b128_ws")
    assert big.dynamic_smem_bytes(128) == 3 * 64 * 1024 + 3 * 16 + 16 == 196672
    assert api.kernel_defines(128, c) == {**c.defines(128)}  # no mutants: the config's macros
    # the producer copies with TMA (and its kernel takes the tensor maps); no other tile does
    assert [cfg.tma for cfg in (c, plain, big, KernelConfig(16, 64, "wgmma"), KernelConfig(4, 64, "mma"),
                                KernelConfig(4, 136, "wgspan", pack=8, walk=4))] == [
        True, False, True, False, False, False]


@pytest.mark.parametrize("kw", [
    dict(m_tiles=8, bkv=64, path="mma", ws=True),     # the mma path has no producer
    dict(m_tiles=4, bkv=64, ws=True),                 # the scalar path neither
    dict(m_tiles=16, bkv=64, path="wgmma", ws=True),  # 640 threads: 112 registers a consumer
    dict(m_tiles=4, bkv=64, path="wgmma", ws=True),   # not measured: not offered
    dict(m_tiles=8, bkv=64, path="wgmma", ws=1),      # a bool, not a truthy int
])
def test_ws_config_validation(kw):
    with pytest.raises(ValueError, match="^ws: "):
        KernelConfig(**kw)


def test_m_tiles_16_is_for_wgmma_only():
    """Four warpgroups a block (512 threads) exist on the wgmma path only; the other paths
    keep their m_tiles set (and its message)."""
    assert KernelConfig(16, 64, "wgmma").threads == 512
    for path in ("scalar", "mma"):
        with pytest.raises(ValueError, match=r"^m_tiles: expected one of \(1, 2, 4, 8\), got 16"):
            KernelConfig(16, 64, path)


@pytest.mark.parametrize("kw, field", [
    (dict(m_tiles=1, bkv=64), "m_tiles"),   # 16 rows: not a warpgroup's 64
    (dict(m_tiles=2, bkv=64), "m_tiles"),
    (dict(m_tiles=8, bkv=16), "bkv"),       # not an n the Q.K wgmma takes here
    (dict(m_tiles=8, bkv=64, warp_m=2), "warp_m"),  # 32 rows a warp: the mma path only
])
def test_wgmma_config_validation(kw, field):
    with pytest.raises(ValueError, match=f"^{field}") as e:
        KernelConfig(path="wgmma", **kw)
    assert "'wgmma'" in str(e.value), f"the message does not name the path: {e.value}"


@pytest.mark.parametrize("arch, mma, wgmma", [
    ("sm_90", True, True), ("sm_90a", True, True),
    ("sm_80", True, False), ("sm_89", True, False), ("sm_100", True, False),
    ("sm_120", True, False), ("sm_75", False, False),
    ("gfx942", False, False), ("gfx90a", False, False), ("gfx1151", False, False),
    ("sm_test", False, False),
])
def test_has_wgmma_truth_table(arch, mma, wgmma):
    """wgmma is sm_90a code: compute capability 9.0 only (not 10.x, whose sm_100a has no
    wgmma)."""
    assert (has_mma(arch), has_wgmma(arch)) == (mma, wgmma), arch


def test_wgmma_candidates_only_on_sm90():
    """On sm_90 each head dim's sweep ends with its wgmma tiles (at d = 64 under a window
    then the wgspan tile); sm_80 and AMD get none."""
    assert candidates("sm_90", 64, window=-1)[-1].name == "wgmma_m12_b128_ws"
    assert [c.name for c in candidates("sm_90", 64)[-3:]] == ["wgmma_m16_b64", "wgmma_m12_b128_ws",
                                                              "wgspan_m4_b136_p8_q4"]
    assert candidates("sm_90", 128)[-1].name == "wgmma_m8_b128_ws"
    assert [c.name for c in candidates("sm_90a", 64) if c.path == "wgmma"] == ["wgmma_m16_b64",
                                                                               "wgmma_m12_b128_ws"]
    assert [c.name for c in candidates("sm_90") if c.path == "wgmma"] == ["wgmma_m16_b64",
                                                                           "wgmma_m12_b128_ws",
                                                                           "wgmma_m8_b128_ws"]
    for arch in ("sm_80", "sm_89", "sm_100", "gfx942", "gfx1151"):
        for d in (None, *HEAD_DIMS):
            assert not [c.name for c in candidates(arch, d) if c.path == "wgmma"], (arch, d)
    assert all(c.fits(d) for d in HEAD_DIMS for c in candidates("sm_90", d))
    assert default_config("sm_90").path == "mma"  # no sweep: the mma default, not wgmma


def test_compiled_variants_hold_both_wgmma_tiles():
    """What the offline build check compiles: sm_90a's candidates per head dim, so each wgmma
    tile at its own head dim, then the AMD matrix-core configs (for their AMD targets), and
    nothing that overflows shared memory."""
    from hipkernel.config import MFMA_CANDIDATES, WMMA_CANDIDATES

    variants = compiled_variants()
    assert [(d, c.name) for d, c in variants if c.path == "wgmma"] == [
        (64, "wgmma_m16_b64"), (64, "wgmma_m12_b128_ws"), (128, "wgmma_m8_b128_ws")]
    assert variants == [(d, c) for d in HEAD_DIMS
                        for c in candidates("sm_90a", d) + WMMA_CANDIDATES + MFMA_CANDIDATES]
    assert all(c.fits(d) for d, c in variants)
    assert len(set(variants)) == len(variants)


@pytest.mark.parametrize("d, bkv, m_wg", [(64, 64, 8), (128, 32, 8), (64, 64, 16), (128, 64, 8)])
def test_wgmma_model_is_the_mma_model(d, bkv, m_wg, monkeypatch):
    """The model of "wgmma" is the model of "mma" at the same key tiles (P rounded to fp16
    before P.V, the same KV walk) but for lazy rescaling (off here; see the next test):
    bitwise equal output, with a sink, a window and a ragged tail, also with four warpgroups
    a block (256 rows; the extra tiles its start clamp walks are invisible to the rows that
    did not need them). Against the scalar path they differ by that rounding only. (At
    d = 64 also with l summed in fp32, not on the tensor cores: off here too.)"""
    monkeypatch.setattr(config_module, "WGMMA_RESCALE_LOG2", 0)
    monkeypatch.setattr(config_module, "WGMMA_ROWSUM_HEAD_DIMS", ())
    s = Shape("wgmma", B=2, Sq=300, Hq=8, Hkv=2, d=d, past=83, window=70, sink="per_head", seed=3)
    wg = run_model(replace(s, config=KernelConfig(m_wg, bkv, "wgmma")))
    mma = run_model(replace(s, config=KernelConfig(8, bkv, "mma")))
    scalar = run_model(replace(s, config=KernelConfig(8, bkv)))
    assert wg.dtype == np.float16 and wg.shape == (2, 300, 8, d) and np.isfinite(wg).all()
    assert np.array_equal(wg.view(np.uint16), mma.view(np.uint16)), \
        f"wgmma and mma models differ at {int((wg != mma).sum())} elements"
    assert not np.array_equal(wg, scalar)  # the fp16 P rounding is there
    assert rel_l2(wg, scalar) < 2e-3
    assert_close(wg, run_reference(s))


@pytest.mark.parametrize("path, m_tiles, bkv", [("wmma", 4, 64), ("mfma", 2, 32), ("wmma", 1, 16)])
def test_amd_matrix_core_model_is_the_mma_model(path, m_tiles, bkv):
    """The model of the AMD matrix-core paths is the mma path's at the same key tiles (P
    rounded to fp16 before P.V, acc * (1 / l), the row max rounded up): bitwise equal output,
    with a sink, a window and a ragged tail, at both head dims; and it kills a mutant there."""
    for d in HEAD_DIMS:
        s = Shape(path, B=1, Sq=200, Hq=8, Hkv=2, d=d, past=83, window=70, sink="per_head", seed=5)
        amd = run_model(replace(s, config=KernelConfig(m_tiles, bkv, path)))
        mma = run_model(replace(s, config=KernelConfig(m_tiles, bkv, "mma")))
        assert np.isfinite(amd).all() and np.array_equal(amd.view(np.uint16), mma.view(np.uint16))
        expected = run_reference(s)
        assert_close(amd, expected)
        assert killed(run_model(replace(s, config=KernelConfig(m_tiles, bkv, path)),
                                mutants={"window_mask_off_by_one"}), expected)


def test_lazy_rescaling_is_the_wgmma_rule():
    """Lazy rescaling is on for the wgmma path at d = 64 and 128, and reaches the kernel as
    RESCALE_LOG2; elsewhere (the other paths, the wgspan tile) the macro is absent (the
    kernel's default, 0)."""
    for cfg in (KernelConfig(16, 64, "wgmma"), KernelConfig(4, 32, "wgmma"), KernelConfig(8, 64, "wgmma", ws=True)):
        assert cfg.rescale_log2(64) == WGMMA_RESCALE_LOG2 == 8
        assert cfg.defines(64)["RESCALE_LOG2"] == 8
    d128 = KernelConfig(8, 128, "wgmma", ws=True)
    assert d128.rescale_log2(128) == 8 and d128.defines(128)["RESCALE_LOG2"] == 8
    # the producer tiles at d = 128 decide it by each half of a warp's rows, the rest by the warp
    assert d128.rescale_rows(128) == 8 and d128.defines(128)["RESCALE_ROWS"] == 8
    for cfg, d in ((d128, 64), (KernelConfig(16, 64, "wgmma"), 64), (KernelConfig(8, 128, "wgmma"), 128),
                   (KernelConfig(12, 128, "wgmma", ws=True), 64)):
        assert cfg.rescale_rows(d) == 16 and "RESCALE_ROWS" not in cfg.defines(d)
    for cfg in (DEFAULT, KernelConfig(4, 64, "mma"), KernelConfig(8, 64, "mma", 2)):
        assert cfg.rescale_log2(64) == 0 and "RESCALE_LOG2" not in cfg.defines(64)
        assert cfg.rescale_log2(128) == 0 and "RESCALE_LOG2" not in cfg.defines(128)
    span = WGSPAN_CANDIDATES[0]
    assert span.rescale_log2(64) == 0 and "RESCALE_LOG2" not in span.defines(64)


def test_the_owed_pv_is_waited_for_mid_softmax_on_the_three_consumer_tile_only():
    """pv_wait_split: the three-consumer tile waits for its owed P.V after its first score
    block's exp2 and says so with PV_WAIT_SPLIT; every other config after all of them
    (bkv / 8, the kernel's default), with no macro."""
    m12, m8, m16 = (config_module.config_from_name(n)
                    for n in ("wgmma_m12_b128_ws", "wgmma_m8_b128_ws", "wgmma_m16_b64"))
    assert m12.pv_wait_split() == 1 and m12.defines(64)["PV_WAIT_SPLIT"] == 1
    assert m8.pv_wait_split() == 16 and "PV_WAIT_SPLIT" not in m8.defines(128)
    assert m16.pv_wait_split() == 8 and "PV_WAIT_SPLIT" not in m16.defines(64)
    for cfg in CANDIDATES + MMA_CANDIDATES + WGSPAN_CANDIDATES:
        assert "PV_WAIT_SPLIT" not in cfg.defines(64)


def test_rowsum_mma_is_the_wgmma_d64_rule():
    """Row sums on the tensor cores are on for the wgmma path at d = 64 only: they reach the
    kernel as ROWSUM_MMA and add the 2 KiB block of ones to its dynamic shared memory;
    elsewhere the macro is absent (the kernel's default, 0: l sums the fp32 p)."""
    for cfg in (KernelConfig(16, 64, "wgmma"), KernelConfig(4, 32, "wgmma"), KernelConfig(8, 64, "wgmma", ws=True)):
        assert cfg.rowsum_mma(64) and cfg.defines(64)["ROWSUM_MMA"] == 1
        assert not cfg.rowsum_mma(128) and "ROWSUM_MMA" not in cfg.defines(128)
        stages = cfg.kv_stages(64)
        assert cfg.dynamic_smem_bytes(64) == stages * (cfg.smem_bytes(64) // stages + 16) + 2048 + 16 * cfg.ws
    for cfg in (DEFAULT, KernelConfig(4, 64, "mma"), KernelConfig(4, 136, "wgspan", pack=8, walk=4)):
        assert not cfg.rowsum_mma(64) and "ROWSUM_MMA" not in cfg.defines(64)


@pytest.mark.parametrize("window, sink", [(-1, "per_head"), (70, "none"), (70, "smooth")])
def test_rowsum_mma_model(window, sink, monkeypatch):
    """The wgmma model at d = 64 sums the fp16 P into l: it matches the reference, and against
    the same model with fp32 sums it moves only the rounding (not bitwise equal, within the
    fp16 P's rounding)."""
    s = Shape("rowsum", B=1, Sq=300, Hq=8, Hkv=2, past=83, window=window, sink=sink,
              config=KernelConfig(16, 64, "wgmma"), seed=11)
    assert s.config.rowsum_mma(s.d)
    expected = run_reference(s)
    fp16_sums = run_model(s)
    assert_close(fp16_sums, expected)
    monkeypatch.setattr(config_module, "WGMMA_ROWSUM_HEAD_DIMS", ())
    fp32_sums = run_model(s)
    assert_close(fp32_sums, expected)
    assert not np.array_equal(fp16_sums, fp32_sums)
    assert rel_l2(fp16_sums, fp32_sums) < 1e-3


# Keys whose logits climb along the sequence (k_j scaled by 1 + j / 16): a row's max grows
# by far more than 2^8 over its tiles, so the lazy model both defers and rescales.
def _climbing(s: Shape):
    q, k, v, sink = make(s)
    k = (k.astype(np.float32) * (1 + np.arange(k.shape[2]) / 16)[:, None]).astype(np.float16)
    return q, k, v, sink


def test_lazy_rescaling_model(monkeypatch):
    """The wgmma model at d = 64 keeps a warp's max while no row's grows by more than 2^8:
    it matches the reference, differs from eager rescaling only by rounding, and really
    defers (with a threshold of 2^1000 the climbing maxima overflow p = exp2(s2 - m) to inf,
    which the eager model never sees)."""
    s = Shape("lazy", Sq=200, Hq=4, Hkv=2, past=120, sink="per_head", q_scale=2.0,
              config=KernelConfig(16, 64, "wgmma"), seed=5)
    q, k, v, sink = _climbing(s)
    kw = dict(kwargs(s, sink), config=s.config)
    expected = reference.attention(q, k[:, :, :s.skv], v[:, :, :s.skv], dtype=np.float64,
                                   **kwargs(s, sink))
    lazy = model.attention(q, k, v, **kw)
    assert_close(lazy, expected)
    monkeypatch.setattr(config_module, "WGMMA_RESCALE_LOG2", 0)
    eager = model.attention(q, k, v, **kw)
    assert_close(eager, expected)
    assert not np.array_equal(lazy, eager)
    assert rel_l2(lazy, eager) < 2e-3
    monkeypatch.setattr(config_module, "WGMMA_RESCALE_LOG2", 1000)
    with np.errstate(over="ignore", invalid="ignore"):
        assert not np.isfinite(model.attention(q, k, v, **kw)).all()


def test_lazy_rescaling_by_half_warps_model(monkeypatch):
    """On the d = 128 producer tile each 8 rows of a warp decide a lazy rescale on their own
    (rescale_rows 8): the model matches the reference, and where the second half of every
    warp's rows climbs faster than the first, it rounds differently from the whole warp's
    vote (rescale_rows 16)."""
    cfg = KernelConfig(8, 128, "wgmma", ws=True)
    s = Shape("lazy8", Sq=200, Hq=4, Hkv=2, d=128, past=120, sink="per_head", q_scale=2.0, config=cfg, seed=5)
    q, k, v, sink = _climbing(s)
    for i in range(8, 16):
        q[:, i::16] *= 4
    kw = dict(kwargs(s, sink), config=cfg)
    expected = reference.attention(q, k[:, :, :s.skv], v[:, :, :s.skv], dtype=np.float64,
                                   **kwargs(s, sink))
    assert cfg.rescale_rows(128) == 8
    halves = model.attention(q, k, v, **kw)
    assert_close(halves, expected)
    monkeypatch.setattr(config_module, "WGMMA_RESCALE_ROWS_HEAD_DIMS", ())
    assert cfg.rescale_rows(128) == 16
    whole = model.attention(q, k, v, **kw)
    assert_close(whole, expected)
    assert not np.array_equal(halves, whole)


@pytest.mark.parametrize("name", [m.name for m in MUTANTS if m.name in KILLERS])
def test_mutant_is_killed_under_lazy_rescaling(name):
    """Every killer shape, on the wgmma tile of its geometry at d = 64 (lazy rescaling),
    still kills its mutant: a deferred rescale hides none of them."""
    s = KILLERS[name]
    cfg = KernelConfig(max(4, s.config.m_tiles), max(32, s.config.bkv), "wgmma")
    s = replace(s, config=cfg)
    assert cfg.rescale_log2(s.d) > 0
    expected = run_reference(s)
    assert_close(run_model(s), expected)
    assert killed(run_model(s, mutants={name}), expected), f"{name} survives {s}"


@pytest.mark.parametrize("args, field", [((3, 64), "m_tiles"), ((4, 48), "bkv"),
                                         ((True, 64), "m_tiles"), ((4, 64, "xmma"), "path")])
def test_config_validation(args, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        KernelConfig(*args)


def test_config_rejects_bad_head_dim_and_grid():
    with pytest.raises(ValueError, match="^d:"):
        DEFAULT.defines(96)
    with pytest.raises(ValueError, match="^bkv"):
        KernelConfig(8, 128).defines(128)  # 64 KiB of shared memory
    with pytest.raises(ValueError, match="^Sq"):
        DEFAULT.grid(0, 4, 1)
