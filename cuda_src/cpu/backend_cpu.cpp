// backend_cpu.cpp — the CPU backend: the same stages as the CUDA backend in plain C++, float32
// arithmetic throughout (accumulating in float as the GPU does, so the verifier's tolerance model
// applies unchanged), and the same tiled online-softmax algorithm for the flash stages.
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

// A rows x cols matrix transposed (cols x rows).
std::vector<float> transposed(const float* a, int rows, int cols) {
    std::vector<float> t(static_cast<size_t>(rows) * cols);
    for (int r = 0; r < rows; ++r)
        for (int c = 0; c < cols; ++c) t[static_cast<size_t>(c) * rows + r] = a[static_cast<size_t>(r) * cols + c];
    return t;
}

// out[0..n) = x[0..k) . B (k x n, row-major), accumulated over k in order.
inline void row_times_matrix(const float* x, const float* B, int k, int n, float* out) {
    std::fill_n(out, n, 0.f);
    for (int t = 0; t < k; ++t) {
        const float xt = x[t];
        const float* Bt = B + static_cast<size_t>(t) * n;
        for (int c = 0; c < n; ++c) out[c] += xt * Bt[c];
    }
}

// The per-head matrices of one stage inside a group buffer.
struct View {
    float* base;
    size_t per_head;
    float* head(int h) const { return base + per_head * h; }
};

class CpuBackend : public Backend {
public:
    const char* name() const override { return "cpu"; }
    std::string device_name() const override {
        return "host CPU (" + std::to_string(std::max(1u, std::thread::hardware_concurrency())) + " threads)";
    }
    FlashPlan flash_plan(const Problem&) const override { return {kFlashBr, kFlashBc, "cpu-tiled"}; }
    size_t working_bytes_per_head(const Problem& p, StageSet computed) const override {
        // TF32 keeps rounded copies of Q, K, V; the flash tiles' scratch is per thread, not per
        // head, and small enough to ignore.
        const Dims& d = p.dims;
        bool gemm = computed.has(Stage::QK) || computed.has(Stage::output) || computed.any_flash();
        if (p.precision != Precision::tf32 || !gemm) return 0;
        return (static_cast<size_t>(d.N) * d.dk + static_cast<size_t>(d.M) * (d.dk + d.dv)) * sizeof(float);
    }
    size_t available_bytes() const override { return host_budget_bytes(); }
    void compute(const Problem& p, StageSet computed, HeadGroup& g, StageTimes* times) override;

private:
    void run_stage(Stage s, const Problem& p, HeadGroup& g, const float* q, const float* k, const float* v);
    void flash(const Problem& p, HeadGroup& g, const float* q, const float* k, const float* v);
};

void CpuBackend::compute(const Problem& p, StageSet computed, HeadGroup& g, StageTimes* times) {
    const Dims& d = p.dims;
    if (p.poison)
        for (int i = 0; i < kNumStages; ++i) {
            Stage s = static_cast<Stage>(i);
            if (computed.has(s) && g.out[i])
                std::fill_n(g.out[i], stage_elems(s, d) * g.count, std::numeric_limits<float>::quiet_NaN());
        }
    // GEMM operands, rounded once per group for TF32.
    const float *q = g.q, *k = g.k, *v = g.v;
    std::vector<float> qr, kr, vr;
    if (p.precision == Precision::tf32) {
        auto rounded = [](const float* src, size_t n, std::vector<float>& dst) {
            dst.resize(n);
            std::transform(src, src + n, dst.begin(), round_tf32);
            return dst.data();
        };
        q = rounded(g.q, stage_elems(Stage::Q, d) * g.count, qr);
        k = rounded(g.k, stage_elems(Stage::K, d) * g.count, kr);
        v = rounded(g.v, stage_elems(Stage::V, d) * g.count, vr);
    }
    for (int i = 0; i < kNumStages; ++i) {
        Stage s = static_cast<Stage>(i);
        if (!computed.has(s) || s == Stage::flash_lse) continue;  // flash_lse comes with flash_output
        if (!g.out[i]) fail(kExitInternal, where(__FILE__, __LINE__) + ": no buffer for stage " + stage_name(s));
        auto t0 = std::chrono::steady_clock::now();
        if (s == Stage::flash_output) flash(p, g, q, k, v);
        else run_stage(s, p, g, q, k, v);
        double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        if (times) times->ms[i] += ms;
    }
}

