// flash_common.cuh — device pieces the tensor-core FlashAttention kernels share (flash_fast.cu and
// flash_bwd.cu on mma.sync, sm90a/flash_wgmma.cu on wgmma): TF32 splitting, the mma.sync MMA,
// cp.async, and the online softmax on accumulator fragments. The kernels hold a 16-row slice of S
// per warp in the mma.sync/wgmma accumulator layout: s[j][e] is row g + 8·(e/2), column
// 8j + 2t + e%2 (lane = 4g + t).
#pragma once

#include <cmath>
#include <cstdint>

#include "device_variant.cuh"
#include "half_format.cuh"
#include "warp.cuh"

namespace attnstep {
namespace flash {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// cp.async and TF32 mma.sync need sm_80; the build may also target older GPUs, where these compile
// to nothing and the kernels that use them are never launched (their dispatchers check the
// compute capability).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define ATTNSTEP_NO_CP_ASYNC 1
#endif

// Rounding to TF32 (10 explicit mantissa bits), nearest with ties away from zero, as
// cvt.rna.tf32.f32 does for finite x, with two integer instructions instead of one conversion
// (conversions issue at 16/clk/SM).
__device__ __forceinline__ uint32_t round_tf32(float x) {
    return (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
}

// The same rounding on the FP32 pipe (Veltkamp split with 2^13 + 1), so that the two halves of
// split() run on different pipes. x·8193 must not overflow: |x| < 2^114. Used only for the lo
// parts, which are at most 2^-11 of the input, so inputs up to 2^125 in magnitude are fine.
__device__ __forceinline__ uint32_t round_tf32_fp(float x) {
    const float c = __fmul_rn(x, 8193.f);
    return __float_as_uint(__fsub_rn(c, __fsub_rn(c, x)));
}

// x = hi + lo with both parts representable in TF32 (lo only in 3xTF32 mode).
template <bool kThree>
__device__ __forceinline__ void split(float x, uint32_t& hi, uint32_t& lo) {
    hi = round_tf32(x);
    if (kThree) lo = round_tf32_fp(__fsub_rn(x, __uint_as_float(hi)));
}

// The four floats of v split alike (a 16-byte load of an operand).
template <bool kThree>
__device__ __forceinline__ void split4(const float4& v, uint32_t (&hi)[4], uint32_t (&lo)[4]) {
    split<kThree>(v.x, hi[0], lo[0]);
    split<kThree>(v.y, hi[1], lo[1]);
    split<kThree>(v.z, hi[2], lo[2]);
    split<kThree>(v.w, hi[3], lo[3]);
}

// An mma.sync m16n8k8 B fragment {b0, b1} (k 2t and 2t+1 of column g, k-permuted), split.
template <bool kThree>
__device__ __forceinline__ void split_b(float b0, float b1, uint32_t (&hi)[2], uint32_t (&lo)[2]) {
    split<kThree>(b0, hi[0], lo[0]);
    split<kThree>(b1, hi[1], lo[1]);
}

// An mma.sync m16n8k8 A fragment from the k pair (2t, 2t+1) of row g (x) and of row g + 8 (y):
// {x.x, y.x, x.y, y.y} under the k permutation (kperm below), split.
template <bool kThree>
__device__ __forceinline__ void split_a(float2 x, float2 y, uint32_t (&hi)[4], uint32_t (&lo)[4]) {
    split<kThree>(x.x, hi[0], lo[0]);
    split<kThree>(y.x, hi[1], lo[1]);
    split<kThree>(x.y, hi[2], lo[2]);
    split<kThree>(y.y, hi[3], lo[3]);
}

// An accumulator fragment c (c0, c1: row g, columns 2t, 2t+1; c2, c3: row g + 8) as the A operand
// of the next MMA, its 8 columns becoming that MMA's k: the k pair (2t, 2t+1) of both rows, so
// {c0, c2, c1, c3}, split. This is how P (and dS) go from one MMA to the next with no shuffle.
template <bool kThree>
__device__ __forceinline__ void split_acc_a(const float (&c)[4], uint32_t (&hi)[4], uint32_t (&lo)[4]) {
    split<kThree>(c[0], hi[0], lo[0]);
    split<kThree>(c[2], hi[1], lo[1]);
    split<kThree>(c[1], hi[2], lo[2]);
    split<kThree>(c[3], hi[3], lo[3]);
}

// Fragment accumulators: all zero; out += acc.
template <int R>
__device__ __forceinline__ void zero(float (&x)[R][4]) {
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) x[i][e] = 0.f;
}
template <int R>
__device__ __forceinline__ void add_to(float (&out)[R][4], const float (&acc)[R][4]) {
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) out[i][e] += acc[i][e];
}

// The key tiles of BC keys a block of BR query rows from q0 visits: all ⌈M/BC⌉, or (causal) those
// up to its last row.
template <bool kCausal>
__device__ __forceinline__ int visible_key_tiles(int M, int N, int q0, int BR, int BC) {
    const int n_tiles = ceil_div(M, BC);
    return kCausal ? min(n_tiles, ceil_div(min(q0 + BR, N), BC)) : n_tiles;
}

// Split split_id's share [begin, end) of n_tiles key tiles cut into `splits` parts (empty for a
// split past the tiles).
__device__ __forceinline__ void split_share(int n_tiles, int splits, int split_id, int& begin, int& end) {
    const int per_split = ceil_div(n_tiles, splits);
    begin = min(n_tiles, split_id * per_split);
    end = min(n_tiles, begin + per_split);
}

// The variant's key tiles (flash_problem.cuh): those of [first_key(q0), end_key(last row)) for a
// block of BR query rows from q0, every row's visible keys (the rule's ranges move right with the
// row, so tiles on both sides of them are skipped), and split_id's share of them.
__device__ __forceinline__ void variant_tile_share(const DeviceVariant& v, int M, int N, int q0, int BR, int BC,
                                                   int splits, int split_id, int& begin, int& end) {
    const int first = v.first_key(q0) / BC;
    const int last = ceil_div(v.end_key(min(q0 + BR, N) - 1, M), BC);
    split_share(max(0, last - first), splits, split_id, begin, end);
    begin += first;
    end += first;
}

// The query tiles of BT rows that a block of BB keys from k0 is seen by: [begin, end). All ⌈N/BT⌉,
// or (top-left causal) from the one holding row k0 on, or the variant's, those of the rows
// [first_row(k0), end_row(the block's end)): the backward's dK/dV side of variant_tile_share.
template <bool kCausal, bool kVariant>
__device__ __forceinline__ void visible_query_tiles(const DeviceVariant& v, int M, int N, int k0, int BB, int BT,
                                                    int& begin, int& end) {
    end = kVariant ? ceil_div(v.end_row(min(k0 + BB, M), N), BT) : ceil_div(N, BT);
    begin = kVariant ? min(end, v.first_row(k0) / BT) : kCausal ? min(end, k0 / BT) : 0;
}

// C(16×8) += A(16×8, row) · B(8×8, col), TF32 inputs, FP32 accumulators (mma.sync, sm_80+).
__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#ifndef ATTNSTEP_NO_CP_ASYNC
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// c += a·b in the chosen precision (3xTF32 or TF32); the small cross terms go first so they are
// not lost.
template <bool kThree>
__device__ __forceinline__ void mma_split(float (&c)[4], const uint32_t (&ahi)[4], const uint32_t (&alo)[4],
                                          const uint32_t (&bhi)[2], const uint32_t (&blo)[2]) {
    if (kThree) {
        mma_tf32(c, alo, bhi);
        mma_tf32(c, ahi, blo);
    }
    mma_tf32(c, ahi, bhi);
}

// 16-byte global → shared copy; reads nothing and writes zeros when !valid (tails).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid = true) {
#ifndef ATTNSTEP_NO_CP_ASYNC
    const unsigned saddr = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    const int bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(saddr), "l"(src), "r"(bytes));
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#ifndef ATTNSTEP_NO_CP_ASYNC
    asm volatile("cp.async.commit_group;\n");
