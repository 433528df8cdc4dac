"""scripts/mma_check.py's plan on the CPU: which config each case runs when a config is
forced, and that the prewarm compiles every kernel the matrix and the kill matrices launch
(the sections themselves need the GPU)."""
import importlib.util
from pathlib import Path

import pytest

from hipkernel import api
from hipkernel.config import (MMA_DEFAULT, WGMMA_CANDIDATES, WGSPAN_CANDIDATES, KernelConfig,
                              config_from_name)
from refattn.cases import load_suites
from refattn.mutants import MUTANTS

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "mma_check.py"
SUITES = ["seed", "extended", "coverage", "ragged"]


@pytest.fixture(scope="module")
def mc():
    spec = importlib.util.spec_from_file_location("mma_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_forced_tiles_keep_the_cases_tiles_where_the_path_allows_them(mc):
    m12 = config_from_name("wgmma_m12_b128_ws")
    # no case tiles: the forced config, and its producer
    assert mc.forced_tiles(m12, None, 8, False) == {
        "m_tiles": 12, "bkv": 128, "path": "wgmma", "warp_m": 1, "pack": 1, "walk": 1, "ws": True}
    # a ragged case cannot take the TMA producer: three warpgroups need it, so two
    assert mc.forced_tiles(m12, None, 8, True)["m_tiles"] == 8
    assert mc.forced_tiles(m12, None, 8, True)["ws"] is False
    # a case's own m4 / bkv 32 win on the wgmma path, without the producer (m_tiles 8, 12 only)
    c = mc.forced_tiles(m12, {"m_tiles": 4, "bkv": 32}, 8, False)
    assert (c["m_tiles"], c["bkv"], c["ws"]) == (4, 32, False)
    assert mc.forced_tiles(m12, {"m_tiles": 4, "bkv": 32}, 8, False, respect_case=False)["m_tiles"] == 12
    # wgspan keeps its own chunk tiles and packs as the case's G allows
    span = WGSPAN_CANDIDATES[0]
    assert [(lambda c: (c["pack"], c["walk"], c["m_tiles"], c["bkv"]))(
        mc.forced_tiles(span, {"m_tiles": 1, "bkv": 32}, g, False)) for g in (1, 2, 4, 8, 12)] == [
        (1, 1, 4, 136), (2, 1, 4, 136), (4, 2, 4, 136), (8, 4, 4, 136), (4, 2, 4, 136)]
    # every forced tile of every case is a config api.attention takes
    for cfg in mc.MMA_ALL:
        for case in load_suites(SUITES):
            api._check_config(mc.forced_tiles(cfg, case.config, case.Hq // case.Hkv, case.ragged))


def test_prewarm_covers_every_build_of_the_matrix_and_the_kill_matrices(mc):
    cases = load_suites(SUITES)
    jobs = mc.prewarm_jobs(["matrix", "mutants"])
    built = {(KernelConfig(m, b, path, w, ws, pack, walk), d, dt, mut)
             for path, d, m, b, mut, mb, w, ws, pack, dt, walk in jobs}
    launched = set()
    for i, cfg in enumerate(mc.MMA_ALL):  # section_matrix: the first at the cases' tiles
        for case in cases:
            if case.d in (64, 128) and case.dtype in ("fp16", "bf16"):
                k = api._check_config(mc.forced_tiles(cfg, case.config, case.Hq // case.Hkv,
                                                      case.ragged, respect_case=i == 0))
                if k.fits(case.d):
                    launched.add((k, case.d, case.dtype, frozenset()))
    assert launched <= built
    names = {mu.name for mu in MUTANTS}
    for cfg in mc.mutant_configs():  # section_mutants: clean and each mutant, every case
        for case in cases:
            if case.d in (64, 128) and case.dtype in ("fp16", "bf16"):
                k = api._check_config(mc.forced_tiles(cfg, case.config, case.Hq // case.Hkv, case.ragged))
                if k.fits(case.d):
                    assert {(k, case.d, case.dtype, frozenset({n})) for n in names} <= built, (cfg.name, case.id)
    # the wgspan kill matrix's builds, at each packing its cases leave it, are among them
    span = {(k.name, d, dt) for k, d, dt, mut in built if k.path == "wgspan" and mut}
    assert {("wgspan_m4_b136_p8_q4", 64, "fp16"), ("wgspan_m4_b136_p4_q2", 64, "bf16"),
            ("wgspan_m4_b136", 128, "fp16")} <= span
    # and the walking mma tile compiles walking (QWALK), as it launches
    assert any(k.walk > 1 and k.path == "mma" for k, d, dt, mut in built)
    assert mc.mutant_configs()[0] == MMA_DEFAULT and set(WGMMA_CANDIDATES) <= set(mc.mutant_configs())
