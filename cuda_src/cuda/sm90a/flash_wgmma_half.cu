// flash_wgmma_half.cu — FlashAttention forward on Hopper's warpgroup MMA (wgmma, sm_90a) with
// bf16 or fp16 operands and FP32 accumulation (--precision bf16|fp16): O = softmax(scale·Q·Kᵀ
// [causal-masked])·V and lse = log Σ exp(scale·q·k), per head.
//
// FlashAttention-3's structure: the inputs are read as the format's 16-bit values, row-major as the
// caller holds them (FlashArgs::Qh, Kh, Vh), by tensor memory access (tensor_map.cuh) straight into
// shared memory in the 128-byte swizzle, so no pass prepares them. A producer warpgroup streams the
// block's Q and then the K/V tiles into two stages, counted on mbarriers; each consumer warpgroup
// computes 64 query rows: S = Q·Kᵀ (both operands K-major in shared memory), the online softmax in
// FP32 registers (flash_common.cuh), O += P·V (A = P from registers, B = V as it lies, MN-major:
// wgmma's transposed B operand, which 16-bit types have).
//   - A 16-bit wgmma's register A fragment is the S accumulator fragment as it stands, two
//     neighbouring columns to a register (wgmma.cuh), so P needs no permutation.
//   - P is rounded to the format as it is packed (FlashAttention's order: l sums the FP32 weights,
//     only the GEMM operand is rounded), and the P·V products accumulate straight into O: a
//     product of two half values is exact in FP32.
//   - O is stored rounded to the format (the KV-split combine rounds instead when it merges).
//
// The arithmetic, which the verifier's CUDA model bounds (verify/model/kernels.py:
// KERNELS["cuda-wgmma-bf16"] and ["cuda-wgmma-fp16"], with the half pipeline's roundings,
// verify/check/half_rounding.py): half products exact, summed in FP32 by the tensor cores with truncation;
// scale·log2(e) rounded once per head; the exponent c·s − m in one FFMA for a positive scale (m the
// running row max of c·s, rounded once: a rounding fewer than the model allows for), else c·s
// rounded and m subtracted; ex2.approx.ftz; P rounded to the format before P·V; lse =
// (m + log2 l)·ln 2 in FP32; O divided by l (and combined across splits) in FP32, then rounded to
// the format once.
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
#include "../flash_scores.cuh"
#include "../half_format.cuh"
#include "../packed_blocks.cuh"
#include "bulk_copy.cuh"
#include "tensor_map.cuh"
#include "wgmma.cuh"

