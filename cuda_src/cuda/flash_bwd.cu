// flash_bwd.cu — FlashAttention-2 backward on tensor cores (mma.sync m16n8k8 TF32, sm_80+), in the
// deterministic two-kernel form: no N×M buffer, no floating-point atomics, so two runs give
// bit-identical gradients.
//
//   1. D = rowsum(dO∘O), one value per query row (launch_row_dot, kernels.cuh).
//   2. dkdv kernel: a block owns BB = 16·NW keys (K and V rows in shared memory, 16 per warp) and
//      walks the query tiles of BT rows that can see them (causal: from the tile holding its first
//      key on). Per tile each warp computes, transposed (its keys are the MMA rows),
//        Sᵀ = K_w·Q_iᵀ,  Pᵀ = 2^(Sᵀ·scale·log2 e − lse·log2 e),  dPᵀ = V_w·dO_iᵀ,
//        dSᵀ = Pᵀ∘(dPᵀ − D),  dV_w += Pᵀ·dO_i,  dK_w += dSᵀ·Q_i,
//      with Pᵀ and dSᵀ taken straight from the accumulators as the next MMA's A operand (the k
//      permutation of flash_common.cuh). dK is scaled once at the end.
//   3. dq kernel: a block owns BB query rows (Q and dO in shared memory) and walks the key tiles
//      (causal: up to its last row), recomputing S, P, dP, dS the same way and adding dS·K_j.
//   Q_i/dO_i (kernel 2) and K_j/V_j (kernel 3) stream through shared memory with cp.async, double
//   buffered. Tails (N, M not multiples of the tiles) are zero-filled and masked: a query row past
//   N gets lse = +inf (P = 0), a key past M is masked explicitly.
//   The variant instantiation (flash_problem.cuh) visits only the query tiles (kernel 2) and key
//   tiles (kernel 3) of the rule's range and rebuilds each score as the forward read it (softcap,
//   ALiBi, the bias file, the mask file and the rule; variant_softmax_grad): dV reads P∘Z/(1 − p)
//   (Z dropout's keep decision, drawn again), dQ and dK read P∘(dP∘Z/(1 − p) − D)·(1 − t²) (the
//   softcap's derivative); a row the forward saw no key for (lse -inf) gives P = 0.
//
// On Hopper, TF32 at d 64 and 128 (no variant) goes to the wgmma kernels of
// sm90a/flash_bwd_wgmma_tf32.cu, bf16 and fp16 to sm90a/flash_bwd_wgmma_half.cu (every variant but
// mask or bias files and dropout). Those keep dK, dV
// and dQ in the tensor cores' accumulators across every tile, so the truncation spans the whole sum
// (which the verifier's model bounds: the running sums over every 8-long chunk), not one tile as
// here; their products and roundings are otherwise these.
//
// Arithmetic the verifier assumes (verify/model/kernels.py: the CUDA model of the forward's
// cuda-* flash_kernel): Precision::fp32 3xTF32 (every operand split hi + lo; FP32-accurate
// products, as the forward), Precision::tf32 one TF32 product. Each tile's products are summed in a
// fresh accumulator and added to the running gradient in FP32, so the tensor cores' truncating
// accumulation spans one tile only. P = 2^(s·scale·log2 e − lse·log2 e) by ex2.approx.ftz (the GPU
// exp model), scale·log2 e and lse·log2 e each rounded once; dK and dQ scaled once at the end.
#include "flash_bwd.cuh"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "../common.h"
#include "cuda_check.cuh"
#include "device.cuh"
#include "flash_common.cuh"
#include "flash_scores.cuh"
#include "flash_dispatch.cuh"
#include "kernels.cuh"
#ifdef ATTNSTEP_HAVE_WGMMA
#include "sm90a/flash_bwd_wgmma_half.cuh"
#include "sm90a/flash_bwd_wgmma_tf32.cuh"
#endif