// One stage of the stage path for every head of the group.
void CpuBackend::run_stage(Stage s, const Problem& p, HeadGroup& g, const float* q, const float* k,
                           const float* v) {
    const Dims& d = p.dims;
    const int N = d.N, M = d.M, dk = d.dk, dv = d.dv;
    const size_t rows_all = static_cast<size_t>(g.count) * N;
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
            // Items are (head, block of kRowBlock rows); each makes its own KT copy, 1/kRowBlock of
            // its arithmetic.
            parallel_for(static_cast<size_t>(g.count) * row_blocks(N), [&](size_t item) {
                const size_t h = item / row_blocks(N);
                const int r0 = static_cast<int>(item % row_blocks(N)) * kRowBlock, r1 = std::min(N, r0 + kRowBlock);
                std::vector<float> KT = transposed(k + stage_elems(Stage::K, d) * h, M, dk);
                for (int r = r0; r < r1; ++r)
                    row_times_matrix(q + stage_elems(Stage::Q, d) * h + static_cast<size_t>(r) * dk, KT.data(), dk, M,
                                     out.head(static_cast<int>(h)) + static_cast<size_t>(r) * M);
            });
            break;
        case Stage::QK_scaled: {
            View qk{g.out[static_cast<int>(Stage::QK)], stage_elems(Stage::QK, d)};
            parallel_for(rows_all, [&](size_t hr) {
                size_t h = hr / N, r = hr % N;
                const float* src = qk.head(static_cast<int>(h)) + r * M;
                float* row = out.head(static_cast<int>(h)) + r * M;
                for (int c = 0; c < M; ++c)
                    row[c] = masked(p.causal, static_cast<int>(r), c) ? kNegInf : src[c] * p.scale;
            });
            break;
        }
        case Stage::attention_weights: {
            // Row softmax: P = exp(S - rowmax(S)) / rowsum; masked entries are exp(-inf) = 0 exactly.
            View sc{g.out[static_cast<int>(Stage::QK_scaled)], stage_elems(Stage::QK_scaled, d)};
            parallel_for(rows_all, [&](size_t hr) {
                size_t h = hr / N, r = hr % N;
                const float* S = sc.head(static_cast<int>(h)) + r * M;
                float* P = out.head(static_cast<int>(h)) + r * M;
                float m = kNegInf;
                for (int c = 0; c < M; ++c) m = std::max(m, S[c]);
                float l = 0.f;
                for (int c = 0; c < M; ++c) {
                    P[c] = S[c] == kNegInf ? 0.f : std::exp(S[c] - m);
                    l += P[c];
                }
                float inv = 1.f / l;
                for (int c = 0; c < M; ++c) P[c] *= inv;
            });
            break;
        }
        case Stage::output: {
            // O[r] = sum_c P[r][c] V[c]: a running axpy over V's rows keeps every access contiguous.
            View pw{g.out[static_cast<int>(Stage::attention_weights)], stage_elems(Stage::attention_weights, d)};
            bool tf32 = p.precision == Precision::tf32;
            parallel_for(rows_all, [&](size_t hr) {
                size_t h = hr / N, r = hr % N;
                const float* P = pw.head(static_cast<int>(h)) + r * M;
                const float* V = v + stage_elems(Stage::V, d) * h;
                float* O = out.head(static_cast<int>(h)) + r * dv;
                std::fill_n(O, dv, 0.f);
                for (int c = 0; c < M; ++c) {
                    float w = tf32 ? round_tf32(P[c]) : P[c];
                    const float* Vc = V + static_cast<size_t>(c) * dv;
                    for (int j = 0; j < dv; ++j) O[j] += w * Vc[j];
                }
            });
            break;
        }
        default:
            fail(kExitInternal, where(__FILE__, __LINE__) + ": the CPU backend has no code for stage " + stage_name(s));
    }
}

