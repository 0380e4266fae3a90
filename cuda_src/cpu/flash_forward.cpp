// flash_forward.cpp — the CPU backend's FlashAttention forward (flash_output and flash_lse): the
// same tiled online-softmax algorithm as the GPU's flash kernels, in float32, over kFlashBr x
// kFlashBc tiles; and its split-KV form (flash-decoding: split_output, split_lse and their combine).
// backend_cpu.cpp's header states the arithmetic.
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

// The running state of FlashAttention's online softmax for the rows of one query tile: per row
// the maximum m, the sum l and the unnormalised output O (d wide).
struct OnlineRows {
    int d;
    Precision precision;  // P rounded to TF32 or the half format as the P·V GEMM reads it
    std::vector<float> m, l, O;
    OnlineRows(int rows, int d_, Precision precision_)
        : d(d_), precision(precision_), m(rows, kNegInf), l(rows, 0.f), O(static_cast<size_t>(rows) * d_, 0.f) {}

    // Row rr takes the scores S[0, cols) the softmax reads (-inf where masked) of the keys whose
    // values are the rows of Vj, and their keep decisions Z (null without dropout):
    // m_new = max(m, rowmax(S)), P = exp(S - m_new), l = exp(m - m_new)·l + rowsum(P),
    // O = exp(m - m_new)·O + (P∘Z)·Vj. l sums the undropped P: dropout drops weights after the
    // softmax, whose denominator it leaves alone; finish() applies the 1/(1 − p).
    void add(int rr, const float* S, int cols, const float* Vj, const float* Z) {
        float m_new = m[rr];
        for (int cc = 0; cc < cols; ++cc) m_new = max_keep_nan(m_new, S[cc]);
        if (m_new == kNegInf) return;  // nothing visible yet in this row
        const float alpha = m[rr] == kNegInf ? 0.f : std::exp(m[rr] - m_new);
        float* Or = O.data() + static_cast<size_t>(rr) * d;
        for (int t = 0; t < d; ++t) Or[t] *= alpha;
        float rowsum = 0.f;
        for (int cc = 0; cc < cols; ++cc) {
            const float pc = S[cc] == kNegInf ? 0.f : std::exp(S[cc] - m_new);
            rowsum += pc;
            // l sums the float32 weights; only the GEMM operand is rounded (FlashAttention's order)
            axpy(gemm_operand(precision, Z ? pc * Z[cc] : pc), Vj + static_cast<size_t>(cc) * d, Or, d);
        }
        l[rr] = alpha * l[rr] + rowsum;
        m[rr] = m_new;
    }

    // O_i = diag(l)^-1 O_i·keep_scale (dropout's 1/(1 − p); 1 without) and lse_i = m_i + log(l_i)
    // into the tile's rows of the head's outputs, rows `o_stride` and `lse_stride` floats apart (a
    // split's columns of the split stages' rows). A row that saw no key has output 0 and lse
    // log 0 = -inf, not the NaN of 0/0.
    void finish(float* Oout, size_t o_stride, float* lse, size_t lse_stride, float keep_scale) const {
        for (size_t rr = 0; rr < m.size(); ++rr) {
            float* Or = Oout + rr * o_stride;
            if (m[rr] == kNegInf) {
                std::fill_n(Or, d, 0.f);
                lse[rr * lse_stride] = kNegInf;
                continue;
            }
            const float inv = keep_scale / l[rr];
            for (int t = 0; t < d; ++t) Or[t] = O[rr * d + t] * inv;
            lse[rr * lse_stride] = m[rr] + std::log(l[rr]);
        }
    }
};

// One query tile against one key tile: row rr of the tile takes the scores the softmax reads
// (head_scores.h) and, under dropout, their keep decisions.
struct TileRows {
    const HeadScores& sc;
    const float* Qi;  // the tile's first query row
    int r0, rows, d;

    void visit(int c0, int cols, const float* Kj, const float* Vj, OnlineRows& state) const {
        const std::vector<float> KjT = transposed(Kj, cols, d);  // d x cols
        std::vector<float> S(cols), Z(sc.drops() ? cols : 0);
        for (int rr = 0; rr < rows; ++rr) {
            const int r = r0 + rr;
            // S = scale·Qi Kjᵀ, modified, -inf where masked
            row_times_matrix(Qi + static_cast<size_t>(rr) * d, KjT.data(), d, cols, S.data());
            for (int cc = 0; cc < cols; ++cc) S[cc] = sc.score(S[cc], r, c0 + cc);
            if (sc.drops())
                for (int cc = 0; cc < cols; ++cc) Z[cc] = sc.keep(r, c0 + cc);
            state.add(rr, S.data(), cols, Vj, sc.drops() ? Z.data() : nullptr);
        }
    }
};

// The keys [k0, k1) of one head through the online softmax of one query tile, Bc keys at a time from
// k0; key tiles outside every row's visible range are skipped whole.
void stream_keys(const TileRows& tile, const float* K, const float* V, int k0, int k1, OnlineRows& state) {
    const int d = tile.d;
    for (int c0 = k0; c0 < k1; c0 += kFlashBc) {
        const int cols = std::min(kFlashBc, k1 - c0);
        if (!tile.sc.tile_visible(tile.r0, tile.r0 + tile.rows, c0, c0 + cols)) continue;
        tile.visit(c0, cols, K + static_cast<size_t>(c0) * d, V + static_cast<size_t>(c0) * d, state);
    }
}

