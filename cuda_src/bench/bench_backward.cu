// bench_backward.cu — the backward rows of `main --bench` (--pass backward or both).
//
// The stage path: D, dP, dS, dQ, dK, dV, each timed alone over every group of heads, and the
// whole stage-path backward (the six in the order the CUDA backend runs them, group by group;
// in a grouped run then the sums of dK and dV over each K/V group) timed as one unit. They run the
// backend's own launchers and cuBLAS calls (kernels.cuh, variant_kernels.cuh, gemm.cuh) on the
// buffers a run of the binary would hand them: dS through the variant's kernel beyond the plain
// masks, and under a softcap dQ and dK from dS∘(1 − t²) (launch_softcap_grad, inside their time).
// The forward's QK, P and O they read are computed first by the forward stage path, untimed.
// Rates: GB/s of bytes read + written for D and dS, TFLOP/s of 2·N·M·d per head for the GEMMs,
// and for the whole pass 2.5× the forward's FLOPs (bench_options.h: the visible entries), the
// FlashAttention convention, so that it compares with the flash backward and with PyTorch's.
//
// The flash backward: flash_backward() as the backend calls it (D's row sums, its workspace, the
// dK/dV kernel and the dQ kernel: everything a run's flash_dQ time covers; in a grouped run then
// the sums of dK and dV, also timed alone as kv_group_sum), after one untimed flash forward for
// its O and lse, at the run's precision; TFLOP/s by the same 2.5× count.
//
// --check compares dQ of the checked query heads and dK, dV of the checked K/V heads (summed over
// their query heads) of the whole stage path and of the flash backward with float64
// (bench_check_backward.cu); the gradients are NaN-poisoned before the checked launch.
//
// At bf16/fp16 the flash backward is timed where it has a kernel (Hopper's wgmma, no mask or bias
// files, no dropout), with its forward and both passes on Q, K, V in the format; the stage
// path's whole-pass row is "unsupported".
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "../backend.h"
#include "../common.h"
#include "../stages.h"
#include "bench_parts.cuh"
#include "../cuda/cuda_check.cuh"
#include "../cuda/device.cuh"
#include "../cuda/flash.cuh"
#include "../cuda/flash_bwd.cuh"
#include "../cuda/gemm.cuh"
#include "../cuda/kernels.cuh"
#include "../cuda/variant_kernels.cuh"