namespace attnstep {
namespace {

using namespace flash;
using Half = uint16_t;  // one bf16/fp16 value in shared and global memory

constexpr int kWarpgroup = 128;  // threads
constexpr int kSwizzleAtom = 1024;  // bytes: 8 rows of 128 (tensor_map.cuh, wgmma.cuh: sw128_desc)

// The tile configuration: D head width, BC keys per tile, NWG consumer warpgroups (64 query rows
// each), PINGPONG whether they take turns to issue their GEMMs (Turns), Fmt the operand format;
// two K/V stages in shared memory (tile j+1 loads while tile j is computed).
template <int D_, int BC_, int NWG_, bool PINGPONG_, class Fmt_>
struct HalfTiles {
    using Fmt = Fmt_;
    static constexpr int D = D_, BC = BC_, NWG = NWG_, STAGES = 2;
    static constexpr bool PINGPONG = PINGPONG_;
    // The consumer warpgroups, then a producer warpgroup whose one thread issues every copy (a
    // whole warpgroup, so that it can hand its registers to the consumers: setmaxnreg).
    static constexpr int BR = 64 * NWG, CONSUMERS = kWarpgroup * NWG, THREADS = CONSUMERS + kWarpgroup;
    // Registers per thread after the hand-over: the producer keeps the minimum, the consumers
    // share the rest of the 64K register file.
    static constexpr int PRODUCER_REGS = 24;
    static constexpr int CONSUMER_REGS = (65536 / kWarpgroup - PRODUCER_REGS) / NWG / 8 * 8;
    static_assert(CONSUMER_REGS <= 256 && CONSUMER_REGS >= 160, "register hand-over");
    // Shared memory: the block's Q [BR×D], then two stages of K [BC×D] and V [BC×D]. Each tile is
    // D/64 column blocks of 64 values (one tensor copy each), rows of 128 bytes in the swizzle.
    static constexpr int COL_BLOCKS = D / tma::kRowValues;
    static constexpr int Q_ELEMS = BR * D, K_ELEMS = BC * D, V_ELEMS = BC * D;
    static constexpr int STAGE = K_ELEMS + V_ELEMS, V_OFFSET = K_ELEMS;
    static constexpr uint32_t Q_BYTES = Q_ELEMS * sizeof(Half), K_BYTES = K_ELEMS * sizeof(Half),
                              V_BYTES = V_ELEMS * sizeof(Half);
    // + one atom: the dynamic shared memory is aligned up to the swizzle atom in the kernel.
    static constexpr size_t SMEM_BYTES = (static_cast<size_t>(Q_ELEMS) + STAGES * STAGE) * sizeof(Half) + kSwizzleAtom;
    static_assert(D % tma::kRowValues == 0 && BC % 16 == 0, "tiles: whole column blocks and k steps");
    static_assert((64 * tma::kRowValues * sizeof(Half)) % kSwizzleAtom == 0 && (BC * 128) % kSwizzleAtom == 0,
                  "every tile and warpgroup slice starts on a swizzle atom");
    // The opt-in shared-memory limit of sm_90 (227 KB) less the kernel's static barriers; an
    // mbarrier phase counts at most 2^20 - 1 bytes.
    static_assert(SMEM_BYTES + 80 <= 227 * 1024, "shared memory");
    static_assert(Q_BYTES < (1u << 20) && K_BYTES < (1u << 20) && V_BYTES < (1u << 20), "mbarrier transaction count");
};

struct HalfParams {
    float* O;    // [heads][N][D], or the split partials [splits][heads][N][D]
    float* lse;  // [heads][N],    or [splits][heads][N]
    int heads, N, M;
    float scale_log2;  // scale·log2(e): the softmax runs in base 2
    int splits;
    // A packed batch (packed_blocks.cuh): grid.x's blocks in order of work; N and M are then the
    // packed totals, the rows every head's matrices hold. Null: one dense problem.
    const PackedBlock* packed = nullptr;
};

// The block's problem: its query block, its sequence's first query row and key row in the
// matrices, and the sequence's queries and keys (a dense problem's are the whole matrices').
struct BlockProblem {
    int qblock, q_begin, k_begin, N, M;
};
__device__ __forceinline__ BlockProblem block_problem(const HalfParams& p, int work) {
    if (!p.packed) return {work, 0, 0, p.N, p.M};
    const PackedBlock b = p.packed[work];
    return {b.qblock, b.q_begin, b.k_begin, b.n, b.m};
}

// The three inputs as tensor maps (tensor_map.cuh), __grid_constant__ kernel parameters: Q in
// boxes of the block's BR rows, K and V of a tile's BC keys.
struct HalfMaps {
    CUtensorMap q, k, v;
};

using wg::desc_plus;
using wg::k_step_bytes;

// Copies the R rows from `row` of head `head`, every column block, into the tile at dst.
template <class T, int R>
__device__ __forceinline__ void load_rows(Half* dst, const CUtensorMap* map, int row, int head, uint64_t* bar) {
    tma::load_row_blocks<R, T::COL_BLOCKS>(dst, map, row, head, bar);
}

// ---------------------------------------------------------------------------------------------
// The kernel's steps.

// Ping-pong between the consumer warpgroups (FlashAttention-3's scheduling): they take turns to
// issue their tile's GEMMs, in a ring, so that one warpgroup's GEMMs run on the tensor cores while
// the others run their softmax, instead of all issuing at once and then all waiting on the
// exponentials together. Warpgroup w's turn is named barrier 1 + w (0 is __syncthreads'), which
// completes when w syncs on it and its predecessor has arrived: 256 threads. Every warpgroup
// takes the same number of turns (one per tile, and one for the first tile's S), so the ring
// closes; the last warpgroup's last turn passes nothing, which would be an arrival nobody waits for.
template <int NWG>
struct Turns {
    int wg;
    __device__ __forceinline__ void start() const {  // the first warpgroup holds the first turn
        if (wg == 0) arrive(0);
    }
    __device__ __forceinline__ void take() const {
        asm volatile("bar.sync %0, %1;\n" ::"r"(1 + wg), "n"(2 * kWarpgroup) : "memory");
    }
    __device__ __forceinline__ void pass(bool last) const {
        if (!(last && wg == NWG - 1)) arrive((wg + 1) % NWG);
    }
    __device__ __forceinline__ void arrive(int to) const {
        asm volatile("bar.arrive %0, %1;\n" ::"r"(1 + to), "n"(2 * kWarpgroup) : "memory");
    }
};

// The block's query block and head. Grid: x = query blocks, y = heads. Without a mask every block
// has the same work: x runs fastest, so the blocks running at once share a few heads' K and V in
// L2. With the causal mask a block's work grows with its query block, and the blocks go longest
// first (the last to start are the shortest, so the GPU's tail is short) within groups of
// kLptHeads heads, the heads whose K and V the blocks running at once share.
constexpr int kLptHeads = 8;
struct BlockWork {
    int qblock, head;
};
template <bool kCausal>
__device__ __forceinline__ BlockWork block_work(int heads) {
    const int nq = gridDim.x;
    // (Reversed as the causal order is; without the mask the order of a head's blocks is free.)
    if (!kCausal) return {nq - 1 - static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y)};
    const int lin = blockIdx.y * nq + blockIdx.x;
    const int group = lin / (kLptHeads * nq), r = lin % (kLptHeads * nq);
    const int group_heads = min(kLptHeads, heads - group * kLptHeads);
    return {nq - 1 - r / group_heads, group * kLptHeads + r % group_heads};
}

// Issues S(64×BC) = Q_wg·K_jᵀ for the warpgroup's 64 rows as one wgmma group; s is valid after
// the next wg::wait. q, k: the descriptors of the warpgroup's rows of Q and of the stage's K.
template <class T>
__device__ __forceinline__ void qk_issue(float (&s)[T::BC / 8][4], uint64_t q, uint64_t k) {
    wg::fence();
#pragma unroll
    for (int ks = 0; ks < T::D / 16; ++ks)
        wg::WgmmaHalf<T::BC, typename T::Fmt>::ss(s, desc_plus(q, k_step_bytes<T::BR>(ks)),
                                                  desc_plus(k, k_step_bytes<T::BC>(ks)), ks > 0);
    wg::commit();
}

// P(64×BC), the S accumulator fragments after the softmax, as P·V's register A fragments: for keys
// 16kk.., the pair s[2kk], s[2kk+1] rounded to the format, two neighbouring keys to a register.
template <class T>
__device__ __forceinline__ void pack_p(uint32_t (&pa)[T::BC / 16][4], const float (&s)[T::BC / 8][4]) {
    using Fmt = typename T::Fmt;
#pragma unroll
    for (int kk = 0; kk < T::BC / 16; ++kk) {
        pa[kk][0] = Fmt::pack(s[2 * kk][0], s[2 * kk][1]);          // row g,     keys 2t, 2t+1
        pa[kk][1] = Fmt::pack(s[2 * kk][2], s[2 * kk][3]);          // row g + 8
        pa[kk][2] = Fmt::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);  // row g,     keys 2t+8, 2t+9
        pa[kk][3] = Fmt::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);  // row g + 8
    }
}

