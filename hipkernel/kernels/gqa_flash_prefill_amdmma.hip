// gqa_flash_prefill_amdmma.hip: the fused GQA flash-attention prefill on AMD matrix cores,
// one 16x16x16 product a wave at a time (amd_mma.h): WMMA on RDNA 3 (gfx11, WAVE 32), MFMA on
// CDNA (gfx90a, gfx94x, WAVE 64).
//
// Device code only, with the same ABI and entry name as gqa_flash_prefill.hip (so the launch
// code is shared; docs/ARCHITECTURE.md "Kernel ABI"):
//   compile-time  HEAD_DIM (64 | 128), M_TILES (waves a block, 16 query rows each), BKV (keys
//                 per tile, a multiple of 16), WAVE (32 | 64: the instruction, amd_mma.h),
//                 HK_BF16 (0 | 1: q, k, v, out, and P before P.V, in bf16; portable.h)
//   grid          (ceil(Sq / BM), Hq, B), BM = 16 * M_TILES query rows of one head a block
//   block         WAVE * M_TILES threads: wave w owns block rows [16 w, 16 w + 16); lane l
//                 of it owns row l % 16 (with the other lanes l % 16 + 16 q of its wave)
//   shared        static: the K tile, keys x dims (BKV x (HEAD_DIM + 8) halves), and the V
//                 tile transposed, dims x keys (HEAD_DIM x (BKV + 8) halves); the padding
//                 spreads a wave's 16 row reads over the banks
//   pointers      q, k, v, out 16-byte aligned
//   ragged        past_lens, q_lens after scale (null: past_len / Sq for every sequence):
//                 block z = b is sequence b, its valid rows i < q_len[b] at past_len[b] + i
//                 reading its own keys j < past_len[b] + q_len[b] (seq_lengths); its padded
//                 rows are stored as zeros, and a block wholly in the padding stores its
//                 zeros and walks no KV tile
//
// The algorithm is hipkernel/model.py's docstring, step for step, as in the other paths:
// start-tile clamp from the Q tile's first row, the per-row visibility predicate, zero-fill
// on load of keys j >= skv and j < kv_start, the all-masked-tile NaN guard, the sink epilogue
// in exp2 space with the max over the sink, out = acc * (fac * (1 / l)) (0 when l == 0). The
// products run transposed, so that every lane holds one query row's state:
//   S^T = K Q^T  A = the K tile (a lane: key l % 16 of a 16-key block, from LDS), B = Q^T
//                (a lane: row l % 16's dims, in registers for the whole block); the
//                accumulator gives lane l keys mma_acc_row(v, l) of row l % 16.
//   softmax      per lane, on one row: its max and sum over the lanes that share the row
//                (l ^ 16 for WMMA; l ^ 16, l ^ 32 for MFMA), so m, l and alpha are scalars.
//   O^T += V^T P^T  A = the transposed V tile (a lane: dim l % 16 of a 16-dim block), B = P^T
//                (a lane: row l % 16's p of 16 keys, rounded to fp16, bf16 in a bf16 kernel,
//                as model.py does for the tensor-core paths). MFMA's accumulator holds exactly the keys its B slice
//                wants; WMMA's holds every other key, and one exchange with lane l ^ 16
//                completes it. O^T's accumulator gives lane l dims mma_acc_row(v, l) of its row.
// A wave skips a KV tile in which none of its rows sees a key, as the mma path's warps do
// (bit-identical: there the model's state does not change), except under the three mutants
// that make such a tile matter (and in the NVIDIA emulation of WAVE 64, EMU_BLOCK_SYNC). Mutants (refattn/mutants.py) are -DHIPKERNEL_MUTANT_<NAME>=1:
// flash_common.h's, and the per-row ones below at the same places as in the other paths.
//
// Validated on NVIDIA through amd_mma.h's lane-exact emulation of both instructions (the
// case matrix and the kill matrix with the configs forced); never run on AMD hardware here.

#include "portable.h"
#include "flash_common.h"

#if !defined(HEAD_DIM) || !defined(M_TILES) || !defined(BKV) || !defined(WAVE)
#error "compile with -DHEAD_DIM=<64|128> -DM_TILES=<waves> -DBKV=<keys per tile> -DWAVE=<32|64>"
#endif
#if HEAD_DIM % 16 != 0 || BKV % 16 != 0
#error "HEAD_DIM and BKV must be multiples of 16 (the products are 16x16x16)"
#endif
#if HK_AMD && defined(__AMDGCN_WAVEFRONT_SIZE) && __AMDGCN_WAVEFRONT_SIZE != WAVE
#error "WAVE does not match the target's wavefront size (WMMA: wave32 gfx11; MFMA: wave64)"
#endif
#define EMU_WAVES M_TILES  // waves a block: the NVIDIA emulation's scratch, one a wave
#include "amd_mma.h"

