"""Nothing lost, nothing half-written: how the command line writes what it found.

* output paths are checked before any case runs (a bad one is exit 2, naming the option);
* the result files are written before the table is printed, each atomically (a reader never
  sees an empty or partial file), and a write that fails even so keeps the results in a
  temporary file whose name is printed;
* a non-finite metric (a relL2 of inf) is written as ``null`` with the reason, and the table
  still prints;
* a reader of standard output that goes away ends the command quietly (exit 141, no
  traceback), and the result files are already written;
* a bad ``$REFATTN_*`` variable is one usage line (exit 2), checked before any work;
* a case the host cannot hold is an ``error`` with the reason, not a MemoryError.
"""

from __future__ import annotations

import errno
import io
import json
import os
import threading

import numpy as np
import pytest

from refattn import cli, fileio
from refattn.cases import Case
from refattn.runner import InputCache, ReferenceCache, run_case
from tests.helpers_kernels import CorrectKernel

TINY = """
[[case]]
name = "tiny-sink"
Hq = 4
Hkv = 2
d = 16
sq = 24
past_len = 40
sink = "per_head"
why = "a sink on a tiny shape"
"""


class HugeKernel(CorrectKernel):
    """Returns finite float64 values so large that the squared error overflows: relL2 = inf."""

    name = "huge"

    def run(self, inputs):
        return 0, np.full(inputs.q.shape, 1e300)


@pytest.fixture
def suite(tmp_path, monkeypatch):
    d = tmp_path / "cases"
    d.mkdir()
    (d / "tiny.toml").write_text(TINY)
    monkeypatch.setenv("REFATTN_CASES_DIR", str(d))
    return "tiny"


def _tripwire(what):
    def trip(*a, **kw):
        raise AssertionError(f"{what} ran after a usage error")
    return trip


# --------------------------------------------------------------------------- before the run

def test_output_paths_are_checked_before_any_case_runs(tmp_path, suite, capsys, monkeypatch):
    monkeypatch.setattr("refattn.runner.run_matrix", _tripwire("run_matrix"))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for argv, opt in ((["--json", str(tmp_path)], "--json"),
                      (["--json", str(blocker / "r.json")], "--json"),
                      (["--report", str(blocker)], "--report"),
                      (["--report", str(blocker / "sub")], "--report")):
        code = cli.main(["run", "--kernel", "reference", "--suite", suite, *argv])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith(f"refattn run: error: {opt}: "), err
        assert "Traceback" not in err


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="root writes into any directory, so no path is unwritable")
def test_an_unwritable_directory_is_refused_before_the_run(tmp_path, suite, capsys, monkeypatch):
    monkeypatch.setattr("refattn.runner.run_matrix", _tripwire("run_matrix"))
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        code = cli.main(["run", "--kernel", "reference", "--suite", suite, "--json", str(locked / "r.json")])
    finally:
        locked.chmod(0o700)
    err = capsys.readouterr().err
    assert code == 2 and "--json: directory" in err and "is not writable" in err, err


def test_a_missing_parent_directory_is_created(tmp_path, suite, capsys):
    path = tmp_path / "a" / "b" / "r.json"
    code = cli.main(["run", "--kernel", "reference", "--suite", suite, "-q", "--json", str(path),
                     "--report", str(tmp_path / "rep" / "x")])
    assert code == 0, capsys.readouterr().err
    assert json.loads(path.read_text())["ok"] is True
    assert (tmp_path / "rep" / "x" / "run-reference.json").is_file()


