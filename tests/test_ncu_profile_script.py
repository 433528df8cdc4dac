"""scripts/ncu_profile.py's peer launches on the CPU: a fake peer in place of FA4 is prepared
once on the bench shape's case and called --launches times; what it cannot do is refused
with the argument named."""
import importlib.util
from pathlib import Path

import pytest

import refattn.kernels

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ncu_profile.py"


@pytest.fixture
def script():
    spec = importlib.util.spec_from_file_location("ncu_profile", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class FakePeer:
    peer = True

    def __init__(self, sink: bool = True):
        self.sink, self.calls, self.prepared, self.closed, self.synced = sink, 0, [], 0, 0

    def available(self):
        return True, "fake"

    def supports(self, case):
        return self.sink or case.sink == "none"

    def unsupported_reason(self, case):
        return None if self.supports(case) else "no sink"

    def prepare(self, inputs):
        self.prepared.append(inputs.case)

        def call():
            self.calls += 1

        def close():
            self.closed += 1

        call.close = close
        return call

    def synchronize(self):
        self.synced += 1


def test_a_peer_is_prepared_once_and_called_launches_times(script, monkeypatch, capsys):
    for sink, mode in ((True, "per_head"), (False, "none")):
        fake = FakePeer(sink)
        monkeypatch.setattr(refattn.kernels, "get_kernel", lambda name: fake)
        assert script.main(["gptoss-128@8192", "--peer", "fa4", "--launches", "4"]) == 0
        assert (fake.calls, fake.closed, fake.synced) == (4, 1, 1)
        [case] = fake.prepared
        assert (case.sq, case.past_len, case.Hq, case.Hkv, case.d, case.sink) == (128, 8192, 64, 8, 64, mode)
        assert f"gptoss-128@8192: 4 calls of fa4 ({mode} sink)" in capsys.readouterr().out


@pytest.mark.parametrize("argv, words", [
    (["--peer", "fa4", "--config", "wgmma_m16_b64"], "--config: names a hipkernel config"),
    (["--peer", "no-such-kernel"], "--peer: kernel: unknown kernel 'no-such-kernel'"),
    (["--peer", "model"], "--peer: model is not a bench peer"),
])
def test_what_a_peer_launch_cannot_do_is_refused(script, capsys, argv, words):
    with pytest.raises(SystemExit) as e:
        script.main(["gptoss-128@8192", *argv])
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_an_unavailable_peer_says_why(script, monkeypatch, capsys):
    fake = FakePeer()
    fake.available = lambda: (False, "torch sees no CUDA device")
    monkeypatch.setattr(refattn.kernels, "get_kernel", lambda name: fake)
    with pytest.raises(SystemExit) as e:
        script.main(["gptoss-128@8192", "--peer", "fa4"])
    assert e.value.code == 2 and "fa4 is not available here: torch sees no CUDA device" in capsys.readouterr().err
