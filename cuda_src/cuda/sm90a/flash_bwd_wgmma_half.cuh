// flash_bwd_wgmma_half.cuh — the FlashAttention backward on Hopper's warpgroup MMA at half
// precision (flash_bwd_wgmma_half.cu): bf16 or fp16 operands, FP32 accumulation, deterministic.
// flash_bwd.cu hands it the problems it takes; built only for sm_90a, run on compute capability
// 9.0 alone.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "../flash_bwd.cuh"

namespace attnstep {

// Whether the kernels take `a`: bf16 or fp16, d 64 or 128, no mask or bias files or dropout (the
// rule of either alignment, windows, softcap and ALiBi they take), dense (no packed batch), Q, K and V in the format (FlashBwdArgs::Qh, Kh, Vh). The caller checks
// the compute capability.
bool wgmma_half_backward_takes(const FlashBwdArgs& a);

// Device bytes per head the launch allocates beyond its arguments: dO in the format, and the rows'
// lse·log2 e and D padded to whole query tiles.
size_t wgmma_half_backward_workspace_bytes_per_head(const FlashBwdArgs& a);

// The preparation pass (dO to the format; D and lse·log2 e per row), the dK/dV kernel and the dQ
// kernel on `stream`; no atomics. Checked.
void wgmma_half_backward(const FlashBwdArgs& a, cudaStream_t stream);

}  // namespace attnstep
