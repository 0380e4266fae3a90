"""Grouped K/V heads (GQA/MQA) in the check: one job is one K/V head and the query heads that read
it (Dims.query_heads_of), so that what a K/V head's stages need is in one process.

The stages of the K/V heads (Stage.kv) are checked once per K/V head and named after it. K, V and
KT are exact copies, the same for every query head of the group: its first query head checks them
and lends the result (and the program's matrix, which the others' references start from) to the
rest. dK, dV, flash_dK and flash_dV are sums over the group (summed(): a stage of the K/V heads
computed from a query head's stages): each query head, as it is checked, contributes a Term (its
isolated reference from its own upstream stages, its chained reference from the inputs, their
bounds), and the group's matrix is compared with the sums once every query head is done; a query
head's state is dropped after it, so a group holds one query head's matrices at a time.

Bounds of a sum: the query heads' roundings are independent, so the isolated bounds' variances add
and their one-signed parts add (tolerance.BoundParts); the chained bounds, whole, add (their parts
are not separate); the float32 sum of G terms, in any order, errs by at most γ_{G−1}·Σ|term|
(Higham, Accuracy and Stability of Numerical Algorithms, §4.2), each term counted with its bound;
a half-precision program's sum is rounded to its format once more. Of the reference-free checks, a
sum gets those that hold of it with a group's bounds: no NaN/Inf, and a flash gradient's agreement
with its stage-path partner within both group bounds (a query head's invariant, dK's column sums
from its dS row sums, has a query head's allowance).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from ..files.outputs import RunInfo
from ..files.resolution import half_values
from ..model.half import is_half, storage_bound
from ..model.rounding import UNIT_ROUNDOFF
from ..specs import SPECS, HeadContext, upstream
from ..specs.base import NONFINITE, consistency, nonfinite
from ..stages import STAGES
from . import flash_attn_criterion, tolerance
from .diagnosis import Diagnoser, Diagnosis, Suspect
from .half_rounding import stored_in_format
from .results import FAIL, UNCHECKABLE, HeadResult, compare_arrays, print_limited
from .stage_check import (STATUS_CODES, blamed_elsewhere, classify, failed_upstream, isolated_sources,
                          load_output, new_result, nonfinite_propagated, quantization, read_quantum, reference,
                          sources, with_quantum)

# The group's sum is formed in float32 whatever the precision (the half pipelines accumulate in it).
SUM_U = UNIT_ROUNDOFF["fp32"]


def summed(stage: str) -> bool:
    """Whether a stage of the K/V heads is a sum over the group: computed from a query head's stages."""
    return STAGES[stage].kv and any(not STAGES[u].kv for u in upstream(stage))


def sum_gamma(terms: int) -> float:
    """γ_{G−1}: the relative error bound of a float32 sum of `terms` terms, in any order, against
    the sum of their magnitudes."""
    n = max(terms - 1, 0) * SUM_U
    return n / (1.0 - n)


@dataclass
class Term:
    """One query head's part of a summed stage: its isolated and chained references, their bounds
    (None under a user tolerance), the upstream stages it failed, or why it cannot be checked."""
    want_iso: Optional[np.ndarray] = None
    want_chain: Optional[np.ndarray] = None
    parts: Optional[tolerance.BoundParts] = None
    propagated: object = 0.0
    chained: Optional[np.ndarray] = None
    upstream_failed: List[str] = field(default_factory=list)
    unchecked: Optional[str] = None
    baseline: Optional[np.ndarray] = None  # the eager half baseline's part (flash-attn's criterion)

    def isolated_bound(self) -> np.ndarray:
        """Its isolated bound (0 for an exact copy, whose parts are None)."""
        bound = np.zeros(self.want_iso.shape) if self.parts is None else self.parts.bound(self.want_iso)
        return bound + self.propagated


def head_term(stage: str, ctx: HeadContext, results: Dict[str, HeadResult],
              override: Optional[Tuple[float, float]], unchecked: Optional[str]) -> Term:
    """Query head ctx's Term of summed stage `stage`, from its own upstream stages (results)."""
    if unchecked:
        return Term(unchecked=unchecked)
    src, q = isolated_sources(sources(stage, ctx), ctx.got, ctx.quanta, results, ctx.chain)
    want = reference(stage, src, ctx, with_bound=override is None)
    term = Term(want, ctx.chain[stage], upstream_failed=failed_upstream(stage, results),
                baseline=flash_attn_criterion.head_baseline(stage, ctx))
    if override is None:
        term.parts = tolerance.stage_bound_parts(stage, src, want, **ctx.bound_args())
        term.propagated = quantization(stage, src, q, ctx)
        term.chained = tolerance.chained_bound(stage, ctx.chain, **ctx.bound_args())
    return term


