// bench.cu — `main --bench`: times every stage of the binary on one shape with device events and
// reports it against ceilings measured in the same run (bench_ceilings.cu); options in
// bench_options.cu, the float64 check of the flash forward in bench_check.cu, the backward's rows
// in bench_backward.cu, the table and JSON in bench_output.cu.
//
//   build/main --bench [--batch B --heads H --seq-q N --seq-k M --d D --causal --scale S
//                       --precision fp32|tf32|bf16|fp16 --warmup W --reps R --json FILE --check
//                       --check-rows K --only all|stages|flash --pass forward|backward|both
//                       --no-ceilings --seed S --fast-variant I --splits S]
//
// Inputs are generated on the device (bench_inputs.h: a hash of the element index, uniform in
// [-1, 1)), so no text I/O is timed. Each kernel runs W times, then R timed runs, each between two
// cudaEvents; the median is reported. Rates: TFLOP/s for the GEMMs (2·N·M·d per head each) and the
// flash forward (4·B·H·N·M·d, halved when causal), GB/s of bytes read + written for the
// memory-bound stages (KT, QK_scaled, attention_weights), each against its ceiling. The stage path
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
#include "../cuda/flash_dispatch.cuh"
#include "../cuda/flash_fast.cuh"
#include "../cuda/gemm.cuh"
#include "../cuda/half.cuh"
#include "../cuda/kernels.cuh"

