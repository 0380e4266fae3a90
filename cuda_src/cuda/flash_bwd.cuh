// flash_bwd.cuh — the FlashAttention backward as the CUDA backend and bench call it (flash_bwd.cu).
// All pointers are device memory; `heads` matrices lie back to back, row-major:
//   Q, dQ [heads][N][d]; K, V, dK, dV [heads][M][d]; O, dO [heads][N][d]; lse [heads][N]
// (O and lse are the flash forward's outputs). dQ = scale·dS·K, dK = scale·dSᵀ·Q, dV = Pᵀ·dO with
// P = exp(scale·Q·Kᵀ − lse) recomputed tile by tile and dS = P∘(dO·Vᵀ − rowsum(dO∘O)); under the
// variant (FlashProblem::variant) P from the scores the forward read, dropout's keep-mask on P and
// dP, and dS through the softcap's derivative for dQ and dK (flash_bwd.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "../backend.h"
#include "flash_problem.cuh"

namespace attnstep {

struct FlashBwdArgs : FlashProblem {
    const float* O = nullptr;  // the flash forward's outputs
    const float* lse = nullptr;
    const float* dO = nullptr;
    float* dQ = nullptr;
    float* dK = nullptr;
    float* dV = nullptr;
    // Q, K and V as 16-bit values of the format at bf16 and fp16 (the Hopper kernels read them by
    // tensor memory access, as the forward does: FlashArgs::Qh); unused at fp32 and tf32.
    const uint16_t* Qh = nullptr;
    const uint16_t* Kh = nullptr;
    const uint16_t* Vh = nullptr;
};

// Whether this binary and GPU have a flash backward for `a`: at fp32 and tf32 on compute
// capability 8.0+ (mma.sync; on 9.0 by wgmma tf32 at d 64 and 128 and fp32 at d 64, where there
// is no mask or the top-left causal one), at bf16 and fp16 on 9.0 (wgmma) without mask or bias
// files or dropout.
bool flash_backward_available(const FlashBwdArgs& a);

// The backward's tiles and kernel name ("cuda-bwd-3xtf32", "cuda-bwd-tf32", "cuda-bwd-wgmma-fp32",
// "cuda-bwd-wgmma-tf32", "cuda-bwd-wgmma-bf16", "cuda-bwd-wgmma-fp16"): Br is the query rows per tile, Bc the keys. Requires
// flash_backward_available().
FlashPlan flash_backward_plan(const FlashBwdArgs& a);

// Device memory flash_backward allocates per head beyond its arguments: D (a float per query row),
// at a half precision dO in the format and lse·log2 e, on Hopper at tf32 the operands rounded to
// TF32 and transposed (fp32: their two TF32 parts); O((N + M)·d), never an N×M buffer.
size_t flash_backward_workspace_bytes_per_head(const FlashBwdArgs& a);

// Launches the backward on `stream`: the preprocess (D), then one kernel over key blocks (dK, dV)
// and one over query blocks (dQ); no atomics, so two runs give bit-identical gradients. Checked.
void flash_backward(const FlashBwdArgs& a, cudaStream_t stream);

}  // namespace attnstep
