// kernels.cu — the memory-bound stage kernels of the CUDA backend: transpose (KT), scale + causal
// mask (QK_scaled) and the NaN poison fill; the row softmax (attention_weights) is in softmax.cu.
// Checked on a GPU by scripts/gpu_check.sh, which compares every stage with the CPU backend and
// float64 NumPy.
//
// Arithmetic the verifier assumes of them (verify/model/kernels.py, the CUDA model of every
// cuda-* flash_kernel): KT is an exact copy; QK_scaled is one FP32 product per element (x·scale,
// rounded once).
//
// Each kernel aims at device-to-device copy bandwidth (bytes read + written): 16-byte float4
// accesses where alignment allows, with a scalar path for odd widths, and several independent
// loads in flight per thread (docs/journal.md has the measured fractions):
//   transpose4_kernel   rows and cols multiples of 4: a 64×32 tile (128×16 when cols <= 16) moved
//                       with float4 loads and stores, 2 of each in flight per thread.
//   transpose_kernel    any shape: 32×32 scalar tile (padded: no bank conflicts), 4 loads per
//                       thread; the fallback for widths not divisible by 4.
//   scale_mask_kernel   flat float4 over the whole buffer (any M: rows may straddle a vector), 4
//                       vectors in flight per thread; one index division per vector, only when causal.
#include "kernels.cuh"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "cuda_check.cuh"
#include "device.cuh"
#include "warp.cuh"

