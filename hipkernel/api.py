"""Host API of the fused flash-prefill kernel: argument checks, the decline contract, config
choice (autotune) and dispatch to a GPU backend.

Two levels:

* :func:`flash_prefill_v3` works on device buffers and returns 0 (computed) or -1 (declined),
  on a given stream and, with ``sync=False``, without a synchronize. :func:`prepare_call` is
  its first half: the checked, tuned and packed launch of a geometry (:class:`PreparedCall`),
  which a caller of many calls (``hipkernel.torch``) launches itself.
  :func:`flash_prefill_v2` is the pre-sink signature: v3 with no sink and no window.
* :func:`attention` takes NumPy arrays shaped like ``refattn.attention`` and returns
  ``(status, out)``.

The contract (docs/semantics.md, Kernel contract): the decline decision is made here, on the host, before any device
call, so it is testable without a GPU. A decline launches nothing and leaves ``out``
byte-identical. It declines what the kernel does not implement: a head dim outside
``HEAD_DIMS``, ``softcap > 0``, a dtype other than fp16 and bf16. Invalid arguments are not
declines: they raise ``ValueError`` naming the argument.

Ragged batches (docs/semantics.md, Ragged batches): ``past_len`` per sequence and ``q_len``
(valid rows of each sequence, right-padded to Sq) go to the kernel as two int32 device
arrays (``past_lens``, ``q_lens``; null for a uniform one). Sequence b's rows i < q_len[b]
sit at past_len[b] + i and read only its first past_len[b] + q_len[b] keys; its padded rows
come back as zeros. A config that copies with TMA (``KernelConfig.tma``) bounds every
sequence by one tensor-map row count, so a ragged call refuses it and the tuner does not
offer it there.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import numbers
import re
import statistics
import threading
import time
from functools import lru_cache
from pathlib import Path

import numpy as np

from hipkernel.autotune import TUNER, Work, model_times, prune_by_model, tune_key
from hipkernel.config import (DEFAULT, DTYPES, HEAD_DIMS, PATH_NEEDS, KernelConfig, candidates,
                              default_config, runs_path)
from refattn.args import FP32_MAX, FP32_TINY, check_attention_args
from refattn.mutants import by_name as _mutant_by_name

KERNEL_DIR = Path(__file__).parent / "kernels"
KERNEL_FILE = KERNEL_DIR / "gqa_flash_prefill.hip"  # the scalar path
KERNEL_FILES = {"scalar": KERNEL_FILE, "mma": KERNEL_DIR / "gqa_flash_prefill_mma.hip",
                "wgmma": KERNEL_DIR / "gqa_flash_prefill_wgmma.hip",
                "wgspan": KERNEL_DIR / "gqa_flash_prefill_wgspan.hip",
                "wmma": KERNEL_DIR / "gqa_flash_prefill_amdmma.hip",
                "mfma": KERNEL_DIR / "gqa_flash_prefill_amdmma.hip"}
KERNEL_NAME = "gqa_flash_prefill"  # the entry point of every path
SUPPORTED_DTYPES = DTYPES  # ("fp16", "bf16"): q, k, v and out; the sink is fp16 in both
_SINK_MODES = {"none": 0, "per_head": 1, "smooth": 2}


# --------------------------------------------------------------------------- source

def inline_includes(read, name: str) -> str:
    """The kernel file ``name`` with every ``#include "x.h"`` of a file beside it inlined once
    (between ``// ---- begin x.h ----`` and ``// ---- end x.h ----``); ``read(name)`` gives a
    file's text (the working tree's, or a git revision's in ``hipkernel.ab``)."""
    def inline(fname: str, seen: set) -> str:
        out = []
        for line in read(fname).splitlines():
            m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
            if m:
                dep = m.group(1)
                if dep not in seen:
                    seen.add(dep)
                    out.append(f"// ---- begin {dep} ----")
                    out.append(inline(dep, seen))
                    out.append(f"// ---- end {dep} ----")
                continue
            out.append(line)
        return "\n".join(out)

    return inline(name, {name}) + "\n"


@lru_cache(maxsize=None)
def kernel_source(path: str = "scalar") -> str:
    """The kernel of ``path`` (``hipkernel.config.PATHS``: "scalar", "mma", "wgmma", "wmma" or
    "mfma", the last two one file) as one translation
    unit: ``#include "x.h"`` of files beside it are inlined, so every compiler (NVRTC, hiprtc,
    clang) sees the same text and needs no include path."""
    if path not in KERNEL_FILES:
        raise ValueError(f"path: expected one of {tuple(KERNEL_FILES)}, got {path!r}")
    return inline_includes(lambda name: (KERNEL_DIR / name).read_text(), KERNEL_FILES[path].name)


# The host code between a caller and the kernel: what picks the config, tunes, compiles,
# packs the arguments and launches (the NumPy level and the runtimes). An edit of it can
# change what a GPU record measured as surely as a kernel edit can, so the hash that stamps
# the records covers it too. The torch entry point (torch.py) is hashed on top of it for its
# own records only (``torch_source_hash``): the other records never run it.
PACKAGE_DIR = Path(__file__).parent
LAUNCH_FILES = ("api.py", "autotune.py", "config.py", "backends")
TORCH_ENTRY_FILE = "torch.py"


def _hashed_files() -> list[tuple[str, Path]]:
    """(name, file) of every kernel file (each ``.hip`` and ``.h`` under ``KERNEL_DIR``) and
    every launch file (``LAUNCH_FILES`` under ``PACKAGE_DIR``, each ``.py`` of a folder),
    sorted by name; a launch file's name is its path under the package."""
    files = [(p.name, p) for p in KERNEL_DIR.iterdir() if p.suffix in (".hip", ".h")]
    for name in LAUNCH_FILES:
        p = PACKAGE_DIR / name
        if p.is_dir():
            files += [(f"{name}/{f.name}", f) for f in p.iterdir() if f.suffix == ".py"]
        else:
            files.append((name, p))
    return sorted(files)


def source_hash() -> str:
    """sha256 over every kernel file and every launch file (``_hashed_files``: its name, a
    NUL, its bytes, a NUL), so an edit of any kernel path, header, or of the host code that
    tunes, compiles and launches them changes it. GPU records in reports/gpu/ carry it; CI
    compares it with the current tree, so a record is fresh only for the code it ran."""
    h = hashlib.sha256()
    for name, f in _hashed_files():
        h.update(name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def torch_source_hash() -> str:
    """sha256 over ``source_hash()`` and the torch entry point (``TORCH_ENTRY_FILE``): what a
    record of ``hipkernel.torch`` (kernel ``hipkernel-torch``) ran, so that an edit of the
    entry point stales its records and no other."""
    h = hashlib.sha256(source_hash().encode() + b"\0")
    h.update(TORCH_ENTRY_FILE.encode() + b"\0" + (PACKAGE_DIR / TORCH_ENTRY_FILE).read_bytes())
    return h.hexdigest()


def kernel_defines(d: int, config: KernelConfig, mutants=frozenset(), dtype: str = "fp16") -> dict:
    """The ``-D`` macros of ``config`` at head dim ``d`` for ``dtype`` inputs (bf16 adds
    ``HK_BF16=1``), with each mutant's macro."""
    defines = dict(config.defines(d, dtype))
    for name in sorted(mutants):
        defines[_mutant_by_name(name).macro] = 1
    return defines


def kv_tensor_maps(backend, config: KernelConfig, *, k, v, B: int, Hkv: int, d: int, S_cap: int,
                   skv: int, mutants=frozenset()) -> list[tuple]:
    """The two trailing kernel arguments of a config that copies with TMA (``config.tma``):
    the tensor maps of its copies (kernels/gqa_flash_prefill_wgmma.hip, "TMA"), ``k`` then
    ``v``, each the cache ``(B, Hkv, S_cap, d)`` seen as ``(d, rows, B * Hkv)`` with a box of
    one 64-dim column block of a ``bkv``-key tile. ``rows`` is what the copies may read of a
    KV head, ``skv``: the map's bound zero-fills the keys past it, which is the TMA path's
    key_kept (flash_common.h), so under its ``tail_unmasked`` mutant it is the whole cache,
    canaries included. [] for every other config."""
    from hipkernel.backends import TensorMap

    if not config.tma:
        return []
    rows = S_cap if "tail_unmasked" in mutants else skv
    dims, strides, box = (d, rows, B * Hkv), (2 * d, 2 * d * S_cap), (64, config.bkv, 1)
    return [(TensorMap, backend.tensor_map(ptr, dims, strides, box)) for ptr in (k, v)]


def kernel_args(backend, config: KernelConfig, *, q, k, v, sink, out, B: int, Sq: int, Hq: int,
                Hkv: int, d: int, S_cap: int, past_len: int, window: int, sink_mode: int,
                scale: float, past_lens=0, q_lens=0, mutants=frozenset()) -> list[tuple]:
    """The kernel ABI's argument list (docs/ARCHITECTURE.md "Kernel ABI") of ``config`` on
    device buffers: the fifteen arguments of every path (``sink_mode`` the ABI's integer,
    ``sink`` 0 unless it is 1; ``past_lens`` and ``q_lens`` the device arrays of a ragged
    call, 0 (null) for a uniform one), plus the tensor maps of a config that copies with TMA
    (``kv_tensor_maps``, built for ``mutants``; such a config runs uniform calls only)."""
    return [
        (ctypes.c_void_p, q), (ctypes.c_void_p, k), (ctypes.c_void_p, v),
        (ctypes.c_void_p, sink if sink_mode == 1 else 0), (ctypes.c_void_p, out),
        (ctypes.c_int32, Sq), (ctypes.c_int32, Hq), (ctypes.c_int32, Hkv),
        (ctypes.c_int32, S_cap), (ctypes.c_int32, past_len), (ctypes.c_int32, window),
        (ctypes.c_int32, sink_mode), (ctypes.c_float, scale),
        (ctypes.c_void_p, past_lens), (ctypes.c_void_p, q_lens),
    ] + kv_tensor_maps(backend, config, k=k, v=v, B=B, Hkv=Hkv, d=d, S_cap=S_cap,
                       skv=past_len + Sq, mutants=mutants)


# --------------------------------------------------------------------------- contract

def decline_reason(*, d: int, softcap: float = 0.0, dtype: str = "fp16") -> str | None:
    """Why the kernel declines this call, or None when it implements it."""
    if d not in HEAD_DIMS:
        return f"head dim {d} not compiled (have {HEAD_DIMS})"
    if softcap and softcap > 0:
        return "softcap is not implemented"
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} is not implemented (have {SUPPORTED_DTYPES})"
    return None


def _dtype_name(a: np.ndarray) -> str:
    return {np.dtype(np.float16): "fp16", np.dtype(np.float32): "fp32",
            np.dtype(np.float64): "fp64"}.get(a.dtype, str(a.dtype))


def _check_int(name: str, x, lo: int) -> int:
    if not isinstance(x, numbers.Integral) or isinstance(x, bool) or x < lo:
        raise ValueError(f"{name}: expected an int >= {lo}, got {x!r}")
    return int(x)


def _check_config(config) -> KernelConfig | None:
    if config is None or isinstance(config, KernelConfig):
        return config
    if isinstance(config, dict):
        unknown = set(config) - {"m_tiles", "bkv", "path", "warp_m", "ws", "pack", "walk"}
        if unknown:
            raise ValueError(f"config: unknown keys {sorted(unknown)} (known: m_tiles, bkv, path, "
                             f"warp_m, ws, pack, walk)")
        try:
            return KernelConfig(config.get("m_tiles", DEFAULT.m_tiles), config.get("bkv", DEFAULT.bkv),
                                config.get("path", DEFAULT.path), config.get("warp_m", DEFAULT.warp_m),
                                config.get("ws", DEFAULT.ws), config.get("pack", DEFAULT.pack),
                                config.get("walk", DEFAULT.walk))
        except ValueError as e:
            raise ValueError(f"config: {e}") from None
    raise ValueError(f"config: expected a KernelConfig, a dict or None, got {config!r}")


_INT32_LIMIT = 2**31


def _check_int32_sizes(**sizes: int) -> None:
    """Every size and position the kernel ABI takes as an int32 must fit one (``past_len`` is
    checked as ``past_len + Sq``, the last position)."""
    for name, x in sizes.items():
        if x >= _INT32_LIMIT:
            raise ValueError(f"{name}: {x} does not fit the kernel's int32 arguments")


def _check_mutants(mutants) -> frozenset:
    if isinstance(mutants, str):
        raise ValueError(f"mutants: expected a set of mutant names, got the string {mutants!r}")
    mutants = frozenset(mutants)
    for name in mutants:
        _mutant_by_name(name)
    return mutants


def _check_config_for(config: KernelConfig | None, arch: str, d: int | None = None,
                      G: int | None = None) -> None:
    if config is not None and d is not None:
        try:
            config.defines(d)  # shared memory of this tile at this head dim
        except ValueError as e:
            raise ValueError(f"config: {e}") from None
    if config is not None and G is not None and not config.supports(G):
        raise ValueError(f"config: {config.name} packs {config.pack} query heads a block, which "
                         f"must share a KV head; G = Hq / Hkv = {G} is not a multiple of "
                         f"{config.pack}")
    if config is not None and not runs_path(config.path, arch):
        raise ValueError(f"config: path {config.path!r} needs {PATH_NEEDS[config.path]}, the "
                         f"backend targets {arch}")


# --------------------------------------------------------------------------- device level

def _check_lengths(name: str, x, B: int) -> np.ndarray:
    """A per-sequence length argument given as a host integer sequence or array: shape (B,),
    entries >= 0 and int32, as int64; else ValueError naming ``name``."""
    try:
        a = np.asarray(x)
    except Exception:  # noqa: BLE001 - whatever numpy cannot take is not a length array
        a = None
    if a is None or a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{name}: expected {'an int >= 0 or ' if name == 'past_len' else ''}a host "
                         f"integer array of shape (B,) = ({B},), got {x!r}")
    if a.shape != (B,):
        raise ValueError(f"{name}: expected shape (B,) = ({B},) (one entry per sequence), got {a.shape}")
    if (a < 0).any():
        b = int(np.flatnonzero(a < 0)[0])
        raise ValueError(f"{name}: expected entries >= 0, got {int(a[b])} for sequence {b}")
    if (a >= _INT32_LIMIT).any():
        b = int(np.flatnonzero(a >= _INT32_LIMIT)[0])
        raise ValueError(f"{name}: {int(a[b])} for sequence {b} does not fit the kernel's int32 lengths")
    return a.astype(np.int64)


