// device.cu — device.cuh's questions to the runtime.
#include "device.cuh"

#include <algorithm>

#include "cuda_check.cuh"

namespace attnstep {

namespace {

int device_attribute(cudaDeviceAttr attr) {
    int dev = 0, value = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&value, attr, dev));
    return value;
}

}  // namespace

int device_sm_count() {
    static const int count = device_attribute(cudaDevAttrMultiProcessorCount);
    return count;
}

int device_compute_capability() {
    static const int cc = 10 * device_attribute(cudaDevAttrComputeCapabilityMajor) +
                          device_attribute(cudaDevAttrComputeCapabilityMinor);
    return cc;
}

int prepare_kernel(const void* kernel, int threads, size_t smem_bytes) {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(smem_bytes)));
    int blocks = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem_bytes));
    return std::max(blocks, 1);
}

}  // namespace attnstep
