// bench_backward.cu — the backward rows of `main --bench` (--pass backward or both).
//
// The stage path: D, dP, dS, dQ, dK, dV, each timed alone over every group of heads, and the
// whole stage-path backward (the six in the order the CUDA backend runs them, group by group)
// timed as one unit. They run the backend's own launchers and cuBLAS calls (kernels.cuh,
// gemm.cuh) on the buffers a run of the binary would hand them; the forward's P and O they read
// are computed first by the forward stage path, untimed. Rates: GB/s of bytes read + written for
// D and dS, TFLOP/s of 2·N·M·d per head for the GEMMs, and for the whole pass 2.5× the forward's
// 4·B·H·N·M·d (halved when causal), the FlashAttention convention, so that it compares with the
// flash backward and with PyTorch's.
//
// The flash backward: flash_backward() as the backend calls it (D's row sums, its workspace, the
// dK/dV kernel and the dQ kernel: everything a run's flash_dQ time covers), after one untimed
// flash forward for its O and lse, at the run's precision; TFLOP/s by the same 2.5× count.
//
// --check compares dQ, dK, dV of the whole stage path and of the flash backward with float64
// (bench_check_backward.cu); the gradients are NaN-poisoned before the checked launch.
//
// At bf16/fp16 nothing of the backward is timed: its two whole-pass rows are "unsupported".
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
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

