"""Checking a run that splits the keys (flash-decoding): each split of split_output and split_lse
against its own float64 reference, then flash_output and flash_lse against the combine of the
program's own splits, so that a bug is placed in a split or in the combine.

A split is the flash forward restricted to a key range (verify/specs/splits.py restricted()): its
reference and bounds are flash_output's and flash_lse's under the case's variant with the keys
outside [s·K, (s+1)·K) hidden, i.e. the flash forward's error model at the split's key count (at
bf16/fp16 with the kernel's rounding of P, the split stages being kept float32). A row that sees no
key of a split must hold output 0 and lse −inf exactly.

The combine (docs/tolerances.md, "The split-KV combine"): lse = ln Σ_s exp(lse_s) and
O = Σ_s exp(lse_s − lse)·O_s over the program's own split files, in float64, is the isolated
reference of flash_lse and flash_output; the allowance is the float32 arithmetic of any correct
combine (combine_bound) plus, at bf16/fp16, flash_output's rounding to the format. The chained
check (from Q, K, V) is flash_output's as in any run, plus what the float32 combine of correct
splits adds (combine_allowance: its lse_s are float32 values of magnitude |lse|, so each weight
exp(lse_s − lse) is off by about u·|lse|, which no unsplit forward has): a correct split program
passes both, a wrong split fails its own check and leaves the flash stages INHERITED, a wrong
combine fails the flash stages on their own.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from ..model.half import is_half, storage_bound
from ..model.rounding import FLUSH, HeadCache
from ..specs import HeadContext
from ..specs.splits import key_ranges, max_logits, restricted
from ..stages import (FLASH_LSE, FLASH_OUTPUT, INPUT_NAMES, SPLIT_LSE, SPLIT_OUTPUT, SPLIT_STAGES, STAGES,
                      split_columns)
from . import tolerance
from .diagnosis import Diagnosis, Suspect
from .half_rounding import route_error
from .reference import compute_stage
from .results import FAIL, HeadResult, compare_arrays, elementwise_error
from .split_values import stand_ins_read_as_empty, stored_in_half_format
from .stage_check import STATUS_CODES, load_output, read_quantum, with_quantum

# The diagnosis of a split a row sees no key of, mishandled (verify/diagnose/splits.py names it).
EMPTY_SPLIT = "empty_split"
# Each split stage is the flash stage restricted to the split's keys.
FLASH_OF = {SPLIT_OUTPUT: FLASH_OUTPUT, SPLIT_LSE: FLASH_LSE}
# What each flash stage is combined from.
COMBINED_FROM = {FLASH_OUTPUT: (SPLIT_OUTPUT, SPLIT_LSE), FLASH_LSE: (SPLIT_LSE,)}


def row_statistic(stage: str) -> bool:
    """Whether the stage is a log-sum-exp (one column per split, or one), not an output."""
    return STAGES[stage].cols in ("1", "S")


def splitting(ctx: HeadContext) -> bool:
    return ctx.dims.split_size > 0


# ---- one split's reference and bound ---------------------------------------------------------

def _flash_sources(ctx: HeadContext) -> Dict[str, np.ndarray]:
    src = {n: np.asarray(ctx.inputs[n], dtype=np.float64) for n in INPUT_NAMES}
    src.update(ctx.variant_tensors())
    return src


def restricted_reference(ctx: HeadContext, stage: str, first: int, end: int) -> np.ndarray:
    """The flash stage `stage` (flash_output or flash_lse) of the head over the keys [first, end)
    only: what a split covering those keys holds."""
    src = _flash_sources(ctx)
    n, m = src[INPUT_NAMES[0]].shape[0], src[INPUT_NAMES[1]].shape[0]
    src_s, variant = restricted(src, ctx.effective_variant, first, end, n, m)
    return compute_stage(stage, src_s, ctx.scale, ctx.causal, variant=variant, slope=ctx.slope)


def _bound(stage: str, src: Dict[str, np.ndarray], ref: np.ndarray, ctx: HeadContext, variant,
           cache: HeadCache) -> np.ndarray:
    """The flash stage's isolated bound under the restricted variant, kept float32 (at bf16/fp16
    the kernel's roundings of P, not the storage rounding of flash_output)."""
    kw = {**ctx.bound_args(), "variant": variant, "cache": cache}
    parts = tolerance.stage_bound_parts(stage, src, ref, **kw)
    extra = route_error(stage, src, ctx.scale, ctx.causal, ctx.precision, cache, ctx.half_rounding,
                        variant=variant, slope=ctx.slope) if is_half(ctx.precision) else 0.0
    return tolerance.BoundParts(parts.var, parts.det, parts.floor, extra).bound(ref)


