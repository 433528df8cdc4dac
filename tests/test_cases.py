"""Case files: validation with located messages, the shipped suites, deterministic inputs."""

import collections

import numpy as np
import pytest

from refattn.cases import (
    KV_PAD_MIN, OUT_CANARY_BITS, SINK_HIGH, SINK_LOW, Case, CaseError, cases_dir, list_suites,
    load_suite, load_suites, make_inputs, round_bf16, round_through,
)

GOOD = """
[defaults]
Hq = 8
Hkv = 2
d = 16
sq = 24

[[case]]
name = "a"
why = "first"

[[case]]
name = "b"
past_len = 40
window = 7
sink = "per_head"
config = { bkv = 32 }
why = "second"
"""


def _case(**kw):
    base = dict(name="t", Hq=4, Hkv=2, d=16, sq=20, past_len=30, why="test")
    base.update(kw)
    return Case(**base)


# ------------------------------------------------------------------ loading and validation

def test_defaults_merge_and_case_overrides(suite_dir):
    p = suite_dir("mini", GOOD)
    a, b = load_suite(p)
    assert (a.name, a.suite, a.Hq, a.Hkv, a.d, a.sq, a.past_len, a.window, a.sink) == \
        ("a", "mini", 8, 2, 16, 24, 0, -1, "none")
    assert (b.past_len, b.window, b.sink, b.config) == (40, 7, "per_head", {"bkv": 32})
    assert list_suites() == ["mini"] and cases_dir() == suite_dir.dir
    assert load_suites(["mini"]) == [a, b]


def _one(body: str, defaults: str = "Hq = 8\nHkv = 2\nd = 16\nsq = 24\n") -> str:
    return f"[defaults]\n{defaults}\n[[case]]\nname = \"c1\"\nwhy = \"w\"\n{body}\n"


@pytest.mark.parametrize("body, key, words", [
    ("sinkk = \"per_head\"", "sinkk", "did you mean 'sink'"),
    ("Hq = \"64\"", "Hq", "expected an integer"),
    ("Hq = true", "Hq", "expected an integer"),
    ("Hkv = 3", "Hkv", "not a multiple"),
    ("window = 0", "window", "W >= 1"),
    ("window = -2", "window", "W >= 1"),
    ("window = 1.5", "window", "expected an integer"),
    ("past_len = -1", "past_len", ">= 0"),
    ("sq = 0", "sq", ">= 1"),
    ("d = 0", "d", ">= 1"),
    ("B = 0", "B", ">= 1"),
    ("sink = \"yes\"", "sink", "'per_head'"),
    ("dtype = \"fp8\"", "dtype", "'bf16'"),
    ("softcap = -1.0", "softcap", ">= 0"),
    ("scale = 0.0", "scale", "> 0"),
    ("config = { tile = 3 }", "config.tile", "unknown key"),
    ("config = { bkv = 48 }", "config.bkv", "(32, 64)"),
    ("config = { m_tiles = 0 }", "config.m_tiles", ">= 1"),
    ("config = 5", "config", "expected a table"),
    ("seed_contract = \"accept\"", "seed_contract", "decline"),
    ("seed = -3", "seed", ">= 0"),
])
def test_invalid_value_names_file_case_and_key(suite_dir, body, key, words):
    p = suite_dir("bad", _one(body))
    with pytest.raises(CaseError) as ei:
        load_suite(p)
    msg = str(ei.value)
    assert str(p) in msg and "case 'c1'" in msg and f": {key}: " in msg and words in msg, msg
    assert (ei.value.case, ei.value.key) == ("c1", key)
    assert isinstance(ei.value, ValueError)


def test_missing_required_key(suite_dir):
    p = suite_dir("bad", "[[case]]\nname = \"c1\"\nHq = 8\nHkv = 2\nd = 16\nwhy = \"w\"\n")
    with pytest.raises(CaseError, match=r"bad\.toml: case 'c1': sq: required key is missing"):
        load_suite(p)


