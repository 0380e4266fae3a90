// backend_cuda.cu — the CUDA backend: computes a group of heads stage by stage on the GPU, each
// stage by its function in cuda_stages.cu (cuBLAS GEMMs of gemm.cu, the kernels of kernels.cu and
// backward_kernels.cu, the flash forward of flash_dispatch.cu, the flash backward of flash_bwd.cu);
// this file is the backend around them: device memory, uploads, timing and the dispatch. Built by
// CMake when a CUDA toolkit is found (ATTNSTEP_HAVE_CUDA=1); run with `build/main --in data/random_test
// --out data/random_verify --backend cuda`; checked on a GPU by scripts/gpu_check.sh.
//
// Per group: Q, K, V (and dO for the backward) are copied host -> device once, each stage in `computed`
// runs on one stream (timed with a pair of CUDA events), and each computed stage is copied back to
// group.out[s]. Device memory is one arena, carved into one buffer per stage and kept between groups (it
// only grows), so a run of equal groups allocates once. The first group of each size runs its stages once
// untimed first, so that kernel loading stays out of the stage times.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <tuple>

#include "../backend.h"
#include "../common.h"
#include "cuda_check.cuh"
#include "cuda_stages.cuh"
#include "decode.cuh"
#include "flash.cuh"
#include "flash_bwd.cuh"
#include "gemm.cuh"
#include "half.cuh"
#include "kernels.cuh"
#include "variant_buffers.cuh"

namespace attnstep {

namespace {

constexpr size_t kBufferAlign = 256;  // each stage buffer starts 256-byte aligned (float4-safe)
constexpr double kUsableFraction = 0.9;  // of the device's free memory
constexpr double kMiB = 1024.0 * 1024.0;

size_t align_up(size_t n) { return (n + kBufferAlign - 1) / kBufferAlign * kBufferAlign; }

// The forward inputs are always on the device (every stage derives from them), dO when a backward
// stage is computed; other stages only when computed.
bool needs_device_buffer(Stage s, StageSet computed) {
    return (is_input_echo(s) && (!is_backward_stage(s) || computed.any_backward())) || computed.has(s);
}

size_t group_stage_bytes(Stage s, const Dims& d, int heads) {
    return stage_elems(s, d) * sizeof(float) * static_cast<size_t>(heads);
}

// The function that computes each stage, indexed by Stage: one per row of the table (stages.h).
constexpr DeviceStageFunction kComputeStage[kNumStages] = {ATTNSTEP_STAGES(ATTNSTEP_COMPUTE_FN)};

// The half pipelines' GEMM operands as bf16/fp16 (HalfGemm): room for the two operands of the
// largest product per head, 2 bytes an element (an N×M weight matrix and an N or M row block).
constexpr StageSet kGemmStages{stage_mask(Stage::QK, Stage::output, Stage::dP, Stage::dQ, Stage::dK, Stage::dV)};
size_t half_operand_bytes(const Dims& d, int heads) {
    const size_t w = static_cast<size_t>(std::max(d.dk, d.dv));
    const size_t big = std::max({static_cast<size_t>(d.N) * d.M, static_cast<size_t>(d.N) * w,
                                 static_cast<size_t>(d.M) * w});
    return big * 2 * static_cast<size_t>(heads);
}
bool needs_half_operands(const Problem& p, StageSet computed) {
    return is_half(p.precision) && (computed.bits & kGemmStages.bits);
}
// The half-precision flash forward reads Q, K, V as 16-bit values of the format (FlashArgs::Qh,
// Kh, Vh): made as the inputs are uploaded, so the flash stage's time is its kernels alone.
bool needs_format_inputs(const Problem& p, StageSet computed) {
    return is_half(p.precision) && computed.any_flash() && flash_supported(p.dims);
}

std::string mib(size_t bytes) { return std::to_string(static_cast<long long>(bytes / kMiB + 0.5)) + " MiB"; }

// A computed stage whose source is not computed means the caller skipped dependency_closure(). The
// dropout keep-mask is a source only in a case with dropout (main.cpp drops it otherwise).
void check_computable(const Problem& p, StageSet computed) {
    const StageSet optional = p.variant.dropout > 0.f ? StageSet{} : StageSet::dropout();
    for (int i = 0; i < kNumStages; ++i) {
        const Stage s = static_cast<Stage>(i);
        if (!computed.has(s)) continue;
        const StageSet missing = StageSet{stage_info(s).sources}.minus(computed).minus(optional);
        if (!missing.empty())
            fail(kExitInternal, where(__FILE__, __LINE__) + ": stage " + stage_name(s) +
                                    " requested without a source stage (dependency_closure not applied)");
    }
}

class CudaBackend final : public Backend {
public:
    CudaBackend();
    ~CudaBackend() override { release(); }
    CudaBackend(const CudaBackend&) = delete;
    CudaBackend& operator=(const CudaBackend&) = delete;

