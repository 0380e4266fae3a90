"""The words of verify/diagnose/masks.py's diagnoses: how a shifted mask or window errs, in a
query's terms, and which alignment an offset is."""
from __future__ import annotations

from typing import Optional

from ..text import plural
from ..variant import ALIGNMENTS, BOTTOM_RIGHT, TOP_LEFT, Variant

# The convention each alignment is, in a user's words.
CONVENTIONS = {TOP_LEFT: "PyTorch's convention", BOTTOM_RIGHT: "flash-attn's convention"}
ALIGNMENT_WORDS = {a: f"{a} aligned ({CONVENTIONS[a]})" for a in ALIGNMENTS}


def shift_words(k: int) -> str:
    """Which way a mask shifted by k errs, in a query's terms."""
    if k > 0:
        return f"each query sees {plural(k, 'key')} past the diagonal"
    return ("the diagonal masked too" if k == -1 else f"the diagonal and {plural(-k - 1, 'key')} before it "
            "masked too") + f": each query sees {plural(-k, 'key')} fewer"


def keys_words(offset: int) -> str:
    return "keys c <= r" + (f" {'+' if offset > 0 else '-'} {abs(offset)}" if offset else "")


def window_words(side: str, k: int) -> str:
    more = (k > 0)
    return f"each query sees {plural(abs(k), 'key')} {'more' if more else 'fewer'} on the {side}"


def alignment_of(v: Variant, offset: int, n: int, m: int) -> Optional[str]:
    """The alignment whose diagonal is at `offset`, when it is not the case's own."""
    return next((a for a in ALIGNMENTS if a != v.align and n != m and v.with_(align=a).offset(n, m) == offset), None)


def alignment_words(v: Variant, offset: int, n: int, m: int) -> str:
    a = alignment_of(v, offset, n, m)
    return f": {ALIGNMENT_WORDS[a]}, the case's mask is {ALIGNMENT_WORDS[v.align].split(' (')[0]}" if a else ""


def offset_detail(v: Variant, k: int, n: int, m: int) -> dict:
    a = alignment_of(v, v.offset(n, m) + k, n, m)
    return {"offset": k, "alignment": a, "bottom_right": a == BOTTOM_RIGHT}
