// gqa_flash_prefill_wgmma.hip: the fused GQA flash-attention prefill on Hopper tensor cores
// (wgmma.mma_async, sm_90a only), one warpgroup per 64 query rows.
//
// NVIDIA sm_90a ONLY (hipkernel.config offers path "wgmma" on sm_90 devices, which the CUDA
// backend compiles for sm_90a). Same ABI and entry name as the other two paths
// (docs/ARCHITECTURE.md "Kernel ABI"):
//   compile-time  HEAD_DIM (64 | 128), M_TILES (16-row groups, a multiple of 4), BKV (keys
//                 per tile: 32, 64 or 128), KV_STAGES (K/V tile buffers, >= 1), WS (0 | 1:
//                 a producer warpgroup, below; with it TMA and OVERLAP, on by default),
//                 RESCALE_LOG2 (lazy rescaling, flash_rows.h; KernelConfig.rescale_log2
//                 sets it, the model follows), ROWSUM_MMA (0 | 1: l summed on the tensor
//                 cores, below; KernelConfig.rowsum_mma sets it, the model follows),
//                 HK_BF16 (0 | 1: q, k, v, out, and P before P.V, in bf16; portable.h),
//                 QSMEM (0 | 1: Q read from shared memory; KernelConfig.qsmem sets it, below),
//                 ROWSUM_N72 (the row sums inside P.V's wgmma, below), PV_WAIT_SPLIT
//                 (where the owed P.V is waited for; KernelConfig.pv_wait_split sets it),
//                 L_DEFER (fp32 row sums a lane's own until the epilogue, below)
//   grid          (ceil(Sq / BM), Hq, B), BM = 16 * M_TILES
//   block         32 * M_TILES threads = M_TILES / 4 warpgroups, + 128 with WS; warpgroup w
//                 < M_TILES / 4 owns query rows [64 w, 64 w + 64) of the Q tile, its warp x
//                 rows [16 x, 16 x + 16) of those; with WS the last warpgroup only loads
//   shared        dynamic, KV_STAGES x (K tile + V tile) = KV_STAGES * 4 * BKV * HEAD_DIM
//                 bytes, with ROWSUM_MMA 2 KiB of fp16 ones, then two mbarriers a stage (16
//                 bytes; with WS 16 more, below; with QSMEM the Q tiles after them, Q_AT;
//                 KernelConfig.dynamic_smem_bytes; the launch raises the function's limit above the
//                 default 48 KiB), BKV x HEAD_DIM halves a tile, in wgmma's 128-byte
//                 swizzled layout (below), each tile 1024-byte aligned
//   pointers      q, k, v, out 16-byte aligned
//   ragged        past_lens, q_lens after scale (null: past_len / Sq for every sequence):
//                 block z = b is sequence b, its valid rows i < q_len[b] at past_len[b] + i
//                 reading its own keys j < past_len[b] + q_len[b] (seq_lengths); its padded
//                 rows are stored as zeros, and a block wholly in the padding stores its
//                 zeros and walks no KV tile. Not with TMA (below): its tensor maps bound
//                 every sequence's keys by one row count, so a TMA kernel traps on a ragged
//                 launch, and the host never makes one (hipkernel.api refuses a TMA config
//                 for a ragged call, and the tuner does not offer one)
//   tensor maps   with WS two more parameters after those, the K and the V tensor maps of
//                 the producer's TMA copies (below; hipkernel.api.kv_tensor_maps encodes them)
//
// The algorithm is the mma path's, step for step, with the per-row steps in
// flash_rows.h (start-tile clamp, visibility, zero-fill of keys no row may see, online
// softmax with the NaN guard, the sink epilogue). What differs is who multiplies:
//   S = Q K^T    one wgmma m64 n BKV k16 per 16 dims: Q from registers (each warp's A
//                fragments, loaded once; with QSMEM from shared memory by descriptor, copied
//                there once), K from shared memory by descriptor.
//   O += P V     one wgmma m64 n HEAD_DIM k16 per 16 keys: P (rounded to fp16, bf16 in a bf16
//                kernel, as model.py does for the tensor-core paths) from registers, V from shared memory,
//                read transposed (MN-major) by the same descriptor mechanism.
//   l += P 1     with ROWSUM_MMA, one wgmma m64 n8 k16 per 16 keys beside P V's, B the
//                block of ones (with ROWSUM_N72 the ninth 8-column block of P V's, n = 72): l
//                sums the fp16 P that P V multiplies (else, as in the mma path, each lane
//                sums its fp32 p and the row's 4 lanes add theirs up).
// A warpgroup's S and O fragments are, warp by warp, exactly the mma path's, so the softmax
// is the same code. A warpgroup skips a KV tile none of its 64 rows sees; as in the mma path
// that is bit-identical to walking it, except under no_nan_guard, tail_unmasked and
// window_skip_off.
//
// Shared layout of a K or V tile: wgmma's 128-byte swizzle (wgmma.h). The tile is HEAD_DIM / 64
// column blocks of 64 dims (CBLOCK_BYTES = BKV x 128 bytes each); key j's 16-byte chunk c
// (dims 8 c .. 8 c + 7 of its block) sits at
//   byte(key j, chunk c) = block * CBLOCK_BYTES + 128 j + 16 (c ^ (j % 8))
// so a warp's cp.async of whole rows writes whole 128-byte shared rows (the no-swizzle
// layout before it wrote 8-key columns: 32 shared wavefronts a copy instruction, not 4), and
// it is the layout a TMA copy with the 128-byte swizzle writes (the producer's, WS).
// K and V use the same layout, and every tile starts on a 1024-byte boundary.
//   K as B of S = Q K^T (n = key, k = dim: K-major):  SBO = 1024 (8 keys), 16 dims on = 32 bytes
//   V as B of O = P V   (k = key, n = dim: MN-major): SBO = 1024 (8 keys), LBO = CBLOCK_BYTES
// Mutants (refattn/mutants.py) bite in flash_rows.h and at the same places as in the mma path.

#include "portable.h"
#include "flash_rows.h"
#include "wgmma.h"

#if !HK_CUDA
#error "gqa_flash_prefill_wgmma.hip is NVIDIA sm_90a-only (wgmma); AMD uses gqa_flash_prefill.hip"
#endif
#if !defined(HEAD_DIM) || !defined(M_TILES) || !defined(BKV) || !defined(KV_STAGES)
#error "compile with -DHEAD_DIM=<64|128> -DM_TILES=<4|8|16> -DBKV=<32|64|128> -DKV_STAGES=<n>"
#endif
#if HEAD_DIM != 64 && HEAD_DIM != 128
#error "HEAD_DIM must be 64 or 128 (the n of the P.V wgmma)"
#endif
#if BKV != 32 && BKV != 64 && BKV != 128
#error "BKV must be 32, 64 or 128 (the n of the Q.K wgmma)"
#endif
#if M_TILES % 4 != 0
#error "M_TILES must be a multiple of 4: a warpgroup (4 warps) computes 64 rows"
#endif
#if KV_STAGES < 1
#error "KV_STAGES must be >= 1"
#endif

