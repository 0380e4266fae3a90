"""Checks that need no reference: properties every correct result has, on one head's got-matrix.

No NaN/Inf appears where none is allowed (-inf only where the reference holds it: a score the
mask hides, the lse of a row that sees no key); each stage's own properties are in its spec
(verify/specs/): echoes and the transpose are exact copies, masked entries hold their masked value
under the head's whole mask (the causal flag, alignment and window, the mask file, the bias file's
-inf), softmax rows are non-negative and sum to 1 within the row sum's rounding (a row that sees
no key: all 0), dS rows sum to 0 and dK columns too (without a softcap), and the flash stages agree
with the stage path the binary wrote. A spec's `canonical` puts the program's values in the
reference's convention first (flash_lse's +inf for an empty row, flash-attn's causal ALiBi shift).
"""
from __future__ import annotations

from typing import List

import numpy as np

from ..specs import SPECS, HeadContext
from ..specs.base import (COLUMN_SUM, ECHO_MISMATCH, FLASH_VS_OUTPUT, FLASH_VS_STAGES, LSE_VS_SCORES, MASK_MISSING,
                          NEGATIVE_WEIGHTS, NONFINITE, NOT_TRANSPOSE, ROW_SUM, Violation, nonfinite)
from ..stages import Dims
from . import half_rounding, reference, splits, tolerance

__all__ = ["check_invariants", "canonical", "ENGINE_BOUNDS", "head_context", "Violation", "NONFINITE",
           "NEGATIVE_WEIGHTS", "ROW_SUM", "MASK_MISSING", "NOT_TRANSPOSE", "ECHO_MISMATCH", "FLASH_VS_OUTPUT", "LSE_VS_SCORES",
           "FLASH_VS_STAGES", "COLUMN_SUM"]


class EngineBounds:
    """The engine's bounds and references as the specs' reference-free checks see them
    (verify/specs/base.py's Bounds, handed to them as HeadContext.bounds)."""
    stage_bound = staticmethod(tolerance.stage_bound)
    chained_bound = staticmethod(tolerance.chained_bound)
    reference_chain = staticmethod(reference.reference_chain)
    invariant_quantum = staticmethod(half_rounding.invariant_quantum)
    combine_allowance = staticmethod(splits.combine_allowance)


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


def canonical(stage: str, got: np.ndarray, ctx: HeadContext) -> np.ndarray:
    """got in the reference's convention (the spec's `canonical`; got itself without one or
    without the reference)."""
    spec = SPECS[stage]
    if spec.canonical is None or stage not in ctx.chain:
        return got
    return spec.canonical(got, np.asarray(ctx.chain[stage], np.float64), ctx)


def _neg_inf_allowed(stage: str, got: np.ndarray, ctx: HeadContext) -> np.ndarray:
    """Where −inf is a correct value: where the reference holds it (else, for a stage whose masked
    value is −inf, where the head's mask hides the entry)."""
    if stage in ctx.chain and np.shape(ctx.chain[stage]) == got.shape:
        return np.asarray(ctx.chain[stage]) == -np.inf
    if SPECS[stage].masked_value == -np.inf:
        return ctx.hidden(*got.shape)
    return np.zeros(got.shape, bool)


def check_invariants(stage: str, got: np.ndarray, ctx: HeadContext) -> List[Violation]:
    """Reference-free checks on one head's float64 got-matrix of `stage` (see the module doc)."""
    got = canonical(stage, np.asarray(got, dtype=np.float64), ctx)
    spec = SPECS[stage]
    out: List[Violation] = []
    if not spec.echo:  # an echo's own check judges non-finite values against its input
        v = nonfinite(stage, _where_reference_finite(stage, got, ctx), _neg_inf_allowed(stage, got, ctx))
        if v:
            out.append(v)
    for check in spec.invariants:
        if spec.partner and out:
            break  # agreement with the stage path is meaningless for a result that is not finite
        out.extend(check(stage, got, ctx))
    return out
