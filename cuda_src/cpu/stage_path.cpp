// stage_path.cpp — the CPU backend's stage path, forward and backward: each stage of the table
// that is not a flash stage, computed for every head of a group from the inputs and the stages
// before it (docs/contract.md). backend_cpu.cpp's header states the arithmetic.
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_stages.h"
#include "head_scores.h"
#include "matrix_ops.h"
#include "parallel.h"

namespace attnstep {
namespace cpu {

namespace {

// One row of the softmax: P = exp(S - rowmax(S)) / rowsum; masked entries are exp(-inf) = 0
// exactly; a NaN score makes the maximum, and so the whole row, NaN. A row that sees no key (every
// score -inf) has weights 0, not the 0/0 of the formula.
void softmax_row(const float* S, float* P, int M) {
    float m = kNegInf;
    for (int c = 0; c < M; ++c) m = max_keep_nan(m, S[c]);
    if (m == kNegInf) {
        std::fill_n(P, M, 0.f);
        return;
    }
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

// A row of attention weights as the GEMM after them reads it under dropout: P∘Z·(1/(1 − p)) in
// float32 (Z the row of the keep-mask stage), rounded as the GEMM's operand (TF32 or the half
// format; fp32 keeps it).
void dropped_row(const float* P, const float* Z, float keep_scale, Precision precision, int M, float* out) {
    for (int c = 0; c < M; ++c) out[c] = gemm_operand(precision, P[c] * Z[c] * keep_scale);
}

// Row r of dS on its way to dQ and dK: dS∘(1 − t²), the softcap's derivative at row r of QK.
void capped_row(const HeadScores& sc, const float* dS, const float* QK, int M, float* out) {
    for (int c = 0; c < M; ++c) out[c] = dS[c] * sc.cap_derivative(QK[c]);
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

// The scores the softmax reads (head_scores.h): scale·QK, capped, ALiBi, the bias; -inf where masked.
void compute_QK_scaled(const StageWork& w) {
    const Dims& d = w.p.dims;
    const View qk = w.out(Stage::QK), out = w.out(Stage::QK_scaled);
    parallel_rows(w.g.count, d.N, [&](int h, int r) {
        const HeadScores sc(w.p, w.g, h);
        const size_t row = static_cast<size_t>(r) * d.M;
        for (int c = 0; c < d.M; ++c) out.head(h)[row + c] = sc.score(qk.head(h)[row + c], r, c);
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

// The keep-mask: 1 where dropout keeps entry (r, c), 0 where it drops it (every entry drawn, masked
// or not, so the mask does not depend on the other variants).
void compute_dropout_mask(const StageWork& w) {
    const Dims& d = w.p.dims;
    const View out = w.out(Stage::dropout_mask);
    parallel_rows(w.g.count, d.N, [&](int h, int r) {
        const HeadScores sc(w.p, w.g, h);
        float* row = out.head(h) + static_cast<size_t>(r) * d.M;
        for (int c = 0; c < d.M; ++c) row[c] = sc.keep(r, c);
    });
}

// O[r] = sum_c P[r][c] V[c] (P∘Z·(1/(1 − p)) under dropout): a running axpy over V's rows keeps
// every access contiguous.
void compute_output(const StageWork& w) {
    const Dims& d = w.p.dims;
    const View pw = w.out(Stage::attention_weights), Z = w.out(Stage::dropout_mask), out = w.out(Stage::output);
    parallel_rows(w.g.count, d.N, [&](int h, int r) {
        const HeadScores sc(w.p, w.g, h);
        const size_t row = static_cast<size_t>(r) * d.M;
        const float* P = pw.head(h) + row;
        std::vector<float> dropped;
        if (sc.drops()) {
            dropped.resize(d.M);
            dropped_row(P, Z.head(h) + row, sc.keep_scale(), w.p.precision, d.M, dropped.data());
            P = dropped.data();
        }
        row_times_matrix(P, w.in.head(Stage::V, d, h), d.M, d.dv, out.head(h) + static_cast<size_t>(r) * d.dv,
                         w.p.precision == Precision::tf32);
    });
}

// ---------------------------------------------------------------- backward
// D, dP, dS, dQ, dK, dV from dO and the forward's stages.

void compute_dO(const StageWork& w) { copy_input(w, Stage::dO, w.g.dout); }

void compute_D(const StageWork& w) { row_dots_do_o(w.g, w.p.dims, w.out(Stage::output), w.out(Stage::D).base); }

void compute_dP(const StageWork& w) {
    gemm_abt_heads(w.in, Stage::dO, Stage::V, w.p.dims, w.g.count, w.p.dims.dv, w.out(Stage::dP));
}

// dS = P∘(dP∘Z·(1/(1 − p)) − D) (P∘(dP − D) without dropout), written as 0 where masked (P is 0
// there, and a product could be -0).
void compute_dS(const StageWork& w) {
    const Dims& d = w.p.dims;
    const View P = w.out(Stage::attention_weights), Z = w.out(Stage::dropout_mask), dP = w.out(Stage::dP),
               D = w.out(Stage::D), out = w.out(Stage::dS);
    parallel_rows(w.g.count, d.N, [&](int h, int r) {
        const HeadScores sc(w.p, w.g, h);
        const size_t row = static_cast<size_t>(r) * d.M;
        const float *Pr = P.head(h) + row, *dPr = dP.head(h) + row;
        const float Dr = D.head(h)[r];
        const float* Zr = sc.drops() ? Z.head(h) + row : nullptr;
        float* dSr = out.head(h) + row;
        for (int c = 0; c < d.M; ++c) {
            const float dp = Zr ? dPr[c] * Zr[c] * sc.keep_scale() : dPr[c];
            dSr[c] = sc.hidden(r, c) ? 0.f : Pr[c] * (dp - Dr);
        }
    });
}

// dQ = scale·(dS∘(1 − t²))·K: the softcap's derivative (head_scores.h) read from QK; dS as it is
// without a softcap.
void compute_dQ(const StageWork& w) {
    const Dims& d = w.p.dims;
    const View dS = w.out(Stage::dS), QK = w.out(Stage::QK), out = w.out(Stage::dQ);
    parallel_rows(w.g.count, d.N, [&](int h, int r) {
        const HeadScores sc(w.p, w.g, h);
        const size_t at = static_cast<size_t>(r) * d.M;
        const float* dSr = dS.head(h) + at;
        std::vector<float> capped;
        if (sc.capped()) {
            capped.resize(d.M);
            capped_row(sc, dSr, QK.head(h) + at, d.M, capped.data());
            dSr = capped.data();
        }
        float* row = out.head(h) + static_cast<size_t>(r) * d.dk;
        row_times_matrix(dSr, w.in.head(Stage::K, d, h), d.M, d.dk, row, w.p.precision == Precision::tf32);
        scale_by(row, w.p.scale, d.dk);
    });
}

// dK = scale·(dS∘(1 − t²))ᵀ·Q, as dQ.
void compute_dK(const StageWork& w) {
    const Dims& d = w.p.dims;
    const View dS = w.out(Stage::dS), QK = w.out(Stage::QK), out = w.out(Stage::dK);
    const bool tf32 = w.p.precision == Precision::tf32;
    parallel_row_blocks(w.g.count, d.M, [&](int h, int c0, int c1) {
        const HeadScores sc(w.p, w.g, h);
        const float *dSh = dS.head(h), *Q = w.in.head(Stage::Q, d, h);
        if (sc.capped()) {
            const float* QKh = QK.head(h);
            auto capped = [&](int r, int c) {
                const size_t at = static_cast<size_t>(r) * d.M + c;
                return dSh[at] * sc.cap_derivative(QKh[at]);
            };
            transposed_entries_times_matrix(capped, Q, d.N, c0, c1, d.dk, out.head(h), tf32);
        } else {
            transposed_times_matrix(dSh, Q, d.N, d.M, c0, c1, d.dk, out.head(h), tf32);
        }
        scale_by(out.head(h) + static_cast<size_t>(c0) * d.dk, w.p.scale, static_cast<size_t>(c1 - c0) * d.dk);
    });
}

// dV = (P∘Z·(1/(1 − p)))ᵀ·dO, the weights as the output's GEMM read them (Pᵀ·dO without dropout).
void compute_dV(const StageWork& w) {
    const Dims& d = w.p.dims;
    const View P = w.out(Stage::attention_weights), Z = w.out(Stage::dropout_mask), out = w.out(Stage::dV);
    const bool tf32 = w.p.precision == Precision::tf32;
    parallel_row_blocks(w.g.count, d.M, [&](int h, int c0, int c1) {
        const HeadScores sc(w.p, w.g, h);
        const float *Ph = P.head(h), *dO = w.in.head(Stage::dO, d, h);
        if (sc.drops()) {
            const float* Zh = Z.head(h);
            auto dropped = [&](int r, int c) {
                const size_t at = static_cast<size_t>(r) * d.M + c;
                return gemm_operand(w.p.precision, Ph[at] * Zh[at] * sc.keep_scale());
            };
            transposed_entries_times_matrix(dropped, dO, d.N, c0, c1, d.dv, out.head(h), tf32);
        } else {
            transposed_times_matrix(Ph, dO, d.N, d.M, c0, c1, d.dv, out.head(h), tf32);
        }
    });
}

}  // namespace cpu
}  // namespace attnstep
