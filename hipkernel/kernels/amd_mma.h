// amd_mma.h: the AMD matrix-core instruction of gqa_flash_prefill_amdmma.hip, one 16x16x16
// product D = A B + C (fp16 in, fp32 accumulate) a wave, with the exchange between the lanes
// of a wave that the kernel needs next to it. WAVE picks the instruction:
//   WAVE 32  v_wmma_f32_16x16x16_f16 (RDNA 3, gfx11, wave32)
//   WAVE 64  v_mfma_f32_16x16x16f16  (CDNA, gfx90a and gfx94x, wave64)
//
// Lane layouts (the ISA's; rows and columns in 0..15, l the lane in its wave, v an index
// into the lane's registers):
//   A (M x K)   lane l holds row l % 16,    k = MMA_K0(l) + v, v < MMA_KL
//   B (K x N)   lane l holds column l % 16, k = MMA_K0(l) + v, v < MMA_KL
//   C, D        lane l holds column l % 16, row mma_acc_row(v, l), v < MMA_ACC
// with, for WMMA, MMA_KL = 16, MMA_K0 = 0, MMA_ACC = 8, rows 2 v + l / 16 (lanes 16..31 must
// hold the same A and B as lanes 0..15, which a lane's operand of row or column l % 16 is);
// for MFMA, MMA_KL = 4, MMA_K0 = 4 (l / 16), MMA_ACC = 4, rows 4 (l / 16) + v. Operands are
// fp16 pairs in 32-bit words (MMA_KW = MMA_KL / 2), element 2 w in the low half of word w.
//
// On NVIDIA (no such instruction) the same calls are emulated lane for lane, so that the
// kernel's index arithmetic and these layouts run the case matrix on a CUDA GPU: WAVE 32 is
// a warp (the product through warp shuffles); WAVE 64 is two warps, which exchange through
// shared memory behind a named barrier of the wave's 64 threads. The emulation is for
// checking only (slow, and its fp32 sums run in k order, where the matrix cores' order is
// their own); hipkernel.config never offers it to the tuner.

#if !defined(WAVE) || (WAVE != 32 && WAVE != 64)
#error "compile with -DWAVE=32 (WMMA, gfx11) or -DWAVE=64 (MFMA, gfx90a / gfx94x)"
#endif
#if WAVE == 32
#define MMA_KL 16
#define MMA_ACC 8
#else
#define MMA_KL 4
#define MMA_ACC 4
#endif
#define MMA_KW (MMA_KL / 2)

// The first k of lane l's operand slice, and the row of its accumulator element v.
HK_INLINE int mma_k0(int l) { return WAVE == 32 ? 0 : 4 * (l >> 4); }
HK_INLINE int mma_acc_row(int v, int l) { return WAVE == 32 ? 2 * v + (l >> 4) : 4 * (l >> 4) + v; }

#if HK_AMD
typedef _Float16 hk_mma_in __attribute__((ext_vector_type(MMA_KL)));
typedef unsigned int hk_mma_words __attribute__((ext_vector_type(MMA_KW)));
typedef float hk_mma_acc __attribute__((ext_vector_type(MMA_ACC)));

HK_INLINE hk_mma_in hk_mma_operand(const unsigned int (&w)[MMA_KW]) {
    hk_mma_words x;
#pragma unroll
    for (int i = 0; i < MMA_KW; ++i) x[i] = w[i];
    return __builtin_bit_cast(hk_mma_in, x);
}

// d = A b + d, the wave's 16x16x16 product.
HK_INLINE void hk_amd_mma(float (&d)[MMA_ACC], const unsigned int (&a)[MMA_KW],
                          const unsigned int (&b)[MMA_KW]) {
    hk_mma_acc c;
#pragma unroll
    for (int i = 0; i < MMA_ACC; ++i) c[i] = d[i];
#if WAVE == 32
    c = __builtin_amdgcn_wmma_f32_16x16x16_f16_w32(hk_mma_operand(a), hk_mma_operand(b), c);
#else
    c = __builtin_amdgcn_mfma_f32_16x16x16f16(hk_mma_operand(a), hk_mma_operand(b), c, 0, 0, 0);
#endif
#pragma unroll
    for (int i = 0; i < MMA_ACC; ++i) d[i] = c[i];
}