@dataclass
class SplitReference:
    """One split of a head: its keys [first, end), the flash stages' references over them and their
    bounds, and the rows that see none of its keys."""
    first: int
    end: int
    refs: Dict[str, np.ndarray]
    bounds: Dict[str, np.ndarray]
    keyless: np.ndarray  # (N,) bool


def _split_reference(ctx: HeadContext, first: int, end: int) -> SplitReference:
    src = _flash_sources(ctx)
    n, m = src[INPUT_NAMES[0]].shape[0], src[INPUT_NAMES[1]].shape[0]
    if first >= end:  # past the last key: no row sees any
        refs = {FLASH_OUTPUT: np.zeros((n, ctx.dims.d_v)), FLASH_LSE: np.full((n, 1), -np.inf)}
        return SplitReference(first, end, refs, {k: np.zeros(v.shape) for k, v in refs.items()}, np.ones(n, bool))
    src_s, variant = restricted(src, ctx.effective_variant, first, end, n, m)
    cache = HeadCache()  # (one split's: dropped before the next, so a head holds one split's arrays)
    refs, bounds = {}, {}
    with np.errstate(all="ignore") if ctx.allow_nonfinite else np.errstate():
        for stage in (FLASH_OUTPUT, FLASH_LSE):
            refs[stage] = compute_stage(stage, src_s, ctx.scale, ctx.causal, variant=variant, slope=ctx.slope)
            bounds[stage] = _bound(stage, src_s, refs[stage], ctx, variant, cache)
    keyless = np.isneginf(refs[FLASH_LSE][:, 0])
    return SplitReference(first, end, refs, bounds, keyless)


def split_references(ctx: HeadContext) -> List[SplitReference]:
    """Every split of the head (computed once: both split stages and the combine read them)."""
    if "references" not in ctx.splits:
        d = ctx.dims
        ctx.splits["references"] = [_split_reference(ctx, first, end)
                                    for first, end in key_ranges(d.split_size, d.splits, d.seq_k)]
    return ctx.splits["references"]


def wide(stage: str, ctx: HeadContext) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The split stage's reference and bound as the head's matrix (splits side by side), and where
    an element belongs to a row that sees no key of its split."""
    parts = split_references(ctx)
    flash, cols = FLASH_OF[stage], split_columns(stage, ctx.dims)
    want = np.hstack([p.refs[flash] for p in parts])
    bound = np.hstack([p.bounds[flash] for p in parts])
    keyless = np.repeat(np.stack([p.keyless for p in parts], axis=1), cols, axis=1)
    return want, bound, keyless


def _shifted_back(got: np.ndarray, want: np.ndarray, ctx: HeadContext) -> np.ndarray:
    """split_lse under causal ALiBi as flash-attn's kernel writes it (every score of row i raised by
    slope·diag(i): verify/specs/flash.py's canonical), shifted back where that is nearer."""
    shift = ctx.head().flash_shift(got.shape[0], ctx.dims.seq_k)
    if shift is None:
        return got
    with np.errstate(invalid="ignore"):
        nearer = np.isfinite(got) & (np.abs(got - shift - want) < np.abs(got - want))
    return np.where(nearer, got - shift, got)


# ---- what the diagnoses see -----------------------------------------------------------------

@dataclass
class SplitSuspect:
    """What the split diagnoses (verify/diagnose/splits.py) see of a failing stage × head: which
    check failed (`split`: a split stage's own; `combine`: a flash stage against the combine of the
    program's splits), the head's splits (their keys, references and rows without keys), the
    program's split stages as (N, S, cols) arrays, the allowance, and `recompute(flash stage,
    first, end)`: the flash stage over another key range."""
    kind: str
    stage: str
    references: List[SplitReference]
    split_output: Optional[np.ndarray]  # (N, S, DV), the program's
    split_lse: Optional[np.ndarray]     # (N, S)
    allowed: np.ndarray
    recompute: Callable[[str, int, int], np.ndarray]
    keys: int
    split_size: int
    max_logits: Callable[[], np.ndarray]  # (N, S): each split's row maximum of the scores (specs.splits)


def _program_splits(ctx: HeadContext) -> Tuple[Optional[np.ndarray], Optional[np.ndarray]]:
    d = ctx.dims
    out = ctx.got.get(SPLIT_OUTPUT)
    lse = ctx.got.get(SPLIT_LSE)
    out = None if out is None else np.asarray(out, np.float64).reshape(out.shape[0], d.splits, d.d_v)
    lse = None if lse is None else np.asarray(lse, np.float64).reshape(lse.shape[0], d.splits)
    return out, lse