#endif
}
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
#ifndef ATTNSTEP_NO_CP_ASYNC
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
#endif
}

// 2^x on the special-function unit as it stands (ex2.approx.ftz: ~2 ulp, the accuracy exp2f has;
// exp2f adds a test and two multiplies per call only to keep results below 2^-126 subnormal,
// which a softmax weight that small cannot affect). 2^-inf = 0.
__device__ __forceinline__ float exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// x = S·scale·log2e: the softmax runs in base 2. Before masking, so that a negative scale cannot
// turn a masked -inf into +inf.
template <int BC>
__device__ __forceinline__ void scale_tile(float (&s)[BC / 8][4], float scale_log2) {
#pragma unroll
    for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] *= scale_log2;
}

// Keys past M, and (causal) keys after the query, get -inf. row0: the thread's row g (g+8 is the
// other); key0: the tile's first key.
template <int BC, bool kCausal>
__device__ __forceinline__ void mask_tile(float (&s)[BC / 8][4], int key0, int M, int row0, int t) {
#pragma unroll
    for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int key = key0 + nt * 8 + 2 * t + (e & 1);
            const int row = row0 + (e >= 2 ? 8 : 0);
            if (key >= M || (kCausal && key > row)) s[nt][e] = -INFINITY;
        }
}

