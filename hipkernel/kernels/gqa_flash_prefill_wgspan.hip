// gqa_flash_prefill_wgspan.hip: the fused GQA flash-attention prefill on Hopper tensor cores
// (wgmma.mma_async, sm_90a only) for sliding windows: each warpgroup walks its keys in chunks
// that start at its own first visible key, so that a window's whole span is one chunk.
//
// Why. Under a window of W keys the rows at positions [p, p + n) see the keys [p - W + 1,
// p + n - 1]: W + n - 1 of them. The wgmma path walks tiles aligned to multiples of BKV, and a
// warpgroup's 64 rows there are 64 positions: at W = 128 their 191 keys take 4 tiles of 64,
// 256 keys computed for the 128 each row sees. Here a warpgroup's 64 rows are 64 / PACK
// positions of PACK query heads that share a KV head (GQA packing, as on the mma path): 8
// positions of 8 heads span 135 keys, and one chunk of BKV = 136 keys, starting at the
// first of them, holds them all: one Q.K^T, one softmax step, one P.V a row.
//
// NVIDIA sm_90a ONLY (hipkernel.config offers path "wgspan" on sm_90 devices, compiled for
// sm_90a, as the wgmma path). Same ABI and entry name as the other paths
// (docs/ARCHITECTURE.md "Kernel ABI"):
//   compile-time  HEAD_DIM (64 | 128), M_TILES (4, 8 or 16: a warpgroup per 64 rows), BKV
//                 (72 or 136 keys a chunk: one wgmma of n BKV - 8 and one of n 8), PACK (1,
//                 2, 4 or 8; default 1), QWALK (steps a block walks, 1, 2, 4 or 8; default
//                 1), KV_STAGES (round buffers, >= 1), HK_BF16 (0 | 1: q, k, v, out, and
//                 P before P.V, in bf16; portable.h)
//   grid          (ceil(ceil(Sq / BP) / QWALK), Hq / PACK, B), BP = BM / PACK positions a
//                 step, BM = 16 * M_TILES rows: block (x, y) takes the QWALK steps of
//                 positions [BP (QWALK x + s), BP (QWALK x + s) + BP) in turn, each of PACK
//                 heads PACK y .. PACK y + PACK - 1. Needs (Hq / Hkv) % PACK == 0, which the
//                 host checks.
//   block         32 * M_TILES threads: in step s warpgroup w owns the BP_WG = 64 / PACK
//                 positions of "unit" u = NWG s + w, [i0 + BP_WG u, i0 + BP_WG u + BP_WG)
//                 (i0 the block's first); its row r is position r / PACK of head PACK y +
//                 r % PACK, its warp x rows [16 x, 16 x + 16) of those
//   shared        dynamic, KV_STAGES x (K round + V round) of CH = (NWG QWALK - 1) BP_WG +
//                 PV_KEYS rows of HEAD_DIM halves each, in wgmma's 128-byte swizzle (the
//                 wgmma path's layout), each on a 1024-byte boundary; then, at d 64, 2 KiB
//                 a warp for the staged epilogue (KernelConfig.dynamic_smem_bytes,
//                 KernelConfig.span_rows)
//   pointers      q, k, v, out 16-byte aligned
//   ragged        past_lens, q_lens after scale (null: past_len / Sq for every sequence):
//                 block z = b is sequence b, its valid rows i < q_len[b] at past_len[b] + i
//                 reading its own keys j < past_len[b] + q_len[b] (seq_lengths); units
//                 wholly in the padding walk nothing and their rows, like every padded row,
//                 are stored as zeros; a block wholly in the padding stores its zeros and
//                 walks nothing
//
// The chunks. A unit's first key lo_u is its first row's first visible key (the start clamp
// of model.py, with its mutants, span_lo); the block's first, kv_base, is unit 0's. Unit u
// walks the chunks of keys [a_u + BKV c, a_u + BKV c + BKV), c = 0, 1, ..., up to its last
// row's position, from a_u = kv_base + ((lo_u - kv_base) & ~7): its first key rounded down
// to a whole swizzle atom (8 keys) of the block's buffer, which under a window is lo_u itself
// (the units' first positions differ by multiples of 8, and so do their first keys, unless
// clamped at key 0). Round c stages keys [kv_base + BKV c, kv_base + BKV c + CH), which hold
// chunk c of every unit of the block, at rows a_u - kv_base <= (NWG QWALK - 1) BP_WG on; the
// loads zero-fill the keys no row of the block may see (below the block's first visible key,
// past skv), as on the other paths. When every unit's walk has at most KV_STAGES chunks (a
// window whose span fits one chunk: one), the rounds are staged once, at the start, and
// serve every step ("resident"); otherwise each step streams its rounds through the buffers
// with a block barrier a round.
//
// The rest is the wgmma path's, step for step (flash_rows.h: visibility, online softmax
// with the NaN guard, the sink epilogue in exp2 space):
//   S = Q K^T    wgmma m64 n(BKV - 8) k16 and m64 n8 k16 per 16 dims, Q from registers
//                (the next step's loaded once this step's last Q.K^T has read them), K by
//                descriptor from the unit's first row of the round
//   mask         an 8-key block every row of the warp sees whole is not tested (under a
//                window all but the chunk's two ends)
//   O += P V     ceil(BKV / 16) wgmma m64 n HEAD_DIM k16, P (fp16, bf16 in a bf16 kernel) from registers; the
//                last 16-key step's upper 8 keys (the 8 keys after the chunk) take p = 0.
//                A unit's first chunk overwrites the accumulator (no acc *= alpha, no zeroing)
//   epilogue     out = acc * scale, one factor a row (flash_common.h row_scale); at d 64
//                through shared memory (STAGED_EPI), 16-byte stores of whole rows
// No chunk precedes a row's first visible key (every row's window starts inside its unit's
// first chunk: lo_p - a_u <= BP_WG - 1 + 7 < BKV), so the NaN guard never fires here and
// the no_nan_guard mutant cannot change an output (hipkernel.config.EQUIVALENT_ON_PATH); a
// unit walks no chunk past its last row. (Under the window_skip_off mutant every unit's
// chunks start at key 0, so there the guard does fire.) The model walks the same chunks (model.py, path
// "wgspan"). Mutants (refattn/mutants.py) bite in flash_common.h / flash_rows.h and in
// span_lo below.

