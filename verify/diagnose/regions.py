"""Where a failing result is wrong: a shifted or missing causal mask, and errors that follow tile
boundaries (a dropped tail tile, a race between tiles). Hypotheses of verify/diagnose/hypotheses.py."""
from __future__ import annotations

from typing import List, Optional

import numpy as np

from ..check.diagnosis import Diagnosis
from ..check.reference import causal_mask
from ..specs import SPECS
from ..stages import KEYS, QUERIES, STAGES
from ..text import plural
from .base import (MASK_FIT_ROWS, MATCH_WIDTHS, MAX_MASK_FIT_KEYS, MAX_MASK_OFFSET, TILE_DENSITY, TILE_PERIODS,
                   explains)
from .inputs import case_inputs, rebuilder


def _offset_mask(shape, k: int) -> np.ndarray:
    """Masked where c > r + k (k = 0: the top-left causal mask)."""
    return np.triu(np.ones(shape, dtype=bool), k=k + 1)


def _mask_pattern(got: np.ndarray, stage: str) -> Optional[np.ndarray]:
    """Where got holds the stage's masked value (a weight row with no visible key normalizes 0/0:
    NaN counts as masked too); None for stages that hold no masked entries."""
    value = SPECS[stage].masked_value
    if value is None:
        return None
    return (got == value) | (np.isnan(got) if value == 0 else False)


def mask(stage, got, want, ctx, width) -> List[Diagnosis]:
    pattern = _mask_pattern(got, stage)
    if pattern is not None:
        return _mask_in_pattern(stage, got, pattern, ctx.causal)
    recompute = _mask_recompute(stage, ctx, width)
    if recompute is None:
        return []
    rebuild, fit_rows, (N, M), width = recompute
    if ctx.causal:
        diff = explains(got, rebuild(np.zeros((N, M), bool)), want, width)
        if diff is not None:
            return [Diagnosis("mask_missing", f"{stage}: causal masking is on but got matches the "
                              f"unmasked attention (max diff {diff:.2g})", {"max_diff": diff}, 0.9)]
    fixed = sorted({k for k in range(-MAX_MASK_OFFSET, MAX_MASK_OFFSET + 1)} | {M - N}, key=abs)
    fitted = _fitted_offsets(fit_rows, got, (N, M), width) if fit_rows is not None else []
    for k in dict.fromkeys(fitted + fixed) if ctx.causal else []:
        masked = _offset_mask((N, M), k)
        if k == 0 or k >= M - 1:
            continue  # the run's own mask, or none at all
        # A row with no visible key: 0/0 (NaN), or 0 in a kernel that guards it (flash-attn does).
        cand = rebuild(masked)
        diff = explains(got, cand, want, width)
        if diff is None and masked.all(axis=1).any():
            diff = explains(got, np.nan_to_num(cand, nan=0.0), want, width)
        if diff is not None:
            return [Diagnosis("mask_offset", f"{stage}: the causal mask is shifted by {k:+d} (keys "
                              f"c <= r {'+' if k >= 0 else '-'} {abs(k)} visible: {_shift_words(k)})"
                              f"{_alignment_words(k, N, M)} (max diff {diff:.2g})",
                              {"offset": k, "max_diff": diff, "bottom_right": k == M - N}, 0.9)]
    return []


def _alignment_words(k: int, N: int, M: int) -> str:
    """The convention a shifted mask follows, when it is a known one."""
    return ": bottom-right aligned (flash-attn's convention), the case's mask is top-left aligned" \
        if k == M - N else ""


def _mask_in_pattern(stage: str, got: np.ndarray, pattern: np.ndarray, causal: bool) -> List[Diagnosis]:
    """A stage that holds the masked value: the mask read off where it holds it."""
    N, M = got.shape
    expected = causal_mask(N, M) if causal else np.zeros(got.shape, bool)
    if (pattern == expected).all():
        return []
    k = _fit_offset(pattern)
    if k is not None and k != 0 and (causal or k < M - 1):
        return [Diagnosis("mask_offset", f"{stage}: the mask is shifted by {k:+d}: entries "
                          f"c > r {'+' if k >= 0 else '-'} {abs(k)} are masked instead of c > r "
                          f"({_shift_words(k)}){_alignment_words(k, N, M)}",
                          {"offset": k, "bottom_right": k == M - N}, 0.9)]
    upper = causal_mask(N, M)
    if causal and upper.any():
        unmasked = upper & ~pattern & np.isfinite(got)
        if unmasked.sum() >= 0.5 * upper.sum() and not (pattern & upper).all():
            value = SPECS[stage].masked_value
            return [Diagnosis("mask_missing", f"{stage}: causal masking is on but "
                              f"{int(unmasked.sum())} of {int(upper.sum())} entries above the "
                              f"diagonal do not hold the masked value {value:g} (not masked, or "
                              "masked with a finite stand-in such as -1e9)",
                              {"count": int(unmasked.sum())}, 0.9)]
    return []


