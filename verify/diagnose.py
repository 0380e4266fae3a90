"""Bug diagnosis: hypotheses tested on a failing stage × head, each naming a pattern that explains it.

diagnose() is called with the float64 got and its isolated reference want. Each hypothesis builds
what a specific bug would have produced (want transposed, a reinterpreted cuBLAS operand, the
softmax of the wrong axis, another head's reference, a shifted mask, …) and fires when got matches
it while want does not; pattern hypotheses (unwritten regions, tile boundaries, non-finite values)
look at where got and want differ. No hypothesis fires on a correct or merely noisy result: a
candidate must explain got within a few tolerance widths AND differ from want by far more.

Codes (stable; the report's `diagnosis`): nonfinite, unwritten, transposed, layout, scaled,
softmax_axis, head_permuted, mask_missing, mask_offset, tile_boundary, lse_log2. (`stale` comes from the
integrity check in verify.compare.)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import numpy as np

from .reference import causal_mask, compute_stage, softmax_rows
from .specs import SPECS
from .stages import STAGES

# A candidate explains got when every element is within MATCH_WIDTHS tolerance widths of it (the
# candidate is float64, got carries its own rounding), and it is a real alternative when it
# differs from want by more than DISTINCT_WIDTHS widths somewhere.
MATCH_WIDTHS = 8.0
DISTINCT_WIDTHS = 100.0
# Values a poisoned or uninitialised buffer shows (besides NaN and 0): float32 max and its kin.
POISON_VALUES = (3.4028234663852886e38, -3.4028234663852886e38, 1e30, -1e30)
UNWRITTEN_DENSITY = 0.9      # fraction of the region's entries that must be zero/NaN/poison
TILE_DENSITY = 0.5           # fraction of a wrong tile's entries that must be wrong
MAX_HEADS_SEARCHED = 64
MAX_MASK_OFFSET = 8
# Tile sizes tried besides the run's own (run.toml's flash_block_q/k): the widths kernels tile and
# vectorize by; a period of 2 is what any alternating error pattern shows by chance.
TILE_PERIODS = (4, 8, 16, 32, 64, 128, 256)
SCALE_NAME_RTOL = 2e-3
LOG2_E = 1.0 / np.log(2.0)


@dataclass
class Diagnosis:
    code: str
    message: str
    detail: dict = field(default_factory=dict)
    confidence: float = field(default=0.5, repr=False, compare=False)


# ---------------------------------------------------------------------------------------------
# Matching helpers
# ---------------------------------------------------------------------------------------------

def _width(bound: Optional[np.ndarray], want: np.ndarray) -> float:
    """One tolerance width: the largest finite bound (a scalar keeps reshaped candidates simple)."""
    if bound is not None:
        b = np.asarray(bound, dtype=np.float64)
        b = b[np.isfinite(b)]
        if b.size and b.max() > 0:
            return float(b.max())
    w = np.abs(want[np.isfinite(want)])
    return float(max(w.max() if w.size else 1.0, 1e-30) * 2.0**-20)


def _maxdiff(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b|, with equal infinities equal and any other non-finite mismatch infinite."""
    if a.shape != b.shape:
        return np.inf
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    fin = np.isfinite(a) & np.isfinite(b)
    if (~same & ~fin).any():
        return np.inf
    d = np.abs(np.where(same, 0.0, a - b))
    return float(d.max()) if d.size else 0.0


def _explains(got: np.ndarray, cand: np.ndarray, want: np.ndarray, width: float) -> Optional[float]:
    """max|got - cand| when cand explains got and is a real alternative to want, else None."""
    if cand.shape != got.shape:
        return None
    diff = _maxdiff(got, cand)
    if not diff <= MATCH_WIDTHS * width:
        return None
    if not _maxdiff(cand, want) > DISTINCT_WIDTHS * width:
        return None
    return diff


def _loc(idx) -> str:
    return "[" + ", ".join(str(int(i)) for i in idx) + "]"


# ---------------------------------------------------------------------------------------------
# Hypotheses
# ---------------------------------------------------------------------------------------------

def _nonfinite(stage, got, want, ctx, width) -> List[Diagnosis]:
    bad = ~np.isfinite(got) & np.isfinite(want)
    if not bad.any():
        return []
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    n_nan, n_inf = int((np.isnan(got) & bad).sum()), int((np.isinf(got) & bad).sum())
    return [Diagnosis("nonfinite", f"{stage} has {n_nan} NaN and {n_inf} Inf where the reference is "
                      f"finite; first at {_loc(first)} = {float(got[first])}",
                      {"nan": n_nan, "inf": n_inf, "count": int(bad.sum()), "first": list(first)}, 0.95)]


