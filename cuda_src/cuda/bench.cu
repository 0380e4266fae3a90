// bench.cu — `main --bench`: times every stage of the binary on one shape with device events and
// reports it against ceilings measured in the same run (bench_ceilings.cu); options in
// bench_options.cu, the float64 check of the flash forward in bench_check.cu, the backward's rows
// in bench_backward.cu.
//
//   build/main --bench [--batch B --heads H --seq-q N --seq-k M --d D --causal --scale S
//                       --precision fp32|tf32 --warmup W --reps R --json FILE --check
//                       --check-rows K --only all|stages|flash --pass forward|backward|both
//                       --no-ceilings --fast-variant I --splits S]
//
// Inputs are generated on the device (a hash of the element index, uniform in [-1, 1)), so no
// text I/O is timed. Each kernel runs W times, then R timed runs, each between two cudaEvents;
// the median is reported. Rates: TFLOP/s for the GEMMs (2·N·M·d per head each) and the flash
// forward (4·B·H·N·M·d, halved when causal), GB/s of bytes read + written for the memory-bound
// stages (KT, QK_scaled, attention_weights), each against its ceiling. The stage path runs the
// backend's own kernels and GEMM calls (gemm.cuh) and needs two N×M buffers per head; heads go
// through in groups that fit in device memory (a stage's time is summed over groups), or the
// stage path is reported as "skipped (memory)". The flash forward is timed as `auto` runs it and
// with each tensor-core kernel forced (--splits forces their KV split, --fast-variant picks an
// exploration configuration of the mma.sync kernel). --pass picks the forward rows, the backward
// rows (bench_backward.cu: the backward stage path and the flash backward, from a generated dO),
// or both (the default). --no-ceilings skips the ceilings (no fraction is reported then). --check
// exits 1 when a flash kernel or a backward pass exceeds the tolerance against float64.
//
// Output: a table on stdout; with --json, the same numbers as JSON (written atomically), read by
// verify/bench.py.
#include "../bench.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "../backend.h"
#include "../common.h"
#include "../stages.h"
#include "bench_parts.cuh"
#include "cuda_check.cuh"
#include "flash_dispatch.cuh"
#include "flash_fast.cuh"
#include "gemm.cuh"
#include "kernels.cuh"

