// flash_rows.h: the per-row steps of the wgmma path (gqa_flash_prefill_wgmma.hip), on the
// MMA fragments of one group of 16 query rows. gqa_flash_prefill_mma.hip keeps its own copy
// of the same steps on purpose: on the H200, built on these helpers, it ran 5-7% slower.
//
// Fragments (portable.h, "MMA fragments"): lane l = 4 g + t4 of the warp owning the group
// holds its rows g and g + 8.
//   scores       s[nb][e]   row g + 8 (e >> 1), key 8 nb + 2 t4 + (e & 1) of the KV tile
//   accumulator  o[nd][e]   row g + 8 (e >> 1), dim 8 nd + 2 t4 + (e & 1)
//   row state    m[r], l[r] row g + 8 r; the 4 lanes of a row hold the same values
// The steps are hipkernel/model.py's docstring: the visibility predicate, the online softmax
// with its NaN guard, the sink epilogue in exp2 space with the max taken over the sink, and
// out = acc * (fac * (1 / l)) (0 when l == 0). The mutant macros bite here exactly as in the scalar kernel.
// The steps that do not depend on the fragment layout are flash_common.h's.

#include "flash_common.h"

// RESCALE_LOG2 > 0: rescale acc and l only when a row's max grows by more than that (see
// softmax_step); 0: every tile.
#ifndef RESCALE_LOG2
#define RESCALE_LOG2 0
#endif
// RESCALE_ROWS: the rows that decide a lazy rescale together, 16 (the warp's) or 8 (each half
// of them on its own; KernelConfig.rescale_rows sets it, the model follows).
#ifndef RESCALE_ROWS
#define RESCALE_ROWS 16
#endif
#if RESCALE_ROWS != 8 && RESCALE_ROWS != 16
#error "RESCALE_ROWS: 8 or 16, the rows that decide a lazy rescale together"
#endif

// Q rows g and g + 8 of the group as A fragments: qf[kc] holds dims [16 kc, 16 kc + 16).
// qrow[r] points at dim 2 t4 of row g + 8 r, or is null for a row not computed (past Sq, or
// padding: zeros).
template <int KC>
HK_INLINE void load_q_fragments(unsigned int (&qf)[KC][4], const half_t* const (&qrow)[2]) {
#pragma unroll
    for (int kc = 0; kc < KC; ++kc)
#pragma unroll
        for (int e = 0; e < 4; ++e) {  // e: (row g, k lo) (row g+8, k lo) (g, k hi) (g+8, k hi)
            const half_t* row = qrow[e & 1];
            qf[kc][e] = row != nullptr ? *(const unsigned int*)(row + 16 * kc + 8 * (e >> 1)) : 0u;
        }
}

