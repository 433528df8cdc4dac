"""The offline compile check (``python -m hipkernel.build``).

The parsers are pure and tested on captured compiler output (ptxas ``-v`` through NVRTC,
clang's ``-Rpass-analysis=kernel-resource-usage`` remarks, an AMDGPU code object's metadata
note). The table / exit-status logic runs ``check`` with a fake compiler. Real compiles run
where the compiler is installed and are skipped with the reason elsewhere: a tiny kernel on
every toolchain, and the real kernel for sm_90.
"""

from __future__ import annotations

import json
import struct

import pytest

from hipkernel import build
from hipkernel.backends import BackendUnavailable, CompileError, CompileResult, summarize_usage
from hipkernel.backends import cuda as cuda_be
from hipkernel.backends import hip as hip_be

# --------------------------------------------------------------------------- ptxas (NVRTC)

# NVRTC 13.5, sm_90, the fused kernel at d=64 m4_b64.
PTXAS_NVRTC13 = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'gqa_flash_prefill' for 'sm_90'
ptxas info    : Function properties for gqa_flash_prefill
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 199 registers, used 1 barriers, 18432 bytes smem
ptxas info    : Compile time = 21287.803 ms
"""

# CUDA 11/12 style: no barrier count, cmem listed, a spilling callee and a second entry.
PTXAS_SPILLS = """\
ptxas info    : 0 bytes gmem
ptxas info    : Function properties for _Z6helperPf
ptxas         .     32 bytes stack frame, 24 bytes spill stores, 16 bytes spill loads
ptxas info    : Compiling entry function 'kern' for 'sm_80'
ptxas info    : Function properties for kern
ptxas         .     64 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 255 registers, 16384 bytes smem, 380 bytes cmem[0]
ptxas info    : Compiling entry function 'other' for 'sm_80'
ptxas info    : Function properties for other
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers, 368 bytes cmem[0]
"""


def _nv(log, name):
    return summarize_usage(cuda_be.parse_ptxas_log(log), name, regs="regs", smem="smem",
                           spill_keys=cuda_be.SPILL_KEYS)


def test_ptxas_log_nvrtc13():
    assert cuda_be.parse_ptxas_log(PTXAS_NVRTC13) == {"gqa_flash_prefill": dict(
        regs=199, smem=18432, barriers=1, stack=0, spill_stores=0, spill_loads=0)}
    regs, spills, smem, _ = _nv(PTXAS_NVRTC13, "gqa_flash_prefill")
    assert (regs, spills, smem) == (199, 0, 18432)


def test_ptxas_log_spills_count_over_every_function():
    parsed = cuda_be.parse_ptxas_log(PTXAS_SPILLS)
    assert parsed["_Z6helperPf"] == dict(stack=32, spill_stores=24, spill_loads=16)
    assert parsed["kern"]["regs"] == 255 and parsed["kern"]["smem"] == 16384
    assert parsed["other"] == dict(regs=32, smem=0, stack=0, spill_stores=0, spill_loads=0)
    assert _nv(PTXAS_SPILLS, "kern")[:3] == (255, 56, 16384)
    assert _nv(PTXAS_SPILLS, "other")[:3] == (32, 56, 0)  # a spill anywhere counts
    assert _nv(PTXAS_SPILLS, None)[:3] == (255, 56, 16384)  # name unknown: the largest entry


def test_ptxas_nothing_reported():
    assert cuda_be.parse_ptxas_log("") == {}
    assert _nv("", "k") == (None, None, None, {})


# --------------------------------------------------------------------------- clang remarks (AMD)

# clang 19.1.7 -x hip --offload-arch=gfx942, the fused kernel at d=64 m4_b64 (it spills).
REMARKS_GFX942 = """\
/tmp/k.hip:120:1: remark: Function Name: gqa_flash_prefill [-Rpass-analysis=kernel-resource-usage]
  120 | extern "C" __global__ void HK_LAUNCH_BOUNDS(256) gqa_flash_prefill(
      | ^
/tmp/k.hip:120:1: remark:     SGPRs: 93 [-Rpass-analysis=kernel-resource-usage]
/tmp/k.hip:120:1: remark:     VGPRs: 256 [-Rpass-analysis=kernel-resource-usage]
/tmp/k.hip:120:1: remark:     AGPRs: 256 [-Rpass-analysis=kernel-resource-usage]
/tmp/k.hip:120:1: remark:     ScratchSize [bytes/lane]: 2688 [-Rpass-analysis=kernel-resource-usage]
/tmp/k.hip:120:1: remark:     Dynamic Stack: False [-Rpass-analysis=kernel-resource-usage]
/tmp/k.hip:120:1: remark:     Occupancy [waves/SIMD]: 1 [-Rpass-analysis=kernel-resource-usage]
/tmp/k.hip:120:1: remark:     SGPRs Spill: 0 [-Rpass-analysis=kernel-resource-usage]
/tmp/k.hip:120:1: remark:     VGPRs Spill: 681 [-Rpass-analysis=kernel-resource-usage]
/tmp/k.hip:120:1: remark:     LDS Size [bytes/block]: 18432 [-Rpass-analysis=kernel-resource-usage]
"""

# clang 19.1.7 --offload-arch=gfx1151 (RDNA: no AGPRs), a small kernel, plus a warning.
REMARKS_GFX1151 = """\
k.hip:2:1: remark: Function Name: add [-Rpass-analysis=kernel-resource-usage]
k.hip:2:1: remark:     SGPRs: 10 [-Rpass-analysis=kernel-resource-usage]
k.hip:2:1: remark:     VGPRs: 7 [-Rpass-analysis=kernel-resource-usage]
k.hip:2:1: remark:     ScratchSize [bytes/lane]: 0 [-Rpass-analysis=kernel-resource-usage]
k.hip:2:1: remark:     Dynamic Stack: False [-Rpass-analysis=kernel-resource-usage]
k.hip:2:1: remark:     Occupancy [waves/SIMD]: 16 [-Rpass-analysis=kernel-resource-usage]
k.hip:2:1: remark:     SGPRs Spill: 0 [-Rpass-analysis=kernel-resource-usage]
k.hip:2:1: remark:     VGPRs Spill: 0 [-Rpass-analysis=kernel-resource-usage]
k.hip:2:1: remark:     LDS Size [bytes/block]: 1024 [-Rpass-analysis=kernel-resource-usage]
k.hip:9:3: warning: unused variable 'x' [-Wunused-variable]
"""


def _amd(text, name):
    return summarize_usage(build.parse_resource_remarks(text), name, regs="vgprs", smem="lds",
                           spill_keys=build.AMD_SPILL_KEYS)


def test_remarks_gfx942_spilling_kernel():
    usage = build.parse_resource_remarks(REMARKS_GFX942)
    assert usage == {"gqa_flash_prefill": dict(
        sgprs=93, vgprs=256, agprs=256, scratch=2688, dynamic_stack=False, occupancy=1,
        sgpr_spill=0, vgpr_spill=681, lds=18432)}
    assert _amd(REMARKS_GFX942, "gqa_flash_prefill")[:3] == (256, 681, 18432)


def test_remarks_gfx1151_and_two_functions():
    both = REMARKS_GFX1151 + REMARKS_GFX942
    usage = build.parse_resource_remarks(both)
    assert set(usage) == {"add", "gqa_flash_prefill"}
    assert usage["add"] == dict(sgprs=10, vgprs=7, scratch=0, dynamic_stack=False, occupancy=16,
                                sgpr_spill=0, vgpr_spill=0, lds=1024)
    assert _amd(both, "add")[:3] == (7, 681, 1024)  # spills are module-wide
    assert build.parse_resource_remarks("no remarks here\n") == {}


@pytest.mark.parametrize("arch, version", [
    ("gfx90a", 9010), ("gfx1030", 10300), ("gfx1036", 10306), ("gfx940", 9400),
    ("gfx942", 9402), ("gfx1151", 11501), ("gfx90a:sramecc+:xnack-", 9010), ("gfx803", 8003)])
def test_isa_version_matches_rocm_device_libs(arch, version):
    # The values of ROCm's oclc_isa_version_<gfx>.bc (9010, 10300, 10306, 9400, 8003 read
    # from ROCm 5.2's files).
    assert build.isa_version(arch) == version


def test_parse_target():
    assert build.parse_target("sm_90") == ("sm_90", "nvrtc")
    assert build.parse_target("gfx90a") == ("gfx90a", "hiprtc")
    assert build.parse_target("gfx1030") == ("gfx1030", "hiprtc")
    assert build.parse_target("gfx1151") == ("gfx1151", "clang")
    assert build.parse_target("gfx942") == ("gfx942", "clang")
    assert build.parse_target(" gfx90a@clang ") == ("gfx90a", "clang")
    for bad, match in [("sm_90@clang", "cannot compile"), ("gfx90a@nvrtc", "cannot compile"),
                       ("gfx90a@gcc", "unknown compiler"), ("x86", "not an sm_XY")]:
        with pytest.raises(ValueError, match=match):
            build.parse_target(bad)


# --------------------------------------------------------------------------- code objects (hiprtc)

def _msgpack(obj) -> bytes:
    if isinstance(obj, bool):
        return b"\xc3" if obj else b"\xc2"
    if isinstance(obj, int):
        return bytes([obj]) if 0 <= obj < 128 else b"\xce" + struct.pack(">I", obj)
    if isinstance(obj, str):
        raw = obj.encode()
        return (bytes([0xA0 | len(raw)]) if len(raw) < 32 else b"\xd9" + bytes([len(raw)])) + raw
    if isinstance(obj, list):
        return bytes([0x90 | len(obj)]) + b"".join(_msgpack(x) for x in obj)
    assert isinstance(obj, dict) and len(obj) < 16
    return bytes([0x80 | len(obj)]) + b"".join(_msgpack(k) + _msgpack(v) for k, v in obj.items())


def _code_object(meta: dict) -> bytes:
    """A minimal ELF64 with one SHT_NOTE section holding an NT_AMDGPU_METADATA note."""
    desc = _msgpack(meta)
    pad = lambda b: b + b"\0" * (-len(b) % 4)  # noqa: E731
    note = struct.pack("<III", 7, len(desc), 32) + pad(b"AMDGPU\0") + pad(desc)
    shoff = 64 + len(note)
    header = (b"\x7fELF" + bytes([2, 1, 1, 0]) + b"\0" * 8
              + struct.pack("<HHIQQQIHHHHHH", 3, 224, 1, 0, 0, shoff, 0, 64, 0, 0, 64, 2, 0))
    null_sh = b"\0" * 64
    note_sh = struct.pack("<IIQQQQIIQQ", 0, 7, 0, 0, 64, len(note), 0, 0, 4, 0)
    return header + note + null_sh + note_sh


META = {"amdhsa.kernels": [{
    ".name": "gqa_flash_prefill", ".vgpr_count": 512, ".agpr_count": 256, ".sgpr_count": 34,
    ".vgpr_spill_count": 140, ".sgpr_spill_count": 0, ".group_segment_fixed_size": 18432,
    ".private_segment_fixed_size": 720, ".wavefront_size": 64, ".uses_dynamic_stack": False,
    ".symbol": "gqa_flash_prefill.kd"}], "amdhsa.target": "amdgcn-amd-amdhsa--gfx90a"}


def test_code_object_usage_from_metadata_note():
    usage = hip_be.code_object_usage(_code_object(META))
    assert usage == {"gqa_flash_prefill": dict(
        vgprs=256, vgprs_total=512, agprs=256, sgprs=34, vgpr_spill=140, sgpr_spill=0,
        lds=18432, scratch=720, wavefront_size=64, dynamic_stack=False)}
    rdna = dict(META, **{"amdhsa.target": "amdgcn-amd-amdhsa--gfx1030"})  # no unified file
    assert hip_be.code_object_usage(_code_object(rdna))["gqa_flash_prefill"]["vgprs"] == 512
    assert hip_be.amdgpu_metadata(_code_object(META))["amdhsa.target"].endswith("gfx90a")


def test_code_object_inside_an_offload_bundle():
    elf = _code_object(META)
    ident = b"hipv4-amdgcn-amd-amdhsa--gfx90a"
    head_len = 24 + 8 + 24 + len(ident)
    bundle = (b"__CLANG_OFFLOAD_BUNDLE__" + struct.pack("<Q", 1)
              + struct.pack("<QQQ", head_len, len(elf), len(ident)) + ident + elf)
    assert hip_be.code_object_usage(bundle) == hip_be.code_object_usage(elf)


def test_not_a_code_object():
    with pytest.raises(ValueError, match="ELF64"):
        hip_be.amdgpu_metadata(b"PTX text")
    with pytest.raises(ValueError, match="no AMDGPU metadata"):
        hip_be.amdgpu_metadata(_code_object(META).replace(b"AMDGPU\0", b"OTHERS\0"))


# --------------------------------------------------------------------------- check + report

def _fake_compile(tool, target, source, defines, kernel_name, workdir):
    if target == "gfx1030":
        raise BackendUnavailable("hiprtc is not importable (no module named 'hip')")
    if defines.get("BROKEN") and source != build.PROBE:
        raise CompileError(tool, "compile", 6, "COMPILATION",
                           f"k.hip(3): error: bad thing at d={defines['HEAD_DIM']}\n1 error")
    spills = 24 if defines.get("SPILLY") else 0
    return CompileResult(log="", binary=b"", regs=96, spills=spills, smem=8192, target=target,
                         details={"sgprs": 20} if tool != "nvrtc" else {"stack": spills})


VARIANTS = [build.Variant(64, "m1_b32", {"HEAD_DIM": 64}),
            build.Variant(128, "m1_b32", {"HEAD_DIM": 128})]


def test_check_rows_table_and_summary(monkeypatch):
    monkeypatch.setattr(build, "compile_with", _fake_compile)
    rows = build.check(["sm_90", "gfx1030", "gfx942"], "src", VARIANTS, "k", jobs=0)
    assert [(r.target, r.d, r.status) for r in rows] == [
        ("sm_90", 64, "ok"), ("sm_90", 128, "ok"),
        ("gfx1030", None, "skipped: hiprtc is not importable (no module named 'hip')"),
        ("gfx942", 64, "ok"), ("gfx942", 128, "ok")]
    table = build.format_table(rows)
    assert "v96 s20" in table and "8192" in table and "skipped: hiprtc" in table
    assert build.summarize(rows) == (
        True, "OK: 4 compiled clean, 0 spilled, 0 failed to compile, 1 skipped")
    ok, text = build.summarize(rows, require_all=True)
    assert not ok and "--require-all" in text


def _record_sources(monkeypatch) -> list:
    """Fake the compiler (``_fake_compile``) and return the list it fills with the (target,
    source) of each kernel compile, the toolchain probes left out."""
    seen = []

    def fake(tool, target, source, defines, kernel_name, workdir):
        if source != build.PROBE:
            seen.append((target, source))
        return _fake_compile(tool, target, source, defines, kernel_name, workdir)

    monkeypatch.setattr(build, "compile_with", fake)
    return seen


def test_mma_variants_compile_for_sm80_plus_only(monkeypatch):
    """Each variant compiles its own path's source; mma variants only for sm_80+ targets."""
    seen = _record_sources(monkeypatch)
    variants = [build.Variant(64, "m4_b64", {"HEAD_DIM": 64}),
                build.Variant(64, "mma_m4_b64", {"HEAD_DIM": 64}, "mma")]
    rows = build.check(["sm_90", "sm_75", "gfx942"], {"scalar": "S", "mma": "M"}, variants, "k",
                       jobs=0)
    assert [(r.target, r.config) for r in rows] == [
        ("sm_90", "m4_b64"), ("sm_90", "mma_m4_b64"), ("sm_75", "m4_b64"), ("gfx942", "m4_b64")]
    assert sorted(seen) == sorted([("sm_90", "S"), ("sm_90", "M"), ("sm_75", "S"), ("gfx942", "S")])


def test_kernel_variants_cover_both_paths():
    from hipkernel.config import CANDIDATES, HEAD_DIMS, MMA_CANDIDATES, MMA_DEFAULT
    from refattn.mutants import MUTANTS

    vs = build.kernel_variants(mutants=True)
    names = {(v.d, v.config, v.path) for v in vs}
    assert {(d, c.name, c.path) for d in HEAD_DIMS for c in CANDIDATES + MMA_CANDIDATES} <= names
    assert {(d, f"{MMA_DEFAULT.name}+{m.name}", "mma") for d in HEAD_DIMS for m in MUTANTS} <= names


def test_wgmma_variants_compile_for_sm90a_only(monkeypatch):
    """wgmma variants are sm_90a code: only the sm_90a target compiles them (not sm_90, whose
    PTX has no wgmma, nor sm_80 / sm_100 / AMD), from the wgmma source; sm_90a takes the
    scalar and mma variants too."""
    wg = build.Variant(64, "wgmma_m8_b64", {"HEAD_DIM": 64}, "wgmma")
    mma = build.Variant(64, "mma_m4_b64", {"HEAD_DIM": 64}, "mma")
    scalar = build.Variant(64, "m4_b64", {"HEAD_DIM": 64})
    for target in ("sm_90a", "sm_90", "sm_80", "sm_100", "sm_100a", "compute_90", "gfx942", "gfx90a"):
        assert build._compiles_for(wg, target) == (target == "sm_90a"), target
    assert build._compiles_for(mma, "sm_90a") and build._compiles_for(scalar, "sm_90a")
    seen = _record_sources(monkeypatch)
    rows = build.check(["sm_90a", "sm_90", "sm_80", "gfx942"],
                       {"scalar": "S", "mma": "M", "wgmma": "W"}, [scalar, mma, wg], "k", jobs=0)
    assert [(r.target, r.config) for r in rows] == [
        ("sm_90a", "m4_b64"), ("sm_90a", "mma_m4_b64"), ("sm_90a", "wgmma_m8_b64"),
        ("sm_90", "m4_b64"), ("sm_90", "mma_m4_b64"), ("sm_80", "m4_b64"), ("sm_80", "mma_m4_b64"),
        ("gfx942", "m4_b64")]
    assert [t for t, src in seen if src == "W"] == ["sm_90a"]
    assert build.DEFAULT_TARGETS[0] == "sm_90a" and "sm_90" in build.DEFAULT_TARGETS


def test_kernel_variants_cover_the_wgmma_path():
    from hipkernel import api
    from hipkernel.config import HEAD_DIMS, WGMMA_BY_HEAD_DIM, WGMMA_TILES
    from refattn.mutants import MUTANTS

    plain = [(v.dtype, v.d, v.config, v.path) for v in build.kernel_variants() if v.path == "wgmma"]
    assert plain == [(dt, d, c.name, "wgmma") for dt in ("fp16", "bf16") for d in HEAD_DIMS
                     for c in WGMMA_TILES[d]]
    vs = build.kernel_variants(mutants=True)
    # the mutants compile at each head dim's own wgmma tile (the one that does not spill there)
    wg_mutants = {(v.d, v.config) for v in vs if v.path == "wgmma" and "+" in v.config}
    assert wg_mutants == {(d, f"{WGMMA_BY_HEAD_DIM[d].name}+{m.name}") for d in HEAD_DIMS
                          for m in MUTANTS}
    for v in vs:
        if v.path == "wgmma" and v.config.endswith(f"+{MUTANTS[0].name}"):
            assert v.defines == api.kernel_defines(v.d, WGMMA_BY_HEAD_DIM[v.d], {MUTANTS[0].name},
                                                   v.dtype), v


def test_spill_and_error_fail_the_check(monkeypatch):
    monkeypatch.setattr(build, "compile_with", _fake_compile)
    variants = [build.Variant(64, "m4_b64", {"HEAD_DIM": 64, "SPILLY": 1}),
                build.Variant(64, "m2_b64", {"HEAD_DIM": 64, "BROKEN": 1}),
                build.Variant(128, "m2_b64", {"HEAD_DIM": 128, "BROKEN": 1})]
    rows = build.check(["sm_80"], "src", variants, "k", jobs=0)
    assert [r.status for r in rows] == ["SPILL", "ERROR", "ERROR"]
    assert rows[0].spills == 24 and "stack 24 B" in build.format_table(rows)
    ok, text = build.summarize(rows)
    assert not ok and text == "FAIL: 0 compiled clean, 1 spilled, 2 failed to compile, 0 skipped"
    report = build.error_report(rows)
    assert "--- compile error in sm_80 d=64 m2_b64 ---" in report
    assert "k.hip(3): error: bad thing at d=128" in report


def test_error_report_prints_each_distinct_log_once():
    rows = [build.Row("gfx942", "clang", d, "m1_b32", "ERROR", error="same\nlog")
            for d in (64, 128)]
    assert build.error_report(rows) == (
        "--- compile error in gfx942 d=64 m1_b32, gfx942 d=128 m1_b32 ---\nsame\nlog")


def test_probe_failure_is_a_skip_not_an_error(monkeypatch):
    def no_linker(tool, target, source, defines, kernel_name, workdir):
        raise CompileError("clang", "clang -x hip", 1, "compile failed",
                           "clang-19: error: unable to execute command: ld.lld not found")

    monkeypatch.setattr(build, "compile_with", no_linker)
    (row,) = build.check(["gfx1151"], "src", VARIANTS, "k", jobs=0)
    assert row.skipped and "ld.lld not found" in row.status and "trivial kernel" in row.status


def test_main_writes_json_and_exit_status(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(build, "compile_with", _fake_compile)
    monkeypatch.setattr(build, "kernel_variants", lambda mutants=False, dtypes=None: [
        build.Variant(64, "m1_b32", {"HEAD_DIM": 64}),
        build.Variant(64, "m4_b64", {"HEAD_DIM": 64, "SPILLY": 1})])
    out = tmp_path / "build.json"
    rc = build.main(["--targets", "sm_90,gfx1030", "--json", str(out), "--jobs", "0",
                     "--configs", "m1_b32"])
    assert rc == 0
    payload = json.loads(out.read_text())
    assert payload["ok"] and [r["status"] for r in payload["rows"]][0] == "ok"
    assert len(payload["rows"]) == 2 and payload["kernel_source_hash"]
    assert build.main(["--targets", "sm_90", "--jobs", "0"]) == 1  # the m4_b64 spill
    assert build.main(["--targets", "gfx1030", "--jobs", "0", "--require-all"]) == 1
    assert "SPILL" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        build.main(["--targets", "sm_90@hiprtc"])


# --------------------------------------------------------------------------- real compilers

TINY = """\
#include "portable_probe.h"
extern "C" __global__ void tiny(float* p, int n) {
    __shared__ float s[64];
    int i = GLOBAL_ID;
    s[i & 63] = (float)i * SCALE;
    if (i < n) p[i] = s[63 - (i & 63)];
}
""".replace('#include "portable_probe.h"\n', """\
#if defined(__HIP__) || defined(__HIPCC_RTC__)
#ifndef __global__
#define __global__ __attribute__((global))
#define __shared__ __attribute__((shared))
#endif
#define GLOBAL_ID ((int)(__builtin_amdgcn_workgroup_id_x() * 64 + __builtin_amdgcn_workitem_id_x()))
#else
#define GLOBAL_ID ((int)(blockIdx.x * blockDim.x + threadIdx.x))
#endif
""")


@pytest.mark.parametrize("target", ["sm_90", "sm_80", "gfx90a", "gfx1030", "gfx1151", "gfx942"])
def test_tiny_kernel_on_each_toolchain(target):
    rows = build.check([target], TINY, [build.Variant(64, "tiny", {"SCALE": 2})], "tiny", jobs=0)
    (row,) = rows
    if row.skipped:
        pytest.skip(row.status)
    assert row.status == "ok", row.error
    assert row.regs and row.regs > 0 and row.spills == 0
    assert row.smem == 256  # 64 floats of shared memory / LDS


def test_nvrtc_compile_error_carries_the_log():
    if cuda_be.nvrtc is None:
        pytest.skip(f"cuda-bindings not importable: {cuda_be.IMPORT_ERROR}")
    with pytest.raises(CompileError) as e:
        cuda_be.compile_offline(TINY.replace("SCALE", "NO_SUCH_NAME"), {}, "sm_90")
    assert "NO_SUCH_NAME" in e.value.log and "NVRTC_ERROR_COMPILATION" in str(e.value)


def _require_nvrtc_sm90a() -> None:
    """Skip unless this machine's NVRTC works and can compile for sm_90a."""
    try:
        cuda_be.nvrtc_version()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"NVRTC not usable here: {e}")
    archs = cuda_be.supported_archs()
    if archs and 90 not in archs:
        pytest.skip(f"this NVRTC cannot compile for sm_90a (supports {archs})")


def test_real_wgmma_kernel_sm90a(tmp_path):
    """The real check of the wgmma path for sm_90a at its tile of each head dim (wgmma_m16_b64
    at d=64, wgmma_m8_b128_ws at d=128): compiles, no spill, and no static shared memory (its
    K/V stages are the dynamic shared memory KernelConfig.dynamic_smem_bytes sizes: 96 KiB
    of stages, 192 KiB with a producer warpgroup, and 16 bytes of mbarriers a stage)."""
    _require_nvrtc_sm90a()
    from hipkernel import api
    from hipkernel.config import WGMMA_TILES, config_from_name

    if not api.KERNEL_FILES["wgmma"].exists():
        pytest.skip(f"{api.KERNEL_FILES['wgmma']} is not there")
    out = tmp_path / "sm90a.json"
    names = ",".join(c.name for tiles in WGMMA_TILES.values() for c in tiles)
    rc = build.main(["--targets", "sm_90a", "--configs", names, "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["target"], r["dtype"], r["d"], r["config"], r["status"]) for r in rows] == [
        ("sm_90a", dt, d, c.name, "ok") for dt in ("fp16", "bf16") for d, tiles in WGMMA_TILES.items()
        for c in tiles], rows
    assert rc == 0
    for r in rows:
        cfg = config_from_name(r["config"])
        assert r["spills"] == 0 and 0 < r["regs"] <= 255, r
        assert r["smem"] == 0, r
        ones = 2048 if cfg.rowsum_mma(r["d"]) else 0  # the row sums' block of ones
        used = cfg.kv_stages(r["d"]) * (cfg.smem_bytes(r["d"]) // cfg.kv_stages(r["d"]) + 16) + ones + 16 * cfg.ws
        if cfg.qsmem:  # Q's tiles after the barriers, 1024-byte aligned, inside the ws budget
            assert cfg.smem_bytes(r["d"]) + 3 * 64 * r["d"] * 2 <= 192 * 1024, r
            assert cfg.dynamic_smem_bytes(r["d"]) == -(-used // 1024) * 1024 + 3 * 64 * r["d"] * 2, r
        else:
            stages = (192 if cfg.ws else 96) * 1024
            assert cfg.smem_bytes(r["d"]) == stages, r
            assert cfg.dynamic_smem_bytes(r["d"]) == used, r


def test_every_wgmma_tile_compiles_with_dynamic_shared_memory_only():
    """Every wgmma tile that fits (m_tiles 4/8/16 x bkv 32/64/128 x each head dim, and m_tiles
    8 and 12 with a producer warpgroup, with the KV_STAGES its config gives) compiles for sm_90a
    with no static shared memory; the ones
    the tuner offers do not spill (four warpgroups at d = 128 do: 128 registers a thread
    cannot hold their accumulators, which is why d = 128 gets two)."""
    _require_nvrtc_sm90a()
    from hipkernel import api
    from hipkernel.config import HEAD_DIMS, WGMMA_TILES, KernelConfig

    tiles = [(d, KernelConfig(m, b, "wgmma")) for d in HEAD_DIMS for m in (4, 8, 16)
             for b in (32, 64, 128)]
    tiles += [(d, KernelConfig(m, b, "wgmma", ws=True)) for d in HEAD_DIMS for m in (8, 12)
              for b in (32, 64, 128)]
    # one stage of the biggest is 64 KiB of 96; four warpgroups need two (mbarrier pipeline)
    assert [(d, c.name) for d, c in tiles if not c.fits(d)] == [(128, "wgmma_m16_b128")]
    tiles = [(d, c) for d, c in tiles if c.fits(d)]
    variants = [build.Variant(d, c.name, api.kernel_defines(d, c), "wgmma") for d, c in tiles]
    rows = build.check(["sm_90a"], {"wgmma": api.kernel_source("wgmma")}, variants,
                       api.KERNEL_NAME, jobs=0)
    got = {(r.d, r.config): r for r in rows}
    assert set(got) == {(d, c.name) for d, c in tiles}
    assert all(r.status in ("ok", "SPILL") and r.smem == 0 for r in rows), \
        [(r.d, r.config, r.status, r.smem) for r in rows if r.status not in ("ok", "SPILL") or r.smem]
    assert all(got[(d, c.name)].status == "ok" for d, tiles in WGMMA_TILES.items() for c in tiles)
    assert got[(128, "wgmma_m16_b64")].status == "SPILL"


def test_real_kernel_sm90(tmp_path):
    """The real check, for sm_90 at the default config (every head dim, fp16 and bf16):
    compiles, no spill."""
    try:
        cuda_be.nvrtc_version()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"NVRTC not usable here: {e}")
    from hipkernel import api
    from hipkernel.config import DEFAULT, HEAD_DIMS

    if not api.KERNEL_FILE.exists():
        pytest.skip(f"{api.KERNEL_FILE} is not there")
    out = tmp_path / "sm90.json"
    rc = build.main(["--targets", "sm_90", "--configs", DEFAULT.name, "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["dtype"], r["d"], r["status"]) for r in rows] == [
        (dt, d, "ok") for dt in ("fp16", "bf16") for d in HEAD_DIMS], rows
    assert rc == 0
    assert all(r["regs"] <= 255 and 0 < r["smem"] <= 48 * 1024 for r in rows)  # static limit
