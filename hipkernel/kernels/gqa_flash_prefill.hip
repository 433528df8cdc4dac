// gqa_flash_prefill.hip: fused GQA flash-attention prefill with per-head sinks, smooth
// softmax, a sliding window and chunked prefill over a KV cache, for uniform and ragged
// batches (per-sequence past_len and q_len), in fp16 or bf16.
//
// Device code only. The algorithm is hipkernel/model.py's docstring, line by line; the
// launch ABI is docs/ARCHITECTURE.md "Kernel ABI":
//   compile-time  HEAD_DIM (64 | 128), M_TILES (rows / 16), BKV (keys per KV tile),
//                 HK_BF16 (0 | 1: q, k, v and out in bf16; portable.h)
//   grid          (ceil(Sq / BM), Hq, B), BM = 16 * M_TILES
//   block         32 * M_TILES threads; query row r of the Q tile is owned by the lane
//                 pair (2r, 2r + 1), each lane holding HEAD_DIM / 2 dims of q and acc
//   shared        static only: K and V tiles (BKV x HEAD_DIM halves each) and the score /
//                 probability tile S = P (BM x BKV floats); see hipkernel.config.smem_bytes
//   pointers      q, k, v, out 16-byte aligned (all accesses are 8 halves wide)
//   ragged        block z = b is sequence b: with past_lens / q_lens (null: past_len / Sq for
//                 every sequence) its rows i < q_len[b] sit at past_len[b] + i and read its
//                 own keys j < past_len[b] + q_len[b]; its padded rows (q_len[b] <= i < Sq)
//                 are stored as zeros, and a block wholly in the padding stores its zeros
//                 and walks no KV tile
// P stays fp32 through P.V here (no 16-bit P operand), in an fp16 and a bf16 kernel alike.
// Mutants (refattn/mutants.py) are -DHIPKERNEL_MUTANT_<NAME>=1, each an #ifdef where it bites.

#include "portable.h"

#if !defined(HEAD_DIM) || !defined(M_TILES) || !defined(BKV)
#error "compile with -DHEAD_DIM=<64|128> -DM_TILES=<m> -DBKV=<keys per tile>"
#endif
#if HEAD_DIM % 16 != 0
#error "HEAD_DIM must be a multiple of 16 (each lane of a pair holds HEAD_DIM/2 dims in 16-byte chunks)"
#endif
#if (BKV & (BKV - 1)) != 0 || BKV < 16
#error "BKV must be a power of two >= 16"
#endif

#define BM (16 * M_TILES)        // query rows per block
#define NTHREADS (32 * M_TILES)  // two lanes per row
#define VPR (HEAD_DIM / 8)       // 16-byte vectors per q/k/v row
#define NCH (VPR / 2)            // vectors per lane: the lane holds chunks 2*c + lane_half
// Unroll factors of the per-key loops. Deeper unrolling lets compilers hoist the shared
// loads of many keys at once; at these values no compiler checked spills (see
// hipkernel/build.py): NVRTC sm_80/sm_90, clang-19 gfx1151/gfx942/gfx90a, ROCm 5.2 hiprtc.
#define UNROLL_S 1   // key pairs per step of the score loop
// keys per step of the P.V loop: 1 for bf16 on AMD, where unpacking a bf16 takes an
// instruction and a register a value (fp16 feeds the FMAs directly: v_fma_mix) and at 2
// clang spilled at d 128 (gfx90a m1_b64, gfx1030 m1_b32, gfx1151 m4_b64)
#if HK_BF16 && HK_AMD
#define UNROLL_PV 1
#else
#define UNROLL_PV 2
#endif

// Shared layout. K/V rows need no padding: all rows of the Q tile read the same key at a
// time (a broadcast) and the cooperative store is contiguous. Row r of P is rotated by 2r,
// so the 16 rows of a warp read and write 16 different banks.
#define P_AT(row, key) ((row) * BKV + (((key) + 2 * (row)) & (BKV - 1)))

#define LOG2E 1.4426950408889634f  // exp(x) = exp2(x * LOG2E)

// Key j is visible from absolute query position p: causal, and under a window of W keys
// (self included) j >= p - W + 1. W < 0: no window.
HK_INLINE bool visible(int p, int j, int window) {
#ifdef HIPKERNEL_MUTANT_WINDOW_MASK_OFF_BY_ONE
    return j <= p && (window < 0 || j >= p - window);  // W + 1 keys
#else
    return j <= p && (window < 0 || j >= p - window + 1);
#endif
}

