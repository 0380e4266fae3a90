"""The FlashAttention backward's chained bounds (flash_dQ, flash_dK, flash_dV from Q, K, V and dO:
the forward's lse and output errors reaching P and D), in one pass over the row tiles that also
computes the forward's bounds and references (verify/specs/flash.py share_forward), and, where the
check asks, the isolated bounds and references from the program's own flash_output and flash_lse
(flash_bounds.py own_tile): the two share each tile's Q·Kᵀ, logits, dP and their variances.
"""
from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Tuple

import numpy as np

from ...model.arrays import clip, namespace, to_device, to_numpy_all, zeros
from ...model.attention import log_sum_exp_rows
from ...model.backward import d_var, flash_rows
from ...model.dot import pv, pv_var, rowdot_var_later
from ...model.flash import flash_output_var_det, flash_parts, plus, times_transposed
from ...model.rounding import FLUSH, ROUND_VAR, HeadCache, finish, finite_abs, memo
from ...model.scores import HeadVariant, as_head
from ...model.softmax import finite_logits
from ...model.tiles import Total, in_order, least, smallest, smallest_now
from ...stages import FLASH_LSE, FLASH_OUTPUT, GRAD_OUTPUT, KEYS, QUERIES, VALUES
from ..base import Problem
from ..flash import forward_sums, lse_var_det, on_device_of, share_forward
from .bounds import chain_cap, dp_var
from .flash_bounds import (KeyGrads, flash_grad_bounds, lse_magnitude, own_bounds, own_row_terms, own_tile,
                           recomputed_eta, remember_own, scale_det)
from .flash_tiles import ROW_TERMS, over_queries
from .reference import FLASH_SOURCES, d_reference, ds_reference


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


def flash_chain(Q, K, V, dO, scale, head, u, kernel, cache, own: Optional[Dict[str, np.ndarray]] = None) -> FlashChain:
    """The flash backward's errors from the original inputs: its forward's lse and output errors
    (verify/model/flash.py) reach P (shared along the row) and D; a row tile at a time (on the
    check's device where the head runs there: its inputs moved once, its results back once). own:
    the isolated check's sources (FLASH_SOURCES, float64; its Q, K, V and dO these very arrays),
    whose bounds and references the same pass computes and keeps for it (flash_bounds.py)."""
    head = as_head(head)
    # (Not on a device: there the shared products are float64 GEMMs its tensor cores make light of,
    # and a head at 131072 keys took as long either way with 3 GiB more of the device's memory.)
    joint = own is not None and not on_device_of(head) and all(
        own[n] is x for n, x in zip(FLASH_SOURCES, (Q, K, V, dO)))

    def compute() -> FlashChain:
        if on_device_of(head):
            fc, forward, isolated = to_numpy_all(_chain(*map(to_device, (Q, K, V, dO)), scale, head, u, kernel,
                                                        HeadCache()))
        else:
            extra = {FLASH_OUTPUT: own[FLASH_OUTPUT], FLASH_LSE: own[FLASH_LSE],
                     ROW_TERMS: own_row_terms(own, u)} if joint else None
            fc, forward, isolated = _chain(Q, K, V, dO, scale, head, u, kernel, cache, extra)
        share_forward(cache, Q, K, V, scale, head, u, kernel, forward[:2], forward[2:])
        if isolated is not None:
            remember_own(own, scale, head, u, kernel, cache, *isolated)
        return fc
    return memo(cache, "flash backward chain", (Q, K, V, dO), (scale, head, u, kernel), compute)


class _TinyProducts(Exception):
    """A tile's smallest entries could make a product near float32's normal range: the flushed
    products' floors are not 0, and their sums over every tile are needed."""


# Below this, a product of two entries comes near float32's normal range (dot.flush_sum's test).
_TINY = FLUSH * 2.0**24


def _chain(Q, K, V, dO, scale, head: HeadVariant, u, kernel, cache, own=None) -> Tuple[FlashChain, tuple, tuple]:
    """flash_chain's FlashChain, computed, what its tiles computed of the forward's bounds:
    flash_output's (variance, one-signed part) and flash_lse's row sums (verify/specs/flash.py
    share_forward), and with own (the program's output, lse and D's row terms) the isolated
    bounds and references (flash_bounds.own_bounds; else None). The gradients' floors for flushed
    products (dot.flush_sum) are 0 unless some product of their operands' entries comes near
    float32's normal range: a first pass leaves out their sums (three GEMMs a tile) and stops at a
    tile where one could; a second pass then computes them, as every pass did before (the same
    bounds, bit for bit, either way)."""
    if namespace(Q) is not np:  # (a device computes the floors' sums sooner than it waits for the test)
        return _chain_pass(Q, K, V, dO, scale, head, u, kernel, cache, floors=True, own=own)
    try:
        return _chain_pass(Q, K, V, dO, scale, head, u, kernel, cache, floors=False, own=own)
    except _TinyProducts:
        return _chain_pass(Q, K, V, dO, scale, head, u, kernel, cache, floors=True, own=own)


