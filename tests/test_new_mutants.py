"""Three mutants of the catalogue on the CPU model, input by input: where each changes the
output and where it cannot (refattn/mutants.py; the kernels' macros sit at the same places).

  head_tile_crosses_group  a tile of 16 query heads reads the KV head of its first head,
                           (h & ~15) // G: exactly the heads h with (h & ~15) // G != h // G
                           change, which needs a KV group boundary inside a 16-head tile.
  window_skip_off          the walk and the loads start at key 0, not at the window's first
                           tile: on finite data the extra keys add exact zeros (bitwise the
                           clean output on every path whose tiles sit on multiples of BKV); a
                           NaN or inf in v left of the window reaches every row through
                           p = 0 times it.
  max_floor                the running max starts at -1e4 (exp2 units) instead of -inf: a row
                           whose logits all lie far below it (natural-log logits below about
                           -7000) loses every p, and its output is 0.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from hipkernel import model
from hipkernel.config import (MFMA_CANDIDATES, MMA_WALK_CANDIDATES, WGMMA_BY_HEAD_DIM, WGSPAN_CANDIDATES,
                              WMMA_CANDIDATES, KernelConfig)
from refattn.mutants import by_name
from tests.test_model import (KILLERS, Shape, assert_close, killed, make, rel_l2, run_model,
                              run_reference)

KERNELS = Path(model.__file__).parent / "kernels"

# The model's paths: each config's tiles, packing, walk and rounding.
CONFIGS = {
    "scalar": KernelConfig(4, 32),
    "mma": KernelConfig(4, 64, "mma"),
    "mma-packed": KernelConfig(4, 32, "mma", pack=8),
    "mma-walk": MMA_WALK_CANDIDATES[0],
    "wgmma-lazy": WGMMA_BY_HEAD_DIM[64],
    "wmma": WMMA_CANDIDATES[0],
    "mfma": MFMA_CANDIDATES[0],
    "wgspan": WGSPAN_CANDIDATES[0],
}
# The NaN of the window_skip_off kills is the bug itself (np.errstate does not reach the
# model's worker threads).
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def on(s: Shape, path: str) -> Shape:
    """``s`` on the config of ``path``, packed as far as its G allows."""
    return replace(s, config=CONFIGS[path].for_group(s.Hq // s.Hkv))


def bitwise_equal(a, b) -> bool:
    return np.array_equal(a.view(np.uint16), b.view(np.uint16))


# ---- head_tile_crosses_group -------------------------------------------------------------

# (Hq, Hkv): G = 12 and 24 put a group boundary inside a tile; G = 8, 4, 2 and 1 too, once
# there are several KV heads; G = 16, 32 align the groups with the tiles; Hkv = 1 has no
# boundary at all.
HEAD_GEOMETRIES = [(24, 2), (48, 2), (16, 2), (8, 2), (4, 2), (6, 6), (36, 3),
                   (32, 2), (64, 2), (12, 1), (16, 1)]


def tile_head_changes(Hq: int, Hkv: int) -> set[int]:
    """The query heads whose KV head the bug changes: (h & ~15) // G != h // G."""
    G = Hq // Hkv
    return {h for h in range(Hq) if (h & ~15) // G != h // G}


def test_the_heads_the_bug_moves():
    assert tile_head_changes(24, 2) == {12, 13, 14, 15}
    assert tile_head_changes(48, 2) == set(range(24, 32))
    assert tile_head_changes(8, 2) == {4, 5, 6, 7}
    assert tile_head_changes(32, 2) == tile_head_changes(64, 2) == tile_head_changes(12, 1) == set()


@pytest.mark.parametrize("path", ["scalar", "mma-packed", "wgmma-lazy", "wmma", "wgspan"])
@pytest.mark.parametrize("Hq, Hkv", HEAD_GEOMETRIES, ids=lambda x: str(x))
def test_head_tile_crosses_group_changes_exactly_the_heads_across_a_boundary(Hq, Hkv, path):
    """The mutant's output differs from the clean model's in exactly the heads whose tile's
    first head lies in another KV group, on every path (a packed block's heads share one
    16-head tile); the other heads are bitwise the clean ones."""
    s = on(Shape("heads", Sq=16, Hq=Hq, Hkv=Hkv, past=5, window=12), path)
    clean = run_model(s)
    mut = run_model(s, mutants={"head_tile_crosses_group"})
    changed = {int(h) for h in np.flatnonzero((clean != mut).any(axis=(0, 1, 3)))}
    assert changed == tile_head_changes(Hq, Hkv)
    if changed:
        assert killed(mut, run_reference(s))


# ---- window_skip_off ---------------------------------------------------------------------

# Q tiles at positions 100..139 under a window of 20: every row's window starts at key 81 or
# later, so keys [0, 81) are left of every window.
SKIP = Shape("skip", Sq=40, past=100, window=20, sink="per_head")


@pytest.mark.parametrize("path", [p for p in CONFIGS if p != "wgspan"])
def test_window_skip_off_is_bitwise_clean_on_finite_data(path):
    """The extra tiles left of the window hold no key any row sees: every row keeps its
    state there (NaN guard: alpha = 1, p = 0), and the keys below the window in the first
    tile that was walked before now hold real values instead of zeros, which p = 0 turns
    into exact zeros. Tiles sit on multiples of BKV either way, so the sums are the same
    and so is every bit; finite garbage left of the window (3e4) changes nothing either."""
    for fill in (None, 3e4):
        s = on(replace(SKIP, left_fill=fill), path)
        assert bitwise_equal(run_model(s, mutants={"window_skip_off"}), run_model(s))


def test_window_skip_off_moves_only_rounding_on_wgspan_finite_data():
    """The wgspan path's chunks start at a unit's first visible key; from key 0 they cut the
    keys elsewhere, so the online softmax rescales at other keys: fp32 rounding, no more."""
    s = on(SKIP, "wgspan")
    mut = run_model(s, mutants={"window_skip_off"})
    assert not bitwise_equal(mut, run_model(s))
    assert_close(mut, run_reference(s))


@pytest.mark.parametrize("path", list(CONFIGS))
@pytest.mark.parametrize("fill", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "neginf"])
def test_window_skip_off_leaks_a_non_finite_v_left_of_the_window(path, fill):
    """NaN or +-inf in k and v left of every window: the clean model never loads them; the
    mutant multiplies p = 0 by them, and 0 * NaN = 0 * inf = NaN reaches every row, the
    rows that see nothing in a tile included (they still add 0 * v there)."""
    s = on(replace(SKIP, left_fill=float(fill)), path)
    assert_close(run_model(s), run_reference(s))
    assert np.isnan(run_model(s, mutants={"window_skip_off"})).all()


