"""The flash row sum l = Σ_j exp(S_j − m) in a known kernel's order: key tiles of a fixed width, each
summed from 0 relative to the running maximum, then added to the running sum after rescaling it.

A program of unknown order is modelled in index order (softmax.rowsum_rel_var), whose partial sums
grow to l: M roundings at the magnitude of l, σ ≈ u·√(0.18·M/3). A kernel that sums each tile of T
keys from 0 first makes T roundings at the magnitude of one tile's sum and M/T at the magnitude of
l: for M = 32768 and T = 64, about 8× less variance. run.toml names the kernel (its flash_kernel);
only an unsplit kernel whose tile order is known (kernels.Kernel.row_sum_tile) takes this model.
"""
from __future__ import annotations

import numpy as np

from typing import Optional

from .arrays import like, namespace, to_numpy
from .kernels import Kernel
from .rounding import HeadCache, memo, rounding_var, step_var
from .softmax import EqualTerms, correlated_sum, rowsum_rel_var


# Rows per block: a block's few temporaries (each rows × M) stay within a few MB.
_ROW_BLOCK_ELEMS = 1 << 18


def flash_rowsum_var(p: np.ndarray, u: float, kernel: Kernel, cache: Optional[HeadCache]) -> np.ndarray:
    """Relative variance (N×1) of the flash row sum l, one more rounding per 8 keys for the online
    softmax's rescales (kernel.rescale_factor): in the kernel's tile order where run.toml names a
    kernel whose order is known, else softmax.rowsum_rel_var's index or reverse order."""
    if not kernel.row_sum_tile:
        return rowsum_rel_var(p, u, kernel.rescale_factor, cache)
    tile, exp_var = kernel.row_sum_tile, kernel.exp_var
    steps = memo(cache, "tiled rowsum", (p,), (u, tile, exp_var), lambda: tiled_rowsum_var(p, u, tile, exp_var))
    return (kernel.rescale_factor * steps)[:, None]


def tiled_rowsum_var(p: np.ndarray, u: float, tile: int, exp_var: float) -> np.ndarray:
    """Σ of the rounding variances of each row's l (N,), relative to l², for the order of a kernel
    that walks the keys in tiles of `tile` from key 0 (the CPU flash kernel's online softmax):
      per tile j, with g_j the running maximum of e = exp(S − m_final) over the keys up to its end
      (the kernel works in units of exp(S − m_j), e/g_j), r_j = Σ_tile e/g_j summed from 0 (one
      rounding per key, at the magnitude of the tile's partial sums);
      l_j = α_j·l_(j−1) + r_j, α_j = exp(m_(j−1) − m_j): one rounding of the sum, and where the
      maximum moved (α_j ≠ 1; exp(0) = 1 is exact) the rounding of the product, α_j's own error
      (exp's, Kernel.exp_var u², and the subtraction's, at most u·|m_(j−1) − m_j| relative),
      each at the magnitude of l_(j−1).
    Each rounding is bounded as rounding.step_var bounds it (its binade in the kernel's units, never
    more than the smaller addend); the roundings of adding equal terms count as one error repeated
    (softmax.correlated_sum), in the tiles and in the running sum alike."""
    if namespace(p) is not np:  # a device's row tile: this model's few passes in NumPy
        return like(p, tiled_rowsum_var(to_numpy(p), u, tile, exp_var))
    N, M = p.shape
    J = max(1, -(-M // tile))
    rows = max(1, _ROW_BLOCK_ELEMS // (J * tile))
    out = np.empty(N)
    for r0 in range(0, N, rows):
        pb = p[r0:r0 + rows]
        n = pb.shape[0]
        top = pb.max(axis=1, initial=0.0)
        l = 1.0 / np.where(top > 0, top, 1.0)  # e = p·l, 1 at the row max; a row of no key sums nothing
        e = np.zeros((n, J * tile))
        np.multiply(pb, l[:, None], out=e[:, :M])
        et = e.reshape(n, J, tile)
        g = np.maximum.accumulate(et.max(axis=2), axis=1)     # n×J running maximum after each tile
        g2 = g * g
        scaled = et / np.where(g > 0, g, 1.0)[:, :, None]     # the kernel's terms, tile by tile
        partial = np.cumsum(scaled, axis=2)
        inner, lost = _additions(partial, scaled, u)
        inner *= g2[:, :, None]                               # in units of the final e
        total = correlated_sum(inner.reshape(n, J * tile)[:, :M], EqualTerms(e[:, :M].astype(np.float32)))
        dropped = (lost * g[:, :, None]).sum(axis=(1, 2))
        if J > 1:
            r = partial[:, :, -1]                             # the tiles' sums, kernel units
            L = np.cumsum(et.sum(axis=2), axis=1)              # running sums, units of the final e
            g_now, g_before, before = g[:, 1:], g[:, :-1], L[:, :-1]
            inv = 1.0 / np.where(g_now > 0, g_now, 1.0)
            adds, lost = _additions(L[:, 1:] * inv, r[:, 1:], u)
            adds *= g2[:, 1:]
            dropped += (lost * g_now).sum(axis=1)
            moved = (g_now != g_before) & (before > 0)
            shift = np.log(np.where(moved, g_now / np.where(g_before > 0, g_before, 1.0), 1.0))
            rescale = (rounding_var(before * inv, u) * g2[:, 1:]
                       + before * before * (exp_var * u * u + (u * shift) ** 2 / 3.0))
            adds += np.where(moved, rescale, 0.0)
            total += correlated_sum(adds, EqualTerms(r[:, 1:].astype(np.float32)))
        out[r0:r0 + n] = (total + dropped * dropped) / (l * l)
    return out


def _additions(partial: np.ndarray, t: np.ndarray, u: float):
    """(variance, dropped) of each addition s = s_prev + t of positive terms: an addend below half
    an ulp of s_prev is dropped whole, an error of exactly −t, the same sign every time (counted as
    one error, their sum); any other rounds as rounding.step_var bounds it (0 there)."""
    prev = partial - t
    lost = (prev > 0) & (t * t < 3.0 * rounding_var(prev, u))
    return np.where(lost, 0.0, step_var(partial, t, u)), np.where(lost, t, 0.0)


__all__ = ["flash_rowsum_var", "tiled_rowsum_var"]
