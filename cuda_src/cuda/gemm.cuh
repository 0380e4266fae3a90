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

// The half pipelines' GEMMs (Precision::bf16, fp16): the float32 operands, which hold half values,
// are converted into `a` and `b` (device memory for each operand's elements, 2 bytes each) and
// multiplied by cublasGemmStridedBatchedEx with bf16/fp16 operands, CUBLAS_COMPUTE_32F and a
// float32 result. Without it (fp32, tf32) the GEMMs are SGEMMs.
struct HalfGemm {
    Precision precision = Precision::fp32;
    void* a = nullptr;  // the first operand of the product as written below (Q, P, dO, dS)
    void* b = nullptr;  // the second (K, V, V, K, Q, dO)
    bool on() const { return is_half(precision); }
};

// QK[N][M] = Q[N][dk] · K[M][dk]ᵀ per head.
void gemm_qk(cublasHandle_t blas, const Dims& d, int heads, const float* Q, const float* K, float* QK,
             const HalfGemm& half = {});

// O[N][dv] = P[N][M] · V[M][dv] per head.
void gemm_output(cublasHandle_t blas, const Dims& d, int heads, const float* P, const float* V, float* O,
             const HalfGemm& half = {});

// dP[N][M] = dO[N][dv] · V[M][dv]ᵀ per head.
void gemm_dp(cublasHandle_t blas, const Dims& d, int heads, const float* dO, const float* V, float* dP,
             const HalfGemm& half = {});

// dQ[N][dk] = scale · dS[N][M] · K[M][dk] per head (the scale applied to the finished sum).
void gemm_dq(cublasHandle_t blas, const Dims& d, int heads, float scale, const float* dS, const float* K, float* dQ,
             const HalfGemm& half = {});

// dK[M][dk] = scale · dS[N][M]ᵀ · Q[N][dk] per head (the scale applied to the finished sum).
void gemm_dk(cublasHandle_t blas, const Dims& d, int heads, float scale, const float* dS, const float* Q, float* dK,
             const HalfGemm& half = {});

// dV[M][dv] = P[N][M]ᵀ · dO[N][dv] per head.
void gemm_dv(cublasHandle_t blas, const Dims& d, int heads, const float* P, const float* dO, float* dV,
             const HalfGemm& half = {});

}  // namespace attnstep
