"""flash_output and flash_lse: the FlashAttention forward from Q, K, V (tiled, online softmax), and
the natural-log log-sum-exp of each scaled row.

Their bounds follow the online softmax (verify/model/flash.py): the logits' dot-product error,
the exponents, the running sums' rescales per key tile, the final division (and a split-KV
combine), and, per arithmetic, a folded scale·log2e factor and tensor-core truncation. Each is also
checked against the stage path where the binary wrote it: flash_output against its output,
flash_lse against the log-sum-exp of its QK_scaled; when they disagree and the stage-path stage has
failed already, the flash stage is not blamed.
"""
from __future__ import annotations

from typing import List

import numpy as np

from ..model.attention import causal_mask, log_sum_exp_rows
from ..model.dot import flush_sum
from ..model.flash import flash_lse_sums, flash_output_var_det
from ..model.rounding import FLUSH, ROUND_VAR, ULP_IN_U, finite_abs, memo
from ..model.softmax import need, scaled_logits, softmax_parts
from ..stages import FLASH_LSE, FLASH_OUTPUT, INPUT_NAMES, KEYS, OUTPUT, QUERIES, SCALED_SCORES, STAGES, VALUES
from .base import FLASH_VS_OUTPUT, LSE_VS_SCORES, HeadContext, Problem, StageSpec, Violation, consistency
from .copies import PATTERNS
from .output import attention_from_inputs, values_floor
from .scores import qk_quantization


def _scores(src, scale, masked):
    Q, K = np.asarray(src[QUERIES], np.float64), np.asarray(src[KEYS], np.float64)
    return np.where(masked, -np.inf, (Q @ K.T) * scale)


def _with_mask_output(src, scale, masked):
    return attention_from_inputs(src, scale, masked)


def _with_mask_lse(src, scale, masked):
    return log_sum_exp_rows(_scores(src, scale, masked))


def _mask(src, causal):
    n, m = np.asarray(src[QUERIES]).shape[0], np.asarray(src[KEYS]).shape[0]
    return causal_mask(n, m) if causal else np.zeros((n, m), bool)


def _qk_flush_max(src) -> float:
    qk = flush_sum(src[QUERIES], np.asarray(src[KEYS]).T)
    return float(np.max(qk)) if qk.size else 0.0


def _output_isolated(src, ref, problem: Problem):
    Q, K, V = need(src, FLASH_OUTPUT, QUERIES, KEYS, VALUES)
    return memo(problem.cache, "flash_output var", (Q, K, V), problem.key,
                lambda: flash_output_var_det(Q, K, V, *problem.model_args))


def lse_var_det(Q, K, lse, scale, causal, u, kernel, cache):
    """(variance, one-signed part) of the flash forward's lse error, lse its value: Δlse =
    Σ_j p_j η_j + Δl/l, then log (≤ kernel.log_ulps ulp of log l) and the roundings of values of
    lse's magnitude (m + log l; on the GPU the log2-domain conversions)."""
    m, eta_sum, l_var, det = memo(cache, "flash_lse sums", (Q, K), (scale, causal, u, kernel),
                                  lambda: flash_lse_sums(Q, K, scale, causal, u, kernel, cache))
    log_l = lse - m
    var = (eta_sum + l_var
           + ROUND_VAR * u * u * ((kernel.log_ulps * ULP_IN_U * log_l) ** 2
                                  + kernel.lse_roundings * (np.abs(m) + np.abs(lse)) ** 2 / 4)
           + kernel.log_abs ** 2 / 3)
    return var, det


def _lse_isolated(src, ref, problem: Problem):
    Q, K = need(src, FLASH_LSE, QUERIES, KEYS)
    return lse_var_det(Q, K, ref, *problem.model_args)


def _logit_moves(src, q, problem: Problem):
    """The logits' move when Q or K is known only to within its printed resolution, and p."""
    scale, causal = problem.scale, problem.causal
    dS = qk_quantization(src, q, problem)
    S = scaled_logits(np.asarray(src[QUERIES], np.float64), np.asarray(src[KEYS], np.float64), scale, causal)
    p = softmax_parts(S)[0]
    return p * (abs(scale) * np.broadcast_to(dS, S.shape)), p


def _output_quantization(src, q, problem: Problem):
    if not q:
        return 0.0
    w, p = _logit_moves(src, q, problem)
    O = p @ src[VALUES]
    moved = w @ np.abs(src[VALUES]) + np.abs(O) * w.sum(axis=1, keepdims=True)
    return moved + (p @ q[VALUES] if VALUES in q else 0.0)


