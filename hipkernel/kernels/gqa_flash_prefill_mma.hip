// gqa_flash_prefill_mma.hip: the fused GQA flash-attention prefill on NVIDIA tensor cores
// (mma.sync m16n8k16, fp16 or bf16 in, fp32 accumulate; sm_80 and newer), FlashAttention-2
// style.
//
// NVIDIA ONLY. This file has no AMD implementation: hipkernel.config offers its
// configs (path "mma") only for sm_80+ targets, and AMD keeps gqa_flash_prefill.hip.
//
// Device code only, with the same ABI and entry name as gqa_flash_prefill.hip (so the launch
// code is shared; docs/ARCHITECTURE.md "Kernel ABI"):
//   compile-time  HEAD_DIM (64 | 128), M_TILES (16-row groups), BKV (keys per tile),
//                 WARP_M (16-row groups a warp owns, 1 or 2; default 1),
//                 PACK (query heads of one KV head a block packs, 1, 2, 4 or 8; default 1),
//                 QWALK (Q tiles a block walks, 1, 2, 4 or 8; default 1),
//                 HK_BF16 (0 | 1: q, k, v, out, and P before P.V, in bf16; portable.h)
//   grid          (ceil(ceil(Sq / BP) / QWALK), Hq / PACK, B): block x takes Q tiles
//                 [QWALK x, QWALK x + QWALK) in turn. A Q tile is BM = 16 * M_TILES rows,
//                 BP = BM / PACK query positions of PACK heads: row r of Q tile qt is position
//                 BP qt + r / PACK of head PACK y + r % PACK (GQA packing: the heads share
//                 their K/V tiles, and a window spans BP positions, not BM). Needs
//                 (Hq / Hkv) % PACK == 0, which the host checks.
//   block         32 * M_TILES / WARP_M threads: warp w owns block rows [WR w, WR w + WR),
//                 WR = 16 * WARP_M; in each 16-row group f of them, lane l holds rows
//                 g = l >> 2 and g + 8 of the MMA fragments (portable.h), both of head
//                 PACK y + g % PACK
//   shared        static only: KV_STAGES x (K tile + V tile), BKV x (HEAD_DIM + 8) halves each
//                 (8 halves of padding per row make ldmatrix conflict-free); two stages
//                 (cp.async double buffering) when they fit in 48 KiB, else one; with
//                 QWALK > 1, KV_RING of them when that is more (as many as fit in 48 KiB)
//                 (hipkernel.config.KernelConfig.smem_bytes mirrors this)
//   pointers      q, k, v, out 16-byte aligned
//   ragged        block z = b is sequence b, with its own lengths (past_lens / q_lens, null:
//                 past_len / Sq for every sequence; seq_lengths): its valid rows i < q_len[b]
//                 at past_len[b] + i, its own keys j < past_len[b] + q_len[b]; padded rows
//                 (q_len[b] <= i < Sq) stored as zeros, and a Q tile wholly in the padding
//                 stores its zeros and walks no KV tile
//
// The algorithm is hipkernel/model.py's docstring, the same as the scalar kernel's, step for
// step: start-tile clamp from the Q tile's first row, the per-row visibility predicate,
// zero-fill on load of keys j >= skv and j < kv_start, the all-masked-tile NaN guard, the
// sink epilogue in exp2 space with the max over the sink, out = acc * (fac * (1 / l)) (0 when
// l == 0).
// What differs is only how the products are done:
//   S = Q K^T    Q fragments live in registers for the whole block; K fragments come from
//                shared memory by ldmatrix, each used by the warp's WARP_M row groups (with
//                WARP_M = 2 a fragment read from shared memory feeds two MMAs, which halves
//                the shared-memory traffic per MMA); S accumulates in fp32 registers.
//   softmax      on the accumulator fragments: a row is held by the 4 lanes 4g..4g+3, so its
//                max and sum take two xor-shuffles.
//   O += P V     P is rounded to fp16 (bf16 in a bf16 kernel) and reused in registers as the A operand (the S
//                accumulator layout of two adjacent 8-key blocks is the A layout of one
//                16-key chunk); V fragments come by ldmatrix.trans, reused like K's.
//                model.py rounds P the same way for path "mma".
// A warp skips a KV tile in which none of its rows sees a key (causal diagonal, window
// edge). The model walks such tiles for every row, and there they change nothing exactly
// (m_new = m or the NaN guard holds, alpha = 1, p = 0), so skipping is bit-identical. Three
// mutants make such a tile matter (no_nan_guard: exp2(-inf - -inf); tail_unmasked and
// window_skip_off: 0 * NaN in P.V), so under them the warp walks every tile as the model does.
// Mutants (refattn/mutants.py) are -DHIPKERNEL_MUTANT_<NAME>=1, each an #ifdef where it bites,
// at the same places as in gqa_flash_prefill.hip.
//
// The wgmma path shares these per-row steps through flash_rows.h; this file keeps its own
// copy on purpose. Built on flash_rows.h (same steps, same register counts within one) it
// ran 5-7% slower on the H200 at d = 64, full attention (mma_m8_b64_w2 512@8192 0.264 vs
// 0.246 ms, 16384@0 8.1 vs 7.7 ms; mma_m4_b64 0.336 vs 0.321 ms), on sm_90 and sm_90a alike.

