// flash_fast.cu — fast FlashAttention-2 forward on tensor cores (mma.sync m16n8k8 TF32, sm_80+,
// built for sm_90): O = softmax(scale·Q·Kᵀ [causal-masked])·V and lse = log Σ exp(scale·q·k), per
// head, never holding the N×M matrix.
//
//   Precision::fp32 (default): 3xTF32. Every operand x is split x = hi + lo, hi = tf32(x),
//     lo = tf32(x − hi); a·b ≈ hi·hi + hi·lo + lo·hi accumulated in FP32 (the small terms first),
//     which keeps the error at the level of a plain FP32 kernel. Both GEMMs (S = Q Kᵀ, O += P V).
//   Precision::tf32: one product tf32(a)·tf32(b): about 3x less tensor work, ~3e-4 relative error.
//
// Structure (FlashAttention-2): a block of NW warps owns Br = 16·NW query rows, each warp 16 rows
// whose Q stays in registers (d <= 32) or in shared memory (QStore). K and V tiles of Bc rows stream through shared memory with
// cp.async, double buffered (tile j+1 loads while tile j is used). Per tile each warp computes its
// 16×Bc block of S in registers, updates the running max m and sum l (online softmax, log2
// domain), rescales its O accumulator and adds P·V, with P taken straight from the S accumulators:
// the k index of both MMAs is permuted (logical column t ↔ physical 2t, t+4 ↔ 2t+1) so that the
// accumulator layout of S is the operand layout of P, with no shuffles or shared-memory round trip.
// Causal: tiles above the diagonal are never loaded; only tiles that cross it are masked. The
// variant instantiation (flash_problem.cuh): only the key tiles of the rule's range are loaded
// (windows skip both sides), tiles its band cuts are masked, and the softcap (tanhf) and ALiBi
// are applied in base 2 (flash_common.cuh modify_tile); no mask or bias files, no dropout. Tails
// (N, M not multiples of the tiles) are zero-filled by cp.async and masked. When heads·⌈N/Br⌉
// blocks cannot fill the GPU, the KV loop is split across blocks and a combine kernel merges the
// partial outputs with their lse.
//
// Arithmetic the verifier assumes (verify/model/kernels.py: KERNELS["cuda-fast-3xtf32"] and
// ["cuda-fast-tf32"], the CUDA model, which run.toml's flash_kernel selects): 3xTF32 products (or one
// TF32 product under Precision::tf32), summed by the tensor cores, which truncate while they
// accumulate (up to one ulp of the running sum per mma, 3 mma per 8-long chunk in 3xTF32), over one
// KV tile only: each tile's P·V is added to O in FP32. The logits carry scale·log2(e), rounded once
// for the whole head; 2^x by ex2.approx.ftz (the GPU exp model, ~2 ulp at most); lse =
// (m + log2 l)·ln 2; O·(1/l), and with a KV split the combine's rescale, add and divide: four
// final roundings.
//
// Check resources with
//   nvcc -arch=sm_90 -std=c++17 -Xptxas -v -c cuda_src/cuda/flash_fast.cu
// Exploration configurations (other Bc / warps per block) are compiled only with
// -DATTNSTEP_FLASH_FAST_VARIANTS (scripts/bench_gpu.sh); `main --bench --fast-variant I` picks one.
// Versions and their measurements: docs/journal.md.
#include "flash_fast.cuh"

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda_check.cuh"
#include "device.cuh"
#include "flash_common.cuh"
#include "flash_scores.cuh"