#include "portable.h"
#include "flash_rows.h"
#include "wgmma.h"

#if !HK_CUDA
#error "gqa_flash_prefill_wgspan.hip is NVIDIA sm_90a-only (wgmma); AMD uses gqa_flash_prefill.hip"
#endif
#if !defined(HEAD_DIM) || !defined(M_TILES) || !defined(BKV) || !defined(KV_STAGES)
#error "compile with -DHEAD_DIM=<64|128> -DM_TILES=<4|8|16> -DBKV=<72|136> -DKV_STAGES=<n>"
#endif
#if HEAD_DIM != 64 && HEAD_DIM != 128
#error "HEAD_DIM must be 64 or 128 (the n of the P.V wgmma)"
#endif
#if BKV != 72 && BKV != 136
#error "BKV must be 72 or 136 (a wgmma of n 64 or 128, and one of n 8)"
#endif
#if M_TILES != 4 && M_TILES != 8 && M_TILES != 16
#error "M_TILES must be 4, 8 or 16: a warpgroup (4 warps) computes 64 rows"
#endif
#if KV_STAGES < 1
#error "KV_STAGES must be >= 1"
#endif
#ifndef PACK
#define PACK 1
#endif
#if PACK != 1 && PACK != 2 && PACK != 4 && PACK != 8
#error "PACK must be 1, 2, 4 or 8 (it divides the 8 rows g of a fragment half)"
#endif

#ifndef QWALK
#define QWALK 1
#endif
#if QWALK != 1 && QWALK != 2 && QWALK != 4 && QWALK != 8
#error "QWALK must be 1, 2, 4 or 8"
#endif

