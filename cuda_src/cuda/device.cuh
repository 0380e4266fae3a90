// device.cuh — what the kernels' launchers ask of the current GPU, asked once per process.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace attnstep {

// The GPU's multiprocessor count.
int device_sm_count();
// Its compute capability as 10·major + minor (90 for H100 and H200).
int device_compute_capability();

// Raises `kernel`'s dynamic shared-memory limit to smem_bytes (a kernel must opt in above 48 KB)
// and returns how many of its blocks of `threads` fit on one SM (at least 1). Callers keep the
// answer in a static per kernel instantiation.
int prepare_kernel(const void* kernel, int threads, size_t smem_bytes);

// Grid dimensions y and z hold at most this many blocks.
constexpr int kMaxGridYZ = 65535;

}  // namespace attnstep
