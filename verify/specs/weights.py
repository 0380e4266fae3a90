"""attention_weights: the row softmax of QK_scaled, exactly 0 where masked (a row that sees no
key: all 0).

Its isolated bound starts from the binary's own float32 QK_scaled: the float32 subtraction S - m
is known exactly, exp errs as the arithmetic assumed (kernel.exp_var; fast math: growing with its
argument), the row sum rounds in its own binades, then 1/l and the multiply. Reference-free: no
weight is negative, masked weights are exactly 0 (under the whole mask: the causal flag, the
window, the mask file, the bias file's -inf), every row that sees a key sums to 1 within the row
sum's rounding and the final roundings.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np

from ..model.attention import softmax_rows
from ..model.chain import chained_eta, chained_logits
from ..model.kernels import SOFTMAX_FINAL_ROUNDINGS
from ..model.rounding import FLUSH, LAMBDA, ROUND_VAR, finish, unit_roundoff
from ..model.softmax import (EqualTerms, correlated_sum, exponent_var, f32_subtraction_error, need, rowsum_rel_var,
                             softmax_parts, weights_var)
from ..stages import SCALED_SCORES, WEIGHTS
from ..text import indices
from ..variant import Variant
from .base import MASK_MISSING, NEGATIVE_WEIGHTS, ROW_SUM, HeadContext, Problem, StageSpec, Violation, violation
from . import lse_route
from .copies import PATTERNS
from .output import scores_from_inputs


def _source(src):
    return src[SCALED_SCORES]


def _reference(src, problem: Problem):
    return softmax_rows(_source(src))


def _passed_on(got, ref, src, ctx: HeadContext):
    """The isolated reference with NaN in the rows where the program wrote NaN because its own
    scores left the row without a key that the head's mask shows keys: a wrong mask or score
    upstream hid them all, and a softmax that never needs to guard a row with no key normalizes
    0/0 there (the reference's 0 is the contract's form for the rows the mask empties, and what a
    program that guards writes). The stage only passes on its upstream's fault."""
    S = _source(src)
    if got.shape != ref.shape or S.shape != ref.shape:
        return ref
    emptied = np.isneginf(S).all(axis=1) & ~ctx.hidden(*S.shape).all(axis=1)
    unguarded = emptied & np.isnan(got).all(axis=1)
    return np.where(unguarded[:, None], np.nan, ref) if unguarded.any() else ref


def _isolated(src, ref, problem: Problem):
    u, kernel = problem.u, problem.kernel
    (S,) = need(src, WEIGHTS, SCALED_SCORES)
    p, d, m, finite = softmax_parts(S)
    # The softmax reads the very float32 QK_scaled the isolated reference starts from, so the
    # input's rounding is not this stage's error (the chained bound propagates upstream errors),
    # and its float32 subtraction S - m is known exactly: its error replaces the u|d| model.
    # (The binary's own QK_scaled: nothing else shares these, so they are not cached.)
    eta_var = exponent_var(np.zeros(d.shape), finite, u, kernel)
    if kernel.exp_slope_var:  # exp's own error grows with its argument d (fast math)
        eta_var = eta_var + np.where(finite, kernel.exp_slope_var * (u * d) ** 2, 0.0)
    eta_var = eta_var + np.where(finite, f32_subtraction_error(S, m, d, u) ** 2, 0.0)
    return weights_var(p, eta_var, rowsum_rel_var(p, u), u, div_var=kernel.div_var), np.zeros(ref.shape)


def _chained(sources, problem: Problem):
    u, kernel, cache = problem.u, problem.kernel, problem.cache
    Q, K = sources[:2]
    S, p, _, _, _, _ = chained_logits(Q, K, *problem.model_args)
    eta_var = chained_eta(Q, K, *problem.model_args)
    l_var = rowsum_rel_var(p, u, cache=cache)
    return finish(S, weights_var(p, eta_var, l_var, u, cache, kernel.div_var), np.zeros(S.shape), 2 * FLUSH)


def _quantization(src, q, problem: Problem):
    """How far the weights move when each score may move by up to qs: p_j' / p_j =
    e^(δ_j) / Σ_k p_k e^(δ_k) with |δ| ≤ qs lies within [e^(-qs_j) / Σ p e^(qs), e^(qs_j) / Σ p e^(-qs)]
    (to first order p·(qs + Σ p·qs); exact, as half-precision scores can move by whole units)."""
    S = _source(src)
    p = softmax_parts(S)[0]
    qs = np.minimum(np.where(np.isfinite(S), q.get(SCALED_SCORES, 0.0), 0.0), 700.0)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # rows with no visible key: 0
        up = np.exp(qs) / (p * np.exp(-qs)).sum(axis=1, keepdims=True) - 1.0
        down = 1.0 - np.exp(-qs) / (p * np.exp(qs)).sum(axis=1, keepdims=True)
        return np.where(p == 0, 0.0, p * np.maximum(up, down))


