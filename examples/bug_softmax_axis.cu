// bug_softmax_axis.cu: attention whose softmax normalizes the columns of QK_scaled, not its rows.
//
// BUG (softmax_columns_kernel, below): one thread per column instead of one per row, so each
// column (one key over all queries) sums to 1 where each row (one query over all keys) should.
// The flash kernel normalizes per query row, correctly (seed_steps.cuh).
//
// Build:  cmake --build build --target bug_softmax_axis
// Run:    python3 -m verify generate --heads 3 --seq-q 100 --seq-k 140 --d-k 64 --d-v 64
//         cd build && ./bug_softmax_axis random_test && cd ..
//         python3 -m verify check
// attnstep reports: first failing stage attention_weights, diagnosis `softmax_axis`; output
// inherits it.
#include "seed_steps.cuh"

__global__ void softmax_columns_kernel(const float* S, float* P, int N, int M) {
  int c = blockIdx.x * blockDim.x + threadIdx.x;  // BUG: should be the row r, looping over columns
  if (c >= M) return;
  float mx = -INFINITY, sum = 0.f;
  for (int r = 0; r < N; ++r) mx = fmaxf(mx, S[(size_t)r * M + c]);
  for (int r = 0; r < N; ++r) sum += expf(S[(size_t)r * M + c] - mx);
  for (int r = 0; r < N; ++r) P[(size_t)r * M + c] = expf(S[(size_t)r * M + c] - mx) / sum;
}

void softmax_columns(const float* S, float* P, int N, int M) {
  softmax_columns_kernel<<<(M + 127) / 128, 128>>>(S, P, N, M);
}

int main(int argc, char** argv) {
  seed::Steps steps;
  steps.softmax = softmax_columns;
  return seed::run(argc, argv, steps);
}
