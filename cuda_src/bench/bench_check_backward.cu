// bench_check_backward.cu — `main --bench --check` for the backward rows: dQ, dK, dV of sampled
// rows of the checked heads against a float64 host computation of the true gradients (from Q, K,
// V and dO alone, not from any kernel's intermediate), so that a fast but wrong backward is caught.
//
// dQ of a query row needs its own row of P and dS; a row of dK or dV (a key) needs that key's
// column of P and dS, so every row's log-sum-exp and D = rowsum(dO∘O) first: one pass over the
// whole N×M product per head (its visible entries), spread over the host's cores (at N = M =
// 16384, d = 128 about 7e10 multiply-adds per checked head). The scores go through the variant
// (ReferenceScores), dQ and dK through the softcap's derivative (flash-attn's convention); a K/V
// head's dK and dV are the sums of its query heads' (computed from the generated K/V heads).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <map>
#include <thread>
#include <vector>

#include "bench_parts.cuh"

namespace attnstep {
namespace bench {

namespace {

constexpr unsigned kMaxCheckThreads = 32;
constexpr int kGrads = 3;  // dQ, dK, dV

// Calls f(i) for i in [0, n) on the host's cores.
template <class F>
void parallel_for(int n, F&& f) {
    const unsigned threads = std::max(1u, std::min({std::thread::hardware_concurrency(), kMaxCheckThreads,
                                                    static_cast<unsigned>(std::max(n, 1))}));
    std::atomic<int> next{0};
    auto work = [&] {
        for (int i = next++; i < n; i = next++) f(i);
    };
    std::vector<std::thread> pool;
    for (unsigned t = 1; t < threads; ++t) pool.emplace_back(work);
    work();
    for (std::thread& t : pool) t.join();
}

double dot(const float* a, const float* b, int n) {
    double s = 0;
    for (int c = 0; c < n; ++c) s += double(a[c]) * b[c];
    return s;
}

std::vector<float> head_of(const DeviceBuffer& b, int head, size_t per_head) {
    std::vector<float> h(per_head);
    CUDA_CHECK(cudaMemcpy(h.data(), b.p + head * per_head, per_head * 4, cudaMemcpyDeviceToHost));
    return h;
}

}  // namespace

// One query head's float64 gradients on its sampled query rows (dQ) and key rows (dK, dV: its
// contribution to its K/V head's).
struct HeadReference {
    std::vector<int> rows[kGrads];     // dQ's query rows; dK's and dV's key rows
    std::vector<double> grad[kGrads];  // rows[i].size() × d each
};

struct BackwardReference::Impl {
    const Options& o;
    const BenchInputs& in;
    const DeviceBuffer& dO;
    std::map<int, HeadReference> heads;

    HeadReference compute(int head) const;
    const HeadReference& of(int head) {
        auto it = heads.find(head);
        if (it == heads.end()) it = heads.emplace(head, compute(head)).first;
        return it->second;
    }
};

BackwardReference::BackwardReference(const Options& o, const BenchInputs& in, const DeviceBuffer& dO)
    : impl_(new Impl{o, in, dO, {}}) {}

BackwardReference::~BackwardReference() = default;

namespace {

// A head's inputs on the host, its scores' rule, and every row's lse and D = dO_r·O_r in float64.
struct HeadRows {
    const Options& o;
    std::vector<float> q, k, v, dout;
    ReferenceScores score;
    std::vector<double> lse, D;

