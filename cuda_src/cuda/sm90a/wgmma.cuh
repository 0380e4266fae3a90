// wgmma.cuh — the Hopper warpgroup MMA (wgmma.mma_async, sm_90a) as the flash kernels use it:
// D(64×N) += A(64×K) · B(K×N) with FP32 accumulators, issued by one warpgroup (4 consecutive
// warps, the first a multiple of 4). B always comes from shared memory through a matrix
// descriptor; A from shared memory (ss) or from registers (rs). Two operand types:
//   Wgmma<N>:            TF32, K = 8 (flash_wgmma.cu, the TF32 backward). TF32 wgmma reads only
//                        the top 19 bits of each operand, and both shared-memory operands K-major.
//   WgmmaHalf<N, Fmt>:   bf16 or fp16 (half_format.cuh), K = 16 (flash_wgmma_half.cu), B K-major;
//   WgmmaHalfTransB<N, Fmt>: the same with B MN-major (wgmma's transposed B, 16-bit types only).
//
// Register layouts (per warp w of the warpgroup, lane = 4g + t), the same as mma.sync's:
//   D: d[j][e] = D(16w + g + 8·(e/2), 8j + 2t + e%2)
//   A (rs), TF32 (m16n8k8's):  a = {A(16w+g, t), A(16w+g+8, t), A(16w+g, t+4), A(16w+g+8, t+4)}
//   A (rs), half (m16n8k16's): a[i] holds two values, the lower k in the low 16 bits:
//     a = {A(16w+g, 2t..2t+1), A(16w+g+8, 2t..2t+1), A(16w+g, 2t+8..2t+9), A(16w+g+8, 2t+8..2t+9)}
// Shared-memory operands are K-major without swizzle: 8-row × 16-byte "core matrices" of 128
// contiguous bytes (make_desc below); one k step spans two core matrices along K in both types. The
// half kernels' operands and the TF32 backward's lie in the 128-byte swizzle instead (sw128_desc;
// the half kernels' V, dO, Q and K as B operands MN-major).
//
// The wrappers are generated per N by ATTNSTEP_WGMMA_SHAPE (inline assembly needs its operand
// list written out; the preprocessor writes it once per N for every operand type).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "../half_format.cuh"
#include "sm90a_asm.cuh"

