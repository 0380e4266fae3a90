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
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np

from ..model.half import NEAREST, is_half, storage_bound
from ..model.rounding import HeadCache, memo
from ..specs import SPECS, upstream
from ..specs.base import Problem
from ..stages import CASE_INPUTS, STAGES
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


def route_error(stage: str, inputs: Dict[str, np.ndarray], scale: float, causal: bool, precision: str,
                cache: Optional[HeadCache] = None, rounding: str = NEAREST):
    """Bound on how far the half roundings on `stage`'s route (its own stored value included, for
    a stage-path stage) move it, from the original inputs (Q, K, V, dO as the program read them)."""
    route = _route(stage)
    if route is None:
        return 0.0
    target, rounded = route
    names = [n for n in STAGES if n == target or n in upstream(target)]
    sources = tuple(inputs[n] for n in CASE_INPUTS if n in inputs)

    def compute():
        refs = reference_chain({n: inputs[n] for n in CASE_INPUTS if n in inputs}, scale, causal, names)
        err: Dict[str, object] = {}
        for name in names:
            q = {n: err[n] for n in STAGES[name].inputs if isinstance(err.get(n), np.ndarray)}
            with np.errstate(invalid="ignore"):
                moved = SPECS[name].quantization({n: refs[n] for n in STAGES[name].inputs}, q, Problem(scale, causal)) \
                    if q else 0.0
            own = storage_bound(refs[name], precision, rounding) if name in rounded else 0.0
            total = own + moved
            err[name] = np.asarray(total, np.float64) if np.ndim(total) else total
        return np.broadcast_to(err[target], refs[target].shape).copy() if np.ndim(err[target]) else \
            np.zeros(refs[target].shape)
    return memo(cache, "half route " + stage, sources, (scale, causal, precision, rounding), compute)


def half_terms(stage: str, ref: np.ndarray, inputs: Dict[str, np.ndarray], scale: float, causal: bool,
               precision: str, chained: bool, cache: Optional[HeadCache] = None, rounding: str = NEAREST):
    """What the half pipeline adds to `stage`'s float32 bound: chained, every rounding on its route;
    isolated, its own conversion, and for a flash stage the roundings inside the kernel. rounding:
    how the program converts to the format (NEAREST or TOWARD_ZERO, verify/model/half.py)."""
    own = storage_bound(ref, precision, rounding) if stored_in_format(stage) else 0.0
    if STAGES[stage].flash:
        return own + route_error(stage, inputs, scale, causal, precision, cache, rounding)
    if chained:
        return route_error(stage, inputs, scale, causal, precision, cache, rounding)
    return own


def invariant_quantum(stage: str, got: np.ndarray, ctx):
    """What a reference-free check of `stage` (its rows or columns sum to a known value) allows per
    element beyond its float32 model: the file's printed resolution, and under bf16/fp16 every
    rounding on its route (a sum of stored half values misses its target by their conversions, and
    a route's upstream roundings move the values it sums)."""
    q = ctx.quanta.get(stage)
    if not is_half(ctx.precision):
        return q
    inputs = {n: ctx.chain[n] for n in CASE_INPUTS if n in ctx.chain}
    extra = half_terms(stage, np.where(np.isfinite(got), got, 0.0), inputs, ctx.scale, ctx.causal, ctx.precision,
                       True, ctx.cache, ctx.half_rounding)
    return extra if q is None else q + extra
