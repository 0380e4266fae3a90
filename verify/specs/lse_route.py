"""Weights exponentiated against a float32 log-sum-exp, P = exp(S − lse), and the output P·V from
them: a correct route (a two-pass softmax; FlashAttention's backward recomputes its weights so)
beside the one the error model follows, P = e/l with l the row's own sum.

Such weights share one factor per row, e^(−Δlse), Δlse the error of the program's float32 lse,
which no division by the row sum removes: the roundings of values of lse's magnitude (m + log l)
and of the log, about u·(|m| + |lse|), large where the logits are, and the scores the lse came
from, where the weights' were computed apart (a backward's own GEMM). Each weight and output of the
row carries that factor, and its row sum is off by it. The check allows the factor as what it is,
one number per row within the lse's bound: where factor 1 leaves some element outside, the
comparison is against the reference times the row's fitted factor, where that factor brings every
element inside with room to spare (fitted), so that a few wrong elements (no factor of their row)
still fail; the row-sum check widens by the bound. Where the program wrote its weights, the output's
factor is theirs, their row sum, where it brings the row inside.
"""
from __future__ import annotations

import numpy as np

from ..model.kernels import kernel_for
from ..model.rounding import LAMBDA, ROUND_VAR, ULP_IN_U, memo, unit_roundoff
from ..model.softmax import need
from .base import HeadContext, Problem
from .scores import scaled_chained
from ..stages import KEYS, OUTPUT, QUERIES, SCALED_SCORES, WEIGHTS

ROUTED = (WEIGHTS, OUTPUT)
_U32 = unit_roundoff("fp32")  # the lse is float32 at every precision (docs/contract.md)


def factor_bound(ctx: HeadContext, recomputed: bool = True, rows=None) -> np.ndarray:
    """|Δlse| that a correct float32 lse of each row may err by (N×1; 0 for a row without keys,
    or where the head's scores are not at hand); recomputed: against scores computed apart from
    the lse's own (_scores_shift); rows: _row_lse(ctx), where the caller has it."""
    rows = _row_lse(ctx) if rows is None else rows
    if rows is None:
        return np.zeros((1, 1))
    S, finite, seen, m, log_l = rows
    kernel = kernel_for(ctx.backend, ctx.math, ctx.flash_kernel, ctx.precision)
    magnitude = np.abs(m) + np.abs(m + log_l)
    # The roundings of lse's magnitude and of log l, and each exponent's S_j − lse rounding, whose
    # argument is log l further from 0 than the normalized route's S_j − m.
    var = ROUND_VAR * _U32 * _U32 * ((kernel.log_ulps * ULP_IN_U * log_l) ** 2 + log_l ** 2
                                     + kernel.lse_roundings * magnitude ** 2 / 4)
    shift = _scores_shift(ctx, S, finite, m + log_l) if recomputed else 0.0
    return np.where(seen, LAMBDA * np.sqrt(var) + shift, 0.0)


