// bench_varlen.cu — `main --bench-varlen`: the flash forward on a packed batch of sequences of
// random lengths (a varlen prefill), beside the same kernel on a dense batch at their mean length,
// in the same run.
//
// Sequences of lengths drawn uniformly from 1..--max-len (from --seed) until --tokens are packed,
// the last one cut to fit; --heads heads of width --d, K/V of as many heads, --precision bf16 or
// fp16, causal within each sequence unless --no-causal. The time is what a run of the binary's
// CUDA backend executes for the flash stages of a packed case (CudaBackend::computes_packed): the
// list of the sequences' query blocks built and copied to the device, and the one kernel launch,
// median of --reps runs after --warmup, timed with CUDA events around the call (the GPU waits
// while the host builds the list, so that time is in the figure). The dense batch has as many
// sequences, each of the mean length. FLOP/s count the score pairs a row sees (the causal mask's,
// n(n + 1)/2 per sequence, or n·n), 4·d FLOPs a pair, for both, so the ratio compares work done
// per second. A float64 check of sampled rows (the first and last head) fails the bench (exit 1)
// where the largest error of O relative to max|O|, or of lse, exceeds `main --bench --check`'s
// tolerance for the format, or a value is not finite: a fast wrong kernel cannot pass.
//
//   build/main --bench-varlen                                  # the goal's case: bf16, d 128, causal
//   build/main --bench-varlen --d 64 --precision fp16 --json varlen.json
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "../backend.h"
#include "../common.h"
#include "../sequences.h"
#include "../cuda/cuda_check.cuh"
#include "../cuda/cuda_stages.cuh"
#include "../cuda/half.cuh"
#include "bench.h"
#include "bench_inputs.h"
#include "bench_parts.cuh"

