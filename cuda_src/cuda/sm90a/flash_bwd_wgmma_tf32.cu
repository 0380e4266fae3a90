// flash_bwd_wgmma_tf32.cu — FlashAttention-2 backward on Hopper's warpgroup MMA (wgmma, sm_90a)
// on TF32 tensor cores: --precision tf32 (one product of TF32 operands) and the default fp32
// (3xTF32, FP32-accurate), in the deterministic two-kernel form of flash_bwd.cu.
//
// The kernels are flash_bwd_wgmma_kernels.cuh's with TF32 operands (Tf32Ops). TF32 wgmma reads
// both shared-memory operands K-major only, so the second GEMMs' B operands (dO and Q for dV and
// dK, K for dQ, each with the streamed rows as the reduction) come from transposed copies. This
// file holds the preparation pass that writes them, and the launch:
//   0. Q, K, V and dO rounded to TF32 (nearest, ties away, as flash_bwd.cu's operands; fp32: split
//      into hi and lo parts as flash::split does, each part a copy), each as it lies and, for Q, dO
//      and K, transposed ([head][d][rows padded], zeros past the rows) with the rows permuted within
//      each 8 as flash::kperm says; per query row D = rowsum(dO∘O) of the FP32 values and lse·log2 e,
//      padded to whole query blocks (+inf and 0 past N: P = 0).
//   1. dK/dV kernel: tf32 d64, 128 keys a block (two consumer warpgroups), query tiles of 64 rows;
//      tf32 d128 and fp32 d64, 64 keys (one consumer warpgroup), tiles of 32 rows.
//   2. dQ kernel: the transpose (query rows a block, key tiles).
// Shared memory: the owned K and V (Q and dO) and two stages of the streamed Q, dO, Qᵀ, dOᵀ (the dQ
// kernel: K, V, Kᵀ): 64 KB and two of 64 KB at tf32, both widths; at fp32 the two parts of each
// double the bytes a row, so d64 takes the half-width tiles (64 KB and two of 64 KB), and d128, whose
// owned rows' parts alone would fill 128 KB, has no tiles here (it runs flash_bwd.cu's kernels).
//
// The arithmetic, the verifier's CUDA model of a TF32 and a 3xTF32 flash kernel
// (verify/model/kernels.py): TF32 products exact in FP32 (3xTF32: lo·hi, hi·lo and hi·hi, the
// three per k step of 8), summed by the tensor cores with truncation; scale·log2 e and lse·log2 e
// each rounded once, the exponent one FFMA, ex2.approx.ftz; P and dS rounded to TF32 (split, at
// fp32) as GEMM operands, dS = P·(dP − D) in FP32; dK and dQ times the scale once at the end.
//
// Build: sm_90a only (CMakeLists.txt, the attnstep_sm90a object library); resources:
//   nvcc -gencode=arch=compute_90a,code=sm_90a -std=c++17 -Icuda_src -Xptxas -v -c cuda_src/cuda/sm90a/flash_bwd_wgmma_tf32.cu
// Time / check: build/main --bench --pass backward --precision tf32 --batch 4 --heads 16 --seq-q 4096 --seq-k 4096 --d 64 --check
#include "flash_bwd_wgmma_tf32.cuh"

#include <algorithm>
#include <cstdint>

#include "../cuda_check.cuh"
#include "../device.cuh"
#include "../flash_common.cuh"
#include "../flash_dispatch.cuh"
#include "flash_bwd_wgmma_kernels.cuh"