def _resolve_lengths(past_len, q_len, *, B: int, Sq: int, S_cap: int):
    """``(past_len, past_lens, q_lens)`` of a call: ``past_len`` the ABI's int (0 when it is
    per sequence), ``past_lens`` / ``q_lens`` int64 arrays (B,), or None where uniform. A
    past_len array of one value is that int; a q_len of Sq everywhere is None; so a call
    with neither left is the uniform one. ValueError naming the argument for a wrong length,
    a negative entry, q_len > Sq, a cache that holds fewer keys than a sequence, or a
    position beyond int32."""
    if isinstance(past_len, numbers.Integral) and not isinstance(past_len, bool):
        past, pasts = _check_int("past_len", past_len, 0), None
    else:
        pasts = _check_lengths("past_len", past_len, B)
        past = int(pasts[0])
        if (pasts == past).all():
            pasts = None
    qs = None
    if q_len is not None:
        qs = _check_lengths("q_len", q_len, B)
        if (qs > Sq).any():
            b = int(np.flatnonzero(qs > Sq)[0])
            raise ValueError(f"q_len: expected entries <= Sq = {Sq} (q holds Sq rows), got "
                             f"{int(qs[b])} for sequence {b}")
        if (qs == Sq).all():
            qs = None
    if pasts is None and qs is None:
        if S_cap < past + Sq:
            raise ValueError(f"S_cap: cache capacity {S_cap} < past_len + Sq = {past + Sq}")
        return past, None, None
    ends = (np.full(B, past, np.int64) if pasts is None else pasts) + (Sq if qs is None else qs)
    b = int(np.argmax(ends))
    if ends[b] >= _INT32_LIMIT:
        raise ValueError(f"past_len: past_len[b] + q_len[b] = {int(ends[b])} for sequence {b} "
                         f"does not fit the kernel's int32 positions")
    if S_cap < ends[b]:
        raise ValueError(f"S_cap: cache capacity {S_cap} < past_len[b] + q_len[b] = {int(ends[b])} "
                         f"for sequence b = {b}")
    return (0 if pasts is not None else past), pasts, qs


