"""The comparison engine: every stage × head, chained and isolated, with integrity checks.

Each stage of each head is compared twice:
  * chained  — against the float64 reference computed from the original inputs;
  * isolated — against a float64 reference computed from the binary's own upstream outputs.
A stage that fails in isolation is a fault of its own (status FAIL); one that fails only chained,
downstream of a failing stage, has inherited the error (status INHERITED). The first stage, in the
stage table's order, with a fault of its own is the culprit the report names.

A stage passes in isolation when its own upstream files or the original inputs explain it. Heads are checked one at
a time per process, a K/V head's group of query heads in one job (dK and dV against the sum over its group:
groups.py), shared out to forked workers (pool.py). A packed case is checked sequence by sequence (packed.py). A
case's variant reaches every reference and bound through the head's context (stage_check.VARIANT_SOURCES); dropout's
keep rate is tested once over the run. Results and report: results.py. A failing stage × head is explained by the
Diagnoser the caller hands in (verify/diagnose/, above this package: diagnosis.py; a long head's: slab.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..files.case import InputCase, load_input_case
from ..files.guards import check_folders_apart
from ..files.kinds import CaseError
from ..files.outputs import Overrides, RunInfo, foreign_stage_files, open_run, stage_files_in
from ..files.resolution import half_values
from ..model.arrays import device_jobs, on_device
from ..model.half import is_half, round_to_format
from ..runs.program_checks import ProgramCheck, files_digest, read_findings
from ..specs import SPECS, HeadContext, reads_dropout_mask, upstream, uses_scale_and_mask
from ..specs import dropout as dropout_spec
from ..stages import DROPOUT_MASK, GRAD_INPUT, STAGES
from . import flash_attn_criterion, invariants, sizing, splits, tolerance
from .diagnosis import Diagnoser, Diagnosis
from .groups import KVGroup, check_summed, head_term, summed
from .packed import PackedRun, packed_sources
from .paged_case import diagnose_paged_case
from .devices import device_for
from .pool import collect_head_garbage, head_jobs, map_heads
from .slab import diagnoser as slab_diagnoser, notes as slab_notes
from .results import (FAIL, INHERITED, MISSING, PASS, SHAPE, STALE, UNCHECKABLE, UNREADABLE, Comparison, HeadResult,
                      Report, RunCheck, compare_arrays, elementwise_error, print_limited)
from .stage_diagnosis import diagnose_stage, diagnose_through_splits
from .stage_check import (STATUS_CODES, Loaded, allowed, bit_identical, blamed_elsewhere, chain_of, head_chain,
                          classify, compare_fitted, derived_sources, early_outputs, failed_upstream, file_index,
                          head_inputs, isolated_sources, keep_mask, load_output, new_result, nonfinite_propagated,
                          quantization, query_keys_values, read_quantum, reference, sources, variant_inputs,
                          with_quantum)
from .half_rounding import stored_in_format

__all__ = ["Options", "check", "check_run", "check_head", "error_ratio_map", "Report", "HeadResult", "Comparison",
           "compare_arrays", "elementwise_error", "head_jobs", "RunInfo", "PASS", "FAIL", "INHERITED", "MISSING",
           "STALE", "SHAPE", "UNREADABLE", "UNCHECKABLE"]


@dataclass
class Options:
    """Tolerance overrides: (atol, rtol) replace the error model for every stage or one stage."""
    atol: Optional[float] = None
    rtol: Optional[float] = None
    per_stage: Dict[str, Tuple[float, float]] = field(default_factory=dict)
    only_stages: Optional[Sequence[str]] = None
    jobs: int = 0  # worker processes over heads; 0: as many as cores and memory allow
    # What the run is checked against, when the command line says (else the input case / run.toml).
    causal: Optional[bool] = None
    scale: Optional[float] = None
    precision: Optional[str] = None
    math: str = "ieee"
    names: Dict[str, str] = field(default_factory=dict)  # stage -> file name pattern in OUT
    half_rounding: Optional[str] = None  # how a bf16/fp16 program converts (None: to nearest)
    device: str = "cpu"  # where the flash references run: cpu (NumPy), cuda (verify/model/arrays.py)
    allow_nonfinite: bool = False  # NaN/inf inputs load; NaN then matches a NaN reference
    max_memory_mb: Optional[int] = None  # the most memory the check plans for (else what is available)
    variant: Dict[str, object] = field(default_factory=dict)  # Variant fields said (check --align, --window, ...)
    page_size: Optional[int] = None  # check --page-size: a paged case without a manifest
    split_size: Optional[int] = None  # check --split-size: the keys per split of a run that splits

    def overrides(self) -> Overrides:
        return Overrides(self.causal, self.scale, self.precision, self.math, dict(self.names), self.half_rounding,
                         dict(self.variant), self.split_size)

    def override(self, stage: str) -> Optional[Tuple[float, float]]:
        if stage in self.per_stage:
            return self.per_stage[stage]
        if self.atol is not None or self.rtol is not None:
            return (self.atol or 0.0, self.rtol or 0.0)
        return None

    def checked(self, run: RunInfo) -> List[str]:
        return [s for s in run.stages if self.only_stages is None or s in self.only_stages]


# ----------------------------------------------------------------------------------------------
# One query head.


def _open_head(run: RunInfo, case: InputCase, head: int, opts: Options, stages: Sequence[str], early=None):
    """(the head's context, its keep-mask as read, why the stages reading it can't be checked); early: early_outputs."""
    inputs = raw = head_inputs(run, case, head)
    if is_half(run.precision):
        # The half pipelines compute from the inputs rounded to their format, and so do the references.
        inputs = {name: round_to_format(x, run.precision, run.half_rounding) for name, x in inputs.items()}
    mask_read, unchecked = keep_mask(run, head)
    inputs = {**inputs, **variant_inputs(case, head, mask_read)}
    needed = set(stages).union(*(upstream(s) for s in stages))  # partial runs: upstream too
    needed = {s for s in needed if not (unchecked and reads_dropout_mask(s, run.variant))
              and (not STAGES[s].dropout or s in inputs) and not STAGES[s].split}  # (splits: check/splits.py)
    slope = case.alibi_slope(head)
    # What this head's bounds share (logits, softmax parts, dot-product variances, …), keyed by
    # array identity: none of the arrays in the context is modified while it lives.
    ctx = invariants.head_context(run.dims, run.scale, run.causal, precision=run.precision, backend=run.backend,
                                  math=run.math, flash_kernel=run.flash_kernel, inputs=inputs,
                                  chain={}, got={}, quanta={}, cache=tolerance.HeadCache(),
                                  allow_nonfinite=opts.allow_nonfinite, half_rounding=run.half_rounding,
                                  raw_inputs=raw, variant=run.variant, slope=slope)
    return head_chain(ctx, inputs, needed, [s for s in stages if opts.override(s) is None], early), mask_read, unchecked


def check_head(run: RunInfo, case: InputCase, head: int, opts: Options, ref_of_head: Callable[[str, int], np.ndarray],
               diagnoser: Optional[Diagnoser] = None, group: Optional[KVGroup] = None) -> List[HeadResult]:
    """Every stage of query head `head`. In a grouped case (group: its K/V head's), the stages of
    the K/V heads its group's first query head checked are borrowed, and the summed ones only
    contribute to the group's sums (groups.check_summed checks them)."""
    group = group or KVGroup(run, run.dims.kv_head_of(head))
    stages = opts.checked(run)
    early = early_outputs(run, head, stages, lambda s: opts.override(s) is None and not group.lends(s))
    ctx, mask_read, unchecked = _open_head(run, case, head, opts, stages, early)
    inputs_of_head = functools.partial(query_keys_values, run, case)
    results, lent = {}, set()  # (stage: HeadResult; the stages borrowed)
    for stage in stages:
        why = unchecked if reads_dropout_mask(stage, run.variant) else None
        if group.lends(stage):
            group.lend(stage, results, ctx)
            lent.add(stage)
        elif group.sums_stage(stage):
            group.add(stage, head_term(stage, ctx, results, opts.override(stage), why))
        elif why:
            res = results[stage] = new_result(run, stage, head)
            res.status, res.message = UNCHECKABLE, why
        elif STAGES[stage].split:
            results[stage] = splits.check_split_stage(new_result(run, stage, head), run, ctx, opts, diagnoser)
        else:
            res = results[stage] = new_result(run, stage, head)
            loaded = mask_read if STAGES[stage].dropout else early.pop(stage, None) or load_output(
                run, stage, file_index(run, stage, head))
            mat, quantum = _check_stage(res, loaded, ctx, results, run, opts,
                                        (ref_of_head, inputs_of_head, case.alibi_slope, diagnoser))
            group.keep(stage, res, mat, quantum)
    return [r for s, r in results.items() if s not in lent]


def _check_stage(res: HeadResult, loaded: Loaded, ctx: HeadContext, results: Dict[str, HeadResult], run: RunInfo,
                 opts: Options, diagnosis) -> Tuple[Optional[np.ndarray], object]:
    """One stage × head from its matrix as read (into res); returns (the matrix, its printed
    resolution) for the query heads that borrow it."""
    mat, resolution, bad_status, msg = loaded
    stage = res.stage
    if mat is None:
        res.status, res.message = bad_status, msg
        res.diagnosis.append(Diagnosis(STATUS_CODES[bad_status], msg, {}))
        return None, None
    res.resolution = resolution.describe()
    ctx.got[stage] = mat
    ctx.quanta[stage] = (read_quantum(resolution, mat, run.precision, stored_in_format(stage))
                         if opts.override(stage) is None else None)
    isolated, chained = _compare(res, ctx, results, run, opts)
    res.flash_attn = flash_attn_criterion.head_errors(stage, mat, ctx)  # informational
    res.violations = invariants.check_invariants(stage, mat, ctx)
    if res.isolated.passed and nonfinite_propagated(mat, isolated[1]):
        res.violations = [v for v in res.violations if v.code != invariants.NONFINITE]
    if STAGES[stage].dropout:
        res.keep_counts = dropout_spec.keep_counts(mat, ctx)
    upstream_failed = failed_upstream(stage, results) + splits.failed_splits(stage, ctx, results)
    partner = SPECS[stage].partner
    res.notes = blamed_elsewhere(stage, res.violations, upstream_failed,
                                 partner in results and not results[partner].passed)
    res.violations = [v for v in res.violations if v not in res.notes]
    classify(res, upstream_failed)
    if res.status == FAIL:
        diagnose_stage(res, mat, isolated, ctx, run, *diagnosis)
    elif res.status == INHERITED:  # a correct combine of failing splits: the attention's own bug?
        diagnose_through_splits(res, mat, chained, ctx, results, run, *diagnosis)
    return mat, ctx.quanta[stage]


def _compare(res: HeadResult, ctx: HeadContext, results: Dict[str, HeadResult], run: RunInfo, opts: Options):
    """The chained and the isolated comparison of one stage × head (into res); returns the isolated
    and the chained (sources, reference, allowance) for the diagnoses."""
    stage, mat, quantum = res.stage, ctx.got[res.stage], ctx.quanta[res.stage]
    override, names = opts.override(stage), sources(stage, ctx)
    src_chain = {n: ctx.chain[n] for n in names}
    src_iso, q_iso = isolated_sources(names, ctx.got, ctx.quanta, results, ctx.chain)
    src_iso, derived_q = derived_sources(names, src_iso, ctx, results)
    q_iso.update(derived_q)
    mat = invariants.canonical(stage, mat, ctx)  # (a correct program's other convention: flash_lse's +inf)
    want_chain = ctx.chain[stage]
    model_chain = allowed(stage, src_chain, want_chain, ctx, override, chained=True)
    allowed_chain = with_quantum(model_chain, quantum)
    res.chained, want_chain, allowed_chain = compare_fitted(stage, mat, want_chain, allowed_chain, ctx,
                                                            override is None, opts.allow_nonfinite, chained=True)
    res.half_values = half_values(mat, want_chain, run.precision)
    res.print_limited = print_limited(quantum, model_chain, want_chain)
    if splits.combines(stage, ctx):  # a run that splits: isolated, the combine of the program's splits
        return splits.compare_combine(res, mat, quantum, ctx, override), (src_chain, want_chain, allowed_chain)
    if SPECS[stage].chained is None and not q_iso and bit_identical(src_iso, src_chain):
        # The binary read exactly the reference's sources (its echoes are exact): the isolated
        # reference and bound are the chained ones, so is the comparison.
        res.isolated = res.chained
        return (src_iso, want_chain, allowed_chain), (src_chain, want_chain, allowed_chain)
    want_iso = reference(stage, src_iso, ctx, with_bound=override is None)
    if SPECS[stage].passed_on is not None:  # (the program's form of what a faulty upstream gave it)
        want_iso = SPECS[stage].passed_on(mat, want_iso, src_iso, ctx)
    propagated = quantization(stage, src_iso, q_iso, ctx) if override is None else None
    allowed_iso = with_quantum(allowed(stage, src_iso, want_iso, ctx, override), quantum, propagated)
    res.isolated, want_iso, allowed_iso = compare_fitted(stage, mat, want_iso, allowed_iso, ctx, override is None, True)
    if not q_iso and all(src_iso[n] is ctx.chain.get(n) for n in names):
        # None of its sources is the program's: the isolated bound would take them as exact and count
        # correct elements outside; the comparison that applies is the chained one (the diagnoses keep
        # the isolated reference and bound).
        res.isolated = res.chained
    return (src_iso, want_iso, allowed_iso), (src_chain, want_chain, allowed_chain)


def apply_mismatches(run: RunInfo, results: List[HeadResult]) -> None:
    """A run.toml that says the run computed another causal mode or scale than the input case asks
    for fails every stage that depends on them, with the mismatch as its first diagnosis."""
    for mm in run.mismatches:
        for r in results:
            if not uses_scale_and_mask(r.stage):
                continue
            r.diagnosis.insert(0, Diagnosis(f"{mm.key}_mismatch", mm.message(),
                                                 {"run": mm.run_value, "input": mm.input_value}, 0.99))
            if r.status == PASS:
                r.status, r.message = FAIL, mm.message()


class _HeadChecker:
    """Checks one K/V head's group of a run (one query head where K/V heads are not grouped); holds what every group
    shares (and, per process, the reference stages of other heads that the head_permuted diagnosis compared against
    last: one matrix each, REF_CACHE of them, counted in head_jobs' memory budget)."""

    def __init__(self, run: RunInfo, case: InputCase, opts: Options, diagnoser: Optional[Diagnoser],
                 packed: Optional[PackedRun] = None, slabs: bool = True) -> None:
        self.run, self.case, self.opts, self.diagnoser, self.slabs = run, case, opts, diagnoser, slabs
        self.ref_of_head = functools.lru_cache(maxsize=sizing.REF_CACHE)(self._reference)
        self.packed = packed  # a packed case: each sequence is checked as a dense case of its own

    def _reference(self, stage: str, head: int) -> np.ndarray:
        """The reference of `stage` for query head `head`, or for K/V head `head` of a stage of the
        K/V heads (a summed one's over its group); empty where there is no such head or the
        reference needs a keep-mask the program did not write."""
        dims = self.run.dims
        if not STAGES[stage].kv:
            return self._query_reference(stage, head)
        if head >= dims.total_kv_heads:
            return np.empty((0, 0))
        heads = dims.query_heads_of(head)
        return sum(self._query_reference(stage, h) for h in (heads if summed(stage) else heads[:1]))

    def _query_reference(self, stage: str, head: int) -> np.ndarray:
        mask_read, unchecked = keep_mask(self.run, head)
        if unchecked and reads_dropout_mask(stage, self.run.variant):
            return np.empty((0, 0))
        inputs = {**head_inputs(self.run, self.case, head), **variant_inputs(self.case, head, mask_read)}
        return chain_of(inputs, [stage], self.run.scale, self.run.causal, self.run.variant,
                        self.case.alibi_slope(head))[stage]  # (its upstream stages are computed and dropped)

    def check(self, kv_head: int) -> List[HeadResult]:
        """Every stage of K/V head `kv_head`'s query heads, and its own stages, in table order (in a
        packed case, of each sequence in turn: packed.PackedRun)."""
        if self.packed is not None:
            return self.packed.check(kv_head, lambda run, case, diagnoser: _HeadChecker(
                run, case, self.opts, diagnoser, slabs=False).check(kv_head), self.diagnoser)
        group = KVGroup(self.run, kv_head, functools.partial(head_inputs, self.run, self.case))
        diagnoser = slab_diagnoser(self.run, self.case, self.diagnoser, lambda run, case, capture: _HeadChecker(
            run, case, self.opts, capture, slabs=False).check(kv_head)) if self.slabs else self.diagnoser
        out: List[HeadResult] = []
        # Non-finite inputs, when allowed, make the error model's arithmetic meet inf and NaN.
        with np.errstate(all="ignore") if self.opts.allow_nonfinite else np.errstate():
            for i, head in enumerate(group.heads):
                if i:
                    collect_head_garbage()  # the previous query head's matrices, before the next one's
                out += check_head(self.run, self.case, head, self.opts, self.ref_of_head, diagnoser, group)
            out += check_summed(group, self.opts, self.ref_of_head, diagnoser)
        if group.size == 1:
            return out
        order = {s: i for i, s in enumerate(STAGES)}
        return sorted(out, key=lambda r: order[r.stage])  # (stable: query heads in order)


def check(in_dir: Path, out_dir: Path, opts: Optional[Options] = None,
          progress: Optional[Callable[[int], None]] = None, diagnoser: Optional[Diagnoser] = None) -> Report:
    """Loads both cases, checks their agreement, and compares every stage × head; a failing one is
    explained by `diagnoser` (verify.diagnose.hypotheses.diagnose, as `attnstep check` does)."""
    opts = opts or Options()
    check_folders_apart(in_dir, out_dir)  # as `attnstep check`: inputs compared with themselves would pass
    case = load_input_case(in_dir, alibi=opts.variant.get("alibi"), page_size=opts.page_size)
    case.allow_nonfinite = opts.allow_nonfinite
    return check_run(open_run(out_dir, case, opts.overrides()), case, opts, progress, True, diagnoser)


def check_run(run: RunInfo, case: InputCase, opts: Options, progress: Optional[Callable[[int], None]] = None,
              tune_process: bool = False, diagnoser: Optional[Diagnoser] = None) -> Report:
    """Compares every stage × head of an opened run (files or the Python API's arrays); a failing one is explained
    by `diagnoser` (none: the engine's own findings only). tune_process: this process is attnstep's own (see
    pool.map_heads)."""
    if opts.only_stages:
        unknown = [s for s in opts.only_stages if s not in STAGES]
        if unknown:
            raise CaseError(f"unknown stage '{unknown[0]}'; stages are: {', '.join(STAGES)}")
        absent = [s for s in opts.only_stages if s not in run.stages]
        if absent:
            raise CaseError(f"--stage {absent[0]}: {run.path or 'the run'} holds no {absent[0]} (it has "
                            f"{', '.join(run.stages)}); nothing would be checked")
    backward = [s for s in run.stages if STAGES[s].backward and (opts.only_stages is None or s in opts.only_stages)]
    if backward and not case.backward:
        raise CaseError(f"{run.path or 'the run'} holds the backward stage {backward[0]}, but the input case "
                        f"{case.path} has no {GRAD_INPUT} (the output gradient it is computed from); HINT: "
                        "check it against the case it was run on ('attnstep generate --backward' writes one)")
    packed = None
    if case.sequences is not None:
        packed_sources(run)
        packed = PackedRun(run, case, opts.checked(run))
    checker = _HeadChecker(run, case, opts, diagnoser, packed)
    dims = run.dims
    advance = None if progress is None else (lambda kv: [progress(h) for h in dims.query_heads_of(kv)])
    jobs = head_jobs(run, opts.jobs, opts.max_memory_mb) if packed is None else \
        head_jobs(packed.sizing_run(), opts.jobs, opts.max_memory_mb, packed.held_bytes())
    with on_device(device_for(run, opts.device), dims.seq_q * dims.seq_k, opts.jobs) as device:  # (GPU: one process)
        results = map_heads(checker.check, dims.total_kv_heads, device_jobs(device, jobs), advance, tune_process)
    apply_mismatches(run, results)
    run.notes += slab_notes(run, results) if diagnoser is not None and packed is None else []
    report = Report(run, case, results, foreign_stage_files(run), _program_checks(run, opts), _keep_rate(run, results))
    if packed is not None and diagnoser is not None:  # pages or new keys read from the wrong place
        diagnose_paged_case(report, check_run, Options(jobs=1), load_output)
    return report


def _keep_rate(run: RunInfo, results: List[HeadResult]) -> List[RunCheck]:
    """Under dropout, the keep rate of the program's masks over every head's visible entries
    (each head's counts are its dropout_mask result's), tested once for the whole run."""
    counts = [r.keep_counts for r in results if r.keep_counts is not None]
    if run.variant.dropout <= 0 or not counts:
        return []
    kept, total = (sum(c) for c in zip(*counts))
    passed, line = dropout_spec.keep_rate(kept, total, run.variant.dropout)
    return [RunCheck(dropout_spec.KEEP_RATE, DROPOUT_MASK, dropout_spec.KEEP_RATE_TITLE, passed, line,
                     {"kept": kept, "visible": total, "dropout": run.variant.dropout})]


def _program_checks(run: RunInfo, opts: Options) -> List[ProgramCheck]:
    """The findings `attnstep run --sanitize/--repeat` left about the program that wrote these
    files (none for arrays, or when they describe other files: then a note says so)."""
    if run.path is None:
        return []
    checks, note = read_findings(run.path, files_digest(run.path, stage_files_in(run.path, opts.names)))
    if note:
        run.notes.append(note)
    return checks


def error_ratio_map(run: RunInfo, case: InputCase, stage: str, head: int,
                    opts: Optional[Options] = None, sequence: Optional[int] = None) -> np.ndarray:
    """|got - want| / allowed of one stage × head (a K/V head for a stage of the K/V heads: a summed one's against
    its group's sum) against its isolated reference from the program's own upstream files (for plots); in a packed
    case, of one sequence (`sequence`)."""
    opts = opts or Options()
    if sequence is not None:
        run, case = PackedRun(run, case, [stage]).sequence(sequence)
    got, resolution, _, msg = load_output(run, stage, head)
    if got is None:
        raise CaseError(msg)
    if STAGES[stage].split:  # (against each split's own reference: verify/check/splits.py)
        return splits.ratio_map(got, resolution, _open_head(run, case, head, opts, [stage])[0], stage)
    heads = [head]
    if STAGES[stage].kv:
        heads = list(run.dims.query_heads_of(head))[:None if summed(stage) else 1]
    group = KVGroup(run, run.dims.kv_head_of(heads[0]))
    for h in heads:
        ctx, _, unchecked = _open_head(run, case, h, opts, [stage])
        if unchecked and reads_dropout_mask(stage, run.variant):
            raise CaseError(f"{stage}: {unchecked}")
        for n in sources(stage, ctx):
            if n in run.stages and not SPECS[n].echo:
                up = load_output(run, n, file_index(run, n, h))[0]
                if up is not None:
                    ctx.got[n] = up
        group.add(stage, head_term(stage, ctx, {}, opts.override(stage), None))
    acc, override = group.sums[stage], opts.override(stage)
    want = acc.want_iso
    bound = acc.bounds(run, stage)[0] if override is None else override[0] + override[1] * np.abs(want)
    bound = with_quantum(bound, resolution.quantum(got))
    err = elementwise_error(got, want)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(err == 0, 0.0, err / bound)
    return np.where(np.isnan(ratio), np.inf, ratio)
