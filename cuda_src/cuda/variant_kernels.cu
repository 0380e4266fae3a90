// variant_kernels.cu — the stage path's element-wise kernels for the attention variants
// (variant_kernels.cuh): the modified and masked scores (QK_scaled), dropout's keep-mask and the
// dropped weights, dS under the variant's mask and dropout, and the softcap's derivative applied
// to dS before the dQ and dK GEMMs. Each element calls variant.h's functions (apply_softcap,
// alibi_bias, dropout_keep, the rule), as the CPU backend's loops do.
//
// These run only for a case with a variant beyond no mask or the top-left causal one; they are
// memory-bound and simple on purpose: a block per row (grid-stride over rows), its threads over
// the columns, so that each element knows its head, row and column without a division.
#include "variant_kernels.cuh"

#include <algorithm>
#include <cmath>

#include "cuda_check.cuh"
#include "device.cuh"

namespace attnstep {

namespace {

constexpr int kThreads = 256;

// Calls op(h, r, c, i) for every element of `heads` N×M matrices (i its flat index).
template <class Op>
__global__ void __launch_bounds__(kThreads) each_element(long long rows, int N, int M, Op op) {
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const int h = static_cast<int>(row / N), r = static_cast<int>(row % N);
        for (int c = threadIdx.x; c < M; c += kThreads) op(h, r, c, static_cast<size_t>(row) * M + c);
    }
}

template <class Op>
void launch_each_element(int heads, int N, int M, const Op& op, cudaStream_t stream) {
    const long long rows = static_cast<long long>(heads) * N;
    if (rows <= 0 || M <= 0) return;
    const int blocks = static_cast<int>(std::min<long long>(rows, 64LL * device_sm_count()));
    each_element<<<blocks, kThreads, 0, stream>>>(rows, N, M, op);
    LAUNCH_CHECK(each_element);
}

// The hash's keep decision as a factor: 1 kept, 0 dropped.
__device__ __forceinline__ float kept(const DeviceVariant& v, int h, int r, int c, int M) {
    return v.keep(h, r, c, M) ? 1.f : 0.f;
}

struct Scores {
    const float* qk;
    float* out;
    float scale;
    int M;
    DeviceVariant v;
    __device__ void operator()(int h, int r, int c, size_t i) const {
        if (v.hidden(h, r, c, M)) {
            out[i] = -INFINITY;
            return;
        }
        float s = apply_softcap(qk[i] * scale, v.softcap);
        if (v.slopes) s += alibi_bias(v.slopes[h], r, c, v.rule());
        if (v.bias) s += v.file_bias(h, r, c, M);
        out[i] = s;
    }
};

struct KeepMask {
    float* out;
    int M;
    DeviceVariant v;
    __device__ void operator()(int h, int r, int c, size_t i) const { out[i] = kept(v, h, r, c, M); }
};

// (P∘Z)·(1/(1 − p)): the product by Z first (a NaN weight stays NaN where dropped, as P∘Z is).
struct DroppedWeights {
    const float* P;
    float* out;
    float inv_keep;
    int M;
    DeviceVariant v;
    __device__ void operator()(int h, int r, int c, size_t i) const { out[i] = P[i] * kept(v, h, r, c, M) * inv_keep; }
};

struct Ds {
    const float *P, *dP, *D;
    float* dS;
    float inv_keep;
    int N, M;
    DeviceVariant v;
    __device__ void operator()(int h, int r, int c, size_t i) const {
        if (v.hidden(h, r, c, M)) {
            dS[i] = 0.f;  // +0: P is 0 there, and 0·(negative) would be -0
            return;
        }
        const float dp = v.dropout > 0.f ? dP[i] * kept(v, h, r, c, M) * inv_keep : dP[i];
        dS[i] = P[i] * (dp - D[static_cast<size_t>(h) * N + r]);
    }
};

__global__ void __launch_bounds__(kThreads)
softcap_grad_kernel(const float* __restrict__ dS, const float* __restrict__ QK, float* __restrict__ out, size_t n,
                    float scale, float cap) {
    for (size_t i = blockIdx.x * static_cast<size_t>(kThreads) + threadIdx.x; i < n;
         i += static_cast<size_t>(gridDim.x) * kThreads) {
        out[i] = dS[i] * softcap_derivative(QK[i] * scale, cap);
    }
}

}  // namespace

void launch_variant_scores(const float* QK, float* out, int heads, int N, int M, float scale, const DeviceVariant& v,
                           cudaStream_t stream) {
    launch_each_element(heads, N, M, Scores{QK, out, scale, M, v}, stream);
}

void launch_dropout_mask(float* out, int heads, int N, int M, const DeviceVariant& v, cudaStream_t stream) {
    launch_each_element(heads, N, M, KeepMask{out, M, v}, stream);
}

void launch_dropped_weights(const float* P, float* out, int heads, int N, int M, const DeviceVariant& v,
                            cudaStream_t stream) {
    launch_each_element(heads, N, M, DroppedWeights{P, out, v.inv_keep(), M, v}, stream);
}

void launch_variant_ds(const float* P, const float* dP, const float* D, float* dS, int heads, int N, int M,
                       const DeviceVariant& v, cudaStream_t stream) {
    launch_each_element(heads, N, M, Ds{P, dP, D, dS, v.inv_keep(), N, M, v}, stream);
}

void launch_softcap_grad(const float* dS, const float* QK, float* out, size_t n, float scale, float cap,
                         cudaStream_t stream) {
    if (n == 0) return;
    const size_t blocks = std::min<size_t>((n + kThreads - 1) / kThreads, 64ull * device_sm_count());
    softcap_grad_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(dS, QK, out, n, scale, cap);
    LAUNCH_CHECK(softcap_grad_kernel);
}

}  // namespace attnstep
