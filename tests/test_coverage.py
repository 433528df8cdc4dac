"""The coverage model (refattn.coverage): predicates on hand-made cases, the table over case
lists, the ``complete = true`` claim of a suite, and ``refattn cases --coverage``."""

from __future__ import annotations

import json

import pytest

from refattn import cli
from refattn.cases import Case, CaseError, load_suite, load_suites, suite_complete
from refattn.coverage import AXES, PAIRS, case_cells, coverage, tile_values, unhit_required


def _case(**kw) -> Case:
    base = dict(name="t", Hq=8, Hkv=2, d=64, sq=16, why="w")
    return Case(**{**base, **kw})


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------ predicates

@pytest.mark.parametrize("Hq, Hkv, want", [
    (4, 4, {"1"}), (8, 1, {"pow2", "=Hq"}), (24, 2, {"non-pow2"}), (48, 2, {"non-pow2", ">16"}),
    (64, 2, {"pow2", ">16"}), (12, 1, {"non-pow2", "=Hq"}), (1, 1, {"1"}),
])
def test_the_g_axis(Hq, Hkv, want):
    assert case_cells(_case(Hq=Hq, Hkv=Hkv))["G"] == want


@pytest.mark.parametrize("n, want", [
    (16, {"16k"}), (128, {"16k", "32k", "64k", "128k"}),
    (127, {"16k-1", "32k-1", "64k-1", "128k-1", "prime"}),
    (129, {"16k+1", "32k+1", "64k+1", "128k+1"}),
    (257, {"16k+1", "32k+1", "64k+1", "128k+1", "prime"}),
    (15, {"16k-1"}), (1, set()), (17, {"16k+1", "prime"}), (97, {"16k+1", "32k+1", "prime"}),
])
def test_lengths_relative_to_every_tile(n, want):
    assert case_cells(_case(sq=n))["sq"] == want
    assert case_cells(_case(sq=1, past_len=n - 1))["skv"] == want


def test_tile_sizes_are_an_argument():
    c = _case(sq=73)
    assert case_cells(c, {"q": (72,), "kv": (72,)})["sq"] == {"72k+1", "prime"}
    assert tile_values((72,)) == ("72k", "72k-1", "72k+1", "prime")
    cov = coverage([c], {"q": (72,), "kv": (8,)})
    assert set(cov.cells["sq"]) == {"72k", "72k-1", "72k+1", "prime"}
    assert "sq=72k" in cov.unhit_required() and "sq=16k" not in cov.unhit_required()
    with pytest.raises(ValueError, match="tile sizes"):
        coverage([c], {"q": (), "kv": (16,)})


@pytest.mark.parametrize("kw, want", [
    (dict(), {"none"}),
    (dict(window=1, past_len=40), {"1", "cuts-cache"}),
    (dict(window=5), {"<tile"}),
    (dict(window=64, past_len=512), {"=tile", "cuts-cache", "cuts-whole-tiles"}),
    (dict(window=100, past_len=200), {"not-tile-multiple", "cuts-cache"}),
    (dict(window=96, past_len=0), {"no-op"}),  # 96 is a multiple of 16 and 32: neither value
    (dict(window=2048, past_len=512), {"no-op"}),
    (dict(window=16, past_len=0), {"=tile", "no-op"}),
])
def test_the_window_axis(kw, want):
    assert case_cells(_case(**kw))["window"] == want


def test_sink_weight_small_and_dominant():
    assert case_cells(_case())["sink-weight"] == set()
    # one key on the first row against sinks up to 4: dominant; 16 keys on the last: small
    assert case_cells(_case(sink="per_head"))["sink-weight"] == {"small", "dominant"}
    assert case_cells(_case(sink="per_head", past_len=1000))["sink-weight"] == {"small"}
    # smooth softmax (a zero logit) never outweighs even one key of N(0, 1) logits
    assert case_cells(_case(sink="smooth"))["sink-weight"] == {"small"}
    # under an offset of -5e4 the zero logit dominates every row; per-head sinks move along
    off = dict(logit_offset=-5e4, past_len=1000)
    assert case_cells(_case(sink="smooth", **off))["sink-weight"] == {"dominant"}
    assert case_cells(_case(sink="per_head", **off))["sink-weight"] == {"small"}


