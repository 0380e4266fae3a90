// flash_fast.cuh — the fast FlashAttention forward for Hopper (flash_fast.cu): FlashAttention-2 on
// tensor cores through mma.sync m16n8k8 TF32, FP32-accurate by default (3xTF32 split precision),
// one TF32 product in Precision::tf32. Same arguments and outputs as flash.cuh's flash_forward.
#pragma once

#include <cuda_runtime.h>

#include "flash.cuh"

namespace attnstep {

// Launches the fast forward for `a` on `stream` and returns true, or launches nothing and returns
// false when it has no variant for these arguments (d not in {16, 32, 64, 128}, d_k != d_v is not
// expressible here, more than 65535 heads); the caller then uses the clean kernel. Launches are
// checked (throws attnstep::Error). Uses a stream-ordered workspace when it splits the KV loop.
bool flash_forward_fast(const FlashArgs& a, cudaStream_t stream);

// What flash_forward_fast would do for `a`, without launching: false when it would decline.
// Br, Bc: the tile sizes; splits: how many parts the KV loop is split into (1 = no split).
bool flash_fast_plan(const FlashArgs& a, int* Br, int* Bc, int* splits);

// The same as flash_forward_fast with the split count forced (splits >= 1; clamped to the number
// of KV tiles). For tests and benchmarks: forcing a split on a large problem checks the combine step.
bool flash_forward_fast_splits(const FlashArgs& a, int splits, cudaStream_t stream);

// Shared with the wgmma kernel (sm90a/flash_wgmma.cu). The GPU's multiprocessor count (asked once).
int flash_sm_count();
// Split-KV merge: `splits` partial results Opart [splits][rows][d], lse_part [splits][rows] ->
// lse = log Σ_i exp(lse_i), O = Σ_i exp(lse_i − lse)·O_i. Launch checked.
void flash_combine_splits(const float* Opart, const float* lse_part, float* O, float* lse, size_t rows,
                          int d, int splits, cudaStream_t stream);

}  // namespace attnstep