@pytest.mark.parametrize("path", ["scalar", "mma", "wgmma-lazy"])
def test_window_skip_off_leaks_through_rows_that_see_nothing(path):
    """Keys [0, 32) hold NaN, the whole first KV tile of 32, and every row's window starts at
    key 32 or later (past 47, W 16): no row sees a key of that tile, so the NaN reaches the
    output only through the NaN guard's rows adding P.V = 0 * v, as every kernel path does
    once its skips are off."""
    s = replace(Shape("guard", Sq=40, past=47, window=16, left_fill=float("nan")),
                config=replace(CONFIGS[path], bkv=32) if path != "wgmma-lazy"
                else KernelConfig(4, 32, "wgmma"))
    assert_close(run_model(s), run_reference(s))
    assert np.isnan(run_model(s, mutants={"window_skip_off"})).all()


@pytest.mark.parametrize("path", list(CONFIGS))
def test_window_skip_off_cannot_see_what_a_row_masks(path):
    """Only v can leak: a NaN score is masked by assignment (-inf), so NaN in k alone left of
    the window changes nothing beyond rounding."""
    s = on(SKIP, path)
    q, k, v, sink = make(s)
    k[:, :, :81] = np.nan
    kw = dict(past_len=s.past, window=s.window, sink=sink)
    clean = model.attention(q, k, v, config=s.config, **kw)
    mut = model.attention(q, k, v, config=s.config, mutants={"window_skip_off"}, **kw)
    assert np.isfinite(mut).all()
    assert rel_l2(mut, clean) < 1e-3


