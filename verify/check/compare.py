"""The comparison engine: every stage × head, chained and isolated, with integrity checks.

Each stage of each head is compared twice:
  * chained  — against the float64 reference computed from the original inputs;
  * isolated — against a float64 reference computed from the binary's own upstream outputs.
A stage that fails in isolation is a fault of its own (status FAIL); one that fails only chained,
downstream of a failing stage, has inherited the error (status INHERITED). The first stage, in the
stage table's order, with a fault of its own is the culprit the report names.

A stage passes in isolation when its own upstream files or the original inputs explain it (a
correct program may compute a stage by another route than from the upstream files it wrote).
Heads are checked one at a time per process; large runs share them out to forked worker
processes (verify/check/pool.py). The results and the report are in verify/check/results.py. A
failing stage × head is explained by the Diagnoser the caller hands in (the diagnoses of
verify/diagnose/, which sit above this package: verify/check/diagnosis.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..files.case import InputCase, load_input_case, read_bytes
from ..files.guards import check_folders_apart
from ..files.kinds import CaseError
from ..files.outputs import STAGE_ITEMSIZE, Overrides, RunInfo, foreign_stage_files, open_run, stage_files_in, staleness
from ..files.resolution import EXACT, half_values
from ..model.half import is_half, round_to_format
from ..runs.program_checks import ProgramCheck, files_digest, read_findings
from ..specs import SPECS, HeadContext, upstream, uses_scale_and_mask
from ..stages import GRAD_INPUT, INPUT_NAMES, STAGES
from . import flash_attn_criterion, invariants, tolerance
from .diagnosis import Diagnoser, Diagnosis, Suspect
from .pool import REF_CACHE, head_jobs, map_heads
from .reference import compute_stage, reference_chain
from .results import (FAIL, INHERITED, MISSING, PASS, SHAPE, STALE, UNREADABLE, Comparison, HeadResult, Report,
                      compare_arrays, elementwise_error)

__all__ = ["Options", "check", "check_run", "check_head", "error_ratio_map", "Report", "HeadResult", "Comparison",
           "compare_arrays", "elementwise_error", "head_jobs", "RunInfo", "PASS", "FAIL", "INHERITED", "MISSING",
           "STALE", "SHAPE", "UNREADABLE"]


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

    allow_nonfinite: bool = False  # NaN/inf inputs load; NaN then matches a NaN reference
    max_memory_mb: Optional[int] = None  # the most memory the check plans for (else what is available)
    variant: Dict[str, object] = field(default_factory=dict)  # Variant fields said (check --align, --window, ...)

    def overrides(self) -> Overrides:
        return Overrides(self.causal, self.scale, self.precision, self.math, dict(self.names), self.half_rounding,
                         dict(self.variant))

    def override(self, stage: str) -> Optional[Tuple[float, float]]:
        if stage in self.per_stage:
            return self.per_stage[stage]
        if self.atol is not None or self.rtol is not None:
            return (self.atol or 0.0, self.rtol or 0.0)
        return None


# ----------------------------------------------------------------------------------------------

def _load_output(run: RunInfo, stage: str, head: int):
    """(matrix or None, its Resolution, HeadResult-status or None, message) for one stage × head."""
    src = run.sources[stage]
    data = None
    if src.arrays is None and (src.per_head or not src.file(head, run.dims).exists()):
        path = src.file(head, run.dims)
        if not path.exists():
            why = f"run.toml lists stage {stage}" if run.lists_stages else \
                f"the other {stage} files exist"
            return None, EXACT, MISSING, f"{path.name} is missing ({why})"
        try:
            data = read_bytes(path, STAGES[stage].shape(run.dims), STAGE_ITEMSIZE)  # a FIFO, a device, too large
        except CaseError as exc:
            return None, EXACT, UNREADABLE, str(exc)
        stale = staleness(run, stage, head, data)
        if stale:
            return None, EXACT, STALE, stale
    try:
        mat, resolution, _ = src.read(head, run.dims, data)
    except CaseError as exc:
        return None, EXACT, UNREADABLE, str(exc)
    if run.verify_crc and data is not None:
        resolution = EXACT  # attnstep's binary wrote it (its CRC matches): %.9g round-trips float32
    shape = STAGES[stage].shape(run.dims)
    if mat.shape != shape:
        return None, EXACT, SHAPE, (f"{src.name(head, run.dims)} is {mat.shape[0]}x{mat.shape[1]}, expected "
                                    f"{shape[0]}x{shape[1]} ({STAGES[stage].rows}x{STAGES[stage].cols})")
    return mat, resolution, None, ""


def _model(run: RunInfo) -> dict:
    """The tolerance model's arguments for this run."""
    return dict(scale=run.scale, causal=run.causal, precision=run.precision, backend=run.backend,
                math=run.math, flash_kernel=run.flash_kernel, half_rounding=run.half_rounding)