class GroupSum:
    """The running sums of one summed stage's Terms over a group's query heads."""

    def __init__(self) -> None:
        self.count = 0
        self.want_iso = self.want_chain = self.chained = None
        self.parts: Optional[tolerance.BoundParts] = None
        self.propagated: object = 0.0
        self.abs_iso: object = 0.0     # Σ (|term| + its bound): what the float32 sum's roundings scale with
        self.abs_chain: object = 0.0
        self.terms: List[np.ndarray] = []  # each query head's isolated reference, for the diagnoses
        self.upstream_failed: List[str] = []
        self.unchecked: Optional[str] = None
        self.baseline: Optional[np.ndarray] = None  # the baselines' parts summed, while every term has one
        self.baselines = 0

    def add(self, t: Term) -> None:
        self.count += 1
        self.unchecked = self.unchecked or t.unchecked
        if t.unchecked:
            return
        self.upstream_failed += [u for u in t.upstream_failed if u not in self.upstream_failed]
        self.terms.append(t.want_iso)
        if t.baseline is not None:
            self.baseline, self.baselines = _plus(self.baseline, t.baseline), self.baselines + 1
        self.want_iso = _plus(self.want_iso, t.want_iso)
        self.want_chain = _plus(self.want_chain, t.want_chain)
        if t.chained is not None:  # (None under a user tolerance)
            if t.parts is not None:
                self.parts = t.parts if self.parts is None else self.parts + t.parts
            self.propagated = self.propagated + t.propagated
            self.chained = _plus(self.chained, t.chained)
            self.abs_iso = self.abs_iso + np.abs(t.want_iso) + t.isolated_bound()
            self.abs_chain = self.abs_chain + np.abs(t.want_chain) + t.chained

    def bounds(self, run: RunInfo, stage: str) -> Tuple[np.ndarray, np.ndarray]:
        """(isolated, chained) bounds of the group's sum (see the module doc); of one term, its own."""
        gamma = sum_gamma(self.count)
        own = np.zeros(self.want_iso.shape) if self.parts is None else self.parts.bound(self.want_iso)
        iso, chain = own + self.propagated, self.chained
        if gamma:  # (one term adds nothing: 0·inf where a term is infinite would make the bound NaN)
            iso, chain = iso + gamma * self.abs_iso, chain + gamma * self.abs_chain
        if self.count > 1 and is_half(run.precision) and stored_in_format(stage):
            iso = iso + storage_bound(self.want_iso, run.precision, run.half_rounding)
            chain = chain + storage_bound(self.want_chain, run.precision, run.half_rounding)
        return iso, chain


def _plus(total: Optional[np.ndarray], x: np.ndarray) -> np.ndarray:
    return np.array(x, dtype=np.float64) if total is None else total + x


class KVGroup:
    """One job: K/V head `kv_head` and its query heads. Holds the copies its first query head
    checked (lent to the others) and the sums of the summed stages. inputs_of_head: any query
    head's inputs (dO too), for the diagnoses that rebuild a sum over other query heads."""

    def __init__(self, run: RunInfo, kv_head: int, inputs_of_head: Optional[Callable] = None) -> None:
        self.run, self.kv_head, self.inputs_of_head = run, kv_head, inputs_of_head
        self.heads = run.dims.query_heads_of(kv_head)
        self.copies: Dict[str, Tuple[HeadResult, Optional[np.ndarray], object]] = {}
        self.sums: Dict[str, GroupSum] = {}
        self.done: Dict[str, Tuple[HeadResult, Optional[np.ndarray], Optional[np.ndarray]]] = {}

    @property
    def size(self) -> int:
        return len(self.heads)

    def sums_stage(self, stage: str) -> bool:
        return self.size > 1 and summed(stage)

    def lends(self, stage: str) -> bool:
        return stage in self.copies

    def keep(self, stage: str, res: HeadResult, mat: Optional[np.ndarray], quantum) -> None:
        """A stage of the K/V heads its first query head checked, for the others to borrow."""
        if self.size > 1 and STAGES[stage].kv:
            self.copies[stage] = (res, mat, quantum)

    def lend(self, stage: str, results: Dict[str, HeadResult], ctx: HeadContext) -> None:
        res, mat, quantum = self.copies[stage]
        results[stage] = res
        if mat is not None:
            ctx.got[stage], ctx.quanta[stage] = mat, quantum

    def add(self, stage: str, term: Term) -> None:
        self.sums.setdefault(stage, GroupSum()).add(term)


# ---- the summed stages' check -------------------------------------------------------------------