@pytest.mark.parametrize("path", ["scalar", "mma", "wgspan"])
@pytest.mark.parametrize("window, past", [(-1, 100), (101, 100), (500, 100)],
                         ids=["no-window", "window-reaches-key-0", "window-past-skv"])
def test_window_skip_off_needs_keys_left_of_a_window(path, window, past):
    """No window, or one that reaches key 0 from the first row: the clamp was 0 already, so
    the mutant walks and loads the same keys, NaN past skv stays unread, output bitwise equal."""
    s = on(Shape("nowin", Sq=40, past=past, window=window, sink="per_head"), path)
    assert bitwise_equal(run_model(s, mutants={"window_skip_off"}), run_model(s))


# ---- max_floor ---------------------------------------------------------------------------

@pytest.mark.parametrize("path", list(CONFIGS))
@pytest.mark.parametrize("offset", [0.0, -5e3, -6900.0])
def test_max_floor_is_bitwise_clean_above_the_floor(path, offset):
    """Logits at most 6900 below zero (-9955 in exp2 units, above the floor of -1e4): once a
    row has seen a key its max is above the floor, as without it; before, the floor only
    stands where -inf would (alpha = 1 and p = 0 for a tile the row sees nothing of, and the
    first tile it sees scales l = acc = 0)."""
    s = on(Shape("floor", Sq=40, past=30, window=50, logit_offset=offset), path)
    assert bitwise_equal(run_model(s, mutants={"max_floor"}), run_model(s))


@pytest.mark.parametrize("path", list(CONFIGS))
@pytest.mark.parametrize("offset", [-7100.0, -5e4])
def test_max_floor_zeroes_a_row_far_below_the_floor(path, offset):
    """Every logit more than 150 (exp2 units) below the floor: p = exp2(s2 - floor)
    underflows to 0 for every key, l = 0 and the output is 0, where the clean model (the max
    starts at -inf) is right."""
    s = on(Shape("floor", Sq=40, past=30, window=50, logit_offset=offset), path)
    expected = run_reference(s)
    assert_close(run_model(s), expected)
    assert np.abs(expected).max() > 0.1
    mut = run_model(s, mutants={"max_floor"})
    assert (mut == 0).all() and killed(mut, expected)


@pytest.mark.parametrize("path", ["scalar", "mma", "wgmma-lazy"])
@pytest.mark.parametrize("sink", ["per_head", "smooth"])
def test_max_floor_hides_behind_a_sink(path, sink):
    """With a sink logit near 0 (smooth: 0; per head: a few units) and every key's logit 5e4
    below it, the true output is e^-5e4 times a mean of v: 0 at fp16, which is what the
    mutant gives too (zeros of other signs: the clean output is acc * 0, signed as acc, the
    mutant's acc a sum of exact zeros). A max_floor case needs no sink (or a sink as low as
    the logits)."""
    s = on(Shape("floor", Sq=40, past=30, window=50, sink=sink, logit_offset=-5e4), path)
    assert (run_reference(s) == 0).all()
    assert (run_model(s) == 0).all() and (run_model(s, mutants={"max_floor"}) == 0).all()


# ---- the catalogue and the kernels -------------------------------------------------------

NEW = ("head_tile_crosses_group", "window_skip_off", "max_floor")
# Where each bug lives, per kernel file: the files a path compiles test the macro there
# (wgmma, wgspan and the AMD path through flash_common.h).
MACRO_FILES = {
    "head_tile_crosses_group": ["gqa_flash_prefill.hip", "gqa_flash_prefill_mma.hip", "flash_common.h"],
    "window_skip_off": ["gqa_flash_prefill.hip", "gqa_flash_prefill_mma.hip", "flash_common.h",
                        "gqa_flash_prefill_wgmma.hip", "gqa_flash_prefill_amdmma.hip"],
    "max_floor": ["gqa_flash_prefill.hip", "gqa_flash_prefill_mma.hip", "flash_common.h"],
}


