// bench.cu — `main --bench`: times every stage of the binary on one shape with device events and
// reports it against ceilings measured in the same run (bench_ceilings.cu); options in
// bench_options.cu, the inputs and the variant in bench_variant.cu, the forward's stage path in
// bench_stages.cu and its flash rows in bench_flash.cu, the float64 check of the flash forward in
// bench_check.cu, the backward's rows in bench_backward.cu, the table and JSON in bench_output.cu.
//
//   build/main --bench [--batch B --heads H --kv-heads HK --seq-q N --seq-k M --d D --causal
//                       --align A --window L,R --softcap C --alibi --scale S
//                       --precision fp32|tf32|bf16|fp16 --warmup W --reps R --json FILE --check
//                       --check-rows K --only all|stages|flash --pass forward|backward|both
//                       --no-ceilings --seed S --fast-variant I --splits S]
//
// Inputs are generated on the device (bench_inputs.h: a hash of the element index, uniform in
// [-1, 1)), so no text I/O is timed. Each kernel runs W times, then R timed runs, each between two
// cudaEvents; the median is reported. Rates: TFLOP/s for the GEMMs (2·N·M·d per head each) and the
// flash forward (4·d per visible score entry of each query head: 4·B·H·N·M·d without a mask, about
// half of it causal, exactly the entries a window or an alignment leaves), GB/s of bytes read +
// written for the memory-bound stages (KT, QK_scaled, attention_weights), each against its ceiling. The stage path
// runs the backend's own kernels and GEMM calls (gemm.cuh) and needs two N×M buffers per head;
// heads go through in groups that fit in device memory (a stage's time is summed over groups), or
// the stage path is reported as "skipped (memory)". The flash forward is timed as `auto` runs it
// and with each tensor-core kernel forced (--splits forces their KV split, --fast-variant picks an
// exploration configuration of the mma.sync kernel). --pass picks the forward rows, the backward
// rows (bench_backward.cu: the backward stage path and the flash backward, from a generated dO),
// or both (the default). --no-ceilings skips the ceilings (no fraction is reported then). --check
// exits 1 when a flash kernel or a backward pass exceeds the tolerance against float64.
//
// --precision bf16|fp16: the forward at that format. The stage path as the CUDA backend runs it
// then (GEMMs of bf16/fp16 operands through cublasGemmStridedBatchedEx, their conversions and each
// stage's rounding to the format inside the stage's time; bytes counted as at fp32), and the flash
// kernels that compute in the format (their plan names it: "cuda-wgmma-bf16"); a flash row with no
// such kernel for the GPU and d is "unsupported" with the reason, and so are the backward rows.
//
// The variant (--kv-heads, --causal, --align, --window, --softcap, --alibi): every row computes it
// as a run of the binary does (the backend's kernels for it; a kernel without it is
// "unsupported"); a grouped run's copy of the K/V heads and sums of dK, dV are timed as
// bench_variant.cu says; the JSON records the variant.
#include "bench.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "../backend.h"
#include "../common.h"
#include "../stages.h"
#include "bench_inputs.h"
#include "bench_parts.cuh"
#include "../cuda/cuda_check.cuh"
#include "../cuda/gemm.cuh"