def suspect(kind: str, stage: str, ctx: HeadContext, allowed: np.ndarray) -> SplitSuspect:
    out, lse = _program_splits(ctx)
    return SplitSuspect(kind, stage, split_references(ctx), out, lse, allowed,
                        functools.partial(restricted_reference, ctx), ctx.dims.seq_k, ctx.dims.split_size,
                        functools.partial(split_max_logits, ctx))


def split_max_logits(ctx: HeadContext) -> np.ndarray:
    d = ctx.dims
    return max_logits(_flash_sources(ctx), ctx.effective_variant, ctx.scale, ctx.slope,
                      key_ranges(d.split_size, d.splits, d.seq_k))


# ---- a split stage's check -----------------------------------------------------------------------

def check_split_stage(res: HeadResult, run, ctx: HeadContext, opts, diagnoser) -> HeadResult:
    """Every split of one split stage × head against its own reference (into res, returned; the
    combine reads the matrix from ctx.got). run: the RunInfo, opts: the check's Options."""
    stage = res.stage
    mat, resolution, bad_status, msg = load_output(run, stage, res.head)
    override, allow_nonfinite = opts.override(stage), opts.allow_nonfinite
    res.split_cols = split_columns(stage, ctx.dims)
    if mat is None:
        res.status, res.message = bad_status, msg
        res.diagnosis.append(Diagnosis(STATUS_CODES[bad_status], msg, {}))
        return res
    res.resolution = resolution.describe()
    want, bound, keyless = wide(stage, ctx)
    mat = stand_ins_read_as_empty(mat, keyless, want) if row_statistic(stage) else mat
    ctx.got[stage] = mat
    stored = override is None and stored_in_half_format(mat, want, ctx.precision)
    quantum = None if override is not None else read_quantum(resolution, mat, ctx.precision, stored)
    ctx.quanta[stage] = quantum
    got = _shifted_back(mat, want, ctx) if row_statistic(stage) else mat
    if override is not None:
        atol, rtol = override
        bound = atol + rtol * np.where(np.isfinite(want), np.abs(want), 0.0)
    if stored:
        bound = bound + storage_bound(want, ctx.precision, ctx.half_rounding)
    allowed = np.where(keyless, 0.0, with_quantum(bound, quantum))  # a split no key of which the row sees: exact
    res.chained = res.isolated = compare_arrays(got, want, allowed, allow_nonfinite)
    if res.chained.passed:
        return res
    res.status = FAIL
    res.message = "a split differs from the attention over its own keys"
    if diagnoser is not None:
        res.diagnosis = diagnoser(stage, got, want, Suspect(ctx.dims, ctx.scale, ctx.causal, res.head, {},
                                                            None, None, allowed, ctx,
                                                            splits=suspect("split", stage, ctx, allowed)))
    return res


def ratio_map(got: np.ndarray, resolution, ctx: HeadContext, stage: str) -> np.ndarray:
    """|got − want| / allowed of a split stage × head, each split against its own reference (plots)."""
    want, bound, keyless = wide(stage, ctx)
    got = _shifted_back(got, want, ctx) if row_statistic(stage) else got
    allowed = np.where(keyless, 0.0, with_quantum(bound, resolution.quantum(got)))
    err = elementwise_error(got, want)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(err == 0, 0.0, err / allowed)
    return np.where(np.isnan(ratio), np.inf, ratio)


def failed_splits(stage: str, ctx: HeadContext, results: Dict[str, HeadResult]) -> List[str]:
    """The split stages a combined flash stage is computed from that failed (its upstream in a run
    that splits)."""
    if not combines(stage, ctx):
        return []
    return [s for s in COMBINED_FROM[stage] if s in results and not results[s].passed]


# ---- the combine ---------------------------------------------------------------------------------

def combines(stage: str, ctx: HeadContext) -> bool:
    """Whether `stage` is checked against the combine of the program's own splits: a flash stage of
    a run that splits, with the split stages it is combined from read."""
    return splitting(ctx) and stage in COMBINED_FROM and all(s in ctx.got for s in COMBINED_FROM[stage])


