// flash_dispatch.cu — flash_forward() and its plan: picks a registered kernel (flash_dispatch.cuh)
// for the problem and the GPU, and launches it in parts of at most kMaxGridYZ heads; plus the
// host-side pieces the kernels' launchers share (KV split choice, the split combine, the grid).
//
// Arithmetic of the split combine (run.toml's "-split<K>" suffix; verify/model/kernels.py counts
// it among the tensor-core kernels' four final roundings of O): per row, expf(lse_i − max) weights,
// their FP32 sum, the weighted sum of the partial outputs, one division; lse = max + logf(sum).
#include "flash_dispatch.cuh"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "../sequences.h"
#include "cuda_check.cuh"
#include "device.cuh"
#include "half_format.cuh"
#include "packed_blocks.cuh"

namespace attnstep {

namespace {

constexpr int kMaxSplits = 16;
constexpr int kCombineThreads = 256;

std::string split_suffix(int splits) { return splits > 1 ? "-split" + std::to_string(splits) : ""; }
// fp32 runs 3xTF32 on the tensor cores; every other precision is its own name.
std::string precision_suffix(Precision p) { return p == Precision::fp32 ? "-3xtf32" : std::string("-") + precision_name(p); }

[[noreturn]] void forced_kernel_missing(const char* name, const FlashArgs& a) {
    if (a.variant.per_element_inputs() && std::string(name) != "clean")
        fail(kExitBadInput, std::string("--flash-kernel ") + name + ": no " + name + " variant for mask or bias files "
                                "or dropout (the clean kernel has them)",
             "use --flash-kernel auto or clean");
    fail(kExitBadInput, std::string("--flash-kernel ") + name + ": no " + name + " variant for d=" +
                            std::to_string(a.d) + (is_half(a.precision) ? std::string(" at ") + precision_name(a.precision) : "") +
                            " on this GPU",
         "use --flash-kernel auto (or another kernel)");
}

// Only the wgmma kernel has half-precision variants: compute capability 9.0, d 64 and 128, and
// no mask or bias files or dropout.
[[noreturn]] void half_kernel_missing(const FlashArgs& a) {
    if (a.variant.per_element_inputs())
        fail(kExitBadInput, std::string("--precision ") + precision_name(a.precision) + ": no CUDA flash kernel for mask or "
                                "bias files or dropout at half precision",
             "select the stage path (--stages stages), or use --backend cpu, which emulates the flash kernels");
    fail(kExitBadInput, std::string("--precision ") + precision_name(a.precision) + ": no CUDA flash kernel for d=" +
                            std::to_string(a.d) + " at half precision on this GPU (it needs compute capability 9.0 "
                            "and d 64 or 128)",
         "select the stage path (--stages stages), or use --backend cpu, which emulates the flash kernels");
}

const char* kernel_word(FlashKernel k) {
    switch (k) {
        case FlashKernel::wgmma: return "wgmma";
        case FlashKernel::fast: return "fast";
        case FlashKernel::clean: return "clean";
        case FlashKernel::automatic: break;
    }
    return "auto";
}

struct Choice {
    const FlashKernelOps* ops;
    KernelPlan plan;
};

// `auto`: the first kernel, in the registry's order, that is preferred for the problem and has a
// variant for it; a forced kernel, if it has one. ops is null when none applies.
Choice try_choose(const FlashArgs& a) {
    Choice c{nullptr, {}};
    for (const FlashKernelOps* ops : flash_kernels()) {
        if (a.sequences && !ops->takes_sequences) continue;
        if (a.kernel == FlashKernel::automatic) {
            // At a half precision only a kernel with a half variant plans: preference aside.
            if ((is_half(a.precision) || !ops->preferred || ops->preferred(a)) && ops->plan(a, 0, &c.plan))
                return {ops, c.plan};
        } else if (ops->id == a.kernel) {
            if (ops->plan(a, 0, &c.plan)) return {ops, c.plan};
            break;
        }
    }
    return {nullptr, {}};
}

// try_choose's kernel; a forced kernel that has no variant is the user's error, not a silent
// fallback, and so is a half precision no kernel has.
Choice choose(const FlashArgs& a) {
    const Choice c = try_choose(a);
    if (c.ops) return c;
    if (a.kernel != FlashKernel::automatic) forced_kernel_missing(kernel_word(a.kernel), a);
    if (is_half(a.precision)) half_kernel_missing(a);
    fail(kExitInternal, where(__FILE__, __LINE__) + ": flash_forward: head width d=" + std::to_string(a.d) +
                            " has no kernel (supported: " + flash_head_dims_text() + ")",
         "callers must check flash_supported() first");
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// One thread per output element; the thread of column 0 also writes lse. A split that saw no key
// has lse −inf and weighs 0; a row no split saw a key of (a variant's mask) gets O = 0 and lse
// −inf, not 0/0. O is stored as Fmt rounds it (the format of a half precision).
template <class Fmt>
__global__ void flash_combine_kernel(const float* Opart, const float* lse_part, float* O, float* lse,
                                     int rows, int d, int splits) {
    const long long idx = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= static_cast<long long>(rows) * d) return;
    const int row = static_cast<int>(idx / d), col = static_cast<int>(idx % d);
    float mx = -INFINITY;
    for (int i = 0; i < splits; ++i) mx = fmaxf(mx, lse_part[static_cast<size_t>(i) * rows + row]);
    float wsum = 0.f, acc = 0.f;
    for (int i = 0; i < splits; ++i) {
        const float li = lse_part[static_cast<size_t>(i) * rows + row];
        const float w = li == -INFINITY ? 0.f : expf(li - mx);
        wsum += w;
        acc += w * Opart[(static_cast<size_t>(i) * rows + row) * d + col];
    }
    O[idx] = Fmt::round(wsum == 0.f ? 0.f : acc / wsum);
    if (col == 0) lse[row] = mx + logf(wsum);
}

}  // namespace

FlashKernelList flash_kernels() {
    static const FlashKernelOps* const kernels[] = {
#ifdef ATTNSTEP_HAVE_WGMMA
        &flash_wgmma_ops(),
#endif
        &flash_fast_ops(),
        &flash_clean_ops(),
    };
    return {std::begin(kernels), std::end(kernels)};
}

std::string flash_plan_name(const FlashKernelOps& ops, const FlashArgs& a, const KernelPlan& plan) {
    std::string name = std::string("cuda-") + ops.name;
    if (ops.tensor_cores) name += precision_suffix(a.precision) + split_suffix(plan.splits);
    return name;
}

bool flash_forward_available(const FlashArgs& a) { return try_choose(a).ops != nullptr; }

FlashPlan flash_forward_plan(const FlashArgs& a) {
    const Choice c = choose(a);
    return {c.plan.Br, c.plan.Bc, flash_plan_name(*c.ops, a, c.plan)};
}

size_t flash_workspace_bytes_per_head(const FlashArgs& a) { return choose(a).plan.workspace_per_head; }

size_t flash_format_input_bytes_per_head(const FlashArgs& a) {
    if (!is_half(a.precision)) return 0;
    auto bytes16 = [](size_t values) { return (values * 2 + 15) / 16 * 16; };
    return bytes16(static_cast<size_t>(a.N) * a.d) + 2 * bytes16(static_cast<size_t>(a.M) * a.d);
}

void flash_forward(const FlashArgs& a, cudaStream_t stream) {
    if (a.heads <= 0 || a.N <= 0 || a.M <= 0) {
        fail(kExitInternal, where(__FILE__, __LINE__) + ": flash_forward: empty problem (heads=" +
                                std::to_string(a.heads) + " N=" + std::to_string(a.N) +
                                " M=" + std::to_string(a.M) + ")");
    }
    if (!aligned16(a.Q) || !aligned16(a.K) || !aligned16(a.V) || !aligned16(a.O)) {
        fail(kExitInternal, where(__FILE__, __LINE__) +
                                ": flash_forward: Q, K, V and O must be 16-byte aligned (float4 loads)");
    }
    const Choice c = choose(a);
    flash_launch(*c.ops, a, c.plan, stream);
}

void flash_launch(const FlashKernelOps& ops, const FlashArgs& a, const KernelPlan& plan, cudaStream_t stream) {
    // The half-precision kernel reads the format's copies by tensor memory access (16-byte aligned).
    if (is_half(a.precision) && (!a.Qh || !a.Kh || !a.Vh || !aligned16(a.Qh) || !aligned16(a.Kh) || !aligned16(a.Vh))) {
        fail(kExitInternal, where(__FILE__, __LINE__) + ": flash_forward at " + precision_name(a.precision) +
                                " needs Q, K and V in the format (FlashArgs::Qh, Kh, Vh), 16-byte aligned");
    }
    // The kernels put heads on grid.y (or z): consecutive parts of at most kMaxGridYZ heads.
    for (int h0 = 0; h0 < a.heads; h0 += kMaxGridYZ) {
        FlashArgs part = a;
        part.heads = std::min(kMaxGridYZ, a.heads - h0);
        const size_t q = static_cast<size_t>(h0) * a.N, k = static_cast<size_t>(h0) * a.M;
        part.Q = a.Q + q * a.d;
        part.K = a.K + k * a.d;
        part.V = a.V + k * a.d;
        if (a.Qh) {
            part.Qh = a.Qh + q * a.d;
            part.Kh = a.Kh + k * a.d;
            part.Vh = a.Vh + k * a.d;
        }
        part.O = a.O + q * a.d;
        part.lse = a.lse + q;
        part.variant = a.variant.from_head(h0);
        ops.launch(part, plan, stream);
    }
}

int choose_kv_splits(long long blocks, long long slots, int n_tiles) {
    if (blocks >= slots) return 1;
    int splits = static_cast<int>((slots + blocks - 1) / blocks);
    splits = std::min(splits, std::max(1, n_tiles / 2));
    return std::max(1, std::min(splits, kMaxSplits));
}

int clamp_kv_splits(int splits, int n_tiles) { return std::max(1, std::min(splits, n_tiles)); }

size_t split_partial_floats(const FlashArgs& a, int splits) {
    return splits > 1 ? static_cast<size_t>(splits) * a.heads * a.N * (a.d + 1) : 0;
}

FlashOutputs kernel_outputs(const FlashArgs& a, int splits, float* partials) {
    if (splits <= 1) return {a.O, a.lse};
    return {partials, partials + static_cast<size_t>(splits) * a.heads * a.N * a.d};
}

void combine_splits(const float* O_part, const float* lse_part, float* O, float* lse, long long rows, int d,
                    int splits, Precision precision, cudaStream_t stream) {
    const long long elems = rows * d;
    auto combine = [&](auto fmt) {
        flash_combine_kernel<decltype(fmt)><<<static_cast<unsigned>((elems + kCombineThreads - 1) / kCombineThreads),
                                              kCombineThreads, 0, stream>>>(O_part, lse_part, O, lse,
                                                                            static_cast<int>(rows), d, splits);
        LAUNCH_CHECK(flash_combine_kernel);
    };
    if (is_half(precision)) with_half_format(precision, combine);
    else combine(Fp32{});
}

void combine_kv_splits(const FlashArgs& a, int splits, const FlashOutputs& partials, cudaStream_t stream) {
    if (splits <= 1) return;
    combine_splits(partials.O, partials.lse, a.O, a.lse, static_cast<long long>(a.heads) * a.N, a.d, splits,
                   a.precision, stream);
}

dim3 query_block_grid(const FlashArgs& a, const KernelPlan& plan) {
    return dim3((a.N + plan.Br - 1) / plan.Br, a.heads, plan.splits);
}

std::vector<PackedBlock> packed_blocks(const Sequences& s, int br, int bc, bool causal) {
    // A sequence's most work is its last query block's (causal) or any block's: its key tiles.
    auto most_tiles = [&](int b) {
        const int seen = causal ? std::min(s.m(b), s.n(b)) : s.m(b);
        return (seen + bc - 1) / bc;
    };
    std::vector<int> order(s.count());
    for (int b = 0; b < s.count(); ++b) order[b] = b;
    std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return most_tiles(x) < most_tiles(y); });
    std::vector<PackedBlock> blocks;
    for (int b : order)
        for (int qb = 0; qb * br < s.n(b); ++qb) blocks.push_back({qb, s.q_begin(b), s.k_begin(b), s.n(b), s.m(b)});
    return blocks;
}

