// bench.cu — `main --bench`: times every stage of the binary on one shape with device events and
// reports it against ceilings measured in the same run.
//
//   build/main --bench [--batch B --heads H --seq-q N --seq-k M --d D --causal --scale S
//                       --precision fp32|tf32 --warmup W --reps R --json FILE --check
//                       --check-rows K --only all|stages|flash --fast-variant I --splits S]
//
// Inputs are generated on the device (a hash of the element index, uniform in [-1, 1)), so no
// text I/O is timed. Each kernel runs W times, then R timed runs, each between two cudaEvents;
// the median is reported. Rates: TFLOP/s for the GEMMs (2·N·M·d per head each) and the flash
// forward (4·B·H·N·M·d, halved when causal), GB/s of bytes read + written for the memory-bound
// stages (KT, QK_scaled, attention_weights). Ceilings measured in the same run: the cuBLAS
// strided-batched SGEMM on the QK shape (the stage path's own call; TF32 math under
// --precision tf32), a device-to-device copy, and the issue rates of mma.sync TF32 (flash_fast's
// tensor-core ceiling) and BF16. The stage path needs two N×M buffers per head; heads go through
// in groups that fit in device memory (a stage's time is summed over groups), or the stage path
// is reported as "skipped (memory)". --check compares sampled rows of every flash
// kernel's output and lse with a float64 host computation (all rows with --check-rows 0) and
// exits 1 when one exceeds the tolerance, so a fast but wrong kernel is caught.
//
// Output: a table on stdout; with --json, the same numbers as JSON (written atomically), read by
// verify/bench.py. Versions: v1 (this file; the mma.sync ceilings and the re-measured group size
// were added after the last device run of its session and have not run on a GPU yet).
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
#include "cuda_check.cuh"
#include "flash_dispatch.cuh"
#include "flash_fast.cuh"
#include "kernels.cuh"
#ifdef ATTNSTEP_HAVE_WGMMA
#include "sm90a/flash_wgmma.cuh"
#endif

