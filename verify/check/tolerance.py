"""The tolerance model: an element-wise bound on |got - ref| for every stage, from rounding analysis.

Each float32 operation rounds to nearest; a stage's error is a sum of many such roundings, so the
model computes, per element, the VARIANCE of that sum from the actual data (the partial sums the
computation passes through) and allows LAMBDA standard deviations: a probabilistic bound in the
sense of Higham & Mary (2019), but with the exact partial sums instead of the worst-case
Σ|a_i b_i|, so it stays within ~10× the typical error of a correct computation (a worst-case bound
is 50-200× looser and lets real bugs through). Errors that are bounded but one-signed (the scale's
own rounding, tensor-core truncation) enter as their bound (det). The arithmetic assumed is the
backend's as run.toml names it, any correct IEEE float32 program without one, or CUDA's fast-math
intrinsics (verify/model/kernels.py).

The building blocks are in verify/model/; each stage's use of them is its spec (verify/specs/):
this module dispatches. docs/tolerances.md explains the model; tests/test_tolerance.py
calibrates it. Masked entries (-inf in the reference) get bound 0:
they must match exactly. Under a variant (`variant`, `slope`: verify/variant.py) the sources and
the chain also hold the head's mask, bias and dropout keep-mask (verify.specs.VARIANT_SOURCES),
and the model adds the variant's roundings (verify/model/scores.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np

from ..model.dot import dot_var
from ..model.half import NEAREST, is_half
from ..model.kernels import KERNELS, SOFTMAX_FINAL_ROUNDINGS, Kernel, kernel_for
from ..model.rounding import (FLUSH, LAMBDA, LOG_ULPS, ROUND_VAR, UNIT_ROUNDOFF, HeadCache, ToleranceError, finish,
                              memo, unit_roundoff)
from ..model.softmax import need
from ..specs import SPECS, VARIANT_SOURCES, chain_inputs, sources_of
from ..specs.backward.flash_bounds import flash_own_and_references, own_sources
from ..specs.backward.flash_chain_pass import flash_chain
from ..specs.base import Problem, resolve_variant
from ..stages import (FLASH_GRAD_KEYS, FLASH_GRAD_QUERIES, FLASH_GRAD_VALUES, FLASH_LSE, FLASH_OUTPUT, INPUT_NAMES,
                      STAGES)  # noqa: F401 (tolerance.STAGES: the stage table, for callers)
from ..variant import Variant
from .half_rounding import half_terms

__all__ = ["stage_bound", "stage_bound_parts", "BoundParts", "chained_bound", "quantization_bound", "dot_var",
           "kernel_for", "HeadCache", "ToleranceError", "unit_roundoff", "KERNELS", "Kernel", "FLUSH",
           "LAMBDA", "LOG_ULPS", "ROUND_VAR", "UNIT_ROUNDOFF", "SOFTMAX_FINAL_ROUNDINGS"]


# The half pipelines accumulate in float32: their arithmetic is the fp32 model's (the storage
# roundings are half_terms').
_FLOAT32_OF = {"bf16": "fp32", "fp16": "fp32"}


def _spec(stage: str):
    if stage not in SPECS:
        raise ToleranceError(f"unknown stage {stage!r}")
    return SPECS[stage]


@dataclass(frozen=True)
class BoundParts:
    """An isolated bound in its parts: LAMBDA·√var (the independent roundings) + det (one-signed
    errors) + floor (underflow), 0 where the reference is ±inf, plus extra (the half pipelines'
    conversions). A sum of results with independent roundings (dK of a K/V head's group, summed
    over its query heads) is bounded by the sum of their parts: variances add, the rest adds."""
    var: np.ndarray
    det: np.ndarray
    floor: object
    extra: object = 0.0

    def __add__(self, other: "BoundParts") -> "BoundParts":
        return BoundParts(self.var + other.var, self.det + other.det, self.floor + other.floor,
                          self.extra + other.extra)

    def bound(self, ref: np.ndarray) -> np.ndarray:
        bound = finish(np.asarray(ref, dtype=np.float64), self.var, self.det, self.floor)
        return bound if np.isscalar(self.extra) and self.extra == 0 else bound + self.extra


def stage_bound_parts(stage: str, src: Dict[str, np.ndarray], ref: np.ndarray, *, scale: float,
                      causal: bool, precision: str = "fp32", backend: Optional[str] = None,
                      math: str = "ieee", flash_kernel: Optional[str] = None,
                      cache: Optional[HeadCache] = None, half_rounding: str = NEAREST,
                      variant: Optional[Variant] = None, slope: float = 0.0) -> Optional[BoundParts]:
    """stage_bound's parts (BoundParts); None for an exact copy (echoes, the transpose)."""
    spec = _spec(stage)
    u = unit_roundoff(precision)
    kernel = kernel_for(backend, math, flash_kernel, precision)
    ref = np.asarray(ref, dtype=np.float64)
    if spec.isolated is None:
        return None
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):  # (a program's NaN or Inf among the sources)
        var, det = spec.isolated(src, ref, Problem.of(scale, causal, src, variant, slope, u, kernel, cache))
    extra = half_terms(stage, ref, src, scale, causal, precision, False, cache, half_rounding,
                       variant=variant, slope=slope) if is_half(precision) else 0.0
    return BoundParts(var, det, spec.floor(src), extra)


