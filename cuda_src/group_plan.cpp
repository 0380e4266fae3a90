// group_plan.cpp — the head groups of a run (group_plan.h): host bytes per head (inputs, stage
// buffers and the variant's per-head mask/bias), host bytes for the whole run, the backend's
// working bytes per head, and the budgets they must fit; and the K/V stages' sums over a group.
#include "group_plan.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>

#include "common.h"
#include "io/host_memory.h"

namespace attnstep {

namespace {

const size_t kMiB = size_t(1) << 20;

// The inputs of one query head: a grouped case's K and V are copied to each query head of their
// group (the backend sees one per query head), so they count per query head too.
size_t input_bytes_per_head(const Dims& d, StageSet computed) {
    size_t n = 0;
    for (Stage s : inputs_read(computed)) n += stage_elems(s, d);
    return n * sizeof(float);
}

size_t stage_bytes_per_head(const Dims& d, StageSet computed) {
    size_t b = 0;
    for (int i = 0; i < kNumStages; ++i)
        if (computed.has(static_cast<Stage>(i))) b += stage_elems(static_cast<Stage>(i), d) * sizeof(float);
    return b;
}

// A packed case's host bytes per head beyond the packed inputs and stages, and the backend's
// working bytes per head: those of its largest sequence (each is computed on its own).
struct SequenceBytes {
    size_t host = 0, work = 0;
};
SequenceBytes largest_sequence(const Problem& p, StageSet computed, const Backend& be, const Sequences& seqs) {
    SequenceBytes most;
    for (int b = 0; b < seqs.count(); ++b) {
        if (!seqs.computed(b)) continue;
        Problem pb = p;
        pb.dims.N = seqs.n(b);
        pb.dims.M = seqs.m(b);
        most.host = std::max(most.host, input_bytes_per_head(pb.dims, computed) + stage_bytes_per_head(pb.dims, computed));
        most.work = std::max(most.work, be.working_bytes_per_head(pb, computed));
    }
    return most;
}

// The mask and bias files: an N×M buffer per head of the group for a per-head file, one for the
// run for a broadcast file.
size_t variant_bytes(const Problem& p, Coverage per) {
    const size_t matrix = static_cast<size_t>(p.dims.N) * static_cast<size_t>(p.dims.M) * sizeof(float);
    return (p.variant.mask == per ? matrix : 0) + (p.variant.bias == per ? matrix : 0);
}

std::string mib(size_t bytes) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(bytes) / kMiB);
    return buf;
}

// Fewer heads than a whole K/V group fit: the group is split (KvStageSum gathers it), else whole
// groups only, so that a K/V head's files are read once.
int whole_kv_groups(size_t fit, const Dims& d) {
    const size_t gs = static_cast<size_t>(d.group_size());
    const size_t n = std::min(fit, static_cast<size_t>(d.total_heads()));
    return static_cast<int>(n >= gs ? n / gs * gs : n);
}

}  // namespace

size_t kv_stage_bytes(const Dims& d, StageSet written) {
    size_t b = 0;
    for (int i = 0; i < kNumStages; ++i)
        if (written.has(static_cast<Stage>(i)) && is_kv_stage(static_cast<Stage>(i)))
            b += stage_elems(static_cast<Stage>(i), d) * sizeof(float);
    return b;
}

GroupPlan plan_groups(const Options& o, const Problem& p, StageSet computed, const Backend& be, const Sequences* seqs) {
    GroupPlan g;
    size_t cap = o.max_memory_mb > 0 ? static_cast<size_t>(o.max_memory_mb) * kMiB : SIZE_MAX;
    if (seqs && seqs->packed()) {  // no mask or bias files in a packed case
        const SequenceBytes most = largest_sequence(p, computed, be, *seqs);
        const StageSet packed_stages = computed.minus(StageSet::where(is_score_stage));
        g.host_per_head = input_bytes_per_head(p.dims, computed) + stage_bytes_per_head(p.dims, packed_stages) + most.host;
        g.work_per_head = most.work;
        // A backend that computes the group in one call needs its working memory at the packed
        // dims; a group it hands back to the sequences (packed_run.cpp) needs the sequences'.
        if (be.computes_packed(p, *seqs, computed)) {
            Problem whole = p;
            whole.sequences = seqs;
            g.work_per_head = std::max(g.work_per_head, be.working_bytes_per_head(whole, computed));
        }
    } else {
        g.host_per_head = input_bytes_per_head(p.dims, computed) + stage_bytes_per_head(p.dims, computed) +
                          variant_bytes(p, Coverage::per_head);
        g.work_per_head = be.working_bytes_per_head(p, computed);
    }
    // KvStageSum holds one K/V head's stages only for a grouped case; the slopes only with ALiBi.
    g.host_fixed = variant_bytes(p, Coverage::broadcast) +
                   (p.dims.group_size() > 1 ? kv_stage_bytes(p.dims, computed) : 0) +
                   (p.variant.alibi ? static_cast<size_t>(p.dims.total_heads()) * sizeof(float) : 0);
    g.host_budget = std::min(host_budget_bytes(), cap);
    g.work_budget = std::min(be.available_bytes(), cap);
    // The N×M stages' buffers, where they are a good part of what a head needs, are the thing to
    // drop (the flash stages hold none); otherwise the case or the budget is.
    const size_t score_bytes = stage_bytes_per_head(p.dims, computed.both(StageSet::where(is_score_stage)));
    auto hint = [&](size_t need) {
        const std::string other = "use a smaller case or a larger --max-memory-mb";
        if (4 * score_bytes < need) return other;
        return "the N x M stages take " + mib(score_bytes) + " of it: --stages flash needs no N x M buffers; or " + other;
    };
    if (g.host_fixed + g.host_per_head > g.host_budget)
        fail(kExitNoMemory, "not enough host memory: one head needs " + mib(g.host_fixed + g.host_per_head) +
                                " (inputs + stage buffers + the variant's inputs) but the budget is " +
                                mib(g.host_budget) + " (min of MemAvailable/2 and --max-memory-mb)",
             hint(g.host_fixed + g.host_per_head));
    if (g.work_per_head > g.work_budget)
        fail(kExitNoMemory, std::string("not enough ") + be.name() + " working memory: one head needs " +
                                mib(g.work_per_head) + " but " + mib(g.work_budget) + " is available",
             hint(g.work_per_head));
    size_t by_host = (g.host_budget - g.host_fixed) / g.host_per_head;
    size_t by_work = g.work_per_head ? g.work_budget / g.work_per_head : SIZE_MAX;
    g.group_size = whole_kv_groups(std::min(by_host, by_work), p.dims);
    return g;
}

KvStageSum::KvStageSum(const Dims& d, StageSet written) : d_(d) {
    for (int i = 0; i < kNumStages; ++i) {
        const Stage s = static_cast<Stage>(i);
        if (!written.has(s) || !is_kv_stage(s)) continue;
        stages_.push_back(s);
        if (d.group_size() > 1) sum_[i].resize(stage_elems(s, d));
    }
}

// The gradients (dK, dV, flash_dK, flash_dV: the backward K/V stages) add up over the group, in
// order of h; K, V and KT are the same in every query head of the group: the first one's is kept.
void KvStageSum::gather(Stage s, int pos, const float* src) {
    std::vector<float>& sum = sum_[static_cast<int>(s)];
    if (pos == 0) {
        std::copy(src, src + sum.size(), sum.begin());
        return;
    }
    if (!is_backward_stage(s)) return;
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += src[i];
}

}  // namespace attnstep
