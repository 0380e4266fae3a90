// softmax.cu — the row softmax of the CUDA backend (attention_weights from QK_scaled), launched by
// launch_softmax_rows (kernels.cuh). Checked on a GPU by scripts/gpu_check.sh, which compares every
// stage with the CPU backend and float64 NumPy.
//
// Arithmetic the verifier assumes of it (verify/model/kernels.py, the CUDA model of every cuda-*
// flash_kernel): expf (the GPU exp model: ~0.5 ulp RMS) on x − rowmax, an FP32 row sum in any
// order (warp butterflies), then 1/l and a product by it (two final roundings).
//
// It aims at device-to-device copy bandwidth (bytes read + written; docs/journal.md has the
// measured fractions), with float4 accesses when M % 4 == 0:
//   softmax_rows_kernel one block per row. "Cached": the row is read once into registers (up to 32
//                       floats per thread, 1024 threads: M <= 32768). "Uncached" (longer rows):
//                       three passes over global memory, correct for any M.
#include <algorithm>
#include <cmath>
#include <string>

#include "../common.h"
#include "cuda_check.cuh"
#include "device.cuh"
#include "kernels.cuh"
#include "warp.cuh"

namespace attnstep {

namespace {

int round_up(long long x, int to) { return static_cast<int>((x + to - 1) / to * to); }

// ---------------------------------------------------------------------------------------------
// Row softmax
// ---------------------------------------------------------------------------------------------
constexpr int kSoftmaxMaxThreads = 1024;
constexpr int kSoftmaxPreferredThreads = 256;
// Registers cached per thread: at most 32 floats, so that 1024-thread blocks fit the 64 registers
// per thread that __launch_bounds__(kSoftmaxMaxThreads) allows without spilling.
constexpr int kSoftmaxMaxCachedFloats = 32;

template <int VEC> struct VecOf;
template <> struct VecOf<1> { using type = float; };
template <> struct VecOf<4> { using type = float4; };

__device__ __forceinline__ void set_lane(float& v, int, float x) { v = x; }
__device__ __forceinline__ void set_lane(float4& v, int i, float x) {
    if (i == 0) v.x = x; else if (i == 1) v.y = x; else if (i == 2) v.z = x; else v.w = x;
}

// Block-wide reductions; every thread gets the result. blockDim.x is a multiple of 32.
template <bool kMax>
__device__ float block_reduce(float v, float* scratch /* [32] */) {
    const float identity = kMax ? -INFINITY : 0.f;
    v = kMax ? warp_max(v) : warp_sum(v);
    const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
    if (lane == 0) scratch[warp] = v;
    __syncthreads();  // every warp's partial is in scratch before any warp reads them
    v = lane < static_cast<int>(blockDim.x / kWarp) ? scratch[lane] : identity;
    v = kMax ? warp_max(v) : warp_sum(v);
    __syncthreads();  // every warp has read scratch before the next reduction overwrites it
    return v;
}
__device__ float block_max(float v, float* scratch) { return block_reduce<true>(v, scratch); }
__device__ float block_sum(float v, float* scratch) { return block_reduce<false>(v, scratch); }

// The three passes of softmax_rows_kernel over one row, each thread taking vectors t,
// t + blockDim, ... of its nvec. kCached: the thread's K vectors of the row live in `cache`
// (loaded by the first pass, overwritten with exp by the second), so the row is read from global
// memory once; otherwise each pass reads it again.

// The thread's part of m = rowmax(x).
template <int VEC, int K, bool kCached, class Vec>
__device__ __forceinline__ float row_max_part(const Vec* src, Vec (&cache)[kCached ? K : 1], int nvec) {
    float m = -INFINITY;
    if (kCached) {
#pragma unroll
        for (int k = 0; k < K; ++k) {  // K independent loads in flight
            const int j = threadIdx.x + k * blockDim.x;
            if (j < nvec) cache[k] = src[j];
        }
#pragma unroll
        for (int k = 0; k < K; ++k) {
            if (threadIdx.x + k * blockDim.x < nvec)
#pragma unroll
                for (int i = 0; i < VEC; ++i) m = fmaxf(m, lane_of(cache[k], i));
        }
    } else {
        for (int j = threadIdx.x; j < nvec; j += blockDim.x) {
            const Vec x = src[j];
            for (int i = 0; i < VEC; ++i) m = fmaxf(m, lane_of(x, i));
        }
    }
    return m;
}

// The thread's part of l = rowsum(exp(x - m)); cached, exp(x - m) replaces x in the cache.
template <int VEC, int K, bool kCached, class Vec>
__device__ __forceinline__ float exp_sum_part(const Vec* src, Vec (&cache)[kCached ? K : 1], int nvec, float m) {
    float l = 0.f;
    if (kCached) {
#pragma unroll
        for (int k = 0; k < K; ++k) {
            if (threadIdx.x + k * blockDim.x < nvec) {
#pragma unroll
                for (int i = 0; i < VEC; ++i) {
                    const float p = expf(lane_of(cache[k], i) - m);
                    set_lane(cache[k], i, p);
                    l += p;
                }
            }
        }
    } else {
        for (int j = threadIdx.x; j < nvec; j += blockDim.x) {
            const Vec x = src[j];
            for (int i = 0; i < VEC; ++i) l += expf(lane_of(x, i) - m);
        }
    }
    return l;
}

// dst = exp(x - m) · inv_l, the thread's vectors.
template <int VEC, int K, bool kCached, class Vec>
__device__ __forceinline__ void write_weights(const Vec* src, Vec* dst, Vec (&cache)[kCached ? K : 1], int nvec,
                                              float m, float inv_l) {
    if (kCached) {
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int j = threadIdx.x + k * blockDim.x;
            if (j < nvec) {
                Vec p = cache[k];
#pragma unroll
                for (int i = 0; i < VEC; ++i) set_lane(p, i, lane_of(p, i) * inv_l);
                dst[j] = p;
            }
        }
    } else {
        for (int j = threadIdx.x; j < nvec; j += blockDim.x) {
            Vec p = src[j];
            for (int i = 0; i < VEC; ++i) set_lane(p, i, expf(lane_of(p, i) - m) * inv_l);
            dst[j] = p;
        }
    }
}

// One block per row (grid-stride over rows). VEC: floats per access (4 needs M % 4 == 0).
// kCached: thread t keeps vectors t, t + blockDim, ... (K of them) in registers, so the row is read
// from global memory once; otherwise the row is read three times (max, sum, write).
template <int VEC, int K, bool kCached>
__global__ void __launch_bounds__(kSoftmaxMaxThreads) softmax_rows_kernel(const float* __restrict__ in, float* __restrict__ out,
                                    long long rows, int M) {
    using Vec = typename VecOf<VEC>::type;
    __shared__ float scratch[kWarp];
    const int nvec = M / VEC;
    Vec cache[kCached ? K : 1];
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const Vec* src = reinterpret_cast<const Vec*>(in + row * M);
        Vec* dst = reinterpret_cast<Vec*>(out + row * M);
        const float m = block_max(row_max_part<VEC, K, kCached>(src, cache, nvec), scratch);
        // A row that is -inf throughout: subtract 0 instead, so exp gives 0 rather than NaN.
        const float m_safe = m == -INFINITY ? 0.f : m;
        const float l = block_sum(exp_sum_part<VEC, K, kCached>(src, cache, nvec, m_safe), scratch);
        // An all-masked row (l = 0) gets weights 0. A row whose scores hold a NaN (NaN in Q or K
        // under --allow-nonfinite) has l = NaN, and 1/l makes every weight of the row NaN, as the
        // reference's softmax does: fmaxf skipped the NaN in m, so l is where it survives.
        const float inv_l = l == 0.f ? 0.f : 1.f / l;
        write_weights<VEC, K, kCached>(src, dst, cache, nvec, m_safe, inv_l);
    }
}

