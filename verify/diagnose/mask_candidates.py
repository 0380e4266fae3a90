"""The masks a buggy program applies instead of the case's (verify/diagnose/masks.py tries them):
each a whole mask (True hides) built from verify/variant.py's rule and the case's mask and bias
files, named in a user's words. On a slab of a longer head's rows (verify/check/slab.py) a diagonal
is placed, and an alignment named, by the whole head's rows and keys.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

from ..check.diagnosis import Diagnosis
from ..stages import MASK_INPUT
from ..variant import ALIGNMENTS, NONE, TOP_LEFT, UNBOUNDED, Variant
from .base import MAX_MASK_OFFSET
from .mask_words import ALIGNMENT_WORDS, alignment_words, keys_words, offset_detail, shift_words, window_words
from .inputs import file_hidden, structural_hidden, variant_of, variant_tensors

# A window bound off by up to this many keys is named (a larger error is another bug).
MAX_WINDOW_SHIFT = 3
# The query and key tiles a causal kernel's tile skip is tried with (each pair): the multiples of 16
# that kernels use, up to 256.
SKIP_TILES = tuple(range(16, 257, 16))
# The codes of a wrong mask: they leave rows with no visible key (0/0), and explain them.
CODES = ("mask_missing", "mask_extra", "mask_offset", "window_off", "window_missing", "mask_file_ignored",
         "mask_file_transposed", "mask_file_inverted", "causal_tile_skip")
# What a causal mask the case does not have most often is: a case without a manifest, checked
# without --causal (from Python: without causal=True).
EXTRA_HINT = ("HINT: if the program is meant to mask, the case must say so (its manifest; a case without one is "
               "not causal unless checked with --causal [ALIGN], or from Python with causal=True)")


@dataclass
class Candidate:
    """A mask a buggy program applied: its code, what the program did (a user's words) and the
    whole mask (True hides), or a function of rows that builds those rows of it (the whole mask
    then built when first asked for: a search of many masks tries each on a few rows first)."""
    code: str
    words: str
    hidden: Optional[np.ndarray]
    detail: dict = field(default_factory=dict)
    confidence: float = 0.92
    hint: str = ""
    build_rows: Optional[Callable[[object], np.ndarray]] = None  # (of an index array, or slice(None): all)

    def mask(self) -> np.ndarray:
        """The whole mask (built now where it was not)."""
        if self.hidden is None:
            self.hidden = self.build_rows(slice(None))
        return self.hidden

    def mask_rows(self, rows: np.ndarray) -> np.ndarray:
        """Those rows of the mask (without building the rest)."""
        return self.hidden[rows] if self.hidden is not None else self.build_rows(rows)

    def diagnosis(self, stage: str, diff: Optional[float]) -> Diagnosis:
        how = f" (max diff {diff:.2g})" if diff is not None else ""
        return Diagnosis(self.code, f"{stage}: {self.words}{how}{'; ' + self.hint if self.hint else ''}",
                         {**self.detail, **({"max_diff": diff} if diff is not None else {})}, self.confidence)


class Masks:
    """The case's mask on one head (n query rows, m keys) and its parts: the structural mask of the
    variant at any diagonal offset, the files' hidden entries. On a slab of a longer head's rows,
    first, N and M place them in the head, whose alignments name an offset."""

    def __init__(self, ctx, n: int, m: int) -> None:
        self.v, self.n, self.m = variant_of(ctx), n, m
        self.tensors = variant_tensors(ctx)
        self.files = file_hidden(self.v, self.tensors, n, m)
        self.first, self.N, self.M = ctx.rows_of_head or (0, n, m)
        self.offset = self.offset_of(self.v)

    def offset_of(self, v: Variant) -> int:
        """Key index of row 0's diagonal under v's alignment of the whole head."""
        return self.first + v.offset(self.N, self.M)

    def alignment_words(self, offset: int) -> str:
        """Which alignment of the whole head a diagonal at `offset` is, in words ("" where none)."""
        return alignment_words(self.v, offset - self.first, self.N, self.M)

    def offset_detail(self, k: int) -> dict:
        return offset_detail(self.v, k, self.N, self.M)

    def at(self, offset: int, v: Optional[Variant] = None) -> np.ndarray:
        """The whole mask with row i's diagonal at key i + offset (v: another causal flag or window)."""
        return structural_hidden(self.v if v is None else v, self.n, self.m, offset) | self.files

    @property
    def run(self) -> np.ndarray:
        return self.at(self.offset)

    def of(self, v: Variant) -> np.ndarray:
        return self.at(self.offset_of(v), v)


# ---- the candidates -------------------------------------------------------------------------------

def _missing(masks: Masks) -> Iterator[Candidate]:
    """The causal mask not applied (nor the window, where the case has one)."""
    v = masks.v
    if not v.causal:
        return
    window = v.window != (UNBOUNDED, UNBOUNDED)
    what = f"causal masking and the window {v.window} are on" if window else "causal masking is on"
    words = f"{what} but got matches the result without {'them' if window else 'it'}"
    other = next(a for a in ALIGNMENTS if a != v.align)
    if masks.N != masks.M and (masks.of(v.with_(align=other)) == masks.files).all():
        # Rows that the other alignment lets see every key (a slab's, or a decode step's one query
        # row) cannot tell the two apart.
        words += (f", or with it {ALIGNMENT_WORDS[other]} (on these rows the two hide the same keys; the case's "
                  f"is {ALIGNMENT_WORDS[v.align].split(' (')[0]})")
    yield Candidate("mask_missing", words, masks.files, {"window": list(v.window), "causal": True}, 0.9)


def _extra(masks: Masks) -> Iterator[Candidate]:
    """A causal mask, either alignment, where the case has none (nor a window)."""
    v = masks.v
    if v.structural:
        return
    for align in ALIGNMENTS if masks.N != masks.M else (TOP_LEFT,):
        where = f", {ALIGNMENT_WORDS[align]}" if masks.N != masks.M else ""
        yield Candidate("mask_extra", f"the case is not causal, but got matches the result under a causal mask{where}",
                        masks.of(v.with_(causal=True, align=align)), {"align": align}, 0.9, EXTRA_HINT)


def _other_alignment(masks: Masks) -> Iterator[Candidate]:
    v = masks.v
    if not v.structural or masks.N == masks.M:
        return
    other = next(a for a in ALIGNMENTS if a != v.align)
    k = masks.offset_of(v.with_(align=other)) - masks.offset
    what = "causal mask" if v.causal else "window"
    yield Candidate("mask_offset", f"the {what} is {ALIGNMENT_WORDS[other]}, the case's is "
                    f"{ALIGNMENT_WORDS[v.align]}: its diagonal is shifted by {k:+d} ({shift_words(k)})",
                    masks.of(v.with_(align=other)), masks.offset_detail(k))


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
                                {**masks.offset_detail(k), "window_kept": True}, 0.9)


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
    v = masks.v
    if not v.structural:
        return
    for k in dict.fromkeys(fitted + sorted(range(-MAX_MASK_OFFSET, MAX_MASK_OFFSET + 1), key=abs)):
        if k == 0:
            continue
        yield Candidate("mask_offset", f"the {'causal mask' if v.causal else 'window'} is shifted by {k:+d} "
                        f"({keys_words(masks.offset - masks.first + k)} visible instead of "
                        f"{keys_words(masks.offset - masks.first)}: "
                        f"{shift_words(k)}){masks.alignment_words(masks.offset + k)}",
                        masks.at(masks.offset + k), masks.offset_detail(k), 0.9)


