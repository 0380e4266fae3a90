// backend_cpu.cpp — the CPU backend: the same stages as the CUDA backend in plain C++, float32
// arithmetic throughout (accumulating in float as the GPU does, so the verifier's tolerance model
// applies unchanged), and the same tiled online-softmax algorithm for the flash stages.
// Arithmetic the verifier assumes (verify/model/kernels.py: KERNELS["cpu-tiled"], the cpu model):
// float32 products and sums in index order (no FMA on x86-64 without -march flags), std::exp (one
// rounding in practice), the scale applied to each finished dot product, lse = m + log(l), O·(1/l);
// under tf32 the GEMM operands rounded to TF32, nearest even; under bf16/fp16 the inputs and each
// stage's values rounded to the format (nearest even) as soon as the stage is computed, so the next
// stage reads half values (GEMM products of two half values are exact in float32, the sums float32),
// and the flash kernels' P (and the backward's dS) rounded before their GEMMs, as FlashAttention
// does; flash_lse and D stay float32. A run that splits the keys (flash-decoding) runs the same online
// softmax over each split's keys (Bc keys at a time from the split's start) into split_output and
// split_lse (float32 at every precision), and combines them in float32: m = max_s lse_s,
// lse = m + log(sum_s exp(lse_s − m)), O = sum_s exp(lse_s − lse)·O_s in split order, O then rounded
// to the format at bf16/fp16 (flash_forward.cpp's combine_row).
// The variants (variant.h) go through head_scores.h: every score the softmax reads is scale·q·k,
// capped (C·tanhf(s/C)), less ALiBi's slope·|diag − c|, plus the bias, in that order, each one
// float32 rounding; under dropout the weights the GEMMs read are P∘Z·(1/(1 − p)) (the stage path
// rounds that product as the GEMM's operand; the flash forward multiplies by 1/(1 − p) with 1/l
// at the end, as FlashAttention does), and dQ, dK read dS∘(1 − t²) under a softcap.
//   build: cmake -S . -B build-cpu -DATTNSTEP_CUDA=OFF && cmake --build build-cpu -j2
//   run:   build-cpu/main --in tests/data/tiny_test --out /tmp/tiny_verify --backend cpu
// Work is spread over the host's cores with std::thread (parallel.h: rows, or (head, query tile)
// pairs); each stage is timed with a steady clock around its parallel loop. The stages themselves:
// stage_path.cpp, flash_forward.cpp and flash_backward.cpp (cpu_stages.h); this file is the
// backend around them: memory, the TF32 operands, the dispatch and the half formats' storage.
#include <algorithm>
#include <chrono>
#include <limits>
#include <thread>
#include <vector>

#include "../backend.h"
#include "../common.h"
#include "../io/host_memory.h"
#include "cpu_stages.h"
#include "matrix_ops.h"
#include "parallel.h"