    const char* name() const override { return "cuda"; }
    std::string device_name() const override { return device_name_; }
    FlashPlan flash_plan(const Problem& p) const override;
    StageSet half_flash_stages(const Problem& p) const override;
    size_t working_bytes_per_head(const Problem& p, StageSet computed) const override;
    size_t available_bytes() const override;
    void compute(const Problem& p, StageSet computed, HeadGroup& group, StageTimes* times) override;
    bool computes_packed(const Problem& p, const Sequences& s, StageSet c) const override { return packed_flash_available(p, s, c); }

private:
    DeviceBuffers carve_buffers(const Problem& p, StageSet computed, int heads);
    void reserve_arena(size_t bytes);
    void run_stages(const Problem& p, StageSet computed, int heads, const DeviceBuffers& b);
    // Runs `work` on the stream, between the stage's two events unless record_events_ is off.
    template <class Work>
    void timed(Stage s, Work&& work);
    void warm_up_stages(const Problem& p, StageSet computed, int heads, const DeviceBuffers& b);
    void release() noexcept;

    std::string device_name_;
    cudaStream_t stream_ = nullptr;
    cublasHandle_t blas_ = nullptr;
    cudaEvent_t start_[kNumStages] = {};
    cudaEvent_t stop_[kNumStages] = {};
    bool timed_[kNumStages] = {};
    bool record_events_ = true;
    std::set<std::tuple<int, int, unsigned>> warmed_;  // (heads, precision, stage bits) run once
    void* arena_ = nullptr;
    size_t arena_bytes_ = 0;
};

CudaBackend::CudaBackend() {
    try {
        int dev = 0;
        CUDA_CHECK(cudaGetDevice(&dev));
        cudaDeviceProp prop{};
        CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
        device_name_ = prop.name;
        CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
        CUBLAS_CHECK(cublasCreate(&blas_));
        CUBLAS_CHECK(cublasSetStream(blas_, stream_));
        for (int i = 0; i < kNumStages; ++i) {
            CUDA_CHECK(cudaEventCreate(&start_[i]));
            CUDA_CHECK(cudaEventCreate(&stop_[i]));
        }
    } catch (...) {
        release();  // the destructor does not run for a constructor that throws
        throw;
    }
}

// Errors are ignored here: this runs on the way out, possibly while another error unwinds.
void CudaBackend::release() noexcept {
    if (arena_) cudaFree(arena_);
    arena_ = nullptr;
    arena_bytes_ = 0;
    for (int i = 0; i < kNumStages; ++i) {
        if (start_[i]) cudaEventDestroy(start_[i]);
        if (stop_[i]) cudaEventDestroy(stop_[i]);
        start_[i] = stop_[i] = nullptr;
    }
    if (blas_) cublasDestroy(blas_);
    blas_ = nullptr;
    if (stream_) cudaStreamDestroy(stream_);
    stream_ = nullptr;
}

FlashPlan CudaBackend::flash_plan(const Problem& p) const {
    if (!flash_supported(p.dims)) return {};  // no flash stage for this width: nothing to report
    if (p.split_size > 0) return {decode_tile_rows(p.precision), decode_chunk_keys(p.precision, p.dims.dk),
                                  decode_kernel_name(p.precision)};
    return flash_forward_plan(flash_args(p));
}

// The forward's kernels where the dispatcher has a half variant for the problem (wgmma, on compute
// capability 9.0, or a split run's decode kernel, which has every width); the backward's likewise.
StageSet CudaBackend::half_flash_stages(const Problem& p) const {
    if (!flash_supported(p.dims) || (p.split_size == 0 && !flash_forward_available(flash_args(p)))) return {};
    const bool backward = p.split_size == 0 && flash_backward_available(flash_bwd_args(p));
    return backward ? StageSet::flash() : StageSet::flash().minus(StageSet::backward());
}

size_t CudaBackend::working_bytes_per_head(const Problem& p, StageSet computed) const {
    size_t bytes = 0;
    for (int i = 0; i < kNumStages; ++i) {
        const Stage s = static_cast<Stage>(i);
        // Each buffer may gain up to kBufferAlign of padding per group; counting it per head is
        // a safe over-estimate.
        if (needs_device_buffer(s, computed)) bytes += group_stage_bytes(s, p.dims, 1) + kBufferAlign;
    }
    if (computed.any_flash() && flash_supported(p.dims) && p.split_size == 0)
        bytes += flash_workspace_bytes_per_head(flash_args(p));
    else if (p.split_size > 0)  // the split kernel's partials (flash_splits.cu)
        bytes += static_cast<size_t>(p.dims.splits) * p.dims.N * (p.dims.dv + 1) * sizeof(float);
    if (computed.has(Stage::flash_dQ) && flash_supported(p.dims))
        bytes += flash_backward_workspace_bytes_per_head(flash_bwd_args(p));
    if (needs_half_operands(p, computed)) bytes += 2 * (half_operand_bytes(p.dims, 1) + kBufferAlign);
    if (needs_format_inputs(p, computed)) bytes += flash_format_input_bytes_per_head(flash_args(p)) + 3 * kBufferAlign;
    return bytes + variant_bytes_per_head(p, computed, kBufferAlign);
}

size_t CudaBackend::available_bytes() const {
    size_t free_bytes = 0, total_bytes = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    // The arena is reused (or freed before a larger one), so it counts as available.
    return static_cast<size_t>(kUsableFraction * static_cast<double>(free_bytes + arena_bytes_));
}

void CudaBackend::reserve_arena(size_t bytes) {
    if (bytes <= arena_bytes_) return;
    if (arena_) CUDA_CHECK(cudaFree(arena_));
    arena_ = nullptr;
    arena_bytes_ = 0;
    const cudaError_t err = cudaMalloc(&arena_, bytes);
    if (err == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();  // clear it, so later calls do not report it again
        arena_ = nullptr;
        size_t free_bytes = 0, total_bytes = 0;
        cudaMemGetInfo(&free_bytes, &total_bytes);
        fail(kExitNoMemory,
             "the CUDA backend needs " + mib(bytes) + " of device memory for this group of heads; " +
                 mib(free_bytes) + " of " + mib(total_bytes) + " are free on " + device_name_,
             "lower --max-memory-mb so that fewer heads go to the GPU at once, or select fewer stages");
    }
    CUDA_CHECK(err);
    arena_bytes_ = bytes;
}

DeviceBuffers CudaBackend::carve_buffers(const Problem& p, StageSet computed, int heads) {
    const Dims& d = p.dims;
    size_t offsets[kNumStages] = {};
    size_t total = 0;
    for (int i = 0; i < kNumStages; ++i) {
        const Stage s = static_cast<Stage>(i);
        if (!needs_device_buffer(s, computed)) continue;
        offsets[i] = total;
        total += align_up(group_stage_bytes(s, d, heads));
    }
    const size_t half_at = total, half_bytes = align_up(half_operand_bytes(d, heads));
    if (needs_half_operands(p, computed)) total += 2 * half_bytes;
    const Stage format_inputs[3] = {Stage::Q, Stage::K, Stage::V};
    size_t format_at[3] = {};
    if (needs_format_inputs(p, computed)) {
        for (int k = 0; k < 3; ++k) {
            format_at[k] = total;
            total += align_up(stage_elems(format_inputs[k], d) * sizeof(uint16_t) * static_cast<size_t>(heads));
        }
    }
    const VariantLayout v = variant_layout(p, computed, heads);
    const size_t variant_floats[4] = {v.mask, v.bias, v.slopes, v.scratch};
    size_t variant_at[4] = {};
    for (int k = 0; k < 4; ++k) {
        variant_at[k] = total;
        total += align_up(variant_floats[k] * sizeof(float));
    }
    reserve_arena(total);
    DeviceBuffers b;
    for (int i = 0; i < kNumStages; ++i) {
        if (needs_device_buffer(static_cast<Stage>(i), computed))
            b.at[i] = reinterpret_cast<float*>(static_cast<char*>(arena_) + offsets[i]);
    }
    if (needs_half_operands(p, computed))
        b.half = HalfGemm{p.precision, static_cast<char*>(arena_) + half_at, static_cast<char*>(arena_) + half_at + half_bytes};
    if (needs_format_inputs(p, computed)) {
        for (int k = 0; k < 3; ++k) b.format[k] = reinterpret_cast<uint16_t*>(static_cast<char*>(arena_) + format_at[k]);
    }
    float* part[4] = {};
    for (int k = 0; k < 4; ++k)
        if (variant_floats[k]) part[k] = reinterpret_cast<float*>(static_cast<char*>(arena_) + variant_at[k]);
    b.variant_at = VariantBuffers{part[0], part[1], part[2], part[3]};
    return b;
}

template <class Work>
void CudaBackend::timed(Stage s, Work&& work) {
    if (!record_events_) {
        work();
        return;
    }
    const int i = static_cast<int>(s);
    CUDA_CHECK(cudaEventRecord(start_[i], stream_));
    work();
    CUDA_CHECK(cudaEventRecord(stop_[i], stream_));
    timed_[i] = true;
}

// Every computed stage but the inputs' echoes (uploaded by compute()), in the table's order, each
// timed; stages computed together (the flash stages of a pass) at the first of them.
void CudaBackend::run_stages(const Problem& p, StageSet computed, int heads, const DeviceBuffers& b) {
    const DeviceStageWork work{p, heads, b, blas_, stream_};
    for (int i = 0; i < kNumStages; ++i) {
        const Stage s = static_cast<Stage>(i);
        if (!computed.has(s) || is_input_echo(s) || !leads_computation(s, computed)) continue;
        if (!kComputeStage[i])
            fail(kExitInternal, where(__FILE__, __LINE__) + ": the CUDA backend has no code for stage " + stage_name(s));
        timed(s, [&] { kComputeStage[i](work); });
    }
}

// The first launch of a kernel loads it into the context, which for cuBLAS's GEMM kernels costs
// far more than the GEMM (docs/journal.md, "Kernel loading"). One untimed pass per group size,
// precision and stage set keeps that out of the stage times; later groups of the same size skip it.
void CudaBackend::warm_up_stages(const Problem& p, StageSet computed, int heads, const DeviceBuffers& b) {
    if (!warmed_.insert({heads, static_cast<int>(p.precision), computed.bits}).second) return;
    record_events_ = false;
    try {
        run_stages(p, computed, heads, b);
    } catch (...) {
        record_events_ = true;
        throw;
    }
    record_events_ = true;
}

void CudaBackend::compute(const Problem& p, StageSet computed, HeadGroup& group, StageTimes* times) {
    const int heads = group.count;
    if (heads <= 0) return;
    check_computable(p, computed);
    if (computed.any_flash() && !flash_supported(p.dims)) {
        fail(kExitBadInput,
             "the flash stages need d_k == d_v in " + flash_head_dims_text() + "; got d_k=" + std::to_string(p.dims.dk) +
                 ", d_v=" + std::to_string(p.dims.dv),
             "select the stage path only (--stages stages) for this shape");
    }
    const Dims& d = p.dims;
    set_gemm_precision(blas_, p.precision);

    DeviceBuffers b = carve_buffers(p, computed, heads);
    b.variant = upload_variant_inputs(p, group, b.variant_at, stream_);
    for (bool& t : timed_) t = false;

    // Inputs. The echo stages Q, K, V, dO are the device copies read back, so their time is the
    // upload (with, for the half flash forward, the copy in the format).
    const float* host_inputs[] = {group.q, group.k, group.v, group.dout};
    const Stage inputs[] = {Stage::Q, Stage::K, Stage::V, Stage::dO};
    for (int k = 0; k < 4; ++k) {
        const Stage s = inputs[k];
        if (!needs_device_buffer(s, computed)) continue;
        if (!host_inputs[k]) fail(kExitInternal, where(__FILE__, __LINE__) + ": no host data for input " + stage_name(s));
        timed(s, [&] {
            CUDA_CHECK(cudaMemcpyAsync(b.at[static_cast<int>(s)], host_inputs[k], group_stage_bytes(s, d, heads),
                                       cudaMemcpyHostToDevice, stream_));
            if (k < 3 && b.format[k])
                launch_to_half(b.at[static_cast<int>(s)], b.format[k], stage_elems(s, d) * heads, p.precision, stream_);
        });
    }

    warm_up_stages(p, computed, heads, b);

    // After the warm-up: every output buffer starts the timed pass as NaN, so an element a stage
    // skips shows.
    if (p.poison) {
        for (int i = 0; i < kNumStages; ++i) {
            const Stage s = static_cast<Stage>(i);
            if (computed.has(s) && !is_input_echo(s)) poison_fill(b.at[i], stage_elems(s, d) * heads, stream_);
        }
    }

    run_stages(p, computed, heads, b);

    for (int i = 0; i < kNumStages; ++i) {
        const Stage s = static_cast<Stage>(i);
        if (!computed.has(s) || !group.out[i]) continue;  // out[s] is null for stages not written
        CUDA_CHECK(cudaMemcpyAsync(group.out[i], b.at[i], group_stage_bytes(s, d, heads),
                                   cudaMemcpyDeviceToHost, stream_));
    }
    // Errors inside kernels surface here, reported at this line.
    CUDA_CHECK(cudaStreamSynchronize(stream_));

    if (!times) return;
    for (int i = 0; i < kNumStages; ++i) {
        if (!timed_[i] || !computed.has(static_cast<Stage>(i))) continue;
        float ms = 0.f;
        CUDA_CHECK(cudaEventElapsedTime(&ms, start_[i], stop_[i]));
        times->ms[i] += ms;
    }
}

}  // namespace

bool cuda_backend_built() { return true; }

// Never throws: "no device", "insufficient driver" and the like all mean "use the CPU".
bool cuda_device_available() {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    return count > 0;
}

std::unique_ptr<Backend> make_cuda_backend() {
    if (!cuda_device_available()) {
        fail(kExitBadInput, "--backend cuda: no usable CUDA device found (cudaGetDeviceCount reports none)",
             "use --backend cpu or --backend auto on a machine without a GPU");
    }
    return std::make_unique<CudaBackend>();
}

}  // namespace attnstep