// Invisible keys of the tile starting at key j0 get -inf; p[r] is row g + 8 r's position.
template <int NB_S>
HK_INLINE void mask_scores(float (&s)[NB_S][4], int j0, int t4, const int (&p)[2], int window) {
#pragma unroll
    for (int nb = 0; nb < NB_S; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (!visible(p[e >> 1], j0 + 8 * nb + 2 * t4 + (e & 1), window)) s[nb][e] = hk_neg_inf();
}

// The sink_per_tile mutant: one sink term a tile, added to the row sums after their scaling,
// in each row that has seen a key (m != -inf: the rows that updated); l_r is row g + 8 r's
// sum, kept here (softmax_scores) or by the caller (the wgmma tile's ROWSUM_MMA). Nothing
// without the mutant.
HK_INLINE void sink_per_tile_mutant(float& l0, float& l1, const float (&m)[2], bool has_sink, float sig2) {
#ifdef HIPKERNEL_MUTANT_SINK_PER_TILE
    if (has_sink && m[0] != hk_neg_inf()) l0 += hk_exp2(sig2 - m[0]);  // split-KV bug
    if (has_sink && m[1] != hk_neg_inf()) l1 += hk_exp2(sig2 - m[1]);
#else
    (void)l0, (void)l1, (void)m, (void)has_sink, (void)sig2;
#endif
}

// One online-softmax step over a tile of raw dot products s (in place: s becomes p, fp32),
// without the row sums. Logits in exp2 space are s2 = c2 * dot, c2 = scale * LOG2E > 0, so
// max_j s2_j = c2 max_j dot_j; m takes it rounded up (hk_mul_up, portable.h), so that every
// p_j <= 1. NaN guard: a row that has seen nothing so far and sees nothing in this tile
// (m_new = -inf) keeps (m, l, acc): it takes alpha = 1 and p = 0 instead of
// exp2(-inf - -inf) = NaN.
//   p_j = exp2(s2_j - m_new) = exp2(fma(dot_j, c2, -m_new)), one FFMA and one MUFU; an
//   invisible key (dot = -inf) gives exp2(-inf) = 0 with no select. A row that does not
//   update has only invisible keys: its shift is 0, so its p are 0 too.
// on_p(r, p_j) sees each p of the lane's row g + 8 r as it is made (softmax_scores sums
// them there; softmax_p, for the wgmma tile's ROWSUM_MMA, which sums the fp16 P on the tensor
// cores, ignores them). Returns whether acc and the row sums must be scaled by alpha (always,
// unless lazy rescaling skips it); rescale_acc does it.
// mid(alpha, rescale), where given, runs after the exp2 of the key blocks [0, SPLIT) and before
// the rest's (the wgmma tile waits there for its owed P.V, so that what follows the wait can
// run among the remaining exp2); SPLIT = NB_S: never.
template <int NB_S, int SPLIT = NB_S, class OnP, class Mid>
HK_INLINE bool softmax_tile(float (&s)[NB_S][4], float (&m)[2], float (&alpha)[2], float c2, OnP&& on_p,
                            Mid&& mid) {
    float m_tile[2] = {hk_neg_inf(), hk_neg_inf()};
#pragma unroll
    for (int nb = 0; nb < NB_S; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) m_tile[e >> 1] = hk_fmax(m_tile[e >> 1], s[nb][e]);

    float m_new[2], neg_m[2];
    bool update[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        m_tile[r] = hk_fmax(m_tile[r], hk_xor(m_tile[r], 1));  // the row's 4 lanes
        m_tile[r] = hk_fmax(m_tile[r], hk_xor(m_tile[r], 2));
        m_new[r] = hk_fmax(m[r], hk_mul_up(c2, m_tile[r]));  // rounded up: p <= 1 (portable.h)
    }
#if RESCALE_LOG2 > 0
    // Lazy rescaling: the warp (with RESCALE_ROWS 8, each half of its rows) keeps its rows'
    // running max m while no row's grows by more than RESCALE_LOG2 (in exp2 space) in this
    // tile, so p <= 2^RESCALE_LOG2 and acc, l stay relative to the same m (the epilogue
    // divides the shift out); otherwise each of those rows rescales as below. A row that has
    // seen nothing (m = -inf) and sees something now always rescales.
#if RESCALE_ROWS == 8
    // each half of the warp's rows (the lanes' row g, then g + 8) votes on its own: a row's
    // exp2 waits for its own half's vote only; acc is scaled when either half moved (alpha = 1
    // exactly in a half that kept its m)
    bool rescale = false;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const bool half = hk_any(m_new[r] > m[r] + RESCALE_LOG2);
        if (!half) m_new[r] = m[r];
        rescale = rescale || half;
    }
#else
    const bool rescale = hk_any(m_new[0] > m[0] + RESCALE_LOG2 || m_new[1] > m[1] + RESCALE_LOG2);
    if (!rescale) {
#pragma unroll
        for (int r = 0; r < 2; ++r) m_new[r] = m[r];
    }
#endif
#endif
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#ifdef HIPKERNEL_MUTANT_NO_NAN_GUARD
        update[r] = true;  // m_new = -inf: alpha and p become exp2(-inf - -inf) = NaN
#else
        update[r] = m_new[r] != hk_neg_inf();
#endif
        alpha[r] = update[r] ? hk_exp2_ftz(m[r] - m_new[r]) : 1.0f;  // 0 when m = -inf
        neg_m[r] = update[r] ? -m_new[r] : 0.0f;
    }