namespace attnstep {
namespace {

using namespace flash;
using namespace wgbwd;

// tf32 d64: two consumer warpgroups (128 keys or rows a block), tiles of 64 rows. tf32 d128: the
// owned rows' 64 KB a warpgroup and four streamed matrices a stage leave room for one warpgroup and
// tiles of 32; fp32 d64 likewise (each value two parts).
template <int D, bool kThree>
struct Tf32Config;
template <> struct Tf32Config<64, false> { using type = BwdTiles<64, 2, 64, Tf32Ops<false>>; };
template <> struct Tf32Config<128, false> { using type = BwdTiles<128, 1, 32, Tf32Ops<false>>; };
template <> struct Tf32Config<64, true> { using type = BwdTiles<64, 1, 32, Tf32Ops<true>>; };

// Calls f(TypeTag<T>{}) with a's tiles; false for a precision or width without them.
template <class F>
bool with_tiles(const FlashBwdArgs& a, F&& f) {
    if (a.precision == Precision::tf32 && a.d == 64) f(TypeTag<Tf32Config<64, false>::type>{});
    else if (a.precision == Precision::tf32 && a.d == 128) f(TypeTag<Tf32Config<128, false>::type>{});
    else if (a.precision == Precision::fp32 && a.d == 64) f(TypeTag<Tf32Config<64, true>::type>{});
    else return false;
    return true;
}

// x's part `part` of kParts (flash::split: hi = tf32(x), lo = tf32(x − hi)).
template <int kParts>
__device__ __forceinline__ float tf32_part(float x, int part) {
    uint32_t hi, lo = 0;
    flash::split<kParts == 2>(x, hi, lo);
    return __uint_as_float(part == 0 ? hi : lo);
}

__device__ __forceinline__ float4 as_float4(const uint32_t (&v)[4]) {
    return make_float4(__uint_as_float(v[0]), __uint_as_float(v[1]), __uint_as_float(v[2]), __uint_as_float(v[3]));
}

// x's TF32 parts, four at a time: hi of element i at out[i], lo (two parts) at out[n + i]; n = 4·n4,
// a multiple of 4 (d is).
template <int kParts>
__global__ void __launch_bounds__(256) split_tf32_kernel(const float4* __restrict__ x, float4* __restrict__ out, size_t n4) {
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n4; i += size_t(gridDim.x) * blockDim.x) {
        uint32_t hi[4], lo[4];
        flash::split4<kParts == 2>(x[i], hi, lo);
        out[i] = as_float4(hi);
        if constexpr (kParts == 2) out[n4 + i] = as_float4(lo);
    }
}

// xT[part][h][c][p] = part `part` of x[h][8·(p/8) + kperm(p%8)][c] for p < pad (0 for rows >= rows): a
// 32-row × 32-column block per block of (32, 8) threads, through shared memory; reads and writes
// coalesced.
template <int kParts>
__global__ void __launch_bounds__(256) transpose_tf32_kernel(const float* __restrict__ x, float* __restrict__ xT,
                                                             int rows, int pad, int d, int heads) {
    __shared__ float tile[32][33];  // +1: the column reads below spread over the banks
    const int row0 = blockIdx.x * 32, col0 = blockIdx.y * 32;
    for (int h = blockIdx.z; h < heads; h += gridDim.z) {
        const float* xh = x + static_cast<size_t>(h) * rows * d;
        for (int y = threadIdx.y; y < 32; y += 8) {
            const int r = row0 + y;
            tile[y][threadIdx.x] = r < rows ? xh[static_cast<size_t>(r) * d + col0 + threadIdx.x] : 0.f;
        }
        __syncthreads();
        const int p = threadIdx.x, src = (p & ~7) + kperm(p & 7);
        const size_t part_floats = static_cast<size_t>(heads) * d * pad;
        for (int y = threadIdx.y; y < 32; y += 8)
#pragma unroll
            for (int part = 0; part < kParts; ++part)
                xT[part * part_floats + (static_cast<size_t>(h) * d + col0 + y) * pad + row0 + p] =
                    tf32_part<kParts>(tile[src][y], part);
        __syncthreads();
    }
}

// The workspace of a launch, in floats, each part a multiple of 4 (16-byte aligned): Q, dO, K, V
// rounded (or split: T::PARTS copies each); Qᵀ, dOᵀ, Kᵀ likewise; lse₂ and D.
template <class T>
struct Workspace {
    size_t q, k, qT, kT, rows;  // one part of each
    Workspace(const FlashBwdArgs& a, int heads)
        : q(static_cast<size_t>(heads) * a.N * a.d), k(static_cast<size_t>(heads) * a.M * a.d),
          qT(static_cast<size_t>(heads) * a.d * padded_rows<T>(a.N)), kT(static_cast<size_t>(heads) * a.d * padded_rows<T>(a.M)),
          rows(static_cast<size_t>(heads) * padded_rows<T>(a.N)) {}
    size_t floats() const { return T::PARTS * (2 * q + 2 * k + 2 * qT + kT) + 2 * rows; }
};

template <int kParts>
void launch_split(const float* x, float* out, size_t n, cudaStream_t stream) {
    const size_t n4 = n / 4;
    const int blocks = static_cast<int>(std::min<size_t>((n4 + 255) / 256, 32ull * device_sm_count()));
    split_tf32_kernel<kParts><<<std::max(blocks, 1), 256, 0, stream>>>(reinterpret_cast<const float4*>(x),
                                                                       reinterpret_cast<float4*>(out), n4);
    LAUNCH_CHECK(split_tf32_kernel);
}

template <int kParts>
void launch_transpose(const float* x, float* xT, int rows, int pad, int d, int heads, cudaStream_t stream) {
    const dim3 grid(pad / 32, d / 32, std::min(heads, kMaxGridYZ));
    transpose_tf32_kernel<kParts><<<grid, dim3(32, 8), 0, stream>>>(x, xT, rows, pad, d, heads);
    LAUNCH_CHECK(transpose_tf32_kernel);
}

template <class T, bool kCausal>
void launch_tiles(const FlashBwdArgs& a, cudaStream_t stream) {
    const int n_pad = padded_rows<T>(a.N), m_pad = padded_rows<T>(a.M);
    const Workspace<T> sizes(a, a.heads);
    StreamWorkspace ws(sizes.floats(), stream);
    constexpr int P = T::PARTS;  // each copy's parts lie one after the other, as heads [0, P·heads)
    float* const Qr = ws.p;
    float* const dOr = Qr + P * sizes.q;
    float* const Kr = dOr + P * sizes.q;
    float* const Vr = Kr + P * sizes.k;
    float* const QT = Vr + P * sizes.k;
    float* const dOT = QT + P * sizes.qT;
    float* const KT = dOT + P * sizes.qT;
    float* const lse2 = KT + P * sizes.kT;
    float* const Drow = lse2 + sizes.rows;
    launch_split<P>(a.Q, Qr, sizes.q, stream);
    launch_split<P>(a.dO, dOr, sizes.q, stream);
    launch_split<P>(a.K, Kr, sizes.k, stream);
    launch_split<P>(a.V, Vr, sizes.k, stream);
    launch_transpose<P>(a.Q, QT, a.N, n_pad, T::D, a.heads, stream);
    launch_transpose<P>(a.dO, dOT, a.N, n_pad, T::D, a.heads, stream);
    launch_transpose<P>(a.K, KT, a.M, m_pad, T::D, a.heads, stream);
    const long long rows = static_cast<long long>(a.heads) * n_pad;
    const int blocks = static_cast<int>(std::min<long long>((rows + 7) / 8, 64LL * device_sm_count()));
    rows_kernel<Fp32><<<blocks, 256, 0, stream>>>(a.dO, a.O, a.lse, lse2, Drow, nullptr, rows, a.N, n_pad, a.d);
    LAUNCH_CHECK(rows_kernel);
    constexpr int kF = sizeof(float);
    const int ph = P * a.heads;  // the maps' heads: every part
    const CUtensorMap qT = tma::rows_map(QT, n_pad, T::D, ph, T::D, kF);
    const CUtensorMap dOT_map = tma::rows_map(dOT, n_pad, T::D, ph, T::D, kF);
    const BwdMaps by_keys{tma::rows_map(Qr, T::D, a.N, ph, T::STREAM, kF), tma::rows_map(Kr, T::D, a.M, ph, T::OWN, kF),
                          tma::rows_map(Vr, T::D, a.M, ph, T::OWN, kF), tma::rows_map(dOr, T::D, a.N, ph, T::STREAM, kF),
                          qT, dOT_map, CUtensorMap{}};
    const BwdMaps by_rows{tma::rows_map(Qr, T::D, a.N, ph, T::OWN, kF), tma::rows_map(Kr, T::D, a.M, ph, T::STREAM, kF),
                          tma::rows_map(Vr, T::D, a.M, ph, T::STREAM, kF), tma::rows_map(dOr, T::D, a.N, ph, T::OWN, kF),
                          CUtensorMap{}, CUtensorMap{}, tma::rows_map(KT, m_pad, T::D, ph, T::D, kF)};
    launch_kernels<T, kCausal>(a, by_keys, by_rows, lse2, Drow, n_pad, stream);
    ws.release();
}

}  // namespace