namespace attnstep {
namespace {

using namespace flash;  // flash_common.cuh: TF32 split, the MMA, cp.async, exp2

// The tiles: NW warps own BB = 16·NW rows (keys in the dkdv kernel, query rows in the dq kernel);
// the other side streams in tiles of BT rows. Rows are padded by 8 floats so the 8-byte fragment
// loads of a half-warp cover all 32 banks, and stay 16-byte aligned for cp.async.
template <int D_, int NW_, int BT_, int MINB_>
struct BwdTiles {
    static constexpr int D = D_, NW = NW_, BT = BT_, MIN_BLOCKS = MINB_;
    static constexpr int BB = 16 * NW, THREADS = NW * kWarp;
    static constexpr int LD = D + 8;
    static constexpr int OWN = BB * LD;    // floats of one owned matrix
    static constexpr int STAGE = BT * LD;  // floats of one streamed matrix, one buffer
    // Two owned matrices, two streamed ones double buffered, and two per-row vectors (lse, D) of
    // the streamed query tiles, double buffered.
    static constexpr size_t SMEM_BYTES = (2 * OWN + 4 * STAGE + 4 * BT) * sizeof(float);
    static_assert(D % 8 == 0 && BT % 8 == 0, "tiles are made of 8×8 MMA pieces");
    // Columns of a gradient summed per fresh accumulator (registers).
    static constexpr int DC = D < 64 ? D : 64;
};

// Per width: two blocks per SM at every width; d128 streams tiles of 16 rows, which keeps two
// blocks' shared memory within an SM's. Registers and shared memory: docs/journal.md
// ("flash_fast and flash_bwd resources").
template <int D>
struct BwdConfig;
template <> struct BwdConfig<16> { using type = BwdTiles<16, 4, 64, 2>; };
template <> struct BwdConfig<32> { using type = BwdTiles<32, 4, 64, 2>; };
template <> struct BwdConfig<64> { using type = BwdTiles<64, 4, 64, 2>; };
template <> struct BwdConfig<128> { using type = BwdTiles<128, 4, 16, 2>; };

struct BwdParams {
    const float* Q;
    const float* K;
    const float* V;
    const float* lse;  // natural log, [heads][N]
    const float* D;    // rowsum(dO∘O), [heads][N]
    const float* dO;
    float* dQ;
    float* dK;
    float* dV;
    int head0, N, M;  // head0: the first head of this launch (grids hold at most kMaxGridYZ)
    float scale, scale_log2;
};

// Rows [row0, row0 + ROWS) of a [rows][D] matrix into a padded shared tile; rows past `rows` are
// zeros.
template <class T, int ROWS>
__device__ __forceinline__ void load_rows(float* tile, const float* src, int row0, int rows) {
    constexpr int kChunksPerRow = T::D / 4;
#pragma unroll
    for (int c = threadIdx.x; c < ROWS * kChunksPerRow; c += T::THREADS) {
        const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * 4;
        const bool valid = row0 + r < rows;
        cp_async_16(tile + r * T::LD + col, src + static_cast<size_t>(valid ? row0 + r : 0) * T::D + col, valid);
    }
}

// acc(16×BN) = A(16×D)·B(BN×D)ᵀ: A the warp's 16 rows, B a tile, both in shared memory (row
// stride T::LD). The reduction index is k-permuted in both operands alike (flash_common.cuh).
// Under 3xTF32 the two small cross terms go to an accumulator of their own, added at the end: the
// tensor cores truncate each addition to the running sum, and that error is biased (toward zero),
// so the main sum takes one truncation per 8-long chunk instead of three. dP's bias does not cancel
// in dP − D (D comes from O), and dQ = scale·dS·K amplifies it.
template <class T, int BN, bool kThree>
__device__ __forceinline__ void gemm_abt(float (&acc)[BN / 8][4], const float* A, const float* B, int g, int t) {
    float small[kThree ? BN / 8 : 1][4];
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] = small[kThree ? nt : 0][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < T::D / 8; ++ks) {
        uint32_t ahi[4], alo[4];
        split_a<kThree>(*reinterpret_cast<const float2*>(A + g * T::LD + ks * 8 + 2 * t),
                        *reinterpret_cast<const float2*>(A + (g + 8) * T::LD + ks * 8 + 2 * t), ahi, alo);
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
            const float2 b = *reinterpret_cast<const float2*>(B + (nt * 8 + g) * T::LD + ks * 8 + 2 * t);
            uint32_t bhi[2], blo[2];
            split_b<kThree>(b.x, b.y, bhi, blo);
            if constexpr (kThree) {
                mma_tf32(small[nt], alo, bhi);
                mma_tf32(small[nt], ahi, blo);
            }
            mma_tf32(acc[nt], ahi, bhi);
        }
    }
    if constexpr (kThree) add_to(acc, small);
}

