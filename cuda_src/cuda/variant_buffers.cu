// variant_buffers.cu — the device variant of a problem (make_device_variant, device_variant.cuh) and
// the group's variant inputs on the device (variant_buffers.cuh).
#include "variant_buffers.cuh"

#include <algorithm>
#include <string>

#include "../common.h"
#include "cuda_check.cuh"

namespace attnstep {

namespace {

// A window bound as the kernels take it: one that reaches past every key (N + M or more: diag(r)
// lies in [−N, M)) hides nothing and is unbounded, so every bound left fits an int.
int kernel_bound(long long bound, const Dims& d) {
    return bound == kUnbounded || bound >= static_cast<long long>(d.N) + d.M ? kUnbounded : static_cast<int>(bound);
}

bool stage_path_scratch(const Problem& p, StageSet computed) {
    const bool dropped = p.variant.dropout > 0.f && (computed.has(Stage::output) || computed.has(Stage::dV));
    const bool capped = p.variant.softcap > 0.f && (computed.has(Stage::dQ) || computed.has(Stage::dK));
    return dropped || capped;
}

size_t matrix_floats(const Dims& d) { return static_cast<size_t>(d.N) * d.M; }

// A file covering the heads per head or by one matrix.
size_t file_floats(Coverage c, const Dims& d, int heads) {
    return c == Coverage::none ? 0 : matrix_floats(d) * (c == Coverage::per_head ? heads : 1);
}

// Copies `heads` N×M matrices from the host (head_stride floats apart; 0: one matrix) to `dst`,
// packed, and returns the device stride (N×M, or 0).
long long upload_file(const float* host, long long head_stride, float* dst, const Dims& d, int heads,
                      const char* what, cudaStream_t stream) {
    if (!host) fail(kExitInternal, where(__FILE__, __LINE__) + ": the case's " + what + " file is not in the group");
    const size_t n = matrix_floats(d);
    const int copies = head_stride == 0 ? 1 : heads;
    for (int h = 0; h < copies; ++h)
        CUDA_CHECK(cudaMemcpyAsync(dst + n * h, host + head_stride * h, n * sizeof(float), cudaMemcpyHostToDevice, stream));
    return head_stride == 0 ? 0 : static_cast<long long>(n);
}

}  // namespace

DeviceVariant make_device_variant(const Problem& p) {
    Variant var = p.variant;
    var.causal = var.causal || p.causal;  // Problem::causal mirrors it; either one asks for the mask
    const MaskRule rule = var.rule(p.dims.N, p.dims.M);
    DeviceVariant v;
    v.offset = static_cast<int>(rule.offset);
    v.left = kernel_bound(rule.left, p.dims);
    v.right = kernel_bound(rule.right, p.dims);
    v.softcap = var.softcap;
    v.alibi = var.alibi;
    v.mask_file = var.mask != Coverage::none;
    v.bias_file = var.bias != Coverage::none;
    v.dropout = var.dropout;
    v.seed = var.dropout_seed;
    return v;
}

VariantLayout variant_layout(const Problem& p, StageSet computed, int heads) {
    VariantLayout l;
    l.mask = file_floats(p.variant.mask, p.dims, heads);
    l.bias = file_floats(p.variant.bias, p.dims, heads);
    l.slopes = p.variant.alibi ? static_cast<size_t>(heads) : 0;
    l.scratch = stage_path_scratch(p, computed) ? matrix_floats(p.dims) * heads : 0;
    return l;
}

size_t variant_bytes_per_head(const Problem& p, StageSet computed, size_t align) {
    VariantLayout l = variant_layout(p, computed, 1);
    size_t bytes = 0;
    for (size_t floats : {l.mask, l.bias, l.slopes, l.scratch})
        if (floats) bytes += floats * sizeof(float) + align;
    return bytes;
}

DeviceVariant upload_variant_inputs(const Problem& p, const HeadGroup& g, const VariantBuffers& at,
                                    cudaStream_t stream) {
    DeviceVariant v = make_device_variant(p);
    v.head_base = g.first;
    if (v.mask_file) {
        v.mask_stride = upload_file(g.mask, g.mask_head_stride, at.mask, p.dims, g.count, "mask", stream);
        v.mask = at.mask;
    }
    if (v.bias_file) {
        v.bias_stride = upload_file(g.bias, g.bias_head_stride, at.bias, p.dims, g.count, "bias", stream);
        v.bias = at.bias;
    }
    if (v.alibi) {
        if (!g.alibi_slopes) fail(kExitInternal, where(__FILE__, __LINE__) + ": an ALiBi case without its slopes");
        CUDA_CHECK(cudaMemcpyAsync(at.slopes, g.alibi_slopes, g.count * sizeof(float), cudaMemcpyHostToDevice, stream));
        v.slopes = at.slopes;
    }
    return v;
}

}  // namespace attnstep
