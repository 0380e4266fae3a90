// flash_bwd_wgmma_kernels.cuh — the FlashAttention-2 backward's two Hopper kernels (warpgroup MMA,
// sm_90a), written once for three operand families: bf16/fp16 (flash_bwd_wgmma_half.cu), TF32 and
// 3xTF32 (flash_bwd_wgmma_tf32.cu). The deterministic two-kernel form of flash_bwd.cu: no N×M
// buffer, no atomics, so two runs give the same bytes.
//
//   1. dK/dV kernel: a block owns 64·NWG keys (K and V in shared memory, 64 keys per consumer
//      warpgroup) and streams the query tiles of STREAM rows that can see them (Q, dO, and the
//      rows' lse·log2 e and D). Per tile each warpgroup computes, with its keys as the MMA rows,
//        Sᵀ = K_w·Qᵀ,  dPᵀ = V_w·dOᵀ           (both operands K-major in shared memory)
//        Pᵀ = 2^(Sᵀ·scale·log2 e − lse₂),  dSᵀ = Pᵀ∘(dPᵀ − D)      (FP32 registers)
//        dV_w += Pᵀ·dO,  dK_w += dSᵀ·Q          (A from registers)
//   2. dQ kernel: a block owns 64·NWG query rows (Q, dO; lse₂ and D in registers) and streams the
//      key tiles it can see: S = Q_w·Kᵀ, dP = dO_w·Vᵀ, P, dS as above, dQ_w += dS·K.
//   The second GEMMs' B operand (dO, Q, K with the streamed rows as the reduction) is where the two
//   families differ. wgmma reads 16-bit B operands MN-major (transposed), so the half family reads
//   the streamed tile as it lies; TF32 B operands must be K-major, so the TF32 family streams a
//   transposed copy beside each such tile (dOᵀ, Qᵀ, Kᵀ, written by its preparation pass with the
//   rows permuted within each 8 as flash::kperm says, so that the accumulators are the next A
//   fragments as they stand).
//   3xTF32 (FP32 accuracy) keeps every operand as two TF32 parts, x = hi + lo, each matrix's lo part
//   right after its hi part in shared memory and in the preparation pass's copies (the lo parts as
//   heads [heads, 2·heads) of the same tensor maps); each product is three MMAs, lo·hi, hi·lo, hi·hi,
//   per k step (the dropped lo·lo is a product of two TF32 rounding errors).
//   The variant instantiation (kVariant, half operands: the mask rule of either causal alignment
//   and of sliding windows, the softcap, ALiBi; no per-element inputs) visits only the tiles of
//   the rule's range, skips a warpgroup's tile that the rule hides whole, and makes each score as
//   the half forward made it (variant_weights); dS takes the softcap's derivative.
//   A producer warpgroup's one thread issues every copy by tensor memory access (tensor_map.cuh)
//   into the 128-byte swizzle, into two stages counted on mbarriers. Rows past N or M land as
//   zeros; a key past M is masked in the dQ kernel (its P could overflow where lse is very
//   negative, and ∞·0 would poison dQ); a key's own gradient rows past M are never stored.
#pragma once

#include <algorithm>
#include <cstdint>

#include "../cuda_check.cuh"
#include "../device.cuh"
#include "../flash_bwd.cuh"
#include "../flash_common.cuh"
#include "../flash_dispatch.cuh"
#include "../flash_scores.cuh"
#include "../half_format.cuh"
#include "bulk_copy.cuh"
#include "tensor_map.cuh"
#include "wgmma.cuh"