#define NWG (M_TILES / 4)          // warpgroups a block
#define NTHREADS (32 * M_TILES)
#define BP_WG (64 / PACK)          // positions a warpgroup (of PACK heads each)
#define BP (NWG * BP_WG)           // positions a step of a block
#define NB_S (BKV / 8)             // 8-key blocks of a chunk's scores
#define NQ_MAIN (BKV - 8)          // the n of the first Q.K^T wgmma; the second's is 8
#define KC_S (HEAD_DIM / 16)       // 16-dim steps of Q K^T
#define KC_P ((BKV + 15) / 16)     // 16-key steps of P V
#define PV_KEYS (16 * KC_P)        // keys P.V reads: the chunk and 8 more (p = 0)
#define NB_O (HEAD_DIM / 8)        // 8-dim blocks of the output
#define O_MAX ((NWG * QWALK - 1) * BP_WG)  // the last warpgroup's first row in a round, at most
#define CH (O_MAX + PV_KEYS)       // rows a round stages
#define VPR (HEAD_DIM / 8)         // 16-byte vectors per K/V row
#define CHUNK_BYTES (CH * HEAD_DIM * 2)
#define CBLOCK_BYTES (CH * 128)    // a 64-dim column block of a chunk buffer
#define DESC_SW128 (1u << 30)      // the 128-byte swizzle (wgmma.h)
#define KSTEP (NTHREADS / VPR)     // rows a pass of the block's copies covers
#if CH % 8 != 0 || KSTEP % 8 != 0
#error "a round and a pass of the copies must be whole 8-row swizzle atoms"
#endif
#define PENDING (KV_STAGES > 1 ? KV_STAGES - 2 : 0)  // cp.async groups after round c's
// The epilogue's stores: at d 64 through 2 KiB of shared memory a warp (STAGED_EPI, after the
// round buffers: KernelConfig.dynamic_smem_bytes), 16-byte stores of whole rows; 0: each lane
// stores its fragment's 4-byte pairs.
#ifndef STAGED_EPI
#define STAGED_EPI (HEAD_DIM == 64)
#endif
#if STAGED_EPI && HEAD_DIM != 64
#error "STAGED_EPI: a warp's 16 output rows of 128 bytes (d 64) in 2 KiB"
#endif

// Blocks an SM should hold at once (ptxas plans 65536 / (NTHREADS * MIN_BLOCKS) registers a
// thread): a chunk's scores (BKV / 2 a thread), the O accumulator and Q take most of them. At
// d 64 with 136-key chunks one warpgroup a block takes 168 registers, 3 blocks an SM, without
// spilling; at 4 blocks (128) ptxas spills 568 bytes and serializes the wgmma.
#ifndef MIN_BLOCKS
#if HEAD_DIM == 64
#define MIN_BLOCKS (M_TILES == 4 ? 3 : M_TILES == 8 ? 2 : 1)
#else
#define MIN_BLOCKS 1
#endif
#endif

// The first key of the span of a unit's rows at positions [p_first, p_last]: its first
// row's first visible key (the start clamp from the FIRST row, as first_tile's, under the
// same two mutants).
HK_INLINE int span_lo(int p_first, int p_last, int window) {
#ifdef HIPKERNEL_MUTANT_CLAMP_FROM_LAST_ROW
    int j = kv_start_of(p_last, window);
#else
    int j = kv_start_of(p_first, window);
#endif
#ifdef HIPKERNEL_MUTANT_CLAMP_PLUS_ONE_TILE
    j += BKV;  // a chunk late
#endif
    return j;
}

// The first key of unit u's chunks, and how many it walks (0: none of its rows is computed,
// i < n_rows).
HK_INLINE void unit_span(int u, int i0, int n_rows, int past, int window, int kv_base, int& a, int& n) {
    const int iw = i0 + BP_WG * u;
    a = kv_base, n = 0;
    if (iw < n_rows) {
        const int p_first = past + iw, p_last = past + (iw + BP_WG < n_rows ? iw + BP_WG : n_rows) - 1;
        a = kv_base + ((span_lo(p_first, p_last, window) - kv_base) & ~7);
        n = p_last + 1 - a > 0 ? (p_last + 1 - a + BKV - 1) / BKV : 0;
    }
}

