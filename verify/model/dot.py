"""Dot products: the variance of a float32 sum's roundings from its partial sums, over the summation
orders GEMMs use; tensor-core truncation; underflow of tiny products.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import numpy as np

from .arrays import float64, like, namespace, to_numpy, to_numpy_later
from .mma import mma_running_sums, mma_truncation_det  # noqa: F401 (the dot products' truncation model)
from .rounding import FLUSH, ROUND_VAR, HeadCache, binade, binade_sq, finite_abs, memo


# Above this many multiply-adds per head's product the exact partial-sum energy costs too much time
# (its memory is bounded by blocks, below); the model then takes ENERGY_FALLBACK_FACTOR × the mean
# over random orders, ~2.8× looser (docs/performance.md, "Power on long rows"). At 1 << 26 two heads
# at N = M = 1024, d = 64 checked in 107 s against 4.5 s at 1 << 24 (docs/tolerances.md).
ENERGY_EXACT_MAX_MACS = 1 << 24
ENERGY_FALLBACK_FACTOR = 8.0


# Products per block of the exact path: large enough that each numpy call does real work, small
# enough that a block's dozen buffers stay in cache (docs/journal.md: the sizes timed).
_CHUNK_ELEMS = 1 << 16

# The most products of a block where a row's K×C products are more: B's columns then come in blocks
# (at least 4 columns, ~32·K bytes a buffer at the least); each column is its own sum: the same bits.
_MAX_BLOCK_ELEMS = 1 << 20


# Structured summation orders dot_var covers besides index and reverse order: where the index-order
# walk of partial sums cancels early, a strided or blocked order (OpenBLAS's two FMA accumulators,
# split-K blocks) keeps summing at the magnitude of one half, with up to ~2× the variance, and the
# mean over random orders cannot stand in for them without losing tightness (the measurements are
# in docs/tolerances.md, "Measurements behind the model").
DOT_LANES = (2, 4, 8, 16, 32)   # L interleaved accumulators (SIMD lanes, unrolled FMA chains)
DOT_MIN_BLOCK = 8               # index-order blocks of 8, 16, … K/2 (k-tiles restarted, split-K)
DOT_SPLITS = (2, 3, 4, 5, 6, 7, 8)  # split-K into n equal chunks (blocks of ⌈K/n⌉): 3 splits reached 0.78


# While a row tile of a head is computed (verify/model/tiles.py), the head's query rows: a dot
# product's exact or expected variance is chosen by the whole head's size, so that a tile's
# bounds are the rows of the whole head's.
_HEAD_ROWS: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar("head_rows", default=None)


@contextlib.contextmanager
def head_rows(n: int):
    """Within: the row-tiled GEMMs (A's rows a tile of the head's n rows) size as the head's."""
    token = _HEAD_ROWS.set(n)
    try:
        yield
    finally:
        _HEAD_ROWS.reset(token)


def _rows(R: int) -> int:
    """The rows of the GEMM whose size decides its model: the head's, within a row tile."""
    whole = _HEAD_ROWS.get()
    return R if whole is None else whole


def exact_energy(R: int, K: int, C: int) -> bool:
    """Whether dot_var takes the exact partial sums for an R×K by K×C product (else their
    expectation over random orders)."""
    return R * K * C <= ENERGY_EXACT_MAX_MACS


class _Orders(NamedTuple):
    lanes: Tuple[int, ...]    # interleaved accumulators
    blocks: Tuple[int, ...]   # block lengths
    padded: int               # the longest sum a lane or block order walks (zeros past K)


