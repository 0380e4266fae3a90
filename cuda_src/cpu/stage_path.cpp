// stage_path.cpp — the CPU backend's stage path, forward and backward: each stage of the table
// that is not a flash stage, computed for every head of a group from the inputs and the stages
// before it (docs/contract.md). backend_cpu.cpp's header states the arithmetic.
#include <algorithm>
#include <cmath>

#include "cpu_stages.h"
#include "matrix_ops.h"
#include "parallel.h"

namespace attnstep {
namespace cpu {

namespace {

// Row r of QK_scaled from row r of QK: src[c]·scale, -inf where causal-masked.
void scale_mask_row(const float* src, float* row, int r, int M, float scale, bool causal) {
    for (int c = 0; c < M; ++c) row[c] = masked(causal, r, c) ? kNegInf : src[c] * scale;
}

// One row of the softmax: P = exp(S - rowmax(S)) / rowsum; masked entries are exp(-inf) = 0
// exactly; a NaN score makes the maximum, and so the whole row, NaN.
void softmax_row(const float* S, float* P, int M) {
    float m = kNegInf;
    for (int c = 0; c < M; ++c) m = max_keep_nan(m, S[c]);
    float l = 0.f;
    for (int c = 0; c < M; ++c) {
        P[c] = S[c] == kNegInf ? 0.f : std::exp(S[c] - m);
        l += P[c];
    }
    const float inv = 1.f / l;
    for (int c = 0; c < M; ++c) P[c] *= inv;
}

// out[h] = A[h]·B[h]ᵀ (N×M, inner dimension k) for every head of the group, A and B input stages
// (QK = Q·Kᵀ, dP = dO·Vᵀ). Items are (head, block of kRowBlock rows); each makes its own
// transposed copy of B, 1/kRowBlock of its arithmetic.
void gemm_abt_heads(const Operands& in, Stage A, Stage B, const Dims& d, int heads, int k, const View& out) {
    parallel_row_blocks(heads, d.N, [&](int h, int r0, int r1) {
        rows_times_transposed(in.head(A, d, h), in.head(B, d, h), r0, r1, k, d.M, out.head(h), false);
    });
}

// The echo of an input stage: the group's values as read.
void copy_input(const StageWork& w, Stage s, const float* values) {
    std::copy_n(values, stage_elems(s, w.p.dims) * w.g.count, w.out(s).base);
}

}  // namespace

void row_dots_do_o(const HeadGroup& g, const Dims& d, const View& O, float* D) {
    parallel_rows(g.count, d.N, [&](int h, int r) {
        D[static_cast<size_t>(h) * d.N + r] = dot(g.dout + stage_elems(Stage::dO, d) * h + static_cast<size_t>(r) * d.dv,
                                                  O.head(h) + static_cast<size_t>(r) * d.dv, d.dv);
    });
}

// ---------------------------------------------------------------- forward

void compute_Q(const StageWork& w) { copy_input(w, Stage::Q, w.g.q); }
void compute_K(const StageWork& w) { copy_input(w, Stage::K, w.g.k); }
void compute_V(const StageWork& w) { copy_input(w, Stage::V, w.g.v); }

// KT[c][r] = K[r][c]; K's rows are read in order, KT's columns written in order.
void compute_KT(const StageWork& w) {
    const Dims& d = w.p.dims;
    const View out = w.out(Stage::KT);
    parallel_for(w.g.count, [&](size_t h) {
        const float* K = w.g.k + stage_elems(Stage::K, d) * h;
        float* KT = out.head(static_cast<int>(h));
        for (int r = 0; r < d.M; ++r)
            for (int c = 0; c < d.dk; ++c) KT[static_cast<size_t>(c) * d.M + r] = K[static_cast<size_t>(r) * d.dk + c];
    });
}

// QK[r][:] = sum_t Q[r][t] KT[t][:]: an axpy over a transposed copy of K vectorises across
// columns, while each element still accumulates over t in order, like a dot.
void compute_QK(const StageWork& w) {
    gemm_abt_heads(w.in, Stage::Q, Stage::K, w.p.dims, w.g.count, w.p.dims.dk, w.out(Stage::QK));
}

void compute_QK_scaled(const StageWork& w) {
    const Dims& d = w.p.dims;
    const View qk = w.out(Stage::QK), out = w.out(Stage::QK_scaled);
    parallel_rows(w.g.count, d.N, [&](int h, int r) {
        const size_t row = static_cast<size_t>(r) * d.M;
        scale_mask_row(qk.head(h) + row, out.head(h) + row, r, d.M, w.p.scale, w.p.causal);
    });
}

void compute_attention_weights(const StageWork& w) {
    const Dims& d = w.p.dims;
    const View sc = w.out(Stage::QK_scaled), out = w.out(Stage::attention_weights);
    parallel_rows(w.g.count, d.N, [&](int h, int r) {
        const size_t row = static_cast<size_t>(r) * d.M;
        softmax_row(sc.head(h) + row, out.head(h) + row, d.M);
    });
}

// O[r] = sum_c P[r][c] V[c]: a running axpy over V's rows keeps every access contiguous.
void compute_output(const StageWork& w) {
    const Dims& d = w.p.dims;
    const View pw = w.out(Stage::attention_weights), out = w.out(Stage::output);
    parallel_rows(w.g.count, d.N, [&](int h, int r) {
        row_times_matrix(pw.head(h) + static_cast<size_t>(r) * d.M, w.in.head(Stage::V, d, h), d.M, d.dv,
                         out.head(h) + static_cast<size_t>(r) * d.dv, w.p.precision == Precision::tf32);
    });
}

// ---------------------------------------------------------------- backward
// D, dP, dS, dQ, dK, dV from dO and the forward's stages.

void compute_dO(const StageWork& w) { copy_input(w, Stage::dO, w.g.dout); }

void compute_D(const StageWork& w) { row_dots_do_o(w.g, w.p.dims, w.out(Stage::output), w.out(Stage::D).base); }

void compute_dP(const StageWork& w) {
    gemm_abt_heads(w.in, Stage::dO, Stage::V, w.p.dims, w.g.count, w.p.dims.dv, w.out(Stage::dP));
}

// dS = P∘(dP − D), written as 0 where masked (P is 0 there, and a product could be -0).
void compute_dS(const StageWork& w) {
    const Dims& d = w.p.dims;
    const View P = w.out(Stage::attention_weights), dP = w.out(Stage::dP), D = w.out(Stage::D), out = w.out(Stage::dS);
    parallel_rows(w.g.count, d.N, [&](int h, int r) {
        const size_t row = static_cast<size_t>(r) * d.M;
        for (int c = 0; c < d.M; ++c)
            out.head(h)[row + c] =
                masked(w.p.causal, r, c) ? 0.f : P.head(h)[row + c] * (dP.head(h)[row + c] - D.head(h)[r]);
    });
}

void compute_dQ(const StageWork& w) {
    const Dims& d = w.p.dims;
    const View dS = w.out(Stage::dS), out = w.out(Stage::dQ);
    parallel_rows(w.g.count, d.N, [&](int h, int r) {
        float* row = out.head(h) + static_cast<size_t>(r) * d.dk;
        row_times_matrix(dS.head(h) + static_cast<size_t>(r) * d.M, w.in.head(Stage::K, d, h), d.M, d.dk, row,
                         w.p.precision == Precision::tf32);
        scale_by(row, w.p.scale, d.dk);
    });
}

void compute_dK(const StageWork& w) {
    const Dims& d = w.p.dims;
    const View dS = w.out(Stage::dS), out = w.out(Stage::dK);
    parallel_row_blocks(w.g.count, d.M, [&](int h, int c0, int c1) {
        transposed_times_matrix(dS.head(h), w.in.head(Stage::Q, d, h), d.N, d.M, c0, c1, d.dk, out.head(h),
                                w.p.precision == Precision::tf32);
        scale_by(out.head(h) + static_cast<size_t>(c0) * d.dk, w.p.scale, static_cast<size_t>(c1 - c0) * d.dk);
    });
}

void compute_dV(const StageWork& w) {
    const Dims& d = w.p.dims;
    const View P = w.out(Stage::attention_weights), out = w.out(Stage::dV);
    parallel_row_blocks(w.g.count, d.M, [&](int h, int c0, int c1) {
        transposed_times_matrix(P.head(h), w.in.head(Stage::dO, d, h), d.N, d.M, c0, c1, d.dv, out.head(h),
                                w.p.precision == Precision::tf32);
    });
}

}  // namespace cpu
}  // namespace attnstep
