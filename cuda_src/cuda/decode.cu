// decode.cu — the split-KV decode kernels and their launcher (decode.cuh).
//
// A block computes one split of one K/V head of one sequence for a tile of R rows: the group's
// query heads times the sequence's queries (a decode step of 1 query and 4 query heads per K/V
// head is one tile of 4 rows), so it reads each key and value of the split once for all of them.
// Its four warps take the split's keys in chunks of C keys (4 KB of K and 4 KB of V each), round
// robin, each with its own pipeline of three chunks in flight and its own online softmax; no block
// barrier until the warps' states are merged at the end. Decode is bound by reading the cache, and
// per warp pipelines keep 2 chunks × 8 KB × 8 warps per SM in flight. A chunk that lies in one
// page is found with one read of the page table, not one per key: decode does so little arithmetic
// per byte that the addressing of its copies counts.
//
// bf16/fp16: the tensor-core kernel (decode_parts.cuh: MmaWarp), its chunks copied by cp.async
// here, or by tensor memory access on Hopper (sm90a/decode_tma.cu) where that kernel takes the
// launch. fp32: the CUDA-core kernel below. Within its chunk the lanes work two ways. Scores:
// LPK = 32/C lanes per key, each a dot product over D/LPK of the dimensions for every row, summed
// across its lanes by shuffles. Values: each lane owns D/32 dimensions of the output for every row
// and reads P from shared memory. The 16-byte pieces of a key's row are XOR-swizzled in shared
// memory so that both reads are free of bank conflicts.
#include "decode.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <string>
#include <type_traits>

#include "../common.h"
#include "cuda_check.cuh"
#include "decode_parts.cuh"
#include "device.cuh"
#include "flash_common.cuh"
#include "flash_dispatch.cuh"
#include "half_format.cuh"
#ifdef ATTNSTEP_HAVE_WGMMA
#include "sm90a/decode_tma.cuh"
#endif

namespace attnstep {

namespace {

using flash::cp_async_16;
using flash::cp_async_commit;
using flash::cp_async_wait;

using namespace decode;

constexpr int kBlocksPerSmTarget = 2;
constexpr int kMinComputeCapability = 80;  // cp.async and the 16-bit mma.sync

// The input formats (F32: how its values read as float32, for the CUDA-core kernel).
struct F32 {
    using bits = float;
    static __device__ __forceinline__ float f(float x) { return x; }
};

template <int Bytes> struct Vec;
template <> struct Vec<16> { using type = uint4; };
template <> struct Vec<8> { using type = uint2; };
template <> struct Vec<4> { using type = unsigned; };
template <> struct Vec<2> { using type = unsigned short; };

// N values of format Fmt at p (N·size 2..16 bytes, aligned to it), as float32.
template <class Fmt, int N>
__device__ __forceinline__ void load_floats(const char* p, float (&out)[N]) {
    using Bits = typename Fmt::bits;
    union {
        typename Vec<N * sizeof(Bits)>::type v;
        Bits b[N];
    } u;
    u.v = *reinterpret_cast<const typename Vec<N * sizeof(Bits)>::type*>(p);
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = Fmt::f(u.b[i]);
}

template <class Fmt, int D, int R>
struct Shape {
    static constexpr int kRowBytes = D * static_cast<int>(sizeof(typename Fmt::bits));
    static constexpr int C = kRowBytes >= 128 ? kChunkBytes / kRowBytes : 32;  // keys per chunk
    static constexpr int LPK = 32 / C;                                          // lanes per key
    static constexpr int kRowPieces = kRowBytes / 16;
    static constexpr int kPieces = kRowPieces / LPK;  // 16-byte pieces of a key per lane
    static constexpr bool kSwizzle = kRowPieces >= 8;
    static constexpr int kPerPiece = 16 / static_cast<int>(sizeof(typename Fmt::bits));
    static constexpr int kVPL = D >= 32 ? D / 32 : 1;  // output dimensions per lane
    static constexpr int kVLanes = D / kVPL;
    static constexpr int kChunk = C * kRowBytes;
    static constexpr int kWarpBytes = kStages * 2 * kChunk;
    // Shared memory: the warps' chunks, then the tile's queries (float32), P per warp, the rows'
    // key ranges, slopes and diagonals. The warps' final states reuse the chunks' room.
    static constexpr int kQOffset = kWarps * kWarpBytes;
    static constexpr int kPOffset = kQOffset + R * D * 4;
    static constexpr int kRowOffset = kPOffset + kWarps * C * R * 4;
    static constexpr int kSmem = kRowOffset + R * 16;
    static_assert(kPieces * LPK == kRowPieces, "a key's row splits evenly over its lanes");
    static_assert(!kSwizzle || kPieces == 8, "the swizzle permutes 8 pieces per lane");
    static_assert(kWarps * R * (D + 2) * 4 <= kWarps * kWarpBytes, "the final states fit the chunks' room");

