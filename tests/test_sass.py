"""hipkernel.sass: the SASS reader, and the schedule fact the d 128 tile's speed rests on.

Under OVERLAP the softmax of tile t must run while tile t - 1's P.V is on the tensor cores:
in SASS, the tile's MUFU.EX2 between the wait that leaves one wgmma group in flight and the
wait for all. ptxas is free to hoist the second wait, and did in kernel sources 2ee6512e to
7149d8c1 (0 exp2 between the waits at d 128; 66 with hk_wgmma_wait_all_after); these tests
compile every shipped config with OVERLAP on, offline, where NVRTC and nvdisasm are installed
(CI installs both: .ci/install-amd.sh), and are skipped with the reason elsewhere."""

from __future__ import annotations

import pytest

from hipkernel import sass
from hipkernel.backends import cuda as cuda_be
from hipkernel.config import compiled_variants

HOISTED = """\
        /*1c40*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*1c50*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*1c60*/                   FFMA R4, R4, R2, -R3 ;
        /*1c70*/                   MUFU.EX2 R4, R4 ;
        /*1c80*/               @P1 MUFU.EX2 R5, R5 ;
""".splitlines()
PINNED = """\
        /*1c40*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*1c60*/                   FFMA R4, R4, R2, -R3 ;
        /*1c70*/                   MUFU.EX2 R4, R4 ;
        /*1c80*/               @P1 MUFU.EX2 R5, R5 ;
        /*1c90*/              @!P0 MUFU.EX2 R6, R6 ;
        /*1ca0*/                   MUFU.RCP R7, R7 ;
        /*1cb0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*1cc0*/                   MUFU.EX2 R8, R8 ;
""".splitlines()


def test_exp2_between_waits_counts_the_softmax_under_the_owed_pv():
    assert sass.exp2_between_waits(HOISTED) == 0
    assert sass.exp2_between_waits(PINNED) == 3  # not the RCP, not the exp2 after the wait
    # no wait_group 1: OVERLAP is off
    assert sass.exp2_between_waits([l for l in PINNED if "0x1 ;" not in l]) is None
    # a wait_group 1 never followed by a full wait: not a pair either
    assert sass.exp2_between_waits(PINNED[:5]) is None


def test_softmax_runs_are_the_longest_runs_of_one_opcode_after_the_wait_for_qk():
    lines = """\
        /*1c30*/                   FMNMX R1, R1, R2, !PT ;
        /*1c40*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*1c50*/                   FMNMX R1, R1, R2, !PT ;
        /*1c60*/                   FMNMX R1, R1, R3, !PT ;
        /*1c70*/                   FFMA R4, R4, R2, -R3 ;
        /*1c80*/                   FFMA R5, R5, R2, -R3 ;
        /*1c90*/               @P1 MUFU.EX2 R4, R4 ;
        /*1ca0*/                   MUFU.EX2 R5, R5 ;
        /*1cb0*/                   MUFU.EX2 R6, R6 ;
        /*1cc0*/                   F2FP.F16.F32.PACK_AB R4, R5, R4 ;
        /*1cd0*/                   MUFU.EX2 R7, R7 ;
        /*1ce0*/                   HGMMA.64x128x16.F32 R24, gdesc[UR20], RZ, !UPT ;
        /*1cf0*/                   MUFU.EX2 R8, R8 ;
        /*1d00*/                   MUFU.EX2 R9, R9 ;
        /*1d10*/                   MUFU.EX2 R10, R10 ;
        /*1d20*/                   MUFU.EX2 R11, R11 ;
""".splitlines()
    # from the wait for Q.K^T (the FMNMX before it not counted) to the next wgmma (the four
    # exp2 after it not counted); the guard predicate and the modifiers do not split a run
    assert sass.softmax_runs(lines) == {"FMNMX": 2, "FFMA": 2, "MUFU": 3, "F2FP": 1, "FADD": 0}
    assert sass.softmax_runs(lines, ("MUFU",)) == {"MUFU": 3}
    assert sass.softmax_runs([l for l in lines if "0x1 ;" not in l]) is None  # no OVERLAP
    assert sass.softmax_runs(lines[1:7]) == {"FMNMX": 2, "FFMA": 2, "MUFU": 1, "F2FP": 0, "FADD": 0}


