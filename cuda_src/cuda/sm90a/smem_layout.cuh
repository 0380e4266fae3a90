// smem_layout.cuh — the shared-memory layout flash_wgmma.cu gives its TF32 operand parts: K-major
// without swizzle, in "core matrices" of 8 rows × 16 bytes (128 contiguous bytes), as wgmma.cuh's
// make_desc reads them. E is the element type, 4 floats to a 16-byte core-matrix row, so one TF32
// k step (8 columns) spans two core matrices along K. (The half-precision kernel's tiles lie in the
// 128-byte swizzle its tensor copies write: tensor_map.cuh.)
#pragma once

#include <cstdint>

#include "wgmma.cuh"

namespace attnstep {
namespace wg {

// Elements in one 16-byte row of a core matrix.
template <class E>
constexpr int kCoreCols = 16 / static_cast<int>(sizeof(E));

// Element offset of element (r, c) of an R-row tile: core matrix (r/8, c/kCoreCols) is 128
// contiguous bytes (8 rows of 16 bytes); core matrices adjacent in r are 128 B apart (the
// descriptor's SBO), adjacent in c R·16 B apart (its LBO).
template <int R, class E>
__device__ __forceinline__ int cm_offset(int r, int c) {
    constexpr int kC = kCoreCols<E>;
    return (c / kC) * (R * kC) + (r / 8) * (8 * kC) + (r % 8) * kC + (c % kC);
}

// Descriptor of the first k step of an R-row tile; desc_at moves it on.
template <int R>
__device__ __forceinline__ uint64_t tile_desc(const void* tile) {
    return make_desc(tile, R * 16, 128);
}

// The descriptor `elems` elements of type E further on in shared memory: its address field (bits
// 0-13, 16-byte units) plus the offset. Shared addresses stay below 2^18 bytes, so the field
// cannot carry into the next one; adding constants to one base descriptor saves the per-wgmma
// address arithmetic. Every offset used is a whole number of 16-byte units.
template <class E>
__device__ __forceinline__ uint64_t desc_at(uint64_t desc, int elems) {
    return desc + static_cast<uint64_t>(elems / kCoreCols<E>);
}

// Elements from one k step of an R-row tile to the next (two core matrices along K).
template <int R, class E>
constexpr int kStep = 2 * R * kCoreCols<E>;

// Chunk i of an R×C tile, 16 bytes each, in the order that keeps both sides fast: 8 consecutive
// threads take the 8 rows of one core matrix (128 contiguous bytes of shared memory), and a warp
// covers 4 core matrices along c (64 contiguous bytes of each of 8 global rows).
template <int C, class E>
__device__ __forceinline__ void chunk_coords(int i, int& r, int& c) {
    constexpr int kC = kCoreCols<E>;
    const int rest = i / 8;
    r = (rest / (C / kC)) * 8 + i % 8;
    c = (rest % (C / kC)) * kC;
}

}  // namespace wg
}  // namespace attnstep
