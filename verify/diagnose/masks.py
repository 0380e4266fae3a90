"""The mask a program applied, when it is not the one the case asks for: the causal mask or window
missing or shifted (another alignment among them), a window bound off by a few keys or ignored,
the mask file ignored or read transposed. A hypothesis of verify/diagnose/hypotheses.py ("mask").

Every candidate is a whole mask (True hides: verify/diagnose/mask_candidates.py), built from
verify/variant.py's rule, the case's mask and bias files: in a stage that holds the masked value
(the scores' −inf, the weights' 0) the mask is read off got and must equal a candidate exactly;
elsewhere the stage is recomputed under each candidate (from its sources, from the case's inputs
where the program wrote no upstream stage, or, for a K/V head's summed dK and dV, as the sum over
its query heads: verify/diagnose/heads.py's group_sum) and must explain got while the reference
does not.

Codes: mask_missing (the causal mask or the whole window not applied), mask_offset (the diagonal
moved by k keys: any k, the other alignment named as such), window_off (one bound of the window
off by a few keys, or the bounds swapped), window_missing (one bound of the window ignored, or the
window with the causal mask kept), mask_file_ignored, mask_file_transposed, mask_file_inverted,
causal_tile_skip (a kernel that skips the key tiles past the diagonal by its query tile's first
row: the tile's later rows lose the keys of the tiles it skipped).
"""
from __future__ import annotations

from typing import Callable, List, Optional

import numpy as np

from ..check.diagnosis import Diagnosis
from ..specs import SPECS
from ..specs.scores import STAND_IN_CEILING, STAND_IN_GAP, stand_ins
from ..stages import KEYS, QUERIES, STAGES
from ..variant import ALIGNMENTS, Variant
from .base import MASK_FIT_ROWS, MATCH_WIDTHS, MAX_GROUP_MASK_VALUES, MAX_MASK_FIT_KEYS, explains_closely
from .mask_candidates import EXTRA_HINT, CODES, Masks, candidates  # noqa: F401 (CODES: the hypothesis's codes)
from .mask_words import ALIGNMENT_WORDS, alignment_words, offset_detail, shift_words
from .heads import group_rebuildable, group_sum
from .inputs import case_inputs, rebuilder, rows_fit, slope_of, variant_of, variant_tensors, worst_rows
from .mask_gradients import gradient_recompute

# ---- the hypothesis -------------------------------------------------------------------------------

def _mask_pattern(got: np.ndarray, stage: str) -> Optional[np.ndarray]:
    """Where got holds the stage's masked value (a weight row with no visible key normalizes 0/0:
    NaN counts as masked too; scores masked with a finite stand-in for −inf, such as -1e9, count
    where it lies far below the row's other scores); None for stages that hold no masked entries."""
    value = SPECS[stage].masked_value
    if value is None:
        return None
    if value == -np.inf:
        far = np.isfinite(got) & (got <= STAND_IN_CEILING)
        return (got == value) | stand_ins(got, far | (got == value))
    return (got == value) | (np.isnan(got) if value == 0 else False)


def mask(stage, got, want, ctx, width) -> List[Diagnosis]:
    pattern = _mask_pattern(got, stage)
    if pattern is not None:
        return _mask_in_pattern(stage, got, pattern, ctx)
    recompute = _mask_recompute(stage, ctx, width)
    if recompute is None:
        return []
    rebuild, fit_rows, (N, M), width = recompute
    masks = Masks(ctx, N, M)
    fitted = _fitted_offsets(fit_rows, got, (N, M), width) if fit_rows is not None else []
    rows = worst_rows(got, want) if fit_rows is not None and got.shape[0] == N else None
    for c in candidates(masks, [k - masks.offset for k in fitted], tile_skips=rows is not None):
        if rows is not None and not rows_fit(fit_rows, got, rows, c.mask_rows, width):
            continue
        diff = _explains_empty_rows(got, rebuild(c.mask()), want, width, c.mask())
        if diff is not None:
            return [c.diagnosis(stage, diff)]
    return []



def _explains_empty_rows(got, cand, want, width, hidden) -> Optional[float]:
    """explains_closely(), with a row that sees no key under the candidate mask (and has as many
    rows in the stage) taken as 0/0 (NaN) or as 0 (a kernel that guards it, as flash-attn does).
    (Closely: over many keys a mask that moves each row's keys by thousands may move the output by
    less than a hundred widths of its widest bound, yet got reproduces it to its own rounding.)"""
    diff = explains_closely(got, cand, want, width)
    empty = hidden.all(axis=1)
    if diff is not None or not empty.any() or cand.shape[0] != empty.shape[0]:
        return diff
    for fill in (np.nan, 0.0):
        diff = explains_closely(got, np.where(empty[:, None], fill, cand), want, width, nan_evidence=True)
        if diff is not None:
            return diff
    return None


def _mask_in_pattern(stage: str, got: np.ndarray, pattern: np.ndarray, ctx) -> List[Diagnosis]:
    """A stage that holds the masked value: the mask read off where it holds it."""
    N, M = got.shape
    masks = Masks(ctx, N, M)
    if (pattern == masks.run).all():
        return []
    if not masks.v.structural and not masks.files.any():
        return _plain_offset(stage, pattern, masks)
    fitted = _fit_offset(pattern & ~masks.files)
    for c in candidates(masks, [] if fitted is None else [fitted - masks.offset]):
        if (pattern == c.mask()).all():
            found = c.diagnosis(stage, None)
            if c.code == "mask_missing":  # (read off where got holds the masked value: none does)
                what = "causal masking is on" if masks.v.causal else "the case has a sliding window"
                found.message = (f"{stage}: {what} but no entry it hides holds the masked value "
                                 f"{SPECS[stage].masked_value:g} ({_STAND_IN})")
            return [found]
    return _stand_in(stage, got, pattern, masks)