namespace attnstep {
namespace wgbwd {

using flash::ceil_div;
using flash::tanh_approx;
using flash::variant_args;
using flash::VariantArgs;
using flash::zero;

constexpr int kWarpgroup = 128;     // threads
constexpr int kSwizzleAtom = 1024;  // bytes: 8 rows of 128 (tensor_map.cuh)
constexpr int kRowBytes = 128;      // one swizzled row

using wg::desc_plus;
using wg::k_step_bytes;

// bf16/fp16 operands (Fmt: half_format.cuh), rounded to the format as the GEMMs read them.
template <class Fmt_>
struct HalfOps {
    using Fmt = Fmt_;  // the gradients are rounded to the format as they are stored
    using Elem = uint16_t;
    static constexpr int K = 16;  // the k of one wgmma
    static constexpr int PARTS = 1;  // parts of each operand (3xTF32: hi and lo)
    static constexpr bool TRANSPOSED_COPIES = false;
    static constexpr int ROW_VALUES = kRowBytes / sizeof(Elem);
    template <int N>
    static __device__ __forceinline__ void ss(float (&x)[N / 8][4], uint64_t a, uint64_t b, int accumulate) {
        wg::WgmmaHalf<N, Fmt>::ss(x, a, b, accumulate);
    }
    // acc(64×N) (+)= X·B (accumulate 0: acc starts from 0), X's k step kk from registers, B the
    // streamed tile of R rows as it lies (MN-major: 64-column blocks R rows apart, k step kk 16 rows
    // in).
    template <int N, int R>
    static __device__ __forceinline__ void rs(float (&acc)[N / 8][4], const uint32_t (&x)[4], const void* tile, int kk,
                                              int accumulate) {
        wg::WgmmaHalfTransB<N, Fmt>::rs(acc, x, desc_plus(wg::sw128_desc(tile, R * kRowBytes), kk * 16 * kRowBytes),
                                        accumulate);
    }
    // Accumulator fragments (64×C) rounded to the format as the next wgmma's A fragments: the
    // column pairs of s[2kk] and s[2kk+1] make k step kk.
    template <int C>
    static __device__ __forceinline__ void pack_a(uint32_t (&a)[PARTS][C / K][4], const float (&s)[C / 8][4]) {
#pragma unroll
        for (int kk = 0; kk < C / K; ++kk) {
            a[0][kk][0] = Fmt::pack(s[2 * kk][0], s[2 * kk][1]);
            a[0][kk][1] = Fmt::pack(s[2 * kk][2], s[2 * kk][3]);
            a[0][kk][2] = Fmt::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            a[0][kk][3] = Fmt::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
        }
    }
};

// TF32 operands, rounded to TF32 (nearest, ties away) by the preparation pass and, for P and dS,
// as they become A fragments; the gradients are stored as FP32. kThree: 3xTF32, each operand split
// into hi = tf32(x) and lo = tf32(x − hi) (flash::split), the products' three MMAs.
template <bool kThree>
struct Tf32Ops {
    using Fmt = Fp32;
    using Elem = float;
    static constexpr int K = 8;
    static constexpr int PARTS = kThree ? 2 : 1;
    static constexpr bool TRANSPOSED_COPIES = true;
    static constexpr int ROW_VALUES = kRowBytes / sizeof(Elem);
    template <int N>
    static __device__ __forceinline__ void ss(float (&x)[N / 8][4], uint64_t a, uint64_t b, int accumulate) {
        wg::Wgmma<N>::ss(x, a, b, accumulate);
    }
    // acc(64×N) (+)= X·B, B from the transposed copy of the streamed tile (N rows, K-major).
    template <int N, int R>
    static __device__ __forceinline__ void rs(float (&acc)[N / 8][4], const uint32_t (&x)[4], const void* tile_t, int kk,
                                              int accumulate) {
        wg::Wgmma<N>::rs(acc, x, desc_plus(wg::sw128_desc(tile_t, 16), k_step_bytes<N>(kk)), accumulate);
    }
    // s[kk] as k step kk's A fragment under kperm, {c0, c2, c1, c3}: its parts a[0] (hi) and a[1]
    // (lo, 3xTF32; with one part the split writes no lo).
    template <int C>
    static __device__ __forceinline__ void pack_a(uint32_t (&a)[PARTS][C / K][4], const float (&s)[C / 8][4]) {
#pragma unroll
        for (int kk = 0; kk < C / K; ++kk) flash::split_acc_a<kThree>(s[kk], a[0][kk], a[PARTS - 1][kk]);
    }
};

// A block owns OWN = 64·NWG rows (keys in kernel 1, query rows in kernel 2), 64 per consumer
// warpgroup, and streams tiles of STREAM rows of the other side through two stages. Shared
// memory: the two owned matrices, two stages of the streamed ones (kernel 1: Q, dO, and with
// transposed copies Qᵀ, dOᵀ; kernel 2: K, V, and Kᵀ), two stages of two row vectors (lse₂ and D,
// kernel 1 only), each matrix in blocks of 128-byte rows in the swizzle.
// 3xTF32 stores two parts of every matrix, the lo part right after the hi part. (Two stages at
// least: a consumer waits for tile j's copies before it releases tile j − 1's stage.)
template <int D_, int NWG_, int STREAM_, class Ops_>
struct BwdTiles {
    using Ops = Ops_;
    using Fmt = typename Ops::Fmt;
    using Elem = typename Ops::Elem;
    static constexpr int D = D_, NWG = NWG_, OWN = 64 * NWG, STREAM = STREAM_, STAGES = 2;
    static constexpr int PARTS = Ops::PARTS;
    static constexpr int CONSUMERS = kWarpgroup * NWG, THREADS = CONSUMERS + kWarpgroup;
    // The producer keeps the minimum; the consumers share the rest of the 64K registers, at most
    // 240 a thread (one consumer warpgroup: what its launch already holds).
    static constexpr int PRODUCER_REGS = 24;
    static constexpr int CONSUMER_REGS = std::min((65536 / kWarpgroup - PRODUCER_REGS) / NWG / 8 * 8, 240);
    // Whether kernel 1 issues a tile's Sᵀ and dPᵀ before the last tile's dV, dK group completes:
    // that keeps the last P and dS fragments live beside the next Sᵀ and dPᵀ, which fit the
    // consumers' registers at d64 alone (at d128 ptxas would serialize every wgmma of the kernel).
    // TF32 at d64 fits too but measured no faster (H100, B4 H16 N = M = 4096: 4.16 ms with the
    // overlap against 3.98 without, causal 2.97 against 2.95), so it keeps the registers.
    static constexpr bool OVERLAP_TILES = D <= 64 && NWG == 2 && !Ops::TRANSPOSED_COPIES;
    static constexpr int ROW_VALUES = Ops::ROW_VALUES;
    static constexpr int COL_BLOCKS = D / ROW_VALUES;
    static constexpr int OWN_ELEMS = OWN * D, STREAM_ELEMS = STREAM * D;
    static constexpr int MATS_1 = Ops::TRANSPOSED_COPIES ? 4 : 2;  // streamed matrices a stage, kernel 1
    static constexpr int MATS_2 = Ops::TRANSPOSED_COPIES ? 3 : 2;  // and kernel 2
    static constexpr uint32_t OWN_BYTES = OWN_ELEMS * sizeof(Elem), STREAM_BYTES = STREAM_ELEMS * sizeof(Elem),
                              ROW_BYTES = STREAM * sizeof(float);
    static constexpr size_t TILE_BYTES =
        (2 * static_cast<size_t>(OWN_ELEMS) + STAGES * MATS_1 * STREAM_ELEMS) * PARTS * sizeof(Elem);
    // Sized for kernel 1 (the larger stages and the row vectors); kernel 2 takes the same, one block
    // an SM either way.
    static constexpr size_t SMEM_BYTES = TILE_BYTES + STAGES * 2 * ROW_BYTES + kSwizzleAtom;
    static_assert(D % ROW_VALUES == 0 && STREAM % ROW_VALUES == 0, "whole column blocks");
    static_assert(STREAM % 8 == 0 && STREAM_BYTES % kSwizzleAtom == 0, "tiles of whole swizzle atoms");
    static_assert(SMEM_BYTES + 64 <= 227 * 1024, "shared memory");
    // A streamed matrix with its parts, in elements; the bytes the owned rows' copies and each
    // tile's (kernel 1, kernel 2) bring, as their mbarriers count them.
    static constexpr int STREAM_MAT = PARTS * STREAM_ELEMS;
    static constexpr uint32_t OWN_TX = 2 * PARTS * OWN_BYTES, TILE_TX_1 = MATS_1 * PARTS * STREAM_BYTES + 2 * ROW_BYTES,
                              TILE_TX_2 = MATS_2 * PARTS * STREAM_BYTES;
    static_assert(OWN_TX < (1u << 20) && TILE_TX_1 < (1u << 20), "mbarrier transaction count");
};

struct BwdParams {
    const float* lse2;  // [heads][n_pad]: lse·log2 e, +inf past N
    const float* Drow;  // [heads][n_pad]: rowsum(dO∘O), 0 past N
    float* dQ;          // [heads][N][D]
    float* dK;          // [heads][M][D]
    float* dV;
    int head0;          // the launch's first head (a grid holds at most kMaxGridYZ)
    int heads;          // the heads of a's tensors: a lo part's head in the tensor maps is head + heads
    int N, M, n_pad;
    float scale_log2, scale;
};

// The query rows (or keys) padded to whole blocks of T::OWN: the rows the row vectors lse₂ and D
// hold, and the transposed copies' (every tile the kernels read, rows 16-byte multiples).
template <class T>
int padded_rows(int rows) {
    return ceil_div(rows, T::OWN) * T::OWN;
}

// Whether a kernel argument can be read 16 bytes at a time (tensor maps, float4 loads).
inline bool aligned16(const void* p) { return p && reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Q, K, V and dO (and the transposed copies Qᵀ, dOᵀ, Kᵀ: [heads][D][rows padded]) as tensor
// maps, boxes of the owned or the streamed rows as the kernel reads them.
struct BwdMaps {
    CUtensorMap q, k, v, dO, qT, dOT, kT;
};

// The tensor maps' head of a head's part: the lo parts (3xTF32) are heads [heads, 2·heads).
__device__ __forceinline__ int part_head(int head, int part, int heads) { return head + part * heads; }

// Rows [row, row + R) of a [heads][rows][D] tensor: D/ROW_VALUES column blocks of R rows.
template <class T, int R>
__device__ __forceinline__ void load_rows(typename T::Elem* dst, const CUtensorMap* map, int row, int head, uint64_t* bar) {
    tma::load_row_blocks<R, T::COL_BLOCKS>(dst, map, row, head, bar);
}

// Columns [col, col + STREAM) of a transposed [heads][D][rows padded] copy: STREAM/ROW_VALUES
// column blocks of D rows.
template <class T>
__device__ __forceinline__ void load_cols(typename T::Elem* dst, const CUtensorMap* map, int col, int head, uint64_t* bar) {
#pragma unroll
    for (int b = 0; b < T::STREAM / T::ROW_VALUES; ++b)
        tma::load(dst + b * T::D * T::ROW_VALUES, map, col + b * T::ROW_VALUES, 0, head, bar);
}

// The dynamic shared memory from its first swizzle atom (the swizzle follows address bits).
template <class E>
__device__ __forceinline__ E* atom_aligned(float4* smem) {
    const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    return reinterpret_cast<E*>(reinterpret_cast<char*>(smem) + (kSwizzleAtom - base % kSwizzleAtom) % kSwizzleAtom);
}

// X(64×STREAM) = A(64×D)·B(STREAM×D)ᵀ, both K-major: a, the warpgroup's 64 owned rows; b, a tile.
// 3xTF32 (each matrix's lo part right after its hi part): the small terms lo·hi and hi·lo of every k step
// first, then hi·hi. The tensor cores truncate each addition to the running sum, a bias toward
// zero; summed first, the small terms' truncations are of a small sum, so the result takes about
// one truncation per k step, as flash_bwd.cu's separate small accumulator gives.
template <class T>
__device__ __forceinline__ void issue_abt(float (&x)[T::STREAM / 8][4], uint64_t a, uint64_t b) {
    if constexpr (T::PARTS == 2) {
#pragma unroll
        for (int ks = 0; ks < T::D / T::Ops::K; ++ks) {
            const uint64_t ak = desc_plus(a, k_step_bytes<T::OWN>(ks)), bk = desc_plus(b, k_step_bytes<T::STREAM>(ks));
            T::Ops::template ss<T::STREAM>(x, desc_plus(ak, T::OWN_BYTES), bk, ks > 0);  // lo·hi
            T::Ops::template ss<T::STREAM>(x, ak, desc_plus(bk, T::STREAM_BYTES), 1);    // hi·lo
        }
    }
#pragma unroll
    for (int ks = 0; ks < T::D / T::Ops::K; ++ks)
        T::Ops::template ss<T::STREAM>(x, desc_plus(a, k_step_bytes<T::OWN>(ks)), desc_plus(b, k_step_bytes<T::STREAM>(ks)),
                                       T::PARTS == 2 || ks > 0);
}

// acc(64×D) += X(64×STREAM, register fragments: x[0] hi, x[1] lo)·B(STREAM×D): `b` the streamed
// tile, or its transposed copy (Ops::TRANSPOSED_COPIES). 3xTF32: acc = X·B instead, the tile's sums
// in an accumulator of their own that the caller adds in FP32 (one chain over every tile would take
// three truncations per k step of the whole sum, their bias growing with its length); the small
// terms first, as in issue_abt.
template <class T>
__device__ __forceinline__ void issue_xb(float (&acc)[T::D / 8][4],
                                         const uint32_t (&x)[T::PARTS][T::STREAM / T::Ops::K][4], const void* b) {
    if constexpr (T::PARTS == 2) {
        const void* b_lo = static_cast<const typename T::Elem*>(b) + T::STREAM_ELEMS;
#pragma unroll
        for (int kk = 0; kk < T::STREAM / T::Ops::K; ++kk) {
            T::Ops::template rs<T::D, T::STREAM>(acc, x[1][kk], b, kk, kk > 0);  // lo·hi
            T::Ops::template rs<T::D, T::STREAM>(acc, x[0][kk], b_lo, kk, 1);   // hi·lo
        }
    }
#pragma unroll
    for (int kk = 0; kk < T::STREAM / T::Ops::K; ++kk) T::Ops::template rs<T::D, T::STREAM>(acc, x[0][kk], b, kk, 1);
}

// Writes the thread's part of a warp's 16 gradient rows (row0 = the warp's first + g), times
// `factor` and rounded to the format; rows at or past `rows` are not written.
template <class T>
__device__ __forceinline__ void store_grad(const float (&x)[T::D / 8][4], float* dst, int row0, int rows, float factor,
                                           int t) {
    using Fmt = typename T::Fmt;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = row0 + 8 * h;
        if (row >= rows) continue;
#pragma unroll
        for (int j = 0; j < T::D / 8; ++j)
            *reinterpret_cast<float2*>(dst + static_cast<size_t>(row) * T::D + 8 * j + 2 * t) =
                make_float2(Fmt::round(x[j][2 * h] * factor), Fmt::round(x[j][2 * h + 1] * factor));
    }
}

// The barriers of a block: its owned rows, and per stage the streamed tile landed / released (by
// every consumer thread).
template <class T>
struct Barriers {
    uint64_t own, full[T::STAGES], empty[T::STAGES];
    __device__ void init() {
        bulk::init(&own, 1);
        for (int s = 0; s < T::STAGES; ++s) {
            bulk::init(&full[s], 1);
            bulk::init(&empty[s], T::CONSUMERS);
        }
        bulk::fence_init();
    }
};

// Stream tile j's stage, and the parity of the phase it completes (the n-th tile of a stage
// completes its n-th phase); `tile_begin` is the block's first tile.
struct StageRing {
    int tile_begin, stages;
    __device__ int slot(int j) const { return (j - tile_begin) % stages; }
    __device__ int use(int j) const { return (j - tile_begin) / stages; }
    __device__ uint32_t parity(int j) const { return static_cast<uint32_t>(use(j) & 1); }
};

// The producer thread: the owned rows (own_map from own_row, each part), then each tile j of
// [begin, end) into its stage once the consumers released the stage's previous tile;
// copy_tile(j, stage, bar) issues the tile's copies, `tile_bytes` in all.
template <class T, class CopyTile>
__device__ void produce(Barriers<T>& bars, typename T::Elem* own, const CUtensorMap* own_a, const CUtensorMap* own_b,
                        int own_row, int head, int heads, const StageRing& ring, int end, uint32_t tile_bytes,
                        CopyTile copy_tile) {
    if (ring.tile_begin >= end) return;  // nothing to compute: nobody waits on a copy
    bulk::arrive_expect_tx(&bars.own, T::OWN_TX);
#pragma unroll
    for (int part = 0; part < T::PARTS; ++part) {
        const int h = part_head(head, part, heads);
        load_rows<T, T::OWN>(own + part * T::OWN_ELEMS, own_a, own_row, h, &bars.own);
        load_rows<T, T::OWN>(own + (T::PARTS + part) * T::OWN_ELEMS, own_b, own_row, h, &bars.own);
    }
    for (int j = ring.tile_begin; j < end; ++j) {
        const int s = ring.slot(j);
        if (ring.use(j) > 0) bulk::wait(&bars.empty[s], static_cast<uint32_t>((ring.use(j) - 1) & 1));
        bulk::arrive_expect_tx(&bars.full[s], tile_bytes);
        copy_tile(j, s, &bars.full[s]);
    }
}


// The variant instantiation's weights of a tile of raw scores s (half operands), as the half
// forward made them (flash_wgmma_half.cu, flash_scores.cuh): x = c·y with y = s and c = scale·log2 e,
// or under a softcap (kCap) y = t = tanh(s·scale/C) by tanh.approx and c = C·log2 e; kAlibi: x
// minus the slope·|diag − key|; P = 2^(x − lse₂), its exponent c·y − lse₂ in one FFMA without
// ALiBi, and 0 for a key past M or one the rule hides (tested only where `cut`: the tile is not
// visible whole). s becomes P∘f, f = 1 − t² the softcap's derivative (1 without), which
// dS = P∘f∘(dP − D) takes; kPack: P itself is packed into pa as the dV GEMM's A fragments
// (HalfOps::pack_a's layout) before s is overwritten. at(jj, e, r, c): the score's query row and
// key; dist_of(jj, e): diag(r) − key as a float (a tile's base and the fragment's constant offset: an
// addition, where converting each score's own integer would take a special-function slot);
// lse2_of(jj, e): its row's lse·log2 e.
template <class T, bool kCap, bool kAlibi, bool kPack, class At, class Dist, class Lse2>
__device__ __forceinline__ void variant_weights(float (&s)[T::STREAM / 8][4], uint32_t (&pa)[1][T::STREAM / 16][4],
                                                const VariantArgs& va, float slope_log2, int M, bool cut, At at,
                                                Dist dist_of, Lse2 lse2_of) {
    static_assert(T::PARTS == 1 && T::Ops::K == 16, "half operands");
    const float c = kCap ? va.mods.cap_out : va.mods.scale_log2;
#pragma unroll
    for (int jj = 0; jj < T::STREAM / 8; ++jj)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float p[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int e = 2 * h + i;
                float y = s[jj][e], f = 1.f;
                if constexpr (kCap) {
                    y = tanh_approx(y * va.mods.cap_in);
                    f = __fmaf_rn(-y, y, 1.f);
                }
                float exponent;
                if constexpr (kAlibi) exponent = __fmaf_rn(-slope_log2, fabsf(dist_of(jj, e)), y * c) - lse2_of(jj, e);
                else exponent = __fmaf_rn(y, c, -lse2_of(jj, e));
                int r, k;
                at(jj, e, r, k);
                p[i] = cut && (k >= M || !va.v.visible(r, k)) ? 0.f : flash::exp2_ftz(exponent);
                s[jj][e] = kCap ? p[i] * f : p[i];
            }
            if constexpr (kPack) pa[0][jj / 2][(jj % 2) * 2 + h] = T::Fmt::pack(p[0], p[1]);
        }
}

// variant_weights with the softcap's and ALiBi's branches taken once per tile (a test per score
// would be a divergent branch of its own in the machine code, and ALiBi's conversion of each
// distance would cost the others a special-function slot per score).
template <class T, bool kPack, class At, class Dist, class Lse2>
__device__ __forceinline__ void variant_tile_weights(float (&s)[T::STREAM / 8][4], uint32_t (&pa)[1][T::STREAM / 16][4],
                                                     const VariantArgs& va, float slope_log2, int M, bool cut, At at,
                                                     Dist dist_of, Lse2 lse2_of) {
    const bool cap = va.mods.cap_in != 0.f;
    if (slope_log2 != 0.f) {
        if (cap) variant_weights<T, true, true, kPack>(s, pa, va, slope_log2, M, cut, at, dist_of, lse2_of);
        else variant_weights<T, false, true, kPack>(s, pa, va, slope_log2, M, cut, at, dist_of, lse2_of);
    } else {
        if (cap) variant_weights<T, true, false, kPack>(s, pa, va, slope_log2, M, cut, at, dist_of, lse2_of);
        else variant_weights<T, false, false, kPack>(s, pa, va, slope_log2, M, cut, at, dist_of, lse2_of);
    }
}

// Kernel 1 (grid: x = key blocks, y = heads): dK and dV of the block's OWN keys. kVariant: va's
// rule, softcap and ALiBi (its own kernel parameter, read in place).
template <class T, bool kCausal, bool kVariant>
__global__ void __launch_bounds__(T::THREADS, 1) dkdv_kernel(const BwdParams p, const __grid_constant__ BwdMaps maps,
                                                             const __grid_constant__ VariantArgs va) {
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
    __trap();  // built for sm_90a only; never launched elsewhere
#else
    using E = typename T::Elem;
    using Ops = typename T::Ops;
    extern __shared__ float4 smem_f4[];
    E* const own = atom_aligned<E>(smem_f4);   // K [PARTS][OWN×D], V [PARTS][OWN×D]
    E* const tiles = own + 2 * T::PARTS * T::OWN_ELEMS;  // [STAGES]{Q, dO [STREAM×D], and Qᵀ, dOᵀ [D×STREAM]}
    float* const rows = reinterpret_cast<float*>(tiles + T::STAGES * T::MATS_1 * T::STREAM_MAT);  // [STAGES]{lse₂, D}
    __shared__ Barriers<T> bars;
    const int head = p.head0 + blockIdx.y, k0 = blockIdx.x * T::OWN;
    // The query tiles that can see the block's keys: causal, from the one holding query k0 on; the
    // variant's, those of the rows [first_row, end_row) of its keys.
    int tile_begin = 0, tile_end = 0;
    flash::visible_query_tiles<kCausal, kVariant>(va.v, p.M, p.N, k0, T::OWN, T::STREAM, tile_begin, tile_end);
    const StageRing ring{tile_begin, T::STAGES};
    auto q_tile = [&](int s) { return tiles + s * T::MATS_1 * T::STREAM_MAT; };
    auto do_tile = [&](int s) { return q_tile(s) + T::STREAM_MAT; };
    // The B operands of dK += dSᵀ·Q and dV += Pᵀ·dO: the tiles, or their transposed copies.
    auto q_b = [&](int s) { return Ops::TRANSPOSED_COPIES ? q_tile(s) + 2 * T::STREAM_MAT : q_tile(s); };
    auto do_b = [&](int s) { return Ops::TRANSPOSED_COPIES ? q_tile(s) + 3 * T::STREAM_MAT : do_tile(s); };
    auto lse2_of = [&](int s) { return rows + s * 2 * T::STREAM; };
    if (threadIdx.x == 0) bars.init();
    __syncthreads();

    if (threadIdx.x >= T::CONSUMERS) {
        wg::release_registers<T::PRODUCER_REGS>();
        if (threadIdx.x == T::CONSUMERS) {
            const size_t row_base = static_cast<size_t>(head) * p.n_pad;
            produce<T>(bars, own, &maps.k, &maps.v, k0, head, p.heads, ring, tile_end, T::TILE_TX_1,
                       [&](int j, int s, uint64_t* bar) {
#pragma unroll
                           for (int part = 0; part < T::PARTS; ++part) {
                               const int at = part * T::STREAM_ELEMS, h = part_head(head, part, p.heads);
                               load_rows<T, T::STREAM>(q_tile(s) + at, &maps.q, j * T::STREAM, h, bar);
                               load_rows<T, T::STREAM>(do_tile(s) + at, &maps.dO, j * T::STREAM, h, bar);
                               if constexpr (Ops::TRANSPOSED_COPIES) {
                                   load_cols<T>(q_b(s) + at, &maps.qT, j * T::STREAM, h, bar);
                                   load_cols<T>(do_b(s) + at, &maps.dOT, j * T::STREAM, h, bar);
                               }
                           }
                           bulk::copy(lse2_of(s), p.lse2 + row_base + j * T::STREAM, T::ROW_BYTES, bar);
                           bulk::copy(lse2_of(s) + T::STREAM, p.Drow + row_base + j * T::STREAM, T::ROW_BYTES, bar);
                       });
        }
        return;
    }
    wg::claim_registers<T::CONSUMER_REGS>();

    const int wg = threadIdx.x / kWarpgroup, warp = (threadIdx.x % kWarpgroup) / 32;
    const int lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
    const int key_lo = k0 + 64 * wg, key0 = key_lo + 16 * warp + g;  // the thread's keys: key0, key0 + 8
    const float slope_log2 = kVariant ? va.v.slope(head) * flash::kLog2e : 0.f;
    const uint64_t k_desc = wg::sw128_desc(own + wg * 64 * T::ROW_VALUES, 16);
    const uint64_t v_desc = wg::sw128_desc(own + T::PARTS * T::OWN_ELEMS + wg * 64 * T::ROW_VALUES, 16);
    float dk[T::D / 8][4], dv[T::D / 8][4], st[T::STREAM / 8][4], dpt[T::STREAM / 8][4];
    uint32_t pa[T::PARTS][T::STREAM / Ops::K][4], dsa[T::PARTS][T::STREAM / Ops::K][4];
    // 3xTF32: the tile's own dV and dK sums (issue_xb); unused otherwise.
    constexpr int kTileSums = T::PARTS == 2 ? T::D / 8 : 1;
    float dk_tile[kTileSums][4], dv_tile[kTileSums][4];
    zero(dk);
    zero(dv);
    // Every consumer thread arrives: its own loads of the stage's lse₂ and D are then ordered
    // before the producer's next copy into the stage (one arrival a warp leaves the other lanes'
    // loads unordered, and compute-sanitizer's racecheck reports them once a stage is reused).
    auto release = [&](int j) { bulk::arrive(&bars.empty[ring.slot(j)]); };
    int pending = -1;  // the tile whose dV, dK group may still run, its stage not yet released
    auto finish_pending = [&] {
        if (pending < 0) return;
        if constexpr (T::PARTS == 2) {
            wg::fence_operands(dv_tile);
            wg::fence_operands(dk_tile);
            flash::add_to(dv, dv_tile);
            flash::add_to(dk, dk_tile);
        } else {
            wg::fence_operands(dv);
            wg::fence_operands(dk);
        }
        release(pending);
        pending = -1;
    };
    if (ring.tile_begin < tile_end) bulk::wait(&bars.own, 0);
    for (int j = ring.tile_begin; j < tile_end; ++j) {
        const int s = ring.slot(j), q_lo = j * T::STREAM;
        bulk::wait(&bars.full[s], ring.parity(j));
        // Every key of the warpgroup after every query (causal), or hidden from every query (the rule).
        if ((kCausal && key_lo > q_lo + T::STREAM - 1) ||
            (kVariant && va.v.none_visible(q_lo, q_lo + T::STREAM, key_lo, key_lo + 64))) {
            wg::wait<0>();
            finish_pending();
            release(j);
            continue;
        }
        if constexpr (!T::OVERLAP_TILES) {
            wg::wait<0>();
            finish_pending();
        }
        wg::fence();
        issue_abt<T>(st, k_desc, wg::sw128_desc(q_tile(s), 16));  // Sᵀ = K_w·Q_jᵀ
        wg::commit();
        issue_abt<T>(dpt, v_desc, wg::sw128_desc(do_tile(s), 16));  // dPᵀ = V_w·dO_jᵀ
        wg::commit();
        wg::wait<1>();  // Sᵀ has landed, and with it the last tile's dV, dK group
        wg::fence_operands(st);
        finish_pending();
        const float* lse2 = lse2_of(s);
        const float* Dr = lse2 + T::STREAM;
        if constexpr (kVariant) {  // P into pa, P∘f into st
            const int wk0 = key_lo + 16 * warp;
            const float dist0 = static_cast<float>(q_lo + 2 * t + va.v.offset - key0);  // diag − key of (0, 0)
            variant_tile_weights<T, true>(
                st, pa, va, slope_log2, p.M, wk0 + 16 > p.M || !va.v.all_visible(q_lo, q_lo + T::STREAM, wk0, wk0 + 16),
                [&](int jj, int e, int& r, int& c) {
                    r = q_lo + 8 * jj + 2 * t + (e & 1);
                    c = key0 + 8 * (e >> 1);
                },
                [&](int jj, int e) { return dist0 + static_cast<float>(8 * jj + (e & 1) - 8 * (e >> 1)); },
                [&](int jj, int e) { return lse2[8 * jj + 2 * t + (e & 1)]; });
        } else {
            const bool cut = kCausal && key_lo + 16 * warp + 15 > q_lo;  // some key of the warp after some query
#pragma unroll
            for (int jj = 0; jj < T::STREAM / 8; ++jj)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int c = 8 * jj + 2 * t + (e & 1);  // the query within the tile
                    const float x = flash::exp2_ftz(__fmaf_rn(st[jj][e], p.scale_log2, -lse2[c]));
                    st[jj][e] = cut && key0 + 8 * (e >> 1) > q_lo + c ? 0.f : x;
                }
        }
        wg::wait<0>();
        wg::fence_operands(dpt);
#pragma unroll
        for (int jj = 0; jj < T::STREAM / 8; ++jj)
#pragma unroll
            for (int e = 0; e < 4; ++e) dpt[jj][e] = st[jj][e] * (dpt[jj][e] - Dr[8 * jj + 2 * t + (e & 1)]);
        if constexpr (!kVariant) Ops::template pack_a<T::STREAM>(pa, st);
        Ops::template pack_a<T::STREAM>(dsa, dpt);
        wg::fence();
        if constexpr (T::PARTS == 2) {
            issue_xb<T>(dv_tile, pa, do_b(s));  // dV_w += Pᵀ·dO_j, once the group completes
            issue_xb<T>(dk_tile, dsa, q_b(s));  // dK_w += dSᵀ·Q_j
        } else {
            issue_xb<T>(dv, pa, do_b(s));  // dV_w += Pᵀ·dO_j
            issue_xb<T>(dk, dsa, q_b(s));  // dK_w += dSᵀ·Q_j
        }
        wg::commit();
        pending = j;
    }
    wg::wait<0>();
    finish_pending();
    const size_t head_rows = static_cast<size_t>(head) * p.M;
    store_grad<T>(dk, p.dK + head_rows * T::D, key0, p.M, p.scale, t);
    store_grad<T>(dv, p.dV + head_rows * T::D, key0, p.M, 1.f, t);
#endif
}

