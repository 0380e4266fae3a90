"""The backward pass: D, dP, dS, dQ, dK, dV on the stage path, and the FlashAttention backward's
flash_dQ, flash_dK, flash_dV (P recomputed from the logits and the saved flash_lse).

Isolated bounds start from the program's own upstream files (its P, dP, D, dS; for the flash
gradients its flash_output and flash_lse): their own roundings only. Chained bounds start from Q,
K, V and dO, with every upstream error propagated (verify/model/backward.py). Reference-free: dS is
exactly 0 where masked and each of its rows sums to 0 (Σ_j P_j·dP_j = D); dK's columns sum to 0
(softmax is shift-invariant along a row); the flash gradients agree with the stage path's.
"""
from __future__ import annotations

from typing import List

import numpy as np

from ..model.attention import causal_mask, log_sum_exp_rows
from ..model.backward import (d_var, ds_round_var, ds_var_parts, flash_rows, grad_over_keys_var, grad_over_queries_var,
                              stage_rows, transposed_gemm_var, weight_round_var)
from ..model.chain import chained_eta, chained_logits
from ..model.dot import dot_var, flush_sum, mma_truncation_det, pv_var, qk_var, rowdot_var
from ..model.flash import flash_output_var_det, flash_parts
from ..model.kernels import FLASH_LOGIT_ROUNDINGS, kernel_for
from ..model.rounding import FLUSH, LAMBDA, ROUND_VAR, finish, finite_abs, memo, unit_roundoff
from ..model.softmax import exponent_var, need, rowsum_rel_var, weights_var
from ..stages import STAGES
from .base import (COLUMN_SUM, FLASH_VS_STAGES, MASK_MISSING, ROW_SUM, HeadContext, StageSpec, Violation,
                   consistency, violation)
from .copies import PATTERNS

GRAD_OUT, OUT = STAGES["D"].inputs                      # dO, output
_, VALUES = STAGES["dP"].inputs                          # V
WEIGHTS, DP, DSTAT = STAGES["dS"].inputs                 # attention_weights, dP, D
DS, KEYS = STAGES["dQ"].inputs                           # dS, K
_, QUERIES = STAGES["dK"].inputs                         # Q
FLASH_GRADS = tuple(s for s in STAGES if STAGES[s].flash and STAGES[s].backward)
FLASH_DQ, FLASH_DK, FLASH_DV = FLASH_GRADS
FLASH_SOURCES = STAGES[FLASH_DQ].inputs                 # Q, K, V, dO, flash_output, flash_lse
FLASH_OUT, FLASH_LSE = FLASH_SOURCES[-2:]


def _stage_path_gradient(flash: str) -> str:
    """The stage-path stage computing the same gradient as a flash one (the one of its shape)."""
    return next(s for s, st in STAGES.items() if st.backward and not st.flash and st.inputs
                and (st.rows, st.cols) == (STAGES[flash].rows, STAGES[flash].cols))


PARTNERS = {f: _stage_path_gradient(f) for f in FLASH_GRADS}   # flash_dQ -> dQ, ...
GRAD_INDEX = {**{f: i for i, f in enumerate(FLASH_GRADS)}, **{PARTNERS[f]: i for i, f in enumerate(FLASH_GRADS)}}

# The bug hypotheses (verify/diagnose_backward.py) of the stages they can explain.
D_BUGS = ("D_wrong_O",)
DS_BUGS = D_BUGS + ("dS_missing_P",)
SCALE_BUGS = ("grad_unscaled",)


def _mask_of(n: int, m: int, causal: bool) -> np.ndarray:
    return causal_mask(n, m) if causal else np.zeros((n, m), bool)


# ---- references ------------------------------------------------------------------------------

def d_reference(dO, O):
    return (dO * O).sum(axis=1, keepdims=True)


def ds_reference(P, dP, D):
    return P * (dP - D)


