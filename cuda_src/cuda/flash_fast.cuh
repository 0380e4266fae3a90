// flash_fast.cuh — the mma.sync tensor-core forward (flash_fast.cu): FlashAttention-2 on tensor
// cores through mma.sync m16n8k8 TF32, FP32-accurate by default (3xTF32 split precision), one TF32
// product in Precision::tf32. Registered with the dispatcher as flash_fast_ops()
// (flash_dispatch.cuh); compute capability 8.0 and newer.
#pragma once

#include "flash_dispatch.cuh"

namespace attnstep {

// The plan of tile configuration `config` (0: the shipped one, flash_fast_ops()'s; 1..3: the
// exploration configurations built with -DATTNSTEP_FLASH_FAST_VARIANTS, for `main --bench
// --fast-variant`); false where it has none for `a`. Launched by flash_fast_ops().launch.
bool flash_fast_config_plan(const FlashArgs& a, int config, int forced_splits, KernelPlan* plan);

}  // namespace attnstep