// out(16×D) += W(16×BK)·B(BK×D), W in the accumulator layout (Pᵀ, dSᵀ or dS), B a tile in shared
// memory. W's fragment for rows 8kk..8kk+7 of B is w[kk] (split_acc_a); b0 = B[8kk+2t][col],
// b1 = B[8kk+2t+1][col]. Summed per tile in a fresh accumulator of DC columns, then added in FP32.
template <class T, int BK, bool kThree>
__device__ __forceinline__ void add_product(float (&out)[T::D / 8][4], const float (&w)[BK / 8][4], const float* B,
                                            int g, int t) {
#pragma unroll
    for (int c0 = 0; c0 < T::D; c0 += T::DC) {
        float acc[T::DC / 8][4];
        zero(acc);
#pragma unroll
        for (int kk = 0; kk < BK / 8; ++kk) {
            uint32_t ahi[4], alo[4];
            split_acc_a<kThree>(w[kk], ahi, alo);
            const float* b0 = B + (kk * 8 + 2 * t) * T::LD + c0 + g;
#pragma unroll
            for (int nt = 0; nt < T::DC / 8; ++nt) {
                uint32_t bhi[2], blo[2];
                split_b<kThree>(b0[nt * 8], b0[nt * 8 + T::LD], bhi, blo);
                mma_split<kThree>(acc[nt], ahi, alo, bhi, blo);
            }
        }
#pragma unroll
        for (int nt = 0; nt < T::DC / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) out[c0 / 8 + nt][e] += acc[nt][e];
    }
}

// Writes the thread's part of a warp's 16 gradient rows (row0 = the warp's first + g), times
// `factor`; rows at or past `rows` are not written.
template <class T>
__device__ __forceinline__ void store_grad(const float (&x)[T::D / 8][4], float* dst, int row0, int rows,
                                           float factor, int t) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int row = row0 + 8 * half;
        if (row >= rows) continue;
#pragma unroll
        for (int nt = 0; nt < T::D / 8; ++nt)
            *reinterpret_cast<float2*>(dst + static_cast<size_t>(row) * T::D + nt * 8 + 2 * t) =
                make_float2(x[nt][2 * half] * factor, x[nt][2 * half + 1] * factor);
    }
}

// P and dS of a tile from its scores s and dP, in place: s becomes P = 2^(s·scale·log2 e − lse₂)
// and dp becomes dS = P∘(dP − D), both exactly 0 where `masked(e, nt)` holds. lse₂ and D come from
// `row_lse2(nt, e)` / `row_d(nt, e)`.
template <int BN, class Masked, class Lse2, class RowD>
__device__ __forceinline__ void softmax_grad(float (&s)[BN / 8][4], float (&dp)[BN / 8][4], float scale_log2,
                                             Masked masked, Lse2 row_lse2, RowD row_d) {
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            if (masked(nt, e)) {
                s[nt][e] = dp[nt][e] = 0.f;
                continue;
            }
            const float p = exp2_ftz(s[nt][e] * scale_log2 - row_lse2(nt, e));
            s[nt][e] = p;
            dp[nt][e] = p * (dp[nt][e] - row_d(nt, e));
        }
}

