"""The parts of one stage's check that a query head's check (verify/check/compare.py) and a K/V
group's summed stages (verify/check/groups.py) share: reading the program's matrix, the sources of
the isolated reference, the references and bounds under the case's variant, and the verdict from
the two comparisons.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import numpy as np

from ..files.case import read_bytes
from ..files.kinds import CaseError
from ..files.matrix_io import wrong_shape
from ..files.outputs import STAGE_ITEMSIZE, RunInfo, staleness
from ..files.resolution import EXACT
from ..files.split_files import SplitSource
from ..files.stage_files import STAGE_NPY
from ..specs import SPECS, HeadContext, lse_route, sources_of, upstream
from ..specs.base import Violation
from ..files.case import InputCase
from ..model.half import round_to_format
from ..stages import BIAS_INPUT, DROPOUT_MASK, GRAD_INPUT, HALF_PRECISIONS, INPUT_NAMES, MASK_INPUT, STAGES
from . import tolerance
from .reference import compute_stage, reference_chain
from .results import FAIL, INHERITED, MISSING, PASS, SHAPE, STALE, UNREADABLE, Comparison, HeadResult, compare_arrays

# A file's state -> its diagnosis code.
STATUS_CODES = {STALE: "stale", MISSING: "missing", SHAPE: "shape", UNREADABLE: "unreadable"}

Loaded = Tuple[Optional[np.ndarray], object, Optional[str], str]


@dataclass
class SequenceRun(RunInfo):
    """One sequence of a packed run, as a dense run of its own (verify/check/packed.py): its dims
    are the sequence's, its N×M stages are its own files, and `rows` reads every other stage as
    the sequence's rows (and KT's columns) of the packed files."""
    rows: Optional[Callable[[str, int], Loaded]] = None
    crc_names: Dict[str, str] = field(default_factory=dict)  # stage -> its files' CRC-32 key, {i} the head

    def crc(self, stage: str, head: int) -> Optional[str]:
        if stage in self.crc_names:
            return self.values.get(self.crc_names[stage].format(i=head))
        return super().crc(stage, head)


def _per_sequence_hint(path, stage: str) -> str:
    """Where a packed run wrote a per-token stage one file per sequence (`<stage>_head_0_seq_1.txt`):
    that such a stage is one file per head over every sequence's tokens."""
    if STAGES[stage].cols == "M" or not any(path.parent.glob(f"{path.stem}_seq_*")):
        return ""
    per_sequence = ", ".join(s for s, st in STAGES.items() if st.rows == "N" and st.cols == "M")
    return (f"; HINT: {stage} is stored packed, one file per head over every sequence's tokens; the "
            f"_seq_<b> files are for the N×M stages ({per_sequence})")


def load_output(run: RunInfo, stage: str, index: int) -> Loaded:
    """(matrix or None, its Resolution, HeadResult-status or None, message) for one stage's matrix
    `index` (a query head's; a K/V head's for a stage of the K/V heads)."""
    if isinstance(run, SequenceRun) and stage not in run.crc_names:
        return run.rows(stage, index)
    src = run.sources[stage]
    if isinstance(src, SplitSource):
        return src.load(run, index)  # (one file per split, each checked on its own)
    data = None
    if src.arrays is None and (src.per_head or not src.file(index, run.dims).exists()):
        path = src.file(index, run.dims)
        if not path.exists():
            why = f"run.toml lists stage {stage}" if run.lists_stages else \
                f"the other {stage} files exist"
            return None, EXACT, MISSING, f"{path} is missing ({why})" + _per_sequence_hint(path, stage)
        try:
            data = read_bytes(path, STAGES[stage].shape(run.dims), STAGE_ITEMSIZE, STAGE_NPY)  # a FIFO, too large
        except CaseError as exc:
            return None, EXACT, UNREADABLE, str(exc)
        stale = staleness(run, stage, index, data)
        if stale:
            return None, EXACT, STALE, stale
    try:
        mat, resolution, _ = src.read(index, run.dims, data)
    except CaseError as exc:
        return None, EXACT, UNREADABLE, str(exc)
    if run.verify_crc and data is not None:
        resolution = EXACT  # attnstep's binary wrote it (its CRC matches): %.9g round-trips float32
    shape = STAGES[stage].shape(run.dims)
    if mat.shape != shape:
        symbols = f"{STAGES[stage].rows}x{STAGES[stage].cols}"
        return None, EXACT, SHAPE, wrong_shape(src.name(index, run.dims), mat.shape, shape, symbols)
    return mat, resolution, None, ""