// Issues O(64×D) += P(64×BC)·V_j as one wgmma group; pa (pack_p) must stay untouched until the
// group completes. v: the descriptor of the stage's V (MN-major); a k step is 16 keys, 16 rows of
// 128 bytes.
template <class T>
__device__ __forceinline__ void pv_issue(float (&o)[T::D / 8][4], const uint32_t (&pa)[T::BC / 16][4], uint64_t v) {
    wg::fence();
#pragma unroll
    for (int kk = 0; kk < T::BC / 16; ++kk)
        wg::WgmmaHalfTransB<T::D, typename T::Fmt>::rs(o, pa[kk], desc_plus(v, kk * 16 * 128), 1);
    wg::commit();
}

// Grid: x = query blocks, y = heads (block_work orders them), z = KV splits. Shared memory: Q [BR×D],
// then two stages of {K [BC×D], V [BC×D]}.
//
// The pipeline, as FlashAttention-3 runs it: a producer warpgroup copies the block's Q (q_full) and
// streams the key tiles into the two stages (tensor copies counted on the stage's k_full/v_full
// barriers), refilling a stage's K and its V each once every consumer warp has released it
// (k_empty, v_empty). K_j is released as soon as S_j has landed, a tile before V_j: K_{j+2} then
// loads while tile j is computed. Within a warpgroup, tile j+1's S = Q·Kᵀ is issued, O takes tile
// j's rescale while it runs, then P_j·V_j is issued, and the softmax of tile j+1 runs while P·V is
// still on the tensor cores. Across warpgroups, either they drift apart freely, one's softmax
// overlapping another's MMAs by chance, or (T::PINGPONG) they issue in turns, which forces that
// overlap (Turns). A warpgroup whose rows are all above a causal tile waits for the tile to land
// and releases it unread (a release ahead of the load would count toward the stage's previous
// phase); it still takes its turns.
//
// kVariant (flash_problem.cuh): the rule's tiles alone (variant_tile_share), the softcap (tanh_approx)
// and ALiBi applied to S before the rule's mask, as far as the exponent's FFMA cannot take them
// (modify_tile_for_exp). A window's warpgroups may start seeing tiles after the block's first: the
// one that skips tile j and sees tile j+1 computes S_{j+1} in tile j's turn, as the loop's visible
// path would have.
template <class T, bool kCausal, bool kPositiveScale, bool kVariant>
__global__ void __launch_bounds__(T::THREADS, 1)
    flash_wgmma_half_kernel(const HalfParams p, const __grid_constant__ HalfMaps maps,
                            const __grid_constant__ VariantArgs va) {
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
    __trap();  // built for sm_90a only; never launched elsewhere (device_compute_capability)
#else
    extern __shared__ float4 smem_f4[];
    // The swizzle's pattern follows address bits, so every tile starts on an atom (SMEM_BYTES
    // leaves room to align up).
    const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem_f4));
    Half* const Qs = reinterpret_cast<Half*>(reinterpret_cast<char*>(smem_f4) +
                                             (kSwizzleAtom - base % kSwizzleAtom) % kSwizzleAtom);  // [BR×D]
    Half* const stages = Qs + T::Q_ELEMS;  // [STAGES][STAGE]
    __shared__ uint64_t q_full, k_full[T::STAGES], v_full[T::STAGES], k_empty[T::STAGES], v_empty[T::STAGES];
    constexpr int kConsumerWarps = T::CONSUMERS / 32;

    // The variant's blocks go longest first where a right bound makes their work uneven, and so do
    // a packed batch's (its list is in order of work).
    const auto [work, head] = !kVariant ? (p.packed ? block_work<true>(p.heads) : block_work<kCausal>(p.heads))
                              : va.v.right != kUnbounded ? block_work<true>(p.heads)
                                                         : block_work<false>(p.heads);
    const BlockProblem bp = block_problem(p, work);
    const int split_id = blockIdx.z;
    const int q0 = bp.qblock * T::BR;
    int tile_begin, tile_end;
    if constexpr (kVariant)
        variant_tile_share(va.v, bp.M, bp.N, q0, T::BR, T::BC, p.splits, split_id, tile_begin, tile_end);
    else
        split_share(visible_key_tiles<kCausal>(bp.M, bp.N, q0, T::BR, T::BC), p.splits, split_id, tile_begin, tile_end);
    // Tile j lives in stage (j - tile_begin) % 2; the n-th tile of a stage completes the n-th
    // phase (parity n % 2) of its full barriers, and its releases the n-th phases of the empty ones.
    auto slot = [&](int j) { return (j - tile_begin) % T::STAGES; };
    auto use = [&](int j) { return (j - tile_begin) / T::STAGES; };
    auto stage_of = [&](int j) { return stages + slot(j) * T::STAGE; };

    if (threadIdx.x == 0) {
        bulk::init(&q_full, 1);
        for (int st = 0; st < T::STAGES; ++st) {
            bulk::init(&k_full[st], 1);
            bulk::init(&v_full[st], 1);
            bulk::init(&k_empty[st], kConsumerWarps);
            bulk::init(&v_empty[st], kConsumerWarps);
        }
        bulk::fence_init();
    }
    __syncthreads();  // the barriers are initialized; the only block-wide barrier

    if (threadIdx.x >= T::CONSUMERS) {  // the producer warpgroup: one thread issues every copy
        wg::release_registers<T::PRODUCER_REGS>();
        if (threadIdx.x == T::CONSUMERS) {
            if (tile_begin < tile_end) {  // an empty split reads nothing (and nobody would wait)
                bulk::arrive_expect_tx(&q_full, T::Q_BYTES);
                load_rows<T, T::BR>(Qs, &maps.q, bp.q_begin + q0, head, &q_full);
            }
            for (int j = tile_begin; j < tile_end; ++j) {
                const uint32_t previous = static_cast<uint32_t>((use(j) - 1) & 1);  // the stage's last use
                if (use(j) > 0) bulk::wait(&k_empty[slot(j)], previous);
                bulk::arrive_expect_tx(&k_full[slot(j)], T::K_BYTES);
                load_rows<T, T::BC>(stage_of(j), &maps.k, bp.k_begin + j * T::BC, head, &k_full[slot(j)]);
                if (use(j) > 0) bulk::wait(&v_empty[slot(j)], previous);
                bulk::arrive_expect_tx(&v_full[slot(j)], T::V_BYTES);
                load_rows<T, T::BC>(stage_of(j) + T::V_OFFSET, &maps.v, bp.k_begin + j * T::BC, head,
                                    &v_full[slot(j)]);
            }
        }
        return;
    }
    wg::claim_registers<T::CONSUMER_REGS>();

    const int wg = threadIdx.x / kWarpgroup, warp = (threadIdx.x % kWarpgroup) / 32;
    const int lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
    const int wg_row0 = q0 + wg * 64;
    const int warp_row0 = wg_row0 + warp * 16;
    const int row0 = warp_row0 + g;  // the thread's rows: row0 and row0 + 8
    const uint64_t q_desc = wg::sw128_desc(Qs + wg * 64 * tma::kRowValues, 16);
    const Turns<T::NWG> turns{wg};
    auto take = [&] {
        if constexpr (T::PINGPONG) turns.take();
    };
    auto pass = [&](bool last) {
        if constexpr (T::PINGPONG) turns.pass(last);
    };
    auto parity = [&](int j) { return static_cast<uint32_t>(use(j) & 1); };
    auto visible = [&](int j) {
        if constexpr (kVariant) return !va.v.none_visible(wg_row0, wg_row0 + 64, j * T::BC, j * T::BC + T::BC);
        return !kCausal || j * T::BC <= wg_row0 + 63;
    };
    auto release_k = [&](int j) {
        if (lane == 0) bulk::arrive(&k_empty[slot(j)]);
    };
    auto release_v = [&](int j) {
        if (lane == 0) bulk::arrive(&v_empty[slot(j)]);
    };

    float o[T::D / 8][4];
    zero(o);
    // alpha: the rescale O owes from the last softmax, taken before the next P·V is issued.
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, alpha[2] = {1.f, 1.f};
    float s[T::BC / 8][4];
    uint32_t pa[T::BC / 16][4];
    // The online softmax of tile j's S (issued by qk_issue, landed): masked, and scaled to base 2
    // within the exponent's FFMA (a positive scale) or before the mask (any other; a negative
    // scale would turn a masked -inf into +inf).
    ScoreMods mods = va.mods;
    if constexpr (kVariant) mods.slope_log2 = va.v.slope(head) * kLog2e;
    auto softmax = [&](float (&s)[T::BC / 8][4], int j) {
        const int key0 = j * T::BC;
        if constexpr (kVariant) {
            const float c = modify_tile_for_exp<T::BC, true>(s, mods, key0, row0, t);
            if (rule_cuts<T::BC>(va.v, key0, bp.M, warp_row0, 16)) mask_tile_rule<T::BC>(s, va.v, key0, bp.M, row0, t);
            softmax_tile<T::BC, true>(s, m, l, alpha, c);
        } else {
            if constexpr (!kPositiveScale) scale_tile<T::BC>(s, p.scale_log2);
            if (key0 + T::BC > bp.M || (kCausal && key0 + T::BC - 1 > warp_row0))
                mask_tile<T::BC, kCausal>(s, key0, bp.M, row0, t);
            softmax_tile<T::BC, kPositiveScale>(s, m, l, alpha, p.scale_log2);
        }
    };
    if (tile_begin < tile_end) {
        bulk::wait(&q_full, 0);  // every warp waits, so no copy is still landing when the block ends
        if constexpr (T::PINGPONG) turns.start();
        if (visible(tile_begin)) {  // the first tile's P
            take();
            bulk::wait(&k_full[slot(tile_begin)], parity(tile_begin));
            qk_issue<T>(s, q_desc, wg::sw128_desc(stage_of(tile_begin), 16));
            pass(false);
            wg::wait<0>();
            wg::fence_operands(s);
            release_k(tile_begin);
            softmax(s, tile_begin);
            pack_p<T>(pa, s);
        } else {
            take();
            pass(false);
        }
    }
    for (int j = tile_begin; j < tile_end; ++j) {
        const bool last = j + 1 == tile_end;
        if (!visible(j)) {  // causal: this and every later tile lie above the warpgroup's rows
            // The variant: a window's tiles may start after this one (the first tile's P then
            // comes here, in this tile's turn).
            // Again two straight paths, each with its own issue and wait.
            take();
            if (kVariant && !last && visible(j + 1)) {
                bulk::wait(&k_full[slot(j + 1)], parity(j + 1));
                qk_issue<T>(s, q_desc, wg::sw128_desc(stage_of(j + 1), 16));  // S_{j+1} = Q K_{j+1}ᵀ
                pass(last);
                bulk::wait(&k_full[slot(j)], parity(j));
                bulk::wait(&v_full[slot(j)], parity(j));
                release_k(j);
                release_v(j);
                wg::wait<0>();
                wg::fence_operands(s);
                release_k(j + 1);
                softmax(s, j + 1);
                pack_p<T>(pa, s);
            } else {
                pass(last);
                bulk::wait(&k_full[slot(j)], parity(j));
                bulk::wait(&v_full[slot(j)], parity(j));
                release_k(j);
                release_v(j);
            }
            continue;
        }
        const uint64_t v = wg::sw128_desc(stage_of(j) + T::V_OFFSET, T::BC * 128);
        // Two straight paths, not one with the issue and the wait each under `if`: ptxas then
        // cannot pair them and serializes every wgmma of the loop.
        if (!last && visible(j + 1)) {
            take();
            bulk::wait(&k_full[slot(j + 1)], parity(j + 1));
            qk_issue<T>(s, q_desc, wg::sw128_desc(stage_of(j + 1), 16));  // S_{j+1} = Q K_{j+1}ᵀ
            rescale_rows<T::D>(o, alpha);  // while S_{j+1} is on the tensor cores
            bulk::wait(&v_full[slot(j)], parity(j));
            pv_issue<T>(o, pa, v);  // O += P_j V_j
            pass(false);
            wg::wait<1>();          // S_{j+1} has landed; P_j V_j may still run
            wg::fence_operands(s);
            release_k(j + 1);
            softmax(s, j + 1);
            wg::wait<0>();
            wg::fence_operands(o);
            release_v(j);
            pack_p<T>(pa, s);
        } else {
            take();
            rescale_rows<T::D>(o, alpha);
            bulk::wait(&v_full[slot(j)], parity(j));
            pv_issue<T>(o, pa, v);
            pass(last);
            wg::wait<0>();
            wg::fence_operands(o);
            release_v(j);
        }
    }

    // A packed block's rows start at its sequence's first: they are rows [0, bp.N) from there.
    const size_t head_rows = (static_cast<size_t>(split_id) * p.heads + head) * p.N + bp.q_begin;
    float* O = p.O + head_rows * T::D;
    float* lse = p.lse + head_rows;
    if (p.splits == 1) store_rows<T::D, typename T::Fmt>(o, m, l, O, lse, row0, bp.N, t);
    else store_rows<T::D>(o, m, l, O, lse, row0, bp.N, t);  // partials: the combine rounds
