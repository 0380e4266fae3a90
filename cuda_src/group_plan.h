// group_plan.h — how many heads main.cpp streams through the backend at once: the largest group
// whose inputs and stage buffers fit the host budget and whose working memory fits the backend's;
// and how a grouped case's K/V stages (K, V, KT, dK, dV, flash_dK, flash_dV) are gathered from the
// query heads that computed them into one file per K/V head.
#pragma once

#include <cstddef>
#include <vector>

#include "backend.h"
#include "cli.h"
#include "sequences.h"
#include "stages.h"

namespace attnstep {

struct GroupPlan {
    size_t host_per_head = 0, work_per_head = 0, host_budget = 0, work_budget = 0;
    size_t host_fixed = 0;  // host bytes held for the whole run: broadcast mask/bias, slopes, one K/V head's sums
    int group_size = 0;
};

// The largest group of heads that fits both the host budget (min of MemAvailable/2 and
// --max-memory-mb) and the backend's working memory; exit 3 when not even one head fits. A grouped
// case's groups hold whole K/V groups (a multiple of Dims::group_size() heads) when at least one
// fits; otherwise a K/V group is split over head groups, which KvStageSum allows.
// A packed case (seqs; null otherwise) holds per head its inputs and its stages but the score stages
// over the packed tokens, and the inputs and every computed stage of one sequence at a time: the
// largest sequence's are counted, and its working memory (packed_run.h).
GroupPlan plan_groups(const Options& o, const Problem& p, StageSet computed, const Backend& be,
                      const Sequences* seqs = nullptr);

// The host bytes of one head's K/V stages in `written`: what KvStageSum holds.
size_t kv_stage_bytes(const Dims& d, StageSet written);

// The K/V stages of a run, one K/V head at a time. The backend computes them per query head (it
// sees one K and V per query head); K/V head j's files hold K, V and KT as its first query head
// computed them (every query head of the group holds the same copy), and the gradients dK, dV,
// flash_dK, flash_dV summed in float32 over its query heads in order of h. A K/V head's query
// heads are consecutive, so one K/V head is open at a time, also when a head group ends inside it.
class KvStageSum {
public:
    KvStageSum(const Dims& d, StageSet written);
    // Takes the K/V stages of every head of `g` (after compute()); calls write(stage, kv_head, data)
    // for each K/V stage of each K/V head whose last query head is in `g`.
    template <typename Write>
    void add(const HeadGroup& g, Write write) {
        for (int j = 0; j < g.count; ++j) {
            const int head = g.first + j;
            const int pos = head % d_.heads % d_.group_size();  // its place in the K/V group
            for (Stage s : stages_) {
                const float* src = g.out[static_cast<int>(s)] + stage_elems(s, d_) * j;
                if (d_.group_size() == 1) {
                    write(s, d_.kv_head_of(head), src);  // nothing to gather: the head is its K/V head
                    continue;
                }
                gather(s, pos, src);
                if (pos == d_.group_size() - 1) write(s, d_.kv_head_of(head), sum_[static_cast<int>(s)].data());
            }
        }
    }

private:
    void gather(Stage s, int pos, const float* src);
    Dims d_;
    std::vector<Stage> stages_;
    std::vector<float> sum_[kNumStages];
};

}  // namespace attnstep