// Kernel 2 (grid: x = query blocks, y = heads): dQ of the block's OWN query rows. kVariant: as
// kernel 1's.
template <class T, bool kCausal, bool kVariant>
__global__ void __launch_bounds__(T::THREADS, 1) dq_kernel(const BwdParams p, const __grid_constant__ BwdMaps maps,
                                                           const __grid_constant__ VariantArgs va) {
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
    __trap();
#else
    using E = typename T::Elem;
    using Ops = typename T::Ops;
    extern __shared__ float4 smem_f4[];
    E* const own = atom_aligned<E>(smem_f4);   // Q [PARTS][OWN×D], dO [PARTS][OWN×D]
    E* const tiles = own + 2 * T::PARTS * T::OWN_ELEMS;  // [STAGES]{K, V [STREAM×D], and Kᵀ [D×STREAM]}
    __shared__ Barriers<T> bars;
    // Causal blocks go longest first (the last query block sees the most keys; so does a
    // bottom-right one's under the rule).
    const int qblock = kCausal || kVariant ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int head = p.head0 + blockIdx.y, q0 = qblock * T::OWN;
    // The key tiles the block's rows can see: the variant's, those of [first_key, end_key).
    int tile_begin = 0, tile_end = flash::visible_key_tiles<kCausal>(p.M, p.N, q0, T::OWN, T::STREAM);
    if constexpr (kVariant) flash::variant_tile_share(va.v, p.M, p.N, q0, T::OWN, T::STREAM, 1, 0, tile_begin, tile_end);
    const StageRing ring{tile_begin, T::STAGES};
    auto k_tile = [&](int s) { return tiles + s * T::MATS_2 * T::STREAM_MAT; };
    auto v_tile = [&](int s) { return k_tile(s) + T::STREAM_MAT; };
    auto k_b = [&](int s) { return Ops::TRANSPOSED_COPIES ? k_tile(s) + 2 * T::STREAM_MAT : k_tile(s); };
    if (threadIdx.x == 0) bars.init();
    __syncthreads();

    if (threadIdx.x >= T::CONSUMERS) {
        wg::release_registers<T::PRODUCER_REGS>();
        if (threadIdx.x == T::CONSUMERS)
            produce<T>(bars, own, &maps.q, &maps.dO, q0, head, p.heads, ring, tile_end, T::TILE_TX_2,
                       [&](int j, int s, uint64_t* bar) {
#pragma unroll
                           for (int part = 0; part < T::PARTS; ++part) {
                               const int at = part * T::STREAM_ELEMS, h = part_head(head, part, p.heads);
                               load_rows<T, T::STREAM>(k_tile(s) + at, &maps.k, j * T::STREAM, h, bar);
                               load_rows<T, T::STREAM>(v_tile(s) + at, &maps.v, j * T::STREAM, h, bar);
                               if constexpr (Ops::TRANSPOSED_COPIES) load_cols<T>(k_b(s) + at, &maps.kT, j * T::STREAM, h, bar);
                           }
                       });
        return;
    }
    wg::claim_registers<T::CONSUMER_REGS>();

    const int wg = threadIdx.x / kWarpgroup, warp = (threadIdx.x % kWarpgroup) / 32;
    const int lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
    const int wg_row0 = q0 + 64 * wg, warp_row0 = wg_row0 + 16 * warp, row0 = warp_row0 + g;
    const float slope_log2 = kVariant ? va.v.slope(head) * flash::kLog2e : 0.f;
    const uint64_t q_desc = wg::sw128_desc(own + wg * 64 * T::ROW_VALUES, 16);
    const uint64_t do_desc = wg::sw128_desc(own + T::PARTS * T::OWN_ELEMS + wg * 64 * T::ROW_VALUES, 16);
    const size_t row_base = static_cast<size_t>(head) * p.n_pad;  // n_pad covers every block's rows
    const float lse2[2] = {p.lse2[row_base + row0], p.lse2[row_base + row0 + 8]};
    const float Dr[2] = {p.Drow[row_base + row0], p.Drow[row_base + row0 + 8]};
    float dq[T::D / 8][4], s[T::STREAM / 8][4], dp[T::STREAM / 8][4];
    uint32_t dsa[T::PARTS][T::STREAM / Ops::K][4];
    float dq_tile[T::PARTS == 2 ? T::D / 8 : 1][4];  // 3xTF32: the tile's own dQ sums
    zero(dq);
    auto release = [&](int j) { bulk::arrive(&bars.empty[ring.slot(j)]); };
    int pending = -1;  // the tile whose dQ group may still run, its stage not yet released
    auto finish_pending = [&] {
        if (pending < 0) return;
        if constexpr (T::PARTS == 2) {
            wg::fence_operands(dq_tile);
            flash::add_to(dq, dq_tile);
        } else {
            wg::fence_operands(dq);
        }
        release(pending);
        pending = -1;
    };
    if (ring.tile_begin < tile_end) bulk::wait(&bars.own, 0);
    for (int j = ring.tile_begin; j < tile_end; ++j) {
        const int st = ring.slot(j), key_lo = j * T::STREAM;
        bulk::wait(&bars.full[st], ring.parity(j));
        // Every key of the tile after every row of the warpgroup (causal), or hidden from all of them.
        if ((kCausal && key_lo > wg_row0 + 63) ||
            (kVariant && va.v.none_visible(wg_row0, wg_row0 + 64, key_lo, key_lo + T::STREAM))) {
            wg::wait<0>();
            finish_pending();
            release(j);
            continue;
        }
        if constexpr (T::PARTS == 2) {  // the last tile's own dQ sums, read with no wgmma in flight
            wg::wait<0>();
            finish_pending();
        }
        wg::fence();
        issue_abt<T>(s, q_desc, wg::sw128_desc(k_tile(st), 16));  // S = Q_w·K_jᵀ
        wg::commit();
        issue_abt<T>(dp, do_desc, wg::sw128_desc(v_tile(st), 16));  // dP = dO_w·V_jᵀ
        wg::commit();
        wg::wait<1>();
        wg::fence_operands(s);
        // (3xTF32 read the last tile's own dQ sums above: read while any wgmma is in flight, ptxas
        // serializes every wgmma of the kernel.)
        if constexpr (T::PARTS == 1) finish_pending();
        // Keys past M (zeros) and, causal, keys after the row get P = 0; the variant's P∘f.
        if constexpr (kVariant) {
            uint32_t unused[1][T::STREAM / 16][4];
            const float dist0 = static_cast<float>(row0 + va.v.offset - key_lo - 2 * t);  // diag − key of (0, 0)
            variant_tile_weights<T, false>(
                s, unused, va, slope_log2, p.M,
                key_lo + T::STREAM > p.M || !va.v.all_visible(warp_row0, warp_row0 + 16, key_lo, key_lo + T::STREAM),
                [&](int jj, int e, int& r, int& c) {
                    r = row0 + 8 * (e >> 1);
                    c = key_lo + 8 * jj + 2 * t + (e & 1);
                },
                [&](int jj, int e) { return dist0 + static_cast<float>(8 * (e >> 1) - 8 * jj - (e & 1)); },
                [&](int, int e) { return lse2[e >> 1]; });
        } else {
            const bool cut = key_lo + T::STREAM > p.M || (kCausal && key_lo + T::STREAM - 1 > warp_row0);
#pragma unroll
            for (int jj = 0; jj < T::STREAM / 8; ++jj)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = key_lo + 8 * jj + 2 * t + (e & 1), row = row0 + 8 * (e >> 1);
                    const float x = flash::exp2_ftz(__fmaf_rn(s[jj][e], p.scale_log2, -lse2[e >> 1]));
                    s[jj][e] = cut && (key >= p.M || (kCausal && key > row)) ? 0.f : x;
                }
        }
        wg::wait<0>();
        wg::fence_operands(dp);
#pragma unroll
        for (int jj = 0; jj < T::STREAM / 8; ++jj)
#pragma unroll
            for (int e = 0; e < 4; ++e) dp[jj][e] = s[jj][e] * (dp[jj][e] - Dr[e >> 1]);
        Ops::template pack_a<T::STREAM>(dsa, dp);
        wg::fence();
        if constexpr (T::PARTS == 2) issue_xb<T>(dq_tile, dsa, k_b(st));  // dQ_w += dS·K_j, once it completes
        else issue_xb<T>(dq, dsa, k_b(st));  // dQ_w += dS·K_j
        wg::commit();
        pending = j;
    }
    wg::wait<0>();
    finish_pending();
    store_grad<T>(dq, p.dQ + static_cast<size_t>(head) * p.N * T::D, row0, p.N, p.scale, t);