def new_result(run: RunInfo, stage: str, head: int) -> HeadResult:
    """A passing result of `stage` for query head `head`: a stage of the K/V heads is named after
    the K/V head the query head reads (and, in a grouped case, the query heads that share it)."""
    dims = run.dims
    if not STAGES[stage].kv:
        return HeadResult(stage, head, *dims.decode_head(head), PASS)
    kv = dims.kv_head_of(head)
    serves = tuple(dims.query_heads_of(kv)) if dims.kv_heads else None
    return HeadResult(stage, kv, *divmod(kv, dims.kv), PASS, query_heads=serves)


def file_index(run: RunInfo, stage: str, head: int) -> int:
    """The number of query head `head`'s matrix of `stage` among the stage's files."""
    return run.dims.kv_head_of(head) if STAGES[stage].kv else head


# ---- what a query head reads -----------------------------------------------------------------

def case_inputs(run: RunInfo):
    """The input matrices a run's checks read: Q, K, V, and dO when it holds a backward stage."""
    backward = any(STAGES[s].backward for s in run.stages)
    return INPUT_NAMES + ((GRAD_INPUT,) if backward else ())


def query_keys_values(run: RunInfo, case: InputCase, head: int) -> Dict[str, np.ndarray]:
    """Query head `head`'s Q and the K, V it reads (another head's, for the diagnoses)."""
    inputs = head_inputs(run, case, head)
    return {n: inputs[n] for n in INPUT_NAMES}


def head_inputs(run: RunInfo, case: InputCase, head: int) -> Dict[str, np.ndarray]:
    """Query head `head`'s Q (and dO) and the K, V of the K/V head it reads, as float64."""
    return {n: case.load(n, file_index(run, n, head)).astype(np.float64) for n in case_inputs(run)}


def variant_inputs(case: InputCase, head: int, keep_mask: Optional[Loaded]) -> Dict[str, np.ndarray]:
    """The head's mask and bias files (where the case has them) and the program's keep-mask."""
    out = {}
    for name in (MASK_INPUT, BIAS_INPUT):
        x = case.variant_input(name, head)
        if x is not None:
            out[name] = np.asarray(x, dtype=np.float64)
    if keep_mask is not None and keep_mask[0] is not None:
        out[DROPOUT_MASK] = keep_mask[0]
    return out


def keep_mask(run: RunInfo, head: int) -> Tuple[Optional[Loaded], Optional[str]]:
    """The program's dropout keep-mask of the head (read once: the stages after it read it, and it
    is checked itself), and why the stages that read it cannot be checked (None: they can)."""
    loaded = None if run.sources.get(DROPOUT_MASK) is None else load_output(run, DROPOUT_MASK, head)
    p = run.variant.dropout
    if p <= 0 or (loaded is not None and loaded[0] is not None):
        return loaded, None
    if loaded is not None:
        return loaded, f"not checkable without the program's keep-mask: {loaded[3]}"
    return None, (f"not checkable: the case has dropout {p:g} but the run has no {DROPOUT_MASK} (the program's "
                  f"keep-mask, which the stages after it are computed from: the check never draws its own); HINT: "
                  f"write it as {DROPOUT_MASK}_head_{{i}}, 1 where kept, 0 where dropped")


# ---- references and bounds under the case's variant -------------------------------------------