def flash_prefill_v3(backend, q, k, v, sink, out, *, B: int, Sq: int, Hq: int, Hkv: int, d: int,
                     S_cap: int, past_len, q_len=None, window: int = -1, sink_mode: str = "none",
                     scale: float | None = None, softcap: float = 0.0, dtype: str = "fp16",
                     config: KernelConfig | dict | None = None, mutants=frozenset(),
                     stream: int | None = None, sync: bool = True,
                     device_lengths: tuple[int, int] | None = None) -> int:
    """Fused GQA flash prefill on device buffers (``q (B,Sq,Hq,d)``, ``k, v (B,Hkv,S_cap,d)``,
    ``sink (Hq,)`` fp16 or 0, ``out (B,Sq,Hq,d)``; q, k, v, out fp16, or bf16 with
    ``dtype="bf16"``). ``past_len``: an int, or a host integer sequence of shape (B,) (one
    past_len per sequence); ``q_len``: None (Sq rows each) or a host integer sequence (B,) of
    valid rows, ``0 <= q_len[b] <= Sq``, the rest padding that comes back as zeros; the cache
    holds ``S_cap >= max_b(past_len[b] + q_len[b])`` keys. A ragged call uploads the lengths
    into a small device buffer for the launch and frees it after the synchronize.

    ``stream``: the runtime stream handle (an int) to launch on; None: the backend's default
    stream. ``sync=False`` returns once the kernel is enqueued, without a synchronize and
    without a host copy: the caller orders its use of ``out`` on ``stream``. Such a call
    cannot upload host lengths (their buffer would be freed under the running kernel), so a
    ragged one passes them on the device: ``device_lengths = (past_lens, q_lens)``, device
    pointers of int32 arrays (B,), 0 for one that is uniform, alive until the kernel is done.
    With them ``past_len`` is an int: the kernel's past_len where ``past_lens`` is 0, else
    the uniform call's past_len that reaches every key a sequence reads, ``past_len + Sq >=
    past_len[b] + q_len[b]`` for every b (:func:`ragged_bound`; the capacity check and the
    tuning geometry use it), and ``q_len`` is None. The launch of a geometry (its config, compiled kernel and packed
    arguments) is prepared at its first call and kept (:func:`prepare_call`); later calls
    only patch the pointers and lengths. The first call of a geometry also tunes its config,
    which times candidates and synchronizes whatever ``sync`` says.

    Returns 0, or -1 when it declines, in which case nothing is launched and ``out`` is
    untouched."""
    c = _checked_call(backend, q, k, v, sink, out, B=B, Sq=Sq, Hq=Hq, Hkv=Hkv, d=d, S_cap=S_cap,
                      past_len=past_len, q_len=q_len, window=window, sink_mode=sink_mode,
                      scale=scale, softcap=softcap, dtype=dtype, config=config, mutants=mutants,
                      stream=stream, sync=sync, device_lengths=device_lengths)
    if c is None:
        return -1  # decided before any device call: nothing launched, out untouched
    lens_buf, lens = None, c.lens
    try:
        if c.ragged and c.lens == (0, 0):  # one int32 buffer: past_lens, then q_lens
            parts = [x for x in (c.past_lens, c.q_lens) if x is not None]
            host = np.concatenate(parts).astype(np.int32)
            lens_buf = backend.alloc(host.nbytes)
            backend.htod(lens_buf, host)
            at = int(lens_buf)
            lens = (at if c.past_lens is not None else 0,
                    at + 4 * B * (c.past_lens is not None) if c.q_lens is not None else 0)
        call = _plan(backend, c, q, k, v, sink, out, lens)
        call(q=q, k=k, v=v, sink=sink, out=out, past_len=c.past_len, lens=lens, stream=stream)
        if sync:
            backend.synchronize()
    finally:
        if lens_buf is not None:
            backend.free(lens_buf)
    return 0


