// bench_decode.cu — `main --bench-decode`: the split-KV decode kernel (cuda/decode.cu) timed on a
// paged KV cache, beside a device-to-device copy of the same bytes in the same run.
//
// A decode step: `batch` sequences of `queries` queries each against `cache-len` keys per sequence,
// K/V in pages of `page-size` keys assigned to the sequences in a shuffled order (as a cache that
// has lived a while hands them out), grouped K/V heads. The time is every kernel of the step as an
// inference engine runs it: the split kernel, and the combine where there are several splits (one
// split stores its output from the kernel's blocks); a run of the binary, which writes the split
// stages, adds their layout copy and the combine. The median of --reps runs after --warmup.
// Bandwidth: the K and V bytes the step must read (each sequence's keys once per K/V head) over
// that time. The copy baseline copies that many bytes with cudaMemcpyAsync and counts its bytes
// read and written, the memory traffic a copy reaches. A float64 check of sampled sequences (every
// head) reports the largest error of O and lse and fails the bench (exit 1) past the format's
// tolerance, or on a value that is not finite: a fast wrong kernel cannot pass.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "../backend.h"
#include "../common.h"
#include "../cuda/cuda_check.cuh"
#include "../cuda/decode.cuh"
#include "../cuda/device.cuh"
#include "bench.h"
#include "bench_inputs.h"
#include "bench_parts.cuh"

namespace attnstep {
namespace bench {

namespace {

struct DecodeOptions {
    int batch = 64, heads = 32, kv_heads = 8, cache_len = 8192, page_size = 64, d = 128, queries = 1;
    int split_size = 0;  // 0: the kernel's choice
    Precision precision = Precision::bf16;
    int warmup = 5, reps = 20, check_sequences = 2;
    uint64_t seed = 1234;
    std::string json;
};

[[noreturn]] void usage_error(const std::string& what) {
    fail(kExitBadInput, "--bench-decode: " + what,
         "options: --batch B --heads H --kv-heads Hk --cache-len L --page-size P --d D --queries Q "
         "--precision fp32|bf16|fp16 [--split-size K] [--warmup W] [--reps R] [--check-sequences S] [--seed S] "
         "[--json FILE]");
}

int positive(const std::string& flag, const char* text) {
    char* end = nullptr;
    const long v = std::strtol(text, &end, 10);
    if (!*text || *end || v < 1 || v > kMaxDim) usage_error(flag + " wants a whole number 1.." + std::to_string(kMaxDim) + ", got '" + text + "'");
    return static_cast<int>(v);
}

DecodeOptions parse(int argc, char** argv) {
    DecodeOptions o;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--bench-decode") continue;
        if (i + 1 >= argc) usage_error(a + " needs a value (or is not an option of --bench-decode)");
        const char* v = argv[++i];
        if (a == "--batch") o.batch = positive(a, v);
        else if (a == "--heads") o.heads = positive(a, v);
        else if (a == "--kv-heads") o.kv_heads = positive(a, v);
        else if (a == "--cache-len") o.cache_len = positive(a, v);
        else if (a == "--page-size") o.page_size = positive(a, v);
        else if (a == "--d") o.d = positive(a, v);
        else if (a == "--queries") o.queries = positive(a, v);
        else if (a == "--split-size") o.split_size = positive(a, v);
        else if (a == "--warmup") o.warmup = positive(a, v);
        else if (a == "--reps") o.reps = positive(a, v);
        else if (a == "--check-sequences") o.check_sequences = std::atoi(v);
        else if (a == "--seed") o.seed = static_cast<uint64_t>(positive(a, v));
        else if (a == "--json") o.json = v;
        else if (a == "--precision") {
            const std::string p = v;
            if (p == "fp32") o.precision = Precision::fp32;
            else if (p == "bf16") o.precision = Precision::bf16;
            else if (p == "fp16") o.precision = Precision::fp16;
            else usage_error("--precision wants fp32, bf16 or fp16, got '" + p + "'");
        } else usage_error("unknown option " + a);
    }
    if (o.heads % o.kv_heads) usage_error("--heads must be a multiple of --kv-heads");
    if (!decode_supported(o.d)) usage_error("--d must be one of " + flash_head_dims_text());
    return o;
}

// Element i of an input as the kernel reads it: uniform_input rounded to the format.
float input_value(uint64_t i, uint64_t seed, Precision p) { return round_to(p, uniform_input(i, seed)); }

__global__ void fill_bits(void* out, long long n, uint64_t seed, int precision) {
    for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<long long>(gridDim.x) * blockDim.x) {
        const float x = uniform_input(static_cast<uint64_t>(i), seed);
        if (precision == static_cast<int>(Precision::bf16))
            static_cast<uint16_t*>(out)[i] = __bfloat16_as_ushort(__float2bfloat16_rn(x));
        else if (precision == static_cast<int>(Precision::fp16))
            static_cast<uint16_t*>(out)[i] = __half_as_ushort(__float2half_rn(x));
        else static_cast<float*>(out)[i] = x;
    }
}

struct Bytes {
    void* p = nullptr;
    explicit Bytes(size_t n) { CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 16))); }
    ~Bytes() { cudaFree(p); }
    Bytes(const Bytes&) = delete;
    Bytes& operator=(const Bytes&) = delete;
};