bool wgmma_tf32_backward_takes(const FlashBwdArgs& a) {
    return !a.sequences && !a.variant.beyond_plain() && with_tiles(a, [](auto) {});
}

void wgmma_tf32_backward_tiles(const FlashBwdArgs& a, int* rows, int* keys) {
    with_tiles(a, [&](auto tag) {
        using T = tag_type<decltype(tag)>;
        *rows = T::STREAM, *keys = T::OWN;
    });
}

size_t wgmma_tf32_backward_workspace_bytes_per_head(const FlashBwdArgs& a) {
    size_t bytes = 0;
    with_tiles(a, [&](auto tag) { bytes = Workspace<tag_type<decltype(tag)>>(a, 1).floats() * sizeof(float) + 16; });
    return bytes;
}

void wgmma_tf32_backward(const FlashBwdArgs& a, cudaStream_t stream) {
    if (!aligned16(a.Q) || !aligned16(a.K) || !aligned16(a.V) || !aligned16(a.dO))
        fail(kExitInternal, where(__FILE__, __LINE__) + ": the TF32 flash backwards read Q, K, V and dO 16 bytes at a time "
                                                        "and need them 16-byte aligned");
    with_tiles(a, [&](auto tag) {
        using T = tag_type<decltype(tag)>;
        if (a.causal) launch_tiles<T, true>(a, stream);
        else launch_tiles<T, false>(a, stream);
    });
}

}  // namespace attnstep
