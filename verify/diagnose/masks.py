"""The mask a program applied, when it is not the one the case asks for: the causal mask or window
missing or shifted (another alignment among them), a window bound off by a few keys or ignored,
the mask file ignored or read transposed. A hypothesis of verify/diagnose/hypotheses.py ("mask").

Every candidate is a whole mask (True hides), built from verify/variant.py's rule, the case's
mask and bias files: in a stage that holds the masked value (the scores' −inf, the weights' 0) the
mask is read off got and must equal a candidate exactly; elsewhere the stage is recomputed under
each candidate (from its sources, or from the case's inputs where the program wrote no upstream
stage) and must explain got while the reference does not.

Codes: mask_missing (the causal mask or the whole window not applied), mask_offset (the diagonal
moved by k keys: any k, the other alignment named as such), window_off (one bound of the window
off by a few keys, or the bounds swapped), window_missing (one bound of the window ignored, or the
window with the causal mask kept), mask_file_ignored, mask_file_transposed, mask_file_inverted.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Tuple

import numpy as np

from ..check.diagnosis import Diagnosis
from ..specs import SPECS
from ..specs.scores import STAND_IN_CEILING, STAND_IN_GAP, stand_ins
from ..stages import KEYS, MASK_INPUT, QUERIES, STAGES
from ..variant import ALIGNMENTS, NONE, TOP_LEFT, UNBOUNDED, Variant
from .base import MASK_FIT_ROWS, MATCH_WIDTHS, MAX_MASK_FIT_KEYS, MAX_MASK_OFFSET, explains
from .mask_words import ALIGNMENT_WORDS, alignment_words, keys_words, offset_detail, shift_words, window_words
from .inputs import (case_inputs, file_hidden, rebuilder, slope_of, structural_hidden, variant_of,
                     variant_tensors)

# A window bound off by up to this many keys is named (a larger error is another bug).
MAX_WINDOW_SHIFT = 3
# The codes of a wrong mask: they leave rows with no visible key (0/0), and explain them.
CODES = ("mask_missing", "mask_extra", "mask_offset", "window_off", "window_missing", "mask_file_ignored",
         "mask_file_transposed", "mask_file_inverted")
# What a causal mask the case does not have most often is: a case without a manifest, checked
# without --causal.
_EXTRA_HINT = ("HINT: if the program is meant to mask, the case must say so (its manifest; a case without one is "
               "not causal unless checked with --causal [ALIGN])")


@dataclass
class Candidate:
    """A mask a buggy program applied: its code, what the program did (a user's words) and the
    whole mask (True hides)."""
    code: str
    words: str
    hidden: np.ndarray
    detail: dict = field(default_factory=dict)
    confidence: float = 0.92
    hint: str = ""

    def diagnosis(self, stage: str, diff: Optional[float]) -> Diagnosis:
        how = f" (max diff {diff:.2g})" if diff is not None else ""
        return Diagnosis(self.code, f"{stage}: {self.words}{how}{'; ' + self.hint if self.hint else ''}",
                         {**self.detail, **({"max_diff": diff} if diff is not None else {})}, self.confidence)


class Masks:
    """The case's mask on one head (n query rows, m keys) and its parts: the structural mask of the
    variant at any diagonal offset, the files' hidden entries."""

    def __init__(self, ctx, n: int, m: int) -> None:
        self.v, self.n, self.m = variant_of(ctx), n, m
        self.tensors = variant_tensors(ctx)
        self.files = file_hidden(self.v, self.tensors, n, m)
        self.offset = self.v.offset(n, m)

    def at(self, offset: int, v: Optional[Variant] = None) -> np.ndarray:
        """The whole mask with row i's diagonal at key i + offset (v: another causal flag or window)."""
        return structural_hidden(self.v if v is None else v, self.n, self.m, offset) | self.files

    @property
    def run(self) -> np.ndarray:
        return self.at(self.offset)

    def of(self, v: Variant) -> np.ndarray:
        return self.at(v.offset(self.n, self.m), v)


# ---- the candidates -------------------------------------------------------------------------------

def _missing(masks: Masks) -> Iterator[Candidate]:
    """The causal mask not applied (nor the window, where the case has one)."""
    v = masks.v
    if not v.causal:
        return
    window = v.window != (UNBOUNDED, UNBOUNDED)
    what = f"causal masking and the window {v.window} are on" if window else "causal masking is on"
    yield Candidate("mask_missing", f"{what} but got matches the result without {'them' if window else 'it'}",
                    masks.files, {"window": list(v.window), "causal": True}, 0.9)


def _extra(masks: Masks) -> Iterator[Candidate]:
    """A causal mask, either alignment, where the case has none (nor a window)."""
    v = masks.v
    if v.structural:
        return
    for align in ALIGNMENTS if masks.n != masks.m else (TOP_LEFT,):
        where = f", {ALIGNMENT_WORDS[align]}" if masks.n != masks.m else ""
        yield Candidate("mask_extra", f"the case is not causal, but got matches the result under a causal mask{where}",
                        masks.of(v.with_(causal=True, align=align)), {"align": align}, 0.9, _EXTRA_HINT)


def _other_alignment(masks: Masks) -> Iterator[Candidate]:
    v, n, m = masks.v, masks.n, masks.m
    if not v.structural or n == m:
        return
    other = next(a for a in ALIGNMENTS if a != v.align)
    k = v.with_(align=other).offset(n, m) - masks.offset
    what = "causal mask" if v.causal else "window"
    yield Candidate("mask_offset", f"the {what} is {ALIGNMENT_WORDS[other]}, the case's is "
                    f"{ALIGNMENT_WORDS[v.align]}: its diagonal is shifted by {k:+d} ({shift_words(k)})",
                    masks.of(v.with_(align=other)), offset_detail(v, k, n, m))


def _window_bounds(v: Variant) -> Iterator[Tuple[str, str, Tuple[int, int]]]:
    """(code, what, the window a buggy program applied) for each bound of v's window off by a few
    keys, ignored, or the two swapped (the causal flag, which sets the right bound, kept)."""
    left, right = v.window
    sides = [("left", 0)] + ([] if v.causal else [("right", 1)])
    bounded = [(side, i) for side, i in sides if v.window[i] != UNBOUNDED]
    for side, i in bounded:
        for k in _shifts():
            bound = v.window[i] + k
            if bound < 0:
                continue
            w = (bound, right) if i == 0 else (left, bound)
            yield "window_off", f"the window's {side} bound is off by {k:+d}: {bound} keys instead of " \
                f"{v.window[i]} ({window_words(side, k)})", w
    if not v.causal and left != right and UNBOUNDED not in v.window:
        yield "window_off", f"the window's bounds are swapped: ({right}, {left}) instead of ({left}, {right})", \
            (right, left)
    for side, i in bounded if len(bounded) > 1 else ():
        w = (UNBOUNDED, right) if i == 0 else (left, UNBOUNDED)
        yield "window_missing", f"the window's {side} bound ({v.window[i]} keys) is ignored", w
    if bounded:
        kept = "; the causal mask is applied" if v.causal else ": got matches the result without it"
        yield "window_missing", f"the window {v.window} is ignored{kept}", (UNBOUNDED, UNBOUNDED)


def _shifts() -> List[int]:
    """1, -1, 2, -2, … MAX_WINDOW_SHIFT keys: the off-by-few errors, the smallest first."""
    return sorted((k for k in range(-MAX_WINDOW_SHIFT, MAX_WINDOW_SHIFT + 1) if k), key=lambda x: (abs(x), -x))


def _window(masks: Masks) -> Iterator[Candidate]:
    v = masks.v
    for code, words, w in _window_bounds(v):
        other = v.with_(window=w)
        yield Candidate(code, words, masks.of(other), {"window": list(w), "case_window": list(v.window)})
    left = v.window[0]
    if v.causal and left != UNBOUNDED:
        # The causal diagonal (the window's right bound) moved while its left bound stayed.
        for k in _shifts():
            if left + k >= 0:
                yield Candidate("mask_offset", f"the causal mask is shifted by {k:+d} ({shift_words(k)}); the "
                                "window's left bound is where it belongs",
                                masks.at(masks.offset + k, v.with_(window=(left + k, v.window[1]))),
                                {**offset_detail(v, k, masks.n, masks.m), "window_kept": True}, 0.9)


def _mask_file(masks: Masks) -> Iterator[Candidate]:
    v, mask = masks.v, masks.tensors.get(MASK_INPUT)
    if v.mask == NONE or mask is None:
        return
    without = file_hidden(v.with_(mask=NONE), masks.tensors, masks.n, masks.m)
    structural = structural_hidden(v, masks.n, masks.m, masks.offset)
    yield Candidate("mask_file_ignored", f"the mask file ({v.mask}) is ignored: got matches the result "
                    "without it", structural | without, {"coverage": v.mask})
    for how, read in _transposed_reads(mask):
        yield Candidate("mask_file_transposed", f"the mask file ({v.mask}) is read {how}",
                        structural | without | (read == 0), {"coverage": v.mask, "how": how})
    if (mask == 0).any():  # (a file of 1s alone, read inverted, would hide every key: an empty output's look)
        yield Candidate("mask_file_inverted", f"the mask file ({v.mask}) is read inverted: its 1s (True: keep) "
                        "hide keys and its 0s keep them", structural | without | (mask != 0), {"coverage": v.mask})


def _transposed_reads(x: np.ndarray) -> Iterator[Tuple[str, np.ndarray]]:
    """An N×M file read transposed: its transpose where square, else the buffer read as column-major
    (an M×N layout), as a program that swapped its strides does."""
    n, m = x.shape
    if n == m:
        yield "transposed (mask[j, i] for row i, key j)", x.T
    elif n > 1 and m > 1:
        yield "as column-major (transposed strides)", x.reshape(m, n).T


def _offsets(masks: Masks, fitted: List[int]) -> Iterator[Candidate]:
    """The structural mask at the run's diagonal shifted by k (fitted ones first, then small ones)."""
    v, n, m = masks.v, masks.n, masks.m
    if not v.structural:
        return
    for k in dict.fromkeys(fitted + sorted(range(-MAX_MASK_OFFSET, MAX_MASK_OFFSET + 1), key=abs)):
        if k == 0:
            continue
        yield Candidate("mask_offset", f"the {'causal mask' if v.causal else 'window'} is shifted by {k:+d} "
                        f"({keys_words(masks.offset + k)} visible instead of {keys_words(masks.offset)}: "
                        f"{shift_words(k)}){alignment_words(v, masks.offset + k, n, m)}",
                        masks.at(masks.offset + k), offset_detail(v, k, n, m), 0.9)


def candidates(masks: Masks, fitted: List[int]) -> Iterator[Candidate]:
    """Every named mask, most specific first; none equal to the run's own or to another before it
    (told apart by a digest: one N×M mask is held at a time)."""
    seen = {_digest(masks.run)}
    for group in (_missing(masks), _extra(masks), _other_alignment(masks), _mask_file(masks), _window(masks),
                  _offsets(masks, fitted)):
        for c in group:
            digest = _digest(c.hidden)
            if digest not in seen:
                seen.add(digest)
                yield c


def _digest(hidden: np.ndarray) -> bytes:
    return hashlib.blake2b(np.packbits(hidden).tobytes(), digest_size=16).digest()


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
    for c in candidates(masks, [k - masks.offset for k in fitted]):
        diff = _explains_empty_rows(got, rebuild(c.hidden), want, width, c.hidden)
        if diff is not None:
            return [c.diagnosis(stage, diff)]
    return []


def _explains_empty_rows(got, cand, want, width, hidden) -> Optional[float]:
    """explains(), with a row that sees no key under the candidate mask (and has as many rows in
    the stage) taken as 0/0 (NaN) or as 0 (a kernel that guards it, as flash-attn does)."""
    diff = explains(got, cand, want, width)
    empty = hidden.all(axis=1)
    if diff is not None or not empty.any() or cand.shape[0] != empty.shape[0]:
        return diff
    for fill in (np.nan, 0.0):
        diff = explains(got, np.where(empty[:, None], fill, cand), want, width)
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
        return _plain_offset(stage, pattern)
    fitted = _fit_offset(pattern & ~masks.files)
    for c in candidates(masks, [] if fitted is None else [fitted - masks.offset]):
        if (pattern == c.hidden).all():
            found = c.diagnosis(stage, None)
            if c.code == "mask_missing":  # (read off where got holds the masked value: none does)
                what = "causal masking is on" if masks.v.causal else "the case has a sliding window"
                found.message = (f"{stage}: {what} but no entry it hides holds the masked value "
                                 f"{SPECS[stage].masked_value:g} ({_STAND_IN})")
            return [found]
    return _stand_in(stage, got, pattern, masks)


def _plain_offset(stage: str, pattern: np.ndarray) -> List[Diagnosis]:
    """A case without a mask whose program masked causally at offset k (k < M − 1: some key hidden)."""
    N, M = pattern.shape
    k = _fit_offset(pattern)
    if k is None or k >= M - 1:
        return []
    v = Variant()
    align = next((a for a in ALIGNMENTS if v.with_(causal=True, align=a).offset(N, M) == k), None)
    if align is not None:  # the causal mask itself, where the case has none
        where = f", {ALIGNMENT_WORDS[align]}" if N != M else ""
        return [Diagnosis("mask_extra", f"{stage}: the case is not causal, but entries c > r "
                          f"{'+ ' + str(k) + ' ' if k else ''}are masked (a causal mask{where}); {_EXTRA_HINT}",
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
    width to match with), from the case's inputs where the program wrote no upstream stage, else
    from the stage's own sources; None where neither recomputes it."""
    built = rebuilder(stage, ctx, width)
    if built is not None:
        rebuild, width = built
        qkv = case_inputs(ctx)
        N, M = qkv[QUERIES].shape[0], qkv[KEYS].shape[0]
        return (lambda masked: rebuild(qkv, masked)), _row_fitter(rebuild, qkv, ctx), (N, M), width
    src, with_mask = ctx.src, SPECS[stage].with_mask
    if with_mask is None or not all(n in src for n in STAGES[stage].inputs):
        return None
    # Query rows and keys from the inputs: a key-major stage (dK, dV) has M rows, not N.
    N = next(np.asarray(src[n]).shape[0] for n in STAGES[stage].inputs if STAGES[n].rows == "N")
    M = next(np.asarray(src[n]).shape[0] for n in STAGES[stage].inputs if STAGES[n].rows == "M")
    v, s = variant_of(ctx), slope_of(ctx)
    return (lambda masked: with_mask(src, ctx.scale, masked, variant=v, slope=s)), None, (N, M), width


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