// Online softmax for one tile of x (scaled, masked), in base 2: m_new = max(m, rowmax x),
// P = 2^(x − m_new) in place of x, l = l·2^(m − m_new) + rowsum P; alpha = 2^(m − m_new), the
// factor the running O must take (rescale_rows). l is kept per thread (a quarter of each row) and
// summed across the quad at the end; m is reduced across the quad here, so every thread rescales
// by the same factor. All 32 lanes of the warp call it together (quad shuffles).
//
// kScaleInExp: the tile holds the scores not yet scaled (masked with -inf) and c = scale·log2e is
// positive. The row max is taken of the raw scores (c > 0 keeps their order) and scaled once, so m
// is the same, and each weight is 2^(c·s − m) with the product and the subtraction in one FFMA:
// one rounding instead of two, one instruction instead of a multiply and a subtraction. A row
// whose scaled max overflows float32 (|S|·c past 3.4e38, bf16 inputs of that size) gets weights 0
// here, so O = 0 and lse = -inf, where the two-step path gives NaN: wrong either way, and either
// fails a check against float64.
template <int BC, bool kScaleInExp = false>
__device__ __forceinline__ void softmax_tile(float (&s)[BC / 8][4], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                             float c = 1.f) {
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]);
    float base[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float tile_max = quad_max(mx[r]);
        const float m_new = fmaxf(m[r], kScaleInExp ? tile_max * c : tile_max);
        // A row with no visible key yet keeps m = -inf; subtract 0 then, so 2^(-inf - base) = 0
        // instead of NaN.
        base[r] = m_new == -INFINITY ? 0.f : m_new;
        alpha[r] = exp2_ftz(m[r] - base[r]);
        m[r] = m_new;
        l[r] *= alpha[r];
    }
#pragma unroll
    for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float x = s[nt][e];
            s[nt][e] = exp2_ftz(kScaleInExp ? __fmaf_rn(x, c, -base[e >> 1]) : x - base[e >> 1]);
            l[e >> 1] += s[nt][e];
        }
}

// O·alpha per row (softmax_tile's factor). Once the running maxima settle, most tiles leave them
// unchanged (alpha = 1 exactly): the warp skips the multiplies then (D/2 per thread and tile).
// All 32 lanes of the warp call it together (a warp vote).
template <int D>
__device__ __forceinline__ void rescale_rows(float (&o)[D / 8][4], const float (&alpha)[2]) {
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[nt][e] *= alpha[e >> 1];
    }
}

// softmax_tile, then O rescaled: one tile of the online softmax for a kernel whose O is not being
// written by the tensor cores meanwhile.
template <int BC, int D>
__device__ __forceinline__ void online_softmax(float (&s)[BC / 8][4], float (&o)[D / 8][4],
                                               float (&m)[2], float (&l)[2]) {
    float alpha[2];
    softmax_tile<BC>(s, m, l, alpha);
    rescale_rows<D>(o, alpha);
}

// The k permutation that lets P go from the S accumulators straight into the P·V MMA: within each
// 8-key block, operand position p holds key kperm(p): 0,2,4,6,1,3,5,7 (A fragment column t is
// accumulator column 2t, column t+4 is 2t+1).
__host__ __device__ constexpr int kperm(int p) { return p < 4 ? 2 * p : 2 * (p - 4) + 1; }

// Writes the thread's two rows of O / l and their lse = (m + log2 l)·ln 2. A split that saw no key
// (l = 0) writes O = 0, lse = -inf, which the combine step weighs as 0. A row whose scores hold a
// NaN (NaN in Q or K under --allow-nonfinite) has l = NaN, and O and lse come out NaN: the running
// max (fmaxf) skips NaN and the TF32 rounding of P may turn 2^NaN into ±0 before P·V, so the FP32
// row sum is where the NaN survives; testing it here keeps the per-tile path free of NaN checks.
// O: the head's [N][D] output, each value stored as Fmt rounds it (half_format.cuh: float32 as is,
// or the half format the output of a half precision holds).
template <int D, class Fmt = Fp32>
__device__ __forceinline__ void store_rows(const float (&o)[D / 8][4], const float (&m)[2],
                                           const float (&l)[2], float* O, float* lse, int row0,
                                           int N, int t) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row0 + 8 * r;
        const float lsum = quad_sum(l[r]);
        if (row >= N) continue;
        const float inv = lsum == 0.f ? 0.f : 1.f / lsum;  // NaN stays NaN
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
            *reinterpret_cast<float2*>(O + static_cast<size_t>(row) * D + nt * 8 + 2 * t) =
                make_float2(Fmt::round(o[nt][2 * r] * inv), Fmt::round(o[nt][2 * r + 1] * inv));
        }
        if (t == 0) lse[row] = lsum == 0.f ? -INFINITY : (m[r] + log2f(lsum)) * kLn2;
    }
}

}  // namespace flash
}  // namespace attnstep