#define BM (16 * M_TILES)          // query rows per block
#define NTHREADS (WAVE * M_TILES)  // one wave per 16 rows
#define VPR (HEAD_DIM / 8)         // 16-byte vectors per K/V row
#define KS (HEAD_DIM + 8)          // halves per shared K row (a key)
#define VS (BKV + 8)               // halves per shared V^T row (a dim)
#define KC (HEAD_DIM / 16)         // 16-dim chunks of S^T = K Q^T (MMA k)
#define NKB (BKV / 16)             // 16-key blocks of S^T (MMA m), chunks of O^T (MMA k)
#define ND (HEAD_DIM / 16)         // 16-dim blocks of O^T (MMA m)

// The NVIDIA emulation of WAVE 64 syncs a wave's two warps with the block barrier (amd_mma.h),
// so there every wave walks every tile of its block, as the model does (no skipping).
#if HK_CUDA && WAVE == 64
#define EMU_BLOCK_SYNC 1
#else
#define EMU_BLOCK_SYNC 0
#endif
#if !defined(HIPKERNEL_MUTANT_NO_NAN_GUARD) && !defined(HIPKERNEL_MUTANT_TAIL_UNMASKED) && \
    !defined(HIPKERNEL_MUTANT_WINDOW_SKIP_OFF) && !EMU_BLOCK_SYNC
#define WAVE_SKIP 1
#else
#define WAVE_SKIP 0
#endif

#if HK_AMD
#define EXP2 hk_exp2       // v_exp_f32
#else
#define EXP2 hk_exp2_ftz   // ex2.approx.ftz
#endif

// The row's max and sum over the lanes of the wave that hold it.
HK_INLINE float row_max(float x, int l) {
    x = hk_fmax(x, hk_wave_xor(x, 16, l));
    if (WAVE == 64) x = hk_fmax(x, hk_wave_xor(x, 32, l));
    return x;
}
HK_INLINE float row_sum(float x, int l) {
    x += hk_wave_xor(x, 16, l);
    if (WAVE == 64) x += hk_wave_xor(x, 32, l);
    return x;
}

