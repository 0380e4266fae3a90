"""Dot products: the variance of a float32 sum's roundings from its partial sums, over the summation
orders GEMMs use; tensor-core truncation; underflow of tiny products.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from .kernels import MMA_K
from .rounding import FLUSH, ROUND_VAR, ULP_IN_U, HeadCache, finite_abs, memo, rounding_var, step_var


# Above this many multiply-adds per head the exact partial-sum energy (chunked cumsum) costs too
# much; the model then uses its expectation over random summation orders, inflated by
# ENERGY_FALLBACK_FACTOR to cover orders whose partial sums wander further than average.
# 1 << 24: dot_var enumerates ~20 summation orders for K = 4096 (docs/tolerances.md, "History").
ENERGY_EXACT_MAX_MACS = 1 << 24


ENERGY_FALLBACK_FACTOR = 8.0


_CHUNK_ELEMS = 1 << 21


# Structured summation orders dot_var covers besides index and reverse order: where the index-order
# walk of partial sums cancels early, a strided or blocked order (OpenBLAS's two FMA accumulators,
# split-K blocks) keeps summing at the magnitude of one half, with up to ~2× the variance, and the
# mean over random orders cannot stand in for them without losing tightness (the measurements are
# in docs/tolerances.md, "History").
DOT_LANES = (2, 4, 8, 16, 32)   # L interleaved accumulators (SIMD lanes, unrolled FMA chains)


DOT_MIN_BLOCK = 8               # index-order blocks of 8, 16, … K/2 (k-tiles restarted, split-K)


DOT_SPLITS = (2, 3, 4, 5, 6, 7, 8)  # split-K into n equal chunks (blocks of ⌈K/n⌉): 3 splits reached 0.78


def _strided_var(t: np.ndarray, L: int, u: float, blocked: bool) -> np.ndarray:
    """Σ var(rounding) of the sum over axis 1 of t (r, K, C) done as L interleaved accumulators
    (k ≡ i mod L), or (blocked) as blocks of L consecutive terms each summed from 0; then the L
    lane totals (the K/L block totals) added in order."""
    r, K, C = t.shape
    Kp = -(-K // L) * L
    if Kp > K:
        t = np.concatenate([t, np.zeros((r, Kp - K, C))], axis=1)
    tr = t.reshape(r, Kp // L, L, C)
    axis = 2 if blocked else 1
    part = np.cumsum(tr, axis=axis)
    var = step_var(part, tr, u).sum(axis=(1, 2))
    totals = part[:, :, -1] if blocked else part[:, -1]
    var += step_var(np.cumsum(totals, axis=1), totals, u).sum(axis=1)
    return var


def dot_var(A: np.ndarray, B: np.ndarray, u: float, product_var: float = ROUND_VAR) -> np.ndarray:
    """Variance of the float32 error of each element of A @ B (R×K times K×C), from its products
    t_k and partial sums s_k: Σ_k var(rounding of s_k), the largest over the summation orders
    float32 GEMMs use: index order, reverse order, DOT_LANES interleaved accumulators, index-order
    blocks of every power of two from DOT_MIN_BLOCK to K/2 and of ⌈K/n⌉ (split-K, n in DOT_SPLITS;
    each block summed from 0, then the block sums), and the expectation over random orders (for the orders not enumerated); plus
    product_var·u²·Σ_k t_k² for the products' own rounding (an upper bound when FMA fuses them:
    an FMA's one rounding is that of the new partial sum, counted above)."""
    A = np.asarray(A, dtype=np.float64)
    B = np.asarray(B, dtype=np.float64)
    R, K = A.shape
    C = B.shape[1]
    if R * K * C > ENERGY_EXACT_MAX_MACS:
        return _expected_var(A, B, u, product_var)
    blocks = {DOT_MIN_BLOCK << j for j in range(K.bit_length()) if DOT_MIN_BLOCK << j <= K // 2}
    blocks |= {-(-K // n) for n in DOT_SPLITS if DOT_MIN_BLOCK <= -(-K // n) < K}
    structured = [(L, False) for L in DOT_LANES if L < K] + [(L, True) for L in sorted(blocks)]
    out = np.empty((R, C))
    rows = max(1, _CHUNK_ELEMS // max(1, K * C))
    for r0 in range(0, R, rows):
        t = A[r0:r0 + rows, :, None] * B[None, :, :]          # (r, K, C) products
        s = np.cumsum(t, axis=1)                               # index-order partial sums
        total = s[:, -1:, :].copy()  # a copy: s is overwritten below
        t2 = t * t
        var = step_var(s, t, u, t2).sum(axis=1)
        # Reverse order: t_K, t_K + t_(K-1), …, i.e. total - s + t (s is not needed after this).
        np.subtract(total, s, out=s)
        s += t
        np.maximum(var, step_var(s, t, u, t2).sum(axis=1), out=var)
        del s
        for L, blocked in structured:
            np.maximum(var, _strided_var(t, L, u, blocked), out=var)
        # Random order: E[s_k²] averaged over k is Σt²/6 + S²/3 (sampling without replacement).
        mean_s2 = t2.sum(axis=1, keepdims=True) / 6.0 + total * total / 3.0
        np.maximum(var, np.minimum(ROUND_VAR * u * u * mean_s2, t2).sum(axis=1), out=var)
        # Products: one rounding each (its binade's ulp²/12), scaled for split-precision kernels.
        var += rounding_var(t, u).sum(axis=1) * (product_var / ROUND_VAR)
        out[r0:r0 + rows] = var
    return out


def _expected_var(A: np.ndarray, B: np.ndarray, u: float, product_var: float) -> np.ndarray:
    """For very large heads: E[Σ_k s_k²] over random orders, (K+1)(Σt²/6 + S²/3), inflated by
    ENERGY_FALLBACK_FACTOR for orders whose partial sums wander further than average."""
    K = A.shape[1]
    S = A @ B
    T2 = (A * A) @ (B * B)
    # In place, in this grouping: u·u·(ROUND_VAR·energy + product_var·T2),
    # energy = ENERGY_FALLBACK_FACTOR·(K + 1)·(T2/6 + S·S/3).
    var = np.divide(T2, 6.0)
    np.multiply(S, S, out=S)
    S /= 3.0
    var += S
    var *= ENERGY_FALLBACK_FACTOR * (K + 1)
    var *= ROUND_VAR
    T2 *= product_var
    var += T2
    var *= u * u
    return var


def mma_truncation_det(A: np.ndarray, B: np.ndarray, u: float, passes: int) -> np.ndarray:
    """Bound on the one-signed error of A @ B accumulated by tensor-core mma (truncating): each of
    `passes` mma per MMA_K-long chunk loses < 1 ulp (≤ 2u·|running sum|)."""
    partial = np.zeros((A.shape[0], B.shape[1]))
    total = np.zeros_like(partial)
    for k0 in range(0, A.shape[1], MMA_K):
        partial += A[:, k0:k0 + MMA_K] @ B[k0:k0 + MMA_K]
        total += np.abs(partial)
    return passes * ULP_IN_U * u * total


def flush_sum(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """Bound on what flushing tiny products and partial sums of A @ B to zero can cost: none when
    no product of non-zero entries comes near float32's normal range, else min(Σ|a·b|, K·FLUSH)."""
    A, B = finite_abs(A), finite_abs(B)

    def smallest(x):
        nz = x[x != 0]
        return float(nz.min()) if nz.size else np.inf
    if smallest(A) * smallest(B) >= FLUSH * 2.0**24:
        return np.zeros((1, 1))
    return np.minimum(A @ B, A.shape[1] * FLUSH)


def qk_var(Q: np.ndarray, K: np.ndarray, u: float, product_var: float,
            cache: Optional[HeadCache]) -> np.ndarray:
    """dot_var of Q·Kᵀ (keyed on Q and K: K.T is a new view object at every call)."""
    return memo(cache, "QK var", (Q, K), (u, product_var), lambda: dot_var(Q, K.T, u, product_var))


def pv_var(p: np.ndarray, V: np.ndarray, u: float, product_var: float,
            cache: Optional[HeadCache]) -> np.ndarray:
    return memo(cache, "PV var", (p, V), (u, product_var), lambda: dot_var(p, V, u, product_var))


def pv(p: np.ndarray, V: np.ndarray, cache: Optional[HeadCache]) -> np.ndarray:
    return memo(cache, "PV", (p, V), (), lambda: p @ V)
