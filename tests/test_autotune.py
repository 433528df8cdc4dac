"""Autotune cache keys (docs/semantics.md, Kernel contract): one sweep per (d, sq, Hq, G,
window, dtype, arch), never per skv; the window is in the key; tuning launches omit the sink."""

import pytest

from hipkernel import api
from hipkernel.autotune import TUNER, Autotuner, prune_by_model, tune_key
from hipkernel.config import CANDIDATES, DEFAULT
from tests.fake_backend import RecordingBackend

# gpt-oss geometry
GEOM = dict(B=1, Hq=64, Hkv=8, d=64)
SINK_PTR = 0xBEE0  # a fake device pointer: must never reach a tuning launch


@pytest.fixture(autouse=True)
def fresh_tuner(monkeypatch):
    monkeypatch.setenv("HIPKERNEL_TUNE", "1")
    monkeypatch.delenv("HIPKERNEL_TUNE_DEBUG", raising=False)
    TUNER.clear()
    yield
    TUNER.clear()


def prefill_chunk(be, past_len, window=-1, sq=512, S_cap=16384):
    return api.flash_prefill_v3(be, 0x100, 0x200, 0x300, SINK_PTR, 0x500, Sq=sq, S_cap=S_cap, past_len=past_len,
                                window=window, sink_mode="per_head", **GEOM)


def test_chunked_16k_prefill_sweeps_once():
    fastest = CANDIDATES[-1]
    be = RecordingBackend(times={(c.m_tiles, c.bkv): (0.5 if c == fastest else 2.0) for c in CANDIDATES})
    for chunk in range(32):  # 32 chunks of 512 = 16384 tokens, skv grows every call
        assert prefill_chunk(be, past_len=chunk * 512) == 0
    assert TUNER.sweeps == 1
    tuning = [l for l in be.launches if l["tuning"]]
    real = [l for l in be.launches if not l["tuning"]]
    # per candidate, the probe: one launch, then one short burst sized from its time. The
    # others' probes are 4x the fastest's, so it is the only finalist: nothing to time in full
    per_cfg = {c: sum(1 for l in tuning if (l["kernel"]["M_TILES"], l["kernel"]["BKV"]) == (c.m_tiles, c.bkv))
               for c in CANDIDATES}
    probe = {c: 1 + api.tune_burst_length(0.5 if c == fastest else 2.0, api.TUNE_PROBE_BURST_MS)
             for c in CANDIDATES}
    assert per_cfg == probe
    assert TUNER.choices()[0]["times_ms"] == {}
    assert set(TUNER.choices()[0]["probe_ms"]) == {c.name for c in CANDIDATES}
    assert len(real) == 32
    assert all(l["kernel"]["M_TILES"] == fastest.m_tiles and l["kernel"]["BKV"] == fastest.bkv for l in real)


def test_window_change_triggers_new_sweep():
    be = RecordingBackend()
    prefill_chunk(be, 0, window=-1)
    prefill_chunk(be, 512, window=-1)
    prefill_chunk(be, 512, window=128)
    prefill_chunk(be, 8192, window=128)
    assert TUNER.sweeps == 2
    prefill_chunk(be, 0, window=100)
    assert TUNER.sweeps == 3


def test_sink_absent_from_tuning_launches():
    be = RecordingBackend()
    prefill_chunk(be, 1024)
    tuning = [l for l in be.launches if l["tuning"]]
    real = [l for l in be.launches if not l["tuning"]]
    assert tuning and real
    # args: q, k, v, sink, out, Sq, Hq, Hkv, S_cap, past_len, window, sink_mode, scale
    assert all(l["args"][3] == 0 and l["args"][11] == 0 for l in tuning)
    assert real[0]["args"][3] == SINK_PTR and real[0]["args"][11] == 1


def test_tune_disabled_uses_default(monkeypatch):
    monkeypatch.setenv("HIPKERNEL_TUNE", "0")
    be = RecordingBackend()
    prefill_chunk(be, 0)
    assert TUNER.sweeps == 0
    assert not any(l["tuning"] for l in be.launches)
    k = be.launches[0]["kernel"]
    assert (k["M_TILES"], k["BKV"]) == (DEFAULT.m_tiles, DEFAULT.bkv)


