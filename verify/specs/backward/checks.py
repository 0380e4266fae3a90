"""The backward pass's reference-free checks: dS is exactly 0 where masked (the whole mask of the
head's variant) and each of its rows sums to 0 (Σ_j P_j·dP_j = D; under dropout with dP kept and
rescaled, whose Σ_j P_j·dP_j·Z_j/(1 − p) is D too; a row that sees no key is all 0); dK's columns
sum to 0 (softmax is shift-invariant along a row: not under a softcap, whose derivative weighs dS's
entries); each flash gradient agrees with the stage path's where the program wrote both.
"""
from __future__ import annotations

from typing import List

import numpy as np

from ...model.backward import transposed_gemm_var
from ...model.kernels import kernel_for
from ...model.rounding import FLUSH, LAMBDA, ROUND_VAR, unit_roundoff
from ...stages import GRAD_OUTPUT, KEYS, QUERIES, VALUES
from ..base import COLUMN_SUM, FLASH_VS_STAGES, MASK_MISSING, ROW_SUM, HeadContext, Violation, consistency, violation
from .bounds import stage_chain
from .flash_chain_pass import ColumnSumParts, flash_chain


def _chain_model(ctx: HeadContext):
    """(u, kernel, (Q, K, V, dO) from the chain, the head's variant) for the invariants' bounds;
    None without dO."""
    if not all(n in ctx.chain for n in (QUERIES, KEYS, VALUES, GRAD_OUTPUT)):
        return None
    inputs = tuple(np.asarray(ctx.chain[n], np.float64) for n in (QUERIES, KEYS, VALUES, GRAD_OUTPUT))
    kernel = kernel_for(ctx.backend, ctx.math, ctx.flash_kernel, ctx.precision)
    return unit_roundoff(ctx.precision), kernel, inputs, ctx.head()


def _row_sum_sd(indep, rows) -> np.ndarray:
    """Standard deviation of each dS row sum's error (N×1): its entries' independent errors, and
    D's (the shared part Σ_j −dS_j(η̄ + ε) vanishes with Σ_j dS_j; Σ_j P_j·δD = δD)."""
    return np.sqrt((indep * indep).sum(axis=1, keepdims=True)) + np.sqrt(rows.D)


def ds_checks(stage: str, got: np.ndarray, ctx: HeadContext) -> List[Violation]:
    masked = ctx.hidden(*got.shape)
    out = [violation(MASK_MISSING, stage, masked & (got != 0) & ~np.isnan(got), "are not 0 where the mask hides them")]
    finite = np.isfinite(got).all(axis=1)
    model = _chain_model(ctx)
    if finite.any() and model is not None:
        out.append(_ds_row_sums(stage, got, finite, ctx, model))
    return [v for v in out if v]


def _ds_row_sums(stage, got, finite, ctx, model):
    """Σ_j dS_j = Σ_j P_j·dP_j − D·Σ_j P_j = 0, within each row sum's error (_row_sum_sd)."""
    u, kernel, (Q, K, V, dO), head = model
    _, _, _, _, rows, indep, *_ = stage_chain(Q, K, V, dO, ctx.scale, head, u, kernel, ctx.cache)
    allowed = LAMBDA * _row_sum_sd(indep, rows)[:, 0] + 6 * FLUSH * got.shape[1]
    q = ctx.bounds.invariant_quantum(stage, got, ctx)
    if q is not None:
        allowed = allowed + np.broadcast_to(q, got.shape).sum(axis=1)
    dev = np.abs(np.where(np.isfinite(got), got, 0.0).sum(axis=1))
    bad = finite & ~(dev <= allowed)
    if not bad.any():
        return None
    r = int(np.argmax(np.where(bad, dev / np.maximum(allowed, 1e-300), -1.0)))
    return Violation(ROW_SUM, f"{stage}: {int(bad.sum())} of {got.shape[0]} rows do not sum to 0; worst row "
                     f"{r} sums to {got[r].sum():.9g} (allowed ±{allowed[r]:.2g})", int(bad.sum()), (r,))


