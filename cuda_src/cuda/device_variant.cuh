// device_variant.cuh — the case's variant (variant.h) as the CUDA kernels read it: the mask rule in
// int (the flash kernels compute key ranges per tile and per element), the softcap, ALiBi's slopes,
// the mask and bias files and dropout, with the device pointers of the group's uploads
// (variant_buffers.cu makes them). The stage path's kernels (variant_kernels.cu) and every flash
// kernel take one by value; the functions below are variant.h's on the device, so the two
// backends compute one definition.
#pragma once

#include <cmath>
#include <cstdint>

#include "../backend.h"
#include "../variant.h"

namespace attnstep {

struct DeviceVariant {
    // The mask rule (variant.h MaskRule): diag(r) = r + offset, key c visible when diag(r) − left
    // <= c <= diag(r) + right, kUnbounded dropping a side. A bound past N + M hides no key, so the
    // host keeps bounds there (make_device_variant) and all of this fits an int.
    int offset = 0, left = kUnbounded, right = kUnbounded;
    float softcap = 0.f;      // C > 0: s <- C·tanh(s/C) after the scale
    bool alibi = false;       // slopes: one per head of the launch (device), set where it runs
    bool mask_file = false;   // a mask file (nonzero keeps) ...
    bool bias_file = false;   // ... a bias file, N×M per head, `*_stride` floats apart (0: broadcast)
    float dropout = 0.f;      // p; the keep-mask is dropout_keep(seed, head_base + h, r, c, M, p)
    uint64_t seed = 0;
    long long head_base = 0;  // the flat query head of head 0 of the launch
    const float* slopes = nullptr;
    const float* mask = nullptr;
    long long mask_stride = 0;
    const float* bias = nullptr;
    long long bias_stride = 0;

    // -- what a kernel needs --------------------------------------------------------------------
    ATTNSTEP_HD bool has_rule() const { return left != kUnbounded || right != kUnbounded; }
    ATTNSTEP_HD bool top_left_causal() const { return offset == 0 && left == kUnbounded && right == 0; }
    // Score modifications (softcap, ALiBi, a bias file), as Variant::modifies_scores.
    ATTNSTEP_HD bool modifies_scores() const { return softcap > 0.f || alibi || bias_file; }
    // What only the plain FP32 flash kernel and the flash backward read per element: the files
    // and dropout.
    ATTNSTEP_HD bool per_element_inputs() const { return mask_file || bias_file || dropout > 0.f; }
    // Anything beyond no mask or the top-left causal one: the kernels' variant instantiation.
    ATTNSTEP_HD bool beyond_plain() const {
        return modifies_scores() || per_element_inputs() || (has_rule() && !top_left_causal());
    }
    ATTNSTEP_HD float inv_keep() const { return 1.f / (1.f - dropout); }

    // -- the mask rule --------------------------------------------------------------------------
    ATTNSTEP_HD MaskRule rule() const {
        MaskRule m;
        m.offset = offset;
        m.left = left;
        m.right = right;
        return m;
    }
    ATTNSTEP_HD bool visible(int r, int c) const {
        const int diag = r + offset;
        return (left == kUnbounded || c >= diag - left) && (right == kUnbounded || c <= diag + right);
    }
    // [first_key(r), end_key(r, M)): the keys row r may see (none when first >= end).
    ATTNSTEP_HD int first_key(int r) const {
        const int f = left == kUnbounded ? 0 : r + offset - left;
        return f < 0 ? 0 : f;
    }
    ATTNSTEP_HD int end_key(int r, int M) const {
        const int e = right == kUnbounded ? M : r + offset + right + 1;
        return e > M ? M : e < 0 ? 0 : e;
    }
    // [first_row(c0), end_row(c1, N)): the query rows that may see a key of [c0, c1) (first_key
    // and end_key grow with r, so these are their inverses).
    ATTNSTEP_HD int first_row(int c0) const {
        const int f = right == kUnbounded ? 0 : c0 - offset - right;
        return f < 0 ? 0 : f;
    }
    ATTNSTEP_HD int end_row(int c1, int N) const {
        const int e = left == kUnbounded ? N : c1 + left - offset;
        return e > N ? N : e < 0 ? 0 : e;
    }
    // Whether every key of [c0, c1) is visible to every row of [r0, r1) (r0 < r1, c0 < c1).
    ATTNSTEP_HD bool all_visible(int r0, int r1, int c0, int c1) const {
        return (left == kUnbounded || c0 >= r1 - 1 + offset - left) && (right == kUnbounded || c1 - 1 <= r0 + offset + right);
    }
    // Whether no key of [c0, c1) is visible to any row of [r0, r1).
    ATTNSTEP_HD bool none_visible(int r0, int r1, int c0, int c1) const {
        return (left != kUnbounded && c1 - 1 < r0 + offset - left) || (right != kUnbounded && c0 > r1 - 1 + offset + right);
    }
    // The same variant for a launch that starts `h0` heads further into the group.
    DeviceVariant from_head(int h0) const {
        DeviceVariant v = *this;
        v.head_base += h0;
        if (slopes) v.slopes += h0;
        if (mask) v.mask += h0 * mask_stride;
        if (bias) v.bias += h0 * bias_stride;
        return v;
    }

#if defined(__CUDACC__)
    // -- per element (head h of the launch, row r, key c) --------------------------------------
    __device__ __forceinline__ float slope(int h) const { return slopes ? slopes[h] : 0.f; }
    __device__ __forceinline__ size_t at(int r, int c, int M) const {
        return static_cast<size_t>(r) * M + c;
    }
    __device__ __forceinline__ float file_bias(int h, int r, int c, int M) const {
        return bias ? bias[h * bias_stride + at(r, c, M)] : 0.f;
    }
    // Whether score (r, c) of head h is masked: outside the rule, 0 in the mask file, or -inf in
    // the bias file (as PyTorch's float attn_mask masks), as the CPU backend's HeadScores::hidden.
    __device__ __forceinline__ bool hidden(int h, int r, int c, int M) const {
        return !visible(r, c) || (mask && mask[h * mask_stride + at(r, c, M)] == 0.f) ||
               (bias && file_bias(h, r, c, M) == -INFINITY);
    }
    __device__ __forceinline__ bool keep(int h, int r, int c, int M) const {
        return dropout_keep(seed, head_base + h, r, c, M, dropout);
    }
#endif
};

// The variant of problem `p` without device pointers (the kernels' plans need its flags; the
// backend sets the pointers where it uploads the inputs): the rule of p.variant, with p.causal.
DeviceVariant make_device_variant(const Problem& p);

}  // namespace attnstep