namespace attnstep {
namespace wg {

// A shared-memory matrix descriptor (PTX ISA "matrix descriptor"): start address, leading byte
// offset (between core matrices adjacent in K), stride byte offset (between core matrices
// adjacent in M or N), all in 16-byte units; swizzle mode 0 (none) and base offset 0.
__device__ __forceinline__ uint64_t make_desc(const void* smem, uint32_t lbo_bytes, uint32_t sbo_bytes) {
    const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    return static_cast<uint64_t>((addr >> 4) & 0x3FFFu) |
           (static_cast<uint64_t>((lbo_bytes >> 4) & 0x3FFFu) << 16) |
           (static_cast<uint64_t>((sbo_bytes >> 4) & 0x3FFFu) << 32);
}

// A descriptor of a tile in the 128-byte swizzle (layout type 1; tensor_map.cuh's copies land in
// it): rows of 128 bytes (64 16-bit values or 32 TF32 ones), 8-row atoms of 1024 bytes, the tile
// 1024-byte aligned.
// K-major (Q, K): SBO 1024 between 8-row groups, LBO unused; a k step within a row moves the start
// address 32 bytes. MN-major (V as it lies in memory, the B operand transposed): LBO between
// 64-column blocks, SBO 1024 between 8-key groups.
__device__ __forceinline__ uint64_t sw128_desc(const void* smem, uint32_t lbo_bytes) {
    return make_desc(smem, lbo_bytes, 1024) | (1ull << 62);
}

// Byte offset of k step ks (32 bytes: 16 half or 8 TF32 values) in a K-major tile of R rows in the
// 128-byte swizzle: four steps to a 128-byte row, then the next column block of R rows.
template <int R>
__device__ __forceinline__ uint32_t k_step_bytes(int ks) {
    return (ks / 4) * R * 128 + (ks % 4) * 32;
}
// The descriptor `bytes` further on (its address field counts 16-byte units).
__device__ __forceinline__ uint64_t desc_plus(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

// Orders earlier register and shared-memory accesses before the wgmma that follow.
__device__ __forceinline__ void fence() { ATTNSTEP_SM90A_ASM("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { ATTNSTEP_SM90A_ASM("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most kPending committed groups are still running.
template <int kPending>
__device__ __forceinline__ void wait() {
    ATTNSTEP_SM90A_ASM("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Shared memory written by ordinary stores (or cp.async) is read by wgmma through the async
// proxy: each writing thread fences before the barrier that publishes the data.
__device__ __forceinline__ void fence_proxy_async() {
    ATTNSTEP_SM90A_ASM("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Pins accumulator registers: the compiler may not move their uses across this point (so no
// copy of a register the tensor cores are still writing is read before wait()).
template <int J>
__device__ __forceinline__ void fence_operands(float (&d)[J][4]) {
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
}

// A warpgroup's register budget moved between warpgroups (setmaxnreg): a block of W warpgroups
// starts with the even share that __launch_bounds__ sets; a warpgroup that needs few registers
// (a producer that only issues copies) hands them back, one that holds the accumulators claims
// them. kRegs is per thread, a multiple of 8 in 24..256; all threads of the warpgroup execute it.
template <int kRegs>
__device__ __forceinline__ void release_registers() {
    ATTNSTEP_SM90A_ASM("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void claim_registers() {
    ATTNSTEP_SM90A_ASM("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// The accumulator operands d[0..J)[0..4) of an m64nN wgmma (J = N/8).
#define ATTNSTEP_WG_ACC(d, j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define ATTNSTEP_WG_ACC4(d, j) ATTNSTEP_WG_ACC(d, j), ATTNSTEP_WG_ACC(d, j + 1), ATTNSTEP_WG_ACC(d, j + 2), ATTNSTEP_WG_ACC(d, j + 3)
#define ATTNSTEP_WG_ACC_N32(d) ATTNSTEP_WG_ACC4(d, 0)
#define ATTNSTEP_WG_ACC_N64(d) ATTNSTEP_WG_ACC4(d, 0), ATTNSTEP_WG_ACC4(d, 4)
#define ATTNSTEP_WG_ACC_N128(d) ATTNSTEP_WG_ACC4(d, 0), ATTNSTEP_WG_ACC4(d, 4), ATTNSTEP_WG_ACC4(d, 8), ATTNSTEP_WG_ACC4(d, 12)
// The accumulator registers of an m64n32 wgmma, then the operand numbers after them: ss takes
// desc_a, desc_b, accumulate; rs takes a[0..4), desc_b, accumulate.
#define ATTNSTEP_WG_REGS_N32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define ATTNSTEP_WG_SS_N32 "%16, %17, p"
#define ATTNSTEP_WG_SS_PRED_N32 "%18"
#define ATTNSTEP_WG_RS_N32 "{%16, %17, %18, %19}, %20, p"
#define ATTNSTEP_WG_RS_PRED_N32 "%21"
// The accumulator registers of an m64n64 wgmma, then the operand numbers after them: ss takes
// desc_a, desc_b, accumulate; rs takes a[0..4), desc_b, accumulate.
#define ATTNSTEP_WG_REGS_N64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define ATTNSTEP_WG_SS_N64 "%32, %33, p"
#define ATTNSTEP_WG_SS_PRED_N64 "%34"
#define ATTNSTEP_WG_RS_N64 "{%32, %33, %34, %35}, %36, p"
#define ATTNSTEP_WG_RS_PRED_N64 "%37"
// The accumulator registers of an m64n128 wgmma, then the operand numbers after them: ss takes
// desc_a, desc_b, accumulate; rs takes a[0..4), desc_b, accumulate.
#define ATTNSTEP_WG_REGS_N128 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define ATTNSTEP_WG_SS_N128 "%64, %65, p"
#define ATTNSTEP_WG_SS_PRED_N128 "%66"
#define ATTNSTEP_WG_RS_N128 "{%64, %65, %66, %67}, %68, p"
#define ATTNSTEP_WG_RS_PRED_N128 "%69"

// The ss and rs wrappers of the m64n<N> shape for one operand type: TYPES is the instruction's
// "k<K>.f32.<a>.<b>" and SS_TAIL/RS_TAIL its operands after the scales (the half types' transpose
// flags: 0 for K-major, 1 for MN-major).
#define ATTNSTEP_WGMMA_SHAPE(N, TYPES, SS_TAIL, RS_TAIL)                                                   \
    /* D(64xN) (+)= A(64xK, shared) * B(KxN, shared) */                                                    \
    static __device__ __forceinline__ void ss(float (&d)[N / 8][4], uint64_t desc_a, uint64_t desc_b,     \
                                              int accumulate) {                                           \
        ATTNSTEP_SM90A_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, " ATTNSTEP_WG_SS_PRED_N##N ", 0;\n"            \
                           "wgmma.mma_async.sync.aligned.m64n" #N TYPES " " ATTNSTEP_WG_REGS_N##N ", "     \
                           ATTNSTEP_WG_SS_N##N ", 1, 1" SS_TAIL ";\n}\n"                                   \
                           : ATTNSTEP_WG_ACC_N##N(d)                                                       \
                           : "l"(desc_a), "l"(desc_b), "r"(accumulate)                                     \
                           : "memory");                                                                    \
    }                                                                                                      \
    /* D(64xN) (+)= A(64xK, registers) * B(KxN, shared) */                                                 \
    static __device__ __forceinline__ void rs(float (&d)[N / 8][4], const uint32_t (&a)[4],               \
                                              uint64_t desc_b, int accumulate) {                          \
        ATTNSTEP_SM90A_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, " ATTNSTEP_WG_RS_PRED_N##N ", 0;\n"            \
                           "wgmma.mma_async.sync.aligned.m64n" #N TYPES " " ATTNSTEP_WG_REGS_N##N ", "     \
                           ATTNSTEP_WG_RS_N##N ", 1, 1" RS_TAIL ";\n}\n"                                   \
                           : ATTNSTEP_WG_ACC_N##N(d)                                                       \
                           : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate)      \
                           : "memory");                                                                    \
    }

template <int N>
struct Wgmma;  // m64nNk8 TF32; specialized for the N the flash kernel uses
template <> struct Wgmma<32> { ATTNSTEP_WGMMA_SHAPE(32, "k8.f32.tf32.tf32", "", "") };
template <> struct Wgmma<64> { ATTNSTEP_WGMMA_SHAPE(64, "k8.f32.tf32.tf32", "", "") };
template <> struct Wgmma<128> { ATTNSTEP_WGMMA_SHAPE(128, "k8.f32.tf32.tf32", "", "") };

template <int N, class Fmt>
struct WgmmaHalf;  // m64nNk16 with bf16 or fp16 operands (Fmt: half_format.cuh)
template <> struct WgmmaHalf<64, Bf16> { ATTNSTEP_WGMMA_SHAPE(64, "k16.f32.bf16.bf16", ", 0, 0", ", 0") };
template <> struct WgmmaHalf<128, Bf16> { ATTNSTEP_WGMMA_SHAPE(128, "k16.f32.bf16.bf16", ", 0, 0", ", 0") };
template <> struct WgmmaHalf<64, Fp16> { ATTNSTEP_WGMMA_SHAPE(64, "k16.f32.f16.f16", ", 0, 0", ", 0") };
template <> struct WgmmaHalf<128, Fp16> { ATTNSTEP_WGMMA_SHAPE(128, "k16.f32.f16.f16", ", 0, 0", ", 0") };

// The same with B MN-major (transpose flag 1): B(K×N) stored N-contiguous, V as it lies in memory.
template <int N, class Fmt>
struct WgmmaHalfTransB;
template <> struct WgmmaHalfTransB<64, Bf16> { ATTNSTEP_WGMMA_SHAPE(64, "k16.f32.bf16.bf16", ", 0, 1", ", 1") };
template <> struct WgmmaHalfTransB<128, Bf16> { ATTNSTEP_WGMMA_SHAPE(128, "k16.f32.bf16.bf16", ", 0, 1", ", 1") };
template <> struct WgmmaHalfTransB<64, Fp16> { ATTNSTEP_WGMMA_SHAPE(64, "k16.f32.f16.f16", ", 0, 1", ", 1") };
template <> struct WgmmaHalfTransB<128, Fp16> { ATTNSTEP_WGMMA_SHAPE(128, "k16.f32.f16.f16", ", 0, 1", ", 1") };

}  // namespace wg
}  // namespace attnstep