@functools.lru_cache(maxsize=None)
def _orders(K: int) -> _Orders:
    """The structured summation orders of a sum of K terms."""
    blocks = {DOT_MIN_BLOCK << j for j in range(K.bit_length()) if DOT_MIN_BLOCK << j <= K // 2}
    blocks |= {-(-K // n) for n in DOT_SPLITS if DOT_MIN_BLOCK <= -(-K // n) < K}
    lanes = tuple(L for L in DOT_LANES if L < K)
    padded = max([K] + [-(-K // n) * n for n in (*blocks, *lanes)])
    return _Orders(lanes, tuple(sorted(blocks)), padded)


# The exact path works in units of u²/3, the variance of a rounding in the binade [1, 2): a
# rounding of x in [2^e, 2^(e+1)) then has variance 4^e (rounding.binade_sq). Partial sums are
# formed in float64; their binades, squares and the sums of their variances in float32, each sum
# first scaled by the power of two that brings its largest product into [1, 2) (exact): a float32
# then holds every term that matters (those below 2^-126 lie far below the largest product's own
# rounding), and the arithmetic runs twice as fast. Each term carries float32's relative error,
# ~1e-7, and a sum of K terms K·6e-8 at most: the variance differs from float64's by 1e-5 (K = 128)
# at most, its square root (the bound) by half that.
class _Scratch:
    """Buffers reused by every row block of one call: a fresh array of a few hundred KB is mapped
    from the OS, and touching its pages again on every use cost ~5× the arithmetic."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._flat: Dict[Tuple[str, type], np.ndarray] = {}
        self._views: Dict[tuple, np.ndarray] = {}  # every block but the last asks for the same

    def get(self, name: str, dtype: type, *shape: int) -> np.ndarray:
        """The buffer `name` of `dtype`, as a contiguous array of `shape` (its contents left over)."""
        view = self._views.get((name, dtype, shape))
        if view is None:
            flat = self._flat.get((name, dtype))
            if flat is None:
                flat = self._flat[name, dtype] = np.empty(self._size, dtype)
            view = self._views[name, dtype, shape] = flat[:math.prod(shape)].reshape(shape)
        return view


def _scaled_sq(x: np.ndarray, g: float, out: np.ndarray) -> np.ndarray:
    """g·x² into out (may be x)."""
    np.multiply(x, x, out=out)
    return np.multiply(out, g, out=out)


def _running_sum(t: np.ndarray, stride: int, out: np.ndarray) -> np.ndarray:
    """out[k] = t[k] + out[k - stride] along axis 0 (t[k] for k < stride): the partial sums of
    `stride` interleaved accumulators. A slab at a time: numpy's cumsum along axis 0 of a
    row-major array walks it column by column, against the cache."""
    out[:stride] = t[:stride]
    for k in range(stride, t.shape[0], stride):
        np.add(out[k - stride:k], t[k:k + stride], out=out[k:k + stride])
    return out


def _steps(binade: np.ndarray, prev_sq: np.ndarray, t_sq: np.ndarray, work: np.ndarray,
           axis) -> np.ndarray:
    """Σ over `axis` of each addition's rounding variance: that of its sum's binade, and never more
    than the square of either addend (round to nearest picks the closer of the floats next to the
    sum, and both addends lie at their own distance from it; adding 0 is exact). The squares are
    in the same units as binade; work is scratch of their shape."""
    np.minimum(prev_sq, t_sq, out=work)
    np.minimum(work, binade, out=work)
    return work.sum(axis=axis)


class _Sums:
    """n sums of K products each, t (padded×n float64: t[k, j] the k-th product of sum j, zeros
    past K), scaled in place by `scale` (a power of two per sum), with what every summation order
    shares: the index-order partial sums S (S[k] the sum of the first k products; float64), and in
    float32 the binades of S, g·S² and g·t² (g = 3/u²: squares in units of u²/3)."""

    def __init__(self, t: np.ndarray, K: int, u: float, scratch: _Scratch) -> None:
        padded, n = t.shape
        self.t, self.K, self.n, self.scratch = t, K, n, scratch
        self.g = 3.0 / (u * u)
        top = binade(np.maximum(t.max(axis=0, initial=0.0), -t.min(axis=0, initial=0.0)))
        self.scale = np.divide(1.0, top, out=np.ones(n), where=top > 0)
        t *= self.scale
        self.t32 = self.f32("t32", padded)
        np.copyto(self.t32, t, casting="same_kind")
        self.t_sq = _scaled_sq(self.t32, self.g, self.f32("t_sq", padded))
        self.S = scratch.get("S", np.float64, padded + 1, n)
        self.S[0] = 0.0
        _running_sum(t, 1, self.S[1:])
        s32 = self.f32("x", padded + 1)
        np.copyto(s32, self.S, casting="same_kind")
        self.s_binade = binade_sq(s32, self.f32("s_binade", padded + 1))
        self.s_sq = _scaled_sq(s32, self.g, self.f32("s_sq", padded + 1))

    def f32(self, name: str, rows: int) -> np.ndarray:
        """float32 scratch of rows×n."""
        return self.scratch.get(name, np.float32, rows, self.n)

    def partials(self, rows: int):
        """Scratch for one order's partial sums: (values, binades, g·values²), float32."""
        return tuple(self.f32(name, rows) for name in ("x", "x_binade", "x_sq"))


def _order_energy(sums: _Sums) -> np.ndarray:
    """The largest over the summation orders of Σ_k var(rounding of the partial sum s_k), in units
    of u²/3, for each of the n sums: index and reverse order, the interleaved accumulators and the
    blocks of _orders(K) (each lane or block summed from 0, then the lane or block totals in
    order), and the expectation over random orders (for the orders not enumerated)."""
    K, t_sq = sums.K, sums.t_sq
    lanes, blocks, _ = _orders(K)
    work = sums.f32("work", K)
    best = _steps(sums.s_binade[1:K + 1], sums.s_sq[:K], t_sq[:K], work, 0)
    np.maximum(best, _reverse_energy(sums), out=best)
    for b in blocks:
        np.maximum(best, _blocks_energy(sums, b), out=best)
    for L in lanes:
        np.maximum(best, _lanes_energy(sums, L), out=best)
    # Random order: E[s_k²] averaged over k is Σt²/6 + S²/3 (sampling without replacement), and a
    # sum's rounding variance ROUND_VAR·u²·s² (3·ROUND_VAR·s² in units of u²/3).
    mean_var = t_sq[:K].sum(axis=0)
    mean_var /= 6.0
    mean_var += sums.s_sq[K] / 3.0
    mean_var *= 3.0 * ROUND_VAR / sums.g
    np.minimum(t_sq[:K], mean_var, out=work)
    return np.maximum(best, work.sum(axis=0), out=best)


def _reverse_energy(sums: _Sums) -> np.ndarray:
    """Reverse order: adding t_k to W_k = total - S_k gives W_(k-1)."""
    K, S = sums.K, sums.S
    W, w_binade, w_sq = sums.partials(K + 1)
    np.subtract(S[K], S[:K + 1], out=W)
    binade_sq(W, w_binade)
    return _steps(w_binade[:K], _scaled_sq(W, sums.g, w_sq)[1:], sums.t_sq[:K], sums.f32("work", K), 0)


def _blocks_energy(sums: _Sums, b: int) -> np.ndarray:
    """Blocks of b consecutive terms, each summed from 0, then the block totals in order: a
    block's partial sums are S minus S at its start, the running total of the blocks is S at
    their ends."""
    K, n, S = sums.K, sums.n, sums.S
    nb = -(-K // b)
    P, p_binade, p_sq = (x.reshape(nb, b, n) for x in sums.partials(nb * b))
    np.subtract(S[1:nb * b + 1].reshape(nb, b, n), S[0:nb * b:b].reshape(nb, 1, n), out=P)
    binade_sq(P, p_binade)
    _scaled_sq(P, sums.g, p_sq)
    energy = _steps(p_binade[:, 1:], p_sq[:, :-1], sums.t_sq[:nb * b].reshape(nb, b, n)[:, 1:],
                    sums.f32("work", nb * b).reshape(nb, b, n)[:, 1:], (0, 1))
    ends = np.minimum(np.arange(1, nb + 1) * b, K)
    totals = np.subtract(S[ends[1:]], S[ends[:-1]], out=sums.f32("totals", nb - 1))
    _scaled_sq(totals, sums.g, totals)
    at_end = np.take(sums.s_binade, ends[1:], axis=0, out=sums.f32("end_binade", nb - 1))
    before = np.take(sums.s_sq, ends[:-1], axis=0, out=sums.f32("end_sq", nb - 1))
    energy += _steps(at_end, before, totals, totals, 0)
    return energy


def _lanes_energy(sums: _Sums, L: int) -> np.ndarray:
    """L interleaved accumulators (term k into lane k mod L), then the L lane totals in order."""
    K, n, g = sums.K, sums.n, sums.g
    rows = -(-K // L) * L
    C64 = _running_sum(sums.t[:rows], L, sums.scratch.get("lanes", np.float64, rows, n))
    C, c_binade, c_sq = sums.partials(rows)
    np.copyto(C, C64, casting="same_kind")
    binade_sq(C, c_binade)
    _scaled_sq(C, g, c_sq)
    energy = _steps(c_binade[L:], c_sq[:-L], sums.t_sq[L:rows], sums.f32("work", rows - L), 0)
    lane_sq = c_sq[rows - L:]
    running = sums.f32("running", L)
    np.copyto(running, _running_sum(C64[rows - L:], 1, sums.scratch.get("running", np.float64, L, n)),
              casting="same_kind")
    r_binade = binade_sq(running, sums.f32("running_binade", L))
    r_sq = _scaled_sq(running, g, running)
    energy += _steps(r_binade[1:], r_sq[:-1], lane_sq[1:], sums.f32("work", L - 1), 0)
    return energy


def _sums_var(t: np.ndarray, K: int, u: float, product_var: float, scratch: _Scratch) -> np.ndarray:
    """The variance of the float32 error of each column sum of t (padded×n, K products each, zeros
    below; scaled in place): _order_energy plus product_var·(the products' binade-exact rounding
    variance)/ROUND_VAR."""
    sums = _Sums(t, K, u, scratch)
    var = _order_energy(sums).astype(np.float64)
    products = binade_sq(sums.t32[:K], sums.f32("work", K)).sum(axis=0)
    var += products * (product_var / ROUND_VAR)
    var *= u * u / 3.0
    var /= sums.scale
    var /= sums.scale
    return var


def _products(scratch: _Scratch, K: int, n: int) -> np.ndarray:
    """The products buffer for n sums of K terms: zeros past K, for the lane and block orders."""
    t = scratch.get("t", np.float64, _orders(K).padded, n)
    t[K:] = 0.0
    return t


def _block_sums(K: int, n_per_row: int) -> int:
    """Rows of a product per block (each of n_per_row sums)."""
    return max(1, _CHUNK_ELEMS // max(1, _orders(K).padded * n_per_row))


def _column_blocks(K: int, C: int) -> List[Tuple[int, int]]:
    """[start, stop) of B's column blocks: one where a row's K×C products fit _MAX_BLOCK_ELEMS, else nearly
    equal ones, never one column alone (numpy sums its terms pairwise, several columns in order: other bits)."""
    n = -(-C // max(4, _MAX_BLOCK_ELEMS // _orders(K).padded))
    return [(i * C // n, (i + 1) * C // n) for i in range(n)]


def dot_var(A: np.ndarray, B: np.ndarray, u: float, product_var: float = ROUND_VAR, product=None) -> np.ndarray:
    """Variance of the float32 error of each element of A @ B (R×K times K×C), from its products
    t_k and partial sums s_k: Σ_k var(rounding of s_k), the largest over the summation orders
    float32 GEMMs use: index order, reverse order, DOT_LANES interleaved accumulators, index-order
    blocks of every power of two from DOT_MIN_BLOCK to K/2 and of ⌈K/n⌉ (split-K, n in DOT_SPLITS;
    each block summed from 0, then the block sums), and the expectation over random orders (for
    the orders not enumerated); plus product_var·u²·Σ_k t_k² for the products' own rounding (an
    upper bound when FMA fuses them: an FMA's one rounding is that of the new partial sum,
    counted above). product: A @ B where the caller has it (the expected model's sums)."""
    A, B = float64(A), float64(B)
    R, K = A.shape
    C = B.shape[1]
    if not exact_energy(_rows(R), K, C):
        return _expected_var(A @ B if product is None else product, (A * A) @ (B * B), K, u, product_var)
    if not isinstance(A, np.ndarray):  # a device's: the exact partial sums (small heads) in NumPy
        return like(A, dot_var(to_numpy(A), to_numpy(B), u, product_var))
    blocks = _column_blocks(K, C)
    cols = max(b - a for a, b in blocks)
    rows = _block_sums(K, cols)
    scratch = _Scratch((_orders(K).padded + 1) * min(rows, R) * cols)
    out = np.empty((R, C))
    for r0 in range(0, R, rows):
        a = A[r0:r0 + rows]
        for c0, c1 in blocks:
            b = B[:, c0:c1]
            shape = (a.shape[0], b.shape[1])
            t = _products(scratch, K, a.shape[0] * b.shape[1])     # t[k, i·cols + j] = A[i, k]·B[k, c0 + j]
            np.multiply(a.T[:, :, None], b[:, None, :], out=t[:K].reshape((K,) + shape))
            out[r0:r0 + rows, c0:c1] = _sums_var(t, K, u, product_var, scratch).reshape(shape)
    return out


def rowdot_var(A: np.ndarray, B: np.ndarray, u: float, product_var: float = ROUND_VAR) -> np.ndarray:
    """Variance (R×1) of the float32 error of the row-wise dot products Σ_k A[i, k]·B[i, k] (A and
    B both R×K), under dot_var's model: row i's is dot_var(A[i:i+1], B[i:i+1].T)."""
    A, B = float64(A), float64(B)
    R, K = A.shape
    if not isinstance(A, np.ndarray):  # a device's: its expected model there, the exact one in NumPy
        if exact_energy(_rows(R), K, 1):
            return like(A, rowdot_var(to_numpy(A), to_numpy(B), u, product_var))
        t = A * B
        xp = namespace(t)
        return _expected_var(xp.sum(t, axis=1, keepdims=True), xp.sum(t * t, axis=1, keepdims=True), K, u,
                             product_var)
    if not exact_energy(_rows(R), K, 1):
        t = A * B
        return _expected_var(t.sum(axis=1, keepdims=True), np.einsum("ij,ij->i", t, t)[:, None], K,
                             u, product_var)
    rows = _block_sums(K, 1)
    scratch = _Scratch((_orders(K).padded + 1) * min(rows, R))
    out = np.empty((R, 1))
    for r0 in range(0, R, rows):
        t = _products(scratch, K, min(rows, R - r0))  # t[k, i] = A[i, k]·B[i, k]
        np.multiply(A[r0:r0 + rows].T, B[r0:r0 + rows].T, out=t[:K])
        out[r0:r0 + rows, 0] = _sums_var(t, K, u, product_var, scratch)
    return out


def rowdot_var_later(A, B, u: float, product_var: float = ROUND_VAR) -> Callable[[], np.ndarray]:
    """A function returning rowdot_var(A, B, u, product_var): a device's rows for NumPy's exact model
    start their copies now, the call waits for those alone (arrays.to_numpy_later)."""
    if isinstance(A, np.ndarray) or not exact_energy(_rows(A.shape[0]), A.shape[1], 1):
        var = rowdot_var(A, B, u, product_var)
        return lambda: var
    a, b = to_numpy_later(float64(A)), to_numpy_later(float64(B))
    return lambda: like(A, rowdot_var(a(), b(), u, product_var))


def _expected_var(S: np.ndarray, T2: np.ndarray, K: int, u: float, product_var: float) -> np.ndarray:
    """For very large heads, from the sums S and the sums of squared products T2: E[Σ_k s_k²] over
    random orders, (K+1)(T2/6 + S²/3), inflated by ENERGY_FALLBACK_FACTOR for orders whose partial
    sums wander further than average. T2 is overwritten; S is not (a caller's product may be it)."""
    a, b = expected_var_weights(K, u, product_var)  # (a·T2 + b·S²: four passes over the result, not nine)
    if not isinstance(S, np.ndarray):  # a device's: a·T2 + b·S² in two passes, not four
        return (T2 * a).addcmul_(S, S, value=b)
    var = np.multiply(T2, a, out=T2)
    s2 = np.multiply(S, S)
    s2 *= b
    var += s2
    return var


def expected_var_weights(K: int, u: float, product_var: float) -> Tuple[float, float]:
    """(a, b) of _expected_var = a·T2 + b·S² = u²·(ROUND_VAR·energy + product_var·T2), its energy
    ENERGY_FALLBACK_FACTOR·(K + 1)·(T2/6 + S²/3)."""
    grow = ENERGY_FALLBACK_FACTOR * (K + 1) * ROUND_VAR
    return u * u * (grow / 6.0 + product_var), u * u * (grow / 3.0)


def flush_sum(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """Bound on what flushing tiny products and partial sums of A @ B to zero can cost: none when
    no product of non-zero entries comes near float32's normal range, else min(Σ|a·b|, K·FLUSH)."""
    A, B = finite_abs(A), finite_abs(B)
    if np.min(A[A != 0], initial=np.inf) * np.min(B[B != 0], initial=np.inf) >= FLUSH * 2.0**24:
        return np.zeros((1, 1))
    return np.minimum(A @ B, A.shape[1] * FLUSH)


def qk_var(Q: np.ndarray, K: np.ndarray, u: float, product_var: float,
            cache: Optional[HeadCache], product=None) -> np.ndarray:
    """dot_var of Q·Kᵀ (keyed on Q and K: K.T is a new view object at every call); product():
    Q·Kᵀ, where the caller has it (asked for by the expected model only)."""
    def compute():
        expected = product is not None and not exact_energy(_rows(Q.shape[0]), Q.shape[1], K.shape[0])
        return dot_var(Q, K.T, u, product_var, product() if expected else None)
    return memo(cache, "QK var", (Q, K), (u, product_var), compute)


def pv_var(p: np.ndarray, V: np.ndarray, u: float, product_var: float,
            cache: Optional[HeadCache]) -> np.ndarray:
    return memo(cache, "PV var", (p, V), (u, product_var),
                lambda: dot_var(p, V, u, product_var, pv(p, V, cache)))  # (a copy of P·V: its sums)


def pv(p: np.ndarray, V: np.ndarray, cache: Optional[HeadCache]) -> np.ndarray:
    return memo(cache, "PV", (p, V), (), lambda: p @ V)
