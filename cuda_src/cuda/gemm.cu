// gemm.cu — gemm.cuh's GEMMs as strided-batched cublasSgemm calls.
//
// Arithmetic the verifier assumes (verify/model/kernels.py, the CUDA model): FP32 dot products in
// any summation order and blocking cuBLAS picks (CUBLAS_DEFAULT_MATH: no tensor-core rounding of
// operands), or under --precision tf32 TF32-rounded operands (the verifier's --precision tf32
// bounds); alpha (the scale of dQ, dK) applied to the finished sum, one rounding.
#include "gemm.cuh"

#include "cuda_check.cuh"

namespace attnstep {

void set_gemm_precision(cublasHandle_t blas, Precision precision) {
    CUBLAS_CHECK(cublasSetMathMode(
        blas, precision == Precision::tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
}

namespace {

// cuBLAS is column-major, and a row-major X[r][c] is the column-major Xᵀ (c×r, leading dimension
// c). Every product below is therefore computed as its transpose, which needs no copy: the
// column-major Cᵀ (cols×rows, ldc = cols) of the row-major C[rows][cols].

// C[rows][cols] = A[rows][k] · B[cols][k]ᵀ: Cᵀ = B · Aᵀ, with B's storage read column-major as
// k×cols (lda = k) and taken transposed, A's as k×rows (ldb = k) taken as is.
void gemm_abt(cublasHandle_t blas, int heads, int rows, int cols, int k, const float* A, const float* B, float* C) {
    const float one = 1.f, zero = 0.f;
    CUBLAS_CHECK(cublasSgemmStridedBatched(
        blas, CUBLAS_OP_T, CUBLAS_OP_N, /*m=*/cols, /*n=*/rows, /*k=*/k, &one,
        B, /*lda=*/k, /*strideA=*/static_cast<long long>(cols) * k,
        A, /*ldb=*/k, /*strideB=*/static_cast<long long>(rows) * k, &zero,
        C, /*ldc=*/cols, /*strideC=*/static_cast<long long>(rows) * cols, heads));
}

// C[rows][cols] = alpha · A[rows][k] · B[k][cols]: Cᵀ = Bᵀ · Aᵀ, both storages read column-major
// as they are (cols×k, lda = cols; k×rows, ldb = k); no transposes.
void gemm_ab(cublasHandle_t blas, int heads, int rows, int cols, int k, float alpha, const float* A, const float* B,
             float* C) {
    const float zero = 0.f;
    CUBLAS_CHECK(cublasSgemmStridedBatched(
        blas, CUBLAS_OP_N, CUBLAS_OP_N, /*m=*/cols, /*n=*/rows, /*k=*/k, &alpha,
        B, /*lda=*/cols, /*strideA=*/static_cast<long long>(k) * cols,
        A, /*ldb=*/k, /*strideB=*/static_cast<long long>(rows) * k, &zero,
        C, /*ldc=*/cols, /*strideC=*/static_cast<long long>(rows) * cols, heads));
}

// C[rows][cols] = alpha · A[k][rows]ᵀ · B[k][cols]: Cᵀ = Bᵀ · A, B's storage read column-major as
// cols×k (lda = cols) as is, A's as rows×k (ldb = rows) taken transposed.
void gemm_atb(cublasHandle_t blas, int heads, int rows, int cols, int k, float alpha, const float* A, const float* B,
              float* C) {
    const float zero = 0.f;
    CUBLAS_CHECK(cublasSgemmStridedBatched(
        blas, CUBLAS_OP_N, CUBLAS_OP_T, /*m=*/cols, /*n=*/rows, /*k=*/k, &alpha,
        B, /*lda=*/cols, /*strideA=*/static_cast<long long>(k) * cols,
        A, /*ldb=*/rows, /*strideB=*/static_cast<long long>(k) * rows, &zero,
        C, /*ldc=*/cols, /*strideC=*/static_cast<long long>(rows) * cols, heads));
}

}  // namespace

void gemm_qk(cublasHandle_t blas, const Dims& d, int heads, const float* Q, const float* K, float* QK) {
    gemm_abt(blas, heads, d.N, d.M, d.dk, Q, K, QK);
}

void gemm_output(cublasHandle_t blas, const Dims& d, int heads, const float* P, const float* V, float* O) {
    gemm_ab(blas, heads, d.N, d.dv, d.M, 1.f, P, V, O);
}

void gemm_dp(cublasHandle_t blas, const Dims& d, int heads, const float* dO, const float* V, float* dP) {
    gemm_abt(blas, heads, d.N, d.M, d.dv, dO, V, dP);
}

void gemm_dq(cublasHandle_t blas, const Dims& d, int heads, float scale, const float* dS, const float* K, float* dQ) {
    gemm_ab(blas, heads, d.N, d.dk, d.M, scale, dS, K, dQ);
}

void gemm_dk(cublasHandle_t blas, const Dims& d, int heads, float scale, const float* dS, const float* Q, float* dK) {
    gemm_atb(blas, heads, d.M, d.dk, d.N, scale, dS, Q, dK);
}

void gemm_dv(cublasHandle_t blas, const Dims& d, int heads, const float* P, const float* dO, float* dV) {
    gemm_atb(blas, heads, d.M, d.dv, d.N, 1.f, P, dO, dV);
}

}  // namespace attnstep
