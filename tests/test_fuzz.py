"""Fuzzing, and the reliability tools hipkernel.gpu_session runs (hipkernel/reliability.py).

Three fuzzers, each against the next level of trust down:

* the reference (fp64) against the mpmath oracle on random tiny geometries: every option of
  docs/semantics.md (Semantics) at once (B, Sq, Hq, Hkv, d, past_len, window, sink mode,
  softcap, scale), gate relL2 <= 1e-12, or max-abs <= 1e-12 where the oracle's output is ~0 (a dominating sink);
* the CPU model, through the ``model`` adapter on ``refattn.cases.make_inputs`` (NaN
  canaries in the cache padding and the output buffer), against the fp64 reference under
  the derived gate (``metrics.compare`` with ``reference.attention_with_baseline``);
* the GPU kernel against the fp64 reference on random geometries up to Sq 300 and past_len
  3000 (``@pytest.mark.gpu``; ``REFATTN_FUZZ_EXAMPLES`` examples, default 50), through
  ``hipkernel.reliability.run_one``.

The reliability functions take a backend object. On the CPU they run end to end on
:class:`ModelBackend`, a ``tests.fake_backend.RecordingBackend`` whose launches decode the
kernel ABI and compute with ``hipkernel.model``: host code, buffers, configs and mutant
macros are the GPU path's, only the arithmetic is the model's. Broken variants of it (a
kernel that skips a row, one whose output wobbles between runs, one that crashes) show that
each check can fail. Tests that pin existing edge cases live in test_edge_semantics.py; the
oracle sweep over fixed shapes is test_oracle_vs_reference.py.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import hipkernel
from hipkernel import api, model, reliability
from hipkernel.autotune import Autotuner
from hipkernel.config import (CANDIDATES, DEFAULT, HEAD_DIMS, WGMMA_TILES,
                              WGMMA_TARGET, KernelConfig, candidates, has_mma, has_wgmma)
from hipkernel.reliability import Geometry
from refattn.cases import OUT_CANARY_BITS, Case, make_inputs
from refattn.kernels import get_kernel
from refattn.metrics import compare
from refattn.mutants import MUTANTS
from refattn.oracle import attention_mp
from refattn.reference import attention, attention_with_baseline
from tests.fake_backend import RecordingBackend
from tests.oracle_gate import assert_matches_oracle

FUZZ_EXAMPLES = int(os.environ.get("REFATTN_FUZZ_EXAMPLES", "50"))


# --------------------------------------------------------------------------- a model backend

class ModelBackend(RecordingBackend):
    """A recording backend whose launches compute. Each launch decodes the kernel ABI
    (docs/ARCHITECTURE.md: q, k, v, sink, out, Sq, Hq, Hkv, S_cap, past_len, window,
    sink_mode, scale; grid z = B; compile defines HEAD_DIM, M_TILES, BKV, PACK, QWALK and
    mutant macros; the kernel path from the source compiled) and writes ``hipkernel.model``'s
    output into the ``out`` buffer, for the rows and heads the grid's blocks own (block x of
    QWALK Q tiles of 16 M_TILES / PACK positions, block y of PACK heads), as the kernel does:
    a grid too small leaves the rest of ``out`` as it was."""

    name = "model-backend"
    force_mutants: frozenset = frozenset()

    def compile(self, source, defines, kernel_name):
        kern = super().compile(source, defines, kernel_name)
        kern["PATH"] = next((p for p in api.KERNEL_FILES if api.kernel_source(p) == source), "?")
        return kern

    def launch(self, kernel, grid, block, args, shared_mem=0, stream=None):
        super().launch(kernel, grid, block, args, shared_mem, stream)
        # the thirteen of every path (a ws tile's two tensor maps follow: the model's loads
        # keep what they keep, key_kept, as the maps' bounds do)
        q, k, v, sink, out, Sq, Hq, Hkv, S_cap, past, window, mode, scale = [x for _, x in args][:13]
        d, B = kernel["HEAD_DIM"], grid[2]
        mutants = {m.name for m in MUTANTS if kernel.get(m.macro)} | set(self.force_mutants)
        res = model.attention(
            self.view(q, (B, Sq, Hq, d)), self.view(k, (B, Hkv, S_cap, d)),
            self.view(v, (B, Hkv, S_cap, d)), past_len=past, window=window,
            sink=self.view(sink, (Hq,)) if mode == 1 else None, smooth_softmax=mode == 2,
            scale=scale, config=KernelConfig(kernel["M_TILES"], kernel["BKV"], kernel["PATH"],
                                             ws=bool(kernel.get("WS", 0)), pack=kernel.get("PACK", 1),
                                             walk=kernel.get("QWALK", 1)),
            mutants=mutants)
        positions = grid[0] * kernel.get("QWALK", 1) * 16 * kernel["M_TILES"] // kernel.get("PACK", 1)
        heads = grid[1] * kernel.get("PACK", 1)
        if positions < Sq or heads < Hq:  # blocks own no more: the rest keeps what it held
            res = res.copy()
            held = self.view(out, res.shape)
            res[:, positions:] = held[:, positions:]
            res[:, :, heads:] = held[:, :, heads:]
        self.store(out, res)

    def view(self, ptr, shape) -> np.ndarray:
        return np.frombuffer(self._mem[ptr], dtype=np.float16).reshape(shape)

    def store(self, ptr, res) -> None:
        self.view(ptr, res.shape)[...] = res


class LazyBackend(ModelBackend):
    """Never writes the last query row of any batch or head (a grid one block short)."""

    def store(self, ptr, res):
        self.view(ptr, res.shape)[:, :-1] = res[:, :-1]


class NoisyBackend(ModelBackend):
    """Every other launch flips the lowest mantissa bit of one output element (what an
    atomic or split-KV reduction in varying order would do)."""

    def store(self, ptr, res):
        res = res.copy()
        n = sum(c[0] == "launch" for c in self.calls)
        if n % 2 == 0:
            res.view(np.uint16).flat[0] ^= 1
        super().store(ptr, res)


class CrashingBackend(ModelBackend):
    def launch(self, kernel, grid, block, args, shared_mem=0, stream=None):
        raise RuntimeError("illegal memory access (simulated)")


@pytest.fixture(autouse=True)
def fresh_tuner(monkeypatch):
    """Each test gets its own autotuner (the API's is process-wide) and HIPKERNEL_TUNE=0
    unless it sets it."""
    tuner = Autotuner()
    monkeypatch.setattr(api, "TUNER", tuner)
    monkeypatch.setenv("HIPKERNEL_TUNE", "0")
    return tuner


# --------------------------------------------------------------------------- reference vs oracle

@dataclass(frozen=True)
class Call:
    """One tiny attention call: geometry, options, input amplitude and seed."""

    B: int
    Sq: int
    Hq: int
    Hkv: int
    d: int
    past_len: int
    window: int
    sink: str  # "none" | "per_head" | "smooth" | "both" (a sink and smooth_softmax: sink wins)
    softcap: float
    scale: float | None
    amp: float  # q ~ amp * N(0, 1): larger means sharper softmax
    seed: int

    def inputs(self):
        """q (B, Sq, Hq, d), k/v (B, Hkv, skv, d) float64; sink (Hq,) U(-4, 6), some -inf."""
        rng = np.random.default_rng(self.seed)
        skv = self.past_len + self.Sq
        q = rng.standard_normal((self.B, self.Sq, self.Hq, self.d)) * self.amp
        k = rng.standard_normal((self.B, self.Hkv, skv, self.d))
        v = rng.standard_normal((self.B, self.Hkv, skv, self.d))
        sink = rng.uniform(-4, 6, self.Hq)
        sink[rng.random(self.Hq) < 0.2] = -np.inf
        kw = dict(past_len=self.past_len, window=self.window, softcap=self.softcap, scale=self.scale)
        if self.sink in ("per_head", "both"):
            kw["sink"] = sink
        if self.sink in ("smooth", "both"):
            kw["smooth_softmax"] = True
        return q, k, v, kw


@st.composite
def tiny_calls(draw) -> Call:
    Hkv, G = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    Sq, past = draw(st.integers(1, 6)), draw(st.integers(0, 8))
    window = draw(st.one_of(st.just(-1), st.integers(1, past + Sq + 2)))
    return Call(B=draw(st.integers(1, 2)), Sq=Sq, Hq=Hkv * G, Hkv=Hkv, d=draw(st.integers(1, 8)),
                past_len=past, window=window,
                sink=draw(st.sampled_from(["none", "per_head", "smooth", "both"])),
                softcap=draw(st.sampled_from([0.0, 0.0, 0.7, 5.0])),
                scale=draw(st.sampled_from([None, None, 0.3, 2.0])),
                amp=draw(st.sampled_from([0.1, 1.0, 3.0])), seed=draw(st.integers(0, 2**32 - 1)))


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(call=tiny_calls())
@example(call=Call(1, 1, 1, 1, 1, 0, -1, "none", 0.0, None, 1.0, 0))          # one row, one key
@example(call=Call(1, 3, 4, 1, 4, 8, 1, "per_head", 0.0, None, 1.0, 1))       # W = 1 deep in the cache, G = Hq
@example(call=Call(2, 4, 6, 2, 8, 3, 2, "both", 5.0, 2.0, 3.0, 2))            # huge logits, softcap, sink wins
@example(call=Call(1, 2, 2, 2, 3, 0, -1, "smooth", 0.0, 0.3, 0.1, 3))         # flat logits against sigma = 0
def test_reference_matches_oracle_on_random_tiny_calls(call):
    q, k, v, kw = call.inputs()
    assert_matches_oracle(attention(q, k, v, dtype=np.float64, **kw), attention_mp(q, k, v, **kw))


# --------------------------------------------------------------------------- model vs reference

SCALES = [None, None, 0.02, 0.5, 4.0]  # default, a sink-dominated flat softmax, sharp, huge logits


@st.composite
def model_cases(draw) -> Case:
    Hkv, G = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 4]))
    Sq, past = draw(st.integers(1, 80)), draw(st.integers(0, 150))
    window = draw(st.one_of(st.just(-1), st.integers(1, 8), st.integers(1, past + Sq + 10)))
    cfg = draw(st.sampled_from(CANDIDATES))
    return Case(name="fuzz-model", suite="fuzz", Hq=Hkv * G, Hkv=Hkv, d=draw(st.sampled_from(HEAD_DIMS)),
                sq=Sq, B=draw(st.integers(1, 2)), past_len=past, window=window,
                sink=draw(st.sampled_from(["none", "per_head", "smooth"])),
                scale=draw(st.sampled_from(SCALES)), seed=draw(st.integers(0, 2**31 - 1)),
                config={"m_tiles": cfg.m_tiles, "bkv": cfg.bkv}, why="hypothesis")


def _case(**kw) -> Case:
    base = dict(name="pin", suite="fuzz", Hq=4, Hkv=2, d=64, sq=16, why="pinned example")
    return Case(**(base | kw))


def assert_model_passes(case: Case):
    """The ``model`` adapter on the case's inputs writes every element of the NaN-prefilled
    buffer and passes the derived gate against the fp64 reference."""
    __tracebackhide__ = True
    inputs = make_inputs(case)
    k, v = inputs.clean_kv()
    ref, base = attention_with_baseline(inputs.q, k, v, **inputs.reference_kwargs())
    status, out = get_kernel("model").run(inputs)
    assert status == 0 and out is inputs.out
    unwritten = int((out.view(np.uint16) == OUT_CANARY_BITS).sum())
    assert unwritten == 0, f"{unwritten} elements never written ({case.describe()})"
    c = compare(out, ref, base)
    assert c.passed, f"{case.describe()}\n{c.failure_message()}"


@settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=model_cases())
@example(case=_case(sq=64, window=8, config={"m_tiles": 4, "bkv": 32}))       # rows 40..63 see nothing in tile 0
@example(case=_case(sink="per_head", scale=0.02, past_len=30))                # sinks dominate a flat softmax
@example(case=_case(d=128, scale=4.0, past_len=70, window=40, B=2))           # huge logits, window crossing tiles
@example(case=_case(sq=1, past_len=150, Hq=8, Hkv=1, sink="smooth"))          # one row, G = Hq
def test_model_matches_reference_on_random_small_calls(case):
    assert_model_passes(case)


# --------------------------------------------------------------------------- GPU kernel

@st.composite
def gpu_geometries(draw) -> Geometry:
    Hkv, G = draw(st.sampled_from([1, 2, 4, 8])), draw(st.sampled_from([1, 2, 4, 8]))
    Sq, past = draw(st.integers(1, 300)), draw(st.integers(0, 3000))
    window = draw(st.one_of(st.just(-1), st.integers(1, 8), st.integers(1, 600)))
    d = draw(st.sampled_from(HEAD_DIMS))
    # every config some target runs (scalar, mma, wgmma) that fits d; the test falls back
    # where the GPU lacks its path
    configs = [c for c in candidates(WGMMA_TARGET) if c.fits(d)]
    g = Geometry(B=draw(st.integers(1, 2)), Sq=Sq, Hq=Hkv * G, Hkv=Hkv, d=d,
                 past_len=past, window=window, sink=draw(st.sampled_from(["none", "per_head", "smooth"])),
                 seed=draw(st.integers(0, 2**31 - 1)),
                 config=draw(st.sampled_from(configs)).name,
                 tight=draw(st.booleans()), scale=draw(st.sampled_from([None, None, None, 0.5, 2.0])))
    return reliability.fit_cost(g)


@pytest.fixture(scope="module")
def gpu_backend():
    from hipkernel.backends import get_backend

    try:
        return get_backend()
    except Exception as e:  # noqa: BLE001 - the reason is the skip message
        pytest.skip(f"no GPU backend: {e}")


@pytest.mark.gpu
@settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(g=gpu_geometries())
@example(g=Geometry(1, 64, 8, 2, 64, 0, 8, "none", 1, "m4_b32"))               # fully masked tile
@example(g=Geometry(1, 1, 64, 8, 64, 2999, -1, "per_head", 2, "m1_b64", tight=True))  # decode, tail tile
@example(g=Geometry(2, 300, 4, 4, 128, 1000, 128, "smooth", 3, "m2_b32", scale=2.0))  # window skips tiles
@example(g=Geometry(1, 77, 16, 2, 128, 2500, -1, "per_head", 4, "mma_m4_b64"))   # tensor-core path
@example(g=Geometry(1, 300, 16, 2, 64, 700, 100, "per_head", 5, "wgmma_m16_b64"))  # wgmma, window
@example(g=Geometry(2, 45, 8, 8, 128, 37, -1, "smooth", 6, "wgmma_m8_b64", tight=True))  # ragged tail
def test_gpu_kernel_matches_reference_on_random_geometries(gpu_backend, g):
    """The kernel on ``g`` writes every element of a NaN-primed output and passes the
    derived gate; a failure names the geometry and how to reproduce it. Tensor-core configs
    fall back to the default on a target without their path."""
    path = g.kernel_config().path
    lacks = {"mma": not has_mma(gpu_backend.arch), "wgmma": not has_wgmma(gpu_backend.arch)}
    if lacks.get(path, False):
        g = replace(g, config=DEFAULT.name)
    row = reliability.run_one(gpu_backend, g)
    assert row["passed"], (f"{row['describe']}: {row['summary']}\n{row.get('failure_message', '')}\n"
                           f"reproduce: reliability.run_one(be, Geometry(**{row['geometry']}))")


# --------------------------------------------------------------------------- reliability: geometry

def test_random_geometry_is_reproducible_capped_and_varied():
    cap = 2**18
    gs = [reliability.random_geometry(np.random.default_rng(7), cap) for _ in range(2)]
    assert gs[0] == gs[1]
    rng = np.random.default_rng(0)
    gs = [reliability.random_geometry(rng, cap) for _ in range(300)]
    assert all(g.cost <= cap for g in gs)
    assert all(g.case().G == g.Hq // g.Hkv for g in gs)  # each is a valid Case
    assert {g.d for g in gs} == set(HEAD_DIMS)
    assert {g.sink for g in gs} == {"none", "per_head", "smooth"}
    assert {g.config for g in gs} == {c.name for c in CANDIDATES}
    assert {g.tight for g in gs} == {False, True}
    assert any(g.window == -1 for g in gs) and any(0 < g.window <= 8 for g in gs)
    assert any(g.past_len > 1000 for g in gs) and any(g.past_len == 0 for g in gs)
    assert any(g.Sq == 1 for g in gs) and any(g.Sq > 100 for g in gs)
    assert any(g.Hq // g.Hkv > 1 and g.Hkv > 1 for g in gs)


def test_random_geometry_draws_only_configs_that_fit_the_head_dim():
    """A 128-key mma tile needs 68 KiB of static shared memory at d = 128 (over 48): drawn
    at d = 64 only."""
    big, small = KernelConfig(4, 128, "mma"), KernelConfig(8, 32, "wgmma")
    assert big.fits(64) and not big.fits(128) and small.fits(128)
    rng = np.random.default_rng(5)
    gs = [reliability.random_geometry(rng, 2**18, configs=(big, small)) for _ in range(200)]
    by_d = {d: {g.config for g in gs if g.d == d} for d in HEAD_DIMS}
    assert by_d == {64: {big.name, small.name}, 128: {small.name}}, by_d
    assert all(g.kernel_config().fits(g.d) for g in gs)


def test_fit_cost_shrinks_work_not_raggedness():
    g = Geometry(2, 300, 64, 8, 128, 3000, -1, "per_head", 0, "m4_b64")
    small = reliability.fit_cost(g, 10**6)
    assert small.cost <= 10**6 and small.Sq == 300 and small.window == -1
    assert small.Hq % small.Hkv == 0 and small.Hq < 64
    g3 = Geometry(1, 5, 9, 3, 64, 10, -1, "none", 0, "m1_b32")  # G = 3: halving keeps Hq % Hkv == 0
    assert reliability.fit_cost(g3, 5 * 15 * 3).Hq == 3
    with pytest.raises(ValueError, match="^config"):
        Geometry(1, 5, 2, 1, 64, 0, -1, "none", 0, "tile-4x64").kernel_config()
    with pytest.raises(ValueError, match="^config: 'm3_b48': m_tiles"):
        Geometry(1, 5, 2, 1, 64, 0, -1, "none", 0, "m3_b48").kernel_config()


# --------------------------------------------------------------------------- reliability: kernel runs

def _small_inputs(d=64):
    return make_inputs(_case(d=d, sq=20, past_len=13, sink="per_head"))


def test_run_kernel_matches_the_model_and_primes_the_output():
    inputs = _small_inputs()
    out = inputs.fresh_out()
    assert reliability.run_kernel(ModelBackend(), inputs.q, inputs.k, inputs.v, out=out,
                                  **inputs.reference_kwargs()) == 0
    want = model.attention(inputs.q, inputs.k, inputs.v, **inputs.reference_kwargs())
    assert out.tobytes() == want.tobytes()
    lazy = inputs.fresh_out()
    reliability.run_kernel(LazyBackend(), inputs.q, inputs.k, inputs.v, out=lazy,
                           **inputs.reference_kwargs())
    assert reliability._unwritten(lazy) == 4 * 64  # the last row of each of the 4 heads


def test_run_kernel_declines_on_the_host():
    inputs = make_inputs(_case(d=80))
    be = ModelBackend()
    assert reliability.run_kernel(be, inputs.q, inputs.k, inputs.v, out=inputs.out,
                                  **inputs.reference_kwargs()) == -1
    assert be.calls == [] and inputs.out_intact()
    with pytest.raises(ValueError, match="^out"):
        reliability.run_kernel(be, inputs.q, inputs.k, inputs.v, out=inputs.out[:, :1],
                               **inputs.reference_kwargs())


def test_hipkernel_attention_shows_unwritten_elements():
    inputs = _small_inputs()
    out = inputs.fresh_out()
    hipkernel.attention(inputs.q, inputs.k, inputs.v, out=out, backend=LazyBackend(),
                        **inputs.reference_kwargs())
    assert reliability._unwritten(out) > 0


def test_run_one_passes_on_the_model_backend():
    for g in (Geometry(1, 37, 4, 2, 64, 50, 9, "per_head", 5, "m2_b32"),
              Geometry(2, 3, 2, 1, 128, 70, -1, "smooth", 6, "m1_b64", tight=True),
              Geometry(1, 20, 8, 8, 64, 0, 1, "none", 7, "m4_b64", scale=2.0)):
        row = reliability.run_one(ModelBackend(), g)
        assert row["passed"] and row["unwritten"] == 0, row["summary"]
        assert row["rel_l2"] <= row["gate_rel_l2"]
        json.dumps(row, allow_nan=False)


def test_fuzz_on_the_model_backend_passes():
    rep = reliability.fuzz(ModelBackend(), n=6, seed=1, max_cost=20_000)
    assert rep["ok"] and (rep["passed"], rep["failed"]) == (6, 0) and rep["failures"] == []
    assert rep["worst"]["ratio"] <= 1.0
    json.dumps(rep, allow_nan=False)


def test_fuzz_covers_the_mma_path_where_the_arch_has_it():
    be = ModelBackend(arch="sm_90")
    rep = reliability.fuzz(be, n=8, seed=4, max_cost=20_000)
    assert rep["ok"], rep["failures"]
    assert any(name.startswith("mma_") for name in rep["configs"])
    assert any(name.startswith("wgmma_") for name in rep["configs"])  # sm_90: wgmma too
    assert {l["kernel"]["PATH"] for l in be.launches} <= {"scalar", "mma", "wgmma", "wgspan"}
    assert {"scalar", "mma", "wgmma"} <= {l["kernel"]["PATH"] for l in be.launches}
    sm80 = ModelBackend(arch="sm_80")  # tensor cores without wgmma
    rep80 = reliability.fuzz(sm80, n=8, seed=4, max_cost=20_000)
    assert rep80["ok"], rep80["failures"]
    assert {l["kernel"]["PATH"] for l in sm80.launches} <= {"scalar", "mma"}
    assert not any(name.startswith("wgmma_") for name in rep80["configs"])
    assert reliability.config_from_name("mma_m4_b64") == KernelConfig(4, 64, "mma")
    assert reliability.config_from_name("wgmma_m8_b64") == KernelConfig(8, 64, "wgmma")
    assert reliability.config_from_name("wgmma_m8_b32").name == "wgmma_m8_b32"
    assert reliability.config_from_name("m1_b32") == KernelConfig(1, 32)
    wide = KernelConfig(8, 64, "mma", 2)
    assert reliability.config_from_name(wide.name) == wide
    ws = KernelConfig(8, 64, "wgmma", ws=True)
    assert reliability.config_from_name(ws.name) == ws
    walked = KernelConfig(4, 32, "mma", pack=4, walk=4)
    assert reliability.config_from_name("mma_m4_b32_p4_q4") == walked
    assert reliability.config_from_name("mma_m4_b64_q2") == KernelConfig(4, 64, "mma", walk=2)
    for bad in ("mma_m8_b64_x2", "wgmma_m8_b64_ws2"):
        with pytest.raises(ValueError, match="^config"):
            reliability.config_from_name(bad)
    with pytest.raises(ValueError, match="^config: 'mma_m8_b64_ws': ws: "):  # the name parses; the config is refused
        reliability.config_from_name("mma_m8_b64_ws")


def test_fuzz_failures_carry_a_geometry_that_reproduces_them():
    rep = reliability.fuzz(ModelBackend(), n=5, seed=2, max_cost=20_000,
                           mutants={"clamp_plus_one_tile"})
    assert not rep["ok"] and rep["failed"] >= 1 and len(rep["failures"]) == rep["failed"]
    f = rep["failures"][0]
    assert "Mismatched elements" in f["failure_message"] or "non-finite" in f["failure_message"]
    g = Geometry(**f["geometry"])
    assert not reliability.run_one(ModelBackend(), g, mutants={"clamp_plus_one_tile"})["passed"]
    assert reliability.run_one(ModelBackend(), g)["passed"]


def test_fuzz_catches_unwritten_output_and_crashes():
    lazy = reliability.fuzz(LazyBackend(), n=3, seed=3, max_cost=20_000)
    assert lazy["failed"] == 3
    assert all("never written" in f["summary"] or "non-finite" in f["summary"] for f in lazy["failures"])
    crash = reliability.fuzz(CrashingBackend(), n=2, seed=3, max_cost=20_000)
    assert crash["failed"] == 2 and "raised RuntimeError: illegal memory access" in crash["failures"][0]["summary"]
    with pytest.raises(ValueError, match="^n:"):
        reliability.fuzz(ModelBackend(), n=0)


# --------------------------------------------------------------------------- reliability: determinism

DET_CASES = [_case(name="det-sink", sq=40, past_len=30, sink="per_head", window=17),
             _case(name="det-cfg", sq=33, d=128, config={"m_tiles": 2, "bkv": 32}),
             _case(name="det-d80", d=80)]  # declined: checked, not compared


def test_determinism_on_a_deterministic_kernel():
    rep = reliability.determinism(ModelBackend(), DET_CASES, runs=3)
    assert rep["ok"] and (rep["n_run"], rep["n_declined"], rep["n_identical"]) == (2, 1, 2)
    assert rep["incomplete"] == [] and all(r["unwritten"] == 0 for r in rep["cases"] if not r["declined"])
    rows = {r["case"]: r for r in rep["cases"]}
    assert rows["fuzz/det-sink"]["config"] == DEFAULT.name  # HIPKERNEL_TUNE=0
    assert rows["fuzz/det-cfg"]["config"] == "m2_b32"       # the case's own config
    assert rows["fuzz/det-sink"]["max_diff"] == 0.0 and rows["fuzz/det-sink"]["status"] == [0, 0, 0]
    assert rows["fuzz/det-d80"]["declined_ok"]
    json.dumps(rep, allow_nan=False)


def test_determinism_flags_a_wobbling_kernel():
    rep = reliability.determinism(NoisyBackend(), DET_CASES[:1], runs=3)
    (row,) = rep["cases"]
    assert not rep["ok"] and rep["nondeterministic"] == [f"fuzz/det-sink {DEFAULT.name}"]
    assert not row["identical"] and row["max_diff"] > 0
    with pytest.raises(ValueError, match="^runs"):
        reliability.determinism(ModelBackend(), DET_CASES, runs=1)


def test_determinism_over_given_configs_and_on_an_incomplete_kernel():
    cfgs = [KernelConfig(1, 32), KernelConfig(4, 64, "mma")]
    rep = reliability.determinism(ModelBackend(arch="sm_90"), DET_CASES[:1], runs=2, configs=cfgs)
    assert rep["ok"] and [r["config"] for r in rep["cases"]] == ["m1_b32", "mma_m4_b64"]
    lazy = reliability.determinism(LazyBackend(), DET_CASES[:1], runs=2)
    assert not lazy["ok"] and lazy["incomplete"] == [f"fuzz/det-sink {DEFAULT.name}"]
    assert lazy["cases"][0]["identical"]  # deterministic, but incomplete


def test_determinism_uses_the_autotuned_config(monkeypatch, fresh_tuner):
    """With HIPKERNEL_TUNE on, the config is the tuner's choice for the case's key (one sweep),
    then passed explicitly to every run."""
    monkeypatch.setenv("HIPKERNEL_TUNE", "1")
    be = ModelBackend(times={(c.m_tiles, c.bkv): 2.0 for c in CANDIDATES} | {(2, 64): 0.5})
    rep = reliability.determinism(be, DET_CASES[:1], runs=2)
    assert rep["ok"] and rep["cases"][0]["config"] == "m2_b64" and fresh_tuner.sweeps == 1


# --------------------------------------------------------------------------- reliability: sanitizer

TINY_SUITE = """
[defaults]
Hq = 4
Hkv = 2
d = 64
sq = 21
past_len = 9

[[case]]
name = "san-sink-w5"
window = 5
sink = "per_head"
why = "a window and a sink"

[[case]]
name = "san-cfg"
config = { m_tiles = 1, bkv = 32 }
why = "a forced config"

[[case]]
name = "san-d80"
d = 80
why = "declined"
"""


def test_sanitize_target_runs_every_case_and_restores_the_env(suite_dir, monkeypatch, capsys):
    suite_dir("tiny", TINY_SUITE)
    monkeypatch.setenv("HIPKERNEL_TUNE", "1")
    be = ModelBackend()
    assert reliability.sanitize_target(["tiny"], backend=be, cache="both", judge=True) == 0
    out = capsys.readouterr().out
    assert "3 cases" in out and "6 calls, 0 bad" in out and "BAD" not in out
    assert os.environ["HIPKERNEL_TUNE"] == "1"
    launched = {(l["kernel"]["M_TILES"], l["kernel"]["BKV"]) for l in be.launches}
    assert launched == {(DEFAULT.m_tiles, DEFAULT.bkv), (1, 32)} and not any(l["tuning"] for l in be.launches)
    assert {l["args"][8] for l in be.launches} == {30, make_inputs(_case(sq=21, past_len=9)).k.shape[2]}
    assert reliability.sanitize_target(["tiny"], backend=ModelBackend(), match=["san-cfg"],
                                       all_configs=True) == 0
    assert f"{len(CANDIDATES)} calls, 0 bad" in capsys.readouterr().out
    with pytest.raises(ValueError, match="^cache"):
        reliability.sanitize_target(["tiny"], backend=be, cache="loose")
    # tensor cores: the mma defaults (16 and 32 rows a warp, packed heads: PACK 2 at these
    # cases' G = 2, and packed heads walking 4 Q tiles a block) too, and on sm_90 the wgmma
    # tiles of the head dim and (d = 64) the wgspan tile, packed as G = 2 allows: PACK 2 and
    # its walk cut to one step
    sm90 = ModelBackend(arch="sm_90")
    assert reliability.sanitize_target(["tiny"], backend=sm90, judge=True) == 0
    assert {l["kernel"]["PATH"] for l in sm90.launches} == {"scalar", "mma", "wgmma", "wgspan"}
    mma = [l["kernel"] for l in sm90.launches if l["kernel"]["PATH"] == "mma"]
    assert sum(k.get("WARP_M") == 2 for k in mma) == 2  # both d=64 cases
    assert sum(k.get("PACK") == 2 and "QWALK" not in k for k in mma) == 2
    assert sum(k.get("QWALK") == 4 for k in mma) == 2  # both d=64 cases
    wg = [(c.m_tiles, c.bkv) for c in WGMMA_TILES[64]]
    assert [(l["kernel"]["M_TILES"], l["kernel"]["BKV"]) for l in sm90.launches
            if l["kernel"]["PATH"] == "wgmma"] == wg * 2  # both d=64 cases
    assert [(k["M_TILES"], k["BKV"], k.get("PACK"), k.get("QWALK")) for k in
            (l["kernel"] for l in sm90.launches) if k["PATH"] == "wgspan"] == [(4, 136, 2, None)] * 2
    assert f"{13 + 2 * len(wg)} calls, 0 bad" in capsys.readouterr().out
    sm80 = ModelBackend(arch="sm_80")  # mma, no wgmma or wgspan: four fewer calls
    assert reliability.sanitize_target(["tiny"], backend=sm80, judge=True) == 0
    assert {l["kernel"]["PATH"] for l in sm80.launches} == {"scalar", "mma"}
    assert "11 calls, 0 bad" in capsys.readouterr().out


def test_walking_config_writes_every_row_as_the_unwalked_tile_does():
    """walk = 4 Q tiles a block: the model backend writes only the rows the grid's blocks own
    (as the kernel does), so a grid short of a Q tile would leave canaries; none is left, and
    the output is the unwalked packed tile's, bit for bit (a row's tiles and arithmetic are
    the same), with and without the ring (window 16 past 300, where 16 positions' keys fit
    in 5 tiles of 32; no window; window 150, where they do not)."""
    walked = KernelConfig(4, 32, "mma", pack=2, walk=4)
    for window, ring in ((16, True), (-1, False), (150, False)):
        assert walked.ring_serves(64, window, 300) is ring
        inputs = make_inputs(_case(sq=300, past_len=300, window=window, sink="per_head"))
        outs = []
        for cfg in (walked, replace(walked, walk=1)):
            be = ModelBackend(arch="sm_90")
            buf = inputs.fresh_out()
            assert reliability.run_kernel(be, inputs.q, inputs.k, inputs.v, out=buf, config=cfg,
                                          **inputs.reference_kwargs()) == 0
            assert be.launches[-1]["grid"] == cfg.grid(300, 4, 1)
            assert int((buf.view(np.uint16) == OUT_CANARY_BITS).sum()) == 0, (cfg.name, window)
            outs.append(buf)
        assert be.launches[-1]["grid"][0] == 10 and walked.grid(300, 4, 1)[0] == 3  # 4 + 4 + 2
        np.testing.assert_array_equal(outs[0].view(np.uint16), outs[1].view(np.uint16))


def test_sanitize_target_cheapest_first(suite_dir, capsys):
    suite_dir("tiny", TINY_SUITE + """