// softmax_grad for the variant instantiation (flash_problem.cuh): element (nt, e) is score
// (row, key) = at(nt, e) of head h, its raw q·k in s and its dP in dp. The score the softmax read is
// rebuilt in base 2 (ScoreMods, then the bias file), P = 2^(x − lse₂), and, as the CPU backend's
// recompute: s becomes the weights dV reads, P∘Z·(1/(1 − p)), and dp the gradient dQ and dK read,
// P∘(dP∘Z·(1/(1 − p)) − D)·(1 − t²) (Z dropout's keep decision; 1 − t² the softcap's derivative).
// Both are exactly 0 where the score is hidden (the rule, the mask file, -inf in the bias file), past
// N or M, and in a row that saw no key (lse₂ = +inf there: row_lse2).
//
// Without the files and dropout (the rule, the softcap and ALiBi alone) the tile takes a lean path,
// one loop per softcap or none, every test per score a compare without a branch: the general one
// tests each input per score, and ptxas keeps those tests as branches.
template <bool kCap, int BN, class At, class Lse2, class RowD>
__device__ __forceinline__ void lean_softmax_grad(float (&s)[BN / 8][4], float (&dp)[BN / 8][4], const VariantArgs& va,
                                                  float slope_log2, int N, int M, At at, Lse2 row_lse2, RowD row_d) {
    const DeviceVariant& v = va.v;
    const ScoreMods& mods = va.mods;
    // The rule's bounds, an unbounded side as one that no key reaches (diag is within ±2^25: every
    // dimension is at most kMaxDim = 2^24, and the host keeps bounds within N + M).
    constexpr int kFar = 1 << 29;
    const int left = v.left == kUnbounded ? kFar : v.left, right = v.right == kUnbounded ? kFar : v.right;
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            int r, c;
            at(nt, e, r, c);
            const int diag = r + v.offset;
            const bool hidden = (r >= N) | (c >= M) | (c < diag - left) | (c > diag + right);
            float x, derivative = 1.f;
            if constexpr (kCap) {
                const float t = tanhf(s[nt][e] * mods.cap_in);
                x = t * mods.cap_out;
                derivative = 1.f - t * t;
            } else {
                x = s[nt][e] * mods.scale_log2;
            }
            const int dist = diag - c;
            x = __fmaf_rn(-slope_log2, static_cast<float>(dist < 0 ? -dist : dist), x);  // 0 without ALiBi
            const float p = hidden ? 0.f : exp2_ftz(x - row_lse2(nt, e));
            s[nt][e] = p;
            dp[nt][e] = hidden ? 0.f : p * (dp[nt][e] - row_d(nt, e)) * derivative;
        }
}

template <int BN, class At, class Lse2, class RowD>
__device__ __forceinline__ void variant_softmax_grad(float (&s)[BN / 8][4], float (&dp)[BN / 8][4],
                                                     const VariantArgs& va, float slope_log2, int h, int N, int M,
                                                     At at, Lse2 row_lse2, RowD row_d) {
    const DeviceVariant& v = va.v;
    const ScoreMods& mods = va.mods;
    if (!v.per_element_inputs()) {
        if (mods.cap_in != 0.f) lean_softmax_grad<true, BN>(s, dp, va, slope_log2, N, M, at, row_lse2, row_d);
        else lean_softmax_grad<false, BN>(s, dp, va, slope_log2, N, M, at, row_lse2, row_d);
        return;
    }
    const float inv_keep = v.inv_keep();
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            int r, c;
            at(nt, e, r, c);
            if (r >= N || c >= M || v.hidden(h, r, c, M)) {
                s[nt][e] = dp[nt][e] = 0.f;
                continue;
            }
            float x, derivative = 1.f;
            if (mods.cap_in != 0.f) {
                const float t = tanhf(s[nt][e] * mods.cap_in);
                x = t * mods.cap_out;
                derivative = 1.f - t * t;
            } else {
                x = s[nt][e] * mods.scale_log2;
            }
            if (slope_log2 != 0.f) {
                const int dist = r + v.offset - c;
                x = __fmaf_rn(-slope_log2, static_cast<float>(dist < 0 ? -dist : dist), x);
            }
            if (v.bias) x = __fmaf_rn(v.file_bias(h, r, c, M), kLog2e, x);
            const float p = exp2_ftz(x - row_lse2(nt, e));
            const float z = v.dropout > 0.f ? (v.keep(h, r, c, M) ? inv_keep : 0.f) : 1.f;
            s[nt][e] = p * z;
            dp[nt][e] = p * (dp[nt][e] * z - row_d(nt, e)) * derivative;
        }
}

// A row's lse·log2 e in the variant instantiation: +inf for a row past N (!valid) as in the plain
// ones, and also for a row that saw no key (lse -inf), so that P = 2^(x − inf) = 0 there
// (flash-attn stores +inf for such a row).
__device__ __forceinline__ float variant_lse2(bool valid, const float* lse) {
    if (!valid) return INFINITY;
    const float x = *lse;
    return x == -INFINITY ? INFINITY : x * kLog2e;
}