namespace attnstep {

namespace {

// ---------------------------------------------------------------------------------------------
// Transpose
// ---------------------------------------------------------------------------------------------
constexpr int kTile = 32;       // a kTile×kTile tile per block
constexpr int kTileRows = 8;    // threads per block: kTile × kTileRows, each moves kTile/kTileRows

// float4 version. A block moves a kT4Rows×kT4Cols tile of `in`: each thread loads float4s along
// an input row and stores float4s along an output row, so both global sides are 16-byte accesses.
// Shared memory holds the tile already transposed, sm[c][r], padded to kT4Rows + 1: the scalar
// stores of a load phase (lanes: 8 column groups × 4 rows) then hit 32 different banks; the
// scalar reads of a store phase have at most a 2-way conflict.
// kT4Rows × kT4Cols: 64 × 32, or 128 × 16 for narrow matrices (d_k = 16) so no thread idles.
constexpr int kT4Threads = 256;

template <int kT4Rows, int kT4Cols>
__global__ void __launch_bounds__(kT4Threads)
transpose4_kernel(const float* __restrict__ in, float* __restrict__ out, int heads, int rows, int cols) {
    __shared__ float sm[kT4Cols][kT4Rows + 1];
    constexpr int kInVecsPerRow = kT4Cols / 4;    // float4s per input row of the tile
    constexpr int kOutVecsPerRow = kT4Rows / 4;   // float4s per output row of the tile
    constexpr int kVecs = kT4Rows * kT4Cols / 4;  // float4s per tile, each way
    const int r0 = blockIdx.x * kT4Rows, c0 = blockIdx.y * kT4Cols;
    for (int h = blockIdx.z; h < heads; h += gridDim.z) {
        const float* src = in + static_cast<size_t>(h) * rows * cols;
        float* dst = out + static_cast<size_t>(h) * rows * cols;
        float4 v[kVecs / kT4Threads];
#pragma unroll
        for (int k = 0; k < kVecs / kT4Threads; ++k) {  // all loads first: several in flight
            const int e = threadIdx.x + k * kT4Threads;
            const int r = r0 + e / kInVecsPerRow, c = c0 + (e % kInVecsPerRow) * 4;
            if (r < rows && c < cols) v[k] = *reinterpret_cast<const float4*>(src + static_cast<size_t>(r) * cols + c);
        }
#pragma unroll
        for (int k = 0; k < kVecs / kT4Threads; ++k) {
            const int e = threadIdx.x + k * kT4Threads;
            const int r = e / kInVecsPerRow, c = (e % kInVecsPerRow) * 4;
            sm[c + 0][r] = v[k].x;
            sm[c + 1][r] = v[k].y;
            sm[c + 2][r] = v[k].z;
            sm[c + 3][r] = v[k].w;
        }
        __syncthreads();  // the whole tile is in shared memory before any thread reads it across
#pragma unroll
        for (int k = 0; k < kVecs / kT4Threads; ++k) {
            const int e = threadIdx.x + k * kT4Threads;
            const int oc = e / kOutVecsPerRow, orr = (e % kOutVecsPerRow) * 4;  // tile row in out, col
            const int grow = c0 + oc, gcol = r0 + orr;
            if (grow < cols && gcol < rows) {
                const float4 w = make_float4(sm[oc][orr], sm[oc][orr + 1], sm[oc][orr + 2], sm[oc][orr + 3]);
                *reinterpret_cast<float4*>(dst + static_cast<size_t>(grow) * rows + gcol) = w;
            }
        }
        __syncthreads();  // every read of the tile is done before the next head overwrites it
    }
}

// Grid: x over row tiles of `in` (the long dimension, M for K), y over column tiles, z over heads
// (grid-stride, so any number of heads fits).
__global__ void transpose_kernel(const float* __restrict__ in, float* __restrict__ out, int heads,
                                 int rows, int cols) {
    __shared__ float tile[kTile][kTile + 1];  // +1: column reads hit 32 different banks
    const int r0 = blockIdx.x * kTile, c0 = blockIdx.y * kTile;
    for (int h = blockIdx.z; h < heads; h += gridDim.z) {
        const float* src = in + static_cast<size_t>(h) * rows * cols;
        float* dst = out + static_cast<size_t>(h) * rows * cols;
        const int c = c0 + threadIdx.x;
#pragma unroll
        for (int i = 0; i < kTile; i += kTileRows) {
            const int r = r0 + threadIdx.y + i;
            if (r < rows && c < cols) tile[threadIdx.y + i][threadIdx.x] = src[static_cast<size_t>(r) * cols + c];
        }
        __syncthreads();  // the whole tile is loaded before any thread reads a column of it
        const int oc = r0 + threadIdx.x;  // output column = input row
#pragma unroll
        for (int i = 0; i < kTile; i += kTileRows) {
            const int orow = c0 + threadIdx.y + i;  // output row = input column
            if (orow < cols && oc < rows) dst[static_cast<size_t>(orow) * rows + oc] = tile[threadIdx.x][threadIdx.y + i];
        }
        __syncthreads();  // every read of the tile is done before the next head overwrites it
    }
}

// ---------------------------------------------------------------------------------------------
// Scale + causal mask
// ---------------------------------------------------------------------------------------------
constexpr int kScaleThreads = 256;
constexpr int kScaleUnroll = 4;  // float4 vectors in flight per thread

// Element e of the flat buffer lies in row (e / M) % N and column e % M of its head. `r` and `c`
// are that position for the first element; they advance with wrap-around for the next ones.
template <typename Idx>
struct MaskCursor {
    Idx r, c;
    __device__ MaskCursor(Idx e, Idx N, Idx M) {
        const Idx row = e / M;
        c = e - row * M;
        r = row % N;
    }
    __device__ void next(Idx N, Idx M) {
        if (++c == M) {
            c = 0;
            if (++r == N) r = 0;
        }
    }
};

template <typename Idx, bool kCausal>
__device__ float4 scale_mask4(float4 x, Idx e, Idx N, Idx M, float scale) {
    float4 y = make_float4(x.x * scale, x.y * scale, x.z * scale, x.w * scale);
    if (kCausal) {
        const float ninf = -INFINITY;
        MaskCursor<Idx> at(e, N, M);
        if (at.c > at.r) y.x = ninf;
        at.next(N, M);
        if (at.c > at.r) y.y = ninf;
        at.next(N, M);
        if (at.c > at.r) y.z = ninf;
        at.next(N, M);
        if (at.c > at.r) y.w = ninf;
    }
    return y;
}

// `in` and `out` may alias (in-place), so no __restrict__: each element is read and then written
// by the same thread.
template <typename Idx, bool kCausal>
__global__ void scale_mask_kernel(const float* in, float* out, Idx n, Idx N, Idx M, float scale) {
    const Idx nvec = n / 4;  // cudaMalloc'd buffers are 256-byte aligned, so float4 is safe
    const float4* in4 = reinterpret_cast<const float4*>(in);
    float4* out4 = reinterpret_cast<float4*>(out);
    const Idx chunk = static_cast<Idx>(blockDim.x) * kScaleUnroll;
    for (Idx first = blockIdx.x * chunk; first < nvec; first += static_cast<Idx>(gridDim.x) * chunk) {
        float4 x[kScaleUnroll];
#pragma unroll
        for (int u = 0; u < kScaleUnroll; ++u) {  // all loads first: kScaleUnroll in flight
            const Idx v = first + threadIdx.x + u * blockDim.x;
            if (v < nvec) x[u] = in4[v];
        }
#pragma unroll
        for (int u = 0; u < kScaleUnroll; ++u) {
            const Idx v = first + threadIdx.x + u * blockDim.x;
            if (v < nvec) out4[v] = scale_mask4<Idx, kCausal>(x[u], v * 4, N, M, scale);
        }
    }
    // The last n % 4 elements, scalar.
    const Idx e = nvec * 4 + threadIdx.x;
    if (blockIdx.x == 0 && e < n) {
        float y = in[e] * scale;
        if (kCausal) {
            MaskCursor<Idx> at(e, N, M);
            if (at.c > at.r) y = -INFINITY;
        }
        out[e] = y;
    }
}

template <typename Idx>
void launch_scale_mask_typed(const float* in, float* out, Idx n, Idx N, Idx M, float scale,
                             bool causal, cudaStream_t stream) {
    const long long chunks = (static_cast<long long>(n / 4) + kScaleThreads * kScaleUnroll - 1) /
                             (kScaleThreads * kScaleUnroll);
    // Enough blocks to fill every SM several times over; the kernel grid-strides over the rest.
    const int blocks = static_cast<int>(std::max(1LL, std::min(chunks, 16LL * device_sm_count())));
    if (causal) {
        scale_mask_kernel<Idx, true><<<blocks, kScaleThreads, 0, stream>>>(in, out, n, N, M, scale);
        LAUNCH_CHECK(scale_mask_kernel);
    } else {
        scale_mask_kernel<Idx, false><<<blocks, kScaleThreads, 0, stream>>>(in, out, n, N, M, scale);
        LAUNCH_CHECK(scale_mask_kernel);
    }
}

template <int kTileRows, int kTileCols, class Kernel>
void launch_transpose_tiled(Kernel kernel, dim3 block, const float* in, float* out, int heads,
                            int rows, int cols, cudaStream_t stream) {
    const long long col_tiles = (cols + kTileCols - 1) / kTileCols;
    if (col_tiles > kMaxGridYZ) {
        fail(kExitInternal, where(__FILE__, __LINE__) + ": transpose: " + std::to_string(cols) +
                                " columns exceed the grid's y limit");
    }
    const dim3 grid((rows + kTileRows - 1) / kTileRows, static_cast<unsigned>(col_tiles),
                    std::min(heads, kMaxGridYZ));
    kernel<<<grid, block, 0, stream>>>(in, out, heads, rows, cols);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------------
void launch_transpose(const float* in, float* out, int heads, int rows, int cols,
                      cudaStream_t stream) {
    // float4 on both sides needs every row of `in` (cols) and of `out` (rows) 16-byte aligned.
    if (rows % 4 == 0 && cols % 4 == 0 && cols <= 16) {
        launch_transpose_tiled<128, 16>(transpose4_kernel<128, 16>, dim3(kT4Threads), in, out, heads, rows, cols, stream);
        LAUNCH_CHECK(transpose4_kernel);
    } else if (rows % 4 == 0 && cols % 4 == 0) {
        launch_transpose_tiled<64, 32>(transpose4_kernel<64, 32>, dim3(kT4Threads), in, out, heads, rows, cols, stream);
        LAUNCH_CHECK(transpose4_kernel);
    } else {
        launch_transpose_tiled<kTile, kTile>(transpose_kernel, dim3(kTile, kTileRows), in, out, heads, rows, cols, stream);
        LAUNCH_CHECK(transpose_kernel);
    }
}

void launch_scale_mask(const float* in, float* out, int heads, int N, int M, float scale,
                       bool causal, cudaStream_t stream) {
    const unsigned long long n = static_cast<unsigned long long>(heads) * N * M;
    // 32-bit index arithmetic (cheaper division) whenever the flat index, plus one chunk of
    // look-ahead in the loop, fits.
    if (n < (1ULL << 31)) {
        launch_scale_mask_typed<uint32_t>(in, out, static_cast<uint32_t>(n), N, M, scale, causal, stream);
    } else {
        launch_scale_mask_typed<uint64_t>(in, out, n, N, M, scale, causal, stream);
    }
}

void poison_fill(float* p, size_t n, cudaStream_t stream) {
    // 0xFFFFFFFF is a quiet NaN in IEEE-754 single precision.
    CUDA_CHECK(cudaMemsetAsync(p, 0xFF, n * sizeof(float), stream));
}

}  // namespace attnstep
