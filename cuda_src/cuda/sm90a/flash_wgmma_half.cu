// flash_wgmma_half.cu — FlashAttention forward on Hopper's warpgroup MMA (wgmma, sm_90a) with
// bf16 or fp16 operands and FP32 accumulation (--precision bf16|fp16): O = softmax(scale·Q·Kᵀ
// [causal-masked])·V and lse = log Σ exp(scale·q·k), per head.
//
// The structure is flash_wgmma.cu's (read its header first): a preparation pass lays K and Vᵀ out
// per key tile exactly as shared memory wants a stage, one thread streams the stages in with bulk
// copies counted on mbarriers, double buffered, and each warpgroup of the block computes 64 query
// rows: S = Q·Kᵀ (A = Q from shared memory), the online softmax in FP32 registers
// (flash_common.cuh), O += P·V (A = P from registers). What differs with 16-bit operands:
//   - Q, K, V arrive as float32 buffers holding values of the format (the backend rounded the
//     inputs); the preparation pass and the block's Q load convert them, exactly.
//   - A 16-bit wgmma's register A fragment is the S accumulator fragment as it stands, two
//     neighbouring columns to a register (wgmma.cuh), so Vᵀ needs no key permutation.
//   - P is rounded to the format as it is packed (FlashAttention's order: l sums the FP32 weights,
//     only the GEMM operand is rounded), and the P·V products accumulate straight into O: a
//     product of two half values is exact in FP32, so the per-tile chain of the 3xTF32 kernel
//     buys nothing here and would cost D/2 registers.
//   - O is stored rounded to the format (the KV-split combine rounds instead when it merges).
//
// Arithmetic the verifier assumes (verify/model/kernels.py: KERNELS["cuda-wgmma-bf16"] and
// ["cuda-wgmma-fp16"], the CUDA model with the half pipeline's roundings, verify/half_route.py):
// half products exact, summed in FP32 by the tensor cores with truncation; scale·log2(e) rounded
// once per head; ex2.approx.ftz; P rounded to the format before P·V; lse = (m + log2 l)·ln 2 in
// FP32; O divided by l (and combined across splits) in FP32, then rounded to the format once.
//
// Build: compiled for sm_90a only (CMakeLists.txt: the attnstep_sm90a object library); check
// resources with
//   nvcc -gencode=arch=compute_90a,code=sm_90a -std=c++17 -Icuda_src -Xptxas -v -c cuda_src/cuda/sm90a/flash_wgmma_half.cu
// Run / time / check: build/main --bench --precision bf16 --batch 4 --heads 16 --seq-q 4096 --seq-k 4096 --d 128 --check
#include "flash_wgmma_half.cuh"

#include <cstdint>

#include "../cuda_check.cuh"
#include "../device.cuh"
#include "../flash_common.cuh"
#include "../half_format.cuh"
#include "bulk_copy.cuh"
#include "smem_layout.cuh"
#include "wgmma.cuh"