#define BM (16 * M_TILES)          // query rows per block
#define NCONSUMERS (32 * M_TILES)  // a warp per 16 rows, a warpgroup per 64
// WS (warp specialization): one more warpgroup, the producer, streams the K/V tiles in and
// the M_TILES / 4 that own rows (the consumers) only compute. The producer gives its
// registers up to them (setmaxnreg): a thread starts with REG_CAP, which ptxas gives a
// kernel with setmaxnreg (the most its launch bounds allow); the producer keeps
// PRODUCER_REGS, the consumers share the rest in steps of 8.
// TMA (on with WS): one thread of the producer copies each K and V tile with the tensor
// memory accelerator (wgmma.h), a box of BKV keys x 64 dims a column block, into the same
// 128-byte swizzled layout the cp.async copies write; a stage's full barrier counts that one
// arrival and the tile's bytes. The keys a tile keeps are key_kept's: the maps span the keys
// that exist (rows [0, skv) of each KV head; hipkernel.api.kv_tensor_maps), so the copies'
// out-of-bounds fill zeroes the keys past skv; and under a window whose first key kv_start
// falls inside the first tile, that tile lands on a barrier of its own, the producer
// warpgroup zeroes its keys below kv_start and only then releases it. 24 registers are
// enough for the producer: the consumers get 240 (216 with the cp.async producer).
// Timed with the producer copying nothing after its first round (a probe), the cp.async
// producer's copies cost 16 % of d128 16384@0 (3.82 against 4.57 ms); with TMA (same
// process, bit-identical, before OVERLAP) 16384@0 ran 4.10 / 4.14 ms against 4.52 / 4.52,
// 512@8192 0.1211 / 0.1214 against 0.1369 / 0.1368.
// TMA 0: the cp.async producer, every producer thread copying its share of a tile, whose
// unrolled copy loop of a 128-key tile at d 128 (32 cp.async a thread) needs 72 registers
// without spilling.
#ifndef WS
#define WS 0
#endif
// LOAD_RR (the self-loading mbarrier pipeline, four warpgroups): the warpgroups load the
// tiles in turn, tile t by warpgroup (t - t0) % 4, 8 copies a thread, instead of every thread
// 2 copies of each; a tile's full barrier then counts one warpgroup's arrivals. On the H200
// (wgmma_m16_b64, same process, bit-identical) 16384@0 ran 5.072 / 5.087 ms against 5.156 /
// 5.128, 512@8192 0.1557 / 0.1554 against 0.1603 / 0.1606.
// (TMA copies by one thread of the loading warpgroup ran slower there: 16384@0 5.22 / 5.24 /
// 5.22 ms against 5.06 / 5.06, 512@8192 0.1630 against 0.1567-0.1573.)
#ifndef LOAD_RR
#define LOAD_RR (!WS && M_TILES >= 16)
#endif
#if LOAD_RR && WS
#error "LOAD_RR is the self-loading pipeline's (no WS)"
#endif
#ifndef TMA
#define TMA WS
#endif
// HEAVY_FIRST (0 | 1): block x runs Q tile gridDim.x - 1 - x. The GPU starts blocks in the
// order of their linear index, x fastest; under the causal mask a Q tile's KV walk grows
// with its rows, so each head's heaviest tiles then start first and its lightest last, and
// the grid's last wave is made of short blocks that even the SMs out instead of long ones
// that leave most of them idle. On an H100 (python -m hipkernel.ab, same process, three
// passes, bit-identical): d128 16384@0 (wgmma_m8_b128_ws) 3.806 / 3.801 ms against 3.875 /
// 3.875 (a third pass of each ran throttled: 4.07 / 3.93); d 64 16384@0 wgmma_m16_b64
// 4.877 / 4.900 / 4.979 against 4.922 / 4.910 / 5.103, wgmma_m12_b128_ws level (4.67-4.70);
// B 4 4096@4096 and 2048@14336, whose blocks walk near-equal KV ranges, level.
#ifndef HEAVY_FIRST
#define HEAVY_FIRST 1
#endif
#if TMA && !WS
#error "TMA: the tensor-memory copies are the producer warpgroup's (WS=1)"
#endif
#if WS
#define NTHREADS (NCONSUMERS + 128)
#define LOADERS 128                // the cp.async producer's copying threads
#define FULL_ARRIVALS (TMA ? 1 : LOADERS)  // arrivals that fill a stage
#ifndef PRODUCER_REGS
#define PRODUCER_REGS (TMA ? 24 : 72)
#endif
#define REG_CAP ((65536 / NTHREADS) & ~7)
#define CONSUMER_REGS_FIT (((REG_CAP * NTHREADS - 128 * PRODUCER_REGS) / NCONSUMERS) & ~7)
#define CONSUMER_REGS (CONSUMER_REGS_FIT > 256 ? 256 : CONSUMER_REGS_FIT)
#if CONSUMER_REGS <= REG_CAP
#error "WS: the consumers would gain no registers from the producer (M_TILES 8 or 12 only)"
#endif
#else
#define NTHREADS NCONSUMERS
#if LOAD_RR
#define LOADERS 128
#else
#define LOADERS NTHREADS           // every thread loads its share of each tile
#endif
#endif
#define VPR (HEAD_DIM / 8)        // 16-byte vectors per K/V row
#define TILE_BYTES (BKV * HEAD_DIM * 2)
#define CBLOCK_BYTES (BKV * 128)  // a 64-dim column block of a tile (see the header)
#define DESC_SW128 (1u << 30)  // the mode, bits 62-63 of the descriptor: its high word's 30-31
// ROWSUM_MMA (KernelConfig.rowsum_mma sets it, the model follows): the row sums ride on the
// tensor cores, l += P . 1, one m64n8k16 wgmma a 16-key step beside P.V's, B a block of fp16
// ones after the K/V stages (16 rows of 128 bytes: whatever the descriptor's layout reads of
// it is 1). l is then the sum of the fp16 P that P.V multiplies, accumulated like acc (and
// scaled with it), and the softmax has no FADD an element. 0: l sums the fp32 p in registers.
#ifndef ROWSUM_MMA
#define ROWSUM_MMA 0
#endif
// ROWSUM_N72 (with ROWSUM_MMA at d 64, on by default there): the row sums as the ninth
// 8-column block of P.V, one m64n72k16 wgmma a 16-key step instead of an m64n64k16 and an
// m64n8k16: B's columns 64-71 are read from the ones, a column block away from the V tile
// (the descriptor's LBO, set per stage and 16-key step). Bit-identical to the separate
// m64n8k16; an m64n8k16 took the issuing warp about half an m64n64k16's time (ncu's stall
// sampling on wgmma_m12_b128_ws). On an H100 (hipkernel.ab, same process, three passes):
// wgmma_m12_b128_ws 16384@0 4.543-4.564 ms against 4.579-4.605, B4 4096@4096 3.494-3.496
// against 3.512-3.538, 128@8192 0.0861-0.0873 against 0.0870-0.0881; wgmma_m16_b64 16384@0
// 4.697-4.705 against 4.780-4.811, 512@8192 0.1472-0.1501 against 0.1534-0.1544,
// 2048@14336 1.136-1.138 against 1.155-1.158.
#ifndef ROWSUM_N72
#define ROWSUM_N72 (ROWSUM_MMA && HEAD_DIM == 64)
#endif
#if ROWSUM_N72 && (!ROWSUM_MMA || HEAD_DIM != 64)
#error "ROWSUM_N72 needs ROWSUM_MMA at HEAD_DIM 64"
#endif
#define ONES_BYTES (ROWSUM_MMA ? 2048 : 0)
#define BARS_AT (KV_STAGES * 2u * TILE_BYTES + ONES_BYTES)  // the mbarriers' byte offset
#define ONES_DESC (KV_STAGES * 2u * TILE_BYTES >> 4)  // from K stage 0's descriptor to theirs
// QSMEM: the warpgroups' Q tiles (64 rows x HEAD_DIM halves each, in 64-dim column blocks of
// Q_CBLOCK_BYTES) after the barriers, the 16 bytes of WS and 1024-byte alignment
// (KernelConfig.dynamic_smem_bytes)
#define Q_AT ((BARS_AT + KV_STAGES * 16u + 16u + 1023u) & ~1023u)
#define Q_CBLOCK_BYTES (64 * 128)
#define Q_TILE_BYTES (64 * HEAD_DIM * 2)
#if TILE_BYTES % 1024 != 0
#error "a tile must be a whole number of 1024-byte swizzle atoms"
#endif
// KV_STAGES buffers of (K tile, V tile): tile t + KV_STAGES - 1 streams in while tile t is
// computed (with one stage, tile t + 1 after it). A warpgroup's tile takes a few hundred
// cycles, far less than a load's latency, so depth matters more here than on the mma path.
// Three pipelines (below): with a producer warpgroup (WS), stages on mbarriers that it
// fills; without, every thread loads its share, with four warpgroups a block on mbarriers
// (so that they drift apart), with fewer at a block barrier a tile. On the H200 the
// mbarriers ran 16384@0 7.5 % faster with four warpgroups (d 64: 6.54 against 7.07 ms) and
// 9-11 % slower with two (d 128), where the producer ran it 14 % faster on 64-key tiles and
// 24 % on 128-key tiles (docs/performance.md).
#define MBAR_PIPE (WS || M_TILES >= 16)
#if MBAR_PIPE && KV_STAGES < 2
#error "the mbarrier pipelines need KV_STAGES >= 2"
#endif
#if MBAR_PIPE && !WS
// Tiles loaded ahead. A warpgroup may run KV_STAGES - 1 - LOOKAHEAD tiles ahead of the
// slowest of its block; on the H200 (wgmma_m16_b64, 6 stages) 3 tiles of that drift ran
// 16384@0 in 6.78 ms, 2 in 7.62, 1 in 7.78: so 3 where the stages allow it.
#ifndef LOOKAHEAD
#define LOOKAHEAD (KV_STAGES > 4 ? KV_STAGES - 4 : 1)
#endif
#if LOOKAHEAD < 1 || LOOKAHEAD >= KV_STAGES
#error "LOOKAHEAD must be in [1, KV_STAGES)"
#endif
#elif !MBAR_PIPE
#define PENDING (KV_STAGES > 1 ? KV_STAGES - 2 : 0)  // cp.async groups after tile t's
#endif
// OVERLAP (FlashAttention-3's intra-warpgroup overlap): a consumer warpgroup issues tile t's Q K^T
// and the previous tile's P.V together and runs tile t's softmax while that P.V is on the tensor
// cores; acc is scaled once it has landed, and the previous tile's stage is released then. That
// wait is hk_wgmma_wait_all_after: ptxas hoisted a bare one above the whole softmax, so that only
// the two wgmma overlapped. The sums and their order are OVERLAP 0's (the first
// tile's P.V is of P = 0, adding zeros). It needs the owed P (32 registers at d 128) beside Q, S
// and acc: 240 registers a consumer hold them without spilling, the owed tile's stage derived from
// the current one and, with the producer, the sink logit kept in shared memory until the epilogue.
// On the H200 (same process, bit-identical): d 128 (wgmma_m8_b128_ws) 16384@0
// 3.970-3.976 ms against 4.020-4.025 with the hoisted wait, 512@8192 0.1168-0.1177 against
// 0.1186-0.1218 (and with the hoisted wait 4.03 against 4.17 ms without OVERLAP). On by
// default with the TMA producer. Allowed on the self-loading pipeline, but slower there: d 64 m16
// (126 registers, no spill) 16384@0 5.08 ms against 4.98-5.02, 512@8192 0.159-0.161 against
// 0.153-0.158 (four warpgroups an SM already overlap each other's softmax and wgmma).
#ifndef OVERLAP
#define OVERLAP (WS && TMA)
#endif
// QSMEM (KernelConfig.qsmem sets it): Q K^T reads Q from shared memory (A by descriptor, the
// same 128-byte swizzle as a K tile of 64 keys) instead of holding it in registers (16 a
// thread at d 64, 32 at d 128). Each warpgroup copies its 64 rows there once, after the K/V
// stages' barriers (Q_AT, 1024-byte aligned), and meets on its own named barrier. Three
// consumer warpgroups (M_TILES 12) at 160 registers a thread hold S, the owed P and acc of
// OVERLAP only so.
#ifndef QSMEM
#define QSMEM 0
#endif
// PV_WAIT_SPLIT (with OVERLAP; KernelConfig.pv_wait_split sets it): the owed P.V is waited
// for after the exp2 of this many 8-key blocks of the scores (of BKV / 8), so that acc's
// rescale and the packing of those blocks' P run among the rest's exp2 (ptxas keeps code on
// either side of the wait's vote branch); BKV / 8: after all of them. On the three-consumer
// tile after the first block: on an H100 (hipkernel.ab, three passes, bit-identical, against
// half the blocks) 16384@0 4.294-4.319 ms against 4.375-4.397, B4 4096@4096 3.308-3.334
// against 3.359-3.377, 2048@14336 1.089-1.092 against 1.084-1.121, 128@8192 0.0751-0.0760
// against 0.0808-0.0818; after 2 blocks level at the long shapes, after 3 or 4 slower there
// (half had been 128@8192 0.0820-0.0822 against 0.0848-0.0852 after all of them). On the
// d 128 tile every split was slower (half: 16384@0 3.692-3.701 against 3.626-3.637,
// 512@8192 0.1243-0.1255 against 0.1145-0.1156).
#ifndef PV_WAIT_SPLIT
#define PV_WAIT_SPLIT (BKV / 8)
#endif
#if PV_WAIT_SPLIT < 1 || PV_WAIT_SPLIT > BKV / 8
#error "PV_WAIT_SPLIT: the 8-key blocks before the wait for the owed P.V, 1 to BKV / 8"
#endif
// L_DEFER (0 | 1; with the row sums on the FMA pipe, ROWSUM_MMA 0): each lane keeps its own
// part of its rows' sums through the loop, and the parts are summed across the row's 4 lanes
// once, before the epilogue (flash_rows.h, softmax_lane_scores), as FlashAttention-4 does:
// the two shuffles and adds a row leave the tile's path between its exp2 and the P packing.
// On with the overlap (the d 128 producer tile): on an H100 (hipkernel.ab, four passes; the
// sums in another order, relL2 against the reference 2.934903e-4 against 2.934908e-4 at
// 512@8192) 16384@0 3.633-3.668 ms against 3.709-3.711, 512@8192 0.1140-0.1175 against
// 0.1151-0.1259. (Without the overlap, on the four-warpgroup d 64 tile before its row sums
// moved to the tensor cores, it was 1.5 % slower.)
#ifndef L_DEFER
#define L_DEFER (OVERLAP && !ROWSUM_MMA)
#endif
#if L_DEFER && ROWSUM_MMA
#error "L_DEFER: the row sums on the FMA pipe (ROWSUM_MMA 0)"
#endif
// PINGPONG: the warpgroups issue their Q K^T wgmma in turn (0, 1, ..., NWG - 1, 0, ...),
// passing a token on named barriers 1 + w (two warpgroups' threads each), so that one's
// softmax runs while the next multiplies. On the H200 with four free-running warpgroups
// (wgmma_m16_b64, d 64) it ran 512@8192 3 % faster on top of lazy rescaling (0.1990 against
// 0.2060 ms) and 16384@0 0.5 % (6.281 against 6.319); with the producer at d 128 it did
// not pay (docs/performance.md). Off since the swizzled layout: with the shared pipe no
// longer taken by the copies, it cost 2.6 % at 16384@0 (5.274 / 5.307 ms against 5.137 /
// 5.163 without) and 2 % at 512@8192. With the
// cp.async producer (d 128, wgmma_m8_b128_ws) it paid on the swizzled layout: 16384@0
// 4.588 / 4.606 ms against 4.688 / 4.696, 512@8192 0.1370 / 0.1371 against 0.1407 / 0.1409. With the TMA producer it still pays without
// OVERLAP (512@8192 0.1228 / 0.1224 against 0.1260 / 0.1259 without it; 16384@0 4.17 / 4.19
// against 4.19 / 4.20), and not with it (16384@0 4.02 / 4.05 against 4.03 / 4.02, 512@8192
// 0.1191 / 0.1217 against 0.1188 / 0.1198): on with the producer unless OVERLAP is. On the
// three consumer warpgroups (M_TILES 12), passed round all three as in FlashAttention-4's
// sm90 forward, it paid with the row sums in P.V (ROWSUM_N72; on an H100, hipkernel.ab,
// three passes, 128@8192 0.0838-0.0850 ms against 0.0861-0.0873 without it, 16384@0
// 4.514-4.569 against 4.543-4.564) and no longer with the wait for the owed P.V after the
// first key block (PV_WAIT_SPLIT 1; three runs of three passes, bit-identical: 16384@0
// 0.0-1.2 % slower with it, B4 4096@4096 -0.6-1.1 %, 128@8192 level): off there too.
#define NWG (M_TILES / 4)  // warpgroups that own rows
#ifndef PINGPONG
#define PINGPONG (WS && !OVERLAP)
#endif
#if PINGPONG && NWG < 2
#error "PINGPONG passes a token between warpgroups: M_TILES >= 8"
#endif
#define NB_S (BKV / 8)        // 8-key blocks of the score tile
#define KC_S (HEAD_DIM / 16)  // 16-dim steps of Q K^T (wgmma k)
#define KC_P (BKV / 16)       // 16-key steps of P V (wgmma k)
#define NB_O (HEAD_DIM / 8)   // 8-dim blocks of the output