namespace attnstep {
namespace bench {

namespace {


size_t q_elems(const Options& o) { return size_t(o.N) * o.d; }
size_t k_elems(const Options& o) { return size_t(o.M) * o.d; }

// One group's buffers of the backward stage path: the forward's P and O (the stage path's
// attention_weights and output), and every backward stage but the inputs. dP and dS double as the
// forward's N×M scratch (QK, QK_scaled) while P is prepared; under a softcap QK is kept, and
// `capped` holds dS∘(1 − t²) for the dQ and dK GEMMs.
struct PathBuffers {
    DeviceBuffer P, dP, dS, O, D, dQ, dK, dV;
    std::unique_ptr<DeviceBuffer> QK, capped;
    PathBuffers(const Options& o, size_t G)
        : P(G * o.N * o.M), dP(G * o.N * o.M), dS(G * o.N * o.M), O(G * q_elems(o)), D(G * o.N),
          dQ(G * q_elems(o)), dK(G * k_elems(o)), dV(G * k_elems(o)) {
        if (o.variant.softcap <= 0.f) return;
        QK = std::make_unique<DeviceBuffer>(G * o.N * o.M);
        capped = std::make_unique<DeviceBuffer>(G * o.N * o.M);
    }
    const float* scores() const { return QK ? QK->p : dP.p; }
};

double path_bytes_per_head(const Options& o) {
    const double N = o.N, M = o.M, d = o.d;
    const double capped = o.variant.softcap > 0.f ? 2.0 * N * M : 0.0;
    return 4.0 * (3.0 * N * M + capped + 3.0 * N * d + N + 2.0 * M * d);
}

// A grouped run's dK and dV per K/V head: the sums of its query heads' (none otherwise).
struct KvSums {
    std::unique_ptr<DeviceBuffer> dK, dV;
    explicit KvSums(const Options& o) {
        if (!grouped(o)) return;
        dK = std::make_unique<DeviceBuffer>(size_t(bench_dims(o).total_kv_heads()) * k_elems(o));
        dV = std::make_unique<DeviceBuffer>(size_t(bench_dims(o).total_kv_heads()) * k_elems(o));
    }
    // Adds the query heads [h0, h0 + n) of dK and dV (n heads each) to their K/V heads' sums.
    void add(const Options& o, const float* dK_heads, const float* dV_heads, int h0, int n, cudaStream_t s) const {
        if (!dK) return;
        launch_kv_group_sum(dK_heads, dK->p, h0, n, bench_dims(o), k_elems(o), s);
        launch_kv_group_sum(dV_heads, dV->p, h0, n, bench_dims(o), k_elems(o), s);
    }
};

// A backward stage of the stage path, run on heads [h0, h0 + n) of the inputs into the group's
// buffers.
struct PathStage {
    Stage stage;
    Kind kind;
    double flops, bytes;
    std::function<void(int h0, int n)> run;
};

// The stages of the backward stage path, in the order the backend runs them.
constexpr Stage kPathStages[] = {Stage::D, Stage::dP, Stage::dS, Stage::dQ, Stage::dK, Stage::dV};

Kind path_kind(Stage st) { return st == Stage::D || st == Stage::dS ? Kind::memory : Kind::gemm; }

// The launch of each stage of kPathStages: the calls of CudaBackend::run_backward_stages. The
// lambdas keep copies of what they use (pointers, sizes, the variant, the handle and stream).
std::function<void(int, int)> path_launch(Stage st, const BenchContext& c, const DeviceBuffer& dOb, PathBuffers& b) {
    const Options& o = c.o;
    const Dims dims = bench_dims(o);
    const size_t qs = q_elems(o), ks = k_elems(o);
    const float *Q = c.in.Q.p, *K = c.in.Kq().p, *V = c.in.Vq().p, *dO = dOb.p, *QK = b.scores();
    float *P = b.P.p, *dP = b.dP.p, *dS = b.dS.p, *O = b.O.p, *D = b.D.p, *dQ = b.dQ.p, *dK = b.dK.p, *dV = b.dV.p;
    float* capped = b.capped ? b.capped->p : nullptr;
    const int N = o.N, M = o.M, d = o.d;
    const float scale = o.scale, cap = o.variant.softcap;
    const DeviceVariant v = c.variant;
    const cublasHandle_t blas = c.blas;
    const cudaStream_t s = c.s;
    // dS as the dQ and dK GEMMs read it: through the softcap's derivative when there is one.
    auto gemm_ds = [=](int n) -> const float* {
        if (!capped) return dS;
        launch_softcap_grad(dS, QK, capped, size_t(n) * N * M, scale, cap, s);
        return capped;
    };
    switch (st) {
        case Stage::D: return [=](int h0, int n) { launch_row_dot(dO + h0 * qs, O, D, 1LL * n * N, d, s); };
        case Stage::dP: return [=](int h0, int n) { gemm_dp(blas, dims, n, dO + h0 * qs, V + h0 * ks, dP); };
        case Stage::dS:
            return [=](int h0, int n) {
                if (!v.beyond_plain()) launch_ds(P, dP, D, dS, n, N, M, v.has_rule(), s);
                else launch_variant_ds(P, dP, D, dS, n, N, M, v.from_head(h0), s);
            };
        case Stage::dQ: return [=](int h0, int n) { gemm_dq(blas, dims, n, scale, gemm_ds(n), K + h0 * ks, dQ); };
        case Stage::dK: return [=](int h0, int n) { gemm_dk(blas, dims, n, scale, gemm_ds(n), Q + h0 * qs, dK); };
        case Stage::dV: return [=](int h0, int n) { gemm_dv(blas, dims, n, P, dO + h0 * qs, dV); };
        default:
            fail(kExitInternal, where(__FILE__, __LINE__) + ": " + stage_name(st) + " is not a backward path stage");
    }
}

// Work of each stage over every head: 2·N·M·d per GEMM; bytes read + written once for D (dO and
// O read, D written) and dS (P and dP read, dS written, D read).
std::vector<PathStage> path_stages(const BenchContext& c, const DeviceBuffer& dO, PathBuffers& b) {
    const double H = c.total_heads, N = c.o.N, M = c.o.M, d = c.o.d;
    std::vector<PathStage> stages;
    for (Stage st : kPathStages) {
        PathStage p{st, path_kind(st), 0, 0, path_launch(st, c, dO, b)};
        if (p.kind == Kind::gemm) p.flops = 2 * H * N * M * d;
        else p.bytes = st == Stage::D ? 4 * H * (2 * N * d + N) : 4 * H * (3 * N * M + N);
        stages.push_back(std::move(p));
    }
    return stages;
}

// The forward stage path on heads [h0, h0 + n): QK (kept under a softcap), P (attention_weights)
// and O (output), as the backend computes them.
void prepare_forward(const BenchContext& c, PathBuffers& b, int h0, int n) {
    const Options& o = c.o;
    const Dims dims = bench_dims(o);
    float* QK = b.QK ? b.QK->p : b.dP.p;
    gemm_qk(c.blas, dims, n, c.in.Q.p + h0 * q_elems(o), c.in.Kq().p + h0 * k_elems(o), QK);
    launch_scaled_scores(c, QK, b.dS.p, h0, n);
    launch_softmax_rows(b.dS.p, b.P.p, static_cast<long long>(n) * o.N, o.M, c.s);
    gemm_output(c.blas, dims, n, b.P.p, c.in.Vq().p + h0 * k_elems(o), b.O.p);
}

// Head `head` of a device buffer of heads of per_head floats, on the host.
std::vector<float> fetch(const float* p, int head, size_t per_head) {
    std::vector<float> h(per_head);
    CUDA_CHECK(cudaMemcpy(h.data(), p + head * per_head, per_head * 4, cudaMemcpyDeviceToHost));
    return h;
}

void begin_check(Result* r) {
    r->checked = true;
    r->check_passed = true;
}

// Each checked K/V head's query heads alone (groups of one): the forward, poisoned gradients, the
// six stages; the checked query heads' dQ, then the K/V head's dK and dV, summed on the device.
void check_path(const BenchContext& c, PathBuffers& b, const KvSums& sums, const std::vector<PathStage>& stages,
                BackwardReference& ref, Result* whole) {
    const Options& o = c.o;
    const Dims dims = bench_dims(o);
    const std::vector<int> query_heads = heads_to_check(o, c.total_heads);
    begin_check(whole);
    for (int kv : heads_to_check(o, dims.total_kv_heads())) {
        for (int head = kv * dims.group_size(); head < (kv + 1) * dims.group_size(); ++head) {
            prepare_forward(c, b, head, 1);
            for (DeviceBuffer* p : {&b.D, &b.dQ, &b.dK, &b.dV}) poison_fill(p->p, p->n, c.s);
            for (const PathStage& st : stages) st.run(head, 1);
            sums.add(o, b.dK.p, b.dV.p, head, 1, c.s);
            CUDA_CHECK(cudaStreamSynchronize(c.s));
            if (std::count(query_heads.begin(), query_heads.end(), head))
                ref.compare_dq(head, fetch(b.dQ.p, 0, q_elems(o)), whole);
        }
        const bool summed = sums.dK != nullptr;
        ref.compare_kv(kv, fetch(summed ? sums.dK->p : b.dK.p, summed ? kv : 0, k_elems(o)),
                       fetch(summed ? sums.dV->p : b.dV.p, summed ? kv : 0, k_elems(o)), whole);
    }
}

// The stage path's buffers for groups of *group heads, or null (and *group 0) when they do not fit.
std::unique_ptr<PathBuffers> path_buffers(const BenchContext& c, int* group) {
    *group = heads_that_fit(path_bytes_per_head(c.o), c.total_heads);
    if (*group < 1) return nullptr;
    try {
        return std::make_unique<PathBuffers>(c.o, size_t(*group));
    } catch (const Error&) {
        cudaGetLastError();  // an out-of-memory error is not sticky; clear it and go on
        *group = 0;
        return nullptr;
    }
}

void bench_path_backward(const BenchContext& c, const DeviceBuffer& dO, const KvSums& sums, BackwardReference* ref,
                         int* group, std::vector<Result>* out) {
    const Options& o = c.o;
    Result whole{kStagePathBackwardRow, Kind::attention};
    whole.flops = kBackwardFlopFactor * attention_flops(o, c.total_heads);
    const std::unique_ptr<PathBuffers> buffers = path_buffers(c, group);
    std::vector<Result> rows;
    if (!buffers) {
        for (Stage st : kPathStages) rows.push_back(Result{stage_name(st), path_kind(st)});
    } else {
        const int G = *group;
        auto over_groups = [&](auto&& f) {
            for (int h0 = 0; h0 < c.total_heads; h0 += G) f(h0, std::min(G, c.total_heads - h0));
        };
        const std::vector<PathStage> stages = path_stages(c, dO, *buffers);
        prepare_forward(c, *buffers, 0, std::min(G, c.total_heads));
        for (const PathStage& st : stages) {
            Result r{stage_name(st.stage), st.kind};
            r.flops = st.flops;
            r.bytes = st.bytes;
            r.ms = c.timer.median_ms(o.warmup, o.reps, [&] { over_groups(st.run); });
            rows.push_back(r);
        }
        whole.ms = c.timer.median_ms(o.warmup, o.reps, [&] {
            over_groups([&](int h0, int n) {
                for (const PathStage& st : stages) st.run(h0, n);
                sums.add(o, buffers->dK.p, buffers->dV.p, h0, n, c.s);
            });
        });
        if (o.check) check_path(c, *buffers, sums, stages, *ref, &whole);
    }
    rows.push_back(whole);
    for (Result& r : rows) {
        r.backward = true;
        if (!buffers) r.status = "skipped (memory)";
        out->push_back(r);
    }
}

// The flash backward's gradients, per query head.
struct FlashGrads {
    DeviceBuffer dQ, dK, dV;
    FlashGrads(const Options& o, int heads) : dQ(heads * q_elems(o)), dK(heads * k_elems(o)), dV(heads * k_elems(o)) {}
};

// Compares the checked query heads' dQ and the checked K/V heads' dK, dV (the sums in a grouped
// run) of the flash backward with float64.
void check_flash_grads(const BenchContext& c, const FlashGrads& g, const KvSums& sums, BackwardReference& ref,
                       Result* r) {
    const Options& o = c.o;
    begin_check(r);
    for (int head : heads_to_check(o, c.total_heads)) ref.compare_dq(head, fetch(g.dQ.p, head, q_elems(o)), r);
    const bool summed = sums.dK != nullptr;
    for (int kv : heads_to_check(o, bench_dims(o).total_kv_heads()))
        ref.compare_kv(kv, fetch(summed ? sums.dK->p : g.dK.p, kv, k_elems(o)),
                       fetch(summed ? sums.dV->p : g.dV.p, kv, k_elems(o)), r);
}

// A grouped run's kv_group_sum row: the sums of dK and dV over each K/V group, alone.
Result kv_group_sum_row(const BenchContext& c, const FlashGrads& g, const KvSums& sums) {
    const Options& o = c.o;
    Result r{kKvGroupSumRow, Kind::memory};
    r.backward = true;
    r.bytes = 2.0 * 4.0 * double(k_elems(o)) * (c.total_heads + bench_dims(o).total_kv_heads());
    r.ms = c.timer.median_ms(o.warmup, o.reps, [&] { sums.add(o, g.dK.p, g.dV.p, 0, c.total_heads, c.s); });
    return r;
}

// The flash backward of o.precision, after an untimed flash forward for its O and lse.
void bench_flash_backward(const BenchContext& c, const DeviceBuffer& dO, const KvSums& sums, BackwardReference* ref,
                          std::vector<Result>* out) {
    const Options& o = c.o;
    Result r{kFlashBackwardRow, Kind::attention};
    r.backward = true;
    r.flops = kBackwardFlopFactor * attention_flops(o, c.total_heads);
    const FlashProblem problem = bench_flash_problem(o, c.in, c.variant);
    if (!flash_supported(bench_dims(o)) || !flash_backward_available(FlashBwdArgs{problem})) {
        r.status = "unsupported";
        if (is_half(o.precision))
            r.reason = std::string("the flash backward at ") + precision_name(o.precision) +
                       " needs a build for sm_90a, compute capability 9.0, d 64 or 128, and no mask or bias "
                       "files or dropout";
        out->push_back(r);
        return;
    }
    DeviceBuffer O(c.total_heads * q_elems(o)), lse(size_t(c.total_heads) * o.N);
    FlashGrads g(o, c.total_heads);
    // At a half precision the forward and the backward read Q, K, V in the format, made untimed
    // (a run makes them as the inputs arrive).
    FlashArgs fa{problem, O.p, lse.p};
    const FormatInputs format(o, c.in, c.s);
    format.attach(&fa);
    if (is_half(o.precision)) format.expansion(o).launch(c.s);
    flash_forward(fa, c.s);
    FlashBwdArgs a{problem, O.p, lse.p, dO.p, g.dQ.p, g.dK.p, g.dV.p};
    std::tie(a.Qh, a.Kh, a.Vh) = std::make_tuple(fa.Qh, fa.Kh, fa.Vh);
    const FlashPlan plan = flash_backward_plan(a);
    r.tiles = std::to_string(plan.Br) + "x" + std::to_string(plan.Bc) + ", " + plan.kernel;
    auto launch = [&] {
        flash_backward(a, c.s);
        sums.add(o, g.dK.p, g.dV.p, 0, c.total_heads, c.s);
    };
    // Poisoned gradients: an element the pass never writes stays NaN and fails the check.
    for (DeviceBuffer* p : {&g.dQ, &g.dK, &g.dV}) poison_fill(p->p, p->n, c.s);
    launch();
    CUDA_CHECK(cudaStreamSynchronize(c.s));
    if (o.check) check_flash_grads(c, g, sums, *ref, &r);
    r.ms = c.timer.median_ms(o.warmup, o.reps, launch);
    out->push_back(r);
    if (sums.dK) out->push_back(kv_group_sum_row(c, g, sums));
}

// At bf16/fp16: the whole stage path's row, marked (not timed).
Result half_path_row(const Options& o) {
    Result r{kStagePathBackwardRow, Kind::attention};
    r.backward = true;
    r.status = "unsupported";
    r.reason = std::string("the backward stage path is timed at fp32 and tf32 only, not ") + precision_name(o.precision);
    return r;
}

}  // namespace

void bench_backward(const BenchContext& c, const DeviceBuffer& dO, int* group, std::vector<Result>* out) {
    *group = 0;
    BackwardReference ref(c.o, c.in, dO);
    const KvSums sums(c.o);
    if (c.o.only != "flash") {
        if (is_half(c.o.precision)) out->push_back(half_path_row(c.o));
        else bench_path_backward(c, dO, sums, &ref, group, out);
    }
    if (c.o.only != "stages") bench_flash_backward(c, dO, sums, &ref, out);
}

}  // namespace bench
}  // namespace attnstep