#include "portable.h"

#if !HK_CUDA
#error "gqa_flash_prefill_mma.hip is NVIDIA-only (mma.sync, ldmatrix, cp.async); AMD uses gqa_flash_prefill.hip"
#endif
#if !defined(HEAD_DIM) || !defined(M_TILES) || !defined(BKV)
#error "compile with -DHEAD_DIM=<64|128> -DM_TILES=<m> -DBKV=<keys per tile>"
#endif
#if HEAD_DIM % 32 != 0
#error "HEAD_DIM must be a multiple of 32 (ldmatrix.x4 reads 32 dims of a K row at a time)"
#endif
#if (BKV & (BKV - 1)) != 0 || BKV < 16
#error "BKV must be a power of two >= 16 (P.V consumes 16 keys per MMA)"
#endif
#ifndef WARP_M
#define WARP_M 1
#endif
#if (WARP_M != 1 && WARP_M != 2) || M_TILES % WARP_M != 0
#error "WARP_M must be 1 or 2 and divide M_TILES"
#endif
#ifndef PACK
#define PACK 1
#endif
#if PACK != 1 && PACK != 2 && PACK != 4 && PACK != 8
#error "PACK must be 1, 2, 4 or 8 (it divides the 8 rows g of a fragment half)"
#endif

#define BM (16 * M_TILES)                // query rows per block
#define BP (BM / PACK)                   // ... which are BP positions of PACK heads
#define WR (16 * WARP_M)                 // query rows per warp
#define NTHREADS (32 * M_TILES / WARP_M) // one warp per WR rows
#define VPR (HEAD_DIM / 8)        // 16-byte vectors per K/V row
#define KV_STRIDE (HEAD_DIM + 8)  // halves per shared K/V row: 16 bytes of padding
#define KV_TILE (BKV * KV_STRIDE) // halves per shared K or V tile
#if 2 * 2 * BKV * (HEAD_DIM + 8) * 2 <= 48 * 1024
#define KV_STAGES 2  // double-buffered: tile t + 1 streams in while tile t is computed
#else
#define KV_STAGES 1
#endif
// QWALK = n > 1: block x walks the n consecutive Q tiles [n x, n x + n) of its heads, one
// after the other. Under a window whose KV span fits the ring, the K/V tiles they share stay
// in a ring of KV_RING slots (as many K + V tiles as 48 KiB holds) and each is loaded once;
// otherwise each Q tile streams its KV tiles double-buffered, as a block of one Q tile does.
#ifndef QWALK
#define QWALK 1
#endif
#define KV_RING ((48 * 1024) / (2 * KV_TILE * 2))
#if QWALK > 1 && KV_RING > KV_STAGES
#define KV_SLOTS KV_RING
#else
#define KV_SLOTS KV_STAGES
#endif
#define NB_S (BKV / 8)        // 8-key blocks of the score tile (MMA n)
#define KC_S (HEAD_DIM / 16)  // 16-dim chunks of Q K^T (MMA k)
#define KC_P (BKV / 16)       // 16-key chunks of P V (MMA k)
#define NB_O (HEAD_DIM / 8)   // 8-dim blocks of the output (MMA n)

// Tiles that cannot change a row's state may be skipped (see the header), except under the
// three mutants for which they do (window_skip_off: the skip of the tiles left of a warp's
// window is the window skip the mutant removes).
#if !defined(HIPKERNEL_MUTANT_NO_NAN_GUARD) && !defined(HIPKERNEL_MUTANT_TAIL_UNMASKED) && \
    !defined(HIPKERNEL_MUTANT_WINDOW_SKIP_OFF)
#define WARP_SKIP 1
#else
#define WARP_SKIP 0
#endif

#define LOG2E 1.4426950408889634f  // exp(x) = exp2(x * LOG2E)

// Blocks an SM should hold at once: ptxas plans for 65536 / (NTHREADS * MIN_BLOCKS)
// registers a thread; 0: no minimum (ptxas' own heuristic). Picked from a sweep on the H200
// (scripts/mma_check.py --sections sweep) among the choices that do not spill:
//   d = 64, BKV = 32   16 warps an SM (128 registers): 0.33 ms at 512@8192 vs 0.36 ms with 0
//   d = 64, BKV = 64   12 warps an SM (170 registers; ptxas takes ~166): 0.32 ms. A cap of
//                      128 (which ptxas' heuristic picks by itself on sm_80) spills.
//   d = 128            1: ptxas takes ~230 and 185 for BKV = 64 and 32 (lower caps spill)
//   WARP_M = 2         1: twice the accumulators; no cap below ptxas' own choice
#ifndef MIN_BLOCKS
#if WARP_M == 2
#define MIN_BLOCKS 1
#elif HEAD_DIM <= 64 && BKV <= 32
#define MIN_BLOCKS (512 / NTHREADS)
#elif HEAD_DIM <= 64
#define MIN_BLOCKS (384 / NTHREADS > 0 ? 384 / NTHREADS : 1)
#else
#define MIN_BLOCKS 1
#endif
#endif
#if MIN_BLOCKS > 0
#define MMA_LAUNCH_BOUNDS __launch_bounds__(NTHREADS, MIN_BLOCKS)
#else
#define MMA_LAUNCH_BOUNDS __launch_bounds__(NTHREADS)
#endif

