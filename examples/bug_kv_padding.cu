// bug_kv_padding.cu: a FlashAttention forward that reads uninitialised memory, with right values.
//
// BUG (padded_flash, below): K and V are copied into buffers padded to whole key tiles, so that
// the kernel can load every tile without a bounds check; the padding is never written. The last
// tile's loads read those uninitialised rows. Their scores are masked out afterwards (update()
// skips keys past M), so the output is right and every stage passes: the values cannot show this
// bug, which turns into wrong results as soon as the mask changes or the garbage holds a NaN
// (0 * NaN). compute-sanitizer's initcheck finds it (`attnstep run --sanitize initcheck`), naming
// the function and line of the read.
//
// Build:  cmake --build build --target bug_kv_padding
// Run:    python3 -m verify generate --heads 3 --seq-q 100 --seq-k 140 --d-k 64 --d-v 64
//         python3 -m verify run --binary build/bug_kv_padding --cwd build --sanitize initcheck -- random_test
//         python3 -m verify check
// attnstep reports: every stage passes its bounds, initcheck fails: uninitialised global memory
// read in load_padded_tile (this file, the line marked BUG).
#include "seed_steps.cuh"

using namespace seed;

template <int D>
__device__ void load_padded_tile(float* Ks, float* Vs, const float* K, const float* V, int k0) {
  for (int e = threadIdx.x; e < FLASH_BC * D; e += blockDim.x) {
    const size_t at = (size_t)(k0 + e / D) * D + e % D;
    Ks[e] = K[at];  // BUG: past key M-1 this reads the padding, which nothing ever wrote
    Vs[e] = V[at];
  }
}

template <int D>
__global__ void padded_flash_kernel(const float* Q, const float* K, const float* V, float* O, float* lse, int N,
                                    int M, float scale, bool causal) {
  __shared__ float Ks[FLASH_BC * D], Vs[FLASH_BC * D];
  const int row = blockIdx.x * FLASH_BR + threadIdx.x;
  FlashRow<D> st;
  if (row < N) st.load_query(Q, row, scale);
  for (int k0 = 0; k0 < M; k0 += FLASH_BC) {
    load_padded_tile<D>(Ks, Vs, K, V, k0);
    __syncthreads();  // the tile is complete before anyone reads it
    if (row < N && !(causal && k0 > row)) st.update(Ks, Vs, k0, row, M, causal);
    __syncthreads();  // nobody reads the tile any more when the next load overwrites it
  }
  if (row < N) {
    st.store_output(O, row);
    lse[row] = st.lse();
  }
}

void padded_flash(const float* Q, const float* K, const float* V, float* O, float* lse, int N, int M, int d,
                  float scale, bool causal) {
  const int padded = (M + FLASH_BC - 1) / FLASH_BC * FLASH_BC;
  DeviceMatrix Kp(padded, d), Vp(padded, d);  // whole tiles; rows M.. are left as they come
  CUDA_CHECK(cudaMemcpy(Kp.ptr, K, sizeof(float) * M * d, cudaMemcpyDeviceToDevice));
  CUDA_CHECK(cudaMemcpy(Vp.ptr, V, sizeof(float) * M * d, cudaMemcpyDeviceToDevice));
  with_head_dim(d, [&](auto dc) {
    constexpr int D = decltype(dc)::value;
    padded_flash_kernel<D><<<(N + FLASH_BR - 1) / FLASH_BR, FLASH_BR>>>(Q, Kp.ptr, Vp.ptr, O, lse, N, M, scale,
                                                                        causal);
  });
  CUDA_CHECK(cudaDeviceSynchronize());  // the padded copies are freed on return
}

int main(int argc, char** argv) {
  Steps steps;
  steps.flash = padded_flash;
  return run(argc, argv, steps);
}