def _tile_skips(masks: Masks) -> Iterator[Candidate]:
    """A causal kernel that tests whether a key tile lies past the diagonal at its query tile's
    first row, where the tile's last row decides: a key tile starting between the two diagonals
    is skipped for every row of the query tile (query tiles counted from the head's row 0). Each
    tiling leaves a row the keys up to a last one (with the files, no such prefix: not tried);
    tilings with the same last keys are one candidate, whose rows are built when asked for."""
    v = masks.v
    if not v.causal or masks.files.any():
        return
    rows = np.arange(masks.first, masks.first + masks.n)
    diag = np.arange(masks.n) + masks.offset  # (in the stage's own columns)
    tilings: Dict[bytes, List[Tuple[int, int]]] = {}
    last: Dict[bytes, np.ndarray] = {}
    for br in SKIP_TILES:
        first_diag = (rows // br) * br - masks.first + masks.offset
        for bc in SKIP_TILES:
            keys = np.minimum(diag, (first_diag // bc + 1) * bc - 1)  # the last key of the last tile visited
            if (keys < diag).any():
                tilings.setdefault(keys.tobytes(), []).append((br, bc))
                last.setdefault(keys.tobytes(), keys)
    cols, run = np.arange(masks.m), masks.run
    for key, pairs in tilings.items():
        (br, bc), same = pairs[0], ", ".join(f"{r} x {c}" for r, c in pairs[1:4])
        more = f" and {len(pairs) - 4} more" if len(pairs) > 4 else ""

        def part(r, keys=last[key]) -> np.ndarray:
            return run[r] | (cols[None, :] > keys[r][:, None])
        yield Candidate("causal_tile_skip", f"the causal tile skip tests a query tile's first row: key tiles "
                        f"of {bc} that start past its diagonal are skipped for all {br} rows of the query "
                        "tile (its last row's diagonal decides)"
                        + (f"; query x key tiles of {same}{more} hide the same keys" if same else ""), None,
                        {"query_tile": br, "key_tile": bc, "tilings": [list(p) for p in pairs]},
                        0.9, build_rows=part)


def candidates(masks: Masks, fitted: List[int], tile_skips: bool = True) -> Iterator[Candidate]:
    """Every named mask, most specific first; none equal to the run's own or to another before it
    (told apart by a digest: one N×M mask is held at a time). tile_skips: with the causal tile
    skips (a search of many tilings, for a caller that tries each on a few rows first)."""
    seen = {digest(masks.run)}
    for group in (_missing(masks), _extra(masks), _other_alignment(masks), _mask_file(masks), _window(masks),
                  _offsets(masks, fitted), _tile_skips(masks) if tile_skips else ()):
        for c in group:
            if c.hidden is None:  # (built when asked for: its search keeps its own apart)
                yield c
                continue
            key = digest(c.hidden)
            if key not in seen:
                seen.add(key)
                yield c


def digest(hidden: np.ndarray) -> bytes:
    return hashlib.blake2b(np.packbits(hidden).tobytes(), digest_size=16).digest()
