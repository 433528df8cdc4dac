"""hipkernel.gpu_session's bench section: a bench record whose checks passed but whose
performance targets were missed is a finding the record keeps, not a failed section; a
failed check, a missing or unreadable record still fails it."""

from __future__ import annotations

import json
import subprocess
from types import SimpleNamespace

import pytest

from hipkernel import gpu_session


def _targets(**over):
    tg = {"hits": ["a"], "misses": [], "untimed": [], "flat": [], "bf16_within": [], "peer_within": []}
    tg.update(over)
    return tg


PEER_MISS = [{"shape": "gptoss-16384@0", "peer": "fa4", "factor": 0.95, "mode": "sink",
              "kernel_ms": 4.3, "peer_ms": 4.2, "ratio": 4.3 / 4.2, "hit": False}]


def _run_bench(monkeypatch, tmp_path, rc, rec):
    """section_bench with the bench subprocess replaced: it exits ``rc`` after writing ``rec``
    (None: no record)."""
    def fake_run(cmd):
        if rec is not None:
            (tmp_path / "bench-h200.json").write_text(rec if isinstance(rec, str) else json.dumps(rec))
        return SimpleNamespace(returncode=rc)

    monkeypatch.setattr(subprocess, "run", fake_run)
    gpu_session.section_bench(SimpleNamespace(name="cuda"), tmp_path)


def test_missed_targets_of_a_passing_run_are_printed_not_raised(monkeypatch, tmp_path, capsys):
    _run_bench(monkeypatch, tmp_path, 1, {"ok": True, "targets": _targets(
        misses=["gptoss-16384@0"], peer_within=PEER_MISS)})
    assert "bench: every check passed; targets missed" in capsys.readouterr().out


@pytest.mark.parametrize("rc, rec", [
    (1, {"ok": False, "targets": _targets(peer_within=PEER_MISS)}),  # a failed check
    (1, None),                                                     # no record
    (1, "{not json"),                                              # unreadable
    (1, {"ok": True, "targets": _targets()}),                      # exit 1 with nothing missed
    (1, {"ok": True}),                                             # no verdicts
    (2, {"ok": True, "targets": _targets(misses=["x"])}),          # a usage error
])
def test_a_failed_check_or_no_readable_record_fails_the_section(monkeypatch, tmp_path, rc, rec):
    with pytest.raises(RuntimeError, match=f"bench exited {rc}"):
        _run_bench(monkeypatch, tmp_path, rc, rec)


def test_a_clean_run_passes_quietly(monkeypatch, tmp_path, capsys):
    _run_bench(monkeypatch, tmp_path, 0, {"ok": True, "targets": _targets()})
    assert "targets missed" not in capsys.readouterr().out