// The window's lower bound: key j is inside a window of W keys (self included) ending at
// absolute position p iff j >= window_lo(p, W) = p - W + 1.
HK_INLINE int window_lo(int p, int window) {
#ifdef HIPKERNEL_MUTANT_WINDOW_MASK_OFF_BY_ONE
    return p - window;  // W + 1 keys
#else
    return p - window + 1;
#endif
}

// Key j is visible from absolute query position p: causal, and under a window (W > 0)
// j >= p - W + 1. W < 0: no window.
HK_INLINE bool visible(int p, int j, int window) {
    return j <= p && (window < 0 || j >= window_lo(p, window));
}

// Sequence b's lengths (a ragged batch; null pointers: the uniform call): `past`, its
// past_len; `rows`, its valid rows q_len[b]; `skv`, the keys it may read, past + rows.
HK_INLINE void seq_lengths(const int* past_lens, const int* q_lens, int b, int past_len, int Sq,
                           int& past, int& rows, int& skv) {
    past = past_lens != nullptr ? past_lens[b] : past_len;
    rows = q_lens != nullptr ? q_lens[b] : Sq;
    skv = past + rows;
#ifdef HIPKERNEL_MUTANT_RAGGED_MAX_DIAG
    // every sequence takes the batch's longest lengths: the diagonal of max_s past_len[s]
    // and the key bound max_s (past_len[s] + q_len[s]), past its own cache
    for (int s = 0; s < hk_grid_z(); ++s) {
        const int ps = past_lens != nullptr ? past_lens[s] : past_len;
        const int ks = ps + (q_lens != nullptr ? q_lens[s] : Sq);
        past = ps > past ? ps : past;
        skv = ks > skv ? ks : skv;
    }
#endif
}

// The rows a Q tile computes, [0, n): the valid rows (n = rows). Under padded_row_next_seq a
// padded row is computed as an ordinary row and stored: every row below Sq.
HK_INLINE int computed_rows(int rows, int Sq) {
#ifdef HIPKERNEL_MUTANT_PADDED_ROW_NEXT_SEQ
    (void)rows;
    return Sq;
#else
    (void)Sq;
    return rows;
#endif
}

// The sequence whose cache the Q tile of first row i0 reads, and its key bound skv (in: the
// sequence's own): sequence b. Under padded_row_next_seq a Q tile wholly in the padding
// (i0 >= rows, the valid rows) reads sequence (b + 1) % B's cache up to key
// min(S_cap, past + Sq); a tile that straddles rows reads sequence b's, whose K/V tiles all
// its rows share.
HK_INLINE int kv_seq(int b, int i0, int rows, int Sq, int S_cap, int past, int& skv) {
#ifdef HIPKERNEL_MUTANT_PADDED_ROW_NEXT_SEQ
    if (i0 >= rows) {
        skv = past + Sq < S_cap ? past + Sq : S_cap;
        return b + 1 < hk_grid_z() ? b + 1 : 0;
    }
#else
    (void)i0, (void)rows, (void)Sq, (void)S_cap, (void)past, (void)skv;
#endif
    return b;
}

// Whether the epilogue stores row i: every row below Sq, a padded row (rows <= i) as zeros;
// under padding_not_written the padded rows are skipped.
HK_INLINE bool row_stored(int i, int rows, int Sq) {
#ifdef HIPKERNEL_MUTANT_PADDING_NOT_WRITTEN
    (void)Sq;
    return i < rows;
#else
    (void)rows;
    return i < Sq;
#endif
}

// The zeros of Q tiles wholly in the padding: out's rows [i_lo, i_hi) of heads [h0, h0 + nh)
// (contiguous in each row), 16 bytes a store by the block's nthreads threads (this one
// `tid`). Under padding_not_written nothing is stored.
HK_INLINE void store_zero_rows(half_t* out, int b, int Sq, int Hq, int h0, int nh, int i_lo, int i_hi,
                               int tid, int nthreads) {
#ifdef HIPKERNEL_MUTANT_PADDING_NOT_WRITTEN
    (void)out, (void)b, (void)Sq, (void)Hq, (void)h0, (void)nh, (void)i_lo, (void)i_hi, (void)tid,
        (void)nthreads;
#else
    const int per_row = nh * (HEAD_DIM / 8);  // 16-byte vectors of a row's heads
    for (int e = tid; e < (i_hi - i_lo) * per_row; e += nthreads) {
        const int i = i_lo + e / per_row;
        hk_vec8* row = (hk_vec8*)(out + (((hk_u64)b * Sq + i) * Hq + h0) * HEAD_DIM);
        row[e % per_row] = hk_vec(0u, 0u, 0u, 0u);
    }
#endif
}