// FlashAttention forward (Dao et al., Algorithm 1): for each query tile Qi (Br rows), stream the
// key/value tiles Kj, Vj (Bc rows) keeping a running row max m, row sum l and unnormalised output;
// never holds an N x M matrix. Causal tiles wholly above the diagonal are skipped; the last tiles
// may be partial (tail rows/columns are simply not visited).
void CpuBackend::flash(const Problem& p, HeadGroup& g, const float* q, const float* k, const float* v) {
    const Dims& dm = p.dims;
    const int N = dm.N, M = dm.M, d = dm.dk;
    const int Br = kFlashBr, Bc = kFlashBc;
    const int Tr = (N + Br - 1) / Br, Tc = (M + Bc - 1) / Bc;
    const bool tf32 = p.precision == Precision::tf32;
    float* O_all = g.out[static_cast<int>(Stage::flash_output)];
    float* lse_all = g.out[static_cast<int>(Stage::flash_lse)];
    if (!lse_all) fail(kExitInternal, where(__FILE__, __LINE__) + ": no buffer for flash_lse");
    parallel_for(static_cast<size_t>(g.count) * Tr, [&](size_t item) {
        const int h = static_cast<int>(item / Tr), i = static_cast<int>(item % Tr);
        const int r0 = i * Br, rows = std::min(Br, N - r0);
        const float* Qi = q + stage_elems(Stage::Q, dm) * h + static_cast<size_t>(r0) * d;
        const float* K = k + stage_elems(Stage::K, dm) * h;
        const float* V = v + stage_elems(Stage::V, dm) * h;
        std::vector<float> m(rows, kNegInf), l(rows, 0.f), O(static_cast<size_t>(rows) * d, 0.f),
            S(static_cast<size_t>(Bc));
        for (int j = 0; j < Tc; ++j) {
            const int c0 = j * Bc, cols = std::min(Bc, M - c0);
            if (p.causal && c0 > r0 + rows - 1) break;  // this and later tiles are above the diagonal
            const std::vector<float> KjT = transposed(K + static_cast<size_t>(c0) * d, cols, d);  // d x cols
            for (int rr = 0; rr < rows; ++rr) {
                const int r = r0 + rr;
                // S = scale * Qi Kjᵀ (masked -> -inf), m_new = max(m, rowmax(S))
                float m_new = m[rr];
                row_times_matrix(Qi + static_cast<size_t>(rr) * d, KjT.data(), d, cols, S.data());
                for (int cc = 0; cc < cols; ++cc) {
                    S[cc] = masked(p.causal, r, c0 + cc) ? kNegInf : S[cc] * p.scale;
                    m_new = std::max(m_new, S[cc]);
                }
                if (m_new == kNegInf) continue;  // nothing visible yet in this row
                // P = exp(S - m_new); l = exp(m - m_new) l + rowsum(P); O = exp(m - m_new) O + P Vj
                const float alpha = m[rr] == kNegInf ? 0.f : std::exp(m[rr] - m_new);
                float* Or = O.data() + static_cast<size_t>(rr) * d;
                for (int t = 0; t < d; ++t) Or[t] *= alpha;
                float rowsum = 0.f;
                for (int cc = 0; cc < cols; ++cc) {
                    const float pc = S[cc] == kNegInf ? 0.f : std::exp(S[cc] - m_new);
                    rowsum += pc;
                    const float w = tf32 ? round_tf32(pc) : pc;
                    const float* Vc = V + static_cast<size_t>(c0 + cc) * d;
                    for (int t = 0; t < d; ++t) Or[t] += w * Vc[t];
                }
                l[rr] = alpha * l[rr] + rowsum;
                m[rr] = m_new;
            }
        }
        // O_i = diag(l)^-1 O_i, lse_i = m_i + log(l_i)
        float* Oout = O_all + stage_elems(Stage::flash_output, dm) * h + static_cast<size_t>(r0) * d;
        float* lse = lse_all + stage_elems(Stage::flash_lse, dm) * h + r0;
        for (int rr = 0; rr < rows; ++rr) {
            const float inv = 1.f / l[rr];
            for (int t = 0; t < d; ++t) Oout[static_cast<size_t>(rr) * d + t] = O[static_cast<size_t>(rr) * d + t] * inv;
            lse[rr] = m[rr] + std::log(l[rr]);
        }
    });
}

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace attnstep