#endif
}

// The preparation pass's row vectors, one warp per padded row: D = rowsum(dO∘O) of dO as the GEMMs
// read it (Fmt::round: rounded to a half format; the TF32 family, as flash_bwd.cu, sums the FP32
// dO), by FP32 FMAs strided per lane, then a butterfly; and lse·log2 e (a row that saw no key,
// lse = −inf, gets +inf: P = 0). A half format also writes dO rounded to it (dO_half, the GEMMs'
// operand) in the same pass, which reads dO once for both.
template <class Fmt>
__global__ void __launch_bounds__(256) rows_kernel(const float* __restrict__ dO, const float* __restrict__ O,
                                                   const float* __restrict__ lse, float* __restrict__ lse2,
                                                   float* __restrict__ Drow, uint16_t* __restrict__ dO_half,
                                                   long long rows, int N, int n_pad, int d) {
    constexpr bool kHalf = Fmt::precision != Precision::fp32;
    const int lane = threadIdx.x % 32;
    const long long warps = static_cast<long long>(gridDim.x) * (blockDim.x / 32);
    for (long long r = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; r < rows; r += warps) {
        const long long h = r / n_pad;
        const int i = static_cast<int>(r % n_pad);
        if (i >= N) {
            if (lane == 0) lse2[r] = INFINITY, Drow[r] = 0.f;
            continue;
        }
        const size_t at = (static_cast<size_t>(h) * N + i) * d;
        float sum = 0.f;
        for (int c = lane; c < d; c += 32) {
            const float x = dO[at + c];
            sum = fmaf(Fmt::round(x), O[at + c], sum);
            if constexpr (kHalf) dO_half[at + c] = static_cast<uint16_t>(Fmt::pack(x, 0.f));  // the low half
        }
        sum = warp_sum(sum);
        if (lane == 0) {
            const float l = lse[static_cast<size_t>(h) * N + i];
            lse2[r] = l == -INFINITY ? INFINITY : l * flash::kLog2e;
            Drow[r] = sum;
        }
    }
}

