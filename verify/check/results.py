"""What a check found: one comparison (got against want under an allowance), one stage × head's
result, and the report of a whole run, with their JSON forms."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, List, Optional, Tuple

import numpy as np

from ..files.case import InputCase
from ..files.outputs import RunInfo
from ..files.resolution import EXACT
from ..specs.base import Violation
from ..stages import STAGES
from .diagnosis import Diagnosis

if TYPE_CHECKING:  # (an annotation only)
    from ..runs.program_checks import ProgramCheck

# The key of flash-attn's test criterion in --json (per head here, per stage in the report) and
# --junit (verify/check/flash_attn_criterion.py).
FLASH_ATTN_KEY = "flash_attn_criterion"

# Statuses of one stage × head; only PASS passes. UNCHECKABLE: what the stage is checked against
# is missing from the run (under dropout, the program's keep-mask).
PASS, FAIL, INHERITED = "PASS", "FAIL", "INHERITED"
MISSING, STALE, SHAPE, UNREADABLE = "MISSING", "STALE", "SHAPE", "UNREADABLE"
UNCHECKABLE = "UNCHECKABLE"


MAX_LISTED_MISMATCHES = 5


@dataclass
class Comparison:
    """One comparison of got against want under an element-wise allowance."""
    passed: bool
    total: int
    mismatched: int
    max_abs: float
    max_rel: float
    worst: Optional[Tuple[int, int]]
    got: float
    want: float
    allowed: float
    tol_used: float   # max |got - want| / allowed: < 1 passes; the headroom is 1 - tol_used
    min_atol: float   # the smallest absolute tolerance that would have passed
    first: List[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        d = {k: getattr(self, k) for k in ("passed", "total", "mismatched", "max_abs", "max_rel",
                                             "tol_used", "min_atol")}
        d["worst"] = None if self.worst is None else {
            "row": self.worst[0], "col": self.worst[1], "got": self.got, "want": self.want,
            "allowed": self.allowed}
        d["first_mismatches"] = self.first
        return d


def elementwise_error(got: np.ndarray, want: np.ndarray, nan_agrees: bool = False) -> np.ndarray:
    """|got - want| where equal infinities count as 0 and NaN stays NaN (NaN never passes);
    nan_agrees: NaN where want is NaN counts as 0 (an isolated reference computed from a binary's
    own NaN: the stage propagated what it was given)."""
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.subtract(got, want)
        np.abs(err, out=err)
    np.copyto(err, 0.0, where=(got == want))  # equal infinities included
    if nan_agrees:
        np.copyto(err, 0.0, where=np.isnan(got) & np.isnan(want))
    return err


def _ratio(err: np.ndarray, denom: np.ndarray, zero: np.ndarray) -> np.ndarray:
    """err / denom, 0 where err is 0 and +inf where that is NaN (0/0 aside, NaN never passes)."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # a tiny denominator: +inf
        ratio = np.divide(err, denom)
    np.copyto(ratio, 0.0, where=zero)
    np.copyto(ratio, np.inf, where=np.isnan(ratio))
    return ratio


def _nan_as_inf(x: float) -> float:
    return np.inf if np.isnan(x) else x


def _first_indices(bad: np.ndarray, limit: int) -> List[Tuple[int, int]]:
    """The first `limit` True entries of `bad` in row-major order (np.argwhere(bad)[:limit]
    without listing every bad entry of a matrix that fails everywhere)."""
    out: List[Tuple[int, int]] = []
    for i in np.flatnonzero(bad.any(axis=1)):
        out.extend((int(i), int(j)) for j in np.flatnonzero(bad[i])[:limit - len(out)])
        if len(out) >= limit:
            break
    return out


# Elements per row block of a comparison: a block's temporaries stay in the CPU cache, where
# whole-matrix temporaries of a large head would not.
_COMPARE_BLOCK_ELEMS = 1 << 16


def print_limited(quantum, model, want: np.ndarray) -> bool:
    """Whether the file's printed resolution (quantum) is coarser than the error model's bound
    somewhere the reference is finite (where it is not, a row that sees no key, the bound is 0 and
    the file's ±inf is exact whatever its resolution)."""
    if quantum is None:
        return False
    with np.errstate(invalid="ignore"):
        return bool(np.any((quantum > model) & np.isfinite(want)))


