// flash_common.h: the steps of the fused prefill that do not depend on how a kernel lays out
// its MMA fragments: visibility, the KV head of a query head, query positions, a sequence's
// lengths in a ragged batch, the first KV tile of a Q tile, the keys a load keeps, the
// padded rows' zeros, the P operand's format, the sink term and a row's epilogue factor.
// Shared by the wgmma and wgspan paths (through flash_rows.h) and the AMD matrix-core path
// (gqa_flash_prefill_amdmma.hip); every mutant macro that bites here bites at the same place
// as in the scalar kernel.

#define LOG2E 1.4426950408889634f  // exp(x) = exp2(x * LOG2E)

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

// Whether the sink term exists for this call (sink_mode 1 per head, 2 smooth: sigma = 0),
// and the sink logit in exp2 space (the epilogue folds it in once).
HK_INLINE bool sink_present(int sink_mode) {
#if defined(HIPKERNEL_MUTANT_SINK_IGNORED)
    return false;
#elif defined(HIPKERNEL_MUTANT_SMOOTH_IGNORED)
    return sink_mode == 1;
#else
    return sink_mode == 1 || sink_mode == 2;
#endif
}
HK_INLINE float sink_logit2(const half_t* sink, int sink_mode, int h) {
    const float sigma = sink_mode == 1 ? hk_fp16_value(sink[h]) : 0.0f;  // fp16 in every kernel
#ifdef HIPKERNEL_MUTANT_SINK_NO_LOG2E
    return sigma;
#else
    return sigma * LOG2E;
#endif
}

// The running max a row starts from, in exp2 units: -inf (the NaN guard keeps a row that has
// seen nothing).
HK_INLINE float row_max_init() {
#ifdef HIPKERNEL_MUTANT_MAX_FLOOR
    return -1.0e4f;  // a finite floor: a row whose logits all lie far below it gets p = 0
#else
    return hk_neg_inf();
#endif
}

// ---- block-level steps (per Q tile)

// The KV head of query head h: G = Hq / Hkv consecutive query heads share one.
HK_INLINE int kv_head(int h, int Hq, int Hkv) {
#if defined(HIPKERNEL_MUTANT_GQA_MODULO)
    return h % Hkv;
#elif defined(HIPKERNEL_MUTANT_HEAD_TILE_CROSSES_GROUP)
    return (h & ~15) / (Hq / Hkv);  // the KV head of h's 16-head tile's first head
#else
    return h / (Hq / Hkv);
#endif
}

// Query row i sits at absolute position query_base(past_len) + i (bottom-right alignment).
HK_INLINE int query_base(int past_len) {
#ifdef HIPKERNEL_MUTANT_PAST_LEN_IGNORED
    return 0;  // top-left causal alignment
#else
    return past_len;
#endif
}

// ---- ragged batches: sequence b of the batch is block z = b

// Sequence b's lengths: `past`, its past_len (row i sits at query_base(past) + i), `rows`, its
// valid query rows q_len[b] (rows [rows, Sq) are padding, stored as zeros), and `skv`, the keys
// it may read (past + rows; its cache's slots from skv on are never read). A null past_lens /
// q_lens is the uniform call: past_len / Sq for every sequence.
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

// Whether the epilogue stores row i: every row below Sq, a padded row (rows <= i) as zeros.
// Under padding_not_written the padded rows are skipped.
HK_INLINE bool row_stored(int i, int rows, int Sq) {
#ifdef HIPKERNEL_MUTANT_PADDING_NOT_WRITTEN
    (void)Sq;
    return i < rows;
#else
    (void)rows;
    return i < Sq;
#endif
}

// The zeros of a Q tile wholly in the padding, which walks no KV tile: out's rows [i_lo, i_hi)
// of heads [h0, h0 + nh) (contiguous in each row), 16 bytes a store by the block's nthreads
// threads (this one `tid`). Under padding_not_written nothing is stored.
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

// ---- the P operand of P.V

// Two p as a word of P.V's 16-bit operand, rounded to the storage format (nearest, ties to
// even): fp16, bf16 in a bf16 kernel. Under bf16_p_as_fp16 a bf16 kernel converts with the
// fp16 conversion, and P.V reads those fp16 bit patterns as bf16.
HK_INLINE unsigned int p_pack(float lo, float hi) {
#if HK_BF16 && defined(HIPKERNEL_MUTANT_BF16_P_AS_FP16)
    return hk_pack_fp16(lo, hi);
#elif HK_CUDA
    return hk_pack_h2(lo, hi);
#else
    return hk_pack(lo, hi);
#endif
}

// ---- Q tiles

// The first key any row at positions [p_first, p_last] of a Q tile may see.
HK_INLINE int kv_start_of(int p_first, int window) {
#ifdef HIPKERNEL_MUTANT_WINDOW_SKIP_OFF
    (void)p_first, (void)window;
    return 0;  // no start clamp: the walk and the loads start at key 0
#else
    return window > 0 ? (p_first - window + 1 > 0 ? p_first - window + 1 : 0) : 0;
#endif
}

// The first KV tile (of bkv keys) of that Q tile. Start-tile clamp from the tile's FIRST
// row: the rows' lower bounds p - W + 1 are non-decreasing, so this start covers every row
// and the mask trims the rest.
HK_INLINE int first_tile(int p_first, int p_last, int window, int bkv) {
#ifdef HIPKERNEL_MUTANT_CLAMP_FROM_LAST_ROW
    int t0 = kv_start_of(p_last, window) / bkv;
#else
    int t0 = kv_start_of(p_first, window) / bkv;
#endif
#ifdef HIPKERNEL_MUTANT_CLAMP_PLUS_ONE_TILE
    t0 += 1;
#endif
    return t0;
}

// Whether the load keeps key j; a key not kept is zero-filled: past skv (cache padding) and
// below kv_start (below every row's window). P.V multiplies p = 0 by them, and 0 * NaN
// would still be NaN.
HK_INLINE bool key_kept(int j, int kv_start, int skv, int S_cap) {
#ifdef HIPKERNEL_MUTANT_TAIL_UNMASKED
    return j >= kv_start && j < S_cap;  // raw past skv: NaN canaries
#else
    return j >= kv_start && j < skv;
#endif
}

// ---- epilogue (per row)

// A row's output factor, out = acc * row_scale(...): the sink folded into the denominator
// once, with the max taken over it too (acc and l times fac = exp2(m - m_fin)); fac * (1 / l),
// one correctly rounded reciprocal, 0 for a row with nothing in its denominator (l == 0; a NaN
// l stays NaN). m, l: the row's running max (exp2 space) and sum; sig2: sink_logit2's.
HK_INLINE float row_scale(float m, float l, bool has_sink, float sig2) {
    float fac = 1.0f;
    if (has_sink) {
#ifdef HIPKERNEL_MUTANT_SINK_MAX_SKIPPED
        const float m_fin = m;  // exp2(sig2 - m) overflows for a large sink
#else
        const float m_fin = hk_fmax(m, sig2);
#endif
        fac = m == hk_neg_inf() ? 0.0f : hk_exp2(m - m_fin);  // row saw nothing: 0
        l *= fac;
#ifndef HIPKERNEL_MUTANT_SINK_PER_TILE
#ifdef HIPKERNEL_MUTANT_SINK_UNSHIFTED
        l += sig2 == hk_neg_inf() ? 0.0f : hk_exp2(sig2);  // not shifted by the max
#else
        l += sig2 == hk_neg_inf() ? 0.0f : hk_exp2(sig2 - m_fin);
#endif
#endif
    }
    return l == 0.0f ? 0.0f : fac * hk_rcp(l);
}
