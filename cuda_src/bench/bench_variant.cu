// bench_variant.cu — the inputs and the variant of a `main --bench` run on the device: Q, K and V
// filled from bench_inputs.h, a grouped run's copy of each K/V head to its query heads and its sums
// of dK and dV over each group, the variant's rule and ALiBi slopes, and the inputs in a half
// format for the half flash kernel.
//
// What a grouped run (--kv-heads) times: the CUDA kernels read one K and V per query head (the
// backend is handed them so: main.cpp copies each K/V head to the query heads of its group on the
// host, and sums their dK and dV after the backward). The bench keeps B·Hk K/V heads on the device
// and does the same work there: every flash forward row times the copy to the query heads' buffers
// (of the K and V it reads: float32, or at bf16/fp16 the format's) and then the kernel; the flash
// backward times the kernel and then the float32 sums of dK and dV over each group, in order of h;
// the whole stage-path backward includes the sums too. kv_expand and kv_group_sum time the copy and
// the sums alone; the stage path's forward stages read copies made once, before any timing.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../cuda/half.cuh"
#include "../cuda/variant_buffers.cuh"
#include "bench_inputs.h"
#include "bench_parts.cuh"

namespace attnstep {
namespace bench {

namespace {

// Destination head i (blockIdx.y and on) = source head i / group, `units` units each (query head i
// reads K/V head i / group: b·H + h reads b·Hk + h/G). One grid row per head: no division per unit.
template <class Unit>
__global__ void expand_heads(const Unit* src, Unit* dst, size_t units, int group, int heads) {
    for (int head = blockIdx.y; head < heads; head += gridDim.y) {
        const Unit* from = src + size_t(head / group) * units;
        Unit* to = dst + size_t(head) * units;
        for (size_t u = blockIdx.x * size_t(blockDim.x) + threadIdx.x; u < units; u += size_t(gridDim.x) * blockDim.x)
            to[u] = from[u];
    }
}

constexpr int kCopyThreads = 256, kCopyBlocksPerHead = 256, kMaxGridY = 65535;

// The widest unit (16, 8, 4 or 2 bytes) that divides a head's bytes: heads then start aligned to
// it in a cudaMalloc'd buffer.
template <class Unit>
void launch_expand(const KvCopy& c, size_t head_bytes, int group, int heads, cudaStream_t s) {
    const size_t units = head_bytes / sizeof(Unit);
    const size_t blocks = std::min<size_t>((units + kCopyThreads - 1) / kCopyThreads, kCopyBlocksPerHead);
    const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(std::min(heads, kMaxGridY)));
    expand_heads<Unit><<<grid, kCopyThreads, 0, s>>>(static_cast<const Unit*>(c.src), static_cast<Unit*>(c.dst), units,
                                                    group, heads);
    LAUNCH_CHECK(expand_heads);
}

// For every K/V head j that a query head of [h0, h0 + n) reads, each of its per_head elements.
__global__ void group_sum(const float* src, float* dst, int h0, int n, int group, size_t per_head, size_t total) {
    const int first_kv = h0 / group;
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < total; i += size_t(gridDim.x) * blockDim.x) {
        const int j = first_kv + static_cast<int>(i / per_head);
        const size_t e = i % per_head;
        const int q0 = j * group, q1 = q0 + group;
        const int a = q0 > h0 ? q0 : h0, b = q1 < h0 + n ? q1 : h0 + n;
        float acc = q0 < h0 ? dst[size_t(j) * per_head + e] : 0.f;
        for (int h = a; h < b; ++h) acc += src[size_t(h - h0) * per_head + e];
        dst[size_t(j) * per_head + e] = acc;
    }
}

size_t kv_elems(const Options& o) { return size_t(o.M) * o.d; }

}  // namespace

BenchInputs::BenchInputs(const Options& o, cudaStream_t s)
    : Q(size_t(o.batch) * o.heads * o.N * o.d), K(size_t(bench_dims(o).total_kv_heads()) * kv_elems(o)),
      V(size_t(bench_dims(o).total_kv_heads()) * kv_elems(o)) {
    fill(Q, input_seed(o.seed, BenchInput::Q), s);
    fill(K, input_seed(o.seed, BenchInput::K), s);
    fill(V, input_seed(o.seed, BenchInput::V), s);
    if (!grouped(o)) return;
    K_heads = std::make_unique<DeviceBuffer>(size_t(o.batch) * o.heads * kv_elems(o));
    V_heads = std::make_unique<DeviceBuffer>(size_t(o.batch) * o.heads * kv_elems(o));
    float_expansion(o, *this).launch(s);
}

