"""NumPy model of the fused kernel: the executable spec that gqa_flash_prefill.hip follows
line by line, with the same tiles, start-tile clamp, masks, NaN guard and sink epilogue.
CI runs it on the CPU; the mutants of ``refattn.mutants`` are flags of it.

Geometry (``hipkernel.config``). Block (qt, h, b) owns query rows i in
[qt*BM, min(Sq, (qt+1)*BM)), BM = 16*M_TILES / pack (``config.block_positions``), of query
head h (with pack > 1, of the pack heads of one KV head that the kernel's block holds: the
same rows, so the same KV walk), and reads KV head kvh = h // G, G = Hq // Hkv.
skv = past_len + Sq keys exist; the cache may be longer (S_cap >= skv), and what lies past
skv is never meant to be read (tests fill it with NaN). Row i sits at absolute position
p = past_len + i; p_first, p_last are the Q tile's first and last rows' positions.

KV range and start-tile clamp:

    kv_end   = p_last + 1                                       (exclusive)
    kv_start = max(0, p_first - W + 1) if W > 0 else 0
    t0       = kv_start // BKV

The clamp uses the tile's FIRST row: the rows' window lower bounds p - W + 1 are
non-decreasing, so a start that covers the first row covers them all. This is what makes a
window cheaper rather than merely masked.

KV tiles t = t0 .. ceil(kv_end / BKV) - 1, keys j in [t*BKV, t*BKV + BKV):

  load    K and V tiles; keys j >= skv and keys j < kv_start are ZERO-FILLED. No row may
          see them, but P.V is a plain product-sum over the whole tile (as a matrix core
          would do it), where p = 0 times a NaN from storage would still be NaN.
  scores  s_j = dot(q_i, k_j), fp32; in exp2 space the logit is c2 * s_j, c2 = scale * log2 e
          rounded to fp32, never rounded on its own (see p_j).
  mask    visible(p, j) = j <= p and (W < 0 or j >= p - W + 1)   (W keys, self included);
          invisible keys get s_j = -inf, hence p_j = 0 (a select in the kernel; here
          exp2(-inf - finite) = 0 exactly).
  update  (online softmax, per row, fp32)
          m_new = max(m, c2 * max_j s_j rounded up)  (c2 > 0: >= every c2 s_j, so p_j <= 1
                                                 at any magnitude; its rounding is common
                                                 to the row and cancels in acc / l)
          NaN guard: if m_new == -inf the row has seen nothing so far and sees nothing in
          this tile: leave (m, l, acc) untouched (exp2(-inf - -inf) would be NaN). (The
          kernels take alpha = 1 and p = 0 for such a row and still add P.V = 0 * v_j, the
          same unless the tile loads a NaN or inf v_j; the mma, wgmma and AMD paths' warps
          skip a tile none of their rows sees, which keeps acc as here. Under the
          window_skip_off mutant those skips are off, and the model adds 0 * v_j too.) Else
          alpha = exp2(m - m_new)                (0 when m = -inf)
          p_j   = exp2(fma(s_j, c2, -m_new))     one rounding, so p_j has no error of size
                                                 ulp(c2 s_j) where |c2 s_j| is large (at
                                                 fp16-max logits that would be 0.27 % of p_j)
          l     = l * alpha + sum_j p_j              (rowsum_mma: sum_j fp16(p_j), below)
          acc   = acc * alpha + sum_j p_j * v_j
          m     = m_new

Lazy rescaling (the wgmma path at d = 64 and 128: T = ``config.rescale_log2(d)`` > 0): the 16 rows
of a warp (rows [i0 + 16 w, i0 + 16 w + 16) of the Q tile; on the producer tiles at d = 128
each 8 of them, ``config.rescale_rows(d)``) take m_new = m, so alpha = 1 and acc, l stay
relative to the old m, unless one of them has c2 max_j s_j > m + T; then all of them update
as above. So p_j <= 2^T, and a row that has seen nothing (m = -inf) always updates
once it sees a key. The kernel's rows past Sq (zero queries) vote too, which the model
leaves out: that only moves a rescale, which changes rounding, not the result.

Epilogue, with the sink folded in once, in exp2 space. sink_mode 1 (per head):
sigma = sink[h] (fp16, natural-log units, neither scaled nor softcapped); 2 (smooth):
sigma = 0; 0: no sink term.

    sig2  = sigma * log2 e
    m_fin = max(m, sig2)                            (the max covers the sink: no overflow)
    f     = exp2(m - m_fin), or 0 when m = -inf     (a row that saw nothing: acc = l = 0)
    acc   = acc * f
    l     = l * f + exp2(sig2 - m_fin), the term 0 when sig2 = -inf
    out   = acc / l, or 0 when l == 0                -> rounded to fp16
            (tensor-core paths: acc0 * (f * (1 / l)), acc0 the accumulator before * f,
             and 0 * acc0 when l == 0)

(``l == 0``, not ``l > 0``: l is never negative, and a NaN in l must reach the output
rather than be laundered into a zero. The tensor-core kernels take one correctly rounded
reciprocal a row, fold f into it and then take one product an element, not a division an
element nor two products; the scalar kernel divides, which on sm_80 keeps two of its tiles
free of spills.)

Inputs are fp16 or bf16, arithmetic is fp32 (``np.float32`` throughout, exp2 in fp32), the
output is in the input's format (bf16 values held in float32, as the harness holds them). On the tensor-core paths (``config.path`` "mma" or "wgmma") P is rounded to fp16
before P.V, which the model mirrors; l still sums the fp32 p, except on the wgmma path at
d = 64 (``config.rowsum_mma(d)``), whose kernel sums P on the tensor cores beside P.V
(P . 1): there l sums the fp16 P that P.V multiplies. In a bf16 kernel P is rounded to
bf16 instead. The kernel's dot products and sums run in a different order than NumPy's, so
the two agree to fp32 rounding, not bitwise.

Ragged batches (``past_len`` and ``q_len`` per sequence, docs/semantics.md): block (qt, h, b)
takes sequence b's own lengths, so each sequence is computed exactly as the uniform call of
its own geometry (rows [0, q_len[b]) at past_len[b] + i over keys [0, past_len[b] +
q_len[b])); its padded rows are written as zeros, and a block wholly in the padding walks no
KV tile.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import dataclasses

from hipkernel.config import DEFAULT, HEAD_DIMS, TENSOR_CORE_PATHS, KernelConfig
from refattn.args import check_attention_args
from refattn.lowp import round_bf16
from refattn.mutants import MUTANTS
from refattn.sharding import affinity_cpus

LOG2E = np.float32(1.4426950408889634)  # exp(x) = exp2(x * LOG2E)
_NEG_INF = np.float32(-np.inf)
_F32 = np.float32
_MUTANT_NAMES = frozenset(m.name for m in MUTANTS)
_CPUS = affinity_cpus()
_N_WORKERS = max(1, min(4, _CPUS))  # threads over Q tiles (see _run)
_SINK_MODE = {"none": 0, "per_head": 1, "smooth": 2}  # the kernel's sink_mode argument
# The running max the max_floor mutant starts a row from (exp2 units, the kernels' m), in place
# of -inf: -1e4 is -6931.5 in natural-log units.
MAX_FLOOR = np.float32(-1e4)
DTYPES = ("fp16", "bf16")
OUT_CANARY_BITS = 0x7E5A  # what the harness's output buffer holds (refattn.cases): an fp16 NaN


def visible(p, j, window: int, *, off_by_one: bool = False):
    """Key ``j`` is visible from absolute query position ``p`` (broadcasting arrays):
    ``j <= p`` and, under a window of ``W`` keys, ``j >= p - W + 1``. ``off_by_one`` is the
    ``window_mask_off_by_one`` mutant: ``j >= p - W`` (W + 1 keys)."""
    causal = j <= p
    if window < 0:
        return causal
    return causal & (j >= p - window + (0 if off_by_one else 1))


def attention(q, k, v, *, past_len, q_len=None, window=-1, sink=None, smooth_softmax=False,
              softcap=0.0, scale=None, config: KernelConfig = DEFAULT,
              mutants: Iterable[str] = frozenset(), dtype: str = "fp16") -> np.ndarray:
    """The fused kernel's output, computed on the CPU by its own tiled algorithm.

    ``q: (B, Sq, Hq, d)``, ``k, v: (B, Hkv, S_cap, d)`` with ``S_cap >= past_len + Sq``
    (keys past ``skv`` are never read), ``sink: (Hq,)`` float16 or None. ``dtype`` "fp16":
    q, k, v float16, returns ``(B, Sq, Hq, d)`` float16; "bf16": q, k, v float32 holding
    bf16 values, returns float32 holding bf16 values. Ragged: ``past_len`` and ``q_len``
    integer arrays (B,) (docs/semantics.md, Ragged batches); padded rows are zeros.
    ``config`` picks the tiles (BM = 16 * m_tiles, BKV = bkv); ``mutants`` names bugs from
    ``refattn.mutants`` to switch on.
    """
    a = check_attention_args(q, k, v, past_len=past_len, q_len=q_len, window=window, sink=sink,
                             smooth_softmax=smooth_softmax, softcap=softcap, scale=scale,
                             allow_cache_capacity=True, allow_ragged=True)
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(map(repr, DTYPES))}, got {dtype!r}")
    want = np.float16 if dtype == "fp16" else np.float32
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype != want:
            raise ValueError(f"{name}: the fused kernel takes {dtype} as "
                             f"{np.dtype(want).name}, got {x.dtype}")
        if dtype == "bf16" and (np.ascontiguousarray(x).view(np.uint32) & 0xFFFF).any():
            raise ValueError(f"{name}: expected bf16 values (float32 with the low 16 bits of "
                             f"every word zero)")
    if sink is not None and sink.dtype != np.float16:
        raise ValueError(f"sink: the fused kernel takes float16, got {sink.dtype}")
    if a.softcap > 0:
        raise ValueError(f"softcap: the fused kernel does not implement softcap, got {a.softcap}")
    if a.d not in HEAD_DIMS:
        raise ValueError(f"q: head dim {a.d} is not compiled; the kernel has d in {HEAD_DIMS}")
    if not isinstance(config, KernelConfig):
        raise ValueError(f"config: expected a hipkernel.config.KernelConfig, got {config!r}")
    mut = _check_mutants(mutants)
    bf16 = dtype == "bf16"
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        if not a.ragged:
            return _run(a, q, k, v, sink, config, mut, bf16)
        return _ragged(a, q, k, v, sink, config, mut, bf16)


def _ragged(a, q, k, v, sink, config: KernelConfig, mut: frozenset[str], bf16: bool) -> np.ndarray:
    """A ragged batch: each sequence as the uniform call of its own geometry (B = 1, its
    q_len rows, its past_len), padded rows zero; or what the ragged mutants make of it."""
    out = np.zeros(q.shape, np.float32 if bf16 else np.float16)
    if "padding_not_written" in mut:  # padded rows keep the buffer's canary
        canary = np.full((), OUT_CANARY_BITS, np.uint16).view(np.float16)
        out[...] = canary
    S_cap = k.shape[2]
    longest_past, longest = max(a.past_lens), max(a.lengths)

    def seq(b: int, past: int, rows: slice, skv: int, kv_b: int) -> None:
        n = rows.stop - rows.start
        if n <= 0:
            return
        one = dataclasses.replace(a, B=1, Sq=n, past_len=past, skv=skv, past_lens=(past,),
                                  q_lens=(n,), ragged=False)
        out[b:b + 1, rows] = _run(one, q[b:b + 1, rows], k[kv_b:kv_b + 1], v[kv_b:kv_b + 1],
                                  sink, config, mut, bf16)

    for b, (past, n) in enumerate(zip(a.past_lens, a.q_lens)):
        if "ragged_max_diag" in mut:  # the longest sequence's diagonal and key bound
            seq(b, longest_past, slice(0, n), longest, b)
        else:
            seq(b, past, slice(0, n), past + n, b)
        if "padded_row_next_seq" in mut:  # rows n.. at past + n + i, against sequence b + 1
            seq(b, past + n, slice(n, a.Sq), min(S_cap, past + a.Sq), (b + 1) % a.B)
    return out


def _fp16_bits_as_bf16(x: np.ndarray) -> np.ndarray:
    """The bf16 numbers whose bit patterns are those of ``x`` rounded to fp16 (as float32):
    the ``bf16_p_as_fp16`` mutant's P."""
    bits = x.astype(np.float16).view(np.uint16).astype(np.uint32) << 16
    return bits.view(np.float32)


