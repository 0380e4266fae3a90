// flash_wgmma.cuh — the Hopper FlashAttention forward (flash_wgmma.cu): FlashAttention-2 on wgmma
// (sm_90a), FP32-accurate by default (3xTF32 split precision), one TF32 product in
// Precision::tf32. Same arguments and outputs as flash.cuh's flash_forward. Built only for sm_90a;
// it runs on compute capability 9.0 GPUs (H100, H200) and declines elsewhere.
#pragma once

#include <cuda_runtime.h>

#include "../flash.cuh"

namespace attnstep {

// What flash_forward_wgmma would do for `a`, without launching: false when it would decline
// (not a compute capability 9.0 GPU, d not in {64, 128}, more than 65535 heads).
bool flash_wgmma_plan(const FlashArgs& a, int* Br, int* Bc, int* splits);

// Launches the forward for `a` on `stream` and returns true, or launches nothing and returns
// false where flash_wgmma_plan declines. splits > 0 forces the KV split count (tests, benchmarks).
// Uses a stream-ordered workspace (flash_wgmma_workspace_bytes) for the TF32-split K and Vᵀ.
bool flash_forward_wgmma(const FlashArgs& a, cudaStream_t stream, int splits = 0);

// Whether `auto` should run this kernel rather than the mma.sync one (flash_fast.cuh) where both
// have a variant: only where it measured faster.
bool flash_wgmma_preferred(const FlashArgs& a);

// Device memory the workspace takes per head (0 where the kernel declines).
size_t flash_wgmma_workspace_bytes_per_head(const FlashArgs& a);

// bench.cu's ceiling for this kernel: launches a kernel that only issues TF32 wgmma (m64n128k8,
// operands in shared memory) on every SM and returns its FLOP count; 0 (nothing launched) where
// the GPU is not compute capability 9.0. Launch checked; `sink` is a device float.
double launch_wgmma_peak(float* sink, cudaStream_t stream);

}  // namespace attnstep