def flash_backward(src, scale: float, masked: np.ndarray, D=None, lse=None):
    """(dQ, dK, dV, P, dP, D, dS) of the FlashAttention backward from its sources, under `masked`
    (D and lse may be replaced: the diagnoses build buggy variants)."""
    Q, K, V, dO = (np.asarray(src[n], np.float64) for n in FLASH_SOURCES[:4])
    lse = np.asarray(src[FLASH_LSE], np.float64) if lse is None else lse
    S = np.where(masked, -np.inf, (Q @ K.T) * scale)
    P = np.exp(S - lse)
    P[masked] = 0.0
    D = d_reference(dO, np.asarray(src[FLASH_OUT], np.float64)) if D is None else D
    dP = dO @ V.T
    dS = ds_reference(P, dP, D)
    return scale * dS @ K, scale * dS.T @ Q, P.T @ dO, P, dP, D, dS


def _flash_reference(index: int):
    def reference(src, scale, causal):
        Q, K = np.asarray(src[QUERIES]), np.asarray(src[KEYS])
        return flash_backward(src, scale, _mask_of(Q.shape[0], K.shape[0], causal))[index]
    return reference


def _flash_with_mask(index: int):
    return lambda src, scale, masked: flash_backward(src, scale, masked)[index]


# ---- isolated bounds (from the program's own upstream files) -----------------------------------

def _d_isolated(src, ref, scale, causal, u, kernel, cache):
    dO, O = need(src, "D", GRAD_OUT, OUT)
    return rowdot_var(dO, O, u), np.zeros(ref.shape)


def _dp_isolated(src, ref, scale, causal, u, kernel, cache):
    dO, V = need(src, "dP", GRAD_OUT, VALUES)
    return memo(cache, "dP var", (dO, V), (u,), lambda: dot_var(dO, V.T, u)), np.zeros(ref.shape)


def _ds_isolated(src, ref, scale, causal, u, kernel, cache):
    P, dP, D = need(src, "dS", WEIGHTS, DP, DSTAT)
    return ds_round_var(P, dP, D, u), np.zeros(ref.shape)


def _dq_isolated(src, ref, scale, causal, u, kernel, cache):
    dS, K = need(src, "dQ", DS, KEYS)
    return scale * scale * dot_var(dS, K, u, 2 * ROUND_VAR), 2.0 * u * np.abs(ref)


def _dk_isolated(src, ref, scale, causal, u, kernel, cache):
    dS, Q = need(src, "dK", DS, QUERIES)
    return scale * scale * dot_var(dS.T, Q, u, 2 * ROUND_VAR), 2.0 * u * np.abs(ref)


def _dv_isolated(src, ref, scale, causal, u, kernel, cache):
    P, dO = need(src, "dV", WEIGHTS, GRAD_OUT)
    return dot_var(P.T, dO, u), np.zeros(ref.shape)


def _dp_var(dO, V, u, product_var, cache):
    return memo(cache, "dP var", (dO, V), (u, product_var), lambda: dot_var(dO, V.T, u, product_var))


def _scale_det(S, P, finite, u, kernel):
    """The head's one rounded scale factor (a relative δ ≤ u): each recomputed weight moves by
    δ·(S_j − S̄), S̄ = Σ_j P_j S_j carried by the lse (one-signed, relative); 0 without one."""
    if not kernel.common_scale:
        return np.zeros(finite.shape)
    Sf = np.where(finite, S, 0.0)
    return np.where(finite, u * np.abs(Sf - (P * Sf).sum(axis=1, keepdims=True)), 0.0)


def _logit_det(Q, K, S, P, scale, finite, u, kernel):
    """One-signed relative errors of the recomputed weights: tensor-core truncation of the logits
    and the common scale factor."""
    det = _scale_det(S, P, finite, u, kernel)
    if kernel.mma_passes:
        det = det + np.where(finite, abs(scale) * mma_truncation_det(Q, K.T, u, kernel.mma_passes), 0.0)
    return det