namespace attnstep {
namespace {

using namespace flash;  // flash_common.cuh: TF32 split, the MMA, cp.async, online softmax


// ---------------------------------------------------------------------------------------------
// The tile configuration. Rows of K are padded by 8 floats (the 8-byte fragment loads of 4 rows
// × 4 threads then cover all 32 banks), rows of V by 4 (the scalar loads of rows 2t, 2t+1 land
// in distinct banks). Both pads keep rows 16-byte aligned for cp.async.

// Where the warp's Q fragments live for the whole KV loop.
enum class QStore {
    regs,       // raw FP32 in registers (D/2 per thread), split per use: small D
    smem,       // raw FP32 in shared memory, split per use: D = 128, where split Q would not fit
    smem_split  // split once into hi/lo pairs in shared memory: no conversions in the loop
};

template <int D_, int BC_, int NW_, int MINB_, QStore QS_>
struct Tiles {
    static constexpr int D = D_, BC = BC_, NW = NW_;
    static constexpr int MIN_BLOCKS = MINB_;  // __launch_bounds__ occupancy target (register cap)
    // Q in registers does not fit beside O and S at D >= 64 without spilling.
    static constexpr bool Q_SMEM = QS_ != QStore::regs, Q_SPLIT = QS_ == QStore::smem_split;
    static constexpr int BR = 16 * NW, THREADS = NW * kWarp;
    // Split Q in shared memory: per row, for each k pair (2i, 2i+1), the float4
    // {hi(2i), lo(2i), hi(2i+1), lo(2i+1)}; rows padded by 16 floats so that the 16-byte fragment
    // loads of a quarter warp (2 rows × 4 threads) hit distinct banks. Raw Q: padded like K.
    static constexpr int LDK = D + 8, LDV = D + 4, LDQ = Q_SPLIT ? 2 * D + 16 : D + 8;
    static constexpr int K_STAGE = BC * LDK, V_STAGE = BC * LDV;  // floats per stage
    static constexpr int Q_FLOATS = Q_SMEM ? BR * LDQ : 0;
    static constexpr size_t SMEM_BYTES = (2 * (K_STAGE + V_STAGE) + Q_FLOATS) * sizeof(float);
    static_assert(D % 8 == 0 && BC % 8 == 0, "tiles are made of 8×8 MMA pieces");
};

struct FastParams {
    const float* Q;
    const float* K;
    const float* V;
    float* O;       // [heads][N][D], or the split partials [splits][heads][N][D]
    float* lse;     // [heads][N],    or [splits][heads][N]
    int heads, N, M;
    float scale_log2;  // scale·log2(e): the softmax runs in base 2
    int splits;
};

// Copies rows [row0, row0 + BC) of a [M][D] matrix into a padded shared tile; rows >= M are zeros
// so masked keys multiply as 0, not as leftover NaN.
template <class T, int LD>
__device__ __forceinline__ void load_tile(float* tile, const float* src, int row0, int M) {
    constexpr int kChunksPerRow = T::D / 4;
    constexpr int kChunks = T::BC * kChunksPerRow;
#pragma unroll
    for (int c = threadIdx.x; c < kChunks; c += T::THREADS) {
        const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * 4;
        const bool valid = row0 + r < M;
        const float* g = src + static_cast<size_t>(valid ? row0 + r : 0) * T::D + col;
        cp_async_16(tile + r * LD + col, g, valid);
    }
}

// The warp's Q fragments: raw FP32 in registers, or (T::Q_SMEM) its 16 rows, already split, in
// shared memory.
template <class T>
struct QFrags {
    float reg[T::Q_SMEM ? 1 : T::D / 8][4];
    const float* rows;  // the warp's first row in shared memory (T::Q_SMEM)
};

// Fragment ks of Q, k-permuted: {Q[g][8ks+2t], Q[g+8][8ks+2t], Q[g][8ks+2t+1], Q[g+8][8ks+2t+1]},
// as hi and lo parts.
template <class T, bool kThree>
__device__ __forceinline__ void q_fragment(const QFrags<T>& q, int ks, int g, int t,
                                           uint32_t (&ahi)[4], uint32_t (&alo)[4]) {
    if constexpr (T::Q_SPLIT) {
        const int col = (ks * 8 + 2 * t) * 2;
        const float4 x = *reinterpret_cast<const float4*>(q.rows + g * T::LDQ + col);
        const float4 y = *reinterpret_cast<const float4*>(q.rows + (g + 8) * T::LDQ + col);
        ahi[0] = __float_as_uint(x.x);
        ahi[1] = __float_as_uint(y.x);
        ahi[2] = __float_as_uint(x.z);
        ahi[3] = __float_as_uint(y.z);
        alo[0] = __float_as_uint(x.y);
        alo[1] = __float_as_uint(y.y);
        alo[2] = __float_as_uint(x.w);
        alo[3] = __float_as_uint(y.w);
    } else if constexpr (T::Q_SMEM) {
        const float* r0 = q.rows + g * T::LDQ + ks * 8 + 2 * t;
        split_a<kThree>(*reinterpret_cast<const float2*>(r0), *reinterpret_cast<const float2*>(r0 + 8 * T::LDQ),
                        ahi, alo);
    } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) split<kThree>(q.reg[ks][e], ahi[e], alo[e]);
    }
}

