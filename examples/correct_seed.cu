// correct_seed.cu: multi-head attention, stage by stage, with no bug: the reference the other
// examples are compared with.
//
// Computes, per head, KT, QK = Q·Kᵀ (cuBLAS), QK_scaled (·1/√d_k, -inf above the diagonal when
// causal), attention_weights (row softmax), output (cuBLAS), and a tiled FlashAttention forward
// (flash_output, flash_lse in natural log). The steps are in seed_steps.cuh, the file reading and
// writing in seed_io.h; every buggy example swaps exactly one step for its own version.
//
// Build:  cmake --build build --target correct_seed     (or: --target examples, for all of them)
//    or:  nvcc -O2 -std=c++17 -arch=sm_90 examples/correct_seed.cu -lcublas -o build/correct_seed
// Run:    python3 -m verify generate --heads 3 --seq-q 100 --seq-k 140 --d-k 64 --d-v 64
//         cd build && ./correct_seed random_test && cd ..
//         python3 -m verify check
// Causal: generate with --causal (the program reads `causal` from the manifest, or pass it
// --causal) and check with --causal.
// attnstep reports: every stage passes (exit 0).
#include "seed_steps.cuh"

int main(int argc, char** argv) { return seed::run(argc, argv, seed::Steps{}); }