#if !defined(HIPKERNEL_MUTANT_NO_NAN_GUARD) && !defined(HIPKERNEL_MUTANT_TAIL_UNMASKED) && \
    !defined(HIPKERNEL_MUTANT_WINDOW_SKIP_OFF)
#define GROUP_SKIP 1  // see the header
#else
#define GROUP_SKIP 0
#endif

// Blocks an SM should hold at once (ptxas then plans for 65536 / (NTHREADS * MIN_BLOCKS)
// registers a thread): at d = 64 with 64-key tiles the S and O accumulators, Q and P take
// ~100 registers, so 128 fit without spilling and an SM holds 4 warpgroups (one block of
// M_TILES 16, two of 8), whose loads and softmax overlap each other's wgmma. Elsewhere
// ptxas' own choice (one block at least).
#ifndef MIN_BLOCKS
#if HEAD_DIM == 64 && BKV <= 64 && !WS
#define MIN_BLOCKS (512 / NTHREADS)
#else
#define MIN_BLOCKS 1
#endif
#endif

// Stage KV tile t into buffer st: 16-byte cp.async by loading thread lt (of LOADERS),
// zero-filling keys no row of this block may see (key_kept). kg, vg: the block's KV head;
// k_s0, v_s0: the K and V stages.
HK_INLINE void load_tile(const half_t* kg, const half_t* vg, unsigned int k_s0, unsigned int v_s0,
                         int t, int st, int lt, int kv_start, int skv, int S_cap) {
    const int j0 = t * BKV;
    // Consecutive threads copy consecutive chunks of a row: a warp reads whole rows (512
    // contiguous bytes) and writes whole 128-byte shared rows, with no bank conflict. Thread
    // lt copies chunk c = lt % VPR of keys key0 + it * KSTEP; KSTEP is a multiple of 8, so
    // the chunk's swizzled place in its row is the same for all of them.
#define KSTEP (LOADERS / VPR)
#if LOADERS % VPR != 0 || KSTEP % 8 != 0
#error "the loaders must cover whole rows, 8 keys a step at least"
#endif
    const int key0 = lt / VPR, c = lt % VPR;
    const unsigned int dst0 = st * TILE_BYTES + (c >> 3) * CBLOCK_BYTES + 128u * key0 + 16u * ((c & 7) ^ (key0 & 7));
#pragma unroll
    for (int it = 0; it < (BKV + KSTEP - 1) / KSTEP; ++it) {
        const int key = key0 + it * KSTEP;
        if (BKV % KSTEP == 0 || key < BKV) {
            const unsigned int dst = dst0 + 128u * KSTEP * it;
            const int j = j0 + key;
            const bool keep = key_kept(j, kv_start, skv, S_cap);
            // a key not kept reads nothing (src-size 0), from key 0 of its row anyway: one
            // select of j, not of two pointers
            const hk_u64 src = (hk_u64)(unsigned int)(keep ? j : 0) * HEAD_DIM + 8 * c;
            hk_cp_async_16(k_s0 + dst, kg + src, keep);
            hk_cp_async_16(v_s0 + dst, vg + src, keep);
        }
    }
}

