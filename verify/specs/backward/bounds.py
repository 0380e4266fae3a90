"""The backward pass's error bounds: isolated (from the program's own upstream files: its P, dP,
D, dS; for the flash gradients its flash_output and flash_lse; their own roundings only) and
chained (from Q, K, V and dO, every upstream error propagated), with their underflow floors.
The error model itself is verify/model/backward.py.
"""
from __future__ import annotations

import numpy as np

from ...model.attention import log_sum_exp_rows
from ...model.backward import (d_var, ds_round_var, ds_var_parts, flash_rows, grad_over_keys_var, grad_over_queries_var,
                               stage_rows, weight_round_var)
from ...model.chain import chained_eta, chained_logits
from ...model.dot import dot_var, flush_sum, mma_truncation_det, pv_var, qk_var, rowdot_var
from ...model.flash import flash_output_var_det, flash_parts
from ...model.kernels import FLASH_LOGIT_ROUNDINGS
from ...model.rounding import FLUSH, ROUND_VAR, finish, finite_abs, memo
from ...model.softmax import exponent_var, need, rowsum_rel_var, weights_var
from ...stages import (FLASH_GRAD_QUERIES, GRAD_OUTPUT, GRAD_QUERIES, GRAD_KEYS, GRAD_SCORES, GRAD_VALUES,
                       GRAD_WEIGHTS, KEYS, OUTPUT, QUERIES, ROW_DOT, VALUES, WEIGHTS)
from ..base import Problem
from ..flash import lse_var_det
from .reference import FLASH_SOURCES, d_reference, ds_reference, flash_backward, mask_of


# ---- isolated bounds (from the program's own upstream files) -----------------------------------

def d_isolated(src, ref, problem: Problem):
    dO, O = need(src, ROW_DOT, GRAD_OUTPUT, OUTPUT)
    return rowdot_var(dO, O, problem.u), np.zeros(ref.shape)


def dp_isolated(src, ref, problem: Problem):
    u, cache = problem.u, problem.cache
    dO, V = need(src, GRAD_WEIGHTS, GRAD_OUTPUT, VALUES)
    return memo(cache, "dP var", (dO, V), (u,), lambda: dot_var(dO, V.T, u)), np.zeros(ref.shape)


def ds_isolated(src, ref, problem: Problem):
    P, dP, D = need(src, GRAD_SCORES, WEIGHTS, GRAD_WEIGHTS, ROW_DOT)
    return ds_round_var(P, dP, D, problem.u), np.zeros(ref.shape)


def dq_isolated(src, ref, problem: Problem):
    scale, u = problem.scale, problem.u
    dS, K = need(src, GRAD_QUERIES, GRAD_SCORES, KEYS)
    return scale * scale * dot_var(dS, K, u, 2 * ROUND_VAR), 2.0 * u * np.abs(ref)


def dk_isolated(src, ref, problem: Problem):
    scale, u = problem.scale, problem.u
    dS, Q = need(src, GRAD_KEYS, GRAD_SCORES, QUERIES)
    return scale * scale * dot_var(dS.T, Q, u, 2 * ROUND_VAR), 2.0 * u * np.abs(ref)


def dv_isolated(src, ref, problem: Problem):
    P, dO = need(src, GRAD_VALUES, WEIGHTS, GRAD_OUTPUT)
    return dot_var(P.T, dO, problem.u), np.zeros(ref.shape)


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
    Q, K, V, dO, O, lse = need(src, FLASH_GRAD_QUERIES, *FLASH_SOURCES)

    def compute():
        masked = mask_of(Q.shape[0], K.shape[0], causal)
        _, _, _, P, dP, D, dS = flash_backward(src, scale, masked)
        finite = ~masked & np.isfinite(lse)
        S = np.where(finite, (Q @ K.T) * scale, 0.0)
        eta = _recomputed_eta(Q, K, S, lse, finite, scale, u, kernel, cache)
        lse_fold = ROUND_VAR * u * u * np.where(np.isfinite(lse), lse, 0.0) ** 2
        rows = flash_rows(eta, lse_fold, rowdot_var(dO, O, u))
        return _flash_grad_bounds((Q, K, dO, P, dP, D, dS), rows, _dp_var(dO, V, u, kernel.flash_product_var, cache),
                                  _logit_det(Q, K, S, P, scale, finite, u, kernel), scale, u, kernel, cache)
    return memo(cache, "flash grads own", (Q, K, V, dO, O, lse), (scale, causal, u, kernel), compute)


def flash_isolated(index: int):
    def isolated(src, ref, problem: Problem):
        var, det = _flash_own(src, *problem.model_args)[index]
        return var, det + 2.0 * problem.u * np.abs(ref) * (index < 2)  # dQ, dK: the scale's own rounding
    return isolated


