// flash_splits.cu — the CUDA backend's split-KV forward (flash.cuh compute_flash_splits): the heads
// of a group as one sequence each for the decode kernel (decode.cu), which writes the split stages
// in their stage layout and their combine.
#include <cuda_runtime.h>

#include <string>

#include "../common.h"
#include "cuda_check.cuh"
#include "decode.cuh"
#include "flash.cuh"
#include "flash_dispatch.cuh"
#include "half.cuh"

namespace attnstep {

void compute_flash_splits(const FlashSplitArgs& a, cudaStream_t stream) {
    if (a.variant.mask_file || a.variant.bias_file || a.variant.dropout > 0.f)
        fail(kExitBadInput, "--split-size: the CUDA split kernel takes no mask file, bias file or dropout",
             "use --backend cpu, which computes the split stages of every variant");
    if (!decode_supported(a.d))
        fail(kExitBadInput, "--split-size: the CUDA split kernel has no head width " + std::to_string(a.d),
             "its widths are " + flash_head_dims_text() + "; use --backend cpu");
    // The group's heads share one sequence: its queries, its keys at rows 0..M-1.
    const int host_ints[] = {0, a.N, a.M, 0};
    StreamWorkspace ws(4 + static_cast<size_t>(a.splits) * a.heads * a.N * (a.d + 1), stream);
    int* ints = reinterpret_cast<int*>(ws.p);
    CUDA_CHECK(cudaMemcpyAsync(ints, host_ints, sizeof host_ints, cudaMemcpyHostToDevice, stream));
    DecodeArgs d;
    d.precision = a.precision;
    d.heads = d.kv_heads = a.heads;  // the backend hands every query head its own K and V
    d.d = a.d;
    d.scale = a.scale;
    d.batch = 1;
    d.total_q = d.max_q = a.N;
    d.max_k = a.M;
    d.cu_q = ints;
    d.seqlen_k = ints + 2;
    d.k_begin = ints + 3;
    // One sequence: the variant's offset is M − N exactly when it is aligned bottom-right.
    d.bottom_right = a.variant.offset == a.M - a.N;
    d.left = a.variant.left;
    d.right = a.variant.right;
    d.softcap = a.variant.softcap;
    d.slopes = a.variant.alibi ? a.variant.slopes : nullptr;
    // At bf16/fp16 the kernel reads the format's 16-bit values, made here from the float32 inputs
    // (which hold values of the format) into this call's own workspace.
    const bool half = is_half(a.precision);
    const size_t q_elems = static_cast<size_t>(a.heads) * a.N * a.d, kv_elems = static_cast<size_t>(a.heads) * a.M * a.d;
    StreamWorkspace bits(half ? (q_elems + 2 * kv_elems + 24) / 2 : 0, stream);
    if (half) {
        auto* q = reinterpret_cast<uint16_t*>(bits.p);
        uint16_t* k = q + (q_elems + 7) / 8 * 8;  // each 16-byte aligned
        uint16_t* v = k + (kv_elems + 7) / 8 * 8;
        launch_to_half(a.Q, q, q_elems, a.precision, stream);
        launch_to_half(a.K, k, kv_elems, a.precision, stream);
        launch_to_half(a.V, v, kv_elems, a.precision, stream);
        d.Q = q;
        d.K = k;
        d.V = v;
    } else {
        d.Q = a.Q;
        d.K = a.K;
        d.V = a.V;
    }
    d.kv_stride = static_cast<long long>(a.M) * a.d;
    d.split_size = a.split_size;
    d.splits = a.splits;
    d.O_part = ws.p + 4;
    d.lse_part = d.O_part + static_cast<size_t>(a.splits) * a.heads * a.N * a.d;
    d.O = a.O;
    d.lse = a.lse;
    d.split_O = a.split_O;
    d.split_lse = a.split_lse;
    decode_forward(d, stream);
    ws.release();
    bits.release();
}

}  // namespace attnstep
