// head_scores.h — the scores the softmax reads, for one query head of a group: scale·q·k through the
// variant's modifications (softcap, ALiBi, the bias file) and masks (the causal/window rule with its
// alignment, the mask file, −inf in the bias file), and dropout's keep decisions. The stage path and
// both flash kernels read every score and every keep decision through this one class, built on the
// functions of variant.h, so that they modify, mask and drop exactly the same entries.
#pragma once

#include <algorithm>
#include <cstdint>

#include "../backend.h"
#include "../variant.h"
#include "matrix_ops.h"

namespace attnstep {
namespace cpu {

class HeadScores {
public:
    // Head h of group g (main.cpp hands the group's mask, bias and slopes; check_variant_inputs in
    // backend_cpu.cpp has made sure that the variant's are there).
    HeadScores(const Problem& p, const HeadGroup& g, int h)
        : rule_(p.variant.rule(p.dims.N, p.dims.M)), M_(p.dims.M), scale_(p.scale), softcap_(p.variant.softcap),
          alibi_(p.variant.alibi), slope_(p.variant.alibi ? g.alibi_slopes[h] : 0.f),
          mask_(g.mask ? g.mask + g.mask_head_stride * h : nullptr),
          bias_(g.bias ? g.bias + g.bias_head_stride * h : nullptr), head_(g.first + h),
          dropout_(p.variant.dropout), seed_(p.variant.dropout_seed), keep_scale_(1.f / (1.f - p.variant.dropout)) {}

    // Whether score (r, c) is masked: outside the rule, 0 in the mask file, or −inf in the bias file
    // (PyTorch's float attn_mask masks with −inf too).
    bool hidden(int r, int c) const {
        if (!rule_.visible(r, c)) return true;
        const size_t at = static_cast<size_t>(r) * M_ + c;
        return (mask_ && mask_[at] == 0.f) || (bias_ && bias_[at] == kNegInf);
    }

    // The score the softmax reads from the raw dot product qk = q_r·k_c: s = scale·qk, capped,
    // less ALiBi's distance penalty, plus the bias; −inf where hidden.
    float score(float qk, int r, int c) const { return hidden(r, c) ? kNegInf : modified(qk, r, c); }
    // The same for an entry known not to be hidden.
    float modified(float qk, int r, int c) const {
        float s = apply_softcap(qk * scale_, softcap_);
        if (alibi_) s += alibi_bias(slope_, r, c, rule_);
        if (bias_) s += bias_[static_cast<size_t>(r) * M_ + c];
        return s;
    }

    // The softcap's derivative at qk (1 − t², t = tanh(scale·qk/C)): what dS is multiplied by on
    // its way to dQ and dK. ALiBi and the bias are additive, so they add no factor.
    bool capped() const { return softcap_ > 0.f; }
    float cap_derivative(float qk) const { return softcap_derivative(qk * scale_, softcap_); }

    // Dropout: whether entry (r, c) is kept (1) or dropped (0), the counter hash of flat query
    // head `head_` that the CUDA backend draws too; and kept weights' factor 1/(1 − p).
    bool drops() const { return dropout_ > 0.f; }
    float keep(int r, int c) const { return dropout_keep(seed_, head_, r, c, M_, dropout_) ? 1.f : 0.f; }
    float keep_scale() const { return keep_scale_; }
    // What P or dP of entry (r, c) is multiplied by under dropout: Z·(1/(1 − p)), 1 without dropout.
    float dropped_scale(int r, int c) const { return drops() ? keep(r, c) * keep_scale_ : 1.f; }

    // Whether any row of [r0, r1) may see a key of [c0, c1) under the rule. The rule's ranges move
    // right with the row, so [first_key(r0), end_key(r1 − 1)) holds every row's: a tile outside it
    // is skipped whole (the mask and bias files are read entry by entry, never to skip a tile).
    bool tile_visible(int r0, int r1, int c0, int c1) const {
        return std::max<long long>(c0, rule_.first_key_of_rows(r0)) <
               std::min<long long>(c1, rule_.end_key_of_rows(r1, M_));
    }

private:
    MaskRule rule_;
    int M_;
    float scale_, softcap_;
    bool alibi_;
    float slope_;
    const float* mask_;  // this head's N×M (nonzero keeps), null without a mask file
    const float* bias_;  // this head's N×M, null without a bias file
    long long head_;     // the flat query head: dropout's counter
    float dropout_;
    uint64_t seed_;
    float keep_scale_;
};

}  // namespace cpu
}  // namespace attnstep
