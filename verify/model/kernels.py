"""The arithmetic assumed of a program: attnstep's backends as run.toml names them, any correct IEEE
float32 program, or CUDA's fast-math intrinsics.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from .half import is_half
from .rounding import ROUND_VAR, ULP_IN_U, ToleranceError


# The online softmax rescales its running sums (O and l) by exp(m_old - m_new) once per key tile
# (Bc ≥ 8 keys): at most one more rounding of the partial sum per 8 keys.
FLASH_RESCALE_FACTOR = 1.0 + 1.0 / 8.0


# tanhf: at most 2 ulps on the GPU (CUDA C++ Programming Guide, tanhf) and in glibc (its
# libm-test-ulps for float); the softcap's tanh (verify/model/scores.py).
TANH_ULPS = 2.0


# tanh.approx.f32 (PTX ISA: maximum relative error 2^-10.987), which flash-attn's softcap calls
# through cutlass::fast_tanh, and so does the half-precision wgmma kernel (tanh_approx in
# cuda_src/cuda/flash_scores.cuh): the error of t it may make, relative.
TANH_APPROX_REL = 2.0**-10.987


# tanh from the exponential, sign(x)·(1 − 2/(e^(2|x|) + 1)), as any program may compute it with
# ex2.approx and __fdividef: near 0 the subtraction cancels and the error is absolute, ex2.approx's
# 2^-22 relative error of e ≈ 1, the rounding of e + 1 and __fdividef's 2 ulp of the quotient ≈ 1:
# 2^-22 + 2^-24 + 2^-22 < 2^-20.5.
TANH_FROM_EXP_ABS = 2.0**-20.5


@dataclass(frozen=True)
class Kernel:
    """What the model assumes of the binary's arithmetic, per backend (run.toml's `backend`)."""
    exp_var: float        # variance of exp's relative error, in units of u²
    flash_product_var: float  # variance of one product in the flash GEMMs, in units of (u·ab)²
    common_scale: bool    # the flash logits carry one rounded scale factor common to the head
    lse_roundings: int    # roundings of lse's magnitude: m + log l, log2-domain conversions
    final_roundings: int  # roundings of each flash_output element after the accumulation
    mma_passes: int = 0   # flash GEMMs on tensor cores: mma.sync per 8-long chunk of the sum
    rescale_factor: float = FLASH_RESCALE_FACTOR
    exp_slope_var: float = 0.0  # exp's error growing with its argument (fast math), u² per unit²
    log_ulps: float = 1.0       # log's error in ulps of log l
    log_abs: float = 0.0        # and an absolute part (fast math near l = 1)
    div_var: float = 0.0        # extra variance of the softmax's final division, in u²
    tanh_ulps: float = TANH_ULPS  # the softcap's tanh: its error in ulps of t
    tanh_rel: float = 0.0       # and a relative error of t (an approximate tanh)
    tanh_abs: float = 0.0       # and an absolute error of t (a tanh computed from the exponential)


# Measured on an H200 (docs/tolerances.md): expf errs 0.48 ulp RMS (max 1.86), exp2f 0.75
# ulp RMS (max 2.06); logf/log2f 0.30 ulp RMS. One ulp is 2^(e-23), so a relative variance of
# (0.75 ulp)² is 0.75²·4·0.541 ≈ 1.2 u² (Benford mantissas); λ·√1.2 u = 6.6u > 2 ulp, the max.
_GPU_EXP_VAR = 0.75**2 * 4 * (3.0 / (8.0 * np.log(2.0)))


# The fast flash kernel multiplies in 3xTF32: a·b ≈ a_hi·b_hi + a_hi·b_lo + a_lo·b_hi, each part
# TF32 (u_tf32 = 2⁻¹¹). The low parts are TF32 roundings of a TF32 rounding error and the dropped
# a_lo·b_lo is a product of two: three terms of variance (2⁻¹¹)⁴·ROUND_VAR² = 16u²·ROUND_VAR².
_GPU_FLASH_PRODUCT_VAR = 3 * 16.0 * ROUND_VAR**2


_BACKEND_KERNELS = {
    # cuda: expf/exp2f as measured, 3xTF32 flash, scale·log2e rounded once for the whole head.
    # Tensor-core mma.sync accumulates with truncation, not rounding: each of the 3 (3xTF32)
    # mma per 8-long chunk can lose up to one ulp of the running sum, all in the same direction
    # (measured on an H100: flash_lse of uniform data off by ~26u, one-signed). A bias does not
    # average out, so it enters the bound as det: 3·2u·Σ_chunks |partial sum|. Four final
    # roundings of O: the division by l and the split-KV combine (rescale, add, divide).
    "cuda": Kernel(_GPU_EXP_VAR, _GPU_FLASH_PRODUCT_VAR, True, 4, 4, mma_passes=3),
    # cpu (cuda_src/cpu/backend_cpu.cpp): std::exp correctly rounded in practice (one rounding),
    # plain float32 products (no FMA without -march), the float32 scale exactly as run.toml says.
    # lse = m + log(l) with m an exact float32 logit: one rounding of lse's magnitude (log's own
    # is the LOG_ULPS term). O·(1/l): two final roundings (the reciprocal and the product).
    "cpu": Kernel(ROUND_VAR, ROUND_VAR, False, 1, 2),
}
# The arithmetic per flash kernel, as run.toml's `flash_kernel` names it (a "-split<K>" suffix: the
# same kernel with its KV loop split K ways; its combine is among the final roundings). Each CUDA
# kernel's header (cuda_src/cuda/) names what it does. The plain-FP32 clean kernel has no
# tensor-core truncation, but shares the CUDA model until a GPU sweep calibrates it on its own:
# a looser bound there costs catch power, never a false alarm. So do the half-precision wgmma
# kernels (bf16/fp16 operands: their products are exact in FP32, one truncating tensor-core pass
# per 16-long chunk, fewer than the model's three per 8); their roundings to the format are the
# half model's (verify/check/half_rounding.py).
KERNELS = {"cpu-tiled": _BACKEND_KERNELS["cpu"],
           **{f"cuda-{k}": _BACKEND_KERNELS["cuda"]
              for k in ("clean", "fast-3xtf32", "fast-tf32", "wgmma-3xtf32", "wgmma-tf32")},
           # The half-precision kernel's softcap takes tanh.approx.f32.
           **{f"cuda-{k}": replace(_BACKEND_KERNELS["cuda"], tanh_rel=TANH_APPROX_REL)
              for k in ("wgmma-bf16", "wgmma-fp16")},
           # The split-KV decode kernel (cuda_src/cuda/decode.cu): float32 FMAs on the CUDA cores,
           # or bf16/fp16 tensor cores (the CUDA model's truncating passes cover both); its four
           # warps' states merged (a rescale, an add and a division by l) before the split combine's
           # own three: seven final roundings of O.
           **{f"cuda-decode-{p}": replace(_BACKEND_KERNELS["cuda"], final_roundings=7)
              for p in ("fp32", "bf16", "fp16")}}
_SPLIT = re.compile(r"-split\d+$")


def kernel_base_name(flash_kernel: str) -> str:
    """run.toml's flash_kernel without its split suffix: the key of KERNELS."""
    return _SPLIT.sub("", flash_kernel)


