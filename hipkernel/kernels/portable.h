// portable.h: the few differences between HIP (AMD) and CUDA (NVIDIA) device code that
// gqa_flash_prefill.hip needs, behind small inline functions.
//
// It includes no header at all, so it compiles unchanged under
//   - NVRTC (CUDA): builtins only; fp16 converts through inline PTX, not <cuda_fp16.h>,
//     so the runtime compiler needs no include path;
//   - hiprtc (AMD): HIP clang, which pre-declares __global__, __shared__, threadIdx, ...;
//   - clang -x hip -nogpuinc -nogpulib (AMD, offline check): nothing pre-declared and no
//     device libraries, hence amdgcn builtins instead of ocml/ockl calls.
//
// fp16 tensors cross the ABI as `half_t`: 16-bit storage (the bits of an IEEE binary16),
// converted to and from fp32 in registers.
#pragma once

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

typedef unsigned short half_t;  // fp16 storage
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
HK_INLINE void hk_sync() { __syncthreads(); }
#endif

// ---- fp16 <-> fp32 -----------------------------------------------------------------------
#if HK_AMD
HK_INLINE float hk_h2f(half_t h) { return (float)__builtin_bit_cast(_Float16, h); }
HK_INLINE half_t hk_f2h(float f) { return __builtin_bit_cast(half_t, (_Float16)f); }  // RNE
#else
HK_INLINE float hk_h2f(half_t h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
HK_INLINE half_t hk_f2h(float f) {
    half_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#endif
// The two halves packed in a 32-bit word (little endian: element 0 in the low bits).
HK_INLINE float hk_lo(unsigned int w) { return hk_h2f((half_t)(w & 0xffffu)); }
HK_INLINE float hk_hi(unsigned int w) { return hk_h2f((half_t)(w >> 16)); }
HK_INLINE unsigned int hk_pack(float lo, float hi) {
    return (unsigned int)hk_f2h(lo) | ((unsigned int)hk_f2h(hi) << 16);
}

// ---- fp32 math ---------------------------------------------------------------------------
#if HK_AMD
HK_INLINE float hk_exp2(float x) { return __builtin_exp2f(x); }  // v_exp_f32, no libcall
HK_INLINE float hk_fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
HK_INLINE float hk_fmax(float a, float b) { return __builtin_fmaxf(a, b); }
HK_INLINE float hk_neg_inf() { return -__builtin_inff(); }
#else
HK_INLINE float hk_exp2(float x) { return exp2f(x); }  // ex2.approx based
HK_INLINE float hk_fma(float a, float b, float c) { return fmaf(a, b, c); }
HK_INLINE float hk_fmax(float a, float b) { return fmaxf(a, b); }
HK_INLINE float hk_neg_inf() { return __int_as_float(0xff800000); }
#endif

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