def _chain_pass(Q, K, V, dO, scale, head: HeadVariant, u, kernel, cache, floors: bool,
                own=None) -> Tuple[FlashChain, tuple, tuple]:
    """_chain's pass over the row tiles; floors: with the floors' sums (else _TinyProducts where
    they are not 0)."""
    n, m = Q.shape[0], K.shape[0]
    keys, row_sd_q2, small = KeyGrads.of(n, head, u, kernel, column_sums=True), Total(), [np.inf]
    own_keys = None if own is None else KeyGrads.of(n, head, u, kernel)
    K_abs = finite_abs(K)
    others = None if floors else (smallest(K_abs), smallest(finite_abs(Q)), smallest(finite_abs(dO)))

    def tile(s, h, c):
        Qt, dOt = s[QUERIES], s[GRAD_OUTPUT]
        dq_ref, dq, G, Pz, row_sd, forward = _chain_tile(Qt, K, V, dOt, scale, h, u, kernel, c, keys)
        if not floors:  # (G·K, Gᵀ·Q, Pzᵀ·dO: each floor is 0 if no product of their entries is tiny)
            small_g = smallest(finite_abs(G))
            if min(small_g * others[0], small_g * others[1], smallest(finite_abs(Pz)) * others[2]) < _TINY:
                raise _TinyProducts
        if own is not None:  # (the isolated pass's rows last: its dQ's bound and reference)
            forward = forward + own_tile(s, scale, h, u, kernel, c, own_keys, True)
        if floors:
            keys.dk.add_floor(G, Qt)
            keys.dv.add_floor(Pz, dOt)
        row_sd_q2.add(namespace(Qt).sum(row_sd * row_sd * Qt * Qt, axis=0))
        if not floors:
            return (dq_ref, dq[0], dq[1], 0.0) + forward
        G_abs = finite_abs(G)
        small_g = smallest_now(G_abs)
        in_order(lambda: small.__setitem__(0, least(small[0], small_g)))
        return (dq_ref, dq[0], dq[1], clip(G_abs @ K_abs, high=m * FLUSH)) + forward  # flush_sum(G, K)'s rows
    sources = {QUERIES: Q, KEYS: K, VALUES: V, GRAD_OUTPUT: dO, **(own or {})}
    dq_ref, dq_var, dq_det, dq_flush, *forward = over_queries(sources, head, cache, tile)
    isolated = None
    if own is not None:
        isolated, forward = own_bounds(forward[-3:], own_keys, scale, head, u, kernel, cache), forward[:-3]
    forward, refs = forward[:-2], tuple(forward[-2:])  # (the forward's bounds, then its output and lse)
    if small[0] * smallest_now(K_abs) >= _TINY:  # (on a device read once the tiles are in)
        dq_flush = zeros(Q, (1, 1))
    dk, dv = keys.bounds(scale, head, u, kernel, cache)
    return FlashChain((dq_ref, scale * keys.dk.gemm.sum, keys.dv.gemm.sum), ((dq_var, dq_det), dk, dv),
                      (abs(scale) * dq_flush, abs(scale) * keys.dk.floor(), keys.dv.floor()),
                      ColumnSumParts(row_sd_q2.value, keys.dk.gemm.sum, keys.dk.gemm_var), refs), \
        tuple(forward), isolated


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
    dP = times_transposed(dO, V, cache)
    D = d_reference(dO, O)
    dS = ds_reference(p, dP, D, head)
    forward = flash_output_var_det(Q, K, V, scale, head, u, kernel, cache) \
        + forward_sums(Q, K, scale, head, u, kernel, cache) + (O, lse)
    O_det = forward[1]
    acc = kernel.rescale_factor * pv_var(pz, V, u, kernel.flash_product_var + ROUND_VAR * dropout, cache) \
        + ((kernel.final_roundings + dropout) * ROUND_VAR + kernel.div_var) * (u * O) ** 2
    Dv = d_var(p, eta_fwd, l_var, None, dO, head.dropped(dP), D, acc, d_rows())
    D_sd = xp.sqrt(Dv) + xp.sum(xp.abs(dO) * O_det, axis=1, keepdims=True)
    eta = recomputed_eta(Q, K, S, lse, finite, scale, head, u, kernel, cache)
    lse_mag = lse_magnitude(lse, head, Q.shape[0], K.shape[0])
    shared_sd = xp.sqrt(lse_var + ROUND_VAR * u * u * lse_mag * lse_mag) + lse_det
    rows = flash_rows(eta, shared_sd * shared_sd, D_sd * D_sd)
    s_det = plus(s_det, scale_det(Q, K, scale, head, p, finite, u, kernel, cache))  # flash_parts': truncation
    dPv = dp_var(dO, V, u, kernel.flash_product_var, cache, dP)
    cap = chain_cap(Q, K, scale, head, u, kernel, cache, kernel.flash_product_var)
    gb = flash_grad_bounds((Q, K, dO, p, dP, D, dS), rows, dPv, s_det, scale, head, u, kernel, cache, cap, keys)
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




__all__ = ["flash_chain", "flash_chained", "ColumnSumParts", "FlashChain"]
