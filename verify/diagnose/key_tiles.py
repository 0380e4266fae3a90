"""A key tile skipped: a flash kernel's key loop that never reads one tile of w keys (keys t·w up
to (t+1)·w − 1, a loop bound or a tile counter off), so that every row's softmax leaves them out.
A hypothesis of verify/diagnose/hypotheses.py, searched with the softmax loops' (after every other
cause) on the stages whose spec names it.

The widths tried are the run's own key tile (run.toml's flash_block_k) where it is known, else the
usual ones (base.KEY_TILES) and then every multiple of 16 up to 256, each at every tile. The rows
without tile t are the combine of the tiles before it and those after it (each tile's log-sum-exp
and output computed once on a few sampled rows, then merged from either end: no tile's sum is
subtracted from the row's, where it could cancel the rest), and the stage is recomputed whole only
for a tile those rows fit.
"""
from __future__ import annotations

from typing import Iterator, List, Optional, Tuple

import numpy as np

from ..check.diagnosis import KEY_TILE_SKIPPED, Diagnosis
from ..check.splits import combine
from ..model.attention import log_sum_exp_rows, softmax_rows
from .base import KEY_TILES, MIN_SEARCHED_VALUES
from .inputs import run_key_tile
from .screens import SAMPLED_ROWS, loop_rows, loop_screen
from .softmax_loops import MIN_ROWS, loop_head, loop_matches

CODES = (KEY_TILE_SKIPPED,)
_ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth")

# (each row's log-sum-exp, a column, and output, or None) over some of the keys
_State = Tuple[np.ndarray, Optional[np.ndarray]]


# Without the run's own width: the usual widths first, then every other multiple of 16 up to 256
# (48, 80, 96, … : key tiles a kernel sizes to its shared memory), each first screened on the
# sampled rows.
SEARCHED_WIDTHS = KEY_TILES + tuple(w for w in range(16, 257, 16) if w not in KEY_TILES)


def _widths(ctx, m: int) -> List[int]:
    """The tile widths tried: the run's own where known, else SEARCHED_WIDTHS; two tiles at least
    (a kernel that skips its only tile reads no key)."""
    own = run_key_tile(ctx)
    return [w for w in (SEARCHED_WIDTHS if own is None else (own,)) if w < m]


def _tile_states(head, rows: np.ndarray, width: int) -> List[_State]:
    """Each tile's (log-sum-exp, output) on the sampled rows, under the run's mask."""
    masked = np.where(head.hidden[rows], -np.inf, head.logits[rows])
    out = []
    for k0 in range(0, masked.shape[1], width):
        s = masked[:, k0:k0 + width]
        out.append((log_sum_exp_rows(s), None if head.values is None else softmax_rows(s) @ head.values[k0:k0 + width]))
    return out


def _merged(a: _State, b: _State) -> _State:
    """Two states' keys together (the combine of two splits)."""
    lse, out, _ = combine(np.concatenate([a[0], b[0]], axis=1), None if a[1] is None else np.stack([a[1], b[1]], 1))
    return lse, out


def _without_each(states: List[_State]) -> Iterator[Tuple[int, _State]]:
    """(t, the state of every tile but t), each from the merge of the tiles before t and after it."""
    empty = (np.full_like(states[0][0], -np.inf), None if states[0][1] is None else np.zeros_like(states[0][1]))
    before, after = [empty], [empty]
    for s in states[:-1]:
        before.append(_merged(before[-1], s))
    for s in states[:0:-1]:
        after.append(_merged(s, after[-1]))
    for t in range(len(states)):
        yield t, _merged(before[t], after[len(states) - 1 - t])


def _ordinal(t: int) -> str:
    """'first', ..., 'tenth', '11th', '22nd' for tile t (counted from 0)."""
    n = t + 1
    if n <= len(_ORDINALS):
        return _ORDINALS[t]
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _which(t: int, width: int, m: int) -> str:
    """'keys 64..127 (the second tile of 64 keys)', or the last, partial tile's."""
    first, end = t * width, min((t + 1) * width, m)
    which = "the last, partial tile" if end - first < width else f"the {_ordinal(t)} tile"
    return f"keys {first}..{end - 1} ({which} of {width} keys)"


def key_tile(stage, got, want, ctx, width) -> List[Diagnosis]:
    head = loop_head(stage, got, ctx, width)
    # (a few rows, a decode step's one, leave the keys they weigh little free to fit some tile)
    if head is None or got.size < MIN_SEARCHED_VALUES or got.shape[0] < MIN_ROWS:
        return []
    m = head.logits.shape[1]
    rows = loop_rows(got, want)  # (rows never written are the unwritten diagnosis's)
    if rows.size < min(MIN_ROWS, SAMPLED_ROWS):
        return []
    cols, fits = np.arange(m), loop_screen(got, want, head)
    for w in _widths(ctx, m):
        for t, (lse, out) in _without_each(_tile_states(head, rows, w)):
            skipped = (cols >= t * w) & (cols < (t + 1) * w)
            sampled = head.from_state(lse, out, np.where(head.hidden[rows] | skipped, -np.inf, head.logits[rows]))
            if not fits(sampled, rows):
                continue
            diff = loop_matches(got, want, head, head.softmax_stage(np.where(skipped, -np.inf, head.logits)))
            if diff is not None:
                return [Diagnosis(KEY_TILE_SKIPPED, f"{stage}: the key loop skips a whole tile: {_which(t, w, m)} are "
                                  f"never read, left out of every row's softmax (max diff {diff:.2g})",
                                  {"tile": w, "keys": [t * w, min((t + 1) * w, m) - 1], "max_diff": diff}, 0.92)]
    return []


HYPOTHESES = {"key_tile": key_tile}
# (a search over tile widths and tiles, tried with the softmax loops' searches)
SEARCHES = ("key_tile",)
