"""The FlashAttention backward's error bounds (flash_dQ, flash_dK, flash_dV): isolated from the
program's own saved flash_output and flash_lse (P recomputed from the logits), chained from Q, K,
V and dO (the forward's lse and output errors reaching P and D). The chained ones are computed in
flash_chain_pass.py's pass, which may compute the isolated ones too. The variants enter as on the
stage path (bounds.py): the recomputed logits carry the score modifications' errors
(verify/model/scores.py), dS reads dP kept and rescaled under dropout, dQ and dK read dS through
the softcap's derivative, dV the kept and rescaled weights.
"""
from __future__ import annotations

from typing import Dict, NamedTuple

import numpy as np

from ...model.arrays import isfinite, like, namespace, to_device, to_numpy_all, zeros
from ...model.backward import CappedGrads, RowErrors, capped_grads, ds_var_parts, flash_rows, grad_over_keys_var
from ...model.dot import mma_truncation_det, qk_var, rowdot_var
from ...model.flash import common_factor_logits, logit_magnitude, plus, times_transposed
from ...model.kernels import FLASH_LOGIT_ROUNDINGS
from ...model.rounding import FLUSH, ROUND_VAR, HeadCache, everywhere, finite_abs, memo
from ...model.scores import HeadVariant, as_head, cap_factor_error, dropout_factor_error, modification_det
from ...model.softmax import exponent_var, logits, need, raw_logits
from ...model.tiles import flush_max
from ...stages import FLASH_GRAD_QUERIES, FLASH_OUTPUT, GRAD_OUTPUT, QUERIES
from ..base import Problem
from ..flash import on_device_of
from .bounds import dp_var
from .flash_tiles import ROW_TERMS, QueryGrad, over_queries, remember_gradients
from .reference import FLASH_SOURCES, flash_terms, through_cap


def scale_det(Q, K, scale, head, P, finite, u, kernel, cache):
    """The head's one rounded scale factor (a relative δ ≤ u): each recomputed weight moves by
    δ·(S_j − S̄), S̄ = Σ_j P_j S_j carried by the lse (one-signed, relative), for each quantity
    such a factor may multiply (verify/model/flash.py common_factor_logits); None without one."""
    det = None
    if not kernel.common_scale:
        return det
    xp = namespace(P)
    for S in common_factor_logits(Q, K, scale, head, cache):
        det = plus(det, xp.where(finite, u * xp.abs(S - xp.sum(P * S, axis=1, keepdims=True)), 0.0))
    return det


def _logit_det(Q, K, P, scale, head, finite, u, kernel, cache):
    """One-signed relative errors of the recomputed weights: tensor-core truncation of the logits
    (through the softcap's derivative) and the common scale factor; None for a kernel with neither."""
    det = scale_det(Q, K, scale, head, P, finite, u, kernel, cache)
    if kernel.mma_passes:
        trunc = abs(scale) * mma_truncation_det(Q, K.T, u, kernel.mma_passes)
        slope = head.cap_slope(raw_logits(Q, K, scale, cache)) if head.cap > 0 else None
        det = plus(det, namespace(trunc).where(finite, trunc if slope is None else trunc * slope, 0.0))
    return det


def recomputed_eta(Q, K, S, lse, finite, scale, head: HeadVariant, u, kernel, cache, product=None):
    """Variance of each recomputed weight's relative error: its logit's dot product (through the
    cap), the modifications' and the logit's roundings, the subtraction of lse, exp; product():
    Q·Kᵀ, where the caller has it."""
    eta = scale * scale * qk_var(Q, K, u, kernel.flash_product_var, cache, product)
    if head.modifies:
        S0 = raw_logits(Q, K, scale, cache)
        slope = head.cap_slope(S0)
        eta = eta * (1.0 if slope is None else slope * slope) + modification_det(S0, head, u, kernel, flash=True) ** 2
    xp = namespace(S)
    seen = everywhere(finite)  # (then the where()s are no-ops)
    eta = eta if seen else xp.where(finite, eta, 0.0)
    d = S - xp.where(isfinite(lse), lse, 0.0)
    d = d if seen else xp.where(finite, d, 0.0)
    return eta + exponent_var(d, finite, u, kernel, logit_magnitude(S, finite, head), FLASH_LOGIT_ROUNDINGS)