    // Where 16-byte piece j of key c's row lies: XOR-swizzled within each lane's 8 pieces so that
    // 8 lanes reading the same piece of 8 keys hit different banks.
    static __device__ __forceinline__ int piece(int c, int j) {
        return kSwizzle ? (j ^ ((c * LPK + j / kPieces) & 7)) : j;
    }
};

template <class Fmt, int D, int R>
__global__ void __launch_bounds__(kThreads) decode_split_kernel(const DecodeArgs a, int tiles) {
    using S = Shape<Fmt, D, R>;
    using Bits = typename Fmt::bits;
    extern __shared__ __align__(16) char smem[];
    float* q_s = reinterpret_cast<float*>(smem + S::kQOffset);
    RowInfo* rows_s = reinterpret_cast<RowInfo*>(smem + S::kRowOffset);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float* p_s = reinterpret_cast<float*>(smem + S::kPOffset) + warp * S::C * R;

    const Place place = block_place(a);
    const int b = place.x / tiles;
    const int q0 = a.cu_q[b], n = a.cu_q[b + 1] - q0, m = a.seqlen_k[b], group = a.heads / a.kv_heads;
    const Tile t{place.split, place.g, group, n, q0, place.x % tiles, min(R, group * n - (place.x % tiles) * R)};
    if (t.rows <= 0) return;  // this sequence has fewer tiles than the longest
    const int split = t.split, g = t.g, tile = t.tile, tile_rows = t.rows;
    const int k_lo = split * a.split_size, k_hi = min(m, k_lo + a.split_size);
    describe_rows<R>(a, t, m, k_lo, k_hi, rows_s);
    for (int e = threadIdx.x; e < R * D; e += kThreads) {
        const int r = e / D, rho = tile * R + r;
        q_s[e] = r < tile_rows
                     ? Fmt::f(static_cast<const Bits*>(a.Q)[(static_cast<long long>(t.head(rho)) * a.total_q + t.query(rho)) * D + e % D])
                     : 0.f;
    }
    __syncthreads();
    int range_lo = INT_MAX, range_hi = 0;  // none yet (k_hi < k_lo past a short sequence's keys)
    key_range<R>(rows_s, tile_rows, range_lo, range_hi);
    const int base = range_lo < range_hi ? range_lo / S::C * S::C : 0;
    const int chunks = range_lo < range_hi ? (range_hi - base + S::C - 1) / S::C : 0;
    const int mine = chunks > warp ? (chunks - warp + kWarps - 1) / kWarps : 0;

    const Bits* K = static_cast<const Bits*>(a.K) + g * a.kv_stride;
    const Bits* V = static_cast<const Bits*>(a.V) + g * a.kv_stride;
    char* warp_smem = smem + warp * S::kWarpBytes;
    const int c = lane / S::LPK, part = lane % S::LPK;

    // Chunk `it` of this warp into slot it % kStages: lane (c, part) copies its pieces of key c,
    // zeros for a key outside the range (so that P·V reads 0 there, never stale values).
    auto load = [&](int it) {
        const int key = base + (warp + it * kWarps) * S::C + c;
        const bool valid = key >= range_lo && key < range_hi;
        const long long row = valid ? key_row(a, b, key) : 0;
        char* k_dst = warp_smem + (it % kStages) * 2 * S::kChunk + c * S::kRowBytes;
        char* v_dst = k_dst + S::kChunk;
        const char* k_src = reinterpret_cast<const char*>(K + row * D);
        const char* v_src = reinterpret_cast<const char*>(V + row * D);
#pragma unroll
        for (int t = 0; t < S::kPieces; ++t) {
            const int j = part * S::kPieces + t, at = S::piece(c, j) * 16;
            cp_async_16(k_dst + at, k_src + j * 16, valid);
            cp_async_16(v_dst + at, v_src + j * 16, valid);
        }
    };

    float m_run[R], l_run[R], acc[R][S::kVPL];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        m_run[r] = -INFINITY;
        l_run[r] = 0.f;
#pragma unroll
        for (int e = 0; e < S::kVPL; ++e) acc[r][e] = 0.f;
    }

#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) {
        if (st < mine) load(st);
        cp_async_commit();
    }
    for (int it = 0; it < mine; ++it) {
        if (it + kStages - 1 < mine) load(it + kStages - 1);
        cp_async_commit();
        cp_async_wait<kStages - 1>();
        __syncwarp();
        const char* k_chunk = warp_smem + (it % kStages) * 2 * S::kChunk;
        const char* v_chunk = k_chunk + S::kChunk;
        const int key = base + (warp + it * kWarps) * S::C + c;

        // Scores of key c for every row: this lane's share of the dot products, then its key's lanes'.
        float s[R];
#pragma unroll
        for (int r = 0; r < R; ++r) s[r] = 0.f;
#pragma unroll
        for (int t = 0; t < S::kPieces; ++t) {
            const int j = part * S::kPieces + t;
            float k[S::kPerPiece];
            load_floats<Fmt, S::kPerPiece>(k_chunk + c * S::kRowBytes + S::piece(c, j) * 16, k);
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int e = 0; e < S::kPerPiece; ++e) s[r] = fmaf(q_s[r * D + j * S::kPerPiece + e], k[e], s[r]);
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
            for (int off = 1; off < S::LPK; off <<= 1) s[r] += __shfl_xor_sync(0xffffffffu, s[r], off);
            const RowInfo info = rows_s[r];
            float x = s[r] * a.scale;
            if (a.softcap > 0.f) x = a.softcap * tanhf(x / a.softcap);
            if (a.slopes) x -= info.slope * static_cast<float>(abs(info.diag - key));
            x = key >= info.lo && key < info.hi ? x : -INFINITY;
            float chunk_max = x;
#pragma unroll
            for (int off = S::LPK; off < 32; off <<= 1)
                chunk_max = fmaxf(chunk_max, __shfl_xor_sync(0xffffffffu, chunk_max, off));
            const float m_new = fmaxf(m_run[r], chunk_max);
            const float alpha = m_new == -INFINITY ? 1.f : expf(m_run[r] - m_new);
            const float p = x == -INFINITY ? 0.f : expf(x - m_new);
            m_run[r] = m_new;
            l_run[r] = l_run[r] * alpha + (part == 0 ? p : 0.f);
#pragma unroll
            for (int e = 0; e < S::kVPL; ++e) acc[r][e] *= alpha;
            if (part == 0) p_s[c * R + r] = p;
        }
        __syncwarp();
        // P·V: this lane's output dimensions for every row.
        if (lane < S::kVLanes) {
            const int at = lane * S::kVPL * static_cast<int>(sizeof(Bits));
#pragma unroll 4
            for (int cc = 0; cc < S::C; ++cc) {
                float v[S::kVPL];
                load_floats<Fmt, S::kVPL>(v_chunk + cc * S::kRowBytes + S::piece(cc, at / 16) * 16 + at % 16, v);
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const float p = p_s[cc * R + r];
#pragma unroll
                    for (int e = 0; e < S::kVPL; ++e) acc[r][e] = fmaf(p, v[e], acc[r][e]);
                }
            }
        }
        __syncwarp();
    }
    cp_async_wait<0>();
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], off);
    __syncthreads();  // every warp is past its chunks: their room holds the final states now

    float* m_s = reinterpret_cast<float*>(smem);
    float* l_s = m_s + kWarps * R;
    float* acc_s = l_s + kWarps * R;
    if (lane == 0)
