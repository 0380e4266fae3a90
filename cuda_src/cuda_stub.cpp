// cuda_stub.cpp — what the CPU-only build links in place of cuda/backend_cuda.cu and bench/bench.cu;
// CMake compiles it only for that build: no CUDA toolkit, -DATTNSTEP_CUDA=OFF, or the default
// (AUTO) where nvidia-smi listed no GPU at configure time. Its hints say how to get CUDA.
#include "backend.h"
#include "bench/bench.h"
#include "common.h"

namespace attnstep {

bool cuda_backend_built() { return false; }
bool cuda_device_available() { return false; }
std::unique_ptr<Backend> make_cuda_backend() {
    fail(kExitBadInput, "--backend cuda: this binary was built without CUDA",
         std::string(kHowToBuildCuda) + "; or use --backend cpu");
}

int run_bench(int, char**) {
    fail(kExitBadInput, "--bench: bench needs a CUDA build and a GPU",
         std::string(kHowToBuildCuda) + "; run it on a machine with a GPU");
}

int run_decode_bench(int, char**) {
    fail(kExitBadInput, "--bench-decode: bench needs a CUDA build and a GPU",
         std::string(kHowToBuildCuda) + "; run it on a machine with a GPU");
}

int run_varlen_bench(int, char**) {
    fail(kExitBadInput, "--bench-varlen: bench needs a CUDA build and a GPU",
         std::string(kHowToBuildCuda) + "; run it on a machine with a GPU");
}

}  // namespace attnstep
