"""Ragged batches and bf16 in the harness: the case format, the inputs' canaries, the runner's
gate on adapters that do not take ragged batches, the bf16 baseline, derived suites, and the
model's ragged / bf16 mutants."""

from __future__ import annotations

import numpy as np
import pytest

from hipkernel import model
from hipkernel.adapter import ModelKernel
from hipkernel.config import DEFAULT, KernelConfig
from refattn.cases import (Case, CaseError, case_from_text, case_to_inline, case_to_toml,
                           load_suite, load_suites, make_inputs)
from refattn.lowp import round_bf16, round_lowp
from refattn.metrics import compare
from refattn.reference import attention_with_baseline
from refattn.runner import ReferenceCache, run_case


def _case(**kw) -> Case:
    base = dict(name="r", Hq=8, Hkv=2, d=64, sq=24, why="test")
    return Case(**{**base, **kw})


RAGGED = dict(B=3, sq=24, past_len=[0, 130, 40], q_len=[24, 1, 0])

# Each ragged / bf16 mutant of the catalogue with a case on which the model shows it.
CASE_KILLERS = {
    "ragged_max_diag": _case(B=2, past_len=[10, 300], sink="per_head"),
    "padded_row_next_seq": _case(**RAGGED),
    "padding_not_written": _case(**RAGGED),
    "bf16_p_as_fp16": _case(sq=32, past_len=64, dtype="bf16", sink="per_head"),
}


# ---------------------------------------------------------------- the case format

def test_ragged_case_fields_and_derived_lengths():
    c = _case(**RAGGED, window=32)
    assert c.ragged and c.past_len == (0, 130, 40) and c.q_len == (24, 1, 0)
    assert c.past_lens == (0, 130, 40) and c.q_lens == (24, 1, 0)
    assert c.seq_lens == (24, 131, 40) and c.skv == 131
    assert c.hidden_slots_per_seq == (0, 99, 9) and c.hidden_slots == 99
    assert "past0,130,40 qlen24,1,0" in c.describe()
    u = _case(past_len=5)
    assert not u.ragged and u.past_lens == (5,) and u.q_lens == (24,) and u.skv == 29


@pytest.mark.parametrize("kw, key", [
    (dict(B=2, past_len=[1, 2, 3]), "past_len"),
    (dict(B=2, past_len=[1, -2]), r"past_len\[1\]"),
    (dict(B=2, past_len=[1, 2.5]), r"past_len\[1\]"),
    (dict(B=2, past_len=[1, True]), r"past_len\[1\]"),
    (dict(B=2, past_len=1, q_len=[3]), "q_len"),
    (dict(B=2, q_len=[3, 25]), r"q_len\[1\]"),
    (dict(B=2, q_len=5), "q_len"),
    (dict(B=2, past_len=[0, 0], q_len=[0, 0]), "q_len"),
    (dict(B=2, past_len="7"), "past_len"),
])
def test_bad_ragged_fields_are_named(kw, key):
    with pytest.raises(CaseError, match=key):
        _case(**kw)


def test_ragged_case_round_trips_through_toml_and_inline(tmp_path):
    c = _case(**RAGGED, window=32, sink="per_head")
    path = tmp_path / "s.toml"
    path.write_text(case_to_toml(c))
    (back,) = load_suite(path, suite="adhoc")
    assert back == c
    assert case_from_text(case_to_inline(c), name="r").past_len == c.past_len


# ---------------------------------------------------------------- inputs and reference

def test_ragged_inputs_carry_canaries_where_a_sequence_must_not_read():
    c = _case(**RAGGED)
    i = make_inputs(c)
    assert i.ragged and i.past_len.tolist() == [0, 130, 40] and i.q_len.tolist() == [24, 1, 0]
    assert i.skv == 131
    for b, (n, end) in enumerate(zip(c.q_lens, c.seq_lens)):
        assert np.isnan(i.k[b, :, end:]).all() and np.isnan(i.v[b, :, end:]).all()
        assert np.isfinite(i.k[b, :, :end]).all()
        assert np.isnan(i.q[b, n:]).all() and np.isfinite(i.q[b, :n]).all()
    ref, base = ReferenceCache().get(c, i)
    assert np.isfinite(ref).all()
    assert not ref[1, 1:].any() and not ref[2].any() and not base[2].any()


def test_ragged_cache_fill_is_per_sequence():
    c = _case(B=2, sq=8, past_len=[10, 100], window=16, cache_fill="nan-outside-window")
    i = make_inputs(c)
    assert c.hidden_slots_per_seq == (0, 85)
    assert np.isfinite(i.k[0, :, :18]).all()
    assert np.isnan(i.k[1, :, :85]).all() and np.isfinite(i.k[1, :, 85:108]).all()


# ---------------------------------------------------------------- the runner

class _Uniform:
    """An adapter that knows one past_len: it must never be called on a ragged case."""

    name = "uniform"
    calls = 0

    def supports(self, case):
        return True

    def run(self, inputs):
        type(self).calls += 1
        return 0, inputs.out


