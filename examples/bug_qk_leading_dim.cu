// bug_qk_leading_dim.cu: attention whose QK GEMM hands cuBLAS the wrong operand layout.
//
// BUG (qk_gemm_transposed_again, below): KT is already Kᵀ, row-major d×M, which cuBLAS must see as
// the column-major M×d matrix K (CUBLAS_OP_N, lda = M). Remembering "cuBLAS is column-major, so
// transpose", this version adds CUBLAS_OP_T with lda = d: cuBLAS then reads the buffer as a
// column-major d×M matrix, i.e. as if it held K itself, and QK = Q · (Kᵀ reshaped to M×d)ᵀ.
// Every other step is the correct one (seed_steps.cuh).
//
// Build:  cmake --build build --target bug_qk_leading_dim
// Run:    python3 -m verify generate --heads 3 --seq-q 100 --seq-k 140 --d-k 64 --d-v 64
//         cd build && ./bug_qk_leading_dim random_test && cd ..
//         python3 -m verify check
// attnstep reports: first failing stage QK, diagnosis `layout` (operand K read as if it held its
// transpose); QK_scaled .. output inherit the error; the flash stages pass.
#include "seed_steps.cuh"

void qk_gemm_transposed_again(cublasHandle_t handle, const float* Q, const float* KT, float* S, int N, int M,
                              int d) {
  const float one = 1.f, zero = 0.f;
  // BUG: should be CUBLAS_OP_N with lda = M.
  CUBLAS_CHECK(cublasSgemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, M, N, d, &one, KT, d, Q, d, &zero, S, M));
}

int main(int argc, char** argv) {
  seed::Steps steps;
  steps.qk = qk_gemm_transposed_again;
  return seed::run(argc, argv, steps);
}
