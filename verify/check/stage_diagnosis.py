"""What explains a failing stage × head: the diagnoser's patterns and the stage's reference-free
findings; and, in a run that splits the keys, the causes a split's own diagnoses cannot see.

A split diagnosis (verify/diagnose/splits.py) looks at one split's boundaries and empty rows. A bug
of the attention every split computes (a mask aligned at the other corner, a wrong K/V head, a page
read from the wrong place) leaves each split wrong in its own way, and a correct combine passes that
error on: the flash stage then fails against the reference from the original inputs only
(INHERITED). There the diagnoses of a run that does not split find the cause, and the failing
splits are given it too, so that the first failing stage names it.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional

import numpy as np

from ..specs import HeadContext
from . import invariants, splits
from .diagnosis import Diagnoser, Diagnosis, Suspect
from .results import HeadResult

# What names no cause: every NaN or Inf is counted, whatever put it there.
_NO_CAUSE = {invariants.NONFINITE}


def diagnose_stage(res: HeadResult, mat: np.ndarray, isolated, ctx: HeadContext, run, ref_of_head, inputs_of_head,
                   slope_of_head, diagnoser: Optional[Diagnoser]) -> None:
    """The patterns that explain a failing stage × head (the diagnoser's; none without one), then
    its reference-free findings."""
    if splits.combines(res.stage, ctx) and not res.isolated.passed:  # the combine, not the splits, is wrong
        return splits.diagnose_combine(res, invariants.canonical(res.stage, mat, ctx), isolated, ctx, diagnoser)
    src_iso, want_iso, allowed_iso = isolated
    if diagnoser is not None:
        res.diagnosis = diagnoser(res.stage, mat, want_iso, _suspect(res, src_iso, allowed_iso, ctx, run, ref_of_head,
                                                                      inputs_of_head, slope_of_head))
    for v in res.violations:
        if not any(d.code == v.code for d in res.diagnosis):
            res.diagnosis.append(Diagnosis(v.code, v.message, {"count": v.count}))


def diagnose_through_splits(res: HeadResult, mat: np.ndarray, chained, ctx: HeadContext,
                            results: Dict[str, HeadResult], run, ref_of_head, inputs_of_head, slope_of_head,
                            diagnoser: Optional[Diagnoser]) -> None:
    """A combined flash stage INHERITED from failing splits: the diagnoses of a run that does not
    split, against the reference from the original inputs (`chained`: its sources, reference and
    allowance, as its chained comparison used them), into res and the failing splits'."""
    failed = splits.failed_splits(res.stage, ctx, results)
    if diagnoser is None or not failed:
        return
    src, want, bound = chained
    found = [d for d in diagnoser(res.stage, mat, want, _suspect(res, src, bound, ctx, run, ref_of_head,
                                                                  inputs_of_head, slope_of_head))
             if d.code not in _NO_CAUSE]
    res.diagnosis = found
    for stage in failed:
        give_split(results[stage], found, f"in {res.stage}, the combine of the splits")


def give_split(split: HeadResult, found: List[Diagnosis], where: str) -> None:
    """Adds causes found on the combined output to a failing split's diagnoses: first where the
    split's own diagnoses name no cause, after them where they do (a split's gap at the sequence's
    end is also keys the attention left out)."""
    have = {d.code for d in split.diagnosis}
    new = [Diagnosis(d.code, f"{d.message} ({where})", d.detail, d.confidence) for d in found if d.code not in have]
    if all(d.code in _NO_CAUSE for d in split.diagnosis):
        split.diagnosis[:0] = new
    else:
        split.diagnosis.extend(new)


def _suspect(res: HeadResult, src, bound, ctx: HeadContext, run, ref_of_head: Callable, inputs_of_head,
             slope_of_head) -> Suspect:
    return Suspect(ctx.dims, ctx.scale, ctx.causal, res.head, src, functools.partial(ref_of_head, res.stage),
                   run.flash_tiles, bound, ctx, inputs_of_head, slope_of_head=slope_of_head)
