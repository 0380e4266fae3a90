// variant_kernels.cuh — the stage path's kernels for a case with a variant beyond no mask or the
// top-left causal one (variant_kernels.cu); the plain cases keep kernels.cuh's. All pointers are
// device memory; `heads` N×M matrices lie back to back, row-major, head h of the group being flat
// query head v.head_base + h. Every launcher enqueues on `stream` and checks its launch.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "device_variant.cuh"

namespace attnstep {

// QK_scaled from QK (docs/contract.md): s = QK·scale, then C·tanh(s/C), − slope_h·|diag(r) − c|,
// + the bias file, and -inf where (r, c) is hidden (DeviceVariant::hidden: the rule, the mask file,
// -inf in the bias file).
void launch_variant_scores(const float* QK, float* out, int heads, int N, int M, float scale, const DeviceVariant& v,
                           cudaStream_t stream);

// The dropout_mask stage: 1 where dropout keeps (r, c) (dropout_keep), else 0.
void launch_dropout_mask(float* out, int heads, int N, int M, const DeviceVariant& v, cudaStream_t stream);

// out = (P∘Z)·(1/(1 − p)), Z the keep-mask: the weights the output and dV GEMMs read under dropout.
void launch_dropped_weights(const float* P, float* out, int heads, int N, int M, const DeviceVariant& v,
                            cudaStream_t stream);

// dS = P∘(dP∘Z·(1/(1 − p)) − D) (without dropout P∘(dP − D)), exactly +0 where (r, c) is hidden.
// D holds one value per row ([heads][N]).
void launch_variant_ds(const float* P, const float* dP, const float* D, float* dS, int heads, int N, int M,
                       const DeviceVariant& v, cudaStream_t stream);

// out = dS∘(1 − t²), t = tanh(QK·scale/C), for n elements: what the dQ and dK GEMMs read under a
// softcap (its derivative; flash-attn's convention).
void launch_softcap_grad(const float* dS, const float* QK, float* out, size_t n, float scale, float cap,
                         cudaStream_t stream);

}  // namespace attnstep
