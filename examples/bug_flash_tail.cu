// bug_flash_tail.cu: a FlashAttention forward that drops the last, partial block of query rows.
//
// BUG (flash_full_blocks, below): the grid has N / FLASH_BR blocks, rounded down, so when N is
// not a multiple of the 64-row block the rows past the last full block are never computed and
// keep the zeros the output buffers were cleared to (N = 100: rows 64..99). It passes every test
// whose N is a multiple of 64. The kernel itself is the correct one (seed_steps.cuh).
//
// Build:  cmake --build build --target bug_flash_tail
// Run:    python3 -m verify generate --heads 3 --seq-q 100 --seq-k 140 --d-k 64 --d-v 64
//         cd build && ./bug_flash_tail random_test && cd ..
//         python3 -m verify check
// attnstep reports: first failing stage flash_output, diagnosis `unwritten` (rows 64..99 hold
// zeros); flash_lse fails the same way; the stage path passes.
#include "seed_steps.cuh"

using namespace seed;

void flash_full_blocks(const float* Q, const float* K, const float* V, float* O, float* lse, int N, int M,
                       int d, float scale, bool causal) {
  with_head_dim(d, [&](auto dc) {
    constexpr int D = decltype(dc)::value;
    const int blocks = N / FLASH_BR;  // BUG: should round up, (N + FLASH_BR - 1) / FLASH_BR
    flash_forward_kernel<D><<<blocks, FLASH_BR>>>(Q, K, V, O, lse, N, M, scale, causal);
  });
}

int main(int argc, char** argv) {
  Steps steps;
  steps.flash = flash_full_blocks;
  return run(argc, argv, steps);
}
