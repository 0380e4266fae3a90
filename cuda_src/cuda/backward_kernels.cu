// backward_kernels.cu — the memory-bound stages of the backward stage path: D (a dot product per
// row) and dS (element-wise). The backward's GEMMs are cuBLAS calls (gemm.cu).
//
// Arithmetic the verifier assumes of them (verify/model/kernels.py, the CUDA model): D is an FP32
// FMA dot product in any order (strided per lane, then a warp butterfly); dS is P·(dP − D), one
// subtraction and one product per element, each rounded once.
#include "kernels.cuh"

#include <algorithm>
#include <type_traits>

#include "cuda_check.cuh"
#include "device.cuh"
#include "warp.cuh"

namespace attnstep {

namespace {

constexpr int kRowDotThreads = 256;  // 8 rows per block, a warp each
constexpr int kDsThreads = 256;

// One warp per row: strided partial sums per lane, then a butterfly sum.
__global__ void __launch_bounds__(kRowDotThreads)
row_dot_kernel(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ out, long long rows,
               int cols) {
    const int lane = threadIdx.x % kWarp;
    const long long warps = static_cast<long long>(gridDim.x) * (kRowDotThreads / kWarp);
    for (long long r = blockIdx.x * (kRowDotThreads / kWarp) + threadIdx.x / kWarp; r < rows; r += warps) {
        const float* ar = a + r * cols;
        const float* br = b + r * cols;
        float s = 0.f;
        for (int c = lane; c < cols; c += kWarp) s = fmaf(ar[c], br[c], s);
        s = warp_sum(s);
        if (lane == 0) out[r] = s;
    }
}

// A block walks whole rows (grid-stride), so each row's D and causal limit are read once.
// VEC = 4 when M is a multiple of 4 (every row then starts 16-byte aligned).
template <int VEC, bool kCausal>
__global__ void __launch_bounds__(kDsThreads)
ds_kernel(const float* __restrict__ P, const float* __restrict__ dP, const float* __restrict__ D,
          float* __restrict__ dS, long long rows, int N, int M) {
    using Vec = std::conditional_t<VEC == 4, float4, float>;
    const int nvec = M / VEC;
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const int r = static_cast<int>(row % N);  // the query row within its head
        const float Dr = D[row];
        const Vec* p = reinterpret_cast<const Vec*>(P + row * M);
        const Vec* dp = reinterpret_cast<const Vec*>(dP + row * M);
        Vec* ds = reinterpret_cast<Vec*>(dS + row * M);
        for (int v = threadIdx.x; v < nvec; v += kDsThreads) {
            const Vec x = p[v], y = dp[v];
            Vec z;
            float* zl = reinterpret_cast<float*>(&z);
#pragma unroll
            for (int i = 0; i < VEC; ++i) {
                const int c = v * VEC + i;
                // +0 where masked: P is 0 there, and 0·(negative) would be -0.
                zl[i] = kCausal && c > r ? 0.f : lane_of(x, i) * (lane_of(y, i) - Dr);
            }
            ds[v] = z;
        }
    }
}

template <int VEC>
void launch_ds_vec(const float* P, const float* dP, const float* D, float* dS, long long rows, int N, int M,
                   bool causal, cudaStream_t stream) {
    const int blocks = static_cast<int>(std::min<long long>(rows, 32LL * device_sm_count()));
    if (causal) {
        ds_kernel<VEC, true><<<blocks, kDsThreads, 0, stream>>>(P, dP, D, dS, rows, N, M);
        LAUNCH_CHECK(ds_kernel);
    } else {
        ds_kernel<VEC, false><<<blocks, kDsThreads, 0, stream>>>(P, dP, D, dS, rows, N, M);
        LAUNCH_CHECK(ds_kernel);
    }
}

}  // namespace

void launch_row_dot(const float* a, const float* b, float* out, long long rows, int cols, cudaStream_t stream) {
    if (rows <= 0) return;
    constexpr int kRowsPerBlock = kRowDotThreads / kWarp;
    const int blocks = static_cast<int>(std::min<long long>((rows + kRowsPerBlock - 1) / kRowsPerBlock,
                                                            64LL * device_sm_count()));
    row_dot_kernel<<<blocks, kRowDotThreads, 0, stream>>>(a, b, out, rows, cols);
    LAUNCH_CHECK(row_dot_kernel);
}

void launch_ds(const float* P, const float* dP, const float* D, float* dS, int heads, int N, int M, bool causal,
               cudaStream_t stream) {
    const long long rows = static_cast<long long>(heads) * N;
    if (rows <= 0 || M <= 0) return;
    if (M % 4 == 0) launch_ds_vec<4>(P, dP, D, dS, rows, N, M, causal, stream);
    else launch_ds_vec<1>(P, dP, D, dS, rows, N, M, causal, stream);
}

}  // namespace attnstep
