"""Weights exponentiated against a float32 log-sum-exp, P = exp(S − lse), and the output P·V from
them: a correct route (a two-pass softmax; FlashAttention's backward recomputes its weights so)
beside the one the error model follows, P = e/l with l the row's own sum.

Such weights share one factor per row, e^(−Δlse), Δlse the error of the program's float32 lse,
which no division by the row sum removes: the roundings of values of lse's magnitude (m + log l)
and of the log, about u·(|m| + |lse|), large where the logits are. Each weight and output of the
row carries that factor, and its row sum is off by it. The check allows the factor as what it is,
one number per row within the lse's bound: where factor 1 leaves some element outside, the
comparison is against the reference times a factor that brings every element inside and lies
near the row's median got/want (fitted), so that a few wrong elements (no factor of their row)
still fail; the row-sum check widens by the bound. Where the program wrote its weights, the output's
factor is theirs, their row sum, where it brings the row inside (an output of logits in the
hundreds, whose elements' ratios scatter too widely for the median to find it).
"""
from __future__ import annotations

import warnings

import numpy as np

from ..model.kernels import kernel_for
from ..model.rounding import LAMBDA, ROUND_VAR, ULP_IN_U, unit_roundoff
from .base import HeadContext
from ..stages import OUTPUT, SCALED_SCORES, WEIGHTS

ROUTED = (WEIGHTS, OUTPUT)
_U32 = unit_roundoff("fp32")  # the lse is float32 at every precision (docs/contract.md)


def factor_bound(ctx: HeadContext) -> np.ndarray:
    """|Δlse| that a correct float32 lse of each row may err by (N×1; 0 for a row without keys,
    or where the head's scores are not at hand)."""
    S = ctx.chain.get(SCALED_SCORES)
    if S is None:
        return np.zeros((1, 1))
    S = np.asarray(S, dtype=np.float64)
    finite = np.isfinite(S)
    seen = finite.any(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        m = np.where(seen, np.max(np.where(finite, S, -np.inf), axis=1, keepdims=True), 0.0)
        log_l = np.where(seen, np.log(np.sum(np.where(finite, np.exp(S - m), 0.0), axis=1, keepdims=True)), 0.0)
    kernel = kernel_for(ctx.backend, ctx.math, ctx.flash_kernel, ctx.precision)
    magnitude = np.abs(m) + np.abs(m + log_l)
    # The roundings of lse's magnitude and of log l, and each exponent's S_j − lse rounding, whose
    # argument is log l further from 0 than the normalized route's S_j − m.
    var = ROUND_VAR * _U32 * _U32 * ((kernel.log_ulps * ULP_IN_U * log_l) ** 2 + log_l ** 2
                                     + kernel.lse_roundings * magnitude ** 2 / 4)
    return np.where(seen, LAMBDA * np.sqrt(var), 0.0)


def fitted(stage: str, got: np.ndarray, want: np.ndarray, allowed: np.ndarray, ctx: HeadContext,
           chained: bool = False) -> np.ndarray:
    """want, times a factor c in each row that c = 1 leaves outside some element's allowance and c
    brings inside every one; want itself elsewhere and for other stages. c is the row's own: the
    median m of got/want over its larger elements (a quarter of its largest |want| or more), moved
    at most its uncertainty (MEDIAN_SPREAD times its elements' deviation over √count) to the nearest
    factor that fits every element, within factor_bound. A few wrong elements move neither m nor
    the rest's fit: they fail as before. chained: want is from the inputs, so the output's factor
    may be the program's own weights' (an isolated want, from those weights, has it already)."""
    if stage not in ROUTED or got.shape != want.shape or got.ndim != 2:
        return want
    bound = factor_bound(ctx)
    if bound.shape[0] != want.shape[0]:
        return want
    allowed = np.broadcast_to(allowed, want.shape)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        both = np.isfinite(got) & np.isfinite(want)
        if np.all((np.abs(got - want) <= allowed) | ~both):  # (factor 1 explains every row: no fit, no cost)
            return want
        size = np.abs(np.where(both, want, 0.0))
        big = both & (size > 0) & (size >= np.max(size, axis=1, keepdims=True) / 4)
        if not big.any():
            return want
        count = np.maximum(big.sum(axis=1, keepdims=True), 1)
        with warnings.catch_warnings():  # (a row without a finite element: its median NaN, never used)
            warnings.simplefilter("ignore", RuntimeWarning)
            median = np.nanmedian(np.where(big, got / np.where(big, want, 1.0), np.nan), axis=1, keepdims=True)
            spread = np.nanmedian(np.where(big, allowed / (LAMBDA * size), np.nan), axis=1, keepdims=True)
        lo, hi = _fitting(got, want, allowed, both)
        lo, hi = np.maximum(lo, np.exp(-bound)), np.minimum(hi, np.exp(bound))
        own = _weights_factor(stage, ctx, want.shape[0]) if chained else None
        if own is not None:  # (the program's own factor, where it fits: no estimate needed)
            fits = (lo <= own) & (own <= hi) & ~((lo <= 1.0) & (1.0 <= hi))
            lo, hi = np.where(fits, own, lo), np.where(fits, own, hi)
        c = np.clip(median, lo + (hi - lo) / 4, hi - (hi - lo) / 4)
        near = np.abs(c - median) <= MEDIAN_SPREAD * spread / np.sqrt(count)
        if own is not None:
            near |= fits
        use = (lo <= hi) & ~((lo <= 1.0) & (1.0 <= hi)) & near
    use &= np.isfinite(c)
    return want * np.where(use, c, 1.0) if use.any() else want


# How far the fitted factor may lie from the row's median ratio, in units of its elements' relative
# deviation over √count (a median of k deviations of σ varies by about 1.25σ/√k): a row with one
# element wrong by 10σ needs its fit some 3σ from the median. Measured by scripts/catch_rate.py:
# at 4 the normal distribution's output lost 0.09 of its catch rate at M = 1024, at 2 none beyond
# the measurement's spread.
MEDIAN_SPREAD = 2.0


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