// Both kernels over a's heads (a grid holds at most kMaxGridYZ), their shared-memory limits raised
// first; lse2 and Drow as the preparation pass wrote them, n_pad floats a head. kVariant: a's
// variant, whose per-head inputs the kernels index by the head of the whole call (head0 + y).
template <class T, bool kCausal, bool kVariant = false>
void launch_kernels(const FlashBwdArgs& a, const BwdMaps& by_keys, const BwdMaps& by_rows, const float* lse2,
                    const float* Drow, int n_pad, cudaStream_t stream) {
    kernel_blocks_per_sm<T, dkdv_kernel<T, kCausal, kVariant>>();
    kernel_blocks_per_sm<T, dq_kernel<T, kCausal, kVariant>>();
    const VariantArgs va = kVariant ? variant_args(a.scale, a.variant) : VariantArgs{};
    for (int head0 = 0; head0 < a.heads; head0 += kMaxGridYZ) {
        const int heads = std::min(kMaxGridYZ, a.heads - head0);
        const BwdParams p{lse2, Drow, a.dQ, a.dK, a.dV, head0, a.heads, a.N, a.M, n_pad, a.scale * flash::kLog2e, a.scale};
        dkdv_kernel<T, kCausal, kVariant>
            <<<dim3(ceil_div(a.M, T::OWN), heads), T::THREADS, T::SMEM_BYTES, stream>>>(p, by_keys, va);
        LAUNCH_CHECK(dkdv_kernel);
        dq_kernel<T, kCausal, kVariant>
            <<<dim3(ceil_div(a.N, T::OWN), heads), T::THREADS, T::SMEM_BYTES, stream>>>(p, by_rows, va);
        LAUNCH_CHECK(dq_kernel);
    }
}

}  // namespace wgbwd
}  // namespace attnstep
