// decode_tma.cuh — the split-KV decode kernel on Hopper (decode_tma.cu): decode.cu launches it in
// place of its cp.async kernel on compute capability 9.0 where it takes the launch.
#pragma once

#include <cuda_runtime.h>

#include "../decode.cuh"

namespace attnstep {

// Whether the Hopper kernel takes this launch: bf16 or fp16, d 64 or 128, and each warp's chunk of
// keys consecutive rows of the pool (packed keys, or pages of a multiple of the chunk's keys).
bool decode_tma_takes(const DecodeArgs& a);

// Launches the split kernel alone (decode_forward adds the layout copy and the combine where due).
void decode_tma_split(const DecodeArgs& a, cudaStream_t stream);

}  // namespace attnstep
