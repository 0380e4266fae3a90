// main.cpp — the attnstep binary: reads an input case, computes the selected attention stages
// head group by head group on a backend, and writes one file per stage and head plus run.toml
// (docs/contract.md). Order of work, so that bad input never leaves a half-written case:
//   1. parse the command line, find and check the input case (every file, the manifest, shapes,
//      the variant's mask/bias/slopes files), choose the stages and the backend, check the output
//      folder: all before writing anything;
//   2. mark the output folder as holding an unfinished run; plan the head groups (so that not
//      enough memory is a run that did not finish); per group: read Q/K/V (and dO; a grouped
//      case's K/V head copied to each of its query heads) and the variant's per-head files,
//      compute, and write the stage files into a staging folder inside it (io/run_folder.h): the
//      K/V stages once per K/V head, the gradients summed over its query heads (group_plan.h); a
//      packed case's group one sequence at a time, each a dense problem (packed_run.h);
//   3. write run.toml last, then put the staged files in place of the previous run's at once. On
//      any failure the previous run's files stay untouched and the marker says why.
#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>
#include <unistd.h>

#include "backend.h"
#include "bench/bench.h"
#include "cli.h"
#include "common.h"
#include "group_plan.h"
#include "packed_run.h"
#include "io/atomic_file.h"
#include "io/case_layout.h"
#include "io/manifest.h"
#include "io/matrix_io.h"
#include "io/output_folder.h"
#include "io/run_folder.h"
#include "io/run_files.h"
#include "io/sequence_inputs.h"
#include "io/variant_inputs.h"
#include "stages.h"