def prepare_call(backend, q, k, v, sink, out, *, B: int, Sq: int, Hq: int, Hkv: int, d: int,
                 S_cap: int, past_len: int, window: int = -1, sink_mode: str = "none",
                 scale: float | None = None, softcap: float = 0.0, dtype: str = "fp16",
                 config: KernelConfig | dict | None = None, mutants=frozenset(),
                 device_lengths: tuple[int, int] | None = None) -> PreparedCall | None:
    """The :class:`PreparedCall` that :func:`flash_prefill_v3` with these arguments and
    ``sync=False`` would launch, checked the same way and tuned at a geometry's first call,
    without launching it (None where v3 declines). A caller that makes many calls of one
    geometry (``hipkernel.torch``) keeps it and launches it with new buffers, skipping
    v3's checks, which cost more host time than a short kernel runs."""
    c = _checked_call(backend, q, k, v, sink, out, B=B, Sq=Sq, Hq=Hq, Hkv=Hkv, d=d, S_cap=S_cap,
                      past_len=past_len, q_len=None, window=window, sink_mode=sink_mode,
                      scale=scale, softcap=softcap, dtype=dtype, config=config, mutants=mutants,
                      stream=None, sync=False, device_lengths=device_lengths)
    return None if c is None else _plan(backend, c, q, k, v, sink, out, c.lens)