void KvExpansion::launch(cudaStream_t s) const {
    const int group = dims.group_size(), heads = dims.total_heads();
    for (const KvCopy& c : copies) {
        const size_t head_bytes = size_t(dims.M) * dims.dk * c.elem_bytes;
        if (head_bytes % 16 == 0) launch_expand<uint4>(c, head_bytes, group, heads, s);
        else if (head_bytes % 8 == 0) launch_expand<uint2>(c, head_bytes, group, heads, s);
        else if (head_bytes % 4 == 0) launch_expand<uint32_t>(c, head_bytes, group, heads, s);
        else launch_expand<uint16_t>(c, head_bytes, group, heads, s);
    }
}

double KvExpansion::bytes() const {
    double b = 0;
    for (const KvCopy& c : copies)
        b += double(dims.M) * dims.dk * c.elem_bytes * (dims.total_kv_heads() + dims.total_heads());
    return b;
}

KvExpansion float_expansion(const Options& o, const BenchInputs& in) {
    KvExpansion e{bench_dims(o), {}};
    if (in.K_heads) e.copies = {{in.K.p, in.K_heads->p, sizeof(float)}, {in.V.p, in.V_heads->p, sizeof(float)}};
    return e;
}

void launch_kv_group_sum(const float* src, float* dst, int h0, int n, const Dims& dims, size_t per_head,
                         cudaStream_t s) {
    if (n <= 0) return;
    const int group = dims.group_size();
    const size_t kv_touched = size_t((h0 + n - 1) / group - h0 / group + 1);
    group_sum<<<1024, 256, 0, s>>>(src, dst, h0, n, group, per_head, kv_touched * per_head);
    LAUNCH_CHECK(group_sum);
}

double bench_slope(const Options& o, int head) {
    return o.variant.alibi ? double(static_cast<float>(alibi_slope(head % o.heads, o.heads))) : 0.0;
}

BenchVariant::BenchVariant(const Options& o, cudaStream_t s) {
    Problem p;
    p.dims = bench_dims(o);
    p.variant = o.variant;
    p.causal = o.variant.causal;
    p.scale = o.scale;
    p.precision = o.precision;
    v = make_device_variant(p);
    if (!o.variant.alibi) return;
    const int heads = p.dims.total_heads();
    std::vector<float> host(heads);
    for (int i = 0; i < heads; ++i) host[i] = static_cast<float>(bench_slope(o, i));
    slopes = std::make_unique<DeviceBuffer>(heads);
    CUDA_CHECK(cudaMemcpyAsync(slopes->p, host.data(), heads * sizeof(float), cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaStreamSynchronize(s));  // the host vector goes out of scope
    v.slopes = slopes->p;
}

FlashProblem bench_flash_problem(const Options& o, const BenchInputs& in, const DeviceVariant& v) {
    return FlashProblem{in.Q.p, in.Kq().p, in.Vq().p, o.batch * o.heads, o.N, o.M, o.d, o.scale,
                        !v.beyond_plain() && v.top_left_causal(), o.precision, v};
}

FormatInputs::FormatInputs(const Options& o, const BenchInputs& in, cudaStream_t s) {
    if (!is_half(o.precision)) return;
    // DeviceBuffer counts floats: two half values each, rounded up.
    auto halves = [](size_t n) { return std::make_unique<DeviceBuffer>((n + 1) / 2); };
    auto convert = [&](const DeviceBuffer& x) {
        auto h = halves(x.n);
        launch_to_half(x.p, h->p, x.n, o.precision, s);
        return h;
    };
    q = convert(in.Q);
    k = convert(in.K);
    v = convert(in.V);
    if (!grouped(o)) return;
    k_heads = halves(size_t(o.batch) * o.heads * kv_elems(o));
    v_heads = halves(size_t(o.batch) * o.heads * kv_elems(o));
}

void FormatInputs::attach(FlashArgs* a) const {
    if (!q) return;
    a->Qh = reinterpret_cast<const uint16_t*>(q->p);
    a->Kh = reinterpret_cast<const uint16_t*>((k_heads ? k_heads : k)->p);
    a->Vh = reinterpret_cast<const uint16_t*>((v_heads ? v_heads : v)->p);
}

KvExpansion FormatInputs::expansion(const Options& o) const {
    KvExpansion e{bench_dims(o), {}};
    if (k_heads) e.copies = {{k->p, k_heads->p, sizeof(uint16_t)}, {v->p, v_heads->p, sizeof(uint16_t)}};
    return e;
}

void bench_kv_expand(const BenchContext& c, std::vector<Result>* out) {
    if (!grouped(c.o)) return;
    const KvExpansion e = float_expansion(c.o, c.in);
    Result r{kKvExpandRow, Kind::memory};
    r.bytes = e.bytes();
    r.ms = c.timer.median_ms(c.o.warmup, c.o.reps, [&] { e.launch(c.s); });
    out->push_back(r);
}

}  // namespace bench
}  // namespace attnstep
