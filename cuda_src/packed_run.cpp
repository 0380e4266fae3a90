// packed_run.cpp — a packed case, one dense problem per sequence or one backend call; see packed_run.h.
#include "packed_run.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "io/run_folder.h"

namespace attnstep {

namespace {

// The rows (or columns) of one axis that sequence b owns in the packed matrices: its query rows
// along N, the keys it reads along M (through key_row: a paged case's pages), the whole axis
// otherwise (d_k, d_v, 1). at(i): the packed index of the sequence's i-th.
struct Span {
    const Sequences* seqs = nullptr;
    Sym axis = Sym::ONE;
    int b = 0, begin = 0, count = 0;
    int at(int i) const { return axis == Sym::M ? seqs->key_row(b, i) : begin + i; }
    // Consecutive packed indices: a row's columns copy in one piece.
    bool contiguous() const { return axis != Sym::M || !seqs->paged(); }
};
Span span(Sym axis, const Sequences& seqs, int b, const Dims& packed) {
    if (axis == Sym::N) return {&seqs, axis, b, seqs.q_begin(b), seqs.n(b)};
    if (axis == Sym::M) return {&seqs, axis, b, 0, seqs.m(b)};
    return {&seqs, axis, b, 0, sym_value(axis, packed)};
}

// Copies sequence b's block of stage s, for `heads` heads, between the packed matrices (at the
// packed dims) and the sequence's (at its own dims): from the packed ones (gather) or into them.
enum class Direction { gather, scatter };
void copy_block(Stage s, const Sequences& seqs, int b, const Dims& packed, int heads, const float* from, float* to,
                Direction dir) {
    const StageInfo& info = stage_info(s);
    const Span rows = span(info.rows, seqs, b, packed), cols = span(info.cols, seqs, b, packed);
    const size_t packed_cols = static_cast<size_t>(stage_cols(s, packed));
    const size_t packed_elems = stage_elems(s, packed), seq_elems = static_cast<size_t>(rows.count) * cols.count;
    for (int h = 0; h < heads; ++h)
        for (int r = 0; r < rows.count; ++r) {
            const size_t row_packed = packed_elems * h + static_cast<size_t>(rows.at(r)) * packed_cols;
            const size_t at_seq = seq_elems * h + static_cast<size_t>(r) * cols.count;
            if (cols.contiguous() && cols.count > 0) {
                const size_t at_packed = row_packed + static_cast<size_t>(cols.at(0));
                if (dir == Direction::gather) std::copy_n(from + at_packed, cols.count, to + at_seq);
                else std::copy_n(from + at_seq, cols.count, to + at_packed);
                continue;
            }
            for (int c = 0; c < cols.count; ++c) {  // KT of a paged case: its columns are pool rows
                const size_t at_packed = row_packed + static_cast<size_t>(cols.at(c));
                if (dir == Direction::gather) to[at_seq + c] = from[at_packed];
                else to[at_packed] = from[at_seq + c];
            }
        }
}

// The group's inputs, indexed by Stage (null for the other stages and an input not read).
struct GroupInputs {
    const float* of[kNumStages] = {};
    explicit GroupInputs(const HeadGroup& g) {
        of[static_cast<int>(Stage::Q)] = g.q;
        of[static_cast<int>(Stage::K)] = g.k;
        of[static_cast<int>(Stage::V)] = g.v;
        of[static_cast<int>(Stage::dO)] = g.dout;
    }
};

}  // namespace

PackedRun::PackedRun(const Problem& p, const Sequences& seqs, StageSet computed, StageSet written)
    : p_(p), seqs_(seqs), computed_(computed), written_(written) {}

Problem PackedRun::sequence_problem(int b) const {
    Problem pb = p_;
    pb.dims.N = seqs_.n(b);
    pb.dims.M = seqs_.m(b);
    return pb;
}

// What a row holds when no sequence computes it: the inputs as read (K and V of padding keys too),
// KT as K's transpose, lse -inf (a row that sees no key; every split's too), 0 for every other stage.
void PackedRun::fill_unread_rows(HeadGroup& g) const {
    const Dims& d = p_.dims;
    const GroupInputs inputs(g);
    for (int i = 0; i < kNumStages; ++i) {
        const Stage s = static_cast<Stage>(i);
        if (!computed_.has(s) || is_score_stage(s)) continue;
        float* out = g.out[i];
        const size_t n = stage_elems(s, d) * static_cast<size_t>(g.count);
        if (is_input_echo(s)) {
            std::copy_n(inputs.of[i], n, out);
        } else if (s == Stage::KT) {
            for (int h = 0; h < g.count; ++h)
                for (int r = 0; r < d.M; ++r)
                    for (int c = 0; c < d.dk; ++c)
                        out[stage_elems(s, d) * h + static_cast<size_t>(c) * d.M + r] =
                            g.k[stage_elems(Stage::K, d) * h + static_cast<size_t>(r) * d.dk + c];
        } else {
            const bool lse = s == Stage::flash_lse || s == Stage::split_lse;  // a row that sees no key
            std::fill_n(out, n, lse ? -std::numeric_limits<float>::infinity() : 0.f);
        }
    }
}

namespace {

// Whether every value of V is finite in the precision's format. A kernel over the whole batch reads
// its key tiles whole: rows past a sequence's keys (its padding, the next sequence's) come in
// with weight 0, and 0·inf is NaN, so a non-finite value there (one --allow-nonfinite let in, or a
// float32 past fp16's range) would reach rows that never see it. Such a group goes sequence by
// sequence instead, where no sequence reads another's rows.
bool finite_values(const HeadGroup& g, const Dims& d, Precision p) {
    const size_t n = stage_elems(Stage::V, d) * static_cast<size_t>(g.count);
    for (size_t i = 0; i < n; ++i)
        if (!std::isfinite(round_to(p, g.v[i]))) return false;
    return true;
}

}  // namespace

void PackedRun::compute(Backend& be, HeadGroup& g, StageTimes* times, const SequenceStageWriter& write) {
    if (be.computes_packed(p_, seqs_, computed_) && finite_values(g, p_.dims, p_.precision)) {
        // Every row is some sequence's, and the backend writes them all: nothing to fill.
        Problem whole = p_;
        whole.sequences = &seqs_;
        be.compute(whole, computed_, g, times);
        return;
    }
    const Dims& d = p_.dims;
    fill_unread_rows(g);
    const GroupInputs inputs(g);
    for (int b = 0; b < seqs_.count(); ++b) {
        if (!seqs_.computed(b)) continue;
        const Problem pb = sequence_problem(b);
        HeadGroup gb;
        gb.first = g.first;
        gb.count = g.count;
        gb.alibi_slopes = g.alibi_slopes;  // per head: the same in every sequence
        for (Stage s : inputs_read(computed_)) {
            std::vector<float>& buf = in_[static_cast<int>(s)];
            buf.resize(stage_elems(s, pb.dims) * g.count);
            copy_block(s, seqs_, b, d, g.count, inputs.of[static_cast<int>(s)], buf.data(), Direction::gather);
        }
        gb.q = in_[static_cast<int>(Stage::Q)].data();
        gb.k = in_[static_cast<int>(Stage::K)].data();
        gb.v = in_[static_cast<int>(Stage::V)].data();
        gb.dout = computed_.any_backward() ? in_[static_cast<int>(Stage::dO)].data() : nullptr;
        for (int i = 0; i < kNumStages; ++i)
            if (computed_.has(static_cast<Stage>(i))) {
                out_[i].resize(stage_elems(static_cast<Stage>(i), pb.dims) * g.count);
                gb.out[i] = out_[i].data();
            }
        check_interrupted();
        be.compute(pb, computed_, gb, times);
        for (int i = 0; i < kNumStages; ++i) {
            const Stage s = static_cast<Stage>(i);
            if (!computed_.has(s)) continue;
            if (!is_score_stage(s)) {
                copy_block(s, seqs_, b, d, g.count, out_[i].data(), g.out[i], Direction::scatter);
            } else if (written_.has(s)) {
                for (int j = 0; j < g.count; ++j) write(s, g.first + j, b, out_[i].data() + stage_elems(s, pb.dims) * j, pb.dims);
            }
        }
    }
}

}  // namespace attnstep
