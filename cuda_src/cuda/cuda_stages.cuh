// cuda_stages.cuh — the CUDA backend's stage functions, one per row of the stage table (stages.h):
// compute_X enqueues stage X for every head of a group on the backend's stream (cuda_stages.cu).
// backend_cuda.cu calls them through kComputeStage, each between its stage's two timing events.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../backend.h"
#include "../stages.h"
#include "device_variant.cuh"
#include "flash.cuh"
#include "flash_bwd.cuh"
#include "gemm.cuh"
#include "variant_buffers.cuh"

namespace attnstep {

// A group's device memory, carved from the backend's arena: one buffer per stage on the device.
struct DeviceBuffers {
    float* at[kNumStages] = {};
    HalfGemm half;  // the half pipelines' GEMM operands (none for fp32, tf32)
    uint16_t* format[3] = {};  // Q, K, V in the format for the half flash forward (needs_format_inputs)
    VariantBuffers variant_at;  // the variant's inputs and the stage path's scratch (variant_buffers.cuh)
    DeviceVariant variant;      // the group's variant, its pointers into variant_at
};

// What a stage function works on: the problem, the group's heads and buffers, and the backend's
// cuBLAS handle and stream (the handle is bound to the stream).
struct DeviceStageWork {
    const Problem& p;
    int heads;
    const DeviceBuffers& b;
    cublasHandle_t blas;
    cudaStream_t stream;
    float* buf(Stage s) const { return b.at[static_cast<int>(s)]; }
    // The half pipelines store each stage in the format as it is computed (in its timed span), so
    // the stages after it read the stored values, as on the CPU backend.
    void store_in_format(Stage s) const;
};
using DeviceStageFunction = void (*)(const DeviceStageWork&);

// The inputs' echo stages are the uploads that CudaBackend::compute makes before any stage runs:
// no function of their own.
constexpr DeviceStageFunction compute_Q = nullptr;
constexpr DeviceStageFunction compute_K = nullptr;
constexpr DeviceStageFunction compute_V = nullptr;
constexpr DeviceStageFunction compute_dO = nullptr;

// The stage path: kernels.cu, backward_kernels.cu and cuBLAS (gemm.cu).
void compute_KT(const DeviceStageWork& w);
void compute_QK(const DeviceStageWork& w);
void compute_QK_scaled(const DeviceStageWork& w);
void compute_attention_weights(const DeviceStageWork& w);
void compute_dropout_mask(const DeviceStageWork& w);
void compute_output(const DeviceStageWork& w);
void compute_D(const DeviceStageWork& w);
void compute_dP(const DeviceStageWork& w);
void compute_dS(const DeviceStageWork& w);
void compute_dQ(const DeviceStageWork& w);
void compute_dK(const DeviceStageWork& w);
void compute_dV(const DeviceStageWork& w);

// The flash forward (flash_dispatch.cu) writes flash_output and flash_lse; in a run that splits,
// split_output leads the set and compute_flash_splits (flash_splits.cu) writes split_output,
// split_lse and their combine as flash_output, flash_lse. The flash backward (flash_bwd.cu) writes
// flash_dQ, flash_dK and flash_dV.
void compute_split_output(const DeviceStageWork& w);
constexpr DeviceStageFunction compute_split_lse = nullptr;
void compute_flash_output(const DeviceStageWork& w);
constexpr DeviceStageFunction compute_flash_lse = nullptr;
void compute_flash_dQ(const DeviceStageWork& w);
constexpr DeviceStageFunction compute_flash_dK = nullptr;
constexpr DeviceStageFunction compute_flash_dV = nullptr;

// The flash kernels' arguments for a whole problem, without buffers: for plans and memory
// estimates (the split decision depends on the work; groups may be smaller).
FlashArgs flash_args(const Problem& p);

// Whether a packed case's group is computed in one call (Backend::computes_packed): the forward
// flash stages alone, the keys in slots (not pages), no split stages, the plain masks within every
// sequence, and a flash kernel that reads the sequences' rows itself for the precision and GPU.
bool packed_flash_available(const Problem& p, const Sequences& seqs, StageSet computed);
FlashBwdArgs flash_bwd_args(const Problem& p);

}  // namespace attnstep
