"""The bad-input table (docs/bad-input.md) and the tests behind the rows no other file has.

docs/bad-input.md lists the kinds of bad input every entry point refuses (``refattn.attention``,
the oracle, ``hipkernel.attention``, ``hipkernel.flash_prefill_v3``, the CPU model, case files,
the ``refattn`` command line): the entry point, the input, the error and the start of its
message, and the test that checks it, as ``tests/<file>.py::<function>`` or
``tests/<file>.py::<function>[<param id>]``. This file

1. checks the table: every test it names exists (functions by reading the file, parametrized
   ids by pytest collection), there are at least 30 distinct rows, every entry point has
   rows, and where a row's test is a table of this file or of test_reference_bad_input.py
   the documented error and message are what the code raises;
2. holds the tests for rows covered nowhere else. "Rejected before any work" is checked
   the strict way: ``hipkernel`` calls get a ``tests.fake_backend.RecordingBackend`` and
   must leave ``be.calls == []`` (no allocation, copy, compile or launch) and the ``out``
   buffer byte-identical; CLI errors exit 2 with one line and never reach the runner;
3. pins the known gaps (the "Known gaps" table) as ``xfail(strict=True)`` with the fix.

A message prefix may contain ``…``, which stands for text that varies (a temporary path).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import hipkernel
from hipkernel import api
from refattn import cli
from refattn.cases import CaseError, canary_out, load_suite
from tests.fake_backend import RecordingBackend

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "bad-input.md"
THIS = "tests/test_bad_input_table.py"
ENTRY_POINTS = ("refattn.attention", "hipkernel.attention", "hipkernel.flash_prefill_v3",
                "case file", "refattn CLI")
COLUMNS = ("#", "entry point", "bad input", "error", "message starts with", "test")
TEST_REF = re.compile(r"tests/[\w/]+\.py::\w+(?:\[[^\]`]*\])?")


def matches_prefix(text: str, prefix: str) -> bool:
    """``text`` starts with ``prefix``, where ``…`` in the prefix matches anything."""
    pattern = ".*?".join(re.escape(part) for part in prefix.split("…"))
    return re.match(pattern, text, re.S) is not None


# =========================================================================== the table

def parse_tables(text: str) -> tuple[dict[str, list[dict]], list[str]]:
    """Rows of every table in the document, by the ``##`` section they sit in (cells
    stripped of surrounding backticks), and the lines that do not fit their table."""
    tables: dict[str, list[dict]] = {}
    problems, section, header = [], None, None
    for line in text.splitlines():
        if line.startswith("## "):
            section, header = line[3:].strip(), None
            continue
        if not line.startswith("|"):
            header = None
            continue
        if re.fullmatch(r"\|[\s:|-]+\|", line.strip()):
            continue  # the separator under a header
        cells = [c.strip() for c in line.strip()[1:-1].split(" | ")]
        if header is None:
            header = cells
        elif len(cells) != len(header):
            problems.append(f"{section}: {len(cells)} cells under a {len(header)}-column header: {line}")
        else:
            tables.setdefault(section, []).append(
                {h: c[1:-1] if c.startswith("`") and c.endswith("`") else c for h, c in zip(header, cells)})
    return tables, problems


TABLES, TABLE_PROBLEMS = parse_tables(DOC.read_text())
ROWS = TABLES.get("Rows", [])
GAPS = TABLES.get("Known gaps", [])


def _split(ref: str) -> tuple[str, str, str | None]:
    path, _, rest = ref.partition("::")
    func, _, param = rest.partition("[")
    return path, func, (param[:-1] if param else None)


def _functions(path: str) -> set[str]:
    tree = ast.parse((ROOT / path).read_text())
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_table_has_30_distinct_rows_over_every_entry_point():
    assert not TABLE_PROBLEMS, "docs/bad-input.md:\n" + "\n".join(TABLE_PROBLEMS)
    assert [list(r) for r in ROWS[:1]] == [list(COLUMNS)], "docs/bad-input.md: the Rows table's columns"
    kinds = {(r["entry point"], r["bad input"]) for r in ROWS}
    assert len(kinds) == len(ROWS), "duplicate (entry point, bad input) rows"
    assert len(kinds) >= 30, f"only {len(kinds)} distinct bad inputs"
    assert [int(r["#"]) for r in ROWS] == list(range(1, len(ROWS) + 1)), "rows are numbered 1..n"
    entries = {r["entry point"] for r in ROWS}
    assert set(ENTRY_POINTS) <= entries, f"entry points without rows: {set(ENTRY_POINTS) - entries}"
    for r in ROWS + GAPS:
        assert r["error"] and r["message starts with"] and TEST_REF.fullmatch(r["test"]), r


def test_every_named_test_exists():
    """Every ``tests/...::...`` the document names (table cells and prose alike) is a
    function in that file; a ``[param id]`` must be one pytest collects."""
    refs = set(TEST_REF.findall(DOC.read_text())) | {r["test"] for r in ROWS + GAPS}
    missing = [ref for ref in sorted(refs) if _split(ref)[1] not in _functions(_split(ref)[0])]
    assert not missing, f"no such test function: {missing}"
    with_ids = sorted(ref for ref in refs if _split(ref)[2] is not None)
    files = sorted({_split(ref)[0] for ref in with_ids})
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           *files], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    collected = {line.strip() for line in proc.stdout.splitlines() if "::" in line}
    assert collected, proc.stdout[-2000:] + proc.stderr[-2000:]
    missing = [ref for ref in with_ids if ref not in collected]
    assert not missing, f"pytest collects no such test: {missing}"


def test_known_gaps_are_strict_xfails():
    assert "## Known gaps" in DOC.read_text(), "docs/bad-input.md: the Known gaps section is missing"
    for r in GAPS:
        path, func, _ = _split(r["test"])
        assert path == THIS, r
        marks = [m for m in getattr(globals()[func], "pytestmark", []) if m.name == "xfail"]
        assert marks and marks[0].kwargs.get("strict") and marks[0].kwargs.get("reason"), func


def test_rows_on_this_files_tables_agree_with_the_code():
    """For the rows whose test is one of this file's parametrized tables, the documented
    error and message prefix are the ones the test asserts."""
    code = {}
    for func, table, err in (("test_hipkernel_attention_rejects_before_any_device_call", HIPKERNEL_BAD, "ValueError"),
                             ("test_flash_prefill_v3_rejects_before_any_device_call", V3_BAD, "ValueError"),
                             ("test_case_file_rejects", CASE_BAD, "CaseError"),
                             ("test_cli_rejects_with_exit_2", CLI_BAD, "exit 2")):
        code.update({f"{THIS}::{func}[{t[0]}]": (err, t[1]) for t in table})
    used = set()
    for r in ROWS:
        if r["test"] in code:
            assert (r["error"], r["message starts with"]) == code[r["test"]], r
            used.add(r["test"])
    assert used == set(code), f"table entries without a row in docs/bad-input.md: {sorted(set(code) - used)}"


def test_reference_rows_show_the_message_the_reference_raises():
    """Rows pointing at test_reference_bad_input.py's BAD list: replaying the bad call gives
    the documented message."""
    from refattn import attention
    from tests import test_reference_bad_input as R

    bad = {b[0]: b[2] for b in R.BAD}
    rows = [r for r in ROWS if r["test"].startswith("tests/test_reference_bad_input.py::test_reference_rejects[")]
    assert len(rows) >= 10
    for r in rows:
        c = bad[_split(r["test"])[2]](R.valid_call())
        with pytest.raises(ValueError) as e:
            attention(c.pop("q"), c.pop("k"), c.pop("v"), **c)
        assert r["error"] == "ValueError" and matches_prefix(str(e.value), r["message starts with"]), \
            f"row {r['#']}: {e.value}"


# =========================================================================== hipkernel.attention

B, SQ, HQ, HKV, D, PAST, CAP = 1, 8, 4, 2, 64, 4, 16  # a cache with spare capacity: 16 >= 4 + 8


def valid_attention_call() -> dict:
    rng = np.random.default_rng(0)
    return dict(
        q=rng.standard_normal((B, SQ, HQ, D)).astype(np.float16),
        k=rng.standard_normal((B, HKV, CAP, D)).astype(np.float16),
        v=rng.standard_normal((B, HKV, CAP, D)).astype(np.float16),
        past_len=PAST, window=-1, sink=np.array([0.5, -1, 2, -np.inf], np.float16),
        out=canary_out((B, SQ, HQ, D)),
    )


def _set(**kw):
    return lambda c: c | kw


def _with(name, fn):
    return lambda c: c | {name: fn(c[name])}


def _huge(shape):
    """A zero-stride view: any shape, no memory."""
    return np.broadcast_to(np.zeros((), np.float16), shape)


def _read_only(a):
    a = a.copy()
    a.flags.writeable = False
    return a


def _noncontiguous_same_shape(a):
    return np.ascontiguousarray(a.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)


# (param id, message prefix, how to break the valid call). Every one is a ValueError.
HIPKERNEL_BAD = [
    ("q-fortran-order", "q: expected a C-contiguous array", _with("q", np.asfortranarray)),
    ("k-negative-stride", "k: expected a C-contiguous array", _with("k", lambda k: k[:, :, ::-1])),
    ("v-transposed-view", "v: expected a C-contiguous array", _with("v", _noncontiguous_same_shape)),
    ("q-zero-stride-broadcast", "q: expected a C-contiguous array",
     _with("q", lambda q: np.broadcast_to(q[:, :1], q.shape))),
    ("q-absurd-size", "q: 34359738368 elements exceeds the limit of 17179869184",
     _set(q=_huge((1, 2**21, 2**8, 2**6)), k=_huge((1, 1, 2**21, 2**6)), v=_huge((1, 1, 2**21, 2**6)),
          past_len=0, sink=None, out=None)),
    ("k-absurd-cache", "k: 34359738368 elements exceeds the limit of 17179869184",
     _set(q=_huge((1, 1, 1, 64)), k=_huge((1, 1, 2**29, 64)), v=_huge((1, 1, 2**29, 64)),
          past_len=2**29 - 1, sink=None, out=None)),
    ("q-rank3", "q: expected rank 4 (B, Sq, Hq, d)", _with("q", lambda q: q[0])),
    ("q-int16", "q: expected a floating dtype", _with("q", lambda q: q.astype(np.int16))),
    ("q-empty-sq", "q: expected non-empty dimensions", _with("q", lambda q: q[:, :0])),
    ("v-shape-ne-k", "v: expected the same shape as k", _with("v", lambda v: v[:, :, :-1])),
    ("hq-not-multiple-of-hkv", "k: Hq=4 query heads is not a multiple of Hkv=3",
     lambda c: c | {"k": np.zeros((B, 3, CAP, D), np.float16), "v": np.zeros((B, 3, CAP, D), np.float16)}),
    ("past-len-beyond-cache", "past_len: k.shape[2]=16 holds fewer than past_len + Sq = 9 + 8 = 17 keys",
     _set(past_len=9)),
    ("past-len-negative", "past_len: expected an int >= 0, got -1", _set(past_len=-1)),
    ("window-zero", "window: expected -1 (no window) or W >= 1 keys, got 0", _set(window=0)),
    ("window-minus2", "window: expected -1 (no window) or W >= 1 keys, got -2", _set(window=-2)),
    ("sink-per-kv-head", "sink: expected shape (4,) (one logit per query head), got (2,)",
     _set(sink=np.zeros(2, np.float16))),
    ("sink-nan", "sink: expected finite logits or -inf (no sink for that head), got nan at head 1",
     _set(sink=np.array([0, np.nan, 0, 0], np.float16))),
    ("scale-nan", "scale: expected a finite float > 0 or None, got nan", _set(scale=float("nan"))),
    ("scale-inf", "scale: expected a finite float > 0 or None, got inf", _set(scale=float("inf"))),
    ("scale-beyond-fp32", "scale: 1e+39 is outside the normal float32 range", _set(scale=1e39)),
    ("window-beyond-int32", "window: expected at most 2147483647 keys", _set(window=2**31)),
    ("q-masked-array", "q: expected a plain numpy.ndarray (B, Sq, Hq, d), got the subclass numpy.ma",
     _with("q", np.ma.masked_array)),
    ("softcap-nan", "softcap: expected a finite float >= 0 (0 = off), got nan", _set(softcap=float("nan"))),
    ("smooth-softmax-int", "smooth_softmax: expected a bool, got 1", _set(smooth_softmax=1)),
    ("out-float32", "out: expected a float16 array of shape (1, 8, 4, 64), got float32",
     _with("out", lambda o: o.astype(np.float32))),
    ("out-wrong-shape", "out: expected a float16 array of shape (1, 8, 4, 64), got float16 (1, 8, 4, 32)",
     _with("out", lambda o: o[..., :32].copy())),
    ("out-list", "out: expected a float16 array of shape (1, 8, 4, 64), got list", _with("out", np.ndarray.tolist)),
    ("out-fortran-order", "out: expected a C-contiguous array", _with("out", np.asfortranarray)),
    ("out-read-only", "out: expected a writeable array", _with("out", _read_only)),
    ("config-unknown-key", "config: unknown keys ['tiles'] (known: m_tiles, bkv", _set(config={"tiles": 2})),
    ("config-tuple", "config: expected a KernelConfig, a dict or None, got (4, 64)", _set(config=(4, 64))),
    ("config-m-tiles-3", "config: m_tiles: expected one of (1, 2, 4, 8), got 3", _set(config={"m_tiles": 3})),
    ("config-bkv-48", "config: bkv: expected one of (16, 32, 64, 128), got 48", _set(config={"bkv": 48})),
    ("config-path-unknown",
     "config: path: expected one of ('scalar', 'mma', 'wgmma', 'wgspan', 'wmma', 'mfma'), got 'xmma'",
     _set(config={"path": "xmma"})),
    ("config-warp-m-scalar", "config: warp_m: 2 row groups a warp needs path 'mma'",
     _set(config={"warp_m": 2})),
    ("config-warp-m-3", "config: warp_m: expected one of (1, 2), got 3",
     _set(config={"path": "mma", "warp_m": 3})),
    ("backend-unknown-name", "backend: unknown backend 'nope' (have cuda, hip)", _set(backend="nope")),
]


def _call_hipkernel(c: dict):
    be = c.pop("backend", None)
    be = RecordingBackend() if be is None else be
    return be, lambda: hipkernel.attention(c.pop("q"), c.pop("k"), c.pop("v"), backend=be, **c)


@pytest.mark.parametrize("prefix,mutate", [t[1:] for t in HIPKERNEL_BAD], ids=[t[0] for t in HIPKERNEL_BAD])
def test_hipkernel_attention_rejects_before_any_device_call(prefix, mutate, monkeypatch):
    """A ValueError naming the argument, before any allocation, copy, compile or launch,
    with the output buffer and the inputs byte-identical."""
    monkeypatch.setenv("HIPKERNEL_TUNE", "0")
    c = mutate(valid_attention_call())
    before = {n: c[n].tobytes() for n in ("q", "k", "v", "out")
              if isinstance(c.get(n), np.ndarray) and c[n].strides[-1] != 0}
    be, call = _call_hipkernel(dict(c))
    with pytest.raises(ValueError) as e:
        call()
    assert matches_prefix(str(e.value), prefix), str(e.value)
    assert isinstance(be, str) or be.calls == [], f"device calls before the error: {be.calls}"
    for n, b in before.items():
        assert c[n].tobytes() == b, f"{n} was modified"


def test_valid_hipkernel_call_runs(monkeypatch):
    """The base call of the table is valid, so each rejection is due to its one change."""
    monkeypatch.setenv("HIPKERNEL_TUNE", "0")
    be, call = _call_hipkernel(valid_attention_call())
    status, out = call()
    assert status == 0 and out.shape == (B, SQ, HQ, D)
    assert sum(c[0] == "launch" for c in be.calls) == 1


# =========================================================================== flash_prefill_v3

def valid_v3_call() -> dict:
    return dict(q=0x1000, k=0x2000, v=0x3000, sink=0x4000, out=0x5000, B=1, Sq=4, Hq=4, Hkv=2,
                d=64, S_cap=8, past_len=4, window=-1, sink_mode="per_head")


V3_BAD = [
    ("B-zero", "B: expected an int >= 1, got 0", dict(B=0)),
    ("Sq-float", "Sq: expected an int >= 1, got 4.0", dict(Sq=4.0)),
    ("d-bool", "d: expected an int >= 1, got True", dict(d=True)),
    ("past-len-negative", "past_len: expected an int >= 0, got -1", dict(past_len=-1)),
    ("S-cap-below-skv", "S_cap: cache capacity 7 < past_len + Sq = 8", dict(S_cap=7)),
    ("hq-not-multiple-of-hkv", "Hkv: Hq=6 is not a multiple of Hkv=4", dict(Hq=6, Hkv=4)),
    ("window-zero", "window: expected -1 (no window) or W >= 1, got 0", dict(window=0)),
    ("window-float", "window: expected -1 (no window) or W >= 1, got 2.0", dict(window=2.0)),
    ("sink-mode-unknown", "sink_mode: expected one of ['none', 'per_head', 'smooth'], got 'sinks'",
     dict(sink_mode="sinks")),
    ("sink-pointer-missing", "sink: a device buffer is required when sink_mode='per_head'", dict(sink=0)),
    ("scale-inf", "scale: expected a finite float > 0, got inf", dict(scale=float("inf"))),
    ("scale-zero", "scale: expected a finite float > 0, got 0.0", dict(scale=0.0)),
    ("scale-beyond-fp32", "scale: 1e+39 is outside the normal float32 range", dict(scale=1e39)),
    ("window-beyond-int32", "window: 2147483648 does not fit the kernel's int32 arguments",
     dict(window=2**31)),
    ("softcap-negative", "softcap: expected a finite float >= 0, got -1.0", dict(softcap=-1.0)),
    ("q-misaligned", "q: device pointer 0x1008 is not 16-byte aligned", dict(q=0x1008)),
    ("sink-misaligned", "sink: device pointer 0x4002 is not 16-byte aligned", dict(sink=0x4002)),
    ("out-misaligned", "out: device pointer 0x5004 is not 16-byte aligned", dict(out=0x5004)),
    ("config-unknown-key", "config: unknown keys ['tile'] (known: m_tiles, bkv", dict(config={"tile": 4})),
    ("config-mma-without-tensor-cores", "config: path 'mma' needs an NVIDIA sm_80+ GPU, the backend targets sm_test",
     dict(config={"path": "mma"})),
    ("config-over-shared-memory", "config: bkv: 128 keys at d=128 need 131072 bytes of static shared memory",
     dict(d=128, config={"m_tiles": 8, "bkv": 128})),
    ("mutant-unknown", "mutant: unknown mutant 'no_such_bug'", dict(mutants={"no_such_bug"})),
]


def _v3(be, c):
    c = dict(c)
    return api.flash_prefill_v3(be, c.pop("q"), c.pop("k"), c.pop("v"), c.pop("sink"), c.pop("out"), **c)


@pytest.mark.parametrize("prefix,change", [t[1:] for t in V3_BAD], ids=[t[0] for t in V3_BAD])
def test_flash_prefill_v3_rejects_before_any_device_call(prefix, change, monkeypatch):
    """Device-level argument errors: a ValueError naming the argument and no backend call
    at all (not even a compile)."""
    monkeypatch.setenv("HIPKERNEL_TUNE", "0")
    be = RecordingBackend()
    with pytest.raises(ValueError) as e:
        _v3(be, valid_v3_call() | change)
    assert matches_prefix(str(e.value), prefix), str(e.value)
    assert be.calls == []


def test_valid_v3_call_launches(monkeypatch):
    monkeypatch.setenv("HIPKERNEL_TUNE", "0")
    be = RecordingBackend()
    assert _v3(be, valid_v3_call()) == 0 and [c[0] for c in be.calls] == ["compile", "launch", "synchronize"]


# =========================================================================== case files

CASE_HEAD = '[defaults]\nHq = 8\nHkv = 2\nd = 16\nsq = 24\n\n[[case]]\nname = "c1"\nwhy = "w"\n'
CASE_BAD = [
    ("scale-nan", "…/bad.toml: case 'c1': scale: expected a finite number > 0 (or leave it out), got nan",
     "scale = nan"),
    ("softcap-inf", "…/bad.toml: case 'c1': softcap: expected a finite number >= 0 (0 = off), got inf",
     "softcap = inf"),
    ("config-bkv-string", "…/bad.toml: case 'c1': config.bkv: expected an integer >= 1, got '64'",
     'config = { bkv = "64" }'),
    ("scale-int-beyond-float", "…/bad.toml: case 'c1': scale: expected a finite number > 0 (or leave "
     "it out), got 10000000000000000000...00000000 (401 characters)", "scale = 1" + "0" * 400),
    ("scale-beyond-fp32", "…/bad.toml: case 'c1': scale: 1e+39 is outside the normal float32 range",
     "scale = 1e39"),
    ("sq-beyond-host-memory", "…/bad.toml: case 'c1': sq: the run would need about 111.8 GiB of host "
     "memory", "Hq = 1\nHkv = 1\nd = 4\nsq = 1_000_000_000"),
]


@pytest.mark.parametrize("prefix,body", [t[1:] for t in CASE_BAD], ids=[t[0] for t in CASE_BAD])
def test_case_file_rejects(prefix, body, suite_dir, monkeypatch):
    """Rejected at load, naming the file, the case and the key; no inputs are made."""
    monkeypatch.setattr("refattn.cases.make_inputs", _tripwire("make_inputs"))
    p = suite_dir("bad", CASE_HEAD + body + "\n")
    with pytest.raises(CaseError) as e:
        load_suite(p)
    assert matches_prefix(str(e.value), prefix) and str(p) in str(e.value), str(e.value)


def _tripwire(what):
    def trip(*a, **kw):
        raise AssertionError(f"{what} ran after a usage error")
    return trip


# =========================================================================== command line

CLI_BAD = [
    ("run-config-unknown", "refattn run: error: kernel: cannot build 'model@nope': ValueError: config: "
     "expected a config name like", ["run", "--kernel", "model@nope"]),
    ("run-config-not-a-tile", "refattn run: error: kernel: cannot build 'model@mma_m3_b64': ValueError: "
     "config: 'mma_m3_b64': m_tiles: expected one of (1, 2, 4, 8), got 3", ["run", "--kernel", "model@mma_m3_b64"]),
    ("run-config-on-reference", "refattn run: error: kernel: 'reference' takes no @CONFIG (got 'reference@m4_b64')",
     ["run", "--kernel", "reference@m4_b64"]),
    ("run-config-empty", "refattn run: error: kernel: expected a config name after '@' in 'model@'",
     ["run", "--kernel", "model@"]),
    ("mutants-config-unknown", "refattn mutants: error: kernel: cannot build 'model@nope': ValueError: config: "
     "expected a config name like", ["mutants", "--kernel", "model@nope"]),
    ("run-gpus-zero", "refattn run: error: argument --gpus: expected at least 1 GPU, got 0",
     ["run", "--kernel", "reference", "--gpus", "0"]),
    ("run-gpus-not-a-number", "refattn run: error: argument --gpus: expected a whole number of GPUs, got 'two'",
     ["run", "--kernel", "reference", "--gpus", "two"]),
    ("run-json-without-path", "refattn run: error: argument --json: expected one argument", ["run", "--json"]),
    ("run-reference-variant", "refattn run: error: kernel: unknown reference variant 'fp8' (have fp32, fp64)",
     ["run", "--kernel", "reference:fp8"]),
    ("run-hipkernel-variant", "refattn run: error: kernel: unknown hipkernel variant 'rocm' (have cuda, hip)",
     ["run", "--kernel", "hipkernel:rocm"]),
    ("run-import-path-missing", "refattn run: error: kernel: 'tests.helpers_kernels:NoSuchKernel' is unavailable",
     ["run", "--kernel", "tests.helpers_kernels:NoSuchKernel"]),
    ("run-not-an-adapter", "refattn run: error: kernel: 'collections:OrderedDict' is not a kernel adapter",
     ["run", "--kernel", "collections:OrderedDict"]),
    ("cases-unknown-suite", "refattn cases: error: …/nosuch.toml: unknown suite 'nosuch'",
     ["cases", "--suite", "nosuch"]),
    ("mutants-unknown-mutant", "refattn mutants: error: mutant: unknown mutant 'no_such_bug'",
     ["mutants", "--mutant", "no_such_bug"]),
    ("mutants-unknown-kernel", "refattn mutants: error: kernel: unknown kernel 'nope'",
     ["mutants", "--kernel", "nope"]),
    ("mutants-k-matches-nothing", "refattn mutants: error: -k: no case name contains 'no-such-case'",
     ["mutants", "-k", "no-such-case", "-q"]),
    ("mutants-missing-case-file", "refattn mutants: error: nowhere/x.toml: no such case file",
     ["mutants", "--suite", "nowhere/x.toml"]),
    ("mutants-jobs-zero", "refattn mutants: error: argument -j/--jobs: expected at least 1 process, got 0",
     ["mutants", "--jobs", "0"]),
    ("run-json-is-a-directory", "refattn run: error: --json: … is a directory, expected a file path",
     ["run", "--kernel", "reference", "--json", str(ROOT / "cases")]),
    ("run-json-parent-is-a-file", "refattn run: error: --json: cannot write …/pyproject.toml/x.json: "
     "…/pyproject.toml is not a directory", ["run", "--kernel", "reference", "--json", str(ROOT / "pyproject.toml" / "x.json")]),
    ("run-report-is-a-file", "refattn run: error: --report: …/pyproject.toml is not a directory",
     ["run", "--kernel", "reference", "--report", str(ROOT / "pyproject.toml")]),
    ("mutants-json-is-a-directory", "refattn mutants: error: --json: … is a directory, expected a file path",
     ["mutants", "--json", str(ROOT / "cases")]),
]


@pytest.mark.parametrize("prefix,argv", [t[1:] for t in CLI_BAD], ids=[t[0] for t in CLI_BAD])
def test_cli_rejects_with_exit_2(prefix, argv, capsys, monkeypatch):
    """Exit status 2 and one ``refattn <command>: error: ...`` line (after argparse's usage
    line, for flag errors), no traceback, and neither the runner nor the kill matrix ran."""
    import refattn.killmatrix  # noqa: F401 - imported first, so it binds the real run_matrix, not the tripwire

    monkeypatch.delenv("REFATTN_CASES_DIR", raising=False)
    monkeypatch.setattr("refattn.runner.run_matrix", _tripwire("run_matrix"))
    monkeypatch.setattr("refattn.killmatrix.run_kill_matrix", _tripwire("run_kill_matrix"))
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and lines, err
    assert matches_prefix(lines[-1], prefix), err
    assert "Traceback" not in err and out == ""


# =========================================================================== known gaps

@pytest.mark.parametrize("change", [dict(mutants={"no_such_bug"}), dict(mutants="no_nan_guard"),
                                    dict(config={"m_tiles": 8, "bkv": 128}), dict(config={"path": "mma"})],
                         ids=["mutant-unknown", "mutants-as-a-string", "config-over-shared-memory",
                              "mma-on-a-target-without-it"])
def test_hipkernel_attention_checks_everything_before_allocating(change, monkeypatch):
    monkeypatch.setenv("HIPKERNEL_TUNE", "0")
    c = valid_attention_call() | change
    if "config" in change:  # the limit bites at d = 128
        rng = np.random.default_rng(0)
        c |= {x: rng.standard_normal(c[x].shape[:3] + (128,)).astype(np.float16) for x in ("q", "k", "v")}
        c["out"] = canary_out(c["q"].shape)
    be, call = _call_hipkernel(c)
    with pytest.raises(ValueError):
        call()
    assert be.calls == []


def test_hipkernel_attention_rejects_a_sink_beyond_fp16(monkeypatch):
    monkeypatch.setenv("HIPKERNEL_TUNE", "0")
    c = valid_attention_call() | {"sink": np.array([0, 1e5, 0, 0], np.float32)}
    be, call = _call_hipkernel(c)
    with np.errstate(over="ignore"), pytest.raises(ValueError, match="^sink"):
        call()
    assert be.calls == []


@pytest.mark.parametrize("change", [dict(S_cap=2**31, past_len=4), dict(S_cap=2**31 + 2, past_len=2**31 - 2)],
                         ids=["S_cap-over-int32", "past-plus-sq-over-int32"])
def test_flash_prefill_v3_refuses_int32_overflow(change, monkeypatch):
    monkeypatch.setenv("HIPKERNEL_TUNE", "0")
    be = RecordingBackend()
    with pytest.raises(ValueError, match="^(S_cap|past_len)"):
        _v3(be, valid_v3_call() | change)
    assert be.calls == []


def test_case_file_that_is_not_utf8_names_the_byte_and_line(suite_dir):
    p = suite_dir("bad", "")
    p.write_bytes(CASE_HEAD.encode() + b'# caf\xe9\n')
    with pytest.raises(CaseError) as e:
        load_suite(p)
    assert str(e.value) == f"{p}: not UTF-8 text: byte 0xe9 at line 10"


def test_case_file_rejects_an_uncompiled_m_tiles(suite_dir):
    p = suite_dir("bad", CASE_HEAD + "config = { m_tiles = 3 }\n")
    with pytest.raises(CaseError, match=r"config\.m_tiles"):
        load_suite(p)


def test_case_file_refuses_an_absurd_geometry(suite_dir):
    p = suite_dir("bad", CASE_HEAD.replace("Hq = 8", "Hq = 64").replace("d = 16", "d = 128")
                  + "sq = 1073741824\n")
    with pytest.raises(CaseError, match=r"case 'c1': (sq|B|Hq|d)"):
        load_suite(p)


def test_valid_case_file_loads(suite_dir):
    """The base of the case-file rows loads, so each rejection is due to its one line."""
    (c,) = load_suite(suite_dir("good", CASE_HEAD))
    assert (c.name, c.Hq, c.sq) == ("c1", 8, 24)