#pragma unroll
        for (int r = 0; r < R; ++r) {
            m_s[warp * R + r] = m_run[r];
            l_s[warp * R + r] = l_run[r];
        }
    if (lane < S::kVLanes)
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int e = 0; e < S::kVPL; ++e) acc_s[(warp * R + r) * D + lane * S::kVPL + e] = acc[r][e];
    __syncthreads();
    store_merged<D, R>(a, Tile{split, g, group, n, q0, tile, tile_rows}, smem);
}

// ---------------------------------------------------------------------------------------------
// The half formats on tensor cores (decode_parts.cuh: MmaWarp), keys brought in by per-warp
// cp.async pipelines: any GPU from compute capability 8.0 (on an older target these compile to
// nothing, and decode_forward refuses the GPU). Hopper takes sm90a/decode_tma.cu where it can.

template <int D>
struct MmaShape : MmaDims<D> {
    using M = MmaDims<D>;
    static constexpr int kRowPieces = M::kRowBytes / 16;
    static constexpr int kChunk = M::C * M::kRowBytes;
    static constexpr int kLoads = M::C * kRowPieces / 32;  // 16-byte pieces each lane copies per chunk
    static constexpr int kWarpBytes = kStages * 2 * kChunk;
    static constexpr int kQOffset = kWarps * kWarpBytes;
    static constexpr int kRowOffset = kQOffset + M::R * D * 2;
    static constexpr int kSmem = kRowOffset + M::R * 16;
    static_assert(kLoads >= 1, "a piece per lane at least");
    static_assert(kWarps * M::R * (D + 2) * 4 <= kWarps * kWarpBytes, "the final states fit the chunks' room");
    // 8 consecutive keys at one piece land in 8 different bank groups (ldmatrix's 8 rows).
    static __device__ __forceinline__ int offset(int c, int j) {
        return c * M::kRowBytes + (kRowPieces >= 8 ? j ^ (c & 7) : j) * 16;
    }
    struct At {
        __device__ __forceinline__ const char* operator()(const char* chunk, int c, int j) const {
            return chunk + offset(c, j);
        }
    };
};