def _plain_offset(stage: str, pattern: np.ndarray, masks: Masks) -> List[Diagnosis]:
    """A case without a mask whose program masked causally at offset k (k < M − 1: some key hidden);
    k in the whole head's rows."""
    fitted = _fit_offset(pattern)
    if fitted is None or fitted >= pattern.shape[1] - 1:
        return []
    v, k, N, M = Variant(), fitted - masks.first, masks.N, masks.M
    align = next((a for a in ALIGNMENTS if v.with_(causal=True, align=a).offset(N, M) == k), None)
    if align is not None:  # the causal mask itself, where the case has none
        where = f", {ALIGNMENT_WORDS[align]}" if N != M else ""
        return [Diagnosis("mask_extra", f"{stage}: the case is not causal, but entries c > r "
                          f"{'+ ' + str(k) + ' ' if k else ''}are masked (a causal mask{where}); {EXTRA_HINT}",
                          {"align": align, "offset": k}, 0.9)]
    return [Diagnosis("mask_offset", f"{stage}: the mask is shifted by {k:+d}: entries c > r "
                      f"{'+' if k >= 0 else '-'} {abs(k)} are masked instead of c > r ({shift_words(k)})"
                      f"{alignment_words(v, k, N, M)}", offset_detail(v, k, N, M), 0.9)]


def _stand_in(stage: str, got: np.ndarray, pattern: np.ndarray, masks: Masks) -> List[Diagnosis]:
    """The mask applied with a finite stand-in (−1e9), or not at all: most hidden entries hold a
    finite value other than the masked one."""
    hidden = masks.run & ~masks.files
    if not hidden.any():
        return []
    unmasked = hidden & ~pattern & np.isfinite(got)
    if unmasked.sum() < 0.5 * hidden.sum() or (pattern & hidden).all():
        return []
    if not unmasked[~masks.run.all(axis=1)].any():
        return []  # only rows that see no key: the stage's own check says what such a row holds
    value = SPECS[stage].masked_value
    what = "causal masking is on" if masks.v.causal else "the case has a sliding window"
    return [Diagnosis("mask_missing", f"{stage}: {what} but {int(unmasked.sum())} of {int(hidden.sum())} "
                      f"entries it hides do not hold the masked value {value:g} ({_STAND_IN})",
                      {"count": int(unmasked.sum())}, 0.9)]


_STAND_IN = ("not masked, or masked with a finite value too near the row's scores: a stand-in for -inf "
             f"lies at least {STAND_IN_GAP:g} below the row's largest visible score, as -1e9 does")


def _mask_recompute(stage: str, ctx, width):
    """(the stage under any whole mask, its sampled rows under per-row masks or None, (N, M), the
    width to match with), from the case's inputs where the program wrote no upstream stage (a K/V
    head's sum: its group's), else from the stage's own sources; None where none recomputes it."""
    built = rebuilder(stage, ctx, width)
    if built is not None:
        rebuild, width = built
        qkv = case_inputs(ctx)
        N, M = qkv[QUERIES].shape[0], qkv[KEYS].shape[0]
        return (lambda masked: rebuild(qkv, masked)), _row_fitter(rebuild, qkv, ctx), (N, M), width
    if ctx.head_ctx is None and group_rebuildable(ctx):
        # (group_sum rebuilds under a mask the stages with a masked reference: the flash dK, dV)
        return _group_recompute(stage, ctx, width) if SPECS[stage].with_mask is not None else None
    gradient = gradient_recompute(stage, ctx, width)  # (a program that wrote its gradients alone)
    if gradient is not None:
        return gradient
    src, with_mask = ctx.src, SPECS[stage].with_mask
    if with_mask is None or not all(n in src for n in STAGES[stage].inputs):
        return None
    # Query rows and keys from the inputs: a key-major stage (dK, dV) has M rows, not N.
    N = next(np.asarray(src[n]).shape[0] for n in STAGES[stage].inputs if STAGES[n].rows == "N")
    M = next(np.asarray(src[n]).shape[0] for n in STAGES[stage].inputs if STAGES[n].rows == "M")
    v, s = variant_of(ctx), slope_of(ctx)
    return (lambda masked: with_mask(src, ctx.scale, masked, variant=v, slope=s)), None, (N, M), width


def _group_recompute(stage: str, ctx, width):
    """_mask_recompute's for a K/V head's summed stage (dK, dV): the sum over its group's query
    heads, each recomputed from its inputs under the mask, as a program that applied the mask to
    every query head wrote it."""
    group = list(ctx.dims.query_heads_of(ctx.head))
    x = ctx.inputs_of_head(group[0])
    N, M = np.shape(x[QUERIES])[0], np.shape(x[KEYS])[0]
    if N * M * len(group) > MAX_GROUP_MASK_VALUES:
        return None
    v = variant_of(ctx)
    return (lambda masked: group_sum(stage, ctx, group, v, masked)), None, (N, M), width


def _row_fitter(rebuild: Callable, qkv, ctx) -> Optional[Callable]:
    """Sampled query rows recomputed under per-row masks, for a case whose scores do not depend on
    the row's place (ALiBi's distances and the files' rows do): None otherwise."""
    v = variant_of(ctx)
    if v.alibi or variant_tensors(ctx):
        return None

    def fit_rows(rows, masked):
        return rebuild({**qkv, QUERIES: qkv[QUERIES][rows]}, masked)
    return fit_rows


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


def _offset_mask(shape, k: int) -> np.ndarray:
    """Masked where c > r + k (k = 0: the top-left causal mask)."""
    return np.triu(np.ones(shape, dtype=bool), k=k + 1)


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
