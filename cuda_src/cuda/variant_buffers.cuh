// variant_buffers.cuh — what the CUDA backend keeps on the device for a case's variant (variant.h):
// the group's mask and bias files and ALiBi slopes, and the stage path's scratch matrix (the
// dropped weights, or dS through the softcap's derivative, which the GEMMs read). Both are carved
// from the backend's arena after the stage buffers (backend_cuda.cu); variant_buffers.cu uploads.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "../backend.h"
#include "device_variant.cuh"

namespace attnstep {

// The floats of each part for a group of `heads` (0: not needed).
struct VariantLayout {
    size_t mask = 0, bias = 0, slopes = 0, scratch = 0;
};
VariantLayout variant_layout(const Problem& p, StageSet computed, int heads);

// Device bytes per head for variant_layout's parts, each with room for its alignment (a broadcast
// file counts once per head: an over-estimate).
size_t variant_bytes_per_head(const Problem& p, StageSet computed, size_t align);

// Where the parts lie in device memory.
struct VariantBuffers {
    float* mask = nullptr;
    float* bias = nullptr;
    float* slopes = nullptr;
    float* scratch = nullptr;
};

// Copies the group's mask and bias files and ALiBi slopes (main.cpp hands them per group) into
// `at` on `stream` and returns the group's device variant, its pointers set.
DeviceVariant upload_variant_inputs(const Problem& p, const HeadGroup& g, const VariantBuffers& at, cudaStream_t stream);

}  // namespace attnstep