def _unwritten(stage, got, want, ctx, width) -> List[Diagnosis]:
    """A rectangle of zeros / NaN / poison where want has other values."""
    err = np.where((got == want) | (np.isnan(got) & np.isnan(want)), 0.0, np.abs(got - want))
    wrong = ~(err <= MATCH_WIDTHS * width)
    blank = np.isnan(got) | (got == 0) | np.isin(got, POISON_VALUES)
    suspect = wrong & blank
    if not suspect.any():
        return []
    rows = np.flatnonzero(suspect.any(axis=1))
    cols = np.flatnonzero(suspect.any(axis=0))
    r0, r1, c0, c1 = int(rows[0]), int(rows[-1]), int(cols[0]), int(cols[-1])
    box = blank[r0:r1 + 1, c0:c1 + 1]
    if box.mean() < UNWRITTEN_DENSITY or suspect.sum() < 2:
        return []
    kinds = [k for k, m in (("NaN", np.isnan(box)), ("zeros", box & (got[r0:r1 + 1, c0:c1 + 1] == 0)),
                            ("poison", np.isin(got[r0:r1 + 1, c0:c1 + 1], POISON_VALUES))) if m.any()]
    whole = "whole matrix" if (r1 - r0 + 1, c1 - c0 + 1) == got.shape else \
        f"rows {r0}..{r1}, cols {c0}..{c1}"
    return [Diagnosis("unwritten", f"{stage}: {whole} hold {'/'.join(kinds)} where the reference "
                      f"has values: never written ({int(suspect.sum())} entries)",
                      {"rows": [r0, r1], "cols": [c0, c1], "values": kinds,
                       "count": int(suspect.sum())}, 0.9)]


def _transposed(stage, got, want, ctx, width) -> List[Diagnosis]:
    R, C = want.shape
    cands = []
    if R == C:
        cands.append(("got[i,j] ≈ want[j,i]", want.T))
    elif R > 1 and C > 1:
        cands.append(("got ≈ wantᵀ written into the same buffer (got.reshape(C, R) ≈ wantᵀ)",
                      want.T.reshape(R, C)))
    for how, cand in cands:
        diff = _explains(got, cand, want, width)
        if diff is not None:
            return [Diagnosis("transposed", f"{stage} looks transposed: {how} (max diff {diff:.2g})",
                              {"max_diff": diff, "square": R == C}, 0.97)]
    return []


def _operand_variants(x: np.ndarray) -> Iterable[Tuple[str, np.ndarray]]:
    """How a row-major R×C buffer gets misread by a GEMM with the wrong layout or leading dimension:
    as column-major (x.reshape(C, R).T), or as holding xᵀ (x.T.reshape(R, C))."""
    R, C = x.shape
    if R == 1 or C == 1:
        return
    yield "read as column-major", x.reshape(C, R).T
    if R != C:
        yield "read as if it held its transpose", x.T.reshape(R, C)


def _layout(stage, got, want, ctx, width) -> List[Diagnosis]:
    """Row-/column-major or leading-dimension reinterpretations of the result or of an operand."""
    R, C = want.shape
    found: List[Tuple[str, float]] = []
    if R > 1 and C > 1:
        for how, cand in (("the result was written column-major (got = wantᵀ in row-major order)",
                           want.T.reshape(R, C)),
                          ("the result was read back column-major (got = want.reshape(C, R)ᵀ)",
                           want.reshape(C, R).T)):
            diff = _explains(got, cand, want, width)
            if diff is not None:
                found.append((how, diff))
    src: Dict[str, np.ndarray] = ctx.get("src") or {}
    scale, causal = float(ctx.get("scale", 1.0)), bool(ctx.get("causal", False))
    if not found and src and SPECS[stage].isolated is not None:  # not an exact copy
        for name, x in src.items():
            if name not in STAGES[stage].inputs:
                continue
            for how, x2 in _operand_variants(np.asarray(x, dtype=np.float64)):
                try:
                    cand = compute_stage(stage, {**src, name: x2}, scale, causal)
                except ValueError:
                    continue
                diff = _explains(got, cand, want, width)
                if diff is not None:
                    found.append((f"operand {name} was {how} (wrong layout / leading dimension)", diff))
    if not found:
        return []
    how, diff = min(found, key=lambda f: f[1])
    return [Diagnosis("layout", f"{stage}: row/column-major mix-up: {how} (max diff {diff:.2g})",
                      {"how": how, "max_diff": diff}, 0.93)]


