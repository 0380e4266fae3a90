"""QK = Q·Kᵀ (unscaled) and QK_scaled: the scores the softmax reads, scale·QK modified by the
variant (softcap, ALiBi, bias), -inf where masked.

QK is a dot product of length d_k: its bound is the variance of the float32 sum's roundings over
every summation order GEMMs use (verify/model/dot.py). QK_scaled is one rounding of the product
plus the float32 scale's own (≤ 2u|scale·QK|) from the binary's QK, through the softcap's
derivative, plus the roundings of the softcap, ALiBi and the bias (verify/model/scores.py); a
program may also compute it by a GEMM of its own ((Q·scale)·Kᵀ, QK/√d): its chained bound from Q
and K admits that route. Masked entries are exact: −inf, or a finite stand-in far enough below the
row's visible scores that its exponential is 0 in float32 (masked_fill(-1e9)).
"""
from __future__ import annotations

import numpy as np

from ..model.attention import scaled_scores
from ..model.chain import chained_logits
from ..model.dot import flush_sum, qk_var
from ..model.rounding import FLUSH, ROUND_VAR, finish
from ..model.scores import modification_det
from ..model.softmax import need
from ..stages import KEYS, QUERIES, SCALED_SCORES, SCORES
from .base import MASK_MISSING, Problem, StageSpec, product_quantization, score_sources, violation
from .copies import PATTERNS
from .output import scores_from_inputs


def _qk_reference(src, problem: Problem):
    return src[QUERIES] @ src[KEYS].T


def _qk_isolated(src, ref, problem: Problem):
    Q, K = need(src, SCORES, QUERIES, KEYS)
    return qk_var(Q, K, problem.u, ROUND_VAR, problem.cache), np.zeros(ref.shape)


def _qk_floor(src):
    return flush_sum(src[QUERIES], np.asarray(src[KEYS]).T) + FLUSH


def qk_quantization(src, q, problem: Problem):
    """How far Q·Kᵀ moves when Q or K is known only to within its printed resolution."""
    return product_quantization(src, q, QUERIES, KEYS)


def _scaled_reference(src, problem: Problem):
    return scaled_scores(src[SCORES], problem.scale, problem.head)


def _scaled_isolated(src, ref, problem: Problem):
    # One rounding of the product plus the float32 scale's own rounding (when the given scale is
    # the float64 1/√d_k rather than the value the binary used): ≤ 2u|scale·QK|, through the cap's
    # derivative; then the modifications' own roundings.
    u, head = problem.u, problem.head
    finite = np.isfinite(ref)
    if not head.modifies:
        return np.zeros(ref.shape), np.where(finite, 2.0 * u * np.abs(ref), 0.0)
    S0 = np.asarray(src[SCORES], np.float64) * problem.scale
    slope = head.cap_slope(S0)
    det = 2.0 * u * np.abs(S0) * (1.0 if slope is None else slope)
    det += modification_det(S0, head, u, problem.kernel)
    return np.zeros(ref.shape), np.where(finite, det, 0.0)


def scaled_chained(sources, problem: Problem):
    """QK_scaled's chained bound, from Q and K (also the lse route's bound on the scores)."""
    Q, K = sources[:2]
    S, _, _, _, s_var, s_det = chained_logits(Q, K, *problem.model_args)
    return finish(S, s_var, s_det, abs(problem.scale) * _qk_floor({QUERIES: Q, KEYS: K}) + FLUSH)


def _scaled_quantization(src, q, problem: Problem):
    QK = src[SCORES]
    moved = abs(problem.scale) * np.where(np.isfinite(QK), q.get(SCORES, 0.0), 0.0)
    slope = problem.head.cap_slope(np.asarray(QK, np.float64) * problem.scale)
    return moved if slope is None else moved * slope


# A finite stand-in for −inf (masked_fill(-1e9), float16's −65504, float32's lowest) hides a key as
# −inf does where its exponential against the row's largest visible score is 0 in float32 (e^-104
# lies below the smallest subnormal): the weights are then exactly those of −inf. In a row that
# sees no key, any value up to STAND_IN_CEILING stands in (what the weights make of such a row,
# 0 or each key alike, is the weights' to answer).
STAND_IN_GAP = 104.0
STAND_IN_CEILING = -1e3


def stand_ins(got: np.ndarray, hidden: np.ndarray) -> np.ndarray:
    """Where got holds a finite stand-in for −inf at an entry `hidden` hides."""
    with np.errstate(invalid="ignore"):
        visible_max = np.max(np.where(hidden | np.isnan(got), -np.inf, got), axis=1, keepdims=True, initial=-np.inf)
        limit = np.where(hidden.all(axis=1, keepdims=True), STAND_IN_CEILING, visible_max - STAND_IN_GAP)
        return hidden & np.isfinite(got) & (got <= limit)


def _scores_canonical(got: np.ndarray, ref: np.ndarray, ctx) -> np.ndarray:
    """QK_scaled as the reference writes it: −inf where the program wrote a stand-in for it."""
    return np.where(stand_ins(got, ref == -np.inf), -np.inf, got)


def _mask_check(stage, got, ctx):
    hidden = ctx.hidden(*got.shape)
    v = violation(MASK_MISSING, stage, hidden & (got != -np.inf) & ~np.isnan(got) & ~stand_ins(got, hidden),
                  "are not -inf where the mask hides them")
    return [v] if v else []


SPECS = (
    StageSpec(SCORES, reference=_qk_reference, isolated=_qk_isolated, floor=_qk_floor,
              quantization=qk_quantization, linear=True, diagnoses=PATTERNS + ("scaled",)),
    StageSpec(SCALED_SCORES, reference=_scaled_reference, isolated=_scaled_isolated, chained=scaled_chained,
              quantization=_scaled_quantization, invariants=(_mask_check,), masked_value=-np.inf,
              canonical=_scores_canonical, from_inputs=scores_from_inputs,
              scaled=True, linear=True, diagnoses=PATTERNS + ("scaled", "mask"), variant_sources=score_sources),
)