DevicePackedBlocks::DevicePackedBlocks(const std::vector<PackedBlock>& blocks, cudaStream_t stream)
    : count(static_cast<int>(blocks.size())), stream_(stream) {
    if (blocks.empty()) return;
    const size_t bytes = blocks.size() * sizeof(PackedBlock);
    PackedBlock* d = nullptr;
    CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&d), bytes, stream));
    // From pageable memory: the call returns once the list is staged, so `blocks` may go.
    CUDA_CHECK(cudaMemcpyAsync(d, blocks.data(), bytes, cudaMemcpyHostToDevice, stream));
    p = d;
}

DevicePackedBlocks::~DevicePackedBlocks() {
    if (p) cudaFreeAsync(const_cast<PackedBlock*>(p), stream_);
}

void DevicePackedBlocks::release() {
    if (p) CUDA_CHECK(cudaFreeAsync(const_cast<PackedBlock*>(p), stream_));
    p = nullptr;
}

StreamWorkspace::StreamWorkspace(size_t floats, cudaStream_t s) : stream(s) {
    if (floats > 0) CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&p), floats * sizeof(float), stream));
}

void StreamWorkspace::release() {
    if (p) CUDA_CHECK(cudaFreeAsync(p, stream));
    p = nullptr;
}

}  // namespace attnstep