def test_missing_name_is_located_by_position(suite_dir):
    p = suite_dir("bad", _one("") + "\n[[case]]\nwhy = \"no name\"\n")
    with pytest.raises(CaseError, match=r"case '#2': name: required key is missing"):
        load_suite(p)


@pytest.mark.parametrize("name", ["Bad", "-x", "a_b", "a b", ""])
def test_bad_names(suite_dir, name):
    p = suite_dir("bad", _one("").replace('name = "c1"', f'name = "{name}"'))
    with pytest.raises(CaseError, match=r": name: expected a string matching"):
        load_suite(p)


def test_why_is_one_line(suite_dir):
    p = suite_dir("bad", _one("").replace('why = "w"', 'why = """two\nlines"""'))
    with pytest.raises(CaseError, match=r"case 'c1': why: expected one non-empty line"):
        load_suite(p)


def test_duplicate_names_within_a_file(suite_dir):
    p = suite_dir("bad", GOOD.replace('name = "b"', 'name = "a"'))
    with pytest.raises(CaseError, match=r"bad\.toml: case 'a': name: duplicate case name"):
        load_suite(p)


def test_duplicate_names_across_suites(suite_dir):
    suite_dir("one", GOOD)
    p2 = suite_dir("two", GOOD.replace('name = "a"', 'name = "z"'))
    want = r"two\.toml: case 'b': name: duplicate case name \(also in .*one\.toml\)"
    with pytest.raises(CaseError, match=want) as ei:
        load_suites(["one", "two"])
    assert str(p2) in str(ei.value)
    assert len(load_suites(["one", "one"])) == 2  # the same suite twice is loaded once


@pytest.mark.parametrize("text, where", [
    (GOOD.replace("[defaults]", "[defaults]\nname = \"x\""), "case 'defaults': name: belongs to each case"),
    (GOOD.replace("sq = 24", "sq = 24\nwindoww = 3"), "case 'defaults': windoww: unknown key"),
    ("title = 'x'\n" + GOOD, "title: unknown key"),
    ("[[case]]\nname = ", "not valid TOML"),
    ("description = 'nothing'\n", "case: no [[case]] tables"),
])
def test_file_level_errors(suite_dir, text, where):
    p = suite_dir("bad", text)
    with pytest.raises(CaseError) as ei:
        load_suite(p)
    assert str(p) in str(ei.value) and where in str(ei.value)


def test_unknown_suite_lists_known(suite_dir):
    suite_dir("mini", GOOD)
    with pytest.raises(CaseError, match=r"unknown suite 'nope' \(known in .*: mini\)"):
        load_suite("nope")


def test_direct_construction_validates():
    with pytest.raises(CaseError, match=r"case 't': Hkv: Hq=4 query heads is not a multiple of Hkv=3"):
        _case(Hkv=3)
    c = _case(config={"m_tiles": 2, "bkv": 64}, scale=1)
    assert c.scale == 1.0 and isinstance(c.scale, float)
    assert hash(c) == hash(_case(config={"bkv": 64, "m_tiles": 2}, scale=1.0))
    assert len({c, _case(config={"m_tiles": 2, "bkv": 64}, scale=1), _case()}) == 2


# ------------------------------------------------------------------ the shipped suites

def test_every_shipped_suite_loads_with_unique_names(monkeypatch):
    monkeypatch.delenv("REFATTN_CASES_DIR", raising=False)
    names = list_suites()
    assert {"seed", "extended", "contracts"} <= set(names)
    cases = load_suites(names)
    assert len({c.name for c in cases}) == len(cases)
    assert all(c.why.strip() for c in cases)