#if QSMEM
// QSMEM: the 64 rows [ig, ig + 64) of Q (their 16-byte chunks in the 128-byte swizzle, a
// column block of 64 dims at a time) into shared memory at q_s, by the warpgroup's 128
// threads (lt); rows at or past n_rows as zeros. Every copy has landed and is visible to
// wgmma once the caller's warpgroup barrier is passed.
HK_INLINE void load_q_smem(const half_t* q, unsigned int q_s, int b, int Sq, int Hq, int h, int ig,
                           int n_rows, int lt) {
#pragma unroll
    for (int i = lt; i < 64 * VPR; i += 128) {
        const int r = i / VPR, c = i % VPR;
        const bool keep = ig + r < n_rows;
        const half_t* src = q + (((hk_u64)b * Sq + (keep ? ig + r : 0)) * Hq + h) * HEAD_DIM + 8 * c;
        hk_cp_async_16(q_s + (c >> 3) * Q_CBLOCK_BYTES + 128u * r + 16u * ((c & 7) ^ (r & 7)), src, keep);
    }
    hk_cp_async_commit();
    hk_cp_async_wait<0>();
    hk_fence_proxy_async();
}
#endif

#if TMA
// TMA: KV tile t into stage st, by one thread, completing on mbarrier bar (armed here with
// the tile's bytes): its K and V boxes, a column block of 64 dims each, of KV head bh (the
// maps' third coordinate). Keys past the maps' rows (skv) land as zeros.
HK_INLINE void tma_tile(const hk_tensor_map* tmap_k, const hk_tensor_map* tmap_v, unsigned int k_s0,
                        unsigned int v_s0, int t, int st, int bh, unsigned int bar) {
    hk_mbar_arrive_expect_tx(bar, 2u * TILE_BYTES);
#pragma unroll
    for (int cb = 0; cb < HEAD_DIM / 64; ++cb) {
        const unsigned int dst = st * TILE_BYTES + cb * CBLOCK_BYTES;
        hk_tma_load_3d(k_s0 + dst, tmap_k, 64 * cb, t * BKV, bh, bar);
        hk_tma_load_3d(v_s0 + dst, tmap_v, 64 * cb, t * BKV, bh, bar);
    }
}