# Unknown backend: the larger of each.
ANY_KERNEL = Kernel(*(max(getattr(k, f) for k in _BACKEND_KERNELS.values())
                      for f in ("exp_var", "flash_product_var", "common_scale", "lse_roundings",
                                "final_roundings", "mma_passes")))


# A program other than the project's binary: any correct IEEE float32 route. expf/exp2f within
# the 2 ulp the CUDA C++ Programming Guide documents (uniform within ±2 ulp: (2·2u)²/3), logf within
# 1 ulp, online softmax with any tile width (a rescale rounding per key), and the looser of both
# backends otherwise (tensor-core products and truncation, a folded scale·log2e, split combines).
DOCUMENTED_EXP_ULPS = 2.0


# Its softcap's tanh: tanhf's 2 ulps, or a tanh from the exponential (its absolute error). At
# float32, tanh.approx.f32 is a fast-math intrinsic like __expf (`--math fast`: FAST_KERNEL): an
# IEEE program's bound without its 2^-11 is a few hundred times tighter under a softcap, where a
# missing cap derivative at Gemma-2's C = 50 changes a gradient by less than that. A half-precision
# program may take it (flash-attn's bf16/fp16 softcap calls it through cutlass::fast_tanh).
FOREIGN_KERNEL = replace(ANY_KERNEL, exp_var=max(ANY_KERNEL.exp_var, (DOCUMENTED_EXP_ULPS * ULP_IN_U) ** 2 / 3),
                         rescale_factor=2.0, tanh_abs=TANH_FROM_EXP_ABS)