def _row_lse(ctx: HeadContext):
    """The head's scaled scores, where they are finite, the rows that see a key, and each row's
    max m and log l (lse = m + log l); None where the scores are not at hand."""
    S = ctx.chain.get(SCALED_SCORES)
    if S is None:
        return None
    S = np.asarray(S, dtype=np.float64)
    finite = np.isfinite(S)
    seen = finite.any(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        m = np.where(seen, np.max(np.where(finite, S, -np.inf), axis=1, keepdims=True), 0.0)
        log_l = np.where(seen, np.log(np.sum(np.where(finite, np.exp(S - m), 0.0), axis=1, keepdims=True)), 0.0)
    return S, finite, seen, m, log_l


def _scores_shift(ctx: HeadContext, S: np.ndarray, finite: np.ndarray, lse: np.ndarray) -> np.ndarray:
    """How far a row's lse may lie from the log-sum-exp of the scores its weights are exponentiated
    from where the two come from two computations of the scores (a backward recomputing S with a
    GEMM of its own, against the forward's lse): each within the scores' chained bound b, which
    moves the log-sum-exp by at most Σ p·b."""
    b = _scores_bound(ctx)
    if b is None:
        return 0.0
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.where(finite, np.exp(np.where(finite, S, 0.0) - np.where(np.isfinite(lse), lse, 0.0)), 0.0)
        return 2.0 * np.sum(p * np.where(finite, b, 0.0), axis=1, keepdims=True)


def _scores_bound(ctx: HeadContext):
    """The scaled scores' chained bound b (N×M), None without the head's Q and K."""
    if not all(n in ctx.chain for n in (QUERIES, KEYS)):
        return None
    problem = Problem.of(ctx.scale, ctx.causal, ctx.chain, ctx.effective_variant, ctx.slope, _U32,
                         kernel_for(ctx.backend, ctx.math, ctx.flash_kernel, ctx.precision), ctx.cache)
    # (under the key the check's own chained bound of the scores is kept: computed once a head)
    return memo(ctx.cache, "chained " + SCALED_SCORES, need(ctx.chain, SCALED_SCORES, QUERIES, KEYS), problem.key,
                lambda: scaled_chained(need(ctx.chain, SCALED_SCORES, QUERIES, KEYS), problem))


def _own_terms(stage: str, want: np.ndarray, ctx: HeadContext, chained: bool, rows):
    """What each weight exponentiated against the lse, exp(S_j − lse), errs by on its own, beside
    the row's factor (0 for other stages):
    - isolated (from the program's own scores): its float32 subtraction S_j − lse, at most
      u·|S_j − lse|, which moves exp by that relative amount; the isolated bound models the
      normalized route's S_j − m exactly (known bits), which says nothing of S_j − lse;
    - chained (from the inputs): the part of each score's own error that the normalized route's
      bound leaves out, p_j·δ_j (relative). That route's e_j/l errs by (1 − p_j)·δ_j − Σ_k≠j p_k·δ_k,
      cancelling most of a dominant weight's; exp(S_j − lse) with the scores computed apart from the
      lse's (a backward's own GEMM) errs by δ_j − Δlse, whose common part is the factor. δ_j = S_j −
      the reference's as the scores the program wrote show it, capped at the scores' chained bound
      (a wrong QK_scaled file, which fails on its own, widens no weight past a correct program's);
      where it wrote none, that bound's deviation (b/LAMBDA), what a correct program's own scores
      typically err by: the whole bound would let a dominant weight off by a few times its largest
      correct error pass, as a row's factor would.
    rows: _row_lse(ctx) (None where the scores are not at hand)."""
    if stage != WEIGHTS or rows is None or rows[0].shape != want.shape:
        return 0.0
    S, finite, _, m, log_l = rows
    with np.errstate(invalid="ignore", over="ignore"):
        if not chained:
            return np.where(finite, np.abs(want) * _U32 * np.abs(np.where(finite, S, 0.0) - (m + log_l)), 0.0)
        own = np.asarray(ctx.got[SCALED_SCORES], np.float64) if SCALED_SCORES in ctx.got else None
        b = _scores_bound(ctx)
        if b is None or (own is not None and own.shape != S.shape):
            return 0.0
        both = finite & (np.isfinite(own) if own is not None else True)
        # (no more than a correct program's scores may err by: a wrong QK_scaled widens nothing)
        delta = np.where(both, b / LAMBDA, 0.0) if own is None else \
            np.minimum(np.abs(np.where(both, own - S, 0.0)), np.where(both, b, 0.0))
        return np.where(both, want * want * np.expm1(delta), 0.0)


def fitted(stage: str, got: np.ndarray, want: np.ndarray, allowed: np.ndarray, ctx: HeadContext,
           chained: bool = False):
    """(want, times a factor c in each row that c = 1 leaves outside some element's allowance and
    c brings inside every one with room to spare, want itself elsewhere and for other stages; the
    allowance, with each weight's own error beside the factor added in the rows c = 1 leaves
    outside: _own_terms).

    c is the row's least-squares factor (each element weighted by its inverse variance,
    (want/allowed)²) moved into the middle half of the interval of factors that fit every element,
    taken where that move is within FIT_SPREAD of the fit's deviations and c within factor_bound. A
    correct row's elements err on either side of the factor, so its fit lies near that interval's
    middle or a few deviations from it; an element wrong by more than its allowance is one edge of
    the interval and pulls the fit only by its weight's share, so the middle half lies far from
    the fit and the row fails as before. (A median of the row's ratios, the first form, was thrown off
    at logits of a few hundred, where a few dominant keys' errors move the whole row's ratios
    together.) chained: want is from the inputs, so the output's factor may be the program's own
    weights' (an isolated want, from those weights, has it already)."""
    if stage not in ROUTED or got.shape != want.shape or got.ndim != 2:
        return want, allowed
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        both = np.isfinite(got) & np.isfinite(want)
        if np.all((np.abs(got - want) <= allowed) | ~both):  # (factor 1 explains every row: no fit, no cost)
            return want, allowed
        own = _weights_factor(stage, ctx, want.shape[0]) if chained else None
        # (where the program wrote its weights, its output's factor is theirs: no other scores' shift)
        # (the weights' own terms and the bound from one pass over the head's scores)
        rows = _row_lse(ctx) if stage == WEIGHTS else None
        bound = factor_bound(ctx, recomputed=own is None, rows=rows)
        if bound.shape[0] != want.shape[0]:
            return want, allowed
        routed = np.broadcast_to(allowed + _own_terms(stage, want, ctx, chained, rows), want.shape)
        # (a row off without the route: each weight's own error allowed, with or without a factor)
        off = np.any((np.abs(got - want) > allowed) & both, axis=1, keepdims=True)
        # The factor fitted under the model's own allowance first; the routed one, wider, only in the
        # off rows that finds none (its interval's middle half moves away from fits the narrower takes).
        c, use = _factor(got, want, np.broadcast_to(allowed, want.shape), both, own, bound)
        if (off & ~use).any():
            c2, use2 = _factor(got, want, routed, both, own, bound)
            c, use = np.where(use, c, c2), use | use2
    return want * np.where(use, c, 1.0) if use.any() else want, np.where(off, routed, allowed)


def _factor(got, want, allowed, both, own, bound):
    """(each row's factor c, whether it is taken) under `allowed`: fitted()'s rule."""
    lo, hi = _fitting(got, want, allowed, both)
    fit, spread = _least_squares(got, want, allowed, both & (want != 0))
    c = np.clip(fit, lo + (hi - lo) / 4, hi - (hi - lo) / 4)
    inside = (lo <= hi) & (np.abs(c - fit) <= FIT_SPREAD * spread)
    if own is not None:
        fits = (lo <= own) & (own <= hi)
        c, inside = np.where(fits, own, c), inside | fits
    use = inside & (np.abs(np.log(c)) <= bound) & ~((lo <= 1.0) & (1.0 <= hi)) & np.isfinite(c)
    return c, use


def _least_squares(got, want, allowed, used):
    """Each row's c minimising Σ ((got − c·want)/allowed)² over its used elements, and its standard
    deviation where each element errs by allowed/LAMBDA (NaN where none is used)."""
    weight = np.where(used, (want / np.maximum(allowed, np.finfo(np.float64).tiny)) ** 2, 0.0)
    ratio = got / np.where(used, want, 1.0)
    total = np.sum(weight, axis=1, keepdims=True)
    fit = np.sum(weight * np.where(used, ratio, 0.0), axis=1, keepdims=True) / total
    return fit, 1.0 / (LAMBDA * np.sqrt(total))


# How far the factor taken (the fit moved into the middle half of the fitting interval) may lie from
# the least-squares fit, in the fit's standard deviations: a correct row's fit lies within a few of
# the factor; one wrong element makes itself the interval's edge and pulls the fit only by its
# weight's share, so the middle half lies many deviations away.
FIT_SPREAD = 2.0


def _weights_factor(stage: str, ctx: HeadContext, rows: int):
    """The output's row factor where the program wrote its weights: their row sums, which a
    correct route's weights share with its output (exactly 1 but for the roundings of the sum and
    the exponentials, far finer than the factor); None for other stages or without the weights."""
    weights = ctx.got.get(WEIGHTS)
    if stage != OUTPUT or weights is None or np.ndim(weights) != 2 or np.shape(weights)[0] != rows:
        return None
    with np.errstate(invalid="ignore", over="ignore"):
        return np.sum(np.asarray(weights, np.float64), axis=1, keepdims=True)


def _fitting(got, want, allowed, both):
    """Each row's interval [lo, hi] of factors c with |got − c·want| ≤ allowed at every element."""
    a, b = (got - allowed) / want, (got + allowed) / want
    ok_free = np.abs(got) <= allowed  # (want 0: any c, or none)
    lo = np.where(want == 0, np.where(ok_free, -np.inf, np.inf), np.minimum(a, b))
    hi = np.where(want == 0, np.where(ok_free, np.inf, -np.inf), np.maximum(a, b))
    lo = np.where(both, lo, -np.inf)
    hi = np.where(both, hi, np.inf)
    return np.max(lo, axis=1, keepdims=True), np.min(hi, axis=1, keepdims=True)