def _mask_recompute(stage: str, ctx, width):
    """(the stage under any mask, its sampled rows under per-row masks or None, (N, M), the width
    to match with), from the stage's own sources or, where the program wrote no upstream stage,
    from the case's inputs; None where neither recomputes it."""
    built = rebuilder(stage, ctx, width)
    if built is not None:
        rebuild, width = built
        qkv = case_inputs(ctx)
        N, M = qkv[QUERIES].shape[0], qkv[KEYS].shape[0]

        def fit_rows(rows, masked):
            return rebuild({**qkv, QUERIES: qkv[QUERIES][rows]}, masked)
        return (lambda masked: rebuild(qkv, masked)), fit_rows, (N, M), width
    src, with_mask = ctx.src, SPECS[stage].with_mask
    if with_mask is None or not all(n in src for n in STAGES[stage].inputs):
        return None
    # Query rows and keys from the inputs: a key-major stage (dK, dV) has M rows, not N.
    N = next(np.asarray(src[n]).shape[0] for n in STAGES[stage].inputs if STAGES[n].rows == "N")
    M = next(np.asarray(src[n]).shape[0] for n in STAGES[stage].inputs if STAGES[n].rows == "M")
    return (lambda masked: with_mask(src, ctx.scale, masked)), None, (N, M), width


def _fitted_offsets(fit_rows, got: np.ndarray, shape, width: float) -> List[int]:
    """The offsets k that sampled rows of got fit: row r recomputed seeing its first v keys, for
    every v, matches got's row r at v = r + k + 1. Any offset, for MASK_FIT_ROWS recomputed rows."""
    N, M = shape
    if M > MAX_MASK_FIT_KEYS or got.shape[0] != N:
        return []
    visible = np.arange(M)[None, :] >= np.arange(1, M + 1)[:, None]  # row v - 1: v keys visible
    found = []
    for r in np.unique(np.linspace(0, N - 1, MASK_FIT_ROWS).astype(int)):
        with np.errstate(all="ignore"):
            diff = np.abs(fit_rows(np.full(M, r), visible) - got[r][None, :]).max(axis=1)
        v = int(np.argmin(np.where(np.isnan(diff), np.inf, diff))) + 1
        if diff[v - 1] <= MATCH_WIDTHS * width and v < M:  # seeing every key fits any offset past it
            found.append(int(v - 1 - r))
    return list(dict.fromkeys(found))


def _shift_words(k: int) -> str:
    """Which way a mask shifted by k errs, in a query's terms."""
    if k > 0:
        return f"each query sees {plural(k, 'key')} past the diagonal"
    return ("the diagonal masked too" if k == -1 else f"the diagonal and {plural(-k - 1, 'key')} before it "
            "masked too") + f": each query sees {plural(-k, 'key')} fewer"


def _fit_offset(pattern: np.ndarray) -> Optional[int]:
    """The k for which pattern == (c > r + k), if one fits every row."""
    N, M = pattern.shape
    n_masked = pattern.sum(axis=1)
    partial = (n_masked > 0) & (n_masked < M)
    if not partial.any():
        return None
    ks = set((M - n_masked - 1 - np.arange(N))[partial].tolist())  # first masked col = r + k + 1
    if len(ks) != 1:
        return None
    k = int(ks.pop())
    return k if (pattern == _offset_mask((N, M), k)).all() else None


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


def _periodic(lines: np.ndarray, n: int, periods: List[int], name: str) -> Optional[Diagnosis]:
    if len(lines) < 2:
        return None
    if len(lines) < 3:
        return None
    for p in sorted(periods, reverse=True):
        if p < 2 or n < 3 * p:
            continue
        for phase, label in ((0, "first"), (p - 1, "last")):
            if (lines % p == phase).all():
                expected = len(range(phase, n, p))
                if len(lines) >= max(3, 0.75 * expected):
                    return Diagnosis("tile_boundary", f"errors sit on the {label} {name[:-1]} of every "
                                     f"{p}-{name[:-1]} tile ({name} {', '.join(map(str, lines[:6]))}"
                                     f"{'…' if len(lines) > 6 else ''}): period {p}",
                                     {"period": p, "axis": name, "lines": [int(x) for x in lines[:64]]},
                                     0.8)
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
