// decode_tma.cu — the split-KV decode kernel on Hopper: decode.cu's tensor-core kernel (the same
// blocks, warps, chunks and arithmetic: decode_parts.cuh) with its keys brought in by tensor
// memory access instead of cp.async. A warp's chunk of K and V is a few box copies issued by one
// lane and counted on the warp's barrier for that stage, where the cp.async pipeline has every lane
// start 16 copies of 16 bytes per chunk. Decode does little arithmetic per byte, so fewer
// instructions per byte read is its speed: on an H100 this kernel reads the cache about 1% faster
// than the cp.async one (docs/performance.md, "Decode").
//
// A chunk must lie in one page (the page size a multiple of the chunk's keys) or be packed keys, so
// that it is consecutive rows of the pool: decode_tma_takes says when. Rows of a chunk outside the
// block's visible keys (a partial first or last chunk) land as whatever the pool holds there; the
// warp zeroes their V rows before P·V reads them (P is 0 there, but 0·inf is NaN), and fences
// those stores before a later copy overwrites them (the copies write in another proxy).
#include "decode_tma.cuh"

#include <cuda.h>

#include "../cuda_check.cuh"
#include "../decode_parts.cuh"
#include "../device.cuh"
#include "bulk_copy.cuh"
#include "tensor_map.cuh"
#include "wgmma.cuh"

namespace attnstep {

namespace {

using namespace decode;

constexpr int kSwizzleAtom = 1024;  // bytes: 8 rows of 128, the 128-byte swizzle's period

// The tile of a chunk in shared memory: each 64-value column block of its C rows (128 bytes a
// row), one after the other, in the 128-byte swizzle the tensor copies write.
template <int D>
struct TmaShape : MmaDims<D> {
    using M = MmaDims<D>;
    static constexpr int kBlocks = D / tma::kRowValues;
    static constexpr int kBlockBytes = M::C * 128;
    static constexpr int kChunk = kBlocks * kBlockBytes;
    static constexpr int kWarpBytes = kStages * 2 * kChunk;
    static constexpr int kQOffset = kWarps * kWarpBytes;
    static constexpr int kRowOffset = kQOffset + M::R * D * 2;
    static constexpr int kSmem = kRowOffset + M::R * 16 + kSwizzleAtom;  // + room to align the base up
    static_assert(kBlockBytes % kSwizzleAtom == 0, "every column block starts on a swizzle atom");
    static_assert(kWarps * M::R * (D + 2) * 4 <= kWarps * kWarpBytes, "the final states fit the chunks' room");
    static __device__ __forceinline__ int offset(int c, int j) {
        return (j / 8) * kBlockBytes + c * 128 + ((j % 8) ^ (c & 7)) * 16;
    }
    struct At {
        __device__ __forceinline__ const char* operator()(const char* chunk, int c, int j) const {
            return chunk + offset(c, j);
        }
    };
};

struct TmaMaps {
    CUtensorMap k, v;
};

template <class Fmt, int D>
__global__ void __launch_bounds__(kThreads) decode_tma_kernel(const DecodeArgs a, const __grid_constant__ TmaMaps maps,
                                                              int tiles) {
#if !defined(__CUDA_ARCH_FEAT_SM90_ALL)
    __trap();  // built for sm_90a only; never launched elsewhere (decode.cu checks the GPU)
#else
    using S = TmaShape<D>;
    constexpr int C = S::C;
    extern __shared__ float4 smem_f4[];
    const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_f4));
    char* const smem = reinterpret_cast<char*>(smem_f4) + (kSwizzleAtom - addr % kSwizzleAtom) % kSwizzleAtom;
    __shared__ uint64_t full[kWarps][kStages];
    uint16_t* q_s = reinterpret_cast<uint16_t*>(smem + S::kQOffset);
    RowInfo* rows_s = reinterpret_cast<RowInfo*>(smem + S::kRowOffset);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
        for (int st = 0; st < kStages; ++st) bulk::init(&full[warp][st], 1);
        bulk::fence_init();
    }
    MmaBlock blk;
    if (!blk.begin<D, C>(a, block_place(a), tiles, q_s, rows_s))  // its __syncthreads publishes the barriers
        return;
    const int mine = blk.mine(warp);
    MmaWarp<Fmt, D> w;
    w.begin(q_s, rows_s, lane);
    char* warp_smem = smem + warp * S::kWarpBytes;

    // Chunk `it` into slot it % kStages, by lane 0: every column block of its C rows of K and V.
    auto load = [&](int it) {
        const int slot = it % kStages;
        if (lane == 0) {
            const int key0 = blk.key0(warp, it, C);
            const int row = static_cast<int>(key_row(a, blk.b, key0));
            char* k_dst = warp_smem + slot * 2 * S::kChunk;
            bulk::arrive_expect_tx(&full[warp][slot], 2 * S::kChunk);
#pragma unroll
            for (int cb = 0; cb < S::kBlocks; ++cb) {
                tma::load(k_dst + cb * S::kBlockBytes, &maps.k, cb * tma::kRowValues, row, blk.t.g, &full[warp][slot]);
                tma::load(k_dst + S::kChunk + cb * S::kBlockBytes, &maps.v, cb * tma::kRowValues, row, blk.t.g,
                          &full[warp][slot]);
            }
        }
    };

    for (int st = 0; st < kStages - 1; ++st)
        if (st < mine) load(st);
    for (int it = 0; it < mine; ++it) {
        if (it + kStages - 1 < mine) load(it + kStages - 1);
        const int slot = it % kStages, key0 = blk.key0(warp, it, C);
        bulk::wait(&full[warp][slot], static_cast<uint32_t>(it / kStages) & 1u);
        char* k_chunk = warp_smem + slot * 2 * S::kChunk;
        if (key0 < blk.lo || key0 + C > blk.hi) {  // a partial chunk: zero the V rows of keys outside
            for (int e = lane; e < C * (D / 8); e += 32) {
                const int c = e / (D / 8), j = e % (D / 8), key = key0 + c;
                if (key < blk.lo || key >= blk.hi)
                    *reinterpret_cast<uint4*>(k_chunk + S::kChunk + S::offset(c, j)) = make_uint4(0, 0, 0, 0);
            }
            wg::fence_proxy_async();
            __syncwarp();
        }
        w.chunk(a, k_chunk, k_chunk + S::kChunk, key0, lane, typename S::At{});
        __syncwarp();
    }
    __syncthreads();  // every warp is past its chunks: their room holds the final states now
    w.save(smem, warp);
    __syncthreads();
    store_merged<D, S::R>(a, blk.t, smem);