def test_opcodes_drop_the_guard_and_keep_the_modifiers():
    assert sass.opcodes(PINNED[:5]) == ["WARPGROUP.DEPBAR.LE", "FFMA", "MUFU.EX2", "MUFU.EX2", "MUFU.EX2"]
    assert sass.opcodes(["        /*0000*/   @!UP0 HGMMA.64x128x16.F32 R24, R124, gdesc[UR16], RZ ;"]) == [
        "HGMMA.64x128x16.F32"]
    assert sass.opcodes(["  .text.gqa_flash_prefill:", "", "  // comment"]) == []


def test_cli_names_the_bad_argument(capsys):
    with pytest.raises(SystemExit) as e:
        sass.main(["--config", "wgmma_m16_b64", "--define", "OVERLAP"])
    assert e.value.code == 2 and "--define" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        sass.main(["--config", "wgmma_m16_b64", "--head-dim", "96"])
    assert e.value.code == 2 and "head_dim" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        sass.main(["--config", "no_such_config"])
    assert e.value.code == 2 and "config" in capsys.readouterr().err


OVERLAP_CONFIGS = [(d, cfg) for d, cfg in compiled_variants() if cfg.path == "wgmma" and cfg.tma]


def test_some_shipped_config_has_overlap():
    """The check below must have something to check: OVERLAP is on with the TMA producer."""
    assert OVERLAP_CONFIGS, "no wgmma config with the TMA producer (OVERLAP) is compiled"


@pytest.mark.parametrize("d,cfg", OVERLAP_CONFIGS, ids=lambda v: getattr(v, "name", str(v)))
def test_overlap_softmax_runs_under_the_owed_pv(d, cfg):
    """The exp2 of the tile's softmax up to the wait for the owed P.V (4 scores a lane of each
    of the config's ``pv_wait_split()`` first 8-key blocks: BKV / 2, or 4 on the
    three-consumer tile) lie between the wait for Q.K^T and that wait, in the kernel as
    compiled."""
    if cuda_be.nvrtc is None:
        pytest.skip(f"cuda-bindings not importable: {cuda_be.IMPORT_ERROR}")
    if sass.find_nvdisasm() is None:
        pytest.skip("nvdisasm not found (pip install nvidia-cuda-nvdisasm)")
    rep = sass.inspect(cfg.name, d)
    assert rep.spills == 0
    assert rep.exp2_under_pv is not None, "no wait_group 1 / 0 pair: OVERLAP is off in this build"
    expected = 4 * cfg.pv_wait_split()
    assert rep.exp2_under_pv >= expected, (
        f"{cfg.name} d {d}: only {rep.exp2_under_pv} MUFU.EX2 between the waits, "
        f"{expected} expected: ptxas hoisted the wait for the owed P.V above the softmax")


MBAR_CONFIGS = [(d, cfg) for d, cfg in compiled_variants()
                if cfg.path == "wgmma" and (cfg.ws or cfg.m_tiles >= 16)]


@pytest.mark.parametrize("d,cfg", MBAR_CONFIGS, ids=lambda v: getattr(v, "name", str(v)))
def test_wgmma_descriptors_stay_in_uniform_registers(d, cfg):
    """On the mbarrier pipelines the kernel takes its warp index through a shuffle
    (WARP_SHFL), so that ptxas keeps the stage and the wgmma descriptors in uniform registers:
    without it every HGMMA is fed by two R2UR (70 in the d 128 producer tile, 4-5 % of its
    time). Fewer R2UR than HGMMA in the whole kernel."""
    if cuda_be.nvrtc is None:
        pytest.skip(f"cuda-bindings not importable: {cuda_be.IMPORT_ERROR}")
    if sass.find_nvdisasm() is None:
        pytest.skip("nvdisasm not found (pip install nvidia-cuda-nvdisasm)")
    rep = sass.inspect(cfg.name, d)
    hgmma = sum(n for op, n in rep.counts.items() if op.startswith("HGMMA"))
    assert rep.spills == 0
    assert hgmma and rep.counts["R2UR"] < hgmma, (
        f"{cfg.name} d {d}: {rep.counts['R2UR']} R2UR for {hgmma} HGMMA: the descriptors left "
        f"the uniform registers")
