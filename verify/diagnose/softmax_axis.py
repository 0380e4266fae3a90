"""softmax_axis: the weights normalized along the wrong axis (a hypothesis of
verify/diagnose/hypotheses.py): found in the weights themselves, or, where a program wrote only
what comes after them, in its output (the column-normalized weights times V) and in a square
head's log-sum-exp (each column's, over the queries)."""
from __future__ import annotations

from typing import List

import numpy as np

from ..check.diagnosis import Diagnosis
from ..model.attention import softmax_rows
from ..stages import STAGES
from .base import explains
from .softmax_loops import ATTENTION, LOG_SUM_EXP, loop_head, loop_matches


def _unguarded_softmax_rows(S: np.ndarray) -> np.ndarray:
    """The row softmax as a program that does not guard a row with no visible key computes it:
    0/0 = NaN there (the reference's softmax_rows writes the contract's 0)."""
    return np.where(np.isneginf(S).all(axis=1, keepdims=True), np.nan, softmax_rows(S))


def softmax_axis(stage, got, want, ctx, width) -> List[Diagnosis]:
    if STAGES[stage].cols != "M":
        return _after_the_weights(stage, got, want, ctx, width)
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
            with np.errstate(all="ignore"):
                cands.append((f"got is the softmax over {_SWAPPED}", _swapped_rows(S)))
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


_SWAPPED = "rows of N entries, not M: the softmax's row length and row count swapped over the N×M buffer"


def _swapped_rows(s: np.ndarray) -> np.ndarray:
    """The row softmax of the N×M buffer read as M rows of N (a launch with its sizes swapped)."""
    n, m = s.shape
    return _unguarded_softmax_rows(s.reshape(m, n)).reshape(n, m)


def _wrong_axis_weights(s: np.ndarray):
    """(how, the weights) a softmax along the wrong axis gives the logits s (hidden entries −inf):
    each column's softmax, exp(s − row max) over its column sums, and (N ≠ M) the buffer's rows
    taken N long. A column or row that sees nothing normalizes 0/0: NaN, or 0 where the program
    guards it (the caller tries both)."""
    with np.errstate(all="ignore"):
        yield "the softmax over the queries (each column of the weights sums to 1)", _unguarded_softmax_rows(s.T).T
        mx = np.max(s, axis=1, keepdims=True)
        e = np.exp(s - np.where(np.isfinite(mx), mx, 0.0))
        yield "exp(S − row max) divided by its column sums", e / e.sum(axis=0, keepdims=True)
        if s.shape[0] != s.shape[1]:
            yield f"the softmax over {_SWAPPED}", _swapped_rows(s)


def _after_the_weights(stage, got, want, ctx, width) -> List[Diagnosis]:
    """The output (the weights times V) or a square head's log-sum-exp from weights normalized over
    the queries: the stage recomputed from the case's inputs (loop_head), for a program that wrote
    no weights of its own."""
    head = loop_head(stage, got, ctx, width)
    if head is None:
        return []
    s = np.where(head.hidden, -np.inf, head.logits)
    if head.kind == LOG_SUM_EXP:
        if s.shape[0] != s.shape[1]:
            return []
        with np.errstate(all="ignore"):
            mx = np.max(s, axis=0)
            cands = [("each column's log-sum-exp, over the queries, not each row's over the keys",
                      (mx + np.log(np.exp(s - np.where(np.isfinite(mx), mx, 0.0)).sum(axis=0)))[:, None])]
    elif head.kind == ATTENTION:
        cands = list(_wrong_axis_weights(s))
    else:
        return []
    for how, cand in cands:
        for c in ((cand,) if head.kind == LOG_SUM_EXP else (cand, np.nan_to_num(cand, nan=0.0))):
            with np.errstate(all="ignore"):
                stage_cand = c if head.kind == LOG_SUM_EXP else head.from_weights(c)
            diff = loop_matches(got, want, head, stage_cand)
            if diff is not None:
                return [Diagnosis("softmax_axis", f"{stage} comes from a softmax along the wrong axis: {how} "
                                  f"(max diff {diff:.2g})", {"how": how, "max_diff": diff}, 0.93)]
    return []