def _recomputed_eta(Q, K, S, lse, finite, scale, u, kernel, cache):
    """Variance of each recomputed weight's relative error: its logit's dot product and roundings,
    the subtraction of lse, exp."""
    eta = np.where(finite, scale * scale * qk_var(Q, K, u, kernel.flash_product_var, cache), 0.0)
    return eta + exponent_var(np.where(finite, S - lse, 0.0), finite, u, kernel, S, FLASH_LOGIT_ROUNDINGS)


def _flushed_entries(P, dS):
    """(|dS|, P) where a weight or a dS entry lies below float32's normal range, else 0; (None,
    None) when none does. GPUs flush such values to zero (an ftz exp2, FTZ arithmetic), so each may
    be lost whole; the gradients summed from them are then tiny, but no smaller than those terms."""
    edge = 2 * FLUSH  # margin for the weight's own rounding error near the edge
    tiny_p = (P < edge) & (P > 0)
    lost = (tiny_p | (np.abs(dS) < edge)) & (dS != 0)
    if not (lost.any() or tiny_p.any()):
        return None, None
    # Twice the lost terms: a gradient made of one lost term equals its bound exactly, and the
    # reference's own rounding must not decide such a case.
    return np.where(lost, 2 * np.abs(dS), 0.0), np.where(tiny_p, 2 * P, 0.0)


def _flash_grad_bounds(parts, rows, dP_var, s_det, scale, u, kernel, cache):
    """((variance, one-signed part) of flash_dQ, of flash_dK, of flash_dV) from the row errors."""
    Q, K, dO, P, dP, D, dS = parts
    indep, shared = ds_var_parts(P, dP, D, dS, rows, dP_var, u)
    ds_det = np.abs(dS) * s_det
    pv = kernel.flash_product_var + ROUND_VAR  # the kernel's products, and the scale folded in
    dq_var = grad_over_keys_var(P, dS, K, rows, indep, scale, u, cache, pv)
    dk_var = scale * scale * grad_over_queries_var(dS, indep + shared, Q, u, cache, "dS Q var", pv)
    p_sd = P * (np.sqrt(rows.eta) + np.sqrt(rows.shared))
    dv_var = grad_over_queries_var(P, p_sd, dO, u, cache, "P dO var", pv)
    dq_det = abs(scale) * (ds_det @ np.abs(K))
    dk_det = abs(scale) * (ds_det.T @ np.abs(Q))
    dv_det = (P * s_det).T @ np.abs(dO)
    lost_ds, lost_p = _flushed_entries(P, dS)
    if lost_ds is not None:
        dq_det = dq_det + abs(scale) * (lost_ds @ np.abs(K))
        dk_det = dk_det + abs(scale) * (lost_ds.T @ np.abs(Q))
        dv_det = dv_det + lost_p.T @ np.abs(dO)
    if kernel.mma_passes:
        dq_det = dq_det + abs(scale) * mma_truncation_det(dS, K, u, kernel.mma_passes)
        dk_det = dk_det + abs(scale) * mma_truncation_det(dS.T, Q, u, kernel.mma_passes)
        dv_det = dv_det + mma_truncation_det(P.T, dO, u, kernel.mma_passes)
    return (dq_var, dq_det), (dk_var, dk_det), (dv_var, dv_det)


def _flash_own(src, scale, causal, u, kernel, cache):
    """The flash backward's errors from its own saved flash_output and flash_lse: the recomputed
    logits (their dot product, their roundings, exp), the lse's one rounding where a kernel folds
    log2(e) into it (shared along the row), D's and dP's roundings, the gradient GEMMs."""
    Q, K, V, dO, O, lse = need(src, FLASH_DQ, *FLASH_SOURCES)

    def compute():
        masked = _mask_of(Q.shape[0], K.shape[0], causal)
        _, _, _, P, dP, D, dS = flash_backward(src, scale, masked)
        finite = ~masked & np.isfinite(lse)
        S = np.where(finite, (Q @ K.T) * scale, 0.0)
        eta = _recomputed_eta(Q, K, S, lse, finite, scale, u, kernel, cache)
        lse_fold = ROUND_VAR * u * u * np.where(np.isfinite(lse), lse, 0.0) ** 2
        rows = flash_rows(eta, lse_fold, rowdot_var(dO, O, u))
        return _flash_grad_bounds((Q, K, dO, P, dP, D, dS), rows, _dp_var(dO, V, u, kernel.flash_product_var, cache),
                                  _logit_det(Q, K, S, P, scale, finite, u, kernel), scale, u, kernel, cache)
    return memo(cache, "flash grads own", (Q, K, V, dO, O, lse), (scale, causal, u, kernel), compute)