def _stage_path_errors(model, ctx: HeadContext):
    """(the column sums' parts (flash_chain_pass.ColumnSumParts), dK's one-signed part) of the stage
    path's chain."""
    u, kernel, (Q, K, V, dO), head = model
    _, _, _, dS, rows, indep, *_ = stage_chain(Q, K, V, dO, ctx.scale, head, u, kernel, ctx.cache)
    row_sd = _row_sum_sd(indep, rows)
    return ColumnSumParts((row_sd * row_sd * Q * Q).sum(axis=0), dS.T @ Q,
                          transposed_gemm_var(dS, Q, u, ctx.cache, "dS Q var", 2 * ROUND_VAR)), 0.0


def _flash_errors(model, ctx: HeadContext):
    """The same of the flash backward's chain (summed over its row tiles)."""
    u, kernel, (Q, K, V, dO), head = model
    fc = flash_chain(Q, K, V, dO, ctx.scale, head, u, kernel, ctx.cache)
    return fc.column, fc.bounds[1][1].sum(axis=0)


def _column_sums(errors):
    """The check that dK's columns sum to 0, with the errors of the path that computes it."""
    def check(stage: str, got: np.ndarray, ctx: HeadContext) -> List[Violation]:
        model = _chain_model(ctx)
        if not np.isfinite(got).all() or model is None or model[3].cap > 0:
            return []  # under a softcap dK's columns need not sum to 0
        allowed = _column_sum_allowed(stage, got, ctx, model[0], *errors(model, ctx))
        dev = np.abs(got.sum(axis=0))
        bad = ~(dev <= allowed)
        if not bad.any():
            return []
        c = int(np.argmax(np.where(bad, dev / np.maximum(allowed, 1e-300), -1.0)))
        return [Violation(COLUMN_SUM, f"{stage}: {int(bad.sum())} of {got.shape[1]} columns do not sum to 0 over "
                          f"the keys; worst column {c} sums to {got[:, c].sum():.9g} (allowed ±{allowed[c]:.2g})",
                          int(bad.sum()), (c,))]
    return check


def _column_sum_allowed(stage: str, got, ctx: HeadContext, u, parts: ColumnSumParts, det) -> np.ndarray:
    """Σ_j dK_j = scale·Σ_i Q_i·Σ_j dS_ij = 0 (every dS row sums to 0). Its error: each dS row sum's
    (independent across rows: see _ds_row_sums), the GEMM's roundings and the final scaling's,
    and the one-signed parts summed."""
    dK = ctx.scale * parts.dsq
    var = (ctx.scale ** 2 * parts.row_sd_q2 + ctx.scale ** 2 * parts.gemm_var.sum(axis=0)
           + 2 * ROUND_VAR * u * u * (dK * dK).sum(axis=0))
    allowed = LAMBDA * np.sqrt(var) + det + FLUSH * got.shape[0]
    q = ctx.bounds.invariant_quantum(stage, got, ctx)
    if q is not None:
        allowed = allowed + np.broadcast_to(q, got.shape).sum(axis=0)
    return allowed


dk_column_sums = _column_sums(_stage_path_errors)
flash_dk_column_sums = _column_sums(_flash_errors)


def _partner_chain(ctx: HeadContext, names):
    tensors = ctx.variant_tensors()
    if all(n in ctx.chain for n in names):
        return {**tensors, **ctx.chain}
    inputs = {**ctx.inputs, **tensors}
    return {**tensors, **ctx.chain, **ctx.bounds.reference_chain(inputs, ctx.scale, ctx.causal, names,
                                                                 variant=ctx.effective_variant, slope=ctx.slope)}


def agrees_with(partner: str):
    """The check that a flash gradient agrees with the stage path's `partner`: |flash_dX − dX|
    within both stages' chained bounds, where the program wrote dX."""
    def check(stage: str, got: np.ndarray, ctx: HeadContext) -> List[Violation]:
        if partner not in ctx.got:
            return []
        chain = _partner_chain(ctx, [stage, partner])
        kw = ctx.bound_args()
        allowed = (ctx.bounds.chained_bound(stage, chain, **kw) + ctx.bounds.chained_bound(partner, chain, **kw)
                   + ctx.quantum(stage, partner))
        v = consistency(FLASH_VS_STAGES, stage, got, np.asarray(ctx.got[partner], np.float64), allowed,
                        f"the program's {partner}")
        return [v] if v else []
    return check
