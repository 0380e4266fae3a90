"""Checks that need no reference: properties every correct result has, on one head's got-matrix.

No NaN/Inf appears where none is allowed (-inf only where causal masking hides a score); each
stage's own properties are in its spec (verify/specs/): echoes and the transpose are exact copies,
masked entries hold their masked value, softmax rows are non-negative and sum to 1 within the row
sum's rounding, dS rows sum to 0 and dK columns too, and the flash stages agree with the stage path
the binary wrote.
"""
from __future__ import annotations

from typing import List

import numpy as np

from ..model.attention import causal_mask
from ..specs import SPECS, HeadContext
from ..specs.base import (COLUMN_SUM, ECHO_MISMATCH, FLASH_VS_OUTPUT, FLASH_VS_STAGES, LSE_VS_SCORES, MASK_MISSING,
                          NEGATIVE_WEIGHTS, NONFINITE, NOT_TRANSPOSE, ROW_SUM, Violation, nonfinite)
from ..stages import Dims
from . import half_rounding, reference, tolerance

__all__ = ["check_invariants", "ENGINE_BOUNDS", "head_context", "Violation", "NONFINITE", "NEGATIVE_WEIGHTS",
           "ROW_SUM", "MASK_MISSING", "NOT_TRANSPOSE", "ECHO_MISMATCH", "FLASH_VS_OUTPUT", "LSE_VS_SCORES",
           "FLASH_VS_STAGES", "COLUMN_SUM"]


class EngineBounds:
    """The engine's bounds and references as the specs' reference-free checks see them
    (verify/specs/base.py's Bounds, handed to them as HeadContext.bounds)."""
    stage_bound = staticmethod(tolerance.stage_bound)
    chained_bound = staticmethod(tolerance.chained_bound)
    reference_chain = staticmethod(reference.reference_chain)
    invariant_quantum = staticmethod(half_rounding.invariant_quantum)


ENGINE_BOUNDS = EngineBounds()


def head_context(dims: Dims, scale: float, causal: bool, **fields) -> HeadContext:
    """A head's context (verify/specs/base.py's HeadContext, its other fields by name) with the
    engine's bounds."""
    return HeadContext(dims, scale, causal, bounds=ENGINE_BOUNDS, **fields)


def _where_reference_finite(stage: str, got: np.ndarray, ctx: HeadContext) -> np.ndarray:
    """got, with 0 where non-finite inputs (accepted with --allow-nonfinite) made the reference
    non-finite: the comparisons judge those elements, the non-finite check the others."""
    ref = ctx.chain.get(stage) if ctx.allow_nonfinite else None
    return got if ref is None else np.where(np.isfinite(ref), got, 0.0)


def check_invariants(stage: str, got: np.ndarray, ctx: HeadContext) -> List[Violation]:
    """Reference-free checks on one head's float64 got-matrix of `stage` (see the module doc)."""
    got = np.asarray(got, dtype=np.float64)
    spec = SPECS[stage]
    out: List[Violation] = []
    if not spec.echo:  # an echo's own check judges non-finite values against its input
        hidden = spec.masked_value == -np.inf and ctx.causal
        neg_inf_ok = causal_mask(*got.shape) if hidden else np.zeros(got.shape, bool)
        v = nonfinite(stage, _where_reference_finite(stage, got, ctx), neg_inf_ok)
        if v:
            out.append(v)
    for check in spec.invariants:
        if spec.partner and out:
            break  # agreement with the stage path is meaningless for a result that is not finite
        out.extend(check(stage, got, ctx))
    return out