// Invisible keys of the chunk whose first key is j0 get -inf. Key j is visible from position
// p iff 0 <= p - j < lim, lim = 1 - window_lo(0, W) (W keys; W + 1 under the
// window_mask_off_by_one mutant) or 2^31 without a window: one unsigned compare (visible() of
// flash_common.h, spelled for the compare). An 8-key block that every row of the warp
// (positions [pw_first, pw_last]) sees whole needs no test; the whole blocks of a chunk are
// one run (the rows' lower bounds and upper bounds both rise with the position). Under a
// window whose span fits the chunk that run is every block but the first and the last (at
// W = 128 with 8 positions a warpgroup: the first holds the keys below the last row's window,
// the last those past the first row): then those two are tested element by element with no
// branch; otherwise each block is tested first (a warp-uniform branch) and only a partial one
// element by element.
template <int NB>
HK_INLINE void mask_chunk(float (&s)[NB][4], int j0, int t4, const int (&p)[2], int pw_first, int pw_last,
                          int window) {
    const unsigned int lim = window < 0 ? 0x80000000u : (unsigned int)(1 - window_lo(0, window));
    const int d0 = p[0] - j0 - 2 * t4, d1 = p[1] - j0 - 2 * t4;  // p - j of element 0 of block 0
    auto mask_block = [&](int nb) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const unsigned int pj = (unsigned int)((e >> 1 ? d1 : d0) - 8 * nb - (e & 1));
            if (pj >= lim) s[nb][e] = hk_neg_inf();
        }
    };
    // block nb is whole iff its last key is at most pw_first and pw_last - its first < lim
    auto whole = [&](int nb) { return pw_first - (j0 + 8 * nb + 7) >= 0 && (unsigned int)(pw_last - j0 - 8 * nb) < lim; };
    if (whole(1) && whole(NB - 2)) {  // warp-uniform: blocks 1 .. NB - 2 are whole
        mask_block(0);
        mask_block(NB - 1);
        return;
    }
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
        if (!whole(nb)) mask_block(nb);
}

// Stage round c (keys [j_first, j_first + CH)) in buffer st: 16-byte cp.async by thread lt,
// consecutive threads on consecutive chunks of a row (a warp writes whole 128-byte shared
// rows), zero-filling the keys no row of the block may see (key_kept).
HK_INLINE void load_round(const half_t* kg, const half_t* vg, unsigned int k_s0, unsigned int v_s0,
                          int j_first, int st, int lt, int kv_start, int skv, int S_cap) {
    const int row0 = lt / VPR, c = lt % VPR;
    // KSTEP is a multiple of 8, so the chunk's swizzled place is the same in every row it copies
    const unsigned int dst0 = st * CHUNK_BYTES + (c >> 3) * CBLOCK_BYTES + 128u * row0 + 16u * ((c & 7) ^ (row0 & 7));
#pragma unroll
    for (int it = 0; it < (CH + KSTEP - 1) / KSTEP; ++it) {
        const int row = row0 + it * KSTEP;
        if (CH % KSTEP == 0 || row < CH) {
            const int j = j_first + row;
            const bool keep = key_kept(j, kv_start, skv, S_cap);
            const hk_u64 src = (hk_u64)(unsigned int)(keep ? j : 0) * HEAD_DIM + 8 * c;  // not kept: reads nothing
            const unsigned int dst = dst0 + 128u * KSTEP * it;
            hk_cp_async_16(k_s0 + dst, kg + src, keep);
            hk_cp_async_16(v_s0 + dst, vg + src, keep);
        }
    }
}

