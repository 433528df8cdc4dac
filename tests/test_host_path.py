"""The launch path of ``flash_prefill_v3`` without a GPU: a call on a given stream, a call
that returns without a synchronize, device length arrays, and a geometry's launch prepared
once and patched per call (``api.PreparedCall``, ``Backend.prepare``, ``KernelArgs.set``)."""

import ctypes

import pytest

from hipkernel import api
from hipkernel.backends import KernelArgs, TensorMap
from hipkernel.config import KernelConfig
from tests.fake_backend import RecordingBackend

GEOM = dict(B=1, Sq=8, Hq=4, Hkv=2, d=64, S_cap=64)
Q, K, V, SINK, OUT = 0x10000, 0x20000, 0x30000, 0x40000, 0x50000


@pytest.fixture(autouse=True)
def _no_tuning(monkeypatch):
    monkeypatch.setenv("HIPKERNEL_TUNE", "0")
    api.PLANS.clear()
    yield
    api.PLANS.clear()


def _call(be, q=Q, out=OUT, **kw):
    kw = {**GEOM, "past_len": 16, **kw}
    return api.flash_prefill_v3(be, q, K, V, kw.pop("sink", 0), out, **kw)


def _launches(be):
    return [c[1] for c in be.calls if c[0] == "launch"]


def test_stream_reaches_the_launch_and_sync_false_skips_the_synchronize():
    be = RecordingBackend()
    assert _call(be, stream=0xABC0, sync=False) == 0
    (rec,) = _launches(be)
    assert rec["stream"] == 0xABC0
    assert ("synchronize",) not in be.calls
    assert _call(be) == 0  # the default: the backend's stream, then a synchronize
    assert _launches(be)[-1]["stream"] is None and be.calls[-1] == ("synchronize",)


def test_a_geometry_is_prepared_once_and_its_pointers_patched_per_call():
    be = RecordingBackend()
    _call(be, sync=False)
    compiles = sum(c[0] == "compile" for c in be.calls)
    for i in range(1, 4):
        _call(be, q=Q + 0x100 * i, out=OUT + 0x100 * i, past_len=16 + i, sync=False)
    assert be.prepares == 1 and sum(c[0] == "compile" for c in be.calls) == compiles
    args = [rec["args"] for rec in _launches(be)]
    assert [a[0] for a in args] == [Q, Q + 0x100, Q + 0x200, Q + 0x300]
    assert [a[4] for a in args] == [OUT, OUT + 0x100, OUT + 0x200, OUT + 0x300]
    assert [a[9] for a in args] == [16, 17, 18, 19]  # past_len: not part of the geometry
    assert len(api.PLANS) == 1
    _call(be, Sq=16, sync=False)  # another geometry: another prepared call
    assert be.prepares == 2 and len(api.PLANS) == 2


def test_the_sink_slot_follows_the_sink_mode():
    be = RecordingBackend()
    _call(be, sink=SINK, sink_mode="per_head", sync=False)
    _call(be, sink=SINK + 0x100, sink_mode="per_head", sync=False)
    _call(be, sink=SINK, sink_mode="smooth", sync=False)
    assert [rec["args"][3] for rec in _launches(be)] == [SINK, SINK + 0x100, 0]
    assert [rec["args"][11] for rec in _launches(be)] == [1, 1, 2]


def test_ragged_host_lengths_need_the_synchronize():
    be = RecordingBackend()
    with pytest.raises(ValueError, match="^sync: a ragged call with host lengths"):
        _call(be, B=2, past_len=[3, 16], sync=False)
    assert be.calls == []
    with pytest.raises(ValueError, match="^sync: expected True or False"):
        _call(be, sync="no")
    with pytest.raises(ValueError, match="^stream: expected None or a stream handle"):
        _call(be, stream=-1)


def test_device_lengths_go_to_the_kernel_without_an_upload():
    be = RecordingBackend()
    lens = (0x60000, 0x60010)
    assert _call(be, B=2, past_len=40, device_lengths=lens, sync=False) == 0
    assert not any(c[0] in ("alloc", "htod", "free") for c in be.calls)
    (rec,) = _launches(be)
    assert rec["args"][13:15] == list(lens)
    assert rec["args"][9] == 0  # past_len per sequence: the ABI's int is unused
    _call(be, B=2, past_len=7, device_lengths=(0, 0x60010), sync=False)  # q_len only
    assert _launches(be)[-1]["args"][9] == 7 and _launches(be)[-1]["args"][13:15] == [0, 0x60010]


@pytest.mark.parametrize("kw, match", [
    (dict(device_lengths=(0x60000,)), "^device_lengths: expected"),
    (dict(device_lengths=(0x60000, True)), "^device_lengths: expected"),
    (dict(device_lengths=(0x60002, 0)), "^device_lengths: past_lens pointer 0x60002 is not 4-byte"),
    (dict(device_lengths=(0x60000, 0), q_len=[8, 8]), "^q_len: with device_lengths"),
    (dict(device_lengths=(0x60000, 0), past_len=[1, 2]), "^past_len: with device_lengths"),
    (dict(device_lengths=(0x60000, 0), past_len=57), r"^S_cap: cache capacity 64 < past_len \+ Sq = 65"),
])
def test_device_lengths_are_checked(kw, match):
    be = RecordingBackend()
    with pytest.raises(ValueError, match=match):
        _call(be, B=2, **{"past_len": 16, **kw})
    assert be.calls == []


