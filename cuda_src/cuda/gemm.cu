// gemm.cu — gemm.cuh's GEMMs as strided-batched cublasSgemm calls.
#include "gemm.cuh"

#include "cuda_check.cuh"

namespace attnstep {

void set_gemm_precision(cublasHandle_t blas, Precision precision) {
    CUBLAS_CHECK(cublasSetMathMode(
        blas, precision == Precision::tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
}

// cuBLAS is column-major, and a row-major X[r][c] is the column-major Xᵀ (c×r, leading dimension
// c). So compute the column-major Sᵀ (M×N, ldc = M) = K · Qᵀ, where A = K is stored column-major
// as dk×M (lda = dk) and taken transposed (M×dk), and B = Q is stored column-major as dk×N
// (ldb = dk) and taken as is (= Qᵀ, dk×N).
void gemm_qk(cublasHandle_t blas, const Dims& d, int heads, const float* Q, const float* K, float* QK) {
    const float one = 1.f, zero = 0.f;
    CUBLAS_CHECK(cublasSgemmStridedBatched(
        blas, CUBLAS_OP_T, CUBLAS_OP_N, /*m=*/d.M, /*n=*/d.N, /*k=*/d.dk, &one,
        K, /*lda=*/d.dk, /*strideA=*/static_cast<long long>(d.M) * d.dk,
        Q, /*ldb=*/d.dk, /*strideB=*/static_cast<long long>(d.N) * d.dk, &zero,
        QK, /*ldc=*/d.M, /*strideC=*/static_cast<long long>(d.N) * d.M, heads));
}

// Column-major: Oᵀ (dv×N, ldc = dv) = Vᵀ · Pᵀ, where Vᵀ is V's storage read column-major (dv×M,
// lda = dv) and Pᵀ is P's (M×N, ldb = M); no transposes.
void gemm_output(cublasHandle_t blas, const Dims& d, int heads, const float* P, const float* V, float* O) {
    const float one = 1.f, zero = 0.f;
    CUBLAS_CHECK(cublasSgemmStridedBatched(
        blas, CUBLAS_OP_N, CUBLAS_OP_N, /*m=*/d.dv, /*n=*/d.N, /*k=*/d.M, &one,
        V, /*lda=*/d.dv, /*strideA=*/static_cast<long long>(d.M) * d.dv,
        P, /*ldb=*/d.M, /*strideB=*/static_cast<long long>(d.N) * d.M, &zero,
        O, /*ldc=*/d.dv, /*strideC=*/static_cast<long long>(d.N) * d.dv, heads));
}

}  // namespace attnstep