def _allowed(stage: str, src: Dict[str, np.ndarray], want: np.ndarray, run: RunInfo,
             opts: Options, chain: Optional[Dict[str, np.ndarray]] = None,
             cache: Optional[tolerance.HeadCache] = None) -> np.ndarray:
    """The element-wise allowance: the user's atol + rtol·|want| where given, else the error model:
    isolated (this stage's own rounding, from `src`) or, with `chain`, the error accumulated along
    the reference chain from the original inputs. cache: the head's tolerance.HeadCache."""
    ov = opts.override(stage)
    if ov is not None:
        atol, rtol = ov
        return atol + rtol * np.where(np.isfinite(want), np.abs(want), 0.0)
    if chain is not None:
        return tolerance.chained_bound(stage, chain, **_model(run), cache=cache)
    return tolerance.stage_bound(stage, src, want, **_model(run), cache=cache)


def _with_quantum(allowed: np.ndarray, *extra) -> np.ndarray:
    """allowed plus the printed-resolution terms that apply (None or 0: exact)."""
    out = allowed
    for x in extra:
        if x is not None and not (np.isscalar(x) and x == 0):
            out = out + x
    return out


def _isolated_sources(names, got, quanta, results, chain):
    """The sources of a stage's isolated reference: the binary's own upstream stages where it wrote
    them, except echoes that matched their input (the exact input then), and the reference where a
    stage was not written (an unchecked upstream stage is simply not checked)."""
    src, q = {}, {}
    for n in names:
        own = n in got and not (SPECS[n].echo and results[n].passed)
        src[n] = got[n] if own else chain[n]
        if own and quanta.get(n) is not None:
            q[n] = quanta[n]
    return src, q


def _bit_identical(a: Dict[str, np.ndarray], b: Dict[str, np.ndarray]) -> bool:
    """Whether two source sets hold the very same bits (so every reference and bound computed
    from them is the same too): -0.0 vs 0.0 and NaN payloads count as different."""
    return a.keys() == b.keys() and all(
        a[n] is b[n] or (a[n].shape == b[n].shape and a[n].dtype == b[n].dtype
                         and np.ascontiguousarray(a[n]).tobytes() == np.ascontiguousarray(b[n]).tobytes())
        for n in a)


def _blamed_elsewhere(stage: str, violations, results: Dict[str, "HeadResult"]) -> List[invariants.Violation]:
    """Findings that follow from an upstream stage's failure (they become notes): a flash stage's
    disagreement with its stage-path partner when that partner failed, and the invariants that
    hold only given correct upstream stages (dS's row sums when D failed, dK's column sums when dS
    did: see StageSpec.given_partner and given_upstream)."""
    partner = SPECS[stage].partner
    partner_failed = partner is not None and partner in results and not results[partner].passed
    upstream_failed = any(u in results and not results[u].passed for u in upstream(stage))
    out = []
    for v in violations:
        if partner_failed and v.code in SPECS[stage].given_partner:
            out.append(v)
        elif upstream_failed and v.code in SPECS[stage].given_upstream:
            out.append(v)
    return out


def case_inputs(run: RunInfo):
    """The input matrices a run's checks read: Q, K, V, and dO when it holds a backward stage."""
    backward = any(STAGES[s].backward for s in run.stages)
    return INPUT_NAMES + ((GRAD_INPUT,) if backward else ())