namespace attnstep {

namespace {

constexpr double kFp32CheckTol = 1e-4;  // a plain FP32 kernel lands near 1e-6 on these inputs
constexpr double kTf32CheckTol = 5e-3;  // TF32 operands: ~3e-4 expected
constexpr size_t kCopyBytes = size_t(1) << 30;  // the bandwidth ceiling's copy (1 GiB)
constexpr size_t kMemoryMargin = size_t(1) << 30;  // left free for cuBLAS and the runtime

// ---------------------------------------------------------------------------------------------
// Options

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

[[noreturn]] void bad_option(const std::string& what) {
    fail(kExitBadInput, "--bench: " + what, "run 'main --help' for the --bench options");
}

int parse_int(const std::string& flag, const char* text, int lo, int hi) {
    char* end = nullptr;
    const long v = std::strtol(text, &end, 10);
    if (!*text || *end || v < lo || v > hi) {
        bad_option(flag + " needs an integer in " + std::to_string(lo) + ".." + std::to_string(hi) +
                   ", got '" + text + "'");
    }
    return static_cast<int>(v);
}

Options parse_options(int argc, char** argv) {
    Options o;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        auto value = [&]() -> const char* {
            if (i + 1 >= argc) bad_option(a + " needs a value");
            return argv[++i];
        };
        if (a == "--bench") continue;
        else if (a == "--batch") o.batch = parse_int(a, value(), 1, 1 << 20);
        else if (a == "--heads") o.heads = parse_int(a, value(), 1, 1 << 20);
        else if (a == "--seq-q") o.N = parse_int(a, value(), 1, 1 << 24);
        else if (a == "--seq-k") o.M = parse_int(a, value(), 1, 1 << 24);
        else if (a == "--d") o.d = parse_int(a, value(), 1, 256);
        else if (a == "--causal") o.causal = true;
        else if (a == "--scale") {
            const char* t = value();
            char* end = nullptr;
            o.scale = std::strtof(t, &end);
            if (!*t || *end || !std::isfinite(o.scale) || o.scale == 0.f)
                bad_option("--scale needs a finite non-zero number, got '" + std::string(t) + "'");
        } else if (a == "--precision") {
            const std::string p = value();
            if (p == "fp32") o.precision = Precision::fp32;
            else if (p == "tf32") o.precision = Precision::tf32;
            else bad_option("--precision must be fp32 or tf32, got '" + p + "'");
        } else if (a == "--warmup") o.warmup = parse_int(a, value(), 0, 1000);
        else if (a == "--reps") o.reps = parse_int(a, value(), 1, 10000);
        else if (a == "--json") o.json = value();
        else if (a == "--check") o.check = true;
        else if (a == "--check-rows") o.check_rows = parse_int(a, value(), 0, 1 << 24);
        else if (a == "--only") {
            o.only = value();
            if (o.only != "all" && o.only != "stages" && o.only != "flash")
                bad_option("--only must be all, stages or flash, got '" + o.only + "'");
        } else if (a == "--fast-variant") o.fast_variant = parse_int(a, value(), 0, 15);
        else if (a == "--splits") o.splits = parse_int(a, value(), 0, 64);
        else if (a == "--seed") o.seed = static_cast<unsigned>(parse_int(a, value(), 0, 1 << 30));
        else bad_option("unknown option '" + a + "'");
    }
    if (o.scale == 0.f) o.scale = 1.f / std::sqrt(static_cast<float>(o.d));
    const long long heads = static_cast<long long>(o.batch) * o.heads;
    if (heads > (1 << 20)) bad_option("batch × heads = " + std::to_string(heads) + " is too many");
    return o;
}

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

void fill(DeviceBuffer& b, uint64_t seed, cudaStream_t s) {
    fill_uniform<<<1024, 256, 0, s>>>(b.p, b.n, seed);
    LAUNCH_CHECK(fill_uniform);
}

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
const char* kind_name(Kind k) {
    switch (k) {
        case Kind::memory: return "memory";
        case Kind::gemm: return "gemm";
        case Kind::attention: return "attention";
    }
    return "?";
}

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

// ---------------------------------------------------------------------------------------------
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

void set_rate(Result& r, const Ceilings& c) {
    if (r.kind == Kind::memory) {
        r.rate = r.bytes / (r.ms * 1e-3) / 1e9;
        r.fraction = c.copy_gbps > 0 ? r.rate / c.copy_gbps : 0;
    } else {
        r.rate = r.flops / (r.ms * 1e-3) / 1e12;
        r.fraction = c.sgemm_tflops > 0 ? r.rate / c.sgemm_tflops : 0;
    }
}

// ---------------------------------------------------------------------------------------------
// The stage path: the same kernels and cuBLAS calls as backend_cuda.cu, per group of heads.

struct StagePath {
    const Options& o;
    cublasHandle_t blas;
    cudaStream_t stream;
    int group = 0;  // heads per group; 0 = does not fit