def _feeds_the_scale(stage: str) -> bool:
    """Whether the stage is what a scaling stage scales (QK: a scale found there came too early)."""
    return any(SPECS[s].scaled and stage in STAGES[s].inputs for s in STAGES)


def _scale_names(f: float, scale: float, d_k: int, stage: str) -> List[str]:
    named = {"√d_k": d_k ** 0.5, "1/√d_k": d_k ** -0.5, "d_k": float(d_k), "1/d_k": 1.0 / d_k}
    if scale != 0.0:
        if SPECS[stage].scaled:
            named["scale (scale applied twice)"] = scale
            named["1/scale (scale missing)"] = 1.0 / scale
        elif _feeds_the_scale(stage):
            named["scale (QK already scaled)"] = scale
        else:
            named["scale"] = scale
            named["1/scale"] = 1.0 / scale
    return [n for n, v in named.items() if abs(f - v) <= SCALE_NAME_RTOL * abs(v)]


def _scaled(stage, got, want, ctx, width) -> List[Diagnosis]:
    """got ≈ f·want (linear stages), or the stage recomputed with a wrong scale (nonlinear ones)."""
    dims = ctx.get("dims")
    d_k = dims.d_k if dims is not None else 1
    scale = float(ctx.get("scale", 1.0))
    # Entries left blank (0 or NaN where want is not) belong to an unwritten region, not to the
    # scaling: fit the factor on the rest.
    blank = (np.isnan(got) | (got == 0)) & (want != 0) & np.isfinite(want)
    fin = np.isfinite(got) & np.isfinite(want) & ~blank
    if not fin.any() or (np.isfinite(want) != np.isfinite(got))[~blank].any():
        return []
    g, w = got[fin], want[fin]
    ww = float(w @ w)
    if SPECS[stage].linear and ww > 0:
        f = float(g @ w) / ww
        if f != 0 and abs(f - 1) > 1e-3:
            diff = _maxdiff(got[fin], f * want[fin])
            if diff <= MATCH_WIDTHS * width * max(1.0, abs(f)):
                names = _scale_names(f, scale, d_k, stage)
                named = f" ≈ {' = '.join(names)}" if names else ""
                rest = f", apart from {int(blank.sum())} blank entries" if blank.any() else ""
                return [Diagnosis("scaled", f"{stage} is scaled: got ≈ {f:.6g}·want{named}{rest} "
                                  f"(max diff {diff:.2g})", {"factor": f, "names": names,
                                                             "max_diff": diff}, 0.9)]
    src = ctx.get("src") or {}
    if SPECS[stage].scaled and src:
        alts = {"scale applied twice": scale * scale, "scale missing": 1.0,
                "multiplied by √d_k instead of divided": d_k ** 0.5}
        for name, s2 in alts.items():
            if abs(s2 - scale) <= 1e-6 * abs(scale):
                continue
            try:
                cand = compute_stage(stage, src, s2, bool(ctx.get("causal", False)))
            except (KeyError, ValueError):
                continue
            diff = _explains(got, cand, want, width)
            if diff is not None:
                return [Diagnosis("scaled", f"{stage} used scale {s2:.6g} instead of {scale:.6g}: "
                                  f"{name} (max diff {diff:.2g})",
                                  {"factor": s2 / scale, "used_scale": s2, "names": [name],
                                   "max_diff": diff}, 0.9)]
    return []


def _softmax_columns(S: np.ndarray) -> np.ndarray:
    return softmax_rows(S.T).T


def _softmax_axis(stage, got, want, ctx, width) -> List[Diagnosis]:
    src = ctx.get("src") or {}
    S = src.get(STAGES[stage].inputs[0])
    cands = []
    if S is not None:
        S = np.asarray(S, dtype=np.float64)
        cands.append(("got is the softmax over columns: each column sums to 1", _softmax_columns(S)))
        R, C = S.shape
        if R != C:
            cands.append(("got is the row softmax of QK_scaledᵀ written into the N×M buffer",
                          softmax_rows(S.T).reshape(R, C)))
    for how, cand in cands:
        # A column with no visible key (causal, N < M) normalizes 0/0: NaN, or 0 where guarded.
        diff = _explains(got, cand, want, width)
        if diff is None:
            diff = _explains(got, np.nan_to_num(cand, nan=0.0), want, width)
        if diff is not None:
            return [Diagnosis("softmax_axis", f"{stage} normalized along the wrong axis: "
                              f"{how} (max diff {diff:.2g})", {"how": how, "max_diff": diff}, 0.93)]
    # Without the input: columns summing to 1 while rows do not.
    if got.shape[0] > 1 and np.isfinite(got).all():
        col_dev = np.abs(got.sum(axis=0) - 1).max()
        row_dev = np.abs(got.sum(axis=1) - 1).max()
        if col_dev <= 1e-4 and row_dev > 1e-2:
            return [Diagnosis("softmax_axis", f"{stage} columns sum to 1 but rows do not "
                              f"(worst row sum off by {row_dev:.3g}): softmax over the wrong axis",
                              {"row_dev": float(row_dev), "col_dev": float(col_dev)}, 0.85)]
    return []