def compare_arrays(got: np.ndarray, want: np.ndarray, allowed: np.ndarray,
                   nan_agrees: bool = False, measured: Optional[np.ndarray] = None) -> Comparison:
    """got against want under `allowed` (all of one 2-D shape), row block by row block. measured:
    the reference itself where want is it times a row factor that the verdict allows (weights from
    a float32 lse: verify/specs/lse_route.py fitted); the largest errors (max abs, max rel, the
    smallest passing atol) are |got − measured|, what the user's own comparison would see."""
    apart = measured is not None and measured is not want
    if got.size == 0:
        return Comparison(True, 0, 0, 0.0, 0.0, None, 0.0, 0.0, 0.0, 0.0, 0.0)
    cols = got.shape[1]
    rows = max(1, _COMPARE_BLOCK_ELEMS // max(1, cols))
    mismatched, first_idx = 0, []
    tol_used, worst = -1.0, (0, 0)    # every ratio is ≥ 0: the first block sets both
    max_rel = max_abs = 0.0
    for r0 in range(0, got.shape[0], rows):
        g, w, a = got[r0:r0 + rows], want[r0:r0 + rows], allowed[r0:r0 + rows]
        err = elementwise_error(g, w, nan_agrees)
        bad = ~(err <= a)  # NaN compares False, so it is bad
        n_bad = int(np.count_nonzero(bad))
        if n_bad and len(first_idx) < MAX_LISTED_MISMATCHES:
            first_idx += [(r0 + i, j) for i, j in _first_indices(bad, MAX_LISTED_MISMATCHES - len(first_idx))]
        mismatched += n_bad
        zero = err == 0
        ratio = _ratio(err, a, zero)
        k = int(np.argmax(ratio))      # the first largest; a later block must beat it strictly
        if ratio.flat[k] > tol_used:
            tol_used, worst = float(ratio.flat[k]), (r0 + k // cols, k % cols)
        if apart:  # (the verdict's want holds a row factor: the errors shown are against the reference)
            w = measured[r0:r0 + rows]
            err = elementwise_error(g, w, nan_agrees)
            zero = err == 0
        max_rel = max(max_rel, float(_ratio(err, np.abs(w), zero).max()))
        max_abs = max(max_abs, _nan_as_inf(float(err.max())))  # a NaN error counts as +inf
    r, c = worst
    first = [{"row": i, "col": j, "got": float(got[i, j]), "want": float(want[i, j]),
              "allowed": float(allowed[i, j])} for i, j in first_idx]
    return Comparison(
        passed=mismatched == 0, total=int(got.size), mismatched=mismatched,
        max_abs=max_abs, max_rel=max_rel, worst=(r, c),
        got=float(got[r, c]), want=float(want[r, c]), allowed=float(allowed[r, c]),
        tol_used=tol_used, min_atol=max_abs, first=first)


@dataclass
class HeadResult:
    """One stage × head. A stage of the K/V heads (Stage.kv: K, V, KT and their gradients) in a
    case with grouped K/V heads is one per K/V head: head, batch and head_in_batch then number the
    K/V heads, and query_heads names the query heads it serves (None in a case without kv_heads,
    where every stage is per query head)."""
    stage: str
    head: int
    batch: int
    head_in_batch: int
    status: str
    chained: Optional[Comparison] = None
    isolated: Optional[Comparison] = None
    violations: List[Violation] = field(default_factory=list)
    notes: List[Violation] = field(default_factory=list)  # found, but blamed elsewhere
    diagnosis: List[Diagnosis] = field(default_factory=list)
    message: str = ""
    resolution: str = EXACT.describe()  # how finely the file records its values
    # "bf16"/"fp16": checked at fp32 or tf32, yet every value is one of that format's while the
    # exact results are not (a half-precision program's output, or one stored in the format).
    half_values: Optional[str] = None
    print_limited: bool = False  # its printed resolution, not float32, bounds what can be checked
    # Half precision, a stage flash-attn's tests compare: (its, the eager half baseline's) largest
    # |error| against the reference in the format (verify/check/flash_attn_criterion.py; informational).
    flash_attn: Optional[Tuple[float, float]] = None
    query_heads: Optional[Tuple[int, ...]] = None
    # A dropout_mask: (kept, visible) entries, which the run's keep-rate test sums (RunCheck).
    keep_counts: Optional[Tuple[int, int]] = None
    # A packed case (verify/check/packed.py): the sequence this result is of (None: a dense case,
    # or the key rows no sequence reads, padding_rows), and the packed row and column of its
    # matrix's [0, 0] (the rows and columns of the matrix are the sequence's own: token, key).
    sequence: Optional[int] = None
    offsets: Tuple[int, int] = (0, 0)
    padding_rows: bool = False
    # A split stage (split_output, split_lse): the columns of one split in its matrix (DV or 1; the
    # splits side by side), so that a column is decoded to (split, column within it); 0 otherwise.
    split_cols: int = 0

    def split_position(self, col: int) -> Tuple[int, int]:
        """(split, column within the split) of column `col` of a split stage's matrix."""
        return divmod(col, self.split_cols)

    @property
    def split(self) -> Optional[int]:
        """The split of the worst element of a split stage (None for another stage)."""
        c = self.main
        if not self.split_cols or c is None or c.worst is None:
            return None
        return self.split_position(c.worst[1])[0]

    @property
    def packed(self) -> bool:
        return self.sequence is not None or self.padding_rows

    def packed_position(self, row: int, col: int) -> Tuple[int, int]:
        """(packed row, packed column) of the result's element [row, col]."""
        return row + self.offsets[0], col + self.offsets[1]

    @property
    def passed(self) -> bool:
        return self.status == PASS

    @property
    def kv(self) -> bool:
        """Whether head numbers a K/V head (a grouped case's K, V, KT, dK, dV, flash_dK, flash_dV)."""
        return self.query_heads is not None

    @property
    def main(self) -> Optional[Comparison]:
        """The comparison that explains the status: isolated for own faults, else chained."""
        if self.status == FAIL and self.isolated is not None and not self.isolated.passed:
            return self.isolated
        return self.chained

    def to_json(self) -> dict:
        main = self.main
        d = {"stage": self.stage, "head": self.head, "batch": self.batch,
             "head_in_batch": self.head_in_batch, "passed": self.passed, "status": self.status,
             "inherited": self.status == INHERITED, "message": self.message}
        d.update(main.to_json() if main else {"total": 0, "mismatched": None})
        d["chained"] = self.chained.to_json() if self.chained else None
        d["isolated"] = self.isolated.to_json() if self.isolated else None
        d["violations"] = [{"code": v.code, "message": v.message, "count": v.count} for v in self.violations]
        d["notes"] = [{"code": v.code, "message": v.message, "count": v.count} for v in self.notes]
        d["diagnosis"] = [{"code": x.code, "message": x.message, "detail": x.detail} for x in self.diagnosis]
        d["resolution"] = self.resolution
        d["print_limited"] = self.print_limited
        d["half_values"] = self.half_values
        if self.flash_attn is not None:
            d[FLASH_ATTN_KEY] = {"error": self.flash_attn[0], "baseline_error": self.flash_attn[1]}
        if self.kv:
            d["kv_head"] = True
            d["query_heads"] = list(self.query_heads)
        if self.keep_counts is not None:
            d["kept"], d["visible"] = self.keep_counts
        if self.packed:
            d["sequence"] = self.sequence
            d["padding_rows"] = self.padding_rows
            for comparison in (d, d["chained"], d["isolated"]):
                if comparison is not None:
                    self._packed_rows(comparison)
        if self.split_cols:
            d["split"] = self.split
            for comparison in (d, d["chained"], d["isolated"]):
                if comparison is not None:
                    self._split_columns(comparison)
        return d

    def _split_columns(self, comparison: dict) -> None:
        """The split and the column within it beside each position a comparison's JSON names."""
        for at in [comparison.get("worst")] + list(comparison.get("first_mismatches") or []):
            if at is not None:
                at["split"], at["split_col"] = self.split_position(at["col"])

    def _packed_rows(self, comparison: dict) -> None:
        """The packed row and column beside each position a comparison's JSON names."""
        for at in [comparison.get("worst")] + list(comparison.get("first_mismatches") or []):
            if at is not None:
                at["packed_row"], at["packed_col"] = self.packed_position(at["row"], at["col"])


def result_order(r: HeadResult) -> Tuple[int, int, int]:
    """Which of two results a report names first: table order, then head, then sequence (a
    packed case's padding rows after its sequences)."""
    seq = r.sequence if r.sequence is not None else (1 << 62 if r.padding_rows else 0)
    return _STAGE_ORDER[r.stage], r.head, seq


_STAGE_ORDER = {s: i for i, s in enumerate(STAGES)}


@dataclass
class RunCheck:
    """A check of the whole run rather than of one stage × head (under dropout, the keep rate of
    the dropout_mask over every head), reported once; it fails the run like a stage."""
    code: str
    stage: str
    title: str      # what of the stage it checks, in words ("keep rate")
    passed: bool
    message: str
    detail: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"code": self.code, "stage": self.stage, "title": self.title, "passed": self.passed,
                "message": self.message, **self.detail}


@dataclass
class Report:
    run: RunInfo
    case: InputCase
    results: List[HeadResult]
    foreign_files: List[str]
    # What `attnstep run --sanitize/--repeat` found about the program (verify/runs/program_checks.py).
    program_checks: List["ProgramCheck"] = field(default_factory=list)
    run_checks: List[RunCheck] = field(default_factory=list)  # the run-level checks (RunCheck)

    @property
    def stages(self) -> List[str]:
        seen: List[str] = []
        for r in self.results:
            if r.stage not in seen:
                seen.append(r.stage)
        return seen

    @property
    def passed(self) -> bool:
        return self.stages_passed and all(c.passed for c in self.program_checks)

    @property
    def stages_passed(self) -> bool:
        return all(r.passed for r in self.results) and all(c.passed for c in self.run_checks)

    def __bool__(self) -> bool:
        """The verdict, so that `assert attnstep.check_arrays(...)` fails on a failing report (an
        object without __bool__ or __len__ is always true: the assert would pass whatever it found)."""
        return self.passed

    @property
    def first_failure(self) -> Optional[HeadResult]:
        """The culprit: the first stage (table order), then head, failing on its own."""
        own = [r for r in self.results if r.status not in (PASS, INHERITED)]
        if not own:
            own = [r for r in self.results if not r.passed]
        return min(own, key=result_order) if own else None

    @property
    def first_failing_stage(self) -> Optional[str]:
        """The first stage (table order) that fails on its own, or fails a run-level check."""
        f = self.first_failure
        failing = ([f.stage] if f else []) + [c.stage for c in self.run_checks if not c.passed]
        order = {s: i for i, s in enumerate(STAGES)}
        return min(failing, key=order.__getitem__) if failing else None

    def stage_results(self, stage: str) -> List[HeadResult]:
        return [r for r in self.results if r.stage == stage]
