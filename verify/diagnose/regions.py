"""Where a failing result is wrong: errors that follow tile boundaries (a dropped tail tile, a race
between tiles). A hypothesis of verify/diagnose/hypotheses.py (a wrong mask: verify/diagnose/masks.py)."""
from __future__ import annotations

from typing import List, Optional

import numpy as np

from ..check.diagnosis import Diagnosis
from .base import TILE_DENSITY, TILE_PERIODS


def _lines(bad: np.ndarray, axis: int) -> np.ndarray:
    return np.flatnonzero(bad.any(axis=axis))


def tile_boundary(stage, got, want, ctx, width) -> List[Diagnosis]:
    """Errors concentrated on lines at multiples of a period p, or on whole tiles of size p."""
    bound = ctx.bound
    bnd = np.asarray(bound, np.float64) if bound is not None else np.full(got.shape, width)
    err = np.where((got == want) | (np.isnan(got) & np.isnan(want)), 0.0, np.abs(got - want))
    bad = ~(err <= bnd)
    if not bad.any() or bad.all():
        return []
    tiles = ctx.flash_tiles
    out: List[Diagnosis] = []
    for axis, name, n in ((1, "rows", got.shape[0]), (0, "cols", got.shape[1])):
        lines = _lines(bad, axis)
        if len(lines) < 1 or len(lines) == n or n < 4:
            continue
        preferred = []
        if tiles:
            preferred = [int(tiles[0] if name == "rows" else tiles[1])]
        periods = preferred + [p for p in TILE_PERIODS if p not in preferred and p < n]
        hit = _periodic(lines, n, periods, name) or _whole_tiles(bad, lines, n, periods, name, axis, preferred)
        if hit:
            hit.message = f"{stage}: {hit.message}"
            out.append(hit)
            break
    return out


# A kernel's loop that stops short of (or starts late in) each tile leaves out up to this many lines
# of every tile.
MAX_LINES_A_TILE = 3


def _tile_lines(n: int, p: int, k: int, last: bool, clipped: bool) -> np.ndarray:
    """The first (last) k lines of every p-line tile of n: of the partial last tile, the k before
    its own end where `clipped` (a loop bounded by n), else those before its full width's end."""
    starts = np.arange(0, n, p)
    ends = np.minimum(starts + p, n) if clipped else starts + p
    lines = (ends[:, None] - k if last else starts[:, None]) + np.arange(k)[None, :]
    lines = lines.reshape(-1)
    return np.unique(lines[(lines >= 0) & (lines < n)])


def _periodic(lines: np.ndarray, n: int, periods: List[int], name: str) -> Optional[Diagnosis]:
    """Errors on the first or last k ≤ MAX_LINES_A_TILE lines of every p-line tile (two tiles at
    least, three such lines or more, three quarters of them wrong, none elsewhere), the largest
    period first, the fewest lines a tile first."""
    if len(lines) < 3:
        return None
    for p in sorted(periods, reverse=True):
        if p < 2 or n < 2 * p:
            continue
        for k in range(1, min(MAX_LINES_A_TILE, p // 2) + 1):
            for label, last, clipped in (("first", False, False), ("last", True, False), ("last", True, True)):
                expected = _tile_lines(n, p, k, last, clipped)
                if len(expected) >= 3 and np.isin(lines, expected).all() and len(lines) >= 0.75 * len(expected):
                    which = f"{label} {name[:-1]}" if k == 1 else f"{label} {k} {name}"
                    partial = " (the partial last tile's own last" + (f" {k})" if k > 1 else ")") \
                        if clipped and n % p else ""
                    return Diagnosis("tile_boundary", f"errors sit on the {which} of every {p}-{name[:-1]} tile"
                                     f"{partial} ({name} {', '.join(map(str, lines[:6]))}"
                                     f"{'…' if len(lines) > 6 else ''}): period {p}",
                                     {"period": p, "axis": name, "lines_a_tile": k,
                                      "lines": [int(x) for x in lines[:64]]}, 0.8)
    return None


def _whole_tiles(bad, lines, n, periods, name, axis, preferred) -> Optional[Diagnosis]:
    a, b = int(lines[0]), int(lines[-1]) + 1
    if len(lines) != b - a or b - a < 2:
        return None  # not one contiguous block of lines
    block = bad[a:b, :] if name == "rows" else bad[:, a:b]
    if block.mean() < TILE_DENSITY:
        return None
    fits = [p for p in periods if 2 <= p < n and a % p == 0 and ((b - a) % p == 0 or b == n)]
    if not fits:
        return None
    # Many sizes divide a block; name the one a kernel most plausibly has: the run's own, else the
    # smallest whose partial last tile is exactly the block (a dropped tail), else one tile exactly
    # the block, else the largest (the fewest tiles claimed).
    tail = [p for p in fits if b == n and n % p == b - a]
    one = [p for p in fits if b - a == p]
    p = next((q for q in preferred if q in fits), None) or min(tail, default=None) or \
        min(one, default=None) or max(fits)
    which = "the tail tile" if p in tail else (f"tile {a // p}" if b - a == p else f"tiles {a // p}..{(b - 1) // p}")
    return Diagnosis("tile_boundary", f"errors fill {which} along {name} ({name} {a}..{b - 1}, "
                     f"tile size {p}); the rest is correct", {"period": p, "axis": name, "range": [a, b - 1]}, 0.75)