class _Checked:
    """A v3 call's arguments once checked (``_checked_call``)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def _checked_call(backend, q, k, v, sink, out, *, B, Sq, Hq, Hkv, d, S_cap, past_len, q_len,
                  window, sink_mode, scale, softcap, dtype, config, mutants, stream, sync,
                  device_lengths) -> _Checked | None:
    """Every check of :func:`flash_prefill_v3`, in its order; None where it declines."""
    B, Sq, Hq, Hkv, d = (_check_int(n, x, 1) for n, x in
                         (("B", B), ("Sq", Sq), ("Hq", Hq), ("Hkv", Hkv), ("d", d)))
    S_cap = _check_int("S_cap", S_cap, 1)
    if not isinstance(sync, bool):
        raise ValueError(f"sync: expected True or False, got {sync!r}")
    if stream is not None and (isinstance(stream, bool) or not isinstance(stream, numbers.Integral)
                               or stream < 0):
        raise ValueError(f"stream: expected None or a stream handle as an int >= 0, got {stream!r}")
    bound_past = past_len
    if device_lengths is not None:
        device_lengths = _check_device_lengths(device_lengths, past_len, q_len, B=B, Sq=Sq,
                                               S_cap=S_cap)
        past_len, past_lens, q_lens = (0 if device_lengths[0] else past_len), None, None
        ragged = any(device_lengths)
    else:
        past_len, past_lens, q_lens = _resolve_lengths(past_len, q_len, B=B, Sq=Sq, S_cap=S_cap)
        ragged = past_lens is not None or q_lens is not None
        if ragged and not sync:
            raise ValueError("sync: a ragged call with host lengths uploads them into a buffer "
                             "freed after its synchronize; with sync=False pass them as "
                             "device_lengths=(past_lens, q_lens), int32 device arrays")
    if Hq % Hkv:
        raise ValueError(f"Hkv: Hq={Hq} is not a multiple of Hkv={Hkv}")
    if not isinstance(window, numbers.Integral) or window == 0 or window < -1:
        raise ValueError(f"window: expected -1 (no window) or W >= 1, got {window!r}")
    if sink_mode not in _SINK_MODES:
        raise ValueError(f"sink_mode: expected one of {sorted(_SINK_MODES)}, got {sink_mode!r}")
    if sink_mode == "per_head" and not sink:
        raise ValueError("sink: a device buffer is required when sink_mode='per_head'")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale: expected a finite float > 0, got {scale!r}")
    if not FP32_TINY <= scale <= FP32_MAX:  # the ABI's scale is a float32
        raise ValueError(f"scale: {scale} is outside the normal float32 range of the kernel's "
                         f"float argument")
    if not isinstance(softcap, numbers.Real) or not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap: expected a finite float >= 0, got {softcap!r}")
    for name, ptr in (("q", q), ("k", k), ("v", v), ("out", out)) + ((("sink", sink),) if sink else ()):
        if int(ptr) % 16:  # every global access of the kernel is 16 bytes wide
            raise ValueError(f"{name}: device pointer {int(ptr):#x} is not 16-byte aligned")
    _check_int32_sizes(Sq=Sq, Hq=Hq, S_cap=S_cap, window=window,
                       past_len=(bound_past if device_lengths else past_len) + Sq)
    config = _check_config(config)
    mutants = _check_mutants(mutants)

    if decline_reason(d=d, softcap=softcap, dtype=dtype) is not None:
        return None
    G = Hq // Hkv
    _check_config_for(config, backend.arch, d, G)
    if ragged and config is not None and config.tma:
        raise ValueError(f"config: {config.name} copies its K/V tiles with TMA, whose tensor maps "
                         f"bound every sequence by one key count; a ragged call (past_len or "
                         f"q_len per sequence) needs a config without TMA")
    return _Checked(B=B, Sq=Sq, Hq=Hq, Hkv=Hkv, d=d, G=G, S_cap=S_cap, past_len=past_len,
                    past_lens=past_lens, q_lens=q_lens, ragged=ragged, bound_past=bound_past,
                    lens=device_lengths or (0, 0), device_lengths=device_lengths, window=window,
                    sink_mode=sink_mode, scale=float(scale), dtype=dtype, config=config,
                    mutants=mutants)


def _plan(backend, c: _Checked, q, k, v, sink, out, lens) -> PreparedCall:
    """The prepared call of a checked call ``c`` with the length arrays ``lens``: its config
    (given, or tuned at the geometry's first call), from :data:`PLANS` or prepared there."""

    def prepare(cfg: KernelConfig, mode: int, kv=(k, v, c.S_cap, c.past_len), lens=(0, 0)):
        """A :class:`PreparedCall` of ``cfg`` on the cache ``kv`` = (k, v, S_cap, past_len),
        with the length arrays ``lens`` = (past_lens, q_lens), 0 for uniform; calling it
        launches once."""
        kb, vb, cap, past = kv
        return PreparedCall(backend, cfg, q=q, k=kb, v=vb, sink=sink, out=out, B=c.B, Sq=c.Sq,
                            Hq=c.Hq, Hkv=c.Hkv, d=c.d, S_cap=cap, past_len=past, window=c.window,
                            sink_mode=mode, scale=c.scale, lens=lens, dtype=c.dtype,
                            mutants=c.mutants)

    config = c.config
    if config is None:
        key = tune_key(d=c.d, sq=c.Sq, Hq=c.Hq, G=c.G, window=c.window, dtype=c.dtype,
                       arch=backend.arch, ragged=c.ragged)
        # A ragged call is timed as the uniform call of its geometry: Sq rows on a cache of
        # its longest sequence's keys (past_len = that length - Sq, at least 0), without
        # the length arrays; its candidates leave out the configs that copy with TMA. With
        # the lengths on the device, the caller's bound stands in for the longest.
        tune_past = c.past_len
        if c.ragged and c.device_lengths is not None:
            tune_past = c.bound_past
        elif c.ragged:
            tune_past = ragged_bound(c.past_len, c.past_lens, c.q_lens, B=c.B, Sq=c.Sq)
        default = default_config(backend.arch)
        with TuningCache(backend, k, v, B=c.B, Hkv=c.Hkv, d=c.d, Sq=c.Sq, S_cap=c.S_cap,
                         past_len=tune_past) as kv:
            work = Work(sq=c.Sq, skv=kv.timed_keys, Hq=c.Hq, B=c.B, window=c.window,
                        ragged=c.ragged, sm_count=getattr(backend, "sm_count", None))
            cands = candidates(backend.arch, c.d, c.G, c.window)
            if c.ragged:
                cands = tuple(x for x in cands if not x.tma)
            note = {"work": work.as_dict(), "model": model_times(cands, work)}
            cands = prune_by_model(cands, backend.arch, work, modelled=note["model"])
            # Tuning launches omit the sink: one FMA per row cannot reorder the candidates,
            # and leaving it out keeps tuned configs comparable with the no-sink case.
            config = TUNER.choose(key, lambda cfg: tune_times_ms(backend, prepare(cfg, 0, kv.get())),
                                  candidates=cands, default=default, note=note,
                                  probe=lambda cfg: tune_probe_ms(backend, prepare(cfg, 0, kv.get())))
    plan_key = (backend, config, c.B, c.Sq, c.Hq, c.Hkv, c.d, c.S_cap, c.window, c.sink_mode,
                c.scale, c.dtype, c.mutants, bool(lens[0]), bool(lens[1]))
    call = PLANS.get(plan_key)
    if call is None:
        call = PLANS.put(plan_key, prepare(config, _SINK_MODES[c.sink_mode], lens=lens))
    return call


def ragged_bound(past_len: int, past_lens, q_lens, *, B: int, Sq: int) -> int:
    """The past_len of the uniform call whose keys reach every key a ragged batch reads:
    ``max(0, max_b(past_len[b] + q_len[b]) - Sq)``, with ``past_lens`` / ``q_lens`` the
    per-sequence arrays or None where uniform (``past_len``, ``Sq``). What a ragged call is
    tuned as, and the ``past_len`` that goes with its ``device_lengths``."""
    ends = ((np.full(B, past_len, np.int64) if past_lens is None else np.asarray(past_lens, np.int64))
            + (Sq if q_lens is None else np.asarray(q_lens, np.int64)))
    return max(0, int(ends.max()) - Sq)


def _check_device_lengths(lengths, past_len, q_len, *, B: int, Sq: int, S_cap: int):
    """``device_lengths`` of a call as ``(past_lens, q_lens)`` ints, with ``past_len`` an int
    bound and ``q_len`` None (see :func:`flash_prefill_v3`); ValueError naming the argument."""
    if (not isinstance(lengths, (tuple, list)) or len(lengths) != 2
            or any(isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 0
                   for x in lengths)):
        raise ValueError(f"device_lengths: expected (past_lens, q_lens), two device pointers "
                         f"(ints, 0 for uniform), got {lengths!r}")
    if q_len is not None:
        raise ValueError("q_len: with device_lengths the valid rows are on the device "
                         "(device_lengths[1]); q_len must be None")
    if not isinstance(past_len, numbers.Integral) or isinstance(past_len, bool) or past_len < 0:
        raise ValueError(f"past_len: with device_lengths expected an int >= 0 (the kernel's "
                         f"past_len, or the bound of every sequence's keys, ragged_bound), "
                         f"got {past_len!r}")
    for name, ptr in zip(("past_lens", "q_lens"), lengths):
        if int(ptr) % 4:
            raise ValueError(f"device_lengths: {name} pointer {int(ptr):#x} is not 4-byte aligned")
    if S_cap < past_len + Sq:
        raise ValueError(f"S_cap: cache capacity {S_cap} < past_len + Sq = {past_len + Sq}")
    return int(lengths[0]), int(lengths[1])


class PreparedCall:
    """:func:`flash_prefill_v3`'s launch of one geometry and config, prepared once: the
    kernel compiled and loaded, its launch geometry checked, its argument array packed
    (``Backend.prepare``). A call patches the arguments that change between calls of a
    geometry, the five buffers, ``past_len`` and the two length arrays (each only when it
    changed), re-encodes the tensor maps of a config that copies with TMA when the cache or
    its key count changed, and enqueues the kernel on ``stream``. Patch and enqueue hold a
    lock: two threads launching one geometry must not interleave their pointers (the
    runtime copies the arguments at the enqueue, so the lock ends there)."""

    # positions in the kernel ABI's argument list (kernel_args)
    _BUFFERS = (0, 1, 2, 3, 4)  # q, k, v, sink, out
    _PAST_LEN, _PAST_LENS, _Q_LENS, _MAPS = 9, 13, 14, 15

    def __init__(self, backend, config: KernelConfig, *, q, k, v, sink, out, B: int, Sq: int,
                 Hq: int, Hkv: int, d: int, S_cap: int, past_len: int, window: int,
                 sink_mode: int, scale: float, lens=(0, 0), dtype: str = "fp16",
                 mutants=frozenset()):
        from hipkernel.backends import KernelArgs  # backends only once a launch is needed

        self.backend, self.config, self.mutants = backend, config, mutants
        self.geometry = dict(B=B, Hkv=Hkv, d=d, S_cap=S_cap, Sq=Sq)
        self.sink_mode = sink_mode
        kern = backend.compile(kernel_source(config.path), kernel_defines(d, config, mutants, dtype),
                               KERNEL_NAME)
        self.args = KernelArgs(kernel_args(
            backend, config, q=q, k=k, v=v, sink=sink, out=out, B=B, Sq=Sq, Hq=Hq, Hkv=Hkv, d=d,
            S_cap=S_cap, past_len=past_len, window=window, sink_mode=sink_mode, scale=scale,
            past_lens=lens[0], q_lens=lens[1], mutants=mutants))
        self._last = (int(q), int(k), int(v), int(sink) if sink_mode == 1 else 0, int(out),
                      int(past_len), int(lens[0]), int(lens[1]))
        self._maps_for = (int(k), int(v), past_len)
        self.launch = backend.prepare(kern, config.grid(Sq, Hq, B), (config.threads, 1, 1),
                                      self.args, config.dynamic_smem_bytes(d))
        self._lock = threading.Lock()

    def __call__(self, *, q=None, k=None, v=None, sink=0, out=None, past_len=0, lens=(0, 0),
                 stream: int | None = None) -> None:
        """Launch once on ``stream``: with the buffers ``q, k, v, sink, out`` (device
        addresses; ``sink`` is ignored unless the sink mode is per head), ``past_len`` and
        ``lens``, or, with ``q`` left None, with the arguments of the previous launch."""
        with self._lock:
            if q is not None:
                new = (q, k, v, sink if self.sink_mode == 1 else 0, out, past_len, lens[0], lens[1])
                if new != self._last:  # ints compare by value, whatever their type
                    self._patch(tuple(int(x) for x in new))
            self.launch(stream)

    def enqueue(self, q: int, k: int, v: int, sink: int, out: int, past_len: int,
                stream: int | None) -> None:
        """``self(q=q, ..., past_len=past_len, stream=stream)`` of a uniform call (no length
        arrays) with every argument an ``int``, positional: the torch entry point's path,
        where a short kernel runs for about as long as the host takes to launch it."""
        new = (q, k, v, sink if self.sink_mode == 1 else 0, out, past_len, 0, 0)
        with self._lock:
            if new != self._last:
                self._patch(new)
            self.launch(stream)

    def _patch(self, new: tuple) -> None:
        slots = self._BUFFERS + (self._PAST_LEN, self._PAST_LENS, self._Q_LENS)
        for slot, x, was in zip(slots, new, self._last):
            if x != was:
                self.args.set(slot, x)
        self._last = new
        if self.config.tma and (new[1], new[2], new[5]) != self._maps_for:
            g = self.geometry
            maps = kv_tensor_maps(self.backend, self.config, k=new[1], v=new[2], B=g["B"],
                                  Hkv=g["Hkv"], d=g["d"], S_cap=g["S_cap"], skv=new[5] + g["Sq"],
                                  mutants=self.mutants)
            for j, (_, blob) in enumerate(maps):
                self.args.set(self._MAPS + j, blob)
            self._maps_for = (new[1], new[2], new[5])


class PlanCache:
    """The :class:`PreparedCall` of each geometry seen lately, least recently used first out
    past ``size`` entries (a prepared call holds only host memory and a loaded kernel the
    backend caches anyway)."""

    def __init__(self, size: int = 256):
        self.size = size
        self._plans: dict = {}

    def get(self, key):
        plan = self._plans.pop(key, None)
        if plan is not None:
            self._plans[key] = plan  # most recently used last
        return plan

    def put(self, key, plan):
        self._plans[key] = plan
        while len(self._plans) > self.size:
            self._plans.pop(next(iter(self._plans)))
        return plan

    def clear(self) -> None:
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)


