// warp.cuh — lane-level device helpers every kernel file shares: butterfly reductions over groups
// of lanes, and element access to float4 vectors.
#pragma once

#include <cuda_runtime.h>

namespace attnstep {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarp = 32;

// Max / sum of v over the lanes that differ in the bits of kOffsets, by xor shuffles in the order
// given (the order fixes how a sum rounds); every lane of a group gets the result. All 32 lanes
// call it together.
template <int... kOffsets>
__device__ __forceinline__ float xor_max(float v) {
    ((v = fmaxf(v, __shfl_xor_sync(kFullMask, v, kOffsets))), ...);
    return v;
}
template <int... kOffsets>
__device__ __forceinline__ float xor_sum(float v) {
    ((v += __shfl_xor_sync(kFullMask, v, kOffsets)), ...);
    return v;
}

// The groups the kernels reduce over: a whole warp (kernels.cu's block reductions), a half-warp
// (the 16 lanes that share a query row in flash_fwd.cu), and a quad (the 4 lanes that hold one row
// of an mma.sync / wgmma accumulator fragment).
__device__ __forceinline__ float warp_max(float v) { return xor_max<16, 8, 4, 2, 1>(v); }
__device__ __forceinline__ float warp_sum(float v) { return xor_sum<16, 8, 4, 2, 1>(v); }
__device__ __forceinline__ float half_warp_max(float v) { return xor_max<8, 4, 2, 1>(v); }
__device__ __forceinline__ float half_warp_sum(float v) { return xor_sum<8, 4, 2, 1>(v); }
__device__ __forceinline__ float quad_max(float v) { return xor_max<1, 2>(v); }
__device__ __forceinline__ float quad_sum(float v) { return xor_sum<1, 2>(v); }

// Element i of a vector (a scalar is a vector of one).
__device__ __forceinline__ float lane_of(const float& v, int) { return v; }
__device__ __forceinline__ float lane_of(const float4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

}  // namespace attnstep