#if RESCALE_LOG2 > 0
    const bool scaled = rescale;
#else
    const bool scaled = true;
#endif
#pragma unroll
    for (int nb = 0; nb < NB_S; ++nb) {
        if (nb == SPLIT) mid(alpha, scaled);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float pj = hk_exp2_ftz(hk_fma(s[nb][e], c2, neg_m[e >> 1]));
            s[nb][e] = pj;
            on_p(e >> 1, pj);
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r)
        if (update[r]) m[r] = m_new[r];
    return scaled;
}

template <int NB_S, class OnP>
HK_INLINE bool softmax_tile(float (&s)[NB_S][4], float (&m)[2], float (&alpha)[2], float c2, OnP&& on_p) {
    return softmax_tile<NB_S, NB_S>(s, m, alpha, c2, on_p, [](const float (&)[2], bool) {});
}

// The step without the row sums (the caller's, on the tensor cores).
template <int NB_S, int SPLIT = NB_S, class Mid>
HK_INLINE bool softmax_p(float (&s)[NB_S][4], float (&m)[2], float (&alpha)[2], float c2, Mid&& mid) {
    return softmax_tile<NB_S, SPLIT>(s, m, alpha, c2, [](int, float) {}, mid);
}
template <int NB_S>
HK_INLINE bool softmax_p(float (&s)[NB_S][4], float (&m)[2], float (&alpha)[2], float c2) {
    return softmax_tile(s, m, alpha, c2, [](int, float) {});
}

// The step with the row sums in fp32: l = l * alpha + sum_j p_j over the row's 4 lanes.
template <int NB_S, int SPLIT = NB_S, class Mid>
HK_INLINE bool softmax_scores(float (&s)[NB_S][4], float (&m)[2], float (&l)[2], float (&alpha)[2],
                              float c2, bool has_sink, float sig2, Mid&& mid) {
    float l_tile[2] = {0.0f, 0.0f};
    const bool rescale = softmax_tile<NB_S, SPLIT>(s, m, alpha, c2, [&](int r, float pj) { l_tile[r] += pj; }, mid);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l_tile[r] += hk_xor(l_tile[r], 1);  // the row's sum over the whole tile
        l_tile[r] += hk_xor(l_tile[r], 2);
        l[r] = l[r] * alpha[r] + l_tile[r];
    }
    sink_per_tile_mutant(l[0], l[1], m, has_sink, sig2);
    return rescale;
}
template <int NB_S>
HK_INLINE bool softmax_scores(float (&s)[NB_S][4], float (&m)[2], float (&l)[2], float (&alpha)[2],
                              float c2, bool has_sink, float sig2) {
    return softmax_scores<NB_S, NB_S>(s, m, l, alpha, c2, has_sink, sig2, [](const float (&)[2], bool) {});
}

// The step with the row sums kept a lane's own (the wgmma kernel's L_DEFER): l = l * alpha +
// the sum of this lane's p of the row; alpha is the row's, the same in its 4 lanes, so the
// row's sum is the sum of its lanes' l, which lane_sums_to_rows takes once, after the last
// tile. The sums are those of softmax_scores in another order. `lead` (t4 = 0): the lane
// that adds the per-tile sink mutant's term, once a row.
template <int NB_S, int SPLIT = NB_S, class Mid>
HK_INLINE bool softmax_lane_scores(float (&s)[NB_S][4], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                   float c2, bool has_sink, float sig2, bool lead, Mid&& mid) {
    float l_tile[2] = {0.0f, 0.0f};
    const bool rescale = softmax_tile<NB_S, SPLIT>(s, m, alpha, c2, [&](int r, float pj) { l_tile[r] += pj; }, mid);
#pragma unroll
    for (int r = 0; r < 2; ++r) l[r] = l[r] * alpha[r] + l_tile[r];
    if (lead) sink_per_tile_mutant(l[0], l[1], m, has_sink, sig2);
    return rescale;
}
template <int NB_S>
HK_INLINE bool softmax_lane_scores(float (&s)[NB_S][4], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                   float c2, bool has_sink, float sig2, bool lead) {
    return softmax_lane_scores<NB_S, NB_S>(s, m, l, alpha, c2, has_sink, sig2, lead, [](const float (&)[2], bool) {});
}
// The rows' sums from their lanes' (softmax_lane_scores).
HK_INLINE void lane_sums_to_rows(float (&l)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += hk_xor(l[r], 1);
        l[r] += hk_xor(l[r], 2);
    }
}

