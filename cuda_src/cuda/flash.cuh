// flash.cuh — the FlashAttention forward as the CUDA backend and bench call it (flash_dispatch.cu
// picks and launches one of the kernels registered in flash_dispatch.cuh).
// All pointers are device memory; `heads` matrices lie back to back, row-major:
//   Q [heads][N][d], K [heads][M][d], V [heads][M][d] -> O [heads][N][d], lse [heads][N].
// lse[r] = log sum_c exp(s_rc) over the keys row r sees (natural log), s the scores the softmax
// reads (scale·q·k through the variant's softcap, ALiBi and bias: FlashProblem::variant); a row
// that sees no key has O = 0 and lse = -inf.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "../backend.h"
#include "flash_problem.cuh"

namespace attnstep {

struct FlashArgs : FlashProblem {
    float* O = nullptr;
    float* lse = nullptr;
    FlashKernel kernel = FlashKernel::automatic;
    // At bf16/fp16 the same inputs as 16-bit values of the format (bf16/fp16 bits, laid out like Q,
    // K and V, 16-byte aligned): what the half-precision kernel reads, by tensor memory access.
    // Required there (the caller makes them with launch_to_half when the inputs arrive); unused
    // at fp32 and tf32.
    const uint16_t* Qh = nullptr;
    const uint16_t* Kh = nullptr;
    const uint16_t* Vh = nullptr;
};

// Device bytes per head of Qh, Kh and Vh at a half precision (0 at fp32 and tf32), each rounded up
// to 16 bytes.
size_t flash_format_input_bytes_per_head(const FlashArgs& a);

// What flash_forward will run for these arguments: the kernel and its tiles. Throws (exit 2)
// when `kernel` forces a kernel that has no variant for them.
FlashPlan flash_forward_plan(const FlashArgs& a);

// Whether a kernel has a variant for these arguments on this GPU (the half precisions: only the
// wgmma kernel, compute capability 9.0); flash_forward_plan then succeeds.
bool flash_forward_available(const FlashArgs& a);

// Device memory flash_forward allocates per head beyond its arguments (the wgmma kernel's split
// operands), for the backend's memory budget.
size_t flash_workspace_bytes_per_head(const FlashArgs& a);

// Launches the forward pass on `stream`; checks the launch. Requires flash_supported().
void flash_forward(const FlashArgs& a, cudaStream_t stream);

// The split-KV forward (flash-decoding; Problem::split_size): `splits` splits of `split_size` keys,
// split s of row r over the keys [s·split_size, (s+1)·split_size) that r sees. Per head it writes
// split_O [N][splits·d] (split s at columns [s·d, (s+1)·d), normalised by the split's own sum) and
// split_lse [N][splits] (a split that the row sees no key of: output 0, lse −inf), both float32 at
// every precision, then their combine into O and lse as cpu/flash_forward.cpp's combine_row does:
// m = max_s lse_s, lse = m + log(sum_s exp(lse_s − m)), O = sum_s exp(lse_s − lse)·O_s.
struct FlashSplitArgs : FlashArgs {
    int split_size = 0, splits = 0;
    // A packed case (FlashArgs::sequences): whether each sequence's mask diagonal is at key
    // i + m(b) − n(b) (bottom-right) rather than i; its variant's own offset is the totals'.
    bool bottom_right = false;
    float* split_O = nullptr;
    float* split_lse = nullptr;
};
void compute_flash_splits(const FlashSplitArgs& a, cudaStream_t stream);

}  // namespace attnstep
