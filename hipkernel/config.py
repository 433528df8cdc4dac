"""Compile-time configurations of the fused kernel and the launch geometry they imply.

One kernel binary per (path, HEAD_DIM, M_TILES, BKV, WARP_M, WS, PACK, QWALK) and dtype (fp16,
or bf16: HK_BF16) (docs/ARCHITECTURE.md, "Kernel ABI"; the wgmma path also takes KV_STAGES,
which follows from the others):

    path    = "scalar"         kernels/gqa_flash_prefill.hip: fp32 FMAs, every GPU (AMD, NVIDIA)
              "mma"            kernels/gqa_flash_prefill_mma.hip: tensor cores (mma.sync
                               m16n8k16), NVIDIA sm_80 and newer only
              "wgmma"          kernels/gqa_flash_prefill_wgmma.hip: Hopper warpgroup MMA
                               (wgmma.mma_async), NVIDIA sm_90 devices only (compiled for
                               sm_90a); a warpgroup of 4 warps per 64 rows, so m_tiles is
                               4, 8 or 16
              "wmma", "mfma"   kernels/gqa_flash_prefill_amdmma.hip: AMD matrix cores, a wave
                               per 16 rows: WMMA on gfx11 (wave32), MFMA on gfx90a / gfx94x
                               (wave64). On NVIDIA the same source runs with the instruction
                               emulated (amd_mma.h), to check it; the tuner offers these
                               configs on AMD only, and only when ``$HIPKERNEL_AMD_MMA`` is 1
                               (not yet run on AMD hardware)
    BM      = 16 * M_TILES     query rows per block (one Q tile of one head)
    threads = 32 * M_TILES     scalar: each query row is owned by a pair of adjacent lanes;
              / WARP_M         mma: each warp owns 16 * WARP_M rows (WARP_M = 1 or 2; with 2
                               every K/V fragment read from shared memory feeds two MMAs);
                               wgmma: each warp 16 rows, each warpgroup 64; with ws
                               (wgmma, m_tiles 8) 128 more: a producer warpgroup that
                               only streams the K/V tiles in;
                               wmma: a wave32 per 16 rows; mfma: a wave64 per 16
                               rows (threads = 64 * M_TILES)
    grid    = (ceil(Sq / BP / QWALK), Hq / PACK, B), BP = BM / PACK query positions a Q
                               tile: with PACK > 1 (mma only) a Q tile's BM rows are BP
                               positions of PACK query heads that share a KV head (GQA
                               packing; needs G % PACK == 0, see ``KernelConfig.supports``);
                               with QWALK > 1 (mma only) a block takes QWALK consecutive Q
                               tiles in turn, and under a window keeps the K/V tiles they
                               share in a ring (``KernelConfig.ring_serves``)
    BKV                        keys per KV tile, staged in shared memory: static on the
                               scalar and mma paths (48 KiB at most), dynamic on the wgmma
                               path (KV_STAGES tiles, WGMMA_SMEM_BUDGET at most)

All paths share the ABI and the launch geometry; only the source file differs.

The CPU model (`hipkernel.model`) walks the same tiles, so a config changes its rounding
exactly as it changes the kernel's.
"""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass, replace

HEAD_DIMS = (64, 128)  # head dims the kernel is compiled for; anything else is declined
# The 16-bit formats of q, k, v and out a kernel is compiled for (``KernelConfig.defines``):
# fp16, and bf16 with -DHK_BF16=1 (kernels/portable.h). Both take 2 bytes an element, so the
# shared memory of a config is the same in each.
DTYPES = ("fp16", "bf16")

# The scalar and mma kernels use static shared memory only, which CUDA caps at 48 KiB.
SMEM_LIMIT = 48 * 1024