// Two p as a word of the P operand: the storage format (RNE); under bf16_p_as_fp16 a bf16
// kernel converts with the fp16 conversion and P.V reads those bit patterns as bf16.
HK_INLINE unsigned int p_pack(float lo, float hi) {
#if HK_BF16 && defined(HIPKERNEL_MUTANT_BF16_P_AS_FP16)
    return hk_pack_fp16(lo, hi);
#else
    return hk_pack_h2(lo, hi);
#endif
}

extern "C" __global__ MMA_LAUNCH_BOUNDS void gqa_flash_prefill(
    const half_t* HK_RESTRICT q,     // (B, Sq, Hq, D)      contiguous
    const half_t* HK_RESTRICT k,     // (B, Hkv, S_cap, D)  contiguous, S_cap >= past_len + Sq
    const half_t* HK_RESTRICT v,     // (B, Hkv, S_cap, D)
    const half_t* HK_RESTRICT sink,  // (Hq,) natural-log logits, read only when sink_mode == 1
    half_t* HK_RESTRICT out,         // (B, Sq, Hq, D)
    int Sq, int Hq, int Hkv, int S_cap, int past_len,
    int window,                      // -1 = none, else W >= 1 keys (ORT convention)
    int sink_mode,                   // 0 none, 1 per-head sink[h], 2 smooth (sigma = 0)
    float scale,
    const int* HK_RESTRICT past_lens,  // (B,) per-sequence past_len, or null: past_len for all
    const int* HK_RESTRICT q_lens) {   // (B,) valid query rows, <= Sq, or null: Sq for all
    __shared__ __attribute__((aligned(16))) half_t k_s[KV_SLOTS * KV_TILE];  // keys x dims
    __shared__ __attribute__((aligned(16))) half_t v_s[KV_SLOTS * KV_TILE];

    const int tid = hk_thread_x();
    const int warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2;  // this lane's fragment rows are g and g + 8
    const int t4 = lane & 3;  // ... and its fragment columns 2 * t4, 2 * t4 + 1 (+ 8)
    const int b = hk_block_z();
    const int h0 = PACK * hk_block_y();  // the block's first head; lane row heads h0 + g % PACK
    const int h = h0 + g % PACK;         // this lane's rows' head
#if defined(HIPKERNEL_MUTANT_GQA_MODULO)
    const int kvh = h0 % Hkv;
#elif defined(HIPKERNEL_MUTANT_HEAD_TILE_CROSSES_GROUP)
    const int kvh = (h0 & ~15) / (Hq / Hkv);  // the 16-head tile's first head (PACK divides 16)
#else
    const int kvh = h0 / (Hq / Hkv);  // G = Hq / Hkv query heads share a KV head
#endif
    int past_b, rows, skv_b;  // this sequence's past_len, valid rows and keys (seq_lengths)
    seq_lengths(past_lens, q_lens, b, past_len, Sq, past_b, rows, skv_b);
#ifdef HIPKERNEL_MUTANT_PAST_LEN_IGNORED
    const int past = 0;  // top-left causal alignment
#else
    const int past = past_b;  // row i sits at absolute position past_len[b] + i
#endif

#if QWALK > 1
    // The ring serves a launch whose every Q tile's KV tiles fit in it: a window, and at
    // most KV_SLOTS tiles from a Q tile's first key (p - W + 1, at offset lo in its tile)
    // to its last (p + BP - 1). The offsets depend on the Q tiles' first positions mod BKV
    // only, so one bound holds for every block (hipkernel.config.KernelConfig.ring_serves
    // mirrors it).
    bool ring = false;
    // (not under window_skip_off, whose walks start at key 0, nor padded_row_next_seq, whose
    // Q tiles in the padding read another sequence's cache)
#if KV_SLOTS > KV_STAGES && !defined(HIPKERNEL_MUTANT_WINDOW_SKIP_OFF) && !defined(HIPKERNEL_MUTANT_PADDED_ROW_NEXT_SEQ)
    if (window > 0) {
        int span_max = 0;
        for (int r = 0; r < (BKV > BP ? BKV / BP : 1); ++r) {
            const int lo = ((past + r * BP - window + 1) % BKV + BKV) % BKV;
            const int span = (lo + BP + window - 1 + BKV - 1) / BKV;
            span_max = span > span_max ? span : span_max;
        }
        ring = span_max <= KV_SLOTS;
    }
#endif
    const int nqt = (Sq + BP - 1) / BP;
    const int qt_first = hk_block_x() * QWALK;
    const int qt_stop = qt_first + QWALK < nqt ? qt_first + QWALK : nqt;
#else
    const int qt_first = hk_block_x(), qt_stop = qt_first + 1;
#endif
    // The block's Q tiles wholly in the padding, [qt_pad, qt_stop), walk no KV tile and store
    // their zeros (all PACK heads of their positions) after the others' walk (stored before
    // it, ptxas spilled mma_m4_b64 and the walking tiles).
    const int n_rows = computed_rows(rows, Sq);  // a Q tile computes its rows i < n_rows
    const int qt_live = (n_rows + BP - 1) / BP;
    const int qt_pad = qt_live < qt_first ? qt_first : qt_live < qt_stop ? qt_live : qt_stop;
#if QWALK > 1
    int loaded = 0;  // with the ring: the next KV tile to load (the ring holds those below)
    for (int qt = qt_first; qt < qt_pad; ++qt) {
#else
    if (qt_first < qt_pad) {
        const int qt = qt_first;
#endif
        // This Q tile's positions, the sequence whose keys it reads (keys j < skv of sequence
        // kv_b) and the KV range its rows can reach.
        const int i0 = qt * BP;
        int skv = skv_b;
        const int kv_b = kv_seq(b, i0, rows, Sq, S_cap, past_b, skv);
        const int i_last = (i0 + BP < n_rows ? i0 + BP : n_rows) - 1;
        const int p_first = past + i0, p_last = past + i_last;
        const int kv_end = p_last + 1;
#ifdef HIPKERNEL_MUTANT_WINDOW_SKIP_OFF
        const int kv_start = 0;  // no start clamp: the walk and the loads start at key 0
#else
        const int kv_start = window > 0 ? (p_first - window + 1 > 0 ? p_first - window + 1 : 0) : 0;
#endif
        // Start-tile clamp from the tile's FIRST row: the rows' lower bounds p - W + 1 are
        // non-decreasing, so this start covers every row and the mask trims the rest.
#ifdef HIPKERNEL_MUTANT_CLAMP_FROM_LAST_ROW
        int t0 = window > 0 ? (p_last - window + 1 > 0 ? p_last - window + 1 : 0) / BKV : 0;
#else
        int t0 = kv_start / BKV;
#endif
#ifdef HIPKERNEL_MUTANT_CLAMP_PLUS_ONE_TILE
        t0 += 1;
#endif
        const int t_end = (kv_end + BKV - 1) / BKV;

        // The sink logit in exp2 space; the epilogue folds it in once.
#if defined(HIPKERNEL_MUTANT_SINK_IGNORED)
        const bool has_sink = false;
#elif defined(HIPKERNEL_MUTANT_SMOOTH_IGNORED)
        const bool has_sink = sink_mode == 1;
#else
        const bool has_sink = sink_mode == 1 || sink_mode == 2;
#endif
        const float sigma = sink_mode == 1 ? hk_fp16_value(sink[h]) : 0.0f;  // fp16 in every kernel
#ifdef HIPKERNEL_MUTANT_SINK_NO_LOG2E
        const float sig2 = sigma;
#else
        const float sig2 = sigma * LOG2E;
#endif

        // This warp's WR rows, at positions [iw, iw + WR / PACK); this lane's rows are block rows
        // WR w + 16f + g + 8r (group f, r = 0, 1), at positions i0 + (WR w + 16f + g + 8r) / PACK.
        const int iw = i0 + WR * warp / PACK;
        const bool warp_live = iw < n_rows;  // a warp wholly past its valid rows computes nothing
        const int pw_first = past + iw, pw_last = pw_first + WR / PACK - 1;
        int p_r[WARP_M][2], i_r[WARP_M][2];
        bool ok_r[WARP_M][2];
#pragma unroll
        for (int f = 0; f < WARP_M; ++f)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                i_r[f][r] = i0 + (WR * warp + 16 * f + g + 8 * r) / PACK;
                p_r[f][r] = past + i_r[f][r];
                ok_r[f][r] = i_r[f][r] < n_rows;  // padded rows and rows past Sq compute with q = 0
            }

        // Q as A fragments, for the whole block: qf[f][kc] holds dims [16kc, 16kc + 16) of group f.
        unsigned int qf[WARP_M][KC_S][4];
#pragma unroll
        for (int f = 0; f < WARP_M; ++f) {
            const half_t* qrow[2];
#pragma unroll
            for (int r = 0; r < 2; ++r)
                qrow[r] = q + (((hk_u64)b * Sq + (ok_r[f][r] ? i_r[f][r] : 0)) * Hq + h) * HEAD_DIM + 2 * t4;
#pragma unroll
            for (int kc = 0; kc < KC_S; ++kc)
#pragma unroll
                for (int e = 0; e < 4; ++e) {  // e: (row g, k lo) (row g+8, k lo) (g, k hi) (g+8, k hi)
                    const int r = e & 1;
                    qf[f][kc][e] = ok_r[f][r] ? *(const unsigned int*)(qrow[r] + 16 * kc + 8 * (e >> 1)) : 0u;
                }
        }
        const float c2 = scale * LOG2E;  // s2 = c2 * dot(q, k): logits in exp2 space

        // Online-softmax state of this lane's rows (the 4 lanes of a row hold the same m, l).
        float m[WARP_M][2], l[WARP_M][2];
        float o[WARP_M][NB_O][4];  // O accumulator fragments: o[f][nd] holds dims [8nd, 8nd + 8)
#pragma unroll
        for (int f = 0; f < WARP_M; ++f) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
#ifdef HIPKERNEL_MUTANT_MAX_FLOOR
                m[f][r] = -1.0e4f;  // a finite floor (exp2 units) for the running max
#else
                m[f][r] = hk_neg_inf();
#endif
                l[f][r] = 0.0f;
            }
#pragma unroll
            for (int nd = 0; nd < NB_O; ++nd)
#pragma unroll
                for (int e = 0; e < 4; ++e) o[f][nd][e] = 0.0f;
        }

        const hk_u64 kv_base = ((hk_u64)kv_b * Hkv + kvh) * (hk_u64)S_cap * HEAD_DIM;
        const half_t* kg = k + kv_base;
        const half_t* vg = v + kv_base;
        const unsigned int k_s0 = hk_smem_u32(k_s), v_s0 = hk_smem_u32(v_s);
        // ldmatrix row addresses of this lane (bytes), relative to a tile:
        //   K (x4 = dims 32kk + 8m, m = lane >> 3, of keys 8nb + (lane & 7)): b0, b1 of chunk 2kk
        //     and b0, b1 of chunk 2kk + 1, for key block nb;
        //   V (x4.trans = keys 16kc + (lane & 7) + 8 ((lane >> 3) & 1), dims 8 (nd + (lane >> 4))):
        //     b0, b1 of dim block nd, then b0, b1 of dim block nd + 1, for key chunk kc.
        const unsigned int k_lane = 2u * ((lane & 7) * KV_STRIDE + 8 * (lane >> 3));
        const unsigned int v_lane = 2u * (((lane & 7) + 8 * ((lane >> 3) & 1)) * KV_STRIDE + 8 * (lane >> 4));

        // Stage KV tile t into buffer st: 16-byte cp.async per thread, zero-filling keys no row
        // of this block may see: past skv (cache padding) and below kv_start (below every row's
        // window). P.V multiplies p = 0 by them, and 0 * NaN would still be NaN. One pass of the
        // block copies LD_KEYS key rows; thread tid copies column ld_c of rows ld_key + LD_KEYS i.
