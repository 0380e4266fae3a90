// host_memory.h — how much host memory the binary may plan with (Linux /proc/meminfo).
#pragma once

#include <cstddef>

namespace attnstep {

// MemAvailable / 2 (the other half is left to the OS and other processes); when /proc/meminfo
// cannot be read, a conservative 2 GiB.
size_t host_budget_bytes();

}  // namespace attnstep