def _flash_isolated(index: int):
    def isolated(src, ref, scale, causal, u, kernel, cache):
        var, det = _flash_own(src, scale, causal, u, kernel, cache)[index]
        return var, det + 2.0 * u * np.abs(ref) * (index < 2)  # dQ, dK: the scale's own rounding
    return isolated


# ---- chained bounds (from Q, K, V, dO) ----------------------------------------------------------

def _stage_chain(Q, K, V, dO, scale, causal, u, kernel, cache):
    """The stage path's references and row errors from the original inputs (see the model)."""
    def compute():
        S, p, _, _, _, _ = chained_logits(Q, K, scale, causal, u, cache)
        eta = chained_eta(Q, K, scale, causal, u, kernel, cache)
        l_var = rowsum_rel_var(p, u, cache=cache)
        O = p @ V
        dP = dO @ V.T
        D = d_reference(dO, O)
        dS = ds_reference(p, dP, D)
        Dv = d_var(p, eta, l_var, weight_round_var(p, u, kernel), dO, dP, D, pv_var(p, V, u, ROUND_VAR, cache),
                   rowdot_var(dO, O, u))
        rows = stage_rows(p, eta, l_var, Dv, u, kernel)
        indep, shared = ds_var_parts(p, dP, D, dS, rows, _dp_var(dO, V, u, ROUND_VAR, cache), u)
        return p, dP, D, dS, rows, indep, shared, eta, l_var
    return memo(cache, "backward chain", (Q, K, V, dO), (scale, causal, u, kernel), compute)


def _floor_d(dO, O):
    return flush_sum(np.abs(dO) * np.abs(O), np.ones((dO.shape[1], 1))) + FLUSH


def _d_chained(sources, scale, causal, u, kernel, cache):
    Q, K, V, dO = sources
    p, dP, D, dS, rows, *_ = _stage_chain(Q, K, V, dO, scale, causal, u, kernel, cache)
    return finish(D, rows.D, np.zeros(D.shape), _floor_d(dO, p @ V))


def _ds_chained(sources, scale, causal, u, kernel, cache):
    Q, K, V, dO = sources
    p, dP, D, dS, rows, indep, shared, *_ = _stage_chain(Q, K, V, dO, scale, causal, u, kernel, cache)
    return finish(dS, (indep + shared) ** 2, np.zeros(dS.shape), 6 * FLUSH)


def _dq_chained(sources, scale, causal, u, kernel, cache):
    Q, K, V, dO = sources
    p, dP, D, dS, rows, indep, shared, *_ = _stage_chain(Q, K, V, dO, scale, causal, u, kernel, cache)
    dQ = scale * dS @ K
    var = grad_over_keys_var(p, dS, K, rows, indep, scale, u, cache)
    return finish(dQ, var, 2.0 * u * np.abs(dQ), abs(scale) * flush_sum(dS, K) + FLUSH)


def _dk_chained(sources, scale, causal, u, kernel, cache):
    Q, K, V, dO = sources
    p, dP, D, dS, rows, indep, shared, *_ = _stage_chain(Q, K, V, dO, scale, causal, u, kernel, cache)
    dK = scale * dS.T @ Q
    var = scale * scale * grad_over_queries_var(dS, indep + shared, Q, u, cache, "dS Q var")
    return finish(dK, var, 2.0 * u * np.abs(dK), abs(scale) * flush_sum(dS.T, Q) + FLUSH)


