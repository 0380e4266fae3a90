// run_files.cpp — the files of a run, head group by head group; see run_files.h.
#include "run_files.h"

#include <algorithm>
#include <cstdio>

#include "crc32.h"
#include "manifest.h"
#include "matrix_io.h"
#include "run_folder.h"
#include "variant_manifest.h"

namespace attnstep {

std::string stage_list(StageSet set) {
    std::string s;
    for (int i = 0; i < kNumStages; ++i)
        if (set.has(static_cast<Stage>(i))) s += (s.empty() ? "" : ",") + std::string(stage_name(static_cast<Stage>(i)));
    return s;
}

void Progress::step(long long units) {
    if (!on) return;
    done += units;
    int percent = static_cast<int>(100 * done / total);
    if (percent == last_percent) return;  // at most a line a percent: a pipe, not a flood
    last_percent = percent;
    std::fprintf(stderr, "main: progress: %lld/%lld\n", done, total);
    std::fflush(stderr);
}

long long progress_units(const Dims& d, StageSet written, const Sequences* seqs) {
    long long computed_sequences = 0;
    if (seqs)
        for (int b = 0; b < seqs->count(); ++b) computed_sequences += seqs->computed(b);
    long long files = 0;
    for (int i = 0; i < kNumStages; ++i) {
        const Stage s = static_cast<Stage>(i);
        if (!written.has(s)) continue;
        files += heads_of(s, d) * (seqs && seqs->packed() && is_score_stage(s) ? computed_sequences : 1) *
                 (is_split_stage(s) ? d.splits : 1);
    }
    return 2LL * d.total_heads() + files;
}

namespace {

// One stage file of rows x cols (seq >= 0: a score stage of one sequence of a packed case; split >= 0:
// one split of a split stage).
void write_file(RunState& rs, Stage s, int head, int seq, int split, const float* data, int rows, int cols) {
    const std::string name = stage_file_name(stage_name(s), head, format_name(rs.out_format), seq, split);
    const std::string header = "# attnstep stage=" + std::string(stage_name(s)) + " head=" + std::to_string(head) +
                               (seq >= 0 ? " seq=" + std::to_string(seq) : "") +
                               (split >= 0 ? " split=" + std::to_string(split) : "") + " rows=" + std::to_string(rows) +
                               " cols=" + std::to_string(cols) + " run=" + rs.run_id;
    check_interrupted();
    AtomicFile f(rs.out_dir + "/" + name, rs.run_id);
    write_matrix(f, rs.out_format, data, rows, cols, header);
    uint32_t crc = f.commit();
    rs.log.add(name, name.substr(0, name.rfind('.')), crc);
    rs.progress.step();
}

// A split stage's head (N × S·w, split s at columns [s·w, (s+1)·w)) as S files of N × w.
void write_split_files(RunState& rs, Stage s, int head, const float* data, const Dims& d) {
    const int rows = stage_rows(s, d), S = d.splits, width = stage_cols(s, d) / S;
    std::vector<float> one(static_cast<size_t>(rows) * width);
    for (int split = 0; split < S; ++split) {
        for (int r = 0; r < rows; ++r)
            std::copy_n(data + static_cast<size_t>(r) * S * width + static_cast<size_t>(split) * width, width,
                        one.data() + static_cast<size_t>(r) * width);
        write_file(rs, s, head, -1, split, one.data(), rows, width);
    }
}

}  // namespace

void write_stage_file(RunState& rs, Stage s, int head, const float* data, const Dims& d) {
    if (is_split_stage(s)) write_split_files(rs, s, head, data, d);
    else write_file(rs, s, head, -1, -1, data, stage_rows(s, d), stage_cols(s, d));
}

void write_sequence_stage_file(RunState& rs, Stage s, int head, int seq, const float* data, const Dims& seq_dims) {
    write_file(rs, s, head, seq, -1, data, stage_rows(s, seq_dims), stage_cols(s, seq_dims));
}

void write_group(RunState& rs, const HeadGroup& g, StageSet written, const Dims& d) {
    for (int i = 0; i < kNumStages; ++i) {
        Stage s = static_cast<Stage>(i);
        if (!written.has(s) || is_kv_stage(s)) continue;
        for (int j = 0; j < g.count; ++j) write_stage_file(rs, s, g.first + j, g.out[i] + stage_elems(s, d) * j, d);
    }
}

void write_run_manifest(RunState& rs, const Options& o, const Problem& p, const Backend& be, StageSet computed,
                        StageSet written, int sequences) {
    FlashPlan flash;  // tiles 0 and no kernel: no flash stage was computed
    if (computed.any_flash()) flash = be.flash_plan(p);
    ManifestWriter w;
    w.comment("attnstep run manifest (docs/contract.md); written last");
    w.add("run_id", rs.run_id);
    w.add("backend", be.name());
    w.add("device", be.device_name());
    w.add("precision", precision_name(p.precision));
    w.add("format", format_name(rs.out_format));
    w.add("input", o.in_dir);
    for (const DimKey& k : kDimKeys) w.add(k.key, p.dims.*k.field);
    if (sequences > 0) w.add(kSequencesKey, sequences);  // the offsets are in the input case
    w.add_bool("causal", p.causal);
    w.add_float("scale", static_cast<double>(p.scale));
    add_variant_keys(w, p.dims.kv(), p.variant);
    w.add("stages", stage_list(written));
    w.add("flash_block_q", flash.Br);
    w.add("flash_block_k", flash.Bc);
    if (!flash.kernel.empty()) w.add("flash_kernel", flash.kernel);
    if (p.split_size > 0) w.add(kSplitSizeKey, p.split_size);  // the split stages' S follows from it
    w.add_bool("poison", p.poison);
    for (int i = 0; i < kNumStages; ++i)
        if (computed.has(static_cast<Stage>(i)))
            w.add_float(std::string("time_ms_") + stage_name(static_cast<Stage>(i)), rs.times.ms[i]);
    for (const OutputLog::Entry& e : rs.log.entries()) w.add("crc32_" + e.key, crc32_hex(e.crc));
    AtomicFile f(rs.out_dir + "/" + kRunManifest, rs.run_id);
    f.write(w.text());
    f.commit();
}

// Reads the group's heads of the inputs the computed stages need into `inputs` (a buffer per input
// stage, resized to the group) and points g's inputs there; a progress step per head.
void read_group_inputs(const InputCase& in, bool allow_nonfinite, Precision precision, StageSet computed,
                       const Dims& d, HeadGroup& g, std::vector<float> (&inputs)[kNumStages], Progress& progress) {
    for (Stage s : inputs_read(computed)) inputs[static_cast<int>(s)].resize(stage_elems(s, d) * g.count);
    auto head_input = [&](Stage s, int j) {
        std::vector<float>& b = inputs[static_cast<int>(s)];
        return b.empty() ? nullptr : b.data() + stage_elems(s, d) * j;
    };
    for (int j = 0; j < g.count; ++j) {
        const int head = g.first + j;
        for (Stage s : inputs_read(computed)) {
            // A K/V head's query heads are consecutive: its file is read for the first of them in
            // the group, and copied to the others.
            const bool kv = is_kv_stage(s);
            if (kv && j > 0 && d.kv_head_of(head) == d.kv_head_of(head - 1))
                std::copy(head_input(s, j - 1), head_input(s, j), head_input(s, j));
            else
                read_input(in, s, kv ? d.kv_head_of(head) : head, allow_nonfinite, head_input(s, j));
        }
        progress.step();
    }
    // The half pipelines start from the inputs rounded to their format, as a conversion of
    // float32 tensors to bf16/fp16 does; the echoes (Q, K, V, dO) then hold the rounded values.
    if (is_half(precision))
        for (Stage s : inputs_read(computed))
            for (float& x : inputs[static_cast<int>(s)]) x = round_to(precision, x);
    g.q = head_input(Stage::Q, 0);
    g.k = head_input(Stage::K, 0);
    g.v = head_input(Stage::V, 0);
    g.dout = head_input(Stage::dO, 0);
}

// The files a run wrote (stage files, then run.toml), in order: what commit() puts in place.
std::vector<std::string> staged_names(const RunState& rs) {
    std::vector<std::string> names;
    for (const OutputLog::Entry& e : rs.log.entries()) names.push_back(e.name);
    names.push_back(kRunManifest);
    return names;
}

}  // namespace attnstep
