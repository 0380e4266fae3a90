// prepared_stages.cuh — what flash_wgmma.cu's preparation pass (TF32 parts) needs of its stage
// layout: K and Vᵀ laid out in global memory one contiguous stage per key tile, exactly as shared
// memory wants it (so one bulk copy fills a stage), and the way a key kernel gives each thread one
// 16-byte chunk of a tile. E is the stage's element type. (The half-precision kernel needs no
// preparation: tensor copies lay its tiles out.)
#pragma once

#include <cstddef>

#include "smem_layout.cuh"

namespace attnstep {
namespace wg {

// Where key tile j of head h starts in the prepared operands (T::STAGE elements a tile).
template <class T, class E>
__device__ __forceinline__ E* stage_in(E* ops, int h, int j, int Mpad) {
    return ops + (static_cast<size_t>(h) * (Mpad / T::BC) + j) * T::STAGE;
}

// The preparation kernels' block size, and a key kernel's blocks per key tile.
constexpr int kPrepThreads = 256;
template <class T, class E>
constexpr int kPrepBlocksPerTile = T::BC * T::D / kCoreCols<E> / kPrepThreads;

// A key kernel's thread: head h, key tile j, and the tile's row r and column c where its 16 bytes
// start, in chunk_coords order (64 contiguous bytes of each of 8 rows read, 128 contiguous bytes
// written per 8 threads). Grid: x = key tiles × kPrepBlocksPerTile (x holds 2^31 - 1 blocks: every
// M; y would cap the tiles at 65535), y = head.
struct KeyChunk {
    int h, j, r, c;
};
template <class T, class E>
__device__ __forceinline__ KeyChunk key_chunk() {
    constexpr int kBlocksPerTile = kPrepBlocksPerTile<T, E>;
    static_assert(kBlocksPerTile * kPrepThreads == T::BC * T::D / kCoreCols<E>, "whole blocks per key tile");
    KeyChunk k;
    k.h = blockIdx.y;
    k.j = blockIdx.x / kBlocksPerTile;
    chunk_coords<T::D, E>((blockIdx.x % kBlocksPerTile) * kPrepThreads + threadIdx.x, k.r, k.c);
    return k;
}

}  // namespace wg
}  // namespace attnstep