template <class Fmt, int D>
__global__ void __launch_bounds__(kThreads) decode_mma_kernel(const DecodeArgs a, int tiles) {
    using S = MmaShape<D>;
    constexpr int C = S::C;
    extern __shared__ __align__(16) char smem[];
    uint16_t* q_s = reinterpret_cast<uint16_t*>(smem + S::kQOffset);
    RowInfo* rows_s = reinterpret_cast<RowInfo*>(smem + S::kRowOffset);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    MmaBlock blk;
    if (!blk.begin<D, C>(a, block_place(a), tiles, q_s, rows_s)) return;
    const int mine = blk.mine(warp);
    MmaWarp<Fmt, D> w;
    w.begin(q_s, rows_s, lane);

    const uint16_t* K = static_cast<const uint16_t*>(a.K) + blk.t.g * a.kv_stride;
    const uint16_t* V = static_cast<const uint16_t*>(a.V) + blk.t.g * a.kv_stride;
    char* warp_smem = smem + warp * S::kWarpBytes;
    // A chunk within one page (or of packed keys) is C consecutive rows: one table read per chunk.
    const bool one_page = a.page_size % C == 0;
    // Lane l copies pieces l, l + 32, ... of the chunk: whole rows by consecutive lanes; zeros for
    // a key outside the range (so that P·V reads 0 there, never stale values).
    auto load = [&](int it) {
        const int key0 = blk.key0(warp, it, C);
        const long long row0 = one_page && key0 < blk.hi ? key_row(a, blk.b, key0) : 0;
        char* k_dst = warp_smem + (it % kStages) * 2 * S::kChunk;
#pragma unroll
        for (int u = 0; u < S::kLoads; ++u) {
            const int q = lane + 32 * u, c = q / S::kRowPieces, j = q % S::kRowPieces, key = key0 + c;
            const bool valid = key >= blk.lo && key < blk.hi;
            const long long row = valid ? (one_page ? row0 + c : key_row(a, blk.b, key)) : 0;
            const int at = S::offset(c, j);
            cp_async_16(k_dst + at, reinterpret_cast<const char*>(K + row * D) + j * 16, valid);
            cp_async_16(k_dst + S::kChunk + at, reinterpret_cast<const char*>(V + row * D) + j * 16, valid);
        }
    };

#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) {
        if (st < mine) load(st);
        cp_async_commit();
    }
    for (int it = 0; it < mine; ++it) {
        if (it + kStages - 1 < mine) load(it + kStages - 1);
        cp_async_commit();
        cp_async_wait<kStages - 1>();
        __syncwarp();
        const char* k_chunk = warp_smem + (it % kStages) * 2 * S::kChunk;
        w.chunk(a, k_chunk, k_chunk + S::kChunk, blk.key0(warp, it, C), lane, typename S::At{});
        __syncwarp();
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is past its chunks: their room holds the final states now
    w.save(smem, warp);
    __syncthreads();
    store_merged<D, S::R>(a, blk.t, smem);
}