#define LD_KEYS (NTHREADS / VPR)
        const int ld_key = tid / VPR, ld_c = tid % VPR;
        const hk_u64 ld_src = (hk_u64)ld_key * HEAD_DIM + 8 * ld_c;
        const unsigned int ld_dst = 2u * (ld_key * KV_STRIDE + 8 * ld_c);
        auto load_tile = [&](int t, int st) {
            const int j0 = t * BKV;
            const half_t* kt = kg + ((hk_u64)j0 * HEAD_DIM + ld_src);
            const half_t* vt = vg + ((hk_u64)j0 * HEAD_DIM + ld_src);
#pragma unroll
            for (int it = 0; it < (BKV + LD_KEYS - 1) / LD_KEYS; ++it) {
                const int key = ld_key + it * LD_KEYS;
                if (BKV % LD_KEYS == 0 || key < BKV) {
                    const int j = j0 + key;
#ifdef HIPKERNEL_MUTANT_TAIL_UNMASKED
                    const bool keep = j >= kv_start && j < S_cap;  // raw past skv: NaN canaries
#else
                    const bool keep = j >= kv_start && j < skv;
#endif
                    // a key not kept reads nothing (src-size 0); its address is the base anyway
                    const unsigned int dst = ld_dst + 2u * (st * KV_TILE + it * LD_KEYS * KV_STRIDE);
                    hk_cp_async_16(k_s0 + dst, keep ? kt + it * LD_KEYS * HEAD_DIM : kg, keep);
                    hk_cp_async_16(v_s0 + dst, keep ? vt + it * LD_KEYS * HEAD_DIM : vg, keep);
                }
            }
        };

        // One KV tile t in slot st: S = Q K^T, the online softmax, acc += P V.
        auto compute_tile = [&](int t, int st) {
            const int j0 = t * BKV;
#if WARP_SKIP
            const bool skip = !warp_live || j0 > pw_last ||
                              (window > 0 && j0 + BKV - 1 < window_lo(pw_first, window));
#else
            const bool skip = !warp_live;
#endif
            if (!skip) {
                const unsigned int k_t = k_s0 + 2u * st * KV_TILE + k_lane;
                const unsigned int v_t = v_s0 + 2u * st * KV_TILE + v_lane;

                // S = Q K^T, fp32: each K fragment feeds every row group of the warp.
                float s[WARP_M][NB_S][4];
#pragma unroll
                for (int f = 0; f < WARP_M; ++f)
#pragma unroll
                    for (int nb = 0; nb < NB_S; ++nb)
#pragma unroll
                        for (int e = 0; e < 4; ++e) s[f][nb][e] = 0.0f;
#pragma unroll
                for (int kk = 0; kk < HEAD_DIM / 32; ++kk)
#pragma unroll
                    for (int nb = 0; nb < NB_S; ++nb) {
                        unsigned int kb[4];
                        hk_ldmatrix_x4(kb, k_t + 2u * (8 * nb * KV_STRIDE + 32 * kk));
#pragma unroll
                        for (int f = 0; f < WARP_M; ++f) {
                            hk_mma_16816(s[f][nb], qf[f][2 * kk], kb[0], kb[1]);
                            hk_mma_16816(s[f][nb], qf[f][2 * kk + 1], kb[2], kb[3]);
                        }
                    }

                // Invisible keys get -inf. Element e of s[nb] is row g + 8 (e >> 1), key
                // j0 + 8nb + 2 t4 + (e & 1). A tile every row of the warp sees whole needs no
                // per-element test.
                const bool whole = j0 + BKV - 1 <= pw_first &&
                                   (window < 0 || j0 >= window_lo(pw_last, window));
                if (!whole) {
#pragma unroll
                    for (int f = 0; f < WARP_M; ++f)
#pragma unroll
                        for (int nb = 0; nb < NB_S; ++nb)
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                const int j = j0 + 8 * nb + 2 * t4 + (e & 1);
                                if (!visible(p_r[f][e >> 1], j, window)) s[f][nb][e] = hk_neg_inf();
                            }
                }
#pragma unroll
                for (int f = 0; f < WARP_M; ++f) {
                    // The row max of the logits in exp2 space, s2 = c2 * dot: c2 > 0, so max_j s2_j =
                    // c2 max_j dot_j, which m takes rounded up (portable.h): every p_j <= 1.
                    float m_tile[2] = {hk_neg_inf(), hk_neg_inf()};
#pragma unroll
                    for (int nb = 0; nb < NB_S; ++nb)
#pragma unroll
                        for (int e = 0; e < 4; ++e) m_tile[e >> 1] = hk_fmax(m_tile[e >> 1], s[f][nb][e]);

                    // Online softmax per row. NaN guard: a row that has seen nothing so far and sees
                    // nothing in this tile (m_new = -inf) keeps (m, l, acc): it takes alpha = 1 and
                    // p = 0 instead of exp2(-inf - -inf) = NaN.
                    //   p_j = exp2(s2_j - m_new) = exp2(fma(dot_j, c2, -m_new)), one FFMA and one MUFU;
                    //   an invisible key (dot = -inf) gives exp2(-inf) = 0 with no select. A row that
                    //   does not update has only invisible keys: its shift is 0, so its p are 0 too.
                    float m_new[2], alpha[2], neg_m[2], l_tile[2] = {0.0f, 0.0f};
                    bool update[2];
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        m_tile[r] = hk_fmax(m_tile[r], hk_xor(m_tile[r], 1));  // the row's 4 lanes
                        m_tile[r] = hk_fmax(m_tile[r], hk_xor(m_tile[r], 2));
                        m_new[r] = hk_fmax(m[f][r], hk_mul_up(c2, m_tile[r]));  // rounded up: p <= 1
#ifdef HIPKERNEL_MUTANT_NO_NAN_GUARD
                        update[r] = true;  // m_new = -inf: alpha and p become exp2(-inf - -inf) = NaN
#else
                        update[r] = m_new[r] != hk_neg_inf();
#endif
                        alpha[r] = update[r] ? hk_exp2_ftz(m[f][r] - m_new[r]) : 1.0f;  // 0 when m = -inf
                        neg_m[r] = update[r] ? -m_new[r] : 0.0f;
                    }
#pragma unroll
                    for (int nb = 0; nb < NB_S; ++nb)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int r = e >> 1;
                            const float pj = hk_exp2_ftz(hk_fma(s[f][nb][e], c2, neg_m[r]));
                            s[f][nb][e] = pj;
                            l_tile[r] += pj;
                        }
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        l_tile[r] += hk_xor(l_tile[r], 1);  // the row's sum over the whole tile
                        l_tile[r] += hk_xor(l_tile[r], 2);
                        l[f][r] = l[f][r] * alpha[r] + l_tile[r];
                        if (update[r]) m[f][r] = m_new[r];
