// bench_parts.cuh — what the pieces of `main --bench` share: its options (bench_options.h), the
// inputs and the variant on the device (bench_variant.cu), the ceilings it measures
// (bench_ceilings.cu), the forward's stage path (bench_stages.cu) and flash rows (bench_flash.cu),
// the float64 checks of the flash forward (bench_check.cu) and of the backward
// (bench_check_backward.cu), the backward's rows (bench_backward.cu), the table and JSON
// (bench_output.cu); bench.cu runs them.
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
#include "../cuda/device_variant.cuh"
#include "../cuda/flash.cuh"
#include "../cuda/gemm.cuh"
#include "bench_options.h"

namespace attnstep {
namespace bench {

constexpr size_t kCopyBytes = size_t(1) << 30;  // the bandwidth ceiling's copy (1 GiB)

// The rows that are not stages of the stage table (verify/bench/report.py names them alike): the
// whole stage-path backward, timed as one unit, and the flash backward (every kernel of its pass).
constexpr const char* kStagePathBackwardRow = "stages_backward";
constexpr const char* kFlashBackwardRow = "flash_backward";
// The FlashAttention convention: a backward pass counts 2.5 times the forward's FLOPs.
constexpr double kBackwardFlopFactor = 2.5;

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
// The inputs and the variant of a run (bench_variant.cu)

// The rows of a grouped run (--kv-heads) that are not stages (verify/bench/report.py names them
// alike): the copy of each K/V head to its query heads' buffers, and the sums of dK and dV over
// each K/V group, each timed alone; every flash row of a grouped run includes them.
constexpr const char* kKvExpandRow = "kv_expand";
constexpr const char* kKvGroupSumRow = "kv_group_sum";

// The inputs on the device (bench_inputs.h fills them once): Q per query head (B·H), K and V per
// K/V head (B·Hk) and, in a grouped run, K and V per query head: every kernel reads one K and V
// per query head, as the CUDA backend is handed them (main.cpp copies a K/V head to each query
// head of its group before the upload). The stage path reads those copies, made once, untimed.
struct BenchInputs {
    DeviceBuffer Q, K, V;
    std::unique_ptr<DeviceBuffer> K_heads, V_heads;  // grouped runs only
    BenchInputs(const Options& o, cudaStream_t s);
    const DeviceBuffer& Kq() const { return K_heads ? *K_heads : K; }
    const DeviceBuffer& Vq() const { return V_heads ? *V_heads : V; }
};

// The copy of K/V heads to their query heads' buffers that a grouped run makes before its kernels:
// destination head i = source head kv_head_of(i), in elements of `elem_bytes` (4 for float32, 2
// for the half formats). Empty (nothing launched) when the run is not grouped.
struct KvCopy {
    const void* src;
    void* dst;
    size_t elem_bytes;
};
struct KvExpansion {
    Dims dims;
    std::vector<KvCopy> copies;
    void launch(cudaStream_t s) const;
    double bytes() const;  // read + written
};
// The float32 copy: K to K_heads, V to V_heads.
KvExpansion float_expansion(const Options& o, const BenchInputs& in);

// dst (B·Hk heads of per_head floats) = the sums over each K/V group of src's query heads [h0,
// h0 + n) (src holds those n heads), in order of h, in float32; added to dst's value when the
// group began before h0, so that a group split over calls is summed in the same order.
void launch_kv_group_sum(const float* src, float* dst, int h0, int n, const Dims& dims, size_t per_head,
                         cudaStream_t s);

// o's variant on the device: make_device_variant's rule and score modifications, with the
// standard ALiBi slopes of every query head (alibi_slope of h of H, for each batch element).
struct BenchVariant {
    std::unique_ptr<DeviceBuffer> slopes;
    DeviceVariant v;
    BenchVariant(const Options& o, cudaStream_t s);
};

// The ALiBi slope of flat query head `head` (0 without ALiBi), as the device holds it (float32).
double bench_slope(const Options& o, int head);

// The flash kernels' arguments for the run's heads: Q, and K and V per query head; `causal` for
// the top-left causal mask alone, the variant for anything beyond (cuda_stages.cu's convention).
FlashProblem bench_flash_problem(const Options& o, const BenchInputs& in, const DeviceVariant& v);

// Q, K, V as 16-bit values of a half precision's format (none at fp32 and tf32): the inputs the
// half-precision flash forward reads (FlashArgs::Qh, Kh, Vh), two values to a float of storage;
// K and V per K/V head, and in a grouped run the buffers per query head that expansion() fills.
struct FormatInputs {
    std::unique_ptr<DeviceBuffer> q, k, v, k_heads, v_heads;
    FormatInputs(const Options& o, const BenchInputs& in, cudaStream_t s);
    void attach(FlashArgs* a) const;
    // The copy the half flash forward's timed launch begins with in a grouped run.
    KvExpansion expansion(const Options& o) const;
};

// What every part of one run shares.
struct BenchContext {
    const Options& o;
    const BenchInputs& in;
    const DeviceVariant& variant;
    cublasHandle_t blas;
    Timer& timer;
    cudaStream_t s;
    int total_heads;
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
// inputs rounded to the format, as the kernels read them; the scores through o's variant) and
// records the result in r: at fp32 and tf32 the worst row's max|err| / max|ref|, at bf16/fp16 the
// worst head's over its checked rows. A row that sees no key must hold O = 0 and lse = ±inf.
void check_flash(const Options& o, const BenchInputs& in, const DeviceBuffer& O, const DeviceBuffer& lse,
                 int total_heads, Result* r);

// The rows --check samples out of n (first, last, tile edges, middle, spread ones), or all of them
// under --check-rows 0.
std::vector<int> sample_rows(const Options& o, int n);

// The heads --check compares out of `heads` (query heads, or K/V heads for dK and dV): the first
// and the last, or all under --check-rows 0.
std::vector<int> heads_to_check(const Options& o, int heads);

// A fingerprint of the inputs of the checked heads, so that a program that recomputes them
// (bench_inputs.h) can tell it has the same values: over the query heads of heads_to_check, then
// Q, K, V of each (K and V of its K/V head), Σ_j x_j·(j mod 251 + 1) in float64, j the element's
// index in the head's matrix.
double inputs_checksum(const Options& o, const BenchInputs& in, int total_heads);

// The score the softmax reads in float64, for the references: scale·q·k, the softcap, ALiBi
// (bench_check.cu); the mask rule says which keys it covers.
struct ReferenceScores {
    MaskRule rule;
    double scale = 0, cap = 0, slope = 0;
    ReferenceScores(const Options& o, int head);
    double operator()(double qk, long long r, long long c) const;
    // The softcap's derivative at q·k (1 without a cap): what dS is multiplied by for dQ and dK.
    double cap_derivative(double qk) const;
};

// ---------------------------------------------------------------------------------------------
// The backward

// The float64 gradients of sampled rows of each checked head (bench_check_backward.cu): a query
// head's computed on first use and kept, so that every backward row is compared with the same
// numbers; a K/V head's dK and dV are the sums of its query heads'.
class BackwardReference {
public:
    BackwardReference(const Options& o, const BenchInputs& in, const DeviceBuffer& dO);
    ~BackwardReference();
    BackwardReference(const BackwardReference&) = delete;
    BackwardReference& operator=(const BackwardReference&) = delete;
    // Folds query head `head`'s dQ (N×d, on the host) into r's check: its error (normwise over
    // the head's sampled rows) and whether it is finite and within check_tolerance(o).
    void compare_dq(int head, const std::vector<float>& dQ, Result* r);
    // The same for K/V head `kv_head`'s dK and dV (M×d each, summed over its query heads).
    void compare_kv(int kv_head, const std::vector<float>& dK, const std::vector<float>& dV, Result* r);

private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

// ---------------------------------------------------------------------------------------------
// The rows

// The forward's stage path (bench_stages.cu): KT, QK, QK_scaled, attention_weights, output, heads
// in groups that fit; `group` gets the group size (0: skipped for memory).
void bench_stage_path(const BenchContext& c, int* group, std::vector<Result>* out);

// Heads per group of the forward's stage path so that KT, two N×M buffers, the output and
// (bf16/fp16) the GEMMs' half operands fit (bench_stages.cu).
int stage_group(const Options& o, int total_heads);

// QK_scaled of heads [h0, h0 + n) from their QK: the plain kernel (no mask, or the top-left causal
// one), else the variant's, as the CUDA backend chooses.
void launch_scaled_scores(const BenchContext& c, const float* QK, float* out, int h0, int n);

// The flash forward (bench_flash.cu): `auto` as main runs it, then each tensor-core kernel forced.
void bench_flash_kernels(const BenchContext& c, std::vector<Result>* out);

// A grouped run's kv_expand row: the float32 copy of the K/V heads to their query heads.
void bench_kv_expand(const BenchContext& c, std::vector<Result>* out);

// The backward rows: each backward stage of the stage path and the whole of it (heads in groups
// as the forward's stage path; `group` gets the group size, 0 when skipped), then the flash
// backward of o.precision. --check compares dQ, dK, dV with float64.
void bench_backward(const BenchContext& c, const DeviceBuffer& dO, int* group, std::vector<Result>* out);

}  // namespace bench
}  // namespace attnstep
