// portable.h: the few differences between HIP (AMD) and CUDA (NVIDIA) device code that
// gqa_flash_prefill.hip (and, NVIDIA only, gqa_flash_prefill_mma.hip) need, behind small
// inline functions.
//
// It includes no header at all, so it compiles unchanged under
//   - NVRTC (CUDA): builtins only; fp16 converts through inline PTX, not <cuda_fp16.h>,
//     so the runtime compiler needs no include path;
//   - hiprtc (AMD): HIP clang, which pre-declares __global__, __shared__, threadIdx, ...;
//   - clang -x hip -nogpuinc -nogpulib (AMD, offline check): nothing pre-declared and no
//     device libraries, hence amdgcn builtins instead of ocml/ockl calls.
//
// q, k, v and out cross the ABI as `half_t`: 16-bit storage, converted to and from fp32 in
// registers. The format is chosen at compile time: IEEE binary16 (fp16), or with -DHK_BF16=1
// bfloat16 (the top half of an fp32 word). The sink is fp16 in both (hk_fp16_value).
#pragma once

#ifndef HK_BF16
#define HK_BF16 0
#endif

#if defined(__HIP__) || defined(__HIPCC__) || defined(__HIPCC_RTC__)
#define HK_AMD 1
#elif defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(__NVCC__)
#define HK_CUDA 1
#else
#error "portable.h: compile as HIP (hiprtc, clang -x hip) or CUDA (NVRTC)"
#endif

// ---- attributes -------------------------------------------------------------------------
#if HK_AMD
#ifndef __global__  // bare clang with -nogpuinc declares none of these
#define __global__ __attribute__((global))
#endif
#ifndef __device__
#define __device__ __attribute__((device))
#endif
#ifndef __shared__
#define __shared__ __attribute__((shared))
#endif
#define HK_LAUNCH_BOUNDS(n) __attribute__((amdgpu_flat_work_group_size(1, n)))
#else
#define HK_LAUNCH_BOUNDS(n) __launch_bounds__(n)
#endif
#define HK_RESTRICT __restrict__
#define HK_INLINE __device__ __forceinline__
#if HK_AMD && !defined(__forceinline__)
#define __forceinline__ inline __attribute__((always_inline))
#endif

typedef unsigned short half_t;  // 16-bit storage: fp16, or bf16 with HK_BF16
typedef unsigned long long hk_u64;

// 16 bytes = 8 halves: the unit of every global and shared memory access. Word e holds
// halves 2e (low bits) and 2e + 1. On AMD a native vector, so it lives in registers.
#if HK_AMD
typedef unsigned int hk_vec8 __attribute__((ext_vector_type(4)));
HK_INLINE unsigned int hk_word(hk_vec8 x, int e) { return x[e]; }
HK_INLINE hk_vec8 hk_vec(unsigned int a, unsigned int b, unsigned int c, unsigned int d) {
    return hk_vec8{a, b, c, d};
}
#else
struct __attribute__((aligned(16))) hk_vec8 {
    unsigned int w[4];
};
HK_INLINE unsigned int hk_word(hk_vec8 x, int e) { return x.w[e]; }
HK_INLINE hk_vec8 hk_vec(unsigned int a, unsigned int b, unsigned int c, unsigned int d) {
    hk_vec8 x = {{a, b, c, d}};
    return x;
}
#endif

// ---- thread geometry and barrier --------------------------------------------------------
#if HK_AMD
HK_INLINE int hk_thread_x() { return (int)__builtin_amdgcn_workitem_id_x(); }
HK_INLINE int hk_block_x() { return (int)__builtin_amdgcn_workgroup_id_x(); }
HK_INLINE int hk_block_y() { return (int)__builtin_amdgcn_workgroup_id_y(); }
HK_INLINE int hk_block_z() { return (int)__builtin_amdgcn_workgroup_id_z(); }
// Blocks along x and z (the grid's size in work-items over the block's).
HK_INLINE int hk_grid_x() {
    return (int)(__builtin_amdgcn_grid_size_x() / __builtin_amdgcn_workgroup_size_x());
}
HK_INLINE int hk_grid_z() {
    return (int)(__builtin_amdgcn_grid_size_z() / __builtin_amdgcn_workgroup_size_z());
}
// __syncthreads() as HIP defines it: release, s_barrier, acquire at workgroup scope.
HK_INLINE void hk_sync() {
    __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
    __builtin_amdgcn_s_barrier();
    __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
}
#else
HK_INLINE int hk_thread_x() { return (int)threadIdx.x; }
HK_INLINE int hk_block_x() { return (int)blockIdx.x; }
HK_INLINE int hk_block_y() { return (int)blockIdx.y; }
HK_INLINE int hk_block_z() { return (int)blockIdx.z; }
HK_INLINE int hk_grid_x() { return (int)gridDim.x; }  // blocks along x
HK_INLINE int hk_grid_z() { return (int)gridDim.z; }  // blocks along z
HK_INLINE void hk_sync() { __syncthreads(); }
#endif

