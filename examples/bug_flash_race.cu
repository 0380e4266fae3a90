// bug_flash_race.cu: a FlashAttention forward with a shared-memory race between warps.
//
// BUG (racy_flash_kernel, below): the key loop loads a K/V tile into shared memory, waits for it
// (__syncthreads), folds it into each thread's query row, and loads the next tile into the same
// shared arrays without waiting for the other warps to finish reading. A warp with less work
// overwrites the tile while the others still read it. With --causal that happens on almost every
// run: a warp whose rows all lie before a key tile skips that tile and races ahead, so the rows of
// the next warp fold in keys of the following tile. Without a mask the warps of a block run nearly
// in step and the race seldom shows. Every other step is the correct one (seed_steps.cuh).
//
// Build:  cmake --build build --target bug_flash_race
// Run:    python3 -m verify generate --heads 3 --seq-q 100 --seq-k 140 --d-k 64 --d-v 64 --causal
//         cd build && ./bug_flash_race random_test && cd ..
//         python3 -m verify check --causal
// attnstep reports: first failing stage flash_output (rows 32..63 of each 64-row block, and so
// on); the stage path passes. Rerun it: the failing elements change from run to run.
#include "seed_steps.cuh"

using namespace seed;

template <int D>
__global__ void racy_flash_kernel(const float* Q, const float* K, const float* V, float* O, float* lse, int N,
                                  int M, float scale, bool causal) {
  __shared__ float Ks[FLASH_BC * D], Vs[FLASH_BC * D];
  const int row = blockIdx.x * FLASH_BR + threadIdx.x;
  FlashRow<D> st;
  if (row < N) st.load_query(Q, row, scale);
  for (int k0 = 0; k0 < M; k0 += FLASH_BC) {
    load_kv_tile<D>(Ks, Vs, K, V, k0, M);
    __syncthreads();
    if (row < N && !(causal && k0 > row)) st.update(Ks, Vs, k0, row, M, causal);
    // BUG: a __syncthreads() is missing here, before the next iteration's load overwrites Ks, Vs.
  }
  if (row < N) {
    st.store_output(O, row);
    lse[row] = st.lse();
  }
}

void racy_flash(const float* Q, const float* K, const float* V, float* O, float* lse, int N, int M, int d,
                float scale, bool causal) {
  with_head_dim(d, [&](auto dc) {
    constexpr int D = decltype(dc)::value;
    racy_flash_kernel<D><<<(N + FLASH_BR - 1) / FLASH_BR, FLASH_BR>>>(Q, K, V, O, lse, N, M, scale, causal);
  });
}

int main(int argc, char** argv) {
  Steps steps;
  steps.flash = racy_flash;
  return run(argc, argv, steps);
}
