// flash_wgmma.cu — FlashAttention-2 forward on Hopper's warpgroup MMA (wgmma, sm_90a):
// O = softmax(scale·Q·Kᵀ [causal-masked])·V and lse = log Σ exp(scale·q·k), per head.
//
//   Precision::fp32 (default): 3xTF32, as in flash_fast.cu: every operand x = hi + lo (both TF32)
//     and a·b ≈ lo·hi + hi·lo + hi·hi accumulated in FP32, the small terms first.
//   Precision::tf32: one product of TF32-rounded operands.
//
// Why a second tensor-core kernel: Hopper's full tensor rate is reached only through wgmma, well
// above mma.sync's (bench measures both ceilings; docs/journal.md). TF32 wgmma needs
// both operands K-major in shared memory (A may come from registers):
//   S = Q·Kᵀ: A = Q tile (rows × d, d contiguous), B = K tile (keys × d, d contiguous): as stored.
//   O = P·V:  A = P from the S accumulators (registers), B must be Vᵀ (d × keys, keys contiguous).
// So a preparation pass writes, per call, K and Vᵀ already split into TF32 hi/lo parts, padded
// to whole key tiles with zeros (no bounds checks in the loop), with Vᵀ's keys permuted within
// each 8-key block (flash::kperm) so that the S accumulators are P's A fragments as they stand,
// and laid out exactly as shared memory wants a stage: each key tile's K parts, then its Vᵀ
// parts, contiguous, so that one thread loads them with two bulk copies (bulk_copy.cuh), whose
// completion the stage's K and Vᵀ mbarriers count: per-thread loads would spend most of each
// tile's instructions on address arithmetic. Descriptors are constant offsets from one base
// (desc_at). Q is split once per block into shared memory.
//
// Structure: a block of NWG warpgroups owns BR = 64·NWG query rows; each warpgroup computes its
// 64×BC slice of S with wgmma (A = Q hi/lo from shared memory), runs the online softmax on it in
// registers (flash_common.cuh), and adds P·V (A = P hi/lo from registers) into a per-tile FP32
// accumulator that is added to O in FP32 (the tensor cores truncate while they accumulate: one
// chain per tile keeps that to one tile's MMAs). K/Vᵀ tiles stream through shared memory: double buffered (tile j+1 loads
// while tile j is computed), or, for tiles too wide for two stages, single buffered with K_{j+1}
// loading during the softmax and P·V of tile j and Vᵀ_{j+1} during S_{j+1}. Causal: tiles above
// the diagonal are never loaded, and a warpgroup whose rows are all above a tile skips it.
// Shared-memory tiles use the no-swizzle K-major layout of smem_layout.cuh (core matrices of 8
// rows × 16 bytes). The variant instantiation (flash_problem.cuh): the rule's key tiles alone,
// a warpgroup skipping those outside its rows' band, the softcap (tanhf) and ALiBi in base 2
// (flash_common.cuh modify_tile). When heads·⌈N/BR⌉ blocks cannot fill the GPU, the KV loop is split and
// combine_kv_splits (flash_dispatch.cu) merges.
//
// Arithmetic the verifier assumes (verify/model/kernels.py: KERNELS["cuda-wgmma-3xtf32"] and
// ["cuda-wgmma-tf32"], the CUDA model): as flash_fast.cu's:
// 3xTF32 (or TF32) products summed by the tensor cores with truncation, one KV tile per
// accumulator chain, tiles added in FP32; scale·log2(e) rounded once per head; ex2.approx.ftz;
// lse = (m + log2 l)·ln 2; four final roundings of O (1/l, and the split combine).
//
// Build: compiled for sm_90a only (CMakeLists.txt: the attnstep_sm90a object library); check
// resources with
//   nvcc -gencode=arch=compute_90a,code=sm_90a -std=c++17 -Xptxas -v -c cuda_src/cuda/sm90a/flash_wgmma.cu
// Run / time / check: build/main --bench --batch 4 --heads 16 --seq-q 4096 --seq-k 4096 --d 64 --check
#include "flash_wgmma.cuh"