// flash-decoding's combine of one row's S splits (O_s d wide, S·d floats; lse_s S floats), in
// float32 as flash-attn's combine kernel: m = max_s lse_s, lse = m + log(sum_s exp(lse_s − m)),
// O = sum_s exp(lse_s − lse)·O_s, summed over s in order. A split that sees no key (lse −inf) weighs
// 0 exactly; a row whose splits see none has O = 0 and lse = −inf; a NaN lse makes the row NaN.
void combine_row(const float* Os, const float* lses, int S, int d, float* O, float* lse) {
    float m = kNegInf;
    for (int s = 0; s < S; ++s) m = max_keep_nan(m, lses[s]);
    std::fill_n(O, d, 0.f);
    if (m == kNegInf) {
        *lse = kNegInf;
        return;
    }
    float sum = 0.f;
    for (int s = 0; s < S; ++s)
        if (lses[s] != kNegInf) sum += std::exp(lses[s] - m);
    const float L = m + std::log(sum);
    for (int s = 0; s < S; ++s)
        if (lses[s] != kNegInf) axpy(std::exp(lses[s] - L), Os + static_cast<size_t>(s) * d, O, d);
    *lse = L;
}

// The split-KV forward of one query tile (flash-decoding, Problem::split_size K): split s streams
// the keys [s·K, (s+1)·K) ∩ [0, M) through an online softmax of its own (the forward's arithmetic,
// the variant applied through the same scores) into split s's columns of split_output (normalised
// by the split's own sum) and split_lse; a split with no key the row sees (past M, or masked whole)
// has output 0 and lse −inf. Then each row's flash_output and flash_lse are the splits' combine.
void split_tile(const Problem& p, const TileRows& tile, const float* K, const float* V, float* splitO,
                float* splitL, float* O, float* lse) {
    const int S = p.dims.splits, d = tile.d, M = p.dims.M;
    const size_t o_stride = static_cast<size_t>(S) * d;
    for (int s = 0; s < S; ++s) {
        const long long k0 = static_cast<long long>(s) * p.split_size;
        const int begin = static_cast<int>(std::min<long long>(k0, M));
        const int end = static_cast<int>(std::min<long long>(k0 + p.split_size, M));
        OnlineRows state(tile.rows, d, p.precision);
        stream_keys(tile, K, V, begin, end, state);
        state.finish(splitO + static_cast<size_t>(s) * d, o_stride, splitL + s, S, tile.sc.keep_scale());
    }
    for (int rr = 0; rr < tile.rows; ++rr)
        combine_row(splitO + rr * o_stride, splitL + static_cast<size_t>(rr) * S, S, d, O + static_cast<size_t>(rr) * d,
                    lse + rr);
}

}  // namespace

// FlashAttention forward (Dao et al., Algorithm 1): for each query tile Qi (Br rows), stream the
// key/value tiles Kj, Vj (Bc rows) through the online softmax (OnlineRows); never holds an N x M
// matrix. Key tiles outside every row's visible range (causal tiles above the diagonal, tiles left
// of a window) are skipped whole; the last tiles may be partial (tail rows/columns are simply not
// visited). In a run that splits (split_tile) the same streams run split by split, and the output
// is their combine.
void compute_flash_output(const StageWork& w) {
    const Problem& p = w.p;
    const Operands& in = w.in;
    const Dims& dm = p.dims;
    const int N = dm.N, M = dm.M, d = dm.dk;
    const int Br = kFlashBr;
    const int Tr = (N + Br - 1) / Br;
    float* O_all = w.out(Stage::flash_output).base;
    float* lse_all = w.out(Stage::flash_lse).base;
    const View splitO = w.out(Stage::split_output), splitL = w.out(Stage::split_lse);
    const bool splits = p.split_size > 0;
    if (!lse_all) fail(kExitInternal, where(__FILE__, __LINE__) + ": no buffer for flash_lse");
    if (splits && (dm.splits < 1 || !splitO.base || !splitL.base))
        fail(kExitInternal, where(__FILE__, __LINE__) + ": a run that splits without its split stages");
    parallel_for(static_cast<size_t>(w.g.count) * Tr, [&](size_t item) {
        const int h = static_cast<int>(item / Tr), i = static_cast<int>(item % Tr);
        const int r0 = i * Br, rows = std::min(Br, N - r0);
        const HeadScores sc(p, w.g, h);
        const TileRows tile{sc, in.head(Stage::Q, dm, h) + static_cast<size_t>(r0) * d, r0, rows, d};
        const float* K = in.head(Stage::K, dm, h);
        const float* V = in.head(Stage::V, dm, h);
        float* O = O_all + stage_elems(Stage::flash_output, dm) * h + static_cast<size_t>(r0) * d;
        float* lse = lse_all + stage_elems(Stage::flash_lse, dm) * h + r0;
        if (splits) {
            split_tile(p, tile, K, V, splitO.head(h) + static_cast<size_t>(r0) * dm.splits * d,
                       splitL.head(h) + static_cast<size_t>(r0) * dm.splits, O, lse);
            return;
        }
        OnlineRows state(rows, d, p.precision);
        stream_keys(tile, K, V, 0, M, state);
        state.finish(O, d, lse, 1, sc.keep_scale());
    });
}

}  // namespace cpu
}  // namespace attnstep
