// bench_options.cu — `main --bench`'s command line.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "../common.h"
#include "bench_parts.cuh"

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
        "usage: main --bench [--batch B] [--heads H] [--seq-q N] [--seq-k M] [--d D] [--causal]\n"
        "                    [--scale S] [--precision %s] [--warmup W] [--reps R]\n"
        "                    [--json FILE] [--check] [--check-rows K] [--only all|stages|flash]\n"
        "                    [--pass forward|backward|both] [--no-ceilings] [--seed S]\n"
        "                    [--fast-variant I] [--splits S]\n"
        "\n"
        "Times every stage kernel and the flash kernels on one shape (inputs generated on the GPU),\n"
        "the median of R timed runs after W warm-up runs, each between two CUDA events.\n"
        "  --batch, --heads    B x H heads (default 1 x 12)\n"
        "  --seq-q, --seq-k    N query rows, M keys (default 128, 128)\n"
        "  --d                 head width d_k = d_v (default 64)\n"
        "  --causal, --scale   the top-left causal mask; the scale (default 1/sqrt(d))\n"
        "  --precision         fp32 (default), tf32 (TF32 tensor-core GEMMs), or bf16 / fp16: the flash\n"
        "                      forward and the stage path in the format (cuBLAS GEMMs of bf16/fp16\n"
        "                      operands with float32 accumulation, each stage stored in the format);\n"
        "                      the backward is timed at fp32 and tf32 only\n"
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
        else if (a == "--batch") o.batch = parse_int(a, value(), 1, 1 << 20);
        else if (a == "--heads") o.heads = parse_int(a, value(), 1, 1 << 20);
        else if (a == "--seq-q") o.N = parse_int(a, value(), 1, 1 << 24);
        else if (a == "--seq-k") o.M = parse_int(a, value(), 1, 1 << 24);
        else if (a == "--d") o.d = parse_int(a, value(), 1, 256);
        else if (a == "--causal") o.causal = true;
        else if (a == "--scale") {
            const char* t = value();
            char* end = nullptr;
            o.scale = std::strtof(t, &end);
            if (!*t || *end || !std::isfinite(o.scale) || o.scale == 0.f)
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
    const long long heads = static_cast<long long>(o.batch) * o.heads;
    if (heads > (1 << 20)) bad_option("batch × heads = " + std::to_string(heads) + " is too many");
    return o;
}

Dims bench_dims(const Options& o) {
    Dims d;
    d.batch = o.batch;
    d.heads = o.heads;
    d.N = o.N;
    d.M = o.M;
    d.dk = d.dv = o.d;
    return d;
}

}  // namespace bench
}  // namespace attnstep
