"""A recording backend for host-side tests of the kernel API and the autotuner.

It implements the backend interface (compile, alloc, htod, dtoh, launch, time_ms,
synchronize, free) without a device: launches are recorded, device buffers are plain
byte arrays, and ``time_ms`` returns a time chosen by the test per config. It exists to test
host logic (decline before any device call, autotune keys, tuning launches without the
sink); numerics are tested against the model and, on a GPU, the real kernel.
"""

from __future__ import annotations

import struct

import numpy as np


class RecordingBackend:
    name = "recording"
    device_name = "no device"

    def __init__(self, arch="sm_test", times=None):
        self.arch = arch
        self.times = times or {}
        self.calls: list[tuple] = []  # every device-level call, in order
        self.launches: list[dict] = []
        self._mem: dict[int, bytearray] = {}
        self._next = 0x1000
        self._timing = False

    def compile(self, source, defines, kernel_name):
        self.calls.append(("compile", dict(defines)))
        return dict(defines)

    def alloc(self, nbytes):
        ptr = self._next
        self._next += max(256, nbytes)
        self._mem[ptr] = bytearray(nbytes)
        self.calls.append(("alloc", nbytes))
        return ptr

    def memset(self, ptr, byte, nbytes):
        self.calls.append(("memset", ptr, byte, nbytes))
        self._mem[ptr][:nbytes] = bytes([byte]) * nbytes

    def free(self, ptr):
        self.calls.append(("free", ptr))
        self._mem.pop(ptr)

    def htod(self, ptr, arr):
        self.calls.append(("htod", ptr))
        self._mem[ptr][:] = np.ascontiguousarray(arr).tobytes()

    def dtoh(self, arr, ptr):
        self.calls.append(("dtoh", ptr))
        arr[...] = np.frombuffer(bytes(self._mem[ptr]), dtype=arr.dtype).reshape(arr.shape)

    def launch(self, kernel, grid, block, args, shared_mem=0, stream=None):
        rec = dict(kernel=kernel, grid=grid, block=block, args=[val for _, val in args],
                   shared_mem=shared_mem, tuning=self._timing, stream=stream)
        self.launches.append(rec)
        self.calls.append(("launch", rec))

    def prepare(self, kernel, grid, block, args, shared_mem=0):
        """A launch of ``args`` as they are when it is called (``KernelArgs.set`` changes
        them in place), recorded like :meth:`launch`; ``self.prepares`` counts them."""
        self.prepares = getattr(self, "prepares", 0) + 1
        return lambda stream=None: self.launch(kernel, grid, block, args, shared_mem, stream)

    def tensor_map(self, ptr, dims, strides, box):
        """The map's parameters as 16 little-endian uint64 (ptr, 3 dims, 2 strides, 3 box
        sizes, zeros): what a test can read back from the launch's arguments."""
        self.calls.append(("tensor_map", ptr, tuple(dims), tuple(strides), tuple(box)))
        words = [int(ptr), *dims, *strides, *box]
        return struct.pack("<16Q", *(words + [0] * (16 - len(words))))

    def synchronize(self):
        self.calls.append(("synchronize",))

    def time_ms(self, fn, warmup=1, reps=3):
        """Each sample is the test's time for the launched config times the number of
        launches ``fn`` makes (a burst of n launches takes n times one)."""
        self._timing = True
        before = len(self.launches)
        try:
            fn()
        finally:
            self._timing = False
        n = len(self.launches) - before
        cfg = self.launches[-1]["kernel"]
        return [n * self.times.get((cfg["M_TILES"], cfg["BKV"]), 1.0)] * reps