def test_runner_declines_ragged_cases_for_an_adapter_without_ragged():
    r = run_case(_Uniform(), _case(**RAGGED))
    assert r.outcome == "declined" and "ragged = True" in r.note and _Uniform.calls == 0


def test_runner_runs_ragged_cases_on_the_model():
    r = run_case(ModelKernel(), _case(**RAGGED, window=32, sink="per_head"))
    assert r.outcome == "pass", r.note


# ---------------------------------------------------------------- bf16

def test_round_lowp():
    x = np.array([1 + 2**-9, 1 + 2**-8 + 2**-12, -3.0, np.nan])
    assert round_lowp(x, "fp16")[0] == 1 + 2**-9
    assert round_lowp(x, "bf16")[0] == 1.0  # bf16 keeps 7 fraction bits: a tie to even
    assert round_lowp(x, "bf16")[1] == 1 + 2**-7
    assert np.isnan(round_lowp(x, "bf16")[3])
    with pytest.raises(ValueError, match="^lowp"):
        round_lowp(x, "fp8")


def test_bf16_baseline_rounds_p_and_output_through_bf16():
    i = make_inputs(_case(sq=32, past_len=64, dtype="bf16", sink="per_head"))
    k, v = i.clean_kv()
    _, base = attention_with_baseline(i.q, k, v, lowp="bf16", **i.reference_kwargs())
    assert np.array_equal(round_bf16(base).astype(np.float64), base)
    _, base16 = attention_with_baseline(i.q, k, v, **i.reference_kwargs())
    assert not np.array_equal(base, base16)


def test_a_correct_bf16_kernel_needs_the_bf16_baseline():
    """The bf16 model passes the bf16 gate; against an fp16 baseline it would fail: the gate
    must follow the kernel's format."""
    c = _case(sq=64, past_len=200, dtype="bf16", sink="per_head")
    i = make_inputs(c)
    out = model.attention(i.q, i.k, i.v, config=DEFAULT, dtype="bf16", **_model_kw(i))
    assert out.dtype == np.float32 and np.array_equal(round_bf16(out), out)
    k, v = i.clean_kv()
    ref, base = attention_with_baseline(i.q, k, v, lowp="bf16", **i.reference_kwargs())
    assert compare(out, ref, base, "bf16").passed
    _, base16 = attention_with_baseline(i.q, k, v, **i.reference_kwargs())
    assert not compare(out, ref, base16, "fp16").passed


def test_model_rejects_non_bf16_values_and_wrong_dtypes():
    i = make_inputs(_case(sq=8, dtype="bf16"))
    q = np.array(i.q)
    q[0, 0, 0, 0] = np.float32(1 + 2**-20)
    with pytest.raises(ValueError, match="^q: expected bf16 values"):
        model.attention(q, i.k, i.v, past_len=0, dtype="bf16")
    with pytest.raises(ValueError, match="^q: the fused kernel takes bf16"):
        model.attention(i.q.astype(np.float16), i.k, i.v, past_len=0, dtype="bf16")
    with pytest.raises(ValueError, match="^dtype"):
        model.attention(i.q, i.k, i.v, past_len=0, dtype="fp8")


def _model_kw(i) -> dict:
    return dict(past_len=i.past_len, q_len=i.q_len, window=i.window, sink=i.sink,
                smooth_softmax=i.smooth_softmax, scale=i.scale)


# ---------------------------------------------------------------- derived suites

def test_bf16_suite_is_seed_and_extended_in_bf16():
    bf = load_suite("bf16")
    src = load_suites(["seed", "extended"])
    assert [c.name for c in bf] == [c.name + "-bf16" for c in src]
    for a, b in zip(src, bf):
        assert b.dtype == "bf16" and b.suite == "bf16"
        assert (a.Hq, a.Hkv, a.d, a.sq, a.B, a.past_len, a.window, a.sink, a.seed, a.config) == \
               (b.Hq, b.Hkv, b.d, b.sq, b.B, b.past_len, b.window, b.sink, b.seed, b.config)


@pytest.mark.parametrize("derive, key", [
    ('[derive]\nfrom = ["nope"]\nsuffix = "-x"\n', "derive.from"),
    ('[derive]\nfrom = ["d"]\nsuffix = "-x"\n', "derive.from"),
    ('[derive]\nfrom = ["src"]\nsuffix = "-X"\n', "derive.suffix"),
    ('[derive]\nfrom = ["src"]\nsuffix = "-x"\nset = { name = "a" }\n', "derive.set.name"),
    ('[derive]\nfrom = ["src"]\nsuffix = "-x"\nset = { dtyp = "bf16" }\n', "derive.set.dtyp"),
    ('[derive]\nfrom = ["src"]\nsuffix = "-x"\nwhat = 1\n', "derive.what"),
    ('[derive]\nfrom = ["src"]\nsuffix = "-x"\nset = { window = 0 }\n', "window"),
])
def test_bad_derive_tables_are_named(tmp_path, derive, key):
    (tmp_path / "src.toml").write_text('[[case]]\nname = "a"\nHq = 2\nHkv = 1\nd = 8\nsq = 4\n'
                                       'why = "w"\n')
    (tmp_path / "d.toml").write_text(derive)
    with pytest.raises(CaseError, match=key.replace(".", r"\.")):
        load_suite(tmp_path / "d.toml")


