"""The FlashAttention backward's error bounds (flash_dQ, flash_dK, flash_dV): isolated from the
program's own saved flash_output and flash_lse (P recomputed from the logits), chained from Q, K,
V and dO (the forward's lse and output errors reaching P and D). The variants enter as on the
stage path (bounds.py): the recomputed logits carry the score modifications' errors
(verify/model/scores.py), dS reads dP kept and rescaled under dropout, dQ and dK read dS through
the softcap's derivative, dV the kept and rescaled weights.
"""
from __future__ import annotations

from typing import NamedTuple, Tuple

import numpy as np

from ...model.arrays import clip, isfinite, like, namespace, to_device, to_numpy_all, zeros
from ...model.attention import log_sum_exp_rows
from ...model.backward import CappedGrads, RowErrors, capped_grads, d_var, ds_var_parts, flash_rows, grad_over_keys_var
from ...model.dot import mma_truncation_det, pv, pv_var, qk_var, rowdot_var, rowdot_var_later
from ...model.flash import common_factor_logits, flash_output_var_det, flash_parts, logit_magnitude, plus
from ...model.kernels import FLASH_LOGIT_ROUNDINGS
from ...model.rounding import FLUSH, ROUND_VAR, HeadCache, everywhere, finish, finite_abs, memo
from ...model.scores import HeadVariant, as_head, cap_factor_error, dropout_factor_error, modification_det
from ...model.softmax import exponent_var, finite_logits, logits, need, raw_logits
from ...model.tiles import Total, flush_max, in_order, least, smallest, smallest_now
from ...stages import FLASH_GRAD_QUERIES, FLASH_OUTPUT, GRAD_OUTPUT, KEYS, QUERIES, VALUES
from ..base import Problem
from ..flash import forward_sums, lse_var_det, on_device_of, share_forward
from .bounds import chain_cap, dp_var
from .flash_tiles import ROW_TERMS, QueryGrad, over_queries, remember_gradients
from .reference import FLASH_SOURCES, d_reference, ds_reference, flash_terms, through_cap


def _scale_det(Q, K, scale, head, P, finite, u, kernel, cache):
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
    det = _scale_det(Q, K, scale, head, P, finite, u, kernel, cache)
    if kernel.mma_passes:
        trunc = abs(scale) * mma_truncation_det(Q, K.T, u, kernel.mma_passes)
        slope = head.cap_slope(raw_logits(Q, K, scale, cache)) if head.cap > 0 else None
        det = plus(det, namespace(trunc).where(finite, trunc if slope is None else trunc * slope, 0.0))
    return det


def _recomputed_eta(Q, K, S, lse, finite, scale, head: HeadVariant, u, kernel, cache, product=None):
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


def _lse_magnitude(lse, head: HeadVariant, n: int, m: int) -> np.ndarray:
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
    def of(cls, n: int) -> "KeyGrads":
        return cls(QueryGrad(n), QueryGrad(n))

    def bounds(self, scale, head: HeadVariant, u, kernel, cache, capped: bool):
        """((variance, one-signed part) of dK, of dV) once every tile is in."""
        pv = kernel.flash_product_var + ROUND_VAR
        dk_var = scale * scale * self.dk.var(u, cache, "dS Q var", pv + ROUND_VAR * capped)
        dv_var = self.dv.var(u, cache, "P dO var", pv + ROUND_VAR * (head.dropout > 0))
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


