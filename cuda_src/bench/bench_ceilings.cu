// bench_ceilings.cu — the ceilings `main --bench` measures in the same run as the kernels: cuBLAS
// SGEMM on the QK shape (the stage path's own call; at bf16/fp16 its GemmEx call of half operands,
// their conversions included), a device-to-device copy, and the tensor-core issue rates of
// mma.sync TF32 / BF16 and (Hopper) wgmma TF32.
#include <algorithm>
#include <cstdint>

#include "bench_parts.cuh"
#include "../cuda/gemm.cuh"
#ifdef ATTNSTEP_HAVE_WGMMA
#include "../cuda/sm90a/flash_wgmma.cuh"
#endif

namespace attnstep {
namespace bench {

namespace {

// The tensor-core ceiling of flash_fast: every warp issues kMmaChains independent chains of
// mma.sync.m16n8k8 TF32 (2·16·8·8 FLOP each; no loads, no dependencies beyond each chain), enough
// warps to fill every SM. The same for m16n8k16 BF16, the rate a split-BF16 (bf16x3) kernel would
// run at. sm_80+ only; 0 elsewhere.
constexpr int kMmaChains = 8, kMmaIters = 4096, kMmaWarpsPerBlock = 8;  // ~1 ms per launch

template <bool kBf16>
__global__ void mma_peak(float* sink) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    float c[kMmaChains][4] = {};
    const uint32_t a0 = kBf16 ? 0x3f803f80u + threadIdx.x : __float_as_uint(1.0f + threadIdx.x * 1e-3f);
    const uint32_t b0 = kBf16 ? 0x3f003f00u : __float_as_uint(0.5f);
    for (int it = 0; it < kMmaIters; ++it) {
#pragma unroll
        for (int k = 0; k < kMmaChains; ++k) {
            if (kBf16) {
                asm volatile(
                    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                    "{%0,%1,%2,%3}, {%4,%4,%4,%4}, {%5,%5}, {%0,%1,%2,%3};"
                    : "+f"(c[k][0]), "+f"(c[k][1]), "+f"(c[k][2]), "+f"(c[k][3])
                    : "r"(a0), "r"(b0));
            } else {
                asm volatile(
                    "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
                    "{%0,%1,%2,%3}, {%4,%4,%4,%4}, {%5,%5}, {%0,%1,%2,%3};"
                    : "+f"(c[k][0]), "+f"(c[k][1]), "+f"(c[k][2]), "+f"(c[k][3])
                    : "r"(a0), "r"(b0));
            }
        }
    }
    float acc = 0.f;
#pragma unroll
    for (int k = 0; k < kMmaChains; ++k) acc += c[k][0] + c[k][1] + c[k][2] + c[k][3];
    if (acc == 1234.5f) *sink = acc;  // keeps the work alive; never true in practice
#endif
}

// TFLOP/s of mma.sync m16n8k8 TF32 (kBf16 false) or m16n8k16 BF16 (true).
template <bool kBf16>
double measure_mma(const cudaDeviceProp& prop, Timer& timer, int warmup, int reps, cudaStream_t s) {
    if (prop.major < 8) return 0;
    DeviceBuffer sink(1);
    const int blocks = prop.multiProcessorCount * 2;  // 16 warps per SM, 8 chains each
    const double ms = timer.median_ms(warmup, std::max(3, reps / 4), [&] {
        mma_peak<kBf16><<<blocks, kMmaWarpsPerBlock * 32, 0, s>>>(sink.p);
        LAUNCH_CHECK(mma_peak);
    });
    const double k = kBf16 ? 16 : 8;
    const double flops = 2.0 * 16 * 8 * k * kMmaChains * double(kMmaIters) * blocks * kMmaWarpsPerBlock;
    return flops / (ms * 1e-3) / 1e12;
}

// TFLOP/s of wgmma TF32 (sm_90a kernel; 0 on other GPUs or builds without it).
double measure_wgmma(Timer& timer, int warmup, int reps, cudaStream_t s) {
#ifdef ATTNSTEP_HAVE_WGMMA
    DeviceBuffer sink(1);
    double flops = 0;
    const double ms = timer.median_ms(warmup, std::max(3, reps / 4), [&] { flops = launch_wgmma_peak(sink.p, s); });
    return flops > 0 ? flops / (ms * 1e-3) / 1e12 : 0;
#else
    (void)timer, (void)warmup, (void)reps, (void)s;
    return 0;
#endif
}

}  // namespace

Ceilings measure_ceilings(const Options& o, const cudaDeviceProp& prop, int gemm_heads, cublasHandle_t blas,
                          Timer& timer, cudaStream_t s) {
    Ceilings c;
    {  // cuBLAS on the QK shape: one group of heads (at least one head)
        const int heads = std::max(1, std::min(gemm_heads, 8));
        DeviceBuffer q(size_t(heads) * o.N * o.d), k(size_t(heads) * o.M * o.d),
            out(size_t(heads) * o.N * o.M);
        HalfOperands half(o, heads);
        fill(q, 11, s);
        fill(k, 12, s);
        c.sgemm_ms = timer.median_ms(o.warmup, o.reps,
                                     [&] { gemm_qk(blas, bench_dims(o), heads, q.p, k.p, out.p, half.gemm); });
        c.sgemm_tflops = 2.0 * o.N * o.M * o.d * heads / (c.sgemm_ms * 1e-3) / 1e12;
    }
    {
        DeviceBuffer a(kCopyBytes / 4), b(kCopyBytes / 4);
        fill(a, 13, s);
        c.copy_ms = timer.median_ms(o.warmup, o.reps, [&] {
            CUDA_CHECK(cudaMemcpyAsync(b.p, a.p, kCopyBytes, cudaMemcpyDeviceToDevice, s));
        });
        c.copy_gbps = 2.0 * kCopyBytes / (c.copy_ms * 1e-3) / 1e9;
    }
    c.mma_tf32_tflops = measure_mma<false>(prop, timer, o.warmup, o.reps, s);
    c.mma_bf16_tflops = measure_mma<true>(prop, timer, o.warmup, o.reps, s);
    c.wgmma_tf32_tflops = measure_wgmma(timer, o.warmup, o.reps, s);
    return c;
}

}  // namespace bench
}  // namespace attnstep
