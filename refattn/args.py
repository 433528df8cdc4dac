"""Argument checking shared by every attention entry point.

The reference (`refattn.reference`), the oracle (`refattn.oracle`), the CPU model of the
fused kernel (`hipkernel.model`) and the kernel API (`hipkernel.api`) all take the same
arguments with the same meaning (docs/semantics.md, Semantics). They all validate them here, so a bad call is
rejected the same way everywhere, with a `ValueError` whose message starts with the name of
the offending argument and says what was expected. Nothing is computed before this passes.

Shapes:
    q: (B, Sq, Hq, d)            the current chunk's queries, absolute positions past_len + i
    k, v: (B, Hkv, Skv, d)        BNSH cache after the chunk was appended, Skv = past_len + Sq
    sink: (Hq,) or None           per-head sink logit (natural-log units, unscaled)

Ragged batches (docs/semantics.md, Ragged batches), for the entry points that pass
``allow_ragged=True``: ``past_len`` may be an integer array of shape (B,) and ``q_len`` an
integer array of shape (B,) (valid rows of each sequence, right-padded to Sq). Sequence b's
row i sits at past_len[b] + i and reads only its own first past_len[b] + q_len[b] keys; the
cache holds at least max_b(past_len[b] + q_len[b]) keys.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

# Absurd-size guard: a single operand above this many elements is refused up front rather
# than failing half-way through an allocation (2**34 elements = 32 GiB of fp16).
MAX_ELEMENTS = 2**34
# The window is an int32 everywhere it leaves Python: ONNX Runtime's ``local_window_size``
# attribute and the kernel ABI's ``window`` argument. Any W at least the sequence length is
# plain causal attention, so the bound loses nothing.
MAX_WINDOW = 2**31 - 1
# A per-sequence length (past_len[b], q_len[b]) is an int32 wherever it leaves Python: ORT's
# seqlens_k, FlashAttention's cache_seqlens / cu_seqlens, the kernel ABI's past_len.
MAX_LENGTH = 2**31 - 1
# The scale is multiplied into fp32 logits by every kernel and by the fp32 reference: it must
# be a finite, normal float32, or the logits are inf / 0 for reasons that are not the kernel's.
FP32_MAX = float(np.finfo(np.float32).max)
FP32_TINY = float(np.finfo(np.float32).tiny)


class EnvVarError(ValueError):
    """A ``$REFATTN_*`` (or ``$HIPKERNEL_AMD_MMA``) environment variable the harness cannot
    use; the message starts with its name. The ``refattn`` command line reports it in one
    line (exit 2)."""


def parse_count(name: str, value: str) -> int:
    """An environment variable's value as an int >= 1, else :class:`EnvVarError` naming it."""
    try:
        n = int(str(value).strip())
    except ValueError:
        n = 0
    if n < 1:
        raise EnvVarError(f"{name}: expected an int >= 1, got {value!r}")
    return n


def parse_megabytes(name: str, value: str) -> float:
    """An environment variable's value as a number of MB >= 0, else :class:`EnvVarError`."""
    try:
        mb = float(str(value).strip())
    except ValueError:
        mb = math.nan
    if not (math.isfinite(mb) and mb >= 0):
        raise EnvVarError(f"{name}: expected a number of MB >= 0 (0: keep nothing), got {value!r}")
    return mb


def _parse_directory(name: str, value: str) -> str:
    from pathlib import Path

    if not Path(value).is_dir():
        raise EnvVarError(f"{name}: expected a directory of case files, got {value!r}, "
                          f"which is not a directory")
    return value


# The environment variables the harness reads, each with the parser that validates it. A
# variable that is unset or empty takes its default where it is read.
ENVIRONMENT = {
    "REFATTN_THREADS": parse_count,
    "REFATTN_REF_CACHE_MB": parse_megabytes,
    "REFATTN_INPUT_CACHE_MB": parse_megabytes,
    "REFATTN_CASES_DIR": _parse_directory,
}


