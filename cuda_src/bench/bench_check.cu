// bench_check.cu — `main --bench --check`: each flash kernel's output and lse on sampled rows
// against a float64 host computation, so that a fast but wrong kernel is caught. At bf16/fp16 the
// reference starts from the inputs rounded to the format (what the kernels multiply), so the error
// measured is the kernel's own, not the inputs' conversion. The scores go through the variant
// (ReferenceScores: the softcap, ALiBi, the mask rule), and a query head reads its K/V head's
// inputs as generated, not the copies the kernels read: a wrong copy shows.
//
// The check stays cheap at any size: two heads (the first and the last), 16 sampled rows each
// plus the tile edges, each row over its visible keys (--check-rows 0: every row of every head).
#include <algorithm>
#include <cmath>
#include <vector>

#include "bench_parts.cuh"

namespace attnstep {
namespace bench {

namespace {

constexpr double kFp32CheckTol = 1e-4;  // a plain FP32 kernel lands near 1e-6 on these inputs
constexpr double kTf32CheckTol = 5e-3;  // TF32 operands: ~3e-4 expected

// bf16/fp16, as multiples of the format's unit roundoff u (2^-8 bf16, 2^-11 fp16: half an ulp
// relative to the value), against max|ref| of the head: O is stored in the format (at most u·|O|),
// P = exp(S − m) is rounded to the format before P·V (u relative to each term; the terms' signs
// vary with V's, so their sum stays near u·max|O| rather than the worst case u·max|V|), and 2u more
// for float32 accumulation in any order and the online softmax's rescaling. A NumPy model of those
// roundings on these inputs (B = 1, N = M = 127 and 4096, d 64 and 128, causal or not) lands at
// 0.5–1.1 u, so 4 u is headroom, while a wrong mask, tile or scale is off by far more.
constexpr double kHalfCheckUnits = 4;
constexpr int kHalfSignificantBits[] = {0, 0, 8, 11};  // by Precision: bf16 8, fp16 11


struct HostInputs {
    std::vector<float> q, k, v;  // one query head, and its K/V head
};

// Query head `head`'s Q and its K/V head's K and V, as generated (float32).
void copy_head(const Options& o, const BenchInputs& in, int head, HostInputs* h) {
    const int kv = bench_dims(o).kv_head_of(head);
    h->q.resize(size_t(o.N) * o.d);
    h->k.resize(size_t(o.M) * o.d);
    h->v.resize(size_t(o.M) * o.d);
    CUDA_CHECK(cudaMemcpy(h->q.data(), in.Q.p + size_t(head) * o.N * o.d, h->q.size() * 4, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(h->k.data(), in.K.p + size_t(kv) * o.M * o.d, h->k.size() * 4, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(h->v.data(), in.V.p + size_t(kv) * o.M * o.d, h->v.size() * 4, cudaMemcpyDeviceToHost));
}

// The inputs as the kernels of o's precision read them: rounded to bf16/fp16 (nearest even, as
// the CUDA conversions), unchanged at fp32 and tf32 (TF32 rounding is the kernel's error).
void round_inputs(const Options& o, HostInputs* h) {
    for (std::vector<float>* x : {&h->q, &h->k, &h->v})
        for (float& e : *x) e = round_to(o.precision, e);
}

// Reference row r: o = softmax(s_r)·V over the keys row r sees, lse = log Σ exp(s_r); a row that
// sees no key has o = 0 and lse = -inf.
void reference_row(const Options& o, const HostInputs& h, const ReferenceScores& score, int r,
                   std::vector<double>* out, double* lse) {
    const long long first = score.rule.first_key(r), end = score.rule.end_key(r, o.M);
    out->assign(o.d, 0.0);
    *lse = -INFINITY;
    if (first >= end) return;
    std::vector<double> s(end - first);
    double mx = -INFINITY;
    for (long long j = first; j < end; ++j) {
        double acc = 0;
        for (int c = 0; c < o.d; ++c) acc += double(h.q[size_t(r) * o.d + c]) * h.k[size_t(j) * o.d + c];
        s[j - first] = score(acc, r, j);
        mx = std::max(mx, s[j - first]);
    }
    double l = 0;
    for (long long j = first; j < end; ++j) {
        const double p = std::exp(s[j - first] - mx);
        l += p;
        for (int c = 0; c < o.d; ++c) (*out)[c] += p * h.v[size_t(j) * o.d + c];
    }
    for (double& x : *out) x /= l;
    *lse = mx + std::log(l);
}

// The lse error of a row, relative to max(1, |ref|); a row that sees no key must hold -inf (or
// +inf, which flash-attn stores there): its error is then 0, else infinite.
double lse_error(double got, double want) {
    if (std::isinf(want)) return std::isinf(got) ? 0.0 : INFINITY;
    return std::isfinite(got) ? std::fabs(got - want) / std::max(1.0, std::fabs(want)) : INFINITY;
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

std::vector<int> heads_to_check(const Options& o, int n) {
    std::vector<int> heads;
    if (o.check_rows == 0) for (int h = 0; h < n; ++h) heads.push_back(h);
    else {
        heads.push_back(0);
        if (n > 1) heads.push_back(n - 1);
    }
    return heads;
}

double check_tolerance(const Options& o) {
    if (is_half(o.precision))
        return kHalfCheckUnits * std::ldexp(1.0, -kHalfSignificantBits[static_cast<int>(o.precision)]);
    return o.precision == Precision::tf32 ? kTf32CheckTol : kFp32CheckTol;
}

double inputs_checksum(const Options& o, const BenchInputs& in, int total_heads) {
    HostInputs h;
    double sum = 0;
    for (int head : heads_to_check(o, total_heads)) {
        copy_head(o, in, head, &h);
        for (const std::vector<float>* x : {&h.q, &h.k, &h.v})
            for (size_t j = 0; j < x->size(); ++j) sum += double((*x)[j]) * double(j % 251 + 1);
    }
    return sum;
}

ReferenceScores::ReferenceScores(const Options& o, int head)
    : rule(mask_rule(o)), scale(o.scale), cap(o.variant.softcap), slope(bench_slope(o, head)) {}

double ReferenceScores::operator()(double qk, long long r, long long c) const {
    double s = scale * qk;
    if (cap > 0) s = cap * std::tanh(s / cap);
    const long long dist = r + rule.offset - c;
    return s - slope * static_cast<double>(dist < 0 ? -dist : dist);
}

double ReferenceScores::cap_derivative(double qk) const {
    if (!(cap > 0)) return 1.0;
    const double t = std::tanh(scale * qk / cap);
    return 1.0 - t * t;
}

void check_flash(const Options& o, const BenchInputs& in, const DeviceBuffer& O, const DeviceBuffer& lse,
                 int total_heads, Result* r) {
    const std::vector<int> rows = sample_rows(o, o.N);
    HostInputs h;
    std::vector<double> ref;
    double worst = 0, worst_lse = 0;
    bool finite = true;
    // Normwise relative errors (elementwise ratios blow up where the output crosses 0): per row at
    // fp32/tf32; per head at bf16/fp16, max|err| / max|ref| over its checked rows, the measure
    // verify/bench/accuracy.py applies to PyTorch's output on the same rows.
    const bool per_head = is_half(o.precision);
    for (int head : heads_to_check(o, total_heads)) {
        copy_head(o, in, head, &h);
        round_inputs(o, &h);
        const ReferenceScores score(o, head);
        std::vector<float> ohead(size_t(o.N) * o.d), lhead(o.N);
        CUDA_CHECK(cudaMemcpy(ohead.data(), O.p + size_t(head) * o.N * o.d, ohead.size() * 4, cudaMemcpyDeviceToHost));
        CUDA_CHECK(cudaMemcpy(lhead.data(), lse.p + size_t(head) * o.N, lhead.size() * 4, cudaMemcpyDeviceToHost));
        double err = 0, mag = 0;  // max|err| and max|ref| of the row, or of the head so far
        auto close_norm = [&] {
            worst = std::max(worst, err / std::max(mag, 1e-30));
            err = mag = 0;
        };
        for (int row : rows) {
            double ref_lse = 0;
            reference_row(o, h, score, row, &ref, &ref_lse);
            for (int c = 0; c < o.d; ++c) {
                const double x = ohead[size_t(row) * o.d + c];
                if (!std::isfinite(x)) finite = false;
                err = std::max(err, std::fabs(x - ref[c]));
                mag = std::max(mag, std::fabs(ref[c]));
            }
            if (!per_head) close_norm();
            worst_lse = std::max(worst_lse, lse_error(lhead[row], ref_lse));
        }
        if (per_head) close_norm();
    }
    const double tol = check_tolerance(o);
    r->checked = true;
    r->max_rel_err = finite ? worst : INFINITY;
    r->max_lse_err = worst_lse;
    r->check_passed = finite && worst <= tol && worst_lse <= tol;
}

}  // namespace bench
}  // namespace attnstep