def sources(stage: str, ctx: HeadContext) -> Tuple[str, ...]:
    """The names a stage's reference and bounds read for this head: its table inputs and what the
    head's variant adds (specs.sources_of: the mask and bias files, the program's keep-mask, QK
    under a softcap); an echo's is the input file itself."""
    return sources_of(stage, ctx.effective_variant) or (stage,)


def reference(stage: str, src: Dict[str, np.ndarray], ctx: HeadContext, with_bound: bool = True) -> np.ndarray:
    """The float64 reference of `stage` from `src` (its sources()) under the head's variant. With
    `with_bound` (its isolated bound is asked for next: no tolerance override), a flash gradient's
    is computed in one pass over the row tiles with that bound (tolerance.share_flash_references)."""
    if with_bound:
        tolerance.share_flash_references(stage, src, **ctx.bound_args())
    return compute_stage(stage, src, ctx.scale, ctx.causal, variant=ctx.effective_variant, slope=ctx.slope)


def quantization(stage: str, src: Dict[str, np.ndarray], quanta, ctx: HeadContext):
    """How far the isolated reference moves with its sources' printed resolutions."""
    return tolerance.quantization_bound(stage, src, quanta, ctx.scale, ctx.causal, variant=ctx.effective_variant,
                                        slope=ctx.slope)


def chain_of(inputs: Dict[str, np.ndarray], needed: Iterable[str], scale: float, causal: bool, variant,
             slope: float) -> Dict[str, np.ndarray]:
    """The inputs and the reference chain of every stage in `needed` from them."""
    return {**inputs, **reference_chain(inputs, scale, causal, needed, variant=variant, slope=slope)}


def early_outputs(run: RunInfo, head: int, stages: Iterable[str], by_model: Callable[[str], bool]) -> Dict[str, Loaded]:
    """The program's flash_output and flash_lse of this head as read (load_output), where a flash
    gradient's isolated check reads them with its error model (by_model(stage): no tolerance
    override, the stage checked on its own); else none. Read before the head's chain (head_chain),
    whose pass over the row tiles then computes that check's bounds and references as well."""
    stages = list(stages)
    if not all(s in stages for s in tolerance.FLASH_OWN_OUTPUTS) or not any(
            STAGES[s].flash and STAGES[s].backward and not STAGES[s].split and by_model(s) for s in stages):
        return {}
    return {s: load_output(run, s, file_index(run, s, head)) for s in tolerance.FLASH_OWN_OUTPUTS}


def head_chain(ctx: HeadContext, inputs: Dict[str, np.ndarray], needed: Iterable[str],
               asked: Iterable[str], early: Optional[Dict[str, Loaded]] = None) -> HeadContext:
    """ctx with its chain: chain_of the stages `needed` from `inputs`. Where the chained bound of a
    flash stage is asked (`asked`: the stages checked by the error model, no tolerance override)
    and the chain holds the flash backward, that bound's pass over the row tiles computes the flash
    stages' chained references too (tolerance.chained_flash_references): they need no passes of
    their own; and with `early` (early_outputs), the flash gradients' isolated bounds and
    references. Not with non-finite inputs, whose references the passes may spell differently."""
    needed = set(needed)
    src = dict(inputs)
    flash = [s for s in needed if STAGES[s].flash]
    if (any(STAGES[s].backward for s in flash) and any(s in flash for s in asked)
            and all(np.isfinite(np.asarray(src[n])).all() for n in INPUT_NAMES + (GRAD_INPUT,) if n in src)):
        own = {n: loaded[0] for n, loaded in (early or {}).items() if loaded[0] is not None}
        refs = tolerance.chained_flash_references(src, own_outputs=own, **ctx.bound_args())
        src.update({n: x for n, x in refs.items() if n in needed})
    ctx.chain.update(chain_of(src, needed, ctx.scale, ctx.causal, ctx.variant, ctx.slope))
    return ctx