namespace attnstep {
namespace {

using namespace flash;
using Half = uint16_t;  // one bf16/fp16 value in shared and global memory

constexpr int kWarpgroup = 128;  // threads

// The tile configuration: D head width, BC keys per tile, NWG warpgroups (64 query rows each),
// Fmt the operand format; two K/Vᵀ stages in shared memory (tile j+1 loads while tile j is
// computed).
template <int D_, int BC_, int NWG_, class Fmt_>
struct HalfTiles {
    using Fmt = Fmt_;
    static constexpr int D = D_, BC = BC_, NWG = NWG_, STAGES = 2;
    static constexpr int BR = 64 * NWG, THREADS = kWarpgroup * NWG;
    // Elements: the block's Q, one K tile (BC × D), one Vᵀ tile (D × BC); a stage is K then Vᵀ.
    static constexpr int Q_ELEMS = BR * D, K_ELEMS = BC * D, V_ELEMS = D * BC;
    static constexpr int STAGE = K_ELEMS + V_ELEMS, V_OFFSET = K_ELEMS;
    static constexpr uint32_t K_BYTES = K_ELEMS * sizeof(Half), V_BYTES = V_ELEMS * sizeof(Half);
    static constexpr size_t SMEM_BYTES = (static_cast<size_t>(Q_ELEMS) + STAGES * STAGE) * sizeof(Half);
    // The preparation pass moves Vᵀ in blocks of 64 keys × 32 columns; wgmma's k step is 16.
    static_assert(D % 32 == 0 && BC % 64 == 0, "tiles: whole k steps, 64-key transpose blocks");
    // The opt-in shared-memory limit of sm_90 (227 KB) less the kernel's static barriers; an
    // mbarrier phase counts at most 2^20 - 1 bytes.
    static_assert(SMEM_BYTES + 64 <= 227 * 1024, "shared memory");
    static_assert(K_BYTES < (1u << 20) && V_BYTES < (1u << 20), "mbarrier transaction count");
};

struct HalfParams {
    const float* Q;   // [heads][N][D], values of the format
    const Half* ops;  // [heads][Mpad/BC][STAGE]: per key tile, K then Vᵀ in the format (prepare)
    float* O;         // [heads][N][D], or the split partials [splits][heads][N][D]
    float* lse;       // [heads][N],    or [splits][heads][N]
    int heads, N, M, Mpad;
    float scale_log2;  // scale·log2(e): the softmax runs in base 2
    int splits;
};

// Eight float32 values as eight values of the format, 16 bytes (the low half of each word first).
template <class Fmt>
__device__ __forceinline__ uint4 pack8(const float4& a, const float4& b) {
    return make_uint4(Fmt::pack(a.x, a.y), Fmt::pack(a.z, a.w), Fmt::pack(b.x, b.y), Fmt::pack(b.z, b.w));
}

// Eight consecutive floats of row `row` (< rows; zeros past it) from column c.
__device__ __forceinline__ void load8(const float* base, int row, int rows, int width, int c, float4& a, float4& b) {
    if (row < rows) {
        const float4* src = reinterpret_cast<const float4*>(base + static_cast<size_t>(row) * width + c);
        a = src[0];
        b = src[1];
    } else {
        a = b = make_float4(0.f, 0.f, 0.f, 0.f);
    }
}

// ---------------------------------------------------------------------------------------------
// The preparation pass.

template <class T>
__device__ __forceinline__ Half* stage_in(Half* ops, int h, int j, int Mpad) {
    return ops + (static_cast<size_t>(h) * (Mpad / T::BC) + j) * T::STAGE;
}

constexpr int kPrepThreads = 256;
template <class T>
constexpr int kPrepBlocksPerTile = T::BC * T::D / 8 / kPrepThreads;

// Key tile j's K: element (key r, column c) at cm_offset<BC>(r % BC, c), zeros for keys >= M. A
// thread per 16 bytes (8 values) in chunk_coords order. Grid: x = key tiles × kBlocksPerTile,
// y = head.
template <class T>
__global__ void convert_keys(const float* K, Half* ops, int M, int Mpad) {
    constexpr int kBlocksPerTile = kPrepBlocksPerTile<T>;
    static_assert(kBlocksPerTile * kPrepThreads == T::BC * T::D / 8, "whole blocks per key tile");
    const int h = blockIdx.y, j = blockIdx.x / kBlocksPerTile;
    const int i = (blockIdx.x % kBlocksPerTile) * kPrepThreads + threadIdx.x;
    int r, c;
    wg::chunk_coords<T::D, Half>(i, r, c);
    float4 a, b;
    load8(K + static_cast<size_t>(h) * M * T::D, j * T::BC + r, M, T::D, c, a, b);
    *reinterpret_cast<uint4*>(stage_in<T>(ops, h, j, Mpad) + wg::cm_offset<T::BC, Half>(r, c)) =
        pack8<typename T::Fmt>(a, b);
}

// Key tile j's Vᵀ: element (column c, key q) at V_OFFSET + cm_offset<D>(c, q), zeros for keys
// >= M. A block of (32, 8) threads moves 64 keys × 32 columns through shared memory; thread (x, y)
// writes column x's keys 8y..8y+7 as one 16-byte core-matrix row, so each warp writes 512
// contiguous bytes. Grid: (Mpad / 64, D / 32, heads).
template <class T>
__global__ void transpose_values(const float* V, Half* ops, int M, int Mpad) {
    __shared__ float tile[64][33];  // +1: the column reads below spread over the banks
    const int h = blockIdx.z, key0 = blockIdx.x * 64, col0 = blockIdx.y * 32;
    const float* Vh = V + static_cast<size_t>(h) * M * T::D;
    for (int y = threadIdx.y; y < 64; y += 8) {
        const int key = key0 + y;
        tile[y][threadIdx.x] = key < M ? Vh[static_cast<size_t>(key) * T::D + col0 + threadIdx.x] : 0.f;
    }
    __syncthreads();
    const int x = threadIdx.x, k8 = 8 * threadIdx.y;
    const float4 a = make_float4(tile[k8][x], tile[k8 + 1][x], tile[k8 + 2][x], tile[k8 + 3][x]);
    const float4 b = make_float4(tile[k8 + 4][x], tile[k8 + 5][x], tile[k8 + 6][x], tile[k8 + 7][x]);
    Half* const stage = stage_in<T>(ops, h, key0 / T::BC, Mpad) + T::V_OFFSET;
    *reinterpret_cast<uint4*>(stage + wg::cm_offset<T::D, Half>(col0 + x, key0 % T::BC + k8)) =
        pack8<typename T::Fmt>(a, b);
}

// ---------------------------------------------------------------------------------------------
// The kernel's steps.

// Issues S(64×BC) = Q_wg·K_jᵀ for the warpgroup's 64 rows as one wgmma group; s is valid after
// the next wg::wait. q, k: the descriptors of the warpgroup's rows of Q and of the stage's K.
template <class T>
__device__ __forceinline__ void qk_issue(float (&s)[T::BC / 8][4], uint64_t q, uint64_t k) {
    wg::fence();
#pragma unroll
    for (int ks = 0; ks < T::D / 16; ++ks)
        wg::WgmmaHalf<T::BC, typename T::Fmt>::ss(s, wg::desc_at<Half>(q, ks * wg::kStep<T::BR, Half>),
                                                  wg::desc_at<Half>(k, ks * wg::kStep<T::BC, Half>), ks > 0);
    wg::commit();
}

// Issues O(64×D) += P(64×BC)·V_j as one wgmma group. P's A fragment for keys 16kk.. is the pair of
// accumulator fragments s[2kk], s[2kk+1], rounded to the format into pa, which must stay untouched
// until the group completes. v: the descriptor of the stage's Vᵀ.
template <class T>
__device__ __forceinline__ void pv_issue(float (&o)[T::D / 8][4], uint32_t (&pa)[T::BC / 16][4],
                                         const float (&s)[T::BC / 8][4], uint64_t v) {
    using Fmt = typename T::Fmt;
#pragma unroll
    for (int kk = 0; kk < T::BC / 16; ++kk) {
        pa[kk][0] = Fmt::pack(s[2 * kk][0], s[2 * kk][1]);          // row g,     keys 2t, 2t+1
        pa[kk][1] = Fmt::pack(s[2 * kk][2], s[2 * kk][3]);          // row g + 8
        pa[kk][2] = Fmt::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);  // row g,     keys 2t+8, 2t+9
        pa[kk][3] = Fmt::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);  // row g + 8
    }
    wg::fence();
#pragma unroll
    for (int kk = 0; kk < T::BC / 16; ++kk)
        wg::WgmmaHalf<T::D, Fmt>::rs(o, pa[kk], wg::desc_at<Half>(v, kk * wg::kStep<T::D, Half>), 1);
    wg::commit();
}

