"""The GPU backends' shared machinery, on the CPU, and the real backends where a GPU exists.

CPU tests use ``HostBackend``: a Backend whose "device" is host memory and whose "compiler"
is a counter, so the compile cache (keys, in-process and disk hits, corrupt entries), the
argument packing, the copy bounds and the event timing are tested without a driver. Each
real backend's ``_check`` is tested on fake error tuples. GPU tests (marker ``gpu``) compile,
launch and time a vector add on every backend that works, and are skipped with the
backend's reason elsewhere.
"""

from __future__ import annotations

import ctypes
import struct
import os
import time
import types

import numpy as np
import pytest

import hipkernel.backends as backends
from hipkernel.backends import (DEFAULT_DYNAMIC_SHARED, Backend, BackendError, BackendUnavailable,
                                CompileError, CompileResult, DevicePtr, KernelArgs, define_flags,
                                median)
from hipkernel.backends import cuda as cuda_be
from hipkernel.backends import hip as hip_be
from hipkernel.backends._cache import MAGIC, DiskCache, cache_key

# --------------------------------------------------------------------------- a host "device"


class HostBackend(Backend):
    """A Backend on host memory with a fake compiler that counts its calls."""

    name = "host"
    arch = "host_arch"
    device_name = "host memory"
    compiler_version = "fake-cc 1.0"

    def __init__(self, cache, reject_binaries=()):
        super().__init__(cache)
        self.compile_calls = []
        self.launches = []
        self.streams = []  # the stream of each launch (None: the default stream)
        self.opt_ins = []  # (function, bytes) of each dynamic shared memory opt-in
        self.shared_per_block = 227 * 1024
        self.reject_binaries = set(reject_binaries)
        self._bufs = {}
        self.clock = 0.0

    def _compile_options(self, defines, include_dirs):
        return ["--arch=host", *define_flags(defines), *[f"-I{d}" for d in include_dirs]]

    def _compile(self, source, defines, include_dirs):
        self.compile_calls.append((source, dict(defines)))
        return CompileResult(log="fake log", binary=b"BIN:" + source.encode(), regs=42,
                             spills=0, smem=128, target=self.arch, kind="fake",
                             details={"regs": 42})

    def _load(self, binary):
        if binary in self.reject_binaries:
            raise BackendError(self.name, "load", 200, "ERROR_INVALID_IMAGE")
        return {"binary": binary}

    def _get_function(self, module, kernel_name):
        return (module["binary"], kernel_name)

    def _launch(self, function, grid, block, shared_mem, params_address, stream=None):
        self.launches.append((function, grid, block, shared_mem, params_address))
        self.streams.append(stream)
        self.clock += 1.5  # each launch "takes" 1.5 ms

    def _allow_dynamic_shared(self, function, nbytes, static):
        if nbytes + static > self.shared_per_block:
            raise ValueError(f"shared_mem: {nbytes} bytes of dynamic shared memory, over the "
                             f"{self.shared_per_block - static} left next to {static} static")
        self.opt_ins.append((function, nbytes, static))

    def _alloc(self, nbytes):
        buf = ctypes.create_string_buffer(nbytes)
        self._bufs[ctypes.addressof(buf)] = buf
        return ctypes.addressof(buf)

    def _free(self, address):
        del self._bufs[address]

    def _htod(self, address, host_address, nbytes):
        ctypes.memmove(address, host_address, nbytes)

    def _dtoh(self, host_address, address, nbytes):
        ctypes.memmove(host_address, address, nbytes)

    def _memset(self, address, byte, nbytes):
        ctypes.memset(address, byte, nbytes)

    def _synchronize(self):
        pass

    def _event_create(self):
        return {"t": None}

    def _event_record(self, event):
        event["t"] = self.clock

    def _event_elapsed_ms(self, start, end):
        return end["t"] - start["t"]

    def _event_destroy(self, event):
        event["t"] = "destroyed"


@pytest.fixture
def cache_dir(tmp_path):
    return tmp_path / "cache"


@pytest.fixture
def host(cache_dir):
    return HostBackend(DiskCache(cache_dir, enabled=True))


SRC = "extern \"C\" __global__ void k(float* p) { p[0] = SCALE; }\n"


# --------------------------------------------------------------------------- cache keys

def _key(**over):
    parts = dict(source=SRC, options=["-DSCALE=2", "--arch=x"], arch="sm_90", backend="cuda",
                 compiler_version="nvrtc 13.0")
    parts.update(over)
    return cache_key(**parts)


def test_cache_key_is_stable_and_ignores_option_order():
    assert _key() == _key()
    assert _key() == _key(options=["--arch=x", "-DSCALE=2"])
    assert len(_key()) == 64


@pytest.mark.parametrize("change", [
    dict(source=SRC + "// edited\n"),
    dict(options=["-DSCALE=3", "--arch=x"]),
    dict(arch="sm_80"),
    dict(backend="hip"),
    dict(compiler_version="nvrtc 13.1"),
], ids=["source", "defines", "arch", "backend", "compiler"])
def test_cache_key_changes_with_each_input(change):
    assert _key(**change) != _key()


