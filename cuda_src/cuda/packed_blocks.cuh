// packed_blocks.cuh — a packed batch (sequences.h) as one launch of a flash kernel: a block per
// query block of each sequence, each reading its own sequence's rows of the packed matrices, so the
// whole batch runs at once instead of one launch per sequence (whose tails would leave the GPU idle
// between them, and whose short sequences alone could not fill it).
#pragma once

#include <cuda_runtime.h>

#include <vector>

namespace attnstep {

struct Sequences;

// One block's share: query block `qblock` of a sequence whose queries are rows [q_begin, q_begin +
// n) of every head's query matrix and whose m keys are rows [k_begin, k_begin + m) of its K and V.
struct PackedBlock {
    int qblock, q_begin, k_begin, n, m;
};

// The blocks of br query rows of every sequence that has queries, sequence by sequence, each
// sequence's in order of its query blocks, the sequences in order of the most key tiles of bc keys
// a block of theirs visits (the causal mask within the sequence, or every key), fewest first. The
// kernels run the list from its end: the longest sequences' blocks first, the longest of each
// first under the causal mask, so the GPU's tail is short; and the blocks running at once are a
// sequence's or two, sharing its K and V in L2 as a dense batch's blocks share a head's (blocks
// ordered by work alone would mix many sequences, whose K and V then stream from memory). A paged
// case has no rows to name (sequences.h key_row); callers keep it out.
std::vector<PackedBlock> packed_blocks(const Sequences& s, int br, int bc, bool causal);

// The list in device memory, allocated and copied in stream order; release() frees it in stream
// order after the launch that reads it is queued.
struct DevicePackedBlocks {
    const PackedBlock* p = nullptr;
    int count = 0;
    DevicePackedBlocks(const std::vector<PackedBlock>& blocks, cudaStream_t stream);
    ~DevicePackedBlocks();  // frees it where an error was thrown before release() (errors ignored then)
    DevicePackedBlocks(const DevicePackedBlocks&) = delete;
    DevicePackedBlocks& operator=(const DevicePackedBlocks&) = delete;
    void release();

private:
    cudaStream_t stream_;
};

}  // namespace attnstep
