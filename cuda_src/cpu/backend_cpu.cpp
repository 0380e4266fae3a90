// backend_cpu.cpp — the CPU backend: the same stages as the CUDA backend in plain C++, float32
// arithmetic throughout (accumulating in float as the GPU does, so the verifier's tolerance model
// applies unchanged), and the same tiled online-softmax algorithm for the flash stages.
// Arithmetic the verifier assumes (verify/model/kernels.py: KERNELS["cpu-tiled"], the cpu model):
// float32 products and sums in index order (no FMA on x86-64 without -march flags), std::exp (one
// rounding in practice), the scale applied to each finished dot product, lse = m + log(l), O·(1/l);
// under tf32 the GEMM operands rounded to TF32, nearest even; under bf16/fp16 the inputs and each
// stage's values rounded to the format (nearest even) as soon as the stage is computed, so the next
// stage reads half values (GEMM products of two half values are exact in float32, the sums float32),
// and the flash kernels' P (and the backward's dS) rounded before their GEMMs, as FlashAttention
// does; flash_lse and D stay float32.
//   build: cmake -S . -B build-cpu -DATTNSTEP_CUDA=OFF && cmake --build build-cpu -j2
//   run:   build-cpu/main --in tests/data/tiny_test --out /tmp/tiny_verify --backend cpu
// Work is spread over the host's cores with std::thread (rows, or (head, query tile) pairs);
// each stage is timed with a steady clock around its parallel loop.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#include "../backend.h"
#include "../common.h"
#include "../io/host_memory.h"

