// wgmma.h: the sm_90a warpgroup matrix-multiply primitives the wgmma path uses (NVIDIA
// Hopper only: wgmma.mma_async exists on sm_90a, not sm_90 and not sm_100).
//
// A warpgroup is 4 consecutive warps (128 threads) that issue one wgmma together:
//   D (64 x N f32) += A (64 x 16 f16) * B (16 x N f16)
// (bf16 A and B in a bf16 kernel: HK_MMA_AB, portable.h, names the operand type)
// with A from registers (hk_wgmma_*) or, in the SS forms (hk_wgmma_ss_*), from shared memory
// like B, through a 64-bit matrix descriptor.
// Warp w of the group owns rows 16w..16w+15 of A and D, and within them a lane holds exactly
// the mma.sync m16n8k16 fragments of portable.h: A as a0..a3, D as one {c0, c1, c2, c3} per
// 8 columns, d[n8][e] = (row g + 8 (e >> 1), col 8 n8 + 2 t4 + (e & 1)).
//
// Shared-memory operand layouts (the descriptor's mode, bits 62-63, names one; the start
// address and two strides in bytes, LBO and SBO, place it):
//   no swizzle ("interleave", mode 0): core matrices of 8 rows x 16 bytes (8 halves), each
//     128 contiguous bytes (row r at byte 16 r);
//       K-major B (B[k][n] at n-row, k contiguous):  LBO = between core matrices along K,
//                                                    SBO = between core matrices along N
//       MN-major B (B[k][n] at k-row, n contiguous): LBO = between core matrices along K,
//                                                    SBO = between core matrices along N
//   128-byte swizzle (mode 1, what the wgmma and wgspan kernels use): rows of 128 bytes
//     (64 halves of the contiguous dimension), 8 rows to a 1024-byte atom that must start on
//     a 1024-byte boundary; the hardware stores 16-byte chunk c of row r at chunk c ^ (r % 8);
//       K-major B: SBO = between 8-row groups along N; LBO unused (1); a step along K
//                  within the 128 bytes moves the start address
//       MN-major B: SBO = between 8-row groups along K; LBO = between 64-wide blocks along N
// (the transposed form is selected by the instruction's imm-trans-b = 1).
//
// The instructions are asynchronous: an accumulator may be read only after the group that
// writes it is waited for. hk_wgmma_fence_acc() after the wait ties every later use of the
// registers to that point, so the compiler cannot hoist one above it.

#if HK_CUDA && defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "wgmma.h needs the sm_90a target (--gpu-architecture=sm_90a)"
#endif

// Descriptor of a shared-memory operand starting at shared address `addr` (16-byte aligned);
// lbo, sbo in bytes (multiples of 16). Bits: [0,14) addr >> 4, [16,30) lbo >> 4, [32,46)
// sbo >> 4, base offset 0, the layout's mode in bits 62-63. The wgmma functions below take
// its two 32-bit words apart: the low word (hk_wgmma_desc_lo), which moves with the stage a
// tile sits in, and the high word (SBO >> 4 | mode << 30), a constant of the layout (a
// template argument). Adding (bytes >> 4) to a low word moves its start address:
// a shared address is under 2^18, so the sum stays inside the 14-bit field. (Built whole
// and passed as one 64-bit operand, ptxas rebuilt both words before every instruction.)
HK_INLINE unsigned int hk_wgmma_desc_lo(unsigned int addr, unsigned int lbo) {
    return ((addr & 0x3FFFFu) >> 4) | ((lbo >> 4) << 16);
}