namespace attnstep {

namespace {

using namespace cpu;

// The function that computes each stage, indexed by Stage: one per row of the table (stages.h).
constexpr StageFunction kComputeStage[kNumStages] = {ATTNSTEP_STAGES(ATTNSTEP_COMPUTE_FN)};

// The half pipelines store each stage in the format as soon as it is computed, so the stages after
// it compute from the stored values (the row statistics, kept_float32, stay float32).
void store_in_format(const Problem& p, StageSet stages, HeadGroup& g) {
    constexpr size_t kBlock = 1 << 16;
    for (int j = 0; j < kNumStages; ++j) {
        const Stage t = static_cast<Stage>(j);
        if (!stages.has(t) || kept_float32(t) || !g.out[j]) continue;
        const size_t n = stage_elems(t, p.dims) * g.count;
        parallel_for((n + kBlock - 1) / kBlock, [&](size_t blk) {
            float* x = g.out[j] + blk * kBlock;
            std::transform(x, x + std::min(kBlock, n - blk * kBlock), x, [&](float v) { return round_to(p.precision, v); });
        });
    }
}

// What main.cpp hands over for the case's variant (backend.h: Problem::variant, HeadGroup's mask, bias
// and slopes; the keep-mask computed before the stages that read it). One missing is the binary's
// own bug, so an internal error rather than a quiet textbook result.
void check_variant_inputs(const Problem& p, StageSet computed, const HeadGroup& g) {
    const Variant& v = p.variant;
    constexpr StageSet kReadMask{stage_mask(Stage::output, Stage::dS, Stage::dV)};
    const char* problem = v.causal != p.causal                    ? "Problem::causal differs from its variant's"
                          : v.mask != Coverage::none && !g.mask   ? "a mask file's case without its mask"
                          : v.bias != Coverage::none && !g.bias   ? "a bias file's case without its bias"
                          : v.alibi && !g.alibi_slopes            ? "an ALiBi case without its slopes"
                          : v.dropout > 0.f && computed.any(kReadMask) && !computed.has(Stage::dropout_mask)
                              ? "a dropout case without its keep-mask stage"
                              : nullptr;
    if (problem) fail(kExitInternal, where(__FILE__, __LINE__) + ": " + problem);
}

// The GEMMs' operands for the group: the inputs as read, or under TF32 copies rounded once (into
// `copies`).
Operands gemm_operands(const Problem& p, const HeadGroup& g, std::vector<float> (&copies)[4]) {
    Operands in{g.q, g.k, g.v, g.dout};
    if (p.precision != Precision::tf32) return in;
    const float** operand[] = {&in.q, &in.k, &in.v, &in.dout};
    const Stage stage[] = {Stage::Q, Stage::K, Stage::V, Stage::dO};
    for (int j = 0; j < 4; ++j) {
        if (!*operand[j]) continue;
        std::vector<float>& dst = copies[j];
        dst.resize(stage_elems(stage[j], p.dims) * g.count);
        std::transform(*operand[j], *operand[j] + dst.size(), dst.begin(), round_tf32);
        *operand[j] = dst.data();
    }
    return in;
}

class CpuBackend : public Backend {
public:
    const char* name() const override { return "cpu"; }
    std::string device_name() const override {
        return "host CPU (" + plural(std::max(1u, std::thread::hardware_concurrency()), "thread") + ")";
    }
    FlashPlan flash_plan(const Problem&) const override { return {kFlashBr, kFlashBc, "cpu-tiled"}; }
    StageSet half_flash_stages(const Problem&) const override { return StageSet::flash(); }  // emulated
    size_t working_bytes_per_head(const Problem& p, StageSet computed) const override {
        // TF32 keeps rounded copies of the inputs; the flash backward keeps D (N floats); the
        // flash tiles' scratch is per thread, not per head, and small enough to ignore.
        const Dims& d = p.dims;
        size_t floats = computed.has(Stage::flash_dQ) ? static_cast<size_t>(d.N) : 0;
        if (p.precision == Precision::tf32 && computed.any(kGemmStages))
            for (Stage s : inputs_read(computed)) floats += stage_elems(s, d);
        return floats * sizeof(float);
    }
    size_t available_bytes() const override { return host_budget_bytes(); }
    void compute(const Problem& p, StageSet computed, HeadGroup& g, StageTimes* times) override;

private:
    // The stages whose arithmetic reads the TF32-rounded operands.
    static constexpr StageSet kGemmStages{stage_mask(Stage::QK, Stage::output, Stage::flash_output, Stage::dP,
                                                     Stage::dQ, Stage::dK, Stage::dV, Stage::flash_dQ)};
};

void CpuBackend::compute(const Problem& p, StageSet computed, HeadGroup& g, StageTimes* times) {
    const Dims& d = p.dims;
    if (p.poison)
        for (int i = 0; i < kNumStages; ++i) {
            Stage s = static_cast<Stage>(i);
            if (computed.has(s) && g.out[i])
                std::fill_n(g.out[i], stage_elems(s, d) * g.count, std::numeric_limits<float>::quiet_NaN());
        }
    if (computed.any_backward() && !g.dout)
        fail(kExitInternal, where(__FILE__, __LINE__) + ": a backward stage without dO");
    check_variant_inputs(p, computed, g);
    std::vector<float> rounded_copies[4];
    const Operands in = gemm_operands(p, g, rounded_copies);
    const StageWork work{p, g, in};
    for (int i = 0; i < kNumStages; ++i) {
        Stage s = static_cast<Stage>(i);
        // The flash stages of one pass are computed at the first of them (their time is its).
        if (!computed.has(s) || !leads_computation(s, computed)) continue;
        if (!g.out[i]) fail(kExitInternal, where(__FILE__, __LINE__) + ": no buffer for stage " + stage_name(s));
        if (!kComputeStage[i])
            fail(kExitInternal, where(__FILE__, __LINE__) + ": the CPU backend has no code for stage " + stage_name(s));
        auto t0 = std::chrono::steady_clock::now();
        kComputeStage[i](work);
        if (is_half(p.precision)) store_in_format(p, StageSet{computed_together(s).bits & computed.bits}, g);
        double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        if (times) times->ms[i] += ms;
    }
}

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace attnstep