template <class Fmt, int D>
void launch_mma(const DecodeArgs& a, cudaStream_t stream) {
    using S = MmaShape<D>;
    const auto kernel = decode_mma_kernel<Fmt, D>;
    static const int fit = prepare_kernel(reinterpret_cast<const void*>(kernel), kThreads, S::kSmem);
    (void)fit;
    const int tiles = ((a.heads / a.kv_heads) * a.max_q + S::R - 1) / S::R;
    kernel<<<grid_blocks(a, tiles), kThreads, S::kSmem, stream>>>(a, tiles);
    LAUNCH_CHECK(decode_mma_kernel);
}

template <class Fmt, int D, int R>
void launch(const DecodeArgs& a, cudaStream_t stream) {
    using S = Shape<Fmt, D, R>;
    const auto kernel = decode_split_kernel<Fmt, D, R>;
    static const int fit = prepare_kernel(reinterpret_cast<const void*>(kernel), kThreads, S::kSmem);
    (void)fit;
    const int group = a.heads / a.kv_heads;
    const int tiles = (group * a.max_q + R - 1) / R;
    kernel<<<grid_blocks(a, tiles), kThreads, S::kSmem, stream>>>(a, tiles);
    LAUNCH_CHECK(decode_split_kernel);
}

template <class Fmt, int D>
void launch_rows(const DecodeArgs& a, cudaStream_t stream) {
    if constexpr (!std::is_same_v<Fmt, F32>) launch_mma<Fmt, D>(a, stream);
    else if ((a.heads / a.kv_heads) * a.max_q <= kSmallTile) launch<Fmt, D, kSmallTile>(a, stream);
    else launch<Fmt, D, kLargeTile>(a, stream);
}

template <class Fmt>
void launch_width(const DecodeArgs& a, cudaStream_t stream) {
    switch (a.d) {
        case 16: return launch_rows<Fmt, 16>(a, stream);
        case 32: return launch_rows<Fmt, 32>(a, stream);
        case 64: return launch_rows<Fmt, 64>(a, stream);
        case 128: return launch_rows<Fmt, 128>(a, stream);
    }
    fail(kExitInternal, where(__FILE__, __LINE__) + ": decode_forward: no kernel for d=" + std::to_string(a.d));
}

int tile_rows_of(const DecodeArgs& a) {
    if (is_half(a.precision)) return MmaShape<16>::R;
    return (a.heads / a.kv_heads) * a.max_q <= kSmallTile ? kSmallTile : kLargeTile;
}

// The split stages from the kernel's layout to the stage layout: one thread per element.
__global__ void split_stage_layout(const float* O_part, const float* lse_part, float* split_O, float* split_lse,
                                   long long rows, int d, int splits) {
    const long long idx = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= static_cast<long long>(splits) * rows * (d + 1)) return;
    const long long per_split = rows * (d + 1);
    const int s = static_cast<int>(idx / per_split);
    const long long within = idx % per_split, row = within / (d + 1);
    const int col = static_cast<int>(within % (d + 1));
    if (col < d) split_O[(row * splits + s) * d + col] = O_part[(s * rows + row) * d + col];
    else split_lse[row * splits + s] = lse_part[s * rows + row];
}

// Hopper's kernel where it takes the launch (sm90a/decode_tma.cu): whether it ran.
bool ran_tma(const DecodeArgs& a, cudaStream_t stream) {
#ifdef ATTNSTEP_HAVE_WGMMA
    if (device_compute_capability() != 90 || !decode_tma_takes(a)) return false;
    decode_tma_split(a, stream);
    return true;
#else
    (void)a;
    (void)stream;
    return false;
#endif
}

}  // namespace

bool decode_supported(int d) { return d == 16 || d == 32 || d == 64 || d == 128; }