#ifdef HIPKERNEL_MUTANT_SINK_PER_TILE
                        if (has_sink && update[r]) l[f][r] += hk_exp2(sig2 - m_new[r]);  // split-KV bug
#endif
                    }

                    // acc = acc * alpha (P.V follows for every group at once).
#pragma unroll
                    for (int nd = 0; nd < NB_O; ++nd)
#pragma unroll
                        for (int e = 0; e < 4; ++e) o[f][nd][e] *= alpha[e >> 1];
                }  // row group f

                // acc += P.V over every key of the tile, P rounded to fp16 (bf16; p_pack): p = 0
                // times a key no row may see is why the load zero-fills them. Each V fragment
                // feeds every group.
#pragma unroll
                for (int kc = 0; kc < KC_P; ++kc) {
                    // The S fragments of key blocks 2kc and 2kc + 1 are the A fragment of chunk kc.
                    unsigned int pa[WARP_M][4];
#pragma unroll
                    for (int f = 0; f < WARP_M; ++f) {
                        pa[f][0] = p_pack(s[f][2 * kc][0], s[f][2 * kc][1]);
                        pa[f][1] = p_pack(s[f][2 * kc][2], s[f][2 * kc][3]);
                        pa[f][2] = p_pack(s[f][2 * kc + 1][0], s[f][2 * kc + 1][1]);
                        pa[f][3] = p_pack(s[f][2 * kc + 1][2], s[f][2 * kc + 1][3]);
                    }
#pragma unroll
                    for (int nd = 0; nd < NB_O; nd += 2) {
                        unsigned int vb[4];
                        hk_ldmatrix_x4_trans(vb, v_t + 2u * (16 * kc * KV_STRIDE + 8 * nd));
#pragma unroll
                        for (int f = 0; f < WARP_M; ++f) {
                            hk_mma_16816(o[f][nd], pa[f], vb[0], vb[1]);
                            hk_mma_16816(o[f][nd + 1], pa[f], vb[2], vb[3]);
                        }
                    }
                }
            }
        };

