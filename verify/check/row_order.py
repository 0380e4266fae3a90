"""A row statistic (the lse, D: one value per query row and head) written in the other order: a
program that keeps (tokens, heads), or (batch, rows, heads), writes into the (heads, tokens) or
(batch, heads, rows) array the check reads, so that each head's values are another head's and
row's. Named when the same memory read in that order passes: the stage alone re-checked.
"""
from __future__ import annotations

from typing import Callable, Dict, Mapping, Optional

import numpy as np

from ..files.arrays import as_array
from ..stages import STAGES
from .diagnosis import Diagnosis
from .results import Report

ROWS_TRANSPOSED = "rows_heads_transposed"


def _reordered(x, heads: int, rows: int) -> Optional[np.ndarray]:
    """x's memory as written by a program that keeps (…, rows, heads) where the check reads (…,
    heads, rows): its values in the check's order, in x's own shape (any trailing axis of one, as
    an (N, 1) column, kept). None where that order is the same array (one head or one row) or x
    holds no whole (heads, rows) blocks."""
    a = np.ascontiguousarray(as_array(x, "stage"))
    if heads < 2 or rows < 2 or a.size % (heads * rows):
        return None
    return a.reshape(-1, rows, heads).swapaxes(-1, -2).reshape(a.shape)


def name_transposed_rows(report: Report, stages: Mapping[str, object],
                         passes: Callable[[Dict[str, np.ndarray]], bool]) -> None:
    """Each failing row statistic of `stages` that passes read in the other order (passes(the stage
    alone, so read)): named first in its failing results. The heads and rows are the run's (a
    packed run's rows: every token)."""
    dims = report.run.dims
    for name, x in stages.items():
        failing = [r for r in report.results if r.stage == name and not r.passed]
        if not failing or STAGES.get(name) is None or STAGES[name].cols != "1":
            continue
        reordered = _reordered(x, dims.heads, dims.seq_q)
        try:
            named = reordered is not None and passes({name: reordered})
        except ValueError:  # (the other order read as an array the check refuses: not this bug)
            named = False
        if named:
            message = (f"{name} holds its values in (rows, heads) order, each row's heads together, where the "
                       f"array is (heads, rows): written as the program keeps them, not in the array's order")
            for r in failing:
                r.diagnosis.insert(0, Diagnosis(ROWS_TRANSPOSED, message, {"stage": name}, 0.95))


__all__ = ["ROWS_TRANSPOSED", "name_transposed_rows"]