// The block's BR rows of Q in the format, in the core-matrix layout of shared memory. Rows past N
// are zeros and never stored. The caller fences for wgmma (fence_proxy_async).
template <class T>
__device__ __forceinline__ void load_q(Half* Qs, const HalfParams& p, int head, int q0) {
    const float* Qh = p.Q + static_cast<size_t>(head) * p.N * T::D;
    for (int i = threadIdx.x; i < T::BR * T::D / 8; i += T::THREADS) {
        int r, c;
        wg::chunk_coords<T::D, Half>(i, r, c);
        float4 a, b;
        load8(Qh, q0 + r, p.N, T::D, c, a, b);
        *reinterpret_cast<uint4*>(Qs + wg::cm_offset<T::BR, Half>(r, c)) = pack8<typename T::Fmt>(a, b);
    }
}

// Grid: x = query blocks (reversed, so the longest causal blocks start first), y = heads, z = KV
// splits. Shared memory: Q [BR×D], then two stages of {K [BC×D], Vᵀ [D×BC]}. The pipeline is
// flash_wgmma.cu's double-buffered one: at the top of tile j everyone is done with tile j-1's
// stage, which thread 0 then refills with tile j+1.
template <class T, bool kCausal>
__global__ void __launch_bounds__(T::THREADS, 1) flash_wgmma_half_kernel(const HalfParams p) {
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
    __trap();  // built for sm_90a only; never launched elsewhere (device_compute_capability)
#else
    extern __shared__ float4 smem_f4[];
    Half* const Qs = reinterpret_cast<Half*>(smem_f4);  // [BR×D]
    Half* const stages = Qs + T::Q_ELEMS;                // [STAGES][STAGE]
    __shared__ uint64_t k_loaded[T::STAGES], v_loaded[T::STAGES];

    const int qblock = gridDim.x - 1 - blockIdx.x;
    const int head = blockIdx.y, split_id = blockIdx.z;
    const int wg = threadIdx.x / kWarpgroup, warp = (threadIdx.x % kWarpgroup) / 32;
    const int lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
    const int q0 = qblock * T::BR;
    const int wg_row0 = q0 + wg * 64;
    const int warp_row0 = wg_row0 + warp * 16;
    const int row0 = warp_row0 + g;  // the thread's rows: row0 and row0 + 8
    int tile_begin, tile_end;
    split_share(visible_key_tiles<kCausal>(p.M, p.N, q0, T::BR, T::BC), p.splits, split_id, tile_begin, tile_end);

    // Tile j lives in stage (j - tile_begin) % 2, whose barriers complete their n-th phase
    // (parity n % 2) with the n-th tile loaded into it. Thread 0 starts the copies.
    const Half* const ops_h = p.ops + static_cast<size_t>(head) * (p.Mpad / T::BC) * T::STAGE;
    auto slot = [&](int j) { return (j - tile_begin) % T::STAGES; };
    auto parity = [&](int j) { return static_cast<uint32_t>(((j - tile_begin) / T::STAGES) & 1); };
    auto stage_of = [&](int j) { return stages + slot(j) * T::STAGE; };
    auto load_tile = [&](int j) {
        const Half* src = ops_h + static_cast<size_t>(j) * T::STAGE;
        bulk::arrive_expect_tx(&k_loaded[slot(j)], T::K_BYTES);
        bulk::copy(stage_of(j), src, T::K_BYTES, &k_loaded[slot(j)]);
        bulk::arrive_expect_tx(&v_loaded[slot(j)], T::V_BYTES);
        bulk::copy(stage_of(j) + T::V_OFFSET, src + T::V_OFFSET, T::V_BYTES, &v_loaded[slot(j)]);
    };
    if (threadIdx.x == 0) {
        for (int st = 0; st < T::STAGES; ++st) {
            bulk::init(&k_loaded[st], 1);
            bulk::init(&v_loaded[st], 1);
        }
        bulk::fence_init();
        if (tile_begin < tile_end) load_tile(tile_begin);
    }
    load_q<T>(Qs, p, head, q0);  // while the first tile loads
    wg::fence_proxy_async();     // Q's stores are read by wgmma (the async proxy)
    const uint64_t q_desc = wg::tile_desc<T::BR>(Qs + wg * 64 * wg::kCoreCols<Half>);

    float o[T::D / 8][4];
    zero(o);
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

    // Every __syncthreads is reached by all warpgroups, also one that skips the tile; the last
    // warpgroup never skips, so every phase of the barriers is waited for before its stage is
    // loaded again.
    for (int j = tile_begin; j < tile_end; ++j) {
        __syncthreads();
        if (threadIdx.x == 0 && j + 1 < tile_end) load_tile(j + 1);
        const int key0 = j * T::BC;
        if (kCausal && key0 > wg_row0 + 63) continue;  // the whole tile is above this warpgroup's rows
        Half* const stage = stage_of(j);
        float s[T::BC / 8][4];
        bulk::wait(&k_loaded[slot(j)], parity(j));
        qk_issue<T>(s, q_desc, wg::tile_desc<T::BC>(stage));  // S = Q Kᵀ
        wg::wait<0>();
        wg::fence_operands(s);
        scale_tile<T::BC>(s, p.scale_log2);
        if (key0 + T::BC > p.M || (kCausal && key0 + T::BC - 1 > warp_row0))
            mask_tile<T::BC, kCausal>(s, key0, p.M, row0, t);
        online_softmax<T::BC, T::D>(s, o, m, l);  // P = exp(S − m), l, O rescaled
        uint32_t pa[T::BC / 16][4];
        bulk::wait(&v_loaded[slot(j)], parity(j));
        pv_issue<T>(o, pa, s, wg::tile_desc<T::D>(stage + T::V_OFFSET));  // O += P V
        wg::wait<0>();
        wg::fence_operands(o);
    }

    float* O = p.O + (static_cast<size_t>(split_id) * p.heads + head) * p.N * T::D;
    float* lse = p.lse + (static_cast<size_t>(split_id) * p.heads + head) * p.N;
    if (p.splits == 1) store_rows<T::D, typename T::Fmt>(o, m, l, O, lse, row0, p.N, t);
    else store_rows<T::D>(o, m, l, O, lse, row0, p.N, t);  // partials: the combine rounds
#endif
}