def allowed(stage: str, src: Dict[str, np.ndarray], want: np.ndarray, ctx: HeadContext,
            override: Optional[Tuple[float, float]], chained: bool = False) -> np.ndarray:
    """The element-wise allowance: the user's atol + rtol·|want| where given (override), else the
    error model: isolated (this stage's own rounding, from `src`) or chained (the error
    accumulated along the head's reference chain from the original inputs; in a run that splits
    the keys, a flash stage's plus what its float32 combine adds)."""
    if override is not None:
        atol, rtol = override
        return atol + rtol * np.where(np.isfinite(want), np.abs(want), 0.0)
    if chained:
        tolerance.share_flash_passes(stage, ctx.chain, **ctx.bound_args())
        return tolerance.chained_bound(stage, ctx.chain, **ctx.bound_args()) + ctx.bounds.combine_allowance(stage, ctx)
    return tolerance.stage_bound(stage, src, want, **ctx.bound_args())


def compare_fitted(stage: str, got: np.ndarray, want: np.ndarray, allowance: np.ndarray, ctx: HeadContext,
                   fit: bool, nan_agrees: bool, chained: bool = False) -> Tuple[Comparison, np.ndarray, np.ndarray]:
    """got against want under `allowance` (compare_arrays), where weights or an output from a float32
    lse may carry a row factor (with `fit`: no tolerance the user gives, which is taken as it is;
    lse_route.fitted); the comparison, its largest errors against want itself, and the want and
    allowance it judged by."""
    judged, allowance = lse_route.fitted(stage, got, want, allowance, ctx, chained=chained) if fit else (want, allowance)
    return compare_arrays(got, judged, allowance, nan_agrees, measured=want), judged, allowance


def read_quantum(resolution, mat: np.ndarray, precision: str, stored: bool) -> Optional[np.ndarray]:
    """The reading's term of a stage's bound (resolution.quantum): none where the file is a float16
    array at fp16 and the bound already holds the format's storage rounding (`stored`): the file
    then holds exactly the value the program stored, and counting its half unit again would allow
    a value one unit off."""
    if stored and precision == "fp16" and resolution.kind == "half":
        return None
    return resolution.quantum(mat)


def with_quantum(allowed: np.ndarray, *extra) -> np.ndarray:
    """allowed plus the printed-resolution terms that apply (None or 0: exact)."""
    out = allowed
    for x in extra:
        if x is not None and not (np.isscalar(x) and x == 0):
            out = out + x
    return out


def _own(name: str, got, results) -> bool:
    """Whether an isolated reference reads the program's own `name`: written, and not an echo that
    matched its input (the exact input is read then)."""
    return name in got and not (SPECS[name].echo and results[name].passed)


def isolated_sources(names, got, quanta, results, chain):
    """The sources of a stage's isolated reference: the binary's own upstream stages where it wrote
    them (or a stage that stands for one: flash_output for output), except echoes that matched their
    input (the exact input then), and the reference where a stage was not written (an unchecked
    upstream stage is simply not checked)."""
    src, q = {}, {}
    for n in names:
        own = n if _own(n, got, results) else next((s for s in SPECS if SPECS[s].stands_for == n
                                                     and _own(s, got, results)), None)
        src[n] = got[own] if own else chain[n]
        if own and quanta.get(own) is not None:
            q[n] = quanta[own]
    return src, q


def derived_sources(names, src: Dict[str, np.ndarray], ctx: HeadContext, results):
    """(`src` with each source the program did not write, but computed from a stage it wrote that
    failed, recomputed from the program's own stages and stored in the run's format, as a program
    holds it; each such source's uncertainty, for the isolated bound: its own isolated bound from
    those stages, and theirs carried through it). QK_scaled from the program's QK where it wrote
    QK and the weights but not QK_scaled: the reference's own QK_scaled would blame the weights for
    QK's error; from the program's QK they pass, and fail only where they are wrong on their own."""
    memo: Dict[str, Tuple[np.ndarray, Optional[np.ndarray]]] = {}

    def failed_above(n: str) -> bool:  # (a variant's file, a keep-mask: no stage of the table)
        return n in STAGES and any(u in results and _own(u, ctx.got, results) and not results[u].passed
                                   for u in upstream(n))

    def value(n: str) -> Tuple[np.ndarray, Optional[np.ndarray]]:
        if n not in STAGES:
            return (src[n] if n in src else ctx.chain[n]), None
        if _own(n, ctx.got, results):
            return ctx.got[n], ctx.quanta.get(n)
        if n not in memo:
            memo[n] = ctx.chain[n], None
            if failed_above(n):
                memo[n] = _derived(n, {m: value(m) for m in sources(n, ctx)}, ctx) or memo[n]
        return memo[n]

    out, quanta = dict(src), {}
    for n in names:
        if src[n] is ctx.chain.get(n) and failed_above(n):
            out[n], q = value(n)
            if q is not None:
                quanta[n] = q
    return out, quanta


