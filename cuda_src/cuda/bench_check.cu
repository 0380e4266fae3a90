// bench_check.cu — `main --bench --check`: each flash kernel's output and lse on sampled rows
// against a float64 host computation, so that a fast but wrong kernel is caught.
#include <algorithm>
#include <cmath>
#include <vector>

#include "bench_parts.cuh"

namespace attnstep {
namespace bench {

namespace {

constexpr double kFp32CheckTol = 1e-4;  // a plain FP32 kernel lands near 1e-6 on these inputs
constexpr double kTf32CheckTol = 5e-3;  // TF32 operands: ~3e-4 expected


struct HostInputs {
    std::vector<float> q, k, v;  // one head
};

void copy_head(const Options& o, const DeviceBuffer& Q, const DeviceBuffer& K, const DeviceBuffer& V,
               int head, HostInputs* h) {
    h->q.resize(size_t(o.N) * o.d);
    h->k.resize(size_t(o.M) * o.d);
    h->v.resize(size_t(o.M) * o.d);
    CUDA_CHECK(cudaMemcpy(h->q.data(), Q.p + size_t(head) * o.N * o.d, h->q.size() * 4, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(h->k.data(), K.p + size_t(head) * o.M * o.d, h->k.size() * 4, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(h->v.data(), V.p + size_t(head) * o.M * o.d, h->v.size() * 4, cudaMemcpyDeviceToHost));
}

// Reference row r: o = softmax(scale·q_r·Kᵀ)·V over the visible keys, lse = log Σ exp(...).
void reference_row(const Options& o, const HostInputs& h, int r, std::vector<double>* out,
                   double* lse) {
    const int visible = o.causal ? std::min(o.M, r + 1) : o.M;
    std::vector<double> s(visible);
    double mx = -INFINITY;
    for (int j = 0; j < visible; ++j) {
        double acc = 0;
        for (int c = 0; c < o.d; ++c) acc += double(h.q[size_t(r) * o.d + c]) * h.k[size_t(j) * o.d + c];
        s[j] = acc * o.scale;
        mx = std::max(mx, s[j]);
    }
    double l = 0;
    out->assign(o.d, 0.0);
    for (int j = 0; j < visible; ++j) {
        const double p = std::exp(s[j] - mx);
        l += p;
        for (int c = 0; c < o.d; ++c) (*out)[c] += p * h.v[size_t(j) * o.d + c];
    }
    for (double& x : *out) x /= l;
    *lse = mx + std::log(l);
}

}  // namespace

// The first and last rows, the tile edges of every kernel's tiles (16 to 128 rows), the middle and a
// few spread ones: a kernel that mishandles a tile boundary or a tail shows at one of them.
std::vector<int> sample_rows(const Options& o, int n) {
    std::vector<int> rows;
    if (o.check_rows == 0 || o.check_rows >= n) {
        for (int r = 0; r < n; ++r) rows.push_back(r);
        return rows;
    }
    const int fixed[] = {0, 1, 15, 16, 63, 64, 127, 128, n / 2, n - 2, n - 1};
    for (int r : fixed) if (r >= 0 && r < n) rows.push_back(r);
    for (int i = 0; static_cast<int>(rows.size()) < o.check_rows + 11 && i < o.check_rows; ++i)
        rows.push_back(static_cast<int>((static_cast<long long>(i) * 7919 + 13) % n));
    std::sort(rows.begin(), rows.end());
    rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
    return rows;
}

std::vector<int> heads_to_check(const Options& o, int total_heads) {
    std::vector<int> heads;
    if (o.check_rows == 0) for (int h = 0; h < total_heads; ++h) heads.push_back(h);
    else {
        heads.push_back(0);
        if (total_heads > 1) heads.push_back(total_heads - 1);
    }
    return heads;
}

double check_tolerance(const Options& o) {
    return o.precision == Precision::tf32 ? kTf32CheckTol : kFp32CheckTol;
}

void check_flash(const Options& o, const DeviceBuffer& Q, const DeviceBuffer& K,
                 const DeviceBuffer& V, const DeviceBuffer& O, const DeviceBuffer& lse,
                 int total_heads, Result* r) {
    const std::vector<int> heads = heads_to_check(o, total_heads);
    const std::vector<int> rows = sample_rows(o, o.N);
    HostInputs h;
    std::vector<float> orow(o.d);
    std::vector<double> ref;
    double worst = 0, worst_lse = 0;
    bool finite = true;
    for (int head : heads) {
        copy_head(o, Q, K, V, head, &h);
        std::vector<float> ohead(size_t(o.N) * o.d), lhead(o.N);
        CUDA_CHECK(cudaMemcpy(ohead.data(), O.p + size_t(head) * o.N * o.d, ohead.size() * 4, cudaMemcpyDeviceToHost));
        CUDA_CHECK(cudaMemcpy(lhead.data(), lse.p + size_t(head) * o.N, lhead.size() * 4, cudaMemcpyDeviceToHost));
        for (int row : rows) {
            double ref_lse = 0;
            reference_row(o, h, row, &ref, &ref_lse);
            double err = 0, mag = 0;
            for (int c = 0; c < o.d; ++c) {
                const double x = ohead[size_t(row) * o.d + c];
                if (!std::isfinite(x)) finite = false;
                err = std::max(err, std::fabs(x - ref[c]));
                mag = std::max(mag, std::fabs(ref[c]));
            }
            // Row-normwise relative error: elementwise ratios blow up where the output crosses 0.
            worst = std::max(worst, err / std::max(mag, 1e-30));
            const double l = lhead[row];
            if (!std::isfinite(l)) finite = false;
            worst_lse = std::max(worst_lse, std::fabs(l - ref_lse) / std::max(1.0, std::fabs(ref_lse)));
        }
    }
    const double tol = check_tolerance(o);
    r->checked = true;
    r->max_rel_err = finite ? worst : INFINITY;
    r->max_lse_err = finite ? worst_lse : INFINITY;
    r->check_passed = finite && worst <= tol && worst_lse <= tol;
}

}  // namespace bench
}  // namespace attnstep
