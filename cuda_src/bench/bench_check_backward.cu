// bench_check_backward.cu — `main --bench --check` for the backward rows: dQ, dK, dV of sampled
// rows of the checked heads against a float64 host computation of the true gradients (from Q, K,
// V and dO alone, not from any kernel's intermediate), so that a fast but wrong backward is caught.
//
// dQ of a query row needs its own row of P and dS; a row of dK or dV (a key) needs that key's
// column of P and dS, so every row's log-sum-exp and D = rowsum(dO∘O) first: one pass over the
// whole N×M product per head, spread over the host's cores (at N = M = 16384, d = 128 about
// 7e10 multiply-adds per checked head).
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

// One head's float64 gradients on its sampled query rows (dQ) and key rows (dK, dV).
struct HeadReference {
    std::vector<int> rows[kGrads];     // dQ's query rows; dK's and dV's key rows
    std::vector<double> grad[kGrads];  // rows[i].size() × d each
};

struct BackwardReference::Impl {
    const Options& o;
    const BackwardInputs& in;
    std::map<int, HeadReference> heads;

    HeadReference compute(int head) const;
};

BackwardReference::BackwardReference(const Options& o, const BackwardInputs& in)
    : impl_(new Impl{o, in, {}}) {}

BackwardReference::~BackwardReference() = default;

HeadReference BackwardReference::Impl::compute(int head) const {
    const int N = o.N, M = o.M, d = o.d;
    const double scale = o.scale;
    const std::vector<float> q = head_of(in.Q, head, size_t(N) * d), k = head_of(in.K, head, size_t(M) * d),
                             v = head_of(in.V, head, size_t(M) * d), dout = head_of(in.dO, head, size_t(N) * d);
    auto visible = [&](int r) { return o.causal ? std::min(M, r + 1) : M; };  // top-left causal
    auto s_at = [&](int r, int j) { return scale * dot(&q[size_t(r) * d], &k[size_t(j) * d], d); };
    // Every row's lse and D = dO_r · O_r, with O_r = softmax(s_r) · V in float64.
    std::vector<double> lse(N), D(N);
    parallel_for(N, [&](int r) {
        const int n = visible(r);
        std::vector<double> s(n), out(d, 0.0);
        double mx = -INFINITY, l = 0;
        for (int j = 0; j < n; ++j) mx = std::max(mx, s[j] = s_at(r, j));
        for (int j = 0; j < n; ++j) {
            const double p = std::exp(s[j] - mx);
            l += p;
            for (int c = 0; c < d; ++c) out[c] += p * v[size_t(j) * d + c];
        }
        lse[r] = mx + std::log(l);
        double dr = 0;
        for (int c = 0; c < d; ++c) dr += dout[size_t(r) * d + c] * (out[c] / l);
        D[r] = dr;
    });
    // dS[r][j] = P[r][j]·(dO_r·V_j − D_r) with P[r][j] = exp(s[r][j] − lse_r).
    auto ds_at = [&](int r, int j, double* p) {
        *p = std::exp(s_at(r, j) - lse[r]);
        return *p * (dot(&dout[size_t(r) * d], &v[size_t(j) * d], d) - D[r]);
    };
    HeadReference h;
    h.rows[0] = sample_rows(o, N);
    h.rows[1] = h.rows[2] = sample_rows(o, M);
    for (int i = 0; i < kGrads; ++i) h.grad[i].assign(h.rows[i].size() * d, 0.0);
    parallel_for(static_cast<int>(h.rows[0].size()), [&](int i) {  // dQ_r = scale·Σ_j dS[r][j]·K_j
        const int r = h.rows[0][i];
        double p;
        for (int j = 0; j < visible(r); ++j) {
            const double ds = ds_at(r, j, &p);
            for (int c = 0; c < d; ++c) h.grad[0][size_t(i) * d + c] += scale * ds * k[size_t(j) * d + c];
        }
    });
    parallel_for(static_cast<int>(h.rows[1].size()), [&](int i) {  // dK_j, dV_j over the rows seeing key j
        const int j = h.rows[1][i];
        double p;
        for (int r = o.causal ? j : 0; r < N; ++r) {
            const double ds = ds_at(r, j, &p);
            for (int c = 0; c < d; ++c) {
                h.grad[1][size_t(i) * d + c] += scale * ds * q[size_t(r) * d + c];
                h.grad[2][size_t(i) * d + c] += p * dout[size_t(r) * d + c];
            }
        }
    });
    return h;
}

// Normwise over the head's sampled rows of each gradient (max |error| / max |reference|): a
// single entry of dK may be a sum of few terms that cancel, where an elementwise or row-wise ratio
// would blow up on a correct kernel.
void BackwardReference::compare(int head, const HostGrads& g, Result* r) {
    auto it = impl_->heads.find(head);
    if (it == impl_->heads.end()) it = impl_->heads.emplace(head, impl_->compute(head)).first;
    const HeadReference& h = it->second;
    const std::vector<float>* got[kGrads] = {&g.dQ, &g.dK, &g.dV};
    const int d = impl_->o.d;
    for (int i = 0; i < kGrads; ++i) {
        double err = 0, mag = 0;
        bool finite = true;
        for (size_t k = 0; k < h.rows[i].size(); ++k) {
            for (int c = 0; c < d; ++c) {
                const double x = (*got[i])[size_t(h.rows[i][k]) * d + c], want = h.grad[i][k * d + c];
                finite = finite && std::isfinite(x);
                err = std::max(err, std::fabs(x - want));
                mag = std::max(mag, std::fabs(want));
            }
        }
        const double rel = finite ? err / std::max(mag, 1e-30) : INFINITY;
        r->grad_err[i] = std::max(r->grad_err[i], rel);
        r->max_rel_err = std::max(r->max_rel_err, rel);
        if (!(rel <= check_tolerance(impl_->o))) r->check_passed = false;
    }
}

}  // namespace bench
}  // namespace attnstep
