// parallel.h — how the CPU backend spreads its work over the host's cores: std::thread workers
// taking items from a shared counter (rows, blocks of rows, or (head, tile) pairs).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <thread>
#include <vector>

namespace attnstep {
namespace cpu {

constexpr int kRowBlock = 64;  // rows per work item of parallel_row_blocks
inline size_t row_blocks(int rows) { return static_cast<size_t>((rows + kRowBlock - 1) / kRowBlock); }

// Runs fn(i) for i in [0, n) on all cores; items are taken one at a time from a shared counter,
// so uneven items (causal rows) balance themselves.
template <typename Fn>
void parallel_for(size_t n, Fn fn) {
    unsigned hw = std::max(1u, std::thread::hardware_concurrency());
    size_t workers = std::min<size_t>(hw, n);
    if (workers <= 1) {
        for (size_t i = 0; i < n; ++i) fn(i);
        return;
    }
    std::atomic<size_t> next{0};
    auto loop = [&]() {
        for (size_t i; (i = next.fetch_add(1)) < n;) fn(i);
    };
    std::vector<std::thread> pool;
    for (size_t w = 1; w < workers; ++w) pool.emplace_back(loop);
    loop();
    for (std::thread& t : pool) t.join();
}

// Runs fn(h, r) for every row r in [0, rows) of every head h in [0, heads).
template <typename Fn>
void parallel_rows(int heads, int rows, Fn fn) {
    parallel_for(static_cast<size_t>(heads) * rows, [&](size_t hr) {
        fn(static_cast<int>(hr / rows), static_cast<int>(hr % rows));
    });
}

// Runs fn(h, r0, r1) for every block [r0, r1) of kRowBlock rows of every head h.
template <typename Fn>
void parallel_row_blocks(int heads, int rows, Fn fn) {
    parallel_for(static_cast<size_t>(heads) * row_blocks(rows), [&](size_t item) {
        const int r0 = static_cast<int>(item % row_blocks(rows)) * kRowBlock;
        fn(static_cast<int>(item / row_blocks(rows)), r0, std::min(rows, r0 + kRowBlock));
    });
}

}  // namespace cpu
}  // namespace attnstep
