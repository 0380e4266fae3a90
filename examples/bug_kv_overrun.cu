// bug_kv_overrun.cu: a FlashAttention forward that reads past the end of K and V, with right values.
//
// BUG (load_kv_tile_unguarded, below): the last key tile is loaded whole, FLASH_BC keys, even when
// fewer than FLASH_BC keys are left (M not a multiple of the tile): the loads run past the end of
// K and V. The scores of those keys are masked out afterwards (update() skips keys past M), so the
// output is right and every stage passes: the values cannot show this bug, as llm.c's
// attention_forward version 2 passed with 30 out-of-bounds reads. compute-sanitizer's memcheck
// finds it (`attnstep run --sanitize memcheck`), naming the function and line of the read.
//
// Build:  cmake --build build --target bug_kv_overrun
// Run:    python3 -m verify generate --heads 3 --seq-q 100 --seq-k 140 --d-k 64 --d-v 64
//         python3 -m verify run --binary build/bug_kv_overrun --cwd build --sanitize memcheck -- random_test
//         python3 -m verify check
// attnstep reports: every stage passes its bounds, memcheck fails: Invalid __global__ read in
// load_kv_tile_unguarded (bug_kv_overrun.cu, the line marked BUG).
#include "seed_steps.cuh"

using namespace seed;

template <int D>
__device__ void load_kv_tile_unguarded(float* Ks, float* Vs, const float* K, const float* V, int k0) {
  for (int e = threadIdx.x; e < FLASH_BC * D; e += blockDim.x) {
    const size_t at = (size_t)(k0 + e / D) * D + e % D;
    Ks[e] = K[at];  // BUG: no `key < M` guard: the last tile reads past the end of K and V
    Vs[e] = V[at];
  }
}

template <int D>
__global__ void overrun_flash_kernel(const float* Q, const float* K, const float* V, float* O, float* lse, int N,
                                     int M, float scale, bool causal) {
  __shared__ float Ks[FLASH_BC * D], Vs[FLASH_BC * D];
  const int row = blockIdx.x * FLASH_BR + threadIdx.x;
  FlashRow<D> st;
  if (row < N) st.load_query(Q, row, scale);
  for (int k0 = 0; k0 < M; k0 += FLASH_BC) {
    load_kv_tile_unguarded<D>(Ks, Vs, K, V, k0);
    __syncthreads();  // the tile is complete before anyone reads it
    if (row < N && !(causal && k0 > row)) st.update(Ks, Vs, k0, row, M, causal);
    __syncthreads();  // nobody reads the tile any more when the next load overwrites it
  }
  if (row < N) {
    st.store_output(O, row);
    lse[row] = st.lse();
  }
}

void overrun_flash(const float* Q, const float* K, const float* V, float* O, float* lse, int N, int M, int d,
                   float scale, bool causal) {
  with_head_dim(d, [&](auto dc) {
    constexpr int D = decltype(dc)::value;
    overrun_flash_kernel<D><<<(N + FLASH_BR - 1) / FLASH_BR, FLASH_BR>>>(Q, K, V, O, lse, N, M, scale, causal);
  });
}

int main(int argc, char** argv) {
  Steps steps;
  steps.flash = overrun_flash;
  return run(argc, argv, steps);
}
