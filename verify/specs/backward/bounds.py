"""The backward pass's error bounds on the stage path: isolated (from the program's own upstream
files: its P, dP, D, dS; their own roundings only) and chained (from Q, K, V and dO, every upstream
error propagated), with their underflow floors. The flash gradients' are flash_bounds.py's. The
error model itself is verify/model/backward.py; the variants' parts verify/model/scores.py: dS
reads dP kept and rescaled under dropout (one more rounding, the factor's relative error), dQ and
dK read dS through the softcap's derivative f = 1 − t² (one more product rounding, f's own error),
dV the weights kept and rescaled.
"""
from __future__ import annotations

import numpy as np

from ...model.backward import (capped_grads, d_var, ds_round_var, ds_var_parts, grad_over_keys_var,
                               grad_over_queries_var, stage_rows, weight_round_var)
from ...model.chain import chained_eta, chained_logits
from ...model.arrays import namespace
from ...model.dot import dot_var, flush_sum, pv_var, qk_var, rowdot_var
from ...model.rounding import FLUSH, ROUND_VAR, finish, memo
from ...model.scores import as_head, cap_factor_error, dropout_factor_error
from ...model.softmax import need, raw_logits, rowsum_rel_var, weights_var
from ...stages import (GRAD_KEYS, GRAD_OUTPUT, GRAD_QUERIES, GRAD_SCORES, GRAD_VALUES, GRAD_WEIGHTS, OUTPUT, QUERIES,
                       ROW_DOT, SCORES, VALUES, WEIGHTS, KEYS)
from ..base import Problem
from .reference import d_reference, ds_reference, through_cap


# ---- isolated bounds (from the program's own upstream files) -----------------------------------

def d_isolated(src, ref, problem: Problem):
    dO, O = need(src, ROW_DOT, GRAD_OUTPUT, OUTPUT)
    return rowdot_var(dO, O, problem.u), np.zeros(ref.shape)


def dp_isolated(src, ref, problem: Problem):
    u, cache = problem.u, problem.cache
    dO, V = need(src, GRAD_WEIGHTS, GRAD_OUTPUT, VALUES)
    return memo(cache, "dP var", (dO, V), (u,), lambda: dot_var(dO, V.T, u)), np.zeros(ref.shape)


def ds_isolated(src, ref, problem: Problem):
    head, u = problem.head, problem.u
    P, dP, D = need(src, GRAD_SCORES, WEIGHTS, GRAD_WEIGHTS, ROW_DOT)
    dPz = head.dropped(dP)
    var = ds_round_var(P, dPz, D, u, int(head.dropout > 0))
    return var, dropout_factor_error(head, u) * np.abs(P * dPz)


def _own_cap(stage: str, src, problem: Problem):
    """(f, bound on its error) of the softcap's derivative from the program's QK; (None, 0) without
    a cap."""
    head = problem.head
    if head.cap == 0:
        return None, 0.0
    (QK,) = need(src, stage, SCORES)
    S0 = QK * problem.scale
    return head.cap_slope(S0), cap_factor_error(S0, head, problem.u, problem.kernel)


def _gemm_through_cap(stage: str, src, ref, problem: Problem, transpose: bool, other: str):
    """(variance, one-signed part) of scale·(dS∘f)·X, transposed for dK: the GEMM's roundings
    (one more product rounding each for the scale folded in and, under a cap, the product by f),
    f's own error through X, and the scale's own rounding (2u|ref|)."""
    scale, u = problem.scale, problem.u
    dS, X = need(src, stage, GRAD_SCORES, other)
    f, f_err = _own_cap(stage, src, problem)
    G = through_cap(dS, f)
    A = G.T if transpose else G
    var = dot_var(A, X, u, (2 + (f is not None)) * ROUND_VAR)
    if f is not None:
        E = dS * f_err
        var = var + (E.T if transpose else E) ** 2 @ (X * X)
    return scale * scale * var, 2.0 * u * np.abs(ref)


def dq_isolated(src, ref, problem: Problem):
    return _gemm_through_cap(GRAD_QUERIES, src, ref, problem, False, KEYS)


def dk_isolated(src, ref, problem: Problem):
    return _gemm_through_cap(GRAD_KEYS, src, ref, problem, True, QUERIES)


def dv_isolated(src, ref, problem: Problem):
    head, u = problem.head, problem.u
    P, dO = need(src, GRAD_VALUES, WEIGHTS, GRAD_OUTPUT)
    dropout = int(head.dropout > 0)
    det = (dropout_factor_error(head, u) + u * dropout) * np.abs(ref)
    return dot_var(head.dropped(P).T, dO, u, ROUND_VAR * (1 + dropout)), det


def dp_var(dO, V, u, product_var, cache, dP=None):
    """dot_var of dP = dO·Vᵀ (dP: that product, where the caller has it)."""
    return memo(cache, "dP var", (dO, V), (u, product_var), lambda: dot_var(dO, V.T, u, product_var, dP))


# ---- chained bounds (from Q, K, V, dO) ----------------------------------------------------------