def combine(lse_s: np.ndarray, out_s: Optional[np.ndarray]) -> Tuple[np.ndarray, Optional[np.ndarray], np.ndarray]:
    """(lse, O, weights) of the float64 combine of splits: lse = ln Σ_s exp(lse_s), w_s =
    exp(lse_s − lse), O = Σ_s w_s·O_s; a split with lse −inf has weight 0 (whatever its output
    holds), a row whose every split is −inf has lse −inf and O 0."""
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        m = np.max(lse_s, axis=1, keepdims=True)
        empty = np.isneginf(m)
        m0 = np.where(empty | ~np.isfinite(m), 0.0, m)
        e = np.exp(lse_s - m0)
        lse = m0 + np.log(e.sum(axis=1, keepdims=True))
        lse = np.where(empty, -np.inf, np.where(np.isnan(m), np.nan, lse))
        w = np.where(np.isneginf(lse_s), 0.0, np.exp(lse_s - np.where(np.isfinite(lse), lse, 0.0)))
        w = np.where(np.isfinite(lse), w, np.where(np.isneginf(lse), 0.0, np.nan))
    if out_s is None:
        return lse, None, w
    terms = np.where((w > 0)[:, :, None], w[:, :, None] * out_s, np.where(np.isnan(w)[:, :, None], np.nan, 0.0))
    return lse, terms.sum(axis=1), w


# The float32 combine's error, per split: exp within a few ulps (4u; fast-math's __expf its
# documented slope more), the subtractions and the base-2 conversions a program may do.
_EXP_U = 4.0
_FAST_EXP_SLOPE = 2 * 1.173


