// group_plan.cpp — the head groups of a run (group_plan.h): host bytes per head (inputs and
// stage buffers), the backend's working bytes per head, and the budgets they must fit.
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

std::string mib(size_t bytes) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(bytes) / kMiB);
    return buf;
}

}  // namespace

GroupPlan plan_groups(const Options& o, const Problem& p, StageSet computed, const Backend& be) {
    GroupPlan g;
    size_t cap = o.max_memory_mb > 0 ? static_cast<size_t>(o.max_memory_mb) * kMiB : SIZE_MAX;
    g.host_per_head = input_bytes_per_head(p.dims, computed) + stage_bytes_per_head(p.dims, computed);
    g.work_per_head = be.working_bytes_per_head(p, computed);
    g.host_budget = std::min(host_budget_bytes(), cap);
    g.work_budget = std::min(be.available_bytes(), cap);
    bool big_stage_path = computed.has(Stage::QK) || computed.has(Stage::QK_scaled) ||
                          computed.has(Stage::attention_weights);
    std::string hint = big_stage_path
                           ? "the N x M stages dominate: --stages flash needs no N x M buffers; or use a "
                             "smaller case or a larger --max-memory-mb"
                           : "use a smaller case or a larger --max-memory-mb";
    if (g.host_per_head > g.host_budget)
        fail(kExitNoMemory, "not enough host memory: one head needs " + mib(g.host_per_head) +
                                " (inputs + stage buffers) but the budget is " + mib(g.host_budget) +
                                " (min of MemAvailable/2 and --max-memory-mb)", hint);
    if (g.work_per_head > g.work_budget)
        fail(kExitNoMemory, std::string("not enough ") + be.name() + " working memory: one head needs " +
                                mib(g.work_per_head) + " but " + mib(g.work_budget) + " is available", hint);
    size_t by_host = g.host_budget / g.host_per_head;
    size_t by_work = g.work_per_head ? g.work_budget / g.work_per_head : SIZE_MAX;
    g.group_size = static_cast<int>(std::min<size_t>({by_host, by_work, static_cast<size_t>(p.dims.total_heads())}));
    return g;
}

}  // namespace attnstep