// TMA: the first tile t0 of a block whose window starts inside it (kv_start > t0 BKV), into
// stage 0 with its keys below kv_start zeroed (key_kept), then released on full0. Called by
// the 128 threads of one warpgroup (lt its thread, 0 the one that copies): the copy lands
// on first_bar, the warpgroup zeroes whole 128-byte rows [0, below) of each column block
// (the swizzle only moves the 16-byte chunks within a row), and after a proxy fence and
// the warpgroup's named barrier `bar_id` thread 0 makes stage 0's one arrival, with no bytes.
HK_INLINE void tma_first_tile_zeroed(const hk_tensor_map* tmap_k, const hk_tensor_map* tmap_v,
                                     unsigned int k_s0, unsigned int v_s0, int t0, int below, int bh,
                                     unsigned int first_bar, unsigned int full0, int lt, int bar_id) {
    if (lt == 0) tma_tile(tmap_k, tmap_v, k_s0, v_s0, t0, 0, bh, first_bar);
    hk_mbar_wait(first_bar, 0);
    const int chunks = 8 * below;  // 16-byte chunks of a column block's rows below kv_start
    for (int i = lt; i < chunks * (HEAD_DIM / 64); i += 128) {
        const unsigned int at = (i / chunks) * CBLOCK_BYTES + 16u * (i % chunks);
        hk_st_shared_16(k_s0 + at, 0u);
        hk_st_shared_16(v_s0 + at, 0u);
    }
    hk_fence_proxy_async();  // the zeros, visible to wgmma's operand reads ...
    hk_named_sync(bar_id, 128);  // ... once every thread of the warpgroup has written its own
    if (lt == 0) hk_mbar_arrive(full0);
}
#endif

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
    const int* HK_RESTRICT q_lens      // (B,) valid query rows, <= Sq, or null: Sq for all
#if TMA
    , const __grid_constant__ hk_tensor_map tmap_k,  // k as (D, skv, B Hkv): box (64, BKV, 1)
    const __grid_constant__ hk_tensor_map tmap_v     // v, the same