def check_summed(group: KVGroup, opts, ref_of_head: Callable[[str, int], np.ndarray],
                 diagnoser: Optional[Diagnoser]) -> List[HeadResult]:
    """The group's summed stages, in table order (a flash gradient after its partner)."""
    return [_check_sum(group, stage, opts, ref_of_head, diagnoser) for stage in STAGES if stage in group.sums]


def _check_sum(group: KVGroup, stage: str, opts, ref_of_head, diagnoser) -> HeadResult:
    run, acc = group.run, group.sums[stage]
    res = new_result(run, stage, group.heads[0])
    if acc.unchecked:
        res.status, res.message = UNCHECKABLE, acc.unchecked
        return _done(group, res)
    mat, resolution, bad_status, msg = load_output(run, stage, group.kv_head)
    if mat is None:
        res.status, res.message = bad_status, msg
        res.diagnosis.append(Diagnosis(STATUS_CODES[bad_status], msg, {}))
        return _done(group, res)
    override = opts.override(stage)
    res.resolution = resolution.describe()
    quantum = read_quantum(resolution, mat, run.precision, stored_in_format(stage)) if override is None else None
    if override is None:
        a_iso, a_chain = acc.bounds(run, stage)
    else:
        a_iso, a_chain = (override[0] + override[1] * np.abs(w) for w in (acc.want_iso, acc.want_chain))
    res.chained = compare_arrays(mat, acc.want_chain, with_quantum(a_chain, quantum), opts.allow_nonfinite)
    res.isolated = compare_arrays(mat, acc.want_iso, with_quantum(a_iso, quantum), nan_agrees=True)
    res.half_values = half_values(mat, acc.want_chain, run.precision)
    if acc.baseline is not None and acc.baselines == acc.count:  # (informational)
        res.flash_attn = flash_attn_criterion.summed_errors(mat, acc.want_chain, acc.baseline, run.precision)
    res.print_limited = print_limited(quantum, a_chain, acc.want_chain)
    res.violations = _sum_checks(group, stage, mat, acc, a_chain, quantum, opts)
    if res.isolated.passed and nonfinite_propagated(mat, acc.want_iso):
        res.violations = [v for v in res.violations if v.code != NONFINITE]
    partner = SPECS[stage].partner
    partner_failed = partner in group.done and not group.done[partner][0].passed
    res.notes = blamed_elsewhere(stage, res.violations, acc.upstream_failed, partner_failed)
    res.violations = [v for v in res.violations if v not in res.notes]
    classify(res, acc.upstream_failed)
    if res.status == FAIL:
        _diagnose(group, res, mat, acc, a_iso, ref_of_head, diagnoser)
    return _done(group, res, mat, with_quantum(a_chain, quantum))


def _done(group: KVGroup, res: HeadResult, mat=None, allowed=None) -> HeadResult:
    group.done[res.stage] = (res, mat, allowed)
    return res


def _sum_checks(group: KVGroup, stage: str, mat, acc: GroupSum, a_chain, quantum, opts):
    """The reference-free checks that hold of a group's sum: no NaN/Inf (where the reference is
    finite, with non-finite inputs allowed), and agreement with the stage-path partner."""
    judged = np.where(np.isfinite(acc.want_chain), mat, 0.0) if opts.allow_nonfinite else mat
    out = [nonfinite(stage, judged, np.zeros(mat.shape, bool))]
    partner, codes = SPECS[stage].partner, SPECS[stage].given_partner
    other = group.done.get(partner)
    if codes and other is not None and other[1] is not None:
        allowed = with_quantum(a_chain, quantum) + other[2]
        out.append(consistency(codes[0], stage, mat, other[1], allowed, f"the program's {partner}"))
    return [v for v in out if v]


def _diagnose(group: KVGroup, res: HeadResult, mat, acc: GroupSum, allowed, ref_of_head, diagnoser) -> None:
    """The diagnoser's patterns for a failing sum: what it is given is the K/V head's (its
    reference, bound and other K/V heads' references) and each query head's part (group_terms:
    a group not summed, or summed twice); there is no one query head's context."""
    if diagnoser is not None:
        run = group.run
        res.diagnosis = diagnoser(res.stage, mat, acc.want_iso, Suspect(
            run.dims, run.scale, run.causal, group.kv_head, {}, functools.partial(ref_of_head, res.stage),
            run.flash_tiles, allowed, None, group.inputs_of_head, group_terms=list(acc.terms), variant=run.variant))
    for v in res.violations:
        if not any(d.code == v.code for d in res.diagnosis):
            res.diagnosis.append(Diagnosis(v.code, v.message, {"count": v.count}))
