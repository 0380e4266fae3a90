"""The backward pass's error: from the output gradient dO through D, dP, dS and the three gradient
GEMMs, on the stage path (P and O from the forward's files) and in the FlashAttention backward (P
recomputed from the logits and the saved log-sum-exp).

Every gradient is a sum over terms with their own, independent roundings (the GEMMs' partial sums,
each dS entry's subtraction and product, each weight's exponent), and terms every entry of a query
row shares: the softmax's normalization (or the saved lse) and D. The shared terms add coherently
along a row (dQ sums over keys) and independently across rows (dK and dV sum over queries); where
two parts of an error are correlated their standard deviations add (never less than the truth).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .arrays import namespace
from .dot import dot_var
from .kernels import SOFTMAX_FINAL_ROUNDINGS, Kernel
from .rounding import ROUND_VAR, HeadCache, memo

# dS = P∘(dP − D): a subtraction and a product, or P·dP − P·D (two products and a subtraction):
# at most three roundings, of magnitude |P·dP| + |P·D| at most.
DS_ROUNDINGS = 3


@dataclass(frozen=True)
class RowErrors:
    """The errors of one query row's softmax as the backward sees them (variances, N×M or N×1).

    eta: each weight's own relative error (its logit, its exponent), independent across keys;
    shared: the relative error common to the row's weights (the normalization, or the saved lse);
    weight_round: the absolute rounding of each stored weight (stage path only: None in the
    flash backward, which stores none, so that no N×M array of zeros is made and multiplied);
    D: D's error (its own rounding and the output's error reaching it)."""
    eta: np.ndarray
    shared: np.ndarray
    weight_round: Optional[np.ndarray]
    D: np.ndarray


def ds_round_var(P: np.ndarray, dP: np.ndarray, D: np.ndarray, u: float, extra: int = 0) -> np.ndarray:
    """Variance of dS's own roundings (either route: P∘(dP − D) or P·dP − P·D); extra: more
    roundings of the same magnitude (dropout's product dP·Z·(1/(1 − p)))."""
    xp = namespace(P)
    a = P * xp.abs(dP) + P * xp.abs(D)  # (|P·x| = ±P·|x| exactly: squared below, the sign of P is lost)
    return (DS_ROUNDINGS + extra) * ROUND_VAR * u * u * a * a


def ds_var_parts(P, dP, D, dS, rows: RowErrors, dP_var, u, extra: int = 0):
    """(independent, row-shared) standard deviations of each dS entry's error:
    δdS = dS·η + P·δdP + ρ·(dP − D) + own roundings   (independent across keys),
        − dS·ε − P·δD                                 (shared along the row).
    Under dropout dP is the kept and rescaled dP·Z/(1 − p) and dP_var its variance (extra: 1)."""
    indep = dS * dS * rows.eta + P * P * dP_var
    if rows.weight_round is not None:
        indep = indep + rows.weight_round * (dP - D) ** 2
    indep = indep + ds_round_var(P, dP, D, u, extra)
    xp = namespace(dS)
    shared = xp.abs(dS) * xp.sqrt(rows.shared) + P * xp.sqrt(rows.D)  # (P ≥ 0: its own magnitude)
    return xp.sqrt(indep), shared


def grad_over_keys_var(P, dS, K, rows: RowErrors, indep_sd, scale: float, u: float,
                       cache: Optional[HeadCache], product_var: float = 2 * ROUND_VAR, dsk=None) -> np.ndarray:
    """Variance of dQ = scale·dS·K (N×d): the independent parts through K², the row-shared ones
    coherently (−ε·dQ/scale − δD·(P·K)), then the GEMM's own roundings (the scale may be folded
    into either operand: one more product rounding). dsk: dS·K, where the caller has it."""
    xp = namespace(dS)
    ind = (indep_sd * indep_sd) @ (K * K)
    dsk = dS @ K if dsk is None else dsk  # (the GEMM's sums in its rounding model too)
    shared_sd = xp.sqrt(rows.shared) * xp.abs(dsk) + xp.sqrt(rows.D) * xp.abs(P @ K)
    total = (xp.sqrt(ind) + shared_sd) ** 2
    gemm = memo(cache, "dS K var", (dS, K), (u, product_var), lambda: dot_var(dS, K, u, product_var, dsk))
    return scale * scale * (total + gemm)


def grad_over_queries_var(X, E_sd, Y, u: float, cache: Optional[HeadCache], what: str,
                          product_var: float = 2 * ROUND_VAR) -> np.ndarray:
    """Variance of Xᵀ·Y (M×d) where each entry of X (N×M) errs by E_sd, independently across
    queries (their shared parts belong to one row each): (E_sd²)ᵀ·Y² plus the GEMM's roundings
    (product_var: each product's, in u² units, the scale folded into an operand included)."""
    return (E_sd * E_sd).T @ (Y * Y) + transposed_gemm_var(X, Y, u, cache, what, product_var)


def transposed_gemm_var(X, Y, u: float, cache: Optional[HeadCache], what: str,
                        product_var: float = 2 * ROUND_VAR) -> np.ndarray:
    """dot_var of Xᵀ·Y, shared through the head's cache under `what`."""
    return memo(cache, what, (X, Y), (u, product_var), lambda: dot_var(X.T, Y, u, product_var))


def d_var(p, eta_var, l_var, weight_round, dO, dP, D, O_round_var, D_round_var) -> np.ndarray:
    """Variance of D = rowsum(dO∘O)'s error (N×1), O = P·V from the row's softmax: with
    δP_j = p_j(η_j − η̄ − ε_l) + ρ_j (η̄ = Σ_j p_j η_j, the normalization's cancellation),
    δD = Σ_j p_j η_j (dP_j − D) − ε_l·D + Σ_j ρ_j dP_j + Σ_k dO_k r_k + D's own rounding
    (r: O's accumulation and final roundings, ρ: each stored weight's)."""
    w = p * p * eta_var
    xp = namespace(w)
    var = xp.sum(w * (dP - D) ** 2, axis=1, keepdims=True) + l_var * D * D
    if weight_round is not None:  # (None: no stored weight, the flash backward's)
        var = var + xp.sum(weight_round * dP * dP, axis=1, keepdims=True)
    return var + xp.sum(dO * dO * O_round_var, axis=1, keepdims=True) + D_round_var


def weight_round_var(p, u: float, kernel: Kernel) -> np.ndarray:
    """The final roundings of each stored softmax weight (1/l, the product)."""
    return (SOFTMAX_FINAL_ROUNDINGS * ROUND_VAR + kernel.div_var) * u * u * p * p


def stage_rows(p, eta_var, l_var, D_var, u: float, kernel: Kernel) -> RowErrors:
    """The stage path's row errors: the weights' exponents, their normalization (shared: η̄ + ε_l),
    their final roundings, and D's."""
    eta_bar = namespace(p).sum(p * p * eta_var, axis=1, keepdims=True)
    return RowErrors(eta_var, eta_bar + l_var, weight_round_var(p, u, kernel), D_var)


def flash_rows(eta_var, lse_var, D_var) -> RowErrors:
    """The flash backward's row errors: P = exp(S − lse) errs by its logit and exponent (η) and by
    the saved lse (shared along the row; no normalization, no stored weight)."""
    return RowErrors(eta_var, lse_var, None, D_var)


@dataclass(frozen=True)
class CappedGrads:
    """What dQ and dK are made of under a softcap: G = dS∘f (f = 1 − t², the cap's derivative),
    its independent and row-shared error standard deviations, and P∘(|f| + δf), through which D's
    error reaches G. δG = (f + δf)·δdS + dS·δf: the second-order term counts where f vanishes (a
    saturated cap) and dS is exactly 0 (a row with one visible key) while neither error does;
    δf's source, scale·QK's error, is correlated with η's, so the standard deviations add."""
    G: np.ndarray
    indep: np.ndarray
    shared: np.ndarray
    P: np.ndarray


def capped_grads(P, dS, indep, shared, f: Optional[np.ndarray], f_sd) -> CappedGrads:
    """CappedGrads from dS's errors (ds_var_parts), f and the standard deviation (or bound) of its
    error; dS itself without a cap (f None)."""
    if f is None:
        return CappedGrads(dS, indep, shared, P)
    reach = np.abs(f) + f_sd
    return CappedGrads(dS * f, reach * indep + np.abs(dS) * f_sd, reach * shared, P * reach)
