// tensor_map.cuh — Hopper's tensor memory access (TMA, cp.async.bulk.tensor, sm_90) as the
// wgmma kernels use it: a tile of rows of 16-bit values, 64 to a row (128 bytes; or of 32-bit
// values, 32 to a row),
// copied from a row-major [heads][rows][d] tensor into shared memory in the 128-byte swizzle that
// wgmma's descriptors read (wgmma.cuh: sw128_desc), its completion counted on an mbarrier
// (bulk_copy.cuh). Rows past the tensor's end land as zeros. The host describes the tensor once
// per launch (a CUtensorMap, passed to the kernel as a __grid_constant__ parameter).
#pragma once

#include <cuda.h>  // CUtensorMap and its enums (types only: the encoder comes from the runtime)
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "../../common.h"
#include "sm90a_asm.cuh"

namespace attnstep {
namespace tma {

// Values per copied row: 128 bytes of 16-bit values, the widest row the 128-byte swizzle takes.
constexpr int kRowValues = 64;

// The tensor [heads][rows][d] of 16-bit values (elem_bytes 2) or 32-bit ones (4) at `base` (16-byte
// aligned, d a multiple of one 128-byte row), copied box_rows rows × 128 bytes at a time (the
// 128-byte swizzle; zeros past the last row). `promotion`: how much L2 fetches around each
// 128-byte row a copy reads.
inline CUtensorMap rows_map(const void* base, int d, int rows, int heads, int box_rows, int elem_bytes = 2,
                            CUtensorMapL2promotion promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_256B) {
    using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
    // The driver's encoder, through the runtime: no link against the driver library.
    static const Encode encode = [] {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050  // the versioned query; the unversioned one is deprecated from 12.5
        const cudaError_t err =
            cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
#else
        const cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &found);
#endif
        if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == nullptr) {
            fail(kExitInternal, "the CUDA driver does not provide cuTensorMapEncodeTiled (tensor memory access)",
                 "update the NVIDIA driver: the Hopper kernels' copies need it");
        }
        return reinterpret_cast<Encode>(fn);
    }();
    const cuuint64_t dims[3] = {static_cast<cuuint64_t>(d), static_cast<cuuint64_t>(rows),
                                static_cast<cuuint64_t>(heads)};
    const cuuint64_t strides[2] = {static_cast<cuuint64_t>(d) * elem_bytes,
                                   static_cast<cuuint64_t>(d) * elem_bytes * rows};  // bytes
    const cuuint32_t box[3] = {static_cast<cuuint32_t>(128 / elem_bytes), static_cast<cuuint32_t>(box_rows), 1};
    const cuuint32_t unit[3] = {1, 1, 1};
    CUtensorMap map;
    const CUresult r = encode(&map, elem_bytes == 4 ? CU_TENSOR_MAP_DATA_TYPE_UINT32 : CU_TENSOR_MAP_DATA_TYPE_UINT16, 3, const_cast<void*>(base), dims, strides, box,
                              unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        fail(kExitInternal, where(__FILE__, __LINE__) + ": cuTensorMapEncodeTiled failed (" + std::to_string(r) +
                                ") for a [" + std::to_string(heads) + "][" + std::to_string(rows) + "][" +
                                std::to_string(d) + "] tensor");
    }
    return map;
}

// Copies rows [row, row + box_rows) × one 128-byte row's columns from `col` (64 16-bit values or
// 32 32-bit ones) of head `head` to `dst` (1024-byte aligned), counted on `bar` (its expect_tx
// announces the box's bytes, rows past the tensor's end included).
__device__ __forceinline__ void load(void* dst, const CUtensorMap* map, int col, int row, int head, uint64_t* bar) {
    ATTNSTEP_SM90A_ASM(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
        "[%5];\n" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(row), "r"(head),
        "r"(static_cast<uint32_t>(__cvta_generic_to_shared(bar)))
        : "memory");
}

// Rows [row, row + R) of a [heads][rows][d] tensor of E values (2 or 4 bytes), every one of its
// kColBlocks column blocks of 128 bytes, into the tile at dst: block b at dst + b·R rows.
template <int R, int kColBlocks, class E>
__device__ __forceinline__ void load_row_blocks(E* dst, const CUtensorMap* map, int row, int head, uint64_t* bar) {
    constexpr int kValues = 128 / sizeof(E);
#pragma unroll
    for (int b = 0; b < kColBlocks; ++b) load(dst + b * R * kValues, map, b * kValues, row, head, bar);
}

}  // namespace tma
}  // namespace attnstep
