// cli.h — the binary's command line (docs/contract.md, "The binary"), parsed into Options.
// Bad usage throws attnstep::Error with exit 2; main() prints it as one `main: error:` line.
#pragma once

#include <cstdio>
#include <optional>
#include <string>

#include "backend.h"
#include "io/case_layout.h"
#include "io/matrix_io.h"
#include "stages.h"

namespace attnstep {

// The largest --max-memory-mb: 2^30 MiB = 1 PiB, so MB x 2^20 bytes fits any 64-bit size_t.
constexpr long long kMaxMemoryMb = 1LL << 30;

enum class BackendChoice { Auto, Cuda, Cpu };

// The variant's options (docs/contract.md, "The binary"): each overrides the manifest's key, as
// --causal does; unset ones leave it. Every value was checked against its key's rule.
struct VariantOptions {
    std::optional<Align> align;                     // --align
    std::optional<long long> window_left, window_right;  // --window LEFT,RIGHT
    std::string window_text;                        // as given, for messages
    std::optional<double> softcap;                  // --softcap
    bool alibi = false;                             // --alibi
    std::optional<double> dropout;                  // --dropout
    std::optional<long long> dropout_seed;          // --dropout-seed
};

struct Options {
    std::string case_name;           // positional CASE (the original `./main random_test` form)
    std::string in_dir, out_dir;     // empty until given or resolved
    BackendChoice backend = BackendChoice::Auto;
    bool causal = false;             // --causal (overrides the manifest's causal = false)
    VariantOptions variant;
    bool has_scale = false;
    double scale = 0;
    std::string stages_text = "all";
    bool stages_given = false;
    StageSet stages = StageSet::all();
    StageSet stages_named;           // the stages --stages names one by one (not through a group)
    bool has_format = false;
    Format format = Format::txt;
    Precision precision = Precision::fp32;
    bool poison = false;
    FlashKernel flash_kernel = FlashKernel::automatic;
    int split_size = 0;              // --split-size K (1..kMaxDim): the split-KV stages; 0 without
    bool allow_nonfinite = false;
    bool progress = false;           // "main: progress: DONE/TOTAL" lines on stderr
    long long max_memory_mb = 0;     // 0: no cap beyond MemAvailable/2; else 1..kMaxMemoryMb
    bool help = false;
};

Options parse_cli(int argc, char** argv);

// CASE -> --in <data>/CASE and --out <data>/<CASE with _test -> _verify>, where <data> is the
// first of ./data, ../data that holds CASE; with no CASE and no --in, CASE = random_test. A given
// --in without --out writes next to it with the same naming rule.
void resolve_case_paths(Options* o);

// The run's variant: the case's (its manifest's keys), with every key the command line gives in its
// place (--causal, --align, --window, ...). Fails (exit 2) when they combine into a causal mask
// with a window right of the diagonal, naming where each came from.
Variant effective_variant(const Options& o, const InputCase& c);

// The `_test` -> `_verify` naming rule for output folders.
std::string verify_name_for(const std::string& case_name);

void print_usage(FILE* to);

// The --flash-kernel word for a kernel choice ("auto", "wgmma", ...).
const char* flash_kernel_option(FlashKernel k);

// True when the user's --stages list names a flash stage itself (not only through `all`).
bool names_flash_explicitly(const std::string& stages_text);

}  // namespace attnstep
