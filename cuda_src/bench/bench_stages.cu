// bench_stages.cu — the forward's stage path of `main --bench`: KT, QK, QK_scaled,
// attention_weights and output, each timed alone over every group of heads, with the backend's own
// kernels and GEMM calls (kernels.cuh, variant_kernels.cuh, gemm.cuh) on the buffers a run would
// hand them. Rates: GB/s of bytes read + written for KT, QK_scaled and attention_weights, TFLOP/s
// of 2·N·M·d per head for the GEMMs (they compute every entry, masked or not). QK_scaled runs the
// plain kernel without a variant or with the top-left causal mask alone, else the variant's
// (softcap, ALiBi, any rule). A grouped run's stages read K and V already copied to the query
// heads (BenchInputs): kv_expand times that copy.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "../common.h"
#include "bench_parts.cuh"
#include "../cuda/half.cuh"
#include "../cuda/kernels.cuh"
#include "../cuda/variant_kernels.cuh"

namespace attnstep {
namespace bench {

namespace {

// Elements of the larger operand of each product: Q or P first, K or V second (2 bytes each).
size_t half_first_elems(const Options& o) { return std::max(size_t(o.N) * o.d, size_t(o.N) * o.M); }
size_t half_second_elems(const Options& o) { return size_t(o.M) * o.d; }

// The stage buffers of one group of G heads: KT, two N×M buffers, the output, and (bf16/fp16) the
// GEMMs' half operands.
struct StageBuffers {
    DeviceBuffer KT, A, B, O;
    HalfOperands half;
    StageBuffers(const Options& o, size_t G)
        : KT(G * o.d * o.M), A(G * o.N * o.M), B(G * o.N * o.M), O(G * o.N * o.d), half(o, int(G)) {}
};

}  // namespace

double half_operand_bytes_per_head(const Options& o) {
    return is_half(o.precision) ? 2.0 * double(half_first_elems(o) + half_second_elems(o)) : 0.0;
}

HalfOperands::HalfOperands(const Options& o, int heads) {
    if (!is_half(o.precision)) return;
    // DeviceBuffer counts floats: two half elements each, rounded up.
    a = std::make_unique<DeviceBuffer>((size_t(heads) * half_first_elems(o) + 1) / 2);
    b = std::make_unique<DeviceBuffer>((size_t(heads) * half_second_elems(o) + 1) / 2);
    gemm = HalfGemm{o.precision, a->p, b->p};
}

int stage_group(const Options& o, int total_heads) {
    return heads_that_fit(4.0 * (2.0 * o.N * o.M + static_cast<double>(o.d) * o.M + static_cast<double>(o.N) * o.d) +
                              half_operand_bytes_per_head(o),
                          total_heads);
}

// QK_scaled of heads [h0, h0 + n) from QK, as CudaBackend's compute_QK_scaled chooses.
void launch_scaled_scores(const BenchContext& c, const float* QK, float* out, int h0, int n) {
    const Options& o = c.o;
    if (!c.variant.beyond_plain())
        launch_scale_mask(QK, out, n, o.N, o.M, o.scale, c.variant.has_rule(), c.s);
    else
        launch_variant_scores(QK, out, n, o.N, o.M, o.scale, c.variant.from_head(h0), c.s);
}

void bench_stage_path(const BenchContext& c, int* group, std::vector<Result>* out) {
    const Options& o = c.o;
    const double H = c.total_heads, N = o.N, M = o.M, d = o.d;
    Result kt{"KT", Kind::memory}, qk{"QK", Kind::gemm}, sc{"QK_scaled", Kind::memory},
        sm{"attention_weights", Kind::memory}, ov{"output", Kind::gemm};
    kt.bytes = 2 * 4 * H * M * d;
    qk.flops = ov.flops = 2 * H * N * M * d;
    sc.bytes = sm.bytes = 2 * 4 * H * N * M;
    Result* rows[] = {&kt, &qk, &sc, &sm, &ov};
    *group = stage_group(o, c.total_heads);  // measured now: the ceilings' buffers are freed
    std::unique_ptr<StageBuffers> b;
    if (*group >= 1) {
        try {
            b = std::make_unique<StageBuffers>(o, size_t(*group));
        } catch (const Error&) {
            cudaGetLastError();  // an out-of-memory error is not sticky; clear it and go on
        }
    }
    if (!b) {
        *group = 0;
        for (Result* r : rows) r->status = "skipped (memory)";
        for (Result* r : rows) out->push_back(*r);
        return;
    }
    const int G = *group;
    const Dims dims = bench_dims(o);
    // Runs `stage(first_head, heads)` over every group; buffers hold one group at a time.
    auto over_groups = [&](auto&& stage) {
        for (int h0 = 0; h0 < c.total_heads; h0 += G) stage(h0, std::min(G, c.total_heads - h0));
    };
    const size_t qs = size_t(o.N) * o.d, ks = size_t(o.M) * o.d, nm = size_t(o.N) * o.M;
    const HalfGemm& hg = b->half.gemm;
    const float *Q = c.in.Q.p, *K = c.in.Kq().p, *V = c.in.Vq().p;
    // At bf16/fp16 each stage is stored in the format as it is computed, inside its timed span, as
    // the CUDA backend's stage path does (nothing at fp32 and tf32).
    auto stored = [&](float* p, int n, size_t per_head) {
        launch_round_to_format(p, size_t(n) * per_head, o.precision, c.s);
    };
    auto timed = [&](auto&& stage) { return c.timer.median_ms(o.warmup, o.reps, [&] { over_groups(stage); }); };
    kt.ms = timed([&](int h0, int n) { launch_transpose(K + h0 * ks, b->KT.p, n, o.M, o.d, c.s); });
    qk.ms = timed([&](int h0, int n) {
        gemm_qk(c.blas, dims, n, Q + h0 * qs, K + h0 * ks, b->A.p, hg);
        stored(b->A.p, n, nm);
    });
    sc.ms = timed([&](int h0, int n) {
        launch_scaled_scores(c, b->A.p, b->B.p, h0, n);
        stored(b->B.p, n, nm);
    });
    sm.ms = timed([&](int, int n) {
        launch_softmax_rows(b->B.p, b->A.p, static_cast<long long>(n) * o.N, o.M, c.s);
        stored(b->A.p, n, nm);
    });
    ov.ms = timed([&](int h0, int n) {
        gemm_output(c.blas, dims, n, b->A.p, V + h0 * ks, b->O.p, hg);
        stored(b->O.p, n, qs);
    });
    for (Result* r : rows) out->push_back(*r);
}

}  // namespace bench
}  // namespace attnstep