int decode_default_split_size(const DecodeArgs& a) {
    constexpr int kMinSplit = 256;  // keys: a split of fewer costs its partials more than it saves
    const int R = tile_rows_of(a);
    const long long tiles = (static_cast<long long>(a.heads / a.kv_heads) * a.max_q + R - 1) / R;
    const long long blocks = std::max(1LL, static_cast<long long>(a.batch) * tiles * a.kv_heads);
    // Split only until the blocks fill the GPU's resident slots once: on an H100 (B 64, Hk 8, d128
    // bf16) more splits measured slower (docs/performance.md, "Decode").
    const long long slots = static_cast<long long>(kBlocksPerSmTarget) * device_sm_count();
    const long long splits = std::max(1LL, (slots + blocks - 1) / blocks);
    const long long size = (std::max(1, a.max_k) + splits - 1) / splits;
    return static_cast<int>(std::max<long long>(kMinSplit, (size + kMinSplit - 1) / kMinSplit * kMinSplit));
}

int decode_tile_rows(Precision) { return kLargeTile; }

int decode_chunk_keys(Precision p, int d) {
    const int row_bytes = d * (is_half(p) ? 2 : 4);
    return row_bytes >= (is_half(p) ? 256 : 128) ? kChunkBytes / row_bytes : 32;
}

const char* decode_kernel_name(Precision p) {
    switch (p) {
        case Precision::bf16: return "cuda-decode-bf16";
        case Precision::fp16: return "cuda-decode-fp16";
        default: return "cuda-decode-fp32";
    }
}

// More splits than the keys need are allowed: a sequence of a packed case shorter than the longest
// has its last splits empty (lse −inf, output 0), as the case's S counts them.
void decode_forward(const DecodeArgs& a, cudaStream_t stream) {
    if (a.heads <= 0 || a.kv_heads <= 0 || a.heads % a.kv_heads || a.batch <= 0 || a.split_size <= 0 ||
        a.splits < split_count(a.max_k, a.split_size))
        fail(kExitInternal, where(__FILE__, __LINE__) + ": decode_forward: inconsistent arguments (heads=" +
                                std::to_string(a.heads) + " kv_heads=" + std::to_string(a.kv_heads) +
                                " split_size=" + std::to_string(a.split_size) + " splits=" + std::to_string(a.splits) + ")");
    const long long group_rows = static_cast<long long>(a.heads / a.kv_heads) * a.max_q;
    if (!decode_grid_fits(a.batch, group_rows, tile_rows_of(a), a.splits, a.kv_heads))
        fail(kExitInternal, where(__FILE__, __LINE__) + ": decode_forward: " + std::to_string(a.batch) +
                                " sequences of up to " + std::to_string(a.max_q) + " queries, " +
                                std::to_string(a.kv_heads) + " K/V heads and " + std::to_string(a.splits) +
                                " splits are more blocks than a grid has");
    if (device_compute_capability() < kMinComputeCapability)
        fail(kExitBadInput, "--split-size: the CUDA split kernel needs compute capability 8.0 or newer (cp.async, "
                            "mma.sync), this GPU has " + std::to_string(device_compute_capability() / 10) + "." +
                                std::to_string(device_compute_capability() % 10),
             "use --backend cpu, which computes the split stages");
    if (a.total_q > 0) {
        const bool split_stages = a.split_O && a.split_lse;
        DecodeArgs k = a;  // one split without its stages: the blocks store O and lse themselves
        k.combined = a.splits == 1 && !split_stages;
        if (k.combined) {
            k.O_part = a.O;
            k.lse_part = a.lse;
        }
        if (!ran_tma(k, stream)) {
            if (a.precision == Precision::bf16) launch_width<B16>(k, stream);
            else if (a.precision == Precision::fp16) launch_width<H16>(k, stream);
            else launch_width<F32>(k, stream);
        }
        if (k.combined) return;
        const long long rows = static_cast<long long>(a.heads) * a.total_q;
        if (split_stages) {
            constexpr int kLayoutThreads = 256;
            const long long n = rows * a.splits * (a.d + 1);
            split_stage_layout<<<static_cast<unsigned>((n + kLayoutThreads - 1) / kLayoutThreads), kLayoutThreads, 0,
                                 stream>>>(a.O_part, a.lse_part, a.split_O, a.split_lse, rows, a.d, a.splits);
            LAUNCH_CHECK(split_stage_layout);
        }
        combine_splits(a.O_part, a.lse_part, a.O, a.lse, static_cast<long long>(a.heads) * a.total_q, a.d, a.splits,
                       a.precision, stream);
    }
}

}  // namespace attnstep