def _head_permuted(stage, got, want, ctx, width) -> List[Diagnosis]:
    ref_of_head: Optional[Callable[[int], np.ndarray]] = ctx.get("ref_of_head")
    dims, head = ctx.get("dims"), ctx.get("head")
    if ref_of_head is None or dims is None or head is None or dims.total_heads < 2:
        return []
    # Another head's reference comes from the reference chain: allow the chained error as well.
    loose = 4.0 * width + 1e-5 * float(np.max(np.abs(want[np.isfinite(want)]), initial=0.0))
    for h in range(min(dims.total_heads, MAX_HEADS_SEARCHED)):
        if h == head:
            continue
        other = np.asarray(ref_of_head(h), dtype=np.float64)
        if other.shape != got.shape:
            continue
        diff = _explains(got, other, want, loose / MATCH_WIDTHS)
        if diff is not None:
            b, hh = dims.decode_head(h)
            return [Diagnosis("head_permuted", f"{stage} head {head} holds head {h}'s result (batch "
                              f"{b}, head {hh}): max diff {diff:.2g} from its reference",
                              {"matches_head": h, "batch": b, "head_in_batch": hh, "max_diff": diff},
                              0.95)]
    return []


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


def _mask(stage, got, want, ctx, width) -> List[Diagnosis]:
    causal = bool(ctx.get("causal", False))
    N = got.shape[0]
    pattern = _mask_pattern(got, stage)
    if pattern is not None:
        M = got.shape[1]
        expected = causal_mask(N, M) if causal else np.zeros(got.shape, bool)
        if causal:
            upper = causal_mask(N, M)
            if upper.any():
                unmasked = upper & ~pattern & np.isfinite(got)
                if unmasked.sum() >= 0.5 * upper.sum() and not (pattern & upper).all():
                    return [Diagnosis("mask_missing", f"{stage}: causal masking is on but "
                                      f"{int(unmasked.sum())} of {int(upper.sum())} entries above the "
                                      "diagonal are not masked", {"count": int(unmasked.sum())}, 0.9)]
        if (pattern == expected).all():
            return []
        k = _fit_offset(pattern)
        if k is not None and k != 0 and (causal or k < M - 1):
            return [Diagnosis("mask_offset", f"{stage}: the mask is shifted by {k:+d}: entries "
                              f"c > r {'+' if k >= 0 else '-'} {abs(k)} are masked instead of c > r",
                              {"offset": k}, 0.9)]
        return []
    # Stages computed from the inputs under the mask: recompute with the candidate masks.
    src = ctx.get("src") or {}
    with_mask = SPECS[stage].with_mask
    if with_mask is None or not all(n in src for n in STAGES[stage].inputs):
        return []
    scale = float(ctx.get("scale", 1.0))
    M = next(np.asarray(src[n]).shape[0] for n in STAGES[stage].inputs if STAGES[n].rows == "M")  # keys
    if causal:
        cand = with_mask(src, scale, np.zeros((N, M), bool))
        diff = _explains(got, cand, want, width)
        if diff is not None:
            return [Diagnosis("mask_missing", f"{stage}: causal masking is on but got matches the "
                              f"unmasked attention (max diff {diff:.2g})", {"max_diff": diff}, 0.9)]
    offsets = [k for k in range(-MAX_MASK_OFFSET, MAX_MASK_OFFSET + 1) if k != 0]
    if M - N not in offsets and M != N:
        offsets.append(M - N)  # the bottom-right aligned mask
    for k in sorted(offsets, key=abs) if causal else []:
        masked = _offset_mask((N, M), k)
        if masked.all(axis=1).any():
            continue  # a row with no visible key: not a mask the binary could have used
        cand = with_mask(src, scale, masked)
        diff = _explains(got, cand, want, width)
        if diff is not None:
            return [Diagnosis("mask_offset", f"{stage}: the causal mask is shifted by {k:+d} (keys "
                              f"c <= r {'+' if k >= 0 else '-'} {abs(k)} visible)"
                              + (": bottom-right aligned" if k == M - N else "") +
                              f" (max diff {diff:.2g})", {"offset": k, "max_diff": diff}, 0.9)]
    return []


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