// ---- fp16 <-> fp32 (the sink always; q, k, v and out of an fp16 kernel) -----------------
#if HK_AMD
HK_INLINE float hk_fp16_value(half_t h) { return (float)__builtin_bit_cast(_Float16, h); }
HK_INLINE half_t hk_fp16_bits(float f) { return __builtin_bit_cast(half_t, (_Float16)f); }  // RNE
#else
HK_INLINE float hk_fp16_value(half_t h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
HK_INLINE half_t hk_fp16_bits(float f) {
    half_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#endif

// ---- bf16 <-> fp32: bf16 is the top half of an fp32 word -----------------------------------
#if HK_AMD
HK_INLINE float hk_bits_as_float(unsigned int u) { return __builtin_bit_cast(float, u); }
HK_INLINE unsigned int hk_float_bits(float f) { return __builtin_bit_cast(unsigned int, f); }
#else
HK_INLINE float hk_bits_as_float(unsigned int u) { return __uint_as_float(u); }
HK_INLINE unsigned int hk_float_bits(float f) { return __float_as_uint(f); }
#endif
HK_INLINE float hk_bf16_value(half_t h) { return hk_bits_as_float((unsigned int)h << 16); }
// Round to nearest, ties to even: cvt.rn.bf16.f32 on sm_80+; elsewhere in integer arithmetic
// (add 0x7fff and the lowest kept bit, drop the low 16 bits; a NaN stays a quiet NaN).
HK_INLINE half_t hk_bf16_bits(float f) {
#if HK_CUDA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    half_t h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    const unsigned int u = hk_float_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (half_t)((u >> 16) | 0x40u);
    return (half_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#endif
}

// ---- the storage format <-> fp32 ---------------------------------------------------------
#if HK_BF16
HK_INLINE float hk_h2f(half_t h) { return hk_bf16_value(h); }
HK_INLINE half_t hk_f2h(float f) { return hk_bf16_bits(f); }  // RNE
// The two elements packed in a 32-bit word (little endian: element 0 in the low bits).
HK_INLINE float hk_lo(unsigned int w) { return hk_bits_as_float(w << 16); }
HK_INLINE float hk_hi(unsigned int w) { return hk_bits_as_float(w & 0xffff0000u); }
#else
HK_INLINE float hk_h2f(half_t h) { return hk_fp16_value(h); }
HK_INLINE half_t hk_f2h(float f) { return hk_fp16_bits(f); }  // RNE
// The two halves packed in a 32-bit word (little endian: element 0 in the low bits).
HK_INLINE float hk_lo(unsigned int w) { return hk_h2f((half_t)(w & 0xffffu)); }
HK_INLINE float hk_hi(unsigned int w) { return hk_h2f((half_t)(w >> 16)); }
#endif
HK_INLINE unsigned int hk_pack(float lo, float hi) {
    return (unsigned int)hk_f2h(lo) | ((unsigned int)hk_f2h(hi) << 16);
}
// Two fp32 as one word of two fp16 whatever the storage format (RNE), lo in the low bits.
HK_INLINE unsigned int hk_pack_fp16(float lo, float hi) {
#if HK_CUDA
    unsigned int r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));  // d = {hi, lo}
    return r;
#else
    return (unsigned int)hk_fp16_bits(lo) | ((unsigned int)hk_fp16_bits(hi) << 16);
#endif
}

// ---- fp32 math ---------------------------------------------------------------------------
#if HK_AMD
HK_INLINE float hk_exp2(float x) { return __builtin_exp2f(x); }  // v_exp_f32, no libcall
HK_INLINE float hk_fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
HK_INLINE float hk_fmax(float a, float b) { return __builtin_fmaxf(a, b); }
HK_INLINE float hk_neg_inf() { return -__builtin_inff(); }
HK_INLINE float hk_rcp(float x) { return 1.0f / x; }  // correctly rounded (HIP's default)
// a * b rounded toward +inf (no per-instruction rounding modes here): the nearest product,
// one ulp up when the exact error a * b - p (an fma, exact) is positive. inf, NaN and exact
// products stay as they are; an exact product below the smallest subnormal that rounded to
// 0 becomes the smallest subnormal.
HK_INLINE float hk_mul_up(float a, float b) {
    const float p = a * b;
    if (!(__builtin_fmaf(a, b, -p) > 0.0f)) return p;
    const int i = __builtin_bit_cast(int, p);
    return __builtin_bit_cast(float, p == 0.0f ? 1 : (p > 0.0f ? i + 1 : i - 1));
}
#else
HK_INLINE float hk_exp2(float x) { return exp2f(x); }  // ex2.approx based
HK_INLINE float hk_fma(float a, float b, float c) { return fmaf(a, b, c); }
HK_INLINE float hk_fmax(float a, float b) { return fmaxf(a, b); }
HK_INLINE float hk_neg_inf() { return __int_as_float(0xff800000); }
// 1 / x correctly rounded (rcp.rn: the value of IEEE 1.0f / x; 1 / 0 = inf, 1 / NaN = NaN):
// the tensor-core epilogues' one reciprocal a row. (The scalar kernel keeps a division an
// element: with a reciprocal ptxas spilled two of its tiles on sm_80, m4_b32 at d 64 with
// 1.0f / l and m4_b64 at d 128 with rcp.rn.)
HK_INLINE float hk_rcp(float x) {
    float y;
    asm("rcp.rn.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
HK_INLINE float hk_mul_up(float a, float b) { return __fmul_ru(a, b); }  // a * b toward +inf
#endif
// The row max of the logits in exp2 space, c2 * max_j dot_j, is taken rounded UP: then every
// visible key has c2 * dot_j <= m, so p_j = exp2(fma(dot_j, c2, -m)) <= 1 (<= 2^RESCALE_LOG2
// under lazy rescaling) at any magnitude. Rounded to nearest, m may sit ulp(m) / 2 below a
// logit, which at |m| >= 2^31 is over 128: p_j = inf, out = inf / inf = NaN. m's rounding is
// a factor common to the row's p_j, so it cancels in acc / l.

// ---- lane exchange: the value of the partner lane (lane ^ 1) ----------------------------
#if HK_AMD
// DPP quad_perm [1,0,3,2] swaps adjacent lanes within each row of 16; it works for
// wave32 (RDNA) and wave64 (CDNA) alike and needs neither LDS nor a lane id.
HK_INLINE float hk_xor1(float x) {
    int i = __builtin_bit_cast(int, x);
    return __builtin_bit_cast(float, __builtin_amdgcn_update_dpp(i, i, 0xB1, 0xF, 0xF, false));
}
#else
HK_INLINE float hk_xor1(float x) { return __shfl_xor_sync(0xffffffffu, x, 1); }
#endif

// ---- NVIDIA tensor-core and async-copy primitives (sm_80+), for gqa_flash_prefill_mma.hip --
// Inline PTX wrappers, CUDA only: AMD has no MMA path yet and keeps the scalar kernel.
// Fragment layouts are the PTX ISA's ("Matrix Fragments for mma.m16n8k16 with floating
// point type"; "ldmatrix"), with g = lane >> 2 and t = lane & 3:
//   A (16x16 f16, row-major)  a0: (row g,     cols 2t, 2t+1)   a1: (row g + 8, cols 2t, 2t+1)
//                             a2: (row g,     cols 2t+8, 2t+9) a3: (row g + 8, cols 2t+8, 2t+9)
//   B (16x8 f16, "col")       b0: (rows 2t, 2t+1, col g)       b1: (rows 2t+8, 2t+9, col g)
//   C, D (16x8 f32)           c0, c1: (row g, cols 2t, 2t+1)   c2, c3: (row g + 8, cols 2t, 2t+1)
// Each 32-bit register holds two halves, the lower column / row index in the low 16 bits.
// bf16 operands (HK_BF16) have the same layouts.
#if HK_CUDA
// 32-bit shared-state-space address of a generic pointer into shared memory (what
// ldmatrix and cp.async take).
HK_INLINE unsigned int hk_smem_u32(const void* p) {
    hk_u64 a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (unsigned int)a;
}
// Global-state-space address of a generic pointer into global memory.
HK_INLINE hk_u64 hk_gmem_u64(const void* p) {
    hk_u64 a;
    asm("cvta.to.global.u64 %0, %1;" : "=l"(a) : "l"(p));
    return a;
}

// The operand type of the tensor-core instructions: the storage format.
#if HK_BF16
#define HK_MMA_AB ".bf16.bf16"
#else
#define HK_MMA_AB ".f16.f16"
#endif

// D = A * B + D: one warp-wide 16x8x16 product, fp16 (bf16) inputs, fp32 accumulators (in
// place).
HK_INLINE void hk_mma_16816(float (&d)[4], const unsigned int (&a)[4], unsigned int b0,
                            unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32" HK_MMA_AB ".f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ldmatrix .x4: four 8x8 b16 matrices from shared memory. Lanes 8m..8m+7 give the 16-byte
// row addresses of matrix m (rows 0..7); register m of lane l receives matrix m's row l >> 2,
// columns 2(l & 3), 2(l & 3) + 1. With .trans, matrix m is transposed on the way: register m
// receives rows 2(l & 3), 2(l & 3) + 1 of column l >> 2 (a B fragment of a row-major tile).
HK_INLINE void hk_ldmatrix_x4(unsigned int (&r)[4], unsigned int smem_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr));
}
HK_INLINE void hk_ldmatrix_x4_trans(unsigned int (&r)[4], unsigned int smem_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr));
}

