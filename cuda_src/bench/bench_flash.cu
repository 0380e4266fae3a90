// bench_flash.cu — the flash forward rows of `main --bench`: `flash`, as `main` runs it (the
// dispatcher: every kernel of its pass, preparation passes and split combines included; at
// bf16/fp16 the inputs in the format are made before, as main makes them when it uploads them),
// then each tensor-core kernel forced, with --splits and (mma.sync) --fast-variant. Each row's
// FLOPs count the visible score entries (bench_options.h). In a grouped run (--kv-heads) every
// timed launch begins with the copy of the K/V heads to their query heads' buffers
// (bench_variant.cu), as a run has it done before its kernels.
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "../common.h"
#include "bench_parts.cuh"
#include "../cuda/flash_dispatch.cuh"
#include "../cuda/flash_fast.cuh"
#include "../cuda/kernels.cuh"

namespace attnstep {
namespace bench {

namespace {

// Whether a kernel named `kernel` (run.toml's name: "cuda-wgmma-bf16-split2") computes in o's
// precision: at bf16/fp16 it must name the format; one that would run the problem in another
// format is not timed as a half kernel. Any name does at fp32 and tf32.
bool names_precision(const Options& o, const std::string& kernel) {
    return !is_half(o.precision) || kernel.find(std::string("-") + precision_name(o.precision)) != std::string::npos;
}

// The outputs every flash row writes, poisoned before its checked launch.
struct RowOutputs {
    DeviceBuffer O, lse;
    explicit RowOutputs(const BenchContext& c)
        : O(size_t(c.total_heads) * c.o.N * c.o.d), lse(size_t(c.total_heads) * c.o.N) {}
};

// Times one flash kernel and checks it; `why` (not empty) says why there is no kernel for the
// problem, and the row is "unsupported" with that reason.
template <class Launch>
void bench_flash(const BenchContext& c, const std::string& name, const std::string& tiles, const std::string& why,
                 Launch&& launch, RowOutputs& out_buf, std::vector<Result>* out) {
    Result r{name, Kind::attention};
    r.flops = attention_flops(c.o, c.total_heads);
    r.tiles = tiles;
    if (!why.empty()) {
        r.status = "unsupported";
        r.reason = why;
        out->push_back(r);
        return;
    }
    // Poisoned outputs: an element the kernel never writes stays NaN and fails the check.
    poison_fill(out_buf.O.p, out_buf.O.n, c.s);
    poison_fill(out_buf.lse.p, out_buf.lse.n, c.s);
    launch();
    CUDA_CHECK(cudaStreamSynchronize(c.s));
    if (c.o.check) check_flash(c.o, c.in, out_buf.O, out_buf.lse, c.total_heads, &r);
    r.ms = c.timer.median_ms(c.o.warmup, c.o.reps, launch);
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

// Each tensor-core kernel forced: its plan, or why it has none.
void bench_forced_kernels(const BenchContext& c, const FlashArgs& a, const KvExpansion& expansion,
                          RowOutputs& buf, std::vector<Result>* out) {
    const Options& o = c.o;
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
        else if (has)
            tiles = std::to_string(kp.Br) + "x" + std::to_string(kp.Bc) + ", splits " + std::to_string(kp.splits);
        auto launch = [&] {
            expansion.launch(c.s);
            flash_launch(*k, a, kp, c.s);
        };
        bench_flash(c, std::string("flash_") + k->name, tiles, why, launch, buf, out);
    }
}

}  // namespace

void bench_flash_kernels(const BenchContext& c, std::vector<Result>* out) {
    const Options& o = c.o;
    RowOutputs buf(c);
    FlashArgs a{bench_flash_problem(o, c.in, c.variant), buf.O.p, buf.lse.p};
    // At a half precision the inputs in the format as well, made before the timing (as SDPA is
    // given them): the half flash kernel reads those (FlashArgs::Qh).
    const FormatInputs format(o, c.in, c.s);
    format.attach(&a);
    const KvExpansion expansion = is_half(o.precision) ? format.expansion(o) : float_expansion(o, c.in);
    FlashPlan plan;
    const std::string why = dispatcher_plan(o, a, &plan);
    const std::string tiles =
        why.empty() ? std::to_string(plan.Br) + "x" + std::to_string(plan.Bc) + ", " + plan.kernel : "";
    auto launch = [&] {
        expansion.launch(c.s);
        flash_forward(a, c.s);
    };
    bench_flash(c, "flash", tiles, why, launch, buf, out);
    bench_forced_kernels(c, a, expansion, buf, out);
}

}  // namespace bench
}  // namespace attnstep
