// flash_scores.cuh — the scores of the tensor-core FlashAttention kernels' variant instantiation
// (flash_problem.cuh): the softcap and ALiBi, in base 2, and the mask rule on the tiles it cuts, on
// the accumulator fragments of flash_common.cuh (s[j][e]: row g + 8·(e/2), column 8j + 2t + e%2).
// Each modification branches once per tile around a loop of its own: a test per score inside the
// unrolled loops is kept by ptxas as a divergent branch per score.
#pragma once

#include <cmath>

#include "flash_common.cuh"

namespace attnstep {
namespace flash {

// tanh on the special-function unit (tanh.approx.f32, flash-attn's softcap through
// cutlass::fast_tanh): one instruction, a relative error of at most 2^-10.987 (PTX ISA), which the
// verifier's model of the half-precision kernel allows (verify/model/kernels.py). For that kernel,
// whose softmax already keeps the unit busy with one exponential per score: a tanh from the
// exponential and a division (two more) made the softcap 1.74x the time of the run without it,
// this one 1.23x (H100, docs/performance.md). The float32 kernels take tanhf.
__device__ __forceinline__ float tanh_approx(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The modifications of a raw score s = q·k into the softmax's base 2: x = s·scale·log2 e, or under a
// softcap C (cap_in = scale/C) x = C·log2 e·tanh(s·scale/C); then x −= slope·log2 e·|diag(r) − key|
// (ALiBi, slope_log2 = 0 without). Made on the host (score_mods) but for the slope, which the kernel
// reads for its head.
struct ScoreMods {
    float scale_log2 = 0.f;
    float cap_in = 0.f, cap_out = 0.f;
    float slope_log2 = 0.f;
    int offset = 0;
};
inline ScoreMods score_mods(float scale, const DeviceVariant& v) {
    ScoreMods m;
    m.scale_log2 = scale * kLog2e;
    if (v.softcap > 0.f) {
        m.cap_in = scale / v.softcap;
        m.cap_out = v.softcap * kLog2e;
    }
    m.offset = v.offset;
    return m;
}

// What the variant instantiation of a tensor-core kernel takes beside its parameters: a kernel
// parameter of its own (__grid_constant__, read in place), so that the plain instantiations' own
// parameters, and the code that reads them, stay as they are.
struct VariantArgs {
    DeviceVariant v;
    ScoreMods mods;
};
inline VariantArgs variant_args(float scale, const DeviceVariant& v) { return {v, score_mods(scale, v)}; }

// The tile's raw scores through ScoreMods. row0: the thread's row g (g+8 is the other); key0: the
// tile's first key. kApproxTanh: tanh_approx, else tanhf. Each modification is one branch per tile
// around a loop of its own: a test inside the unrolled loop is one per score, and ptxas keeps
// those as divergent branches (the variant kernels ran at half the speed of the plain ones so).
template <int BC, bool kApproxTanh>
__device__ __forceinline__ void modify_tile(float (&s)[BC / 8][4], const ScoreMods& mods, int key0, int row0, int t) {
    if (mods.cap_in != 0.f) {
#pragma unroll
        for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float y = s[nt][e] * mods.cap_in;
                s[nt][e] = (kApproxTanh ? tanh_approx(y) : tanhf(y)) * mods.cap_out;
            }
    } else {
        scale_tile<BC>(s, mods.scale_log2);
    }
    if (mods.slope_log2 != 0.f) {
#pragma unroll
        for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int dist = row0 + (e >= 2 ? 8 : 0) + mods.offset - (key0 + nt * 8 + 2 * t + (e & 1));
                s[nt][e] = __fmaf_rn(-mods.slope_log2, static_cast<float>(dist < 0 ? -dist : dist), s[nt][e]);
            }
    }
}

// modify_tile for softmax_tile<BC, true>, which multiplies each score by a positive c in its
// exponent's FFMA: the scores are left as far as that product can finish them, and c is returned.
// Unscaled (a positive scale, no ALiBi: c = scale·log2 e, as the plain kernels do), tanh(s·scale/C)
// alone (a softcap without ALiBi: c = C·log2 e), or all the way (c = 1). Each saves the tile's
// multiply and the subtraction's own rounding where the score allows it.
template <int BC, bool kApproxTanh>
__device__ __forceinline__ float modify_tile_for_exp(float (&s)[BC / 8][4], const ScoreMods& mods, int key0,
                                                     int row0, int t) {
    const bool alibi = mods.slope_log2 != 0.f;
    if (!alibi && mods.cap_in != 0.f) {
#pragma unroll
        for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float y = s[nt][e] * mods.cap_in;
                s[nt][e] = kApproxTanh ? tanh_approx(y) : tanhf(y);
            }
        return mods.cap_out;
    }
    if (!alibi && mods.scale_log2 > 0.f) return mods.scale_log2;
    modify_tile<BC, kApproxTanh>(s, mods, key0, row0, t);
    return 1.f;
}

// Keys past M and keys the rule hides from the row get -inf. Each of the thread's two rows sees
// the keys [first_key, end_key) (clipped to [0, M)), taken once relative to the thread's first
// column: per score, two compares with constants, where the rule asked per score costs a branch
// and a reload of its bounds.
template <int BC>
__device__ __forceinline__ void mask_tile_rule(float (&s)[BC / 8][4], const DeviceVariant& v, int key0, int M,
                                               int row0, int t) {
    const int col0 = key0 + 2 * t;
    const int lo[2] = {v.first_key(row0) - col0, v.first_key(row0 + 8) - col0};
    const int hi[2] = {v.end_key(row0, M) - col0, v.end_key(row0 + 8, M) - col0};
#pragma unroll
    for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int k = nt * 8 + (e & 1);
            if ((k < lo[e >> 1]) | (k >= hi[e >> 1])) s[nt][e] = -INFINITY;
        }
}

// Whether the tile of keys from key0 needs mask_tile_rule for the rows [r0, r0 + rows): it holds
// keys past M, or keys the rule hides from one of the rows.
template <int BC>
__device__ __forceinline__ bool rule_cuts(const DeviceVariant& v, int key0, int M, int r0, int rows) {
    return key0 + BC > M || !v.all_visible(r0, r0 + rows, key0, key0 + BC);
}

}  // namespace flash
}  // namespace attnstep