#if QWALK > 1
        if (ring) {
            // The ring holds tiles [loaded - KV_SLOTS, loaded) in slots t % KV_SLOTS; this Q tile
            // needs [t0, t_end), and its new tiles go to the slots of tiles below t0 (its span is
            // at most KV_SLOTS), which no later Q tile needs either (t0 never decreases). They
            // are one cp.async group that lands while the tiles already in the ring are computed.
            // The zero-fill of a new tile is this Q tile's (below kv_start, past skv); a later Q
            // tile masks the keys between the two kv_starts, real keys, so p = 0 and P.V adds 0.
            // (Under the window_mask_off_by_one mutant one of them, p - W, is visible: a real key
            // here, a zero in the model, which walks no Q tiles; either way the output moves.)
            if (qt > qt_first) hk_sync();  // the last Q tile's warps are done with the ring
            if (qt == qt_first || loaded < t0) loaded = t0;
            const int fresh = loaded;
            for (int t = fresh; t < t_end; ++t) load_tile(t, t % KV_SLOTS);
            hk_cp_async_commit();
            if (loaded < t_end) loaded = t_end;
            for (int t = t0; t < t_end; ++t) {
                if (t == fresh) {
                    hk_cp_async_wait<0>();
                    hk_sync();  // every thread's copies of the new tiles are visible
                }
                compute_tile(t, t % KV_SLOTS);
            }
        } else
