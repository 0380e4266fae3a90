// bench_parts.cuh — what the pieces of `main --bench` share: its options (bench_options.cu), the
// ceilings it measures (bench_ceilings.cu), the float64 check of the flash kernels
// (bench_check.cu); bench.cu runs them and reports.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "../backend.h"
#include "../stages.h"
#include "cuda_check.cuh"

namespace attnstep {
namespace bench {

constexpr size_t kCopyBytes = size_t(1) << 30;  // the bandwidth ceiling's copy (1 GiB)

struct Options {
    int batch = 1, heads = 12, N = 128, M = 128, d = 64;
    bool causal = false;
    float scale = 0.f;  // 0: 1/sqrt(d)
    Precision precision = Precision::fp32;
    int warmup = 3, reps = 20;
    std::string json;
    bool check = false;
    int check_rows = 16;  // sampled rows per checked head; 0 = all rows of all heads
    std::string only = "all";
    int fast_variant = 0, splits = 0;
    unsigned seed = 1234;
};

// The options of `main --bench` from argv (exit 2 on a bad one); --scale defaults to 1/sqrt(d).
Options parse_options(int argc, char** argv);

// One head's shape.
Dims bench_dims(const Options& o);

// ---------------------------------------------------------------------------------------------
// Device buffers, inputs, timing

// A cudaMalloc'd array freed on scope exit (errors while unwinding are ignored on purpose).
struct DeviceBuffer {
    float* p = nullptr;
    size_t n = 0;
    explicit DeviceBuffer(size_t count) : n(count) {
        CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p), std::max<size_t>(count, 1) * sizeof(float)));
    }
    ~DeviceBuffer() { cudaFree(p); }
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

// Fills b uniformly in [-1, 1) from `seed` (reproducible, no state).
void fill(DeviceBuffer& b, uint64_t seed, cudaStream_t s);

struct Timer {
    cudaStream_t stream;
    cudaEvent_t start = nullptr, stop = nullptr;
    explicit Timer(cudaStream_t s) : stream(s) {
        CUDA_CHECK(cudaEventCreate(&start));
        CUDA_CHECK(cudaEventCreate(&stop));
    }
    ~Timer() {
        cudaEventDestroy(start);
        cudaEventDestroy(stop);
    }
    // Median milliseconds of `reps` runs of work() after `warmup` untimed ones.
    template <class Work>
    double median_ms(int warmup, int reps, Work&& work) {
        for (int i = 0; i < warmup; ++i) work();
        CUDA_CHECK(cudaStreamSynchronize(stream));
        std::vector<float> ms(reps);
        for (int i = 0; i < reps; ++i) {
            CUDA_CHECK(cudaEventRecord(start, stream));
            work();
            CUDA_CHECK(cudaEventRecord(stop, stream));
            CUDA_CHECK(cudaEventSynchronize(stop));
            CUDA_CHECK(cudaEventElapsedTime(&ms[i], start, stop));
        }
        std::sort(ms.begin(), ms.end());
        return reps % 2 ? ms[reps / 2] : 0.5 * (ms[reps / 2 - 1] + ms[reps / 2]);
    }
};

// ---------------------------------------------------------------------------------------------
// Results

enum class Kind { memory, gemm, attention };
struct Result {
    std::string name;
    Kind kind;
    std::string status = "ok";  // "ok", "skipped (memory)", "unsupported", "not built"
    double ms = 0, flops = 0, bytes = 0;
    double rate = 0;      // TFLOP/s or GB/s
    double fraction = 0;  // of the matching ceiling
    std::string tiles;    // flash: "Br x Bc, splits S"
    bool checked = false, check_passed = true;
    double max_rel_err = 0, max_lse_err = 0;
};

struct Ceilings {
    double sgemm_ms = 0, sgemm_tflops = 0;
    double copy_ms = 0, copy_gbps = 0;
    double mma_tf32_tflops = 0;  // mma.sync m16n8k8 TF32 issue rate: flash_fast's own ceiling
    double mma_bf16_tflops = 0;  // mma.sync m16n8k16 BF16: the rate a split-BF16 kernel would see
    double wgmma_tf32_tflops = 0;  // wgmma m64n128k8 TF32 issue rate (Hopper): flash_wgmma's ceiling
};

// The ceilings: cuBLAS SGEMM on the QK shape for `gemm_heads` heads (blas set to the run's
// precision), a device-to-device copy, and the mma.sync / wgmma issue rates.
Ceilings measure_ceilings(const Options& o, const cudaDeviceProp& prop, int gemm_heads, cublasHandle_t blas,
                          Timer& timer, cudaStream_t s);

// The largest error --check allows at o's precision.
double check_tolerance(const Options& o);

// Compares sampled rows (all with --check-rows 0) of O and lse with float64 and records the
// result in r.
void check_flash(const Options& o, const DeviceBuffer& Q, const DeviceBuffer& K, const DeviceBuffer& V,
                 const DeviceBuffer& O, const DeviceBuffer& lse, int total_heads, Result* r);

}  // namespace bench
}  // namespace attnstep