def test_debug_logs_each_candidate(monkeypatch):
    monkeypatch.setenv("HIPKERNEL_TUNE_DEBUG", "1")
    lines = []
    t = Autotuner(log=lines.append)
    t.choose(("k",), lambda cfg: [1.0 + cfg.m_tiles])
    assert sum(cfg.name in l for cfg in CANDIDATES for l in lines) >= len(CANDIDATES)
    assert any("chose" in l for l in lines)


def test_key_ignores_skv_and_includes_window():
    a = tune_key(d=64, sq=512, Hq=64, G=8, window=-1, dtype="fp16", arch="sm_90")
    b = tune_key(d=64, sq=512, Hq=64, G=8, window=128, dtype="fp16", arch="sm_90")
    assert a != b and len(a) == 8


def test_key_has_the_dtype_and_whether_ragged_but_no_lengths():
    """bf16 and fp16 tune apart, and so do ragged and uniform calls (a ragged call cannot run
    the TMA configs); the key holds no length of either."""
    geom = dict(d=128, sq=512, Hq=64, G=8, window=-1, arch="sm_90")
    keys = {tune_key(dtype=dt, ragged=r, **geom) for dt in ("fp16", "bf16") for r in (False, True)}
    assert len(keys) == 4
    assert tune_key(dtype="fp16", **geom) == tune_key(dtype="fp16", ragged=False, **geom)
    choice = Autotuner(log=lambda m: None)
    choice.cache[tune_key(dtype="bf16", ragged=True, **geom)] = DEFAULT
    (row,) = choice.choices()
    assert row["dtype"] == "bf16" and row["ragged"] is True and row["config"] == DEFAULT.name


def test_explicit_config_skips_tuning():
    be = RecordingBackend()
    api.flash_prefill_v3(be, 0x100, 0x200, 0x300, 0, 0x500, Sq=512, S_cap=1024, past_len=512, config={"bkv": 32}, **GEOM)
    assert TUNER.sweeps == 0
    assert be.launches[0]["kernel"]["BKV"] == 32


# ---- candidates per target (hipkernel.config.candidates) -------------------------------

