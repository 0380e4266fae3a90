"""Diagnosing a long head on its first query rows.

A head checked in row tiles (pool.tiled_run: no N×M stage) keeps its memory at O((N + M)·d), but
most diagnoses recompute the failing stage under a changed mask, scale, keys or head from the
head's Q, K, V: N×M float64 matrices, 8 GiB each at N = M = 32768. So where a head holds more
than DIAGNOSIS_SCORES scores, a failing stage is diagnosed in two parts:

* on the whole stage, the patterns that need no recomputation (an unwritten region, NaN or Inf,
  a tile boundary, a transposed result, an lse in base 2: verify/diagnose/hypotheses.py);
* on a slab of the head: its first R query rows with every key (R·M ≤ DIAGNOSIS_SCORES), checked
  by the dense engine as a case of their own, with the diagnoser. Its findings are the stage's
  causes, each message saying the rows it was found on.

The first R rows of an N×M head are the R×M problem of the same variant wherever the mask's
diagonal meets row 0 at key 0: the top-left alignment, either alignment where N = M, or a variant
with no diagonal (no causal flag, window or ALiBi). A bottom-right diagonal with N ≠ M has no such
slab, and only the whole stage's patterns are named. Stages of the keys' rows (K, V, the dK and dV
sums over every query) are not part of a slab either.
"""
from __future__ import annotations

from dataclasses import fields, replace
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from ..files.case import InputCase
from ..files.outputs import RunInfo
from ..stages import STAGES
from ..variant import BOTTOM_RIGHT, TOP_LEFT, Variant
from .diagnosis import Diagnoser, Diagnosis
from .pool import tiled_run
from .results import FAIL, HeadResult
from .stage_check import Loaded, SequenceRun, load_output

# A head of more scores than this is diagnosed on a slab of its first rows; the slab holds at most
# this many (as a head of N = M = 4096, which is diagnosed whole).
DIAGNOSIS_SCORES = 1 << 24
# The fewest rows a slab has (where the head has them): the diagnoses that search the rows' tiles
# sample several rows.
MIN_SLAB_ROWS = 16


def long_run(run: RunInfo) -> bool:
    """Whether a failing stage of `run` is diagnosed on slabs (its heads are checked in row tiles
    and hold more than DIAGNOSIS_SCORES scores)."""
    d = run.dims
    return run.sequences is None and d.seq_q * d.seq_k > DIAGNOSIS_SCORES and tiled_run(run)


def _diagonal(v: Variant) -> bool:
    """Whether the variant's mask or bias depends on a row's diagonal."""
    return v.structural or v.alibi