// S(16×BC) = Q_w · K_jᵀ for this warp's 16 rows.
template <class T, bool kThree>
__device__ __forceinline__ void qk_tile(float (&s)[T::BC / 8][4], const QFrags<T>& q,
                                        const float* Ks, int g, int t) {
    zero(s);
#pragma unroll
    for (int ks = 0; ks < T::D / 8; ++ks) {
        uint32_t ahi[4], alo[4];
        q_fragment<T, kThree>(q, ks, g, t, ahi, alo);
#pragma unroll
        for (int nt = 0; nt < T::BC / 8; ++nt) {
            // b0 = K[8nt+g][8ks+2t], b1 = K[8nt+g][8ks+2t+1]: one 8-byte load.
            const float2 kv =
                *reinterpret_cast<const float2*>(Ks + (nt * 8 + g) * T::LDK + ks * 8 + 2 * t);
            uint32_t bhi[2], blo[2];
            split_b<kThree>(kv.x, kv.y, bhi, blo);
            mma_split<kThree>(s[nt], ahi, alo, bhi, blo);
        }
    }
}

// O(16×D) += P(16×BC) · V_j. P's fragment for keys 8kk..8kk+7 is the S accumulator s[kk]
// (split_acc_a); b0 = V[8kk+2t][8nt+g], b1 = V[8kk+2t+1][8nt+g]. The tile's products are summed
// in a fresh accumulator and added to O in FP32: the tensor cores truncate while they accumulate,
// so a chain over all M keys would add up one truncation per MMA of the row (docs/journal.md,
// flash_fast versions).
template <class T, bool kThree>
__device__ __forceinline__ void pv_tile(float (&o)[T::D / 8][4], const float (&s)[T::BC / 8][4],
                                        const float* Vs, int g, int t) {
    float acc[T::D / 8][4];
    zero(acc);
#pragma unroll
    for (int kk = 0; kk < T::BC / 8; ++kk) {
        uint32_t ahi[4], alo[4];
        split_acc_a<kThree>(s[kk], ahi, alo);
        const float* v0 = Vs + (kk * 8 + 2 * t) * T::LDV + g;
#pragma unroll
        for (int nt = 0; nt < T::D / 8; ++nt) {
            uint32_t bhi[2], blo[2];
            split_b<kThree>(v0[nt * 8], v0[nt * 8 + T::LDV], bhi, blo);
            mma_split<kThree>(acc[nt], ahi, alo, bhi, blo);
        }
    }
    add_to(o, acc);
}

// ---------------------------------------------------------------------------------------------
// The kernel. Grid: x = query blocks (reversed, so the longest causal blocks start first),
// y = heads, z = KV splits. Block: NW warps. Shared memory: T::SMEM_BYTES (2 stages of K and V).
// One function on purpose: moving its Q load into a helper changes the machine code ptxas
// schedules for the shipped configurations (compared section by section), and the body is the
// tuned, benchmarked one; the per-tile steps are the helpers above.

