"""Low-precision rounding: the 16-bit formats a kernel stores P and its output in.

The derived gate (docs/semantics.md, Tolerance model) compares a kernel with a baseline that
rounds P before P.V and the output through the kernel's 16-bit format: fp16 for fp16 and fp32
inputs, bf16 for bf16 inputs. NumPy has no bfloat16, so bf16 values are held in float32 (the
top half of the word; the low 16 bits zero).
"""

from __future__ import annotations

import numpy as np

LOWP = ("fp16", "bf16")
# Spacing of the format's numbers in [1, 2): one rounding step of an output near 1.
EPS = {"fp16": 2.0**-10, "bf16": 2.0**-7}


def check_lowp(lowp) -> str:
    if lowp not in LOWP:
        raise ValueError(f"lowp: expected one of {', '.join(map(repr, LOWP))}, got {lowp!r}")
    return lowp


def lowp_of(dtype: str) -> str:
    """The 16-bit format a kernel with ``dtype`` inputs rounds P and its output through."""
    return "bf16" if dtype == "bf16" else "fp16"


def round_bf16(x) -> np.ndarray:
    """Round to bfloat16 (nearest, ties to even) and return the values as float32.

    bf16 is the top half of an fp32 word: add 0x7FFF plus the lowest kept bit, then truncate
    the low 16 bits. NaN stays NaN; finite values beyond the bf16 range round to +-inf. A
    float64 input is first rounded to float32, as a kernel's fp32 value is.
    """
    x = np.asarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)
    return np.where(np.isnan(x), x, r)


def round_lowp(x, lowp: str) -> np.ndarray:
    """``x`` rounded through ``lowp`` ("fp16" or "bf16"), returned as float64."""
    if check_lowp(lowp) == "fp16":
        return np.asarray(x).astype(np.float16).astype(np.float64)
    return round_bf16(x).astype(np.float64)