#endif
}

template <class Fmt, int D>
void launch(const DecodeArgs& a, cudaStream_t stream) {
    using S = TmaShape<D>;
    const auto kernel = decode_tma_kernel<Fmt, D>;
    static const int fit = prepare_kernel(reinterpret_cast<const void*>(kernel), kThreads, S::kSmem);
    (void)fit;
    const int rows = static_cast<int>(a.kv_stride / D);
    // L2 fetches each 128-byte row a copy reads and no more: with the 256-byte promotion the L2
    // served a quarter more sectors than the step reads, and the step took about 5% longer on an
    // H200 (docs/performance.md, "Decode").
    constexpr auto kPromotion = CU_TENSOR_MAP_L2_PROMOTION_L2_128B;
    const TmaMaps maps{tma::rows_map(a.K, D, rows, a.kv_heads, S::C, 2, kPromotion),
                       tma::rows_map(a.V, D, rows, a.kv_heads, S::C, 2, kPromotion)};
    const int tiles = ((a.heads / a.kv_heads) * a.max_q + S::R - 1) / S::R;
    kernel<<<grid_blocks(a, tiles), kThreads, S::kSmem, stream>>>(a, maps, tiles);
    LAUNCH_CHECK(decode_tma_kernel);
}

template <class Fmt>
void launch_width(const DecodeArgs& a, cudaStream_t stream) {
    if (a.d == 64) launch<Fmt, 64>(a, stream);
    else launch<Fmt, 128>(a, stream);
}

}  // namespace

bool decode_tma_takes(const DecodeArgs& a) {
    if (!is_half(a.precision) || (a.d != 64 && a.d != 128) || a.kv_stride % a.d) return false;
    const int chunk = a.d == 64 ? MmaDims<64>::C : MmaDims<128>::C;
    const long long rows = a.kv_stride / a.d;
    // A chunk is consecutive pool rows; the tensor map's row coordinates are 32-bit.
    return a.page_size % chunk == 0 && rows < (1LL << 31) && reinterpret_cast<uintptr_t>(a.K) % 16 == 0 &&
           reinterpret_cast<uintptr_t>(a.V) % 16 == 0;
}

void decode_tma_split(const DecodeArgs& a, cudaStream_t stream) {
    if (a.precision == Precision::bf16) launch_width<B16>(a, stream);
    else launch_width<H16>(a, stream);
}

}  // namespace attnstep
