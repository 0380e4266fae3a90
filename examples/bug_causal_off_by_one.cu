// bug_causal_off_by_one.cu: a causal mask that lets every query see one key too many.
//
// BUG (scale_mask_off_by_one_kernel, below): query r may see r + 1 keys, c = 0 .. r. The kernel
// counts them as `visible = r + 1` and masks c > visible, a count compared as an index: key
// c = r + 1 stays visible. Only with --causal (or causal = true in the manifest). The flash
// kernel masks correctly (seed_steps.cuh).
//
// Build:  cmake --build build --target bug_causal_off_by_one
// Run:    python3 -m verify generate --heads 3 --seq-q 100 --seq-k 140 --d-k 64 --d-v 64 --causal
//         cd build && ./bug_causal_off_by_one random_test && cd ..
//         python3 -m verify check --causal
// attnstep reports: first failing stage QK_scaled, diagnosis `mask_offset` (shifted by +1);
// attention_weights and output inherit it.
#include "seed_steps.cuh"

__global__ void scale_mask_off_by_one_kernel(const float* S, float* out, int N, int M, float scale,
                                             bool causal) {
  int r = blockIdx.y * blockDim.y + threadIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= N || c >= M) return;
  const int visible = r + 1;  // keys 0 .. r
  // BUG: should be c >= visible.
  out[(size_t)r * M + c] = (causal && c > visible) ? -INFINITY : S[(size_t)r * M + c] * scale;
}

void scale_mask_off_by_one(const float* S, float* out, int N, int M, float scale, bool causal) {
  scale_mask_off_by_one_kernel<<<seed::grid_2d(N, M), dim3(seed::TILE, seed::TILE)>>>(S, out, N, M, scale,
                                                                                       causal);
}

int main(int argc, char** argv) {
  seed::Steps steps;
  steps.scale_mask = scale_mask_off_by_one;
  return seed::run(argc, argv, steps);
}
