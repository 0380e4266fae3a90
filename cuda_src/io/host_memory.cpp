// host_memory.cpp — reads MemAvailable; see host_memory.h.
#include "host_memory.h"

#include <cstdio>
#include <cstring>

namespace attnstep {

size_t host_budget_bytes() {
    const size_t fallback = size_t(2) << 30;
    FILE* f = std::fopen("/proc/meminfo", "r");
    if (!f) return fallback;
    char line[256];
    unsigned long long kb = 0;
    while (std::fgets(line, sizeof line, f))
        if (std::sscanf(line, "MemAvailable: %llu kB", &kb) == 1) break;
    std::fclose(f);
    return kb ? static_cast<size_t>(kb) * 1024 / 2 : fallback;
}

}  // namespace attnstep