def _dv_chained(sources, scale, causal, u, kernel, cache):
    Q, K, dO = sources  # dV = Pᵀ·dO needs no V
    p = chained_logits(Q, K, scale, causal, u, cache)[1]
    eta = chained_eta(Q, K, scale, causal, u, kernel, cache)
    l_var = rowsum_rel_var(p, u, cache=cache)
    p_sd = np.sqrt(weights_var(p, eta, l_var, u, cache, kernel.div_var))
    dV = p.T @ dO
    return finish(dV, grad_over_queries_var(p, p_sd, dO, u, cache, "P dO var"), np.zeros(dV.shape),
                  flush_sum(p.T, dO) + FLUSH)


def _flash_chain(Q, K, V, dO, scale, causal, u, kernel, cache):
    """The flash backward's errors from the original inputs: its forward's lse and output errors
    (verify/model/flash.py) reach P (shared along the row) and D."""
    def compute():
        from .flash import lse_var_det
        S, p, m, eta_fwd, l_var, s_det = flash_parts(Q, K, scale, causal, u, kernel, cache)
        finite = np.isfinite(S)
        lse = log_sum_exp_rows(S)
        lse_var, lse_det = lse_var_det(Q, K, lse, scale, causal, u, kernel, cache)
        # The same weights, dP, D and dS as the stage path's chain (shared arrays share their bounds).
        _, dP, D, dS = _stage_chain(Q, K, V, dO, scale, causal, u, kernel, cache)[:4]
        O = p @ V
        _, O_det = flash_output_var_det(Q, K, V, scale, causal, u, kernel, cache)
        acc = kernel.rescale_factor * pv_var(p, V, u, kernel.flash_product_var, cache) \
            + (kernel.final_roundings * ROUND_VAR + kernel.div_var) * (u * O) ** 2
        Dv = d_var(p, eta_fwd, l_var, np.zeros(p.shape), dO, dP, D, acc, rowdot_var(dO, O, u))
        D_sd = np.sqrt(Dv) + (np.abs(dO) * O_det).sum(axis=1, keepdims=True)
        eta = _recomputed_eta(Q, K, S, lse, finite, scale, u, kernel, cache)
        shared_sd = np.sqrt(lse_var + ROUND_VAR * u * u * lse * lse) + lse_det
        rows = flash_rows(eta, shared_sd * shared_sd, D_sd * D_sd)
        s_det = s_det + _scale_det(S, p, finite, u, kernel)  # flash_parts' s_det: the truncation
        dP_var = _dp_var(dO, V, u, kernel.flash_product_var, cache)
        bounds = _flash_grad_bounds((Q, K, dO, p, dP, D, dS), rows, dP_var, s_det, scale, u, kernel, cache)
        indep = ds_var_parts(p, dP, D, dS, rows, dP_var, u)[0]
        return (scale * dS @ K, scale * dS.T @ Q, p.T @ dO), bounds, dS, p, indep, rows
    return memo(cache, "flash backward chain", (Q, K, V, dO), (scale, causal, u, kernel), compute)


def _flash_chained(index: int):
    def chained(sources, scale, causal, u, kernel, cache):
        Q, K, V, dO = sources
        refs, bounds, dS, p, _, _ = _flash_chain(Q, K, V, dO, scale, causal, u, kernel, cache)
        ref, (var, det) = refs[index], bounds[index]
        det = det + 2.0 * u * np.abs(ref) * (index < 2)
        floor = [abs(scale) * flush_sum(dS, K), abs(scale) * flush_sum(dS.T, Q), flush_sum(p.T, dO)][index]
        return finish(ref, var, det, floor + FLUSH)
    return chained


def _flash_floor(src):
    """Flushed products: none unless the data's products come near float32's normal range."""
    Q, K, V, dO = (finite_abs(src[n]) for n in FLASH_SOURCES[:4])
    tiny = float(np.max(flush_sum(dO, V.T), initial=0.0))
    if not tiny:
        return 2 * FLUSH
    return 2 * FLUSH + tiny * max(1.0, Q.max(initial=0.0), K.max(initial=0.0), dO.max(initial=0.0)) \
        * (Q.shape[0] + K.shape[0])