def test_seed_is_the_seed_prs_23_cases(monkeypatch):
    monkeypatch.delenv("REFATTN_CASES_DIR", raising=False)
    seed = load_suite("seed")
    assert len(seed) == 23

    def key(c):
        cfg = tuple(sorted((c.config or {}).items()))
        return (c.Hq, c.Hkv, c.d, c.B, c.sq, c.past_len, c.window, c.sink, cfg, c.seed_contract)

    got = collections.Counter(key(c) for c in seed)
    want = collections.Counter()
    for p in (0, 512, 8192):  # no-sink baselines at d=128
        want[(32, 8, 128, 1, 512, p, -1, "none", (), None)] += 1
    for s in ("none", "per_head", "smooth"):  # gpt-oss sink modes x past
        for p in (0, 512, 8192):
            want[(64, 8, 64, 1, 512, p, -1, s, (), None)] += 1
    want[(32, 8, 128, 1, 512, 0, -1, "per_head", (), "decline")] += 1
    for p in (0, 512, 8192):  # window alone
        want[(64, 8, 64, 1, 512, p, 128, "none", (), None)] += 1
    for p in (512, 8192):  # window + sink
        want[(64, 8, 64, 1, 512, p, 128, "per_head", (), None)] += 1
    for bkv in (32, 64):  # the start-tile clamp
        want[(64, 8, 64, 1, 512, 512, 100, "none", (("bkv", bkv),), None)] += 1
    want[(64, 8, 64, 1, 512, 512, 2048, "none", (), None)] += 1  # wider than skv = 1024
    want[(64, 8, 64, 1, 512, 512, 1, "none", (), None)] += 1
    want[(32, 8, 128, 1, 512, 512, 128, "none", (), "decline")] += 1
    assert got == want
    wide = next(c for c in seed if c.window == 2048)
    assert wide.window > wide.skv
    assert all(c.dtype == "fp16" and c.softcap == 0 for c in seed)


def test_contracts_suite_covers_each_decline_reason(monkeypatch):
    monkeypatch.delenv("REFATTN_CASES_DIR", raising=False)
    cs = load_suite("contracts")
    assert {c.d for c in cs} >= {80, 96, 256}
    assert any(c.softcap > 0 for c in cs)
    assert {c.dtype for c in cs} >= {"bf16", "fp32"}


# ------------------------------------------------------------------ inputs

def test_inputs_are_deterministic_per_seed():
    c = _case(sink="per_head", seed=7)
    a, b = make_inputs(c), make_inputs(c)
    for name in ("q", "k", "v", "sink", "out"):
        assert getattr(a, name).tobytes() == getattr(b, name).tobytes(), name
    other = make_inputs(_case(sink="per_head", seed=8))
    for name in ("q", "k", "v", "sink"):
        assert getattr(a, name).tobytes() != getattr(other, name).tobytes(), name


def test_cases_differing_only_in_sink_share_q_k_v():
    a, b = make_inputs(_case(sink="per_head")), make_inputs(_case(sink="none"))
    for name in ("q", "k", "v"):
        assert getattr(a, name).tobytes() == getattr(b, name).tobytes()
    assert b.sink is None and not b.smooth_softmax
    s = make_inputs(_case(sink="smooth"))
    assert s.sink is None and s.smooth_softmax


def test_fp16_inputs_and_sink_distribution():
    i = make_inputs(_case(Hq=64, Hkv=8, sink="per_head"))
    assert i.q.dtype == i.k.dtype == i.v.dtype == np.float16
    assert i.sink.dtype == np.float16 and i.sink.shape == (64,)
    assert SINK_LOW <= i.sink.min() and i.sink.max() <= SINK_HIGH
    assert i.sink.min() < 0 < i.sink.max()
    q = i.q.astype(np.float64)
    assert abs(q.mean()) < 0.05 and abs(q.std() - 1) < 0.05


def test_kv_padding_holds_nan_canaries_and_clean_kv_cuts_it():
    for past, sq in ((30, 20), (0, 64), (37, 1)):
        c = _case(past_len=past, sq=sq)
        i = make_inputs(c)
        skv = past + sq
        assert i.k.shape == i.v.shape == (1, 2, c.s_cap, 16)
        assert c.s_cap - skv >= KV_PAD_MIN and c.s_cap % 64 == 0
        for a in (i.k, i.v):
            assert np.isnan(a[:, :, skv:]).all()
            assert np.isfinite(a[:, :, :skv]).all()
        k, v = i.clean_kv()
        assert k.shape == v.shape == (1, 2, skv, 16) and np.isfinite(k).all()