#endif
        {
            if (t0 < t_end) {
                load_tile(t0, 0);
                hk_cp_async_commit();
            }
            for (int t = t0; t < t_end; ++t) {
#if KV_STAGES == 2
                const int st = (t - t0) & 1;
                if (t + 1 < t_end) {
                    load_tile(t + 1, st ^ 1);  // streams in while this tile is computed
                    hk_cp_async_commit();
                    hk_cp_async_wait<1>();     // tile t (the older group) has landed
                } else {
                    hk_cp_async_wait<0>();
                }
#else
                const int st = 0;
                hk_cp_async_wait<0>();
#endif
                hk_sync();  // every thread's copies of tile t are visible
                compute_tile(t, st);
                hk_sync();  // tile t is consumed: its buffer may be refilled
#if KV_STAGES == 1
                if (t + 1 < t_end) {
                    load_tile(t + 1, 0);
                    hk_cp_async_commit();
                }
#endif
            }
        }

        // Epilogue: fold the sink into the denominator once, with the max taken over it too
        // (acc and l times fac); out = acc * scale, scale = fac * (1 / l): one correctly
        // rounded reciprocal and one product a row, acc multiplied once (the model rounds the
        // same way); 0 for a row with nothing in its denominator (a NaN l stays NaN).
#pragma unroll
        for (int f = 0; f < WARP_M; ++f)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float fac = 1.0f, l_fin = l[f][r];
            if (has_sink) {
#ifdef HIPKERNEL_MUTANT_SINK_MAX_SKIPPED
                const float m_fin = m[f][r];  // exp2(sig2 - m) overflows for a large sink
#else
                const float m_fin = hk_fmax(m[f][r], sig2);
#endif
                fac = m[f][r] == hk_neg_inf() ? 0.0f : hk_exp2(m[f][r] - m_fin);  // row saw nothing: 0
                l_fin *= fac;
#ifndef HIPKERNEL_MUTANT_SINK_PER_TILE
#ifdef HIPKERNEL_MUTANT_SINK_UNSHIFTED
                l_fin += sig2 == hk_neg_inf() ? 0.0f : hk_exp2(sig2);  // not shifted by the max
#else
                l_fin += sig2 == hk_neg_inf() ? 0.0f : hk_exp2(sig2 - m_fin);
#endif
#endif
            }
            // Lane (g, t4) writes dims 8nd + 2 t4, 8nd + 2 t4 + 1 of its row; a padded row
            // (n_rows <= i < Sq) zeros.
            if (row_stored(i_r[f][r], n_rows, Sq)) {
                half_t* orow = out + (((hk_u64)b * Sq + i_r[f][r]) * Hq + h) * HEAD_DIM + 2 * t4;
                const float scale = l_fin == 0.0f ? 0.0f : fac * hk_rcp(l_fin);
#pragma unroll
                for (int nd = 0; nd < NB_O; ++nd)
                    *(unsigned int*)(orow + 8 * nd) =
                        ok_r[f][r] ? hk_pack_h2(o[f][nd][2 * r] * scale, o[f][nd][2 * r + 1] * scale) : 0u;
            }
        }
    }  // Q tile
    if (qt_pad < qt_stop)
        store_zero_rows(out, b, Sq, Hq, h0, PACK, qt_pad * BP, qt_stop * BP < Sq ? qt_stop * BP : Sq, tid, NTHREADS);
}
