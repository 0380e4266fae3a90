// bench_parts.cuh — what the pieces of `main --bench` share: its options (bench_options.cu), the
// ceilings it measures (bench_ceilings.cu), the float64 checks of the flash forward
// (bench_check.cu) and of the backward (bench_check_backward.cu), the backward's rows
// (bench_backward.cu), the table and JSON (bench_output.cu); bench.cu runs them.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "../backend.h"
#include "../stages.h"
#include "../cuda/cuda_check.cuh"
#include "../cuda/flash.cuh"
#include "../cuda/gemm.cuh"

namespace attnstep {
namespace bench {

constexpr size_t kCopyBytes = size_t(1) << 30;  // the bandwidth ceiling's copy (1 GiB)

// The rows that are not stages of the stage table (verify/bench/report.py names them alike): the
// whole stage-path backward, timed as one unit, and the flash backward (every kernel of its pass).
constexpr const char* kStagePathBackwardRow = "stages_backward";
constexpr const char* kFlashBackwardRow = "flash_backward";
// The FlashAttention convention: a backward pass counts 2.5 times the forward's FLOPs.
constexpr double kBackwardFlopFactor = 2.5;

// Which passes `--pass` times.
enum class Passes { forward, backward, both };

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
    Passes passes = Passes::both;
    bool ceilings = true;  // --no-ceilings: skip the ceiling microbenchmarks (no fractions then)
    int fast_variant = 0, splits = 0;
    unsigned seed = 1234;
};

inline bool times_forward(const Options& o) { return o.passes != Passes::backward; }
inline bool times_backward(const Options& o) { return o.passes != Passes::forward; }

// The forward FLOPs of the attention: 4·B·H·N·M·d, halved when causal.
inline double attention_flops(const Options& o, int total_heads) {
    return 4.0 * total_heads * o.N * double(o.M) * o.d * (o.causal ? 0.5 : 1.0);
}

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

// Q, K, V as 16-bit values of a half precision's format (none at fp32 and tf32): the inputs the
// half-precision flash forward reads (FlashArgs::Qh, Kh, Vh). Two values to a float of storage.
struct FormatInputs {
    std::unique_ptr<DeviceBuffer> q, k, v;
    FormatInputs(Precision p, const DeviceBuffer& Q, const DeviceBuffer& K, const DeviceBuffer& V, cudaStream_t s);
    void attach(FlashArgs* a) const;
};

// Fills b uniformly in [-1, 1) from `seed` (bench_inputs.h: reproducible, no state).
void fill(DeviceBuffer& b, uint64_t seed, cudaStream_t s);

// The half pipelines' GEMM operands (gemm.cuh's HalfGemm) for `heads` heads of the forward stage
// path, 2 bytes an element: the first operand Q or P (N×d or N×M), the second K or V (M×d).
// Nothing is allocated at fp32 and tf32, whose GEMMs are SGEMMs.
struct HalfOperands {
    std::unique_ptr<DeviceBuffer> a, b;
    HalfGemm gemm;
    HalfOperands(const Options& o, int heads);
};

// Device bytes per head of HalfOperands (0 at fp32 and tf32).
double half_operand_bytes_per_head(const Options& o);

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
    std::string reason;         // why an "unsupported" row has no kernel (shown and in the JSON)
    double ms = 0, flops = 0, bytes = 0;
    double rate = 0;      // TFLOP/s or GB/s
    double fraction = 0;  // of the matching ceiling
    std::string tiles;    // flash: "Br x Bc, splits S"
    bool backward = false;  // a row of the backward pass
    bool checked = false, check_passed = true;
    double max_rel_err = 0, max_lse_err = 0;
    double grad_err[3] = {0, 0, 0};  // backward rows: dQ, dK, dV, each against float64
};

struct Ceilings {
    double sgemm_ms = 0, sgemm_tflops = 0;
    double copy_ms = 0, copy_gbps = 0;
    double mma_tf32_tflops = 0;  // mma.sync m16n8k8 TF32 issue rate: flash_fast's own ceiling
    double mma_bf16_tflops = 0;  // mma.sync m16n8k16 BF16: the rate a split-BF16 kernel would see
    double wgmma_tf32_tflops = 0;  // wgmma m64n128k8 TF32 issue rate (Hopper): flash_wgmma's ceiling
    bool measured = false;         // false under --no-ceilings: every figure above is 0
};