# ---- printed resolution ------------------------------------------------------------------------

def _q(q, name):
    return q.get(name, 0.0)


def _d_quantization(src, q, scale, causal):
    return (_q(q, GRAD_OUT) * np.abs(src[OUT]) + np.abs(src[GRAD_OUT]) * _q(q, OUT)).sum(axis=1, keepdims=True)


def _dp_quantization(src, q, scale, causal):
    out = 0.0
    if GRAD_OUT in q:
        out = out + q[GRAD_OUT] @ np.abs(src[VALUES]).T
    if VALUES in q:
        out = out + np.abs(src[GRAD_OUT]) @ q[VALUES].T
    return out


def _ds_quantization(src, q, scale, causal):
    P, dP, D = src[WEIGHTS], src[DP], src[DSTAT]
    return _q(q, WEIGHTS) * np.abs(dP - D) + np.abs(P) * (_q(q, DP) + _q(q, DSTAT))


def _gemm_quantization(a, b, transpose_a, factor):
    def quantization(src, q, scale, causal):
        A, B = np.abs(src[a]), np.abs(src[b])
        qa, qb = q.get(a), q.get(b)
        if transpose_a:
            A, qa = A.T, (qa.T if qa is not None else None)
        out = 0.0
        if qa is not None:
            out = out + qa @ B
        if qb is not None:
            out = out + A @ qb
        return abs(scale) * out if factor else out
    return quantization


def _flash_quantization(index: int):
    def quantization(src, q, scale, causal):
        if not (FLASH_OUT in q or FLASH_LSE in q):
            return 0.0
        Q, K = np.asarray(src[QUERIES]), np.asarray(src[KEYS])
        _, _, _, P, dP, D, dS = flash_backward(src, scale, _mask_of(Q.shape[0], K.shape[0], causal))
        q_lse = _q(q, FLASH_LSE)
        q_D = (np.abs(src[GRAD_OUT]) * _q(q, FLASH_OUT)).sum(axis=1, keepdims=True)
        ds_q = np.abs(dS) * q_lse + P * q_D
        return [abs(scale) * ds_q @ np.abs(K), abs(scale) * ds_q.T @ np.abs(Q),
                (P * q_lse).T @ np.abs(src[GRAD_OUT])][index]
    return quantization


# ---- invariants ---------------------------------------------------------------------------------

def _chain_model(ctx: HeadContext):
    """(u, kernel, (Q, K, V, dO) from the chain) for the invariants' bounds; None without dO."""
    if not all(n in ctx.chain for n in (QUERIES, KEYS, VALUES, GRAD_OUT)):
        return None
    inputs = tuple(np.asarray(ctx.chain[n], np.float64) for n in (QUERIES, KEYS, VALUES, GRAD_OUT))
    return unit_roundoff(ctx.precision), kernel_for(ctx.backend, ctx.math, ctx.flash_kernel), inputs


def _row_sum_sd(indep, rows) -> np.ndarray:
    """Standard deviation of each dS row sum's error (N×1): its entries' independent errors, and
    D's (the shared part Σ_j −dS_j(η̄ + ε) vanishes with Σ_j dS_j; Σ_j P_j·δD = δD)."""
    return np.sqrt((indep * indep).sum(axis=1, keepdims=True)) + np.sqrt(rows.D)


def _ds_checks(stage: str, got: np.ndarray, ctx: HeadContext) -> List[Violation]:
    masked = _mask_of(*got.shape, ctx.causal)
    out = [violation(MASK_MISSING, stage, masked & (got != 0) & ~np.isnan(got),
                     "above the diagonal are not 0 although causal masking is on")]
    finite = np.isfinite(got).all(axis=1)
    model = _chain_model(ctx)
    if finite.any() and model is not None:
        out.append(_ds_row_sums(stage, got, finite, ctx, model))
    return [v for v in out if v]