@pytest.mark.parametrize("name", NEW)
def test_new_mutants_are_in_the_catalogue_with_a_killer(name):
    m = by_name(name)
    assert m.macro == f"HIPKERNEL_MUTANT_{name.upper()}" and m.equivalent is None
    assert name in KILLERS


@pytest.mark.parametrize("name", NEW)
def test_new_macros_are_tested_where_the_bug_lives(name):
    macro = by_name(name).macro
    for fn in MACRO_FILES[name]:
        assert re.search(rf"#if(def| defined\(| !defined\()[^\n]*\b{macro}\b|\bdefined\({macro}\)",
                         (KERNELS / fn).read_text()), f"{macro} not tested in {fn}"
    users = {"head_tile_crosses_group": r"kv_head\(", "window_skip_off": r"kv_start_of\(",
             "max_floor": r"row_max_init\(\)"}[name]
    for fn in ("gqa_flash_prefill_wgmma.hip", "gqa_flash_prefill_wgspan.hip", "gqa_flash_prefill_amdmma.hip"):
        assert re.search(users, (KERNELS / fn).read_text()), f"{fn} does not use flash_common.h's {users}"


def test_the_warp_skips_are_off_under_window_skip_off():
    """The per-warp (warpgroup, wave) skip of tiles left of its rows' windows is a window
    skip too: each path turns it off under the mutant, as under the two other mutants that
    make a skipped tile matter, so that the kernels walk what the model walks."""
    for fn, flag in (("gqa_flash_prefill_mma.hip", "WARP_SKIP"), ("gqa_flash_prefill_wgmma.hip", "GROUP_SKIP"),
                     ("gqa_flash_prefill_amdmma.hip", "WAVE_SKIP")):
        src = (KERNELS / fn).read_text()
        cond = re.search(rf"#if (!defined\(HIPKERNEL_MUTANT_NO_NAN_GUARD\)[^\n]*(?:\\\n[^\n]*)*)\n#define {flag} 1", src)
        assert cond and "!defined(HIPKERNEL_MUTANT_WINDOW_SKIP_OFF)" in cond.group(1), fn


# ---- the case matrix ---------------------------------------------------------------------

# mutant -> (a case that kills it, cases where it cannot show), as `--case` bodies
MATRIX = {
    "head_tile_crosses_group": (
        'Hq = 24, Hkv = 2, d = 64, sq = 32, past_len = 16',  # G = 12
        ['Hq = 32, Hkv = 2, d = 64, sq = 32, past_len = 16',  # G = 16: the groups are the tiles
         'Hq = 12, Hkv = 1, d = 64, sq = 32, past_len = 16']),  # one KV head
    "window_skip_off": (
        'Hq = 4, Hkv = 2, d = 64, sq = 40, past_len = 100, window = 20, cache_fill = "nan-outside-window"',
        ['Hq = 4, Hkv = 2, d = 64, sq = 40, past_len = 100, window = 20']),  # finite evicted rows
    "max_floor": (
        'Hq = 4, Hkv = 2, d = 64, sq = 32, past_len = 16, logit_offset = -5e4, sink = "per_head"',
        ['Hq = 4, Hkv = 2, d = 64, sq = 32, past_len = 16, logit_offset = -5e3',  # above the floor
         # the smooth softmax's zero logit outweighs every key: the true output is 0 as well
         'Hq = 4, Hkv = 2, d = 64, sq = 32, past_len = 16, logit_offset = -5e4, sink = "smooth"']),
}


@pytest.mark.parametrize("name", NEW)
def test_the_case_matrix_kills_each_new_mutant_where_it_shows(name):
    from hipkernel.adapter import ModelKernel
    from refattn.cases import case_from_text
    from refattn.runner import run_matrix

    kill, blind = MATRIX[name]
    cases = [case_from_text(t, name=f"c{i}") for i, t in enumerate([kill] + blind)]
    assert run_matrix(ModelKernel(), cases).ok
    res = run_matrix(ModelKernel(mutants={name}), cases)
    assert [r.outcome for r in res.results] == ["fail"] + ["pass"] * len(blind)