namespace attnstep {

namespace {

constexpr int kFlashBr = 64;  // query rows per tile (FlashAttention's Br)
constexpr int kFlashBc = 64;  // key rows per tile (Bc)
const float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kRowBlock = 64;  // QK rows per work item
inline size_t row_blocks(int rows) { return static_cast<size_t>((rows + kRowBlock - 1) / kRowBlock); }

// Rounds to TF32 (10 explicit mantissa bits), round to nearest even, as tensor cores read
// operands; Inf and NaN pass through.
inline float round_tf32(float x) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    if ((u & 0x7F800000u) == 0x7F800000u) return x;
    u += 0x0FFFu + ((u >> 13) & 1u);
    u &= 0xFFFFE000u;
    std::memcpy(&x, &u, sizeof u);
    return x;
}

// A GEMM's weight operand as the kernel's tensor cores would read it: TF32 or the half format.
inline float gemm_operand(Precision p, float x) { return p == Precision::tf32 ? round_tf32(x) : round_to(p, x); }

// Runs fn(i) for i in [0, n) on all cores; items are taken one at a time from a shared counter,
// so uneven items (causal rows) balance themselves.
template <typename Fn>
void parallel_for(size_t n, Fn fn) {
    unsigned hw = std::max(1u, std::thread::hardware_concurrency());
    size_t workers = std::min<size_t>(hw, n);
    if (workers <= 1) {
        for (size_t i = 0; i < n; ++i) fn(i);
        return;
    }
    std::atomic<size_t> next{0};
    auto loop = [&]() {
        for (size_t i; (i = next.fetch_add(1)) < n;) fn(i);
    };
    std::vector<std::thread> pool;
    for (size_t w = 1; w < workers; ++w) pool.emplace_back(loop);
    loop();
    for (std::thread& t : pool) t.join();
}

inline bool masked(bool causal, int r, int c) { return causal && c > r; }  // top-left aligned

// std::max(m, x), except that a NaN in either stays NaN: a row maximum over scores that hold a NaN
// (NaN in Q or K under --allow-nonfinite) is NaN, so the whole row's softmax, output and lse are
// NaN, as the reference's are. std::max(-inf, NaN) would drop it, and a row of NaN scores would
// look like a row with no visible key.
inline float max_keep_nan(float m, float x) { return m < x || x != x ? x : m; }

// A rows x cols matrix transposed (cols x rows).
std::vector<float> transposed(const float* a, int rows, int cols) {
    std::vector<float> t(static_cast<size_t>(rows) * cols);
    for (int r = 0; r < rows; ++r)
        for (int c = 0; c < cols; ++c) t[static_cast<size_t>(c) * rows + r] = a[static_cast<size_t>(r) * cols + c];
    return t;
}

// out[0..n) = x[0..k) . B (k x n, row-major), accumulated over k in order; with tf32, each x[t]
// is rounded as a tensor core reads it (B is rounded by the caller, once).
inline void row_times_matrix(const float* x, const float* B, int k, int n, float* out, bool tf32 = false) {
    std::fill_n(out, n, 0.f);
    for (int t = 0; t < k; ++t) {
        const float xt = tf32 ? round_tf32(x[t]) : x[t];
        const float* Bt = B + static_cast<size_t>(t) * n;
        for (int c = 0; c < n; ++c) out[c] += xt * Bt[c];
    }
}

// y[i] += a x[i] for i in [0, n).
inline void axpy(float a, const float* x, float* y, int n) {
    for (int i = 0; i < n; ++i) y[i] += a * x[i];
}

// out[i] += x[i] for i in [0, n).
inline void add_to(float* out, const float* x, int n) {
    for (int i = 0; i < n; ++i) out[i] += x[i];
}

// out[i] *= s for i in [0, n).
inline void scale_by(float* out, float s, size_t n) {
    for (size_t i = 0; i < n; ++i) out[i] *= s;
}

// Rows [r0, r1) of A·Bᵀ (A: rows x k, B: n x k, both row-major) into out (row stride n): each row
// a row_times_matrix over a transposed copy of B, accumulating over k in order like a dot product.
void rows_times_transposed(const float* A, const float* B, int r0, int r1, int k, int n, float* out, bool tf32) {
    const std::vector<float> BT = transposed(B, n, k);
    for (int r = r0; r < r1; ++r)
        row_times_matrix(A + static_cast<size_t>(r) * k, BT.data(), k, n, out + static_cast<size_t>(r) * n, tf32);
}

// Rows [c0, c1) of Aᵀ·B (A: rows x cols, B: rows x n, both row-major) into out (row stride n):
// out[c] = sum_r A[r][c] B[r], accumulated over r in order. Reads A's rows in order, so no
// transposed copy of A.
void transposed_times_matrix(const float* A, const float* B, int rows, int cols, int c0, int c1, int n, float* out,
                             bool tf32) {
    std::fill(out + static_cast<size_t>(c0) * n, out + static_cast<size_t>(c1) * n, 0.f);
    for (int r = 0; r < rows; ++r) {
        const float* Ar = A + static_cast<size_t>(r) * cols;
        const float* Br = B + static_cast<size_t>(r) * n;
        for (int c = c0; c < c1; ++c) axpy(tf32 ? round_tf32(Ar[c]) : Ar[c], Br, out + static_cast<size_t>(c) * n, n);
    }
}

// sum_i x[i] y[i], in order.
inline float dot(const float* x, const float* y, int n) {
    float s = 0.f;
    for (int i = 0; i < n; ++i) s += x[i] * y[i];
    return s;
}

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

// The per-head matrices of one stage inside a group buffer.
struct View {
    float* base;
    size_t per_head;
    float* head(int h) const { return base + per_head * h; }
};

// The group's inputs as the GEMMs read them (rounded copies for TF32).
struct Operands {
    const float *q, *k, *v, *dout;
    // Head h's matrix of input stage s.
    const float* head(Stage s, const Dims& d, size_t h) const {
        const float* base = s == Stage::Q ? q : s == Stage::K ? k : s == Stage::V ? v : dout;
        return base + stage_elems(s, d) * h;
    }
};

// Runs fn(h, r) for every row r in [0, rows) of every head h in [0, heads).
template <typename Fn>
void parallel_rows(int heads, int rows, Fn fn) {
    parallel_for(static_cast<size_t>(heads) * rows, [&](size_t hr) {
        fn(static_cast<int>(hr / rows), static_cast<int>(hr % rows));
    });
}

// Runs fn(h, r0, r1) for every block [r0, r1) of kRowBlock rows of every head h.
template <typename Fn>
void parallel_row_blocks(int heads, int rows, Fn fn) {
    parallel_for(static_cast<size_t>(heads) * row_blocks(rows), [&](size_t item) {
        const int r0 = static_cast<int>(item % row_blocks(rows)) * kRowBlock;
        fn(static_cast<int>(item / row_blocks(rows)), r0, std::min(rows, r0 + kRowBlock));
    });
}

// out[h] = A[h]·B[h]ᵀ (N×M, inner dimension k) for every head of the group, A and B input stages
// (QK = Q·Kᵀ, dP = dO·Vᵀ). Items are (head, block of kRowBlock rows); each makes its own
// transposed copy of B, 1/kRowBlock of its arithmetic.
void gemm_abt_heads(const Operands& in, Stage A, Stage B, const Dims& d, int heads, int k, const View& out) {
    parallel_row_blocks(heads, d.N, [&](int h, int r0, int r1) {
        rows_times_transposed(in.head(A, d, h), in.head(B, d, h), r0, r1, k, d.M, out.head(h), false);
    });
}

// D[h·N + r] = dO_r · O_r (width dv) for every query row of every head of the group, from dO as
// read (not a GEMM operand): the D stage, and the flash backward's preprocess.
void row_dots_do_o(const HeadGroup& g, const Dims& d, const View& O, float* D) {
    parallel_rows(g.count, d.N, [&](int h, int r) {
        D[static_cast<size_t>(h) * d.N + r] = dot(g.dout + stage_elems(Stage::dO, d) * h + static_cast<size_t>(r) * d.dv,
                                                  O.head(h) + static_cast<size_t>(r) * d.dv, d.dv);
    });
}

// The half pipelines store each stage in the format as soon as it is computed, so the stages after
// it compute from the stored values (the row statistics, kept_float32, stay float32).
void store_in_format(const Problem& p, StageSet stages, HeadGroup& g) {
    constexpr size_t kBlock = 1 << 16;
    for (int j = 0; j < kNumStages; ++j) {
        const Stage t = static_cast<Stage>(j);
        if (!stages.has(t) || kept_float32(t) || !g.out[j]) continue;
        const size_t n = stage_elems(t, p.dims) * g.count;
        parallel_for((n + kBlock - 1) / kBlock, [&](size_t blk) {
            float* x = g.out[j] + blk * kBlock;
            std::transform(x, x + std::min(kBlock, n - blk * kBlock), x, [&](float v) { return round_to(p.precision, v); });
        });
    }
}

class CpuBackend : public Backend {
public:
    const char* name() const override { return "cpu"; }
    std::string device_name() const override {
        return "host CPU (" + plural(std::max(1u, std::thread::hardware_concurrency()), "thread") + ")";
    }
    FlashPlan flash_plan(const Problem&) const override { return {kFlashBr, kFlashBc, "cpu-tiled"}; }
    StageSet half_flash_stages(const Problem&) const override { return StageSet::flash(); }  // emulated
    size_t working_bytes_per_head(const Problem& p, StageSet computed) const override {
        // TF32 keeps rounded copies of the inputs; the flash backward keeps D (N floats); the
        // flash tiles' scratch is per thread, not per head, and small enough to ignore.
        const Dims& d = p.dims;
        size_t floats = computed.has(Stage::flash_dQ) ? static_cast<size_t>(d.N) : 0;
        if (p.precision == Precision::tf32 && computed.any(kGemmStages))
            for (Stage s : {Stage::Q, Stage::K, Stage::V, Stage::dO})
                if (s != Stage::dO || computed.any_backward()) floats += stage_elems(s, d);
        return floats * sizeof(float);
    }
    size_t available_bytes() const override { return host_budget_bytes(); }
    void compute(const Problem& p, StageSet computed, HeadGroup& g, StageTimes* times) override;

private:
    // The stages whose arithmetic reads the TF32-rounded operands.
    static constexpr StageSet kGemmStages{stage_mask(Stage::QK, Stage::output, Stage::flash_output, Stage::dP,
                                                     Stage::dQ, Stage::dK, Stage::dV, Stage::flash_dQ)};
    void run_stage(Stage s, const Problem& p, HeadGroup& g, const Operands& in);
    void run_backward_stage(Stage s, const Problem& p, HeadGroup& g, const Operands& in);
    void flash(const Problem& p, HeadGroup& g, const Operands& in);
    void flash_backward(const Problem& p, HeadGroup& g, const Operands& in);
};

void CpuBackend::compute(const Problem& p, StageSet computed, HeadGroup& g, StageTimes* times) {
    const Dims& d = p.dims;
    if (p.poison)
        for (int i = 0; i < kNumStages; ++i) {
            Stage s = static_cast<Stage>(i);
            if (computed.has(s) && g.out[i])
                std::fill_n(g.out[i], stage_elems(s, d) * g.count, std::numeric_limits<float>::quiet_NaN());
        }
    if (computed.any_backward() && !g.dout)
        fail(kExitInternal, where(__FILE__, __LINE__) + ": a backward stage without dO");
    // GEMM operands, rounded once per group for TF32.
    Operands in{g.q, g.k, g.v, g.dout};
    std::vector<float> rounded_copies[4];
    if (p.precision == Precision::tf32) {
        const float** operand[] = {&in.q, &in.k, &in.v, &in.dout};
        const Stage stage[] = {Stage::Q, Stage::K, Stage::V, Stage::dO};
        for (int j = 0; j < 4; ++j) {
            if (!*operand[j]) continue;
            std::vector<float>& dst = rounded_copies[j];
            dst.resize(stage_elems(stage[j], d) * g.count);
            std::transform(*operand[j], *operand[j] + dst.size(), dst.begin(), round_tf32);
            *operand[j] = dst.data();
        }
    }
    for (int i = 0; i < kNumStages; ++i) {
        Stage s = static_cast<Stage>(i);
        // The flash stages of one pass are computed at the first of them (their time is its).
        if (!computed.has(s) || !leads_computation(s)) continue;
        if (!g.out[i]) fail(kExitInternal, where(__FILE__, __LINE__) + ": no buffer for stage " + stage_name(s));
        auto t0 = std::chrono::steady_clock::now();
        if (s == Stage::flash_output) flash(p, g, in);
        else if (s == Stage::flash_dQ) flash_backward(p, g, in);
        else if (is_backward_stage(s)) run_backward_stage(s, p, g, in);
        else run_stage(s, p, g, in);
        if (is_half(p.precision)) store_in_format(p, StageSet{computed_together(s).bits & computed.bits}, g);
        double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        if (times) times->ms[i] += ms;
    }
}

// One stage of the stage path for every head of the group.
void CpuBackend::run_stage(Stage s, const Problem& p, HeadGroup& g, const Operands& in) {
    const Dims& d = p.dims;
    const int N = d.N, M = d.M, dk = d.dk, dv = d.dv;
    View out{g.out[static_cast<int>(s)], stage_elems(s, d)};
    switch (s) {
        case Stage::Q: std::copy_n(g.q, stage_elems(s, d) * g.count, out.base); break;
        case Stage::K: std::copy_n(g.k, stage_elems(s, d) * g.count, out.base); break;
        case Stage::V: std::copy_n(g.v, stage_elems(s, d) * g.count, out.base); break;
        case Stage::KT:
            // KT[c][r] = K[r][c]; K's rows are read in order, KT's columns written in order.
            parallel_for(g.count, [&](size_t h) {
                const float* K = g.k + stage_elems(Stage::K, d) * h;
                float* KT = out.head(static_cast<int>(h));
                for (int r = 0; r < M; ++r)
                    for (int c = 0; c < dk; ++c) KT[static_cast<size_t>(c) * M + r] = K[static_cast<size_t>(r) * dk + c];
            });
            break;
        case Stage::QK:
            // QK[r][:] = sum_t Q[r][t] KT[t][:]: an axpy over a transposed copy of K vectorises
            // across columns, while each element still accumulates over t in order, like a dot.
            gemm_abt_heads(in, Stage::Q, Stage::K, d, g.count, dk, out);
            break;
        case Stage::QK_scaled: {
            const View qk{g.out[static_cast<int>(Stage::QK)], stage_elems(Stage::QK, d)};
            parallel_rows(g.count, N, [&](int h, int r) {
                const size_t row = static_cast<size_t>(r) * M;
                scale_mask_row(qk.head(h) + row, out.head(h) + row, r, M, p.scale, p.causal);
            });
            break;
        }
        case Stage::attention_weights: {
            const View sc{g.out[static_cast<int>(Stage::QK_scaled)], stage_elems(Stage::QK_scaled, d)};
            parallel_rows(g.count, N, [&](int h, int r) {
                const size_t row = static_cast<size_t>(r) * M;
                softmax_row(sc.head(h) + row, out.head(h) + row, M);
            });
            break;
        }
        case Stage::output: {
            // O[r] = sum_c P[r][c] V[c]: a running axpy over V's rows keeps every access contiguous.
            View pw{g.out[static_cast<int>(Stage::attention_weights)], stage_elems(Stage::attention_weights, d)};
            parallel_rows(g.count, N, [&](int h, int r) {
                row_times_matrix(pw.head(h) + static_cast<size_t>(r) * M, in.head(Stage::V, d, h), M, dv,
                                 out.head(h) + static_cast<size_t>(r) * dv, p.precision == Precision::tf32);
            });
            break;
        }
        default:
            fail(kExitInternal, where(__FILE__, __LINE__) + ": the CPU backend has no code for stage " + stage_name(s));
    }
}

// One backward stage of the stage path for every head of the group (docs/contract.md: D, dP, dS,
// dQ, dK, dV from dO and the forward's stages).
void CpuBackend::run_backward_stage(Stage s, const Problem& p, HeadGroup& g, const Operands& in) {
    const Dims& d = p.dims;
    const int N = d.N, M = d.M, dk = d.dk, dv = d.dv;
    const bool tf32 = p.precision == Precision::tf32;
    View out{g.out[static_cast<int>(s)], stage_elems(s, d)};
    auto stage = [&](Stage t) { return View{g.out[static_cast<int>(t)], stage_elems(t, d)}; };
    switch (s) {
        case Stage::dO: std::copy_n(g.dout, stage_elems(s, d) * g.count, out.base); break;
        case Stage::D: row_dots_do_o(g, d, stage(Stage::output), out.base); break;
        case Stage::dP: gemm_abt_heads(in, Stage::dO, Stage::V, d, g.count, dv, out); break;
        case Stage::dS: {
            // dS = P∘(dP − D), written as 0 where masked (P is 0 there, and a product could be -0).
            const View P = stage(Stage::attention_weights), dP = stage(Stage::dP), D = stage(Stage::D);
            parallel_rows(g.count, N, [&](int h, int r) {
                const size_t row = static_cast<size_t>(r) * M;
                for (int c = 0; c < M; ++c)
                    out.head(h)[row + c] = masked(p.causal, r, c) ? 0.f : P.head(h)[row + c] * (dP.head(h)[row + c] - D.head(h)[r]);
            });
            break;
        }
        case Stage::dQ: {
            const View dS = stage(Stage::dS);
            parallel_rows(g.count, N, [&](int h, int r) {
                float* row = out.head(h) + static_cast<size_t>(r) * dk;
                row_times_matrix(dS.head(h) + static_cast<size_t>(r) * M, in.head(Stage::K, d, h), M, dk, row, tf32);
                scale_by(row, p.scale, dk);
            });
            break;
        }
        case Stage::dK: {
            const View dS = stage(Stage::dS);
            parallel_row_blocks(g.count, M, [&](int h, int c0, int c1) {
                transposed_times_matrix(dS.head(h), in.head(Stage::Q, d, h), N, M, c0, c1, dk, out.head(h), tf32);
                scale_by(out.head(h) + static_cast<size_t>(c0) * dk, p.scale, static_cast<size_t>(c1 - c0) * dk);
            });
            break;
        }
        case Stage::dV: {
            const View P = stage(Stage::attention_weights);
            parallel_row_blocks(g.count, M, [&](int h, int c0, int c1) {
                transposed_times_matrix(P.head(h), in.head(Stage::dO, d, h), N, M, c0, c1, dv, out.head(h), tf32);
            });
            break;
        }
        default:
            fail(kExitInternal, where(__FILE__, __LINE__) + ": the CPU backend has no code for stage " + stage_name(s));
    }
}

// The running state of FlashAttention's online softmax for the rows of one query tile: per row
// the maximum m, the sum l and the unnormalised output O (d wide).
struct OnlineRows {
    int d;
    Precision precision;  // P rounded to TF32 or the half format as the P·V GEMM reads it
    std::vector<float> m, l, O;
    OnlineRows(int rows, int d_, Precision precision_)
        : d(d_), precision(precision_), m(rows, kNegInf), l(rows, 0.f), O(static_cast<size_t>(rows) * d_, 0.f) {}

