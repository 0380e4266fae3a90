// flash_backward.cpp — the CPU backend's FlashAttention-2 backward (flash_dQ, flash_dK, flash_dV)
// in the deterministic two-pass form the GPU runs, over kFlashBr x kFlashBc tiles, P recomputed
// from the forward's lse. backend_cpu.cpp's header states the arithmetic.
#include <algorithm>
#include <cmath>
#include <vector>

#include "../common.h"
#include "cpu_stages.h"
#include "head_scores.h"
#include "matrix_ops.h"
#include "parallel.h"

namespace attnstep {
namespace cpu {

namespace {

// One key tile of one head, as the flash backward reads it: Kj and Vj (cols rows from key c0) and
// their transposed copies.
struct KeyTile {
    int c0 = 0, cols = 0;
    const float *K = nullptr, *V = nullptr;
    std::vector<float> KT, VT;  // d x cols
    KeyTile(const float* K_head, const float* V_head, int c0_, int cols_, int d)
        : c0(c0_), cols(cols_), K(K_head + static_cast<size_t>(c0_) * d), V(V_head + static_cast<size_t>(c0_) * d),
          KT(transposed(K, cols_, d)), VT(transposed(V, cols_, d)) {}
};

// One query row's view of the flash backward: its Q and dO rows, its lse and D.
struct QueryRow {
    int r;
    const float *q, *dout;
    float lse, D;
};

// P and dS of one query row against one key tile, recomputed from the forward's lse, as the
// gradients read them: P = exp(S − lse) with S the scores the softmax read (head_scores.h) and
// dP = dO·vᵀ; into P the weights dV reads, P∘Z·(1/(1 − p)), into dS the softmax input's gradient
// P∘(dP∘Z·(1/(1 − p)) − D) times the softcap's derivative, which dQ and dK read (without dropout
// and softcap: P and P∘(dP − D)). Both 0 where masked and in a row that saw no key (lse = -inf).
void recompute_row(const HeadScores& sc, const QueryRow& row, const KeyTile& t, int d, float* P, float* dS) {
    row_times_matrix(row.q, t.KT.data(), d, t.cols, P);      // q·kᵀ
    row_times_matrix(row.dout, t.VT.data(), d, t.cols, dS);  // dP
    for (int cc = 0; cc < t.cols; ++cc) {
        const int c = t.c0 + cc;
        if (row.lse == kNegInf || sc.hidden(row.r, c)) {
            P[cc] = dS[cc] = 0.f;
            continue;
        }
        const float qk = P[cc], z = sc.dropped_scale(row.r, c);
        const float pc = std::exp(sc.modified(qk, row.r, c) - row.lse);
        P[cc] = pc * z;
        dS[cc] = pc * (dS[cc] * z - row.D);
        if (sc.capped()) dS[cc] *= sc.cap_derivative(qk);
    }
}

// What the flash backward's passes read for one group: the inputs as the GEMMs read them, the
// forward's lse and the rows' D = dO·O.
struct FlashBwdInputs {
    const Problem& p;
    const HeadGroup& g;  // the variant's inputs (head_scores.h)
    const Operands& in;
    View lse;
    const std::vector<float>& D;  // [heads][N]

