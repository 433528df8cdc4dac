"""On-disk cache of compiled kernel modules (CUBIN, PTX or AMDGPU code objects).

Compiling the flash-prefill kernel takes seconds per config; a case matrix needs a dozen
configs and every test process would pay for them again. So compiled binaries are kept on
disk, keyed by everything that can change the binary:

    key = sha256(source text, headers in the include dirs, sorted compile options,
                 target arch, backend name, compiler version)

Entries live in ``$HIPKERNEL_CACHE_DIR`` (default ``~/.cache/hipkernel``). ``HIPKERNEL_CACHE=0``
turns the disk cache off (the in-process cache in ``Backend.compile`` stays). The cache is
best effort: a write is atomic (temporary file + ``os.replace``, so a reader never sees half
an entry), and an entry that is missing, truncated, corrupt or unreadable is a miss, never
an error. Every entry carries a magic and the sha256 of its payload to tell.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

MAGIC = b"HIPKMOD1"  # entry = MAGIC + sha256(payload) (32 bytes) + payload
_HEADER_SUFFIXES = (".h", ".hpp", ".cuh", ".hip", ".inc")


def default_dir() -> Path:
    env = os.environ.get("HIPKERNEL_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "hipkernel"


def headers_digest(include_dirs: Iterable[str | os.PathLike]) -> str:
    """sha256 over the header files directly in each include dir (name + content), so that
    editing a header the kernel includes invalidates its cached modules."""
    h = hashlib.sha256()
    for d in include_dirs:
        d = Path(d)
        h.update(str(d).encode() + b"\0")
        try:
            files = sorted(p for p in d.iterdir() if p.suffix in _HEADER_SUFFIXES and p.is_file())
        except OSError:
            continue
        for p in files:
            try:
                h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
            except OSError:
                h.update(p.name.encode() + b"\0<unreadable>\0")
    return h.hexdigest()


_SOURCE_DIGESTS: dict[str, str] = {}
_SOURCE_DIGESTS_MAX = 64


def source_digest(source: str) -> str:
    """The hex sha256 of a source text, kept per text: a kernel is about 100 KB, and hashing
    it for every new launch plan took 54 us of a cold first call's 140 (2-core CPU)."""
    digest = _SOURCE_DIGESTS.get(source)
    if digest is None:
        if len(_SOURCE_DIGESTS) >= _SOURCE_DIGESTS_MAX:
            _SOURCE_DIGESTS.clear()
        digest = _SOURCE_DIGESTS[source] = hashlib.sha256(source.encode()).hexdigest()
    return digest


def cache_key(*, source: str, options: Iterable[str], arch: str, backend: str,
              compiler_version: str, include_dirs: Iterable[str | os.PathLike] = ()) -> str:
    """The cache key (hex sha256). ``options`` are sorted: they are -D/-I/-arch flags whose
    order does not change the binary."""
    parts = {
        "source": source_digest(source),
        "headers": headers_digest(include_dirs),
        "options": sorted(str(o) for o in options),
        "arch": str(arch),
        "backend": str(backend),
        "compiler": str(compiler_version),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


class DiskCache:
    """Binaries by key under ``directory``. ``enabled=False`` makes every lookup a miss and
    every store a no-op."""

    def __init__(self, directory: str | os.PathLike | None = None, enabled: bool | None = None):
        self.directory = Path(directory) if directory is not None else default_dir()
        if enabled is None:
            enabled = os.environ.get("HIPKERNEL_CACHE", "1") != "0"
        self.enabled = enabled
        self.hits = 0
        self.misses = 0

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.bin"

    def load(self, key: str) -> bytes | None:
        """The payload stored under ``key``, or None when absent or damaged (a damaged entry
        is removed so that the next store replaces it)."""
        if not self.enabled:
            return None
        p = self.path(key)
        try:
            blob = p.read_bytes()
        except OSError:
            self.misses += 1
            return None
        head = len(MAGIC) + 32
        payload = blob[head:]
        if (len(blob) < head or not blob.startswith(MAGIC)
                or hashlib.sha256(payload).digest() != blob[len(MAGIC):head]):
            self.misses += 1
            self.discard(key)
            return None
        self.hits += 1
        return payload

    def store(self, key: str, payload: bytes) -> None:
        """Write atomically; a failure to write (read-only home, full disk) is ignored."""
        if not self.enabled:
            return
        from refattn.fileio import atomic_write_bytes

        try:
            atomic_write_bytes(self.path(key), MAGIC + hashlib.sha256(payload).digest() + payload,
                               prefix=f".{key[:16]}.")
        except OSError:
            pass

    def discard(self, key: str) -> None:
        try:
            self.path(key).unlink()
        except OSError:
            pass

    def get_or_compile(self, key: str, compile_fn: Callable[[], bytes]) -> tuple[bytes, bool]:
        """``(payload, hit)``: the stored payload, or ``compile_fn()`` stored under ``key``."""
        payload = self.load(key)
        if payload is not None:
            return payload, True
        payload = compile_fn()
        self.store(key, payload)
        return payload, False