// ---------------------------------------------------------------------------------------------
// Host side.

// The tile configuration for width D (void: none). Bc 128: a 64×128 S slice per warpgroup keeps
// the softmax's per-tile overhead (max, rescale, barrier) over twice as many keys as Bc 64.
template <int D, class Fmt>
struct HalfConfig {
    using type = void;
};
template <class Fmt> struct HalfConfig<64, Fmt> { using type = HalfTiles<64, 128, 2, Fmt>; };
template <class Fmt> struct HalfConfig<128, Fmt> { using type = HalfTiles<128, 128, 2, Fmt>; };

// Calls f(TypeTag<T>{}, causal) with a's configuration T and causality (std::bool_constant);
// false where there is none.
template <class F>
bool with_config(const FlashArgs& a, F&& f) {
    return with_head_dim(a.d, [&](auto D) {
        return with_half_format(a.precision, [&](auto fmt) {
            return with_flag(a.causal, [&](auto causal) {
                using T = typename HalfConfig<constant_v<decltype(D)>, decltype(fmt)>::type;
                if constexpr (std::is_void_v<T>) {
                    return false;
                } else {
                    f(TypeTag<T>{}, causal);
                    return true;
                }
            });
        });
    });
}

template <class T, bool kCausal>
int blocks_per_sm() {
    static const int blocks = prepare_kernel(reinterpret_cast<const void*>(flash_wgmma_half_kernel<T, kCausal>),
                                             T::THREADS, T::SMEM_BYTES);
    return blocks;
}