def _flash_grad_bounds(parts, rows: RowErrors, dP_var, s_det, scale, head: HeadVariant, u, kernel, cache,
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
    these sources too, kept for flash_gradients (flash_tiles.remember_gradients)."""
    need(src, FLASH_GRAD_QUERIES, *FLASH_SOURCES)
    src = {n: np.asarray(src[n], np.float64) for n in FLASH_SOURCES}
    head = as_head(head)

    def compute(on, cache):
        keys = KeyGrads.of(on[QUERIES].shape[0])
        # D's dot products' variance, each row its own: the whole head's at once from the sources
        # as read (on a device no tile then waits to bring its rows back to NumPy's exact model).
        rows = {**on, ROW_TERMS: like(on[QUERIES], rowdot_var(src[GRAD_OUTPUT], src[FLASH_OUTPUT], u))}
        parts = over_queries(rows, head, cache, lambda s, h, c: _own_tile(s, scale, h, u, kernel, c, keys, references))
        out = (parts[:2],) + keys.bounds(scale, head, u, kernel, cache, head.cap > 0)
        if not references:
            return out
        refs = (parts[2], scale * keys.dk.gemm.sum, keys.dv.gemm.sum)  # (the bounds' sums over the queries)
        refs = to_numpy_all(refs) if on is not src else refs
        remember_gradients(src, scale, head, refs)
        return out
    if on_device_of(head):  # its sources moved once, its results back once
        return memo(cache, "flash grads own", tuple(src[n] for n in FLASH_SOURCES), (scale, head, u, kernel),
                    lambda: to_numpy_all(compute({n: to_device(x) for n, x in src.items()}, HeadCache())))
    return memo(cache, "flash grads own", tuple(src[n] for n in FLASH_SOURCES), (scale, head, u, kernel),
                lambda: compute(src, cache))


def flash_own_and_references(src, problem: Problem) -> None:
    """Before a flash gradient's isolated reference and bound from the same sources: both in one
    pass over the row tiles (each tile's P, dP and dS computed once), the bound kept in the head's
    cache, the references for flash_gradients."""
    _flash_own(src, *problem.model_args, references=True)


def _own_tile(src, scale, head: HeadVariant, u, kernel, cache, keys: KeyGrads, references: bool):
    """_flash_own's rows of one tile: dQ's bound (variance, one-signed part), and dK's and dV's
    parts into keys; with references, the tile's rows of dQ's reference too (a third result: dK's
    and dV's are the sums over the queries that their bounds hold)."""
    Q, K, V, dO, O, lse = (src[n] for n in FLASH_SOURCES)
    masked = head.hidden_like(Q, Q.shape[0], K.shape[0])
    qk = Q @ K.T  # (once for the weights, the logits and their dot products' variance)
    P, dP, D, dS, _ = flash_terms(src, scale, masked, head=head, qk=qk)
    xp = namespace(Q)
    finite = ~masked & isfinite(lse)
    S = logits(Q, K, scale, head, cache, lambda: qk)
    S = S if everywhere(finite) else xp.where(finite, S, 0.0)
    eta = _recomputed_eta(Q, K, S, lse, finite, scale, head, u, kernel, cache, lambda: qk)
    lse_fold = ROUND_VAR * u * u * _lse_magnitude(lse, head, Q.shape[0], K.shape[0]) ** 2
    rows = flash_rows(eta, lse_fold, src[ROW_TERMS])
    gb = _flash_grad_bounds((Q, K, dO, P, dP, D, dS), rows, dp_var(dO, V, u, kernel.flash_product_var, cache, dP),
                            _logit_det(Q, K, P, scale, head, finite, u, kernel, cache), scale, head, u, kernel,
                            cache, _own_cap(Q, K, scale, head, u, kernel, cache), keys)
    return gb.dq + ((scale * gb.gk,) if references else ())


def flash_isolated(index: int):
    def isolated(src, ref, problem: Problem):
        var, det = _flash_own(src, *problem.model_args)[index]
        return var, det + 2.0 * problem.u * np.abs(ref) * (index < 2)  # dQ, dK: the scale's own rounding
    return isolated


class ColumnSumParts(NamedTuple):
    """What the check that dK's columns sum to 0 reads of a chain (specs/backward/checks.py): Σ_i
    (the sd of dS row i's sum)²·Q_i² (d), dSᵀ·Q (M×d) and its GEMM's rounding variance (M×d)."""
    row_sd_q2: np.ndarray
    dsq: np.ndarray
    gemm_var: np.ndarray


class FlashChain(NamedTuple):
    refs: Tuple[np.ndarray, np.ndarray, np.ndarray]   # dQ, dK, dV
    bounds: Tuple[tuple, tuple, tuple]
    floors: Tuple[object, object, object]             # dot.flush_sum of each gradient's GEMM
    column: ColumnSumParts
    forward: Tuple[np.ndarray, np.ndarray]            # the forward's output and lse, from the same tiles


def flash_chain(Q, K, V, dO, scale, head, u, kernel, cache) -> FlashChain:
    """The flash backward's errors from the original inputs: its forward's lse and output errors
    (verify/model/flash.py) reach P (shared along the row) and D; a row tile at a time (on the
    check's device where the head runs there: its inputs moved once, its results back once)."""
    head = as_head(head)

    def compute() -> FlashChain:
        if on_device_of(head):
            fc, forward = to_numpy_all(_chain(*map(to_device, (Q, K, V, dO)), scale, head, u, kernel, HeadCache()))
        else:
            fc, forward = _chain(Q, K, V, dO, scale, head, u, kernel, cache)
        share_forward(cache, Q, K, V, scale, head, u, kernel, forward[:2], forward[2:])
        return fc
    return memo(cache, "flash backward chain", (Q, K, V, dO), (scale, head, u, kernel), compute)


class _TinyProducts(Exception):
    """A tile's smallest entries could make a product near float32's normal range: the flushed
    products' floors are not 0, and their sums over every tile are needed."""


# Below this, a product of two entries comes near float32's normal range (dot.flush_sum's test).
_TINY = FLUSH * 2.0**24


def _chain(Q, K, V, dO, scale, head: HeadVariant, u, kernel, cache) -> Tuple[FlashChain, tuple]:
    """flash_chain's FlashChain, computed, and what its tiles computed of the forward's bounds:
    flash_output's (variance, one-signed part) and flash_lse's row sums (verify/specs/flash.py
    share_forward). The gradients' floors for flushed products (dot.flush_sum) are 0 unless some
    product of their operands' entries comes near float32's normal range: a first pass leaves out
    their sums (three GEMMs a tile) and stops at a tile where one could; a second pass then computes
    them, as every pass did before (the same bounds, bit for bit, either way)."""
    if namespace(Q) is not np:  # (a device computes the floors' sums sooner than it waits for the test)
        return _chain_pass(Q, K, V, dO, scale, head, u, kernel, cache, floors=True)
    try:
        return _chain_pass(Q, K, V, dO, scale, head, u, kernel, cache, floors=False)
    except _TinyProducts:
        return _chain_pass(Q, K, V, dO, scale, head, u, kernel, cache, floors=True)


def _chain_pass(Q, K, V, dO, scale, head: HeadVariant, u, kernel, cache, floors: bool) -> Tuple[FlashChain, tuple]:
    """_chain's pass over the row tiles; floors: with the floors' sums (else _TinyProducts where
    they are not 0)."""
    n, m = Q.shape[0], K.shape[0]
    keys, row_sd_q2, small = KeyGrads.of(n), Total(), [np.inf]
    K_abs = finite_abs(K)
    others = None if floors else (smallest(K_abs), smallest(finite_abs(Q)), smallest(finite_abs(dO)))

    def tile(s, h, c):
        Qt, dOt = s[QUERIES], s[GRAD_OUTPUT]
        dq_ref, dq, G, Pz, row_sd, forward = _chain_tile(Qt, K, V, dOt, scale, h, u, kernel, c, keys)
        if not floors:  # (G·K, Gᵀ·Q, Pzᵀ·dO: each floor is 0 if no product of their entries is tiny)
            small_g = smallest(finite_abs(G))
            if min(small_g * others[0], small_g * others[1], smallest(finite_abs(Pz)) * others[2]) < _TINY:
                raise _TinyProducts
        else:
            keys.dk.add_floor(G, Qt)
            keys.dv.add_floor(Pz, dOt)
        row_sd_q2.add(namespace(Qt).sum(row_sd * row_sd * Qt * Qt, axis=0))
        if not floors:
            return (dq_ref, dq[0], dq[1], 0.0) + forward
        G_abs = finite_abs(G)
        small_g = smallest_now(G_abs)
        in_order(lambda: small.__setitem__(0, least(small[0], small_g)))
        return (dq_ref, dq[0], dq[1], clip(G_abs @ K_abs, high=m * FLUSH)) + forward  # flush_sum(G, K)'s rows
    dq_ref, dq_var, dq_det, dq_flush, *forward = over_queries({QUERIES: Q, KEYS: K, VALUES: V, GRAD_OUTPUT: dO},
                                                               head, cache, tile)
    forward, refs = forward[:-2], tuple(forward[-2:])  # (the forward's bounds, then its output and lse)
    if small[0] * smallest_now(K_abs) >= _TINY:  # (on a device read once the tiles are in)
        dq_flush = zeros(Q, (1, 1))
    dk, dv = keys.bounds(scale, head, u, kernel, cache, head.cap > 0)
    return FlashChain((dq_ref, scale * keys.dk.gemm.sum, keys.dv.gemm.sum), ((dq_var, dq_det), dk, dv),
                      (abs(scale) * dq_flush, abs(scale) * keys.dk.floor(), keys.dv.floor()),
                      ColumnSumParts(row_sd_q2.value, keys.dk.gemm.sum, keys.dk.gemm_var), refs), tuple(forward)


def _chain_tile(Q, K, V, dO, scale, head: HeadVariant, u, kernel, cache, keys: KeyGrads):
    """flash_chain's rows of one tile: (dQ's reference, dQ's bound, G, the kept weights, the sd of
    each dS row sum's error, the forward's bounds: flash_output's two parts and flash_lse's four
    row sums, then the forward's output and lse); dK's and dV's parts into keys."""
    S, p, m, eta_fwd, l_var, s_det = flash_parts(Q, K, scale, head, u, kernel, cache)
    xp = namespace(S)
    finite = finite_logits(S, cache)
    lse = log_sum_exp_rows(S)
    lse_var, lse_det = lse_var_det(Q, K, lse, scale, head, u, kernel, cache)
    # The same weights, dP, D and dS as the stage path's chain (bounds.stage_chain), without its
    # bounds, which the flash chain does not read.
    dropout = int(head.dropout > 0)
    pz = head.dropped(p)
    O = pv(pz, V, cache)  # (the forward's, below)
    d_rows = rowdot_var_later(dO, O, u)  # (D's dot products: on a device read back once the forward's are queued)
    dP = dO @ V.T
    D = d_reference(dO, O)
    dS = ds_reference(p, dP, D, head)
    forward = flash_output_var_det(Q, K, V, scale, head, u, kernel, cache) \
        + forward_sums(Q, K, scale, head, u, kernel, cache) + (O, lse)
    O_det = forward[1]
    acc = kernel.rescale_factor * pv_var(pz, V, u, kernel.flash_product_var + ROUND_VAR * dropout, cache) \
        + ((kernel.final_roundings + dropout) * ROUND_VAR + kernel.div_var) * (u * O) ** 2
    Dv = d_var(p, eta_fwd, l_var, None, dO, head.dropped(dP), D, acc, d_rows())
    D_sd = xp.sqrt(Dv) + xp.sum(xp.abs(dO) * O_det, axis=1, keepdims=True)
    eta = _recomputed_eta(Q, K, S, lse, finite, scale, head, u, kernel, cache)
    lse_mag = _lse_magnitude(lse, head, Q.shape[0], K.shape[0])
    shared_sd = xp.sqrt(lse_var + ROUND_VAR * u * u * lse_mag * lse_mag) + lse_det
    rows = flash_rows(eta, shared_sd * shared_sd, D_sd * D_sd)
    s_det = plus(s_det, _scale_det(Q, K, scale, head, p, finite, u, kernel, cache))  # flash_parts': truncation
    dPv = dp_var(dO, V, u, kernel.flash_product_var, cache, dP)
    cap = chain_cap(Q, K, scale, head, u, kernel, cache, kernel.flash_product_var)
    gb = _flash_grad_bounds((Q, K, dO, p, dP, D, dS), rows, dPv, s_det, scale, head, u, kernel, cache, cap, keys)
    G = gb.grads.G
    row_sd = xp.sqrt(xp.sum(gb.indep * gb.indep, axis=1, keepdims=True)) + xp.sqrt(rows.D)
    return scale * gb.gk, gb.dq, G, pz, row_sd, forward


def flash_chained(index: int):
    def chained(sources, problem: Problem):
        u = problem.u
        Q, K, V, dO = sources
        fc = flash_chain(Q, K, V, dO, *problem.model_args)
        ref, (var, det) = fc.refs[index], fc.bounds[index]
        det = det + 2.0 * u * np.abs(ref) * (index < 2)
        return finish(ref, var, det, fc.floors[index] + FLUSH)
    return chained


def flash_floor(src):
    """Flushed products: none unless the data's products come near float32's normal range."""
    Q, K, V, dO = (finite_abs(src[n]) for n in FLASH_SOURCES[:4])
    tiny = flush_max(dO, V.T)
    if not tiny:
        return 2 * FLUSH
    return 2 * FLUSH + tiny * max(1.0, Q.max(initial=0.0), K.max(initial=0.0), dO.max(initial=0.0)) \
        * (Q.shape[0] + K.shape[0])


__all__ = ["flash_isolated", "flash_own_and_references", "flash_chained", "flash_chain", "flash_floor"]