PLANS = PlanCache()


# The autotuner's timer. A pair of events around one launch also times the host's cost of
# making the launch: the GPU reaches the start event at once and waits for the kernel. For a
# 25 us kernel that cost is of the same size and reorders the candidates (it made the tuner
# pick a scalar config for window 128 at 2-3x the mma path's time). So each sample is a burst
# of back-to-back launches of pre-packed arguments between one pair of events: from the
# second launch on, the host enqueues while the GPU runs, and the burst divided by its length
# is the kernel's time. The burst is sized from one probe launch to fill TUNE_BURST_MS.
TUNE_BURST_MS = 1.0
TUNE_BURST_MAX = 32
TUNE_SAMPLES = 5
TUNE_HOLD_MAX_MS = 200.0  # the cap of the sweep's hold (backends.hold_ms_for)
TUNE_PROBE_BURST_MS = 0.25  # the probe's one burst (tune_probe_ms)


# The KV length the sweep times the candidates at. The cache key leaves skv out (one sweep
# for a whole chunked prefill), but the winner does depend on it where the KV is short:
# measured on the H200 in the first run with the 32-rows-a-warp configs, 512 rows at
# past_len 0 were fastest with mma_m4_b64 (0.0220 ms against 0.0226 for mma_m8_b64_w2, the
# sweep of that run's matrix: at short KV the grid's size decides), at past_len 8192
# mma_m8_b64_w2 took 0.247 ms against 0.318 (reports/gpu/mma-check-h200.json, "sweep": the
# work per KV tile decides). A chunked prefill spends its
# time in the long chunks, so a call with fewer than TUNE_MIN_KV keys is timed on a zeroed
# scratch cache of TUNE_MIN_KV keys (the real cache is never read past skv). Zeroed keys and
# values take the same time as real ones: the kernel has no data-dependent work.
TUNE_MIN_KV = 4096
TUNE_SCRATCH_MAX_BYTES = 256 * 2**20  # larger scratch (huge B x Hkv): time on the real cache