[[case]]
name = "san-big"
sq = 40
past_len = 300
why = "costs the most"

[[case]]
name = "san-small"
sq = 2
past_len = 0
why = "costs the least"
""")
    cases = {c.name: c for c in reliability.load_suites(["tiny"])}
    assert reliability.case_cost(cases["san-small"]) == 3 * 4  # rows see 1 and 2 keys, 4 heads
    assert reliability.sanitize_target(["tiny"], backend=ModelBackend(), cheapest_first=True) == 0
    order = [line.split()[1] for line in capsys.readouterr().out.splitlines()
             if line.startswith("  ok")]
    names = list(dict.fromkeys(n.split("/")[1] for n in order))
    assert names[0] == "san-small" and names[-1] == "san-big"
    costs = [reliability.case_cost(cases[n]) for n in names]
    assert costs == sorted(costs)


def test_sanitize_target_stops_at_its_time_budget_and_says_so(suite_dir, capsys, monkeypatch):
    """With a time budget the target starts no case after it, prints how many it reached,
    and exits as usual; the parsed log then carries the tool's summary over those launches and
    ``target_cases``. Without one it runs every case and the parse says nothing of a budget."""
    suite_dir("tiny", TINY_SUITE)
    n = len(reliability.load_suites(["tiny"]))
    clock = iter(range(0, 1000, 10))  # each look at the clock is 10 s later: cases at 10, 20
    real_clock = reliability._now
    monkeypatch.setattr(reliability, "_now", lambda: float(next(clock)))
    assert reliability.sanitize_target(["tiny"], backend=ModelBackend(), time_budget=25) == 0
    out = capsys.readouterr().out
    assert f"time budget of 25 s reached after 2 of {n} cases" in out
    ran = {line.split()[1] for line in out.splitlines() if line.startswith("  ok")}
    assert len({r.split("/")[1] for r in ran}) == 2
    log = out + "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n"
    parsed = reliability.parse_sanitizer_summary(log)
    assert parsed["ok"] and parsed["target_cases"] == {"run": 2, "of": n}
    monkeypatch.setattr(reliability, "_now", real_clock)
    assert reliability.sanitize_target(["tiny"], backend=ModelBackend()) == 0
    whole = capsys.readouterr().out + "========= ERROR SUMMARY: 0 errors\n"
    assert "time budget" not in whole and reliability.parse_sanitizer_summary(whole)["target_cases"] is None


def test_time_budget_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        reliability.main(["--sanitize-target", "--time-budget", "0"])
    assert "--time-budget: expected seconds > 0, got 0" in capsys.readouterr().err


def test_sanitize_target_fails_on_a_broken_kernel(suite_dir, capsys):
    suite_dir("tiny", TINY_SUITE)
    assert reliability.sanitize_target(["tiny"], backend=LazyBackend()) == 1
    out = capsys.readouterr().out
    assert "BAD tiny/san-sink-w5" in out and "ok  tiny/san-d80" in out and "2 bad" in out
    wrong = ModelBackend()
    wrong.force_mutants = frozenset({"sink_ignored"})
    assert reliability.sanitize_target(["tiny"], backend=wrong, judge=True) == 1
    out = capsys.readouterr().out
    assert "BAD tiny/san-sink-w5" in out and "ok  tiny/san-cfg" in out


# Captured from the documented format (compute-sanitizer user manual: memcheck and
# racecheck reports, "ERROR SUMMARY", "RACECHECK SUMMARY", "LEAK SUMMARY").
MEMCHECK_CLEAN = """\
========= COMPUTE-SANITIZER
sanitize target: 45 cases on cuda (sm_90), cache tight, HIPKERNEL_TUNE=0
sanitize target: 45 calls, 0 bad
========= LEAK SUMMARY: 0 bytes leaked in 0 allocations
========= ERROR SUMMARY: 0 errors
"""
MEMCHECK_OOB = """\
========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 16 bytes
=========     at gqa_flash_prefill+0x1b70
=========     by thread (64,0,0) in block (8,3,0)
=========     Address 0x7f3a2c001000 is out of bounds
=========     and is 1 bytes after the nearest allocation at 0x7f3a2c000000 of size 4096 bytes
=========
========= Program hit CUDA_ERROR_LAUNCH_FAILED (error 719) due to "unspecified launch failure" on CUDA API call to cuCtxSynchronize.
=========
========= Target application returned an error
========= ERROR SUMMARY: 2 errors
"""
RACECHECK_CLEAN = """\
========= COMPUTE-SANITIZER
sanitize target: 45 calls, 0 bad
========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)
"""
RACECHECK_HAZARD = """\
========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at gqa_flash_prefill+0x9a0
=========     and Read access at gqa_flash_prefill+0xc10 [128 hazards]
=========
========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)
"""
NO_SUMMARY = """\
========= COMPUTE-SANITIZER
Traceback (most recent call last):
RuntimeError: no GPU backend available
"""


@pytest.mark.parametrize("text, tool, ok, errors, hazards", [
    (MEMCHECK_CLEAN, "memcheck", True, 0, None),
    (MEMCHECK_OOB, "unknown", False, 2, None),
    (RACECHECK_CLEAN, "racecheck", True, 0, 0),
    (RACECHECK_HAZARD, "racecheck", False, 1, 1),
    (NO_SUMMARY, "unknown", False, 0, None),
    (MEMCHECK_CLEAN + MEMCHECK_CLEAN.replace("0 errors", "3 errors"), "memcheck", False, 3, None),
], ids=["memcheck-clean", "memcheck-oob", "racecheck-clean", "racecheck-hazard", "no-summary",
        "two-processes"])
def test_parse_sanitizer_summary(text, tool, ok, errors, hazards):
    p = reliability.parse_sanitizer_summary(text)
    assert (p["tool"], p["ok"], p["errors"], p["hazards"]) == (tool, ok, errors, hazards), p
    assert bool(p["problems"]) != ok
    json.dumps(p, allow_nan=False)


def test_parse_sanitizer_details():
    oob = reliability.parse_sanitizer_summary(MEMCHECK_OOB, tool="memcheck")
    assert oob["tool"] == "memcheck" and oob["target_error"]
    assert oob["program_hits"] == ["CUDA_ERROR_LAUNCH_FAILED"]
    assert oob["first_reports"][0] == "Invalid __global__ read of size 16 bytes"
    race = reliability.parse_sanitizer_summary(RACECHECK_HAZARD)
    assert race["first_reports"][0].startswith("Error: Race reported between Write access")
    leak = reliability.parse_sanitizer_summary(
        MEMCHECK_CLEAN.replace("0 bytes leaked in 0 allocations", "4096 bytes leaked in 1 allocation"))
    assert (leak["ok"], leak["leaked_bytes"], leak["leaked_allocations"]) == (False, 4096, 1)
    warn = reliability.parse_sanitizer_summary(
        RACECHECK_CLEAN.replace("0 hazards displayed (0 errors, 0 warnings)",
                                "2 hazards displayed (0 errors, 2 warnings)"))
    assert not warn["ok"] and warn["errors"] == 0 and warn["warnings"] == 2


def test_sanitizer_commands_and_script():
    cmds = reliability.sanitizer_commands()
    for tool in ("memcheck", "racecheck", "initcheck", "synccheck"):
        assert cmds[tool].startswith(f"compute-sanitizer --tool {tool} ")
        assert cmds[tool].endswith("python -m hipkernel.reliability --sanitize-target --suites seed,extended,coverage,ragged")
    assert "--leak-check full" in cmds["memcheck"]
    script = reliability.sanitizer_script(out_dir="logs")
    assert script.startswith("#!/usr/bin/env bash") and "export PYTHONPATH=." in script
    assert "> logs/racecheck.log 2>&1" in script
    assert script.rstrip().endswith("--parse-sanitizer logs/memcheck.log logs/racecheck.log")


def test_main_parses_logs_with_exit_status(tmp_path, capsys):
    clean, dirty = tmp_path / "memcheck.log", tmp_path / "racecheck.log"
    clean.write_text(MEMCHECK_CLEAN)
    dirty.write_text(RACECHECK_HAZARD)
    assert reliability.main(["--parse-sanitizer", str(clean)]) == 0
    assert json.loads(capsys.readouterr().out)[str(clean)]["ok"] is True
    assert reliability.main(["--parse-sanitizer", str(clean), str(dirty)]) == 1
    assert json.loads(capsys.readouterr().out)[str(dirty)]["hazards"] == 1
    assert reliability.main(["--print-sanitizer-script"]) == 0
    assert "compute-sanitizer --tool memcheck" in capsys.readouterr().out


def test_record_body_is_ok_only_when_every_section_is():
    be = ModelBackend()
    good = reliability.parse_sanitizer_summary(MEMCHECK_CLEAN)
    bad = reliability.parse_sanitizer_summary(RACECHECK_HAZARD)
    body, ok = reliability.record_body(be, determinism={"ok": True}, fuzz={"ok": True},
                                       sanitizer={"memcheck": good})
    assert ok and body["backend"] == "model-backend" and set(body) >= {"determinism", "fuzz", "sanitizer"}
    assert not reliability.record_body(be, fuzz={"ok": True}, sanitizer={"memcheck": good, "racecheck": bad})[1]
    assert not reliability.record_body(be, determinism={"ok": False})[1]
    assert not reliability.record_body(be)[1]  # nothing recorded is not a pass


RACECHECK_CUT = """\
========= COMPUTE-SANITIZER
sanitize target: 45 cases on cuda (sm_90), cache tight, HIPKERNEL_TUNE=0
  ok  seed/gptoss-sink-past0                  tight  m4_b64   status 0, 0 unwritten, finite=True
  ok  seed/gptoss-sink-past0                  tight  mma_m4_b64 status 0, 0 unwritten, finite=True
