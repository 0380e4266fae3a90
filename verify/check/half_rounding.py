"""The half pipelines' storage roundings, carried along each stage's route from the inputs.

Under bf16/fp16 a program rounds some intermediates to the format and computes on from the rounded
values: the stage path stores every stage but the row statistics (Stage.float32 in
verify/stages.py) and each stage reads its upstream stages' stored values; the flash kernels keep the
scores in float32 and round only the GEMM operands P (before P·V and Pᵀ·dO) and dS (before dS·K and
dSᵀ·Q), and the backward reads the stored flash_output. Each rounding errs by at most half a unit in
the format's last place (verify/model/half.py); its first-order effect on the stage is what the
stage spec's `quantization` gives for a source known to within that much (the rule printed
resolution follows too): worst-case, so it never under-counts. The isolated checks need only the
stage's own conversion (the upstream files are the exact values the program used) and, for the
flash stages, the roundings inside the kernel; the chained checks every rounding on the route.
Under dropout a stage-path GEMM reads a stored value times Z/(1 − p) (StageSpec.dropped), which
the pipeline may round to the format again: one more conversion of that source.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np

from ..model.half import NEAREST, is_half, storage_bound
from ..model.rounding import HeadCache, memo
from ..specs import SPECS, VARIANT_SOURCES, sources_of, upstream
from ..specs.base import Problem, head_variant, resolve_variant
from ..stages import CASE_INPUTS, STAGES
from ..variant import Variant
from .reference import reference_chain


def stored_in_format(stage: str) -> bool:
    """Whether the stage's file holds values of the half format (exact copies hold them already)."""
    return not STAGES[stage].float32 and SPECS[stage].isolated is not None


def _route(stage: str) -> Optional[Tuple[str, Tuple[str, ...]]]:
    """The stage-path stage whose value `stage` is, and the intermediates rounded on the way: a
    flash stage's kernel rounds only its GEMM operands (Stage.rounds; none: no route), the stage
    path stores every stage."""
    if STAGES[stage].flash:
        return (SPECS[stage].partner, STAGES[stage].rounds) if STAGES[stage].rounds else None
    return stage, tuple(n for n in STAGES if not STAGES[n].flash and stored_in_format(n))


def _inputs(inputs: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """The case's inputs and the head's variant tensors among `inputs`."""
    return {n: inputs[n] for n in CASE_INPUTS + VARIANT_SOURCES if n in inputs}


def _dropped_rounding(name: str, src: Dict[str, np.ndarray], variant: Variant, precision: str, rounding: str):
    """The conversion of the dropped sources of stage `name` (StageSpec.dropped) under dropout."""
    if variant.dropout == 0:
        return {}
    return {n: storage_bound(src[n], precision, rounding) for n in SPECS[name].dropped if n in src}


def route_error(stage: str, inputs: Dict[str, np.ndarray], scale: float, causal: bool, precision: str,
                cache: Optional[HeadCache] = None, rounding: str = NEAREST, *, variant: Optional[Variant] = None,
                slope: float = 0.0):
    """Bound on how far the half roundings on `stage`'s route (its own stored value included, for
    a stage-path stage) move it, from the original inputs (Q, K, V, dO as the program read them,
    and the head's variant tensors)."""
    route = _route(stage)
    if route is None:
        return 0.0
    variant = resolve_variant(variant, causal)
    target, rounded = route
    names = [n for n in STAGES if n == target or n in upstream(target)]
    given = _inputs(inputs)
    sources = tuple(given[n] for n in CASE_INPUTS if n in given)
    head = head_variant(variant, slope, given)

    def compute():
        refs = {**given, **reference_chain(given, scale, variant.causal, names, variant=variant, slope=slope)}
        err: Dict[str, object] = {}
        for name in names:
            src = {n: refs[n] for n in sources_of(name, variant) + VARIANT_SOURCES if n in refs}
            q = {n: err[n] for n in STAGES[name].inputs if isinstance(err.get(n), np.ndarray)}
            if name in rounded:
                for n, extra in _dropped_rounding(name, src, variant, precision, rounding).items():
                    q[n] = q.get(n, 0.0) + extra
            with np.errstate(invalid="ignore"):
                moved = SPECS[name].quantization(src, q, Problem.of(scale, variant.causal, src, variant, slope)) \
                    if q else 0.0
            own = storage_bound(refs[name], precision, rounding) if name in rounded else 0.0
            total = own + moved
            err[name] = np.asarray(total, np.float64) if np.ndim(total) else total
        return np.broadcast_to(err[target], refs[target].shape).copy() if np.ndim(err[target]) else \
            np.zeros(refs[target].shape)
    return memo(cache, "half route " + stage, sources, (scale, head, precision, rounding), compute)


def half_terms(stage: str, ref: np.ndarray, inputs: Dict[str, np.ndarray], scale: float, causal: bool,
               precision: str, chained: bool, cache: Optional[HeadCache] = None, rounding: str = NEAREST, *,
               variant: Optional[Variant] = None, slope: float = 0.0):
    """What the half pipeline adds to `stage`'s float32 bound: chained, every rounding on its route;
    isolated, its own conversion (and, under dropout, its dropped sources' second conversion), and
    for a flash stage the roundings inside the kernel. rounding: how the program converts to the
    format (NEAREST or TOWARD_ZERO, verify/model/half.py). inputs: the stage's sources (isolated)
    or the chain (with the head's variant tensors)."""
    variant = resolve_variant(variant, causal)
    own = storage_bound(ref, precision, rounding) if stored_in_format(stage) else 0.0
    if STAGES[stage].flash:
        return own + route_error(stage, inputs, scale, causal, precision, cache, rounding, variant=variant,
                                 slope=slope)
    if chained:
        return route_error(stage, inputs, scale, causal, precision, cache, rounding, variant=variant, slope=slope)
    dropped = _dropped_rounding(stage, inputs, variant, precision, rounding)
    if dropped:
        src = {n: np.asarray(x, np.float64) for n, x in inputs.items()}
        own = own + SPECS[stage].quantization(src, dropped, Problem.of(scale, variant.causal, src, variant, slope))
    return own


def invariant_quantum(stage: str, got: np.ndarray, ctx):
    """What a reference-free check of `stage` (its rows or columns sum to a known value) allows per
    element beyond its float32 model: the file's printed resolution, and under bf16/fp16 every
    rounding on its route (a sum of stored half values misses its target by their conversions, and
    a route's upstream roundings move the values it sums)."""
    q = ctx.quanta.get(stage)
    if not is_half(ctx.precision):
        return q
    inputs = {**ctx.variant_tensors(), **{n: ctx.chain[n] for n in CASE_INPUTS if n in ctx.chain}}
    extra = half_terms(stage, np.where(np.isfinite(got), got, 0.0), inputs, ctx.scale, ctx.causal, ctx.precision,
                       True, ctx.cache, ctx.half_rounding, variant=ctx.effective_variant, slope=ctx.slope)
    return extra if q is None else q + extra
