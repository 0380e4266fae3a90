// flash_splits.cu — the CUDA backend's split-KV forward (flash.cuh compute_flash_splits). This
// build has no split kernel: a run that splits the keys says so in one line (exit 2), before any
// stage file is put in place; the CPU backend computes the split stages.
#include "../common.h"
#include "flash.cuh"

namespace attnstep {

void compute_flash_splits(const FlashSplitArgs&, cudaStream_t) {
    fail(kExitBadInput, "--split-size: split stages are not built for this GPU kernel yet",
         "use --backend cpu, which computes the split stages");
}

}  // namespace attnstep