// ---------------------------------------------------------------------------------------------
// Kernels 2 and 3 are one function each on purpose: their per-tile steps are the helpers above,
// and what remains is the double-buffered tile pipeline, whose loads, waits and barriers read
// best in one place (and whose machine code is the benchmarked one).
//
// Kernel 2: dK and dV. Grid: x = key blocks, y = heads. Shared memory: T::SMEM_BYTES. kVariant:
// the query tiles of the rows that may see the block's keys, each score through
// variant_softmax_grad (its own kernel parameter, read in place).
template <class T, bool kThree, bool kCausal, bool kVariant>
__global__ void __launch_bounds__(T::THREADS, T::MIN_BLOCKS)
    flash_bwd_dkdv_kernel(const BwdParams p, const __grid_constant__ VariantArgs va) {
#ifdef ATTNSTEP_NO_CP_ASYNC
    __trap();  // never launched below sm_80 (flash_backward_plan)
#endif
    extern __shared__ float4 smem_f4[];
    float* const Ks = reinterpret_cast<float*>(smem_f4);  // [BB][LD]
    float* const Vs = Ks + T::OWN;                          // [BB][LD]
    float* const Qs = Vs + T::OWN;                          // [2][BT][LD]
    float* const dOs = Qs + 2 * T::STAGE;                   // [2][BT][LD]
    float* const Ls = dOs + 2 * T::STAGE;                   // [2][BT] lse·log2 e, +inf past N
    float* const Ds = Ls + 2 * T::BT;                       // [2][BT] D, 0 past N

    const int head = p.head0 + blockIdx.y;
    const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
    const int g = lane >> 2, t = lane & 3;
    const int k0 = blockIdx.x * T::BB;  // the block's first key
    const int wk0 = k0 + warp * 16;     // the warp's first key
    const size_t qoff = static_cast<size_t>(head) * p.N, koff = static_cast<size_t>(head) * p.M;
    const float* Qh = p.Q + qoff * T::D;
    const float* dOh = p.dO + qoff * T::D;

    load_rows<T, T::BB>(Ks, p.K + koff * T::D, k0, p.M);
    load_rows<T, T::BB>(Vs, p.V + koff * T::D, k0, p.M);
    cp_async_commit();

    // Causal: query rows before k0 see none of these keys; the variant's rule, those of its range.
    int first = 0, n_tiles = 0;
    visible_query_tiles<kCausal, kVariant>(va.v, p.M, p.N, k0, T::BB, T::BT, first, n_tiles);
    auto load_tile = [&](int i, int buf) {
        const int q0 = i * T::BT;
        load_rows<T, T::BT>(Qs + buf * T::STAGE, Qh, q0, p.N);
        load_rows<T, T::BT>(dOs + buf * T::STAGE, dOh, q0, p.N);
        cp_async_commit();
        for (int r = threadIdx.x; r < T::BT; r += T::THREADS) {
            const bool valid = q0 + r < p.N;
            if constexpr (kVariant) Ls[buf * T::BT + r] = variant_lse2(valid, p.lse + qoff + q0 + r);
            else Ls[buf * T::BT + r] = valid ? p.lse[qoff + q0 + r] * kLog2e : INFINITY;
            Ds[buf * T::BT + r] = valid ? p.D[qoff + q0 + r] : 0.f;
        }
    };

    float dk[T::D / 8][4], dv[T::D / 8][4];
    zero(dk);
    zero(dv);
    if (first < n_tiles) load_tile(first, 0);
    for (int i = first; i < n_tiles; ++i) {
        const int buf = (i - first) & 1;
        if (i + 1 < n_tiles) {
            load_tile(i + 1, buf ^ 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // K, V and tile i have landed for every thread's copies

        const float* Qi = Qs + buf * T::STAGE;
        const float* dOi = dOs + buf * T::STAGE;
        const float* Li = Ls + buf * T::BT;
        const float* Di = Ds + buf * T::BT;
        const int q0 = i * T::BT;
        float s[T::BT / 8][4], dp[T::BT / 8][4];
        gemm_abt<T, T::BT, kThree>(s, Ks + warp * 16 * T::LD, Qi, g, t);    // Sᵀ = K_w Q_iᵀ
        gemm_abt<T, T::BT, kThree>(dp, Vs + warp * 16 * T::LD, dOi, g, t);  // dPᵀ = V_w dO_iᵀ
        // Element (nt, e): key wk0 + g + 8·(e/2), query q0 + 8nt + 2t + e%2.
        if constexpr (kVariant) {
            variant_softmax_grad<T::BT>(
                s, dp, va, va.v.slope(head) * kLog2e, head, p.N, p.M,
                [&](int nt, int e, int& r, int& c) {
                    r = q0 + nt * 8 + 2 * t + (e & 1);
                    c = wk0 + g + 8 * (e >> 1);
                },
                [&](int nt, int e) { return Li[nt * 8 + 2 * t + (e & 1)]; },
                [&](int nt, int e) { return Di[nt * 8 + 2 * t + (e & 1)]; });
        } else {
            const bool diagonal = kCausal && q0 < wk0 + 15;
            softmax_grad<T::BT>(
                s, dp, p.scale_log2,
                [&](int nt, int e) { return diagonal && wk0 + g + 8 * (e >> 1) > q0 + nt * 8 + 2 * t + (e & 1); },
                [&](int nt, int e) { return Li[nt * 8 + 2 * t + (e & 1)]; },
                [&](int nt, int e) { return Di[nt * 8 + 2 * t + (e & 1)]; });
        }
        add_product<T, T::BT, kThree>(dv, s, dOi, g, t);  // dV_w += Pᵀ dO_i
        add_product<T, T::BT, kThree>(dk, dp, Qi, g, t);  // dK_w += dSᵀ Q_i
        __syncthreads();  // every warp is done with buffer `buf` before tile i+2 overwrites it
    }
    if (first >= n_tiles) cp_async_wait<0>();  // nothing visible: the gradients stay 0

    store_grad<T>(dk, p.dK + koff * T::D, wk0 + g, p.M, p.scale, t);
    store_grad<T>(dv, p.dV + koff * T::D, wk0 + g, p.M, 1.f, t);
}

// ---------------------------------------------------------------------------------------------
// Kernel 3: dQ. Grid: x = query blocks (reversed, so the longest causal blocks start first),
// y = heads. Shared memory: T::SMEM_BYTES (the lse/D vectors unused: each thread keeps its rows').
// kVariant: the key tiles of the rule's range, each score through variant_softmax_grad.
template <class T, bool kThree, bool kCausal, bool kVariant>
__global__ void __launch_bounds__(T::THREADS, T::MIN_BLOCKS)
    flash_bwd_dq_kernel(const BwdParams p, const __grid_constant__ VariantArgs va) {
#ifdef ATTNSTEP_NO_CP_ASYNC
    __trap();
#endif
    extern __shared__ float4 smem_f4[];
    float* const Qs = reinterpret_cast<float*>(smem_f4);  // [BB][LD]
    float* const dOs = Qs + T::OWN;                         // [BB][LD]
    float* const Ks = dOs + T::OWN;                         // [2][BT][LD]
    float* const Vs = Ks + 2 * T::STAGE;                    // [2][BT][LD]

    const int head = p.head0 + blockIdx.y;
    const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
    const int g = lane >> 2, t = lane & 3;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * T::BB;
    const int wq0 = q0 + warp * 16;
    const size_t qoff = static_cast<size_t>(head) * p.N, koff = static_cast<size_t>(head) * p.M;
    const float* Kh = p.K + koff * T::D;
    const float* Vh = p.V + koff * T::D;

    load_rows<T, T::BB>(Qs, p.Q + qoff * T::D, q0, p.N);
    load_rows<T, T::BB>(dOs, p.dO + qoff * T::D, q0, p.N);
    cp_async_commit();
    // The thread's two rows, wq0 + g and wq0 + g + 8.
    float lse2[2], Dr[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int row = wq0 + g + 8 * half;
        if constexpr (kVariant) lse2[half] = variant_lse2(row < p.N, p.lse + qoff + row);
        else lse2[half] = row < p.N ? p.lse[qoff + row] * kLog2e : INFINITY;
        Dr[half] = row < p.N ? p.D[qoff + row] : 0.f;
    }

    const int n_tiles = kVariant ? ceil_div(va.v.end_key(min(q0 + T::BB, p.N) - 1, p.M), T::BT)
                                 : visible_key_tiles<kCausal>(p.M, p.N, q0, T::BB, T::BT);
    const int first = kVariant ? min(n_tiles, va.v.first_key(q0) / T::BT) : 0;
    auto load_tile = [&](int j, int buf) {
        load_rows<T, T::BT>(Ks + buf * T::STAGE, Kh, j * T::BT, p.M);
        load_rows<T, T::BT>(Vs + buf * T::STAGE, Vh, j * T::BT, p.M);
        cp_async_commit();
    };

    float dq[T::D / 8][4];
    zero(dq);
    if (kVariant ? first < n_tiles : n_tiles > 0) load_tile(first, 0);
    for (int j = first; j < n_tiles; ++j) {
        const int buf = (j - first) & 1;
        if (j + 1 < n_tiles) {
            load_tile(j + 1, buf ^ 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();

        const float* Kj = Ks + buf * T::STAGE;
        const float* Vj = Vs + buf * T::STAGE;
        const int key0 = j * T::BT;
        float s[T::BT / 8][4], dp[T::BT / 8][4];
        gemm_abt<T, T::BT, kThree>(s, Qs + warp * 16 * T::LD, Kj, g, t);    // S = Q_w K_jᵀ
        gemm_abt<T, T::BT, kThree>(dp, dOs + warp * 16 * T::LD, Vj, g, t);  // dP = dO_w V_jᵀ
        // Element (nt, e): query row wq0 + g + 8·(e/2), key key0 + 8nt + 2t + e%2.
        if constexpr (kVariant) {
            variant_softmax_grad<T::BT>(
                s, dp, va, va.v.slope(head) * kLog2e, head, p.N, p.M,
                [&](int nt, int e, int& r, int& c) {
                    r = wq0 + g + 8 * (e >> 1);
                    c = key0 + nt * 8 + 2 * t + (e & 1);
                },
                [&](int, int e) { return lse2[e >> 1]; }, [&](int, int e) { return Dr[e >> 1]; });
        } else {
            const bool edge = key0 + T::BT > p.M || (kCausal && key0 + T::BT - 1 > wq0);
            softmax_grad<T::BT>(
                s, dp, p.scale_log2,
                [&](int nt, int e) {
                    const int key = key0 + nt * 8 + 2 * t + (e & 1);
                    return edge && (key >= p.M || (kCausal && key > wq0 + g + 8 * (e >> 1)));
                },
                [&](int, int e) { return lse2[e >> 1]; }, [&](int, int e) { return Dr[e >> 1]; });
        }
        add_product<T, T::BT, kThree>(dq, dp, Kj, g, t);  // dQ_w += dS K_j
        __syncthreads();
    }
    if (kVariant ? first >= n_tiles : n_tiles == 0) cp_async_wait<0>();

    store_grad<T>(dq, p.dQ + qoff * T::D, wq0 + g, p.N, p.scale, t);
}

// ---------------------------------------------------------------------------------------------
// Launch.

bool device_supported() { return device_compute_capability() >= 80; }

template <class T, bool kThree, bool kCausal, bool kVariant>
void launch_kernels(const FlashBwdArgs& a, const float* D, cudaStream_t stream) {
    static const int dkdv_ok = prepare_kernel(
        reinterpret_cast<const void*>(flash_bwd_dkdv_kernel<T, kThree, kCausal, kVariant>), T::THREADS, T::SMEM_BYTES);
    static const int dq_ok = prepare_kernel(
        reinterpret_cast<const void*>(flash_bwd_dq_kernel<T, kThree, kCausal, kVariant>), T::THREADS, T::SMEM_BYTES);
    (void)dkdv_ok;
    (void)dq_ok;
    // The kernels index the variant's per-head inputs by the head of the whole call (head0 + y).
    const VariantArgs va = variant_args(a.scale, a.variant);
    for (int head0 = 0; head0 < a.heads; head0 += kMaxGridYZ) {
        const int heads = std::min(kMaxGridYZ, a.heads - head0);
        const BwdParams p{a.Q, a.K, a.V, a.lse, D, a.dO, a.dQ, a.dK, a.dV, head0, a.N, a.M, a.scale, a.scale * kLog2e};
        flash_bwd_dkdv_kernel<T, kThree, kCausal, kVariant>
            <<<dim3(ceil_div(a.M, T::BB), heads), T::THREADS, T::SMEM_BYTES, stream>>>(p, va);
        LAUNCH_CHECK(flash_bwd_dkdv_kernel);
        flash_bwd_dq_kernel<T, kThree, kCausal, kVariant>
            <<<dim3(ceil_div(a.N, T::BB), heads), T::THREADS, T::SMEM_BYTES, stream>>>(p, va);
        LAUNCH_CHECK(flash_bwd_dq_kernel);
    }
}

// Calls f(TypeTag<T>{}) with the tiles for width d; false for a width without them.
template <class F>
bool with_bwd_tiles(int d, F&& f) {
    return with_head_dim(d, [&](auto D) {
        f(TypeTag<typename BwdConfig<constant_v<decltype(D)>>::type>{});
        return true;
    });
}

// The Hopper kernels (sm90a/flash_bwd_wgmma_half.cu at bf16/fp16, sm90a/flash_bwd_wgmma_tf32.cu at
// tf32 and fp32), where built and taken.
bool hopper_backward(const FlashBwdArgs& a) {
#ifdef ATTNSTEP_HAVE_WGMMA
    return device_compute_capability() == 90 &&
           (is_half(a.precision) ? wgmma_half_backward_takes(a) : wgmma_tf32_backward_takes(a));
#else
    (void)a;
    return false;
#endif
}

void check_supported(const FlashBwdArgs& a) {
    if (is_half(a.precision)) {
        if (!hopper_backward(a))
            fail(kExitInternal, where(__FILE__, __LINE__) + ": no half-precision flash backward for this problem");
        return;
    }
    if (!device_supported())
        fail(kExitBadInput, "the flash backward needs a GPU of compute capability 8.0 or newer (TF32 tensor cores)",
             "select the backward stage path only (--stages stages) on this GPU");
    if (!with_bwd_tiles(a.d, [](auto) {}))
        fail(kExitInternal, where(__FILE__, __LINE__) + ": the flash backward has no tiles for d=" + std::to_string(a.d));
}

}  // namespace

bool flash_backward_available(const FlashBwdArgs& a) {
    if (is_half(a.precision)) return hopper_backward(a);
    return device_supported() && with_bwd_tiles(a.d, [](auto) {});
}

FlashPlan flash_backward_plan(const FlashBwdArgs& a) {
    check_supported(a);
    // A label: the dK/dV kernel's tiles (query rows streamed a tile by keys a block: 64 by 128 at
    // a half precision); the dQ kernel's are the transpose.
    const std::string wgmma = std::string("cuda-bwd-wgmma-") + precision_name(a.precision);
    if (is_half(a.precision)) return FlashPlan{64, 128, wgmma};
#ifdef ATTNSTEP_HAVE_WGMMA
    if (hopper_backward(a)) {
        FlashPlan plan{0, 0, wgmma};
        wgmma_tf32_backward_tiles(a, &plan.Br, &plan.Bc);
        return plan;
    }
#endif
    FlashPlan plan;
    with_bwd_tiles(a.d, [&](auto tag) {
        using T = tag_type<decltype(tag)>;
        plan = FlashPlan{T::BB, T::BB, std::string("cuda-bwd-") + (a.precision == Precision::fp32 ? "3xtf32" : "tf32")};
    });
    return plan;
}

size_t flash_backward_workspace_bytes_per_head(const FlashBwdArgs& a) {
    size_t bytes = static_cast<size_t>(a.N) * sizeof(float);  // D
#ifdef ATTNSTEP_HAVE_WGMMA
    if (is_half(a.precision)) bytes = wgmma_half_backward_workspace_bytes_per_head(a);
    else if (hopper_backward(a)) bytes = wgmma_tf32_backward_workspace_bytes_per_head(a);
#endif
    return bytes;
}

void flash_backward(const FlashBwdArgs& a, cudaStream_t stream) {
    if (a.heads < 1 || a.N < 1 || a.M < 1) return;
    check_supported(a);
#ifdef ATTNSTEP_HAVE_WGMMA
    if (is_half(a.precision)) return wgmma_half_backward(a, stream);
    if (hopper_backward(a)) return wgmma_tf32_backward(a, stream);
#endif
    StreamWorkspace D(static_cast<size_t>(a.heads) * a.N, stream);
    launch_row_dot(a.dO, a.O, D.p, static_cast<long long>(a.heads) * a.N, a.d, stream);
    with_bwd_tiles(a.d, [&](auto tag) {
        using T = tag_type<decltype(tag)>;
        with_flag(a.precision == Precision::fp32, [&](auto three) {
            with_mask_kind(a, [&](auto causal, auto variant) {
                launch_kernels<T, constant_v<decltype(three)>, constant_v<decltype(causal)>, constant_v<decltype(variant)>>(
                    a, D.p, stream);
            });
        });
    });
    D.release();
}

}  // namespace attnstep