def test_a_derived_suite_cannot_derive_from_a_derived_one(tmp_path):
    (tmp_path / "src.toml").write_text('[[case]]\nname = "a"\nHq = 2\nHkv = 1\nd = 8\nsq = 4\n'
                                       'why = "w"\n')
    (tmp_path / "d1.toml").write_text('[derive]\nfrom = ["src"]\nsuffix = "-x"\n')
    (tmp_path / "d2.toml").write_text('[derive]\nfrom = ["d1"]\nsuffix = "-y"\n')
    assert [c.name for c in load_suite(tmp_path / "d1.toml")] == ["a-x"]
    with pytest.raises(CaseError, match="itself derived"):
        load_suite(tmp_path / "d2.toml")


# ---------------------------------------------------------------- the model

@pytest.mark.parametrize("config", [DEFAULT, KernelConfig(4, 32, "mma"), KernelConfig(4, 64, "wgmma")],
                         ids=lambda c: c.name)
def test_ragged_model_equals_each_sequence_alone(config):
    c = _case(B=4, sq=40, past_len=[0, 77, 200, 5], q_len=[40, 13, 0, 1], window=50,
              sink="per_head")
    i = make_inputs(c)
    out = model.attention(i.q, i.k, i.v, config=config, **_model_kw(i))
    for b, (p, n) in enumerate(zip(c.past_lens, c.q_lens)):
        assert not out[b, n:].any()
        if n:
            one = model.attention(np.ascontiguousarray(i.q[b:b + 1, :n]), i.k[b:b + 1],
                                  i.v[b:b + 1], past_len=p, window=50, sink=i.sink, config=config)
            assert np.array_equal(out[b:b + 1, :n], one)


@pytest.mark.parametrize("name", sorted(CASE_KILLERS))
def test_ragged_and_bf16_mutants_are_killed_on_the_model(name):
    case = CASE_KILLERS[name]
    assert run_case(ModelKernel(), case).outcome == "pass"
    r = run_case(ModelKernel(mutants={name}), case)
    assert r.outcome == "fail", f"{name} survives {case.describe()}: {r.note}"


def test_ragged_mutants_leave_a_uniform_call_alone():
    c = _case(sq=40, past_len=100, window=30, sink="per_head")
    i = make_inputs(c)
    clean = model.attention(i.q, i.k, i.v, config=DEFAULT, **_model_kw(i))
    for name in ("ragged_max_diag", "padded_row_next_seq", "padding_not_written", "bf16_p_as_fp16"):
        assert np.array_equal(model.attention(i.q, i.k, i.v, config=DEFAULT, mutants={name},
                                              **_model_kw(i)), clean), name


# ---------------------------------------------------------------- the fuzzer

def test_fuzzer_draws_ragged_batches_only_for_a_ragged_kernel():
    from hypothesis import HealthCheck, given, settings

    from refattn.fuzz import case_strategy, supported_axes

    assert supported_axes(ModelKernel())["ragged"] == (False, True)
    assert supported_axes(_Uniform())["ragged"] == (False,)
    seen = []

    @settings(max_examples=200, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case_strategy(supported_axes(ModelKernel()), max_cost=2**20))
    def draw(c):
        seen.append(c)

    draw()
    ragged = [c for c in seen if c.ragged]
    assert ragged and len(ragged) < len(seen)
    for c in ragged:
        assert 2 <= c.B <= 4 and any(c.q_lens) and max(c.q_lens) <= c.sq


def test_a_forced_tma_config_declines_ragged_cases_untouched_and_runs_uniform_ones():
    """``model@CONFIG`` (as ``hipkernel@CONFIG``) with a config that copies with TMA: a ragged
    case is declined by ``supports`` and by ``run`` (status -1, buffer byte-identical), and no
    variant of a ragged case copies with TMA; a uniform case still runs under it."""
    from hipkernel.config import WGMMA_BY_HEAD_DIM, config_from_name

    tma = WGMMA_BY_HEAD_DIM[128]
    assert tma.tma
    ragged = next(c for c in load_suite("ragged") if c.ragged)
    kernel = ModelKernel(config=tma)
    assert not kernel.supports(ragged)
    assert "TMA" in kernel.unsupported_reason(ragged)
    inputs = make_inputs(ragged)
    status, out = kernel.run(inputs)
    assert status == -1 and out is inputs.out and inputs.out_intact()
    free = ModelKernel()
    free._arch = lambda: "sm_90a"  # the arch whose candidates include a TMA config
    wide = next(c for c in load_suite("ragged") if c.ragged and c.d == 128)
    assert free.supports(wide) and free.variants(wide)
    assert not any(config_from_name(n).tma for n in free.variants(wide))
    from dataclasses import replace
    uniform_twin = replace(wide, past_len=max(wide.past_lens), q_len=None)
    assert any(config_from_name(n).tma for n in free.variants(uniform_twin))
    uniform = next(c for c in load_suite("seed") if c.d == 128)
    assert kernel.supports(uniform)
    assert kernel.run(make_inputs(uniform))[0] == 0
