// flash_wgmma_half.cuh — the Hopper FlashAttention forward at half precision (flash_wgmma_half.cu):
// bf16 or fp16 wgmma operands, FP32 accumulation and softmax. flash_wgmma_ops() (flash_wgmma.cu)
// hands it the problems whose precision is bf16 or fp16, so `wgmma` is one kernel name in every
// precision. Built only for sm_90a; its callers run it on compute capability 9.0 alone.
#pragma once

#include "../flash_dispatch.cuh"

namespace attnstep {

// FlashKernelOps::plan and ::launch for a half precision; plan is false for any other precision
// and for widths without a configuration.
bool plan_wgmma_half(const FlashArgs& a, int forced_splits, KernelPlan* plan);
void launch_wgmma_half(const FlashArgs& a, const KernelPlan& plan, cudaStream_t stream);

}  // namespace attnstep