@pytest.mark.parametrize("argv,command", [
    (["run", "--kernel", "reference", "--suite", "tiny"], "run"),
    (["mutants", "--suite", "tiny", "-q"], "mutants"),
    (["cases", "--suite", "tiny"], "cases"),
], ids=["run", "mutants", "cases"])
@pytest.mark.parametrize("var,value", [
    ("REFATTN_THREADS", "garbage"), ("REFATTN_THREADS", "0"), ("REFATTN_REF_CACHE_MB", "1GB"),
    ("REFATTN_INPUT_CACHE_MB", "-1"), ("REFATTN_CASES_DIR", "/nonexistent/cases"),
], ids=["threads-garbage", "threads-zero", "ref-cache-1GB", "input-cache-negative", "cases-dir-missing"])
def test_a_bad_environment_variable_is_one_usage_line(argv, command, var, value, suite, capsys,
                                                       monkeypatch):
    """Checked once, before the command's work: every case failing with the same message
    (what a garbage ``$REFATTN_THREADS`` did) is one line naming the variable instead."""
    import refattn.killmatrix  # noqa: F401 - bound to the real run_matrix before the tripwire

    monkeypatch.setattr("refattn.runner.run_matrix", _tripwire("run_matrix"))
    monkeypatch.setattr("refattn.killmatrix.run_kill_matrix", _tripwire("run_kill_matrix"))
    monkeypatch.setenv(var, value)
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.strip().splitlines()[-1].startswith(f"refattn {command}: error: {var}: expected"), err
    assert repr(value) in err and "Traceback" not in err


# --------------------------------------------------------------------------- after the run

def test_a_non_finite_metric_is_null_with_its_reason_and_the_table_prints(tmp_path, suite, capsys):
    path = tmp_path / "r.json"
    code = cli.main(["run", "--kernel", "tests.test_cli_outputs:HugeKernel", "--suite", suite, "-q",
                     "--json", str(path)])
    out, err = capsys.readouterr()
    assert code == 1, err
    assert "tiny-sink" in out and "FAILED" in out  # the table and the verdict
    doc = json.loads(path.read_text())  # strict JSON: no Infinity
    r = doc["results"][0]
    assert r["outcome"] == "fail" and r["rel_l2"] is None
    assert doc["nonfinite"]["values"]["results[0].rel_l2"] == "inf"
    assert "null" in doc["nonfinite"]["why"]


def test_results_are_written_before_the_table_so_a_closed_pipe_loses_nothing(tmp_path, suite,
                                                                            capsys, monkeypatch):
    def closed_pipe(m):
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    monkeypatch.setattr(cli, "_results_table", closed_pipe)
    out_fd = os.open(tmp_path / "stdout", os.O_WRONLY | os.O_CREAT)
    fake = io.TextIOWrapper(io.FileIO(out_fd, "w", closefd=False))
    monkeypatch.setattr("sys.stdout", fake)
    code = cli.main(["run", "--kernel", "reference", "--suite", suite, "-q",
                     "--json", str(tmp_path / "r.json"), "--report", str(tmp_path / "rep")])
    os.close(out_fd)
    assert code == cli.EXIT_BROKEN_PIPE
    assert "Traceback" not in capsys.readouterr().err
    assert json.loads((tmp_path / "r.json").read_text())["ok"] is True
    assert json.loads((tmp_path / "rep" / "run-reference.json").read_text())["ok"] is True


class _ClosedStdout(io.TextIOBase):
    """A standard output whose reader went away: every write raises BrokenPipeError. Its file
    descriptor is a real one, so the command can point it at /dev/null."""

    def __init__(self, fd: int):
        self._fd = fd

    def write(self, s):
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    def fileno(self):
        return self._fd

    def isatty(self):
        return False


@pytest.mark.parametrize("argv", [
    ["cases"], ["cases", "--json"], ["kernels"], ["kernels", "--json"],
    ["run", "--kernel", "reference", "--suite", "tiny", "-q"],
    ["run", "--kernel", "reference", "--suite", "tiny", "-q", "--json", "-"],
    ["mutants", "--suite", "tiny", "-q", "--mutant", "no_nan_guard"],
    ["--help"], ["run", "--help"],
], ids=lambda a: "-".join(x.strip("-") for x in a[:2]) + ("-json-stdout" if "-" in a else ""))
def test_every_subcommand_ends_quietly_on_a_closed_pipe(argv, suite, tmp_path, capsys, monkeypatch):
    fd = os.open(tmp_path / "stdout", os.O_WRONLY | os.O_CREAT)
    monkeypatch.setattr("sys.stdout", _ClosedStdout(fd))
    try:
        code = cli.main(argv)
    finally:
        os.close(fd)
    err = capsys.readouterr().err
    # argparse ignores an OSError while printing --help and exits 0 as usual
    assert code == (0 if "--help" in argv else cli.EXIT_BROKEN_PIPE), err
    assert "Traceback" not in err and "BrokenPipeError" not in err