_M_TILES = (1, 2, 4, 8)  # 32..256 threads a block
_BKV = (16, 32, 64, 128)  # the kernel needs a power of two
_WARP_M = (1, 2)  # 16-row groups per warp (mma path)
_PACK = (1, 2, 4, 8)  # query heads a block packs (mma path): a divisor of a fragment's 8 rows
_WALK = (1, 2, 4, 8)  # Q tiles a block walks (mma path)
PATHS = ("scalar", "mma", "wgmma", "wgspan", "wmma", "mfma")
# P is rounded to fp16 before P.V (hipkernel.model)
TENSOR_CORE_PATHS = ("mma", "wgmma", "wgspan", "wmma", "mfma")
# The paths that compile to sm_90a only (wgmma.mma_async)
WGMMA_PATHS = ("wgmma", "wgspan")
# The AMD matrix-core paths and their wave sizes (the instruction each compiles to, amd_mma.h).
AMD_MMA_WAVE = {"wmma": 32, "mfma": 64}
# 16 to 64 rows a block (the NVIDIA emulation adds a scratch a wave; at 4 waves and d 128 the
# static shared memory is 46,336 bytes, under the 48 KiB limit)
AMD_MMA_M_TILES = (1, 2, 4)
AMD_MMA_BKV = (16, 32, 64)
# The AMD matrix-core configs are offered to the tuner on AMD targets only when this variable
# is 1: their kernel has run only through the emulation on NVIDIA so far.
AMD_MMA_ENV = "HIPKERNEL_AMD_MMA"
MMA_MIN_SM = 80  # mma.sync m16n8k16 f16 with fp32 accumulators, ldmatrix, cp.async
WGMMA_SM = 90  # wgmma.mma_async: sm_90a code, which runs on compute capability 9.0 only
WGMMA_TARGET = "sm_90a"
_WGMMA_M_TILES = (4, 8, 12, 16)  # one to four warpgroups of 64 rows (three: with ws only)
_WGMMA_BKV = (32, 64, 128)  # the n of the Q.K wgmma
# wgspan: keys a chunk, one wgmma of n bkv - 8 and one of n 8 (a window of 128 keys and 8
# positions span 135 keys: one chunk of 136)
_WGSPAN_BKV = (72, 136)
# Its chunk buffers: one. Under a window whose span fits a chunk a block stages one round for
# all its steps; otherwise (not what the tuner picks it for) each step streams its rounds
# through the one buffer, loading and computing in turn.
WGSPAN_MAX_STAGES = 1
# wgspan at d = 64: the epilogue stages a warp's 16 output rows (128 bytes each) in shared
# memory after the round buffers and stores them 16 bytes a lane (kernel STAGED_EPI).
WGSPAN_EPI_BYTES_PER_WARP = 16 * 64 * 2
# The wgmma kernel's K/V stages live in dynamic shared memory, which the launch opts in to
# above 48 KiB (Hopper allows 227 KiB a block): as many stages as fit in the budget, at most
# WGMMA_MAX_STAGES. On the H200 (d = 64, wgmma_m16_b64, 16384@0) 6 stages (96 KiB) ran
# 7.05 ms, 4 stages 7.41 and 8 stages 7.20.
WGMMA_SMEM_BUDGET = 96 * 1024
WGMMA_MAX_STAGES = 6
# With four warpgroups (m_tiles 16) the kernel's stages run on mbarriers (16 bytes a stage,
# after them in the dynamic buffer; reserved for every wgmma tile), which refill a stage
# other than the one computed: 2 stages at least.
WGMMA_MBAR_M_TILES = 16
WGMMA_MBAR_MIN_STAGES = 2
# ws: a producer warpgroup loads the stages (on mbarriers too) and gives its registers to the
# two consumer warpgroups (setmaxnreg: 216 a consumer thread). One block an SM, so the stages
# may take most of the 227 KiB: at d = 128, 3 stages of 128-key tiles are 192 KiB.
WGMMA_WS_M_TILES = (8, 12)
WGMMA_WS_SMEM_BUDGET = 192 * 1024
# Three consumer warpgroups (m_tiles 12, ws) read Q from shared memory (``qsmem``; the
# kernel's QSMEM): at 160 registers a consumer thread Q in registers spilled. Its 64 x d
# halves a warpgroup come out of the stages' budget.
WGMMA_QSMEM_M_TILES = (12,)
# Lazy rescaling on the wgmma path at d = 64: a warp's rows keep their running max (and acc,
# l stay relative to it) until one row's grows by more than 2^WGMMA_RESCALE_LOG2, so most
# tiles skip the acc *= alpha of the online softmax (hipkernel.model mirrors it). On the
# H200 (wgmma_m16_b64) 16384@0 ran 3.6 % faster (6.319 against 6.552 ms), 512@8192 4 %.
# At d = 128 it did not pay on the ws tile before the intra-warpgroup overlap (6.346
# against 6.311); with it, where every tile's 64 acc *= alpha a thread wait for the owed
# P.V, it does: on an H100 (hipkernel.ab, wgmma_m8_b128_ws, four passes) 16384@0 3.666-3.692
# ms against 3.724-3.753, 512@8192 0.1148-0.1185 against 0.1168-0.1233.
WGMMA_RESCALE_LOG2 = 8
WGMMA_RESCALE_HEAD_DIMS = (64, 128)
# The producer tiles at these head dims decide a lazy rescale by each half of a warp's 16 rows
# (``rescale_rows``; the kernel's RESCALE_ROWS): a row's exp2 then waits only for its own
# half's vote, not for the other eight rows' max. On an H100 (hipkernel.ab, wgmma_m8_b128_ws,
# three runs of three passes, bit-identical on the bench inputs) d128 16384@0 0.4-1.5 %
# faster, 512@8192 0.1-1.2 %; on the three-consumer d 64 tile it was 0.3-0.9 % slower.
WGMMA_RESCALE_ROWS_HEAD_DIMS = (128,)
# Row sums on the tensor cores on the wgmma path at d = 64 (``rowsum_mma``; the kernel's
# ROWSUM_MMA): l += P . 1, one m64n8k16 wgmma a 16-key step beside P.V's, against a 2 KiB
# block of fp16 ones after the K/V stages (before their mbarriers): l then sums the fp16 P
# that P.V multiplies (hipkernel.model follows), and the softmax loses its FADD a score. On
# the H200 (wgmma_m16_b64, same process and inputs, three runs) 16384@0
# ran 1.0-1.5 % faster (4.93-4.97 against 5.00-5.05 ms), 512@8192 0.5-1.3 %, 4096@8192
# 1.6-2.3 %; at d = 128 (the ws tile, whose consumers then spilled 8 bytes) 3.5 % slower.
WGMMA_ROWSUM_HEAD_DIMS = (64,)
# The three consumer warpgroups wait for the owed P.V after the exp2 of the score tile's first
# 8-key block (``pv_wait_split``; the kernel's PV_WAIT_SPLIT, measured in its header; its SASS
# has 6 MUFU.EX2 before the wait, and 9 of its 32 F2FP among the exp2, against 16 with the
# wait after half the blocks); the other tiles after all of it.
WGMMA_PV_WAIT_EARLY_M_TILES = (12,)
WGMMA_ONES_BYTES = 2048


def _check_int(name: str, x, allowed) -> int:
    if not isinstance(x, numbers.Integral) or isinstance(x, bool) or int(x) not in allowed:
        raise ValueError(f"{name}: expected one of {tuple(allowed)}, got {x!r}")
    return int(x)


