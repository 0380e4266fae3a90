"""Query-row tiles: the flash stages' references and error model computed a few MB at a time.

A head's N×M scores never exist whole: the rows of Q are taken TILE_BYTES of scores at a time,
each tile runs the same model code as a whole head (the head's variant seen through
HeadVariant.rows_of, the dot products sized as the whole head's: dot.head_rows), the row-wise
results (the outputs, dQ, lse and their bounds) are stacked and the sums over the query rows (dK,
dV and their bounds) added tile by tile. A head whose scores fit in one tile, or whose sums over
the query rows take the exact partial-sum model (small heads: dot.exact_energy), is one tile: the
whole head, computed as it always was. Memory: O((N + M)·d) per head plus a tile's matrices.

Only what the array API offers is used on the arrays (matmul, elementwise arithmetic, sums and
maxima along an axis, concatenation), so that the loop runs on the check's device too, its arrays
in that namespace (verify/model/arrays.py).

On the CPU the tiles may run on several threads (tile_workers; NumPy's and BLAS's loops release
Python's lock): each tile's arrays are computed on a worker, and what adds tiles together (a sum
over the query rows, a list of rows) runs in tile order once the earlier tiles' has (in_order), so
that the result is bit for bit the one thread's, whatever thread computed which tile.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from .arrays import concat_rows, like, namespace, target, zeros
from .dot import _HEAD_ROWS, _expected_var, exact_energy, head_rows
from .mma import mma_running_sums
from .kernels import MMA_K
from .rounding import FLUSH, ULP_IN_U, HeadCache, finite_abs

# The float64 scores of one tile: its dozen or so temporaries stay within a few tens of MB.
TILE_BYTES = 4 << 20

# On a GPU (verify/model/arrays.py): its dozen temporaries a few GB of the device's memory, and few
# enough tiles that the time goes to arithmetic, not to launching each tile's few hundred kernels.
DEVICE_TILE_BYTES = 256 << 20


# The threads a head's row tiles run on (the check's choice: verify/check/pool.py); the steps of the
# tile being computed on a worker that must run in tile order (None: run them at once).
_WORKERS: contextvars.ContextVar[Tuple[int, Optional[Callable]]] = contextvars.ContextVar("tile workers",
                                                                                        default=(1, None))
_ORDERED: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("tile steps in order", default=None)


@contextlib.contextmanager
def tile_workers(n: int, around: Optional[Callable] = None):
    """Within: the row tiles of a head on the CPU are computed on n threads; around(): a context
    manager the threads run within (the check's: BLAS on one thread of its own per worker)."""
    token = _WORKERS.set((max(1, int(n)), around))
    try:
        yield
    finally:
        _WORKERS.reset(token)


def in_order(step: Callable[[], None]) -> None:
    """step() now, or, in a tile computed on a worker thread, after every earlier tile's steps and
    this tile's own before it: the tiles' parts add in tile order, as on one thread."""
    steps = _ORDERED.get()
    if steps is None:
        step()
    else:
        steps.append(step)


def map_tiles(compute: Callable, tiles: Iterable) -> list:
    """[compute(t) for t in tiles], on the tile workers where there are several and the arrays are
    NumPy's (a device runs its own kernels in parallel): each tile in a copy of the caller's context
    (the head's rows, the device), its in_order steps run here, tile after tile."""
    tiles = list(tiles)
    workers, around = _WORKERS.get()
    workers = min(workers, len(tiles))
    if workers <= 1 or target() is not None:
        return [compute(t) for t in tiles]

    def run(t):
        steps: list = []
        _ORDERED.set(steps)
        return compute(t), steps
    out: list = []
    pending: deque = deque()
    with (around() if around else contextlib.nullcontext()), ThreadPoolExecutor(workers) as pool:
        for t in tiles + [None] * (workers + 1):  # at most workers + 1 tiles' results held at once
            if t is not None:
                pending.append(pool.submit(contextvars.copy_context().run, run, t))
            if len(pending) > workers or (t is None and pending):
                result, steps = pending.popleft().result()
                for step in steps:
                    step()
                out.append(result)
    return out


def tiled() -> bool:
    """Whether the rows being computed are one tile of several (over_rows): a head's sums over the
    query rows then take the expected model, never the exact one of a single tile's."""
    return _HEAD_ROWS.get() is not None


def row_tiles(n: int, m: int, d: int) -> List[Tuple[int, int]]:
    """[start, stop) of the row tiles of an n×m head of width d: one tile for a head that fits in
    TILE_BYTES of scores (DEVICE_TILE_BYTES on a GPU), whose query sums take the exact model, or that is itself a tile; else
    tiles of a multiple of MMA_K rows (the tensor-core chunks of a sum over the queries)."""
    budget = TILE_BYTES if target() is None else DEVICE_TILE_BYTES
    if tiled() or 8 * n * m <= budget or exact_energy(m, n, max(1, d)):
        return [(0, n)]
    rows = max(MMA_K, budget // (8 * max(1, m)) // MMA_K * MMA_K)
    return [(a, min(n, a + rows)) for a in range(0, n, rows)]


def over_rows(n: int, m: int, d: int, head, cache: Optional[HeadCache],
              compute: Callable[[slice, object, Optional[HeadCache]], tuple]) -> tuple:
    """compute(rows, the head's variant of those rows, a cache) over the row tiles, its results
    (arrays with a row per query row) stacked; for one tile, compute(None, head, cache): the whole
    head's arrays themselves (rows_of), which key the head's cache."""
    tiles = row_tiles(n, m, d)
    if len(tiles) == 1:
        return compute(None, head, cache)
    with head_rows(n):
        parts = map_tiles(lambda t: compute(slice(*t), head.rows_of(t[0], t[1], n), HeadCache()), tiles)
    heights = [b - a for a, b in tiles]
    return tuple(stack_rows([p[i] for p in parts], heights) for i in range(len(parts[0])))


def stack_over_rows(n: int, m: int, d: int, compute: Callable[[Optional[slice]], np.ndarray]) -> np.ndarray:
    """compute(rows) over the row tiles, stacked (compute(None) for a head of one tile), in the
    namespace compute's arrays are in."""
    tiles = row_tiles(n, m, d)
    if len(tiles) == 1:
        return compute(None)
    return concat_rows(map_tiles(lambda t: compute(slice(*t)), tiles))


def flush_max(A: np.ndarray, B: np.ndarray) -> float:
    """The largest element of dot.flush_sum(A, B) (A: n×k, B: k×m), row tile by row tile."""
    A, B = finite_abs(A), finite_abs(B)
    if smallest(A) * smallest(B) >= FLUSH * 2.0**24 or not A.size or not B.size:
        return 0.0
    rows = max(1, TILE_BYTES // (8 * max(1, B.shape[1])))
    return max(float(np.max(np.minimum(A[a:a + rows] @ B, A.shape[1] * FLUSH))) for a in range(0, A.shape[0], rows))


def rows_of(x, rows: Optional[slice]):
    """x's rows of a tile (x itself for the whole head)."""
    return x if rows is None else x[rows]


def stack_rows(parts: Sequence, heights: Sequence[int]):
    """The tiles' row blocks as one array (a scalar, where every tile's is that scalar)."""
    if all(np.ndim(p) == 0 for p in parts) and all(p == parts[0] for p in parts):
        return parts[0]
    ref = next(p for p in parts if np.ndim(p))
    width = tuple(ref.shape[1:])
    if isinstance(ref, np.ndarray):
        return np.concatenate([np.broadcast_to(p, (h,) + width) for p, h in zip(parts, heights)], axis=0)
    xp = namespace(ref)  # a device's parts (a scalar among them moved there)
    return concat_rows([xp.broadcast_to(like(ref, p) if isinstance(p, (float, int, np.ndarray, np.generic)) else p,
                                        (h,) + width) for p, h in zip(parts, heights)])


class QuerySum:
    """Σ over the head's query rows of Xᵀ·Y (X: rows×M, Y: rows×d), a tile at a time, with the
    variance of its float32 roundings: dot_var of Xᵀ·Y for a head of one tile (the exact model
    where it applies), else its expectation over summation orders from the sums of the products
    and of their squares, which add over the tiles."""

    def __init__(self, n: int) -> None:
        self.n, self.tiles = n, 0
        self.pair: Optional[Tuple[np.ndarray, np.ndarray]] = None
        self.sum: Optional[np.ndarray] = None
        self.squares: Optional[np.ndarray] = None

    def add(self, X: np.ndarray, Y: np.ndarray) -> None:
        if _ORDERED.get() is not None:  # a tile on a worker, one of several: its parts made there
            part, squares = X.T @ Y, (X * X).T @ (Y * Y)
            in_order(lambda: self._add_parts(part, squares))
            return
        self.tiles += 1
        if self.tiles == 1:
            self.pair = (X, Y)
        else:
            if self.pair is not None:  # a second tile: the first one's squares too
                X0, Y0 = self.pair
                self.squares, self.pair = (X0 * X0).T @ (Y0 * Y0), None
            self.squares += (X * X).T @ (Y * Y)  # (its own arrays, made here: added into in place)
        part = X.T @ Y
        if self.sum is None:
            self.sum = part
        else:
            self.sum += part

    def add_sum(self, X: np.ndarray, Y: np.ndarray) -> None:
        """add's Xᵀ·Y alone, for a head of several tiles whose caller counts the squares' part of
        the variance in a GEMM of its own (var then takes the sum's part alone)."""
        part = X.T @ Y
        in_order(lambda: self._add_parts(part, None))

    def _add_parts(self, part: np.ndarray, squares: Optional[np.ndarray]) -> None:
        """A tile's Xᵀ·Y and (X∘X)ᵀ·(Y∘Y), of its own, added as add does (the first ones kept)."""
        self.tiles += 1
        if self.tiles == 1:
            self.sum, self.squares = part, squares
        else:
            if squares is not None:
                self.squares += squares
            self.sum += part

    def var(self, u: float, product_var: float, single: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> np.ndarray:
        """The variance; single(X, Y): the whole head's (a cached dot_var of Xᵀ·Y)."""
        if self.pair is not None:
            return single(*self.pair)
        own = np.array if isinstance(self.squares, np.ndarray) else (lambda x: x)  # (a device's: out of place)
        return _expected_var(self.sum, own(self.squares), self.n, u, product_var)


class Total:
    """A sum over the tiles (0 before the first): the first tile's array, then a sum of its own,
    which the later tiles' are added into in place (the same additions, no new M×d array a tile)."""

    def __init__(self) -> None:
        self.value = 0.0
        self._own = False

    def add(self, x) -> None:
        in_order(lambda: self._add(x))

    def _add(self, x) -> None:
        if np.ndim(self.value) == 0 and self.value == 0.0:
            self.value = x
        elif self._own and np.shape(x) == np.shape(self.value) and _writable(self.value):
            self.value += x
        else:
            self.value, self._own = self.value + x, True


def _writable(x) -> bool:
    """Whether x may be added into in place (a NumPy array must be writeable; a device's is)."""
    return not isinstance(x, np.ndarray) or x.flags.writeable


class MmaCarry:
    """dot.mma_truncation_det of Xᵀ·Y over the query rows, a tile at a time: the running partial
    sum of the MMA_K-row chunks and the sum of its magnitudes carry from tile to tile (tiles begin
    at multiples of MMA_K, so the chunks are the whole head's)."""

    def __init__(self) -> None:
        self.partial = self.total = None

    def add(self, X: np.ndarray, Y: np.ndarray) -> None:
        in_order(lambda: self._add(X, Y))  # (each tile's chunks carry the one before: in tile order)

    def _add(self, X: np.ndarray, Y: np.ndarray) -> None:
        A = X.T
        if self.partial is None:
            self.partial = zeros(A, (A.shape[0], Y.shape[1]))
            self.total = zeros(A, (A.shape[0], Y.shape[1]))
        self.partial, self.total = mma_running_sums(A, Y, self.partial, self.total)

    def det(self, u: float, passes: int) -> np.ndarray:
        return passes * ULP_IN_U * u * self.total


def smallest(x: np.ndarray) -> float:
    """The smallest nonzero element of x (inf for none): dot.flush_sum's test, over tiles."""
    return float(smallest_now(x))


def smallest_now(x):
    """smallest(x) without waiting for it: on a device a 0-d array of its own (reading it would wait
    for the tile's kernels; the tiles' least is read once they are all in)."""
    if 0 in tuple(x.shape):
        return np.inf
    xp = namespace(x)  # (no boolean indexing: on a device it waits for the count of nonzeros)
    return xp.min(xp.where(x != 0, x, np.inf))


def least(a, b):
    """The lesser of two smallest_now results (floats, or a device's 0-d arrays; inf: none yet)."""
    if isinstance(a, float) and isinstance(b, float):
        return min(a, b)
    if not isinstance(a, float) and not isinstance(b, float):
        return namespace(a).minimum(a, b)
    x, y = (a, b) if isinstance(b, float) else (b, a)  # x the array, y the float
    return x if y == np.inf else namespace(x).clip(x, max=y)


__all__ = ["TILE_BYTES", "DEVICE_TILE_BYTES", "tile_workers", "in_order", "map_tiles", "row_tiles", "over_rows",
           "stack_over_rows", "flush_max", "rows_of", "stack_rows", "QuerySum", "Total", "tiled", "MmaCarry",
           "smallest", "smallest_now", "least"]