def test_a_closed_pipe_ends_a_real_process_quietly(tmp_path):
    """The same in a process of its own, whose interpreter flushes standard output at exit:
    the reader is gone before anything is written."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r, w = os.pipe()
    os.close(r)
    proc = subprocess.run([sys.executable, "-m", "refattn", "cases", "--json"], stdout=w,
                          stderr=subprocess.PIPE, text=True, cwd=root,
                          env={**os.environ, "PYTHONPATH": root})
    os.close(w)
    assert proc.returncode == cli.EXIT_BROKEN_PIPE, proc.stderr
    assert proc.stderr == ""


def test_a_write_that_fails_after_the_run_keeps_the_results(tmp_path, suite, capsys, monkeypatch):
    def full_disk(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fileio, "atomic_write_text", full_disk)
    code = cli.main(["run", "--kernel", "reference", "--suite", suite, "-q", "--json", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert code == 1, err
    line = [ln for ln in err.splitlines() if "cannot write" in ln][0]
    assert line.startswith(f"refattn run: error: cannot write {tmp_path / 'r.json'}: No space left")
    kept = line.rsplit("the results are in ", 1)[1]
    try:
        assert json.loads(open(kept).read())["ok"] is True
    finally:
        os.unlink(kept)


# --------------------------------------------------------------------------- atomic writes

def test_atomic_write_never_shows_a_reader_an_empty_or_partial_file(tmp_path):
    """A reader polling the file while it is rewritten sees one complete document or the
    other. (With a plain ``write_text`` about 1 % of such reads saw an empty file.)"""
    path = tmp_path / "r.json"
    docs = [json.dumps({"n": n, "pad": "x" * 20000}) for n in range(2)]
    fileio.atomic_write_text(path, docs[0])
    stop, seen = threading.Event(), []

    def read():
        while not stop.is_set():
            seen.append(path.read_text())

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(300):
            fileio.atomic_write_text(path, docs[i % 2])
    finally:
        stop.set()
        reader.join()
    assert seen and all(text in docs for text in seen)
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary file left


def test_atomic_write_keeps_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    path.write_text("old")

    def fail(*a):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        fileio.atomic_write_text(path, "new")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_json_text_lists_every_non_finite_value():
    doc = {"a": [1.0, float("inf"), {"b": float("nan")}], "c": -float("inf"), "d": 2}
    parsed = json.loads(fileio.json_text(doc))
    assert parsed["a"] == [1.0, None, {"b": None}] and parsed["c"] is None and parsed["d"] == 2
    assert parsed["nonfinite"]["values"] == {"a[1]": "inf", "a[2].b": "nan", "c": "-inf"}
    assert "nonfinite" not in json.loads(fileio.json_text({"a": 1.0}))


# --------------------------------------------------------------------------- host memory

def test_a_case_the_host_cannot_hold_is_an_error_before_any_input_is_made(monkeypatch):
    case = Case(name="big", Hq=4, Hkv=2, d=16, sq=24, why="w")
    monkeypatch.setattr("refattn.runner.host_memory_bytes", lambda: case.host_bytes - 1)
    monkeypatch.setattr("refattn.runner.make_inputs", _tripwire("make_inputs"))
    r = run_case(CorrectKernel(), case, cache=ReferenceCache(0), input_cache=InputCache(0))
    assert r.outcome == "error" and r.note.startswith("needs about") and "this host has" in r.note