FOREIGN_HALF_KERNEL = replace(FOREIGN_KERNEL, tanh_rel=TANH_APPROX_REL)


# CUDA's fast-math intrinsics (-use_fast_math, __expf, __logf, __fdividef), by the maximum errors
# the CUDA C++ Programming Guide documents: __expf(x) 2 + floor(1.173·|x|) ulp (here uniform within
# that maximum, its two parts bounded by twice their squares), __logf 3 ulp or 2^-21.41 absolute
# for x in [0.5, 2], __fdividef 2 ulp; tanh as tanh.approx.f32.
FAST_EXP_ULPS, FAST_EXP_SLOPE, FAST_LOG_ULPS, FAST_LOG_ABS, FAST_DIV_ULPS = 2.0, 1.173, 3.0, 2.0**-21.41, 2.0


FAST_KERNEL = replace(FOREIGN_HALF_KERNEL,
                      exp_var=2 * (FAST_EXP_ULPS * ULP_IN_U) ** 2 / 3,
                      exp_slope_var=2 * (FAST_EXP_SLOPE * ULP_IN_U) ** 2 / 3,
                      log_ulps=FAST_LOG_ULPS, log_abs=FAST_LOG_ABS,
                      div_var=(FAST_DIV_ULPS * ULP_IN_U) ** 2 / 3)


MMA_K = 8  # the k extent of one mma.sync m16n8k8


# Per key element, the flash kernels round the logit once before exp (S·scale, or S·scale·log2e
# in the fast kernel).
FLASH_LOGIT_ROUNDINGS = 1


# Final per-element roundings after the accumulation: the softmax's 1/l and ·(1/l) (flash's are
# per kernel: Kernel.final_roundings).
SOFTMAX_FINAL_ROUNDINGS = 2


def kernel_for(backend: Optional[str], math: str = "ieee", flash_kernel: Optional[str] = None,
               precision: str = "fp32") -> Kernel:
    """The arithmetic assumed: attnstep's flash kernel or backend as run.toml names them, any
    correct IEEE float32 implementation for other programs (backend None; at bf16 and fp16 also
    an approximate tanh), CUDA's fast-math intrinsics on request."""
    if math not in ("ieee", "fast"):
        raise ToleranceError(f"unknown math mode {math!r}; the tolerance model knows ieee, fast")
    if math == "fast":
        return FAST_KERNEL
    if flash_kernel:
        name = kernel_base_name(flash_kernel)
        if name not in KERNELS:
            raise ToleranceError(f"unknown flash kernel {flash_kernel!r}; the tolerance model knows "
                                 f"{', '.join(KERNELS)}")
        return KERNELS[name]
    if backend is None:
        return FOREIGN_HALF_KERNEL if is_half(precision) else FOREIGN_KERNEL
    if backend not in _BACKEND_KERNELS:
        raise ToleranceError(f"unknown backend {backend!r}; the tolerance model knows "
                             f"{', '.join(_BACKEND_KERNELS)}")
    return _BACKEND_KERNELS[backend]