#endif
}

// ---------------------------------------------------------------------------------------------
// Host side.

// The tile configuration for width D (void: none): the fastest measured on an H100 among Bc 64
// and 128 with two or three consumer warpgroups, with and without ping-pong (docs/journal.md,
// "The half-precision flash forward"). d64: three warpgroups (Br 192) share each K/V tile; d128:
// two, as the 160 registers a thread of three would get cannot hold d128's accumulators beside S
// and P with Bc 128. Both take turns: d128 measured 1.6% faster without them when unmasked but 11%
// slower causal, and a build choosing per mask failed to load its kernels (docs/journal.md).
template <int D, class Fmt>
struct HalfConfig {
    using type = void;
};
template <class Fmt> struct HalfConfig<64, Fmt> { using type = HalfTiles<64, 128, 3, true, Fmt>; };
template <class Fmt> struct HalfConfig<128, Fmt> { using type = HalfTiles<128, 128, 2, true, Fmt>; };

// Calls f(TypeTag<T>{}, causal, variant) with a's configuration T and mask instantiation
// (with_mask_kind: std::bool_constant each); false where there is none.
template <class F>
bool with_config(const FlashArgs& a, F&& f) {
    return with_head_dim(a.d, [&](auto D) {
        return with_half_format(a.precision, [&](auto fmt) {
            return with_mask_kind(a, [&](auto causal, auto variant) {
                return call_with_config<typename HalfConfig<constant_v<decltype(D)>, decltype(fmt)>::type>(f, causal,
                                                                                                            variant);
            });
        });
    });
}