def test_softcap_magnitude_cache_batch_dtype_scale():
    cells = case_cells(_case(softcap=3.0, dtype="bf16", B=2, scale=0.5))
    assert cells["softcap"] == {"small"} and cells["dtype"] == {"bf16"}
    assert cells["batch"] == {">1"} and cells["scale"] == {"custom"}
    assert case_cells(_case(softcap=30.0))["softcap"] == {"large"}
    assert case_cells(_case(softcap=10.0))["softcap"] == {"other"}
    assert case_cells(_case(logit_offset=-5e4))["magnitude"] == {"logit-offset"}
    assert case_cells(_case(q_spike=4e4))["magnitude"] == {"q-spike"}
    assert case_cells(_case(q_spike=100.0))["magnitude"] == {"unit"}  # 2 * 100 < 65504
    w = dict(window=8, past_len=40)
    assert case_cells(_case(**w))["cache-outside"] == {"nan-past-skv", "clean-left-of-window"}
    assert case_cells(_case(cache_fill="nan-outside-window", **w))["cache-outside"] == {
        "nan-past-skv", "nan-left-of-window"}
    assert case_cells(_case(cache_fill="inf-outside-window", spare=0, **w))["cache-outside"] == {
        "tight", "inf-left-of-window"}


def test_every_predicate_names_only_its_axis_values():
    import itertools

    variants = [dict(), dict(window=1, past_len=3), dict(sink="smooth", softcap=4.0),
                dict(Hq=24, Hkv=2, sq=127, past_len=128, sink="per_head", logit_offset=-5e4)]
    for kw in variants:
        for ax in AXES:
            assert ax.hits(_case(**kw)) <= set(ax.values)
    for p in PAIRS:
        axes = {a.name: a for a in AXES}
        assert p.a in axes and p.b in axes
        for x, y in p.required:
            assert x in axes[p.a].values and y in axes[p.b].values
    for ax in AXES:
        assert set(ax.required) <= set(ax.values) and not set(ax.required) & set(ax.future)
    assert len(list(itertools.chain.from_iterable(ax.values for ax in AXES))) > 50


# ------------------------------------------------------------------ the table

def test_coverage_lists_the_cases_of_every_cell_and_pair():
    a = _case(name="a", Hq=24, Hkv=2, softcap=3.0, window=5, past_len=40)
    b = _case(name="b", sink="per_head", softcap=3.0)
    cov = coverage([a, b])
    assert cov.cells["G"]["non-pow2"] == ["adhoc/a"] and cov.cells["G"]["pow2"] == ["adhoc/b"]
    assert cov.cells["softcap"]["small"] == ["adhoc/a", "adhoc/b"]
    assert cov.pairs["softcap x window"][("small", "cuts-cache")] == ["adhoc/a"]
    assert cov.pairs["softcap x sink"][("small", "per_head")] == ["adhoc/b"]
    assert cov.pairs["G x Hkv"][("non-pow2", ">1")] == ["adhoc/a"]
    unhit = cov.unhit_required()
    assert "softcap=small & window=cuts-cache" not in unhit
    assert "G=>16" in unhit and "dtype=fp32" in unhit
    assert "magnitude=logit-offset & sink=none" in unhit
    assert cov.per_case["adhoc/a"]["window"] == ["<tile", "cuts-cache"]
    doc = cov.to_json(limit=1)
    assert doc["complete"] is False and doc["unhit_required"] == unhit
    g = next(x for x in doc["axes"] if x["axis"] == "G")
    assert {"value": "non-pow2", "required": True, "future": False, "count": 1,
            "cases": ["adhoc/a"]} in g["values"]
    json.dumps(doc)


def test_a_pair_cell_needs_both_values_on_one_case():
    """A small softcap without a window and a window without a softcap: each value hit,
    the pair cell not."""
    a = _case(name="a", softcap=3.0)
    b = _case(name="b", window=5, past_len=40)
    unhit = unhit_required([a, b])
    assert "softcap=small" not in unhit and "window=cuts-cache" not in unhit
    assert "softcap=small & window=cuts-cache" in unhit


# ------------------------------------------------------------------ complete suites

def test_the_coverage_suite_is_complete_on_its_own(monkeypatch):
    monkeypatch.delenv("REFATTN_CASES_DIR", raising=False)
    assert suite_complete("coverage")
    assert unhit_required(load_suite("coverage")) == []


def test_the_default_matrix_hits_every_required_cell(monkeypatch):
    monkeypatch.delenv("REFATTN_CASES_DIR", raising=False)
    assert unhit_required(load_suites(["seed", "coverage"])) == []
    # the seed suite alone does not: this is why the coverage suite exists
    seed = set(unhit_required(load_suite("seed")))
    assert {"G=non-pow2", "G=>16", "skv=128k-1", "softcap=small", "magnitude=logit-offset",
            "cache-outside=nan-left-of-window"} <= seed


def test_every_shipped_suite_that_declares_complete_is(monkeypatch):
    from refattn.cases import list_suites

    monkeypatch.delenv("REFATTN_CASES_DIR", raising=False)
    for name in list_suites():
        if suite_complete(name):
            assert unhit_required(load_suite(name)) == [], name