    // Row rr takes the scaled, masked scores S[0, cols) of the keys whose values are the rows of
    // Vj: m_new = max(m, rowmax(S)), P = exp(S - m_new), l = exp(m - m_new)·l + rowsum(P),
    // O = exp(m - m_new)·O + P·Vj.
    void add(int rr, const float* S, int cols, const float* Vj) {
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
            axpy(gemm_operand(precision, pc), Vj + static_cast<size_t>(cc) * d, Or, d);
        }
        l[rr] = alpha * l[rr] + rowsum;
        m[rr] = m_new;
    }

    // O_i = diag(l)^-1 O_i and lse_i = m_i + log(l_i) into the tile's rows of the head's outputs.
    void finish(float* Oout, float* lse) const {
        for (size_t rr = 0; rr < m.size(); ++rr) {
            const float inv = 1.f / l[rr];
            for (int t = 0; t < d; ++t) Oout[rr * d + t] = O[rr * d + t] * inv;
            lse[rr] = m[rr] + std::log(l[rr]);
        }
    }
};

// FlashAttention forward (Dao et al., Algorithm 1): for each query tile Qi (Br rows), stream the
// key/value tiles Kj, Vj (Bc rows) through the online softmax (OnlineRows); never holds an N x M
// matrix. Causal tiles wholly above the diagonal are skipped; the last tiles may be partial (tail
// rows/columns are simply not visited).
void CpuBackend::flash(const Problem& p, HeadGroup& g, const Operands& in) {
    const Dims& dm = p.dims;
    const int N = dm.N, M = dm.M, d = dm.dk;
    const int Br = kFlashBr, Bc = kFlashBc;
    const int Tr = (N + Br - 1) / Br, Tc = (M + Bc - 1) / Bc;
    float* O_all = g.out[static_cast<int>(Stage::flash_output)];
    float* lse_all = g.out[static_cast<int>(Stage::flash_lse)];
    if (!lse_all) fail(kExitInternal, where(__FILE__, __LINE__) + ": no buffer for flash_lse");
    parallel_for(static_cast<size_t>(g.count) * Tr, [&](size_t item) {
        const int h = static_cast<int>(item / Tr), i = static_cast<int>(item % Tr);
        const int r0 = i * Br, rows = std::min(Br, N - r0);
        const float* Qi = in.head(Stage::Q, dm, h) + static_cast<size_t>(r0) * d;
        const float* K = in.head(Stage::K, dm, h);
        const float* V = in.head(Stage::V, dm, h);
        OnlineRows state(rows, d, p.precision);
        std::vector<float> S(static_cast<size_t>(Bc));
        for (int j = 0; j < Tc; ++j) {
            const int c0 = j * Bc, cols = std::min(Bc, M - c0);
            if (p.causal && c0 > r0 + rows - 1) break;  // this and later tiles are above the diagonal
            const std::vector<float> KjT = transposed(K + static_cast<size_t>(c0) * d, cols, d);  // d x cols
            for (int rr = 0; rr < rows; ++rr) {
                // S = scale * Qi Kjᵀ, -inf where masked
                row_times_matrix(Qi + static_cast<size_t>(rr) * d, KjT.data(), d, cols, S.data());
                for (int cc = 0; cc < cols; ++cc)
                    S[cc] = masked(p.causal, r0 + rr, c0 + cc) ? kNegInf : S[cc] * p.scale;
                state.add(rr, S.data(), cols, V + static_cast<size_t>(c0) * d);
            }
        }
        state.finish(O_all + stage_elems(Stage::flash_output, dm) * h + static_cast<size_t>(r0) * d,
                     lse_all + stage_elems(Stage::flash_lse, dm) * h + r0);
    });
}

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

