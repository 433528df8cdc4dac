// amd_mma.h: the AMD matrix-core instruction of gqa_flash_prefill_amdmma.hip, one 16x16x16
// product D = A B + C (fp16 in, fp32 accumulate) a wave, with the exchange between the lanes
// of a wave that the kernel needs next to it. WAVE picks the instruction:
//   WAVE 32  v_wmma_f32_16x16x16_f16 (RDNA 3, gfx11, wave32)
//   WAVE 64  v_mfma_f32_16x16x16f16  (CDNA, gfx90a and gfx94x, wave64)
// and in a bf16 kernel (HK_BF16) their bf16 forms, with the same lane layouts:
//   WAVE 32  v_wmma_f32_16x16x16_bf16
//   WAVE 64  v_mfma_f32_16x16x16bf16_1k (gfx90a and gfx94x; gfx908 has no 16x16x16 bf16)
//
// Lane layouts (the ISA's; rows and columns in 0..15, l the lane in its wave, v an index
// into the lane's registers):
//   A (M x K)   lane l holds row l % 16,    k = MMA_K0(l) + v, v < MMA_KL
//   B (K x N)   lane l holds column l % 16, k = MMA_K0(l) + v, v < MMA_KL
//   C, D        lane l holds column l % 16, row mma_acc_row(v, l), v < MMA_ACC
// with, for WMMA, MMA_KL = 16, MMA_K0 = 0, MMA_ACC = 8, rows 2 v + l / 16 (lanes 16..31 must
// hold the same A and B as lanes 0..15, which a lane's operand of row or column l % 16 is);
// for MFMA, MMA_KL = 4, MMA_K0 = 4 (l / 16), MMA_ACC = 4, rows 4 (l / 16) + v. Operands are
// fp16 (bf16) pairs in 32-bit words (MMA_KW = MMA_KL / 2), element 2 w in the low half of word w.
//
// On NVIDIA (no such instruction) the same calls are emulated lane for lane, so that the
// kernel's index arithmetic and these layouts run the case matrix on a CUDA GPU: each lane's
// operand slices go where the AMD layout puts them in a shared 16x16 A and B, mma.sync
// computes A B (bf16 in a bf16 kernel: hk_mma_16816), and each lane takes back the D elements the AMD layout gives it. WAVE 32 is
// a warp; WAVE 64 is two warps, which meet at the block barrier (and exchange lanes l ^ 32
// through shared memory). The emulation is for checking only (slower,
// and D = C + A B rounds once more than a matrix core); hipkernel.config never offers it to
// the tuner.

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
#if HK_BF16
typedef short hk_mma_in __attribute__((ext_vector_type(MMA_KL)));  // the builtins' bf16 bits
#else
typedef _Float16 hk_mma_in __attribute__((ext_vector_type(MMA_KL)));
#endif
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
#if WAVE == 32 && HK_BF16
    c = __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32(hk_mma_operand(a), hk_mma_operand(b), c);
#elif WAVE == 32
    c = __builtin_amdgcn_wmma_f32_16x16x16_f16_w32(hk_mma_operand(a), hk_mma_operand(b), c);
#elif HK_BF16
    c = __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(hk_mma_operand(a), hk_mma_operand(b), c, 0, 0, 0);
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

// The wave's threads meet: a warp (WAVE 32), or for WAVE 64 the whole block (the kernel
// then keeps every wave on the same path, EMU_BLOCK_SYNC). A named barrier of the wave's
// two warps ran correctly, but racecheck reported RAW hazards between the block barrier's
// K/V tile stores and the waves' reads with it.
HK_INLINE void hk_wave_sync() {
#if WAVE == 32
    __syncwarp();
#else
    hk_sync();
#endif
}

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

// The product, lane-exact: every lane puts its A and B slices where the AMD layout says they
// belong in a 16x16 A and B of the wave's shared scratch, the wave's warps compute A B with
// mma.sync m16n8k16 (portable.h; WAVE 32: the warp both 8-column halves, WAVE 64: warp h of
// the wave half h), put it in the scratch as a 16x16 D, and every lane adds the D elements
// that the AMD layout gives it to its accumulators (so D = C + (A B) rounded once more than
// the matrix cores would).
#define EMU_LD 24   // halves a scratch row of A and of B (16-byte aligned rows for ldmatrix)
#define EMU_LDD 17  // floats a scratch row of D
#ifndef EMU_WAVES
#error "the emulation needs -DEMU_WAVES=<waves a block> (its shared scratch)"
#endif
struct hk_emu_scratch {
    half_t a[16 * EMU_LD];  // A, row-major (rows m, k contiguous)
    half_t b[16 * EMU_LD];  // B transposed (rows n, k contiguous): ldmatrix gives mma's B
    float d[16 * EMU_LDD];  // A B, row-major
};

HK_INLINE void hk_amd_mma(float (&d)[MMA_ACC], const unsigned int (&a)[MMA_KW],
                          const unsigned int (&b)[MMA_KW]) {
    __shared__ __attribute__((aligned(16))) hk_emu_scratch emu[EMU_WAVES];
    const int l = hk_thread_x() & (WAVE - 1);
    hk_emu_scratch& x = emu[hk_thread_x() / WAVE];
    const int r = l & 15, k0 = mma_k0(l);
    if (WAVE == 64 || l < 16) {  // WMMA: lanes 16..31 hold copies of lanes 0..15's slices
#pragma unroll
        for (int w = 0; w < MMA_KW; ++w) {
            *(unsigned int*)(x.a + r * EMU_LD + k0 + 2 * w) = a[w];  // A row r, k0 + 2w, + 1
            *(unsigned int*)(x.b + r * EMU_LD + k0 + 2 * w) = b[w];  // B column r
        }
    }
    hk_wave_sync();
    const int lw = l & 31, g = lw >> 2, t = lw & 3;
    unsigned int af[4], bf[4];
    hk_ldmatrix_x4(af, hk_smem_u32(x.a + (lw & 15) * EMU_LD + 8 * (lw >> 4)));
    hk_ldmatrix_x4(bf, hk_smem_u32(x.b + ((lw & 7) + 8 * (lw >> 4)) * EMU_LD + 8 * ((lw >> 3) & 1)));
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) {
        if (WAVE == 64 && nb != (l >> 5)) continue;  // the other warp's half
        float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        hk_mma_16816(c, af, bf[2 * nb], bf[2 * nb + 1]);
        x.d[g * EMU_LDD + 8 * nb + 2 * t] = c[0];
        x.d[g * EMU_LDD + 8 * nb + 2 * t + 1] = c[1];
        x.d[(g + 8) * EMU_LDD + 8 * nb + 2 * t] = c[2];
        x.d[(g + 8) * EMU_LDD + 8 * nb + 2 * t + 1] = c[3];
    }
    hk_wave_sync();
#pragma unroll
    for (int v = 0; v < MMA_ACC; ++v) d[v] += x.d[mma_acc_row(v, l) * EMU_LDD + r];
    hk_wave_sync();  // before the next product overwrites the scratch
}
#endif  // HK_AMD