def test_device_lengths_tune_on_the_callers_bound(monkeypatch):
    """The lengths stay on the device, so the sweep times the uniform call the bound gives:
    past_len = the bound, on the real cache once that holds TUNE_MIN_KV keys."""
    monkeypatch.setenv("HIPKERNEL_TUNE", "1")
    monkeypatch.setattr(api, "TUNER", type(api.TUNER)())
    be = RecordingBackend(arch="sm_80")
    geom = {**GEOM, "S_cap": 8192, "B": 2}
    api.flash_prefill_v3(be, Q, K, V, 0, OUT, **geom, past_len=5000, device_lengths=(0x60000, 0),
                         sync=False)
    tuning = [rec for rec in _launches(be) if rec["tuning"]]
    assert tuning and {rec["args"][9] for rec in tuning} == {5000}
    assert {rec["args"][13] for rec in tuning} == {0}  # timed without the length arrays
    (final,) = [rec for rec in _launches(be) if not rec["tuning"]]
    assert final["args"][13] == 0x60000 and final["args"][9] == 0


def test_tma_maps_are_reencoded_when_the_cache_or_its_length_changes():
    be = RecordingBackend(arch="sm_90")
    cfg = KernelConfig(8, 128, "wgmma", ws=True)
    assert cfg.tma
    geom = {**GEOM, "d": 128, "Sq": 64, "S_cap": 512}
    kw = dict(config=cfg, sync=False)
    api.flash_prefill_v3(be, Q, K, V, 0, OUT, **geom, past_len=0, **kw)
    maps = lambda: [c for c in be.calls if c[0] == "tensor_map"]  # noqa: E731
    assert len(maps()) == 2
    api.flash_prefill_v3(be, Q + 0x100, K, V, 0, OUT, **geom, past_len=0, **kw)
    assert len(maps()) == 2  # q moved: the maps stand
    api.flash_prefill_v3(be, Q, K, V, 0, OUT, **geom, past_len=64, **kw)
    assert len(maps()) == 4 and maps()[-1][2][1] == 128  # rows = past_len + Sq
    api.flash_prefill_v3(be, Q, K + 0x1000, V, 0, OUT, **geom, past_len=64, **kw)
    assert len(maps()) == 6 and maps()[-2][1] == K + 0x1000
    last = _launches(be)[-1]["args"]
    words = [int.from_bytes(last[15][i:i + 8], "little") for i in range(0, 32, 8)]
    assert words[:3] == [K + 0x1000, 128, 128]  # the launch passes the new map


def test_kernel_args_set_changes_the_packed_slot_in_place():
    args = KernelArgs([(ctypes.c_void_p, 0x1000), (ctypes.c_int32, 5), (ctypes.c_float, 0.5),
                       (TensorMap, bytes(128))])
    slots = [ctypes.cast(args.address, ctypes.POINTER(ctypes.c_void_p))[i] for i in range(4)]
    args.set(0, 0x2000)
    args.set(1, -7)
    args.set(2, 0.25)
    args.set(3, bytes(range(128)))
    assert [ctypes.cast(args.address, ctypes.POINTER(ctypes.c_void_p))[i] for i in range(4)] == slots
    assert ctypes.c_void_p.from_address(slots[0]).value == 0x2000
    assert ctypes.c_int32.from_address(slots[1]).value == -7
    assert ctypes.c_float.from_address(slots[2]).value == 0.25
    assert ctypes.string_at(slots[3], 128) == bytes(range(128))
    assert list(args)[1] == (ctypes.c_int32, -7)
    with pytest.raises(ValueError, match=r"^args\[1\]: 2147483648 does not fit c_int"):
        args.set(1, 2**31)
    with pytest.raises(TypeError, match=r"^args\[3\]: TensorMap needs"):
        args.set(3, b"short")
    assert ctypes.c_int32.from_address(slots[1]).value == -7  # a refused value changes nothing


def test_plan_cache_drops_the_least_recently_used():
    cache = api.PlanCache(size=2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # a is now the most recent
    cache.put("c", 3)
    assert cache.get("b") is None and cache.get("a") == 1 and cache.get("c") == 3
    assert len(cache) == 2


def test_ragged_bound_is_the_uniform_call_that_reaches_every_key():
    assert api.ragged_bound(0, [3, 36], [8, 2], B=2, Sq=8) == 30  # max(11, 38) - 8
    assert api.ragged_bound(5, None, [1, 0], B=2, Sq=8) == 0  # every row ends before Sq
    assert api.ragged_bound(0, [3, 10], None, B=2, Sq=8) == 10
