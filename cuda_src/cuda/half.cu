// half.cu — half.cuh's conversions. Each conversion rounds to nearest even with the CUDA intrinsics
// (__float2bfloat16_rn, __float2half_rn; half_format.cuh), as the CPU backend's round_bf16 and
// round_fp16 do, so both backends store the same half value for the same float32 one.
#include "half.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "cuda_check.cuh"
#include "half_format.cuh"

namespace attnstep {

namespace {

constexpr int kThreads = 256;

unsigned blocks_for(size_t n) {
    return static_cast<unsigned>(std::min<size_t>((n + kThreads - 1) / kThreads, 65535u * 8u));
}

template <bool kBf16>
__global__ void to_half_kernel(const float* __restrict__ x, void* __restrict__ out, size_t n) {
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<size_t>(gridDim.x) * blockDim.x) {
        if constexpr (kBf16) static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(x[i]);
        else static_cast<__half*>(out)[i] = __float2half_rn(x[i]);
    }
}

template <class Fmt>
__global__ void round_kernel(float* __restrict__ x, size_t n) {
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<size_t>(gridDim.x) * blockDim.x)
        x[i] = Fmt::round(x[i]);
}

}  // namespace

cudaDataType half_data_type(Precision p) { return p == Precision::bf16 ? CUDA_R_16BF : CUDA_R_16F; }

void launch_to_half(const float* x, void* out, size_t n, Precision p, cudaStream_t stream) {
    if (n == 0) return;
    if (p == Precision::bf16) to_half_kernel<true><<<blocks_for(n), kThreads, 0, stream>>>(x, out, n);
    else to_half_kernel<false><<<blocks_for(n), kThreads, 0, stream>>>(x, out, n);
    CUDA_CHECK(cudaGetLastError());
}

void launch_round_to_format(float* x, size_t n, Precision p, cudaStream_t stream) {
    if (n == 0 || !is_half(p)) return;
    with_half_format(p, [&](auto fmt) { round_kernel<decltype(fmt)><<<blocks_for(n), kThreads, 0, stream>>>(x, n); });
    CUDA_CHECK(cudaGetLastError());
}

}  // namespace attnstep