// Two fp32 -> one register of two elements of the storage format (round to nearest even),
// lo in the low 16 bits: the MMA operands of P and the output words.
HK_INLINE unsigned int hk_pack_h2(float lo, float hi) {
#if HK_BF16
    unsigned int r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));  // d = {hi, lo}
    return r;
#else
    return hk_pack_fp16(lo, hi);
#endif
}

// cp.async: a 16-byte global -> shared copy that bypasses registers (and L1: .cg). When
// `full` is false no byte is read (src-size 0) and the 16 destination bytes are zero-filled,
// which is how the kernel zero-fills keys no row may see.
HK_INLINE void hk_cp_async_16(unsigned int smem_addr, const void* gmem, bool full) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :
                 : "r"(smem_addr), "l"(hk_gmem_u64(gmem)), "r"(full ? 16 : 0)
                 : "memory");
}
// Close the group of cp.async issued so far by this thread.
HK_INLINE void hk_cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Wait until at most N of this thread's groups are still in flight (then a barrier makes
// every thread's copies visible to the block).
template <int N>
HK_INLINE void hk_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// 2^x in one MUFU.EX2: ex2.approx.ftz (max relative error 2^-22; subnormal results flush
// to 0, which the fp16 P and the fp32 sums cannot see). exp2(-inf) = 0, exp2(NaN) = NaN.
HK_INLINE float hk_exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Named barrier id (1..15; 0 is hk_sync's) of n threads, a multiple of 32: sync waits for
// n arrivals (its own warp's included), arrive counts its warp's and goes on.
HK_INLINE void hk_named_sync(int id, int n) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }
HK_INLINE void hk_named_arrive(int id, int n) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory"); }
// Whether any lane of the warp passes pred.
HK_INLINE bool hk_any(bool pred) { return __any_sync(0xffffffffu, pred); }

// Exchange with lane ^ mask (the 4 lanes of an MMA row group are lanes 4g..4g+3).
HK_INLINE float hk_xor(float x, int mask) { return __shfl_xor_sync(0xffffffffu, x, mask); }
#endif  // HK_CUDA
