// bench_options.cu — `main --bench`'s command line and the FLOP count of its options
// (bench_options.h). Plain C++ in a .cu file: the CUDA build compiles it with the bench, and
// tests/test_bench_variants.py compiles it as C++ with io/variant_manifest.cpp, whose rules
// (the words of verify/variant.py) the variant's options share with the binary's own.
#include "bench_options.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cerrno>
#include <cstdlib>
#include <string>

#include "../common.h"
#include "../io/variant_manifest.h"

namespace attnstep {
namespace bench {

namespace {

[[noreturn]] void bad_option(const std::string& what) {
    fail(kExitBadInput, "--bench: " + what, "run 'main --bench --help' for its options");
}

// "fp32|tf32|bf16|fp16": the precisions of backend.h's table.
std::string precision_choices(const char* sep) {
    std::string out;
    for (const char* name : kPrecisionNames) out += (out.empty() ? "" : sep) + std::string(name);
    return out;
}

void print_usage() {
    const std::string precisions = precision_choices("|");
    std::printf(
        "usage: main --bench [--batch B] [--heads H] [--kv-heads HK] [--seq-q N] [--seq-k M] [--d D]\n"
        "                    [--causal] [--align top-left|bottom-right] [--window L,R] [--softcap C]\n"
        "                    [--alibi] [--scale S] [--precision %s] [--warmup W] [--reps R]\n"
        "                    [--json FILE] [--check] [--check-rows K] [--only all|stages|flash]\n"
        "                    [--pass forward|backward|both] [--no-ceilings] [--seed S]\n"
        "                    [--fast-variant I] [--splits S]\n"
        "\n"
        "Times every stage kernel and the flash kernels on one shape (inputs generated on the GPU),\n"
        "the median of R timed runs after W warm-up runs, each between two CUDA events.\n"
        "  --batch, --heads    B x H query heads (default 1 x 12)\n"
        "  --kv-heads HK       K/V heads per batch element (GQA; 1: MQA; a divisor of H; default H):\n"
        "                      the inputs hold B x HK K/V heads; a run copies each to its query heads\n"
        "                      and sums dK, dV over them, inside the flash rows' times (kv_expand and\n"
        "                      kv_group_sum time them alone)\n"
        "  --seq-q, --seq-k    N query rows, M keys (default 128, 128)\n"
        "  --d                 head width d_k = d_v (default 64)\n"
        "  --causal, --scale   the causal mask; the scale (default 1/sqrt(d))\n"
        "  --align A           top-left (default) or bottom-right: where the causal mask and the window\n"
        "                      sit when N != M\n"
        "  --window L,R        sliding window: row i sees keys diag(i)-L..diag(i)+R (-1 unbounded)\n"
        "  --softcap C         C*tanh(S/C) on the scaled scores (0: none)\n"
        "  --alibi             ALiBi with the standard slopes of H heads\n"
        "                      (FLOP counts count the score entries the mask leaves visible)\n"
        "  --precision         fp32 (default), tf32 (TF32 tensor-core GEMMs), or bf16 / fp16: the flash\n"
        "                      forward and the stage path in the format (cuBLAS GEMMs of bf16/fp16\n"
        "                      operands with float32 accumulation, each stage stored in the format);\n"
        "                      the backward: the flash kernels alone (Hopper; no mask or bias files,\n"
        "                      no dropout)\n"
        "  --warmup, --reps    untimed and timed runs per kernel (default 3, 20)\n"
        "  --json FILE         write the rows as JSON (docs/performance.md)\n"
        "  --check             compare the flash results and the gradients with float64 on the host\n"
        "                      (at bf16/fp16: from the inputs rounded to the format)\n"
        "  --check-rows K      rows sampled per checked head (default 16; 0: every row of every head)\n"
        "  --only              all (default), stages (the stage path) or flash (the flash kernels)\n"
        "  --pass              forward, backward or both (default)\n"
        "  --no-ceilings       skip the ceiling measurements (cuBLAS SGEMM, copy, tensor-core peaks)\n"
        "  --seed S            the inputs' seed (default 1234)\n"
        "  --fast-variant I, --splits S   the mma.sync flash kernel's variant and KV splits, for\n"
        "                      tuning (docs/performance.md)\n",
        precisions.c_str());
}

int parse_int(const std::string& flag, const char* text, int lo, int hi) {
    char* end = nullptr;
    const long v = std::strtol(text, &end, 10);
    if (!*text || *end || v < lo || v > hi) {
        bad_option(flag + " needs an integer in " + std::to_string(lo) + ".." + std::to_string(hi) +
                   ", got '" + text + "'");
    }
    return static_cast<int>(v);
}

// A finite number, else the option's one-line error.
double parse_number(const std::string& flag, const char* text) {
    char* end = nullptr;
    const double v = std::strtod(text, &end);
    if (!*text || *end || !std::isfinite(v)) bad_option(flag + " needs a finite number, got '" + text + "'");
    return v;
}

// Fails when a value breaks its rule (`why` from variant_manifest.h; "" when it holds).
void check_rule(const std::string& flag, const std::string& text, const std::string& why) {
    if (!why.empty()) bad_option(flag + " '" + text + "': " + why);
}

// --window LEFT,RIGHT: two integers, each -1 (unbounded) or a number of keys.
void parse_window(const std::string& flag, const std::string& text, Variant* v) {
    const size_t comma = text.find(',');
    if (comma == std::string::npos)
        bad_option(flag + " needs LEFT,RIGHT (two integers; -1 is unbounded), got '" + text + "'");
    // Any integer parses; the window's own rule (as in a manifest) then names what is wrong.
    auto side = [&](const std::string& part, const char* name) {
        char* end = nullptr;
        errno = 0;
        const long long b = std::strtoll(part.c_str(), &end, 10);
        if (part.empty() || *end || errno == ERANGE)
            bad_option(flag + " " + name + " needs an integer, got '" + part + "'");
        check_rule(flag, text, window_bound_problem(b));
        return static_cast<int>(b);  // (the rule holds: -1 or 0..kMaxWindow)
    };
    v->window_left = side(text.substr(0, comma), "LEFT");
    v->window_right = side(text.substr(comma + 1), "RIGHT");
}

// The variant's options; false when `a` is none of them.
template <class Value>
bool parse_variant_option(const std::string& a, Value&& value, Options* o) {
    Variant& v = o->variant;
    if (a == "--causal") v.causal = true;
    else if (a == "--kv-heads") o->kv_heads = parse_int(a, value(), 1, 1 << 20);
    else if (a == "--align") {
        const std::string t = value();
        if (!parse_align(t, &v.align)) bad_option(a + " must be " + align_choices() + ", got '" + t + "'");
    } else if (a == "--window") parse_window(a, value(), &v);
    else if (a == "--softcap") {
        const char* t = value();
        const double cap = parse_number(a, t);
        check_rule(a, t, softcap_problem(cap));
        v.softcap = static_cast<float>(cap);
        if (!std::isfinite(v.softcap)) bad_option(a + " '" + t + "' is beyond float32's range");
    } else if (a == "--alibi") v.alibi = true;
    else return false;
    return true;
}

// What holds only of the options together: H a multiple of HK, a causal mask's right bound.
void check_together(const Options& o) {
    if (o.kv_heads > 0 && o.heads % o.kv_heads != 0)
        bad_option("--kv-heads " + std::to_string(o.kv_heads) + " must divide --heads " + std::to_string(o.heads));
    const std::string why = o.variant.causal ? causal_window_problem(o.variant.window_right) : "";
    if (!why.empty())
        bad_option("--window right = " + std::to_string(o.variant.window_right) + " with --causal: " + why);
    const long long heads = static_cast<long long>(o.batch) * o.heads;
    if (heads > (1 << 20)) bad_option("batch × heads = " + std::to_string(heads) + " is too many");
}

}  // namespace

Options parse_options(int argc, char** argv) {
    Options o;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        auto value = [&]() -> const char* {
            if (i + 1 >= argc) bad_option(a + " needs a value");
            return argv[++i];
        };
        if (a == "--bench") continue;
        else if (a == "--help" || a == "-h") {
            print_usage();
            std::exit(kExitOk);
        }
        else if (parse_variant_option(a, value, &o)) continue;
        else if (a == "--batch") o.batch = parse_int(a, value(), 1, 1 << 20);
        else if (a == "--heads") o.heads = parse_int(a, value(), 1, 1 << 20);
        else if (a == "--seq-q") o.N = parse_int(a, value(), 1, 1 << 24);
        else if (a == "--seq-k") o.M = parse_int(a, value(), 1, 1 << 24);
        else if (a == "--d") o.d = parse_int(a, value(), 1, 256);
        else if (a == "--scale") {
            const char* t = value();
            o.scale = static_cast<float>(parse_number(a, t));
            if (!std::isfinite(o.scale) || o.scale == 0.f)
                bad_option("--scale needs a finite non-zero number, got '" + std::string(t) + "'");
        } else if (a == "--precision") {
            const std::string p = value();
            bool known = false;
            for (Precision q : kPrecisions)
                if (p == precision_name(q)) o.precision = q, known = true;
            if (!known) bad_option("--precision must be one of " + precision_choices(", ") + ", got '" + p + "'");
        } else if (a == "--warmup") o.warmup = parse_int(a, value(), 0, 1000);
        else if (a == "--reps") o.reps = parse_int(a, value(), 1, 10000);
        else if (a == "--json") o.json = value();
        else if (a == "--check") o.check = true;
        else if (a == "--check-rows") o.check_rows = parse_int(a, value(), 0, 1 << 24);
        else if (a == "--only") {
            o.only = value();
            if (o.only != "all" && o.only != "stages" && o.only != "flash")
                bad_option("--only must be all, stages or flash, got '" + o.only + "'");
        } else if (a == "--pass") {
            const std::string p = value();
            if (p == "forward") o.passes = Passes::forward;
            else if (p == "backward") o.passes = Passes::backward;
            else if (p == "both") o.passes = Passes::both;
            else bad_option("--pass must be forward, backward or both, got '" + p + "'");
        } else if (a == "--no-ceilings") o.ceilings = false;
        else if (a == "--fast-variant") o.fast_variant = parse_int(a, value(), 0, 15);
        else if (a == "--splits") o.splits = parse_int(a, value(), 0, 64);
        else if (a == "--seed") o.seed = static_cast<unsigned>(parse_int(a, value(), 0, 1 << 30));
        else bad_option("unknown option '" + a + "'");
    }
    if (o.scale == 0.f) o.scale = 1.f / std::sqrt(static_cast<float>(o.d));
    check_together(o);
    return o;
}

Dims bench_dims(const Options& o) {
    Dims d;
    d.batch = o.batch;
    d.heads = o.heads;
    d.kv_heads = o.kv_heads;
    d.N = o.N;
    d.M = o.M;
    d.dk = d.dv = o.d;
    return d;
}

double visible_entries(const Options& o) {
    const MaskRule rule = mask_rule(o);
    if (!rule.masks_anything()) return static_cast<double>(o.N) * o.M;
    double visible = 0;
    for (long long r = 0; r < o.N; ++r)
        visible += static_cast<double>(std::max(0LL, rule.end_key(r, o.M) - rule.first_key(r)));
    return visible;
}

std::string variant_text(const Options& o) {
    const Variant& v = o.variant;
    std::string out;
    auto add = [&](const std::string& part) { out += (out.empty() ? "" : ", ") + part; };
    if (grouped(o)) add("kv_heads " + std::to_string(o.kv_heads));
    if (v.causal) add("causal");
    if (v.align != Align::top_left) add(std::string("align ") + align_name(v.align));
    if (v.window_left != kUnbounded || v.window_right != kUnbounded)
        add("window (" + std::to_string(v.window_left) + ", " + std::to_string(v.window_right) + ")");
    if (v.softcap > 0.f) {
        char cap[32];
        std::snprintf(cap, sizeof cap, "%g", v.softcap);
        add(std::string("softcap ") + cap);
    }
    if (v.alibi) add("alibi");
    return out.empty() ? "none" : out;
}

}  // namespace bench
}  // namespace attnstep