def _lse_quantization(src, q, problem: Problem):
    return _logit_moves(src, q, problem)[0].sum(axis=1, keepdims=True) if q else 0.0


def _flash_sources(ctx: HeadContext):
    return {n: np.asarray(ctx.inputs[n], dtype=np.float64) for n in INPUT_NAMES}


def _partner_reference(ctx: HeadContext, names):
    """The reference chain of `names` from the head's inputs (the caller's when it has them)."""
    if all(n in ctx.chain for n in names):
        return {n: ctx.chain[n] for n in names}
    return ctx.bounds.reference_chain(_flash_sources(ctx), ctx.scale, ctx.causal, names)


def _output_vs_partner(stage: str, got: np.ndarray, ctx: HeadContext) -> List[Violation]:
    """|flash_output - output| ≤ bound(flash_output) + chained bound(output), both from Q, K, V."""
    partner = SPECS_BY_NAME[stage].partner
    if partner not in ctx.got:
        return []
    src = _flash_sources(ctx)
    chain = _partner_reference(ctx, list(INPUT_NAMES) + [partner])
    kw = ctx.bound_args()
    allowed = (ctx.bounds.stage_bound(stage, src, chain[partner], **kw)
               + ctx.bounds.chained_bound(partner, chain, **kw) + ctx.quantum(stage, partner))
    v = consistency(FLASH_VS_OUTPUT, stage, got, np.asarray(ctx.got[partner], np.float64), allowed,
                    f"the binary's {partner}")
    return [v] if v else []


def _lse_vs_partner(stage: str, got: np.ndarray, ctx: HeadContext) -> List[Violation]:
    """|flash_lse - logsumexp(QK_scaled)| ≤ bound(flash_lse) + Σ_j p_j·bound(QK_scaled)_j."""
    partner = SPECS_BY_NAME[stage].partner
    if partner not in ctx.got:
        return []
    scores = np.asarray(ctx.got[partner], np.float64)
    if not (np.isfinite(scores) | (scores == -np.inf)).all() or (scores == -np.inf).all(axis=1).any():
        return []  # the scores' own check reports it
    weights = next(s for s in STAGES if partner in STAGES[s].inputs)
    chain = _partner_reference(ctx, list(INPUT_NAMES) + [partner, weights, stage])
    kw = ctx.bound_args()
    s_bound = ctx.bounds.chained_bound(partner, chain, **kw) + ctx.quantum(partner)
    inherited = (chain[weights] * s_bound).sum(axis=1, keepdims=True) + ctx.quantum(stage)
    allowed = ctx.bounds.stage_bound(stage, _flash_sources(ctx), chain[stage], **kw) + inherited
    v = consistency(LSE_VS_SCORES, stage, got, log_sum_exp_rows(scores), allowed,
                    f"the log-sum-exp of the binary's {partner} rows")
    return [v] if v else []


SPECS = (
    StageSpec(FLASH_OUTPUT,
              reference=lambda src, problem: _with_mask_output(src, problem.scale, _mask(src, problem.causal)),
              isolated=_output_isolated,
              floor=lambda src: (values_floor(src[VALUES])
                                 + _qk_flush_max(src) * np.max(finite_abs(src[VALUES]), initial=0.0)),
              quantization=_output_quantization, invariants=(_output_vs_partner,), scaled=True,
              partner=OUTPUT, given_partner=(FLASH_VS_OUTPUT,), with_mask=_with_mask_output,
              from_inputs=_with_mask_output, diagnoses=PATTERNS + ("scaled", "mask", "keys", "overflow"),
              baseline=OUTPUT),
    StageSpec(FLASH_LSE, reference=lambda src, problem: _with_mask_lse(src, problem.scale, _mask(src, problem.causal)),
              isolated=_lse_isolated,
              floor=lambda src: FLUSH * 2 * np.asarray(src[KEYS]).shape[0] + _qk_flush_max(src),
              quantization=_lse_quantization, invariants=(_lse_vs_partner,), scaled=True, partner=SCALED_SCORES,
              given_partner=(LSE_VS_SCORES,),
              with_mask=_with_mask_lse, from_inputs=_with_mask_lse,
              diagnoses=PATTERNS + ("scaled", "mask", "lse_log2", "keys", "overflow")),
)
SPECS_BY_NAME = {s.name: s for s in SPECS}