namespace attnstep {
namespace bench {

namespace {

constexpr int kFlashBackwardMinCapability = 80;  // flash_backward's TF32 tensor cores

// One group's buffers of the backward stage path: the forward's P and O (the stage path's
// attention_weights and output), and every backward stage but the inputs. dP and dS double as the
// forward's N×M scratch (QK, QK_scaled) while P is prepared.
struct PathBuffers {
    DeviceBuffer P, dP, dS, O, D, dQ, dK, dV;
    PathBuffers(const Options& o, size_t G)
        : P(G * o.N * o.M), dP(G * o.N * o.M), dS(G * o.N * o.M), O(G * o.N * o.d), D(G * o.N),
          dQ(G * o.N * o.d), dK(G * o.M * o.d), dV(G * o.M * o.d) {}
};

double path_bytes_per_head(const Options& o) {
    const double N = o.N, M = o.M, d = o.d;
    return 4.0 * (3.0 * N * M + 3.0 * N * d + N + 2.0 * M * d);
}

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
// lambdas keep copies of what they use (pointers, sizes, the handle and stream).
std::function<void(int, int)> path_launch(Stage st, const Options& o, cublasHandle_t blas, const BackwardInputs& in,
                                          PathBuffers& b, cudaStream_t s) {
    const Dims dims = bench_dims(o);
    const size_t qs = size_t(o.N) * o.d, ks = size_t(o.M) * o.d;
    const float *Q = in.Q.p, *K = in.K.p, *V = in.V.p, *dO = in.dO.p;
    float *P = b.P.p, *dP = b.dP.p, *dS = b.dS.p, *O = b.O.p, *D = b.D.p, *dQ = b.dQ.p, *dK = b.dK.p, *dV = b.dV.p;
    const int N = o.N, M = o.M, d = o.d;
    const float scale = o.scale;
    const bool causal = o.causal;
    switch (st) {
        case Stage::D: return [=](int h0, int n) { launch_row_dot(dO + h0 * qs, O, D, 1LL * n * N, d, s); };
        case Stage::dP: return [=](int h0, int n) { gemm_dp(blas, dims, n, dO + h0 * qs, V + h0 * ks, dP); };
        case Stage::dS: return [=](int, int n) { launch_ds(P, dP, D, dS, n, N, M, causal, s); };
        case Stage::dQ: return [=](int h0, int n) { gemm_dq(blas, dims, n, scale, dS, K + h0 * ks, dQ); };
        case Stage::dK: return [=](int h0, int n) { gemm_dk(blas, dims, n, scale, dS, Q + h0 * qs, dK); };
        case Stage::dV: return [=](int h0, int n) { gemm_dv(blas, dims, n, P, dO + h0 * qs, dV); };
        default:
            fail(kExitInternal, where(__FILE__, __LINE__) + ": " + stage_name(st) + " is not a backward path stage");
    }
}

// Work of each stage over every head: 2·N·M·d per GEMM; bytes read + written once for D (dO and
// O read, D written) and dS (P and dP read, dS written, D read).
std::vector<PathStage> path_stages(const Options& o, cublasHandle_t blas, const BackwardInputs& in,
                                   PathBuffers& b, int total_heads, cudaStream_t s) {
    const double H = total_heads, N = o.N, M = o.M, d = o.d;
    std::vector<PathStage> stages;
    for (Stage st : kPathStages) {
        PathStage p{st, path_kind(st), 0, 0, path_launch(st, o, blas, in, b, s)};
        if (p.kind == Kind::gemm) p.flops = 2 * H * N * M * d;
        else p.bytes = st == Stage::D ? 4 * H * (2 * N * d + N) : 4 * H * (3 * N * M + N);
        stages.push_back(std::move(p));
    }
    return stages;
}

// The forward stage path on heads [h0, h0 + n): P (attention_weights) and O (output), as the
// backend computes them.
void prepare_forward(const Options& o, cublasHandle_t blas, const BackwardInputs& in, PathBuffers& b, int h0,
                     int n, cudaStream_t s) {
    const Dims dims = bench_dims(o);
    const size_t qs = size_t(o.N) * o.d, ks = size_t(o.M) * o.d;
    gemm_qk(blas, dims, n, in.Q.p + h0 * qs, in.K.p + h0 * ks, b.dP.p);
    launch_scale_mask(b.dP.p, b.dS.p, n, o.N, o.M, o.scale, o.causal, s);
    launch_softmax_rows(b.dS.p, b.P.p, static_cast<long long>(n) * o.N, o.M, s);
    gemm_output(blas, dims, n, b.P.p, in.V.p + h0 * ks, b.O.p);
}

// Copies head `head` of three device gradients ([heads][N][d], [heads][M][d] twice) to the host.
void fetch_grads(const Options& o, const float* dQ, const float* dK, const float* dV, int head, HostGrads* g) {
    const size_t qs = size_t(o.N) * o.d, ks = size_t(o.M) * o.d;
    g->dQ.resize(qs);
    g->dK.resize(ks);
    g->dV.resize(ks);
    CUDA_CHECK(cudaMemcpy(g->dQ.data(), dQ + head * qs, qs * 4, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(g->dK.data(), dK + head * ks, ks * 4, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(g->dV.data(), dV + head * ks, ks * 4, cudaMemcpyDeviceToHost));
}

void begin_check(Result* r) {
    r->checked = true;
    r->check_passed = true;
}

// Each checked head alone (a group of one): its forward, poisoned gradients, the six stages.
void check_path(const Options& o, cublasHandle_t blas, const BackwardInputs& in, PathBuffers& b,
                const std::vector<PathStage>& stages, int total_heads, BackwardReference& ref, cudaStream_t s,
                Result* whole) {
    begin_check(whole);
    HostGrads g;
    for (int head : heads_to_check(o, total_heads)) {
        prepare_forward(o, blas, in, b, head, 1, s);
        for (DeviceBuffer* p : {&b.D, &b.dQ, &b.dK, &b.dV}) poison_fill(p->p, p->n, s);
        for (const PathStage& st : stages) st.run(head, 1);
        CUDA_CHECK(cudaStreamSynchronize(s));
        fetch_grads(o, b.dQ.p, b.dK.p, b.dV.p, 0, &g);
        ref.compare(head, g, whole);
    }
}

void bench_path_backward(const Options& o, cublasHandle_t blas, const BackwardInputs& in, int total_heads,
                         Timer& timer, cudaStream_t s, BackwardReference* ref, int* group,
                         std::vector<Result>* out) {
    Result whole{kStagePathBackwardRow, Kind::attention};
    whole.flops = kBackwardFlopFactor * attention_flops(o, total_heads);
    *group = heads_that_fit(path_bytes_per_head(o), total_heads);
    std::unique_ptr<PathBuffers> buffers;
    if (*group >= 1) {
        try {
            buffers = std::make_unique<PathBuffers>(o, size_t(*group));
        } catch (const Error&) {
            cudaGetLastError();  // an out-of-memory error is not sticky; clear it and go on
            *group = 0;
        }
    }
    std::vector<Result> rows;
    if (!buffers) {
        for (Stage st : kPathStages) rows.push_back(Result{stage_name(st), path_kind(st)});
    }
    const int G = std::max(*group, 1);
    auto over_groups = [&](auto&& f) {
        for (int h0 = 0; h0 < total_heads; h0 += G) f(h0, std::min(G, total_heads - h0));
    };
    std::vector<PathStage> stages;
    if (buffers) {
        stages = path_stages(o, blas, in, *buffers, total_heads, s);
        prepare_forward(o, blas, in, *buffers, 0, std::min(G, total_heads), s);
        for (const PathStage& st : stages) {
            Result r{stage_name(st.stage), st.kind};
            r.flops = st.flops;
            r.bytes = st.bytes;
            r.ms = timer.median_ms(o.warmup, o.reps, [&] { over_groups(st.run); });
            rows.push_back(r);
        }
        whole.ms = timer.median_ms(o.warmup, o.reps, [&] {
            over_groups([&](int h0, int n) {
                for (const PathStage& st : stages) st.run(h0, n);
            });
        });
        if (o.check) check_path(o, blas, in, *buffers, stages, total_heads, *ref, s, &whole);
    }
    rows.push_back(whole);
    for (Result& r : rows) {
        r.backward = true;
        if (!buffers) r.status = "skipped (memory)";
        out->push_back(r);
    }
}

// The flash backward of o.precision, after an untimed flash forward for its O and lse.
void bench_flash_backward(const Options& o, const BackwardInputs& in, int total_heads, Timer& timer,
                          cudaStream_t s, BackwardReference* ref, std::vector<Result>* out) {
    Result r{kFlashBackwardRow, Kind::attention};
    r.backward = true;
    r.flops = kBackwardFlopFactor * attention_flops(o, total_heads);
    if (!flash_supported(bench_dims(o)) || device_compute_capability() < kFlashBackwardMinCapability) {
        r.status = "unsupported";
        out->push_back(r);
        return;
    }
    const size_t qn = size_t(total_heads) * o.N * o.d, kn = size_t(total_heads) * o.M * o.d;
    DeviceBuffer O(qn), lse(size_t(total_heads) * o.N), dQ(qn), dK(kn), dV(kn);
    const FlashProblem problem{in.Q.p, in.K.p, in.V.p, total_heads, o.N, o.M, o.d, o.scale, o.causal, o.precision};
    flash_forward(FlashArgs{problem, O.p, lse.p}, s);
    const FlashBwdArgs a{problem, O.p, lse.p, in.dO.p, dQ.p, dK.p, dV.p};
    const FlashPlan plan = flash_backward_plan(a);
    r.tiles = std::to_string(plan.Br) + "x" + std::to_string(plan.Bc) + ", " + plan.kernel;
    // Poisoned gradients: an element the pass never writes stays NaN and fails the check.
    for (DeviceBuffer* p : {&dQ, &dK, &dV}) poison_fill(p->p, p->n, s);
    flash_backward(a, s);
    CUDA_CHECK(cudaStreamSynchronize(s));
    if (o.check) {
        begin_check(&r);
        HostGrads g;
        for (int head : heads_to_check(o, total_heads)) {
            fetch_grads(o, dQ.p, dK.p, dV.p, head, &g);
            ref->compare(head, g, &r);
        }
    }
    r.ms = timer.median_ms(o.warmup, o.reps, [&] { flash_backward(a, s); });
    out->push_back(r);
}

// At bf16/fp16: the whole stage path's and the flash backward's rows, marked (not timed).
void half_backward_rows(const Options& o, std::vector<Result>* out) {
    for (const char* name : {kStagePathBackwardRow, kFlashBackwardRow}) {
        if (o.only == (name == kFlashBackwardRow ? "stages" : "flash")) continue;
        Result r{name, Kind::attention};
        r.backward = true;
        r.status = "unsupported";
        r.reason = std::string("the backward is timed at fp32 and tf32 only, not ") + precision_name(o.precision);
        out->push_back(r);
    }
}

}  // namespace

void bench_backward(const Options& o, cublasHandle_t blas, const BackwardInputs& in, int total_heads,
                    Timer& timer, cudaStream_t s, int* group, std::vector<Result>* out) {
    *group = 0;
    if (is_half(o.precision)) return half_backward_rows(o, out);
    BackwardReference ref(o, in);
    if (o.only != "flash") bench_path_backward(o, blas, in, total_heads, timer, s, &ref, group, out);
    if (o.only != "stages") bench_flash_backward(o, in, total_heads, timer, s, &ref, out);
}

}  // namespace bench
}  // namespace attnstep