def check_head(run: RunInfo, case: InputCase, head: int, opts: Options, ref_of_head: Callable[[str, int], np.ndarray],
               diagnoser: Optional[Diagnoser] = None) -> List[HeadResult]:
    inputs = raw = {name: case.load(name, head).astype(np.float64) for name in case_inputs(run)}
    if is_half(run.precision):
        # The half pipelines compute from the inputs rounded to their format, and so do the references.
        inputs = {name: round_to_format(x, run.precision, run.half_rounding) for name, x in inputs.items()}
    stages = [s for s in run.stages if opts.only_stages is None or s in opts.only_stages]
    needed = set(stages).union(*(upstream(s) for s in stages))  # partial runs: upstream too
    chain = {**inputs, **reference_chain(inputs, run.scale, run.causal, needed)}
    # Logits, softmax parts, dot-product variances, … shared by this head's bounds (the isolated
    # and chained checks, both flash stages and the invariants), keyed by array identity: none of
    # the arrays in the context is modified while it lives.
    ctx = invariants.head_context(run.dims, run.scale, run.causal, precision=run.precision, backend=run.backend,
                                  math=run.math, flash_kernel=run.flash_kernel, inputs=inputs, chain=chain, got={},
                                  quanta={}, cache=tolerance.HeadCache(), allow_nonfinite=opts.allow_nonfinite,
                                  half_rounding=run.half_rounding, raw_inputs=raw)
    b, h = run.dims.decode_head(head)
    results: Dict[str, HeadResult] = {}
    for stage in stages:
        res = results[stage] = HeadResult(stage, head, b, h, PASS)
        mat, resolution, bad_status, msg = _load_output(run, stage, head)
        if mat is None:
            res.status, res.message = bad_status, msg
            code = {STALE: "stale", MISSING: "missing", SHAPE: "shape", UNREADABLE: "unreadable"}[bad_status]
            res.diagnosis.append(Diagnosis(code, msg, {}))
            continue
        res.resolution = resolution.describe()
        ctx.got[stage] = mat
        ctx.quanta[stage] = resolution.quantum(mat) if opts.override(stage) is None else None
        isolated = _compare(res, ctx, results, run, opts)
        res.flash_attn = flash_attn_criterion.head_errors(stage, mat, ctx)  # informational
        res.violations = invariants.check_invariants(stage, mat, ctx)
        if res.isolated.passed and _nonfinite_propagated(mat, isolated[1]):
            res.violations = [v for v in res.violations if v.code != invariants.NONFINITE]
        res.notes = _blamed_elsewhere(stage, res.violations, results)
        res.violations = [v for v in res.violations if v not in res.notes]
        _classify(res, results)
        if res.status == FAIL:
            _diagnose(res, mat, isolated, ctx, run, ref_of_head, diagnoser)
    return list(results.values())


def _compare(res: HeadResult, ctx: HeadContext, results: Dict[str, HeadResult], run: RunInfo, opts: Options):
    """The chained and the isolated comparison of one stage × head (into res); returns the isolated
    (sources, reference, allowance) for the diagnoses."""
    stage, mat, quantum = res.stage, ctx.got[res.stage], ctx.quanta[res.stage]
    names = STAGES[stage].inputs or (stage,)  # an echo's reference is the input file itself
    src_chain = {n: ctx.chain[n] for n in names}
    src_iso, q_iso = _isolated_sources(names, ctx.got, ctx.quanta, results, ctx.chain)
    want_chain = ctx.chain[stage]
    model_chain = _allowed(stage, src_chain, want_chain, run, opts, ctx.chain, ctx.cache)
    allowed_chain = _with_quantum(model_chain, quantum)
    res.chained = compare_arrays(mat, want_chain, allowed_chain, opts.allow_nonfinite)
    res.half_values = half_values(mat, want_chain, run.precision)
    res.print_limited = quantum is not None and bool(np.any(quantum > model_chain))
    if SPECS[stage].chained is None and not q_iso and _bit_identical(src_iso, src_chain):
        # The binary read exactly the reference's sources (its echoes are exact): the isolated
        # reference and bound are the chained ones, so is the comparison.
        res.isolated = res.chained
        return src_iso, want_chain, allowed_chain
    want_iso = compute_stage(stage, src_iso, ctx.scale, ctx.causal)
    propagated = tolerance.quantization_bound(stage, src_iso, q_iso, ctx.scale, ctx.causal) \
        if opts.override(stage) is None else None
    allowed_iso = _with_quantum(_allowed(stage, src_iso, want_iso, run, opts, cache=ctx.cache), quantum, propagated)
    res.isolated = compare_arrays(mat, want_iso, allowed_iso, nan_agrees=True)
    return src_iso, want_iso, allowed_iso


def _diagnose(res: HeadResult, mat: np.ndarray, isolated, ctx: HeadContext, run: RunInfo, ref_of_head,
              diagnoser: Optional[Diagnoser]) -> None:
    """The patterns that explain a failing stage × head (the diagnoser's; none without one), then
    its reference-free findings."""
    src_iso, want_iso, allowed_iso = isolated
    if diagnoser is not None:
        res.diagnosis = diagnoser(res.stage, mat, want_iso, Suspect(
            ctx.dims, ctx.scale, ctx.causal, res.head, src_iso, functools.partial(ref_of_head, res.stage),
            run.flash_tiles, allowed_iso, ctx, lambda h: {n: ref_of_head(n, h) for n in INPUT_NAMES}))
    for v in res.violations:
        if not any(d.code == v.code for d in res.diagnosis):
            res.diagnosis.append(Diagnosis(v.code, v.message, {"count": v.count}))


def _nonfinite_propagated(got: np.ndarray, want_iso: np.ndarray) -> bool:
    """Every NaN/Inf of got stands where the isolated reference has one: the stage propagated
    what its upstream stages gave it (their own checks report the cause)."""
    return bool(np.all(np.isfinite(got) | ~np.isfinite(want_iso)))


