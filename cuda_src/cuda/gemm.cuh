// gemm.cuh — the stage path's cuBLAS GEMMs (QK and output forward; dP, dQ, dK, dV backward), shared
// by the CUDA backend and bench. Row-major matrices, `heads` of them back to back; enqueued on the
// handle's stream.
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

// dP[N][M] = dO[N][dv] · V[M][dv]ᵀ per head.
void gemm_dp(cublasHandle_t blas, const Dims& d, int heads, const float* dO, const float* V, float* dP);

// dQ[N][dk] = scale · dS[N][M] · K[M][dk] per head (the scale applied to the finished sum).
void gemm_dq(cublasHandle_t blas, const Dims& d, int heads, float scale, const float* dS, const float* K, float* dQ);

// dK[M][dk] = scale · dS[N][M]ᵀ · Q[N][dk] per head (the scale applied to the finished sum).
void gemm_dk(cublasHandle_t blas, const Dims& d, int heads, float scale, const float* dS, const float* Q, float* dK);

// dV[M][dv] = P[N][M]ᵀ · dO[N][dv] per head.
void gemm_dv(cublasHandle_t blas, const Dims& d, int heads, const float* P, const float* dO, float* dV);

}  // namespace attnstep
