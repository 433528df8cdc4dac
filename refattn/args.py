"""Argument checking shared by every attention entry point.

The reference (`refattn.reference`), the oracle (`refattn.oracle`), the CPU model of the
fused kernel (`hipkernel.model`) and the kernel API (`hipkernel.api`) all take the same
arguments with the same meaning (DESIGN §1). They all validate them here, so a bad call is
rejected the same way everywhere, with a `ValueError` whose message starts with the name of
the offending argument and says what was expected. Nothing is computed before this passes.

Shapes:
    q: (B, Sq, Hq, d)            the current chunk's queries, absolute positions past_len + i
    k, v: (B, Hkv, Skv, d)        BNSH cache after the chunk was appended, Skv = past_len + Sq
    sink: (Hq,) or None           per-head sink logit (natural-log units, unscaled)
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

# Absurd-size guard: a single operand above this many elements is refused up front rather
# than failing half-way through an allocation (2**34 elements = 32 GiB of fp16).
MAX_ELEMENTS = 2**34


class EnvVarError(ValueError):
    """A ``$REFATTN_*`` (or ``$HIPKERNEL_AMD_MMA``) environment variable the harness cannot
    use; the message starts with its name. The ``refattn`` command line reports it in one
    line (exit 2)."""


@dataclass(frozen=True)
class Attn:
    """A validated attention call: geometry plus resolved options."""

    B: int
    Sq: int
    Hq: int
    Hkv: int
    d: int
    past_len: int
    skv: int  # past_len + Sq: keys that exist
    window: int  # -1 or W >= 1
    scale: float
    softcap: float
    sink: np.ndarray | None  # resolved per-head sink logits, float64 (Hq,), or None
    sink_mode: str  # "none" | "per_head" | "smooth"

    @property
    def G(self) -> int:
        """Query heads per KV head."""
        return self.Hq // self.Hkv


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_array(name: str, a, rank: int, form: str) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{name}: expected a numpy.ndarray {form}, got {type(a).__name__}")
    if a.ndim != rank:
        raise ValueError(f"{name}: expected rank {rank} {form}, got shape {a.shape}")
    if not np.issubdtype(a.dtype, np.floating):
        raise ValueError(f"{name}: expected a floating dtype (float16/32/64), got {a.dtype}")
    if any(n == 0 for n in a.shape):
        raise ValueError(f"{name}: expected non-empty dimensions {form}, got shape {a.shape}")
    if a.size > MAX_ELEMENTS:
        raise ValueError(f"{name}: {a.size} elements exceeds the limit of {MAX_ELEMENTS}")
    return a


def check_attention_args(
    q,
    k,
    v,
    *,
    past_len,
    window=-1,
    sink=None,
    smooth_softmax=False,
    softcap=0.0,
    scale=None,
    allow_cache_capacity: bool = False,
) -> Attn:
    """Validate an attention call and resolve its options.

    With ``allow_cache_capacity`` the cache may be longer than ``past_len + Sq`` (a KV cache
    with spare capacity, as a kernel sees it); keys at ``j >= past_len + Sq`` are never read.
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
    if not _is_int(past_len):
        raise ValueError(f"past_len: expected an int >= 0, got {past_len!r}")
    past_len = int(past_len)
    if past_len < 0:
        raise ValueError(f"past_len: expected an int >= 0, got {past_len}")
    skv = past_len + Sq
    if allow_cache_capacity:
        if S_cap < skv:
            raise ValueError(
                f"past_len: k.shape[2]={S_cap} holds fewer than past_len + Sq = {past_len} + {Sq} = {skv} keys"
            )
    elif S_cap != skv:
        raise ValueError(
            f"past_len: k.shape[2]={S_cap} must equal past_len + Sq = {past_len} + {Sq} = {skv}"
        )
    if not _is_int(window):
        raise ValueError(f"window: expected an int, -1 (none) or >= 1, got {window!r}")
    window = int(window)
    if window == 0 or window < -1:
        raise ValueError(f"window: expected -1 (no window) or W >= 1 keys, got {window}")
    if not isinstance(smooth_softmax, (bool, np.bool_)):
        raise ValueError(f"smooth_softmax: expected a bool, got {smooth_softmax!r}")
    if not isinstance(softcap, numbers.Real) or isinstance(softcap, bool):
        raise ValueError(f"softcap: expected a float >= 0, got {softcap!r}")
    softcap = float(softcap)
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap: expected a finite float >= 0 (0 = off), got {softcap}")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    elif not isinstance(scale, numbers.Real) or isinstance(scale, bool):
        raise ValueError(f"scale: expected a finite float > 0 or None, got {scale!r}")
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale: expected a finite float > 0 or None, got {scale}")

    if sink is not None:
        if not isinstance(sink, np.ndarray):
            raise ValueError(f"sink: expected a numpy.ndarray of shape ({Hq},) or None, got {type(sink).__name__}")
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