def combine_bound(lse_s: np.ndarray, out_s: Optional[np.ndarray], math: str = "ieee",
                  u: float = 2.0**-24) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """Bounds on |float32 combine − float64 combine| of the same splits (lse, O): any correct
    float32 route (docs/tolerances.md): m = max_s lse_s, l = Σ_s exp(lse_s − m), lse = m + ln l,
    then O = Σ_s exp(lse_s − lse)·O_s or Σ_s exp(lse_s − m)·O_s / l, in any order, in base e or 2.
    Worst case over the S terms (S is small): each weight's relative error δ_s = exp's + the
    rounded exponent's + the error of lse; the sum's (S − 1)·u of Σ_s w_s·|O_s|."""
    lse, out, w = combine(lse_s, out_s)
    S = lse_s.shape[1]
    with np.errstate(invalid="ignore", over="ignore"):
        fin = np.isfinite(lse_s) & np.isfinite(lse)
        L = np.where(np.isfinite(lse), lse, 0.0)
        ls = np.where(fin, lse_s, 0.0)
        m = np.max(np.where(fin, lse_s, -np.inf), axis=1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        x = np.abs(ls - L)
        exp_err = _EXP_U * u + (_FAST_EXP_SLOPE * u * x if math == "fast" else 0.0)
        # per split: the exponent's roundings (lse_s − lse, lse_s − m, conversions to base 2)
        expo = u * (x + np.abs(ls - m)) + 2 * u * (np.abs(ls) + np.abs(L))
        p = np.where(fin, w, 0.0)
        dl = (p * (exp_err + expo)).sum(axis=1, keepdims=True) + (S - 1) * u   # Δl/l
        log_l = np.abs(L - m)
        d_lse = dl + 4 * u * log_l + 3 * u * np.abs(L)
        lse_bound = np.where(np.isfinite(lse), 2 * d_lse + 2 * FLUSH, 0.0)
        if out_s is None:
            return lse_bound, None
        delta = exp_err + expo + d_lse + dl + 2 * u  # the weight's relative error (either route)
        mag = np.where(fin[:, :, None], p[:, :, None] * np.abs(np.where(np.isfinite(out_s), out_s, 0.0)), 0.0)
        out_bound = 2 * ((delta[:, :, None] * mag).sum(axis=1) + (S - 1) * u * mag.sum(axis=1)) + 2 * FLUSH
        out_bound = np.where(np.isfinite(lse), out_bound, 0.0)
    return lse_bound, out_bound


def combine_allowance(stage: str, ctx: HeadContext):
    """What a run that splits the keys adds to the bound of a flash stage from Q, K, V (chained, and
    in the flash stages' agreement with the stage path): the float32 combine's error over the
    reference splits (combine_bound), and each split's lse bound carried through the combine
    (∂O/∂lse_s = w_s·(O_s − O); ∂lse/∂lse_s = w_s is the unsplit lse's own). 0 in a run that does
    not split, and for the other stages."""
    if not splitting(ctx) or stage not in COMBINED_FROM:
        return 0.0
    refs = split_references(ctx)
    lse_s = np.concatenate([r.refs[FLASH_LSE] for r in refs], axis=1)
    if row_statistic(stage):
        return combine_bound(lse_s, None, ctx.math)[0]
    out_s = np.stack([r.refs[FLASH_OUTPUT] for r in refs], axis=1)
    _, out, w = combine(lse_s, out_s)
    lse_bounds = np.concatenate([r.bounds[FLASH_LSE] for r in refs], axis=1)
    with np.errstate(invalid="ignore"):
        moved = np.where(w > 0, w * lse_bounds, 0.0)[:, :, None] * np.abs(out_s - out[:, None, :])
    moved = np.where(np.isfinite(moved), moved, 0.0).sum(axis=1)
    return combine_bound(lse_s, out_s, ctx.math)[1] + moved


def _propagated(lse_s, out_s, q_lse, q_out, stage: str):
    """How far the combine moves when the split files are known only to within their printed
    resolution: ∂lse/∂lse_s = w_s, ∂O/∂O_s = w_s, ∂O/∂lse_s = w_s·(O_s − O)."""
    lse, out, w = combine(lse_s, out_s)
    w = np.where(np.isfinite(w), w, 0.0)
    total = 0.0
    if row_statistic(stage):
        return (w * q_lse).sum(axis=1, keepdims=True) if q_lse is not None else 0.0
    if q_out is not None:
        total = total + (w[:, :, None] * q_out).sum(axis=1)
    if q_lse is not None:
        diff = np.abs(np.where(np.isfinite(out_s), out_s, 0.0) - np.where(np.isfinite(out), out, 0.0)[:, None, :])
        total = total + (w[:, :, None] * diff * q_lse[:, :, None]).sum(axis=1)
    return total


def combine_isolated(stage: str, ctx: HeadContext, override) -> Tuple[Dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """(the sources, the reference, the allowance) of a flash stage against the combine of the
    program's own split stages (before the file's own printed resolution)."""
    out_s, lse_s = _program_splits(ctx)
    q = {s: ctx.quanta.get(s) for s in SPLIT_STAGES}
    q_lse = None if q[SPLIT_LSE] is None else q[SPLIT_LSE].reshape(lse_s.shape)
    q_out = None if q[SPLIT_OUTPUT] is None or out_s is None else q[SPLIT_OUTPUT].reshape(out_s.shape)
    use_out = None if row_statistic(stage) else out_s
    lse, out, _ = combine(lse_s, use_out)
    want = lse if row_statistic(stage) else out
    if override is not None:
        atol, rtol = override
        allowed = atol + rtol * np.where(np.isfinite(want), np.abs(want), 0.0)
    else:
        lse_b, out_b = combine_bound(lse_s, use_out, ctx.math)
        allowed = lse_b if row_statistic(stage) else out_b
        allowed = allowed + _propagated(lse_s, use_out, q_lse, q_out, stage)
        if is_half(ctx.precision) and not STAGES[stage].float32:
            allowed = allowed + storage_bound(want, ctx.precision, ctx.half_rounding)
    src = {s: ctx.got[s] for s in COMBINED_FROM[stage]}
    return src, want, allowed


def compare_combine(res: HeadResult, mat: np.ndarray, quantum, ctx: HeadContext, override):
    """The isolated comparison of a combined flash stage (into res): against the combine of the
    program's own splits; returns (sources, reference, allowance) for the diagnoses."""
    src_iso, want_iso, allowed_iso = combine_isolated(stage=res.stage, ctx=ctx, override=override)
    allowed_iso = with_quantum(allowed_iso, quantum)
    res.isolated = compare_arrays(mat, want_iso, allowed_iso, nan_agrees=True)
    return src_iso, want_iso, allowed_iso


def diagnose_combine(res: HeadResult, got: np.ndarray, isolated, ctx: HeadContext, diagnoser) -> None:
    """A flash stage that disagrees with the combine of the program's own splits: the split
    diagnoses of the combine (a split not rescaled, an empty split counted), then its findings."""
    src_iso, want_iso, allowed_iso = isolated
    if diagnoser is not None:
        res.diagnosis = diagnoser(res.stage, got, want_iso, Suspect(
            ctx.dims, ctx.scale, ctx.causal, res.head, src_iso, None, None, allowed_iso, ctx,
            splits=suspect("combine", res.stage, ctx, allowed_iso)))
    for v in res.violations:
        if not any(d.code == v.code for d in res.diagnosis):
            res.diagnosis.append(Diagnosis(v.code, v.message, {"count": v.count}))


__all__ = ["check_split_stage", "combines", "combine", "combine_bound", "combine_isolated", "compare_combine",
           "diagnose_combine",
           "failed_splits", "row_statistic", "ratio_map",
           "split_references", "restricted_reference", "SplitSuspect"]
