// flash_dispatch.cuh — the flash kernels as the dispatcher (flash_dispatch.cu) sees them, and the
// host-side pieces their launchers share. Each kernel file registers one FlashKernelOps:
//   flash_wgmma_ops()  sm90a/flash_wgmma.cu  wgmma (Hopper), d 64 and 128; its bf16/fp16
//                      variants in sm90a/flash_wgmma_half.cu (the only half-precision kernel)
//   flash_fast_ops()   flash_fast.cu         mma.sync tensor cores, every width of kFlashHeadDims
//   flash_clean_ops()  flash_fwd.cu          plain FP32, every width of kFlashHeadDims
// Each kernel has three instantiations (flash_problem.cuh with_mask_kind): no mask, the top-left
// causal mask, and the variant's (any mask rule: both alignments, windows; softcap, ALiBi), which
// skips the key tiles outside the rule's range on both sides. The mask and bias files and dropout
// are the clean kernel's alone: the others' plan() refuses them, so `auto` takes it.
// Planning and launching are separate calls: plan() decides tiles, KV splits and workspace
// without touching the GPU's queue; launch() runs exactly that plan.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <iterator>
#include <string>
#include <type_traits>
#include <utility>

#include "../stages.h"
#include "device.cuh"
#include "flash.cuh"