// acc *= alpha, row by row, when softmax_scores asked for it.
template <int NB_O>
HK_INLINE void rescale_acc(float (&o)[NB_O][4], const float (&alpha)[2], bool rescale) {
    if (rescale)
#pragma unroll
        for (int nd = 0; nd < NB_O; ++nd)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[nd][e] *= alpha[e >> 1];
}

// One whole online-softmax step: the scores, then acc scaled (not when `fresh`: a row's
// first tile, whose acc is not set yet and which the caller's P.V overwrites); the caller
// adds P.V.
template <int NB_S, int NB_O>
HK_INLINE void softmax_step(float (&s)[NB_S][4], float (&m)[2], float (&l)[2], float (&o)[NB_O][4],
                            float c2, bool has_sink, float sig2, bool fresh = false) {
    float alpha[2];
    const bool rescale = softmax_scores(s, m, l, alpha, c2, has_sink, sig2);
    if (!fresh) rescale_acc(o, alpha, rescale);
}

// P of keys [16 kc, 16 kc + 16) as an MMA A fragment, rounded to fp16 (bf16 in a bf16 kernel;
// p_pack): the S fragments of key blocks 2 kc and 2 kc + 1 are the A layout of one 16-key chunk.
template <int NB_S>
HK_INLINE void p_fragment(unsigned int (&pa)[4], const float (&s)[NB_S][4], int kc) {
    pa[0] = p_pack(s[2 * kc][0], s[2 * kc][1]);
    pa[1] = p_pack(s[2 * kc][2], s[2 * kc][3]);
    pa[2] = p_pack(s[2 * kc + 1][0], s[2 * kc + 1][1]);
    pa[3] = p_pack(s[2 * kc + 1][2], s[2 * kc + 1][3]);
}

// The epilogue's factor of the lane's two rows: out = acc * scale[r] (flash_common.h).
HK_INLINE void row_scales(const float (&m)[2], const float (&l)[2], bool has_sink, float sig2, float (&scale)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) scale[r] = row_scale(m[r], l[r], has_sink, sig2);
}

// The group's output as pairs of the storage format: w[r][nd] holds row g + 8 r's dims
// 8 nd + 2 t4, + 1; zeros for a row that is not `valid` (a padded row of a ragged batch).
template <int NB_O>
HK_INLINE void out_words(const float (&o)[NB_O][4], const float (&scale)[2], const bool (&valid)[2],
                         unsigned int (&w)[2][NB_O]) {
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int nd = 0; nd < NB_O; ++nd)
            w[r][nd] = valid[r] ? hk_pack_h2(o[nd][2 * r] * scale[r], o[nd][2 * r + 1] * scale[r]) : 0u;
}

// Epilogue of the group (row_scales, out_words), stored by the lanes: orow[r] points at dim
// 2 t4 of row g + 8 r's output, or is null for a row not stored (past Sq; row_stored);
// valid[r]: the row is computed (not padding).
template <int NB_O>
HK_INLINE void finish_rows(const float (&o)[NB_O][4], const float (&m)[2], const float (&l)[2], bool has_sink,
                           float sig2, half_t* const (&orow)[2], const bool (&valid)[2]) {
    float scale[2];
    row_scales(m, l, has_sink, sig2, scale);
    unsigned int w[2][NB_O];
    out_words(o, scale, valid, w);
#pragma unroll
    for (int r = 0; r < 2; ++r)
        if (orow[r] != nullptr)  // lane (g, t4) writes dims 8 nd + 2 t4, + 1 of its row
#pragma unroll
            for (int nd = 0; nd < NB_O; ++nd) *(unsigned int*)(orow[r] + 8 * nd) = w[r][nd];
}