def lse_magnitude(lse, head: HeadVariant, n: int, m: int) -> np.ndarray:
    """|lse| as a kernel that rounds it sees it (0 for a row that sees no key; raised by
    flash-attn's causal ALiBi shift)."""
    xp = namespace(lse)
    mag = xp.where(isfinite(lse), xp.abs(lse), 0.0)
    shift = head.flash_shift(n, m)
    return mag if shift is None else mag + like(mag, np.abs(shift))


def _flushed_entries(P, dS):
    """(|dS|, P) where a weight or a dS entry lies below float32's normal range, else 0; on NumPy
    (None, None) when none does. GPUs flush such values to zero (an ftz exp2, FTZ arithmetic), so
    each may be lost whole; the gradients summed from them are then tiny, but no smaller than those
    terms."""
    edge = 2 * FLUSH  # margin for the weight's own rounding error near the edge
    xp = namespace(P)
    abs_ds = xp.abs(dS)
    tiny_p = (P < edge) & (P > 0)
    lost = tiny_p | (abs_ds < edge)
    if xp is np:
        lost &= dS != 0
        if not (lost.any() or tiny_p.any()):
            return None, None
    # (On a device a test of the tile would wait for its kernels: the terms are kept whatever they
    # hold, zeros where nothing is lost, which add nothing; and a dS of 0 gives a zero term whether
    # it is counted lost or not, so the test of dS ≠ 0 is left out: two passes fewer.) Twice the
    # lost terms: a gradient made of one lost term equals its bound exactly, and the reference's
    # own rounding must not decide such a case.
    return xp.where(lost, 2 * abs_ds, 0.0), xp.where(tiny_p, 2 * P, 0.0)


class GradBounds(NamedTuple):
    dq: tuple                            # (variance, one-signed part) of these rows of dQ
    indep: np.ndarray                    # dS's independent errors (sd)
    grads: CappedGrads                   # dS through the cap, and its errors
    gk: np.ndarray                       # G·K (dQ's reference, but for the scale)


class KeyGrads(NamedTuple):
    """dK's and dV's bounds, summed over the query rows a tile at a time (flash_tiles.QueryGrad)."""
    dk: QueryGrad
    dv: QueryGrad

    @classmethod
    def of(cls, n: int, head: HeadVariant, u, kernel, column_sums: bool = False) -> "KeyGrads":
        """column_sums: dK's GEMM rounding variance is kept apart (ColumnSumParts)."""
        pv = kernel.flash_product_var + ROUND_VAR  # the kernel's products, and the scale folded in
        return cls(QueryGrad(n, u, pv + ROUND_VAR * (head.cap > 0), apart=column_sums),
                   QueryGrad(n, u, pv + ROUND_VAR * (head.dropout > 0)))

    def bounds(self, scale, head: HeadVariant, u, kernel, cache):
        """((variance, one-signed part) of dK, of dV) once every tile is in."""
        dk_var = scale * scale * self.dk.var(cache, "dS Q var")
        dv_var = self.dv.var(cache, "P dO var")
        dk_det = abs(scale) * _array(self.dk.det.value, self.dk.gemm.sum)
        dv_sum = self.dv.gemm.sum
        dv_det = _array(self.dv.det.value, dv_sum) + dropout_factor_error(head, u) * namespace(dv_sum).abs(dv_sum)
        if kernel.mma_passes:
            dk_det = dk_det + abs(scale) * self.dk.mma.det(u, kernel.mma_passes)
            dv_det = dv_det + self.dv.mma.det(u, kernel.mma_passes)
        return (dk_var, dk_det), (dv_var, dv_det)


def _array(total, like_x):
    """A sum over the tiles as an array of like_x's shape (zeros where no tile added any)."""
    return zeros(like_x, like_x.shape) if np.ndim(total) == 0 and total == 0.0 else total


