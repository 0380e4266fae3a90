// bench_options.h — `main --bench`'s options and the work they describe: the shape, the variant
// (grouped K/V heads, the mask's alignment and window, softcap, ALiBi), and the forward's FLOP
// count, which counts the score entries the mask leaves visible. Plain C++ (no CUDA header), so
// that tests/test_bench_variants.py compiles the parser and the count without a GPU.
#pragma once

#include <string>

#include "../backend.h"
#include "../stages.h"
#include "../variant.h"

namespace attnstep {
namespace bench {

// Which passes `--pass` times.
enum class Passes { forward, backward, both };

struct Options {
    int batch = 1, heads = 12, N = 128, M = 128, d = 64;
    // K/V heads per batch element (--kv-heads: GQA/MQA, a divisor of heads); 0: one per query head.
    int kv_heads = 0;
    // The mask and the score modifications (--causal, --align, --window, --softcap, --alibi): the
    // binary's own Variant, without mask or bias files and without dropout.
    Variant variant;
    float scale = 0.f;  // 0: 1/sqrt(d)
    Precision precision = Precision::fp32;
    int warmup = 3, reps = 20;
    std::string json;
    bool check = false;
    int check_rows = 16;  // sampled rows per checked head; 0 = all rows of all heads
    std::string only = "all";
    Passes passes = Passes::both;
    bool ceilings = true;  // --no-ceilings: skip the ceiling microbenchmarks (no fractions then)
    int fast_variant = 0, splits = 0;
    unsigned seed = 1234;
};

inline bool times_forward(const Options& o) { return o.passes != Passes::backward; }
inline bool times_backward(const Options& o) { return o.passes != Passes::forward; }

// One head's shape, with the K/V heads (Dims::kv_head_of maps a query head to its K/V head).
Dims bench_dims(const Options& o);

// Whether the K/V heads are fewer than the query heads: the inputs then hold B·Hk K/V heads, and
// every run copies them to their query heads (and sums dK, dV over each group).
inline bool grouped(const Options& o) { return bench_dims(o).group_size() > 1; }

// The mask rule of o's variant for its N × M scores (variant.h).
inline MaskRule mask_rule(const Options& o) { return o.variant.rule(o.N, o.M); }

// The score entries one head's mask leaves visible: Σ over rows of end_key − first_key (none when
// the first is past the end), exactly; N·M without a mask.
double visible_entries(const Options& o);

// The forward FLOPs of the attention: 4·d per visible score entry of each of total_heads query
// heads (the two GEMMs' multiply-adds; GQA's heads count as query heads, as they compute).
inline double attention_flops(const Options& o, int total_heads) {
    return 4.0 * total_heads * o.d * visible_entries(o);
}

// The options of `main --bench` from argv (exit 2 on a bad one); --scale defaults to 1/sqrt(d).
Options parse_options(int argc, char** argv);

// "kv_heads 8, window (1024, 0), softcap 50": the variant in words ("none" without one).
std::string variant_text(const Options& o);

}  // namespace bench
}  // namespace attnstep
