"""The FlashAttention backward a query-row tile at a time (verify/model/tiles.py): its float64
reference, what a coarsely printed output or lse moves it by, and the sums over the query rows that
dK's and dV's bounds are made of (QueryGrad), so that no N×M matrix of a head exists whole.

dQ is row-wise: its tiles are stacked. dK = scale·Gᵀ·Q and dV = (P∘Z/(1 − p))ᵀ·dO sum over the
query rows: each tile adds its part. A head of one tile is the whole head (flash_backward).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np

from ...model.arrays import add_scaled, clip, namespace, to_device, to_numpy
from ...model.backward import transposed_gemm_var
from ...model.dot import expected_var_weights
from ...model.rounding import FLUSH, HeadCache, finite_abs
from ...model.scores import HeadVariant
from ...model.tiles import MmaCarry, QuerySum, Total, in_order, least, over_rows, rows_of, smallest_now, tiled
from ...stages import FLASH_LSE, FLASH_OUTPUT, GRAD_OUTPUT, KEYS, QUERIES, VALUES
from ..base import Problem
from ..flash import on_device_of
from .reference import FLASH_SOURCES, flash_terms

# The rows of the flash backward's sources (Q, dO, the output and lse); K and V are the keys'. A
# pass may add rows of its own under ROW_TERMS (what it computes once for the whole head, N×1).
ROW_TERMS = "row terms"
ROW_SOURCES = (QUERIES, GRAD_OUTPUT, FLASH_OUTPUT, FLASH_LSE, ROW_TERMS)


def tile_sources(src, rows: Optional[slice]):
    """The flash backward's sources with the query rows of a tile (src itself for the whole head)."""
    if rows is None:
        return src
    return {**src, **{n: src[n][rows] for n in ROW_SOURCES if n in src}}


def head_shape(src) -> Tuple[int, int, int]:
    """(N, M, the narrower of d_k and d_v): what the head's row tiles are chosen by."""
    Q, V = np.shape(src[QUERIES]), np.shape(src[VALUES])
    return Q[0], np.shape(src[KEYS])[0], min(Q[1], V[1])


def over_queries(src, head: HeadVariant, cache: Optional[HeadCache], compute) -> tuple:
    """compute(the tile's sources, its variant, a cache) over the row tiles (over_rows)."""
    n, m, d = head_shape(src)
    return over_rows(n, m, d, head, cache, lambda r, h, c: compute(tile_sources(src, r), h, c))


# The last head's gradients: the chain asks for dQ, dK and dV in turn, each from the same sources.
_LAST: Dict[str, tuple] = {}


def flash_gradients(src, scale: float, head: HeadVariant) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dQ, dK, dV) of the FlashAttention backward from its sources, a row tile at a time."""
    src = {n: np.asarray(src[n], np.float64) for n in FLASH_SOURCES}
    key = (tuple(id(src[n]) for n in FLASH_SOURCES), scale, head)
    last = _LAST.get("grads")
    if last is not None and last[0] == key:
        return last[2]
    return remember_gradients(src, scale, head, _gradients(src, scale, head))


def remember_gradients(src, scale: float, head: HeadVariant, out: tuple) -> tuple:
    """Keep `out`, (dQ, dK, dV) from the sources src (float64 NumPy arrays), as the last head's
    gradients (another pass over the row tiles computed them: verify/specs/backward/flash_bounds.py
    flash_own_and_references); returns it."""
    key = (tuple(id(src[n]) for n in FLASH_SOURCES), scale, head)
    _LAST["grads"] = (key, src, out)  # (src: its arrays alive, so that their ids stay theirs)
    return out


class GradientSums:
    """flash_gradients' dK and dV, summed over the row tiles (dQ's rows are each tile's own)."""

    def __init__(self) -> None:
        self.dK, self.dV = Total(), Total()

    def add(self, s, h: HeadVariant, scale: float, P, G) -> np.ndarray:
        """A tile's parts (its sources s, variant h, weights P and G = dS through the cap); returns
        its rows of dQ."""
        self.dK.add(G.T @ s[QUERIES])
        self.dV.add(h.dropped(P).T @ s[GRAD_OUTPUT])
        return scale * G @ s[KEYS]

    def gradients(self, dQ, scale: float) -> tuple:
        return dQ, scale * self.dK.value, self.dV.value


def _gradients(src, scale: float, head: HeadVariant):
    """flash_gradients' (dQ, dK, dV), on the check's device where the head's variant runs there
    (its sources moved once, the three gradients back once: verify/specs/flash.py on_device_of)."""
    device = on_device_of(head)
    if device:
        src = {n: to_device(x) for n, x in src.items()}
    K, sums = src[KEYS], GradientSums()

    def tile(s, h, c):
        P, _, _, _, G = flash_terms(s, scale, h.hidden_like(K, s[QUERIES].shape[0], K.shape[0]), head=h)
        return (sums.add(s, h, scale, P, G),)
    dQ, = over_queries(src, head, None, tile)
    out = sums.gradients(dQ, scale)
    return tuple(to_numpy(x) for x in out) if device else out


