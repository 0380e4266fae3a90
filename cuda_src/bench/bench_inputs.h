// bench_inputs.h — the values `main --bench` generates its inputs from, element by element: uniform
// in [-1, 1), a 64-bit mix (splitmix64's finaliser) of the element's index and a seed, so any element
// of any tensor can be recomputed anywhere without the others. Plain C++ (no CUDA header), so that
// verify/bench/accuracy.py's NumPy twin, which gives PyTorch the same inputs, is checked against
// this very file (tests/test_bench_half.py compiles it).
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define ATTNSTEP_HOST_DEVICE __host__ __device__
#else
#define ATTNSTEP_HOST_DEVICE
#endif

namespace attnstep {
namespace bench {

// The tensors --bench fills, in the order of their seeds.
enum class BenchInput { Q = 0, K = 1, V = 2 };

// The fill seed of a forward input for `--seed S`: 3·S + 1, + 2, + 3 for Q, K, V.
ATTNSTEP_HOST_DEVICE constexpr uint64_t input_seed(uint64_t seed, BenchInput which) {
    return 3 * seed + 1 + static_cast<uint64_t>(which);
}

// Element i of the tensor filled from `seed`: k·2^-23 − 1 for a 24-bit k, exact in float32.
ATTNSTEP_HOST_DEVICE inline float uniform_input(uint64_t i, uint64_t seed) {
    uint64_t z = (i + 1) * 0x9E3779B97F4A7C15ull ^ (seed * 0xD1B54A32D192ED03ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return static_cast<float>(static_cast<double>(z >> 40) * (2.0 / 16777216.0) - 1.0);
}

}  // namespace bench
}  // namespace attnstep