// Order this thread's generic-proxy writes of shared memory (st.shared, cp.async) before
// later async-proxy reads (wgmma operands); a barrier then extends it to the block.
HK_INLINE void hk_fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// mbarriers in shared memory (8 bytes each, 8-byte aligned), block scope. A phase completes
// when `count` arrivals have happened; waiters name the parity of the phase they wait for.
HK_INLINE void hk_mbar_init(unsigned int bar, unsigned int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// After the inits: they are visible to the async proxy (TMA's transactions) too.
HK_INLINE void hk_fence_mbar_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
HK_INLINE void hk_mbar_arrive(unsigned int bar) {  // release: this thread's accesses before it
    asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared::cta.b64 st, [%0];\n}" ::"r"(bar) : "memory");
}
// One arrival, triggered once every cp.async this thread issued so far has landed (.noinc:
// it counts against the init count).
HK_INLINE void hk_mbar_arrive_cp_async(unsigned int bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
HK_INLINE void hk_mbar_wait(unsigned int bar, unsigned int parity) {  // acquire
    unsigned int done;
    do {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, p;\n}" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}
// The tensor memory accelerator (TMA): a copy of a whole box of a tensor from global into
// shared memory, issued by one thread, described by a tensor map that the host encodes
// (cuTensorMapEncodeTiled: the tensor's dims and strides, the box, the swizzle, and what fills
// the elements of a box outside the tensor; hipkernel.api.kv_tensor_maps) and passes as a
// __grid_constant__ kernel parameter. The copy completes on an mbarrier as a transaction of
// the box's bytes (out-of-bounds elements included): the thread that arms the barrier says
// how many bytes its phase waits for (arrive.expect_tx), the copies count them down.
struct alignas(64) hk_tensor_map {
    hk_u64 opaque[16];  // CUtensorMap: 128 bytes, 64-byte aligned
};
HK_INLINE void hk_mbar_arrive_expect_tx(unsigned int bar, unsigned int bytes) {  // one arrival
    asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}"
                 ::"r"(bar), "r"(bytes) : "memory");
}
// The box at element coordinates (c0, c1, c2) (c0 the contiguous dimension) into shared memory
// at dst (a 128-byte swizzled box must start on a 1024-byte boundary), completing on bar.
HK_INLINE void hk_tma_load_3d(unsigned int dst, const hk_tensor_map* map, int c0, int c1, int c2,
                              unsigned int bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4}], [%5];"
        ::"r"(dst), "l"((hk_u64)map), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}