class TuningCache:
    """The KV cache a sweep times on: ``(k, v, S_cap, past_len)`` of the call when it has at
    least :data:`TUNE_MIN_KV` keys, else a zeroed scratch cache of that many keys, allocated
    at the first ``get()`` (only a sweep asks) and freed on exit. A geometry the call's cache
    cannot hold (the uniform stand-in of a ragged batch whose sequences all have fewer keys
    than Sq rows) gets a scratch cache of just ``past_len + Sq`` keys where the
    :data:`TUNE_MIN_KV` one is over :data:`TUNE_SCRATCH_MAX_BYTES`."""

    def __init__(self, backend, k, v, *, B: int, Hkv: int, d: int, Sq: int, S_cap: int, past_len: int):
        self.backend, self.real = backend, (k, v, S_cap, past_len)
        self.keys = TUNE_MIN_KV if past_len + Sq < TUNE_MIN_KV else None
        self.nbytes = B * Hkv * (self.keys or 0) * d * 2  # 2 bytes an element: fp16 and bf16
        if self.nbytes > TUNE_SCRATCH_MAX_BYTES:
            self.keys = None
        if self.keys is None and past_len + Sq > S_cap:
            self.keys = past_len + Sq
            self.nbytes = B * Hkv * self.keys * d * 2
        self.Sq = Sq
        self.timed_keys = self.keys or past_len + Sq  # the skv the sweep's launches time
        self.bufs: list = []

    def get(self) -> tuple:
        if self.keys is None:
            return self.real
        if not self.bufs:
            for _ in range(2):
                self.bufs.append(self.backend.alloc(self.nbytes))
                self.backend.memset(self.bufs[-1], 0, self.nbytes)
        return (self.bufs[0], self.bufs[1], self.keys, self.keys - self.Sq)

    def __enter__(self) -> TuningCache:
        return self

    def __exit__(self, *exc) -> None:
        if self.bufs:
            self.backend.synchronize()  # the sweep's launches are done with them
        for buf in self.bufs:
            self.backend.free(buf)
        self.bufs = []


def tune_burst_length(probe_ms: float, burst_ms: float = TUNE_BURST_MS) -> int:
    """Launches per timed burst of about ``burst_ms`` for a kernel whose one-launch probe
    took ``probe_ms``."""
    if not probe_ms > 0:  # 0 or NaN from a coarse timer: the longest burst
        return TUNE_BURST_MAX
    return max(1, min(TUNE_BURST_MAX, math.ceil(burst_ms / probe_ms)))


def tune_times_ms(backend, run) -> list[float]:
    """Per-launch device times (ms) of ``run()`` (one launch), from :data:`TUNE_SAMPLES`
    bursts of :func:`tune_burst_length` launches each. Where the backend can hold the GPU
    (``Backend.hold``), the bursts are queued behind a hold that outlasts the host's
    enqueueing of all of them: a launch shorter than its host cost (a 512-row chunk under a
    128-key window: ~0.014 ms on the H200 against 0.03-0.05 ms to enqueue) would otherwise
    time the host, the same for every candidate, and the pick would be noise."""
    probe = statistics.median(backend.time_ms(run, warmup=1, reps=3))
    n = tune_burst_length(probe)

    def burst() -> None:
        for _ in range(n):
            run()

    if not callable(getattr(backend, "hold", None)):
        return [t / n for t in backend.time_ms(burst, warmup=1, reps=TUNE_SAMPLES)]
    from hipkernel.backends import hold_ms_for

    t0 = time.perf_counter()
    burst()  # warm, and the host's cost of one burst
    hold_ms = hold_ms_for((time.perf_counter() - t0) * 1e3, TUNE_SAMPLES, TUNE_HOLD_MAX_MS)
    return [t / n for t in backend.time_ms(burst, warmup=0, reps=TUNE_SAMPLES, hold_ms=hold_ms)]


def tune_probe_ms(backend, run) -> float:
    """The sweep's first, short look at a candidate (``Autotuner.choose``'s ``probe``): its
    per-launch device time from one burst of about :data:`TUNE_PROBE_BURST_MS`, behind a
    hold where the backend has one (as in :func:`tune_times_ms`, so that a kernel shorter
    than its host cost is not timed as the host). One launch warms it and sizes the burst."""
    one = statistics.median(backend.time_ms(run, warmup=1, reps=1))
    n = tune_burst_length(one, TUNE_PROBE_BURST_MS)

    def burst() -> None:
        for _ in range(n):
            run()

    if not callable(getattr(backend, "hold", None)):
        return backend.time_ms(burst, warmup=0, reps=1)[0] / n
    from hipkernel.backends import hold_ms_for

    t0 = time.perf_counter()
    burst()
    hold_ms = hold_ms_for((time.perf_counter() - t0) * 1e3, 1, TUNE_HOLD_MAX_MS)
    return backend.time_ms(burst, warmup=0, reps=1, hold_ms=hold_ms)[0] / n


def flash_prefill_v2(backend, q, k, v, out, *, B, Sq, Hq, Hkv, d, S_cap, past_len,
                     scale=None, dtype="fp16", config=None) -> int:
    """The pre-sink entry point: v3 with no sink and no window."""
    return flash_prefill_v3(backend, q, k, v, 0, out, B=B, Sq=Sq, Hq=Hq, Hkv=Hkv, d=d,
                            S_cap=S_cap, past_len=past_len, window=-1, sink_mode="none",
                            scale=scale, dtype=dtype, config=config)


# --------------------------------------------------------------------------- NumPy level

def _check_buffer(name: str, a) -> None:
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array (use numpy.ascontiguousarray), "
                         f"got strides {a.strides}")


