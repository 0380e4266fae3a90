// cuda_stub.cpp — what a build without the CUDA pieces links instead of them. CMake compiles the
// parts it needs: ATTNSTEP_STUB_BACKEND when the CUDA backend is not built (no toolkit, or
// -DATTNSTEP_CUDA=OFF, or cuda/backend_cuda.cu not there yet), ATTNSTEP_STUB_BENCH when no
// cuda/bench.cu implements run_bench.
#include <cstdio>

#include "backend.h"
#include "bench.h"
#include "common.h"

namespace attnstep {

#ifdef ATTNSTEP_STUB_BACKEND
bool cuda_backend_built() { return false; }
bool cuda_device_available() { return false; }
std::unique_ptr<Backend> make_cuda_backend() {
    fail(kExitBadInput, "--backend cuda: this binary was built without CUDA",
         "install the CUDA toolkit and rebuild (cmake -S . -B build), or use --backend cpu");
}
#endif

#ifdef ATTNSTEP_STUB_BENCH
int run_bench(int, char**) {
    fail(kExitBadInput, "--bench: bench needs a CUDA build and a GPU",
         "build with the CUDA toolkit (cmake -S . -B build) and run on a machine with a GPU");
}
#endif

}  // namespace attnstep
