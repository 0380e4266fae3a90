// half_format.cuh — the half formats on the device, as the kernels use them: a float32 value
// rounded to the format (nearest even, as a float32 -> bf16/fp16 conversion rounds; the CPU
// backend's round_bf16/round_fp16 round alike), and two values packed into one 32-bit register,
// the first in the low 16 bits (the operand layout of the 16-bit MMAs). Float32 is a format too
// (round is the identity) for code that stores either.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "../backend.h"

namespace attnstep {

struct Fp32 {
    static constexpr Precision precision = Precision::fp32;
    static __device__ __forceinline__ float round(float x) { return x; }
};

struct Bf16 {
    static constexpr Precision precision = Precision::bf16;
    static __device__ __forceinline__ float round(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<const uint32_t*>(&v);
    }
};

struct Fp16 {
    static constexpr Precision precision = Precision::fp16;
    static __device__ __forceinline__ float round(float x) { return __half2float(__float2half_rn(x)); }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        const __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<const uint32_t*>(&v);
    }
};

// Calls f(Fmt{}) with the format of a half precision (bf16 or fp16).
template <class F>
decltype(auto) with_half_format(Precision p, F&& f) {
    return p == Precision::bf16 ? f(Bf16{}) : f(Fp16{});
}

}  // namespace attnstep