template <class T, bool kCausal, bool kVariant>
int blocks_per_sm() {
    // The variant scales in its own modifications: one instantiation.
    if constexpr (kVariant) return kernel_blocks_per_sm<T, flash_wgmma_half_kernel<T, false, false, true>>();
    // Both scale variants (the same resources); asking raises each one's shared-memory limit.
    kernel_blocks_per_sm<T, flash_wgmma_half_kernel<T, kCausal, false, false>>();
    return kernel_blocks_per_sm<T, flash_wgmma_half_kernel<T, kCausal, true, false>>();
}

template <class T, bool kCausal, bool kVariant>
void launch_tiles(const FlashArgs& a, const KernelPlan& plan, cudaStream_t stream) {
    blocks_per_sm<T, kCausal, kVariant>();  // raises the shared-memory limit (flash_launch checked Qh, Kh, Vh)
    const HalfMaps maps{tma::rows_map(a.Qh, T::D, a.N, a.heads, T::BR), tma::rows_map(a.Kh, T::D, a.M, a.heads, T::BC),
                        tma::rows_map(a.Vh, T::D, a.M, a.heads, T::BC)};
    DevicePackedBlocks packed(a.sequences ? packed_blocks(*a.sequences, T::BR, T::BC, kCausal)
                                          : std::vector<PackedBlock>{},
                              stream);
    if (a.sequences && packed.count == 0) return;  // no sequence has queries
    launch_with_workspace(
        a, plan, 0, stream, [](float*) {},
        [&](float*, const FlashOutputs& out) {
            const HalfParams p{out.O, out.lse, a.heads, a.N, a.M, a.scale * kLog2e, plan.splits, packed.p};
            dim3 grid = query_block_grid(a, plan);
            if (a.sequences) grid.x = packed.count;
            const VariantArgs va = variant_args(a.scale, a.variant);
            if constexpr (kVariant)
                flash_wgmma_half_kernel<T, false, false, true><<<grid, T::THREADS, T::SMEM_BYTES, stream>>>(p, maps, va);
            else if (p.scale_log2 > 0.f)
                flash_wgmma_half_kernel<T, kCausal, true, false><<<grid, T::THREADS, T::SMEM_BYTES, stream>>>(p, maps, va);
            else
                flash_wgmma_half_kernel<T, kCausal, false, false><<<grid, T::THREADS, T::SMEM_BYTES, stream>>>(p, maps, va);
            LAUNCH_CHECK(flash_wgmma_half_kernel);
        });
    packed.release();
}

}  // namespace

bool plan_wgmma_half(const FlashArgs& a, int forced_splits, KernelPlan* plan) {
    if (!is_half(a.precision)) return false;
    if (a.sequences && a.variant.beyond_plain()) return false;  // a packed batch: the plain masks alone
    return with_config(a, [&](auto tag, auto causal, auto variant) {
        using T = tag_type<decltype(tag)>;
        // A packed batch's blocks are its sequences' query blocks: no KV split.
        const int splits = a.sequences ? 1 : plan_kv_splits(a, forced_splits, T::BR, T::BC, [] {
            return blocks_per_sm<T, constant_v<decltype(causal)>, constant_v<decltype(variant)>>();
        });
        *plan = KernelPlan{T::BR, T::BC, splits};
    });
}

void launch_wgmma_half(const FlashArgs& a, const KernelPlan& plan, cudaStream_t stream) {
    with_config(a, [&](auto tag, auto causal, auto variant) {
        launch_tiles<tag_type<decltype(tag)>, constant_v<decltype(causal)>, constant_v<decltype(variant)>>(a, plan,
                                                                                                           stream);
    });
}

}  // namespace attnstep