"""


def test_a_sanitizer_run_cut_short_is_reported_apart():
    """A log stopped by a time limit with nothing wrong in it is neither a pass nor a failure:
    it goes to sanitizer_incomplete with the launches it checked. Anything wrong in a cut
    log (a report, a BAD launch, a traceback) still fails the record."""
    be = ModelBackend()
    good = reliability.parse_sanitizer_summary(MEMCHECK_CLEAN)
    cut = reliability.parse_sanitizer_summary(RACECHECK_CUT)
    assert not cut["ok"] and cut["launches_ok"] == 2 and reliability.stopped_clean(cut)
    body, ok = reliability.record_body(be, fuzz={"ok": True},
                                       sanitizer={"memcheck": good, "racecheck": cut})
    assert ok and set(body["sanitizer"]) == {"memcheck"}
    assert body["sanitizer_incomplete"]["racecheck"]["launches_ok"] == 2
    for broken in (RACECHECK_CUT + "  BAD seed/x tight m4_b64 status -1\n",
                   RACECHECK_CUT + "========= Error: Race reported between Write access\n",
                   RACECHECK_CUT + "Traceback (most recent call last):\nRuntimeError: boom\n",
                   NO_SUMMARY):
        parsed = reliability.parse_sanitizer_summary(broken)
        assert not reliability.stopped_clean(parsed), broken
        assert not reliability.record_body(be, fuzz={"ok": True}, sanitizer={"racecheck": parsed})[1]


def test_main_run_writes_a_fresh_reliability_record(suite_dir, tmp_path, monkeypatch, capsys):
    """``--run`` on a (model) backend: determinism over the suites, fuzzing, the parsed
    sanitizer logs, stamped as a ``reliability`` record that hipkernel.record accepts."""
    from hipkernel import backends, record

    suite_dir("tiny", TINY_SUITE)
    monkeypatch.setattr(backends, "get_backend", lambda name=None: ModelBackend())
    log = tmp_path / "memcheck.log"
    log.write_text(MEMCHECK_CLEAN)
    out = tmp_path / "rec"
    assert reliability.main(["--run", "--suites", "tiny", "--fuzz-n", "2", "--fuzz-max-cost", "20000",
                             "--sanitizer-logs", str(log), "--out", str(out)]) == 0
    rec = json.loads((out / "reliability-h200.json").read_text())
    assert rec["kind"] == "reliability" and rec["ok"] and record.check_record(rec) == []
    assert rec["determinism"]["n_run"] == 2 and rec["fuzz"]["passed"] == 2
    assert rec["sanitizer"]["memcheck.log"]["ok"]
    assert "determinism: 2/2 identical" in capsys.readouterr().out


# Sharded GPU fuzzing: REFATTN_FUZZ_SHARDS tests of REFATTN_FUZZ_PER_SHARD geometries each,
# so pytest-xdist (`-n auto --dist loadgroup`) spreads them over the GPUs of a host.
FUZZ_SHARDS = int(os.environ.get("REFATTN_FUZZ_SHARDS", "2"))
FUZZ_PER_SHARD = int(os.environ.get("REFATTN_FUZZ_PER_SHARD", "25"))


@pytest.mark.gpu
@pytest.mark.parametrize("shard", range(FUZZ_SHARDS))
def test_gpu_fuzz_shard(gpu_backend, shard):
    """One shard of random geometries (seeded by the shard number) on the GPU kernel, every
    one under the derived gate with a fully written NaN-primed output."""
    res = reliability.fuzz(gpu_backend, n=FUZZ_PER_SHARD, seed=10_000 + shard)
    assert res["ok"] and res["passed"] == FUZZ_PER_SHARD, json.dumps(res["failures"][:3], indent=1)
