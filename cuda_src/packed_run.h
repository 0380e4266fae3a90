// packed_run.h — a packed case (sequences.h) computed on any backend as one dense problem per
// sequence: sequence b is the case's problem with N = n(b) queries and M = m(b) keys (the same
// heads, K/V heads, head widths, scale and variant, so the causal alignment, the window and ALiBi
// apply within the sequence), its inputs the rows of its queries and the m(b) keys it reads (the
// first of its slot, or in a paged case the rows its block_table row names: Sequences::key_row).
// Attention is block-diagonal, so nothing else reads those rows: the dense problems together are
// the packed one, and each backend's dense pipeline computes it unchanged. A paged case's K and V
// are the pool: rows no sequence reads keep their echoes, and shared pages are gathered by each.
//
// A head group's stages over the packed tokens (every stage but the score stages) are assembled from
// its sequences' stages, row by row at the sequences' offsets; rows no sequence computes keep what
// they are without one: the inputs' echoes and KT as read, 0 for the rest (the gradients of padding
// keys and of keys no query reads; the output, D and dQ of queries that see no key) and lse -inf.
// The score stages (N×M) are handed out per sequence, n(b) × m(b), to be written one file each.
//
// A backend that has a kernel reading the sequences' rows itself (Backend::computes_packed: the
// CUDA backend's half-precision flash forward on Hopper) computes the group in one call instead,
// Problem::sequences set: one launch for the whole batch, as a varlen kernel runs.
#pragma once

#include <functional>
#include <vector>

#include "backend.h"
#include "sequences.h"
#include "stages.h"

namespace attnstep {

// write(stage, query head, sequence, data, the sequence's dims): one score stage of one head.
using SequenceStageWriter = std::function<void(Stage, int, int, const float*, const Dims&)>;

class PackedRun {
public:
    PackedRun(const Problem& p, const Sequences& seqs, StageSet computed, StageSet written);
    // Sequence b's dense problem.
    Problem sequence_problem(int b) const;
    // Computes group g: its inputs hold the group's heads over the packed tokens, g.out every
    // computed stage but the score stages, at the packed dims; the written score stages go to write.
    // In one backend call where the backend computes the case packed, else sequence by sequence.
    void compute(Backend& be, HeadGroup& g, StageTimes* times, const SequenceStageWriter& write);

private:
    void fill_unread_rows(HeadGroup& g) const;
    const Problem& p_;
    const Sequences& seqs_;
    StageSet computed_, written_;
    std::vector<float> in_[kNumStages], out_[kNumStages];  // one sequence's, kept between sequences
};

}  // namespace attnstep