def _softmax_checks(stage: str, got: np.ndarray, ctx: HeadContext) -> List[Violation]:
    masked = ctx.hidden(*got.shape)
    finite = np.isfinite(got)
    unmasked = masked & finite & (got != 0)
    empty = masked.all(axis=1)
    # (a row that sees no key, softmaxed over its stand-ins for −inf: every key alike, not 0)
    what = "are not 0 where the mask hides them" if not unmasked[empty].any() else \
        (f"are not 0 where the mask hides them, in {_rows(np.flatnonzero(unmasked.any(axis=1) & empty))} "
         "hiding every key (a softmax over a row of -1e9 or another finite stand-in weighs each key alike; "
         "such a row's weights are 0)")
    out = [violation(NEGATIVE_WEIGHTS, stage, finite & (got < 0), "are negative"),
           violation(MASK_MISSING, stage, unmasked, what)]
    # A row that sees no key holds only masked zeros (checked above), and sums to 0, not 1.
    rows_ok = finite.all(axis=1) & ~empty
    if rows_ok.any():
        out.append(_row_sums(stage, got, finite, rows_ok, ctx))
    return [v for v in out if v]


def _rows(rows: np.ndarray) -> str:
    return f"row{'s' if len(rows) > 1 else ''} {indices(rows)}"


def _row_sums(stage, got, finite, rows_ok, ctx):
    p = np.where(finite, got, 0.0)
    u = unit_roundoff(ctx.precision)
    # The exp errors cancel in Σ_j p_j; what remains is the row sum's rounding (ε_l) and the
    # final roundings of each weight: the model's variances, evaluated on got itself. Equal
    # weights (equal exponentials) round alike: their final roundings add as one (correlated_sum).
    var = (rowsum_rel_var(np.clip(p, 0.0, None), u)[:, 0]
           + SOFTMAX_FINAL_ROUNDINGS * ROUND_VAR * u * u * correlated_sum(p * p, EqualTerms(p.astype(np.float32))))
    allowed = LAMBDA * np.sqrt(var) + 2 * FLUSH * got.shape[1]
    q = ctx.bounds.invariant_quantum(stage, got, ctx)
    if q is not None:  # the printed resolution of every weight of the row
        allowed = allowed + np.where(finite, q, 0.0).sum(axis=1)
    dev = np.abs(p.sum(axis=1) - 1.0)
    if not (rows_ok & ~(dev <= allowed)).any():
        return None
    # Weights exponentiated against a float32 lse share its error as a factor of the row: the row
    # sum is off by it (lse_route; its bound, an N×M pass, only where a row is off without it).
    allowed = allowed + np.expm1(lse_route.factor_bound(ctx))[:, 0]
    bad = rows_ok & ~(dev <= allowed)
    if not bad.any():
        return None
    r = int(np.argmax(np.where(bad, dev, -1.0)))
    return Violation(ROW_SUM, f"{stage}: {int(bad.sum())} of {got.shape[0]} rows do not sum to 1; worst "
                     f"row {r} sums to {p[r].sum():.9g} (allowed ±{allowed[r]:.2g})", int(bad.sum()), (r,))


def weights_from_inputs(src, scale, masked, variant: Variant = Variant(), slope: float = 0.0, rows=None,
                       n: Optional[int] = None):
    """softmax(scores) in float64 from the case's inputs (output's scores_from_inputs): what the
    diagnoses recompute a program's weights from where it wrote no scores of its own (a wrong
    scale, keys read past the head's end)."""
    return softmax_rows(scores_from_inputs(src, scale, masked, variant, slope, rows, n))


SPECS = (
    StageSpec(WEIGHTS, reference=_reference, isolated=_isolated, chained=_chained,
              quantization=_quantization, invariants=(_softmax_checks,), masked_value=0.0, passed_on=_passed_on,
              from_inputs=weights_from_inputs,
              diagnoses=PATTERNS + ("scaled", "softmax_axis", "mask", "keys", "overflow", "mask_after_softmax",
                                    "tile_keys", "key_tile", "normalization")),
)