def stage_chain(Q, K, V, dO, scale, head, u, kernel, cache):
    """The stage path's references and row errors from the original inputs (see the model):
    (p, dP, D, dS, rows, indep, shared, eta, l_var)."""
    head = as_head(head)

    def compute():
        S, p, _, _, _, _ = chained_logits(Q, K, scale, head, u, kernel, cache)
        eta = chained_eta(Q, K, scale, head, u, kernel, cache)
        l_var = rowsum_rel_var(p, u, cache=cache)
        dropout, r_err = int(head.dropout > 0), dropout_factor_error(head, u)
        pz = head.dropped(p)
        O = pz @ V
        dP = dO @ V.T
        dPz = head.dropped(dP)
        D = d_reference(dO, O)
        dS = ds_reference(p, dP, D, head)
        Dv = d_var(p, eta, l_var, weight_round_var(p, u, kernel), dO, dPz, D,
                   pv_var(pz, V, u, ROUND_VAR * (1 + dropout), cache), rowdot_var(dO, O, u)) + (r_err * D) ** 2
        rows = stage_rows(p, eta, l_var, Dv, u, kernel)
        dP_var = dp_var(dO, V, u, ROUND_VAR, cache)
        indep, shared = ds_var_parts(p, dPz, D, dS, rows, head.dropped(head.dropped(dP_var)), u, dropout)
        return p, dP, D, dS, rows, indep, shared + r_err * namespace(p).abs(p * dPz), eta, l_var
    return memo(cache, "backward chain", (Q, K, V, dO), (scale, head, u, kernel), compute)


def chain_cap(Q, K, scale, head, u, kernel, cache, product_var):
    """(f, standard deviation of its error) along the chain: f's own roundings (cap_factor_error)
    and scale·QK's dot-product error through df/dS0 = −2t(1 − t²)/C; (None, 0) without a cap."""
    if head.cap == 0:
        return None, 0.0
    S0 = raw_logits(Q, K, scale, cache)
    t = np.tanh(S0 / head.cap)
    f = 1.0 - t * t
    qk_sd = abs(scale) * np.sqrt(qk_var(Q, K, u, product_var, cache))
    return f, cap_factor_error(S0, head, u, kernel) + 2 * np.abs(t) * f / head.cap * qk_sd


def _stage_grads(sources, problem: Problem):
    """The stage path's chain with dS through the cap (CappedGrads) and dropout's factor error
    along dS (dQ's and dK's one-signed part)."""
    Q, K, V, dO = sources
    head = problem.head

    def compute():
        p, dP, D, dS, rows, indep, shared, *_ = stage_chain(Q, K, V, dO, *problem.model_args)
        f, f_sd = chain_cap(Q, K, problem.scale, head, problem.u, problem.kernel, problem.cache, ROUND_VAR)
        grads = capped_grads(p, dS, indep, shared, f, f_sd)
        r_det = through_cap(dropout_factor_error(head, problem.u) * np.abs(p * head.dropped(dP)), f)
        return rows, grads, r_det
    return memo(problem.cache, "capped stage grads", (Q, K, V, dO), problem.key, compute)


def floor_d(dO, O):
    return flush_sum(np.abs(dO) * np.abs(O), np.ones((dO.shape[1], 1))) + FLUSH


def d_chained(sources, problem: Problem):
    Q, K, V, dO = sources
    p, dP, D, dS, rows, *_ = stage_chain(Q, K, V, dO, *problem.model_args)
    return finish(D, rows.D, np.zeros(D.shape), floor_d(dO, problem.head.dropped(p) @ V))


def ds_chained(sources, problem: Problem):
    Q, K, V, dO = sources
    p, dP, D, dS, rows, indep, shared, *_ = stage_chain(Q, K, V, dO, *problem.model_args)
    return finish(dS, (indep + shared) ** 2, np.zeros(dS.shape), 6 * FLUSH)


def _gemm_product_var(problem: Problem) -> float:
    """The gradient GEMMs' product roundings: the product, the scale folded in, the cap's factor."""
    return (2 + (problem.head.cap > 0)) * ROUND_VAR


def dq_chained(sources, problem: Problem):
    scale, u, cache = problem.scale, problem.u, problem.cache
    K = sources[1]
    rows, g, r_det = _stage_grads(sources, problem)
    dQ = scale * g.G @ K
    var = grad_over_keys_var(g.P, g.G, K, rows, g.indep, scale, u, cache, _gemm_product_var(problem))
    det = 2.0 * u * np.abs(dQ) + abs(scale) * (r_det @ np.abs(K))
    return finish(dQ, var, det, abs(scale) * flush_sum(g.G, K) + FLUSH)


def dk_chained(sources, problem: Problem):
    scale, u, cache = problem.scale, problem.u, problem.cache
    Q = sources[0]
    rows, g, r_det = _stage_grads(sources, problem)
    dK = scale * g.G.T @ Q
    var = scale * scale * grad_over_queries_var(g.G, g.indep + g.shared, Q, u, cache, "dS Q var",
                                                _gemm_product_var(problem))
    det = 2.0 * u * np.abs(dK) + abs(scale) * (r_det.T @ np.abs(Q))
    return finish(dK, var, det, abs(scale) * flush_sum(g.G.T, Q) + FLUSH)


def dv_chained(sources, problem: Problem):
    head, u, kernel, cache = problem.head, problem.u, problem.kernel, problem.cache
    Q, K, dO = sources  # dV = Pᵀ·dO needs no V
    p = chained_logits(Q, K, *problem.model_args)[1]
    eta = chained_eta(Q, K, *problem.model_args)
    l_var = rowsum_rel_var(p, u, cache=cache)
    p_sd = np.sqrt(weights_var(p, eta, l_var, u, cache, kernel.div_var))
    pz = head.dropped(p)
    dV = pz.T @ dO
    var = grad_over_queries_var(pz, head.dropped(p_sd), dO, u, cache, "P dO var",
                                (2 + (head.dropout > 0)) * ROUND_VAR)
    return finish(dV, var, dropout_factor_error(head, u) * np.abs(dV), flush_sum(pz.T, dO) + FLUSH)
