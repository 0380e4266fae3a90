// flash_wgmma.cuh — the Hopper FlashAttention forward (flash_wgmma.cu): FlashAttention-2 on wgmma
// (sm_90a), FP32-accurate by default (3xTF32 split precision), one TF32 product in
// Precision::tf32. Registered with the dispatcher as flash_wgmma_ops() (flash_dispatch.cuh). Built
// only for sm_90a; it runs on compute capability 9.0 GPUs (H100, H200) and declines elsewhere.
#pragma once

#include <cuda_runtime.h>

namespace attnstep {

// bench.cu's ceiling for this kernel: launches a kernel that only issues TF32 wgmma (m64n128k8,
// operands in shared memory) on every SM and returns its FLOP count; 0 (nothing launched) where
// the GPU is not compute capability 9.0. Launch checked; `sink` is a device float.
double launch_wgmma_peak(float* sink, cudaStream_t stream);

}  // namespace attnstep
