"""Precision diagnoses of the flash forward's scores: a half-precision kernel that rounds them, or an
operand of them, to its format where FlashAttention keeps float32.

* scores_rounded: the score tile kept in bf16/fp16 (an S buffer of the format, a cast of Q·Kᵀ
  before the exponent): Q·Kᵀ·scale rounded, or Q·Kᵀ rounded before the scale.
* row_sum_rounded: the row sum l of the weights taken after they are rounded to the format for P·V
  (the lse moves by their roundings; FlashAttention sums the float32 exponentials).
* prescaled_rounded: Q multiplied by the softmax scale (and log2 e, for exp2) and stored back in
  the format before Q·Kᵀ, as Triton's fused-attention tutorial did (q = (q * qk_scale).to(fp16)):
  every product of each score's dot product then carries a rounding of the format.

Each moves the flash output and lse by far more than float32 scores do; the candidate is the flash
stage recomputed from the rounded scores (or operand), named where got follows it far better than
the reference (FAR_BETTER). Both names keep the verdict: the stage failed; the name says why.
"""
from __future__ import annotations

from typing import List, Tuple

import numpy as np

from ..check.diagnosis import Diagnosis
from ..check.half_rounding import stored_in_format
from ..check.reference import reference_chain
from ..model.attention import log_sum_exp_rows
from ..model.half import NEAREST, round_to_format, storage_bound
from ..stages import KEYS, QUERIES, SCALED_SCORES, SCORES, STAGES, VALUES
from .backward_base import rebuilt_with
from .base import FAR_BETTER, LOG2_E, PRECISION_CONFIDENCE, gap

SCORES_ROUNDED, PRESCALED_ROUNDED, ROW_SUM_ROUNDED = "scores_rounded", "prescaled_rounded", "row_sum_rounded"
CODES = (SCORES_ROUNDED, PRESCALED_ROUNDED, ROW_SUM_ROUNDED)


def from_scores(stage: str) -> bool:
    """The flash forward's stages (its output and lse, not a split's), whose values follow the scores
    directly: a kernel that keeps its score tile in the half format (an S buffer of bf16, a cast
    before the exponent) moves them by far more than its GEMMs' roundings do."""
    st = STAGES[stage]
    return st.flash and not st.backward and not st.split


def diagnose(stage, got, want, ctx, fmt: str) -> List[Diagnosis]:
    """scores_rounded or prescaled_rounded: got matches the flash stage of the rounded scores (or
    of the rounded, scaled Q) far better than want."""
    head = ctx.head_ctx
    if not head.raw_inputs:
        return []
    inputs = {**head.variant_tensors(), **{n: round_to_format(x, fmt, NEAREST) for n, x in head.raw_inputs.items()}}
    # (past the output's own conversion, half a unit: a value near a rounding tie may go either way)
    own = storage_bound(want, fmt) if stored_in_format(stage) else 0.0
    base = gap(got, want, own)
    found = []
    for code, words, s in _routes(inputs, head, fmt):
        cand = _flash_of_scores(stage, s, inputs[VALUES], fmt, code == ROW_SUM_ROUNDED)
        if cand.size == got.size:
            left = gap(got, cand.reshape(got.shape), own)
            if left <= FAR_BETTER * base:
                found.append((left, code, words))
    if not found:
        return []
    left, code, words = min(found)
    beyond = f" beyond its own conversion to {fmt}" if stored_in_format(stage) else ""
    if code == SCORES_ROUNDED:
        what = (f"scores rounded to {fmt} before the softmax: it matches the softmax of {words} to {fmt} to "
                f"{left:.2g}{beyond}, against {base:.2g} for scores kept in float32. The program keeps its score "
                f"tile in {fmt} (a {fmt} buffer for S, or a cast of Q·Kᵀ before the exponent): each score then errs "
                f"by up to half a unit of {fmt}'s last place, which the exponent turns into the weights' relative "
                "error. Keep the scores in float32 until P, as FlashAttention does")
    elif code == ROW_SUM_ROUNDED:
        what = (f"a row sum of the weights rounded to {fmt}: it matches the log-sum-exp of the weights P·V reads, "
                f"each rounded to {fmt}, to {left:.2g}, against {base:.2g} for their float32 sum. The program sums "
                f"P after converting it to {fmt} (l += rowsum(p.to({fmt}))): each weight's rounding, up to half a "
                f"unit of {fmt}, moves l and the lse. Sum the float32 exponentials before the conversion, as "
                "FlashAttention does")
    else:
        what = (f"Q scaled and stored in {fmt} before Q·Kᵀ: it matches {words} to {left:.2g}{beyond}, against "
                f"{base:.2g} for Q as given (Triton's fused-attention tutorial: q = (q * qk_scale).to({fmt})). "
                f"Each product of a score's dot product then carries a rounding of {fmt}, which the exponent turns "
                "into the weights' relative error. Multiply the float32 scores by the scale instead "
                "(qk * qk_scale), as FlashAttention does")
    return [Diagnosis(code, f"{stage} follows {what}", {"precision": fmt, "max_diff": left, "float32_diff": base},
                      PRECISION_CONFIDENCE)]