template <class T, bool kThree, bool kCausal, bool kVariant>
__global__ void __launch_bounds__(T::THREADS, T::MIN_BLOCKS)
    flash_fast_kernel(const FastParams p, const __grid_constant__ VariantArgs va) {
#ifdef ATTNSTEP_NO_CP_ASYNC
    __trap();  // never launched below sm_80 (device_supported)
#endif
    extern __shared__ float4 smem_f4[];
    float* const Ks = reinterpret_cast<float*>(smem_f4);  // [2][BC][LDK]
    float* const Vs = Ks + 2 * T::K_STAGE;                 // [2][BC][LDV]

    const int qblock = gridDim.x - 1 - blockIdx.x;
    const int head = blockIdx.y, split_id = blockIdx.z;
    const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
    const int g = lane >> 2, t = lane & 3;  // MMA fragment coordinates: group, thread in group
    const int q0 = qblock * T::BR;          // first query row of the block
    const int wrow0 = q0 + warp * 16;       // first query row of the warp
    const int row0 = wrow0 + g, row1 = row0 + 8;

    const float* Qh = p.Q + static_cast<size_t>(head) * p.N * T::D;
    const float* Kh = p.K + static_cast<size_t>(head) * p.M * T::D;
    const float* Vh = p.V + static_cast<size_t>(head) * p.M * T::D;

    // The KV tiles this block visits (causal: up to its last row; the variant: its rule's range),
    // this split's share of them.
    int tile_begin, tile_end;
    if constexpr (kVariant)
        variant_tile_share(va.v, p.M, p.N, q0, T::BR, T::BC, p.splits, split_id, tile_begin, tile_end);
    else
        split_share(visible_key_tiles<kCausal>(p.M, p.N, q0, T::BR, T::BC), p.splits, split_id, tile_begin, tile_end);

    // Q (k-permuted, see q_fragment); rows past N read as zeros and are never stored.
    QFrags<T> qf;
    if constexpr (T::Q_SMEM) {
        float* const Qs = Vs + 2 * T::V_STAGE;  // [BR][LDQ]
        constexpr int kChunksPerRow = T::D / 4;
        for (int c = threadIdx.x; c < T::BR * kChunksPerRow; c += T::THREADS) {
            const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * 4;
            const float4 v = q0 + r < p.N
                ? *reinterpret_cast<const float4*>(Qh + static_cast<size_t>(q0 + r) * T::D + col)
                : make_float4(0.f, 0.f, 0.f, 0.f);
            if constexpr (!T::Q_SPLIT) {
                *reinterpret_cast<float4*>(Qs + r * T::LDQ + col) = v;
                continue;
            }
            uint32_t hi[4], lo[4];
            split4<true>(v, hi, lo);
            float* dst = Qs + r * T::LDQ + col * 2;  // k pairs (col, col+1), (col+2, col+3)
            *reinterpret_cast<float4*>(dst) = make_float4(
                __uint_as_float(hi[0]), __uint_as_float(lo[0]), __uint_as_float(hi[1]), __uint_as_float(lo[1]));
            *reinterpret_cast<float4*>(dst + 4) = make_float4(
                __uint_as_float(hi[2]), __uint_as_float(lo[2]), __uint_as_float(hi[3]), __uint_as_float(lo[3]));
        }
        qf.rows = Qs + warp * 16 * T::LDQ;  // read after the first __syncthreads of the loop
    } else {
#pragma unroll
        for (int ks = 0; ks < T::D / 8; ++ks) {
            const int col = ks * 8 + 2 * t;
            const float2 a = row0 < p.N
                ? *reinterpret_cast<const float2*>(Qh + static_cast<size_t>(row0) * T::D + col)
                : make_float2(0.f, 0.f);
            const float2 b = row1 < p.N
                ? *reinterpret_cast<const float2*>(Qh + static_cast<size_t>(row1) * T::D + col)
                : make_float2(0.f, 0.f);
            qf.reg[ks][0] = a.x;
            qf.reg[ks][1] = b.x;
            qf.reg[ks][2] = a.y;
            qf.reg[ks][3] = b.y;
        }
        qf.rows = nullptr;
    }

    float o[T::D / 8][4];
    zero(o);
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

    if (tile_begin < tile_end) {
        // Commit groups go K_j, V_j, K_j+1, V_j+1, ...: S can start as soon as K_j is in.
        load_tile<T, T::LDK>(Ks, Kh, tile_begin * T::BC, p.M);
        cp_async_commit();
        load_tile<T, T::LDV>(Vs, Vh, tile_begin * T::BC, p.M);
        cp_async_commit();
    }
    for (int j = tile_begin; j < tile_end; ++j) {
        const int stage = (j - tile_begin) & 1;
        const float* Kj = Ks + stage * T::K_STAGE;
        const float* Vj = Vs + stage * T::V_STAGE;
        const bool more = j + 1 < tile_end;
        if (more) {
            load_tile<T, T::LDK>(Ks + (stage ^ 1) * T::K_STAGE, Kh, (j + 1) * T::BC, p.M);
            cp_async_commit();
            load_tile<T, T::LDV>(Vs + (stage ^ 1) * T::V_STAGE, Vh, (j + 1) * T::BC, p.M);
            cp_async_commit();
            cp_async_wait<3>();
        } else {
            cp_async_wait<1>();
        }
        __syncthreads();  // K_j has landed for every thread's copies

        float s[T::BC / 8][4];
        qk_tile<T, kThree>(s, qf, Kj, g, t);  // S = Q Kᵀ
        const int key0 = j * T::BC;
        if constexpr (kVariant) {
            ScoreMods mods = va.mods;
            mods.slope_log2 = va.v.slope(head) * kLog2e;
            modify_tile<T::BC, false>(s, mods, key0, row0, t);
            if (rule_cuts<T::BC>(va.v, key0, p.M, wrow0, 16)) mask_tile_rule<T::BC>(s, va.v, key0, p.M, row0, t);
        } else {
            scale_tile<T::BC>(s, p.scale_log2);
            const bool tail = key0 + T::BC > p.M;
            const bool diagonal = kCausal && key0 + T::BC - 1 > wrow0;
            if (tail || diagonal) mask_tile<T::BC, kCausal>(s, key0, p.M, row0, t);
        }
        online_softmax<T::BC, T::D>(s, o, m, l);  // m = rowmax, P = exp(S − m), l = rowsum

        if (more) cp_async_wait<2>(); else cp_async_wait<0>();
        __syncthreads();  // V_j has landed
        pv_tile<T, kThree>(o, s, Vj, g, t);  // O += P V
        __syncthreads();  // every warp is done with this stage before tile j+2 overwrites it
    }

    float* O = p.O + (static_cast<size_t>(split_id) * p.heads + head) * p.N * T::D;
    float* lse = p.lse + (static_cast<size_t>(split_id) * p.heads + head) * p.N;
    store_rows<T::D>(o, m, l, O, lse, row0, p.N, t);
}