def _tile_boundary(stage, got, want, ctx, width) -> List[Diagnosis]:
    """Errors concentrated on lines at multiples of a period p, or on whole tiles of size p."""
    bound = ctx.get("bound")
    bnd = np.asarray(bound, np.float64) if bound is not None else np.full(got.shape, width)
    err = np.where((got == want) | (np.isnan(got) & np.isnan(want)), 0.0, np.abs(got - want))
    bad = ~(err <= bnd)
    if not bad.any() or bad.all():
        return []
    tiles = ctx.get("flash_tiles")
    out: List[Diagnosis] = []
    for axis, name, n in ((1, "rows", got.shape[0]), (0, "cols", got.shape[1])):
        lines = _lines(bad, axis)
        if len(lines) < 1 or len(lines) == n or n < 4:
            continue
        preferred = []
        if tiles:
            preferred = [int(tiles[0] if name == "rows" else tiles[1])]
        periods = preferred + [p for p in TILE_PERIODS if p not in preferred and p < n]
        hit = _periodic(lines, n, periods, name) or _whole_tiles(bad, lines, n, periods, name, axis)
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


def _whole_tiles(bad, lines, n, periods, name, axis) -> Optional[Diagnosis]:
    a, b = int(lines[0]), int(lines[-1]) + 1
    if len(lines) != b - a or b - a < 2:
        return None  # not one contiguous block of lines
    for p in periods:
        if p < 2 or p >= n or a % p:
            continue
        if (b - a) % p and b != n:
            continue
        block = bad[a:b, :] if name == "rows" else bad[:, a:b]
        if block.mean() < TILE_DENSITY:
            continue
        which = "the tail tile" if b == n and (b - a) <= p and n % p else \
            (f"tile {a // p}" if b - a == p else f"tiles {a // p}..{(b - 1) // p}")
        return Diagnosis("tile_boundary", f"errors fill {which} along {name} ({name} {a}..{b - 1}, "
                         f"tile size {p}); the rest is correct", {"period": p, "axis": name,
                                                                    "range": [a, b - 1]}, 0.75)
    return None


def _lse_log2(stage, got, want, ctx, width) -> List[Diagnosis]:
    """flash_lse in base 2: got ≈ want·log2(e), the log-sum-exp of a kernel that works with exp2 and
    log2 internally and does not convert back to the natural log."""
    # The base-2 result carries the natural one's rounding times log2(e).
    diff = _explains(got, want * LOG2_E, want, width * LOG2_E)
    if diff is None:
        return []
    return [Diagnosis("lse_log2", f"{stage} is in base 2: got ≈ want·log2(e) = want·{LOG2_E:.6g} "
                      f"(max diff {diff:.2g}); convert with ·ln(2) or use log instead of log2",
                      {"factor": LOG2_E, "max_diff": diff}, 0.93)]


# Each stage's spec (verify/specs/) names the hypotheses that apply to it.
_HYPOTHESES = {"nonfinite": _nonfinite, "unwritten": _unwritten, "transposed": _transposed, "layout": _layout,
               "scaled": _scaled, "softmax_axis": _softmax_axis, "head_permuted": _head_permuted, "mask": _mask,
               "tile_boundary": _tile_boundary, "lse_log2": _lse_log2}


def diagnose(stage: str, got: np.ndarray, want: np.ndarray, ctx: dict) -> List[Diagnosis]:
    """Every pattern that explains a failing stage × head, most confident first."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        return []
    width = _width(ctx.get("bound"), want)
    found: List[Diagnosis] = []
    for name, hyp in _HYPOTHESES.items():
        if name in SPECS[stage].diagnoses:
            with np.errstate(all="ignore"):
                found.extend(hyp(stage, got, want, ctx, width))
    codes = {d.code for d in found}
    if "nonfinite" in codes and "unwritten" in codes:
        # NaN in an unwritten region: the region explains it better than the bare count.
        for d in found:
            if d.code == "nonfinite":
                d.confidence = 0.85
    if "transposed" in codes:
        found = [d for d in found if d.code != "tile_boundary"]
    found.sort(key=lambda d: -d.confidence)
    return found
