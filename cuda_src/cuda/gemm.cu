// gemm.cu — gemm.cuh's GEMMs as strided-batched cublasSgemm calls.
//
// Arithmetic the verifier assumes (verify/model/kernels.py, the CUDA model): FP32 dot products in
// any summation order and blocking cuBLAS picks (CUBLAS_DEFAULT_MATH: no tensor-core rounding of
// operands), or under --precision tf32 TF32-rounded operands (the verifier's --precision tf32
// bounds); alpha (the scale of dQ, dK) applied to the finished sum, one rounding. Under bf16/fp16
// (HalfGemm): the operands' half values exactly, products exact and summed in float32 in any order
// (CUBLAS_COMPUTE_32F), alpha applied in float32; the caller rounds the result to the format.
#include "gemm.cuh"

#include "cuda_check.cuh"
#include "half.cuh"

namespace attnstep {

void set_gemm_precision(cublasHandle_t blas, Precision precision) {
    CUBLAS_CHECK(cublasSetMathMode(
        blas, precision == Precision::tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
}

namespace {

// One strided-batched product in cuBLAS's column-major terms (X = the cuBLAS A operand, Y = its B):
// SGEMM, or with `half` the operands converted to bf16/fp16 first and cublasGemmStridedBatchedEx.
struct Batched {
    cublasOperation_t op_x, op_y;
    int m, n, k;
    const float *x, *y;
    int ldx, ldy;
    long long stride_x, stride_y;
    float* c;
    int ldc;
    long long stride_c;
};

void run_batched(cublasHandle_t blas, int heads, float alpha, const Batched& g, const HalfGemm& half) {
    const float zero = 0.f;
    if (!half.on()) {
        CUBLAS_CHECK(cublasSgemmStridedBatched(blas, g.op_x, g.op_y, g.m, g.n, g.k, &alpha, g.x, g.ldx, g.stride_x,
                                               g.y, g.ldy, g.stride_y, &zero, g.c, g.ldc, g.stride_c, heads));
        return;
    }
    cudaStream_t stream = nullptr;
    CUBLAS_CHECK(cublasGetStream(blas, &stream));
    // x is the product's second operand (half.b), y its first (half.a): see gemm_abt and the rest.
    launch_to_half(g.x, half.b, static_cast<size_t>(g.stride_x) * heads, half.precision, stream);
    launch_to_half(g.y, half.a, static_cast<size_t>(g.stride_y) * heads, half.precision, stream);
    const cudaDataType t = half_data_type(half.precision);
    CUBLAS_CHECK(cublasGemmStridedBatchedEx(blas, g.op_x, g.op_y, g.m, g.n, g.k, &alpha, half.b, t, g.ldx, g.stride_x,
                                            half.a, t, g.ldy, g.stride_y, &zero, g.c, CUDA_R_32F, g.ldc, g.stride_c,
                                            heads, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// cuBLAS is column-major, and a row-major X[r][c] is the column-major Xᵀ (c×r, leading dimension
// c). Every product below is therefore computed as its transpose, which needs no copy: the
// column-major Cᵀ (cols×rows, ldc = cols) of the row-major C[rows][cols].

// C[rows][cols] = A[rows][k] · B[cols][k]ᵀ: Cᵀ = B · Aᵀ, with B's storage read column-major as
// k×cols (lda = k) and taken transposed, A's as k×rows (ldb = k) taken as is.
void gemm_abt(cublasHandle_t blas, int heads, int rows, int cols, int k, const float* A, const float* B, float* C,
              const HalfGemm& half) {
    run_batched(blas, heads, 1.f,
                {CUBLAS_OP_T, CUBLAS_OP_N, /*m=*/cols, /*n=*/rows, /*k=*/k, B, A, /*lda=*/k, /*ldb=*/k,
                 /*strideA=*/static_cast<long long>(cols) * k, /*strideB=*/static_cast<long long>(rows) * k,
                 C, /*ldc=*/cols, /*strideC=*/static_cast<long long>(rows) * cols},
                half);
}

// C[rows][cols] = alpha · A[rows][k] · B[k][cols]: Cᵀ = Bᵀ · Aᵀ, both storages read column-major
// as they are (cols×k, lda = cols; k×rows, ldb = k); no transposes.
void gemm_ab(cublasHandle_t blas, int heads, int rows, int cols, int k, float alpha, const float* A, const float* B,
             float* C, const HalfGemm& half) {
    run_batched(blas, heads, alpha,
                {CUBLAS_OP_N, CUBLAS_OP_N, /*m=*/cols, /*n=*/rows, /*k=*/k, B, A, /*lda=*/cols, /*ldb=*/k,
                 /*strideA=*/static_cast<long long>(k) * cols, /*strideB=*/static_cast<long long>(rows) * k,
                 C, /*ldc=*/cols, /*strideC=*/static_cast<long long>(rows) * cols},
                half);
}

// C[rows][cols] = alpha · A[k][rows]ᵀ · B[k][cols]: Cᵀ = Bᵀ · A, B's storage read column-major as
// cols×k (lda = cols) as is, A's as rows×k (ldb = rows) taken transposed.
void gemm_atb(cublasHandle_t blas, int heads, int rows, int cols, int k, float alpha, const float* A, const float* B,
              float* C, const HalfGemm& half) {
    run_batched(blas, heads, alpha,
                {CUBLAS_OP_N, CUBLAS_OP_T, /*m=*/cols, /*n=*/rows, /*k=*/k, B, A, /*lda=*/cols, /*ldb=*/rows,
                 /*strideA=*/static_cast<long long>(k) * cols, /*strideB=*/static_cast<long long>(k) * rows,
                 C, /*ldc=*/cols, /*strideC=*/static_cast<long long>(rows) * cols},
                half);
}

}  // namespace

void gemm_qk(cublasHandle_t blas, const Dims& d, int heads, const float* Q, const float* K, float* QK,
             const HalfGemm& half) {
    gemm_abt(blas, heads, d.N, d.M, d.dk, Q, K, QK, half);
}

void gemm_output(cublasHandle_t blas, const Dims& d, int heads, const float* P, const float* V, float* O,
             const HalfGemm& half) {
    gemm_ab(blas, heads, d.N, d.dv, d.M, 1.f, P, V, O, half);
}

void gemm_dp(cublasHandle_t blas, const Dims& d, int heads, const float* dO, const float* V, float* dP,
             const HalfGemm& half) {
    gemm_abt(blas, heads, d.N, d.M, d.dv, dO, V, dP, half);
}

void gemm_dq(cublasHandle_t blas, const Dims& d, int heads, float scale, const float* dS, const float* K, float* dQ,
             const HalfGemm& half) {
    gemm_ab(blas, heads, d.N, d.dk, d.M, scale, dS, K, dQ, half);
}

void gemm_dk(cublasHandle_t blas, const Dims& d, int heads, float scale, const float* dS, const float* Q, float* dK,
             const HalfGemm& half) {
    gemm_atb(blas, heads, d.M, d.dk, d.N, scale, dS, Q, dK, half);
}

void gemm_dv(cublasHandle_t blas, const Dims& d, int heads, const float* P, const float* dO, float* dV,
             const HalfGemm& half) {
    gemm_atb(blas, heads, d.M, d.dv, d.N, 1.f, P, dO, dV, half);
}

}  // namespace attnstep