// What one `main --bench` measured: the ceilings, the stage paths' group sizes (0: skipped), the
// rows, the fingerprint of the checked heads' inputs (--check), and whether every check passed.
struct BenchRun {
    Ceilings ceilings;
    int group = 0, backward_group = 0;
    std::vector<Result> results;
    double inputs_checksum = 0;
    bool passed = true;
};

// The table on stdout and the JSON file (bench_output.cu).
void print_table(const Options& o, const std::string& device, const BenchRun& run);
void write_json(const Options& o, const std::string& device, int sms, const BenchRun& run);

// The ceilings: cuBLAS SGEMM on the QK shape for `gemm_heads` heads (blas set to the run's
// precision), a device-to-device copy, and the mma.sync / wgmma issue rates.
Ceilings measure_ceilings(const Options& o, const cudaDeviceProp& prop, int gemm_heads, cublasHandle_t blas,
                          Timer& timer, cudaStream_t s);

// Heads per group of the stage path so that `per_head_bytes` of buffers per head fit in the free
// device memory, leaving a margin for cuBLAS and the runtime (1 GiB or 3% of the card, the
// larger); at most total_heads, 0 when not even one head fits.
int heads_that_fit(double per_head_bytes, int total_heads);

// The largest error --check allows at o's precision.
double check_tolerance(const Options& o);

// Compares sampled rows (all with --check-rows 0) of O and lse with float64 (at bf16/fp16 from the
// inputs rounded to the format, as the kernels read them) and records the result in r: at fp32
// and tf32 the worst row's max|err| / max|ref|, at bf16/fp16 the worst head's over its checked rows.
void check_flash(const Options& o, const DeviceBuffer& Q, const DeviceBuffer& K, const DeviceBuffer& V,
                 const DeviceBuffer& O, const DeviceBuffer& lse, int total_heads, Result* r);

// The rows --check samples out of n (first, last, tile edges, middle, spread ones), or all of them
// under --check-rows 0.
std::vector<int> sample_rows(const Options& o, int n);

// The heads --check compares: the first and the last, or all under --check-rows 0.
std::vector<int> heads_to_check(const Options& o, int total_heads);

// A fingerprint of the inputs of the checked heads, so that a program that recomputes them
// (bench_inputs.h) can tell it has the same values: over the heads of heads_to_check, then Q, K,
// V of each, Σ_j x_j·(j mod 251 + 1) in float64, j the element's index in the head's matrix.
double inputs_checksum(const Options& o, const DeviceBuffer& Q, const DeviceBuffer& K, const DeviceBuffer& V,
                       int total_heads);

// ---------------------------------------------------------------------------------------------
// The backward

// The forward inputs and the output gradient, every head, on the device.
struct BackwardInputs {
    const DeviceBuffer& Q;
    const DeviceBuffer& K;
    const DeviceBuffer& V;
    const DeviceBuffer& dO;
};

// One head's gradients as a kernel computed them, on the host.
struct HostGrads {
    std::vector<float> dQ, dK, dV;
};

// The float64 gradients of sampled rows of each checked head (bench_check_backward.cu): computed
// on first use of a head and kept, so that every backward row is compared with the same numbers.
class BackwardReference {
public:
    BackwardReference(const Options& o, const BackwardInputs& in);
    ~BackwardReference();
    BackwardReference(const BackwardReference&) = delete;
    BackwardReference& operator=(const BackwardReference&) = delete;
    // Folds one head's gradients into r's check: its worst dQ, dK, dV errors (normwise over the
    // head's sampled rows) and whether they are finite and within check_tolerance(o).
    void compare(int head, const HostGrads& g, Result* r);

private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

// The backward rows: each backward stage of the stage path and the whole of it (heads in groups
// as the forward's stage path; `group` gets the group size, 0 when skipped), then the flash
// backward of o.precision. --check compares dQ, dK, dV with float64.
void bench_backward(const Options& o, cublasHandle_t blas, const BackwardInputs& in, int total_heads,
                    Timer& timer, cudaStream_t s, int* group, std::vector<Result>* out);

}  // namespace bench
}  // namespace attnstep