def _ds_row_sums(stage, got, finite, ctx, model):
    """Σ_j dS_j = Σ_j P_j·dP_j − D·Σ_j P_j = 0, within each row sum's error (_row_sum_sd)."""
    u, kernel, (Q, K, V, dO) = model
    _, _, _, _, rows, indep, *_ = _stage_chain(Q, K, V, dO, ctx.scale, ctx.causal, u, kernel, ctx.cache)
    allowed = LAMBDA * _row_sum_sd(indep, rows)[:, 0] + 6 * FLUSH * got.shape[1]
    q = ctx.quanta.get(stage)
    if q is not None:
        allowed = allowed + np.broadcast_to(q, got.shape).sum(axis=1)
    dev = np.abs(np.where(np.isfinite(got), got, 0.0).sum(axis=1))
    bad = finite & ~(dev <= allowed)
    if not bad.any():
        return None
    r = int(np.argmax(np.where(bad, dev / np.maximum(allowed, 1e-300), -1.0)))
    return Violation(ROW_SUM, f"{stage}: {int(bad.sum())} of {got.shape[0]} rows do not sum to 0; worst row "
                     f"{r} sums to {got[r].sum():.9g} (allowed ±{allowed[r]:.2g})", int(bad.sum()), (r,))


def _dk_column_sums(stage: str, got: np.ndarray, ctx: HeadContext) -> List[Violation]:
    """Σ_j dK_j = scale·Σ_i Q_i·Σ_j dS_ij = 0 (every dS row sums to 0). Its error: each dS row sum's
    (independent across rows: see _ds_row_sums), the GEMM's roundings and the final scaling's,
    and the one-signed parts summed."""
    model = _chain_model(ctx)
    if not np.isfinite(got).all() or model is None:
        return []
    u, kernel, (Q, K, V, dO) = model
    det = 0.0
    if STAGES[stage].flash:
        _, bounds, dS, _, indep, rows = _flash_chain(Q, K, V, dO, ctx.scale, ctx.causal, u, kernel, ctx.cache)
        det, pv = bounds[1][1].sum(axis=0), kernel.flash_product_var + ROUND_VAR
    else:
        _, _, _, dS, rows, indep, *_ = _stage_chain(Q, K, V, dO, ctx.scale, ctx.causal, u, kernel, ctx.cache)
        pv = 2 * ROUND_VAR
    row_sd = _row_sum_sd(indep, rows)
    dK = ctx.scale * dS.T @ Q
    var = (ctx.scale ** 2 * (row_sd * row_sd * Q * Q).sum(axis=0)
           + ctx.scale ** 2 * transposed_gemm_var(dS, Q, u, ctx.cache, "dS Q var", pv).sum(axis=0)
           + 2 * ROUND_VAR * u * u * (dK * dK).sum(axis=0))
    allowed = LAMBDA * np.sqrt(var) + det + FLUSH * got.shape[0]
    q = ctx.quanta.get(stage)
    if q is not None:
        allowed = allowed + np.broadcast_to(q, got.shape).sum(axis=0)
    dev = np.abs(got.sum(axis=0))
    bad = ~(dev <= allowed)
    if not bad.any():
        return []
    c = int(np.argmax(np.where(bad, dev / np.maximum(allowed, 1e-300), -1.0)))
    return [Violation(COLUMN_SUM, f"{stage}: {int(bad.sum())} of {got.shape[1]} columns do not sum to 0 over the "
                      f"keys; worst column {c} sums to {got[:, c].sum():.9g} (allowed ±{allowed[c]:.2g})",
                      int(bad.sum()), (c,))]


def _partner_chain(ctx: HeadContext, names):
    if all(n in ctx.chain for n in names):
        return ctx.chain
    from ..reference import reference_chain
    return {**ctx.chain, **reference_chain(ctx.inputs, ctx.scale, ctx.causal, names)}