// ---------------------------------------------------------------------------------------------
// Tile configurations and launch.

// The tile configuration `kConfig` has for width D (void: none). Config 0 is the shipped one, the
// fastest of scripts/bench_gpu.sh's variant sweep; MIN_BLOCKS caps the registers so that d64 runs
// two blocks per SM and d128 (8 warps, 202 KB of shared memory) one. Registers and shared memory
// per configuration: docs/journal.md ("flash_fast and flash_bwd resources").
template <int kConfig, int D>
struct FastConfig {
    using type = void;
};
template <> struct FastConfig<0, 16> { using type = Tiles<16, 64, 4, 3, QStore::regs>; };
template <> struct FastConfig<0, 32> { using type = Tiles<32, 64, 4, 3, QStore::regs>; };
template <> struct FastConfig<0, 64> { using type = Tiles<64, 64, 4, 2, QStore::smem>; };
template <> struct FastConfig<0, 128> { using type = Tiles<128, 64, 8, 1, QStore::smem>; };
#ifdef ATTNSTEP_FLASH_FAST_VARIANTS
// Exploration configurations (`main --bench --fast-variant I`).
// 1: Bc = 32, more blocks per SM.
template <> struct FastConfig<1, 64> { using type = Tiles<64, 32, 4, 4, QStore::smem_split>; };
template <> struct FastConfig<1, 128> { using type = Tiles<128, 32, 4, 2, QStore::smem>; };
// 2: d = 64: Q split once in shared memory; d = 128: 8 warps, Bc = 32.
template <> struct FastConfig<2, 64> { using type = Tiles<64, 64, 4, 2, QStore::smem_split>; };
template <> struct FastConfig<2, 128> { using type = Tiles<128, 32, 8, 1, QStore::smem>; };
// 3: d = 64: 8 warps (Br = 128); d = 128: 4 warps, Bc = 64.
template <> struct FastConfig<3, 64> { using type = Tiles<64, 64, 8, 1, QStore::smem_split>; };
template <> struct FastConfig<3, 128> { using type = Tiles<128, 64, 4, 1, QStore::smem>; };
#endif