def test_source_digest_is_the_sha256_kept_per_text(monkeypatch):
    """The source's digest is its sha256, computed once per text: a text seen again is not
    hashed again, an edited one is, and the store is emptied at its cap."""
    import hashlib

    from hipkernel.backends import _cache

    monkeypatch.setattr(_cache, "_SOURCE_DIGESTS", {})
    real = hashlib.sha256
    assert _cache.source_digest(SRC) == real(SRC.encode()).hexdigest()
    hashed = []
    monkeypatch.setattr(_cache.hashlib, "sha256", lambda b=b"": hashed.append(b) or real(b))
    assert _cache.source_digest(SRC) == real(SRC.encode()).hexdigest() and hashed == []
    edited = SRC + "// edited\n"
    assert _cache.source_digest(edited) == real(edited.encode()).hexdigest() and len(hashed) == 1
    monkeypatch.setattr(_cache, "_SOURCE_DIGESTS_MAX", 2)
    _cache.source_digest(SRC + "// third\n")
    assert len(_cache._SOURCE_DIGESTS) == 1


def test_cache_key_follows_header_contents(tmp_path):
    (tmp_path / "portable.h").write_text("#define A 1\n")
    before = _key(include_dirs=[tmp_path])
    assert before == _key(include_dirs=[tmp_path])
    (tmp_path / "portable.h").write_text("#define A 2\n")
    assert _key(include_dirs=[tmp_path]) != before


def test_backend_key_changes_with_defines(host):
    a = host.compile(SRC, {"SCALE": 2}, "k")
    b = host.compile(SRC, {"SCALE": 3}, "k")
    assert a.key != b.key
    assert host.compile_calls == [(SRC, {"SCALE": 2}), (SRC, {"SCALE": 3})]


# --------------------------------------------------------------------------- compile cache

def test_second_compile_is_an_in_process_hit(host):
    k1 = host.compile(SRC, {"SCALE": 2}, "k")
    k2 = host.compile(SRC, {"SCALE": 2}, "k")
    assert k1 is k2
    assert host.compiles == 1
    assert k1.info.regs == 42 and k1.info.binary == b""  # info without the binary
    assert not k1.from_disk


def test_second_process_hits_disk_and_does_not_compile(cache_dir):
    first = HostBackend(DiskCache(cache_dir, enabled=True))
    k1 = first.compile(SRC, {"SCALE": 2}, "k")
    assert first.compiles == 1
    assert list(cache_dir.glob("*.bin")) == [cache_dir / f"{k1.key}.bin"]

    second = HostBackend(DiskCache(cache_dir, enabled=True))  # a new process, same disk
    k2 = second.compile(SRC, {"SCALE": 2}, "k")
    assert second.compiles == 0 and second.compile_calls == []
    assert k2.from_disk and k2.key == k1.key
    assert k2.function == (b"BIN:" + SRC.encode(), "k")
    assert (k2.info.regs, k2.info.smem, k2.info.log) == (42, 128, "fake log")


def test_a_loaded_kernel_is_found_again_without_its_cache_key(host, monkeypatch, tmp_path):
    """A compile of a source and defines loaded before returns that kernel without
    computing the cache key again; other defines, another kernel name or include dirs
    (whose headers can change) go through the key."""
    from hipkernel.backends import _cache

    k1 = host.compile(SRC, {"SCALE": 2, "B": 1}, "k")
    keyed = []
    real = _cache.cache_key
    monkeypatch.setattr(backends, "cache_key", lambda **kw: keyed.append(kw) or real(**kw))
    assert host.compile(SRC, {"B": 1, "SCALE": 2}, "k") is k1 and keyed == []
    assert host.compile(SRC, {"SCALE": 3, "B": 1}, "k") is not k1 and len(keyed) == 1
    assert host.compile(SRC, {"SCALE": 2, "B": 1}, "other").name == "other" and len(keyed) == 2
    host.compile(SRC, {"SCALE": 2, "B": 1}, "k", include_dirs=[tmp_path])
    host.compile(SRC, {"SCALE": 2, "B": 1}, "k", include_dirs=[tmp_path])
    assert len(keyed) == 4
    assert host.compiles == 3  # SCALE 2, SCALE 3, and SCALE 2 with include dirs


