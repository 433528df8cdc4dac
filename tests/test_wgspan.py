"""The wgspan path (kernels/gqa_flash_prefill_wgspan.hip): its config's geometry and shared
memory, the chunks its model walks, the model against the reference, and the mutants on it.
The kernel itself runs on the H200 only (scripts/mma_check.py, the GPU records)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from hipkernel import model
from hipkernel.config import (EQUIVALENT_ON_PATH, HEAD_DIMS, WGSPAN_CANDIDATES, KernelConfig,
                              config_from_name)
from refattn.mutants import MUTANTS
from tests.test_model import (KILLERS, SHAPES, Shape, assert_close, canary_outputs, killed,
                              run_model, run_reference)

SPAN = WGSPAN_CANDIDATES[0]  # wgspan_m4_b136_p8_q4


def on_span(s: Shape, cfg: KernelConfig = SPAN) -> Shape:
    """``s`` on the wgspan path, packed as its G allows."""
    return replace(s, config=cfg.for_group(s.Hq // s.Hkv))


def test_config_geometry_and_shared_memory():
    """One warpgroup of 64 rows (8 positions of 8 heads), 4 steps a block; a round stages
    (4 - 1) x 8 + 144 = 168 key rows of K and of V (the last unit's first row, 24 on, and
    P.V's 144 keys), one buffer, no mbarriers, and at d 64 the staged epilogue's 2 KiB for each
    of the 4 warps; BKV 136 and the walk reach the compiler."""
    c = SPAN
    assert (c.name, c.block_rows, c.block_positions, c.threads) == ("wgspan_m4_b136_p8_q4", 64, 8, 128)
    assert config_from_name(c.name) == c
    assert c.span_rows == 168 and c.kv_stages(64) == 1
    assert c.smem_bytes(64) == 2 * 168 * 64 * 2
    assert c.dynamic_smem_bytes(64) == c.smem_bytes(64) + 4 * 16 * 128
    assert c.dynamic_smem_bytes(128) == c.smem_bytes(128) == 2 * 168 * 128 * 2
    assert c.defines(64) == {"HEAD_DIM": 64, "M_TILES": 4, "BKV": 136, "PACK": 8, "QWALK": 4,
                             "KV_STAGES": 1}
    assert c.grid(Sq=16384, Hq=64, B=1) == (512, 8, 1)  # 2048 steps of 8 positions, 4 a block
    assert c.grid(Sq=9, Hq=64, B=2) == (1, 8, 2)
    m8 = KernelConfig(8, 72, "wgspan", pack=4, walk=2)  # 2 warpgroups of 16 positions
    assert m8.span_rows == (2 * 2 - 1) * 16 + 80
    for bad in (dict(bkv=64), dict(bkv=128), dict(m_tiles=2), dict(ws=True), dict(warp_m=2)):
        with pytest.raises(ValueError):
            KernelConfig(**{**dict(m_tiles=4, bkv=136, path="wgspan"), **bad})


@pytest.mark.parametrize("G, name", [(8, "wgspan_m4_b136_p8_q4"), (4, "wgspan_m4_b136_p4_q2"),
                                     (2, "wgspan_m4_b136_p2"), (1, "wgspan_m4_b136"),
                                     (3, "wgspan_m4_b136"), (6, "wgspan_m4_b136_p2")])
def test_for_group_keeps_a_blocks_positions(G, name):
    """Fewer heads a KV head: pack cut to gcd(8, G), and the walk by the same factor (at
    least 1), so a block's staged keys stay within what the packed tile stages, at both head
    dims."""
    c = SPAN.for_group(G)
    assert c.name == name and c.supports(G)
    assert c.span_rows <= SPAN.span_rows
    assert all(c.fits(d) for d in HEAD_DIMS)


def test_spans_window():
    """A window whose span (W + 64 / pack - 1 keys) fits one chunk: W <= 129 at pack 8."""
    assert [w for w in (-1, 0, 1, 128, 129, 130, 4096) if SPAN.spans_window(w)] == [1, 128, 129]
    assert not SPAN.for_group(4).spans_window(128)  # 16 positions: 143 keys
    assert not KernelConfig(4, 64, "mma", pack=8).spans_window(128)


@pytest.mark.parametrize("past", [0, 5, 512, 8192, 8209, 15872])
def test_a_window_of_128_is_one_chunk_a_unit(past):
    """Under a 128-key window with 8 positions a unit, each unit walks exactly one chunk,
    starting at its first row's first visible key (where that is not clamped at key 0), and
    the block's round holds every unit's chunk and the 8 keys P.V reads after it."""
    cfg = SPAN
    bm, walk = cfg.block_rows // cfg.pack, cfg.walk
    for i0 in range(0, 200, bm):
        blk0 = i0 - i0 % (bm * walk)
        tiles, kv_start = model._span_tiles(i0, blk0, 200, past, 128, cfg.bkv, bm, frozenset())
        first = past + i0 - 127
        assert kv_start == max(0, past + blk0 - 127)
        if first >= 0 and past + blk0 - 127 >= 0:
            assert tiles == [first], (i0, tiles)
            assert tiles[0] + 144 - kv_start <= cfg.span_rows  # inside the block's round
        else:
            assert len(tiles) == 1 and tiles[0] <= max(0, first), (i0, tiles)


@pytest.mark.parametrize("s", SHAPES, ids=lambda s: s.name)
def test_model_matches_reference(s):
    assert_close(run_model(on_span(s)), run_reference(s))


@pytest.mark.parametrize("cfg", [SPAN, KernelConfig(8, 72, "wgspan", pack=4, walk=2),
                                 KernelConfig(16, 136, "wgspan", walk=2)], ids=lambda c: c.name)
@pytest.mark.parametrize("window, past", [(128, 1000), (5, 9), (300, 3), (-1, 30), (128, 77)])
def test_other_tiles_match_reference(cfg, window, past):
    """Two warpgroups of 16 positions walking two steps on 72-key chunks, four of 64
    positions: several chunks a unit, units clamped at key 0, no window."""
    s = Shape("span", Sq=150, Hq=16, Hkv=2, past=past, window=window, sink="per_head")
    assert_close(run_model(on_span(s, cfg)), run_reference(s))


@pytest.mark.parametrize("cfg", [SPAN, KernelConfig(8, 72, "wgspan", pack=4, walk=2)],
                         ids=lambda c: c.name)
def test_unseen_storage_cannot_change_output(cfg):
    """Keys below the block's window and the cache padding hold NaN in one run and large
    finite garbage in the other: bitwise equal outputs (a round holds keys that are below
    some units' windows but not the block's: real keys, which p = 0 multiplies)."""
    outs = canary_outputs(on_span(Shape("canary", Sq=70, Hq=16, Hkv=2, past=100, window=20,
                                        sink="per_head"), cfg))
    assert not np.isnan(outs[0]).any()
    assert np.array_equal(outs[0], outs[1])


# Killer shapes for the wgspan path where KILLERS' walk one chunk where the mutant needs
# more (sink_per_tile: a sink term a chunk), or start where it does not bite.
SPAN_KILLERS = {
    "sink_per_tile": Shape("k", Sq=32, past=300, sink=3.0),
    "clamp_plus_one_tile": Shape("k", Sq=40, past=200),
}


# no_nan_guard's exp2(-inf - -inf) would be the bug itself, where it ran
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("name", [m.name for m in MUTANTS if m.name in KILLERS
                                  and m.name not in EQUIVALENT_ON_PATH["wgspan"]])
def test_mutant_is_killed(name):
    s = on_span(SPAN_KILLERS.get(name, KILLERS[name]))
    expected = run_reference(s)
    assert_close(run_model(s), expected)
    assert killed(run_model(s, mutants={name}), expected), f"{name} survives {s}"


def test_equivalent_on_path_names_only_what_the_model_checks():
    """The one claim below is the only one: a new entry needs its own check."""
    assert {p: set(m) for p, m in EQUIVALENT_ON_PATH.items()} == {"wgspan": {"no_nan_guard"}}


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("s", SHAPES + list(KILLERS.values()), ids=lambda s: s.name)
def test_no_nan_guard_is_equivalent_here(s):
    """EQUIVALENT_ON_PATH's claim, on the model: with the NaN guard gone, every shape gives
    bitwise the output it gives with it (no chunk precedes a row's first visible key). The
    same mutant changes the mma path's output on its killer shape."""
    span = on_span(s)
    clean = run_model(span)
    assert np.array_equal(clean.view(np.uint16), run_model(span, mutants={"no_nan_guard"}).view(np.uint16))
    if s is KILLERS["no_nan_guard"]:
        assert np.isnan(run_model(s, mutants={"no_nan_guard"})).any()