// The prepared K and Vᵀ of `heads` heads, in floats (two values to a float; a whole number of
// 16-byte units, so the split partials after them stay aligned).
template <class T>
size_t operand_floats(int heads, int M) {
    return static_cast<size_t>(heads) * (ceil_div(M, T::BC) * T::BC) * T::D;
}

template <class T, bool kCausal>
void launch_tiles(const FlashArgs& a, const KernelPlan& plan, cudaStream_t stream) {
    blocks_per_sm<T, kCausal>();  // raises the shared-memory limit
    const int Mpad = ceil_div(a.M, T::BC) * T::BC;
    const size_t operands = operand_floats<T>(a.heads, a.M);
    StreamWorkspace ws(operands + split_partial_floats(a, plan.splits), stream);
    Half* const ops = reinterpret_cast<Half*>(ws.p);

    convert_keys<T><<<dim3(Mpad / T::BC * kPrepBlocksPerTile<T>, a.heads), kPrepThreads, 0, stream>>>(a.K, ops, a.M, Mpad);
    LAUNCH_CHECK(convert_keys);
    transpose_values<T><<<dim3(Mpad / 64, T::D / 32, a.heads), dim3(32, 8), 0, stream>>>(a.V, ops, a.M, Mpad);
    LAUNCH_CHECK(transpose_values);

    const FlashOutputs out = kernel_outputs(a, plan.splits, ws.p + operands);
    const HalfParams p{a.Q, ops, out.O, out.lse, a.heads, a.N, a.M, Mpad, a.scale * kLog2e, plan.splits};
    flash_wgmma_half_kernel<T, kCausal><<<query_block_grid(a, plan), T::THREADS, T::SMEM_BYTES, stream>>>(p);
    LAUNCH_CHECK(flash_wgmma_half_kernel);
    combine_kv_splits(a, plan.splits, out, stream);
    ws.release();
}

}  // namespace

bool plan_wgmma_half(const FlashArgs& a, int forced_splits, KernelPlan* plan) {
    if (!is_half(a.precision)) return false;
    return with_config(a, [&](auto tag, auto causal) {
        using T = tag_type<decltype(tag)>;
        const int n_tiles = ceil_div(a.M, T::BC);
        const int splits = forced_splits > 0
            ? forced_splits
            : choose_kv_splits(static_cast<long long>(a.heads) * ceil_div(a.N, T::BR),
                               static_cast<long long>(device_sm_count()) * blocks_per_sm<T, constant_v<decltype(causal)>>(),
                               n_tiles);
        *plan = KernelPlan{T::BR, T::BC, clamp_kv_splits(splits, n_tiles), operand_floats<T>(1, a.M) * sizeof(float)};
    });
}

void launch_wgmma_half(const FlashArgs& a, const KernelPlan& plan, cudaStream_t stream) {
    with_config(a, [&](auto tag, auto causal) {
        launch_tiles<tag_type<decltype(tag)>, constant_v<decltype(causal)>>(a, plan, stream);
    });
}

}  // namespace attnstep
