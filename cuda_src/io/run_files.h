// run_files.h — the files of a run, head group by head group (main.cpp drives them): a group's
// inputs read into the buffers the backend sees (a grouped case's K and V copied to every query
// head of their group), its stage files written (one per query head, or per K/V head for the K/V
// stages), and run.toml last; with --progress, the units of work done.
#pragma once

#include <string>
#include <vector>

#include "../backend.h"
#include "../cli.h"
#include "../sequences.h"
#include "../stages.h"
#include "atomic_file.h"
#include "case_layout.h"

namespace attnstep {

// --progress: units of work done so far, for a caller's progress bar (attnstep run draws one on a
// terminal). Reading and writing text dominate large runs on the CPU, so they count as much as
// computing: one unit per head read, per head computed and per stage file written.
struct Progress {
    bool on = false;
    long long done = 0, total = 0;
    int last_percent = -1;

    void step(long long units = 1);
};

struct RunState {
    std::string run_id, out_dir;  // out_dir: where the files go until the commit (the staging folder)
    Format out_format = Format::txt;
    OutputLog log;
    StageTimes times;
    Progress progress;
};

// "QK,dS,...": the stages of a set, in table order.
std::string stage_list(StageSet set);

// The units of --progress a run has: every query head read and computed, every stage file written
// (in a packed case, seqs, a score stage's file per head and computed sequence).
long long progress_units(const Dims& d, StageSet written, const Sequences* seqs = nullptr);

// Reads the group's heads of the inputs the computed stages need into `inputs` (a buffer per input
// stage, resized to the group: K and V once per query head, from its K/V head's file) and points
// g's inputs there; a progress step per head.
void read_group_inputs(const InputCase& in, bool allow_nonfinite, Precision precision, StageSet computed,
                       const Dims& d, HeadGroup& g, std::vector<float> (&inputs)[kNumStages], Progress& progress);

// Writes stage s of `head` (a query head; a K/V head for a K/V stage) from `data` into rs.out_dir: a
// split stage's head as one file per split (N × d_v or N × 1 each, cut from its N × S·w buffer).
void write_stage_file(RunState& rs, Stage s, int head, const float* data, const Dims& d);

// Writes score stage s of query head `head` and sequence `seq` of a packed case (n(b) × m(b), the
// sequence's dims) into rs.out_dir.
void write_sequence_stage_file(RunState& rs, Stage s, int head, int seq, const float* data, const Dims& seq_dims);

// Writes the group's stages in `written` that are indexed by query head (not is_kv_stage).
void write_group(RunState& rs, const HeadGroup& g, StageSet written, const Dims& d);

// run.toml; `sequences` is a packed case's B (0: not packed), recorded as `sequences = B`; a run that
// splits records its split size as `split_size = K`.
void write_run_manifest(RunState& rs, const Options& o, const Problem& p, const Backend& be, StageSet computed,
                        StageSet written, int sequences = 0);

// The files a run wrote (stage files, then run.toml), in order: what commit() puts in place.
std::vector<std::string> staged_names(const RunState& rs);

}  // namespace attnstep