def gradients(stage, got, want, ctx, fmt: str) -> List[Diagnosis]:
    """prescaled_rounded or scores_rounded on a flash gradient: got matches the gradient rebuilt
    from the program's own files with K (or Q) times the scale, or scale·log2 e, rounded to fmt (the
    Triton tutorial's backward: k·(sm_scale·log2 e) stored in the format, for P and dQ), or with the
    recomputed scores rounded to fmt (an S tile of the format), far better than want."""
    head = ctx.head_ctx
    if head is None or not STAGES[stage].flash or not STAGES[stage].backward:
        return []
    own = storage_bound(want, fmt) if stored_in_format(stage) else 0.0
    base = gap(got, want, own)
    found = []
    for code, words, cand in _gradient_routes(stage, ctx, fmt):
        if cand is not None and cand.shape == got.shape:
            left = gap(got, cand, own)
            if left <= FAR_BETTER * base:
                found.append((left, code, words))
    if not found:
        return []
    left, code, words = min(found)
    if code == SCORES_ROUNDED:
        what = (f"the scores it recomputes rounded to {fmt} ({words}) before P = exp(S − lse): it matches that "
                f"gradient to {left:.2g}, against {base:.2g} for scores kept in float32. Each recomputed weight "
                f"then carries a rounding of {fmt} that the forward's lse did not; keep the recomputed scores in "
                "float32 until P, as FlashAttention does")
    else:
        what = (f"{words} stored in {fmt} before the scores are recomputed: it matches that gradient to "
                f"{left:.2g}, against {base:.2g} for the operand as given (Triton's fused-attention tutorial's "
                f"backward stores k * (sm_scale * log2 e) in {fmt}). Each score, and so each recomputed weight, "
                f"then carries a rounding of {fmt}; multiply the float32 scores by the scale instead, as "
                "FlashAttention does")
    return [Diagnosis(code, f"{stage} follows {what}", {"precision": fmt, "max_diff": left, "float32_diff": base},
                      PRECISION_CONFIDENCE)]


def _gradient_routes(stage, ctx, fmt: str):
    """(code, words, the flash gradient rebuilt so) of each rounding a backward kernel may do: an
    operand times the scale (or scale·log2 e) stored in fmt, then its recomputed scores rounded."""
    head = ctx.head_ctx
    for name in (KEYS, QUERIES):
        for factor, words in _prescales(head.scale):
            x = np.asarray(head.own(name), np.float64)
            prescaled = round_to_format((x.astype(np.float32) * factor).astype(np.float64), fmt, NEAREST)
            cand = rebuilt_with(stage, ctx, {name: prescaled / float(factor)})
            yield PRESCALED_ROUNDED, words.replace("Q", name), cand
    qk = np.asarray(head.own(QUERIES), np.float64) @ np.asarray(head.own(KEYS), np.float64).T
    for words, rounded in (("Q·Kᵀ·scale rounded", round_to_format(qk * head.scale, fmt, NEAREST) / head.scale),
                           ("Q·Kᵀ rounded, then scaled", round_to_format(qk, fmt, NEAREST))):
        yield SCORES_ROUNDED, words, rebuilt_with(stage, ctx, {}, qk=rounded)


def _prescales(scale: float):
    """(the factor, in float32, a kernel multiplies Q or K by before rounding it; in words): the
    softmax scale, and the scale times log2 e of an exp2 kernel."""
    return ((np.float32(scale), "Q·scale"), (np.float32(scale) * np.float32(LOG2_E), "Q·scale·log2 e"))


def _routes(inputs, head, fmt: str) -> List[Tuple[str, str, np.ndarray]]:
    """(code, words, the scaled scores) of each rounding a kernel may do: the scores (after the
    scale, or Q·Kᵀ before it: where the variant only hides scores, as the scaled ones are), and Q
    times the scale, or times scale·log2 e (an exp2 kernel), each in float32, rounded to fmt."""
    variant = dict(variant=head.effective_variant, slope=head.slope)
    chain = reference_chain(inputs, head.scale, head.causal, [SCORES, SCALED_SCORES], **variant)
    s = chain[SCALED_SCORES]
    seen = np.isfinite(s)
    routes = [(SCORES_ROUNDED, "Q·Kᵀ·scale rounded", np.where(seen, round_to_format(s, fmt, NEAREST), s)),
              (SCORES_ROUNDED, "Q·Kᵀ rounded, then scaled,",
               np.where(seen, round_to_format(chain[SCORES], fmt, NEAREST) * head.scale, s))]
    q = np.asarray(inputs[QUERIES], np.float64)
    for factor, words in _prescales(head.scale):
        # Q·c in float32, rounded to fmt: the scores are that Q·Kᵀ, over c in the softmax's units.
        prescaled = round_to_format((q.astype(np.float32) * factor).astype(np.float64), fmt, NEAREST)
        other = {**inputs, QUERIES: prescaled / float(factor)}
        scaled = reference_chain(other, head.scale, head.causal, [SCORES, SCALED_SCORES], **variant)
        routes.append((PRESCALED_ROUNDED, f"the flash stage of {words} in {fmt}", scaled[SCALED_SCORES]))
    return routes + [(ROW_SUM_ROUNDED, "", s)]


def _flash_of_scores(stage: str, s: np.ndarray, v: np.ndarray, fmt: str, rounded_sum: bool = False) -> np.ndarray:
    """The flash stage from these scores: the lse, or the output as a flash kernel has it (P rounded
    to the format for P·V, the sum l of P unrounded, or rounded where rounded_sum)."""
    m = np.max(s, axis=1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    l = np.sum(round_to_format(e, fmt, NEAREST) if rounded_sum else e, axis=1, keepdims=True)
    if STAGES[stage].cols == "1":  # (the lse: one a row)
        return log_sum_exp_rows(s) if not rounded_sum else m + np.log(l)
    return (round_to_format(e, fmt, NEAREST) @ v) / l