def check_environment(environ=None) -> None:
    """Validate every variable of :data:`ENVIRONMENT` that is set and not empty, once, before
    any work: the first bad one raises :class:`EnvVarError` naming it (the command line
    reports it in one line, exit 2, instead of failing every case with it)."""
    import os

    environ = os.environ if environ is None else environ
    for name, parse in ENVIRONMENT.items():
        value = environ.get(name, "")
        if value.strip():
            parse(name, value)


@dataclass(frozen=True)
class Attn:
    """A validated attention call: geometry plus resolved options."""

    B: int
    Sq: int
    Hq: int
    Hkv: int
    d: int
    past_len: int | None  # the batch's one past_len; None for a ragged call (see past_lens)
    skv: int  # past_len + Sq: keys that exist (ragged: the longest sequence's length)
    window: int  # -1 or W >= 1
    scale: float
    softcap: float
    sink: np.ndarray | None  # resolved per-head sink logits, float64 (Hq,), or None
    sink_mode: str  # "none" | "per_head" | "smooth"
    past_lens: tuple[int, ...]  # per sequence (B,): past_len repeated when it is an int
    q_lens: tuple[int, ...]  # valid query rows per sequence (B,): Sq each without q_len
    ragged: bool  # past_len was an array or q_len was given

    @property
    def G(self) -> int:
        """Query heads per KV head."""
        return self.Hq // self.Hkv

    @property
    def lengths(self) -> tuple[int, ...]:
        """Keys of each sequence, ``past_lens[b] + q_lens[b]``: the slots it may read."""
        return tuple(p + n for p, n in zip(self.past_lens, self.q_lens))


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_array(name: str, a, rank: int, form: str) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{name}: expected a numpy.ndarray {form}, got {type(a).__name__}")
    if type(a) is not np.ndarray:  # a masked array or a matrix: numpy's kernels ignore the mask
        raise ValueError(f"{name}: expected a plain numpy.ndarray {form}, got the subclass "
                         f"{type(a).__module__}.{type(a).__name__}")
    if a.ndim != rank:
        raise ValueError(f"{name}: expected rank {rank} {form}, got shape {a.shape}")
    if not np.issubdtype(a.dtype, np.floating):
        raise ValueError(f"{name}: expected a floating dtype (float16/32/64), got {a.dtype}")
    if any(n == 0 for n in a.shape):
        raise ValueError(f"{name}: expected non-empty dimensions {form}, got shape {a.shape}")
    if a.size > MAX_ELEMENTS:
        raise ValueError(f"{name}: {a.size} elements exceeds the limit of {MAX_ELEMENTS}")
    return a


def check_lengths(name: str, x, B: int) -> np.ndarray:
    """A per-sequence length argument: a plain numpy.ndarray of an integer dtype and shape
    ``(B,)``, every entry >= 0, returned as int64; else ValueError naming ``name``."""
    form = f"an int or an integer numpy.ndarray of shape (B,) = ({B},)"
    if name != "past_len":
        form = f"an integer numpy.ndarray of shape (B,) = ({B},)"
    if not isinstance(x, np.ndarray) or type(x) is not np.ndarray:
        raise ValueError(f"{name}: expected {form}, got {type(x).__name__}")
    if x.dtype == np.bool_ or not np.issubdtype(x.dtype, np.integer):
        raise ValueError(f"{name}: expected an integer dtype, got {x.dtype}")
    if x.shape != (B,):
        raise ValueError(f"{name}: expected shape (B,) = ({B},) (one entry per sequence), "
                         f"got {x.shape}")
    if B == 0:
        raise ValueError(f"{name}: expected at least one sequence, got shape {x.shape}")
    if (x < 0).any():
        b = int(np.flatnonzero(x < 0)[0])
        raise ValueError(f"{name}: expected entries >= 0, got {int(x[b])} for sequence {b}")
    if int(x.max()) > MAX_LENGTH:
        b = int(np.argmax(x))
        raise ValueError(f"{name}: expected entries of at most {MAX_LENGTH} (an int32, as every "
                         f"kernel and ONNX Runtime carry it), got {int(x[b])} for sequence {b}")
    return x.astype(np.int64)