namespace attnstep {
namespace bench {

namespace {

constexpr size_t kMemoryMargin = size_t(1) << 30;  // left free for cuBLAS and the runtime
// dO's fill seed: far from input_seed() of Q, K, V for any --seed, so dO never repeats an input.
constexpr uint64_t kGradSeedBase = uint64_t(1) << 40;

// ---------------------------------------------------------------------------------------------
// Inputs

__global__ void fill_uniform(float* p, size_t n, uint64_t seed) {
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
         i += size_t(gridDim.x) * blockDim.x)
        p[i] = uniform_input(i, seed);
}

// Elements of the larger operand of each product: Q or P first, K or V second (2 bytes each).
size_t half_first_elems(const Options& o) { return std::max(size_t(o.N) * o.d, size_t(o.N) * o.M); }
size_t half_second_elems(const Options& o) { return size_t(o.M) * o.d; }

}  // namespace

void fill(DeviceBuffer& b, uint64_t seed, cudaStream_t s) {
    fill_uniform<<<1024, 256, 0, s>>>(b.p, b.n, seed);
    LAUNCH_CHECK(fill_uniform);
}

FormatInputs::FormatInputs(Precision p, const DeviceBuffer& Q, const DeviceBuffer& K, const DeviceBuffer& V,
                           cudaStream_t s) {
    if (!is_half(p)) return;
    auto convert = [&](const DeviceBuffer& x) {
        auto h = std::make_unique<DeviceBuffer>((x.n + 1) / 2);  // DeviceBuffer counts floats: two values each
        launch_to_half(x.p, h->p, x.n, p, s);
        return h;
    };
    q = convert(Q);
    k = convert(K);
    v = convert(V);
}

void FormatInputs::attach(FlashArgs* a) const {
    if (!q) return;
    a->Qh = reinterpret_cast<const uint16_t*>(q->p);
    a->Kh = reinterpret_cast<const uint16_t*>(k->p);
    a->Vh = reinterpret_cast<const uint16_t*>(v->p);
}

double half_operand_bytes_per_head(const Options& o) {
    return is_half(o.precision) ? 2.0 * double(half_first_elems(o) + half_second_elems(o)) : 0.0;
}

HalfOperands::HalfOperands(const Options& o, int heads) {
    if (!is_half(o.precision)) return;
    // DeviceBuffer counts floats: two half elements each, rounded up.
    a = std::make_unique<DeviceBuffer>((size_t(heads) * half_first_elems(o) + 1) / 2);
    b = std::make_unique<DeviceBuffer>((size_t(heads) * half_second_elems(o) + 1) / 2);
    gemm = HalfGemm{o.precision, a->p, b->p};
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

// Heads per group so that KT, two N×M buffers, the output and (bf16/fp16) the GEMMs' half
// operands fit.
int stage_group(const Options& o, int total_heads) {
    return heads_that_fit(4.0 * (2.0 * o.N * o.M + static_cast<double>(o.d) * o.M + static_cast<double>(o.N) * o.d) +
                              half_operand_bytes_per_head(o),
                          total_heads);
}

// ---------------------------------------------------------------------------------------------
// The benchmark

void bench_stage_path(const Options& o, cublasHandle_t blas, int* group, const DeviceBuffer& Q,
                      const DeviceBuffer& K, const DeviceBuffer& V, int total_heads, Timer& timer,
                      cudaStream_t s, std::vector<Result>* out) {
    const double H = total_heads, N = o.N, M = o.M, d = o.d;
    Result kt{"KT", Kind::memory}, qk{"QK", Kind::gemm}, sc{"QK_scaled", Kind::memory},
        sm{"attention_weights", Kind::memory}, ov{"output", Kind::gemm};
    kt.bytes = 2 * 4 * H * M * d;
    qk.flops = 2 * H * N * M * d;
    sc.bytes = 2 * 4 * H * N * M;
    sm.bytes = 2 * 4 * H * N * M;
    ov.flops = 2 * H * N * M * d;
    auto skipped = [&] {
        for (Result* r : {&kt, &qk, &sc, &sm, &ov}) {
            r->status = "skipped (memory)";
            out->push_back(*r);
        }
    };
    *group = stage_group(o, total_heads);  // measured now: the ceilings' buffers are freed
    if (*group < 1) return skipped();
    const int G = *group;
    const Dims dims = bench_dims(o);
    std::unique_ptr<DeviceBuffer> KTb, Ab, Bb, Ob;
    std::unique_ptr<HalfOperands> half;
    try {
        KTb = std::make_unique<DeviceBuffer>(size_t(G) * o.d * o.M);
        Ab = std::make_unique<DeviceBuffer>(size_t(G) * o.N * o.M);
        Bb = std::make_unique<DeviceBuffer>(size_t(G) * o.N * o.M);
        Ob = std::make_unique<DeviceBuffer>(size_t(G) * o.N * o.d);
        half = std::make_unique<HalfOperands>(o, G);
    } catch (const Error&) {
        cudaGetLastError();  // an out-of-memory error is not sticky; clear it and go on
        *group = 0;
        return skipped();
    }
    DeviceBuffer &KT = *KTb, &A = *Ab, &B = *Bb, &O = *Ob;
    // Runs `stage(first_head, heads)` over every group; buffers hold one group at a time.
    auto over_groups = [&](auto&& stage) {
        for (int h0 = 0; h0 < total_heads; h0 += G) stage(h0, std::min(G, total_heads - h0));
    };
    const size_t qs = size_t(o.N) * o.d, ks = size_t(o.M) * o.d, nm = size_t(o.N) * o.M;
    const HalfGemm& hg = half->gemm;
    // At bf16/fp16 each stage is stored in the format as it is computed, inside its timed span, as
    // the CUDA backend's stage path does (nothing at fp32 and tf32).
    auto stored = [&](float* p, int n, size_t per_head) {
        launch_round_to_format(p, size_t(n) * per_head, o.precision, s);
    };
    kt.ms = timer.median_ms(o.warmup, o.reps, [&] {
        over_groups([&](int h0, int n) { launch_transpose(K.p + h0 * ks, KT.p, n, o.M, o.d, s); });
    });
    qk.ms = timer.median_ms(o.warmup, o.reps, [&] {
        over_groups([&](int h0, int n) {
            gemm_qk(blas, dims, n, Q.p + h0 * qs, K.p + h0 * ks, A.p, hg);
            stored(A.p, n, nm);
        });
    });
    sc.ms = timer.median_ms(o.warmup, o.reps, [&] {
        over_groups([&](int, int n) {
            launch_scale_mask(A.p, B.p, n, o.N, o.M, o.scale, o.causal, s);
            stored(B.p, n, nm);
        });
    });
    sm.ms = timer.median_ms(o.warmup, o.reps, [&] {
        over_groups([&](int, int n) {
            launch_softmax_rows(B.p, A.p, static_cast<long long>(n) * o.N, o.M, s);
            stored(A.p, n, nm);
        });
    });
    ov.ms = timer.median_ms(o.warmup, o.reps, [&] {
        over_groups([&](int h0, int n) {
            gemm_output(blas, dims, n, A.p, V.p + h0 * ks, O.p, hg);
            stored(O.p, n, qs);
        });
    });
    for (Result* r : {&kt, &qk, &sc, &sm, &ov}) out->push_back(*r);
}

// Whether a kernel named `kernel` (run.toml's name: "cuda-wgmma-bf16-split2") computes in o's
// precision: at bf16/fp16 it must name the format; one that would run the problem in another
// format is not timed as a half kernel. Any name does at fp32 and tf32.
bool names_precision(const Options& o, const std::string& kernel) {
    return !is_half(o.precision) || kernel.find(std::string("-") + precision_name(o.precision)) != std::string::npos;
}

// Times one flash kernel and checks it; `why` (not empty) says why there is no kernel for the
// problem, and the row is "unsupported" with that reason.
template <class Launch>
void bench_flash(const Options& o, const std::string& name, const std::string& tiles, const std::string& why,
                 Launch&& launch, const DeviceBuffer& Q, const DeviceBuffer& K, const DeviceBuffer& V,
                 DeviceBuffer& O, DeviceBuffer& lse, int total_heads, Timer& timer, cudaStream_t s,
                 std::vector<Result>* out) {
    Result r{name, Kind::attention};
    r.flops = attention_flops(o, total_heads);
    r.tiles = tiles;
    if (!why.empty()) {
        r.status = "unsupported";
        r.reason = why;
        out->push_back(r);
        return;
    }
    // Poisoned outputs: an element the kernel never writes stays NaN and fails the check.
    poison_fill(O.p, O.n, s);
    poison_fill(lse.p, lse.n, s);
    launch();
    CUDA_CHECK(cudaStreamSynchronize(s));
    if (o.check) check_flash(o, Q, K, V, O, lse, total_heads, &r);
    r.ms = timer.median_ms(o.warmup, o.reps, launch);
    out->push_back(r);
}

// The plan `flash_forward` (the dispatcher, `--flash-kernel auto`) runs, or why it has none for
// the problem at o's precision (a one-line refusal of the dispatcher is a reason, not an error).
std::string dispatcher_plan(const Options& o, const FlashArgs& a, FlashPlan* plan) {
    if (!flash_supported(bench_dims(o)))
        return "no flash kernel for d=" + std::to_string(o.d) + " (widths " + flash_head_dims_text() + ")";
    try {
        *plan = flash_forward_plan(a);
    } catch (const Error& e) {
        if (e.exit_code != kExitBadInput) throw;
        return e.what();
    }
    if (!names_precision(o, plan->kernel))
        return std::string("no ") + precision_name(o.precision) + " flash kernel (it would run " + plan->kernel + ")";
    return "";
}

// The flash forward: `auto` as `main` runs it (every kernel of its pass, preparation passes and
// split combines included; at bf16/fp16 the inputs in the format are made before, as main makes
// them when it uploads them), then each tensor-core kernel forced, with --splits and (mma.sync)
// --fast-variant.
void bench_flash_kernels(const Options& o, const DeviceBuffer& Q, const DeviceBuffer& K, const DeviceBuffer& V,
                         int total_heads, Timer& timer, cudaStream_t s, std::vector<Result>* out) {
    DeviceBuffer O(size_t(total_heads) * o.N * o.d), lse(size_t(total_heads) * o.N);
    FlashArgs a{{Q.p, K.p, V.p, total_heads, o.N, o.M, o.d, o.scale, o.causal, o.precision}, O.p, lse.p};
    // At a half precision the inputs in the format as well, made before the timing (as SDPA is
    // given them): the half flash kernel reads those (FlashArgs::Qh).
    const FormatInputs format(o.precision, Q, K, V, s);
    format.attach(&a);
    FlashPlan plan;
    const std::string why = dispatcher_plan(o, a, &plan);
    const std::string tiles =
        why.empty() ? std::to_string(plan.Br) + "x" + std::to_string(plan.Bc) + ", " + plan.kernel : "";
    bench_flash(o, "flash", tiles, why, [&] { flash_forward(a, s); }, Q, K, V, O, lse, total_heads, timer, s, out);
    for (const FlashKernelOps* k : flash_kernels()) {
        if (!k->tensor_cores) continue;
        const int config = k->id == FlashKernel::fast ? o.fast_variant : 0;
        KernelPlan kp;
        const bool has = config == 0 ? k->plan(a, o.splits, &kp) : flash_fast_config_plan(a, config, o.splits, &kp);
        std::string tiles, why;
        const std::string at = is_half(o.precision) ? std::string(" at ") + precision_name(o.precision) : "";
        if (!has) why = std::string("no ") + k->name + " variant for d=" + std::to_string(o.d) + at + " on this GPU";
        else if (!names_precision(o, flash_plan_name(*k, a, kp)))
            why = std::string("no ") + precision_name(o.precision) + " " + k->name + " variant";
        if (config != 0) tiles = "variant " + std::to_string(config);
        else if (has) tiles = std::to_string(kp.Br) + "x" + std::to_string(kp.Bc) + ", splits " + std::to_string(kp.splits);
        bench_flash(o, std::string("flash_") + k->name, tiles, why, [&] { flash_launch(*k, a, kp, s); }, Q, K, V, O,
                    lse, total_heads, timer, s, out);
    }
}

// Every row --pass and --only ask for, on inputs generated once (bench_inputs.h).
BenchRun bench_all(const Options& o, const cudaDeviceProp& prop, cublasHandle_t blas, Timer& timer, cudaStream_t s) {
    const int total_heads = o.batch * o.heads;
    BenchRun run;
    DeviceBuffer Q(size_t(total_heads) * o.N * o.d), K(size_t(total_heads) * o.M * o.d),
        V(size_t(total_heads) * o.M * o.d);
    fill(Q, input_seed(o.seed, BenchInput::Q), s);
    fill(K, input_seed(o.seed, BenchInput::K), s);
    fill(V, input_seed(o.seed, BenchInput::V), s);
    if (o.check) {
        CUDA_CHECK(cudaStreamSynchronize(s));  // the fills are done before the host reads them
        run.inputs_checksum = inputs_checksum(o, Q, K, V, total_heads);
    }
    if (o.ceilings) {
        // An estimate for the SGEMM ceiling's shape; the stage path sizes its groups again once
        // the ceilings' buffers are freed.
        run.ceilings = measure_ceilings(o, prop, stage_group(o, total_heads), blas, timer, s);
        run.ceilings.measured = true;
    }
    if (times_forward(o)) {
        if (o.only != "flash") bench_stage_path(o, blas, &run.group, Q, K, V, total_heads, timer, s, &run.results);
        if (o.only != "stages") bench_flash_kernels(o, Q, K, V, total_heads, timer, s, &run.results);
    }
    if (times_backward(o)) {
        DeviceBuffer dO(size_t(total_heads) * o.N * o.d);
        fill(dO, kGradSeedBase + o.seed, s);
        bench_backward(o, blas, BackwardInputs{Q, K, V, dO}, total_heads, timer, s, &run.backward_group,
                       &run.results);
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