// Partial dot product of this lane's q dims with the same dims of a shared K row.
HK_INLINE float half_dot(const float (&qr)[NCH][8], const hk_vec8* krow) {
    float part = 0.0f;
#pragma unroll
    for (int c = 0; c < NCH; ++c) {
        const hk_vec8 x = krow[2 * c];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            part = hk_fma(qr[c][2 * e], hk_lo(hk_word(x, e)), part);
            part = hk_fma(qr[c][2 * e + 1], hk_hi(hk_word(x, e)), part);
        }
    }
    return part;
}

extern "C" __global__ HK_LAUNCH_BOUNDS(NTHREADS) void gqa_flash_prefill(
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
    __shared__ hk_vec8 k_s[BKV * VPR];  // K tile, keys x dims
    __shared__ hk_vec8 v_s[BKV * VPR];  // V tile
    __shared__ float p_s[BM * BKV];      // scores, then probabilities, rows x keys (P_AT)

    const int tid = hk_thread_x();
    const int lane_half = tid & 1;  // which chunks of the row, and which keys, this lane holds
    const int row = tid >> 1;
    const int qt = hk_block_x(), h = hk_block_y(), b = hk_block_z();
#if defined(HIPKERNEL_MUTANT_GQA_MODULO)
    const int kvh = h % Hkv;
#elif defined(HIPKERNEL_MUTANT_HEAD_TILE_CROSSES_GROUP)
    const int kvh = (h & ~15) / (Hq / Hkv);  // the KV head of h's 16-head tile's first head
#else
    const int kvh = h / (Hq / Hkv);  // G = Hq / Hkv query heads share a KV head
#endif
    // This sequence's lengths: its past_len, its valid rows ([rows, Sq) is padding) and the
    // keys that exist, skv ([skv, S_cap) of its cache is never read).
    int past_b = past_lens != nullptr ? past_lens[b] : past_len;
    int rows = q_lens != nullptr ? q_lens[b] : Sq;
    int skv = past_b + rows;
#ifdef HIPKERNEL_MUTANT_RAGGED_MAX_DIAG
    // every sequence takes the batch's longest lengths: the diagonal of max_s past_len[s] and
    // the key bound max_s (past_len[s] + q_len[s]), past its own cache
    for (int s = 0; s < hk_grid_z(); ++s) {
        const int ps = past_lens != nullptr ? past_lens[s] : past_len;
        const int ks = ps + (q_lens != nullptr ? q_lens[s] : Sq);
        past_b = ps > past_b ? ps : past_b;
        skv = ks > skv ? ks : skv;
    }
#endif
    const int i0 = qt * BM;
    int kv_b = b;  // the sequence whose cache the block reads
#ifdef HIPKERNEL_MUTANT_PADDED_ROW_NEXT_SEQ
    // padded rows are computed as ordinary rows and stored; a block wholly in the padding
    // reads sequence (b + 1) % B's cache up to key min(S_cap, past_len[b] + Sq)
    if (i0 >= rows) {
        skv = past_b + Sq < S_cap ? past_b + Sq : S_cap;
        kv_b = b + 1 < hk_grid_z() ? b + 1 : 0;
    }
    rows = Sq;
#endif
    if (i0 >= rows) {  // wholly in the padding: its zeros, and no KV tile
#ifndef HIPKERNEL_MUTANT_PADDING_NOT_WRITTEN
        const int n = ((i0 + BM < Sq ? i0 + BM : Sq) - i0) * VPR;
        for (int e = tid; e < n; e += NTHREADS)
            ((hk_vec8*)(out + (((hk_u64)b * Sq + i0 + e / VPR) * Hq + h) * HEAD_DIM))[e % VPR] = hk_vec(0u, 0u, 0u, 0u);
#endif
        return;
    }
#ifdef HIPKERNEL_MUTANT_PAST_LEN_IGNORED
    const int past = 0;  // top-left causal alignment
#else
    const int past = past_b;  // row i sits at absolute position past_len[b] + i
#endif

    // This block's rows and the KV range they can reach.
    const int i_last = (i0 + BM < rows ? i0 + BM : rows) - 1;
    const int p_first = past + i0, p_last = past + i_last;
    const int i = i0 + row;
    const bool row_ok = i < rows;  // padded rows and rows past Sq compute with q = 0
    const int p = past + i;
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

    // This lane's half of the query row, in fp32.
    float qr[NCH][8];
    {
        const hk_vec8* qrow = (const hk_vec8*)(q + (((hk_u64)b * Sq + i) * Hq + h) * HEAD_DIM);
#pragma unroll
        for (int c = 0; c < NCH; ++c) {
            const hk_vec8 x = row_ok ? qrow[2 * c + lane_half] : hk_vec(0u, 0u, 0u, 0u);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                qr[c][2 * e] = hk_lo(hk_word(x, e));
                qr[c][2 * e + 1] = hk_hi(hk_word(x, e));
            }
        }
    }
    const float c2 = scale * LOG2E;  // c2 * dot(q, k): logits in exp2 space

    // Online-softmax state of this row (both lanes of the pair hold the same m and l).