#include <cstdint>
#include <type_traits>

#include "../cuda_check.cuh"
#include "../device.cuh"
#include "../flash_common.cuh"
#include "../flash_scores.cuh"
#include "../flash_dispatch.cuh"
#include "bulk_copy.cuh"
#include "flash_wgmma_half.cuh"
#include "prepared_stages.cuh"
#include "smem_layout.cuh"
#include "wgmma.cuh"

namespace attnstep {
namespace {

using namespace flash;

constexpr int kWarpgroup = 128;  // threads

// The tile configuration: D head width, BC keys per tile, NWG warpgroups (64 query rows each),
// STAGES K/Vᵀ tiles in shared memory (2: tile j+1 loads while tile j is computed; 1: K_{j+1}
// loads once S_j is done, V_{j+1} once P_j·V_j is, for tiles too wide to double buffer).
template <int D_, int BC_, int NWG_, bool THREE_, int STAGES_ = 2>
struct WgTiles {
    static constexpr int D = D_, BC = BC_, NWG = NWG_, STAGES = STAGES_;
    static constexpr bool THREE = THREE_;
    static constexpr int BR = 64 * NWG, THREADS = kWarpgroup * NWG;
    static constexpr int PARTS = THREE ? 2 : 1;  // hi (and lo) copies of every operand
    // Floats per part: the block's Q, one K tile (BC × D), one Vᵀ tile (D × BC).
    static constexpr int Q_PART = BR * D, K_PART = BC * D, V_PART = D * BC;
    static constexpr int STAGE = PARTS * (K_PART + V_PART);  // K parts, then Vᵀ parts
    static constexpr int V_OFFSET = PARTS * K_PART;
    static constexpr uint32_t K_BYTES = V_OFFSET * sizeof(float), V_BYTES = PARTS * V_PART * sizeof(float);
    static constexpr size_t SMEM_BYTES = (static_cast<size_t>(PARTS) * Q_PART + STAGES * STAGE) * sizeof(float);
    static_assert(D % 32 == 0 && BC % 32 == 0, "tiles: whole core matrices, 32-key transpose blocks");
    static_assert(STAGES == 1 || STAGES == 2, "single or double buffered");
    // The opt-in shared-memory limit of sm_90 (227 KB) less the kernel's static barriers; an
    // mbarrier phase counts at most 2^20 - 1 bytes; desc_at moves in whole 16-byte units.
    static_assert(SMEM_BYTES + 64 <= 227 * 1024, "shared memory");
    static_assert(K_BYTES < (1u << 20) && V_BYTES < (1u << 20), "mbarrier transaction count");
    static_assert(Q_PART % 4 == 0 && K_PART % 4 == 0 && V_PART % 4 == 0, "descriptor offsets");
};

// The float32 instances of smem_layout.cuh's layout.
template <int R>
__device__ __forceinline__ int cm_offset(int r, int c) { return wg::cm_offset<R, float>(r, c); }
using wg::tile_desc;
__device__ __forceinline__ uint64_t desc_at(uint64_t desc, int floats) { return wg::desc_at<float>(desc, floats); }
template <int R>
constexpr int kStep = wg::kStep<R, float>;
template <int C>
__device__ __forceinline__ void chunk_coords(int i, int& r, int& c) { wg::chunk_coords<C, float>(i, r, c); }

struct WgParams {
    const float* Q;    // [heads][N][D]
    const float* ops;  // [heads][Mpad/BC][STAGE]: per key tile, K's and Vᵀ's TF32 parts (prepare)
    float* O;          // [heads][N][D], or the split partials [splits][heads][N][D]
    float* lse;        // [heads][N],    or [splits][heads][N]
    int heads, N, M, Mpad;
    float scale_log2;  // scale·log2(e): the softmax runs in base 2
    int splits;
};

// ---------------------------------------------------------------------------------------------
// The preparation pass.

using wg::kPrepThreads;
using wg::stage_in;

// K part p of key tile j: element (key r, column c) at p·K_PART + cm_offset<BC>(r % BC, c), zeros
// for keys >= M. A thread per 16 bytes (prepared_stages.cuh: key_chunk, and its grid).
template <class T>
__global__ void split_keys(const float* K, float* ops, int M, int Mpad) {
    const auto [h, j, r, c] = wg::key_chunk<T, float>();
    const int key = j * T::BC + r;
    const float4 v = key < M ? *reinterpret_cast<const float4*>(K + (static_cast<size_t>(h) * M + key) * T::D + c)
                             : make_float4(0.f, 0.f, 0.f, 0.f);
    uint32_t hi[4], lo[4];
    split4<T::THREE>(v, hi, lo);
    float* const dst = stage_in<T>(ops, h, j, Mpad) + cm_offset<T::BC>(r, c);
    *reinterpret_cast<uint4*>(dst) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
    if constexpr (T::THREE) *reinterpret_cast<uint4*>(dst + T::K_PART) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
}

// Vᵀ part p of key tile j: element (column c, position q) at V_OFFSET + p·V_PART +
// cm_offset<D>(c, q) holds part(V[key][c]) with key = 8·(q/8) + kperm(q%8) of the tile, zeros
// for keys >= M. A 32-key × 32-column block per block of (32, 8) threads, through shared memory;
// each warp writes whole core matrices (8 columns × 4 positions, 128 contiguous bytes).
template <class T>
__global__ void transpose_split_values(const float* V, float* ops, int M, int Mpad) {
    __shared__ float tile[32][33];  // +1: the column reads below spread over the banks
    const int h = blockIdx.z, key0 = blockIdx.x * 32, col0 = blockIdx.y * 32;
    const float* Vh = V + static_cast<size_t>(h) * M * T::D;
    for (int y = threadIdx.y; y < 32; y += 8) {
        const int key = key0 + y;
        tile[y][threadIdx.x] = key < M ? Vh[static_cast<size_t>(key) * T::D + col0 + threadIdx.x] : 0.f;
    }
    __syncthreads();
    const int lane = threadIdx.x;
    float* const stage = stage_in<T>(ops, h, key0 / T::BC, Mpad) + T::V_OFFSET;
    for (int cmi = threadIdx.y; cmi < 32; cmi += 8) {  // 4 column groups × 8 position groups
        const int col = (cmi % 4) * 8 + lane / 4, pos = (cmi / 4) * 4 + lane % 4;
        const int src = (pos & ~7) + kperm(pos & 7);
        uint32_t hi, lo;
        split<T::THREE>(tile[src][col], hi, lo);
        float* const dst = stage + cm_offset<T::D>(col0 + col, key0 % T::BC + pos);
        *dst = __uint_as_float(hi);
        if constexpr (T::THREE) dst[T::V_PART] = __uint_as_float(lo);
    }
}

// ---------------------------------------------------------------------------------------------
// The kernel. Grid: x = query blocks (reversed, so the longest causal blocks start first),
// y = heads, z = KV splits. Shared memory: Q [PARTS][BR×D], then STAGES stages of
// {K [PARTS][BC×D], Vᵀ [PARTS][D×BC]}, all in the core-matrix layout. The kernel is one function
// on purpose: its per-tile steps are the helpers above, and what remains is the bulk-copy and
// mbarrier pipeline, whose phases and barriers must be read together (and whose machine code is
// the benchmarked one).

// Issues S(64×BC) = Q_wg·K_jᵀ for the warpgroup's 64 rows, small terms first, as one wgmma group;
// s is valid after the next wg::wait. q: the descriptor of the warpgroup's rows of Q (hi part,
// k step 0); k: that of the stage's K (hi part, k step 0).
template <class T>
__device__ __forceinline__ void qk_issue(float (&s)[T::BC / 8][4], uint64_t q, uint64_t k) {
    wg::fence();
#pragma unroll
    for (int ks = 0; ks < T::D / 8; ++ks) {
        const uint64_t q_hi = desc_at(q, ks * kStep<T::BR>), k_hi = desc_at(k, ks * kStep<T::BC>);
        if constexpr (T::THREE) {
            const uint64_t q_lo = desc_at(q_hi, T::Q_PART), k_lo = desc_at(k_hi, T::K_PART);
            wg::Wgmma<T::BC>::ss(s, q_lo, k_hi, ks > 0);
            wg::Wgmma<T::BC>::ss(s, q_hi, k_lo, 1);
            wg::Wgmma<T::BC>::ss(s, q_hi, k_hi, 1);
        } else {
            wg::Wgmma<T::BC>::ss(s, q_hi, k_hi, ks > 0);
        }
    }
    wg::commit();
}

// Issues acc(64×D) = P(64×BC)·V_j as one wgmma group. P's A fragment for keys 8kk.. is s[kk]
// under kperm (split_acc_a), split into TF32 parts in hi/lo, which must stay untouched until
// the group completes. The caller adds acc to O in FP32 after wg::wait (a fresh accumulator per
// tile: the tensor cores' own long accumulation truncates). v: the descriptor of the stage's Vᵀ
// (hi part, k step 0).
template <class T>
__device__ __forceinline__ void pv_issue(float (&acc)[T::D / 8][4], uint32_t (&hi)[T::BC / 8][4],
                                         uint32_t (&lo)[T::BC / 8][4], const float (&s)[T::BC / 8][4],
                                         uint64_t v) {
#pragma unroll
    for (int kk = 0; kk < T::BC / 8; ++kk) {
        constexpr int kFrag[4] = {0, 2, 1, 3};  // split_acc_a's order, written out: same code
#pragma unroll
        for (int e = 0; e < 4; ++e) split<T::THREE>(s[kk][kFrag[e]], hi[kk][e], lo[kk][e]);
    }
    wg::fence();
#pragma unroll
    for (int kk = 0; kk < T::BC / 8; ++kk) {
        const uint64_t v_hi = desc_at(v, kk * kStep<T::D>);
        if constexpr (T::THREE) {
            const uint64_t v_lo = desc_at(v_hi, T::V_PART);
            wg::Wgmma<T::D>::rs(acc, lo[kk], v_hi, kk > 0);
            wg::Wgmma<T::D>::rs(acc, hi[kk], v_lo, 1);
            wg::Wgmma<T::D>::rs(acc, hi[kk], v_hi, 1);
        } else {
            wg::Wgmma<T::D>::rs(acc, hi[kk], v_hi, kk > 0);
        }
    }
    wg::commit();
}

// The block's BR rows of Q, split into TF32 parts in the core-matrix layout of shared memory.
// Rows past N are zeros and never stored. The caller fences for wgmma (fence_proxy_async).
template <class T>
__device__ __forceinline__ void split_q(float* Qs, const WgParams& p, int head, int q0) {
    const float* Qh = p.Q + static_cast<size_t>(head) * p.N * T::D;
    for (int i = threadIdx.x; i < T::BR * T::D / 4; i += T::THREADS) {
        int r, c;
        chunk_coords<T::D>(i, r, c);
        const float4 v = q0 + r < p.N
            ? *reinterpret_cast<const float4*>(Qh + static_cast<size_t>(q0 + r) * T::D + c)
            : make_float4(0.f, 0.f, 0.f, 0.f);
        uint32_t hi[4], lo[4];
        split4<T::THREE>(v, hi, lo);
        *reinterpret_cast<uint4*>(Qs + cm_offset<T::BR>(r, c)) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
        if constexpr (T::THREE)
            *reinterpret_cast<uint4*>(Qs + T::Q_PART + cm_offset<T::BR>(r, c)) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
    }
}

template <class T, bool kCausal, bool kVariant>
__global__ void __launch_bounds__(T::THREADS, 1)
    flash_wgmma_kernel(const WgParams p, const __grid_constant__ VariantArgs va) {
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
    __trap();  // built for sm_90a only; never launched elsewhere (device_is_sm90)
#else
    extern __shared__ float4 smem_f4[];
    float* const Qs = reinterpret_cast<float*>(smem_f4);  // [PARTS][BR×D]
    float* const stages = Qs + T::PARTS * T::Q_PART;       // [STAGES][STAGE]
    // Per stage, one barrier for its K and one for its Vᵀ: a phase completes when the tile's copy
    // has landed.
    __shared__ uint64_t k_loaded[T::STAGES], v_loaded[T::STAGES];

    const int qblock = gridDim.x - 1 - blockIdx.x;
    const int head = blockIdx.y, split_id = blockIdx.z;
    const int wg = threadIdx.x / kWarpgroup, warp = (threadIdx.x % kWarpgroup) / 32;
    const int lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
    const int q0 = qblock * T::BR;
    const int wg_row0 = q0 + wg * 64;            // the warpgroup's first query row
    const int warp_row0 = wg_row0 + warp * 16;   // the warp's
    const int row0 = warp_row0 + g;              // the thread's rows: row0 and row0 + 8
    // The KV tiles this block visits (causal: up to its last row; the variant: its rule's range),
    // this split's share of them.
    int tile_begin, tile_end;
    if constexpr (kVariant)
        variant_tile_share(va.v, p.M, p.N, q0, T::BR, T::BC, p.splits, split_id, tile_begin, tile_end);
    else
        split_share(visible_key_tiles<kCausal>(p.M, p.N, q0, T::BR, T::BC), p.splits, split_id, tile_begin, tile_end);

    // Tile j lives in stage (j - tile_begin) % STAGES, whose barriers complete their n-th phase
    // (parity n % 2) with the n-th tile loaded into it. Thread 0 starts the copies.
    float* const ops_h = stage_in<T>(const_cast<float*>(p.ops), head, 0, p.Mpad);
    auto slot = [&](int j) { return (j - tile_begin) % T::STAGES; };
    auto parity = [&](int j) { return static_cast<uint32_t>(((j - tile_begin) / T::STAGES) & 1); };
    auto stage_of = [&](int j) { return stages + slot(j) * T::STAGE; };
    auto load_k = [&](int j) {
        uint64_t* const bar = &k_loaded[slot(j)];
        bulk::arrive_expect_tx(bar, T::K_BYTES);
        bulk::copy(stage_of(j), ops_h + static_cast<size_t>(j) * T::STAGE, T::K_BYTES, bar);
    };
    auto load_v = [&](int j) {
        uint64_t* const bar = &v_loaded[slot(j)];
        bulk::arrive_expect_tx(bar, T::V_BYTES);
        bulk::copy(stage_of(j) + T::V_OFFSET, ops_h + static_cast<size_t>(j) * T::STAGE + T::V_OFFSET, T::V_BYTES, bar);
    };
    if (threadIdx.x == 0) {
        for (int st = 0; st < T::STAGES; ++st) {
            bulk::init(&k_loaded[st], 1);
            bulk::init(&v_loaded[st], 1);
        }
        bulk::fence_init();
        if (tile_begin < tile_end) {
            load_k(tile_begin);
            load_v(tile_begin);
        }
    }
    split_q<T>(Qs, p, head, q0);  // while the first tile loads
    wg::fence_proxy_async();  // Q's stores are read by wgmma (the async proxy)
    // The warpgroup's rows of Q start 8·wg core matrices into the BR-row tile.
    const uint64_t q_desc = tile_desc<T::BR>(Qs + wg * 64 * 4);

    float o[T::D / 8][4];
    zero(o);
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

    // Every __syncthreads below is reached by all warpgroups, also one that skips the tile; the
    // last warpgroup never skips a causal tile, so every phase of the barriers is waited for before
    // its stage is loaded again. Under the variant's rule any warpgroup may skip tiles (a window
    // ends before the block's last tiles for its first rows, starts after its first tiles for its
    // last ones), so one that skips a tile still waits for it to land.
    ScoreMods mods = va.mods;
    if constexpr (kVariant) mods.slope_log2 = va.v.slope(head) * kLog2e;
    for (int j = tile_begin; j < tile_end; ++j) {
        const bool more = j + 1 < tile_end;
        if constexpr (T::STAGES == 2) {
            // Everyone is done with tile j-1's stage, which tile j+1 takes (and, the first time,
            // Q and the barriers are published).
            __syncthreads();
            if (threadIdx.x == 0 && more) {
                load_k(j + 1);
                load_v(j + 1);
            }
        } else if (j == tile_begin) {
            __syncthreads();  // Q and the barriers are published
        }

        const int key0 = j * T::BC;
        // A whole tile above this warpgroup's rows (or outside the rule's band) is skipped.
        const bool visible = kVariant ? !va.v.none_visible(wg_row0, wg_row0 + 64, key0, key0 + T::BC)
                                      : !kCausal || key0 <= wg_row0 + 63;
        float* const stage = stage_of(j);
        float s[T::BC / 8][4];
        if (visible) {
            bulk::wait(&k_loaded[slot(j)], parity(j));
            qk_issue<T>(s, q_desc, tile_desc<T::BC>(stage));  // S = Q Kᵀ
            wg::wait<0>();
            wg::fence_operands(s);
        } else if constexpr (kVariant) {
            bulk::wait(&k_loaded[slot(j)], parity(j));
            bulk::wait(&v_loaded[slot(j)], parity(j));
        }
        if constexpr (T::STAGES == 1) {
            __syncthreads();  // K_j is no longer read: K_{j+1} takes its place
            if (threadIdx.x == 0 && more) load_k(j + 1);
        }
        if (visible) {
            if constexpr (kVariant) {
                modify_tile<T::BC, false>(s, mods, key0, row0, t);
                if (rule_cuts<T::BC>(va.v, key0, p.M, warp_row0, 16)) mask_tile_rule<T::BC>(s, va.v, key0, p.M, row0, t);
            } else {
                scale_tile<T::BC>(s, p.scale_log2);
                if (key0 + T::BC > p.M || (kCausal && key0 + T::BC - 1 > warp_row0))
                    mask_tile<T::BC, kCausal>(s, key0, p.M, row0, t);
            }
            online_softmax<T::BC, T::D>(s, o, m, l);  // P = exp(S − m), l, O rescaled
            float acc[T::D / 8][4];
            uint32_t hi[T::BC / 8][4], lo[T::BC / 8][4];
            bulk::wait(&v_loaded[slot(j)], parity(j));
            pv_issue<T>(acc, hi, lo, s, tile_desc<T::D>(stage + T::V_OFFSET));  // acc = P V
            wg::wait<0>();
            wg::fence_operands(acc);
            add_to(o, acc);
        }
        if constexpr (T::STAGES == 1) {
            __syncthreads();  // Vᵀ_j is no longer read
            if (threadIdx.x == 0 && more) load_v(j + 1);
        }
    }

    float* O = p.O + (static_cast<size_t>(split_id) * p.heads + head) * p.N * T::D;
    float* lse = p.lse + (static_cast<size_t>(split_id) * p.heads + head) * p.N;
    store_rows<T::D>(o, m, l, O, lse, row0, p.N, t);
#endif
}

// ---------------------------------------------------------------------------------------------
// The wgmma TF32 ceiling for bench.cu: two warpgroups per block each issue batches of
// m64n128k8 wgmma (A and B from one shared tile, no loads in the loop) into one accumulator.

constexpr int kPeakN = 128, kPeakBatches = 512, kPeakBatch = 16, kPeakWarpgroups = 2;

__global__ void __launch_bounds__(kPeakWarpgroups * kWarpgroup, 1) wgmma_peak_kernel(float* sink) {
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
    __trap();
#else
    __shared__ alignas(128) float tile[(64 + kPeakN) * 8];  // A (64×8) then B (kPeakN×8)
    for (int i = threadIdx.x; i < (64 + kPeakN) * 8; i += blockDim.x) tile[i] = 1.f + 1e-3f * (i % 97);
    wg::fence_proxy_async();
    __syncthreads();
    const uint64_t da = tile_desc<64>(tile), db = tile_desc<kPeakN>(tile + 64 * 8);
    float acc[kPeakN / 8][4] = {};
    for (int b = 0; b < kPeakBatches; ++b) {
        wg::fence();
#pragma unroll
        for (int k = 0; k < kPeakBatch; ++k) wg::Wgmma<kPeakN>::ss(acc, da, db, 1);
        wg::commit();
        wg::wait<0>();
    }
    wg::fence_operands(acc);
    float x = 0.f;
#pragma unroll
    for (int j = 0; j < kPeakN / 8; ++j) x += acc[j][0] + acc[j][1] + acc[j][2] + acc[j][3];
    if (x == 1234.5f) *sink = x;  // keeps the work alive; never true in practice
#endif
}

// ---------------------------------------------------------------------------------------------
// Host side.

// The tile configuration for width D, precision and causality (void: none): the fastest measured
// (docs/journal.md, "flash_wgmma configurations (H100)").
template <int D, bool kThree, bool kCausal>
struct WgConfig {
    using type = void;
};
template <bool kCausal> struct WgConfig<64, true, kCausal> { using type = WgTiles<64, 64, 2, true>; };
template <> struct WgConfig<64, false, false> { using type = WgTiles<64, 64, 2, false>; };
// TF32 d64 causal: Bc 64's causal build needs more registers than two blocks per SM allow.
template <> struct WgConfig<64, false, true> { using type = WgTiles<64, 128, 2, false>; };
// 3xTF32 d128: two warpgroups would need Q's 128 KB beside the tiles; one warpgroup with
// single-buffered Bc 64 tiles beats double-buffered Bc 32 (a narrower Q·Kᵀ wgmma reads more shared
// memory per cycle than the SM delivers).
template <bool kCausal> struct WgConfig<128, true, kCausal> { using type = WgTiles<128, 64, 1, true, 1>; };
template <bool kCausal> struct WgConfig<128, false, kCausal> { using type = WgTiles<128, 64, 2, false>; };

// Calls f(TypeTag<T>{}, causal, variant) with a's configuration T and mask instantiation
// (with_mask_kind: std::bool_constant each); false where there is none. The variant's takes the
// causal configuration (its masks cost registers as the causal one's do).
template <class F>
bool with_config(const FlashArgs& a, F&& f) {
    return with_head_dim(a.d, [&](auto D) {
        return with_flag(a.precision == Precision::fp32, [&](auto three) {
            return with_mask_kind(a, [&](auto causal, auto variant) {
                using T = typename WgConfig<constant_v<decltype(D)>, constant_v<decltype(three)>,
                                            constant_v<decltype(causal)> || constant_v<decltype(variant)>>::type;
                return call_with_config<T>(f, causal, variant);
            });
        });
    });
}

template <class T, bool kCausal, bool kVariant>
int blocks_per_sm() {
    return kernel_blocks_per_sm<T, flash_wgmma_kernel<T, kCausal, kVariant>>();
}

template <class T>
size_t operand_floats(int heads, int M) {  // the prepared K and Vᵀ parts
    return 2 * static_cast<size_t>(T::PARTS) * heads * (ceil_div(M, T::BC) * T::BC) * T::D;
}

template <class T, bool kCausal, bool kVariant>
void launch_tiles(const FlashArgs& a, const KernelPlan& plan, cudaStream_t stream) {
    blocks_per_sm<T, kCausal, kVariant>();  // raises the shared-memory limit
    const int Mpad = ceil_div(a.M, T::BC) * T::BC;
    launch_with_workspace(
        a, plan, operand_floats<T>(a.heads, a.M), stream,
        [&](float* ops) {  // K and Vᵀ split into TF32 parts, one contiguous stage per key tile
            split_keys<T><<<dim3(Mpad / T::BC * wg::kPrepBlocksPerTile<T, float>, a.heads), kPrepThreads, 0, stream>>>(
                a.K, ops, a.M, Mpad);
            LAUNCH_CHECK(split_keys);
            transpose_split_values<T><<<dim3(Mpad / 32, T::D / 32, a.heads), dim3(32, 8), 0, stream>>>(
                a.V, ops, a.M, Mpad);
            LAUNCH_CHECK(transpose_split_values);
        },
        [&](float* ops, const FlashOutputs& out) {
            const WgParams p{a.Q, ops, out.O, out.lse, a.heads, a.N, a.M, Mpad, a.scale * kLog2e, plan.splits};
            flash_wgmma_kernel<T, kCausal, kVariant>
                <<<query_block_grid(a, plan), T::THREADS, T::SMEM_BYTES, stream>>>(p, variant_args(a.scale, a.variant));
            LAUNCH_CHECK(flash_wgmma_kernel);
        });
}

// Where `auto` takes this kernel over flash_fast.cu's mma.sync one: where it measured faster
// (docs/journal.md, "Where `auto` takes flash_wgmma"). Its per-call preparation pass and its
// 64-row blocks' causal waste cost more on short sequences, so it starts from N = M = 2048, and
// from 1024 for d64 non-causal.
bool preferred(const FlashArgs& a) {
    const int min_rows = (!a.causal && a.d == 64) ? 1024 : 2048;
    return a.N >= min_rows && a.M >= min_rows;
}

// The kernel is sm_90a machine code: it runs on compute capability 9.0 exactly.
// Half precisions go to flash_wgmma_half.cu.
bool plan_wgmma(const FlashArgs& a, int forced_splits, KernelPlan* plan) {
    if (a.heads < 1 || a.N < 1 || a.M < 1 || device_compute_capability() != 90) return false;
    if (a.variant.per_element_inputs()) return false;  // mask and bias files, dropout: the clean kernel's
    if (a.sequences && !is_half(a.precision)) return false;  // packed batches: the half kernel's alone
    if (is_half(a.precision)) return plan_wgmma_half(a, forced_splits, plan);
    return with_config(a, [&](auto tag, auto causal, auto variant) {
        using T = tag_type<decltype(tag)>;
        const int splits = plan_kv_splits(a, forced_splits, T::BR, T::BC, [] {
            return blocks_per_sm<T, constant_v<decltype(causal)>, constant_v<decltype(variant)>>();
        });
        *plan = KernelPlan{T::BR, T::BC, splits, operand_floats<T>(1, a.M) * sizeof(float)};
    });
}

void launch_wgmma(const FlashArgs& a, const KernelPlan& plan, cudaStream_t stream) {
    if (is_half(a.precision)) return launch_wgmma_half(a, plan, stream);
    with_config(a, [&](auto tag, auto causal, auto variant) {
        launch_tiles<tag_type<decltype(tag)>, constant_v<decltype(causal)>, constant_v<decltype(variant)>>(a, plan,
                                                                                                           stream);
    });
}

}  // namespace

const FlashKernelOps& flash_wgmma_ops() {
    static const FlashKernelOps ops{FlashKernel::wgmma, "wgmma", true, preferred, plan_wgmma, launch_wgmma, true};
    return ops;
}

double launch_wgmma_peak(float* sink, cudaStream_t stream) {
    if (device_compute_capability() != 90) return 0;
    const int blocks = device_sm_count();
    wgmma_peak_kernel<<<blocks, kPeakWarpgroups * kWarpgroup, 0, stream>>>(sink);
    LAUNCH_CHECK(wgmma_peak_kernel);
    return 2.0 * 64 * kPeakN * 8 * double(kPeakBatch) * kPeakBatches * kPeakWarpgroups * blocks;
}

}  // namespace attnstep