@dataclass(frozen=True)
class KernelConfig:
    """A tile configuration: ``m_tiles`` groups of 16 query rows per block, ``bkv`` keys per
    KV tile, the kernel ``path`` ("scalar", "mma" or "wgmma") that runs it, and (mma only)
    ``warp_m`` groups of 16 rows per warp, ``pack`` query heads a Q tile (GQA packing) and
    ``walk`` Q tiles a block, and (wgmma only) ``ws``, a producer warpgroup that streams the
    K/V tiles in. ``warp_m``, ``pack``, ``walk`` and ``ws`` change only which warp computes a
    row or loads a tile, not the
    arithmetic: the model (and so every result) depends on ``bkv`` and ``path``, and on the
    wgmma path at d = 64 on lazy rescaling (``rescale_log2``). (``pack`` and ``m_tiles`` set
    which KV tile a block starts at, ``block_positions``; the tiles before a row's first
    visible key change nothing, exactly, so only the mutants that move that start can tell.)"""

    m_tiles: int
    bkv: int
    path: str = "scalar"
    warp_m: int = 1
    ws: bool = False
    pack: int = 1
    walk: int = 1

    def __post_init__(self):
        # 16 groups (512 threads) only on the wgmma path: a warpgroup per 64 rows
        _check_int("m_tiles", self.m_tiles,
                   _M_TILES + (12, 16) if self.path in WGMMA_PATHS else AMD_MMA_M_TILES if self.path in AMD_MMA_WAVE else _M_TILES)
        _check_int("bkv", self.bkv, _WGSPAN_BKV if self.path == "wgspan" else _BKV)
        if self.path not in PATHS:
            raise ValueError(f"path: expected one of {PATHS}, got {self.path!r}")
        _check_int("warp_m", self.warp_m, _WARP_M)
        if self.warp_m != 1 and self.path != "mma":
            raise ValueError(f"warp_m: {self.warp_m} row groups a warp needs path 'mma' (the "
                             f"scalar path gives each row a lane pair), got path {self.path!r}")
        if self.m_tiles % self.warp_m:
            raise ValueError(f"warp_m: {self.warp_m} does not divide m_tiles={self.m_tiles}")
        _check_int("pack", self.pack, _PACK)
        if self.pack != 1 and self.path not in ("mma", "wgspan"):
            raise ValueError(f"pack: {self.pack} heads a block needs path 'mma' or 'wgspan', "
                             f"got path {self.path!r}")
        _check_int("walk", self.walk, _WALK)
        if self.walk != 1 and self.path not in ("mma", "wgspan"):
            raise ValueError(f"walk: {self.walk} Q tiles a block needs path 'mma' or 'wgspan', "
                             f"got path {self.path!r}")
        if not isinstance(self.ws, bool):
            raise ValueError(f"ws: expected True or False, got {self.ws!r}")
        if self.ws and (self.path != "wgmma" or self.m_tiles not in WGMMA_WS_M_TILES):
            raise ValueError(f"ws: a producer warpgroup needs path 'wgmma' and m_tiles in "
                             f"{WGMMA_WS_M_TILES}, got path {self.path!r}, m_tiles {self.m_tiles}")
        if self.m_tiles == 12 and not self.ws:
            raise ValueError(f"m_tiles: 12 (three warpgroups) needs a producer warpgroup (ws), "
                             f"got path {self.path!r} without ws")
        if self.path in WGMMA_PATHS:
            if self.m_tiles not in _WGMMA_M_TILES:
                raise ValueError(f"m_tiles: path {self.path!r} computes 64 rows a warpgroup and "
                                 f"needs m_tiles in {_WGMMA_M_TILES}, got {self.m_tiles}")
        if self.path == "wgmma":
            if self.bkv not in _WGMMA_BKV:
                raise ValueError(f"bkv: path 'wgmma' needs bkv in {_WGMMA_BKV}, got {self.bkv}")
        if self.path in AMD_MMA_WAVE and self.bkv not in AMD_MMA_BKV:
            raise ValueError(f"bkv: path {self.path!r} needs bkv in {AMD_MMA_BKV}, got {self.bkv}")

    @property
    def tma(self) -> bool:
        """Whether the kernel copies its K/V tiles with TMA, and so takes the two tensor maps
        of ``hipkernel.api.kv_tensor_maps`` after ``q_lens``: the wgmma tile with a producer
        warpgroup (``ws``, which only the wgmma path has; the kernel's TMA). Its maps bound
        every sequence's keys by one row count, so it runs uniform batches only (a ragged
        call refuses it, and the tuner does not offer it there)."""
        return self.ws

    @property
    def qsmem(self) -> bool:
        """Whether the wgmma kernel reads Q from shared memory (the kernel's QSMEM): the
        three consumer warpgroups with a producer (``WGMMA_QSMEM_M_TILES``)."""
        return self.path == "wgmma" and self.ws and self.m_tiles in WGMMA_QSMEM_M_TILES

    def _q_smem_bytes(self, d: int) -> int:
        # QSMEM: a 64-row Q tile of d halves a warpgroup
        return self.m_tiles // 4 * 64 * d * 2 if self.qsmem else 0

    @property
    def block_rows(self) -> int:
        """BM: query rows per block."""
        return 16 * self.m_tiles

    @property
    def block_positions(self) -> int:
        """BP: query positions per block (``block_rows / pack``: each of ``pack`` heads)."""
        return self.block_rows // self.pack

    def spans_window(self, window: int) -> bool:
        """wgspan: whether a ``window`` (W >= 1 keys) spans one chunk of a warpgroup: its 64 /
        pack positions see W + 64 / pack - 1 keys, at most ``bkv`` (the case it is built for;
        it runs any window, and no window, correctly, but then walks several chunks a step
        through one buffer). False on the other paths and without a window."""
        return self.path == "wgspan" and window >= 1 and window + 64 // self.pack - 1 <= self.bkv

    def supports(self, G: int) -> bool:
        """Whether this config runs a geometry of ``G`` query heads a KV head: a block's
        ``pack`` heads must share one KV head."""
        return G % self.pack == 0

    def for_group(self, G: int) -> "KernelConfig":
        """This config for ``G`` query heads a KV head: ``pack`` cut to gcd(pack, G), the
        most of its packing that G allows (itself when it ``supports`` G); on the wgspan
        path ``walk`` cut by the same factor (at least 1), so that a block keeps its
        positions, and its staged keys fit as they did."""
        if self.supports(G):
            return self
        pack = math.gcd(self.pack, G)
        walk = max(1, self.walk * pack // self.pack) if self.path == "wgspan" else self.walk
        return replace(self, pack=pack, walk=walk)

    @property
    def wave(self) -> int:
        """Lanes of the unit that owns 16 rows: 64 on the mfma path, else 32 (a warp, or a
        wave32 on the wmma path)."""
        return AMD_MMA_WAVE.get(self.path, 32)

    @property
    def threads(self) -> int:
        """Threads per block: scalar, two lanes per query row; mma, a warp per 16 * warp_m rows;
        wgmma, a warp per 16 rows and, with ws, the producer warpgroup; wmma / mfma, a wave
        per 16 rows."""
        return self.wave * self.m_tiles // self.warp_m + (128 if self.ws else 0)

    @property
    def name(self) -> str:
        """Short id, e.g. ``m4_b64`` (scalar), ``mma_m4_b64``, ``mma_m8_b64_w2`` (warp_m 2),
        ``mma_m4_b32_p8`` (8 heads a block), ``mma_m4_b32_p4_q4`` (4 Q tiles a block),
        ``wgmma_m8_b64_ws`` (a producer warpgroup)."""
        base = f"m{self.m_tiles}_b{self.bkv}"
        if self.path != "scalar":
            base = f"{self.path}_{base}"
        if self.warp_m != 1:
            base = f"{base}_w{self.warp_m}"
        if self.pack != 1:
            base = f"{base}_p{self.pack}"
        if self.walk != 1:
            base = f"{base}_q{self.walk}"
        return f"{base}_ws" if self.ws else base

    def grid(self, Sq: int, Hq: int, B: int) -> tuple[int, int, int]:
        """Launch grid ``(ceil(ceil(Sq / BP) / walk), Hq / pack, B)``."""
        for name, n in (("Sq", Sq), ("Hq", Hq), ("B", B)):
            if not isinstance(n, numbers.Integral) or isinstance(n, bool) or n < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {n!r}")
        if Hq % self.pack:
            raise ValueError(f"Hq: {Hq} query heads do not split into blocks of pack="
                             f"{self.pack} heads ({self.name})")
        q_tiles = -(-int(Sq) // self.block_positions)
        return (-(-q_tiles // self.walk), int(Hq) // self.pack, int(B))

    def kv_slots(self, d: int) -> int:
        """K/V tile buffers the kernel declares at head dim ``d``: ``kv_stages``, or with
        ``walk`` > 1 on the mma path the ring, as many K + V tiles as static shared memory
        holds, when that is more."""
        if self.walk > 1 and self.path == "mma":
            return max(self.kv_stages(d), SMEM_LIMIT // self._kv_tile_bytes(d))
        return self.kv_stages(d)

    def ring_serves(self, d: int, window: int, past_len: int) -> bool:
        """Whether the walking kernel keeps its K/V tiles in the ring for a launch (the
        kernel's own test, mirrored): ``walk`` > 1 with a ring of more slots than stages, a
        window (``window`` >= 1), and every Q tile's KV tiles, from its first key p - W + 1
        to its last p + BP - 1, within ``kv_slots`` tiles. The Q tiles start at positions
        past_len + BP qt, so their first keys' offsets in a tile take BKV / BP values at
        most; the bound is checked for each. Otherwise each Q tile streams its KV tiles
        double-buffered, with the same result."""
        slots = self.kv_slots(d)
        if self.walk == 1 or slots <= self.kv_stages(d) or window < 1:
            return False
        bp, bkv = self.block_positions, self.bkv
        spans = ((((past_len + r * bp - window + 1) % bkv) + bp + window - 1 + bkv - 1) // bkv
                 for r in range(max(1, bkv // bp)))
        return max(spans) <= slots

    def kv_stages(self, d: int) -> int:
        """K/V tile buffers of the kernel: the mma path double-buffers (cp.async) when two
        stages fit in static shared memory; the wgmma path keeps as many as fit in
        WGMMA_SMEM_BUDGET (WGMMA_WS_SMEM_BUDGET with ws, less the Q tiles of ``qsmem``), up to
        WGMMA_MAX_STAGES; the scalar,
        wmma and mfma paths have one."""
        if self.path == "scalar" or self.path in AMD_MMA_WAVE:
            return 1
        if self.path in WGMMA_PATHS:
            most = WGSPAN_MAX_STAGES if self.path == "wgspan" else WGMMA_MAX_STAGES
            return max(1, min(most, (self._smem_limit - self._q_smem_bytes(d)) // self._kv_tile_bytes(d)))
        return 2 if 2 * self._kv_tile_bytes(d) <= SMEM_LIMIT else 1

    @property
    def span_rows(self) -> int:
        """wgspan: the key rows a round stages, (warpgroups x walk - 1) x (64 / pack) + P.V's
        keys (``bkv`` rounded up to 16): the chunk of every warpgroup of every step, each
        starting up to its first position's offset in the block further (the kernel's CH)."""
        return (self.m_tiles // 4 * self.walk - 1) * (64 // self.pack) + 16 * -(-self.bkv // 16)

    def _kv_tile_bytes(self, d: int) -> int:
        # a K and a V tile of bkv rows (wgspan: span_rows): the mma path pads each row by 8
        # halves (16 bytes, against ldmatrix bank conflicts); the wgmma swizzle needs none
        rows = self.span_rows if self.path == "wgspan" else self.bkv
        return 2 * rows * (d + (8 if self.path == "mma" else 0)) * 2

    def smem_bytes(self, d: int) -> int:
        """Shared memory of the kernel at head dim ``d`` (static on the scalar and mma paths,
        dynamic on the wgmma path). Scalar: a K and a V tile (``bkv x d`` halves each) and
        the score/probability tile (``BM x bkv`` floats). mma: ``kv_stages`` x (K and V
        tile, ``bkv x (d + 8)`` halves each; ``kv_slots`` of them with ``walk``); wgmma: the
        same with ``bkv x d`` halves each; wmma / mfma: the K tile (``bkv x (d + 8)``
        halves) and the V tile transposed (``d x (bkv + 8)``)."""
        if self.path in AMD_MMA_WAVE:
            return 2 * (self.bkv * (d + 8) + d * (self.bkv + 8))
        if self.path in TENSOR_CORE_PATHS:
            return self.kv_slots(d) * self._kv_tile_bytes(d)
        return 2 * self.bkv * d * 2 + self.block_rows * self.bkv * 4

    def dynamic_smem_bytes(self, d: int, stages: int | None = None) -> int:
        """The dynamic shared memory a launch at head dim ``d`` passes: the wgmma path's
        K/V stages, with ``rowsum_mma`` the 2 KiB of ones (``WGMMA_ONES_BYTES``), the stages'
        two mbarriers (16 bytes a stage), with a producer (``ws``) 16 bytes more (the TMA
        copies' first-tile mbarrier and the sink logit's word); 0 on the
        other paths (their shared memory is static); on the wgspan path its chunk buffers and,
        at d = 64, the staged epilogue's 2 KiB a warp (``WGSPAN_EPI_BYTES_PER_WARP``).
        ``stages``: that many K/V stages instead of ``kv_stages(d)`` (an A/B's KV_STAGES)."""
        stages = self.kv_stages(d) if stages is None else stages
        if self.path == "wgspan":
            epi = WGSPAN_EPI_BYTES_PER_WARP * self.m_tiles if d == 64 else 0
            return stages * self._kv_tile_bytes(d) + epi
        if self.path != "wgmma":
            return 0
        ones = WGMMA_ONES_BYTES if self.rowsum_mma(d) else 0
        used = stages * (self._kv_tile_bytes(d) + 16) + ones + (16 if self.ws else 0)
        if self.qsmem:  # the Q tiles after the barriers, 1024-byte aligned (the kernel's Q_AT)
            return -(-used // 1024) * 1024 + self._q_smem_bytes(d)
        return used

    def rescale_log2(self, d: int) -> int:
        """The lazy-rescaling threshold at head dim ``d`` (``WGMMA_RESCALE_LOG2`` on the
        wgmma path at ``WGMMA_RESCALE_HEAD_DIMS``, else 0: every tile rescales). It changes
        the rounding, so the model follows it."""
        return WGMMA_RESCALE_LOG2 if self.path == "wgmma" and d in WGMMA_RESCALE_HEAD_DIMS else 0

    def rescale_rows(self, d: int) -> int:
        """The rows that decide a lazy rescale together: 8 (each half of a warp's rows) on
        the producer tiles at ``WGMMA_RESCALE_ROWS_HEAD_DIMS``, else 16 (the warp's). It
        changes the rounding, so the model follows it."""
        if self.rescale_log2(d) and self.ws and d in WGMMA_RESCALE_ROWS_HEAD_DIMS:
            return 8
        return 16

    def rowsum_mma(self, d: int) -> bool:
        """Whether the row sums l run on the tensor cores at head dim ``d`` (the wgmma path at
        d = 64, ``WGMMA_ROWSUM_HEAD_DIMS``): l = sum of the fp16 P, not of the fp32 p. It
        changes the rounding, so the model follows it."""
        return self.path == "wgmma" and d in WGMMA_ROWSUM_HEAD_DIMS

    def pv_wait_split(self) -> int:
        """The 8-key score blocks whose exp2 run before the wait for the owed P.V (the TMA
        producer tiles' overlap): the first one on ``WGMMA_PV_WAIT_EARLY_M_TILES``, else all
        (``bkv // 8``). The order of the same operations: no rounding changes."""
        if self.path == "wgmma" and self.ws and self.m_tiles in WGMMA_PV_WAIT_EARLY_M_TILES:
            return 1
        return self.bkv // 8

    def fits(self, d: int) -> bool:
        """Whether this config compiles at head dim ``d``: its shared memory fits (48 KiB
        of static memory; on the wgmma path, its minimum of K/V stages in its budget: 2 on
        mbarriers (four warpgroups, or ws), else 1; on the wgspan path one round buffer)."""
        if self.path in WGMMA_PATHS:
            return self._wgmma_min_stages * self._kv_tile_bytes(d) + self._q_smem_bytes(d) <= self._smem_limit
        return self.smem_bytes(d) <= self._smem_limit

    @property
    def _wgmma_min_stages(self) -> int:
        if self.path == "wgspan":
            return 1
        return WGMMA_MBAR_MIN_STAGES if self.m_tiles >= WGMMA_MBAR_M_TILES or self.ws else 1

    @property
    def _smem_limit(self) -> int:
        if self.path not in WGMMA_PATHS:
            return SMEM_LIMIT
        return WGMMA_WS_SMEM_BUDGET if self.ws else WGMMA_SMEM_BUDGET

    def defines(self, d: int, dtype: str = "fp16") -> dict[str, int]:
        """The ``-D`` macros that compile this config at head dim ``d`` for inputs in
        ``dtype`` (``DTYPES``: "fp16", or "bf16", which adds ``HK_BF16=1``)."""
        d = _check_int("d", d, HEAD_DIMS)
        if dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {DTYPES}, got {dtype!r}")
        if not self.fits(d):
            need, kind = self.smem_bytes(d), "static"
            if self.path in WGMMA_PATHS:
                need, kind = self._wgmma_min_stages * self._kv_tile_bytes(d), "dynamic"
            raise ValueError(
                f"bkv: {self.bkv} keys at d={d} need {need} bytes of {kind} shared "
                f"memory, over the {self._smem_limit} byte limit"
            )
        defines = {"HEAD_DIM": d, "M_TILES": self.m_tiles, "BKV": self.bkv}
        if self.warp_m != 1:
            defines["WARP_M"] = self.warp_m
        if self.pack != 1:
            defines["PACK"] = self.pack
        if self.walk != 1:
            defines["QWALK"] = self.walk
        if self.path in WGMMA_PATHS:
            defines["KV_STAGES"] = self.kv_stages(d)
        if self.path in AMD_MMA_WAVE:
            defines["WAVE"] = self.wave
        if self.ws:
            defines["WS"] = 1
        if self.qsmem:
            defines["QSMEM"] = 1
        if self.rescale_log2(d):
            defines["RESCALE_LOG2"] = self.rescale_log2(d)
        if self.rescale_rows(d) != 16:
            defines["RESCALE_ROWS"] = self.rescale_rows(d)
        if self.rowsum_mma(d):
            defines["ROWSUM_MMA"] = 1
        if self.pv_wait_split() != self.bkv // 8:
            defines["PV_WAIT_SPLIT"] = self.pv_wait_split()
        if dtype == "bf16":
            defines["HK_BF16"] = 1
        return defines


_CONFIG_NAME = re.compile(r"(?:([a-z]+)_)?m(\d+)_b(\d+)(?:_w(\d+))?(?:_p(\d+))?(?:_q(\d+))?(_ws)?")


def config_from_name(name: str) -> KernelConfig:
    """The inverse of ``KernelConfig.name``: ``"m4_b64"`` (scalar), ``"mma_m4_b64"``,
    ``"mma_m8_b64_w2"``, ``"mma_m4_b32_p8"``, ``"mma_m4_b32_p4_q4"``, ``"wgmma_m8_b64_ws"``,
    ``"wmma_m4_b64"``. A name of no config (``"mma_m3_b64"``) is a ``ValueError`` that says
    which field ``KernelConfig`` refused."""
    m = _CONFIG_NAME.fullmatch(str(name))
    if m is None:
        raise ValueError(f"config: expected a config name like m4_b64, mma_m4_b64, "
                         f"mma_m8_b64_w2, mma_m4_b32_p8, mma_m4_b32_p4_q4, wgmma_m8_b64_ws or "
                         f"wmma_m4_b64, got {name!r}")
    try:
        return KernelConfig(int(m.group(2)), int(m.group(3)), m.group(1) or "scalar",
                            int(m.group(4) or 1), m.group(7) is not None, int(m.group(5) or 1),
                            int(m.group(6) or 1))
    except ValueError as e:
        raise ValueError(f"config: {name!r}: {e}") from None


# The autotune candidates: configs that compile without register spills for every head dim
# in HEAD_DIMS (checked with `ptxas -v` at sm_90/sm_80 and `-Rpass-analysis=kernel-resource-usage`
# at gfx1151/gfx942/gfx90a; see hipkernel/build.py). CANDIDATES is the scalar set, which runs
# everywhere; `candidates(arch)` adds the tensor-core configs where the target has them.
CANDIDATES = tuple(KernelConfig(m, b) for m in (1, 2, 4) for b in (32, 64))
# mma: one warp per 16 rows; m2_b64 is left out (it spills at d=128 and was the slowest at
# d=64 on the H200).
MMA_CANDIDATES = tuple(KernelConfig(m, b, "mma") for m, b in ((4, 64), (4, 32), (8, 64)))
# mma with 32 rows a warp (warp_m = 2): twice the accumulators, so only at d = 64, where
# ptxas (sm_90) fits them in 246 / 202 / 246 registers without spilling; at d = 128 every one
# spills. They run correctly at d = 128 when asked for explicitly; the tuner does not offer them.
MMA_WIDE_CANDIDATES = tuple(KernelConfig(m, b, "mma", 2) for m, b in ((8, 64), (8, 32), (4, 64)))
WIDE_HEAD_DIMS = (64,)
# mma with GQA packing: a block's 64 rows are 16 positions of 4 heads, or 8 of 8, which share
# their K/V tiles; under a window a block then walks the KV tiles of 16 (8) positions rather
# than 64. Bit-identical to mma_m4_b32 (the tiles a row sees are the same aligned tiles). On
# the H200 (d 64 gpt-oss, kernel-only, same process): 16384@0 window 128
# mma_m4_b32 0.3099 ms, _p4 0.2859, _p8 0.2891; 4096@8192 window 128 0.0840, 0.0788, 0.0790;
# wider tiles lose (m8_b32_p8 0.306, m4_b64_p8 0.327, m1_b32_p8 0.455). Full attention gains
# 1-2 % (mma_m8_b64_w2 7.49 -> 7.37 ms at 16384@0), not enough to matter next to wgmma.
# Offered only where G % pack == 0 (``KernelConfig.supports``).
MMA_PACK_CANDIDATES = tuple(KernelConfig(4, 32, "mma", pack=p) for p in (4, 8))
# The packed tiles walking 4 Q tiles a block: under a window, the K/V tiles that consecutive
# Q tiles share stay in a ring of 5 (48 KiB at d = 64; at d = 128 two K + V tiles fill it, so
# there is no ring and they are not offered). Bit-identical to the unwalked tile. On the H200
# (kernel-only, mean of two passes): 16384@0 window 128
# mma_m4_b32_p4 0.2720 ms, _p4_q4 0.2381, _p8_q4 0.2323; 4096@8192 window 128 0.0734,
# 0.0664, 0.0651. Walking 2 or 8 Q tiles paid a little less than 4 (0.2455 and 0.2435 against
# 0.2414 ms for mma_m4_b32_p4 at 16384@0 window 128).
MMA_WALK_CANDIDATES = tuple(replace(c, walk=4) for c in MMA_PACK_CANDIDATES)
WALK_HEAD_DIMS = (64,)

# wgmma: at d = 64 four warpgroups a block (256 rows) on 64-key tiles, 6 stages (96 KiB),
# each thread loading its share; at d = 128 two warpgroups on 128-key tiles and a producer
# warpgroup, 3 stages (192 KiB). On the H200, same process and inputs (kernel-only,
# back-to-back launches), against the best mma config:
#   d 64   512@8192  m16_b64 0.2354 ms, m8_b64 0.2787, 128-key m8 0.3268; mma 0.2467
#          16384@0   m16_b64 7.049,     m8_b64 8.159,  128-key m8 9.370;  mma 7.593
#   d 128  512@8192  m8_b64  0.2831,    m8_b32 0.3017;                    mma 0.3059
#          16384@0   m8_b64  8.284,     m8_b32 8.981;                     mma 8.979
# and later (mbarriers for m16, then ws): d 64 m16_b64 6.74 ms at 16384@0, against 8.05 for
# m12 with a producer and 8.45 for m8_b128 with one; d 128 m8_b128_ws 6.31 ms, m8_b64_ws
# 7.13 (6 stages), m8_b64 8.27 (0.2306, 0.2474 and 0.2829 ms at 512@8192).
# One warpgroup a block (m4) ran 1.4-1.8x slower than two (twice the K/V traffic per row).
# With 128 registers a thread (m16 at d = 64: 512 threads, one block an SM) 128-key tiles
# spill; at m8 they take ~210 registers and one block an SM, slower than 64-key ones.
# At d = 64 the tuner also times three consumer warpgroups on 128-key tiles with a TMA
# producer, Q in shared memory (qsmem) and the intra-warpgroup overlap: 192 rows a block. On
# an H100 (hipkernel.ab, same process, bit-identical across its stage counts) it ran 16384@0
# in 4.62 ms against 4.80 for m16_b64, B4 4096@4096 3.54 against 3.62, 128@8192 0.0886
# against 0.1061, 2048@14336 1.157-1.174 against 1.136-1.156, and 512@8192 0.213 against
# 0.154 (192 blocks for 132 SMs): so a candidate beside m16_b64, not in its place. The
# tuner's model of the grid (hipkernel.autotune.grid_time) tells the two apart where the
# waves decide, and times both where it cannot.
WGMMA_TILES = {64: (KernelConfig(16, 64, "wgmma"), KernelConfig(12, 128, "wgmma", ws=True)),
               128: (KernelConfig(8, 128, "wgmma", ws=True),)}
# The first tile of each head dim: the one the mutant builds, the model tests and the
# sanitizers' default wgmma runs use.
WGMMA_BY_HEAD_DIM = {d: tiles[0] for d, tiles in WGMMA_TILES.items()}
WGMMA_CANDIDATES = tuple(c for tiles in WGMMA_TILES.values() for c in tiles)

# wgspan (kernels/gqa_flash_prefill_wgspan.hip): under a window, a warpgroup's 64 rows are 8
# positions of the 8 heads of a KV head, and their keys one chunk of 136 starting at the first
# of them; a block of one warpgroup walks 4 such steps over keys it stages once. Offered for
# the windows whose span fits one chunk (``KernelConfig.spans_window``), at d = 64 (at d = 128
# G = 4 packs 4 heads, 16 positions, whose 143 keys do not fit). On the H200, same process
# (before the block-wise mask): 16384@0 window 128 0.1751 ms against 0.2341 for
# mma_m4_b32_p8_q4; walking 1, 2 and 8 steps 0.2113, 0.2018, 0.1773; with the mask 0.1706.
# 18 % fewer instructions a step (the mask's edges, the staged epilogue, one factor a row,
# kernel beef206b): 0.1383 against 0.1705.
WGSPAN_CANDIDATES = (KernelConfig(4, 136, "wgspan", pack=8, walk=4),)
WGSPAN_HEAD_DIMS = (64,)

# Mutants (refattn.mutants) that cannot change any output of one path, with the argument; a
# forced kill matrix of that path counts them as equivalent, as the catalogue's ``equivalent``
# does on every path. tests/test_wgspan.py checks the claim on the model.
EQUIVALENT_ON_PATH = {
    "wgspan": {
        "no_nan_guard": "no chunk of the wgspan path precedes a row's first visible key (a "
                        "unit's first chunk starts at most 7 keys before its first row's first "
                        "key, and its rows' first keys lie within 64 / pack - 1 of that), so no "
                        "row meets a chunk it sees nothing of before it has seen a key: the "
                        "guarded exp2(-inf - -inf) never happens",
    },
}

# The AMD matrix-core paths (kernels/gqa_flash_prefill_amdmma.hip): not timed on AMD hardware
# (none here), so a plain spread of tile shapes for the tuner to choose from where they run.
_AMD_MMA_TILES = ((4, 64), (4, 32), (2, 64))  # (m_tiles, bkv), the first the checked one
WMMA_CANDIDATES = tuple(KernelConfig(m, b, "wmma") for m, b in _AMD_MMA_TILES)
MFMA_CANDIDATES = tuple(KernelConfig(m, b, "mfma") for m, b in _AMD_MMA_TILES)

DEFAULT = KernelConfig(4, 64)
MMA_DEFAULT = MMA_CANDIDATES[0]


def sm_version(arch: str) -> int | None:
    """``"sm_90"`` -> 90, ``"sm_90a"`` / ``"compute_90"`` -> 90; None for anything else
    (AMD ``gfx...`` targets, fakes)."""
    m = re.fullmatch(r"(?:sm|compute)_(\d+)[a-z]?", str(arch))
    return int(m.group(1)) if m else None


def has_mma(arch: str) -> bool:
    """Whether ``arch`` runs the mma path (NVIDIA sm_80 and newer)."""
    sm = sm_version(arch)
    return sm is not None and sm >= MMA_MIN_SM


def has_wgmma(arch: str) -> bool:
    """Whether ``arch`` runs the wgmma path: a compute capability 9.0 device (``sm_90``, whose
    kernels the CUDA backend compiles for ``sm_90a``) or the ``sm_90a`` target itself."""
    return sm_version(arch) == WGMMA_SM


def _gfx(arch: str) -> str | None:
    m = re.fullmatch(r"(gfx[0-9a-f]+)(:[a-z+-]+)*", str(arch))
    return m.group(1) if m else None


def has_wmma(arch: str) -> bool:
    """Whether ``arch`` is an AMD gfx11 (RDNA 3) target, which has WMMA in wave32."""
    gfx = _gfx(arch)
    return gfx is not None and gfx.startswith("gfx11")


def has_mfma(arch: str) -> bool:
    """Whether ``arch`` is an AMD CDNA target with v_mfma_f32_16x16x16f16 (gfx908, gfx90a,
    gfx94x)."""
    gfx = _gfx(arch)
    return gfx is not None and (gfx in ("gfx908", "gfx90a") or gfx.startswith("gfx94"))


# What a path needs, for the error that refuses it where it does not run (``runs_path``).
PATH_NEEDS = {"mma": f"an NVIDIA sm_{MMA_MIN_SM}+ GPU", "wgmma": f"an NVIDIA sm_{WGMMA_SM} (Hopper) GPU",
              "wgspan": f"an NVIDIA sm_{WGMMA_SM} (Hopper) GPU",
              "wmma": "an AMD gfx11 GPU (or an NVIDIA GPU, which emulates it)",
              "mfma": "an AMD gfx90a / gfx94x GPU (or an NVIDIA GPU, which emulates it)"}


def runs_path(path: str, arch: str) -> bool:
    """Whether a kernel of ``path`` runs on ``arch``: scalar everywhere; mma on NVIDIA sm_80+;
    wgmma on sm_90; wmma on gfx11 and mfma on CDNA, natively, and both on every NVIDIA target
    through the emulation (``amd_mma.h``), which is for checking only."""
    if path == "mma":
        return has_mma(arch)
    if path in WGMMA_PATHS:
        return has_wgmma(arch)
    if path in AMD_MMA_WAVE:
        native = has_wmma(arch) if path == "wmma" else has_mfma(arch)
        return native or sm_version(arch) is not None
    return path == "scalar"


def amd_mma_enabled(environ=None) -> bool:
    """Whether ``$HIPKERNEL_AMD_MMA`` asks the tuner to offer the AMD matrix-core configs
    ("1"; unset, "" or "0": not). Anything else is an ``EnvVarError`` (a ``ValueError``)
    naming the variable."""
    import os

    from refattn.args import EnvVarError

    raw = (os.environ if environ is None else environ).get(AMD_MMA_ENV, "").strip()
    if raw not in ("", "0", "1"):
        raise EnvVarError(f"{AMD_MMA_ENV}: expected 0 or 1, got {raw!r}")
    return raw == "1"


def default_config(arch: str) -> KernelConfig:
    """The config used without a sweep (``HIPKERNEL_TUNE=0``) on target ``arch``: the mma
    path's default on NVIDIA sm_80+, else the scalar ``DEFAULT``."""
    return MMA_DEFAULT if has_mma(arch) else DEFAULT


def candidates(arch: str, d: int | None = None, G: int | None = None,
               window: int | None = None) -> tuple[KernelConfig, ...]:
    """The autotune candidates on target ``arch`` at head dim ``d`` for ``G`` query heads a KV
    head under ``window``: the scalar configs everywhere, plus on AMD the wmma (gfx11) or mfma
    (CDNA) configs when ``$HIPKERNEL_AMD_MMA`` is 1 (``amd_mma_enabled``), plus the mma
    configs on NVIDIA sm_80+, plus the 32-rows-a-warp mma configs where ``d`` is in
    ``WIDE_HEAD_DIMS``, plus the packed mma configs that ``G`` allows (and where ``d`` is in
    ``WALK_HEAD_DIMS``, the same walking 4 Q tiles a block), plus the wgmma tiles of ``d``
    (``WGMMA_TILES``) on sm_90, plus there the wgspan configs that ``G`` allows at a ``d`` in
    ``WGSPAN_HEAD_DIMS`` for a window that spans one of their chunks. ``d=None`` /
    ``G=None`` / ``window=None``: every config the target can run at some head dim / some G
    / some window (for fuzzing, sanitizer sweeps and the build check; ``KernelConfig.fits``,
    ``KernelConfig.supports`` and ``KernelConfig.spans_window`` say where)."""
    if not has_mma(arch):
        if has_wmma(arch) and amd_mma_enabled():
            return CANDIDATES + WMMA_CANDIDATES
        if has_mfma(arch) and amd_mma_enabled():
            return CANDIDATES + MFMA_CANDIDATES
        return CANDIDATES
    wide = MMA_WIDE_CANDIDATES if d is None or d in WIDE_HEAD_DIMS else ()
    if not has_wgmma(arch):
        wg = ()
    else:  # the tiles that win at this head dim (see WGMMA_TILES)
        wg = WGMMA_CANDIDATES if d is None else WGMMA_TILES.get(d, ())
    walking = MMA_WALK_CANDIDATES if d is None or d in WALK_HEAD_DIMS else ()
    packed = tuple(c for c in MMA_PACK_CANDIDATES + walking if G is None or c.supports(G))
    span = tuple(c for c in WGSPAN_CANDIDATES if has_wgmma(arch) and (d is None or d in WGSPAN_HEAD_DIMS)
                 and (G is None or c.supports(G)) and (window is None or c.spans_window(window)))
    return CANDIDATES + MMA_CANDIDATES + wide + packed + wg + span


def compiled_variants() -> list[tuple[int, KernelConfig]]:
    """Every (head dim, config) the tuner may launch somewhere: what the offline build check
    compiles and requires free of spills (the AMD matrix-core configs for their AMD targets)."""
    return [(d, cfg) for d in HEAD_DIMS
            for cfg in candidates(WGMMA_TARGET, d) + WMMA_CANDIDATES + MFMA_CANDIDATES]
