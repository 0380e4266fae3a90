"""A row statistic (the lse, D: one value per query row and head) written in the other order: a
program that keeps (tokens, heads), or (batch, rows, heads), writes into the (heads, tokens) or
(batch, heads, rows) array the check reads, so that each head's values are another head's and
row's. Named when the same memory read in that order passes: the stage alone re-checked.
"""
from __future__ import annotations

from typing import Callable, Dict, Mapping

import numpy as np

from ..files.arrays import as_array
from ..stages import STAGES
from .diagnosis import Diagnosis
from .results import Report

ROWS_TRANSPOSED = "rows_heads_transposed"


def _reordered(x) -> np.ndarray:
    """x's memory, (…, H, N) as written by a program that keeps (…, N, H): that array swapped back."""
    a = as_array(x, "stage")
    if a.ndim >= 3 and a.shape[-1] == 1:  # (an N×1 stage with its last axis)
        a = a[..., 0]
    *lead, heads, rows = a.shape
    return np.ascontiguousarray(a).reshape(*lead, rows, heads).swapaxes(-1, -2)


def name_transposed_rows(report: Report, stages: Mapping[str, object],
                         passes: Callable[[Dict[str, np.ndarray]], bool]) -> None:
    """Each failing row statistic of `stages` that passes read in the other order (passes(the stage
    alone, so read)): named first in its failing results."""
    for name, x in stages.items():
        failing = [r for r in report.results if r.stage == name and not r.passed]
        if not failing or STAGES.get(name) is None or STAGES[name].cols != "1" or np.ndim(x) < 2:
            continue
        reordered = _reordered(x)
        if np.shape(reordered)[-2] == 1 or np.shape(reordered)[-1] == 1:
            continue  # (one head or one row: the other order is the same array)
        if passes({name: reordered}):
            message = (f"{name} holds its values in (rows, heads) order, each row's heads together, where the "
                       f"array is (heads, rows): written as the program keeps them, not in the array's order")
            for r in failing:
                r.diagnosis.insert(0, Diagnosis(ROWS_TRANSPOSED, message, {"stage": name}, 0.95))


__all__ = ["ROWS_TRANSPOSED", "name_transposed_rows"]