    QueryRow row(int h, int r) const {
        const Dims& dm = p.dims;
        return QueryRow{r, in.head(Stage::Q, dm, h) + static_cast<size_t>(r) * dm.dk,
                        in.head(Stage::dO, dm, h) + static_cast<size_t>(r) * dm.dk, lse.head(h)[r],
                        D[static_cast<size_t>(h) * dm.N + r]};
    }
    // P or dS as a GEMM operand: rounded to TF32 or the half format as the tensor cores read it.
    float weight(float x) const { return gemm_operand(p.precision, x); }
};

// Pass 1 for key tile j of head h: dK_j = scale·sum_i dS_ijᵀ Q_i and dV_j = sum_i P_ijᵀ dO_i, over
// the query tiles that may see the key tile (causal: from the query tile holding row c0 on; a
// window also ends them).
void key_tile_grads(const FlashBwdInputs& b, int h, int j, const View& dK, const View& dV) {
    const Problem& p = b.p;
    const int N = p.dims.N, M = p.dims.M, d = p.dims.dk, Br = kFlashBr, Bc = kFlashBc;
    const HeadScores sc(p, b.g, h);
    const KeyTile t(b.in.head(Stage::K, p.dims, h), b.in.head(Stage::V, p.dims, h), j * Bc, std::min(Bc, M - j * Bc), d);
    float* dKj = dK.head(h) + static_cast<size_t>(t.c0) * d;
    float* dVj = dV.head(h) + static_cast<size_t>(t.c0) * d;
    std::fill_n(dKj, static_cast<size_t>(t.cols) * d, 0.f);
    std::fill_n(dVj, static_cast<size_t>(t.cols) * d, 0.f);
    std::vector<float> P(Bc), dS(Bc);
    for (int r0 = 0; r0 < N; r0 += Br) {
        const int r1 = std::min(N, r0 + Br);
        if (!sc.tile_visible(r0, r1, t.c0, t.c0 + t.cols)) continue;
        for (int r = r0; r < r1; ++r) {
            const QueryRow row = b.row(h, r);
            recompute_row(sc, row, t, d, P.data(), dS.data());
            for (int cc = 0; cc < t.cols; ++cc) {
                axpy(b.weight(P[cc]), row.dout, dVj + static_cast<size_t>(cc) * d, d);
                axpy(b.weight(dS[cc]), row.q, dKj + static_cast<size_t>(cc) * d, d);
            }
        }
    }
    scale_by(dKj, p.scale, static_cast<size_t>(t.cols) * d);
}

// Pass 2 for query tile i of head h: dQ_i = scale·sum_j dS_ij K_j, over the key tiles the query
// tile may see.
void query_tile_grads(const FlashBwdInputs& b, int h, int i, const View& dQ) {
    const Problem& p = b.p;
    const int N = p.dims.N, M = p.dims.M, d = p.dims.dk, Br = kFlashBr, Bc = kFlashBc;
    const int Tc = (M + Bc - 1) / Bc;
    const int r0 = i * Br, rows = std::min(Br, N - r0);
    const HeadScores sc(p, b.g, h);
    float* dQi = dQ.head(h) + static_cast<size_t>(r0) * d;
    std::fill_n(dQi, static_cast<size_t>(rows) * d, 0.f);
    std::vector<float> P(Bc), dS(Bc), part(d);
    for (int j = 0; j < Tc; ++j) {
        const int c0 = j * Bc, cols = std::min(Bc, M - c0);
        if (!sc.tile_visible(r0, r0 + rows, c0, c0 + cols)) continue;
        const KeyTile t(b.in.head(Stage::K, p.dims, h), b.in.head(Stage::V, p.dims, h), c0, cols, d);
        for (int rr = 0; rr < rows; ++rr) {
            recompute_row(sc, b.row(h, r0 + rr), t, d, P.data(), dS.data());
            if (is_half(p.precision))  // dS rounded to the format before dS·K
                std::transform(dS.begin(), dS.begin() + t.cols, dS.begin(), [&](float x) { return b.weight(x); });
            row_times_matrix(dS.data(), t.K, t.cols, d, part.data(), p.precision == Precision::tf32);
            add_to(dQi + static_cast<size_t>(rr) * d, part.data(), d);
        }
    }
    scale_by(dQi, p.scale, static_cast<size_t>(rows) * d);
}

}  // namespace

// FlashAttention-2 backward (Dao, Algorithm 2) in its deterministic two-pass form, as the GPU runs
// it: D = rowsum(dO∘O) first; then one pass over key tiles, each accumulating its dK_j and dV_j
// over the query tiles it is visible to, and one pass over query tiles, each accumulating its dQ_i
// over the key tiles; tiles no row may see are skipped. P is recomputed tile by tile from Q, K and
// flash_lse through the forward's score modifications and masks, dropped by the forward's keep
// decisions (both drawn again, head_scores.h), so no N x M buffer; every sum has one owner, so the
// result does not depend on the thread schedule.
void compute_flash_dQ(const StageWork& w) {
    const Problem& p = w.p;
    const HeadGroup& g = w.g;
    const Dims& dm = p.dims;
    const int Tr = (dm.N + kFlashBr - 1) / kFlashBr, Tc = (dm.M + kFlashBc - 1) / kFlashBc;
    const View O = w.out(Stage::flash_output), lse = w.out(Stage::flash_lse), dQ = w.out(Stage::flash_dQ),
               dK = w.out(Stage::flash_dK), dV = w.out(Stage::flash_dV);
    if (!O.base || !lse.base || !dK.base || !dV.base)
        fail(kExitInternal, where(__FILE__, __LINE__) + ": the flash backward without its buffers");
    std::vector<float> D(static_cast<size_t>(g.count) * dm.N);
    row_dots_do_o(g, dm, O, D.data());  // preprocess: D_r = dO_r · O_r
    const FlashBwdInputs b{p, g, w.in, lse, D};
    parallel_for(static_cast<size_t>(g.count) * Tc, [&](size_t item) {
        key_tile_grads(b, static_cast<int>(item / Tc), static_cast<int>(item % Tc), dK, dV);
    });
    parallel_for(static_cast<size_t>(g.count) * Tr, [&](size_t item) {
        query_tile_grads(b, static_cast<int>(item / Tr), static_cast<int>(item % Tr), dQ);
    });
}

}  // namespace cpu
}  // namespace attnstep