extern "C" __global__ __launch_bounds__(NTHREADS, MIN_BLOCKS) void gqa_flash_prefill(
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
    extern __shared__ __attribute__((aligned(1024))) half_t kv_s[];  // the K chunks, then V's

    const int tid = hk_thread_x();
    const int warp = tid >> 5, lane = tid & 31;
    const int wg = warp >> 2, x = warp & 3;  // this thread's warpgroup, and its warp in it
    const int g = lane >> 2;  // this lane's fragment rows are g and g + 8
    const int t4 = lane & 3;  // ... and its fragment columns 2 * t4, 2 * t4 + 1 (+ 8)
    const int b = hk_block_z();
    const int h0 = PACK * hk_block_y();  // the block's first head
    const int h = h0 + g % PACK;         // this lane's rows' head
    const int kvh = kv_head(h0, Hq, Hkv);
    // The block's positions (QWALK steps of NWG warpgroups' BP_WG each); this sequence's
    // lengths, the sequence whose cache the block reads (kv_b; keys j < skv exist, [skv, S_cap)
    // is never read) and the rows it computes (i < n_rows; [n_rows, Sq) is padding).
    const int i0 = hk_block_x() * BP * QWALK;
    const int i_end = i0 + BP * QWALK < Sq ? i0 + BP * QWALK : Sq;
    int past_b, rows, skv;
    seq_lengths(past_lens, q_lens, b, past_len, Sq, past_b, rows, skv);
    const int kv_b = kv_seq(b, i0, rows, Sq, S_cap, past_b, skv);
    const int n_rows = computed_rows(rows, Sq);
    if (i0 >= n_rows) {  // wholly in the padding: its zeros, and no chunk
        store_zero_rows(out, b, Sq, Hq, h0, PACK, i0, i_end, tid, NTHREADS);
        return;
    }
    const int past = query_base(past_b);  // row i sits at absolute position past + i

    // The block's first key (that of step 0's warpgroup 0), and the keys its loads keep from.
    const int p_first = past + i0;
    const int kv_base = span_lo(p_first, past + (i0 + BP_WG < n_rows ? i0 + BP_WG : n_rows) - 1, window);
    const int kv_start = kv_start_of(p_first, window);
    // The rounds of the longest walk of a warpgroup: when the stage buffers hold them all,
    // they are staged once and serve every step (a window whose span fits a chunk: one).
    int rounds_max = 0;
#pragma unroll
    for (int u = 0; u < NWG * QWALK; ++u) {
        int a, n;
        unit_span(u, i0, n_rows, past, window, kv_base, a, n);
        rounds_max = n > rounds_max ? n : rounds_max;
    }
    const bool resident = rounds_max <= KV_STAGES;
    const bool has_sink = sink_present(sink_mode);
    const float sig2 = sink_logit2(sink, sink_mode, h);
    const float c2 = scale * LOG2E;  // s2 = c2 * dot(q, k): logits in exp2 space

    const unsigned int k_s0 = hk_smem_u32(kv_s), v_s0 = k_s0 + KV_STAGES * CHUNK_BYTES;
    const unsigned int epi_s0 = v_s0 + KV_STAGES * CHUNK_BYTES;  // STAGED_EPI: 2 KiB a warp
    if (((k_s0 | v_s0) & 1023u) != 0) __trap();  // the swizzle needs 1024-byte aligned chunks
    // The KV head's K and V, recomputed at each use (nothing live across the steps for them).
    auto load = [&](int c, int st) {
        const hk_u64 kv_off = ((hk_u64)kv_b * Hkv + kvh) * (hk_u64)S_cap * HEAD_DIM;
        load_round(k + kv_off, v + kv_off, k_s0, v_s0, kv_base + BKV * c, st, tid, kv_start, skv, S_cap);
    };

    if (resident) {  // every round once, one cp.async group
        for (int c = 0; c < rounds_max; ++c) load(c, c);
        hk_cp_async_commit();
    }

    // This lane's rows in step s: block rows 64 wg + 16 x + g + 8 r of the step, positions
    // i_r[r] = ig + (16 x + g + 8 r) / PACK, at element row0 + i_r[r] Hq HEAD_DIM of q and of
    // out (the same layout); the Q fragments of step 0 load while the rounds stream in, and
    // those of step s + 1 once step s's last Q.K^T has read its own.
    const hk_u64 row0 = ((hk_u64)b * Sq * Hq + h) * HEAD_DIM + 2 * t4;
    auto rows_of = [&](int s, int (&i_r)[2]) {
#pragma unroll
        for (int r = 0; r < 2; ++r) i_r[r] = i0 + BP_WG * (NWG * s + wg) + (16 * x + g + 8 * r) / PACK;
    };
    auto q_ptrs = [&](const int (&i_r)[2], const half_t* (&qrow)[2]) {  // null: not computed
#pragma unroll
        for (int r = 0; r < 2; ++r) qrow[r] = i_r[r] < n_rows ? q + (row0 + (hk_u64)i_r[r] * (Hq * HEAD_DIM)) : nullptr;
    };
    unsigned int qf[KC_S][4];
    {
        int i_r[2];
        const half_t* qrow[2];
        rows_of(0, i_r);
        q_ptrs(i_r, qrow);
        load_q_fragments(qf, qrow);
    }

    for (int s = 0; s < QWALK; ++s) {
        // This warpgroup's unit in step s: its chunks, the rounds of the step's longest walk,
        // and this warp's and lane's positions.
        const int u = NWG * s + wg;
        int a_w, n_w, rounds = 0;
#pragma unroll
        for (int w = 0; w < NWG; ++w) {
            int a, n;
            unit_span(NWG * s + w, i0, n_rows, past, window, kv_base, a, n);
            rounds = n > rounds ? n : rounds;
            if (w == wg) a_w = a, n_w = n;
        }
        const int ig = i0 + BP_WG * u;
        const int pw_first = past + ig + 16 * x / PACK, pw_last = past + ig + (16 * x + 15) / PACK;
        int i_r[2], p_r[2], i_next[2];
        const half_t* qrow_next[2];
        rows_of(s, i_r);
        rows_of(s + 1 < QWALK ? s + 1 : s, i_next);
        q_ptrs(i_next, qrow_next);  // the next step's Q
#pragma unroll
        for (int r = 0; r < 2; ++r) p_r[r] = past + i_r[r];

        // The descriptors' low words at this warpgroup's first row of buffer 0 (wgmma.h, and
        // the wgmma path): K (K-major) SBO 1024 between 8-key groups; V (MN-major) SBO 1024,
        // LBO the 64-dim column blocks' stride. Buffer st adds st * CHUNK_BYTES >> 4.
        const unsigned int o_bytes = 128u * (a_w - kv_base);
        const unsigned int k_lo0 = hk_wgmma_desc_lo(k_s0 + o_bytes, 16u);
        const unsigned int v_lo0 = hk_wgmma_desc_lo(v_s0 + o_bytes, HEAD_DIM > 64 ? CBLOCK_BYTES : 1024u);

        float m[2] = {row_max_init(), row_max_init()}, l[2] = {0.0f, 0.0f};
        // The O accumulator, a wgmma D fragment of n = HEAD_DIM: the first chunk's P.V sets it
        // (a warpgroup that walks no chunk in a step has no row to write).
        float o[NB_O][4];

        // Chunk c of this warpgroup, in buffer st; `fresh`: its first (c == 0), whose P.V
        // overwrites the accumulator rather than rescaling and adding to it.
        auto compute = [&](int c, int st, bool fresh) {
            const int j0 = a_w + BKV * c;  // the chunk's first key
            const unsigned int k_lo = k_lo0 + st * (CHUNK_BYTES >> 4), v_lo = v_lo0 + st * (CHUNK_BYTES >> 4);

            // S = Q K^T, fp32: keys [j0, j0 + BKV - 8), then the last 8 (whole atoms
            // further). The first step overwrites s.
            float s_acc[NB_S][4];
            float(&s_main)[NB_S - 1][4] = *reinterpret_cast<float(*)[NB_S - 1][4]>(&s_acc[0][0]);
            float(&s_tail)[1][4] = *reinterpret_cast<float(*)[1][4]>(&s_acc[NB_S - 1][0]);
            hk_wgmma_fence();
#pragma unroll
            for (int kc = 0; kc < KC_S; ++kc) {
                // 16 dims on: 32 bytes into the row, the next column block every 4
                const unsigned int kd = k_lo + ((kc >> 2) * CBLOCK_BYTES + 32u * (kc & 3) >> 4);
                hk_wgmma<NQ_MAIN, 0, DESC_SW128 | 64u>(s_main, qf[kc], kd, kc > 0);
                hk_wgmma<8, 0, DESC_SW128 | 64u>(s_tail, qf[kc], kd + (128u * NQ_MAIN >> 4), kc > 0);
            }
            hk_wgmma_commit();
            hk_wgmma_wait<0>();
            hk_wgmma_fence_acc(s_acc);
            if (c == n_w - 1 && s + 1 < QWALK) load_q_fragments(qf, qrow_next);  // the next step's

            mask_chunk(s_acc, j0, t4, p_r, pw_first, pw_last, window);
            softmax_step(s_acc, m, l, o, c2, has_sink, sig2, fresh);

            // acc += P.V over the chunk's keys and the 8 after it, whose p is 0 (their V rows
            // are staged: real keys or zero-filled, never NaN from the cache's padding).
            unsigned int pa[KC_P][4];
#pragma unroll
            for (int kp = 0; kp < NB_S / 2; ++kp) p_fragment(pa[kp], s_acc, kp);
#if NB_S % 2
            pa[KC_P - 1][0] = p_pack(s_acc[NB_S - 1][0], s_acc[NB_S - 1][1]);
            pa[KC_P - 1][1] = p_pack(s_acc[NB_S - 1][2], s_acc[NB_S - 1][3]);
            pa[KC_P - 1][2] = 0u;
            pa[KC_P - 1][3] = 0u;
#endif
            if (fresh) hk_wgmma_acc_undef(o);  // overwritten: not live before
            hk_wgmma_fence_acc(o);
            hk_wgmma_fence();
#pragma unroll
            for (int kp = 0; kp < KC_P; ++kp)  // 16 keys on: two 8-key groups further
                hk_wgmma<HEAD_DIM, 1, DESC_SW128 | 64u>(o, pa[kp], v_lo + (2048u >> 4) * kp, !fresh || kp > 0);
            hk_wgmma_commit();
            hk_wgmma_wait<0>();
            hk_wgmma_fence_acc(o);
        };

        if (resident) {
            if (s == 0) {
                hk_cp_async_wait<0>();   // every round has landed
                hk_fence_proxy_async();  // this thread's copies, visible to wgmma's reads ...
                hk_sync();               // ... and every thread's
            }
            if (n_w > 0) compute(0, 0, true);  // uniform over the warpgroup
            for (int c = 1; c < n_w; ++c) compute(c, c, false);
        } else {
            // The pipeline, a block barrier a round: one cp.async group per buffer, committed
            // even when empty, so that at round c exactly PENDING groups follow round c's (with
            // one buffer, round c + 1 is loaded after round c is consumed).
            hk_sync();  // every warp is done with the last step's rounds
#pragma unroll
            for (int i = 0; i < (KV_STAGES > 1 ? KV_STAGES - 1 : 1); ++i) {
                if (i < rounds) load(i, i);
                hk_cp_async_commit();
            }
            int st = 0;  // round c's buffer
            for (int c = 0; c < rounds; ++c) {
                hk_cp_async_wait<PENDING>();  // round c has landed
                hk_fence_proxy_async();
                hk_sync();  // every thread's copies; every warp is done with round c - 1
                if (KV_STAGES > 1) {  // refill round c - 1's buffer
                    const int c_next = c + KV_STAGES - 1;
                    if (c_next < rounds) load(c_next, st == 0 ? KV_STAGES - 1 : st - 1);
                    hk_cp_async_commit();
                }
                if (c < n_w) compute(c, st, c == 0);  // uniform over the warpgroup
                if (KV_STAGES == 1) {
                    hk_sync();  // round c is consumed: its buffer may be refilled
                    if (c + 1 < rounds) load(c + 1, 0);
                    hk_cp_async_commit();
                }
                if (++st == KV_STAGES) st = 0;
            }
        }
        if (n_w == 0 && s + 1 < QWALK) load_q_fragments(qf, qrow_next);  // no chunk loaded them

        // Epilogue: out = acc * scale, one factor a row with the sink folded in (flash_rows.h);
        // a padded row's zeros.
        if (n_w == 0) continue;  // uniform over the warpgroup: no row of it is computed
        float scale[2];
        row_scales(m, l, has_sink, sig2, scale);
        unsigned int w[2][NB_O];
        const bool valid[2] = {i_r[0] < n_rows, i_r[1] < n_rows};
        out_words(o, scale, valid, w);
#if STAGED_EPI
        // Through the warp's 2 KiB of shared memory: its 16 rows (row rr: position ig + (16 x
        // + rr) / PACK, head h0 + (16 x + rr) % PACK; 128 bytes of out each) written with
        // stmatrix in the 128-byte swizzle (16-byte chunk c of row rr at c ^ (rr % 8)), then
        // read back and stored 16 bytes a lane: in pass it, lane L stores chunk L % 8 of row
        // 4 (L / 8) + it, so that a pass moves 4 whole rows and each lane's row advances by a
        // compile-time step (PACK divides 4 or is 8: row + it is position + it / PACK, head +
        // it % PACK).
        {
            const unsigned int ep = epi_s0 + 2048u * warp;
            // stmatrix x4 for dims [16 j, 16 j + 16): the 8 x 8 matrices (rows 0-7, dims 8 (2 j)
            // on), (8-15, 2 j), (0-7, 2 j + 1), (8-15, 2 j + 1); lane L addresses row L % 8 of
            // matrix L / 8
            const int mq = lane & 7, mm = lane >> 3;
            const unsigned int mrow = ep + 128u * (8 * (mm & 1) + mq);
#pragma unroll
            for (int j = 0; j < NB_O / 2; ++j)
                hk_stmatrix_x4(mrow + 16u * ((2 * j + (mm >> 1)) ^ mq), w[0][2 * j], w[1][2 * j], w[0][2 * j + 1],
                               w[1][2 * j + 1]);
            __syncwarp();
            const int c = lane & 7, rr0 = 16 * x + 4 * (lane >> 3);  // pass 0's row of the warpgroup
            const int i_lane = ig + rr0 / PACK;
            half_t* dst = out + ((((hk_u64)b * Sq + i_lane) * Hq + h0 + rr0 % PACK) * HEAD_DIM + 8 * c);
#pragma unroll
            for (int it = 0; it < 4; ++it) {
                const int rw = 4 * (lane >> 3) + it;  // the warp's row
                const hk_u32x4 v = hk_lds_16(ep + 128u * rw + 16u * (c ^ (rw & 7)));
                if (row_stored(i_lane + it / PACK, n_rows, Sq))
                    hk_stg_16(dst + (hk_u64)(it / PACK) * (Hq * HEAD_DIM) + (it % PACK) * HEAD_DIM, v);
            }
            __syncwarp();  // every lane's reads before the next step's stmatrix
        }
#else
#pragma unroll
        for (int r = 0; r < 2; ++r)
            if (row_stored(i_r[r], n_rows, Sq)) {  // lane (g, t4) writes dims 8 nd + 2 t4, + 1 of its row
                half_t* orow = out + (row0 + (hk_u64)i_r[r] * (Hq * HEAD_DIM));
#pragma unroll
                for (int nd = 0; nd < NB_O; ++nd) *(unsigned int*)(orow + 8 * nd) = w[r][nd];
            }
#endif
    }
    // The units wholly in the padding walked nothing: their rows' zeros, from the first
    // unit boundary at or past n_rows.
    const int i_dead = i0 + BP_WG * ((n_rows - i0 + BP_WG - 1) / BP_WG);
    if (i_dead < i_end) store_zero_rows(out, b, Sq, Hq, h0, PACK, i_dead, i_end, tid, NTHREADS);
}