def flash_grad_bounds(parts, rows: RowErrors, dP_var, s_det, scale, head: HeadVariant, u, kernel, cache,
                       cap, keys: KeyGrads) -> GradBounds:
    """The bounds of these rows of flash_dQ from the row errors, and their parts of flash_dK's and
    flash_dV's (into keys); cap: (f, its error's sd)."""
    Q, K, dO, P, dP, D, dS = parts
    dropout, r_err = int(head.dropout > 0), dropout_factor_error(head, u)
    dPz = head.dropped(dP)
    indep, shared = ds_var_parts(P, dPz, D, dS, rows, head.dropped(head.dropped(dP_var)) if dropout else dP_var,
                                 u, dropout)
    g = capped_grads(P, dS, indep, shared, *cap)
    f = cap[0]
    xp = namespace(dS)
    # (s_det None and no dropout: no one-signed part, and no N×M pass or GEMM of zeros for it)
    ds_det = plus(None if s_det is None else xp.abs(dS) * s_det, r_err * xp.abs(P * dPz) if r_err else None)
    ds_det = None if ds_det is None else through_cap(ds_det, f)
    pv = kernel.flash_product_var + ROUND_VAR  # the kernel's products, and the scale folded in
    pv_g = pv + ROUND_VAR * (f is not None)    # and the cap's factor
    gk = g.G @ K  # (dQ's reference, but for the scale, and its GEMM's sums in the bound)
    dq_var = grad_over_keys_var(g.P, g.G, K, rows, g.indep, scale, u, cache, pv_g, gk)
    Pz = head.dropped(P)
    p_sd = head.dropped(P * (xp.sqrt(rows.eta) + xp.sqrt(rows.shared)))
    dq_det = zeros(dS, (dS.shape[0], K.shape[1])) if ds_det is None else abs(scale) * (ds_det @ xp.abs(K))
    keys.dk.add(g.G, g.indep + g.shared, Q, ds_det, bool(kernel.mma_passes))
    keys.dv.add(Pz, p_sd, dO, None if s_det is None else head.dropped(P * s_det), bool(kernel.mma_passes))
    lost_ds, lost_p = _flushed_entries(P, dS)
    if lost_ds is not None:
        lost_ds = through_cap(lost_ds, f)
        dq_det = dq_det + abs(scale) * (lost_ds @ xp.abs(K))
        keys.dk.add_lost(lost_ds, Q)
        keys.dv.add_lost(head.dropped(lost_p), dO)
    if kernel.mma_passes:
        dq_det = dq_det + abs(scale) * mma_truncation_det(g.G, K, u, kernel.mma_passes)
    return GradBounds((dq_var, dq_det), indep, g, gk)


def _own_cap(Q, K, scale, head: HeadVariant, u, kernel, cache):
    """(f, bound on its error) as the flash backward recomputes it from Q and K."""
    if head.cap == 0:
        return None, 0.0
    S0 = raw_logits(Q, K, scale, cache)
    return head.cap_slope(S0), cap_factor_error(S0, head, u, kernel)


def _flash_own(src, scale, head, u, kernel, cache, references: bool = False):
    """The flash backward's errors from its own saved flash_output and flash_lse: the recomputed
    logits (their dot product, their roundings, exp), the lse's one rounding where a kernel folds
    log2(e) into it (shared along the row), D's and dP's roundings, the gradient GEMMs; a row tile
    at a time (flash_tiles.py). references: the same pass computes the gradients' references from
    these sources too, kept for flash_gradients (flash_tiles.remember_gradients). The chain's pass
    may have computed both already (flash_chain_pass.py: remember_own)."""
    need(src, FLASH_GRAD_QUERIES, *FLASH_SOURCES)
    src = own_sources(src)
    head = as_head(head)

    def compute(on, cache):
        keys = KeyGrads.of(on[QUERIES].shape[0], head, u, kernel)
        rows = {**on, ROW_TERMS: like(on[QUERIES], own_row_terms(src, u))}
        parts = over_queries(rows, head, cache, lambda s, h, c: own_tile(s, scale, h, u, kernel, c, keys, references))
        out, refs = own_bounds(parts, keys, scale, head, u, kernel, cache)
        if references:
            remember_gradients(src, scale, head, to_numpy_all(refs) if on is not src else refs)
        return out
    if on_device_of(head):  # its sources moved once, its results back once
        return memo(cache, "flash grads own", tuple(src[n] for n in FLASH_SOURCES), (scale, head, u, kernel),
                    lambda: to_numpy_all(compute({n: to_device(x) for n, x in src.items()}, HeadCache())))
    return memo(cache, "flash grads own", tuple(src[n] for n in FLASH_SOURCES), (scale, head, u, kernel),
                lambda: compute(src, cache))


def own_sources(src) -> Dict[str, np.ndarray]:
    """The flash backward's sources as float64 arrays (the very arrays where they are: the head's
    cache keys on them)."""
    return {n: np.asarray(src[n], np.float64) for n in FLASH_SOURCES}


