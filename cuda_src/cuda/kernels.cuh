// kernels.cuh — launchers for the element-wise and row-wise stage kernels (kernels.cu, softmax.cu).
// All pointers are device memory; `heads` matrices lie back to back, row-major. Every launcher
// enqueues on `stream`, checks its launch, and accepts any size >= 1 (odd widths included).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace attnstep {

// out[h] = in[h]ᵀ: in [heads][rows][cols] -> out [heads][cols][rows] (the KT stage).
void launch_transpose(const float* in, float* out, int heads, int rows, int cols,
                      cudaStream_t stream);

// out = in · scale, and -inf where causal-masked (column c > row r within each N×M head):
// the QK_scaled stage. `in` and `out` may be the same buffer.
void launch_scale_mask(const float* in, float* out, int heads, int N, int M, float scale,
                       bool causal, cudaStream_t stream);

// Numerically stable softmax of each of `rows` rows of width M (the attention_weights stage):
// out[r][c] = exp(in[r][c] - max_r) / sum_c exp(in[r][c] - max_r). -inf entries give exactly 0;
// a row that is -inf throughout gives 0 throughout. Correct for any M.
void launch_softmax_rows(const float* in, float* out, long long rows, int M, cudaStream_t stream);

// The backward's row-wise and element-wise stages (backward_kernels.cu).
// out[r] = Σ_c a[r][c]·b[r][c] for each of `rows` rows of width `cols` (the D stage: dO·O per row).
void launch_row_dot(const float* a, const float* b, float* out, long long rows, int cols, cudaStream_t stream);

// dS = P∘(dP − D) per element, exactly +0 where causal-masked (column c > row r within each N×M
// head): the dS stage. D holds one value per row ([heads][N]).
void launch_ds(const float* P, const float* dP, const float* D, float* dS, int heads, int N, int M, bool causal,
               cudaStream_t stream);

// Fills n floats with NaN (all bytes 0xFF) so that elements a stage fails to write show.
void poison_fill(float* p, size_t n, cudaStream_t stream);

}  // namespace attnstep