    // QK = Q·Kᵀ row-major, as CudaBackend::gemm_qk: column-major QKᵀ = Kᵀᵀ·Qᵀ.
    void gemm_qk(const float* Q, const float* K, float* QK, int heads) const {
        const float one = 1.f, zero = 0.f;
        CUBLAS_CHECK(cublasSgemmStridedBatched(
            blas, CUBLAS_OP_T, CUBLAS_OP_N, o.M, o.N, o.d, &one, K, o.d,
            static_cast<long long>(o.M) * o.d, Q, o.d, static_cast<long long>(o.N) * o.d, &zero, QK,
            o.M, static_cast<long long>(o.N) * o.M, heads));
    }
    // O = P·V row-major, as CudaBackend::gemm_output.
    void gemm_output(const float* P, const float* V, float* O, int heads) const {
        const float one = 1.f, zero = 0.f;
        CUBLAS_CHECK(cublasSgemmStridedBatched(
            blas, CUBLAS_OP_N, CUBLAS_OP_N, o.d, o.N, o.M, &one, V, o.d,
            static_cast<long long>(o.M) * o.d, P, o.M, static_cast<long long>(o.N) * o.M, &zero, O,
            o.d, static_cast<long long>(o.N) * o.d, heads));
    }
};

// Heads per group so that KT, two N×M buffers and the output fit in the free device memory,
// leaving a margin for cuBLAS and the runtime (1 GiB or 3% of the card, the larger).
int stage_group(const Options& o, int total_heads) {
    size_t free_bytes = 0, total_bytes = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    const size_t margin = std::max(kMemoryMargin, total_bytes / 32);
    const double per_head = 4.0 * (2.0 * o.N * o.M + static_cast<double>(o.d) * o.M +
                                   static_cast<double>(o.N) * o.d);
    const double usable = free_bytes > margin ? double(free_bytes - margin) : 0.0;
    return static_cast<int>(std::min<double>(total_heads, std::floor(usable / per_head)));
}

// ---------------------------------------------------------------------------------------------
// The float64 check of a flash kernel's output on sampled rows.

struct HostInputs {
    std::vector<float> q, k, v;  // one head
};

void copy_head(const Options& o, const DeviceBuffer& Q, const DeviceBuffer& K, const DeviceBuffer& V,
               int head, HostInputs* h) {
    h->q.resize(size_t(o.N) * o.d);
    h->k.resize(size_t(o.M) * o.d);
    h->v.resize(size_t(o.M) * o.d);
    CUDA_CHECK(cudaMemcpy(h->q.data(), Q.p + size_t(head) * o.N * o.d, h->q.size() * 4, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(h->k.data(), K.p + size_t(head) * o.M * o.d, h->k.size() * 4, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(h->v.data(), V.p + size_t(head) * o.M * o.d, h->v.size() * 4, cudaMemcpyDeviceToHost));
}

// Reference row r: o = softmax(scale·q_r·Kᵀ)·V over the visible keys, lse = log Σ exp(...).
void reference_row(const Options& o, const HostInputs& h, int r, std::vector<double>* out,
                   double* lse) {
    const int visible = o.causal ? std::min(o.M, r + 1) : o.M;
    std::vector<double> s(visible);
    double mx = -INFINITY;
    for (int j = 0; j < visible; ++j) {
        double acc = 0;
        for (int c = 0; c < o.d; ++c) acc += double(h.q[size_t(r) * o.d + c]) * h.k[size_t(j) * o.d + c];
        s[j] = acc * o.scale;
        mx = std::max(mx, s[j]);
    }
    double l = 0;
    out->assign(o.d, 0.0);
    for (int j = 0; j < visible; ++j) {
        const double p = std::exp(s[j] - mx);
        l += p;
        for (int c = 0; c < o.d; ++c) (*out)[c] += p * h.v[size_t(j) * o.d + c];
    }
    for (double& x : *out) x /= l;
    *lse = mx + std::log(l);
}

// Rows to check in each checked head: the first and last rows, tile edges, the middle, and a few
// spread ones; all rows when check_rows == 0.
std::vector<int> rows_to_check(const Options& o) {
    std::vector<int> rows;
    if (o.check_rows == 0 || o.check_rows >= o.N) {
        for (int r = 0; r < o.N; ++r) rows.push_back(r);
        return rows;
    }
    const int fixed[] = {0, 1, 15, 16, 63, 64, 127, 128, o.N / 2, o.N - 2, o.N - 1};
    for (int r : fixed) if (r >= 0 && r < o.N) rows.push_back(r);
    for (int i = 0; static_cast<int>(rows.size()) < o.check_rows + 11 && i < o.check_rows; ++i)
        rows.push_back(static_cast<int>((static_cast<long long>(i) * 7919 + 13) % o.N));
    std::sort(rows.begin(), rows.end());
    rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
    return rows;
}

void check_flash(const Options& o, const DeviceBuffer& Q, const DeviceBuffer& K,
                 const DeviceBuffer& V, const DeviceBuffer& O, const DeviceBuffer& lse,
                 int total_heads, Result* r) {
    std::vector<int> heads;
    if (o.check_rows == 0) for (int h = 0; h < total_heads; ++h) heads.push_back(h);
    else {
        heads.push_back(0);
        if (total_heads > 1) heads.push_back(total_heads - 1);
    }
    const std::vector<int> rows = rows_to_check(o);
    HostInputs h;
    std::vector<float> orow(o.d);
    std::vector<double> ref;
    double worst = 0, worst_lse = 0;
    bool finite = true;
    for (int head : heads) {
        copy_head(o, Q, K, V, head, &h);
        std::vector<float> ohead(size_t(o.N) * o.d), lhead(o.N);
        CUDA_CHECK(cudaMemcpy(ohead.data(), O.p + size_t(head) * o.N * o.d, ohead.size() * 4, cudaMemcpyDeviceToHost));
        CUDA_CHECK(cudaMemcpy(lhead.data(), lse.p + size_t(head) * o.N, lhead.size() * 4, cudaMemcpyDeviceToHost));
        for (int row : rows) {
            double ref_lse = 0;
            reference_row(o, h, row, &ref, &ref_lse);
            double err = 0, mag = 0;
            for (int c = 0; c < o.d; ++c) {
                const double x = ohead[size_t(row) * o.d + c];
                if (!std::isfinite(x)) finite = false;
                err = std::max(err, std::fabs(x - ref[c]));
                mag = std::max(mag, std::fabs(ref[c]));
            }
            // Row-normwise relative error: elementwise ratios blow up where the output crosses 0.
            worst = std::max(worst, err / std::max(mag, 1e-30));
            const double l = lhead[row];
            if (!std::isfinite(l)) finite = false;
            worst_lse = std::max(worst_lse, std::fabs(l - ref_lse) / std::max(1.0, std::fabs(ref_lse)));
        }
    }
    const double tol = o.precision == Precision::tf32 ? kTf32CheckTol : kFp32CheckTol;
    r->checked = true;
    r->max_rel_err = finite ? worst : INFINITY;
    r->max_lse_err = finite ? worst_lse : INFINITY;
    r->check_passed = finite && worst <= tol && worst_lse <= tol;
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

void print_table(const Options& o, const std::string& device, const Ceilings& c, int group,
                 const std::vector<Result>& results) {
    std::printf("bench: %s  B=%d H=%d N=%d M=%d d=%d %s precision=%s  (median of %d, %d warm-up)\n",
                device.c_str(), o.batch, o.heads, o.N, o.M, o.d, o.causal ? "causal" : "non-causal",
                precision_name(o.precision), o.reps, o.warmup);
    std::printf("ceilings: cuBLAS SGEMM (QK shape) %.1f TFLOP/s, device copy %.0f GB/s, "
                "mma.sync TF32 %.0f / BF16 %.0f TFLOP/s, wgmma TF32 %.0f TFLOP/s%s\n",
                c.sgemm_tflops, c.copy_gbps, c.mma_tf32_tflops, c.mma_bf16_tflops, c.wgmma_tf32_tflops,
                group > 0 ? fmt(", stage path in groups of %.0f heads", group).c_str() : "");
    std::printf("%-18s %10s %16s %9s  %s\n", "kernel", "ms", "rate", "ceiling", "note");
    for (const Result& r : results) {
        if (r.status != "ok") {
            std::printf("%-18s %10s %16s %9s  %s\n", r.name.c_str(), "-", "-", "-", r.status.c_str());
            continue;
        }
        const std::string rate = r.kind == Kind::memory ? fmt("%.0f GB/s", r.rate) : fmt("%.2f TFLOP/s", r.rate);
        std::string note = r.tiles;
        if (r.checked) {
            note += (note.empty() ? "" : "; ") + std::string("max rel err ") + fmt("%.2e", r.max_rel_err) +
                    (r.check_passed ? " ok" : " FAIL");
        }
        std::printf("%-18s %10.4f %16s %8.0f%%  %s\n", r.name.c_str(), r.ms, rate.c_str(),
                    100.0 * r.fraction, note.c_str());
    }
}

void write_json(const Options& o, const std::string& device, int sms, const Ceilings& c, int group,
                const std::vector<Result>& results, bool passed) {
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
       << ",\n  \"reps\": " << o.reps << ",\n  \"stage_group_heads\": " << group << ",\n"
       << "  \"ceilings\": {\"sgemm_ms\": " << num(c.sgemm_ms) << ", \"sgemm_tflops\": " << num(c.sgemm_tflops)
       << ", \"copy_ms\": " << num(c.copy_ms) << ", \"copy_gbps\": " << num(c.copy_gbps)
       << ", \"copy_bytes\": " << num(2.0 * kCopyBytes)
       << ", \"mma_tf32_tflops\": " << num(c.mma_tf32_tflops)
       << ", \"mma_bf16_tflops\": " << num(c.mma_bf16_tflops)
       << ", \"wgmma_tf32_tflops\": " << num(c.wgmma_tf32_tflops) << "},\n"
       << "  \"passed\": " << (passed ? "true" : "false") << ",\n  \"kernels\": [\n";
    for (size_t i = 0; i < results.size(); ++i) {
        const Result& r = results[i];
        js << "    {\"name\": \"" << json_escape(r.name) << "\", \"kind\": \"" << kind_name(r.kind)
           << "\", \"status\": \"" << json_escape(r.status) << "\"";
        if (r.status == "ok") {
            js << ", \"ms\": " << num(r.ms) << ", \"flops\": " << num(r.flops) << ", \"bytes\": " << num(r.bytes)
               << ", \"" << (r.kind == Kind::memory ? "gbps" : "tflops") << "\": " << num(r.rate)
               << ", \"fraction\": " << num(r.fraction);
            if (!r.tiles.empty()) js << ", \"tiles\": \"" << json_escape(r.tiles) << "\"";
            if (r.checked) {
                js << ", \"check\": {\"passed\": " << (r.check_passed ? "true" : "false")
                   << ", \"max_rel_err\": " << num(r.max_rel_err) << ", \"max_lse_err\": " << num(r.max_lse_err)
                   << "}";
            }
        }
        js << "}" << (i + 1 < results.size() ? "," : "") << "\n";
    }
    js << "  ]\n}\n";
    const std::string tmp = o.json + ".tmp";
    {
        std::ofstream f(tmp, std::ios::binary);
        if (!f) fail(kExitBadInput, "--json: cannot write '" + tmp + "'", "check that the folder exists");
        f << js.str();
        if (!f.flush()) fail(kExitBadInput, "--json: writing '" + tmp + "' failed");
    }
    if (std::rename(tmp.c_str(), o.json.c_str()) != 0) {
        std::remove(tmp.c_str());
        fail(kExitBadInput, "--json: cannot rename '" + tmp + "' to '" + o.json + "'");
    }
}

// ---------------------------------------------------------------------------------------------
// The benchmark

Ceilings measure_ceilings(const Options& o, const StagePath& sp, Timer& timer, cudaStream_t s) {
    Ceilings c;
    {  // cuBLAS on the QK shape: one group of heads (at least one head)
        const int heads = std::max(1, std::min(sp.group, 8));
        DeviceBuffer q(size_t(heads) * o.N * o.d), k(size_t(heads) * o.M * o.d),
            out(size_t(heads) * o.N * o.M);
        fill(q, 11, s);
        fill(k, 12, s);
        c.sgemm_ms = timer.median_ms(o.warmup, o.reps, [&] { sp.gemm_qk(q.p, k.p, out.p, heads); });
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
    return c;
}

void bench_stage_path(const Options& o, StagePath& sp, const DeviceBuffer& Q,
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
    sp.group = stage_group(o, total_heads);  // measured now: the ceilings' buffers are freed
    if (sp.group < 1) return skipped();
    const int G = sp.group;
    std::unique_ptr<DeviceBuffer> KTb, Ab, Bb, Ob;
    try {
        KTb = std::make_unique<DeviceBuffer>(size_t(G) * o.d * o.M);
        Ab = std::make_unique<DeviceBuffer>(size_t(G) * o.N * o.M);
        Bb = std::make_unique<DeviceBuffer>(size_t(G) * o.N * o.M);
        Ob = std::make_unique<DeviceBuffer>(size_t(G) * o.N * o.d);
    } catch (const Error&) {
        cudaGetLastError();  // an out-of-memory error is not sticky; clear it and go on
        sp.group = 0;
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
        over_groups([&](int h0, int n) { sp.gemm_qk(Q.p + h0 * qs, K.p + h0 * ks, A.p, n); });
    });
    sc.ms = timer.median_ms(o.warmup, o.reps, [&] {
        over_groups([&](int, int n) { launch_scale_mask(A.p, B.p, n, o.N, o.M, o.scale, o.causal, s); });
    });
    sm.ms = timer.median_ms(o.warmup, o.reps, [&] {
        over_groups([&](int, int n) { launch_softmax_rows(B.p, A.p, static_cast<long long>(n) * o.N, o.M, s); });
    });
    ov.ms = timer.median_ms(o.warmup, o.reps, [&] {
        over_groups([&](int h0, int n) { sp.gemm_output(A.p, V.p + h0 * ks, O.p, n); });
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

int bench(const Options& o) {
    if (!cuda_device_available()) {
        fail(kExitBadInput, "--bench: no CUDA device found", "run the benchmark on a machine with an NVIDIA GPU");
    }
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    cudaDeviceProp prop{};
    CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    const std::string device = prop.name;

    const int total_heads = o.batch * o.heads;
    cudaStream_t s = nullptr;
    CUDA_CHECK(cudaStreamCreate(&s));
    cublasHandle_t blas = nullptr;
    CUBLAS_CHECK(cublasCreate(&blas));
    CUBLAS_CHECK(cublasSetStream(blas, s));
    CUBLAS_CHECK(cublasSetMathMode(
        blas, o.precision == Precision::tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
    Timer timer(s);

    std::vector<Result> results;
    Ceilings c;
    int group = 0;
    bool passed = true;
    {
        DeviceBuffer Q(size_t(total_heads) * o.N * o.d), K(size_t(total_heads) * o.M * o.d),
            V(size_t(total_heads) * o.M * o.d), O(size_t(total_heads) * o.N * o.d),
            lse(size_t(total_heads) * o.N);
        fill(Q, 3ull * o.seed + 1, s);
        fill(K, 3ull * o.seed + 2, s);
        fill(V, 3ull * o.seed + 3, s);
        // An estimate for the SGEMM ceiling's shape; the stage path sizes its groups again once
        // the ceilings' buffers are freed.
        StagePath sp{o, blas, s, stage_group(o, total_heads)};
        c = measure_ceilings(o, sp, timer, s);
        c.mma_tf32_tflops = measure_mma<false>(prop, timer, o.warmup, o.reps, s);
        c.mma_bf16_tflops = measure_mma<true>(prop, timer, o.warmup, o.reps, s);
        c.wgmma_tf32_tflops = measure_wgmma(timer, o.warmup, o.reps, s);
        if (o.only != "flash") {
            bench_stage_path(o, sp, Q, K, V, total_heads, timer, s, &results);
            group = sp.group;
        }

        if (o.only != "stages") {
            FlashArgs a{Q.p, K.p, V.p, O.p, lse.p, total_heads, o.N, o.M, o.d, o.scale, o.causal, o.precision};
            Dims dims;
            dims.batch = o.batch;
            dims.heads = o.heads;
            dims.N = o.N;
            dims.M = o.M;
            dims.dk = dims.dv = o.d;
            const bool supported = flash_supported(dims);
            FlashPlan plan;
            if (supported) plan = flash_forward_plan(a);
            bench_flash(o, "flash", supported ? std::to_string(plan.Br) + "x" + std::to_string(plan.Bc) : "",
                        [&] {
                            if (!supported) return false;
                            flash_forward(a, s);
                            return true;
                        },
                        Q, K, V, O, lse, total_heads, timer, s, &results);
            // Each tensor-core kernel forced, with --splits and (mma.sync) --fast-variant.
            for (const FlashKernelOps* k : flash_kernels()) {
                if (!k->tensor_cores) continue;
                const int config = k->id == FlashKernel::fast ? o.fast_variant : 0;
                KernelPlan kp;
                const bool has = config == 0 ? k->plan(a, o.splits, &kp)
                                             : flash_fast_config_plan(a, config, o.splits, &kp);
                std::string tiles;
                if (config != 0) tiles = "variant " + std::to_string(config);
                else if (has) tiles = std::to_string(kp.Br) + "x" + std::to_string(kp.Bc) + ", splits " + std::to_string(kp.splits);
                bench_flash(o, (std::string("flash_") + k->name).c_str(), tiles,
                            [&] {
                                if (has) flash_launch(*k, a, kp, s);
                                return has;
                            },
                            Q, K, V, O, lse, total_heads, timer, s, &results);
            }
        }
        CUDA_CHECK(cudaStreamSynchronize(s));
    }
    for (Result& r : results) {
        if (r.status == "ok") set_rate(r, c);
        if (r.checked && !r.check_passed) passed = false;
    }
    print_table(o, device, c, group, results);
    if (!o.json.empty()) write_json(o, device, prop.multiProcessorCount, c, group, results, passed);
    cublasDestroy(blas);
    cudaStreamDestroy(s);
    if (!passed) {
        std::fprintf(stderr, "main: error: --bench --check: a flash kernel exceeds the %s tolerance %.0e "
                             "against float64 (see the table)\n",
                     precision_name(o.precision),
                     o.precision == Precision::tf32 ? kTf32CheckTol : kFp32CheckTol);
        return kExitInternal;
    }
    return kExitOk;
}

}  // namespace

int run_bench(int argc, char** argv) { return bench(parse_options(argc, argv)); }

}  // namespace attnstep