def test_output_buffer_is_the_canary():
    i = make_inputs(_case())
    assert i.out.shape == (1, 20, 4, 16) and i.out.dtype == np.float16
    assert (i.out.view(np.uint16) == OUT_CANARY_BITS).all() and np.isnan(i.out).all()
    assert i.out_intact()
    i.out[0, 3, 1, 2] = 0
    assert not i.out_intact()
    assert i.fresh_out().tobytes() == make_inputs(_case()).out.tobytes()


def test_bf16_rounding_is_nearest_even():
    one = 1.0
    ulp = 2.0**-7  # bf16 keeps 7 fraction bits
    x = np.array([one + ulp / 2, one + 3 * ulp / 2, one + ulp / 2 + 2**-20, -(one + ulp / 2),
                  np.finfo(np.float32).max, np.inf, np.nan, 0.0], dtype=np.float32)
    r = round_bf16(x)
    assert r[0] == one  # tie -> even (1.0)
    assert r[1] == one + 2 * ulp  # tie -> even (1 + 2^-6)
    assert r[2] == one + ulp  # above the tie -> up
    assert r[3] == -one
    assert np.isinf(r[4]) and np.isinf(r[5]) and np.isnan(r[6]) and r[7] == 0


def test_bf16_rounding_is_nearest_on_random_values():
    x = np.random.default_rng(0).standard_normal(10_000).astype(np.float32)
    r = round_bf16(x)
    assert (r.view(np.uint32) & 0xFFFF == 0).all()  # representable in bf16
    ulp = np.abs(r).view(np.uint32) + 0x10000  # next bf16 above |r|
    step = ulp.view(np.float32) - np.abs(r)
    assert (np.abs(x.astype(np.float64) - r) <= step / 2).all()


def test_inputs_round_through_the_case_dtype():
    b = make_inputs(_case(dtype="bf16"))
    assert b.q.dtype == np.float32 and (b.q.view(np.uint32) & 0xFFFF == 0).all()
    assert b.sink is None and b.out.dtype == np.float16
    f = make_inputs(_case(dtype="fp32"))
    assert f.q.dtype == np.float32 and (f.q.view(np.uint32) & 0xFFFF != 0).any()
    h = make_inputs(_case())
    assert np.array_equal(round_through(h.q.astype(np.float32), "fp16"), h.q)
    with pytest.raises(ValueError, match="dtype"):
        round_through(h.q, "fp8")


@pytest.mark.parametrize("past, sq, window", [(2, 3, 2), (2, 3, -1), (0, 5, 1), (37, 11, 16), (5, 4, 100)])
def test_flops_count_exactly_the_visible_pairs(past, sq, window):
    from refattn import visible

    c = _case(past_len=past, sq=sq, window=window, B=2, Hq=4, d=16)
    p = np.arange(past, past + sq)[:, None]
    j = np.arange(past + sq)[None, :]
    pairs = int(visible(p, j, window).sum())  # per sequence; the batch holds two
    assert c.visible_pairs == 2 * pairs and c.flops == 4 * 2 * 4 * 16 * pairs


def test_ragged_flops_count_each_sequence_own_rows():
    from refattn import visible

    c = _case(past_len=[0, 40, 7], q_len=[5, 0, 3], sq=5, window=4, B=3, Hq=4, d=16)
    pairs = 0
    for past, n in zip((0, 40, 7), (5, 0, 3)):
        p = np.arange(past, past + n)[:, None]
        pairs += int(visible(p, np.arange(past + n)[None, :], 4).sum())
    assert c.visible_pairs == pairs and c.flops == 4 * 4 * 16 * pairs
