// flash_bwd_wgmma_tf32.cuh — the FlashAttention backward on Hopper's warpgroup MMA on TF32 tensor
// cores (flash_bwd_wgmma_tf32.cu): TF32 operands (--precision tf32) or 3xTF32 ones (fp32), FP32
// accumulation, deterministic. flash_bwd.cu hands it
// the problems it takes; built only for sm_90a, run on compute capability 9.0 alone.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "../flash_bwd.cuh"

namespace attnstep {

// Whether the kernels take `a`: --precision tf32 at d 64 or 128, fp32 at d 64; no mask or the
// top-left causal one, dense (no packed batch). The caller checks the compute capability.
bool wgmma_tf32_backward_takes(const FlashBwdArgs& a);

// The dK/dV kernel's tiles as the bench labels them: {query rows streamed a tile, keys a block}
// (the dQ kernel's are the transpose). Requires wgmma_tf32_backward_takes(a).
void wgmma_tf32_backward_tiles(const FlashBwdArgs& a, int* rows, int* keys);

// Device bytes per head the launch allocates beyond its arguments: Q, K, V and dO rounded to TF32
// (fp32: their two TF32 parts), the transposed copies Qᵀ, dOᵀ and Kᵀ likewise, and the rows'
// lse·log2 e and D; O((N + M)·d).
size_t wgmma_tf32_backward_workspace_bytes_per_head(const FlashBwdArgs& a);

// The preparation pass, the dK/dV kernel and the dQ kernel on `stream`; no atomics. Checked.
void wgmma_tf32_backward(const FlashBwdArgs& a, cudaStream_t stream);

}  // namespace attnstep