namespace attnstep {
namespace bench {

namespace {

struct VarlenOptions {
    int tokens = 65536, max_len = 8192, heads = 16, d = 128;
    bool causal = true;
    Precision precision = Precision::bf16;
    int warmup = 3, reps = 10, check_rows = 32;
    uint64_t seed = 7;
    std::string json;
};

[[noreturn]] void usage_error(const std::string& what) {
    fail(kExitBadInput, "--bench-varlen: " + what,
         "options: --tokens T --max-len L --heads H --d 64|128 --precision bf16|fp16 [--no-causal] [--warmup W] "
         "[--reps R] [--check-rows C] [--seed S] [--json FILE]");
}

int whole(const std::string& flag, const char* text, int lo) {
    char* end = nullptr;
    const long v = std::strtol(text, &end, 10);
    if (!*text || *end || v < lo || v > kMaxDim)
        usage_error(flag + " wants a whole number " + std::to_string(lo) + ".." + std::to_string(kMaxDim) + ", got '" +
                    text + "'");
    return static_cast<int>(v);
}

VarlenOptions parse(int argc, char** argv) {
    VarlenOptions o;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--bench-varlen") continue;
        if (a == "--no-causal") {
            o.causal = false;
            continue;
        }
        if (i + 1 >= argc) usage_error(a + " needs a value (or is not an option of --bench-varlen)");
        const char* v = argv[++i];
        if (a == "--tokens") o.tokens = whole(a, v, 1);
        else if (a == "--max-len") o.max_len = whole(a, v, 1);
        else if (a == "--heads") o.heads = whole(a, v, 1);
        else if (a == "--d") o.d = whole(a, v, 1);
        else if (a == "--warmup") o.warmup = whole(a, v, 0);
        else if (a == "--reps") o.reps = whole(a, v, 1);
        else if (a == "--check-rows") o.check_rows = whole(a, v, 0);
        else if (a == "--seed") o.seed = static_cast<uint64_t>(whole(a, v, 0));
        else if (a == "--json") o.json = v;
        else if (a == "--precision") {
            const std::string p = v;
            if (p == "bf16") o.precision = Precision::bf16;
            else if (p == "fp16") o.precision = Precision::fp16;
            else usage_error("--precision wants bf16 or fp16, got '" + p + "'");
        } else usage_error("unknown option " + a);
    }
    return o;
}

// Lengths uniform in 1..max_len until `tokens` are packed; the last one cut to fit.
Sequences draw_sequences(const VarlenOptions& o) {
    std::mt19937_64 rng(o.seed);
    std::uniform_int_distribution<int> length(1, o.max_len);
    Sequences s;
    s.cu_q.push_back(0);
    while (s.cu_q.back() < o.tokens) s.cu_q.push_back(std::min<long long>(o.tokens, s.cu_q.back() + length(rng)));
    s.cu_k = s.cu_q;
    return s;
}

// The problem a run of the binary hands the backend: one batch element of `heads` heads over the
// packed tokens (sequences set), or `batch` elements of n queries and keys.
Problem problem(const VarlenOptions& o, int batch, int n, const Sequences* seqs) {
    Problem p;
    p.dims.batch = batch;
    p.dims.heads = o.heads;
    p.dims.N = p.dims.M = n;
    p.dims.dk = p.dims.dv = o.d;
    p.causal = p.variant.causal = o.causal;
    p.scale = 1.f / std::sqrt(static_cast<float>(o.d));
    p.precision = o.precision;
    p.sequences = seqs;
    return p;
}

// The score pairs a sequence of n queries and n keys sees, as `main --bench` counts a dense run's.
double visible_pairs(const VarlenOptions& o, int n) {
    Options dense;
    dense.N = dense.M = n;
    dense.variant.causal = o.causal;
    return visible_entries(dense);
}

// The largest errors, a NaN counted as infinite (it never passes), and the largest |O| of the
// reference, which the output's error is relative to.
struct Errors {
    double output = 0, lse = 0, largest = 0;
    static double worse(double e, double d) { return std::isnan(d) ? INFINITY : std::max(e, d); }
};

// Element e of row `row` of head h of an input ([heads][rows][d], filled from `seed`), as the
// kernel reads it: rounded to the format.
float input_at(const VarlenOptions& o, int rows, int h, long long row, int e, uint64_t seed) {
    const uint64_t i = (static_cast<uint64_t>(h) * rows + row) * o.d + e;
    return round_to(o.precision, uniform_input(i, seed));
}

// The float64 check of sampled rows of the packed run, in the first and the last head.
Errors sampled_errors(const VarlenOptions& o, const Sequences& s, float scale, const std::vector<float>& out,
                      const std::vector<float>& out_lse, uint64_t seed) {
    Errors err;
    std::mt19937_64 rng(o.seed + 1);
    std::uniform_int_distribution<int> token(0, o.tokens - 1);
    for (int c = 0; c < o.check_rows; ++c) {
        const int row = token(rng);
        const int b = static_cast<int>(std::upper_bound(s.cu_q.begin(), s.cu_q.end(), row) - s.cu_q.begin()) - 1;
        const int r = row - s.q_begin(b), keys = o.causal ? r + 1 : s.m(b);
        for (int h : {0, o.heads - 1}) {
            std::vector<double> sc(keys);
            double mx = -INFINITY;
            for (int j = 0; j < keys; ++j) {
                double dot = 0;
                for (int e = 0; e < o.d; ++e)
                    dot += static_cast<double>(input_at(o, o.tokens, h, row, e, input_seed(seed, BenchInput::Q))) *
                           input_at(o, o.tokens, h, s.k_begin(b) + j, e, input_seed(seed, BenchInput::K));
                sc[j] = dot * scale;
                mx = std::max(mx, sc[j]);
            }
            double l = 0;
            std::vector<double> acc(o.d, 0.0);
            for (int j = 0; j < keys; ++j) {
                const double p = std::exp(sc[j] - mx);
                l += p;
                for (int e = 0; e < o.d; ++e)
                    acc[e] += p * input_at(o, o.tokens, h, s.k_begin(b) + j, e, input_seed(seed, BenchInput::V));
            }
            const size_t at = static_cast<size_t>(h) * o.tokens + row;
            for (int e = 0; e < o.d; ++e) {
                err.output = Errors::worse(err.output, std::fabs(acc[e] / l - out[at * o.d + e]));
                err.largest = std::max(err.largest, std::fabs(acc[e] / l));
            }
            err.lse = Errors::worse(err.lse, std::fabs(mx + std::log(l) - out_lse[at]));
        }
    }
    return err;
}

struct Row {
    double ms, tflops;
};

// Prints the rows and writes the JSON (--json); whether the float64 check passed.
bool report(const VarlenOptions& o, const Sequences& s, int mean, const Row& varlen, const Row& dense,
            const Errors& err) {
    Options format;
    format.precision = o.precision;
    const double tol = check_tolerance(format), relative = err.largest > 0 ? err.output / err.largest : err.output;
    const bool passed = relative <= tol && err.lse <= tol;
    cudaDeviceProp prop;
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    const double ratio = varlen.tflops / dense.tflops;
    std::printf("varlen: %s, %d sequences of 1..%d tokens (%d in all), heads %d, d %d, %s, %s\n", prop.name, s.count(),
                o.max_len, o.tokens, o.heads, o.d, precision_name(o.precision), o.causal ? "causal" : "no mask");
    std::printf("  packed        %.4f ms, %.1f TFLOP/s\n", varlen.ms, varlen.tflops);
    std::printf("  dense %5d x %d  %.4f ms, %.1f TFLOP/s\n", s.count(), mean, dense.ms, dense.tflops);
    std::printf("  packed / dense TFLOP/s %.3f\n", ratio);
    std::printf("  float64 check of %d rows: max |error| O %.3g (%.3g of max|O|), lse %.3g: %s (tolerance %.1e)\n",
                o.check_rows, err.output, relative, err.lse, passed ? "passed" : "FAILED", tol);
    if (o.json.empty()) return passed;
    std::ofstream f(o.json);
    f << "{\"device\": \"" << prop.name << "\", \"sequences\": " << s.count() << ", \"tokens\": " << o.tokens
      << ", \"max_len\": " << o.max_len << ", \"mean_len\": " << mean << ", \"heads\": " << o.heads
      << ", \"d\": " << o.d << ", \"precision\": \"" << precision_name(o.precision)
      << "\", \"causal\": " << (o.causal ? "true" : "false") << ", \"packed_ms\": " << varlen.ms
      << ", \"packed_tflops\": " << varlen.tflops << ", \"dense_ms\": " << dense.ms
      << ", \"dense_tflops\": " << dense.tflops << ", \"ratio\": " << ratio << ", \"max_error_output\": " << err.output
      << ", \"max_error_lse\": " << err.lse << ", \"check_passed\": " << (passed ? "true" : "false") << "}\n";
    if (!f) fail(kExitBadInput, "--bench-varlen: cannot write " + o.json);
    return passed;
}

}  // namespace

int run_varlen(int argc, char** argv) {
    const VarlenOptions o = parse(argc, argv);
    if (o.d != 64 && o.d != 128) usage_error("--d must be 64 or 128 (the half-precision flash kernel's widths)");
    const Sequences s = draw_sequences(o);
    const int mean = std::max(1, static_cast<int>(std::lround(static_cast<double>(o.tokens) / s.count())));
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreate(&stream));
    // One set of buffers for both problems: the larger of the packed and the dense batch.
    const size_t elems = static_cast<size_t>(o.heads) * std::max<long long>(o.tokens, 1LL * s.count() * mean) * o.d;
    DeviceBuffer Q(elems), K(elems), V(elems), O(elems), lse(elems / o.d);
    DeviceBuffer halves((3 * elems + 1) / 2);  // Q, K, V in the format, 2 bytes a value
    uint16_t* h = reinterpret_cast<uint16_t*>(halves.p);
    DeviceBuffer* inputs[3] = {&Q, &K, &V};
    for (int i = 0; i < 3; ++i) {
        fill(*inputs[i], input_seed(o.seed, static_cast<BenchInput>(i)), stream);
        launch_to_half(inputs[i]->p, h + i * elems, elems, o.precision, stream);
    }
    auto args = [&](const Problem& p) {
        FlashArgs a = flash_args(p);
        std::tie(a.Q, a.K, a.V, a.O, a.lse) = std::make_tuple(Q.p, K.p, V.p, O.p, lse.p);
        std::tie(a.Qh, a.Kh, a.Vh) = std::make_tuple(h, h + elems, h + 2 * elems);
        return a;
    };
    const FlashArgs packed = args(problem(o, 1, o.tokens, &s)), dense = args(problem(o, s.count(), mean, nullptr));
    if (!flash_forward_available(packed)) usage_error("no flash kernel for a packed batch here (it needs compute capability 9.0)");
    Timer timer(stream);
    double packed_flops = 0;
    for (int b = 0; b < s.count(); ++b) packed_flops += visible_pairs(o, s.n(b));
    const double per_pair = 4.0 * o.d * o.heads;
    const double packed_ms = timer.median_ms(o.warmup, o.reps, [&] { flash_forward(packed, stream); });
    const double dense_ms = timer.median_ms(o.warmup, o.reps, [&] { flash_forward(dense, stream); });
    const Row varlen{packed_ms, packed_flops * per_pair / (packed_ms * 1e-3) / 1e12};
    const Row dense_row{dense_ms, s.count() * visible_pairs(o, mean) * per_pair / (dense_ms * 1e-3) / 1e12};

    flash_forward(packed, stream);  // the checked outputs are the packed run's
    CUDA_CHECK(cudaStreamSynchronize(stream));
    const size_t rows = static_cast<size_t>(o.heads) * o.tokens;
    std::vector<float> out(rows * o.d), out_lse(rows);
    CUDA_CHECK(cudaMemcpy(out.data(), O.p, out.size() * sizeof(float), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(out_lse.data(), lse.p, out_lse.size() * sizeof(float), cudaMemcpyDeviceToHost));
    const bool passed = report(o, s, mean, varlen, dense_row, sampled_errors(o, s, packed.scale, out, out_lse, o.seed));
    CUDA_CHECK(cudaStreamDestroy(stream));
    if (!passed) {
        std::fprintf(stderr, "main: error: --bench-varlen: the packed run's outputs exceed the %s tolerance against "
                             "float64 (see the check line)\n", precision_name(o.precision));
        return kExitInternal;
    }
    return kExitOk;
}

}  // namespace bench

int run_varlen_bench(int argc, char** argv) { return bench::run_varlen(argc, argv); }

}  // namespace attnstep