def test_two_kernels_of_one_module_compile_once(host):
    host.compile(SRC, {}, "k")
    host.compile(SRC, {}, "other")
    assert host.compiles == 1


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty", "bad_payload"])
def test_corrupt_entry_is_recompiled(cache_dir, damage):
    k = HostBackend(DiskCache(cache_dir, enabled=True)).compile(SRC, {}, "k")
    path = cache_dir / f"{k.key}.bin"
    blob = path.read_bytes()
    if damage == "garbage":
        path.write_bytes(b"\x00garbage" * 10)
    elif damage == "truncated":
        path.write_bytes(blob[: len(blob) // 2])
    elif damage == "empty":
        path.write_bytes(b"")
    else:  # checksum right, content not a CompileResult
        import hashlib

        payload = b"\xff\xff\xff\xffnot json"
        path.write_bytes(MAGIC + hashlib.sha256(payload).digest() + payload)

    be = HostBackend(DiskCache(cache_dir, enabled=True))
    k2 = be.compile(SRC, {}, "k")
    assert be.compiles == 1 and not k2.from_disk
    assert path.read_bytes() == blob  # rewritten whole

    again = HostBackend(DiskCache(cache_dir, enabled=True))
    assert again.compile(SRC, {}, "k").from_disk and again.compiles == 0


def test_unreadable_entry_does_not_crash(cache_dir):
    k = HostBackend(DiskCache(cache_dir, enabled=True)).compile(SRC, {}, "k")
    path = cache_dir / f"{k.key}.bin"
    path.unlink()
    path.mkdir()  # reading it fails, and so does replacing it
    be = HostBackend(DiskCache(cache_dir, enabled=True))
    assert not be.compile(SRC, {}, "k").from_disk
    assert be.compiles == 1


def test_unwritable_cache_dir_does_not_crash(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    be = HostBackend(DiskCache(blocker / "cache", enabled=True))
    be.compile(SRC, {}, "k")
    assert be.compiles == 1


def test_disk_binary_the_loader_rejects_is_recompiled(cache_dir):
    HostBackend(DiskCache(cache_dir, enabled=True)).compile(SRC, {}, "k")
    stale = b"BIN:" + SRC.encode()
    be = HostBackend(DiskCache(cache_dir, enabled=True), reject_binaries={stale})
    with pytest.raises(BackendError, match="ERROR_INVALID_IMAGE"):
        be.compile(SRC, {}, "k")  # recompiled once, rejected again: the error surfaces
    assert be.compiles == 1


def test_disk_cache_disabled_by_environment(cache_dir, monkeypatch):
    monkeypatch.setenv("HIPKERNEL_CACHE", "0")
    HostBackend(DiskCache(cache_dir)).compile(SRC, {}, "k")
    be = HostBackend(DiskCache(cache_dir))
    be.compile(SRC, {}, "k")
    assert be.compiles == 1 and not cache_dir.exists()


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("HIPKERNEL_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert DiskCache().directory == tmp_path / "elsewhere"


def test_store_is_atomic_and_leaves_no_temporaries(cache_dir):
    dc = DiskCache(cache_dir, enabled=True)
    dc.store("ab" * 32, b"payload")
    assert [p.name for p in cache_dir.iterdir()] == ["ab" * 32 + ".bin"]
    assert dc.load("ab" * 32) == b"payload"
    assert dc.load("cd" * 32) is None


def test_compile_result_round_trips():
    r = CompileResult(log="l", binary=b"\x7fELF\x00", regs=1, spills=2, smem=3, target="t",
                      kind="cubin", details={"stack": 4})
    assert CompileResult.from_bytes(r.to_bytes()) == r


# --------------------------------------------------------------------------- defines + args

def test_define_flags_are_sorted_and_validated():
    assert define_flags({"M_TILES": 4, "HEAD_DIM": 64, "X": True, "Y": None, "Z": False}) == [
        "-DHEAD_DIM=64", "-DM_TILES=4", "-DX=1"]
    with pytest.raises(ValueError, match="macro name"):
        define_flags({"1BAD": 1})
    with pytest.raises(ValueError, match="single token"):
        define_flags({"A": "x y"})
    with pytest.raises(ValueError, match="not finite"):
        define_flags({"A": float("nan")})


def _read_params(address, ctypes_list):
    ptrs = (ctypes.c_void_p * len(ctypes_list)).from_address(address)
    return [ct.from_address(ptrs[i]).value for i, ct in enumerate(ctypes_list)]


def test_kernel_args_pack_declared_widths():
    ptr = DevicePtr(0x7F0000001000, 64, None)
    spec = [(ctypes.c_void_p, ptr), (ctypes.c_void_p, 0), (ctypes.c_void_p, None),
            (ctypes.c_int32, -5), (ctypes.c_int32, 2 ** 31 - 1), (ctypes.c_float, 0.125),
            (ctypes.c_int64, 2 ** 40), (ctypes.c_uint32, 7)]
    args = KernelArgs(spec)
    assert len(args) == 8 and args.address
    got = _read_params(args.address, [t for t, _ in spec])
    assert got == [0x7F0000001000, None, None, -5, 2 ** 31 - 1, 0.125, 2 ** 40, 7]


@pytest.mark.parametrize("spec, exc, match", [
    ([(ctypes.c_int32, 2 ** 31)], ValueError, "does not fit c_int"),
    ([(ctypes.c_uint32, -1)], ValueError, "does not fit c_uint"),
    ([(ctypes.c_int32, 1.5)], TypeError, "needs an int"),
    ([(ctypes.c_int32, True)], TypeError, "needs an int"),
    ([(ctypes.c_float, "1")], TypeError, "needs a real"),
    ([(ctypes.c_void_p, -1)], ValueError, "out of range"),
    ([(ctypes.c_char_p, b"x")], TypeError, "unsupported argument type"),
    ([(ctypes.c_int32,)], TypeError, "pair"),
])
def test_kernel_args_reject_what_would_wrap(spec, exc, match):
    with pytest.raises(exc, match=match):
        KernelArgs(spec)


def test_no_args_is_a_null_array():
    assert KernelArgs([]).address == 0


def test_kernel_args_pass_a_tensor_map_by_value():
    """A TensorMap argument is its 128 bytes, copied into the parameter array; anything but
    128 bytes is refused naming the argument."""
    blob = bytes(range(128))
    args = KernelArgs([(ctypes.c_int32, 3), (backends.TensorMap, blob)])
    ptrs = (ctypes.c_void_p * 2).from_address(args.address)
    assert ctypes.string_at(ptrs[1], 128) == blob and backends.TENSOR_MAP_BYTES == 128
    for bad in (blob[:64], "x" * 128, None):
        with pytest.raises(TypeError, match=r"^args\[0\]: TensorMap needs the 128 bytes"):
            KernelArgs([(backends.TensorMap, bad)])


class MapBackend(HostBackend):
    """A host backend whose encoder returns its parameters (16 uint64), or a wrong size."""

    size = 128

    def _tensor_map(self, address, dims, strides, box):
        words = [address, *dims, *strides, *box]
        return struct.pack("<16Q", *(words + [0] * (16 - len(words))))[:self.size]


@pytest.mark.parametrize("kw, match", [
    (dict(dims=(64, 10), strides=(128,), box=(64, 8, 1)), "^dims: 2 dims need 1 strides and 2 box"),
    (dict(dims=(64, 0, 2), strides=(128, 1280), box=(64, 8, 1)), r"^dims: each in \[1, 2\^32\]"),
    (dict(dims=(64, 10, 2), strides=(120, 1280), box=(64, 8, 1)), "^strides: multiples of 16"),
    (dict(dims=(64, 10, 2), strides=(128, 1280), box=(32, 8, 1)), "^box: 64 elements first"),
    (dict(dims=(64, 10, 2), strides=(128, 1280), box=(64, 512, 1)), "^box: 64 elements first"),
    (dict(ptr=0x1008, dims=(64, 10, 2), strides=(128, 1280), box=(64, 8, 1)), "^ptr: 0x1008 is not 16-byte"),
])
def test_tensor_map_refuses_what_tma_cannot_map(cache_dir, kw, match):
    be = MapBackend(DiskCache(cache_dir, enabled=False))
    with pytest.raises(ValueError, match=match):
        be.tensor_map(kw.pop("ptr", 0x1000), **kw)


def test_tensor_map_passes_its_parameters_and_checks_the_size(cache_dir):
    be = MapBackend(DiskCache(cache_dir, enabled=False))
    blob = be.tensor_map(0x1000, (128, 4096, 8), (256, 256 * 4096), (64, 128, 1))
    assert struct.unpack("<9Q", blob[:72]) == (0x1000, 128, 4096, 8, 256, 256 * 4096, 64, 128, 1)
    be.size = 64
    with pytest.raises(BackendError, match="BAD_SIZE"):
        be.tensor_map(0x1000, (128, 4096, 8), (256, 256 * 4096), (64, 128, 1))
    # a backend without TMA (HIP, the base class) says so
    with pytest.raises(BackendError, match="TMA tensor maps need an NVIDIA sm_90"):
        HostBackend(DiskCache(cache_dir, enabled=False)).tensor_map(0x1000, (64, 8), (128,), (64, 8))


# --------------------------------------------------------------------------- memory, launch, timing

def test_memory_round_trip_and_bounds(host):
    a = np.arange(16, dtype=np.float32)
    p = host.alloc(a.nbytes)
    assert isinstance(p, int) and p.nbytes == 64 and bool(p)
    host.htod(p, a)
    out = np.zeros_like(a)
    host.dtoh(out, p)
    np.testing.assert_array_equal(out, a)
    host.memset(p, 0, 32)
    host.dtoh(out, p)
    np.testing.assert_array_equal(out[:8], 0)
    with pytest.raises(ValueError, match="do not fit"):
        host.htod(p, np.zeros(17, np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        host.htod(p, np.zeros((4, 4), np.float32)[:, ::2])
    with pytest.raises(ValueError, match="read-only"):
        ro = np.zeros(4, np.float32)
        ro.flags.writeable = False
        host.dtoh(ro, p)
    with pytest.raises(ValueError, match="null"):
        host.htod(0, a)
    p.free()
    with pytest.raises(ValueError, match="not a live allocation"):
        host.free(p)


def test_launch_checks_geometry_and_passes_packed_args(host):
    kern = host.compile(SRC, {}, "k")
    host.launch(kern, (3, 2), 128, [(ctypes.c_int32, 9), (ctypes.c_float, 2.0)])
    function, grid, block, shmem, address = host.launches[-1]
    assert function == kern.function and grid == (3, 2, 1) and block == (128, 1, 1)
    assert shmem == 0 and address
    for bad_grid, bad_block in [((0, 1, 1), (32,)), ((1,), (2048,)), ((1, 1, 1, 1), (32,)),
                                ((1.0,), (32,))]:
        with pytest.raises(ValueError):
            host.launch(kern, bad_grid, bad_block, [])


def test_a_prepared_launch_enqueues_on_its_stream_with_the_patched_arguments(host):
    """Backend.prepare checks and packs once; the PreparedLaunch enqueues with one runtime
    call on the stream it is given (None: the backend's default), passing the argument
    array whose slots KernelArgs.set changed in place."""
    kern = host.compile(SRC, {}, "k")
    args = backends.KernelArgs([(ctypes.c_void_p, 0x100), (ctypes.c_int32, 9)])
    launch = host.prepare(kern, (3, 2), 128, args, shared_mem=64 * 1024)
    assert host.launches == [] and host.opt_ins == [(kern.function, 64 * 1024, 128)]
    launch()
    args.set(0, 0x200)
    launch(0xABC0)
    assert host.streams == [None, 0xABC0]
    assert [x[4] for x in host.launches] == [args.address] * 2  # the one packed array
    assert ctypes.c_void_p.from_address(ctypes.cast(args.address, ctypes.POINTER(ctypes.c_void_p))[0]).value == 0x200
    host.launch(kern, 1, 32, [], stream=0xDEF0)
    assert host.streams[-1] == 0xDEF0
    with pytest.raises(ValueError, match="^block: "):
        host.prepare(kern, 1, 2048, [])


def test_launch_opts_a_kernel_in_to_dynamic_shared_memory_once(host):
    """Up to 48 KiB (DEFAULT_DYNAMIC_SHARED) of static plus dynamic shared memory a launch
    passes its dynamic part as is; above, the kernel is opted in first, once per new high:
    launches at or under what it was allowed do not ask again. A bad size is a ValueError
    naming shared_mem, before any call."""
    kern = host.compile(SRC, {}, "k")  # the fake compiler reports 128 bytes of static memory
    assert kern.info.smem == 128 and DEFAULT_DYNAMIC_SHARED == 48 * 1024
    assert kern.shared_mem_allowed == 48 * 1024 - 128
    for nbytes in (0, 1024, 48 * 1024 - 128):
        host.launch(kern, 1, 32, [], shared_mem=nbytes)
    assert host.opt_ins == [] and [x[3] for x in host.launches] == [0, 1024, 48 * 1024 - 128]
    for nbytes in (48 * 1024, 96 * 1024, 96 * 1024, 64 * 1024, 128 * 1024):
        host.launch(kern, 1, 32, [], shared_mem=nbytes)
    assert host.opt_ins == [(kern.function, 48 * 1024, 128), (kern.function, 96 * 1024, 128),
                            (kern.function, 128 * 1024, 128)]
    assert [x[3] for x in host.launches[3:]] == [48 * 1024, 96 * 1024, 96 * 1024, 64 * 1024,
                                                 128 * 1024]
    assert kern.shared_mem_allowed == 128 * 1024
    other = host.compile(SRC + " ", {}, "k")  # another function starts at the default
    assert other.shared_mem_allowed == 48 * 1024 - 128
    n = len(host.launches)
    for bad in (-1, 1.5, True, "96k", None):
        with pytest.raises(ValueError, match="^shared_mem"):
            host.launch(other, 1, 32, [], shared_mem=bad)
    with pytest.raises(ValueError, match="^shared_mem: 233472 bytes"):  # over the device
        host.launch(other, 1, 32, [], shared_mem=228 * 1024)
    with pytest.raises(ValueError, match=r"^shared_mem: 232384 bytes .* over the 232320 left"):
        host.launch(other, 1, 32, [], shared_mem=227 * 1024 - 64)  # fits alone, not with 128
    assert len(host.launches) == n and other.shared_mem_allowed == 48 * 1024 - 128


def test_time_ms_uses_events_around_each_call(host):
    kern = host.compile(SRC, {}, "k")
    times = host.time_ms(lambda: host.launch(kern, 1, 32, []), warmup=2, reps=5)
    assert times == [1.5] * 5 and median(times) == 1.5
    assert len(host.launches) == 7  # warmup included


def test_hold_is_a_spin_calibrated_by_events(host):
    from hipkernel.backends import HOLD_CALIBRATION_CYCLES, HOLD_KERNEL, HOLD_SOURCE
    host.hold(3.0)
    assert host.compile_calls[-1][0] == HOLD_SOURCE
    assert all(f[1] == HOLD_KERNEL for f, *_ in host.launches)
    assert len(host.launches) == 1 + 3 + 1  # calibration: warmup + 3 timed; then the hold
    assert host._hold_cycles_per_ms == HOLD_CALIBRATION_CYCLES / 1.5  # a launch "takes" 1.5 ms
    host.hold(0.5)
    assert len(host.launches) == 6  # calibrated once
    for bad in (-1.0, 1e6, float("nan")):
        with pytest.raises(ValueError, match="^ms: expected a hold in"):
            host.hold(bad)


def test_hold_ms_for_outlasts_the_enqueueing_up_to_a_cap():
    """One sizing rule for every hold (the tuner's sweep, the bench): HOLD_MARGIN times the
    host's time to enqueue the calls, plus HOLD_BASE_MS, capped."""
    from hipkernel.backends import HOLD_BASE_MS, HOLD_MARGIN, HOLD_MAX_MS, hold_ms_for
    assert hold_ms_for(0.04, 5) == pytest.approx(HOLD_MARGIN * 0.2 + HOLD_BASE_MS)
    assert hold_ms_for(0.0, 30) == HOLD_BASE_MS  # never a zero hold
    assert hold_ms_for(10.0, 30, cap_ms=200.0) == 200.0
    assert hold_ms_for(100.0, 30) == HOLD_MAX_MS  # the most Backend.hold takes


def test_time_ms_queues_the_hold_after_warmup_and_before_the_timed_calls(host):
    kern = host.compile(SRC, {}, "k")
    host.hold(1.0)  # calibrate first
    n0 = len(host.launches)
    times = host.time_ms(lambda: host.launch(kern, 1, 32, []), warmup=2, reps=3, hold_ms=4.0)
    names = [f[1] for f, *_ in host.launches[n0:]]
    assert names == ["k", "k", "hk_hold", "k", "k", "k"]
    assert times == [1.5] * 3  # the events bracket the timed calls, not the hold


# --------------------------------------------------------------------------- error decoding

class FakeEnum(int):
    """An error code as the bindings return it: an int with a ``name``."""

    def __new__(cls, value, name):
        self = super().__new__(cls, value)
        self.name = name
        return self


def test_cuda_check_decodes_driver_errors(monkeypatch):
    fake_driver = types.SimpleNamespace(
        cuGetErrorName=lambda err: (FakeEnum(0, "CUDA_SUCCESS"), b"CUDA_ERROR_OUT_OF_MEMORY"))
    monkeypatch.setattr(cuda_be, "driver", fake_driver)
    assert cuda_be._check((FakeEnum(0, "CUDA_SUCCESS"), 1234), "cuMemAlloc") == 1234
    assert cuda_be._check((FakeEnum(0, "CUDA_SUCCESS"), 1, 2), "cuX") == (1, 2)
    assert cuda_be._check((FakeEnum(0, "CUDA_SUCCESS"),), "cuX") is None
    with pytest.raises(BackendError) as e:
        cuda_be._check((FakeEnum(2, "CUDA_ERROR_OUT_OF_MEMORY"),), "cuMemAlloc")
    assert not isinstance(e.value, CompileError)
    assert e.value.error_name == "CUDA_ERROR_OUT_OF_MEMORY" and e.value.code == 2
    assert str(e.value) == "cuda: cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY (2)"


def test_cuda_check_falls_back_to_the_enum_name(monkeypatch):
    def broken(err):
        raise RuntimeError("driver library not loadable")

    monkeypatch.setattr(cuda_be, "driver", types.SimpleNamespace(cuGetErrorName=broken))
    with pytest.raises(BackendError, match=r"CUDA_ERROR_INVALID_IMAGE \(200\)"):
        cuda_be._check((FakeEnum(200, "CUDA_ERROR_INVALID_IMAGE"),), "cuModuleLoadData")


def test_cuda_check_carries_the_whole_compile_log(monkeypatch):
    nvrtcResult = type("nvrtcResult", (FakeEnum,), {})
    monkeypatch.setattr(cuda_be, "nvrtc", types.SimpleNamespace(
        nvrtcGetErrorString=lambda err: (nvrtcResult(0, "NVRTC_SUCCESS"),
                                         b"NVRTC_ERROR_COMPILATION\0junk")))
    log = "k.hip(3): error: identifier \"x\" is undefined\n" + "\n".join(
        f"line {i}" for i in range(200)) + "\n1 error detected"
    with pytest.raises(CompileError) as e:
        cuda_be._check((nvrtcResult(6, "NVRTC_ERROR_COMPILATION"),), "nvrtcCompileProgram", log=log)
    assert e.value.error_name == "NVRTC_ERROR_COMPILATION"
    assert e.value.log == log and log in str(e.value)  # whole, not truncated


def test_cuda_target_is_sm90a_on_compute_capability_90(monkeypatch):
    """The CUDA backend compiles for ``sm_90a`` on a 9.0 device (the arch-specific target
    that has wgmma), ``sm_XY`` on any other device this NVRTC knows, and PTX for the newest
    arch it knows on a newer device. No GPU: the unbound method on a bare object."""
    from hipkernel.config import has_wgmma

    be = object.__new__(cuda_be.CudaBackend)
    be.compiler_version = "nvrtc 13.0 (fake)"
    monkeypatch.setattr(cuda_be, "supported_archs", lambda: [75, 80, 86, 89, 90, 100, 120])
    assert be._target(90) == "sm_90a"
    assert be._target(80) == "sm_80"
    assert be._target(89) == "sm_89" and be._target(100) == "sm_100"  # no "a" elsewhere
    assert be._target(121) == "compute_120"  # newer than NVRTC knows: PTX, JIT by the driver
    assert has_wgmma(be._target(90)) and not has_wgmma(be._target(100))
    monkeypatch.setattr(cuda_be, "supported_archs", lambda: [])  # NVRTC cannot list them
    assert be._target(90) == "sm_90a" and be._target(80) == "sm_80"
    monkeypatch.setattr(cuda_be, "supported_archs", lambda: [80, 86])
    with pytest.raises(BackendUnavailable, match="sm_75"):
        be._target(75)


def test_hip_check_decodes_both_hip_python_conventions(monkeypatch):
    hiprtcResult = type("hiprtcResult", (FakeEnum,), {})
    monkeypatch.setattr(hip_be, "hip", types.SimpleNamespace(
        hipGetErrorName=lambda err: (FakeEnum(0, "hipSuccess"), b"hipErrorOutOfMemory")))
    with pytest.raises(BackendError, match=r"hip: hipMalloc failed: hipErrorOutOfMemory \(2\)"):
        hip_be._check((FakeEnum(2, "hipErrorOutOfMemory"),), "hipMalloc")
    assert hip_be._check((FakeEnum(0, "hipSuccess"), "module"), "hipModuleLoadData") == "module"

    # hip-python >= 10: (HIPRTC_SUCCESS, text); 6.x: (text,)
    for reply in [(hiprtcResult(0, "HIPRTC_SUCCESS"), "HIPRTC_ERROR_COMPILATION"),
                  ("HIPRTC_ERROR_COMPILATION",)]:
        monkeypatch.setattr(hip_be, "hiprtc", types.SimpleNamespace(
            hiprtcGetErrorString=lambda err, reply=reply: reply))
        with pytest.raises(CompileError) as e:
            hip_be._check((hiprtcResult(6, "HIPRTC_ERROR_COMPILATION"),), "hiprtcCompileProgram",
                          log="k.hip:1:1: error: boom")
        assert e.value.error_name == "HIPRTC_ERROR_COMPILATION"
        assert "k.hip:1:1: error: boom" in str(e.value)


def test_real_bindings_decode_real_codes():
    """With the real enums: the names come out whether or not a driver is loadable."""
    if cuda_be.nvrtc is not None:
        with pytest.raises(CompileError, match="NVRTC_ERROR_COMPILATION"):
            cuda_be._check((cuda_be.nvrtc.nvrtcResult.NVRTC_ERROR_COMPILATION,),
                           "nvrtcCompileProgram", log="log")
        with pytest.raises(BackendError, match="CUDA_ERROR_INVALID_VALUE"):
            cuda_be._check((cuda_be.driver.CUresult.CUDA_ERROR_INVALID_VALUE,), "cuMemAlloc")
    if hip_be.hip is not None:
        with pytest.raises(BackendError, match="hipErrorInvalidValue"):
            hip_be._check((hip_be.hip.hipError_t.hipErrorInvalidValue,), "hipMalloc")
    if cuda_be.nvrtc is None and hip_be.hip is None:
        pytest.skip("neither cuda-bindings nor hip-python is importable")


# --------------------------------------------------------------------------- selection

def test_available_backends_reports_a_reason_for_each():
    found = backends.available_backends()
    assert [name for name, _, _ in found] == ["cuda", "hip"]
    for name, be, reason in found:
        assert reason, name
        if be is None:
            assert ":" in reason  # "<ExceptionType>: why"
        else:
            assert be.name == name and be.arch in reason


def test_get_backend_names_every_backend_tried(monkeypatch):
    def fake_import(modname):
        def create():
            if modname.endswith(".cuda"):
                raise BackendUnavailable("NVIDIA driver not loadable: libcuda.so.1 not found")
            raise ImportError("No module named 'hip'")
        return types.SimpleNamespace(create=create)

    monkeypatch.setattr(backends, "_INSTANCES", {})
    monkeypatch.setattr(backends.importlib, "import_module", fake_import)
    monkeypatch.delenv("HIPKERNEL_BACKEND", raising=False)
    with pytest.raises(RuntimeError) as e:
        backends.get_backend()
    msg = str(e.value)
    assert "no GPU backend available" in msg
    assert "cuda: BackendUnavailable: NVIDIA driver not loadable: libcuda.so.1 not found" in msg
    assert "hip: ImportError: No module named 'hip'" in msg
    with pytest.raises(RuntimeError) as e:
        backends.get_backend("hip")
    assert "hip: ImportError" in str(e.value) and "cuda:" not in str(e.value)
    with pytest.raises(ValueError, match="unknown backend 'metal'"):
        backends.get_backend("metal")


def test_no_backend_here_says_why():
    if any(be is not None for _, be, _ in backends.available_backends()):
        pytest.skip("a GPU backend works on this machine")
    with pytest.raises(RuntimeError, match=r"(?s)tried:.*cuda: .*hip: "):
        backends.get_backend()


def test_hip_shim_points_rocm_path_at_hiprtc(monkeypatch, tmp_path):
    """With no ROCm configured, _ensure_rocm_path makes lib/libhiprtc.so + libamdhip64.so."""
    libdir = tmp_path / "usr-lib"
    libdir.mkdir()
    (libdir / "libamdhip64.so.5").write_bytes(b"")
    for var in ("ROCM_PATH", "ROCM_HOME", "HIPKERNEL_ROCM_SHIM"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HIPKERNEL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(hip_be, "_LIB_DIRS", (str(libdir),))
    real_exists = os.path.exists
    monkeypatch.setattr(hip_be.os.path, "exists",
                        lambda p: False if str(p).startswith("/opt/rocm") else real_exists(p))
    shim = hip_be._ensure_rocm_path()
    assert shim == str(tmp_path / "cache" / "rocm-shim") == os.environ["ROCM_PATH"]
    for name in ("libhiprtc.so", "libamdhip64.so"):
        assert os.readlink(os.path.join(shim, "lib", name)) == str(libdir / "libamdhip64.so.5")
    assert hip_be._ensure_rocm_path() == shim  # idempotent: ROCM_PATH now set


# --------------------------------------------------------------------------- on a GPU

VADD = r"""
extern "C" __global__ void vadd(const float* a, const float* b, float* c, int n, float alpha) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) c[i] = a[i] + alpha * b[i] + OFFSET;
}
"""


@pytest.fixture(params=backends.BACKEND_NAMES)
def gpu(request):
    be, reason = backends._try(request.param)
    if be is None:
        pytest.skip(f"{request.param} backend unavailable: {reason}")
    return be


def _vadd(be, kern, n=1000, alpha=0.5):
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    bufs = [be.alloc(x.nbytes) for x in (a, b, a)]
    try:
        be.htod(bufs[0], a)
        be.htod(bufs[1], b)
        be.memset(bufs[2], 0xFF, a.nbytes)  # NaN canary
        args = [(ctypes.c_void_p, bufs[0]), (ctypes.c_void_p, bufs[1]),
                (ctypes.c_void_p, bufs[2]), (ctypes.c_int32, n), (ctypes.c_float, alpha)]
        be.launch(kern, (-(-n // 256),), (256,), args)
        be.synchronize()
        c = np.empty_like(a)
        be.dtoh(c, bufs[2])
        return a, b, c, bufs, args
    except BaseException:
        for p in bufs:
            p.free()
        raise


@pytest.mark.gpu
def test_gpu_vector_add_compiles_launches_and_times(gpu, tmp_path):
    be = type(gpu)(cache=DiskCache(tmp_path, enabled=True))
    kern = be.compile(VADD, {"OFFSET": 1}, "vadd")
    assert be.compiles == 1 and kern.info.regs is not None
    a, b, c, bufs, args = _vadd(be, kern)
    try:
        np.testing.assert_allclose(c, a + 0.5 * b + 1, rtol=1e-6, atol=1e-6)
        times = be.time_ms(lambda: be.launch(kern, (4,), (256,), args), warmup=2, reps=5)
        assert len(times) == 5 and all(t > 0 for t in times) and median(times) < 100
    finally:
        for p in bufs:
            p.free()

    again = type(gpu)(cache=DiskCache(tmp_path, enabled=True))  # loads from disk
    k2 = again.compile(VADD, {"OFFSET": 1}, "vadd")
    assert k2.from_disk and again.compiles == 0
    a, b, c, bufs, _ = _vadd(again, k2, n=77, alpha=-2.0)
    for p in bufs:
        p.free()
    np.testing.assert_allclose(c, a - 2.0 * b + 1, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_gpu_compile_error_has_the_log(gpu, tmp_path):
    be = type(gpu)(cache=DiskCache(tmp_path, enabled=True))
    with pytest.raises(CompileError) as e:
        be.compile(VADD.replace("OFFSET", "UNDEFINED_NAME"), {}, "vadd")
    assert "UNDEFINED_NAME" in e.value.log and "UNDEFINED_NAME" in str(e.value)


@pytest.mark.gpu
def test_gpu_missing_kernel_name_is_a_decoded_error(gpu, tmp_path):
    be = type(gpu)(cache=DiskCache(tmp_path, enabled=True))
    with pytest.raises(BackendError, match=r"ModuleGetFunction failed: \w+"):
        be.compile(VADD, {"OFFSET": 0}, "no_such_kernel")


SMEM_REVERSE = r"""
extern "C" __global__ void smem_reverse(const float* a, float* out, int n) {
    extern __shared__ float buf[];  // n floats of dynamic shared memory
    for (int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = a[i];
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = buf[n - 1 - i];
}
"""


@pytest.mark.gpu
def test_gpu_dynamic_shared_memory_over_48_kib(gpu, tmp_path):
    """A launch with 96 KiB of dynamic shared memory (what the wgmma path takes) works: the
    backend opts the kernel in first (CUDA; AMD needs no opt-in and has 64 KiB, so there it
    asks for 64). Every byte of it is written and read back, so a smaller allocation would
    show as wrong output (or a launch error) rather than pass."""
    be = type(gpu)(cache=DiskCache(tmp_path, enabled=True))
    kern = be.compile(SMEM_REVERSE, {}, "smem_reverse")
    nbytes = 96 * 1024 if be.name == "cuda" else 64 * 1024
    n = nbytes // 4
    a = np.arange(n, dtype=np.float32)
    bufs = [be.alloc(a.nbytes) for _ in range(2)]
    try:
        be.htod(bufs[0], a)
        be.memset(bufs[1], 0xFF, a.nbytes)
        be.launch(kern, 1, 256, [(ctypes.c_void_p, bufs[0]), (ctypes.c_void_p, bufs[1]),
                                 (ctypes.c_int32, n)], shared_mem=nbytes)
        be.synchronize()
        out = np.empty_like(a)
        be.dtoh(out, bufs[1])
        np.testing.assert_array_equal(out, a[::-1])
        assert kern.shared_mem_allowed >= nbytes
        with pytest.raises(ValueError, match="^shared_mem: .* bytes of dynamic shared memory, over"):
            be.launch(kern, 1, 256, [], shared_mem=1 << 20)  # 1 MiB: no GPU has it
    finally:
        for p in bufs:
            p.free()


def test_errors_survive_a_process_boundary():
    """hipkernel.build gets compile errors back from worker processes, log included."""
    import pickle

    e = CompileError("cuda", "nvrtcCompileProgram", 6, "NVRTC_ERROR_COMPILATION", "the log")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is CompileError and str(back) == str(e) and back.log == "the log"


@pytest.mark.gpu
def test_gpu_hold_keeps_host_launch_time_out_of_the_events(gpu, tmp_path):
    """A hold spins about as long as asked, and behind one a burst of tiny launches times
    the device: 200 empty launches take far less on the events than the host's enqueueing
    of them (tens of microseconds each through Python)."""
    be = type(gpu)(cache=DiskCache(tmp_path, enabled=True))
    [t] = be.time_ms(lambda: be.hold(2.0), warmup=1, reps=1)
    assert 1.0 < t < 4.0
    kern = be.compile(VADD, {"OFFSET": 0}, "vadd")
    a, b, c, bufs, args = _vadd(be, kern, n=32, alpha=1.0)
    try:
        def burst():
            for _ in range(200):
                be.launch(kern, 1, 32, args)
        t0 = time.perf_counter()
        burst()
        host_ms = (time.perf_counter() - t0) * 1e3
        be.synchronize()
        [bare] = be.time_ms(burst, warmup=0, reps=1)
        [held] = be.time_ms(burst, warmup=0, reps=1, hold_ms=min(1000.0, 2 * host_ms + 0.5))
        assert held < 0.5 * min(bare, host_ms), (held, bare, host_ms)
    finally:
        for p in bufs:
            p.free()


@pytest.mark.parametrize("raw", ["gpu1", "-1", "1.5"])
def test_a_bad_device_index_in_the_environment_names_the_variable(raw):
    from hipkernel.backends import device_from_environment
    from refattn.args import EnvVarError

    with pytest.raises(EnvVarError, match=rf"^HIPKERNEL_DEVICE: expected a device index >= 0, got '{raw}'"):
        device_from_environment({"HIPKERNEL_DEVICE": raw})
    assert device_from_environment({}) == 0 and device_from_environment({"HIPKERNEL_DEVICE": " 3 "}) == 3