namespace attnstep {

// What a kernel will do for one problem.
struct KernelPlan {
    int Br = 0, Bc = 0;            // query rows and keys per tile
    int splits = 1;                // parts the KV loop is split into (merged by flash_combine_splits)
    size_t workspace_per_head = 0;  // device bytes the launch allocates per head beyond its arguments
    int config = 0;                // the kernel's tile configuration (0: the shipped one)
};

struct FlashKernelOps {
    FlashKernel id;
    const char* name;       // --flash-kernel's word; run.toml says "cuda-<name>..."
    bool tensor_cores;      // run.toml then names the precision and the KV split too
    // Where `auto` may take this kernel when plan() accepts (null: wherever it does).
    bool (*preferred)(const FlashArgs& a);
    // The plan for `a` (heads may exceed kMaxGridYZ: flash_forward launches them in parts), or
    // false where the kernel has no variant (width, GPU). forced_splits > 0 forces the KV split
    // count (clamped to the key tiles): tests and benchmarks.
    bool (*plan)(const FlashArgs& a, int forced_splits, KernelPlan* plan);
    // Launches `plan` for at most kMaxGridYZ heads on `stream` (flash_launch() takes any); checked.
    void (*launch)(const FlashArgs& a, const KernelPlan& plan, cudaStream_t stream);
    // Whether plan() may accept a packed batch (FlashProblem::sequences); the others never see one.
    bool takes_sequences = false;
};

const FlashKernelOps& flash_clean_ops();
const FlashKernelOps& flash_fast_ops();
#ifdef ATTNSTEP_HAVE_WGMMA
const FlashKernelOps& flash_wgmma_ops();
#endif

// The kernels this binary has, in `auto`'s order of preference (the last one, clean, always plans).
struct FlashKernelList {
    const FlashKernelOps* const* first;
    const FlashKernelOps* const* last;
    const FlashKernelOps* const* begin() const { return first; }
    const FlashKernelOps* const* end() const { return last; }
};
FlashKernelList flash_kernels();

// Launches `plan` (from ops.plan for `a`) in parts of at most kMaxGridYZ heads; checked.
void flash_launch(const FlashKernelOps& ops, const FlashArgs& a, const KernelPlan& plan, cudaStream_t stream);

// "cuda-fast-3xtf32-split4" and the like: the kernel's name in run.toml.
std::string flash_plan_name(const FlashKernelOps& ops, const FlashArgs& a, const KernelPlan& plan);

// ---------------------------------------------------------------------------------------------
// Shared by the launchers.

// Calls f(std::integral_constant<int, d>) for the width d of kFlashHeadDims (stages.h) and returns
// its answer (whether the kernel has a variant); false for any other d. The width switches of
// every kernel are generated from that one table here.
template <class F, size_t... I>
bool with_head_dim(int d, F&& f, std::index_sequence<I...>) {
    bool answer = false;
    (void)((d == kFlashHeadDims[I] ? (answer = f(std::integral_constant<int, kFlashHeadDims[I]>{}), true)
                                   : false) || ...);
    return answer;
}
template <class F>
bool with_head_dim(int d, F&& f) {
    return with_head_dim(d, f, std::make_index_sequence<std::size(kFlashHeadDims)>{});
}

// A type as a value, for generic lambdas: f(TypeTag<T>{}) then names T as decltype(tag)::type.
template <class T>
struct TypeTag {
    using type = T;
};

// The value of a std::integral_constant and the type of a TypeTag that a generic lambda got
// (decltype of a captured one is a reference with some host compilers).
template <class C>
inline constexpr auto constant_v = std::decay_t<C>::value;
template <class Tag>
using tag_type = typename std::decay_t<Tag>::type;

// Calls f(TypeTag<T>{}, args...) and returns true for a tile configuration T; false where there is
// none (T void), so that a dispatcher's with_config can say whether a problem has a variant.
template <class T, class F, class... Args>
bool call_with_config(F&& f, Args... args) {
    if constexpr (std::is_void_v<T>) {
        return false;
    } else {
        f(TypeTag<T>{}, args...);
        return true;
    }
}

// Calls f(std::true_type) or f(std::false_type): a run-time flag to a template argument.
template <class F>
decltype(auto) with_flag(bool flag, F&& f) {
    return flag ? f(std::true_type{}) : f(std::false_type{});
}

// The KV split count: 1 while the heads·⌈N/Br⌉ blocks fill the GPU's `slots` (SMs × blocks per
// SM); else enough parts to fill it, at most kMaxSplits, of at least 2 of the n_tiles key tiles
// each (fewer tiles per split means more partial outputs than useful work).
int choose_kv_splits(long long blocks, long long slots, int n_tiles);
// A forced or chosen count kept to 1..n_tiles.
int clamp_kv_splits(int splits, int n_tiles);
// The KV split count of a kernel with br × bc tiles: forced_splits when positive, else
// choose_kv_splits for its heads·⌈N/br⌉ blocks on the GPU's SMs × blocks_per_sm() (asked only
// then); kept to 1..⌈M/bc⌉.
template <class BlocksPerSm>
int plan_kv_splits(const FlashArgs& a, int forced_splits, int br, int bc, BlocksPerSm&& blocks_per_sm) {
    const int n_tiles = (a.M + bc - 1) / bc;
    const int splits = forced_splits > 0
        ? forced_splits
        : choose_kv_splits(static_cast<long long>(a.heads) * ((a.N + br - 1) / br),
                           static_cast<long long>(device_sm_count()) * blocks_per_sm(), n_tiles);
    return clamp_kv_splits(splits, n_tiles);
}

// The split-KV partial results: `splits` × [heads][N][d] outputs, then `splits` × [heads][N] lse.
size_t split_partial_floats(const FlashArgs& a, int splits);  // 0 when splits == 1
struct FlashOutputs {
    float* O;
    float* lse;
};
// Where a kernel writes: a's O and lse when splits == 1, else the partials at `partials`.
FlashOutputs kernel_outputs(const FlashArgs& a, int splits, float* partials);
// Merges the partials into a's O and lse (nothing when splits == 1): lse = log Σ_i exp(lse_i),
// O = Σ_i exp(lse_i − lse)·O_i. Launch checked.
// The split combine on its own: O_part [splits][rows][d] and lse_part [splits][rows] merged into O
// [rows][d] (rounded to the precision's format) and lse [rows]; the decode kernel's combine too.
void combine_splits(const float* O_part, const float* lse_part, float* O, float* lse, long long rows, int d,
                    int splits, Precision precision, cudaStream_t stream);
void combine_kv_splits(const FlashArgs& a, int splits, const FlashOutputs& partials, cudaStream_t stream);

// The tensor-core kernels' grid: x = query blocks, y = heads, z = KV splits.
dim3 query_block_grid(const FlashArgs& a, const KernelPlan& plan);

// A stream-ordered device allocation of `floats` floats (none for 0), freed by release() on the
// same stream after the work that uses it is queued.
struct StreamWorkspace {
    float* p = nullptr;
    cudaStream_t stream;
    StreamWorkspace(size_t floats, cudaStream_t s);
    void release();
};

// Blocks of the kernel kKernel (launched with T::THREADS threads and T::SMEM_BYTES of dynamic
// shared memory) that fit on an SM at once, its shared-memory limit raised first; asked of the
// runtime once per kernel.
template <class T, auto kKernel>
int kernel_blocks_per_sm() {
    static const int blocks = prepare_kernel(reinterpret_cast<const void*>(kKernel), T::THREADS, T::SMEM_BYTES);
    return blocks;
}

// One launch of a tensor-core kernel with its workspace: `operands` floats that prepare(ws) fills
// (the kernel's preparation pass; none for 0), then the KV-split partials. launch(ws, outputs)
// starts the kernel on `stream`, writing `outputs` (a's O and lse, or the partials); the split
// combine follows, and the workspace is freed after it in stream order.
template <class Prepare, class Launch>
void launch_with_workspace(const FlashArgs& a, const KernelPlan& plan, size_t operands, cudaStream_t stream,
                           Prepare&& prepare, Launch&& launch) {
    StreamWorkspace ws(operands + split_partial_floats(a, plan.splits), stream);
    prepare(ws.p);
    const FlashOutputs out = kernel_outputs(a, plan.splits, ws.p + operands);
    launch(ws.p, out);
    combine_kv_splits(a, plan.splits, out, stream);
    ws.release();
}

}  // namespace attnstep
