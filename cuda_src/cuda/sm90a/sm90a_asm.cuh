// sm90a_asm.cuh — the inline-assembly switch of the Hopper-only wrappers (wgmma.cuh,
// bulk_copy.cuh): only the sm_90a device pass has their instructions; other passes compile the
// wrappers empty (flash_wgmma.cu never launches its kernels on a GPU other than compute
// capability 9.0).
#pragma once

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ATTNSTEP_SM90A_ASM(...) asm volatile(__VA_ARGS__)
#else
#define ATTNSTEP_SM90A_ASM(...) \
    do {                        \
    } while (0)
#endif
