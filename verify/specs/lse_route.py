"""Weights exponentiated against a float32 log-sum-exp, P = exp(S − lse), and the output P·V from
them: a correct route (a two-pass softmax; FlashAttention's backward recomputes its weights so)
beside the one the error model follows, P = e/l with l the row's own sum.

Such weights share one factor per row, e^(−Δlse), Δlse the error of the program's float32 lse,
which no division by the row sum removes: the roundings of values of lse's magnitude (m + log l)
and of the log, about u·(|m| + |lse|), large where the logits are. Each weight and output of the
row carries that factor, and its row sum is off by it. The check allows the factor as what it is,
one number per row within the lse's bound: the comparison is against the reference times the
factor that fits the row best, clipped to that bound, so that a wrong element (not a factor of its
row) still fails; the row-sum check widens by the bound.
"""
from __future__ import annotations

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
    kernel = kernel_for(ctx.backend, ctx.math, ctx.flash_kernel)
    magnitude = np.abs(m) + np.abs(m + log_l)
    # The roundings of lse's magnitude and of log l, and each exponent's S_j − lse rounding, whose
    # argument is log l further from 0 than the normalized route's S_j − m.
    var = ROUND_VAR * _U32 * _U32 * ((kernel.log_ulps * ULP_IN_U * log_l) ** 2 + log_l ** 2
                                     + kernel.lse_roundings * magnitude ** 2 / 4)
    return np.where(seen, LAMBDA * np.sqrt(var), 0.0)


def fitted(stage: str, got: np.ndarray, want: np.ndarray, allowed: np.ndarray, ctx: HeadContext) -> np.ndarray:
    """want, times a factor c in each row where one within factor_bound brings every element of the
    row within its allowance and c = 1 does not (near the one nearest 1); want itself for other stages.
    A row that c = 1 explains, or that no such c explains, is compared as it is."""
    if stage not in ROUTED or got.shape != want.shape or got.ndim != 2:
        return want
    bound = factor_bound(ctx)
    if bound.shape[0] != want.shape[0]:
        return want
    allowed = np.broadcast_to(allowed, want.shape)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        # Each element's interval of factors c with |got − c·want| ≤ allowed (want 0: any c or none).
        a, b = (got - allowed) / want, (got + allowed) / want
        lo, hi = np.minimum(a, b), np.maximum(a, b)
        free = want == 0
        lo = np.where(free, np.where(np.abs(got) <= allowed, -np.inf, np.inf), lo)
        hi = np.where(free, np.where(np.abs(got) <= allowed, np.inf, -np.inf), hi)
        lo = np.maximum(np.max(np.where(np.isnan(lo), np.inf, lo), axis=1, keepdims=True), np.exp(-bound))
        hi = np.minimum(np.min(np.where(np.isnan(hi), -np.inf, hi), axis=1, keepdims=True), np.exp(bound))
        # Nearest 1 but a quarter of the interval inside it: at its very end the binding element
        # would sit on its allowance, where a rounding of c·want may put it past.
        inner = np.clip(1.0, lo + (hi - lo) / 4, hi - (hi - lo) / 4)
    c = np.where((lo <= 1.0) & (1.0 <= hi), 1.0, np.where(lo <= hi, inner, 1.0))
    return want if np.all(c == 1.0) else want * c