def _derived(stage: str, given, ctx: HeadContext) -> Optional[Tuple[np.ndarray, np.ndarray]]:
    """The stage from `given` ({source: (values, uncertainty or None)}) as the program would hold
    it, and its uncertainty; None where it cannot be computed from them."""
    src = {m: x for m, (x, _) in given.items()}
    try:
        exact = reference(stage, src, ctx, with_bound=False)
        bound = tolerance.stage_bound(stage, src, exact, **ctx.bound_args())
    except (KeyError, ValueError):
        return None
    quanta = {m: q for m, (_, q) in given.items() if q is not None}
    carried = quantization(stage, src, quanta, ctx) if quanta else None
    stored = round_to_format(exact, ctx.precision) if ctx.precision in HALF_PRECISIONS else \
        exact.astype(np.float32).astype(np.float64)
    return stored, with_quantum(np.asarray(bound, np.float64), carried)


def bit_identical(a: Dict[str, np.ndarray], b: Dict[str, np.ndarray]) -> bool:
    """Whether two source sets hold the very same bits (so every reference and bound computed
    from them is the same too): -0.0 vs 0.0 and NaN payloads count as different."""
    return a.keys() == b.keys() and all(
        a[n] is b[n] or (a[n].shape == b[n].shape and a[n].dtype == b[n].dtype
                         and np.ascontiguousarray(a[n]).tobytes() == np.ascontiguousarray(b[n]).tobytes())
        for n in a)


# ---- the verdict ---------------------------------------------------------------------------------

def failed_upstream(stage: str, results: Dict[str, HeadResult]) -> List[str]:
    """The stages `stage` is computed from that failed (or a stage that stands for one the program did
    not write: flash_output for output), in table order."""
    above = upstream(stage)
    return [u for u in results if not results[u].passed
            and (u in above or (SPECS[u].stands_for in above and SPECS[u].stands_for not in results))]


def blamed_elsewhere(stage: str, violations: List[Violation], upstream_failed: List[str],
                     partner_failed: bool) -> List[Violation]:
    """Findings that follow from an upstream stage's failure (they become notes): a flash stage's
    disagreement with its stage-path partner when that partner failed, and the invariants that
    hold only given correct upstream stages (dS's row sums when D failed, dK's column sums when dS
    did: see StageSpec.given_partner and given_upstream)."""
    out = []
    for v in violations:
        if partner_failed and v.code in SPECS[stage].given_partner:
            out.append(v)
        elif upstream_failed and v.code in SPECS[stage].given_upstream:
            out.append(v)
    return out


def nonfinite_propagated(got: np.ndarray, want_iso: np.ndarray) -> bool:
    """Every NaN/Inf of got stands where the isolated reference has one: the stage propagated
    what its upstream stages gave it (their own checks report the cause)."""
    return bool(np.all(np.isfinite(got) | ~np.isfinite(want_iso)))


def classify(res: HeadResult, upstream_failed: List[str]) -> None:
    """FAIL when the stage fails on its own: neither its own upstream files nor the original inputs
    explain it (a correct program may compute a stage by another route than from the upstream
    files it wrote: QK_scaled as (Q·scale)·Kᵀ, a fused softmax), or a reference-free check fails.
    INHERITED when it fails only chained, downstream of a failing stage."""
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