def stage_bound(stage: str, src: Dict[str, np.ndarray], ref: np.ndarray, *, scale: float,
                causal: bool, precision: str = "fp32", backend: Optional[str] = None,
                math: str = "ieee", flash_kernel: Optional[str] = None,
                cache: Optional[HeadCache] = None, half_rounding: str = NEAREST,
                variant: Optional[Variant] = None, slope: float = 0.0) -> np.ndarray:
    """Element-wise bound on |got - ref| for one head of `stage` computed from `src` (isolated).

    src holds the float64 values of the stage's inputs (verify.stages.STAGES[stage].inputs); the
    flash stages use Q, K (and V for flash_output). Exact copies (echoes, the transpose) get 0;
    entries where ref is ±inf (masked) get 0 and must match exactly. backend (run.toml's
    `backend`, "cpu" or "cuda") picks the arithmetic assumed; None: any correct IEEE float32
    implementation; flash_kernel (run.toml's) refines it per kernel; math "fast": CUDA's fast-math
    intrinsics (kernel_for).
    cache (a HeadCache for this head) shares the intermediate results of the head's bounds.
    half_rounding: how a bf16/fp16 program converts to its format (verify/model/half.py).
    variant, slope: the case's variant and the head's ALiBi slope (default: the plain case).
    """
    parts = stage_bound_parts(stage, src, ref, scale=scale, causal=causal, precision=precision, backend=backend,
                              math=math, flash_kernel=flash_kernel, cache=cache, half_rounding=half_rounding,
                              variant=variant, slope=slope)
    return np.zeros(np.shape(ref)) if parts is None else parts.bound(ref)


def chained_bound(stage: str, chain: Dict[str, np.ndarray], *, scale: float, causal: bool,
                  precision: str = "fp32", backend: Optional[str] = None, math: str = "ieee",
                  flash_kernel: Optional[str] = None, cache: Optional[HeadCache] = None,
                  half_rounding: str = NEAREST, variant: Optional[Variant] = None, slope: float = 0.0) -> np.ndarray:
    """Bound on |got - chain[stage]| where chain holds the float64 reference chain from the
    original inputs (Q, K, V and every stage up to `stage`): each stage's own error plus the
    upstream errors propagated through it (QK's dot-product error through the scale and the
    softmax Jacobian, the softmax's errors through P·V with the normalization's cancellation).
    stage_bound() alone would cry wolf here: QK's rounding reaches QK_scaled and beyond.
    cache (a HeadCache for this head) shares the intermediate results of the head's bounds."""
    variant = resolve_variant(variant, causal)
    bound = _chained_float32(stage, chain, scale=scale, variant=variant, slope=slope, precision=precision,
                             backend=backend, math=math, flash_kernel=flash_kernel, cache=cache)
    if is_half(precision) and _spec(stage).isolated is not None:
        bound = bound + half_terms(stage, chain[stage], chain, scale, variant.causal, precision, True, cache,
                                   half_rounding, variant=variant, slope=slope)
    return bound


def _chained_float32(stage: str, chain: Dict[str, np.ndarray], *, scale: float, variant: Variant, slope: float,
                     precision: str, backend: Optional[str], math: str, flash_kernel: Optional[str],
                     cache: Optional[HeadCache]) -> np.ndarray:
    """chained_bound's float32 arithmetic (every precision's accumulation)."""
    spec = _spec(stage)
    u = unit_roundoff(precision)
    kernel = kernel_for(backend, math, flash_kernel, precision)
    if spec.chained is None:
        names = INPUT_NAMES + VARIANT_SOURCES + sources_of(stage, variant)
        src = {n: chain[n] for n in names if n in chain}
        return stage_bound(stage, src, chain[stage], scale=scale, causal=variant.causal,
                           precision=_FLOAT32_OF.get(precision, precision), backend=backend, math=math,
                           flash_kernel=flash_kernel, cache=cache, variant=variant, slope=slope)
    sources = need(chain, stage, *chain_inputs(stage))
    problem = Problem.of(scale, variant.causal, chain, variant, slope, u, kernel, cache)
    return memo(cache, "chained " + stage, sources, problem.key, lambda: spec.chained(sources, problem))


def _flash_backward(stage: str) -> bool:
    """A stage of the flash backward (its chained bound computes the flash forward's in its pass)."""
    return STAGES[stage].flash and STAGES[stage].backward