template <class T>
int* upload(const std::vector<T>& host, Bytes& dev) {
    CUDA_CHECK(cudaMemcpy(dev.p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
    return static_cast<int*>(dev.p);
}

// The paged cache of a run: its pages' order (the block table, row-major), its shape, the seeds.
struct Cache {
    std::vector<int> order;
    int pages_per_seq = 0;
    long long pool_rows = 0, total_q = 0;
    uint64_t seed_q = 0, seed_k = 0, seed_v = 0;
    long long row(const DecodeOptions& o, int b, int j) const {
        return static_cast<long long>(order[static_cast<size_t>(b) * pages_per_seq + j / o.page_size]) * o.page_size +
               j % o.page_size;
    }
};

struct Errors {
    double output = 0, lse = 0, largest = 0;  // largest: the largest |O| of the float64 reference
    bool finite = true;
};

// The float64 check: sampled sequences, every query head, every query (bottom-right), against the
// cache recomputed on the host from the same generator.
Errors sampled_errors(const DecodeOptions& o, const Cache& c, float scale, const std::vector<float>& out,
                      const std::vector<float>& out_lse) {
    Errors err;
    const int group = o.heads / o.kv_heads;
    for (int si = 0; si < std::min(o.check_sequences, o.batch); ++si) {
        const int b = si * (o.batch - 1) / std::max(1, o.check_sequences - 1);
        for (int h = 0; h < o.heads; ++h) {
            const long long kv = static_cast<long long>(h / group) * c.pool_rows;
            for (int i = 0; i < o.queries; ++i) {
                const long long qrow = static_cast<long long>(h) * c.total_q + static_cast<long long>(b) * o.queries + i;
                const int visible = std::min(o.cache_len, o.cache_len - o.queries + i + 1);
                std::vector<double> s(visible);
                double mx = -INFINITY;
                for (int j = 0; j < visible; ++j) {
                    double dot = 0;
                    for (int e = 0; e < o.d; ++e)
                        dot += static_cast<double>(input_value(qrow * o.d + e, c.seed_q, o.precision)) *
                               input_value((kv + c.row(o, b, j)) * o.d + e, c.seed_k, o.precision);
                    s[j] = dot * scale;
                    mx = std::max(mx, s[j]);
                }
                double l = 0;
                std::vector<double> acc(o.d, 0.0);
                for (int j = 0; j < visible; ++j) {
                    const double p = std::exp(s[j] - mx);
                    l += p;
                    for (int e = 0; e < o.d; ++e)
                        acc[e] += p * input_value((kv + c.row(o, b, j)) * o.d + e, c.seed_v, o.precision);
                }
                for (int e = 0; e < o.d; ++e) {
                    err.output = std::max(err.output, std::fabs(acc[e] / l - out[qrow * o.d + e]));
                    err.largest = std::max(err.largest, std::fabs(acc[e] / l));
                    err.finite = err.finite && std::isfinite(out[qrow * o.d + e]);
                }
                err.lse = std::max(err.lse, std::fabs(mx + std::log(l) - out_lse[qrow]));
                err.finite = err.finite && std::isfinite(out_lse[qrow]);
            }
        }
    }
    return err;
}

// The step run once more and its outputs checked in float64 (sampled_errors).
Errors step_errors(const DecodeOptions& o, const DecodeArgs& a, const Cache& c, size_t rows, cudaStream_t stream) {
    decode_forward(a, stream);
    CUDA_CHECK(cudaStreamSynchronize(stream));
    std::vector<float> out(rows * o.d), out_lse(rows);
    CUDA_CHECK(cudaMemcpy(out.data(), a.O, out.size() * sizeof(float), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(out_lse.data(), a.lse, out_lse.size() * sizeof(float), cudaMemcpyDeviceToHost));
    return sampled_errors(o, c, a.scale, out, out_lse);
}

struct Measured {
    double kernel_ms, copy_ms, kv_bytes, kernel_gbps, copy_gbps;
};

// The lines printed and the JSON (--json); whether the float64 check passed: every value finite,
// the output's largest error within the format's check tolerance of its largest value and lse's
// within it absolutely (bench_check.cu's rule for the flash forward).
bool report(const DecodeOptions& o, const DecodeArgs& a, const Measured& m, const Errors& err) {
    const double kernel_ms = m.kernel_ms, copy_ms = m.copy_ms, kv_bytes = m.kv_bytes, kernel_gbps = m.kernel_gbps,
                 copy_gbps = m.copy_gbps, max_err_o = err.output, max_err_lse = err.lse;
    cudaDeviceProp prop;
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    std::printf("decode: %s, batch %d, heads %d, kv_heads %d, cache %d, page %d, d %d, %s, queries %d, splits %d "
                "of %d keys\n",
                prop.name, o.batch, o.heads, o.kv_heads, o.cache_len, o.page_size, o.d, precision_name(o.precision),
                o.queries, a.splits, a.split_size);
    std::printf("  kernel %.4f ms, %.1f GB/s of K/V read\n", kernel_ms, kernel_gbps);
    std::printf("  copy   %.4f ms, %.1f GB/s read + written\n", copy_ms, copy_gbps);
    std::printf("  fraction of the copy's bandwidth %.3f\n", kernel_gbps / copy_gbps);
    Options format;
    format.precision = o.precision;
    const double tol = check_tolerance(format), relative = err.largest > 0 ? max_err_o / err.largest : max_err_o;
    const bool passed = err.finite && relative <= tol && max_err_lse <= tol;
    std::printf("  float64 check of %d sequences: max |error| O %.3g (%.3g of max|O|), lse %.3g: %s (tolerance %.1e)\n",
                std::min(o.check_sequences, o.batch), max_err_o, relative, max_err_lse, passed ? "passed" : "FAILED",
                tol);
    if (!o.json.empty()) {
        std::ofstream f(o.json);
        f << "{\"device\": \"" << prop.name << "\", \"batch\": " << o.batch << ", \"heads\": " << o.heads
          << ", \"kv_heads\": " << o.kv_heads << ", \"cache_len\": " << o.cache_len << ", \"page_size\": " << o.page_size
          << ", \"d\": " << o.d << ", \"precision\": \"" << precision_name(o.precision) << "\", \"queries\": " << o.queries
          << ", \"splits\": " << a.splits << ", \"split_size\": " << a.split_size << ", \"kernel_ms\": " << kernel_ms
          << ", \"kv_bytes\": " << static_cast<long long>(kv_bytes) << ", \"kernel_gbps\": " << kernel_gbps << ", \"copy_ms\": " << copy_ms
          << ", \"copy_gbps\": " << copy_gbps << ", \"fraction_of_copy\": " << kernel_gbps / copy_gbps
          << ", \"max_error_output\": " << max_err_o << ", \"max_error_lse\": " << max_err_lse << "}\n";
        if (!f) fail(kExitBadInput, "--bench-decode: cannot write " + o.json);
    }
    return passed;
}

}  // namespace

int run_decode(int argc, char** argv) {
    const DecodeOptions o = parse(argc, argv);
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreate(&stream));
    const size_t elem = is_half(o.precision) ? 2 : 4;
    const int pages_per_seq = (o.cache_len + o.page_size - 1) / o.page_size;
    const long long pages = static_cast<long long>(o.batch) * pages_per_seq;
    const long long pool_rows = pages * o.page_size;
    const long long total_q = static_cast<long long>(o.batch) * o.queries;
    const size_t kv_elems = static_cast<size_t>(o.kv_heads) * pool_rows * o.d;
    const uint64_t seed_q = input_seed(o.seed, BenchInput::Q), seed_k = input_seed(o.seed, BenchInput::K),
                   seed_v = input_seed(o.seed, BenchInput::V);

    Bytes Q(static_cast<size_t>(o.heads) * total_q * o.d * elem), K(kv_elems * elem), V(kv_elems * elem);
    auto fill = [&](Bytes& b, long long n, uint64_t seed) {
        fill_bits<<<1024, 256, 0, stream>>>(b.p, n, seed, static_cast<int>(o.precision));
        LAUNCH_CHECK(fill_bits);
    };
    fill(Q, static_cast<long long>(o.heads) * total_q * o.d, seed_q);
    fill(K, static_cast<long long>(kv_elems), seed_k);
    fill(V, static_cast<long long>(kv_elems), seed_v);

    // The cache's pages handed out in a shuffled order; each sequence's table row names its pages.
    std::vector<int> order(static_cast<size_t>(pages));
    std::iota(order.begin(), order.end(), 0);
    std::mt19937_64 rng(o.seed);
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<int> cu_q(o.batch + 1), seqlen(o.batch, o.cache_len);
    for (int b = 0; b <= o.batch; ++b) cu_q[b] = b * o.queries;
    Bytes table_d(order.size() * sizeof(int)), cu_q_d(cu_q.size() * sizeof(int)), seqlen_d(seqlen.size() * sizeof(int));

    DecodeArgs a;
    a.precision = o.precision;
    std::tie(a.heads, a.kv_heads, a.d) = std::tie(o.heads, o.kv_heads, o.d);
    a.scale = 1.f / std::sqrt(static_cast<float>(o.d));
    std::tie(a.batch, a.max_q, a.max_k) = std::tie(o.batch, o.queries, o.cache_len);
    a.total_q = static_cast<int>(total_q);
    a.cu_q = upload(cu_q, cu_q_d);
    a.seqlen_k = upload(seqlen, seqlen_d);
    a.block_table = upload(order, table_d);
    a.table_stride = pages_per_seq;
    a.page_size = o.page_size;
    a.bottom_right = true;  // a decode step's queries are the last keys' (speculative decoding)
    a.right = 0;
    std::tie(a.Q, a.K, a.V) = std::make_tuple(Q.p, K.p, V.p);
    a.kv_stride = pool_rows * o.d;
    a.split_size = o.split_size ? o.split_size : decode_default_split_size(a);
    a.splits = split_count(a.max_k, a.split_size);
    const size_t rows = static_cast<size_t>(o.heads) * total_q;
    DeviceBuffer O_part(a.splits * rows * o.d), lse_part(a.splits * rows), O(rows * o.d), lse(rows);
    a.O_part = O_part.p;
    a.lse_part = lse_part.p;
    a.O = O.p;
    a.lse = lse.p;

    Timer timer(stream);
    const double kernel_ms = timer.median_ms(o.warmup, o.reps, [&] { decode_forward(a, stream); });
    const double kv_bytes = 2.0 * o.batch * o.kv_heads * static_cast<double>(o.cache_len) * o.d * elem;
    Bytes copy_dst(static_cast<size_t>(kv_bytes / 2));
    const double copy_ms = timer.median_ms(o.warmup, o.reps, [&] {
        CUDA_CHECK(cudaMemcpyAsync(copy_dst.p, K.p, static_cast<size_t>(kv_bytes / 2), cudaMemcpyDeviceToDevice, stream));
        CUDA_CHECK(cudaMemcpyAsync(copy_dst.p, V.p, static_cast<size_t>(kv_bytes / 2), cudaMemcpyDeviceToDevice, stream));
    });
    const double kernel_gbps = kv_bytes / (kernel_ms * 1e-3) / 1e9;
    const double copy_gbps = 2.0 * kv_bytes / (copy_ms * 1e-3) / 1e9;

    const Cache cache{order, pages_per_seq, pool_rows, total_q, seed_q, seed_k, seed_v};
    const Errors err = step_errors(o, a, cache, rows, stream);
    const bool passed = report(o, a, Measured{kernel_ms, copy_ms, kv_bytes, kernel_gbps, copy_gbps}, err);
    CUDA_CHECK(cudaStreamDestroy(stream));
    if (!passed) {
        std::fprintf(stderr, "main: error: --bench-decode: the step's outputs exceed the %s tolerance against float64 "
                             "(see the check line)\n", precision_name(o.precision));
        return kExitInternal;
    }
    return kExitOk;
}

}  // namespace bench

int run_decode_bench(int argc, char** argv) { return bench::run_decode(argc, argv); }

}  // namespace attnstep
