// cli.cpp — command-line parsing and CASE resolution; see cli.h.
#include "cli.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <iterator>
#include <system_error>

#include "common.h"
#include "io/variant_manifest.h"

namespace fs = std::filesystem;

namespace attnstep {

namespace {

const char* kUsageHint = "run `main --help` for the options";
const char* kDefaultCase = "random_test";

[[noreturn]] void usage_error(const std::string& what) { fail(kExitBadInput, what, kUsageHint); }

double parse_number(const std::string& opt, const std::string& text) {
    char* end = nullptr;
    errno = 0;
    double v = std::strtod(text.c_str(), &end);
    if (text.empty() || *end != '\0' || errno == ERANGE || !std::isfinite(v))
        usage_error(opt + ": '" + text + "' is not a finite number");
    return v;
}

long long parse_positive_int(const std::string& opt, const std::string& text) {
    char* end = nullptr;
    errno = 0;
    long long v = std::strtoll(text.c_str(), &end, 10);
    if (text.empty() || *end != '\0' || errno == ERANGE || v <= 0)
        usage_error(opt + ": '" + text + "' is not a positive integer");
    return v;
}

// --split-size K: keys per split, 1..kMaxDim (a split size from seq_k on is one split; the bound
// keeps K an int).
int parse_split_size(const std::string& text) {
    const std::string opt = "--split-size";
    const long long k = parse_positive_int(opt, text);
    if (k > kMaxDim)
        usage_error(opt + ": '" + text + "' exceeds " + std::to_string(kMaxDim) +
                    " (the largest seq_k; any split size from seq_k on is one split)");
    return static_cast<int>(k);
}

// A whole decimal integer, else a usage error.
long long parse_int(const std::string& opt, const std::string& text) {
    char* end = nullptr;
    errno = 0;
    long long v = std::strtoll(text.c_str(), &end, 10);
    if (text.empty() || *end != '\0' || errno == ERANGE) usage_error(opt + ": '" + text + "' is not an integer");
    return v;
}

// Fails when a value breaks its rule (`why` from variant_manifest.h; "" when it holds).
void check_rule(const std::string& opt, const std::string& text, const std::string& why) {
    if (!why.empty()) usage_error(opt + ": '" + text + "': " + why);
}

// --window LEFT,RIGHT: two integers, each -1 (unbounded) or a number of keys.
void parse_window(const std::string& opt, const std::string& text, VariantOptions* v) {
    const size_t comma = text.find(',');
    if (comma == std::string::npos)
        usage_error(opt + ": '" + text + "' is not LEFT,RIGHT (two integers; -1 is unbounded)");
    const long long left = parse_int(opt + " LEFT", text.substr(0, comma));
    const long long right = parse_int(opt + " RIGHT", text.substr(comma + 1));
    // Each side named by its manifest key, as the manifest's errors and verify/variant.py say it.
    const struct { const char* key; long long bound; } sides[] = {{"window_left", left}, {"window_right", right}};
    for (const auto& side : sides) {
        const std::string why = window_bound_problem(side.bound);
        if (!why.empty())
            check_rule(opt, text, std::string(side.key) + " = " + std::to_string(side.bound) + ": " + why);
    }
    v->window_left = left;
    v->window_right = right;
    v->window_text = text;
}

// The variant's options (cli.h VariantOptions); false when `arg` is none of them. `take_value`
// returns the option's value, `no_value` refuses one.
template <typename Take, typename NoValue>
bool parse_variant_option(const std::string& arg, Take take_value, NoValue no_value, VariantOptions* v) {
    if (arg == "--align") {
        const std::string text = take_value();
        Align a;
        if (!parse_align(text, &a)) usage_error(arg + ": '" + text + "' is not one of " + align_choices());
        v->align = a;
    } else if (arg == "--window") {
        parse_window(arg, take_value(), v);
    } else if (arg == "--softcap") {
        const std::string text = take_value();
        v->softcap = parse_number(arg, text);
        check_rule(arg, text, softcap_problem(*v->softcap));
    } else if (arg == "--alibi") {
        no_value();
        v->alibi = true;
    } else if (arg == "--dropout") {
        const std::string text = take_value();
        v->dropout = parse_number(arg, text);
        check_rule(arg, text, dropout_problem(*v->dropout));
    } else if (arg == "--dropout-seed") {
        const std::string text = take_value();
        v->dropout_seed = parse_int(arg, text);
        check_rule(arg, text, dropout_seed_problem(*v->dropout_seed));
    } else {
        return false;
    }
    return true;
}

template <typename T, size_t K>
T pick(const std::string& opt, const std::string& text, const char* const (&names)[K], const T (&values)[K]) {
    std::string allowed;
    for (size_t i = 0; i < K; ++i) {
        if (text == names[i]) return values[i];
        allowed += (i ? "|" : "") + std::string(names[i]);
    }
    usage_error(opt + ": '" + text + "' is not one of " + allowed);
}

const char* const kFlashKernelNames[] = {"auto", "wgmma", "fast", "clean"};
const FlashKernel kFlashKernels[] = {FlashKernel::automatic, FlashKernel::wgmma, FlashKernel::fast,
                                     FlashKernel::clean};

// A folder given as "" (an unset shell variable) would be the working directory: refused.
std::string folder_value(const std::string& opt, const std::string& folder) {
    if (folder.empty()) usage_error(opt + ": an empty path (name a folder)");
    return folder;
}

}  // namespace

const char* flash_kernel_option(FlashKernel k) {
    for (size_t i = 0; i < std::size(kFlashKernels); ++i)
        if (kFlashKernels[i] == k) return kFlashKernelNames[i];
    return "?";
}

void print_usage(FILE* to) {
    std::fprintf(to,
        "usage: main [CASE] [--in DIR] [--out DIR] [--backend auto|cuda|cpu] [--causal]\n"
        "            [--align top-left|bottom-right] [--window LEFT,RIGHT] [--softcap C] [--alibi]\n"
        "            [--dropout P] [--dropout-seed S]\n"
        "            [--scale S] [--stages LIST] [--format txt|npy] [--precision fp32|tf32|bf16|fp16]\n"
        "            [--poison] [--flash-kernel auto|wgmma|fast|clean] [--split-size K] [--allow-nonfinite]\n"
        "            [--max-memory-mb MB] [--progress]\n"
        "       main --bench ...   (benchmarks; CUDA builds only: main --bench --help)\n"
        "       main --bench-decode ... | --bench-varlen ...   (the paged decode kernel; a packed\n"
        "                          batch beside a dense one: docs/performance.md)\n"
        "\n"
        "Computes attention one stage at a time and writes every stage per head (docs/contract.md).\n"
        "  CASE               case name under ./data or ../data (default random_test); output goes\n"
        "                     to the sibling <name with _test -> _verify>\n"
        "  --in DIR           input case folder (Q/K/V_head_<i>.txt|.npy, optional dO_head_<i> and\n"
        "                     manifest.toml)\n"
        "  --out DIR          output case folder (created; must differ from --in)\n"
        "  --backend B        auto (CUDA when built and a GPU is present, else CPU), cuda, cpu\n"
        "  --causal           causal mask: query i sees keys j <= diag(i) (diag(i) = i, or i + M - N\n"
        "                     when aligned bottom-right)\n"
        "  --align A          top-left (default) | bottom-right: where the causal mask and the window\n"
        "                     sit when N != M (diag(i) = i + M - N: flash-attn's convention)\n"
        "  --window L,R       sliding window: query i sees keys diag(i)-L..diag(i)+R; -1 is unbounded\n"
        "  --softcap C        cap the scaled scores: C*tanh(S/C) (C > 0; 0: none)\n"
        "  --alibi            ALiBi: S - slope_h*|diag(i) - j| (slopes from alibi_slopes.txt|.npy in\n"
        "                     the case, else the standard geometric slopes)\n"
        "  --dropout P        dropout probability in [0, 1): writes the keep-mask as dropout_mask\n"
        "  --dropout-seed S   dropout's seed (an integer >= 0; default 0), with --dropout P or a case\n"
        "                     that has dropout\n"
        "                     These options override the manifest's keys; run.toml records the values\n"
        "  --scale S          scale for QK (default: the manifest's, else 1/sqrt(d_k))\n"
        "  --stages LIST      all | stages | flash | comma-separated stage names (default all).\n"
        "                     all: every stage the case allows; stages: the stage path; flash: the\n"
        "                     flash stages. The backward stages (dO onwards) only when the case has dO\n"
        "  --format F         output format txt|npy (default: the input's)\n"
        "  --precision P      fp32 | tf32 (GEMM operands rounded to TF32) | bf16 | fp16 (inputs and\n"
        "                     stage values rounded to the format, float32 accumulation and softmax;\n"
        "                     CUDA flash stages: the forward on Hopper GPUs, d 64/128)\n"
        "  --poison           pre-fill outputs with NaN so unwritten elements show\n"
        "  --flash-kernel K   auto | wgmma | fast | clean: the CUDA flash kernel. wgmma: Hopper, d 64/128;\n"
        "                     fast: mma.sync tensor cores, d 16-128; clean: plain FP32. auto: the\n"
        "                     fastest measured for the shape on this GPU (wgmma: d 64/128 from\n"
        "                     N = M = 2048, d 64 non-causal from 1024; the only one at bf16/fp16)\n"
        "  --split-size K     split the keys K at a time, as flash-decoding does: also writes each split's\n"
        "                     output and lse (split_output, split_lse: one file per split), and\n"
        "                     flash_output, flash_lse as their combine\n"
        "  --allow-nonfinite  accept NaN/Inf in the inputs\n"
        "  --max-memory-mb MB cap the working memory, at most 1 PiB (heads are processed in groups\n"
        "                     that fit)\n"
        "  --progress         report progress on stderr as 'main: progress: DONE/TOTAL' lines (units:\n"
        "                     a head read, a head computed, a stage file written), at most one a percent\n"
        "exit status: 0 ok, 1 internal/CUDA failure, 2 bad usage or input, 3 not enough memory\n");
}

Options parse_cli(int argc, char** argv) {
    Options o;
    bool have_in = false;
    for (int i = 1; i < argc; ++i) {
        std::string arg = argv[i], value;
        bool inline_value = false;
        if (arg.size() > 2 && arg.compare(0, 2, "--") == 0) {
            size_t eq = arg.find('=');
            if (eq != std::string::npos) {
                value = arg.substr(eq + 1);
                arg = arg.substr(0, eq);
                inline_value = true;
            }
        }
        auto take_value = [&]() -> std::string {
            if (inline_value) return value;
            if (i + 1 >= argc) usage_error(arg + " needs a value");
            return argv[++i];
        };
        auto no_value = [&]() {
            if (inline_value) usage_error(arg + " takes no value");
        };
        if (arg == "--help" || arg == "-h") { o.help = true; }
        else if (arg == "--in") { o.in_dir = folder_value(arg, take_value()); have_in = true; }
        else if (arg == "--out") { o.out_dir = folder_value(arg, take_value()); }
        else if (arg == "--backend") {
            static const char* const names[] = {"auto", "cuda", "cpu"};
            static const BackendChoice values[] = {BackendChoice::Auto, BackendChoice::Cuda, BackendChoice::Cpu};
            o.backend = pick(arg, take_value(), names, values);
        }
        else if (arg == "--causal") { no_value(); o.causal = true; }
        else if (parse_variant_option(arg, take_value, no_value, &o.variant)) {}
        else if (arg == "--scale") {
            std::string text = take_value();
            o.scale = parse_number(arg, text);
            if (!scale_fits_float32(o.scale)) usage_error("--scale: '" + text + "': " + kScaleRangeWords);
            o.has_scale = true;
        }
        else if (arg == "--stages") {
            o.stages_text = take_value();
            o.stages_given = true;
            std::string bad;
            if (!parse_stage_list(o.stages_text, &o.stages, &bad, &o.stages_named)) {
                std::string names;
                for (int s = 0; s < kNumStages; ++s) names += std::string(" ") + stage_name(static_cast<Stage>(s));
                fail(kExitBadInput, "--stages: unknown stage '" + bad + "'",
                     "use all, stages, flash or a comma-separated list of:" + names);
            }
        }
        else if (arg == "--format") {
            std::string v = take_value();
            if (!parse_format(v, &o.format)) usage_error("--format: '" + v + "' is not one of txt|npy");
            o.has_format = true;
        }
        else if (arg == "--precision") {
            o.precision = pick(arg, take_value(), kPrecisionNames, kPrecisions);
        }
        else if (arg == "--poison") { no_value(); o.poison = true; }
        else if (arg == "--flash-kernel") {
            o.flash_kernel = pick(arg, take_value(), kFlashKernelNames, kFlashKernels);
        }
        else if (arg == "--split-size") { o.split_size = parse_split_size(take_value()); }
        else if (arg == "--allow-nonfinite") { no_value(); o.allow_nonfinite = true; }
        else if (arg == "--progress") { no_value(); o.progress = true; }
        else if (arg == "--max-memory-mb") {
            std::string text = take_value();
            o.max_memory_mb = parse_positive_int(arg, text);
            if (o.max_memory_mb > kMaxMemoryMb)  // beyond this, MB x MiB could overflow size_t
                usage_error("--max-memory-mb: '" + text + "' exceeds " + std::to_string(kMaxMemoryMb) + " (1 PiB)");
        }
        else if (arg.size() > 1 && arg[0] == '-') { usage_error("unknown option '" + arg + "'"); }
        else if (arg.empty()) { usage_error("an empty argument (name a CASE, or leave it out)"); }
        else if (o.case_name.empty()) { o.case_name = arg; }
        else { usage_error("unexpected argument '" + arg + "' (CASE is already '" + o.case_name + "')"); }
    }
    if (have_in && !o.case_name.empty())
        usage_error("give either CASE ('" + o.case_name + "') or --in, not both");
    return o;
}

Variant effective_variant(const Options& o, const InputCase& c) {
    Variant v = c.variant;
    const VariantOptions& opt = o.variant;
    v.causal = o.causal || c.causal;
    if (opt.align) v.align = *opt.align;
    if (opt.window_left) {
        v.window_left = *opt.window_left;
        v.window_right = *opt.window_right;
    }
    if (opt.softcap) v.softcap = static_cast<float>(*opt.softcap);
    v.alibi = v.alibi || opt.alibi;
    if (opt.dropout) v.dropout = static_cast<float>(*opt.dropout);
    if (opt.dropout_seed) v.dropout_seed = static_cast<uint64_t>(*opt.dropout_seed);
    // A seed for a run that has no dropout at all is a mistaken command (it would change nothing);
    // with --dropout given (0 included: dropout turned off) it stays a plain override.
    if (opt.dropout_seed && !opt.dropout && c.variant.dropout == 0.f)
        fail(kExitBadInput, "--dropout-seed " + std::to_string(*opt.dropout_seed) +
                                ": the run has no dropout (neither --dropout P nor the case's manifest gives one)",
             "add --dropout P (P > 0), or leave out --dropout-seed");
    const std::string why = v.causal ? causal_window_problem(v.window_right) : "";
    if (!why.empty()) {
        const std::string window = opt.window_left ? "--window " + opt.window_text : c.where_window_right;
        const std::string causal = o.causal ? "--causal" : c.where_causal;
        fail(kExitBadInput, window + ": window_right = " + std::to_string(v.window_right) + ": " + why +
                                " (causal from " + causal + ")",
             "give the window's right bound as 0 or -1, or drop causal");
    }
    return v;
}

std::string verify_name_for(const std::string& case_name) {
    const std::string suffix = "_test";
    if (case_name.size() > suffix.size() &&
        case_name.compare(case_name.size() - suffix.size(), suffix.size(), suffix) == 0)
        return case_name.substr(0, case_name.size() - suffix.size()) + "_verify";
    return case_name + "_verify";
}

void resolve_case_paths(Options* o) {
    if (o->in_dir.empty()) {
        std::string name = o->case_name.empty() ? kDefaultCase : o->case_name;
        std::string data;
        std::error_code ec;
        for (const char* root : {"data", "../data"})
            if (fs::is_directory(fs::path(root) / name, ec)) { data = root; break; }
        if (data.empty())
            fail(kExitBadInput, "case '" + name + "' not found in ./data or ../data",
                 "generate it with `attnstep generate`, or pass --in DIR");
        o->in_dir = data + "/" + name;
        if (o->out_dir.empty()) o->out_dir = data + "/" + verify_name_for(name);
        return;
    }
    if (o->out_dir.empty()) {
        fs::path in = fs::path(o->in_dir).lexically_normal();
        if (!in.has_filename()) in = in.parent_path();  // "dir/" -> "dir"
        std::string name = in.filename().string();
        if (name.empty() || name == "." || name == "..")
            usage_error("--out is needed: cannot derive an output folder name from --in '" + o->in_dir + "'");
        o->out_dir = (in.parent_path() / verify_name_for(name)).string();
    }
}

bool names_flash_explicitly(const std::string& stages_text) {
    size_t start = 0;
    while (true) {
        size_t comma = stages_text.find(',', start);
        std::string tok = stages_text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
        StageSet s;
        std::string bad;
        if (tok != "all" && parse_stage_list(tok, &s, &bad) && s.any_flash()) return true;
        if (comma == std::string::npos) return false;
        start = comma + 1;
    }
}

}  // namespace attnstep