def flash_reference(index: int):
    """The reference of the flash gradient at `index` of (dQ, dK, dV) (a StageSpec's)."""
    def reference(src, problem: Problem):
        return flash_gradients(src, problem.scale, problem.head)[index]
    return reference


def flash_moves(src, q, scale: float, head: HeadVariant) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """How far dQ, dK, dV move when the output or lse is known only to within its quantum q: the
    lse's through dS and P, the output's through D."""
    src = {n: np.asarray(src[n], np.float64) for n in FLASH_SOURCES}
    K, dK, dV = src[KEYS], Total(), Total()
    q = {n: np.broadcast_to(q.get(n, 0.0), np.shape(src[n])) for n in (FLASH_OUTPUT, FLASH_LSE)}

    def tile(r, h, c):
        s = tile_sources(src, r)
        Q, dO = s[QUERIES], s[GRAD_OUTPUT]
        q_lse, q_O = rows_of(q[FLASH_LSE], r), rows_of(q[FLASH_OUTPUT], r)
        P, _, _, dS, _ = flash_terms(s, scale, h.hidden(Q.shape[0], K.shape[0]), head=h)
        ds_q = np.abs(dS) * q_lse + P * (np.abs(dO) * q_O).sum(axis=1, keepdims=True)
        dV.add(h.dropped(P * q_lse).T @ np.abs(dO))
        if h.cap > 0:
            ds_q = ds_q * h.cap_slope((Q @ K.T) * scale)
        dK.add(abs(scale) * ds_q.T @ np.abs(Q))
        return (abs(scale) * ds_q @ np.abs(K),)
    n, m, d = head_shape(src)
    dQ, = over_rows(n, m, d, head, None, tile)
    return dQ, dK.value, dV.value


class QueryGrad:
    """The bound of a gradient summed over the query rows, Xᵀ·Y (dK: X = dS through the cap, Y =
    Q; dV: X = the kept weights, Y = dO), a tile at a time: X's errors (standard deviations E,
    independent across queries) through Y², the GEMM's roundings (product_var: each product's, in
    u² units), the one-signed parts through |Y|, tensor-core truncation, and the flushed terms
    (model/backward.py grad_over_queries_var). apart: the GEMM's rounding variance is read on its
    own (gemm_var, by the check that dK's columns sum to 0)."""

    def __init__(self, n: int, u: float, product_var: float, apart: bool = False) -> None:
        self.err, self.gemm, self.det, self.mma = Total(), QuerySum(n), Total(), MmaCarry()
        self.n, self.u, self.product_var, self.gemm_var = n, u, product_var, None
        self.small_x = self.small_y = np.inf
        self.flushed = Total()
        # Over several tiles the GEMM's variance is a·Σ(X²)ᵀ·Y² + b·(Σ Xᵀ·Y)² (the expected model):
        # where it is not read apart, its first part joins the errors' GEMM, (E² + a·X²)ᵀ·Y², one
        # GEMM a tile fewer.
        self.weights = None if apart else expected_var_weights(n, u, product_var)
        self.joined = False

    def add(self, X, E, Y, det_x, mma: bool) -> None:
        Y2 = Y * Y
        if self.weights is not None and tiled():
            self.joined = True
            self.err.add(add_scaled(E * E, X * X, self.weights[0]).T @ Y2)
            self.gemm.add_sum(X, Y)
        else:
            self.err.add((E * E).T @ Y2)
            self.gemm.add(X, Y)
        if det_x is not None:  # (None: no one-signed part)
            self.det.add(det_x.T @ namespace(Y).abs(Y))
        if mma:
            self.mma.add(X, Y)

    def add_lost(self, lost_x, Y) -> None:
        """The flushed entries' part of the one-signed bound."""
        self.det.add(lost_x.T @ namespace(Y).abs(Y))

    def add_floor(self, X, Y) -> None:
        """X and Y's part of dot.flush_sum(Xᵀ, Y) (the chained floor)."""
        X, Y = finite_abs(X), finite_abs(Y)
        small_x, small_y = smallest_now(X), smallest_now(Y)
        in_order(lambda: self._smallest(small_x, small_y))
        self.flushed.add(X.T @ Y)

    def _smallest(self, x, y) -> None:
        self.small_x, self.small_y = least(self.small_x, x), least(self.small_y, y)

    def floor(self):
        if self.small_x * self.small_y >= FLUSH * 2.0**24:
            return np.zeros((1, 1))
        return clip(self.flushed.value, high=self.n * FLUSH)

    def var(self, cache, what: str) -> np.ndarray:
        """The variance once every tile is in (its GEMM's part kept as gemm_var, unless joined)."""
        if self.joined:
            total = self.gemm.sum
            return self.err.value + self.weights[1] * (total * total)
        self.gemm_var = self.gemm.var(self.u, self.product_var,
                                      lambda X, Y: transposed_gemm_var(X, Y, self.u, cache, what, self.product_var))
        return self.err.value + self.gemm_var


__all__ = ["flash_gradients", "remember_gradients", "GradientSums", "flash_reference", "flash_moves", "over_queries", "tile_sources", "QueryGrad", "ROW_SOURCES", "ROW_TERMS"]
