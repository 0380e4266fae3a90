// flash_problem.cuh — what the flash forward's and backward's arguments share (FlashArgs in
// flash.cuh, FlashBwdArgs in flash_bwd.cuh): the inputs and the problem. All pointers are device
// memory; `heads` matrices lie back to back, row-major: Q [heads][N][d], K and V [heads][M][d].
#pragma once

#include <type_traits>

#include "../backend.h"
#include "device_variant.cuh"

namespace attnstep {

struct Sequences;

struct FlashProblem {
    const float* Q;
    const float* K;
    const float* V;
    int heads, N, M, d;
    float scale;      // multiplies q·k
    bool causal;      // top-left aligned: query r sees keys c <= r (and the variant is plain)
    Precision precision;
    // The case's variant. Beyond no mask or the top-left causal one (beyond_plain) the kernels run
    // their variant instantiation, which takes the whole rule from here (causal is then false); a
    // plain one leaves it to `causal`. Its pointers are device memory, for the heads of the call.
    DeviceVariant variant = {};
    // A packed batch (host memory): attention within each sequence, whose rows the matrices hold
    // packed (sequences.h; N and M are the totals), in one launch (packed_blocks.cuh). The mask
    // is then the plain kind within every sequence (`causal`: top-left in each). Null: dense.
    const Sequences* sequences = nullptr;
};

// Calls f(causal, variant), both std::bool_constant, for the kernels' three instantiations: no
// mask (false, false), the top-left causal mask (true, false), the variant's (false, true).
template <class F>
decltype(auto) with_mask_kind(const FlashProblem& a, F&& f) {
    if (a.variant.beyond_plain()) return f(std::false_type{}, std::true_type{});
    return a.causal ? f(std::true_type{}, std::false_type{}) : f(std::false_type{}, std::false_type{});
}

}  // namespace attnstep