def share_flash_passes(stage: str, chain: Dict[str, np.ndarray], *, scale: float, causal: bool,
                       precision: str = "fp32", backend: Optional[str] = None, math: str = "ieee",
                       flash_kernel: Optional[str] = None, cache: Optional[HeadCache] = None,
                       half_rounding: str = NEAREST, variant: Optional[Variant] = None, slope: float = 0.0) -> None:
    """Before a flash forward stage's bound (`stage`): where the chain holds a flash backward stage
    too, compute that stage's chained bound first. Its pass over the row tiles computes the
    forward's bounds as well and keeps them in the head's cache (verify/specs/flash.py
    share_forward), so that the forward's logits and softmax are computed once, not once more in a
    pass of their own. The same bounds either way; the arguments are chained_bound's."""
    del half_rounding  # (the backward's float32 chain is what holds the forward's parts)
    later = [s for s in chain if s in STAGES and _flash_backward(s)]
    entry = STAGES[stage]
    if cache is None or not later or not entry.flash or entry.backward or entry.split:
        return
    _chained_float32(later[0], chain, scale=scale, variant=resolve_variant(variant, causal), slope=slope,
                     precision=precision, backend=backend, math=math, flash_kernel=flash_kernel, cache=cache)


def share_flash_references(stage: str, src: Dict[str, np.ndarray], *, scale: float, causal: bool,
                           precision: str = "fp32", backend: Optional[str] = None, math: str = "ieee",
                           flash_kernel: Optional[str] = None, cache: Optional[HeadCache] = None,
                           half_rounding: str = NEAREST, variant: Optional[Variant] = None, slope: float = 0.0) -> None:
    """Before a flash gradient's isolated reference from `src` (the program's own flash_output and
    flash_lse): that reference and the stage's isolated bound (stage_bound) computed in one pass
    over the row tiles, which share each tile's recomputed weights and dS. The same references and
    bounds either way; the arguments are stage_bound's."""
    del half_rounding
    if cache is None or not _flash_backward(stage):
        return
    problem = Problem.of(scale, causal, src, variant, slope, unit_roundoff(precision),
                         kernel_for(backend, math, flash_kernel, precision), cache)
    flash_own_and_references(src, problem)


# The stages whose chained references the flash backward chain's pass gives (in FlashChain's order).
FLASH_CHAINED = (FLASH_OUTPUT, FLASH_LSE, FLASH_GRAD_QUERIES, FLASH_GRAD_KEYS, FLASH_GRAD_VALUES)

# The program's outputs the flash gradients' isolated bounds are computed from, besides the inputs.
FLASH_OWN_OUTPUTS = (FLASH_OUTPUT, FLASH_LSE)


def chained_flash_references(chain: Dict[str, np.ndarray], *, scale: float, causal: bool, precision: str = "fp32",
                             backend: Optional[str] = None, math: str = "ieee", flash_kernel: Optional[str] = None,
                             cache: Optional[HeadCache] = None, half_rounding: str = NEAREST,
                             variant: Optional[Variant] = None, slope: float = 0.0,
                             own_outputs: Optional[Dict[str, np.ndarray]] = None) -> Dict[str, np.ndarray]:
    """The chained references of the flash forward and backward (flash_output, flash_lse, flash_dQ,
    flash_dK, flash_dV) from chain's inputs, computed in the pass over the row tiles of the flash
    backward's chained bound, which the head's cache keeps for that bound (and the forward's): for
    a head whose flash stages' chained bounds are asked for anyway, the references need no passes
    of their own. The same references, to float64 rounding; the other arguments are chained_bound's.
    own_outputs: the program's flash_output and flash_lse as the flash gradients' isolated check
    will read them: the same pass computes that check's bounds and references (share each tile's
    Q·Kᵀ, logits, dP and their variances), kept for it (specs/backward/flash_bounds.py)."""
    del half_rounding
    variant = resolve_variant(variant, causal)
    u, kernel = unit_roundoff(precision), kernel_for(backend, math, flash_kernel, precision)
    problem = Problem.of(scale, variant.causal, chain, variant, slope, u, kernel, cache)
    own = None
    if own_outputs and set(own_outputs) == set(FLASH_OWN_OUTPUTS) \
            and all(x.dtype == np.float64 for x in own_outputs.values()):  # (else the check's arrays differ)
        own_src = {**chain, **own_outputs}
        if Problem.of(scale, causal, own_src, variant, slope, u, kernel, cache).model_args == problem.model_args:
            own = own_sources(own_src)
    fc = flash_chain(*need(chain, FLASH_GRAD_QUERIES, *chain_inputs(FLASH_GRAD_QUERIES)), *problem.model_args,
                     own=own)
    # (the forward's output and lse from the chain's tiles' weights, the gradients from its sums over the queries)
    return {n: np.ascontiguousarray(x) for n, x in zip(FLASH_CHAINED, fc.forward + fc.refs)}


def quantization_bound(stage: str, src: Dict[str, np.ndarray], quanta: Dict[str, np.ndarray],
                       scale: float, causal: bool, *, variant: Optional[Variant] = None, slope: float = 0.0):
    """How far the isolated reference of `stage` can move when its sources are known only to
    within `quanta` (a file's printed resolution; absent: exact): |∂stage/∂source|·quantum, to
    first order. 0 when every source is exact."""
    q = {n: np.asarray(v, np.float64) for n, v in quanta.items() if v is not None and n in src}
    if not q:
        return 0.0
    x = {n: np.asarray(v, np.float64) for n, v in src.items()}
    return _spec(stage).quantization(x, q, Problem.of(scale, causal, x, variant, slope))
