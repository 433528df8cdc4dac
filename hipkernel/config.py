"""Compile-time configurations of the fused kernel and the launch geometry they imply.

One kernel binary per (HEAD_DIM, M_TILES, BKV) (docs/ARCHITECTURE.md, "Kernel ABI"):

    BM      = 16 * M_TILES     query rows per block (one Q tile of one head)
    threads = 32 * M_TILES     each query row is owned by a pair of adjacent lanes
    grid    = (ceil(Sq / BM), Hq, B)
    BKV                        keys per KV tile, staged in static shared memory

The CPU model (`hipkernel.model`) walks the same tiles, so a config changes its rounding
exactly as it changes the kernel's.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

HEAD_DIMS = (64, 128)  # head dims the kernel is compiled for; anything else is declined

# The kernel uses static shared memory only, which CUDA caps at 48 KiB without an opt-in.
SMEM_LIMIT = 48 * 1024

_M_TILES = (1, 2, 4, 8)  # 32..256 threads a block
_BKV = (16, 32, 64, 128)  # the kernel needs a power of two


def _check_int(name: str, x, allowed) -> int:
    if not isinstance(x, numbers.Integral) or isinstance(x, bool) or int(x) not in allowed:
        raise ValueError(f"{name}: expected one of {tuple(allowed)}, got {x!r}")
    return int(x)


@dataclass(frozen=True)
class KernelConfig:
    """A tile configuration: ``m_tiles`` groups of 16 query rows per block, ``bkv`` keys per
    KV tile."""

    m_tiles: int
    bkv: int

    def __post_init__(self):
        _check_int("m_tiles", self.m_tiles, _M_TILES)
        _check_int("bkv", self.bkv, _BKV)

    @property
    def block_rows(self) -> int:
        """BM: query rows per block."""
        return 16 * self.m_tiles

    @property
    def threads(self) -> int:
        """Threads per block: two lanes per query row."""
        return 32 * self.m_tiles

    @property
    def name(self) -> str:
        """Short id, e.g. ``m4_b64``."""
        return f"m{self.m_tiles}_b{self.bkv}"

    def grid(self, Sq: int, Hq: int, B: int) -> tuple[int, int, int]:
        """Launch grid ``(ceil(Sq / BM), Hq, B)``."""
        for name, n in (("Sq", Sq), ("Hq", Hq), ("B", B)):
            if not isinstance(n, numbers.Integral) or isinstance(n, bool) or n < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {n!r}")
        return (-(-int(Sq) // self.block_rows), int(Hq), int(B))

    def smem_bytes(self, d: int) -> int:
        """Static shared memory of the kernel at head dim ``d``: a K and a V tile
        (``bkv x d`` halves each) and the score/probability tile (``BM x bkv`` floats)."""
        return 2 * self.bkv * d * 2 + self.block_rows * self.bkv * 4

    def defines(self, d: int) -> dict[str, int]:
        """The ``-D`` macros that compile this config at head dim ``d``."""
        d = _check_int("d", d, HEAD_DIMS)
        if self.smem_bytes(d) > SMEM_LIMIT:
            raise ValueError(
                f"bkv: {self.bkv} keys at d={d} need {self.smem_bytes(d)} bytes of static shared "
                f"memory, over the {SMEM_LIMIT} byte limit"
            )
        return {"HEAD_DIM": d, "M_TILES": self.m_tiles, "BKV": self.bkv}


# The autotune candidates: configs that compile without register spills for every head dim
# in HEAD_DIMS (checked with `ptxas -v` at sm_90 and `-Rpass-analysis=kernel-resource-usage`
# at gfx1151/gfx942/gfx90a; see hipkernel/build.py).
CANDIDATES = tuple(KernelConfig(m, b) for m in (1, 2, 4) for b in (32, 64))

DEFAULT = KernelConfig(4, 64)