    double qk(long long r, long long j) const { return dot(&q[size_t(r) * o.d], &k[size_t(j) * o.d], o.d); }
    // dS[r][j] = P[r][j]·(dO_r·V_j − D_r) with P[r][j] = exp(s[r][j] − lse_r); *p gets P, *qk q·k.
    double ds(long long r, long long j, double* p, double* qk_rj) const {
        *qk_rj = qk(r, j);
        *p = std::exp(score(*qk_rj, r, j) - lse[r]);
        return *p * (dot(&dout[size_t(r) * o.d], &v[size_t(j) * o.d], o.d) - D[r]);
    }
};

// Row r's lse and D over the keys it sees (-inf and 0 when it sees none).
void row_statistics(HeadRows& h, int r) {
    const int d = h.o.d;
    const long long first = h.score.rule.first_key(r), end = h.score.rule.end_key(r, h.o.M);
    h.lse[r] = -INFINITY;
    h.D[r] = 0;
    if (first >= end) return;
    std::vector<double> s(end - first), out(d, 0.0);
    double mx = -INFINITY, l = 0;
    for (long long j = first; j < end; ++j) mx = std::max(mx, s[j - first] = h.score(h.qk(r, j), r, j));
    for (long long j = first; j < end; ++j) {
        const double p = std::exp(s[j - first] - mx);
        l += p;
        for (int c = 0; c < d; ++c) out[c] += p * h.v[size_t(j) * d + c];
    }
    h.lse[r] = mx + std::log(l);
    double dr = 0;
    for (int c = 0; c < d; ++c) dr += h.dout[size_t(r) * d + c] * (out[c] / l);
    h.D[r] = dr;
}

}  // namespace

// dQ_r = scale·Σ_j dS[r][j]·c'(r, j)·K_j and, for key j, dK_j = scale·Σ_r dS[r][j]·c'(r, j)·Q_r,
// dV_j = Σ_r P[r][j]·dO_r over the visible entries, c' the softcap's derivative (1 without).
HeadReference BackwardReference::Impl::compute(int head) const {
    const int N = o.N, M = o.M, d = o.d, kv = bench_dims(o).kv_head_of(head);
    const size_t qs = size_t(N) * d, ks = size_t(M) * d;
    HeadRows h{o, head_of(in.Q, head, qs), head_of(in.K, kv, ks), head_of(in.V, kv, ks), head_of(dO, head, qs),
               ReferenceScores(o, head), std::vector<double>(N), std::vector<double>(N)};
    // At bf16/fp16 the gradients of the inputs as the kernels read them: rounded to the format.
    if (is_half(o.precision))
        for (std::vector<float>* x : {&h.q, &h.k, &h.v, &h.dout})
            for (float& e : *x) e = round_to(o.precision, e);
    parallel_for(N, [&](int r) { row_statistics(h, r); });
    const double scale = o.scale;
    const MaskRule& rule = h.score.rule;
    HeadReference ref;
    ref.rows[0] = sample_rows(o, N);
    ref.rows[1] = ref.rows[2] = sample_rows(o, M);
    for (int i = 0; i < kGrads; ++i) ref.grad[i].assign(ref.rows[i].size() * d, 0.0);
    parallel_for(static_cast<int>(ref.rows[0].size()), [&](int i) {
        const int r = ref.rows[0][i];
        double p, qk;
        for (long long j = rule.first_key(r); j < rule.end_key(r, M); ++j) {
            const double g = scale * h.ds(r, j, &p, &qk) * h.score.cap_derivative(qk);
            for (int c = 0; c < d; ++c) ref.grad[0][size_t(i) * d + c] += g * h.k[size_t(j) * d + c];
        }
    });
    parallel_for(static_cast<int>(ref.rows[1].size()), [&](int i) {
        const int j = ref.rows[1][i];
        double p, qk;
        for (int r = 0; r < N; ++r) {
            if (!rule.visible(r, j)) continue;
            const double g = scale * h.ds(r, j, &p, &qk) * h.score.cap_derivative(qk);
            for (int c = 0; c < d; ++c) {
                ref.grad[1][size_t(i) * d + c] += g * h.q[size_t(r) * d + c];
                ref.grad[2][size_t(i) * d + c] += p * h.dout[size_t(r) * d + c];
            }
        }
    });
    return ref;
}

namespace {

// Folds one gradient's error into r: normwise over the sampled rows (max |error| / max
// |reference|), since a single entry of dK may be a sum of few terms that cancel, where an
// elementwise or row-wise ratio would blow up on a correct kernel.
void fold(const Options& o, const std::vector<int>& rows, const std::vector<double>& want,
          const std::vector<float>& got, int which, Result* r) {
    double err = 0, mag = 0;
    bool finite = true;
    for (size_t k = 0; k < rows.size(); ++k) {
        for (int c = 0; c < o.d; ++c) {
            const double x = got[size_t(rows[k]) * o.d + c], w = want[k * o.d + c];
            finite = finite && std::isfinite(x);
            err = std::max(err, std::fabs(x - w));
            mag = std::max(mag, std::fabs(w));
        }
    }
    const double rel = finite ? err / std::max(mag, 1e-30) : INFINITY;
    r->grad_err[which] = std::max(r->grad_err[which], rel);
    r->max_rel_err = std::max(r->max_rel_err, rel);
    if (!(rel <= check_tolerance(o))) r->check_passed = false;
}

}  // namespace

void BackwardReference::compare_dq(int head, const std::vector<float>& dQ, Result* r) {
    const HeadReference& h = impl_->of(head);
    fold(impl_->o, h.rows[0], h.grad[0], dQ, 0, r);
}

void BackwardReference::compare_kv(int kv_head, const std::vector<float>& dK, const std::vector<float>& dV,
                                   Result* r) {
    const Dims dims = bench_dims(impl_->o);
    const int group = dims.group_size();
    HeadReference sum = impl_->of(kv_head * group);
    for (int h = kv_head * group + 1; h < (kv_head + 1) * group; ++h) {
        const HeadReference& more = impl_->of(h);
        for (int i = 1; i < kGrads; ++i)
            for (size_t k = 0; k < sum.grad[i].size(); ++k) sum.grad[i][k] += more.grad[i][k];
    }
    fold(impl_->o, sum.rows[1], sum.grad[1], dK, 1, r);
    fold(impl_->o, sum.rows[2], sum.grad[2], dV, 2, r);
}

}  // namespace bench
}  // namespace attnstep