def own_row_terms(src, u: float) -> np.ndarray:
    """D's dot products' variance, each row its own: the whole head's at once from the sources as
    read, by NumPy's exact model (on a device no tile then waits to bring its rows back)."""
    return rowdot_var(src[GRAD_OUTPUT], src[FLASH_OUTPUT], u)


def own_bounds(parts, keys: "KeyGrads", scale, head: HeadVariant, u, kernel, cache):
    """(the bounds of dQ, dK and dV; their references, or None) from an own pass's tiles: own_tile's
    stacked rows and the sums over the queries in keys."""
    out = (tuple(parts[:2]),) + keys.bounds(scale, head, u, kernel, cache)
    return out, ((parts[2], scale * keys.dk.gemm.sum, keys.dv.gemm.sum) if len(parts) > 2 else None)


def remember_own(src, scale, head: HeadVariant, u, kernel, cache, out, refs) -> None:
    """Keep an own pass's bounds (in the head's cache, as _flash_own would) and references
    (flash_tiles.remember_gradients), computed by another pass over the same sources' tiles."""
    memo(cache, "flash grads own", tuple(src[n] for n in FLASH_SOURCES), (scale, head, u, kernel), lambda: out)
    remember_gradients(src, scale, head, refs)


def flash_own_and_references(src, problem: Problem) -> None:
    """Before a flash gradient's isolated reference and bound from the same sources: both in one
    pass over the row tiles (each tile's P, dP and dS computed once), the bound kept in the head's
    cache, the references for flash_gradients."""
    _flash_own(src, *problem.model_args, references=True)


def own_tile(src, scale, head: HeadVariant, u, kernel, cache, keys: KeyGrads, references: bool):
    """_flash_own's rows of one tile (or the chain's pass's, sharing its cache): dQ's bound
    (variance, one-signed part), and dK's and dV's parts into keys; with references, the tile's
    rows of dQ's reference too (a third result: dK's and dV's are the sums over the queries that
    their bounds hold)."""
    Q, K, V, dO, O, lse = (src[n] for n in FLASH_SOURCES)
    masked = head.hidden_like(Q, Q.shape[0], K.shape[0])
    # Q·Kᵀ and dO·Vᵀ once for the weights, the logits, dP and their variances (and once with the
    # chain's pass that shares this tile's cache)
    qk = times_transposed(Q, K, cache)
    P, dP, D, dS, _ = flash_terms(src, scale, masked, head=head, qk=qk, dp=times_transposed(dO, V, cache))
    xp = namespace(Q)
    finite = ~masked & isfinite(lse)
    S = logits(Q, K, scale, head, cache, lambda: qk)
    S = S if everywhere(finite) else xp.where(finite, S, 0.0)
    eta = recomputed_eta(Q, K, S, lse, finite, scale, head, u, kernel, cache, lambda: qk)
    lse_fold = ROUND_VAR * u * u * lse_magnitude(lse, head, Q.shape[0], K.shape[0]) ** 2
    rows = flash_rows(eta, lse_fold, src[ROW_TERMS])
    gb = flash_grad_bounds((Q, K, dO, P, dP, D, dS), rows, dp_var(dO, V, u, kernel.flash_product_var, cache, dP),
                            _logit_det(Q, K, P, scale, head, finite, u, kernel, cache), scale, head, u, kernel,
                            cache, _own_cap(Q, K, scale, head, u, kernel, cache), keys)
    return gb.dq + ((scale * gb.gk,) if references else ())


def flash_isolated(index: int):
    def isolated(src, ref, problem: Problem):
        var, det = _flash_own(src, *problem.model_args)[index]
        return var, det + 2.0 * problem.u * np.abs(ref) * (index < 2)  # dQ, dK: the scale's own rounding
    return isolated


def flash_floor(src):
    """Flushed products: none unless the data's products come near float32's normal range (the
    inputs' magnitudes are taken only then: most heads never need them)."""
    Q, K, V, dO = (src[n] for n in FLASH_SOURCES[:4])
    tiny = flush_max(dO, V.T)
    if not tiny:
        return 2 * FLUSH
    largest = max(1.0, *(float(finite_abs(x).max(initial=0.0)) for x in (Q, K, dO)))
    return 2 * FLUSH + tiny * largest * (Q.shape[0] + K.shape[0])


__all__ = ["flash_isolated", "flash_own_and_references", "flash_floor", "KeyGrads", "flash_grad_bounds",
           "recomputed_eta", "scale_det", "lse_magnitude", "own_tile", "own_row_terms", "remember_own"]