// The value of lane l ^ mask of the wave (ds_bpermute: lane addresses in bytes).
HK_INLINE float hk_wave_xor(float x, int mask, int l) {
    return __builtin_bit_cast(float, __builtin_amdgcn_ds_bpermute((l ^ mask) << 2, __builtin_bit_cast(int, x)));
}

#else  // NVIDIA: the emulation

#if WAVE == 64
#ifndef EMU_WAVES
#error "the WAVE 64 emulation needs -DEMU_WAVES=<waves a block> (its shared scratch)"
#endif
// The 64 threads of wave w (warps 2 w, 2 w + 1) meet at named barrier 1 + w.
HK_INLINE void hk_wave_sync() { hk_named_sync(1 + (hk_thread_x() >> 6), 64); }
#endif

HK_INLINE float hk_wave_xor(float x, int mask, int l) {
#if WAVE == 64
    if (mask >= 32) {  // the other warp of the wave
        __shared__ float xch[EMU_WAVES][64];
        const int w = hk_thread_x() >> 6;
        xch[w][l] = x;
        hk_wave_sync();
        const float y = xch[w][l ^ mask];
        hk_wave_sync();  // before the next exchange overwrites it
        return y;
    }
#endif
    (void)l;
    return __shfl_xor_sync(0xffffffffu, x, mask);
}

// Element v (a half) of an operand slice held as words.
HK_INLINE float hk_mma_elem(unsigned int w, int v) { return (v & 1) ? hk_hi(w) : hk_lo(w); }

HK_INLINE void hk_amd_mma(float (&d)[MMA_ACC], const unsigned int (&a)[MMA_KW],
                          const unsigned int (&b)[MMA_KW]) {
    const int l = hk_thread_x() & (WAVE - 1);
#if WAVE == 32
    // Lane l computes column l % 16 (its own b) of rows 2 v + l / 16, each row of A from the
    // lane that holds it (lane m; lanes m and m + 16 hold the same).
#pragma unroll
    for (int v = 0; v < MMA_ACC; ++v) {
        const int m = mma_acc_row(v, l);
        float acc = d[v];
#pragma unroll
        for (int w = 0; w < MMA_KW; ++w) {
            const unsigned int aw = __shfl_sync(0xffffffffu, a[w], m);
            acc = hk_fma(hk_lo(aw), hk_lo(b[w]), acc);
            acc = hk_fma(hk_hi(aw), hk_hi(b[w]), acc);
        }
        d[v] = acc;
    }
#else
    // Every lane's slices into the wave's scratch; lane l then takes row m = 4 (l / 16) + v of
    // A (k = 4 q + i from lane m + 16 q) and column n = l % 16 of B (from lanes n + 16 q).
    __shared__ unsigned int ab[EMU_WAVES][2][64][MMA_KW];
    const int wv = hk_thread_x() >> 6, n = l & 15;
#pragma unroll
    for (int w = 0; w < MMA_KW; ++w) {
        ab[wv][0][l][w] = a[w];
        ab[wv][1][l][w] = b[w];
    }
    hk_wave_sync();
#pragma unroll
    for (int v = 0; v < MMA_ACC; ++v) {
        const int m = mma_acc_row(v, l);
        float acc = d[v];
#pragma unroll
        for (int k = 0; k < 16; ++k) {
            const unsigned int aw = ab[wv][0][m + 16 * (k >> 2)][(k & 3) >> 1];
            const unsigned int bw = ab[wv][1][n + 16 * (k >> 2)][(k & 3) >> 1];
            acc = hk_fma(hk_mma_elem(aw, k), hk_mma_elem(bw, k), acc);
        }
        d[v] = acc;
    }
    hk_wave_sync();  // before the next product overwrites the scratch
#endif
}
#endif  // HK_AMD
