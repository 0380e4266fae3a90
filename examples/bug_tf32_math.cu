// bug_tf32_math.cu: QK computed by cuBLAS in TF32 tensor-core mode, checked as float32 attention.
//
// BUG (qk_in_tf32, below): the handle's math mode is CUBLAS_TF32_TENSOR_OP_MATH for the QK GEMM, so
// Q and Kᵀ are rounded to TF32 (10 mantissa bits) before they are multiplied: errors of about
// 2^-11 per product where float32 arithmetic allows 2^-24. PyTorch does the same to every float32
// matmul after torch.backends.cuda.matmul.allow_tf32 = True or
// torch.set_float32_matmul_precision("high"), and cuBLAS with CUBLAS_DEFAULT_MATH on some paths
// (cublasLt, CUBLAS_COMPUTE_32F_FAST_TF32): the most common "my kernel is slightly off". The
// values are fine for a TF32 program; checked as float32 they are not.
//
// Build:  cmake --build build --target bug_tf32_math
// Run:    python3 -m verify generate --heads 3 --seq-q 100 --seq-k 140 --d-k 64 --d-v 64
//         cd build && ./bug_tf32_math random_test && cd ..
//         python3 -m verify check                      # QK fails: tf32
//         python3 -m verify check --precision tf32     # every stage passes
// attnstep reports: first failing stage QK, diagnosis tf32 (it passes under --precision tf32).
#include "seed_steps.cuh"

using namespace seed;

void qk_in_tf32(cublasHandle_t handle, const float* Q, const float* KT, float* S, int N, int M, int d) {
  CUBLAS_CHECK(cublasSetMathMode(handle, CUBLAS_TF32_TENSOR_OP_MATH));  // BUG: TF32 operands
  qk_gemm(handle, Q, KT, S, N, M, d);
  CUBLAS_CHECK(cublasSetMathMode(handle, CUBLAS_DEFAULT_MATH));
}

int main(int argc, char** argv) {
  Steps steps;
  steps.qk = qk_in_tf32;
  return run(argc, argv, steps);
}