@pytest.mark.parametrize("drop, cell", [
    ("cov-nan-left-w100-past640", "cache-outside=nan-left-of-window"),
    ("cov-g24-sq129-past128-w512", "G=>16"),
    ("cov-softcap3-w5-sink", "softcap=small & window=cuts-cache"),
    ("cov-offset-5e4-nosink", "magnitude=logit-offset & sink=none"),
    ("cov-spike-4e4-sink", "magnitude=q-spike"),
])
def test_removing_a_case_leaves_its_cell_unhit(monkeypatch, drop, cell):
    monkeypatch.delenv("REFATTN_CASES_DIR", raising=False)
    cases = load_suite("coverage")
    assert cell not in unhit_required(cases)
    assert cell in unhit_required([c for c in cases if c.name != drop])


def _write_suite(path, complete, cases_text):
    path.write_text(f"complete = {complete}\n\n" + cases_text)
    return path


ONE_CASE = '[[case]]\nname = "one"\nHq = 8\nHkv = 2\nd = 64\nsq = 16\nwhy = "w"\n'


def test_a_suite_declaring_complete_that_is_not_fails_the_command(capsys, tmp_path):
    p = _write_suite(tmp_path / "claims.toml", "true", ONE_CASE)
    assert suite_complete(p)
    code, out, err = run_cli(capsys, "cases", "--coverage", "--suite", str(p))
    assert code == 1 and "declares complete = true but leaves required cells unhit" in err
    assert "UNHIT" in out and "G=non-pow2" in out
    code, out, err = run_cli(capsys, "cases", "--coverage", "--json", "--suite", str(p))
    doc = json.loads(out)
    assert code == 1 and doc["suites"]["claims"]["complete_declared"] is True
    assert "G=non-pow2" in doc["suites"]["claims"]["unhit_required"]
    # without the claim the same suite is only reported
    q = _write_suite(tmp_path / "plain.toml", "false", ONE_CASE)
    assert run_cli(capsys, "cases", "--coverage", "--suite", str(q))[0] == 0


def test_complete_must_be_a_boolean(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text('complete = "yes"\n\n' + ONE_CASE)
    with pytest.raises(CaseError, match="complete: expected true or false"):
        load_suite(p)


# ------------------------------------------------------------------ the command

def test_cases_coverage_prints_the_table_and_per_case_cells(capsys, monkeypatch):
    monkeypatch.delenv("REFATTN_CASES_DIR", raising=False)
    code, out, err = run_cli(capsys, "cases", "--coverage", "--suite", "seed", "coverage",
                             "--per-case", "--limit", "2")
    assert code == 0, err
    assert "every required cell hit" in out and "cells per case" in out
    assert "suite coverage (declares complete = true): every required cell hit" in out
    assert "suite seed: " in out and "required cells unhit" in out
    assert "coverage/cov-g12-sq127-past128" in out and "G=non-pow2" in out
    code, out, _ = run_cli(capsys, "cases", "--coverage", "--suite", "seed", "coverage", "--json",
                           "--per-case", "--kv-tiles", "16,32,64,128,256")
    doc = json.loads(out)
    assert doc["coverage"]["tiles"]["kv"] == [16, 32, 64, 128, 256]
    # a 256-key tile: skv = 255 and 257 are 256k -+ 1 too, but 449 evicted slots are less
    # than two whole tiles, so the suite that claims completeness misses a pair cell
    cell = "window=cuts-whole-tiles & cache-outside=inf-left-of-window"
    assert doc["coverage"]["unhit_required"] == [cell]
    assert code == 1 and doc["suites"]["coverage"]["unhit_required"] == [cell]
    assert doc["per_case"]["coverage/cov-g24-sq129-past128-w512"]["G"] == ["non-pow2", ">16"]


def test_cases_coverage_usage_errors(capsys):
    code, _, err = run_cli(capsys, "cases", "--per-case")
    assert code == 2 and "--per-case: needs --coverage" in err
    code, _, err = run_cli(capsys, "cases", "--coverage", "--q-tiles", "16,x")
    assert code == 2 and "--q-tiles" in err


def test_the_default_matrix_covers_the_fused_kernels_own_tiles(capsys, monkeypatch):
    monkeypatch.delenv("REFATTN_CASES_DIR", raising=False)
    code = cli.main(["cases", "--coverage", "--suite", "seed", "--suite", "coverage",
                     "--tiles-of", "model", "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    cov = json.loads(out)["coverage"]
    assert cov["unhit_required"] == [] and cov["tiles"]["kv"] == [32, 64, 128, 136]
    hit = {a["axis"]: {v["value"] for v in a["values"] if v["count"]} for a in cov["axes"]}
    assert {"256k", "256k-1", "256k+1"} <= hit["sq"] and {"136k", "136k-1", "136k+1"} <= hit["skv"]
    assert cli.main(["cases", "--coverage", "--tiles-of", "reference"]) == 2
    assert "has no tile_sizes()" in capsys.readouterr().err