def _check_mutants(mutants) -> frozenset[str]:
    if isinstance(mutants, str) or not isinstance(mutants, Iterable):
        raise ValueError(f"mutants: expected a set of mutant names, got {mutants!r}")
    try:
        mut = frozenset(mutants)
    except TypeError:
        raise ValueError(f"mutants: expected a set of mutant names, got {mutants!r}") from None
    unknown = sorted(str(m) for m in mut - _MUTANT_NAMES)
    if unknown:
        raise ValueError(f"mutants: unknown {', '.join(unknown)}; known: {', '.join(sorted(_MUTANT_NAMES))}")
    return mut


def _run(a, q, k, v, sink, config: KernelConfig, mut: frozenset[str], bf16: bool = False
         ) -> np.ndarray:
    B, Sq, Hq, Hkv, d, G = a.B, a.Sq, a.Hq, a.Hkv, a.d, a.G
    BM, BKV = config.block_positions, config.bkv  # BM: positions a block (of pack heads)
    # wgspan: each warpgroup's BM_WG positions walk their own chunks (see _span_tiles); a
    # block's BM x walk positions share the first key and the zero-fill below it.
    span = config.path == "wgspan"
    BM_WG = 64 // config.pack if span else BM
    PV_KEYS = 16 * -(-BKV // 16) if span else BKV  # keys P.V reads a chunk (p = 0 past BKV)
    # The tensor-core paths round two steps their own way: P to fp16 before P.V, and
    # out = acc * (f * (1 / l)).
    tensor_core = config.path in TENSOR_CORE_PATHS
    lazy = config.rescale_log2(a.d)  # 0: every tile rescales
    vote = config.rescale_rows(a.d)  # the rows that decide a lazy rescale together
    rowsum = config.rowsum_mma(a.d)  # l sums the fp16 P (P . 1 on the tensor cores)
    S_cap, skv, W = k.shape[2], a.skv, a.window
    past = 0 if "past_len_ignored" in mut else a.past_len  # p = i: top-left alignment
    c2 = _F32(a.scale) * LOG2E  # the kernel gets scale as a float and multiplies in fp32

    # GQA: query head h reads KV head kvh(h). Order the query heads by KV head so that one
    # batched GEMM serves all (b, kvh, g): qg is (B, Hkv, G, Sq, d).
    heads = np.arange(Hq)
    kvh = heads // G
    kv_of = None
    if "gqa_modulo" in mut:
        # the kernel maps a block of pack heads by its first head, h0 = pack * (h // pack):
        # kvh = h0 % Hkv, which need not give every KV head G query heads. So each query head
        # gets its own copy of the KV head it reads (Hkv := Hq, G := 1).
        kv_of = heads // config.pack * config.pack % Hkv
    elif "head_tile_crosses_group" in mut:
        # every head of a tile of 16 query heads reads the KV head of the tile's first head;
        # a block's pack heads (pack divides 16) lie in one such tile, so mapping the block by
        # its first head h0 gives the same (h0 & ~15) // G
        kv_of = (heads & ~15) // G
    if kv_of is not None:
        k, v = k[:, kv_of], v[:, kv_of]
        Hkv, G = Hq, 1
        kvh = heads
    order = np.argsort(kvh, kind="stable")
    qg = q[:, :, order, :].astype(_F32).transpose(0, 2, 1, 3).reshape(B, Hkv, G, Sq, d)
    # Keys that any tile can load: all of [0, skv), and under tail_unmasked the raw rest of
    # the last tile (within the cache); a wgspan chunk starts below skv and P.V reads PV_KEYS.
    n_load = min(S_cap, skv + PV_KEYS if span else -(-skv // BKV) * BKV)
    k32 = k[:, :, :n_load].astype(_F32)
    v32 = v[:, :, :n_load].astype(_F32)
    load_hi = n_load if "tail_unmasked" in mut else skv  # keys at j >= load_hi read as 0

    # Sink, per query head in group order: (Hkv, G, 1) so it broadcasts over (B, ., ., rows).
    mode = _SINK_MODE[a.sink_mode]
    has_sink = "sink_ignored" not in mut and (
        mode == 1 or (mode == 2 and "smooth_ignored" not in mut))
    sig2 = None
    if has_sink:
        sigma = sink.astype(_F32) if mode == 1 else np.zeros(Hq, _F32)
        sig2 = sigma if "sink_no_log2e" in mut else sigma * LOG2E
        sig2 = sig2[order].reshape(Hkv, G, 1)

    out = np.empty((B, Hkv, G, Sq, d), _F32)

    def q_tile(i0: int) -> None:  # one Q tile of every (b, h): rows [i0, i1)
        i1 = min(Sq, i0 + BM_WG)
        p_first, p_last = past + i0, past + i1 - 1
        p_rows = np.arange(p_first, p_last + 1)[:, None]  # (R, 1)
        kv_end = p_last + 1
        if span:  # the block's first position sets the zero-fill
            tiles, kv_start = _span_tiles(i0, i0 - i0 % (BM * config.walk), Sq, past, W, BKV, BM_WG, mut)
        else:
            kv_start = _kv_start(p_first, W, mut)
            t0 = kv_start // BKV  # from the FIRST row: later rows' lower bounds are higher
            if "clamp_from_last_row" in mut and W > 0:
                t0 = max(0, p_last - W + 1) // BKV
            if "clamp_plus_one_tile" in mut:
                t0 += 1
            tiles = [t * BKV for t in range(t0, -(-kv_end // BKV))]

        qb = qg[:, :, :, i0:i1]  # (B, Hkv, G, R, d)
        R = i1 - i0
        m = np.full((B, Hkv, G, R), MAX_FLOOR if "max_floor" in mut else _NEG_INF, _F32)
        l = np.zeros((B, Hkv, G, R), _F32)
        acc = np.zeros((B, Hkv, G, R, d), _F32)
        for j0 in tiles:
            kt = _load_tile(k32, j0, PV_KEYS, kv_start, load_hi)  # (B, Hkv, PV_KEYS, d)
            vt = _load_tile(v32, j0, PV_KEYS, kv_start, load_hi)
            # raw scores (c2 goes into the exponent), masked by the one predicate (and on
            # wgspan the keys P.V reads past the chunk, whose p is 0)
            s = _matmul(qb, kt.swapaxes(-1, -2)[:, :, None])  # (B, Hkv, G, R, PV_KEYS)
            keys = np.arange(j0, j0 + PV_KEYS)[None, :]
            vis = visible(p_rows, keys, W, off_by_one="window_mask_off_by_one" in mut)
            if PV_KEYS > BKV:
                vis = vis & (keys < j0 + BKV)
            if not vis.all():
                s[..., ~vis] = _NEG_INF
            # online softmax with the NaN guard; m from c2 * max_j dot_j rounded up
            s_max = s.max(axis=-1)
            m_new = np.maximum(m, _mul_up(s_max, c2))
            if lazy:  # a warp's 16 rows (or each 8) keep m unless one's max grows by more than 2^lazy
                grow = np.pad(m_new > m + lazy, [(0, 0)] * 3 + [(0, -R % vote)])
                grow = grow.reshape(B, Hkv, G, -1, vote).any(axis=-1).repeat(vote, axis=-1)[..., :R]
                m_new = np.where(grow, m_new, m)
            guard = None if "no_nan_guard" in mut else np.isneginf(m_new)
            if guard is not None and guard.any():
                m_ref = np.where(guard, _F32(0), m_new)  # any finite value: those rows are restored
            else:
                guard, m_ref = None, m_new
            alpha = np.exp2(m - m_ref)  # exp2(-inf) = 0 when the row had seen nothing
            # fma(s, c2, -m): the fp64 product of two fp32 values is exact
            s = (s.astype(np.float64) * np.float64(c2) - m_ref[..., None]).astype(_F32)
            np.exp2(s, out=s)  # p_j; invisible keys: exp2(-inf) = 0
            # the tensor-core paths feed P to the MMAs as fp16 (bf16 in a bf16 kernel); l
            # keeps the fp32 p, or sums that P on the tensor cores too (rowsum_mma: P . 1
            # beside P . V)
            if bf16 and "bf16_p_as_fp16" in mut:
                pv = _fp16_bits_as_bf16(s)
            elif tensor_core:
                pv = round_bf16(s) if bf16 else s.astype(np.float16).astype(_F32)
            else:
                pv = s
            l_new = l * alpha + (pv if rowsum else s).sum(axis=-1)
            acc_new = acc * alpha[..., None] + _matmul(pv, vt[:, :, None])
            if "sink_per_tile" in mut and has_sink:
                l_new += np.exp2(sig2 - m_ref)  # split-KV bug: one sink term per tile
            if guard is None:
                m, l, acc = m_new, l_new, acc_new
            else:  # rows that saw nothing keep their state
                m = np.where(guard, m, m_new)
                l = np.where(guard, l, l_new)
                acc_kept = acc
                if "window_skip_off" in mut:
                    # Every path walks every tile of the block here (the mutant turns their
                    # per-warp skips off too), and a guarded row takes alpha = 1 and p = 0
                    # there: P.V adds 0 * v_j to its acc, NaN where a v_j is NaN or inf.
                    acc_kept = acc + (vt * _F32(0)).sum(axis=2)[:, :, None, None, :]
                acc = np.where(guard[..., None], acc_kept, acc_new)

        # epilogue: fold the sink into the denominator, once per row
        f = _F32(1)
        if has_sink:
            m_fin = m if "sink_max_skipped" in mut else np.maximum(m, sig2)
            f = np.where(np.isneginf(m), _F32(0), np.exp2(m - m_fin))
            l = l * f
            if "sink_per_tile" not in mut:
                shift = _F32(0) if "sink_unshifted" in mut else m_fin
                l = l + np.where(np.isneginf(sig2), _F32(0), np.exp2(sig2 - shift))
        l_nz = np.where(l == 0, _F32(1), l)
        if tensor_core:  # one factor a row: 0 * acc when l == 0
            scale = np.where(l == 0, _F32(0), f * (_F32(1) / l_nz))
            out[:, :, :, i0:i1] = acc * scale[..., None]
        else:
            o = (acc * f[..., None] if has_sink else acc) / l_nz[..., None]
            out[:, :, :, i0:i1] = np.where((l == 0)[..., None], _F32(0), o)

    # Q tiles are independent (as the kernel's blocks are) and NumPy releases the GIL in
    # ufuncs and GEMMs, so they run on a few threads; each writes only its own rows.
    starts = range(0, Sq, BM_WG)
    workers = min(len(starts), _N_WORKERS)
    if workers <= 1:
        for i0 in starts:
            q_tile(i0)
    else:
        with ThreadPoolExecutor(workers) as pool:
            for _ in pool.map(q_tile, starts):
                pass

    result = np.empty((B, Sq, Hq, d), _F32 if bf16 else np.float16)
    result[:, :, order, :] = out.reshape(B, Hq, Sq, d).transpose(0, 2, 1, 3)
    return round_bf16(result) if bf16 else result


def _span_tiles(i0: int, blk0: int, Sq: int, past: int, W: int, bkv: int, bm: int,
                mut: frozenset[str]) -> tuple[list[int], int]:
    """The wgspan path's chunks of the warpgroup whose rows start at ``i0``, in the block
    whose rows start at ``blk0`` (``bm`` positions a warpgroup): their first keys, and the
    block's first visible key (the loads zero-fill below it). A warpgroup's first key lo is
    its first row's (last row's under ``clamp_from_last_row``; a chunk later under
    ``clamp_plus_one_tile``); the block's, kv_base, is its first warpgroup's; the chunks
    start at kv_base + ((lo - kv_base) & ~7), a whole 8-key atom of the block's buffer, and
    run ``bkv`` keys each up to the warpgroup's last row."""
    def first_key(i: int) -> int:
        p = past + (min(i + bm, Sq) - 1 if "clamp_from_last_row" in mut else i)
        j = _kv_start(p, W, mut)
        return j + bkv if "clamp_plus_one_tile" in mut else j

    kv_base = first_key(blk0)
    a = kv_base + ((first_key(i0) - kv_base) & ~7)
    kv_end = past + min(i0 + bm, Sq)
    n = -(-(kv_end - a) // bkv) if kv_end > a else 0
    return [a + bkv * c for c in range(n)], _kv_start(past + blk0, W, mut)


def _kv_start(p: int, W: int, mut: frozenset[str]) -> int:
    """The first key a row at position ``p`` may see, max(0, p - W + 1) under a window (the
    kernels' ``kv_start_of``); 0 under the ``window_skip_off`` mutant, whose walk and loads
    then start at key 0 (the mask still hides the keys left of the window)."""
    if W > 0 and "window_skip_off" not in mut:
        return max(0, p - W + 1)
    return 0


def _mul_up(x: np.ndarray, c: np.float32) -> np.ndarray:
    """fp32 ``x * c`` rounded toward +inf (the kernels' ``hk_mul_up``): the fp64 product of two
    fp32 values is exact; where its nearest fp32 value lies below it, one ulp up."""
    exact = x.astype(np.float64) * np.float64(c)
    near = exact.astype(_F32)
    with np.errstate(invalid="ignore"):
        low = near.astype(np.float64) < exact  # False for inf and NaN
    return np.where(low, np.nextafter(near, _F32(np.inf)), near)


# OpenBLAS runs a GEMM of at most 4 * 65536 multiply-adds (M*N*K) on one thread; above
# that it spawns threads, which on a busy 2-core CI machine thrash (measured: 100x slower).
_GEMM_MNK_SINGLE_THREAD = 4 * 65536


def _matmul(x, y):
    """``x @ y`` over stacked 2-D blocks, rows split so each GEMM stays single-threaded."""
    rows, inner, cols = x.shape[-2], x.shape[-1], y.shape[-1]
    step = max(1, _GEMM_MNK_SINGLE_THREAD // (inner * cols))
    if rows <= step:
        return np.matmul(x, y)
    out = np.empty(np.broadcast_shapes(x.shape[:-2], y.shape[:-2]) + (rows, cols), _F32)
    for r0 in range(0, rows, step):
        np.matmul(x[..., r0:r0 + step, :], y, out=out[..., r0:r0 + step, :])
    return out


def _load_tile(x32, j0: int, bkv: int, kv_start: int, load_hi: int) -> np.ndarray:
    """Keys [j0, j0 + bkv) of ``x32: (B, Hkv, n_load, d)``, zero outside [kv_start, load_hi)."""
    lo, hi = max(j0, kv_start), min(j0 + bkv, load_hi)
    if lo == j0 and hi == j0 + bkv:
        return x32[:, :, j0:hi]
    tile = np.zeros(x32.shape[:2] + (bkv, x32.shape[3]), _F32)
    if hi > lo:
        tile[:, :, lo - j0:hi - j0] = x32[:, :, lo:hi]
    return tile
