// bug_missing_scale.cu: attention that never multiplies the scores by 1/√d_k.
//
// BUG (mask_kernel, below): the kernel that should write QK_scaled = QK · scale (and -inf above
// the diagonal when causal) applies the mask and copies QK unscaled. The softmax then sees logits
// √d_k times too large. The flash kernel scales correctly (seed_steps.cuh).
//
// Build:  cmake --build build --target bug_missing_scale
// Run:    python3 -m verify generate --heads 3 --seq-q 100 --seq-k 140 --d-k 64 --d-v 64
//         cd build && ./bug_missing_scale random_test && cd ..
//         python3 -m verify check
// attnstep reports: first failing stage QK_scaled, diagnosis `scaled` (got ≈ 8·want = 1/scale:
// scale missing); attention_weights and output inherit it.
#include "seed_steps.cuh"

__global__ void mask_kernel(const float* S, float* out, int N, int M, float scale, bool causal) {
  int r = blockIdx.y * blockDim.y + threadIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= N || c >= M) return;
  out[(size_t)r * M + c] = (causal && c > r) ? -INFINITY : S[(size_t)r * M + c];  // BUG: no * scale
}

void mask_only(const float* S, float* out, int N, int M, float scale, bool causal) {
  mask_kernel<<<seed::grid_2d(N, M), dim3(seed::TILE, seed::TILE)>>>(S, out, N, M, scale, causal);
}

int main(int argc, char** argv) {
  seed::Steps steps;
  steps.scale_mask = mask_only;
  return seed::run(argc, argv, steps);
}
