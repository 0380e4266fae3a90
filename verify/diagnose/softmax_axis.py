"""softmax_axis: the weights normalized along the wrong axis (a hypothesis of
verify/diagnose/hypotheses.py)."""
from __future__ import annotations

from typing import List

import numpy as np

from ..check.diagnosis import Diagnosis
from ..model.attention import softmax_rows
from ..stages import STAGES
from .base import explains


def _unguarded_softmax_rows(S: np.ndarray) -> np.ndarray:
    """The row softmax as a program that does not guard a row with no visible key computes it:
    0/0 = NaN there (the reference's softmax_rows writes the contract's 0)."""
    return np.where(np.isneginf(S).all(axis=1, keepdims=True), np.nan, softmax_rows(S))


def softmax_axis(stage, got, want, ctx, width) -> List[Diagnosis]:
    src = ctx.src
    S = src.get(STAGES[stage].inputs[0])
    cands = []
    if S is not None:
        S = np.asarray(S, dtype=np.float64)
        by_columns = _unguarded_softmax_rows(S.T)
        cands.append(("got is the softmax over columns: each column sums to 1", by_columns.T))
        with np.errstate(all="ignore"):  # exp(S − row max) summed down the columns (0/0 where a column sees none)
            e = np.exp(S - np.max(S, axis=1, keepdims=True))
            cands.append(("exp(S − row max) divided by its column sums: each column sums to 1",
                          e / e.sum(axis=0, keepdims=True)))
        R, C = S.shape
        if R != C:
            cands.append(("got is the row softmax of QK_scaledᵀ written into the N×M buffer",
                          by_columns.reshape(R, C)))
    for how, cand in cands:
        # A column with no visible key (causal, N < M) normalizes 0/0: NaN, or 0 where guarded.
        diff = explains(got, cand, want, width)
        if diff is None:
            diff = explains(got, np.nan_to_num(cand, nan=0.0), want, width)
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
