"""scripts/near_ties_gpu.py on the CPU model in place of the GPU: its plumbing (the
construction, the gate, the launch status, its arguments) runs end to end without one."""
import importlib.util
from pathlib import Path

import pytest

from hipkernel import api, model

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "near_ties_gpu.py"


@pytest.fixture
def script(monkeypatch):
    spec = importlib.util.spec_from_file_location("near_ties_gpu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(api, "attention",
                        lambda q, k, v, config=None, **kw: (0, model.attention(q, k, v, config=config, **kw)))
    return mod


def test_prints_a_line_per_config_and_magnitude(script, capsys):
    assert script.main(["m4_b64", "mma_m4_b32", "--seeds", "30"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "m4_b64 magnitude 60000", "m4_b64 magnitude 0", "m4_b64 logits ~3.6e9",
        "mma_m4_b32 magnitude 60000", "mma_m4_b32 magnitude 0", "mma_m4_b32 logits ~3.6e9"]
    # seed 26 of the construction is the edge test's, which both paths (one fma, the row max
    # rounded up) pass; at magnitude 0 no path fails any seed; at ~3.6e9 every output is finite
    assert "(seed 26 passes)" in lines[0] and "(seed 26 passes)" in lines[3]
    assert lines[1].startswith("m4_b64 magnitude 0: 0 of 30 fail")
    assert lines[4].startswith("mma_m4_b32 magnitude 0: 0 of 30 fail")
    assert lines[2] == "m4_b64 logits ~3.6e9: 0 of 30 non-finite"
    assert lines[5] == "mma_m4_b32 logits ~3.6e9: 0 of 30 non-finite"


def test_a_declined_launch_is_an_error(script, monkeypatch):
    monkeypatch.setattr(api, "attention", lambda q, k, v, **kw: (-1, None))
    with pytest.raises(RuntimeError, match="^m4_b64: the kernel declined"):
        script.main(["m4_b64", "--seeds", "1"])


@pytest.mark.parametrize("argv, match", [(["m4_b64", "--seeds", "0"], "^--seeds: expected at least 1"),
                                          (["bogus"], "^config: expected a config name")])
def test_bad_arguments(script, argv, match):
    with pytest.raises(ValueError, match=match):
        script.main(argv)