// Calls f(TypeTag<T>{}) with configuration kConfig's tiles for width d; false where it has none.
template <int kConfig, class F>
bool with_config_tiles(int d, F& f) {
    return with_head_dim(d, [&](auto D) {
        return call_with_config<typename FastConfig<kConfig, constant_v<decltype(D)>>::type>(f);
    });
}
template <class F>
bool with_tiles(int config, int d, F&& f) {
    switch (config) {
        case 0: return with_config_tiles<0>(d, f);
#ifdef ATTNSTEP_FLASH_FAST_VARIANTS
        case 1: return with_config_tiles<1>(d, f);
        case 2: return with_config_tiles<2>(d, f);
        case 3: return with_config_tiles<3>(d, f);
#endif
        default: return false;
    }
}

// Calls f(three, causal, variant), each std::bool_constant: 3xTF32 or TF32, and the mask's
// instantiation (with_mask_kind), as `a` asks.
template <class F>
decltype(auto) with_variant(const FlashArgs& a, F&& f) {
    return with_flag(a.precision == Precision::fp32, [&](auto three) {
        return with_mask_kind(a, [&](auto causal, auto variant) { return f(three, causal, variant); });
    });
}

// Blocks of one instantiation that fit on an SM at once (raising its shared-memory limit), asked
// of the runtime once.
template <class T, bool kThree, bool kCausal, bool kVariant>
int blocks_per_sm() {
    return kernel_blocks_per_sm<T, flash_fast_kernel<T, kThree, kCausal, kVariant>>();
}

template <class T, bool kThree, bool kCausal, bool kVariant>
void launch_tiles(const FlashArgs& a, const KernelPlan& plan, cudaStream_t stream) {
    blocks_per_sm<T, kThree, kCausal, kVariant>();
    // No preparation pass: the workspace holds the split partial outputs alone.
    launch_with_workspace(a, plan, 0, stream, [](float*) {}, [&](float*, const FlashOutputs& out) {
        const FastParams p{a.Q, a.K, a.V, out.O, out.lse, a.heads, a.N, a.M, a.scale * kLog2e, plan.splits};
        flash_fast_kernel<T, kThree, kCausal, kVariant>
            <<<query_block_grid(a, plan), T::THREADS, T::SMEM_BYTES, stream>>>(p, variant_args(a.scale, a.variant));
        LAUNCH_CHECK(flash_fast_kernel);
    });
}

// TF32 mma.sync and cp.async need compute capability 8.0 or newer.
bool device_supported() { return device_compute_capability() >= 80; }

bool plan_shipped(const FlashArgs& a, int forced_splits, KernelPlan* plan) {
    return flash_fast_config_plan(a, 0, forced_splits, plan);
}

void launch_fast(const FlashArgs& a, const KernelPlan& plan, cudaStream_t stream) {
    with_tiles(plan.config, a.d, [&](auto tag) {
        using T = tag_type<decltype(tag)>;
        with_variant(a, [&](auto three, auto causal, auto variant) {
            launch_tiles<T, constant_v<decltype(three)>, constant_v<decltype(causal)>, constant_v<decltype(variant)>>(
                a, plan, stream);
        });
    });
}

}  // namespace

bool flash_fast_config_plan(const FlashArgs& a, int config, int forced_splits, KernelPlan* plan) {
    // TF32 operands only: the half precisions have the wgmma kernel. Mask and bias files and dropout
    // are the clean kernel's.
    if (a.heads < 1 || a.N < 1 || a.M < 1 || is_half(a.precision) || !device_supported()) return false;
    if (a.variant.per_element_inputs()) return false;
    return with_tiles(config, a.d, [&](auto tag) {
        using T = tag_type<decltype(tag)>;
        const int splits = plan_kv_splits(a, forced_splits, T::BR, T::BC, [&] {
            return with_variant(a, [&](auto three, auto causal, auto variant) {
                return blocks_per_sm<T, constant_v<decltype(three)>, constant_v<decltype(causal)>,
                                     constant_v<decltype(variant)>>();
            });
        });
        *plan = KernelPlan{T::BR, T::BC, splits, 0, config};
    });
}

const FlashKernelOps& flash_fast_ops() {
    static const FlashKernelOps ops{FlashKernel::fast, "fast", true, nullptr, plan_shipped, launch_fast};
    return ops;
}

}  // namespace attnstep