def slab_rows(run: RunInfo) -> Optional[int]:
    """The query rows of a head's slab (the first ones), or None where the first rows are no case
    of their own (a bottom-right diagonal with N ≠ M)."""
    d, v = run.dims, run.variant
    if _diagonal(v) and v.offset(d.seq_q, d.seq_k) != 0:
        return None
    return min(d.seq_q, max(MIN_SLAB_ROWS, DIAGNOSIS_SCORES // d.seq_k))


def notes(run: RunInfo, results: List[HeadResult]) -> List[str]:
    """What the report of a long run with a failing stage says about its diagnoses."""
    if not long_run(run) or all(r.status != FAIL for r in results):
        return []
    d, rows = run.dims, slab_rows(run)
    head = f"heads of {d.seq_q} x {d.seq_k} scores are too long to recompute whole"
    patterns = "unwritten regions, tile boundaries, NaN and layouts"  # (hypotheses.py's _PATTERNS, in words)
    if rows is None:
        return [f"{head}: a failing stage's {patterns} are named, not its causes (a bottom-right mask with N != M "
                "leaves no first rows that are a case of their own); HINT: the same bug usually shows on a shorter "
                "case"]
    return [f"{head}: a failing stage's causes were looked for on each head's first {rows} query rows, its "
            f"{patterns} on the whole stage (dK and dV, sums over every row: those and a constant factor alone)"]


def diagnoser(run: RunInfo, case: InputCase, diagnoser: Optional[Diagnoser],
              check_group: Callable[[RunInfo, InputCase, Diagnoser], List[HeadResult]]) -> Optional[Diagnoser]:
    """The diagnoser of one job's heads: `diagnoser`, or where the run is long, the same shown its
    slabs (check_group: the dense engine's check of the job's group on a run)."""
    if diagnoser is None or not long_run(run):
        return diagnoser
    return Slab(run, case, diagnoser, check_group).wrap()


class SlabCase(InputCase):
    """The first rows of an input case: Q, dO and the mask and bias files' first `rows` rows."""

    def __init__(self, case: InputCase, dims, variant: Variant, rows: int) -> None:
        values = {f.name: getattr(case, f.name) for f in fields(InputCase) if f.init}
        super().__init__(**{**values, "dims": dims, "variant": variant, "_whole": {}})
        self._case, self._rows = case, rows

    def load(self, name: str, head: int) -> np.ndarray:
        whole = self._case.load(name, head)
        return whole[:self._rows] if STAGES[name].rows == "N" else whole

    def variant_input(self, name: str, head: int) -> Optional[np.ndarray]:
        whole = self._case.variant_input(name, head)
        return None if whole is None else whole[:self._rows]

    def alibi_slope(self, head: int) -> float:
        return self._case.alibi_slope(head)


class Slab:
    """The slabs of one job's heads (a K/V head's group): each checked once, when a stage of its
    group first needs it, with `diagnoser` capturing what it finds on each stage × query head.
    check_group(run, case, diagnoser) is the dense engine's check of the group on a run."""

    def __init__(self, run: RunInfo, case: InputCase, diagnoser: Diagnoser,
                 check_group: Callable[[RunInfo, InputCase, Diagnoser], List[HeadResult]]) -> None:
        self.run, self.case, self.diagnoser, self.check_group = run, case, diagnoser, check_group
        self.rows = slab_rows(run)
        self._found: Optional[Dict[Tuple[str, int], List[Diagnosis]]] = None

    def wrap(self) -> Diagnoser:
        """The whole head's diagnoser: `diagnoser`, shown the slab's findings on the stage."""
        return lambda stage, got, want, suspect: self.diagnoser(
            stage, got, want, replace(suspect, slab=lambda: self.found(stage, suspect.head)))

    def found(self, stage: str, head: Optional[int]) -> List[Diagnosis]:
        """What the slab's diagnoses named on `stage` of query head `head` (none where the stage
        has no slab, or the slab's rows of it passed)."""
        if self.rows is None or STAGES[stage].rows != "N" or head is None:
            return []
        if self._found is None:
            self._found = {}
            self._check()
        where = f" (found on query rows 0..{self.rows - 1} of {self.run.dims.seq_q})"
        return [replace(d, message=d.message + where) for d in self._found.get((stage, head), [])]

    def _check(self) -> None:
        run, rows = self.run, self.rows
        dims = replace(run.dims, seq_q=rows)
        v = run.variant
        if v.align == BOTTOM_RIGHT and run.dims.seq_q == run.dims.seq_k:
            v = replace(v, align=TOP_LEFT)  # (N = M: the same mask; the slab's N < M would move it)
        sources = {s: src for s, src in run.sources.items() if STAGES[s].rows == "N" and not STAGES[s].kv}
        values = {f.name: getattr(run, f.name) for f in fields(RunInfo)}
        sub_run = SequenceRun(**{**values, "dims": dims, "sources": sources, "variant": v},
                              rows=self._output_rows)
        sub_case = SlabCase(self.case, dims, v, rows)

        def capture(stage, got, want, suspect):
            found = self.diagnoser(stage, got, want, suspect)
            self._found[(stage, suspect.head)] = found
            return found
        self.check_group(sub_run, sub_case, capture)

    def _output_rows(self, stage: str, index: int) -> Loaded:
        mat, resolution, status, msg = load_output(self.run, stage, index)
        return (mat if mat is None else mat[:self.rows].copy()), resolution, status, msg
