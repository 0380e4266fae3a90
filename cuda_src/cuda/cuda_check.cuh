// cuda_check.cuh — one check macro per API, each turning a failure into attnstep::Error with exit
// status 1 (kExitInternal) and the message "<file>:<line>: <call> failed: <error string>".
//   CUDA_CHECK(cudaMalloc(&p, n));        runtime API calls
//   CUBLAS_CHECK(cublasSgemm(...));       cuBLAS calls, errors named by cublasGetStatusName
//   LAUNCH_CHECK(kernel_name);            after every kernel launch: cudaGetLastError()
// Launch errors surface at the launch; errors inside a kernel surface at the next synchronizing
// call, which is itself checked.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <string>

#include "../common.h"

namespace attnstep {

[[noreturn]] inline void cuda_api_failed(const char* call, const char* file, int line,
                                         const char* error_string) {
    fail(kExitInternal, where(file, line) + ": " + call + " failed: " + error_string);
}

inline void cuda_check(cudaError_t err, const char* call, const char* file, int line) {
    if (err != cudaSuccess) {
        cuda_api_failed(call, file, line,
                        (std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err)).c_str());
    }
}

inline void cublas_check(cublasStatus_t status, const char* call, const char* file, int line) {
    if (status != CUBLAS_STATUS_SUCCESS) {
        cuda_api_failed(call, file, line,
                        (std::string(cublasGetStatusName(status)) + ": " +
                         cublasGetStatusString(status)).c_str());
    }
}

}  // namespace attnstep

#define CUDA_CHECK(call) ::attnstep::cuda_check((call), #call, __FILE__, __LINE__)
#define CUBLAS_CHECK(call) ::attnstep::cublas_check((call), #call, __FILE__, __LINE__)
// `kernel` is the launched kernel's name, so the message reads "<file>:<line>: launch of
// softmax_rows failed: ...".
#define LAUNCH_CHECK(kernel) \
    ::attnstep::cuda_check(cudaGetLastError(), "launch of " #kernel, __FILE__, __LINE__)