#endif
    ) {
    extern __shared__ __attribute__((aligned(1024))) half_t kv_s[];  // the K stages, then V's
    half_t* const k_s = kv_s;
    half_t* const v_s = kv_s + KV_STAGES * BKV * HEAD_DIM;

    const int tid = hk_thread_x();
    // The warp index through a shuffle from lane 0: ptxas then knows it is the same in every
    // lane, and keeps what derives from it (the tiles a warpgroup walks, the stages, the
    // wgmma descriptors) in uniform registers: no R2UR is left before a wgmma (wgmma_m8_b128_ws
    // 6 R2UR in the kernel against 70). On the mbarrier pipelines, the producer tiles
    // included: on an H100 (hipkernel.ab, three passes, bit-identical) d128 16384@0
    // 3.434-3.461 ms against 3.585-3.598, d128 512@8192 0.1084-0.1091 against 0.1130-0.1156,
    // wgmma_m12_b128_ws 16384@0 4.299-4.335 against 4.487-4.497, B4 4096@4096 3.308-3.333
    // against 3.437-3.442, 128@8192 0.0808-0.0817 against 0.0826. (On the producer tiles of
    // an earlier source the consumers spilled with it and ptxas serialized their wgmma,
    // C7512; wgmma_m4_b64, off the mbarrier pipelines, spills with it.)
#ifndef WARP_SHFL
#define WARP_SHFL MBAR_PIPE
#endif
#if WARP_SHFL
    const int warp = __shfl_sync(0xffffffffu, tid >> 5, 0), lane = tid & 31;
#else
    const int warp = tid >> 5, lane = tid & 31;
#endif
    const int g = lane >> 2;  // this lane's fragment rows are g and g + 8
    const int t4 = lane & 3;  // ... and its fragment columns 2 * t4, 2 * t4 + 1 (+ 8)
    const int qt = HEAVY_FIRST ? hk_grid_x() - 1 - hk_block_x() : hk_block_x();
    const int h = hk_block_y(), b = hk_block_z();
    const int kvh = kv_head(h, Hq, Hkv);
#if TMA
    if (past_lens != nullptr || q_lens != nullptr) __trap();  // ragged: not with TMA (header)
#endif
    // This sequence's lengths, the sequence whose cache the block reads (kv_b; keys j < skv
    // exist, [skv, S_cap) is never read; with TMA the tensor maps' bound, hipkernel.api.
    // kv_tensor_maps) and the rows it computes (i < n_rows; [n_rows, Sq) is padding).
    int past_b, rows, skv;
    seq_lengths(past_lens, q_lens, b, past_len, Sq, past_b, rows, skv);
    const int i0 = qt * BM;
    const int kv_b = kv_seq(b, i0, rows, Sq, S_cap, past_b, skv);
    const int n_rows = computed_rows(rows, Sq);
    if (i0 >= n_rows) {  // wholly in the padding: its zeros, and no KV tile
        store_zero_rows(out, b, Sq, Hq, h, 1, i0, i0 + BM < Sq ? i0 + BM : Sq, tid, NTHREADS);
        return;
    }
    const int past = query_base(past_b);  // row i sits at absolute position past + i

    // This block's rows and the KV range they can reach.
    const int i_last = (i0 + BM < n_rows ? i0 + BM : n_rows) - 1;
    const int p_first = past + i0, p_last = past + i_last;
    const int kv_start = kv_start_of(p_first, window);
    const int t0 = first_tile(p_first, p_last, window, BKV);
    const int t_end = (p_last + 1 + BKV - 1) / BKV;
    const bool has_sink = sink_present(sink_mode);
    const float sig2 = sink_logit2(sink, sink_mode, h);
#if TMA
    // after the stages' barriers (KernelConfig.dynamic_smem_bytes: 16 bytes more with WS): the
    // barrier a windowed first tile's copies land on, then (OVERLAP) the sink logit's word
    const unsigned int first_bar = hk_smem_u32(kv_s) + BARS_AT + KV_STAGES * 16u;
    const int bh = kv_b * Hkv + kvh;            // the tensor maps' third coordinate
    const int below = kv_start - t0 * BKV;      // keys of the first tile below every row's window
#endif

#if ROWSUM_MMA
    if (tid < ONES_BYTES / 16) {  // visible to wgmma after the fence and the first block barrier
        hk_st_shared_16(hk_smem_u32(kv_s) + KV_STAGES * 2u * TILE_BYTES + 16u * tid, HK_BF16 ? 0x3f803f80u : 0x3c003c00u);  // 8 ones
        hk_fence_proxy_async();
    }
#endif

#if WS
    // The K/V stages on mbarriers, filled by the producer warpgroup. Stage s has
    //   full[s]   FULL_ARRIVALS: with TMA the producer thread's, which arms the phase
    //             with the tile's bytes, and the phase completes once they have landed;
    //             else one per producer thread once its copies into s have landed
    //             (cp.async.mbarrier.arrive.noinc): the tile is there for every warp;
    //   empty[s]  NCONSUMERS arrivals, one per consumer thread once its warpgroup is done
    //             with s;
    // both follow the K/V stages in the dynamic buffer (16 bytes a stage). The producer loads
    // tile t into stage (t - t0) % KV_STAGES as soon as every consumer is done with the tile
    // before it there, then leaves; the consumers never meet at a block barrier.
    const unsigned int full0 = hk_smem_u32(kv_s) + BARS_AT;
    const unsigned int empty0 = full0 + 8u * KV_STAGES;
#if OVERLAP
    // The sink logit waits for the epilogue here: in a register through the loop, next to the
    // owed P, ptxas spilled it (240 registers a consumer).
    float* const sig2_s = reinterpret_cast<float*>(reinterpret_cast<char*>(kv_s) + BARS_AT + KV_STAGES * 16 + 8);
    if (tid == 0) *sig2_s = sig2;
#endif
    if (tid == 0) {
#pragma unroll
        for (int i = 0; i < KV_STAGES; ++i) {
            hk_mbar_init(full0 + 8u * i, FULL_ARRIVALS);
            hk_mbar_init(empty0 + 8u * i, NCONSUMERS);
        }
#if TMA
        hk_mbar_init(first_bar, 1);
#endif
        hk_fence_mbar_init();  // the barriers, initialised for the TMA unit's transactions too
    }
    hk_sync();
    if (warp >= M_TILES) {
        hk_setmaxnreg_dec<PRODUCER_REGS>();
#if TMA
        const unsigned int k_s0 = hk_smem_u32(k_s), v_s0 = hk_smem_u32(v_s);
        const bool issuer = tid == NCONSUMERS;  // one thread issues every copy
        if (issuer) {
            hk_tma_prefetch_map(&tmap_k);
            hk_tma_prefetch_map(&tmap_v);
        }
        int t = t0;
        if (below > 0 && t < t_end) {  // block-uniform
            tma_first_tile_zeroed(&tmap_k, &tmap_v, k_s0, v_s0, t0, below, bh, first_bar, full0,
                                  tid - NCONSUMERS, 1 + NWG);
            ++t;
        }
        if (issuer) {
            int st = t - t0, round = 0;  // 0 or 1: the stages are >= 2
            for (; t < t_end; ++t) {
                if (round > 0) hk_mbar_wait(empty0 + 8u * st, (round - 1) & 1);
                tma_tile(&tmap_k, &tmap_v, k_s0, v_s0, t, st, bh, full0 + 8u * st);
                if (++st == KV_STAGES) st = 0, ++round;
            }
        }
        return;
#else
        const hk_u64 kv_base = ((hk_u64)kv_b * Hkv + kvh) * (hk_u64)S_cap * HEAD_DIM;
        const unsigned int k_s0 = hk_smem_u32(k_s), v_s0 = hk_smem_u32(v_s);
        int st = 0, round = 0;
        for (int t = t0; t < t_end; ++t) {
            if (round > 0) hk_mbar_wait(empty0 + 8u * st, (round - 1) & 1);
            load_tile(k + kv_base, v + kv_base, k_s0, v_s0, t, st, tid - NCONSUMERS, kv_start, skv, S_cap);
            hk_mbar_arrive_cp_async(full0 + 8u * st);
            if (++st == KV_STAGES) st = 0, ++round;
        }
        hk_cp_async_commit();  // every copy has landed before the producer leaves
        hk_cp_async_wait<0>();
        return;
#endif
    }
    hk_setmaxnreg_inc<CONSUMER_REGS>();
#endif

    // This warpgroup's 64 rows, this warp's 16 of them, this lane's two.
    const int ig = i0 + 64 * (warp >> 2);
    const bool group_live = ig < n_rows;  // a warpgroup wholly past its rows computes nothing
    const int pg_first = past + ig, pg_last = pg_first + 63;
    const int iw = ig + 16 * (warp & 3);
    const int pw_first = past + iw, pw_last = pw_first + 15;
    // The tiles this warpgroup computes, [tg_lo, tg_hi): tile t (keys [t BKV, t BKV + BKV))
    // is skipped when none of its 64 rows sees a key of it, i.e. t BKV > pg_last, or under a
    // window t BKV + BKV - 1 < window_lo(pg_first). And the tiles every row of this warp
    // sees whole, [tw_lo, tw_hi): t BKV + BKV - 1 <= pw_first and, under a window,
    // t BKV >= window_lo(pw_last). Positions are >= 0, so / is the floor here.
#if GROUP_SKIP
    const int wg_lo = window > 0 ? window_lo(pg_first, window) : 0;
    const int tg_lo = wg_lo > 0 ? wg_lo / BKV : 0;
    const int tg_hi = group_live ? pg_last / BKV + 1 : 0;
#else
    const int tg_lo = 0, tg_hi = group_live ? t_end : 0;
#endif
    const int ww_lo = window < 0 ? 0 : window_lo(pw_last, window);
    const int tw_lo = ww_lo > 0 ? (ww_lo + BKV - 1) / BKV : 0;
    const int tw_hi = (pw_first + 1) / BKV;
    const int i_r[2] = {iw + g, iw + g + 8};
#if QSMEM
    // this warpgroup's Q tile, and its descriptor's low word (K-major, SBO 1024: as K's)
    const unsigned int q_s0 = hk_smem_u32(kv_s) + Q_AT + (warp >> 2) * Q_TILE_BYTES;
    load_q_smem(q, q_s0, b, Sq, Hq, h, ig, n_rows, tid & 127);
    hk_named_sync(2 + NWG + (warp >> 2), 128);
    const unsigned int q_lo0 = hk_wgmma_desc_lo(q_s0, 16u);
#else
    const half_t* qrow[2];
#pragma unroll
    for (int r = 0; r < 2; ++r)
        qrow[r] = i_r[r] < n_rows ? q + (((hk_u64)b * Sq + i_r[r]) * Hq + h) * HEAD_DIM + 2 * t4 : nullptr;
    unsigned int qf[KC_S][4];  // Q as A fragments, for the whole block
    load_q_fragments(qf, qrow);
#endif
    const float c2 = scale * LOG2E;  // s2 = c2 * dot(q, k): logits in exp2 space

    float m[2] = {row_max_init(), row_max_init()};
#if ROWSUM_N72
    float oa[NB_O + 1][4];  // acc and the row sums, one D fragment of n = 72
#pragma unroll
    for (int nd = 0; nd < NB_O + 1; ++nd)
#pragma unroll
        for (int e = 0; e < 4; ++e) oa[nd][e] = 0.0f;
    float (&o)[NB_O][4] = *reinterpret_cast<float (*)[NB_O][4]>(&oa[0][0]);
    float (&ls)[1][4] = *reinterpret_cast<float (*)[1][4]>(&oa[NB_O][0]);
#else
#if ROWSUM_MMA
    float ls[1][4] = {{0.0f, 0.0f, 0.0f, 0.0f}};  // the row sums, a D fragment of n = 8: ls[0][2 r], [2 r + 1] row g + 8 r's l
#else
    float l[2] = {0.0f, 0.0f};  // the row sums
#endif
    float o[NB_O][4];  // the O accumulator, a wgmma D fragment of n = HEAD_DIM
#pragma unroll
    for (int nd = 0; nd < NB_O; ++nd)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[nd][e] = 0.0f;
#endif

#if !WS  // every thread loads its share of the tiles
    const hk_u64 kv_base = ((hk_u64)kv_b * Hkv + kvh) * (hk_u64)S_cap * HEAD_DIM;
    const half_t* kg = k + kv_base;
    const half_t* vg = v + kv_base;
#endif
    const unsigned int k_s0 = hk_smem_u32(k_s), v_s0 = hk_smem_u32(v_s);
    // The descriptors' low words for stage 0 (wgmma.h); stage st adds st * TILE_BYTES >> 4.
    // K (K-major): SBO 1024 between 8-key groups, LBO unused (1). V (MN-major): SBO 1024
    // between 8-key groups, LBO between the 64-dim column blocks (at d 64 there is one).
    const unsigned int k_lo0 = hk_wgmma_desc_lo(k_s0, 16u);
    const unsigned int v_lo0 = hk_wgmma_desc_lo(v_s0, HEAD_DIM > 64 ? CBLOCK_BYTES : 1024u);
    if (((k_s0 | v_s0) & 1023u) != 0) __trap();  // the swizzle needs 1024-byte aligned tiles
#if !WS
    auto load_share = [&](int t, int st) { load_tile(kg, vg, k_s0, v_s0, t, st, LOAD_RR ? tid % LOADERS : tid, kv_start, skv, S_cap); };
#endif

    // A stage's mbarriers complete one phase per round of the stages: tile t (the jt-th
    // walked, jt = t - t0) sits in stage jt % KV_STAGES, in round jt / KV_STAGES, whose
    // parity the waits name; the loop counts both instead of dividing.
    // The pipeline: start() before the first tile, acquire(t, st) when tile t must be in
    // stage st for every warp, release(t, st) once this thread's warpgroup is done with it.
#if WS
    // A consumer thread waits for tile t's full barrier, and arrives on its empty barrier
    // once its warpgroup is done with it.
    auto start = [&]() {};
    auto acquire = [&](int, int st, unsigned int round) {
        hk_mbar_wait(full0 + 8u * st, round & 1);  // tile t has landed
#if !TMA  // TMA writes through the async proxy, which wgmma reads through
        hk_fence_proxy_async();  // the copies, visible to wgmma's operand reads
#endif
    };
    auto release = [&](int, int st) { hk_mbar_arrive(empty0 + 8u * st); };
#elif MBAR_PIPE
    // On mbarriers, no block barrier per tile. Stage s has
    //   full[s]   NTHREADS arrivals, one per thread once its copies into s have landed
    //             (cp.async.mbarrier.arrive.noinc): the tile is there for every warp;
    //   empty[s]  NTHREADS arrivals, one per thread once its warpgroup is done with s;
    // both follow the K/V stages in the dynamic buffer (16 bytes a stage). Every thread
    // loads its share of tile t + LOOKAHEAD at iteration t, into the stage of tile
    // t + LOOKAHEAD - KV_STAGES, which it first waits to be empty: so a warpgroup may run
    // up to KV_STAGES - 1 - LOOKAHEAD tiles ahead of the slowest before anyone blocks.
    const unsigned int full0 = hk_smem_u32(kv_s) + BARS_AT;
    const unsigned int empty0 = full0 + 8u * KV_STAGES;
    auto start = [&]() {
        if (tid == 0) {
#pragma unroll
            for (int i = 0; i < KV_STAGES; ++i) {
                hk_mbar_init(full0 + 8u * i, LOADERS);  // one warpgroup's arrivals under LOAD_RR
                hk_mbar_init(empty0 + 8u * i, NTHREADS);
            }
        }
        hk_sync();
#pragma unroll
        for (int i = 0; i < LOOKAHEAD; ++i) {
            if (t0 + i < t_end && (!LOAD_RR || i % NWG == (warp >> 2))) {
                load_share(t0 + i, i);
                hk_mbar_arrive_cp_async(full0 + 8u * i);
            }
        }
    };
    int sn = LOOKAHEAD;         // the stage of tile t + LOOKAHEAD ...
    unsigned int round_n = 0;   // ... and its round
#if LOAD_RR
    int ld_wg = LOOKAHEAD % NWG;  // ... and the warpgroup that loads it
#endif
    auto acquire = [&](int t, int st, unsigned int round) {
        if (t + LOOKAHEAD < t_end) {  // tile t + LOOKAHEAD, once its stage is free
#if LOAD_RR
            if (ld_wg == (warp >> 2))
#endif
            {
                if (round_n > 0) hk_mbar_wait(empty0 + 8u * sn, (round_n - 1) & 1);
                load_share(t + LOOKAHEAD, sn);
                hk_mbar_arrive_cp_async(full0 + 8u * sn);
            }
            if (++sn == KV_STAGES) sn = 0, ++round_n;
#if LOAD_RR
            if (++ld_wg == NWG) ld_wg = 0;
#endif
        }
        hk_mbar_wait(full0 + 8u * st, round & 1);  // tile t has landed
        hk_fence_proxy_async();  // the copies, visible to wgmma's operand reads
    };
    auto release = [&](int, int st) { hk_mbar_arrive(empty0 + 8u * st); };
#else
    // A block barrier a tile. One cp.async group per tile slot, committed even when empty
    // (past t_end), so that at iteration t exactly PENDING = KV_STAGES - 2 groups follow
    // tile t's (with one stage: tile t + 1 is loaded after tile t is consumed, PENDING = 0).
    auto start = [&]() {
#pragma unroll
        for (int i = 0; i < (KV_STAGES > 1 ? KV_STAGES - 1 : 1); ++i) {
            if (t0 + i < t_end) load_share(t0 + i, i);
            hk_cp_async_commit();
        }
    };
    auto acquire = [&](int t, int st, unsigned int) {
        hk_cp_async_wait<PENDING>();  // tile t has landed
        hk_fence_proxy_async();  // this thread's copies, visible to wgmma's operand reads ...
        hk_sync();               // ... and every thread's; every warp is done with tile t - 1
        if (KV_STAGES > 1) {     // refill tile t - 1's buffer
            const int t_next = t + KV_STAGES - 1;
            if (t_next < t_end) load_share(t_next, st == 0 ? KV_STAGES - 1 : st - 1);
            hk_cp_async_commit();
        }
    };
    auto release = [&](int t, int) {
        if (KV_STAGES == 1) {
            hk_sync();  // tile t is consumed: its buffer may be refilled
            if (t + 1 < t_end) load_share(t + 1, 0);
            hk_cp_async_commit();
        }
    };
#endif

    start();
#if PINGPONG
    const int wg = warp >> 2;
    if (wg == NWG - 1) hk_named_arrive(1, 256);  // warpgroup 0 goes first
#endif
    // The accumulators the wgmma write (acc, and with ROWSUM_MMA l), tied to this point.
    auto fence_acc = [&]() {
        hk_wgmma_fence_acc(o);
#if ROWSUM_MMA
        hk_wgmma_fence_acc(ls);
#endif
    };
    // acc += P.V (and l += P.1) of one tile (v_lo: its V descriptor's low word), P from registers.
    auto pv = [&](const unsigned int (&pa)[KC_P][4], unsigned int v_lo) {
        fence_acc();
        hk_wgmma_fence();
#if ROWSUM_N72
        // the low word: the V tile's address and, as LBO, the distance from it to the ones;
        // each 16-key step moves the first 2048 bytes on and the second 2048 bytes back
        const unsigned int va = v_lo & 0x3FFFu, ones = (k_lo0 + ONES_DESC) & 0x3FFFu;
        const unsigned int lo72 = va | ((ones - va) << 16);
#pragma unroll
        for (int kc = 0; kc < KC_P; ++kc)
            hk_wgmma_n72<1, DESC_SW128 | 64u>(oa, pa[kc], lo72 + ((2048u >> 4) - ((2048u >> 4) << 16)) * kc, 1);
#else
#pragma unroll
        for (int kc = 0; kc < KC_P; ++kc)  // 16 keys on: two 8-key groups of 1024 bytes
            hk_wgmma<HEAD_DIM, 1, DESC_SW128 | 64u>(o, pa[kc], v_lo + (2048u >> 4) * kc, 1);
#endif
#if ROWSUM_MMA && !ROWSUM_N72
#pragma unroll
        for (int kc = 0; kc < KC_P; ++kc) hk_wgmma<8, 1, DESC_SW128 | 64u>(ls, pa[kc], k_lo0 + ONES_DESC, 1);
#endif
        hk_wgmma_commit();
    };
    // The softmax of a tile (s becomes P; with fp32 row sums l is updated here); whether acc
    // (and l on the tensor cores) must be scaled by alpha, which `rescale` does once the P.V
    // that adds to them has landed.
    [[maybe_unused]] auto softmax = [&](float (&s)[NB_S][4], float (&alpha)[2]) {
#if ROWSUM_MMA
        return softmax_p(s, m, alpha, c2);
#elif L_DEFER
        return softmax_lane_scores(s, m, l, alpha, c2, has_sink, sig2, t4 == 0);
#else
        return softmax_scores(s, m, l, alpha, c2, has_sink, sig2);
#endif
    };
    auto rescale = [&](const float (&alpha)[2], bool scale) {
        rescale_acc(o, alpha, scale);
#if ROWSUM_MMA
        rescale_acc(ls, alpha, scale);
        sink_per_tile_mutant(ls[0][0], ls[0][2], m, has_sink, sig2);
#endif
    };
#if OVERLAP
    // The P.V owed (`pending`): the P of the tile before (zeros before the first, whose P.V
    // then adds 0 times that tile's own V). A warpgroup computes consecutive tiles, so the
    // tile owed is always the one before the current: its stage is `prev(st)`.
    unsigned int pa_p[KC_P][4];
#pragma unroll
    for (int kc = 0; kc < KC_P; ++kc)
#pragma unroll
        for (int e = 0; e < 4; ++e) pa_p[kc][e] = 0u;
    bool pending = false;
    auto prev = [](int st) { return st == 0 ? KV_STAGES - 1 : st - 1; };
    auto settle = [&](int st) {  // the owed P.V, issued and waited for here, then its stage freed
        if (pending) {
            pv(pa_p, v_lo0 + prev(st) * (TILE_BYTES >> 4));
            hk_wgmma_wait<0>();
            fence_acc();
            release(0, prev(st));
            pending = false;
        }
    };
#endif
    int st = 0;              // tile t's stage ...
    unsigned int round = 0;  // ... and its round
    for (int t = t0; t < t_end; ++t) {
        acquire(t, st, round);
#if PINGPONG
        hk_named_sync(1 + wg, 256);  // this warpgroup's turn
#endif

        const int j0 = t * BKV;
        const bool skip = t < tg_lo || t >= tg_hi;
        if (!skip) {  // uniform over the warpgroup, as wgmma requires
            const unsigned int k_lo = k_lo0 + st * (TILE_BYTES >> 4), v_lo = v_lo0 + st * (TILE_BYTES >> 4);

            // S = Q K^T, fp32 (the first step overwrites s).
            float s[NB_S][4];
            hk_wgmma_fence();
#pragma unroll
            for (int kc = 0; kc < KC_S; ++kc)
                // 16 dims on: 32 bytes into the row, the next column block every 4
#if QSMEM
                hk_wgmma_ss<BKV, 0, DESC_SW128 | 64u>(s, q_lo0 + ((kc >> 2) * Q_CBLOCK_BYTES + 32u * (kc & 3) >> 4),
                                                      k_lo + ((kc >> 2) * CBLOCK_BYTES + 32u * (kc & 3) >> 4), kc > 0);
#else
                hk_wgmma<BKV, 0, DESC_SW128 | 64u>(s, qf[kc], k_lo + ((kc >> 2) * CBLOCK_BYTES + 32u * (kc & 3) >> 4), kc > 0);
#endif
            hk_wgmma_commit();
#if OVERLAP
            pv(pa_p, pending ? v_lo0 + prev(st) * (TILE_BYTES >> 4) : v_lo);  // the tile before's P.V, behind this Q K^T
#endif
#if PINGPONG
            if (wg != NWG - 1 || t + 1 < t_end) hk_named_arrive(1 + (wg + 1) % NWG, 256);  // the next one's turn
#endif
            hk_wgmma_wait<OVERLAP>();  // Q K^T has landed (with OVERLAP, P.V may not have)
            hk_wgmma_fence_acc(s);

            // A tile every row of the warp sees whole needs no per-element test.
            const bool whole = t >= tw_lo && t < tw_hi;
            if (!whole) {
                const int p_r[2] = {pw_first + g, pw_first + g + 8};  // the lane's rows' positions
                mask_scores(s, j0, t4, p_r, window);
            }
#if OVERLAP
            float alpha[2];
#if PV_WAIT_SPLIT < NB_S
            // the wait after the exp2 of the first PV_WAIT_SPLIT key blocks: acc's rescale and
            // the P packing then run among the rest's exp2
            auto mid = [&](const float (&a)[2], bool sc) {
                hk_wgmma_wait_all_after(s[PV_WAIT_SPLIT - 1][3]);
                fence_acc();
                rescale(a, sc);
            };
#if ROWSUM_MMA
            softmax_p<NB_S, PV_WAIT_SPLIT>(s, m, alpha, c2, mid);
#elif L_DEFER
            softmax_lane_scores<NB_S, PV_WAIT_SPLIT>(s, m, l, alpha, c2, has_sink, sig2, t4 == 0, mid);
#else
            softmax_scores<NB_S, PV_WAIT_SPLIT>(s, m, l, alpha, c2, has_sink, sig2, mid);
#endif
#else
            const bool scale = softmax(s, alpha);
            hk_wgmma_wait_all_after(s[NB_S - 1][3]);  // the previous tile's P.V has landed in acc, after the softmax
            fence_acc();
            rescale(alpha, scale);
#endif
#pragma unroll
            for (int kc = 0; kc < KC_P; ++kc) p_fragment(pa_p[kc], s, kc);
            if (pending) release(0, prev(st));
            pending = true;
        }
#if PINGPONG
        else if (wg != NWG - 1 || t + 1 < t_end) hk_named_arrive(1 + (wg + 1) % NWG, 256);
#endif
        if (skip) {  // the owed P.V, if any, then this tile's stage
            settle(st);
            release(t, st);
        }
#else
            float alpha[2];
            rescale(alpha, softmax(s, alpha));

            // acc += P.V over every key of the tile, P rounded to fp16: p = 0 times a key no
            // row may see is why the load zero-fills them.
            unsigned int pa[KC_P][4];
#pragma unroll
            for (int kc = 0; kc < KC_P; ++kc) p_fragment(pa[kc], s, kc);
            pv(pa, v_lo);
            hk_wgmma_wait<0>();
            fence_acc();
        }
#if PINGPONG
        else if (wg != NWG - 1 || t + 1 < t_end) hk_named_arrive(1 + (wg + 1) % NWG, 256);
#endif
        release(t, st);
#endif
        if (++st == KV_STAGES) st = 0, ++round;
    }
#if OVERLAP
    settle(st);  // the last tile's P.V
#endif

    // Epilogue: the sink, then out = acc * (1 / l); a padded row's zeros.
    half_t* orow[2];
    bool valid[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        orow[r] = row_stored(i_r[r], n_rows, Sq) ? out + (((hk_u64)b * Sq + i_r[r]) * Hq + h) * HEAD_DIM + 2 * t4 : nullptr;
        valid[r] = i_r[r] < n_rows;
    }
#if ROWSUM_MMA
    const float l[2] = {ls[0][0], ls[0][2]};
#elif L_DEFER
    lane_sums_to_rows(l);
#endif
#if OVERLAP && WS
    finish_rows(o, m, l, has_sink, *sig2_s, orow, valid);
#else
    finish_rows(o, m, l, has_sink, sig2, orow, valid);
#endif
}