// P and dS of one query row against one key tile, recomputed from the forward's lse:
// P = exp(scale·q·kᵀ − lse) (0 where masked), dP = dO·vᵀ, dS = P∘(dP − D) (0 where masked).
void recompute_row(const Problem& p, const QueryRow& row, const KeyTile& t, int d, float* P, float* dS) {
    row_times_matrix(row.q, t.KT.data(), d, t.cols, P);
    row_times_matrix(row.dout, t.VT.data(), d, t.cols, dS);
    for (int cc = 0; cc < t.cols; ++cc) {
        if (masked(p.causal, row.r, t.c0 + cc)) {
            P[cc] = dS[cc] = 0.f;
            continue;
        }
        P[cc] = std::exp(P[cc] * p.scale - row.lse);
        dS[cc] = P[cc] * (dS[cc] - row.D);
    }
}

// What the flash backward's passes read for one group: the inputs as the GEMMs read them, the
// forward's lse and the rows' D = dO·O.
struct FlashBwdInputs {
    const Problem& p;
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
// the query rows that are not wholly masked (causal: from the query tile holding row c0 on).
void key_tile_grads(const FlashBwdInputs& b, int h, int j, const View& dK, const View& dV) {
    const Problem& p = b.p;
    const int N = p.dims.N, M = p.dims.M, d = p.dims.dk, Br = kFlashBr, Bc = kFlashBc;
    const KeyTile t(b.in.head(Stage::K, p.dims, h), b.in.head(Stage::V, p.dims, h), j * Bc, std::min(Bc, M - j * Bc), d);
    float* dKj = dK.head(h) + static_cast<size_t>(t.c0) * d;
    float* dVj = dV.head(h) + static_cast<size_t>(t.c0) * d;
    std::fill_n(dKj, static_cast<size_t>(t.cols) * d, 0.f);
    std::fill_n(dVj, static_cast<size_t>(t.cols) * d, 0.f);
    std::vector<float> P(Bc), dS(Bc);
    for (int r = p.causal ? t.c0 / Br * Br : 0; r < N; ++r) {
        const QueryRow row = b.row(h, r);
        recompute_row(p, row, t, d, P.data(), dS.data());
        for (int cc = 0; cc < t.cols; ++cc) {
            axpy(b.weight(P[cc]), row.dout, dVj + static_cast<size_t>(cc) * d, d);
            axpy(b.weight(dS[cc]), row.q, dKj + static_cast<size_t>(cc) * d, d);
        }
    }
    scale_by(dKj, p.scale, static_cast<size_t>(t.cols) * d);
}

// Pass 2 for query tile i of head h: dQ_i = scale·sum_j dS_ij K_j, over the key tiles not wholly
// masked.
void query_tile_grads(const FlashBwdInputs& b, int h, int i, const View& dQ) {
    const Problem& p = b.p;
    const int N = p.dims.N, M = p.dims.M, d = p.dims.dk, Br = kFlashBr, Bc = kFlashBc;
    const int Tc = (M + Bc - 1) / Bc;
    const int r0 = i * Br, rows = std::min(Br, N - r0);
    float* dQi = dQ.head(h) + static_cast<size_t>(r0) * d;
    std::fill_n(dQi, static_cast<size_t>(rows) * d, 0.f);
    std::vector<float> P(Bc), dS(Bc), part(d);
    for (int j = 0; j < Tc; ++j) {
        const int c0 = j * Bc;
        if (p.causal && c0 > r0 + rows - 1) break;  // this and later tiles are above the diagonal
        const KeyTile t(b.in.head(Stage::K, p.dims, h), b.in.head(Stage::V, p.dims, h), c0, std::min(Bc, M - c0), d);
        for (int rr = 0; rr < rows; ++rr) {
            recompute_row(p, b.row(h, r0 + rr), t, d, P.data(), dS.data());
            if (is_half(p.precision))  // dS rounded to the format before dS·K
                std::transform(dS.begin(), dS.begin() + t.cols, dS.begin(), [&](float x) { return b.weight(x); });
            row_times_matrix(dS.data(), t.K, t.cols, d, part.data(), p.precision == Precision::tf32);
            add_to(dQi + static_cast<size_t>(rr) * d, part.data(), d);
        }
    }
    scale_by(dQi, p.scale, static_cast<size_t>(rows) * d);
}

// FlashAttention-2 backward (Dao, Algorithm 2) in its deterministic two-pass form, as the GPU runs
// it: D = rowsum(dO∘O) first; then one pass over key tiles, each accumulating its dK_j and dV_j
// over the query tiles it is visible to, and one pass over query tiles, each accumulating its dQ_i
// over the key tiles. P is recomputed tile by tile from Q, K and flash_lse, so no N x M buffer;
// every sum has one owner, so the result does not depend on the thread schedule.
void CpuBackend::flash_backward(const Problem& p, HeadGroup& g, const Operands& in) {
    const Dims& dm = p.dims;
    const int Tr = (dm.N + kFlashBr - 1) / kFlashBr, Tc = (dm.M + kFlashBc - 1) / kFlashBc;
    auto view = [&](Stage s) { return View{g.out[static_cast<int>(s)], stage_elems(s, dm)}; };
    const View O = view(Stage::flash_output), lse = view(Stage::flash_lse), dQ = view(Stage::flash_dQ),
               dK = view(Stage::flash_dK), dV = view(Stage::flash_dV);
    if (!O.base || !lse.base || !dK.base || !dV.base)
        fail(kExitInternal, where(__FILE__, __LINE__) + ": the flash backward without its buffers");
    std::vector<float> D(static_cast<size_t>(g.count) * dm.N);
    row_dots_do_o(g, dm, O, D.data());  // preprocess: D_r = dO_r · O_r
    const FlashBwdInputs b{p, in, lse, D};
    parallel_for(static_cast<size_t>(g.count) * Tc, [&](size_t item) {
        key_tile_grads(b, static_cast<int>(item / Tc), static_cast<int>(item % Tc), dK, dV);
    });
    parallel_for(static_cast<size_t>(g.count) * Tr, [&](size_t item) {
        query_tile_grads(b, static_cast<int>(item / Tr), static_cast<int>(item % Tr), dQ);
    });
}

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace attnstep
