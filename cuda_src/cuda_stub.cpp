// cuda_stub.cpp — what the CPU-only build (no CUDA toolkit, or -DATTNSTEP_CUDA=OFF) links in
// place of cuda/backend_cuda.cu and cuda/bench.cu; CMake compiles it only for that build.
#include "backend.h"
#include "bench.h"
#include "common.h"

namespace attnstep {

bool cuda_backend_built() { return false; }
bool cuda_device_available() { return false; }
std::unique_ptr<Backend> make_cuda_backend() {
    fail(kExitBadInput, "--backend cuda: this binary was built without CUDA",
         "install the CUDA toolkit and rebuild (cmake -S . -B build), or use --backend cpu");
}

int run_bench(int, char**) {
    fail(kExitBadInput, "--bench: bench needs a CUDA build and a GPU",
         "build with the CUDA toolkit (cmake -S . -B build) and run on a machine with a GPU");
}

}  // namespace attnstep