// A lane's MMA_KL halves of a shared row, from half `at` (even): an A operand slice.
HK_INLINE void lds_slice(unsigned int (&a)[MMA_KW], const half_t* row, int at) {
#pragma unroll
    for (int w = 0; w < MMA_KW; ++w) a[w] = *(const unsigned int*)(row + at + 2 * w);
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
    __shared__ __attribute__((aligned(16))) half_t k_s[BKV * KS];        // keys x dims
    __shared__ __attribute__((aligned(16))) half_t vt_s[HEAD_DIM * VS];  // dims x keys

    const int tid = hk_thread_x();
    const int wave = tid / WAVE, l = tid % WAVE;
    const int r16 = l & 15;  // this lane's query row in its wave, and its A / B operand row
    const int k0 = mma_k0(l);
    const int b = hk_block_z(), h = hk_block_y();
    const int kvh = kv_head(h, Hq, Hkv);
    // This sequence's lengths, the sequence whose cache the block reads (kv_b; keys j < skv
    // exist, [skv, S_cap) is never read) and the rows it computes (i < n_rows; [n_rows, Sq)
    // is padding).
    int past_b, rows, skv;
    seq_lengths(past_lens, q_lens, b, past_len, Sq, past_b, rows, skv);
    const int i0 = hk_block_x() * BM;
    const int kv_b = kv_seq(b, i0, rows, Sq, S_cap, past_b, skv);
    const int n_rows = computed_rows(rows, Sq);
    if (i0 >= n_rows) {  // wholly in the padding: its zeros, and no KV tile
        store_zero_rows(out, b, Sq, Hq, h, 1, i0, i0 + BM < Sq ? i0 + BM : Sq, tid, NTHREADS);
        return;
    }
    const int past = query_base(past_b);

    // The block's Q tile and the KV tiles it walks.
    const int i_last = (i0 + BM < n_rows ? i0 + BM : n_rows) - 1;
    const int p_first = past + i0, p_last = past + i_last;
    const int kv_start = kv_start_of(p_first, window);
    const int t0 = first_tile(p_first, p_last, window, BKV);
    const int t_end = (p_last + 1 + BKV - 1) / BKV;
    const bool has_sink = sink_present(sink_mode);
    const float sig2 = sink_logit2(sink, sink_mode, h);

    // This wave's 16 rows and this lane's row.
    const int iw = i0 + 16 * wave;
    const bool wave_live = iw < n_rows;  // a wave wholly past its rows computes nothing
    (void)wave_live;                 // (but for EMU_BLOCK_SYNC)
    const int pw_first = past + iw, pw_last = pw_first + 15;
    const int i_row = iw + r16;
    const bool ok = i_row < n_rows;  // a padded row or one past Sq computes with q = 0
    const int p = past + i_row;

    // Q^T as B operands: qb[kc] holds dims [16 kc + k0, 16 kc + k0 + MMA_KL) of the lane's row.
    unsigned int qb[KC][MMA_KW];
    {
        const half_t* qrow = q + (((hk_u64)b * Sq + (ok ? i_row : 0)) * Hq + h) * HEAD_DIM + k0;
#pragma unroll
        for (int kc = 0; kc < KC; ++kc)
#pragma unroll
            for (int w = 0; w < MMA_KW; ++w)
                qb[kc][w] = ok ? *(const unsigned int*)(qrow + 16 * kc + 2 * w) : 0u;
    }
    const float c2 = scale * LOG2E;  // s2 = c2 * dot(q, k): logits in exp2 space

    // Online-softmax state of the lane's row; o[nd][v] is dim 16 nd + mma_acc_row(v, l).
    float m = row_max_init(), lsum = 0.0f;
    float o[ND][MMA_ACC];
#pragma unroll
    for (int nd = 0; nd < ND; ++nd)
#pragma unroll
        for (int e = 0; e < MMA_ACC; ++e) o[nd][e] = 0.0f;

    const hk_u64 kv_base = ((hk_u64)kv_b * Hkv + kvh) * (hk_u64)S_cap * HEAD_DIM;
    const half_t* kg = k + kv_base;
    const half_t* vg = v + kv_base;

    for (int t = t0; t < t_end; ++t) {
        const int j0 = t * BKV;
        // Stage tile t: K as it is, V transposed; keys no row of the block may see (past
        // skv, below kv_start) are zero-filled, since P.V multiplies p = 0 by them.
        hk_sync();  // the last tile is consumed
        for (int idx = tid; idx < BKV * VPR; idx += NTHREADS) {
            const int key = idx / VPR, c = idx % VPR;
            const bool keep = key_kept(j0 + key, kv_start, skv, S_cap);
            const hk_u64 at = (hk_u64)(j0 + key) * HEAD_DIM + 8 * c;
            const hk_vec8 kx = keep ? *(const hk_vec8*)(kg + at) : hk_vec(0u, 0u, 0u, 0u);
            const hk_vec8 vx = keep ? *(const hk_vec8*)(vg + at) : hk_vec(0u, 0u, 0u, 0u);
            *(hk_vec8*)(k_s + key * KS + 8 * c) = kx;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const unsigned int w = hk_word(vx, e);
                vt_s[(8 * c + 2 * e) * VS + key] = (half_t)(w & 0xffffu);
                vt_s[(8 * c + 2 * e + 1) * VS + key] = (half_t)(w >> 16);
            }
        }
        hk_sync();

#if WAVE_SKIP
        if (!wave_live || j0 > pw_last || (window > 0 && j0 + BKV - 1 < window_lo(pw_first, window)))
            continue;
#elif !EMU_BLOCK_SYNC
        if (!wave_live) continue;
#endif

        // S^T = K Q^T: s[kb][e] is the dot of key j0 + 16 kb + mma_acc_row(e, l) with the row.
        float s[NKB][MMA_ACC];
#pragma unroll
        for (int kb = 0; kb < NKB; ++kb) {
#pragma unroll
            for (int e = 0; e < MMA_ACC; ++e) s[kb][e] = 0.0f;
#pragma unroll
            for (int kc = 0; kc < KC; ++kc) {
                unsigned int a[MMA_KW];
                lds_slice(a, k_s + (16 * kb + r16) * KS, 16 * kc + k0);
                hk_amd_mma(s[kb], a, qb[kc]);
            }
        }

        // Invisible keys get -inf; a tile every row of the wave sees whole needs no test.
        const bool whole = j0 + BKV - 1 <= pw_first && (window < 0 || j0 >= window_lo(pw_last, window));
        if (!whole) {
#pragma unroll
            for (int kb = 0; kb < NKB; ++kb)
#pragma unroll
                for (int e = 0; e < MMA_ACC; ++e)
                    if (!visible(p, j0 + 16 * kb + mma_acc_row(e, l), window)) s[kb][e] = hk_neg_inf();
        }

        // Online softmax of the row. The max of the logits in exp2 space, c2 max_j dot_j
        // (c2 > 0), rounded up (portable.h): every p_j <= 1. NaN guard: a row that has seen
        // nothing so far and sees nothing in this tile (m_new = -inf) keeps (m, l, acc): it
        // takes alpha = 1 and p = 0 instead of exp2(-inf - -inf) = NaN.
        float m_tile = hk_neg_inf();
#pragma unroll
        for (int kb = 0; kb < NKB; ++kb)
#pragma unroll
            for (int e = 0; e < MMA_ACC; ++e) m_tile = hk_fmax(m_tile, s[kb][e]);
        m_tile = row_max(m_tile, l);
        const float m_new = hk_fmax(m, hk_mul_up(c2, m_tile));
#ifdef HIPKERNEL_MUTANT_NO_NAN_GUARD
        const bool update = true;  // m_new = -inf: alpha and p become exp2(-inf - -inf) = NaN
#else
        const bool update = m_new != hk_neg_inf();
#endif
        const float alpha = update ? EXP2(m - m_new) : 1.0f;  // 0 when m = -inf
        const float neg_m = update ? -m_new : 0.0f;
        float l_tile = 0.0f;
#pragma unroll
        for (int kb = 0; kb < NKB; ++kb)
#pragma unroll
            for (int e = 0; e < MMA_ACC; ++e) {
                // p_j = exp2(fma(dot_j, c2, -m_new)); an invisible key (dot = -inf) gives 0
                s[kb][e] = EXP2(hk_fma(s[kb][e], c2, neg_m));
                l_tile += s[kb][e];
            }
        lsum = lsum * alpha + row_sum(l_tile, l);
        if (update) m = m_new;
#ifdef HIPKERNEL_MUTANT_SINK_PER_TILE
        if (has_sink && update) lsum += hk_exp2(sig2 - m_new);  // split-KV bug
#endif
#pragma unroll
        for (int nd = 0; nd < ND; ++nd)
#pragma unroll
            for (int e = 0; e < MMA_ACC; ++e) o[nd][e] *= alpha;

        // O^T += V^T P^T over every key of the tile, P rounded to fp16 (bf16; p_pack). The B slice of chunk kb
        // is the row's p of keys 16 kb + k0 + [0, MMA_KL).
#pragma unroll
        for (int kb = 0; kb < NKB; ++kb) {
            unsigned int pb[MMA_KW];
#if WAVE == 32
            // Lane l holds keys 2 e + l / 16; lane l ^ 16 the others: word w = keys 2 w, 2 w + 1.
#pragma unroll
            for (int w = 0; w < MMA_KW; ++w) {
                const float mine = s[kb][w], other = hk_wave_xor(mine, 16, l);
                pb[w] = (l & 16) ? p_pack(other, mine) : p_pack(mine, other);
            }
#else
            // Lane l holds keys 4 (l / 16) + e: its slice already.
#pragma unroll
            for (int w = 0; w < MMA_KW; ++w) pb[w] = p_pack(s[kb][2 * w], s[kb][2 * w + 1]);
#endif
#pragma unroll
            for (int nd = 0; nd < ND; ++nd) {
                unsigned int a[MMA_KW];
                lds_slice(a, vt_s + (16 * nd + r16) * VS, 16 * kb + k0);
                hk_amd_mma(o[nd], a, pb);
            }
        }
    }

    // Epilogue: out = acc * row_fac, the sink folded in (flash_common.h row_scale), as the model
    // rounds; a padded row's zeros. Lane l writes dims 16 nd + mma_acc_row(e, l) of its row.
    const float row_fac = row_scale(m, lsum, has_sink, sig2);
    if (row_stored(i_row, n_rows, Sq)) {
        half_t* orow = out + (((hk_u64)b * Sq + i_row) * Hq + h) * HEAD_DIM;
#pragma unroll
        for (int nd = 0; nd < ND; ++nd)
#pragma unroll
            for (int e = 0; e < MMA_ACC; ++e)
                orow[16 * nd + mma_acc_row(e, l)] = ok ? hk_f2h(o[nd][e] * row_fac) : (half_t)0;
    }
}
