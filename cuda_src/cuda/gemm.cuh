// gemm.cuh — the stage path's two cuBLAS GEMMs (QK and output), shared by the CUDA backend and
// bench. Row-major matrices, `heads` of them back to back; enqueued on the handle's stream.
#pragma once

#include <cublas_v2.h>

#include "../backend.h"
#include "../stages.h"

namespace attnstep {

// True FP32 GEMMs, or TF32 tensor-core math under Precision::tf32.
void set_gemm_precision(cublasHandle_t blas, Precision precision);

// QK[N][M] = Q[N][dk] · K[M][dk]ᵀ per head.
void gemm_qk(cublasHandle_t blas, const Dims& d, int heads, const float* Q, const float* K, float* QK);

// O[N][dv] = P[N][M] · V[M][dv] per head.
void gemm_output(cublasHandle_t blas, const Dims& d, int heads, const float* P, const float* V, float* O);

}  // namespace attnstep
