// decode.cuh — the split-KV decode kernel (flash-decoding): attention of packed queries against
// keys that lie packed or in a paged cache, the keys of each sequence cut into splits of
// split_size keys that separate blocks compute, then a combine (none for one split without its
// stages: the blocks store the output themselves, as flash-attn's one split does). Made for few
// queries per sequence (a decode step: 1 to 64), where the work is reading the cache once;
// correct for any.
//
// Grouped K/V heads: one block reads a K/V page once for every query head of its group (and every
// query of its sequence), so a cache is read once per step whatever H / Hk is.
//
// All pointers are device memory. Layouts (row-major):
//   Q      [heads][total_q][d]                     the packed queries of every sequence
//   K, V   [kv_heads][key_rows][d], kv_stride apart the packed keys, or the pool of pages
//   O_part [splits][heads][total_q][d], lse_part [splits][heads][total_q]: split s of a row, its
//          output normalised by the split's own sum and its log-sum-exp (−inf and 0 where the row
//          sees no key of the split): the split stages
//   O      [heads][total_q][d] (rounded to the format at bf16/fp16), lse [heads][total_q]: the
//          combine of the splits, as flash_dispatch.cu's split combine computes it.
// Arithmetic (verify/model/kernels.py `cuda-decode-*`): float32 dot products (fp32 on the CUDA
// cores; bf16/fp16 on tensor cores, mma.sync with float32 accumulation), s = q·k·scale, the
// softcap's tanhf, ALiBi, expf(s − max) with one rescale per chunk of keys, the split's 1/l,
// lse = max + logf(l).
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "../backend.h"

namespace attnstep {

struct DecodeArgs {
    Precision precision = Precision::fp32;
    int heads = 0, kv_heads = 0, d = 0;  // query heads of the launch; heads % kv_heads == 0
    float scale = 0.f;
    // The sequences: query rows [cu_q[b], cu_q[b+1]) of every head, the first seqlen_k[b] keys of
    // sequence b; key j at row k_begin[b] + j (packed), or, with page_size > 0, at row
    // block_table[b·table_stride + j / page_size]·page_size + j % page_size of the pool.
    int batch = 0, total_q = 0, max_q = 0, max_k = 0;
    const int* cu_q = nullptr;
    const int* seqlen_k = nullptr;
    const int* k_begin = nullptr;
    const int* block_table = nullptr;
    int table_stride = 0, page_size = 0;
    // The variant within each sequence of n queries and m keys: the mask rule's offset is
    // m − n (bottom-right) or 0, left/right the window (kUnbounded: none), softcap C > 0, ALiBi
    // slopes one per query head of the launch (null: none).
    bool bottom_right = false;
    int left = kUnbounded, right = kUnbounded;
    float softcap = 0.f;
    const float* slopes = nullptr;
    // Inputs: float32 at fp32 and tf32, the 16-bit format's bits at bf16 and fp16; 16-byte aligned.
    const void* Q = nullptr;
    const void* K = nullptr;
    const void* V = nullptr;
    long long kv_stride = 0;  // elements from one K/V head to the next
    int split_size = 0, splits = 1;
    float* O_part = nullptr;
    float* lse_part = nullptr;
    float* O = nullptr;
    float* lse = nullptr;
    // Set by decode_forward alone (a caller's value is ignored): one split has every key and no
    // split stage is asked for, so O_part and lse_part are O and lse, the blocks' outputs rounded
    // to the format as the combine would round them (its weights are 1 then), and the combine is
    // not launched.
    bool combined = false;
    // Optional: the split stages in their stage layout (split_O [heads][total_q][splits·d],
    // split_lse [heads][total_q][splits]), copied from O_part and lse_part.
    float* split_O = nullptr;
    float* split_lse = nullptr;
};

// Whether the kernel has an instantiation for this width (kFlashHeadDims).
bool decode_supported(int d);

// The split size the kernel would pick for a launch without one: enough blocks to fill the GPU's
// resident slots once, splits of at least 256 keys.
int decode_default_split_size(const DecodeArgs& a);

// The fewest rows a block's tile has.
inline constexpr int kDecodeMinTileRows = 4;

// Whether a launch's grid holds its blocks: batch × tiles × splits × kv_heads in one dimension (at
// most INT_MAX), tiles = ceil(group_rows / tile_rows) for the group_rows query rows of a sequence's
// K/V head (group · max_q).
inline bool decode_grid_fits(long long batch, long long group_rows, int tile_rows, long long splits,
                             long long kv_heads) {
    const long long tiles = (group_rows + tile_rows - 1) / tile_rows;
    return static_cast<double>(batch) * static_cast<double>(tiles) * static_cast<double>(splits) *
               static_cast<double>(kv_heads) <= INT_MAX;
}

// The rows of a block's tile and the keys of a warp's chunk (run.toml's flash tiles).
int decode_tile_rows(Precision p);
int decode_chunk_keys(Precision p, int d);

// The kernel's name for run.toml ("cuda-decode-bf16", ...).
const char* decode_kernel_name(Precision p);

// Launches the split kernel on `stream`, then the split stages' layout copy where they are asked
// for and the combine where there are several splits or those stages; checks the launches.
void decode_forward(const DecodeArgs& a, cudaStream_t stream);

}  // namespace attnstep