namespace attnstep {
namespace bench {

namespace {

constexpr size_t kMemoryMargin = size_t(1) << 30;  // left free for cuBLAS and the runtime
// dO's fill seed: far from 3·seed + 1..3 (Q, K, V) of any --seed, so dO never repeats an input.
constexpr uint64_t kGradSeedBase = uint64_t(1) << 40;

// ---------------------------------------------------------------------------------------------
// Inputs

// Uniform in [-1, 1) from a 64-bit mix of (seed, index): random-looking, reproducible, no state.
__global__ void fill_uniform(float* p, size_t n, uint64_t seed) {
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
         i += size_t(gridDim.x) * blockDim.x) {
        uint64_t z = (i + 1) * 0x9E3779B97F4A7C15ull ^ (seed * 0xD1B54A32D192ED03ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        p[i] = static_cast<float>(static_cast<double>(z >> 40) * (2.0 / 16777216.0) - 1.0);
    }
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

const char* kind_name(Kind k) {
    switch (k) {
        case Kind::memory: return "memory";
        case Kind::gemm: return "gemm";
        case Kind::attention: return "attention";
    }
    return "?";
}

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

// Heads per group so that KT, two N×M buffers and the output fit.
int stage_group(const Options& o, int total_heads) {
    return heads_that_fit(4.0 * (2.0 * o.N * o.M + static_cast<double>(o.d) * o.M + static_cast<double>(o.N) * o.d),
                          total_heads);
}

// ---------------------------------------------------------------------------------------------
// Output

std::string fmt(const char* f, double x) {
    char buf[64];
    std::snprintf(buf, sizeof buf, f, x);
    return buf;
}

// JSON numbers: non-finite values become null (JSON has no inf/nan).
std::string num(double x) { return std::isfinite(x) ? fmt("%.6g", x) : "null"; }

std::string json_escape(const std::string& s) {
    std::string out;
    for (char c : s) {
        if (c == '"' || c == '\\') out += '\\';
        if (static_cast<unsigned char>(c) < 0x20) continue;
        out += c;
    }
    return out;
}

void print_table(const Options& o, const std::string& device, const Ceilings& c, int group, int backward_group,
                 const std::vector<Result>& results) {
    std::printf("bench: %s  B=%d H=%d N=%d M=%d d=%d %s precision=%s  (median of %d, %d warm-up)\n",
                device.c_str(), o.batch, o.heads, o.N, o.M, o.d, o.causal ? "causal" : "non-causal",
                precision_name(o.precision), o.reps, o.warmup);
    if (c.measured) {
        std::printf("ceilings: cuBLAS SGEMM (QK shape) %.1f TFLOP/s, device copy %.0f GB/s, "
                    "mma.sync TF32 %.0f / BF16 %.0f TFLOP/s, wgmma TF32 %.0f TFLOP/s\n",
                    c.sgemm_tflops, c.copy_gbps, c.mma_tf32_tflops, c.mma_bf16_tflops, c.wgmma_tf32_tflops);
    }
    if (group > 0) std::printf("stage path in groups of %s\n", plural(group, "head").c_str());
    if (backward_group > 0)
        std::printf("backward stage path in groups of %s\n", plural(backward_group, "head").c_str());
    std::printf("%-18s %10s %16s %9s  %s\n", "kernel", "ms", "rate", "ceiling", "note");
    for (const Result& r : results) {
        if (r.status != "ok") {
            std::printf("%-18s %10s %16s %9s  %s\n", r.name.c_str(), "-", "-", "-", r.status.c_str());
            continue;
        }
        const std::string rate = r.kind == Kind::memory ? fmt("%.0f GB/s", r.rate) : fmt("%.2f TFLOP/s", r.rate);
        std::string note = r.tiles;
        if (r.checked) {
            note += (note.empty() ? "" : "; ") + std::string(r.backward ? "dQ/dK/dV err " : "max rel err ") +
                    (r.backward ? fmt("%.2e", r.grad_err[0]) + " / " + fmt("%.2e", r.grad_err[1]) + " / " +
                                      fmt("%.2e", r.grad_err[2])
                                : fmt("%.2e", r.max_rel_err)) +
                    (r.check_passed ? " ok" : " FAIL");
        }
        const std::string ceiling = c.measured ? fmt("%.0f%%", 100.0 * r.fraction) : "-";
        std::printf("%-18s %10.4f %16s %9s  %s\n", r.name.c_str(), r.ms, rate.c_str(), ceiling.c_str(), note.c_str());
    }
}

// The ceilings as a JSON object: {} under --no-ceilings.
std::string json_ceilings(const Ceilings& c) {
    if (!c.measured) return "{}";
    std::ostringstream js;
    js << "{\"sgemm_ms\": " << num(c.sgemm_ms) << ", \"sgemm_tflops\": " << num(c.sgemm_tflops)
       << ", \"copy_ms\": " << num(c.copy_ms) << ", \"copy_gbps\": " << num(c.copy_gbps)
       << ", \"copy_bytes\": " << num(2.0 * kCopyBytes) << ", \"mma_tf32_tflops\": " << num(c.mma_tf32_tflops)
       << ", \"mma_bf16_tflops\": " << num(c.mma_bf16_tflops)
       << ", \"wgmma_tf32_tflops\": " << num(c.wgmma_tf32_tflops) << "}";
    return js.str();
}

// One kernel row as a JSON object; "pass" says forward or backward, "fraction" is there when the
// ceilings were measured, "check" when the row was compared with float64.
std::string json_kernel(const Result& r, bool ceilings) {
    std::ostringstream js;
    js << "{\"name\": \"" << json_escape(r.name) << "\", \"kind\": \"" << kind_name(r.kind)
       << "\", \"pass\": \"" << (r.backward ? "backward" : "forward") << "\", \"status\": \""
       << json_escape(r.status) << "\"";
    if (r.status != "ok") return js.str() + "}";
    js << ", \"ms\": " << num(r.ms) << ", \"flops\": " << num(r.flops) << ", \"bytes\": " << num(r.bytes) << ", \""
       << (r.kind == Kind::memory ? "gbps" : "tflops") << "\": " << num(r.rate);
    if (ceilings) js << ", \"fraction\": " << num(r.fraction);
    if (!r.tiles.empty()) js << ", \"tiles\": \"" << json_escape(r.tiles) << "\"";
    if (r.checked) {
        js << ", \"check\": {\"passed\": " << (r.check_passed ? "true" : "false")
           << ", \"max_rel_err\": " << num(r.max_rel_err);
        if (r.backward) {
            js << ", \"max_dq_err\": " << num(r.grad_err[0]) << ", \"max_dk_err\": " << num(r.grad_err[1])
               << ", \"max_dv_err\": " << num(r.grad_err[2]);
        } else {
            js << ", \"max_lse_err\": " << num(r.max_lse_err);
        }
        js << "}";
    }
    return js.str() + "}";
}

// Written to a temporary name and renamed, so that a reader never sees half a file.
void write_atomically(const std::string& path, const std::string& text) {
    const std::string tmp = path + ".tmp";
    {
        std::ofstream f(tmp, std::ios::binary);
        if (!f) fail(kExitBadInput, "--json: cannot write '" + tmp + "'", "check that the folder exists");
        f << text;
        if (!f.flush()) fail(kExitBadInput, "--json: writing '" + tmp + "' failed");
    }
    if (std::rename(tmp.c_str(), path.c_str()) != 0) {
        std::remove(tmp.c_str());
        fail(kExitBadInput, "--json: cannot rename '" + tmp + "' to '" + path + "'");
    }
}

void write_json(const Options& o, const std::string& device, int sms, const Ceilings& c, int group,
                int backward_group, const std::vector<Result>& results, bool passed) {
    std::ostringstream js;
    const std::time_t now = std::time(nullptr);
    char date[32];
    std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
    js << "{\n  \"tool\": \"attnstep bench\",\n  \"format\": 1,\n"
       << "  \"device\": \"" << json_escape(device) << "\",\n  \"sm_count\": " << sms << ",\n"
       << "  \"date\": \"" << date << "\",\n"
       << "  \"shape\": {\"batch\": " << o.batch << ", \"heads\": " << o.heads << ", \"seq_q\": " << o.N
       << ", \"seq_k\": " << o.M << ", \"d\": " << o.d << ", \"causal\": " << (o.causal ? "true" : "false")
       << ", \"scale\": " << num(o.scale) << "},\n"
       << "  \"precision\": \"" << precision_name(o.precision) << "\",\n  \"warmup\": " << o.warmup
       << ",\n  \"reps\": " << o.reps << ",\n  \"stage_group_heads\": " << group
       << ",\n  \"backward_group_heads\": " << backward_group << ",\n"
       << "  \"ceilings\": " << json_ceilings(c) << ",\n"
       << "  \"passed\": " << (passed ? "true" : "false") << ",\n  \"kernels\": [\n";
    for (size_t i = 0; i < results.size(); ++i)
        js << "    " << json_kernel(results[i], c.measured) << (i + 1 < results.size() ? "," : "") << "\n";
    js << "  ]\n}\n";
    write_atomically(o.json, js.str());
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
    try {
        KTb = std::make_unique<DeviceBuffer>(size_t(G) * o.d * o.M);
        Ab = std::make_unique<DeviceBuffer>(size_t(G) * o.N * o.M);
        Bb = std::make_unique<DeviceBuffer>(size_t(G) * o.N * o.M);
        Ob = std::make_unique<DeviceBuffer>(size_t(G) * o.N * o.d);
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
    const size_t qs = size_t(o.N) * o.d, ks = size_t(o.M) * o.d;
    kt.ms = timer.median_ms(o.warmup, o.reps, [&] {
        over_groups([&](int h0, int n) { launch_transpose(K.p + h0 * ks, KT.p, n, o.M, o.d, s); });
    });
    qk.ms = timer.median_ms(o.warmup, o.reps, [&] {
        over_groups([&](int h0, int n) { gemm_qk(blas, dims, n, Q.p + h0 * qs, K.p + h0 * ks, A.p); });
    });
    sc.ms = timer.median_ms(o.warmup, o.reps, [&] {
        over_groups([&](int, int n) { launch_scale_mask(A.p, B.p, n, o.N, o.M, o.scale, o.causal, s); });
    });
    sm.ms = timer.median_ms(o.warmup, o.reps, [&] {
        over_groups([&](int, int n) { launch_softmax_rows(B.p, A.p, static_cast<long long>(n) * o.N, o.M, s); });
    });
    ov.ms = timer.median_ms(o.warmup, o.reps, [&] {
        over_groups([&](int h0, int n) { gemm_output(blas, dims, n, A.p, V.p + h0 * ks, O.p); });
    });
    for (Result* r : {&kt, &qk, &sc, &sm, &ov}) out->push_back(*r);
}

// Times one flash kernel (`launch` returns false when it declines the shape) and checks it.
template <class Launch>
void bench_flash(const Options& o, const char* name, const std::string& tiles, Launch&& launch,
                 const DeviceBuffer& Q, const DeviceBuffer& K, const DeviceBuffer& V,
                 DeviceBuffer& O, DeviceBuffer& lse, int total_heads, Timer& timer, cudaStream_t s,
                 std::vector<Result>* out) {
    Result r{name, Kind::attention};
    r.flops = 4.0 * total_heads * o.N * double(o.M) * o.d * (o.causal ? 0.5 : 1.0);
    r.tiles = tiles;
    // Poisoned outputs: an element the kernel never writes stays NaN and fails the check.
    poison_fill(O.p, O.n, s);
    poison_fill(lse.p, lse.n, s);
    if (!launch()) {
        r.status = "unsupported";
        out->push_back(r);
        return;
    }
    CUDA_CHECK(cudaStreamSynchronize(s));
    if (o.check) check_flash(o, Q, K, V, O, lse, total_heads, &r);
    r.ms = timer.median_ms(o.warmup, o.reps, [&] { launch(); });
    out->push_back(r);
}

// The flash forward: `auto` as `main` runs it, then each tensor-core kernel forced, with --splits
// and (mma.sync) --fast-variant.
void bench_flash_kernels(const Options& o, const DeviceBuffer& Q, const DeviceBuffer& K, const DeviceBuffer& V,
                         int total_heads, Timer& timer, cudaStream_t s, std::vector<Result>* out) {
    DeviceBuffer O(size_t(total_heads) * o.N * o.d), lse(size_t(total_heads) * o.N);
    FlashArgs a{Q.p, K.p, V.p, O.p, lse.p, total_heads, o.N, o.M, o.d, o.scale, o.causal, o.precision};
    const bool supported = flash_supported(bench_dims(o));
    FlashPlan plan;
    if (supported) plan = flash_forward_plan(a);
    bench_flash(o, "flash", supported ? std::to_string(plan.Br) + "x" + std::to_string(plan.Bc) : "",
                [&] {
                    if (!supported) return false;
                    flash_forward(a, s);
                    return true;
                },
                Q, K, V, O, lse, total_heads, timer, s, out);
    for (const FlashKernelOps* k : flash_kernels()) {
        if (!k->tensor_cores) continue;
        const int config = k->id == FlashKernel::fast ? o.fast_variant : 0;
        KernelPlan kp;
        const bool has = config == 0 ? k->plan(a, o.splits, &kp) : flash_fast_config_plan(a, config, o.splits, &kp);
        std::string tiles;
        if (config != 0) tiles = "variant " + std::to_string(config);
        else if (has) tiles = std::to_string(kp.Br) + "x" + std::to_string(kp.Bc) + ", splits " + std::to_string(kp.splits);
        bench_flash(o, (std::string("flash_") + k->name).c_str(), tiles,
                    [&] {
                        if (has) flash_launch(*k, a, kp, s);
                        return has;
                    },
                    Q, K, V, O, lse, total_heads, timer, s, out);
    }
}

// Every row --pass and --only ask for, on inputs generated once; `group` and `backward_group` get
// the stage paths' group sizes.
Ceilings bench_all(const Options& o, const cudaDeviceProp& prop, cublasHandle_t blas, Timer& timer, cudaStream_t s,
                   int* group, int* backward_group, std::vector<Result>* results) {
    const int total_heads = o.batch * o.heads;
    Ceilings c;
    DeviceBuffer Q(size_t(total_heads) * o.N * o.d), K(size_t(total_heads) * o.M * o.d),
        V(size_t(total_heads) * o.M * o.d);
    fill(Q, 3ull * o.seed + 1, s);
    fill(K, 3ull * o.seed + 2, s);
    fill(V, 3ull * o.seed + 3, s);
    if (o.ceilings) {
        // An estimate for the SGEMM ceiling's shape; the stage path sizes its groups again once
        // the ceilings' buffers are freed.
        c = measure_ceilings(o, prop, stage_group(o, total_heads), blas, timer, s);
        c.measured = true;
    }
    if (times_forward(o)) {
        if (o.only != "flash") bench_stage_path(o, blas, group, Q, K, V, total_heads, timer, s, results);
        if (o.only != "stages") bench_flash_kernels(o, Q, K, V, total_heads, timer, s, results);
    }
    if (times_backward(o)) {
        DeviceBuffer dO(size_t(total_heads) * o.N * o.d);
        fill(dO, kGradSeedBase + o.seed, s);
        bench_backward(o, blas, BackwardInputs{Q, K, V, dO}, total_heads, timer, s, backward_group, results);
    }
    CUDA_CHECK(cudaStreamSynchronize(s));
    return c;
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

    std::vector<Result> results;
    int group = 0, backward_group = 0;
    const Ceilings c = bench_all(o, prop, blas, timer, s, &group, &backward_group, &results);
    bool passed = true;
    for (Result& r : results) {
        if (r.status == "ok") set_rate(r, c);
        if (r.checked && !r.check_passed) passed = false;
    }
    print_table(o, device, c, group, backward_group, results);
    if (!o.json.empty()) write_json(o, device, prop.multiProcessorCount, c, group, backward_group, results, passed);
    cublasDestroy(blas);
    cudaStreamDestroy(s);
    if (!passed) {
        std::fprintf(stderr, "main: error: --bench --check: a result exceeds the %s tolerance %.0e "
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