#ifdef HIPKERNEL_MUTANT_MAX_FLOOR
    float m = -1.0e4f, l = 0.0f;  // a finite floor (exp2 units) for the running max
#else
    float m = hk_neg_inf(), l = 0.0f;
#endif
    float acc[NCH][8];
#pragma unroll
    for (int c = 0; c < NCH; ++c)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[c][e] = 0.0f;

    const hk_vec8* k_mine = k_s + lane_half;  // this lane's chunks of the shared K, V rows
    const hk_vec8* v_mine = v_s + lane_half;
    const hk_u64 kv_base = ((hk_u64)kv_b * Hkv + kvh) * (hk_u64)S_cap * HEAD_DIM;
    const hk_vec8* kg = (const hk_vec8*)(k + kv_base);
    const hk_vec8* vg = (const hk_vec8*)(v + kv_base);

    for (int t = t0; t < t_end; ++t) {
        const int j0 = t * BKV;
        hk_sync();  // the previous tile (K, V and P) has been consumed
        // Load the K and V tiles, zero-filling keys no row of this block may see: past skv
        // (cache padding) and below kv_start (below every row's window). P.V multiplies
        // p = 0 by them, and 0 * NaN would still be NaN.
#pragma unroll 4
        for (int it = 0; it < (BKV * VPR + NTHREADS - 1) / NTHREADS; ++it) {
            const int e = it * NTHREADS + tid;
            if ((BKV * VPR) % NTHREADS == 0 || e < BKV * VPR) {
                const int j = j0 + e / VPR;
#ifdef HIPKERNEL_MUTANT_TAIL_UNMASKED
                const bool keep = j >= kv_start && j < S_cap;  // raw past skv: NaN canaries
#else
                const bool keep = j >= kv_start && j < skv;
#endif
                const hk_vec8 zero = hk_vec(0u, 0u, 0u, 0u);
                k_s[e] = keep ? kg[(hk_u64)j0 * VPR + e] : zero;
                v_s[e] = keep ? vg[(hk_u64)j0 * VPR + e] : zero;
            }
        }
        hk_sync();

        // Raw scores q.k (c2 is applied in the exponent, below). Both lanes take a partial
        // dot over their half of the dims for keys 2u and 2u + 1 and complete it with one
        // exchange; then lane_half 0 keeps key 2u and lane_half 1 key 2u + 1. Invisible keys
        // get -inf.
        float m_tile = hk_neg_inf();
#pragma unroll UNROLL_S
        for (int u = 0; u < BKV / 2; ++u) {
            float d0 = half_dot(qr, k_mine + (2 * u) * VPR);
            float d1 = half_dot(qr, k_mine + (2 * u + 1) * VPR);
            d0 += hk_xor1(d0);
            d1 += hk_xor1(d1);
            const int key = 2 * u + lane_half;
            const float s = visible(p, j0 + key, window) ? (lane_half ? d1 : d0) : hk_neg_inf();
            p_s[P_AT(row, key)] = s;
            m_tile = hk_fmax(m_tile, s);
        }
        m_tile = hk_fmax(m_tile, hk_xor1(m_tile));  // the row's max over the whole tile

        // Online softmax. NaN guard: a row that has seen nothing so far and sees nothing in
        // this tile (m_new = -inf) keeps (m, l, acc): it takes alpha = 1 and p = 0 instead of
        // exp2(-inf - -inf) = NaN.
        // c2 > 0: max_j c2 s_j = c2 max_j s_j, rounded up so that every p_j <= 1 (portable.h)
        const float m_new = hk_fmax(m, hk_mul_up(c2, m_tile));
#ifdef HIPKERNEL_MUTANT_NO_NAN_GUARD
        const bool update = true;
#else
        const bool update = m_new != hk_neg_inf();
#endif
        const float alpha = update ? hk_exp2(m - m_new) : 1.0f;  // 0 when m = -inf
        // p_j = exp2(c2 s_j - m_new) with one rounding: at |c2 s_j| near fp16's max, c2 s_j
        // rounded on its own would be off by up to 2^-8, 0.27 % of p_j.
        float l_tile = 0.0f;  // p = 0 for invisible keys, by select; each lane its own keys
#pragma unroll UNROLL_S
        for (int u = 0; u < BKV / 2; ++u) {
            float* slot = &p_s[P_AT(row, 2 * u + lane_half)];
            const float s = *slot;
            const float pj = update && s != hk_neg_inf() ? hk_exp2(hk_fma(s, c2, -m_new)) : 0.0f;
            l_tile += pj;
#if HK_BF16 && defined(HIPKERNEL_MUTANT_BF16_P_AS_FP16)
            *slot = hk_bf16_value(hk_fp16_bits(pj));  // P.V reads pj's fp16 bit pattern as bf16
#else
            *slot = pj;
#endif
        }
        l_tile += hk_xor1(l_tile);  // the row's sum over the whole tile
        l = l * alpha + l_tile;
        if (update) m = m_new;
#ifdef HIPKERNEL_MUTANT_SINK_PER_TILE
        if (has_sink && update) l += hk_exp2(sig2 - m_new);  // split-KV bug: one sink term per tile
#endif
        hk_sync();  // the partner lane's p are written

        // acc = acc * alpha + P.V over every key of the tile, as a matrix core would do it:
        // p = 0 times a key no row may see is why the load zero-fills them.
#pragma unroll
        for (int c = 0; c < NCH; ++c)
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[c][e] *= alpha;
#pragma unroll UNROLL_PV
        for (int jj = 0; jj < BKV; ++jj) {
            const float pj = p_s[P_AT(row, jj)];
            const hk_vec8* vrow = v_mine + jj * VPR;
#pragma unroll
            for (int c = 0; c < NCH; ++c) {
                const hk_vec8 x = vrow[2 * c];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    acc[c][2 * e] = hk_fma(pj, hk_lo(hk_word(x, e)), acc[c][2 * e]);
                    acc[c][2 * e + 1] = hk_fma(pj, hk_hi(hk_word(x, e)), acc[c][2 * e + 1]);
                }
            }
        }
    }

    // Epilogue: fold the sink into the denominator once, with the max taken over it too.
    if (has_sink) {
#ifdef HIPKERNEL_MUTANT_SINK_MAX_SKIPPED
        const float m_fin = m;  // exp2(sig2 - m) overflows for a large sink
#else
        const float m_fin = hk_fmax(m, sig2);
#endif
        const float f = m == hk_neg_inf() ? 0.0f : hk_exp2(m - m_fin);  // row saw nothing: 0
#pragma unroll
        for (int c = 0; c < NCH; ++c)
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[c][e] *= f;
        l *= f;
#ifndef HIPKERNEL_MUTANT_SINK_PER_TILE
#ifdef HIPKERNEL_MUTANT_SINK_UNSHIFTED
        l += sig2 == hk_neg_inf() ? 0.0f : hk_exp2(sig2);  // not shifted by the max
#else
        l += sig2 == hk_neg_inf() ? 0.0f : hk_exp2(sig2 - m_fin);
#endif
#endif
    }

    // out = acc / l, 0 for a row with nothing in its denominator (a NaN l stays NaN); a
    // padded row (rows <= i < Sq) stores zeros.
#ifdef HIPKERNEL_MUTANT_PADDING_NOT_WRITTEN
    const bool store = row_ok;  // padded rows skipped
#else
    const bool store = i < Sq;
#endif
    if (store) {
        hk_vec8* orow = (hk_vec8*)(out + (((hk_u64)b * Sq + i) * Hq + h) * HEAD_DIM);
#pragma unroll
        for (int c = 0; c < NCH; ++c) {
            unsigned int w[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float lo = l == 0.0f ? 0.0f : acc[c][2 * e] / l;
                const float hi = l == 0.0f ? 0.0f : acc[c][2 * e + 1] / l;
                w[e] = row_ok ? hk_pack(lo, hi) : 0u;
            }
            orow[2 * c + lane_half] = hk_vec(w[0], w[1], w[2], w[3]);
        }
    }
}
