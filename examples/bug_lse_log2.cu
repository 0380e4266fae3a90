// bug_lse_log2.cu: a FlashAttention forward that writes its log-sum-exp in base 2.
//
// BUG (flash_lse2_kernel, below): the kernel runs its online softmax in base 2 (scores times
// scale·log2 e, exp2f), as FlashAttention does, and writes lse = m + log2(l) without converting
// back to the natural log (· ln 2). flash_lse comes out log2(e) ≈ 1.4427 times too large;
// flash_output is right, so a test of the output alone passes.
//
// Build:  cmake --build build --target bug_lse_log2
// Run:    python3 -m verify generate --heads 3 --seq-q 100 --seq-k 140 --d-k 64 --d-v 64
//         cd build && ./bug_lse_log2 random_test && cd ..
//         python3 -m verify check
// attnstep reports: first failing stage flash_lse, diagnosis `lse_log2`; every other stage passes.
#include "seed_steps.cuh"

using namespace seed;

template <int D>
__global__ void flash_lse2_kernel(const float* Q, const float* K, const float* V, float* O, float* lse, int N,
                                  int M, float scale, bool causal) {
  __shared__ float Ks[FLASH_BC * D], Vs[FLASH_BC * D];
  const int row = blockIdx.x * FLASH_BR + threadIdx.x;
  FlashRow<D> st;
  if (row < N) st.load_query(Q, row, scale);
  flash_key_loop<D>(st, Ks, Vs, K, V, row, N, M, causal);
  if (row < N) {
    st.store_output(O, row);
    lse[row] = st.m + log2f(st.l);  // BUG: base 2; the natural log is (st.m + log2f(st.l)) * LN_2
  }
}

void flash_lse2(const float* Q, const float* K, const float* V, float* O, float* lse, int N, int M, int d,
                float scale, bool causal) {
  with_head_dim(d, [&](auto dc) {
    constexpr int D = decltype(dc)::value;
    flash_lse2_kernel<D><<<(N + FLASH_BR - 1) / FLASH_BR, FLASH_BR>>>(Q, K, V, O, lse, N, M, scale, causal);
  });
}

int main(int argc, char** argv) {
  Steps steps;
  steps.flash = flash_lse2;
  return run(argc, argv, steps);
}
