"""Diagnosing a long head on a slab of its query rows.

A head checked in row tiles (sizing.tiled_run: no N×M stage) keeps its memory at O((N + M)·d), but
most diagnoses recompute the failing stage under a changed mask, scale, keys or head from the
head's Q, K, V: N×M float64 matrices, 8 GiB each at N = M = 32768. So where a head holds more
than DIAGNOSIS_SCORES scores, a failing stage is diagnosed in two parts:

* on the whole stage, the patterns that need no recomputation (an unwritten region, NaN or Inf,
  a tile boundary, a transposed result, an lse in base 2: verify/diagnose/hypotheses.py);
* on a slab of the head: R of its query rows with every key (R·M ≤ DIAGNOSIS_SCORES), checked
  by the dense engine as a case of their own, with the diagnoser. Its findings are the stage's
  causes, each message saying the rows it was found on.

Row i's diagonal is key i (top-left) or i + M − N (bottom-right): the first R rows are the R×M
problem of the same variant aligned top-left, the last R rows the same aligned bottom-right. So a
slab is the first rows, or the last where the mask is aligned bottom-right with N ≠ M. Its
diagnoses name an alignment by the whole head's (N, M) (Suspect.rows_of_head): a program that
aligned the other way is named as such, not as a shift of the slab's own diagonal. Stages of the
keys' rows (K, V, the dK and dV sums over every query) are not part of a slab.
"""
from __future__ import annotations

from dataclasses import fields, replace
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from ..files.case import InputCase
from ..files.outputs import RunInfo
from ..stages import STAGES
from ..variant import BOTTOM_RIGHT, TOP_LEFT, Variant
from . import pool, sizing
from .diagnosis import Diagnoser, Diagnosis
from .results import FAIL, HeadResult
from .stage_check import Loaded, SequenceRun, load_output

# The fewest rows a slab has (where the head has them): the diagnoses that search the rows' tiles
# sample several rows.
MIN_SLAB_ROWS = 16


def _diagonal(v: Variant) -> bool:
    """Whether the variant's mask or bias depends on a row's diagonal."""
    return v.structural or v.alibi


def slab_rows(run: RunInfo) -> range:
    """The query rows of a head's slab: its first ones, or its last where a diagonal is aligned
    bottom-right with N != M (the first rows alone see M − N keys more than a case of their own)."""
    d, v = run.dims, run.variant
    rows = min(d.seq_q, max(MIN_SLAB_ROWS, sizing.DIAGNOSIS_SCORES // d.seq_k))
    first = d.seq_q - rows if _diagonal(v) and v.offset(d.seq_q, d.seq_k) != 0 else 0
    return range(first, first + rows)


def notes(run: RunInfo, results: List[HeadResult]) -> List[str]:
    """What the report of a long run with a failing stage says about its diagnoses."""
    if not sizing.long_run(run) or all(r.status != FAIL for r in results):
        return []
    d, rows = run.dims, slab_rows(run)
    which = "first" if rows.start == 0 else "last"
    patterns = "unwritten regions, tile boundaries, NaN and layouts"  # (hypotheses.py's _PATTERNS, in words)
    keys = " (dK and dV, sums over every row: those and a constant factor alone)" if any(
        STAGES[s].rows == "M" for s in run.stages) else ""
    return [f"heads of {d.seq_q} x {d.seq_k} scores are too long to recompute whole: a failing stage's causes were "
            f"looked for on each head's {which} {len(rows)} query rows, its {patterns} on the whole stage{keys}"]


def diagnoser(run: RunInfo, case: InputCase, diagnoser: Optional[Diagnoser],
              check_group: Callable[[RunInfo, InputCase, Diagnoser], List[HeadResult]]) -> Optional[Diagnoser]:
    """The diagnoser of one job's heads: `diagnoser`, or where the run is long, the same shown its
    slabs (check_group: the dense engine's check of the job's group on a run)."""
    if diagnoser is None or not sizing.long_run(run):
        return diagnoser
    return Slab(run, case, diagnoser, check_group).wrap()


class SlabCase(InputCase):
    """Rows of an input case: those of Q, dO and the mask and bias files."""

    def __init__(self, case: InputCase, dims, variant: Variant, rows: range) -> None:
        values = {f.name: getattr(case, f.name) for f in fields(InputCase) if f.init}
        super().__init__(**{**values, "dims": dims, "variant": variant, "_whole": {}})
        self._case, self._rows = case, rows

    def load(self, name: str, head: int) -> np.ndarray:
        whole = self._case.load(name, head)
        return whole[self._rows.start:self._rows.stop] if STAGES[name].rows == "N" else whole

    def variant_input(self, name: str, head: int) -> Optional[np.ndarray]:
        whole = self._case.variant_input(name, head)
        return None if whole is None else whole[self._rows.start:self._rows.stop]

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
        if STAGES[stage].rows != "N" or head is None:
            return []
        if self._found is None:
            self._found = {}
            self._check()
        where = f" (found on query rows {self.rows.start}..{self.rows.stop - 1} of {self.run.dims.seq_q})"
        return [replace(d, message=d.message + where) for d in self._found.get((stage, head), [])]

    def _check(self) -> None:
        run, rows = self.run, self.rows
        dims = replace(run.dims, seq_q=len(rows))
        v = run.variant
        if v.align == BOTTOM_RIGHT and run.dims.seq_q == run.dims.seq_k:
            v = replace(v, align=TOP_LEFT)  # (N = M: the same mask; the slab's N < M would move it)
        sources = {s: src for s, src in run.sources.items() if STAGES[s].rows == "N" and not STAGES[s].kv}
        values = {f.name: getattr(run, f.name) for f in fields(RunInfo)}
        sub_run = SequenceRun(**{**values, "dims": dims, "sources": sources, "variant": v},
                              rows=self._output_rows)
        sub_case = SlabCase(self.case, dims, v, rows)

        head = (rows.start, run.dims.seq_q, run.dims.seq_k)

        def capture(stage, got, want, suspect):
            found = self.diagnoser(stage, got, want, replace(suspect, rows_of_head=head))
            self._found[(stage, suspect.head)] = found
            return found
        with pool.slab_slot():
            self.check_group(sub_run, sub_case, capture)

    def _output_rows(self, stage: str, index: int) -> Loaded:
        mat, resolution, status, msg = load_output(self.run, stage, index)
        return (mat if mat is None else mat[self.rows.start:self.rows.stop].copy()), resolution, status, msg
