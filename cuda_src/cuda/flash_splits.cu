// flash_splits.cu — the CUDA backend's split-KV forward (flash.cuh compute_flash_splits): the heads
// of a group for the decode kernel (decode.cu), which writes the split stages in their stage layout
// and their combine. A dense group is one sequence; a packed case is its sequences, in one launch,
// the kernel reading each one's keys from its slot or through the block table.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <vector>

#include "../common.h"
#include "../sequences.h"
#include "cuda_check.cuh"
#include "decode.cuh"
#include "flash.cuh"
#include "flash_dispatch.cuh"
#include "half.cuh"

namespace attnstep {

namespace {

// The sequences as the decode kernel reads them, one array of ints for the device: cu_q [batch + 1],
// then seqlen_k [batch], then k_begin [batch] (keys in slots) or the block table [batch][pages]
// (paged); the members say where each begins (-1: absent).
struct SequenceInts {
    std::vector<int> ints;
    int batch = 1, max_q = 0, max_k = 0, seqlen_k = 0, k_begin = -1, block_table = -1, table_stride = 0,
        page_size = 0;
};

SequenceInts dense_ints(int n, int m) {
    SequenceInts s;
    s.ints = {0, n, m, 0};
    s.max_q = n;
    s.max_k = m;
    s.seqlen_k = 2;
    s.k_begin = 3;
    return s;
}

SequenceInts packed_ints(const Sequences& q) {
    SequenceInts s;
    s.batch = q.count();
    for (int b = 0; b <= s.batch; ++b) s.ints.push_back(static_cast<int>(q.cu_q[b]));
    s.seqlen_k = static_cast<int>(s.ints.size());
    for (int b = 0; b < s.batch; ++b) {
        s.ints.push_back(q.m(b));
        s.max_q = std::max(s.max_q, q.n(b));
        s.max_k = std::max(s.max_k, q.m(b));
    }
    if (q.paged()) {
        s.block_table = static_cast<int>(s.ints.size());
        for (long long page : q.block_table) s.ints.push_back(static_cast<int>(std::max(0LL, page)));  // -1: unused
        s.table_stride = q.pages_per_seq;
        s.page_size = q.page_size;
    } else {
        s.k_begin = static_cast<int>(s.ints.size());
        for (int b = 0; b < s.batch; ++b) s.ints.push_back(q.k_begin(b));
    }
    return s;
}

}  // namespace

void compute_flash_splits(const FlashSplitArgs& a, cudaStream_t stream) {
    if (a.variant.mask_file || a.variant.bias_file || a.variant.dropout > 0.f)
        fail(kExitBadInput, "--split-size: the CUDA split kernel takes no mask file, bias file or dropout",
             "use --backend cpu, which computes the split stages of every variant");
    if (!decode_supported(a.d))
        fail(kExitBadInput, "--split-size: the CUDA split kernel has no head width " + std::to_string(a.d),
             "its widths are " + flash_head_dims_text() + "; use --backend cpu");
    // Where each sequence's queries and keys lie: one sequence of every row (a dense group), or the
    // packed case's, its keys in slots or in pages through the block table.
    const SequenceInts seq = a.sequences ? packed_ints(*a.sequences) : dense_ints(a.N, a.M);
    const size_t int_floats = (seq.ints.size() + 3) / 4 * 4;  // keeps the partials 16-byte aligned
    StreamWorkspace ws(int_floats + static_cast<size_t>(a.splits) * a.heads * a.N * (a.d + 1), stream);
    int* ints = reinterpret_cast<int*>(ws.p);
    CUDA_CHECK(cudaMemcpyAsync(ints, seq.ints.data(), seq.ints.size() * sizeof(int), cudaMemcpyHostToDevice, stream));
    DecodeArgs d;
    d.precision = a.precision;
    d.heads = d.kv_heads = a.heads;  // the backend hands every query head its own K and V
    d.d = a.d;
    d.scale = a.scale;
    d.batch = seq.batch;
    d.total_q = a.N;
    d.max_q = seq.max_q;
    d.max_k = seq.max_k;
    d.cu_q = ints;
    d.seqlen_k = ints + seq.seqlen_k;
    d.k_begin = seq.k_begin >= 0 ? ints + seq.k_begin : nullptr;
    d.block_table = seq.block_table >= 0 ? ints + seq.block_table : nullptr;
    d.table_stride = seq.table_stride;
    d.page_size = seq.page_size;
    // A dense group is one sequence: the variant's offset is M − N exactly when it is aligned
    // bottom-right. A packed one says so (its variant's offset is the totals').
    d.bottom_right = a.sequences ? a.bottom_right : a.variant.offset == a.M - a.N;
    d.left = a.variant.left;
    d.right = a.variant.right;
    d.softcap = a.variant.softcap;
    d.slopes = a.variant.alibi ? a.variant.slopes : nullptr;
    // At bf16/fp16 the kernel reads the format's 16-bit values: the backend's copies in the format
    // (FlashArgs Qh, Kh, Vh) where it made them, else made here from the float32 inputs (which hold
    // values of the format) into this call's own workspace.
    const bool half = is_half(a.precision), made = half && !(a.Qh && a.Kh && a.Vh);
    const size_t q_elems = static_cast<size_t>(a.heads) * a.N * a.d, kv_elems = static_cast<size_t>(a.heads) * a.M * a.d;
    StreamWorkspace bits(made ? (q_elems + 2 * kv_elems + 24) / 2 : 0, stream);
    if (made) {
        auto* q = reinterpret_cast<uint16_t*>(bits.p);
        uint16_t* k = q + (q_elems + 7) / 8 * 8;  // each 16-byte aligned
        uint16_t* v = k + (kv_elems + 7) / 8 * 8;
        launch_to_half(a.Q, q, q_elems, a.precision, stream);
        launch_to_half(a.K, k, kv_elems, a.precision, stream);
        launch_to_half(a.V, v, kv_elems, a.precision, stream);
        d.Q = q;
        d.K = k;
        d.V = v;
    } else if (half) {
        d.Q = a.Qh;
        d.K = a.Kh;
        d.V = a.Vh;
    } else {
        d.Q = a.Q;
        d.K = a.K;
        d.V = a.V;
    }
    d.kv_stride = static_cast<long long>(a.M) * a.d;
    d.split_size = a.split_size;
    d.splits = a.splits;
    d.O_part = ws.p + int_floats;
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