namespace attnstep {

namespace {

void notice(const std::string& line) { std::fprintf(stderr, "main: notice: %s\n", line.c_str()); }

std::unique_ptr<Backend> choose_backend(BackendChoice choice) {
    switch (choice) {
        case BackendChoice::Cpu: return make_cpu_backend();
        case BackendChoice::Cuda:
            if (!cuda_backend_built())
                fail(kExitBadInput, "--backend cuda: this binary was built without CUDA",
                     std::string(kHowToBuildCuda) + "; or use --backend cpu");
            if (!cuda_device_available())
                fail(kExitBadInput, "--backend cuda: no CUDA device found",
                     "run on a machine with an NVIDIA GPU, or use --backend cpu");
            return make_cuda_backend();
        case BackendChoice::Auto:
            // One line either way: a CPU-only build says so and how to get CUDA (no device was
            // looked for); a CUDA build that finds no device says that.
            if (!cuda_backend_built())
                notice(std::string("this binary was built without CUDA; using the CPU backend; to use a GPU, ") +
                       kHowToBuildCuda);
            else if (cuda_device_available())
                return make_cuda_backend();
            else
                notice("no CUDA device found; using the CPU backend");
            return make_cpu_backend();
    }
    fail(kExitInternal, where(__FILE__, __LINE__) + ": unknown backend choice");
}

// The split stages' shape (--split-size K, Problem::split_size): S = split_count over the most keys
// a query row reads (the largest m(b) of a packed case, where every sequence is split S ways, else
// M). Split-KV is an inference path (flash-attn splits no pass that drops weights), so dropout with
// it is refused; the split stages count in the case's size.
void set_splits(const Options& o, const InputCase& c, Problem& p) {
    if (o.split_size == 0) return;
    const std::string opt = "--split-size " + std::to_string(o.split_size);
    if (p.variant.dropout > 0.f)
        fail(kExitBadInput, opt + ": the split stages have no dropout (this run has dropout = " +
                                toml_float(p.variant.dropout) + ")",
             "drop --split-size, or run without dropout (--dropout 0)");
    int max_keys = c.dims.M;
    if (c.packed()) {
        max_keys = 0;
        for (int b = 0; b < c.sequences.count(); ++b) max_keys = std::max(max_keys, c.sequences.m(b));
    }
    p.split_size = o.split_size;
    p.dims.splits = split_count(max_keys, o.split_size);
    if (static_cast<long long>(p.dims.splits) * p.dims.dv > std::numeric_limits<int>::max())
        fail(kExitBadInput, opt + ": " + plural(p.dims.splits, "split") + " of d_v = " + std::to_string(p.dims.dv) +
                                " columns is more than one row of split_output holds",
             "pass a larger --split-size");
    check_case_limits(c.dir + " with " + opt, p.dims, c.backward, false);
}

Problem make_problem(const Options& o, const InputCase& c) {
    Problem p;
    p.dims = c.dims;
    p.variant = effective_variant(o, c);
    p.causal = p.variant.causal;
    check_packed_dropout_option(c, p.variant.dropout);
    // The keep-mask counts in the case's size only with dropout: --dropout on a case without it
    // checks the limits again (the manifest's dropout was counted when the case was opened).
    if (p.variant.dropout > 0.f && !(c.variant.dropout > 0.f))
        check_case_limits(c.dir + " with --dropout", c.dims, c.backward, true);
    // A given scale was checked to survive the float32 conversion (scale_fits_float32).
    double scale = o.has_scale ? o.scale : c.has_scale ? c.scale : 1.0 / std::sqrt(static_cast<double>(c.dims.dk));
    p.scale = static_cast<float>(scale);
    p.precision = o.precision;
    p.poison = o.poison;
    p.flash_kernel = o.flash_kernel;
    set_splits(o, c, p);
    return p;
}

// The CPU backend has one flash kernel (its tiled one, cpu-tiled): forcing any --flash-kernel
// there is a kernel without a variant, exit 2 as on the GPU (cuda/flash_fwd.cu says the same for
// a CUDA kernel the build or the GPU lacks). Only when a flash stage is computed, as there.
void check_forced_flash_kernel(const Options& o, const Backend& be, StageSet computed) {
    if (!computed.any_flash() || o.flash_kernel == FlashKernel::automatic || std::string(be.name()) != "cpu")
        return;
    const std::string k = flash_kernel_option(o.flash_kernel);
    fail(kExitBadInput, "--flash-kernel " + k + ": no " + k + " variant on the CPU backend (it has only its tiled kernel)",
         "use --flash-kernel auto, or --backend cuda on a machine with an NVIDIA GPU");
}

// The backward stages need the case's dO. Named one by one they are an error without; through a
// group (all, stages, flash) they are left out.
StageSet drop_backward(const Options& o, const InputCase& c, StageSet sel) {
    const StageSet named = StageSet{o.stages_named.bits & StageSet::backward().bits};
    if (!c.backward && !named.empty())
        fail(kExitBadInput, "--stages " + o.stages_text + ": " + stage_list(named) +
                                (named.bits & (named.bits - 1) ? " are backward stages" : " is a backward stage") +
                                " and the case " + c.dir + " has no dO (the output gradient)",
             "`attnstep generate --backward` writes a case with dO");
    return c.backward ? sel : sel.minus(StageSet::backward());
}

// The stages computed through dropout's keep-mask: the stage path's output, dS and dV (which list it
// as a source) and the flash stages that redraw it. Each can be checked only against the mask.
constexpr StageSet kKeepMaskReaders{stage_mask(Stage::output, Stage::dS, Stage::dV, Stage::flash_output,
                                               Stage::flash_dQ, Stage::flash_dK, Stage::flash_dV)};

// The dropout stage (dropout_mask) exists only in a run with dropout: named one by one it is an
// error without; through a group (all, stages) it is left out, and never computed. With dropout it
// is written beside any stage computed through it, so that the run can be checked.
StageSet drop_dropout(const Options& o, const Problem& p, StageSet sel) {
    if (p.variant.dropout > 0.f)
        return sel.any(kKeepMaskReaders) ? StageSet{sel.bits | StageSet::dropout().bits} : sel;
    const StageSet named{o.stages_named.bits & StageSet::dropout().bits};
    if (!named.empty())
        fail(kExitBadInput, "--stages " + o.stages_text + ": " + stage_list(named) +
                                " exists only in a run with dropout (this one has dropout = 0)",
             "pass --dropout P, or set dropout in manifest.toml");
    return sel.minus(StageSet::dropout());
}

// What asks for the flash stages `lacking` by name, for the errors when they cannot be computed: the
// --stages list that names a flash stage, else --split-size when the flash forward is among them
// (the split stages come only with it); "" when only a group (all) takes them, and they are then
// left out with a notice.
std::string flash_asked_by(const Options& o, StageSet lacking) {
    if (names_flash_explicitly(o.stages_text)) return "--stages " + o.stages_text;
    const bool forward = lacking.any(StageSet::flash().minus(StageSet::backward()));
    return o.split_size > 0 && forward ? "--split-size " + std::to_string(o.split_size) : "";
}

// The split stages exist only in a run that splits (--split-size): named one by one without it they
// are an error; through a group (all, flash) they are left out, and never computed. A run that
// splits writes them beside the flash forward's stages, which are their combine (unless the list
// names split stages itself), and only there: a selection without the flash forward (the stage
// path, the backward alone) is an error.
StageSet drop_splits(const Options& o, const Problem& p, StageSet sel) {
    const StageSet splits = StageSet::splits();
    if (p.split_size == 0) {
        const StageSet named{o.stages_named.bits & splits.bits};
        if (!named.empty())
            fail(kExitBadInput, "--stages " + o.stages_text + ": " + stage_list(named) +
                                    (named.count() > 1 ? " exist" : " exists") + " only in a run that splits the keys",
                 "pass --split-size K (the keys per split)");
        return sel.minus(splits);
    }
    const StageSet forward_flash = StageSet::flash().minus(StageSet::backward());
    if (!sel.any(forward_flash))
        fail(kExitBadInput, "--split-size " + std::to_string(p.split_size) +
                                ": the split stages come with the flash forward (flash_output, flash_lse), which --stages " +
                                o.stages_text + " does not select",
             "add flash_output to --stages (or select all or flash), or drop --split-size");
    return sel.any(splits) ? sel : StageSet{sel.bits | splits.bits};  // split stages named: those alone
}

// At a half precision a backend may lack some flash kernels (the CUDA backend has them on compute
// capability 9.0 only, neither for mask or bias files nor dropout; the CPU backend emulates them
// all): those stages
// are an error when asked for (by name or by a group such as `flash`, as for an unsupported head
// size), and left out with a notice under the default `all`.
StageSet drop_half_flash(const Options& o, const Backend& be, const Problem& p, StageSet sel) {
    if (!is_half(o.precision) || !sel.any_flash()) return sel;
    const StageSet missing{sel.bits & StageSet::flash().bits & ~be.half_flash_stages(p).bits};
    if (missing.empty()) return sel;
    const std::string why = std::string("--precision ") + precision_name(o.precision) + ": the " + be.name() +
                            " backend has no half-precision kernel for " + stage_list(missing) + " on " + be.device_name();
    const std::string asker = flash_asked_by(o, missing);
    if (!asker.empty())
        fail(kExitBadInput, why + " (" + asker + ")",
             "select the stage path (--stages stages), or use --backend cpu, which emulates the flash kernels");
    notice(why + "; skipping them");
    return sel.minus(missing);
}

// The stages to write: the user's list, less the backward stages when the case has no dO
// (drop_backward), and less the flash stages when the dimensions do not allow them and the
// user did not name them.
StageSet select_stages(const Options& o, const InputCase& c) {
    StageSet sel = drop_backward(o, c, o.stages);
    const Dims& d = c.dims;
    if (!sel.any_flash() || flash_supported(d)) return sel;
    std::string why = "flash stages need d_k = d_v in " + flash_head_dims_text() + "; this case has d_k = " +
                      std::to_string(d.dk) + ", d_v = " + std::to_string(d.dv);
    const StageSet flash{sel.bits & StageSet::flash().bits};
    const std::string asker = flash_asked_by(o, flash);
    if (!asker.empty())
        fail(kExitBadInput, asker + ": " + why,
             names_flash_explicitly(o.stages_text)
                 ? "drop the flash stages (--stages stages) or generate a case with a supported head size"
                 : "drop --split-size, or generate a case with a supported head size");
    // (the split stages, part of the group, are written only by a run that splits: not named here)
    notice(why + "; skipping " + stage_list(o.split_size > 0 ? flash : flash.minus(StageSet::splits())));
    return sel.minus(flash);
}

// Plans the head groups, then per group reads the inputs (the variant's too), computes and writes
// the stage files into rs.out_dir: the query heads' after each group, a K/V head's when its last
// query head is computed (KvStageSum); run.toml last.
// A packed case (in.packed()) is computed sequence by sequence within each group, or in one call
// where the backend has a kernel for it (packed_run.h): its score stages are written per sequence
// as each is computed, the other stages over the packed tokens with the group.
void compute_and_write(const Options& o, const Problem& p, const InputCase& in, VariantInputs& variant_inputs,
                       Backend& be, StageSet written, StageSet computed, RunState& rs) {
    const Sequences* seqs = in.packed() ? &in.sequences : nullptr;
    GroupPlan plan = plan_groups(o, p, computed, be, seqs);
    const Dims& d = p.dims;
    const int total = d.total_heads();
    rs.progress.on = o.progress;
    rs.progress.total = progress_units(d, written, seqs);
    // Buffers over the packed tokens hold no score stage: those exist per sequence only.
    const StageSet buffered = seqs ? computed.minus(StageSet::where(is_score_stage)) : computed;
    const StageSet written_per_head = seqs ? written.minus(StageSet::where(is_score_stage)) : written;
    PackedRun packed(p, in.sequences, computed, written);
    std::vector<float> buf[kNumStages];
    std::vector<float> inputs[kNumStages];
    KvStageSum kv_stages(d, written);
    for (int first = 0; first < total; first += plan.group_size) {
        HeadGroup g;
        g.first = first;
        g.count = std::min(plan.group_size, total - first);
        read_group_inputs(in, o.allow_nonfinite, p.precision, computed, d, g, inputs, rs.progress);
        variant_inputs.read_group(g);
        for (int i = 0; i < kNumStages; ++i)
            if (buffered.has(static_cast<Stage>(i))) {
                buf[i].resize(stage_elems(static_cast<Stage>(i), d) * g.count);
                g.out[i] = buf[i].data();
            }
        check_interrupted();
        if (seqs)
            packed.compute(be, g, &rs.times, [&](Stage s, int head, int seq, const float* data, const Dims& seq_dims) {
                write_sequence_stage_file(rs, s, head, seq, data, seq_dims);
            });
        else
            be.compute(p, computed, g, &rs.times);
        rs.progress.step(g.count);
        write_group(rs, g, written_per_head, d);
        kv_stages.add(g, [&](Stage s, int kv_head, const float* data) { write_stage_file(rs, s, kv_head, data, d); });
    }
    check_interrupted();
    // The flash plan recorded is the one launch's where the backend computes the case packed.
    Problem recorded = p;
    if (seqs && be.computes_packed(p, *seqs, computed)) recorded.sequences = seqs;
    write_run_manifest(rs, o, recorded, be, computed, written, in.sequences.count());
}

int run(int argc, char** argv) {
    catch_signals();  // from the start, so that no signal ends the binary without a word
    Options o = parse_cli(argc, argv);
    if (o.help) {
        print_usage(stdout);
        return kExitOk;
    }
    resolve_case_paths(&o);
    InputCase in = open_input_case(o.in_dir);
    Problem p = make_problem(o, in);
    std::unique_ptr<Backend> be = choose_backend(o.backend);
    // The split stages are settled before the half-precision ones: a refusal then names only stages
    // the run would compute.
    StageSet written = drop_half_flash(o, *be, p, drop_splits(o, p, drop_dropout(o, p, select_stages(o, in))));
    StageSet computed = drop_splits(o, p, drop_dropout(o, p, dependency_closure(written)));
    check_forced_flash_kernel(o, *be, computed);
    VariantInputs variant_inputs(in, p);  // the broadcast mask/bias and the slopes: checked before OUT is touched

    RunState rs;
    rs.run_id = make_run_id();
    rs.out_format = o.has_format ? o.format : in.format;
    // From here on files change (the first is prepare_output_dir's write probe); a failure leaves
    // the previous run's files as they were, marked as unfinished.
    check_interrupted(false);
    prepare_output_dir(o.out_dir, o.in_dir, rs.run_id);
    if (int n = remove_stale_temporaries(o.out_dir, rs.run_id))
        notice("removed " + plural(n, "temporary file") + " left in " + o.out_dir + " by runs that were killed");
    RunFolder folder(o.out_dir, rs.run_id);
    try {
        folder.begin();
        rs.out_dir = folder.staging();
        compute_and_write(o, p, in, variant_inputs, *be, written, computed, rs);
        check_interrupted();
        folder.commit(staged_names(rs));
    } catch (const Error& e) {
        folder.abandon(e.what());
        throw;
    } catch (const std::bad_alloc&) {
        folder.abandon("out of host memory while allocating buffers");
        throw;
    } catch (const std::exception& e) {
        folder.abandon(std::string("internal error: ") + e.what());
        throw;
    }
    if (int sig = pending_signal())
        notice(signal_words(sig) + " arrived while the finished run was put in place; the run is complete");
    return kExitOk;
}

bool wants(const char* flag, int argc, char** argv) {
    for (int i = 1; i < argc; ++i)
        if (std::string(argv[i]) == flag) return true;
    return false;
}

}  // namespace

}  // namespace attnstep

int main(int argc, char** argv) {
    using namespace attnstep;
    try {
        if (wants("--bench-decode", argc, argv)) return run_decode_bench(argc, argv);
        if (wants("--bench-varlen", argc, argv)) return run_varlen_bench(argc, argv);
        if (wants("--bench", argc, argv)) return run_bench(argc, argv);
        return run(argc, argv);
    } catch (const Error& e) {
        std::fprintf(stderr, "main: error: %s\n", e.what());
        if (!e.hint.empty()) std::fprintf(stderr, "HINT: %s\n", e.hint.c_str());
        return e.exit_code;
    } catch (const std::bad_alloc&) {
        std::fprintf(stderr, "main: error: out of host memory while allocating buffers\n"
                             "HINT: lower --max-memory-mb so heads are processed in smaller groups\n");
        return kExitNoMemory;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "main: error: internal: %s\n", e.what());
        return kExitInternal;
    }
}
