// bulk_copy.cuh — Hopper's bulk copy engine (cp.async.bulk, sm_90) and the shared-memory
// transaction barriers (mbarrier) that tell consumers when copies have landed (and, in
// flash_wgmma_half.cu, the producer when the consumers have released a stage), as the wgmma flash
// kernels use them. flash_wgmma.cu's one thread starts the copy of a whole K/Vᵀ stage (contiguous
// bytes in global memory, laid out by its preparation pass as shared memory wants them: plain 1-D
// copies, no tensor map); flash_wgmma_half.cu counts its tensor copies (tensor_map.cuh) on the same
// barriers. Every consumer thread waits on the stage's barrier.
#pragma once

#include <cstdint>

#include "sm90a_asm.cuh"

namespace attnstep {
namespace bulk {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// A barrier that completes a phase when `arrivals` threads have arrived and every byte announced
// with expect_tx has landed.
__device__ __forceinline__ void init(uint64_t* bar, uint32_t arrivals) {
    ATTNSTEP_SM90A_ASM("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(arrivals) : "memory");
}
// Makes initialized barriers visible to the bulk copy engine (the async proxy); before the
// __syncthreads that publishes them.
__device__ __forceinline__ void fence_init() {
    ATTNSTEP_SM90A_ASM("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// The calling thread arrives and announces `bytes` of copies that will complete on this phase.
__device__ __forceinline__ void arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
    ATTNSTEP_SM90A_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
                      : "memory");
}
// The calling thread arrives (a consumer releasing a stage it has finished reading).
__device__ __forceinline__ void arrive(uint64_t* bar) {
    ATTNSTEP_SM90A_ASM("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// Copies `bytes` (a multiple of 16; both addresses 16-byte aligned) from global to shared memory;
// completion is counted on `bar`.
__device__ __forceinline__ void copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
    ATTNSTEP_SM90A_ASM(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
            smem_addr(dst)),
        "l"(src), "r"(bytes), "r"(smem_addr(bar))
        : "memory");
}
// Waits until the phase with this parity (0 for the barrier's 1st, 3rd, ... phase) has completed.
__device__ __forceinline__ void wait(uint64_t* bar, uint32_t parity) {
    ATTNSTEP_SM90A_ASM(
        "{\n.reg .pred done;\nwait_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait_%=;\n}\n" ::"r"(smem_addr(bar)),
        "r"(parity)
        : "memory");
}

}  // namespace bulk
}  // namespace attnstep