HK_INLINE void hk_st_shared_16(unsigned int addr, unsigned int w) {  // 4 copies of w at a shared address
    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(addr), "r"(w) : "memory");
}
// stmatrix (sm_90): four 8 x 8 matrices of 16-bit elements from the warp's registers into
// shared memory. Lane L gives the shared address of row L % 8 of matrix L / 8 (16 bytes);
// register i of a lane holds its pair of matrix i in an mma fragment's layout (row L / 4,
// columns 2 (L % 4), + 1).
HK_INLINE void hk_stmatrix_x4(unsigned int addr, unsigned int r0, unsigned int r1, unsigned int r2,
                              unsigned int r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
                 ::"r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}
// 16 bytes: from a shared address into four registers, and from them to global memory
// (16-byte aligned both).
struct hk_u32x4 {
    unsigned int x, y, z, w;
};
HK_INLINE hk_u32x4 hk_lds_16(unsigned int addr) {
    hk_u32x4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(addr) : "memory");
    return v;
}
HK_INLINE void hk_stg_16(void* dst, const hk_u32x4& v) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}
HK_INLINE void hk_tma_prefetch_map(const hk_tensor_map* map) {  // the descriptor, into its cache
    asm volatile("prefetch.tensormap [%0];" ::"l"((hk_u64)map) : "memory");
}
// Move registers between the warpgroups of a block (a per-block pool): dec gives this
// warpgroup's down to N a thread, inc waits until the pool has enough to raise them to N.
// Every warp of the warpgroup executes the same one.
template <int N>
HK_INLINE void hk_setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N)); }
template <int N>
HK_INLINE void hk_setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N)); }
// Before the first wgmma that reads registers written since the last one.
HK_INLINE void hk_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
// Close the group of wgmma issued so far by this warpgroup.
HK_INLINE void hk_wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Wait until at most N groups of this warpgroup are in flight.
template <int N>
HK_INLINE void hk_wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Wait until no group of this warpgroup is in flight, but not before x has been computed.
// ptxas hoists a bare wait above the independent math before it (under OVERLAP it
// put the wait for the previous tile's P.V ahead of the whole softmax, so nothing overlapped);
// a branch on a warp vote of x keeps it below x's producer. Both branches wait.
HK_INLINE void hk_wgmma_wait_all_after(float x) {
    if (__any_sync(0xffffffffu, x == x)) hk_wgmma_wait<0>();
    else hk_wgmma_wait<0>();
}
// Tie the accumulator registers to this point (see the header).
template <int NB>
HK_INLINE void hk_wgmma_fence_acc(float (&d)[NB][4]) {
#pragma unroll
    for (int i = 0; i < NB; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
}

// Before a wgmma group that overwrites the accumulator (accumulate = 0 first): its old value
// is dead here, so that its registers hold other values until then (the wgmma asm reads D
// whatever its flag says). No instruction.
template <int NB>
HK_INLINE void hk_wgmma_acc_undef(float (&d)[NB][4]) {
#pragma unroll
    for (int i = 0; i < NB; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "=f"(d[i][e]));
}

// D (64 x N) += A (64 x 16, registers) * B (16 x N, descriptor); accumulate = 0 overwrites
// D instead. TRANS_B: 0 for a K-major B, 1 for an MN-major B. One function per N (the
// accumulator list is spelled out by HK_WGMMA_ACC_N and its PTX operands by HK_WGMMA_REGS_N;
// the operand numbers after them follow). Around each instruction the same PTX:
// HK_WGMMA_HEAD turns operand %P (accumulate) into a predicate and builds the descriptor from
// %L (its low word) and %H (DESC_HI); HK_WGMMA_TAIL closes the instruction with it, the
// scales of A and B (1, 1) and %T (TRANS_B); HK_WGMMA_INPUTS are those operands, after the
// accumulator's.
#define HK_WGMMA_HEAD(P, L, H)                                                              \
    "{\n.reg .pred p;\n.reg .b32 dh;\n.reg .b64 db;\nsetp.ne.b32 p, %" #P ", 0;\n"          \
    "mov.b32 dh, %" #H ";\nmov.b64 db, {%" #L ", dh};\n"
#define HK_WGMMA_TAIL(T) "db, p, 1, 1, %" #T ";\n}"
#define HK_WGMMA_INPUTS                                                                      \
    "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(accumulate), "r"(desc_lo), "n"(DESC_HI), \
        "n"(TRANS_B)
#define HK_WGMMA_ACC8(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define HK_WGMMA_ACC_N32 HK_WGMMA_ACC8(0), HK_WGMMA_ACC8(1), HK_WGMMA_ACC8(2), HK_WGMMA_ACC8(3)
#define HK_WGMMA_ACC_N64 \
    HK_WGMMA_ACC_N32, HK_WGMMA_ACC8(4), HK_WGMMA_ACC8(5), HK_WGMMA_ACC8(6), HK_WGMMA_ACC8(7)
#define HK_WGMMA_ACC_N128                                                                 \
    HK_WGMMA_ACC_N64, HK_WGMMA_ACC8(8), HK_WGMMA_ACC8(9), HK_WGMMA_ACC8(10), HK_WGMMA_ACC8(11), \
        HK_WGMMA_ACC8(12), HK_WGMMA_ACC8(13), HK_WGMMA_ACC8(14), HK_WGMMA_ACC8(15)
#define HK_WGMMA_REGS_N32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
#define HK_WGMMA_REGS_N64 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
#define HK_WGMMA_REGS_N128 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
template <int TRANS_B, unsigned int DESC_HI>
HK_INLINE void hk_wgmma_n32(float (&d)[4][4], const unsigned int (&a)[4], unsigned int desc_lo,
                            int accumulate) {
    asm volatile(HK_WGMMA_HEAD(20, 21, 22) "wgmma.mma_async.sync.aligned.m64n32k16.f32" HK_MMA_AB " "
                 HK_WGMMA_REGS_N32 "{%16, %17, %18, %19}, " HK_WGMMA_TAIL(23)
                 : HK_WGMMA_ACC_N32 : HK_WGMMA_INPUTS);
}

template <int TRANS_B, unsigned int DESC_HI>
HK_INLINE void hk_wgmma_n64(float (&d)[8][4], const unsigned int (&a)[4], unsigned int desc_lo,
                            int accumulate) {
    asm volatile(HK_WGMMA_HEAD(36, 37, 38) "wgmma.mma_async.sync.aligned.m64n64k16.f32" HK_MMA_AB " "
                 HK_WGMMA_REGS_N64 "{%32, %33, %34, %35}, " HK_WGMMA_TAIL(39)
                 : HK_WGMMA_ACC_N64 : HK_WGMMA_INPUTS);
}

#define HK_WGMMA_ACC_N72 HK_WGMMA_ACC_N64, HK_WGMMA_ACC8(8)
#define HK_WGMMA_REGS_N72 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35}, "
// n = 72: P.V at d 64 with the row sums as a ninth 8-column block (ROWSUM_N72).
template <int TRANS_B, unsigned int DESC_HI>
HK_INLINE void hk_wgmma_n72(float (&d)[9][4], const unsigned int (&a)[4], unsigned int desc_lo,
                            int accumulate) {
    asm volatile(HK_WGMMA_HEAD(40, 41, 42) "wgmma.mma_async.sync.aligned.m64n72k16.f32" HK_MMA_AB " "
                 HK_WGMMA_REGS_N72 "{%36, %37, %38, %39}, " HK_WGMMA_TAIL(43)
                 : HK_WGMMA_ACC_N72 : HK_WGMMA_INPUTS);
}

template <int TRANS_B, unsigned int DESC_HI>
HK_INLINE void hk_wgmma_n128(float (&d)[16][4], const unsigned int (&a)[4], unsigned int desc_lo,
                            int accumulate) {
    asm volatile(HK_WGMMA_HEAD(68, 69, 70) "wgmma.mma_async.sync.aligned.m64n128k16.f32" HK_MMA_AB " "
                 HK_WGMMA_REGS_N128 "{%64, %65, %66, %67}, " HK_WGMMA_TAIL(71)
                 : HK_WGMMA_ACC_N128 : HK_WGMMA_INPUTS);
}

// D (64 x N) += A (64 x 16) * B (16 x N), both from shared memory by descriptor (low words
// a_lo and b_lo, one high word DESC_HI: the same layout), A K-major; accumulate = 0
// overwrites D. The operands after the accumulator's: %P accumulate, %A a_lo, %B b_lo,
// %H DESC_HI, %T TRANS_B.
#define HK_WGMMA_SS_HEAD(P, A, B, H)                                                        \
    "{\n.reg .pred p;\n.reg .b32 dh;\n.reg .b64 da, db;\nsetp.ne.b32 p, %" #P ", 0;\n"      \
    "mov.b32 dh, %" #H ";\nmov.b64 da, {%" #A ", dh};\nmov.b64 db, {%" #B ", dh};\n"
#define HK_WGMMA_SS_TAIL(T) "da, db, p, 1, 1, 0, %" #T ";\n}"
#define HK_WGMMA_SS_INPUTS "r"(accumulate), "r"(a_lo), "r"(b_lo), "n"(DESC_HI), "n"(TRANS_B)
template <int TRANS_B, unsigned int DESC_HI>
HK_INLINE void hk_wgmma_ss_n32(float (&d)[4][4], unsigned int a_lo, unsigned int b_lo, int accumulate) {
    asm volatile(HK_WGMMA_SS_HEAD(16, 17, 18, 19) "wgmma.mma_async.sync.aligned.m64n32k16.f32" HK_MMA_AB " "
                 HK_WGMMA_REGS_N32 HK_WGMMA_SS_TAIL(20)
                 : HK_WGMMA_ACC_N32 : HK_WGMMA_SS_INPUTS);
}

template <int TRANS_B, unsigned int DESC_HI>
HK_INLINE void hk_wgmma_ss_n64(float (&d)[8][4], unsigned int a_lo, unsigned int b_lo, int accumulate) {
    asm volatile(HK_WGMMA_SS_HEAD(32, 33, 34, 35) "wgmma.mma_async.sync.aligned.m64n64k16.f32" HK_MMA_AB " "
                 HK_WGMMA_REGS_N64 HK_WGMMA_SS_TAIL(36)
                 : HK_WGMMA_ACC_N64 : HK_WGMMA_SS_INPUTS);
}

template <int TRANS_B, unsigned int DESC_HI>
HK_INLINE void hk_wgmma_ss_n128(float (&d)[16][4], unsigned int a_lo, unsigned int b_lo, int accumulate) {
    asm volatile(HK_WGMMA_SS_HEAD(64, 65, 66, 67) "wgmma.mma_async.sync.aligned.m64n128k16.f32" HK_MMA_AB " "
                 HK_WGMMA_REGS_N128 HK_WGMMA_SS_TAIL(68)
                 : HK_WGMMA_ACC_N128 : HK_WGMMA_SS_INPUTS);
}

// D += A * B for N in {32, 64, 128} (the Q.K tiles), A and B by descriptor.
template <int N, int TRANS_B, unsigned int DESC_HI>
HK_INLINE void hk_wgmma_ss(float (&d)[N / 8][4], unsigned int a_lo, unsigned int b_lo, int accumulate) {
    static_assert(N == 32 || N == 64 || N == 128, "hk_wgmma_ss: N is 32, 64 or 128");
    if constexpr (N == 32) hk_wgmma_ss_n32<TRANS_B, DESC_HI>(d, a_lo, b_lo, accumulate);
    else if constexpr (N == 64) hk_wgmma_ss_n64<TRANS_B, DESC_HI>(d, a_lo, b_lo, accumulate);
    else hk_wgmma_ss_n128<TRANS_B, DESC_HI>(d, a_lo, b_lo, accumulate);
}

// n = 8: the span kernel's last 8 keys of a 136- or 72-key chunk (gqa_flash_prefill_wgspan.hip).
template <int TRANS_B, unsigned int DESC_HI>
HK_INLINE void hk_wgmma_n8(float (&d)[1][4], const unsigned int (&a)[4], unsigned int desc_lo,
                           int accumulate) {
    asm volatile(
        HK_WGMMA_HEAD(8, 9, 10) "wgmma.mma_async.sync.aligned.m64n8k16.f32" HK_MMA_AB " "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, " HK_WGMMA_TAIL(11)
        : HK_WGMMA_ACC8(0) : HK_WGMMA_INPUTS);
}

// D += A * B for N in {8, 32, 64, 128}; B by descriptor, low word desc_lo, high word DESC_HI.
template <int N, int TRANS_B, unsigned int DESC_HI>
HK_INLINE void hk_wgmma(float (&d)[N / 8][4], const unsigned int (&a)[4], unsigned int desc_lo, int accumulate) {
    if constexpr (N == 8) hk_wgmma_n8<TRANS_B, DESC_HI>(d, a, desc_lo, accumulate);
    else if constexpr (N == 32) hk_wgmma_n32<TRANS_B, DESC_HI>(d, a, desc_lo, accumulate);
    else if constexpr (N == 64) hk_wgmma_n64<TRANS_B, DESC_HI>(d, a, desc_lo, accumulate);
    else hk_wgmma_n128<TRANS_B, DESC_HI>(d, a, desc_lo, accumulate);
}