# ---- chained bounds (from Q, K, V, dO) ----------------------------------------------------------

def stage_chain(Q, K, V, dO, scale, causal, u, kernel, cache):
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


def floor_d(dO, O):
    return flush_sum(np.abs(dO) * np.abs(O), np.ones((dO.shape[1], 1))) + FLUSH


def d_chained(sources, problem: Problem):
    Q, K, V, dO = sources
    p, dP, D, dS, rows, *_ = stage_chain(Q, K, V, dO, *problem.model_args)
    return finish(D, rows.D, np.zeros(D.shape), floor_d(dO, p @ V))


def ds_chained(sources, problem: Problem):
    Q, K, V, dO = sources
    p, dP, D, dS, rows, indep, shared, *_ = stage_chain(Q, K, V, dO, *problem.model_args)
    return finish(dS, (indep + shared) ** 2, np.zeros(dS.shape), 6 * FLUSH)


def dq_chained(sources, problem: Problem):
    scale, u, cache = problem.scale, problem.u, problem.cache
    Q, K, V, dO = sources
    p, dP, D, dS, rows, indep, shared, *_ = stage_chain(Q, K, V, dO, *problem.model_args)
    dQ = scale * dS @ K
    var = grad_over_keys_var(p, dS, K, rows, indep, scale, u, cache)
    return finish(dQ, var, 2.0 * u * np.abs(dQ), abs(scale) * flush_sum(dS, K) + FLUSH)


def dk_chained(sources, problem: Problem):
    scale, u, cache = problem.scale, problem.u, problem.cache
    Q, K, V, dO = sources
    p, dP, D, dS, rows, indep, shared, *_ = stage_chain(Q, K, V, dO, *problem.model_args)
    dK = scale * dS.T @ Q
    var = scale * scale * grad_over_queries_var(dS, indep + shared, Q, u, cache, "dS Q var")
    return finish(dK, var, 2.0 * u * np.abs(dK), abs(scale) * flush_sum(dS.T, Q) + FLUSH)


def dv_chained(sources, problem: Problem):
    scale, causal, u, kernel, cache = problem.scale, problem.causal, problem.u, problem.kernel, problem.cache
    Q, K, dO = sources  # dV = Pᵀ·dO needs no V
    p = chained_logits(Q, K, scale, causal, u, cache)[1]
    eta = chained_eta(Q, K, scale, causal, u, kernel, cache)
    l_var = rowsum_rel_var(p, u, cache=cache)
    p_sd = np.sqrt(weights_var(p, eta, l_var, u, cache, kernel.div_var))
    dV = p.T @ dO
    return finish(dV, grad_over_queries_var(p, p_sd, dO, u, cache, "P dO var"), np.zeros(dV.shape),
                  flush_sum(p.T, dO) + FLUSH)


def flash_chain(Q, K, V, dO, scale, causal, u, kernel, cache):
    """The flash backward's errors from the original inputs: its forward's lse and output errors
    (verify/model/flash.py) reach P (shared along the row) and D."""
    def compute():
        S, p, m, eta_fwd, l_var, s_det = flash_parts(Q, K, scale, causal, u, kernel, cache)
        finite = np.isfinite(S)
        lse = log_sum_exp_rows(S)
        lse_var, lse_det = lse_var_det(Q, K, lse, scale, causal, u, kernel, cache)
        # The same weights, dP, D and dS as the stage path's chain (shared arrays share their bounds).
        _, dP, D, dS = stage_chain(Q, K, V, dO, scale, causal, u, kernel, cache)[:4]
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


def flash_chained(index: int):
    def chained(sources, problem: Problem):
        scale, u = problem.scale, problem.u
        Q, K, V, dO = sources
        refs, bounds, dS, p, _, _ = flash_chain(Q, K, V, dO, *problem.model_args)
        ref, (var, det) = refs[index], bounds[index]
        det = det + 2.0 * u * np.abs(ref) * (index < 2)
        floor = [abs(scale) * flush_sum(dS, K), abs(scale) * flush_sum(dS.T, Q), flush_sum(p.T, dO)][index]
        return finish(ref, var, det, floor + FLUSH)
    return chained


def flash_floor(src):
    """Flushed products: none unless the data's products come near float32's normal range."""
    Q, K, V, dO = (finite_abs(src[n]) for n in FLASH_SOURCES[:4])
    tiny = float(np.max(flush_sum(dO, V.T), initial=0.0))
    if not tiny:
        return 2 * FLUSH
    return 2 * FLUSH + tiny * max(1.0, Q.max(initial=0.0), K.max(initial=0.0), dO.max(initial=0.0)) \
        * (Q.shape[0] + K.shape[0])