def _resolve_dtype(dtype, q, k, v) -> str:
    """The kernel dtype of a NumPy-level call: ``dtype`` as given ("fp16" needs float16
    arrays, "bf16" float32 arrays of bf16 values, every word's low 16 bits zero: ValueError
    naming the array otherwise), or None: named from the arrays' dtype ("fp16" for float16;
    anything else, which the contract declines, as "fp32", "fp64" or "mixed")."""
    if dtype is None:
        dtypes = {_dtype_name(x) for x in (q, k, v)}
        return dtypes.pop() if len(dtypes) == 1 else "mixed"
    if not isinstance(dtype, str):
        raise ValueError(f"dtype: expected None or one of {SUPPORTED_DTYPES}, got {dtype!r}")
    if dtype not in SUPPORTED_DTYPES:
        return dtype  # declined (decline_reason)
    want = np.float16 if dtype == "fp16" else np.float32
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype != want:
            raise ValueError(f"{name}: dtype {dtype} takes {np.dtype(want).name} arrays"
                             f"{' holding bf16 values' if dtype == 'bf16' else ''}, got {x.dtype}")
        if dtype == "bf16" and (x.view(np.uint32) & 0xFFFF).any():
            raise ValueError(f"{name}: expected bf16 values (float32 with the low 16 bits of every "
                             f"word zero)")
    return dtype


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """The bf16 bit patterns (uint16) of float32 ``x``: each word's top half."""
    return (x.view(np.uint32) >> 16).astype(np.uint16)


def attention(q, k, v, *, past_len, q_len=None, window=-1, sink=None, smooth_softmax=False,
              softcap=0.0, scale=None, out=None, config=None, backend=None, mutants=frozenset(),
              dtype=None):
    """The fused kernel on NumPy arrays: ``q (B,Sq,Hq,d)``, ``k, v (B,Hkv,S_cap,d)`` with
    ``S_cap >= past_len + Sq`` (a cache with spare capacity is fine; keys past
    ``past_len + Sq`` are never read), ``sink (Hq,)`` or None. ``dtype``: None or "fp16"
    (float16 arrays; None declines any other), or "bf16" (float32 arrays holding bf16
    values: every word's low 16 bits zero; they go to the device as the top 16 bits).
    Ragged (docs/semantics.md, Ragged batches): ``past_len`` an integer array (B,) and
    ``q_len`` an integer array (B,) of valid rows; padded rows come back as zeros. Returns
    ``(status, out)``: ``(0, out)`` with ``out (B,Sq,Hq,d)`` float16 (bf16: float32 holding
    the bf16 values), or ``(-1, out)`` when declined, ``out`` untouched (None if none was
    given). A given ``out`` (float16; bf16: float32) seeds the device output, so an element
    the kernel does not write keeps its value (bf16: its top 16 bits); without one the
    device output starts as NaN (every byte 0xFF). ``backend``: a backend object or name
    ("cuda", "hip"); default: the first that works. ``mutants`` is for the kill matrix only."""
    a = check_attention_args(q, k, v, past_len=past_len, q_len=q_len, window=window, sink=sink,
                             smooth_softmax=smooth_softmax, softcap=softcap, scale=scale,
                             allow_cache_capacity=True, allow_ragged=True)
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_buffer(name, x)
    dtype = _resolve_dtype(dtype, q, k, v)
    held = np.float32 if dtype == "bf16" else np.float16  # what out holds
    if out is not None:
        if not isinstance(out, np.ndarray) or out.shape != q.shape or out.dtype != held:
            raise ValueError(f"out: expected a {np.dtype(held).name} array of shape {q.shape}, got "
                             f"{getattr(out, 'dtype', type(out).__name__)} {getattr(out, 'shape', '')}")
        _check_buffer("out", out)
        if not out.flags.writeable:
            raise ValueError("out: expected a writeable array")
    _check_int32_sizes(Sq=a.Sq, Hq=a.Hq, S_cap=k.shape[2], past_len=a.skv, window=a.window)
    config = _check_config(config)
    if decline_reason(d=a.d, softcap=a.softcap, dtype=dtype) is not None:
        return -1, out

    from hipkernel.backends import get_backend  # GPU imports only once a launch is needed

    mutants = _check_mutants(mutants)
    sink16 = None
    if a.sink_mode == "per_head":
        finite = np.isfinite(a.sink)
        if (np.abs(a.sink[finite]) > np.finfo(np.float16).max).any():
            raise ValueError("sink: finite logits beyond the fp16 range (|sigma| <= 65504) would "
                             "become inf in the kernel's fp16 sink")
        sink16 = np.asarray(sink, dtype=np.float16)
    be = backend if backend is not None and not isinstance(backend, str) else get_backend(backend)
    _check_config_for(config, be.arch, a.d, a.G)
    S_cap = k.shape[2]
    if dtype == "bf16":
        q, k, v = (_bf16_bits(x) for x in (q, k, v))
    past = np.asarray(a.past_lens, np.int64) if a.ragged else a.past_len
    lens = np.asarray(a.q_lens, np.int64) if a.ragged else None
    bufs = {}
    try:
        for name, arr in (("q", q), ("k", k), ("v", v), ("sink", sink16)):
            if arr is not None:
                bufs[name] = be.alloc(arr.nbytes)
                be.htod(bufs[name], arr)
        nbytes = q.size * 2
        bufs["out"] = be.alloc(nbytes)
        if out is not None:  # the caller's bytes: an element the kernel misses keeps them
            be.htod(bufs["out"], out if dtype == "fp16" else _bf16_bits(out))
        else:
            be.memset(bufs["out"], 0xFF, nbytes)
        status = flash_prefill_v3(
            be, bufs["q"], bufs["k"], bufs["v"], bufs.get("sink", 0), bufs["out"],
            B=a.B, Sq=a.Sq, Hq=a.Hq, Hkv=a.Hkv, d=a.d, S_cap=S_cap, past_len=past, q_len=lens,
            window=a.window, sink_mode=a.sink_mode, scale=a.scale, softcap=a.softcap,
            dtype=dtype, config=config, mutants=mutants)
        if status != 0:
            return status, out
        if dtype == "fp16":
            result = out if out is not None else np.empty(q.shape, dtype=np.float16)
            be.dtoh(result, bufs["out"])
            return status, result
        bits = np.empty(q.shape, dtype=np.uint16)
        be.dtoh(bits, bufs["out"])
        result = out if out is not None else np.empty(q.shape, dtype=np.float32)
        result.view(np.uint32)[...] = bits.astype(np.uint32) << 16
        return status, result
    finally:
        for ptr in bufs.values():
            be.free(ptr)
