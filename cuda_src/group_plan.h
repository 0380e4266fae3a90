// group_plan.h — how many heads main.cpp streams through the backend at once: the largest group
// whose inputs and stage buffers fit the host budget and whose working memory fits the backend's.
#pragma once

#include <cstddef>

#include "backend.h"
#include "cli.h"
#include "stages.h"

namespace attnstep {

struct GroupPlan {
    size_t host_per_head = 0, work_per_head = 0, host_budget = 0, work_budget = 0;
    int group_size = 0;
};

// The largest group of heads that fits both the host budget (min of MemAvailable/2 and
// --max-memory-mb) and the backend's working memory; exit 3 when not even one head fits.
GroupPlan plan_groups(const Options& o, const Problem& p, StageSet computed, const Backend& be);

}  // namespace attnstep