def test_sweep_covers_the_targets_candidates():
    """On sm_80+ the sweep times the mma configs, compiled from the mma source, and not the
    scalar ones (the model of the work prunes them there). On sm_90, under full attention,
    it times only the wgmma tiles of the head dim, compiled from the wgmma source (rule b),
    and, knowing the SMs, only the tile the grid model cannot rule out (rule c): the
    chunk's 512 rows fill one wave of 256-row blocks. Under a 128-key window the mma
    configs and the wgspan tile are timed too, and an mma config may win. Elsewhere only
    the scalar configs run."""
    from hipkernel.config import (MMA_CANDIDATES, MMA_PACK_CANDIDATES, MMA_WALK_CANDIDATES,
                                  MMA_WIDE_CANDIDATES, WGMMA_TILES, candidates)

    fastest = MMA_CANDIDATES[1]
    path_of = {api.kernel_source(p): p for p in api.KERNEL_FILES}

    def recording(be):
        sources = []
        compile_ = be.compile
        be.compile = lambda src, defines, name: (sources.append(path_of.get(src, "?")),
                                                 compile_(src, defines, name))[1]
        return sources

    be = RecordingBackend(arch="sm_90",
                          times={(fastest.m_tiles, fastest.bkv): 0.1})
    sources = recording(be)
    prefill_chunk(be, 512)
    n_mma = (len(MMA_CANDIDATES) + len(MMA_WIDE_CANDIDATES) + len(MMA_PACK_CANDIDATES)
             + len(MMA_WALK_CANDIDATES))  # G = 8, d = 64
    n_cands = len(candidates("sm_90", 64, GEOM["Hq"] // GEOM["Hkv"], -1))  # no window: no wgspan
    assert n_cands == len(CANDIDATES) + n_mma + len(WGMMA_TILES[64])
    tiles = len(WGMMA_TILES[64])
    # one compile per candidate probed, one per finalist timed in full, then the chosen one's
    assert sources == ["wgmma"] * (tiles + len(TUNER.choices()[0]["times_ms"]) + 1), sources
    assert set(TUNER.choices()[0]["probe_ms"]) == {c.name for c in WGMMA_TILES[64]}
    assert TUNER.choices()[0]["work"]["sm_count"] is None and TUNER.choices()[0]["model"] == {}
    TUNER.clear()
    be = RecordingBackend(arch="sm_90", times={(fastest.m_tiles, fastest.bkv): 0.1})
    be.sm_count = 132
    sources = recording(be)
    prefill_chunk(be, 512)
    (row,) = TUNER.choices()
    assert sources == ["wgmma"] and row["config"] == "wgmma_m16_b64", sources
    assert row["probe_ms"] == row["times_ms"] == {} and row["model"]["wgmma_m12_b128_ws"] == pytest.approx(1.406, abs=1e-3)
    # under a window of 128 keys (G = 8, d = 64) the mma configs, the tiles and the wgspan tile
    windowed = RecordingBackend(arch="sm_90", times={(fastest.m_tiles, fastest.bkv): 0.1})
    w_sources = recording(windowed)
    prefill_chunk(windowed, 512, window=128)
    n_timed = n_mma + tiles + 1
    assert w_sources[:n_timed] == ["mma"] * n_mma + ["wgmma"] * tiles + ["wgspan"], w_sources
    assert "wgspan_m4_b136_p8_q4" in TUNER.choices()[-1]["probe_ms"], "wgspan tile not timed"
    assert TUNER.choices()[-1]["config"] == fastest.name
    sm80 = RecordingBackend(arch="sm_80")  # tensor cores, no wgmma
    sm80_sources = recording(sm80)
    prefill_chunk(sm80, 512)
    n80 = len(prune_by_model(candidates("sm_80", 64, GEOM["Hq"] // GEOM["Hkv"], -1), "sm_80"))
    assert len(sm80_sources) == n80 + len(TUNER.choices()[-1]["times_ms"]) + 1
    assert "wgmma" not in sm80_sources and "scalar" not in sm80_sources
    amd = RecordingBackend(arch="gfx1151")
    amd_sources = recording(amd)
    prefill_chunk(amd, 512)
    assert amd_sources[:len(CANDIDATES)] == ["scalar"] * len(CANDIDATES), amd_sources
    assert len(amd_sources) == len(CANDIDATES) + len(TUNER.choices()[-1]["times_ms"]) + 1


def test_amd_sweep_adds_the_matrix_core_configs_when_asked(monkeypatch):
    """$HIPKERNEL_AMD_MMA=1 on gfx1151: the sweep also times the wmma configs, compiled from
    the amdmma source with WAVE=32 (and mfma, WAVE=64, on gfx942)."""
    from hipkernel.config import AMD_MMA_ENV, MFMA_CANDIDATES, WMMA_CANDIDATES

    monkeypatch.setenv(AMD_MMA_ENV, "1")
    for arch, cands, wave in (("gfx1151", WMMA_CANDIDATES, 32), ("gfx942", MFMA_CANDIDATES, 64)):
        TUNER.clear()
        be = RecordingBackend(arch=arch)
        prefill_chunk(be, 512)
        tuned = {(l["kernel"]["M_TILES"], l["kernel"]["BKV"], l["kernel"].get("WAVE"))
                 for l in be.launches if l["tuning"]}
        assert tuned == ({(c.m_tiles, c.bkv, None) for c in CANDIDATES}
                         | {(c.m_tiles, c.bkv, wave) for c in cands}), tuned
        assert set(TUNER.choices()[0]["probe_ms"]) == {c.name for c in CANDIDATES + cands}


def test_packed_configs_are_offered_where_G_allows_them():
    """A packed config's heads share a KV head: the tuner offers it only where G % pack == 0,
    and the sweep launches it on the packed grid (Sq / (BM / pack), Hq / pack)."""
    from hipkernel.config import MMA_PACK_CANDIDATES, candidates

    assert {c.pack for c in MMA_PACK_CANDIDATES} == {4, 8}
    for G, packs in ((1, set()), (2, set()), (4, {4}), (8, {4, 8}), (16, {4, 8})):
        got = {c.pack for c in candidates("sm_90", 64, G) if c.pack > 1}
        assert got == packs, G
    assert {c.pack for c in candidates("sm_90")} >= {4, 8}  # G unknown: every config
    assert all(c.pack == 1 for c in candidates("gfx942", 64, 8))  # mma only: not on AMD
    be = RecordingBackend(arch="sm_90")
    prefill_chunk(be, 512, window=128)
    grids = {tuple(l["grid"]) for l in be.launches if l["tuning"]}
    assert (512 // 8, 64 // 8, 1) in grids and (512 // 16, 64 // 4, 1) in grids, grids
    assert (512 // 64, 64, 1) in grids


def test_tune_disabled_uses_the_targets_default(monkeypatch):
    from hipkernel.config import MMA_DEFAULT

    monkeypatch.setenv("HIPKERNEL_TUNE", "0")
    be = RecordingBackend(arch="sm_90")
    src = []
    compile_ = be.compile
    be.compile = lambda s, d, n: (src.append(s), compile_(s, d, n))[1]
    prefill_chunk(be, 0)
    k = be.launches[0]["kernel"]
    assert (k["M_TILES"], k["BKV"]) == (MMA_DEFAULT.m_tiles, MMA_DEFAULT.bkv)
    assert src[0] == api.kernel_source("mma")
    assert be.launches[0]["block"] == (MMA_DEFAULT.threads, 1, 1)


def test_choose_takes_candidates_per_call():
    from hipkernel.config import KernelConfig

    t = Autotuner(log=lambda m: None)
    a, b = KernelConfig(1, 32), KernelConfig(2, 64, "mma")
    assert t.choose(("x",), lambda c: 2.0 if c == a else 1.0, candidates=(a, b)) == b
    assert t.choose(("y",), lambda c: 1.0, candidates=(a,)) == a
    with pytest.raises(ValueError, match="^candidates"):
        t.choose(("z",), lambda c: 1.0, candidates=())


class LaunchLatencyBackend(RecordingBackend):
    """A timed sample costs ``latency`` (the host's cost of the first launch, seen by the
    events because the GPU is idle) plus n launches of the config's kernel time. The latency
    differs per config, as host jitter does between candidates."""

    def __init__(self, kernel_ms, latency_ms):
        super().__init__(times=kernel_ms)
        self.latency_ms = latency_ms

    def time_ms(self, fn, warmup=1, reps=3):
        before = len(self.launches)
        [t] = set(super().time_ms(fn, warmup=warmup, reps=1))
        cfg = self.launches[-1]["kernel"]
        return [t + self.latency_ms[(cfg["M_TILES"], cfg["BKV"])]] * reps


def test_burst_timing_amortises_launch_latency():
    """One event pair around one launch would pick the slower kernel here (0.2 + 0.025 ms >
    0 + 0.08 ms); bursts amortise the latency and pick the faster one."""
    fast, slow = CANDIDATES[0], CANDIDATES[1]
    kernel = {(fast.m_tiles, fast.bkv): 0.025, (slow.m_tiles, slow.bkv): 0.08}
    latency = {(fast.m_tiles, fast.bkv): 0.2, (slow.m_tiles, slow.bkv): 0.0}
    be = LaunchLatencyBackend(kernel, latency)
    single = {c: be.time_ms(lambda c=c: be.launch({"M_TILES": c.m_tiles, "BKV": c.bkv}, 1, 1, []))[0]
              for c in (fast, slow)}
    assert single[fast] > single[slow]  # the naive timer's verdict: wrong
    times = {c: api.tune_times_ms(be, lambda c=c: be.launch({"M_TILES": c.m_tiles, "BKV": c.bkv}, 1, 1, []))
             for c in (fast, slow)}
    assert max(times[fast]) < min(times[slow])
    assert times[slow] == pytest.approx([0.08] * api.TUNE_SAMPLES)


class HostBoundBackend(RecordingBackend):
    """Launches the host enqueues more slowly than the GPU runs them: without a hold the
    events of a burst of n launches see n * max(kernel, HOST_MS), behind one n * kernel."""

    HOST_MS = 0.04

    def __init__(self, kernel_ms):
        super().__init__(times=kernel_ms)
        self.holds = []

    def hold(self, ms):
        self.holds.append(ms)

    def time_ms(self, fn, warmup=1, reps=3, hold_ms=0.0):
        if hold_ms > 0:
            self.hold(hold_ms)
        before = len(self.launches)
        [t] = set(super().time_ms(fn, warmup=warmup, reps=1))
        n = len(self.launches) - before
        return [t if hold_ms > 0 else n * max(t / n, self.HOST_MS)] * reps


class HostBoundNoHold(HostBoundBackend):
    hold = None  # a backend without a hold (the attribute exists but is not callable)


def test_sweep_behind_a_hold_times_the_kernel_not_the_host():
    """A 512-row chunk under a 128-key window: 0.014 ms on the GPU against ~0.04 ms to
    enqueue. Timed bare, every candidate takes the host's time and the pick is a tie; behind
    a hold, the faster kernel wins."""
    fast, slow = CANDIDATES[0], CANDIDATES[1]
    kernel = {(fast.m_tiles, fast.bkv): 0.014, (slow.m_tiles, slow.bkv): 0.02}
    run = lambda be, c: api.tune_times_ms(  # noqa: E731
        be, lambda: be.launch({"M_TILES": c.m_tiles, "BKV": c.bkv}, 1, 1, []))
    be = HostBoundBackend(kernel)
    times = {c: run(be, c) for c in (fast, slow)}
    assert times[fast] == pytest.approx([0.014] * api.TUNE_SAMPLES)
    assert times[slow] == pytest.approx([0.02] * api.TUNE_SAMPLES)
    assert len(be.holds) == 2 and all(0.5 <= h <= api.TUNE_HOLD_MAX_MS for h in be.holds)
    bare = HostBoundNoHold(kernel)  # the same sweep without a hold: a tie at the host's time
    assert run(bare, fast) == run(bare, slow) == pytest.approx([0.04] * api.TUNE_SAMPLES)


@pytest.mark.parametrize("probe, n", [(0.001, 32), (0.025, 32), (0.05, 20), (0.3, 4), (1.0, 1),
                                      (9.0, 1), (0.0, 32), (float("nan"), 32)])
def test_burst_length(probe, n):
    assert api.tune_burst_length(probe) == n


# ---- the KV length a sweep times at (api.TuningCache) ------------------------------------

def test_short_kv_is_tuned_on_a_zeroed_scratch_cache():
    """A first call with fewer than TUNE_MIN_KV keys sweeps on a zeroed scratch cache of
    TUNE_MIN_KV keys (freed afterwards); the real launch uses the caller's cache."""
    be = RecordingBackend()
    prefill_chunk(be, past_len=0, S_cap=512)
    tuning = [l for l in be.launches if l["tuning"]]
    real = [l for l in be.launches if not l["tuning"]]
    scratch = {l["args"][1] for l in tuning} | {l["args"][2] for l in tuning}
    assert len(scratch) == 2 and not scratch & {0x200, 0x300}
    # args: q, k, v, sink, out, Sq, Hq, Hkv, S_cap, past_len, ...
    assert {(l["args"][8], l["args"][9]) for l in tuning} == {(api.TUNE_MIN_KV, api.TUNE_MIN_KV - 512)}
    assert [(l["args"][1], l["args"][2], l["args"][8], l["args"][9]) for l in real] == [(0x200, 0x300, 512, 0)]
    nbytes = GEOM["B"] * GEOM["Hkv"] * api.TUNE_MIN_KV * GEOM["d"] * 2
    assert [c for c in be.calls if c[0] == "alloc"] == [("alloc", nbytes)] * 2
    assert {c[1:] for c in be.calls if c[0] == "memset"} == {(p, 0, nbytes) for p in scratch}
    assert {c[1] for c in be.calls if c[0] == "free"} == scratch
    last_free = max(i for i, c in enumerate(be.calls) if c[0] == "free")
    first_real = be.calls.index(("launch", real[0]))
    assert last_free < first_real and be.calls[last_free - 2][0] == "synchronize"
    # the next chunk hits the cache: no sweep, no scratch
    n_calls = len(be.calls)
    prefill_chunk(be, past_len=512, S_cap=1024)
    assert not [c for c in be.calls[n_calls:] if c[0] in ("alloc", "memset")]


def test_long_kv_is_tuned_on_the_callers_cache():
    be = RecordingBackend()
    prefill_chunk(be, past_len=api.TUNE_MIN_KV, S_cap=api.TUNE_MIN_KV + 512)
    tuning = [l for l in be.launches if l["tuning"]]
    assert tuning and {(l["args"][1], l["args"][2], l["args"][9]) for l in tuning} == {(0x200, 0x300, api.TUNE_MIN_KV)}
    assert not [c for c in be.calls if c[0] in ("alloc", "memset", "free")]


def test_scratch_larger_than_the_cap_is_not_allocated():
    be = RecordingBackend()
    api.flash_prefill_v3(be, 0x100, 0x200, 0x300, 0, 0x500, B=256, Sq=16, Hq=64, Hkv=64, d=128,
                         S_cap=16, past_len=0)  # 256 x 64 x 4096 x 128 x 2 bytes = 16 GiB
    assert not [c for c in be.calls if c[0] == "alloc"]
    assert {l["args"][1] for l in be.launches} == {0x200}


# ---- the sweep's pruning ---------------------------------------------------------------

def test_prune_by_model_ranks_the_wgmma_tiles_under_full_attention_only():
    """Rule c: at 512 rows over 8704 keys the grid model rules the three-warpgroup tile out
    under full attention (one wave of 256-row blocks against two of 192-row ones), and
    under a 128-key window it rules nothing out: both tiles are timed there."""
    from hipkernel.autotune import Work
    from hipkernel.config import candidates

    def tiles(window):
        work = Work(sq=512, skv=8704, Hq=64, B=1, window=window, ragged=False, sm_count=132)
        kept = prune_by_model(candidates("sm_90", 64, 8, window), "sm_90", work)
        return sorted(c.name for c in kept if c.path == "wgmma")

    assert tiles(-1) == ["wgmma_m16_b64"]
    assert tiles(128) == ["wgmma_m12_b128_ws", "wgmma_m16_b64"]


def test_prune_by_model_takes_the_callers_model_as_computed(monkeypatch):
    """Given the ratios the caller computed for its record, rule c uses them and does not
    model the grid again; they equal what it would compute after rules a and b."""
    from hipkernel import autotune
    from hipkernel.autotune import Work, model_times
    from hipkernel.config import candidates

    work = Work(sq=512, skv=8704, Hq=64, B=1, window=-1, ragged=False, sm_count=132)
    cands = candidates("sm_90", 64, 8, -1)
    modelled = model_times(cands, work)
    expect = prune_by_model(cands, "sm_90", work)
    monkeypatch.setattr(autotune, "grid_time", lambda cfg, w: pytest.fail("modelled again"))
    assert prune_by_model(cands, "sm_90", work, modelled=modelled) == expect
    assert [c.name for c in expect if c.path == "wgmma"] == ["wgmma_m16_b64"]


def test_prune_by_model_drops_the_scalar_path_where_tensor_cores_run(monkeypatch):
    from hipkernel.config import candidates

    for arch in ("sm_80", "sm_90"):
        full = candidates(arch, 64, 8, -1)
        pruned = prune_by_model(full, arch)
        assert pruned == tuple(c for c in full if c.path != "scalar") and pruned
    for arch in ("gfx1151", "gfx942", "sm_75"):  # no NVIDIA tensor cores: nothing to compare
        assert prune_by_model(candidates(arch, 64, 8, -1), arch) == candidates(arch, 64, 8, -1)
    assert prune_by_model(CANDIDATES, "sm_90") == CANDIDATES  # scalar only: kept
    monkeypatch.setenv("HIPKERNEL_TUNE", "full")
    assert prune_by_model(candidates("sm_90", 64, 8, -1), "sm_90") == candidates("sm_90", 64, 8, -1)


def _record_sweeps() -> list[dict]:
    import json
    from pathlib import Path

    rec = json.loads((Path(__file__).parents[1] / "reports/gpu/h200.json").read_text())
    return rec["autotune"]


def test_the_h200_sweeps_bear_out_the_model():
    """Every sweep of the committed matrix record (tuned with HIPKERNEL_TUNE=full, every
    candidate timed, with the work the model sees) bears out the three rules of
    prune_by_model. (a) A tensor-core winner, and the fastest scalar config at least 3x its
    time. (b) Under full attention in a uniform call at a head dim with wgmma tiles, a
    winner that is no mma.sync config. (c) Under full attention, no wgmma tile the grid
    model rules out (over MODEL_KEEP, for the sweep's recorded work) was the faster tile."""
    from hipkernel.autotune import FULL_WINDOW, MODEL_KEEP, Work, model_times
    from hipkernel.config import config_from_name

    sweeps = _record_sweeps()
    assert len(sweeps) >= 20
    scalar = {c.name for c in CANDIDATES}
    ruled_b = ruled_c = 0
    for s in sweeps:
        times = s["times_ms"]
        assert scalar <= set(times), f"{s}: not a full sweep (the record must be tuned unpruned)"
        assert s["config"] not in scalar
        best = min(times.values())
        assert min(times[n] for n in scalar) >= 3.0 * best, s
        full = s["window"] < 0 or s["window"] >= FULL_WINDOW
        tiles = {n: t for n, t in times.items() if config_from_name(n).path == "wgmma"}
        if tiles and not s["ragged"] and full:
            ruled_b += 1
            assert config_from_name(s["config"]).path != "mma", s
        modelled = model_times([config_from_name(n) for n in tiles], Work(**s["work"]))
        assert set(modelled) == set(tiles), s
        for name, ratio in modelled.items():
            if ratio > MODEL_KEEP and full:
                ruled_c += 1
                assert tiles[name] > min(tiles.values()), (name, s)
    assert ruled_b >= 10 and ruled_c >= 10, (ruled_b, ruled_c)


@pytest.mark.parametrize("sq, skv, m12_over_m16", [
    (512, 8704, (1.3, 1.6)),      # one wave of 256-row blocks against two of 192-row ones
    (1, 8193, (0.7, 0.8)),        # one block a head either way: the 192-row tile does less
    (16384, 16384, (0.9, 1.1)),   # thousands of blocks: the total decides, and it is close
])
def test_grid_model(sq, skv, m12_over_m16):
    from hipkernel.autotune import Work, grid_time
    from hipkernel.config import config_from_name

    work = Work(sq=sq, skv=skv, Hq=64, B=1, window=-1, ragged=False, sm_count=132)
    m12, m16 = (grid_time(config_from_name(n), work) for n in ("wgmma_m12_b128_ws", "wgmma_m16_b64"))
    lo, hi = m12_over_m16
    assert lo <= m12 / m16 <= hi


def test_grid_model_counts_the_windowed_walk():
    from hipkernel.autotune import Work, grid_time
    from hipkernel.config import config_from_name

    m16 = config_from_name("wgmma_m16_b64")
    full = grid_time(m16, Work(sq=512, skv=8704, Hq=64, B=1, window=-1, ragged=False, sm_count=132))
    windowed = grid_time(m16, Work(sq=512, skv=8704, Hq=64, B=1, window=128, ragged=False, sm_count=132))
    # 256 rows under a 128-key window reach 383 keys, from the 64-key tile that holds the
    # window's first (keys 8064.. for rows from 8192): 6 tiles, against up to 136 with none
    assert windowed == 256 * 64 * 6 and full == 256 * 64 * 136


def test_probe_narrows_the_full_timing_to_the_fastest_probes():
    from hipkernel.autotune import PROBE_KEEP, PROBE_MAX
    from hipkernel.config import KernelConfig

    cfgs = [KernelConfig(m, b) for m in (1, 2, 4) for b in (32, 64)]
    probes = dict(zip(cfgs, (1.0, 1.1, 1.2, 1.3, 2.0, 1.24)))
    measured = []
    t = Autotuner(cfgs)

    def measure(c):
        measured.append(c)
        return [3.0 if c == cfgs[2] else 4.0]  # the full timing may reorder the finalists

    best = t.choose(("k",), measure, probe=lambda c: probes[c])
    kept = [c for c in cfgs if probes[c] <= PROBE_KEEP * 1.0][:PROBE_MAX]
    assert sorted(measured, key=cfgs.index) == sorted(kept, key=cfgs.index) == [cfgs[0], cfgs[1], cfgs[2], cfgs[5]]
    assert best == cfgs[2]
    (row,) = t.choices()
    assert set(row["probe_ms"]) == {c.name for c in cfgs} and set(row["times_ms"]) == {c.name for c in kept}
    one = Autotuner(cfgs[:1])  # a single candidate is not probed
    assert one.choose(("k",), lambda c: 1.0, probe=lambda c: pytest.fail("probed")) == cfgs[0]


def test_full_mode_times_every_candidate(monkeypatch):
    monkeypatch.setenv("HIPKERNEL_TUNE", "full")
    be = RecordingBackend(arch="sm_90")
    prefill_chunk(be, 512)
    (row,) = TUNER.choices()
    from hipkernel.config import candidates

    assert row["probe_ms"] == {}
    assert set(row["times_ms"]) == {c.name for c in candidates("sm_90", 64, 8, -1)}