def _check_ragged(past_len, q_len, B: int, Sq: int, S_cap: int):
    """Per-sequence ``past_len`` / ``q_len`` of a ragged call, as tuples of ints."""
    if _is_int(past_len):
        if int(past_len) < 0:
            raise ValueError(f"past_len: expected an int >= 0, got {int(past_len)}")
        pasts = [int(past_len)] * B
    else:
        pasts = check_lengths("past_len", past_len, B).tolist()
    if q_len is None:
        qs = [Sq] * B
    else:
        qs = check_lengths("q_len", q_len, B).tolist()
        over = [b for b in range(B) if qs[b] > Sq]
        if over:
            raise ValueError(f"q_len: expected entries <= Sq = {Sq} (q holds Sq rows), got "
                             f"{qs[over[0]]} for sequence {over[0]}")
    for b in range(B):
        if pasts[b] + qs[b] > S_cap:
            raise ValueError(
                f"past_len: k.shape[2]={S_cap} holds fewer than past_len[b] + q_len[b] = "
                f"{pasts[b]} + {qs[b]} = {pasts[b] + qs[b]} keys for sequence b = {b}")
    return tuple(pasts), tuple(qs)


def check_attention_args(
    q,
    k,
    v,
    *,
    past_len,
    q_len=None,
    window=-1,
    sink=None,
    smooth_softmax=False,
    softcap=0.0,
    scale=None,
    allow_cache_capacity: bool = False,
    allow_ragged: bool = False,
) -> Attn:
    """Validate an attention call and resolve its options.

    With ``allow_cache_capacity`` the cache may be longer than ``past_len + Sq`` (a KV cache
    with spare capacity, as a kernel sees it); keys at ``j >= past_len + Sq`` are never read.

    With ``allow_ragged`` (an entry point that computes per-sequence geometry), ``past_len``
    may be an integer array of shape (B,) and ``q_len`` an integer array of shape (B,),
    ``0 <= q_len[b] <= Sq``. Such a ragged call always allows cache capacity: the cache needs
    ``k.shape[2] >= past_len[b] + q_len[b]`` for every b, and sequence b never reads a slot
    at or past its own length, so ``allow_cache_capacity`` changes nothing for it. Without
    ``allow_ragged`` an array ``past_len`` or a ``q_len`` is refused, naming the argument, so
    that an entry point that only knows one past_len never computes a ragged call wrongly.
    A scalar ``past_len`` without ``q_len`` is the uniform call, checked as before.
    """
    q = _check_array("q", q, 4, "(B, Sq, Hq, d)")
    k = _check_array("k", k, 4, "(B, Hkv, past_len + Sq, d)")
    v = _check_array("v", v, 4, "(B, Hkv, past_len + Sq, d)")
    B, Sq, Hq, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"v: expected the same shape as k {k.shape}, got {v.shape}")
    Bk, Hkv, S_cap, dk = k.shape
    if Bk != B:
        raise ValueError(f"k: batch k.shape[0]={Bk} does not match q.shape[0]={B}")
    if dk != d:
        raise ValueError(f"k: head dim k.shape[3]={dk} does not match q.shape[3]={d}")
    if Hq % Hkv != 0:
        raise ValueError(f"k: Hq={Hq} query heads is not a multiple of Hkv={Hkv} KV heads")
    ragged = q_len is not None or isinstance(past_len, np.ndarray)
    if ragged and not allow_ragged:
        if q_len is not None:
            raise ValueError(f"q_len: this entry point takes no per-sequence q_len (every row "
                             f"of q is valid), got {type(q_len).__name__}")
        raise ValueError(f"past_len: expected an int >= 0 (this entry point takes one past_len "
                         f"for the whole batch), got an array of shape {past_len.shape}")
    if ragged:
        past_lens, q_lens = _check_ragged(past_len, q_len, B, Sq, S_cap)
        past_len, skv = None, max(p + n for p, n in zip(past_lens, q_lens))
    elif not _is_int(past_len):
        raise ValueError(f"past_len: expected an int >= 0, got {past_len!r}")
    else:
        past_len = int(past_len)
        if past_len < 0:
            raise ValueError(f"past_len: expected an int >= 0, got {past_len}")
        skv = past_len + Sq
        past_lens, q_lens = (past_len,) * B, (Sq,) * B
        if allow_cache_capacity:
            if S_cap < skv:
                raise ValueError(f"past_len: k.shape[2]={S_cap} holds fewer than past_len + Sq = "
                                 f"{past_len} + {Sq} = {skv} keys")
        elif S_cap != skv:
            raise ValueError(f"past_len: k.shape[2]={S_cap} must equal past_len + Sq = "
                             f"{past_len} + {Sq} = {skv}")
    if not _is_int(window):
        raise ValueError(f"window: expected an int, -1 (none) or >= 1, got {window!r}")
    window = int(window)
    if window == 0 or window < -1:
        raise ValueError(f"window: expected -1 (no window) or W >= 1 keys, got {window}")
    if window > MAX_WINDOW:
        raise ValueError(f"window: expected at most {MAX_WINDOW} keys (an int32, as in ORT's "
                         f"local_window_size; a window >= the sequence is causal), got {window}")
    if not isinstance(smooth_softmax, (bool, np.bool_)):
        raise ValueError(f"smooth_softmax: expected a bool, got {smooth_softmax!r}")
    if not isinstance(softcap, numbers.Real) or isinstance(softcap, bool):
        raise ValueError(f"softcap: expected a float >= 0, got {softcap!r}")
    try:
        softcap = float(softcap)
    except OverflowError:
        raise ValueError(f"softcap: expected a finite float >= 0 (0 = off), got an int of "
                         f"{len(str(abs(softcap)))} digits, beyond the float range") from None
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap: expected a finite float >= 0 (0 = off), got {softcap}")
    if softcap > FP32_MAX:
        raise ValueError(f"softcap: {softcap} is beyond the float32 range the logits are computed in")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    elif not isinstance(scale, numbers.Real) or isinstance(scale, bool):
        raise ValueError(f"scale: expected a finite float > 0 or None, got {scale!r}")
    try:
        scale = float(scale)
    except OverflowError:  # an int beyond the float range
        raise ValueError(f"scale: expected a finite float > 0 or None, got an int of "
                         f"{len(str(abs(scale)))} digits, beyond the float range") from None
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale: expected a finite float > 0 or None, got {scale}")
    if not FP32_TINY <= scale <= FP32_MAX:
        raise ValueError(f"scale: {scale} is outside the normal float32 range "
                         f"[{FP32_TINY:.3g}, {FP32_MAX:.3g}] the logits are computed in")

    if sink is not None:
        if not isinstance(sink, np.ndarray):
            raise ValueError(f"sink: expected a numpy.ndarray of shape ({Hq},) or None, got {type(sink).__name__}")
        if type(sink) is not np.ndarray:
            raise ValueError(f"sink: expected a plain numpy.ndarray of shape ({Hq},) or None, got the "
                             f"subclass {type(sink).__module__}.{type(sink).__name__}")
        if sink.shape != (Hq,):
            raise ValueError(f"sink: expected shape ({Hq},) (one logit per query head), got {sink.shape}")
        if not np.issubdtype(sink.dtype, np.floating):
            raise ValueError(f"sink: expected a floating dtype, got {sink.dtype}")
        s64 = sink.astype(np.float64)
        bad = np.isnan(s64) | (s64 == np.inf)
        if bad.any():
            raise ValueError(
                f"sink: expected finite logits or -inf (no sink for that head), got {s64[bad][0]} at head {int(np.flatnonzero(bad)[0])}"
            )
        resolved, mode = s64, "per_head"
    elif smooth_softmax:
        resolved, mode = np.zeros(Hq, dtype=np.float64), "smooth"
    else:
        resolved, mode = None, "none"

    return Attn(
        B=B, Sq=Sq, Hq=Hq, Hkv=Hkv, d=d, past_len=past_len, skv=skv, window=window,
        scale=scale, softcap=softcap, sink=resolved, sink_mode=mode,
        past_lens=past_lens, q_lens=q_lens, ragged=ragged,
    )


def check_dtype(dtype) -> np.dtype:
    """Validate a compute dtype argument: float32 or float64."""
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"dtype: expected numpy.float32 or numpy.float64, got {dtype!r}") from e
    if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise ValueError(f"dtype: expected numpy.float32 or numpy.float64, got {dt}")
    return dt