def _flash_vs_stages(stage: str, got: np.ndarray, ctx: HeadContext) -> List[Violation]:
    """|flash_dX − dX| within both stages' chained bounds, where the program wrote dX."""
    from .. import tolerance
    partner = PARTNERS[stage]
    if partner not in ctx.got:
        return []
    chain = _partner_chain(ctx, [stage, partner])
    kw = ctx.bound_args()
    allowed = (tolerance.chained_bound(stage, chain, **kw) + tolerance.chained_bound(partner, chain, **kw)
               + ctx.quantum(stage, partner))
    v = consistency(FLASH_VS_STAGES, stage, got, np.asarray(ctx.got[partner], np.float64), allowed,
                    f"the program's {partner}")
    return [v] if v else []


# ---- the specs ----------------------------------------------------------------------------------

_GRAD_PATTERNS = PATTERNS + ("scaled",)

SPECS = (
    StageSpec("D", reference=lambda src, scale, causal: d_reference(src[GRAD_OUT], src[OUT]),
              isolated=_d_isolated, chained=_d_chained, floor=lambda src: _floor_d(src[GRAD_OUT], src[OUT]),
              quantization=_d_quantization, linear=True, diagnoses=_GRAD_PATTERNS + D_BUGS),
    StageSpec("dP", reference=lambda src, scale, causal: src[GRAD_OUT] @ src[VALUES].T, isolated=_dp_isolated,
              floor=lambda src: flush_sum(src[GRAD_OUT], np.asarray(src[VALUES]).T) + FLUSH,
              quantization=_dp_quantization, linear=True, diagnoses=_GRAD_PATTERNS),
    StageSpec("dS", reference=lambda src, scale, causal: ds_reference(src[WEIGHTS], src[DP], src[DSTAT]),
              isolated=_ds_isolated, chained=_ds_chained, floor=lambda src: 6 * FLUSH,
              quantization=_ds_quantization, invariants=(_ds_checks,), given_upstream=(ROW_SUM,), masked_value=0.0,
              diagnoses=PATTERNS + DS_BUGS + ("mask",)),
    StageSpec("dQ", reference=lambda src, scale, causal: scale * src[DS] @ src[KEYS], isolated=_dq_isolated,
              chained=_dq_chained, floor=lambda src: flush_sum(src[DS], src[KEYS]) + FLUSH,
              quantization=_gemm_quantization(DS, KEYS, False, True), scaled=True, linear=True,
              diagnoses=_GRAD_PATTERNS + DS_BUGS + SCALE_BUGS),
    StageSpec("dK", reference=lambda src, scale, causal: scale * src[DS].T @ src[QUERIES], isolated=_dk_isolated,
              chained=_dk_chained, floor=lambda src: flush_sum(np.asarray(src[DS]).T, src[QUERIES]) + FLUSH,
              quantization=_gemm_quantization(DS, QUERIES, True, True), invariants=(_dk_column_sums,),
              given_upstream=(COLUMN_SUM,),
              scaled=True, linear=True, diagnoses=_GRAD_PATTERNS + DS_BUGS + SCALE_BUGS),
    StageSpec("dV", reference=lambda src, scale, causal: src[WEIGHTS].T @ src[GRAD_OUT], isolated=_dv_isolated,
              chained=_dv_chained, floor=lambda src: flush_sum(np.asarray(src[WEIGHTS]).T, src[GRAD_OUT]) + FLUSH,
              quantization=_gemm_quantization(WEIGHTS, GRAD_OUT, True, False), linear=True,
              diagnoses=_GRAD_PATTERNS + ("dV_untransposed_P",)),
) + tuple(
    StageSpec(name, reference=_flash_reference(i), isolated=_flash_isolated(i), chained=_flash_chained(i),
              floor=_flash_floor,
              quantization=_flash_quantization(i),
              invariants=((_flash_vs_stages, _dk_column_sums) if name == FLASH_DK else (_flash_vs_stages,)),
              given_upstream=(COLUMN_SUM,) if name == FLASH_DK else (),
              scaled=True, linear=True, partner=PARTNERS[name], with_mask=_flash_with_mask(i),
              diagnoses=_GRAD_PATTERNS + ("mask", "lse_log2")
              + ((DS_BUGS + SCALE_BUGS) if name != FLASH_DV else ("dV_untransposed_P",)))
    for i, name in enumerate(FLASH_GRADS)
)