def _classify(res: HeadResult, results: Dict[str, HeadResult]) -> None:
    """FAIL when the stage fails on its own: neither its own upstream files nor the original inputs
    explain it (a correct program may compute a stage by another route than from the upstream
    files it wrote: QK_scaled as (Q·scale)·Kᵀ, a fused softmax), or a reference-free check fails.
    INHERITED when it fails only chained, downstream of a failing stage."""
    upstream_failed = [u for u in upstream(res.stage) if u in results and not results[u].passed]
    explained = res.isolated.passed or res.chained.passed
    if not explained or res.violations:
        res.status = FAIL
    elif not res.chained.passed:
        res.status = INHERITED if upstream_failed else FAIL
        res.message = (f"inherits the error of {upstream_failed[0]}" if upstream_failed else
                       "fails against the reference chain only: error accumulated upstream")
    elif not res.isolated.passed:
        res.message = ("matches the reference from the original inputs (computed by another route "
                       "than from the upstream stages it wrote)")


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
    """Checks one head of a run; holds what every head shares (and, per process, the reference
    stages of other heads that the head_permuted diagnosis compared against last: one matrix
    each, REF_CACHE of them, counted in head_jobs' memory budget)."""

    def __init__(self, run: RunInfo, case: InputCase, opts: Options, diagnoser: Optional[Diagnoser]) -> None:
        self.run, self.case, self.opts, self.diagnoser = run, case, opts, diagnoser
        self.ref_of_head = functools.lru_cache(maxsize=REF_CACHE)(self._reference)

    def _reference(self, stage: str, head: int) -> np.ndarray:
        inputs = {n: self.case.load(n, head) for n in case_inputs(self.run)}
        return reference_chain(inputs, self.run.scale, self.run.causal,
                               [stage])[stage]  # (its upstream stages are computed and dropped)

    def check(self, head: int) -> List[HeadResult]:
        # Non-finite inputs, when allowed, make the error model's arithmetic meet inf and NaN.
        with np.errstate(all="ignore") if self.opts.allow_nonfinite else np.errstate():
            return check_head(self.run, self.case, head, self.opts, self.ref_of_head, self.diagnoser)


def check(in_dir: Path, out_dir: Path, opts: Optional[Options] = None,
          progress: Optional[Callable[[int], None]] = None, diagnoser: Optional[Diagnoser] = None) -> Report:
    """Loads both cases, checks their agreement, and compares every stage × head; a failing one is
    explained by `diagnoser` (verify.diagnose.hypotheses.diagnose, as `attnstep check` does)."""
    opts = opts or Options()
    check_folders_apart(in_dir, out_dir)  # as `attnstep check`: inputs compared with themselves would pass
    case = load_input_case(in_dir)
    case.allow_nonfinite = opts.allow_nonfinite
    run = open_run(out_dir, case, opts.overrides())
    return check_run(run, case, opts, progress, tune_process=True, diagnoser=diagnoser)


def check_run(run: RunInfo, case: InputCase, opts: Options, progress: Optional[Callable[[int], None]] = None,
              tune_process: bool = False, diagnoser: Optional[Diagnoser] = None) -> Report:
    """Compares every stage × head of an opened run (files or the Python API's arrays); a failing
    one is explained by `diagnoser` (none: the engine's own findings only).
    tune_process: this process is attnstep's own (see pool.map_heads)."""
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
    checker = _HeadChecker(run, case, opts, diagnoser)
    results = map_heads(checker.check, run.dims.total_heads, head_jobs(run, opts.jobs, opts.max_memory_mb), progress,
                         tune_process)
    apply_mismatches(run, results)
    return Report(run, case, results, foreign_stage_files(run), _program_checks(run, opts))


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
                    opts: Optional[Options] = None) -> np.ndarray:
    """|got - want| / allowed of one stage × head against its isolated reference (for plots)."""
    opts = opts or Options()
    inputs = {n: case.load(n, head).astype(np.float64) for n in case_inputs(run)}
    got, resolution, _, msg = _load_output(run, stage, head)
    if got is None:
        raise CaseError(msg)
    src = {}
    for n in STAGES[stage].inputs or (stage,):
        up = _load_output(run, n, head)[0] if n in run.stages and not SPECS[n].echo else None
        src[n] = up if up is not None else reference_chain(inputs, run.scale, run.causal, [n])[n]
    want = compute_stage(stage, src, run.scale, run.causal)
    allowed = _with_quantum(_allowed(stage, src, want, run, opts), resolution.quantum(got))
    err = elementwise_error(got, want)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(err == 0, 0.0, err / allowed)
    return np.where(np.isnan(ratio), np.inf, ratio)