namespace attnstep {
namespace bench {

namespace {

constexpr size_t kMemoryMargin = size_t(1) << 30;  // left free for cuBLAS and the runtime
// dO's fill seed: far from input_seed() of Q, K, V for any --seed, so dO never repeats an input.
constexpr uint64_t kGradSeedBase = uint64_t(1) << 40;

__global__ void fill_uniform(float* p, size_t n, uint64_t seed) {
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
         i += size_t(gridDim.x) * blockDim.x)
        p[i] = uniform_input(i, seed);
}

}  // namespace

void fill(DeviceBuffer& b, uint64_t seed, cudaStream_t s) {
    fill_uniform<<<1024, 256, 0, s>>>(b.p, b.n, seed);
    LAUNCH_CHECK(fill_uniform);
}

int heads_that_fit(double per_head_bytes, int total_heads) {
    size_t free_bytes = 0, total_bytes = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    const size_t margin = std::max(kMemoryMargin, total_bytes / 32);
    const double usable = free_bytes > margin ? double(free_bytes - margin) : 0.0;
    return static_cast<int>(std::min<double>(total_heads, std::floor(usable / per_head_bytes)));
}

namespace {

// The fraction of the ceiling stays 0 (and out of the JSON) under --no-ceilings.
void set_rate(Result& r, const Ceilings& c) {
    if (r.kind == Kind::memory) {
        r.rate = r.bytes / (r.ms * 1e-3) / 1e9;
        r.fraction = c.copy_gbps > 0 ? r.rate / c.copy_gbps : 0;
    } else {
        r.rate = r.flops / (r.ms * 1e-3) / 1e12;
        r.fraction = c.sgemm_tflops > 0 ? r.rate / c.sgemm_tflops : 0;
    }
}

// Every row --pass and --only ask for, on inputs generated once (bench_inputs.h).
BenchRun bench_all(const Options& o, const cudaDeviceProp& prop, cublasHandle_t blas, Timer& timer, cudaStream_t s) {
    const int total_heads = o.batch * o.heads;
    BenchRun run;
    const BenchInputs in(o, s);
    const BenchVariant variant(o, s);
    const BenchContext c{o, in, variant.v, blas, timer, s, total_heads};
    if (o.check) {
        CUDA_CHECK(cudaStreamSynchronize(s));  // the fills are done before the host reads them
        run.inputs_checksum = inputs_checksum(o, in, total_heads);
    }
    if (o.ceilings) {
        // An estimate for the SGEMM ceiling's shape; the stage path sizes its groups again once
        // the ceilings' buffers are freed.
        run.ceilings = measure_ceilings(o, prop, stage_group(o, total_heads), blas, timer, s);
        run.ceilings.measured = true;
    }
    if (times_forward(o)) {
        bench_kv_expand(c, &run.results);
        if (o.only != "flash") bench_stage_path(c, &run.group, &run.results);
        if (o.only != "stages") bench_flash_kernels(c, &run.results);
    }
    if (times_backward(o)) {
        DeviceBuffer dO(size_t(total_heads) * o.N * o.d);
        fill(dO, kGradSeedBase + o.seed, s);
        bench_backward(c, dO, &run.backward_group, &run.results);
    }
    CUDA_CHECK(cudaStreamSynchronize(s));
    for (Result& r : run.results) {
        if (r.status == "ok") set_rate(r, run.ceilings);
        if (r.checked && !r.check_passed) run.passed = false;
    }
    return run;
}

int run(const Options& o) {
    if (!cuda_device_available()) {
        fail(kExitBadInput, "--bench: no CUDA device found", "run the benchmark on a machine with an NVIDIA GPU");
    }
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    cudaDeviceProp prop{};
    CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    const std::string device = prop.name;

    cudaStream_t s = nullptr;
    CUDA_CHECK(cudaStreamCreate(&s));
    cublasHandle_t blas = nullptr;
    CUBLAS_CHECK(cublasCreate(&blas));
    CUBLAS_CHECK(cublasSetStream(blas, s));
    set_gemm_precision(blas, o.precision);
    Timer timer(s);

    const BenchRun run = bench_all(o, prop, blas, timer, s);
    print_table(o, device, run);
    if (!o.json.empty()) write_json(o, device, prop.multiProcessorCount, run);
    cublasDestroy(blas);
    cudaStreamDestroy(s);
    if (!run.passed) {
        std::fprintf(stderr, "main: error: --bench --check: a result exceeds the %s tolerance %.1e "
                             "against float64 (see the table)\n",
                     precision_name(o.precision), check_tolerance(o));
        return kExitInternal;
    }
    return kExitOk;
}

}  // namespace
}  // namespace bench

int run_bench(int argc, char** argv) { return bench::run(bench::parse_options(argc, argv)); }

}  // namespace attnstep