template <int VEC, int K, bool kCached>
void launch_softmax_variant(const float* in, float* out, long long rows, int M, int threads,
                            cudaStream_t stream) {
    const int blocks = static_cast<int>(std::min<long long>(rows, 1LL << 30));
    softmax_rows_kernel<VEC, K, kCached><<<blocks, threads, 0, stream>>>(in, out, rows, M);
    LAUNCH_CHECK(softmax_rows_kernel);
}

// Picks registers-per-thread K (vectors of VEC floats) and the block size for a row of nvec
// vectors: the smallest K whose block is at most kSoftmaxPreferredThreads wide, else at most
// kSoftmaxMaxThreads; 0 when even the largest K and block do not hold the row (uncached version).
void softmax_shape(int nvec, int max_k, int* K, int* threads) {
    for (int limit : {kSoftmaxPreferredThreads, kSoftmaxMaxThreads}) {
        for (int k = 1; k <= max_k; k *= 2) {
            const int t = round_up((nvec + k - 1) / k, kWarp);
            if (t <= limit) {
                *K = k;
                *threads = t;
                return;
            }
        }
    }
    *K = 0;
    *threads = kSoftmaxMaxThreads;
}

template <int VEC>
void launch_softmax_vec(const float* in, float* out, long long rows, int M, cudaStream_t stream) {
    int K = 0, threads = 0;
    softmax_shape(M / VEC, kSoftmaxMaxCachedFloats / VEC, &K, &threads);
    switch (K) {
        case 1: return launch_softmax_variant<VEC, 1, true>(in, out, rows, M, threads, stream);
        case 2: return launch_softmax_variant<VEC, 2, true>(in, out, rows, M, threads, stream);
        case 4: return launch_softmax_variant<VEC, 4, true>(in, out, rows, M, threads, stream);
        case 8: return launch_softmax_variant<VEC, 8, true>(in, out, rows, M, threads, stream);
        case 16:
            if constexpr (16 * VEC <= kSoftmaxMaxCachedFloats) {
                return launch_softmax_variant<VEC, 16, true>(in, out, rows, M, threads, stream);
            }
            break;
        case 0: return launch_softmax_variant<VEC, 1, false>(in, out, rows, M, threads, stream);
        default: break;
    }
    fail(kExitInternal, where(__FILE__, __LINE__) + ": softmax: no kernel for K=" + std::to_string(K));
}

}  // namespace

void launch_softmax_rows(const float* in, float* out, long long rows, int M, cudaStream_t stream) {
    if (rows <= 0 || M <= 0) return;
    if (M % 4 == 0) {
        launch_softmax_vec<4>(in, out, rows, M, stream);  // rows start 16-byte aligned
    } else {
        launch_softmax_vec<1>(in, out, rows, M, stream);
    }
}

}  // namespace attnstep
