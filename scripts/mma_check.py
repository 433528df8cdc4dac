"""GPU check of the tensor-core paths (mma, and wgmma on sm_90; and the AMD matrix-core
kernel through its emulation): the case matrix with each path forced, the mutant kill matrix
on it, and device times of scalar vs tensor-core configs at the gpt-oss geometry.

    HIPKERNEL_CACHE_DIR=build/hkcache PYTHONPATH=. python3 scripts/mma_check.py \
        [--out DIR] [--sections matrix,sweep,mutants,time,records] [--no-prewarm]
        [--configs wgmma_m4_b64,mma_m4_b64,...] [--jobs N]

Every kernel the sections launch is compiled first, in parallel processes, into the disk
cache (``records`` only does that for what ``hipkernel.gpu_session`` compiles).

``matrix``: seed + extended + coverage + ragged suites, each case run with the first config's path at its tiles
(a case's own m_tiles / bkv win where the path allows them, so its clamp geometry is kept),
then with every other config forced; per-case relL2 against the derived gate. ``mutants``:
the kill matrix with a path forced (its clean run replaces the matrix's first pass), at
MMA_DEFAULT, the first 32-rows-a-warp config and the first wgmma config. ``sweep``:
kernel-only times (20 back-to-back launches between two events, no host synchronization)
of the scalar m4_b32 / m4_b64 and every tensor-core candidate at 512@8192 (d=64 gpt-oss full
and window 128, 512@512 window 128, d=128 Hq=32 full) and 16384@0 (full and window 128).
``--configs`` narrows matrix, mutants and sweep to the named tensor-core configs. ``time``: the same through
``Resident.time_ms`` (one synchronized API call per sample: includes host overhead).
FLOPs = 4 d Hq B sum_rows(visible keys) (hipkernel.timing).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from hipkernel import api
from hipkernel.adapter import HipKernel
from refattn.cli import _count_of
from hipkernel.config import (AMD_MMA_BKV, AMD_MMA_M_TILES, AMD_MMA_WAVE, CANDIDATES,
                              MFMA_CANDIDATES, MMA_CANDIDATES, MMA_DEFAULT, MMA_PACK_CANDIDATES,
                              MMA_WALK_CANDIDATES, MMA_WIDE_CANDIDATES, WGMMA_CANDIDATES,
                              WGMMA_WS_M_TILES, WGSPAN_CANDIDATES, WMMA_CANDIDATES, KernelConfig)

# Every tensor-core config the checks force: mma with one warp per 16 rows, with 32 rows a
# warp (warp_m = 2), with packed heads and with packed heads walking Q tiles, wgmma (a
# warpgroup per 64 rows), wgspan (a warpgroup's window chunks), and the AMD matrix-core
# kernel's first wmma and mfma configs, which run here through their emulation
# (kernels/amd_mma.h): the matrix and the kill matrix check them, the sweep does not time
# them. --configs narrows it.
AMD_CHECKED = (WMMA_CANDIDATES[0], MFMA_CANDIDATES[0])
MMA_ALL = (MMA_CANDIDATES + MMA_WIDE_CANDIDATES + MMA_PACK_CANDIDATES + MMA_WALK_CANDIDATES
           + WGMMA_CANDIDATES + WGSPAN_CANDIDATES + AMD_CHECKED)


_SECTIONS: list[str] = []
_JOBS = 1  # --jobs: processes for the mutants section
_DOC: dict = {}  # what main writes to OUT/mma_check.json (sections save into it as they go)


def _save(out: Path | None, part: dict) -> None:
    """Write the record so far (``part`` merged over it) to ``out``/mma_check.json."""
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "mma_check.json").write_text(json.dumps({**_DOC, **part}, indent=1, default=str))


def forced_tiles(cfg: KernelConfig, case_config: dict | None, G: int, ragged: bool,
                 respect_case: bool = True) -> dict:
    """The config (``api.attention``'s dict) that ``cfg`` forced on a case runs: the case's
    own m_tiles / bkv (``case_config``) where ``respect_case`` and the path allows them, the
    most of cfg's packing that the case's ``G`` allows, and no TMA producer on a ``ragged``
    case."""
    c = {"m_tiles": cfg.m_tiles, "bkv": cfg.bkv}
    if respect_case and case_config:
        c.update(case_config)
    c["path"] = cfg.path
    c["warp_m"] = cfg.warp_m if c["m_tiles"] % cfg.warp_m == 0 else 1
    # packed heads: the most of cfg.pack that the case's G allows (so cases of G 1, 2, 4
    # run PACK 1, 2, 4 and the gpt-oss ones PACK 8)
    fit = cfg.for_group(G)
    c["pack"] = fit.pack
    c["walk"] = fit.walk  # Q tiles a block walks (mma, wgspan)
    if c["path"] == "wgmma":  # 64 rows a warpgroup: keep the case's tiles where allowed
        c["m_tiles"] = c["m_tiles"] if c["m_tiles"] in (4, 8) else cfg.m_tiles
        c["bkv"] = c["bkv"] if c["bkv"] in (32, 64, 128) else cfg.bkv
        # a producer where it fits; its TMA copies bound every sequence by one key count,
        # so a ragged case runs the same tiles without it (hipkernel.api refuses the pair)
        c["ws"] = cfg.ws and c["m_tiles"] in WGMMA_WS_M_TILES and not ragged
        if c["m_tiles"] == 12 and not c["ws"]:  # three warpgroups need the producer: two
            c["m_tiles"] = 8
    if c["path"] == "wgspan":  # its own chunk sizes: the config's tiles
        c["m_tiles"], c["bkv"] = cfg.m_tiles, cfg.bkv
    if c["path"] in AMD_MMA_WAVE:  # a wave per 16 rows: the case's tiles where allowed
        c["m_tiles"] = c["m_tiles"] if c["m_tiles"] in AMD_MMA_M_TILES else cfg.m_tiles
        c["bkv"] = c["bkv"] if c["bkv"] in AMD_MMA_BKV else cfg.bkv
    return c


class ForcedKernel(HipKernel):
    """hipkernel on CUDA with ``cfg`` forced (the case's own m_tiles / bkv win if
    ``respect_case``; :func:`forced_tiles`)."""

    def __init__(self, cfg: KernelConfig, respect_case: bool = True, mutants=frozenset()):
        super().__init__("cuda", mutants)
        self.cfg, self.respect_case = cfg, respect_case
        self.name = f"hipkernel:{cfg.name}" + (f"+{'+'.join(sorted(mutants))}" if mutants else "")

    def run(self, inputs):
        c = forced_tiles(self.cfg, inputs.config, inputs.q.shape[2] // inputs.k.shape[1],
                         inputs.ragged, self.respect_case)
        fp16 = inputs.dtype == "fp16"  # a bf16 result is float32 (bf16 values), a new array
        status, out = api.attention(inputs.q, inputs.k, inputs.v, out=inputs.out if fp16 else None,
                                    config=c, backend=self._backend or "cuda", mutants=self.active,
                                    dtype=inputs.dtype, **self._kw(inputs))
        return status, inputs.out if out is None else out


def _line(r) -> str:
    rel = "-" if r.rel_l2 is None else f"{r.rel_l2:.3e}"
    gate = "-" if r.gate is None else f"{r.gate:.3e}"
    mx = "-" if r.max_abs is None else f"{r.max_abs:.3e}"
    return f"{r.outcome:<10} {r.case:<42} relL2 {rel} (gate {gate}) maxabs {mx}"


def section_matrix(out: Path) -> dict:
    from refattn.cases import load_suites
    from refattn.runner import run_matrix

    cases = load_suites(["seed", "extended", "coverage", "ragged"])
    doc = {}
    for i, cfg in enumerate(MMA_ALL):
        if i == 0 and "mutants" in _SECTIONS:
            continue  # the kill matrix's clean run is this pass
        t0 = time.perf_counter()
        m = run_matrix(ForcedKernel(cfg, respect_case=(i == 0)), cases)
        bad = [r for r in m.results if r.outcome not in ("pass", "declined")]
        print(f"== matrix {cfg.name}{' (case configs kept)' if i == 0 else ' (forced)'}: "
              f"{m.counts()} in {time.perf_counter() - t0:.1f} s", flush=True)
        for r in (m.results if i == 0 or len(cases) < 10 else bad):
            print("  " + _line(r), flush=True)
            if r.outcome not in ("pass", "declined"):
                print("    " + r.failure_message().replace("\n", "\n    ")[:1500], flush=True)
        doc[cfg.name] = m.to_json()
    return doc


def section_time(out: Path) -> list:
    from hipkernel.backends import get_backend
    from hipkernel.timing import Resident, flops

    be = get_backend("cuda")
    rows = []
    for past, window in ((8192, -1), (8192, 128), (512, 128)):
        r = Resident(be, B=1, Sq=512, Hq=64, Hkv=8, d=64, past_len=past)
        try:
            f = flops(1, 512, 64, 64, past, window)
            for cfg in CANDIDATES + MMA_ALL:
                if (cfg.path == "scalar" and cfg.name not in ("m4_b32", "m2_b32")
                        or cfg.path in AMD_MMA_WAVE):  # emulated: its time means nothing
                    continue
                ms = r.time_ms(window=window, config=cfg, warmup=10, reps=30)
                rows.append({"past_len": past, "window": window, "config": cfg.name, "ms": ms,
                             "tflops": f / ms / 1e9})
                print(f"  512@{past} w{window:<4} {cfg.name:<12} {ms:8.4f} ms  "
                      f"{f / ms / 1e9:7.1f} TF/s", flush=True)
        finally:
            r.free()
    return rows


# MIN_BLOCKS values of the sweep: None is the kernel's own choice; 0 ptxas' heuristic.
# Extend it (e.g. (None, 0, 1, 2, 3, 4)) to re-derive the kernel's MIN_BLOCKS choice.
_SWEEP_MB = (None,)
_SWEEP_GEOMS = ((64, 64, 512, 8192, -1), (64, 64, 512, 8192, 128), (64, 64, 512, 512, 128),
                (128, 32, 512, 8192, -1), (64, 64, 16384, 0, -1), (64, 64, 16384, 0, 128),
                (128, 32, 16384, 0, -1))  # d, Hq, Sq, past_len, W


def _sweep_jobs():
    for d in (64, 128):
        for c in MMA_ALL:
            if (c.warp_m == 2 and d != 64) or not c.fits(d) or c.path in AMD_MMA_WAVE:
                continue
            for mb in _SWEEP_MB:
                if mb is None or 65536 // (c.threads * max(mb, 1)) >= (96 if d == 64 else 168):
                    yield d, c, mb


def raw_ms(be, r, kern, cfg, window, sink_mode=1, n=20) -> float:
    """Device time of one launch, from n back-to-back launches between two events (no host
    synchronization in between, so launch overhead hides behind the kernels)."""
    from hipkernel.timing import burst_ms

    g = r.geom
    return burst_ms(be, kern, cfg.grid(g["Sq"], g["Hq"], g["B"]), (cfg.threads, 1, 1),
                    r.kernel_args(cfg, window, sink_mode), cfg.dynamic_smem_bytes(g["d"]), n=n)


def section_sweep(out: Path) -> list:
    """Kernel-only times (back-to-back launches) of every mma config x MIN_BLOCKS, and of
    the scalar m4_b32, at 512@8192 (d=64 gpt-oss full and w128; d=128 Hq=32 full)."""
    from hipkernel.backends import get_backend
    from hipkernel.timing import Resident, flops

    be = get_backend("cuda")
    rows = []
    for d, Hq, Sq, past, window in _SWEEP_GEOMS:
        r = Resident(be, B=1, Sq=Sq, Hq=Hq, Hkv=8, d=d, past_len=past)
        f = flops(1, Sq, Hq, d, past, window)
        try:
            scalar = [(KernelConfig(4, 32), None), (KernelConfig(4, 64), None)] if Sq <= 512 else []
            variants = scalar + [(c, mb) for dd, c, mb in _sweep_jobs() if dd == d]
            for cfg, mb in variants:
                defines = dict(api.kernel_defines(d, cfg))
                if mb is not None:
                    defines["MIN_BLOCKS"] = mb
                kern = be.compile(api.kernel_source(cfg.path), defines, api.KERNEL_NAME)
                ms = raw_ms(be, r, kern, cfg, window)
                info = kern.info
                rows.append({"d": d, "Hq": Hq, "Sq": Sq, "past_len": past, "window": window,
                             "config": cfg.name, "min_blocks": mb, "ms": ms, "tflops": f / ms / 1e9,
                             "regs": info.regs, "spills": info.spills})
                print(f"  d{d} {Sq}@{past} w{window:<4} {cfg.name:<13} mb {mb!s:<4} {ms:8.4f} ms "
                      f"{f / ms / 1e9:6.1f} TF/s  regs {info.regs} spills {info.spills}", flush=True)
        finally:
            r.free()
    return rows


def _kill_matrix(cfg: KernelConfig) -> tuple[str, dict]:
    """One forced config's kill matrix over seed + extended + coverage + ragged: (printed grid and verdict, JSON)."""
    from dataclasses import replace

    from hipkernel.config import EQUIVALENT_ON_PATH
    from refattn.cases import load_suites
    from refattn.killmatrix import format_grid, run_kill_matrix

    km = run_kill_matrix(lambda mutants: ForcedKernel(cfg, mutants=mutants),
                         load_suites(["seed", "extended", "coverage", "ragged"]))
    why = EQUIVALENT_ON_PATH.get(cfg.path, {})
    km.mutants = [replace(m, equivalent=why[m.name]) if m.name in why and not m.killed else m
                  for m in km.mutants]
    text = (f"{format_grid(km)}\n== mutants ({cfg.name}): ok={km.ok} clean_ok={km.clean_ok} "
            f"survivors={[m.name for m in km.mutants if not m.killed]}")
    return text, km.to_json()


def mutant_configs() -> list[KernelConfig]:
    """The configs the kill matrices force (section_mutants), narrowed by --configs."""
    cfgs = [c for c in (MMA_DEFAULT, MMA_WIDE_CANDIDATES[0], MMA_WALK_CANDIDATES[-1],
                        *WGMMA_CANDIDATES, *WGSPAN_CANDIDATES) if c in MMA_ALL]
    return cfgs + [c for c in MMA_ALL if c.path in AMD_MMA_WAVE]


def forced_builds(cases, cfgs, first_only: bool = False) -> set[tuple]:
    """The kernel builds, (config, head dim, dtype), that forcing each of ``cfgs`` on
    ``cases`` launches (:func:`forced_tiles`: each keeps the cases' own tiles where its path
    allows, as the kill matrices run them; with ``first_only`` only the first does, as
    section_matrix runs them). A case the kernel declines (a head dim or dtype it does not
    compile) or a config api.attention refuses adds nothing."""
    from hipkernel.config import DTYPES, HEAD_DIMS

    builds = set()
    for i, cfg in enumerate(cfgs):
        for case in cases:
            if case.d not in HEAD_DIMS or case.dtype not in DTYPES:
                continue
            c = forced_tiles(cfg, case.config, case.Hq // case.Hkv, case.ragged,
                             respect_case=not first_only or i == 0)
            try:
                k = api._check_config(c)
            except ValueError:
                continue
            if k.fits(case.d):
                builds.add((k, case.d, case.dtype))
    return builds


def section_mutants(out: Path) -> dict:
    """The kill matrix with a tensor-core path forced (case tiles kept where allowed): at
    MMA_DEFAULT, the first 32-rows-a-warp config, the widest packed config walking Q tiles
    (each case at the most of its packing that its G allows; its Q tiles are the unwalked
    packed tile's, and under the windows whose KV span fits it keeps their K/V tiles in its
    ring), each head dim's wgmma config, the wgspan configs, and the emulated AMD configs
    (``AMD_CHECKED``). A mutant that ``EQUIVALENT_ON_PATH`` names for a config's path counts
    as equivalent there when it survives.

    With ``--jobs N`` the configs run in N processes at once on the one GPU (nothing here is
    timed, so they may share it; on the H200 five took 141 s, one at a time over 540); their results
    are written as each config finishes, so a run cut by its time limit keeps the finished
    configs, and ``mutants_planned`` names every config it was to force. A second run with
    ``--configs`` set to the rest, its JSON beside the first as ``mma_check-<n>.json``,
    completes it (``python -m hipkernel.record --collect`` merges them)."""
    cfgs = mutant_configs()
    doc: dict = {}
    # the plan first: a run cut by its limit says which configs it did not reach
    _DOC["mutants_planned"] = [c.name for c in cfgs]
    _save(out, {"mutants": doc})

    def done(cfg, result):
        text, body = result
        print(text, flush=True)
        doc[cfg.name] = body
        _save(out, {"mutants": doc})

    if _JOBS == 1:
        for cfg in cfgs:
            done(cfg, _kill_matrix(cfg))
    else:
        from refattn.killmatrix import in_processes

        in_processes(_kill_matrix, cfgs, _JOBS, done)
    return {c.name: doc[c.name] for c in cfgs}  # in the configs' order, not finishing order


def _compile_one(job) -> str:
    path, d, m_tiles, bkv, mutants, mb, warp_m, ws, pack, dtype, walk = job
    from hipkernel.backends import get_backend

    be = get_backend("cuda")
    cfg = KernelConfig(m_tiles, bkv, path, warp_m, ws, pack, walk)
    t0 = time.perf_counter()
    defines = dict(api.kernel_defines(d, cfg, mutants, dtype))
    if mb is not None:
        defines["MIN_BLOCKS"] = mb
    k = be.compile(api.kernel_source(path), defines, api.KERNEL_NAME)
    info = k.info
    return (f"{cfg.name} d={d} {dtype} mb={mb} {'+'.join(sorted(mutants)) or '-'}: regs {info.regs} spills "
            f"{info.spills} smem {info.smem} ({time.perf_counter() - t0:.1f} s)")


def prewarm_jobs(sections) -> set[tuple]:
    """The compile jobs of every kernel the sections launch: (path, d, m_tiles, bkv,
    mutants, MIN_BLOCKS, warp_m, ws, pack, dtype, walk), as :func:`_compile_one` takes them.
    The matrix and the kill matrices derive theirs from the cases (:func:`forced_builds`):
    the forced tiles of every case, in its dtype, so that no section compiles on its own
    (a kill matrix compiles what the cache lacks in its one process, serially: the wgspan
    config's alone launches 147 builds, its tiles at each packing the cases' G leave it, in
    both head dims and both dtypes, clean and with each mutant)."""
    from refattn.mutants import MUTANTS

    none = frozenset()

    def job(cfg: KernelConfig, d: int, mutants=none, mb=None, dtype="fp16") -> tuple:
        return (cfg.path, d, cfg.m_tiles, cfg.bkv, mutants, mb, cfg.warp_m, cfg.ws, cfg.pack, dtype,
                cfg.walk)

    jobs = set()
    if "matrix" in sections or "mutants" in sections:
        from refattn.cases import load_suites

        cases = load_suites(["seed", "extended", "coverage", "ragged"])
    if "matrix" in sections:  # what the matrix launches: the first config at the cases' tiles
        jobs |= {job(c, d, dtype=dt) for c, d, dt in forced_builds(cases, MMA_ALL, first_only=True)}
    if "time" in sections:
        jobs |= {job(KernelConfig(m, 32), 64) for m in (2, 4)}
        jobs |= {job(c, 64) for c in MMA_ALL}
    if "sweep" in sections:
        jobs |= {job(KernelConfig(4, b), d) for d in (64, 128) for b in (32, 64)}
        jobs |= {job(c, d, mb=mb) for d, c, mb in _sweep_jobs()}
    if "mutants" in sections:  # what the kill matrices launch: clean and each mutant
        jobs |= {job(c, d, mut, dtype=dt) for c, d, dt in forced_builds(cases, mutant_configs())
                 for mut in [none] + [frozenset({mu.name}) for mu in MUTANTS]}
    if "records" in sections:  # what hipkernel.gpu_session compiles: every candidate, and
        # the mutants at the default config (HIPKERNEL_TUNE=0) and at the cases' own configs
        from hipkernel.config import candidates, default_config

        d0 = default_config("sm_90")
        jobs |= {job(c, d) for d in (64, 128) for c in candidates("sm_90", d)}
        jobs |= {job(d0, d, frozenset({mu.name})) for d in (64, 128) for mu in MUTANTS}
        jobs |= {job(KernelConfig(m, b), 64, mut) for m, b in ((1, 32), (4, 32), (4, 64))
                 for mut in [none] + [frozenset({mu.name}) for mu in MUTANTS]}
        # ... and the same in bf16 (the bf16 suite; ragged cases in bf16), without TMA
        jobs |= {job(c, d, dtype="bf16") for d in (64, 128) for c in candidates("sm_90", d) if not c.tma}
        jobs |= {job(d0, d, frozenset({mu.name}), dtype="bf16") for d in (64, 128) for mu in MUTANTS}
        jobs |= {job(KernelConfig(m, b), 64, mut, dtype="bf16") for m, b in ((1, 32), (4, 32), (4, 64))
                 for mut in [none] + [frozenset({mu.name}) for mu in MUTANTS]}
    return jobs


def prewarm(sections) -> None:
    """Compile every kernel the sections launch (:func:`prewarm_jobs`), in parallel
    processes, into the disk cache (``$HIPKERNEL_CACHE_DIR``), so the sections themselves
    only load binaries."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    jobs = prewarm_jobs(sections)
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 1),
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        for line in pool.map(_compile_one, sorted(jobs, key=str)):
            print("  compiled " + line, flush=True)
    print(f"== prewarm: {len(jobs)} kernels in {time.perf_counter() - t0:.1f} s", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--sections", default="matrix,time")
    ap.add_argument("--no-prewarm", action="store_true")
    ap.add_argument("--prewarm-only", action="store_true",
                    help="compile what the sections need into the disk cache, run nothing")
    ap.add_argument("--configs", default=None,
                    help="comma-separated tensor-core config names to check (default: all)")
    ap.add_argument("--jobs", type=_count_of("process", "processes"), default=1,
                    help="processes for the mutants section's configs, all on the one GPU "
                         "(default 1)")
    args = ap.parse_args(argv)
    global _JOBS
    _JOBS = args.jobs
    if args.configs:
        from hipkernel.config import config_from_name

        global MMA_ALL
        MMA_ALL = tuple(config_from_name(n) for n in args.configs.split(","))
    _SECTIONS.extend(args.sections.split(","))
    if not args.no_prewarm:
        prewarm(args.sections.split(","))
    if args.prewarm_only:
        return 0
    doc = _DOC
    doc["kernel_source_hash"] = api.source_hash()  # what python -m hipkernel.record --collect checks
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        print(f"== {name}", flush=True)
        fn = {"matrix": section_matrix, "time": section_time, "mutants": section_mutants,
              "sweep": section_sweep, "records": lambda out: None}[name]
        try:
            doc[name] = fn(args.out)
        except Exception:  # noqa: BLE001 - report and go on
            import traceback

            traceback.print_exc()
            doc[name] = "error"
        print(f"== {name} done in {time.perf_counter() - t0:.1f} s", flush=True)
        _save(args.out, {})
    return 0


if __name__ == "__main__":
    sys.exit(main())
