// half.cuh — the half pipelines on the GPU (--precision bf16|fp16, stage path only): float32
// buffers that hold half values are converted to bf16/fp16 arrays for cublasGemmEx, and each
// computed stage is rounded to the format in place (cuda_src/backend.h's round_to, on the device).
#pragma once

#include <cuda_runtime.h>
#include <library_types.h>

#include <cstddef>

#include "../backend.h"

namespace attnstep {

// CUDA_R_16BF or CUDA_R_16F: the GEMM operand type of a half precision.
cudaDataType half_data_type(Precision p);

// out[i] = x[i] as bf16/fp16 (2 bytes each), nearest even, for i in [0, n).
void launch_to_half(const float* x, void* out, size_t n, Precision p, cudaStream_t stream);

// x[i] = x[i] rounded to the format (nearest even) and back, for i in [0, n): a stage stored in it.
void launch_round_to_format(float* x, size_t n, Precision p, cudaStream_t stream);

}  // namespace attnstep
