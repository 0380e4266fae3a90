"""Which candidates a search over many readings (the key loops' tile widths, each key tile)
computes on a whole stage: those that a few of its rows leave able to explain it (loop_screen), on
the most wrong of the rows the program wrote (loop_rows). The screen is exact: it drops no
candidate that the whole stage's match (explains_rows, closely) would take."""
from __future__ import annotations

from typing import Callable

import numpy as np

from .base import CLOSER, DISTINCT_WIDTHS, MATCH_WIDTHS, maxdiff
from .inputs import blank_rows, worst_rows

SAMPLED_ROWS = 4


def loop_screen(got, want, head) -> Callable[[np.ndarray, np.ndarray], bool]:
    """fits(candidate's rows, rows): whether a candidate's stage on a few of got's rows leaves it
    one that loop_matches may take, so that only those are computed whole. On the rows it judges
    (those written), the candidate must fit got within the largest match width any candidate that
    explains got can have (base.match_width grows with the candidate's largest value, which lies
    within that width of got's), and it must be able to lie farther from want than got lies closer
    to it, CLOSER times (or DISTINCT_WIDTHS widths): at most got's own distance from want and that
    width. Over many keys a tiling that leaves out keys of little weight fits every row; this is
    what rules it out."""
    judged = ~blank_rows(got, want)
    fit = _widest_match(got[judged], want[judged], head.width)
    reach = maxdiff(got[judged], want[judged]) + fit

    def fits(cand_rows: np.ndarray, rows: np.ndarray) -> bool:
        j = judged[rows]
        diff = maxdiff(got[rows][j], cand_rows[j])
        return diff <= fit and reach > min(DISTINCT_WIDTHS * head.width, CLOSER * diff)
    return fits


def _widest_match(got, want, width: float) -> float:
    """The largest max|got − cand| that match_width(cand, want, width) allows any cand: with W and
    G the largest |want| and |got|, diff ≤ a·max(1, (G + diff)/W), a = MATCH_WIDTHS·width, holds
    for diff ≤ a·max(1, G/(W − a)) where W > a (inf otherwise)."""
    a = MATCH_WIDTHS * width
    top_want = float(np.max(np.abs(want[np.isfinite(want)]), initial=0.0))
    top_got = float(np.max(np.abs(got[np.isfinite(got)]), initial=0.0))
    return a * max(1.0, top_got / (top_want - a)) if top_want > a else np.inf


def loop_rows(got, want) -> np.ndarray:
    """The rows a search tries its candidates on first: the most wrong of those written."""
    written = np.flatnonzero(~blank_rows(got, want))
    return written[worst_rows(got[written], want[written], SAMPLED_ROWS)]
