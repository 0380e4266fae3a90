"""Bug diagnosis: hypotheses tested on a failing stage × head, each naming a pattern that explains it.

diagnose() is called with the float64 got and its isolated reference want. Each hypothesis builds
what a specific bug would have produced (want transposed, a reinterpreted cuBLAS operand, the
softmax of the wrong axis, another head's reference, a shifted mask, …) and fires when got matches
it while want does not; pattern hypotheses (unwritten regions, tile boundaries, non-finite values)
look at where got and want differ. No hypothesis fires on a correct or merely noisy result: a
candidate must explain got within a few tolerance widths AND differ from want by far more.

Codes (stable; the report's `diagnosis`; docs/contract.md says each in a user's words): nonfinite,
empty_rows_nan, unwritten, overflow, transposed, layout, scaled, softmax_axis, keys_past_end, keys_dropped,
tile_boundary, lse_log2; the softmax loops' mask_after_softmax, tile_keys_skipped,
online_rescale_missing, softmax_unnormalized, lse_sum_missing, lse_max_missing, running_max_zero
(verify/diagnose/softmax_loops.py) and key_tile_skipped (verify/diagnose/key_tiles.py); the heads'
head_permuted, kv_head_map, kv_group_not_summed, kv_group_summed_twice (verify/diagnose/heads.py); the masks' mask_missing,
mask_offset (any offset; the other alignment named), window_off, window_missing, mask_file_ignored,
mask_file_transposed, mask_file_inverted, causal_tile_skip (verify/diagnose/masks.py and
mask_candidates.py); the variants' softcap_missing, softcap_before_scale,
softcap_derivative_missing, alibi_missing, alibi_sign, alibi_alignment, alibi_slope_order, bias_ignored,
bias_transposed, dropout_unscaled, dropout_not_applied, dropout_mask_inverted
(verify/diagnose/variants.py); the backward's D_wrong_O, dS_missing_P, grad_unscaled,
dV_untransposed_P, lse_log2 and the flash gradients' softcap_derivative_missing, dq_key_tile_rows
(verify/diagnose/backward.py), grad_wrong_operand, dK_untransposed_dS, lse_wrong_head,
lse_sum_missing (a backward's), grad_first_tile_only and grad_scores_scaled
(verify/diagnose/backward_operands.py); the precision ones: tf32, half_storage, half_truncation,
half_accumulation (verify/diagnose/precision.py), scores_rounded, prescaled_rounded,
row_sum_rounded (verify/diagnose/score_rounding.py); and in a packed case, the
sequences' sequence_leak, sequence_boundary, padding_read (verify/diagnose/sequences.py: a
sequence's rows recomputed from the packed rows a buggy program read). overflow, keys_past_end and keys_dropped are in
verify/diagnose/inputs.py: they, the mask, the variants and the scale recompute a stage from the
case's Q, K, V where the program wrote no upstream stage (its spec's from_inputs). Every
recomputation runs under the case's variant (verify/variant.py). (`stale` comes from the integrity
check in verify.check.compare.)
"""
from __future__ import annotations

from dataclasses import replace
from typing import Dict, Iterable, List, Tuple

import numpy as np

from ..check.diagnosis import Diagnosis, Suspect, equivalent
from ..specs import SPECS
from ..stages import KEYS, STAGES
from ..text import indices, plural
from . import backward as backward_bugs
from . import backward_operands as operand_bugs
from . import heads as head_bugs, masks as mask_bugs
from . import precision as precision_bugs
from . import sequences as sequence_bugs
from . import sequence_keys
from . import splits as split_bugs, variants as variant_bugs
from . import softmax_loops as loop_bugs
from . import key_tiles as key_tile_bugs
from .scales import linear_factor, recomputed, scaled
from .softmax_axis import softmax_axis
from .base import (LOG2_E, MATCH_WIDTHS, MIN_READ_VALUES, POISON_VALUES, UNWRITTEN_DENSITY, explains,
                   loc, width_of)
from .inputs import keys as _keys
from .inputs import overflow as _overflow
from .regions import tile_boundary as _tile_boundary

__all__ = ["Diagnosis", "Suspect", "diagnose"]

# Rows that see no key computed as 0/0 (the code is the spec's: verify/specs/copies.py).
EMPTY_ROWS_NAN = "empty_rows_nan"


# ---------------------------------------------------------------------------------------------
# Hypotheses
# ---------------------------------------------------------------------------------------------

def _nonfinite(stage, got, want, ctx, width) -> List[Diagnosis]:
    bad = ~np.isfinite(got) & np.isfinite(want)
    if not bad.any():
        return []
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    n_nan, n_inf = int((np.isnan(got) & bad).sum()), int((np.isinf(got) & bad).sum())
    return [Diagnosis("nonfinite", f"{stage} has {n_nan} NaN and {n_inf} Inf where the reference is "
                      f"finite; first at {loc(first)} = {float(got[first])}",
                      {"nan": n_nan, "inf": n_inf, "count": int(bad.sum()), "first": list(first)}, 0.95)]


def _empty_rows_nan(stage, got, want, ctx, width) -> List[Diagnosis]:
    """NaN in exactly the query rows that see no key (under the head's mask, where the reference
    holds 0, or −inf in the lse): a softmax with no guard for a row whose every score is masked,
    where exp(s − max) is exp(−inf − (−inf)) and the row's sum 0."""
    head = ctx.head_ctx
    if STAGES[stage].rows != "N" or got.ndim != 2 or head is None:
        return []
    hidden = head.hidden(got.shape[0], np.asarray(head.own(KEYS)).shape[0]).all(axis=1)
    empty = hidden & ((want == 0) | np.isneginf(want)).all(axis=1)
    nan_rows = np.isnan(got).all(axis=1)
    wrong = (~np.isfinite(got) & ~(got == want)).any(axis=1)
    if not empty.any() or not (nan_rows == empty).all() or not (wrong <= empty).all():
        return []
    rows = np.flatnonzero(empty)
    which = (f"rows {rows[0]}..{rows[-1]}" if rows[-1] - rows[0] + 1 == len(rows) else
             f"{'row' if len(rows) == 1 else 'rows'} {indices(rows)}")
    held = "-inf" if np.isneginf(want[rows]).all() else "0"
    return [Diagnosis(EMPTY_ROWS_NAN, f"{stage}: the {plural(len(rows), 'row')} that see{'s' if len(rows) == 1 else ''} "
                      f"no key ({which}) hold NaN, the 0/0 of a softmax whose every score is masked; such a row "
                      f"holds {held} (guard the row maximum and the sum where every key is masked)", {"rows": len(rows)}, 0.96)]


def _unwritten(stage, got, want, ctx, width) -> List[Diagnosis]:
    """A rectangle of zeros / NaN / poison where want has other values."""
    err = np.where((got == want) | (np.isnan(got) & np.isnan(want)), 0.0, np.abs(got - want))
    wrong = ~(err <= MATCH_WIDTHS * width)
    blank = np.isnan(got) | (got == 0) | np.isin(got, POISON_VALUES)
    suspect = wrong & blank
    if not suspect.any():
        return []
    rows = np.flatnonzero(suspect.any(axis=1))
    cols = np.flatnonzero(suspect.any(axis=0))
    r0, r1, c0, c1 = int(rows[0]), int(rows[-1]), int(cols[0]), int(cols[-1])
    box = blank[r0:r1 + 1, c0:c1 + 1]
    if box.mean() < UNWRITTEN_DENSITY or suspect.sum() < 2:
        return []
    region = got[r0:r1 + 1, c0:c1 + 1]
    kinds = [k for k, m in (("NaN", np.isnan(region)), ("zeros", region == 0),
                            ("poison", np.isin(region, POISON_VALUES))) if m.any()]
    whole = "whole matrix holds" if (r1 - r0 + 1, c1 - c0 + 1) == got.shape else \
        f"rows {r0}..{r1}, cols {c0}..{c1} hold"
    # (zeros alone are also what a row that sees no key holds: a mask that hid every key)
    how = "never written, or computed as if no key were seen" if kinds == ["zeros"] else "never written"
    return [Diagnosis("unwritten", f"{stage}: {whole} {'/'.join(kinds)} where the reference "
                      f"holds other values: {how} ({plural(int(suspect.sum()), 'entry', 'entries')})",
                      {"rows": [r0, r1], "cols": [c0, c1], "values": kinds,
                       "count": int(suspect.sum())}, 0.9)]


def _transposed(stage, got, want, ctx, width) -> List[Diagnosis]:
    R, C = want.shape
    cands = []
    if R == C:
        cands.append(("got[i,j] ≈ want[j,i]", want.T))
    elif R > 1 and C > 1:
        cands.append(("got ≈ wantᵀ written into the same buffer (got.reshape(C, R) ≈ wantᵀ)",
                      want.T.reshape(R, C)))
    for how, cand in cands:
        diff = explains(got, cand, want, width)
        if diff is not None:
            return [Diagnosis("transposed", f"{stage} looks transposed: {how} (max diff {diff:.2g})",
                              {"max_diff": diff, "square": R == C}, 0.97)]
    return []


def _operand_variants(x: np.ndarray) -> Iterable[Tuple[str, np.ndarray]]:
    """How a row-major R×C buffer gets misread by a GEMM with the wrong layout or leading dimension:
    as column-major (x.reshape(C, R).T), or as holding xᵀ (x.T.reshape(R, C))."""
    R, C = x.shape
    if R == 1 or C == 1:
        return
    yield "read as column-major", x.reshape(C, R).T
    if R != C:
        yield "read as if it held its transpose", x.T.reshape(R, C)


def _layout(stage, got, want, ctx, width) -> List[Diagnosis]:
    """Row-/column-major or leading-dimension reinterpretations of the result or of an operand."""
    R, C = want.shape
    found: List[Tuple[str, float]] = []
    if R > 1 and C > 1:
        for how, cand in (("the result was written column-major (got = wantᵀ in row-major order)",
                           want.T.reshape(R, C)),
                          ("the result was read back column-major (got = want.reshape(C, R)ᵀ)",
                           want.reshape(C, R).T)):
            diff = explains(got, cand, want, width)
            if diff is not None:
                found.append((how, diff))
    src: Dict[str, np.ndarray] = ctx.src
    scale = ctx.scale
    if not found and src and SPECS[stage].isolated is not None:  # not an exact copy
        for name, x in src.items():
            if name not in STAGES[stage].inputs:
                continue
            for how, x2 in _operand_variants(np.asarray(x, dtype=np.float64)):
                try:
                    cand = recomputed(stage, {**src, name: x2}, scale, ctx)
                except ValueError:
                    continue
                diff = explains(got, cand, want, width)
                if diff is not None:
                    found.append((f"operand {name} was {how} (wrong layout / leading dimension)", diff))
    if not found:
        return []
    how, diff = min(found, key=lambda f: f[1])
    return [Diagnosis("layout", f"{stage}: row/column-major mix-up: {how} (max diff {diff:.2g})",
                      {"how": how, "max_diff": diff}, 0.93)]


def _lse_log2(stage, got, want, ctx, width) -> List[Diagnosis]:
    """flash_lse in base 2: got ≈ want·log2(e), the log-sum-exp of a kernel that works with exp2 and
    log2 internally and does not convert back to the natural log (the flash gradients' P
    recomputed from an lse in the wrong base: verify/diagnose/backward.py's grad_lse_log2)."""
    # The base-2 result carries the natural one's rounding times log2(e).
    diff = explains(got, want * LOG2_E, want, width * LOG2_E)
    if diff is None:
        return []
    return [Diagnosis("lse_log2", f"{stage} is in base 2: got ≈ want·log2(e) = want·{LOG2_E:.6g} "
                      f"(max diff {diff:.2g}); convert with ·ln(2) or use log instead of log2",
                      {"factor": LOG2_E, "max_diff": diff}, 0.93)]


# The backward's bugs (verify/diagnose/backward.py, backward_operands.py), and the codes only they give.
_BACKWARD_HYPOTHESES = {**backward_bugs.HYPOTHESES, **operand_bugs.HYPOTHESES}
_BACKWARD_CODES = backward_bugs.CODES + operand_bugs.CODES

# Bugs that leave whole rows or columns empty or renormalized, explaining every element.
_EMPTIES_LINES = {"softmax_axis", EMPTY_ROWS_NAN, loop_bugs.RUNNING_MAX_ZERO, *mask_bugs.CODES}

# Each stage's spec (verify/specs/) names the hypotheses that apply to it. "head_permuted" is every
# head mix-up (verify/diagnose/heads.py: a GQA query head reading another K/V head, a K/V group
# not summed), "mask" every wrong mask (verify/diagnose/masks.py).
_HYPOTHESES = {"nonfinite": _nonfinite, EMPTY_ROWS_NAN: _empty_rows_nan, "unwritten": _unwritten,
               "transposed": _transposed, "layout": _layout,
               "scaled": scaled, "softmax_axis": softmax_axis, "head_permuted": head_bugs.heads, "mask": mask_bugs.mask,
               "tile_boundary": _tile_boundary, "lse_log2": _lse_log2, "keys": _keys, "overflow": _overflow,
               **loop_bugs.HYPOTHESES, **key_tile_bugs.HYPOTHESES, **_BACKWARD_HYPOTHESES}
# The hypotheses that try many readings (every operand's layouts, every other head, every mask
# offset): one of them fits a stage of one value by chance (a decode step's lse, one a head).
_SEARCHES = ("layout", "head_permuted", "mask")
# The variants' bugs (verify/diagnose/variants.py: softcap, ALiBi, bias, dropout) reach the stages
# a wrong scale or mask reaches: they are tried where the spec names either.
_VARIANT_BUGS_WHERE = ("scaled", "mask")
# The backward's named bugs explain a factor, a layout and where the errors are; so does dropout's
# missing rescale (a factor 1 − p) and the variants' bugs (where the errors are).
_EXPLAINED_BY_BACKWARD_BUGS = ("scaled", "layout", "tile_boundary")
_EXPLAINED_BY_VARIANT_BUGS = ("scaled", "tile_boundary", "unwritten")
# A sequence that read other rows of the packed stream has wrong values everywhere, which a factor,
# a tile pattern or a few keys read past the end only approximate.
_EXPLAINED_BY_SEQUENCE_BUGS = sequence_bugs.APPROXIMATIONS
# The key loops' searches over tile widths (tried last), and what they name.
_LOOP_SEARCHES = loop_bugs.SEARCHES + key_tile_bugs.SEARCHES
_LOOP_CODES = set(loop_bugs.CODES) | set(key_tile_bugs.CODES)
# Findings that name where a stage is wrong, not why: the key loops' searches still run.
_NO_CAUSE_NAMED = ("nonfinite", "unwritten", "tile_boundary")
# How much less confident a reading listed after an equivalent one is.
_AFTER = 0.01
# A K/V group summed twice is a factor 2: the cause, not a scale.
_FACTORS = {"kv_group_summed_twice"}
# The named causes that explain every element, NaN and Inf included (a moved −inf of the mask or
# the bias): the nonfinite count comes after them.
_CAUSES = (_EMPTIES_LINES | {"unwritten", "overflow"} | set(variant_bugs.CODES) | set(head_bugs.CODES)
           | set(sequence_bugs.CODES))


def diagnose(stage: str, got: np.ndarray, want: np.ndarray, ctx: Suspect) -> List[Diagnosis]:
    """Every pattern that explains a failing stage × head, most confident first."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        return []
    width = width_of(ctx.bound, want)
    if ctx.splits is not None:  # a split-KV run's split or combine: split_overlap, split_gap, empty_split, ...
        return (split_bugs.diagnose(stage, got, want, ctx.splits, width)
                or loop_bugs.online_rescale_in_splits(stage, got, want, ctx, width)
                or (_lse_log2(stage, got, want, ctx, width) if "lse_log2" in SPECS[stage].diagnoses else [])
                or _nonfinite(stage, got, want, ctx, width))
    if ctx.slab is not None:
        return _patterns_and_slab(stage, got, want, ctx, width)
    found: List[Diagnosis] = []
    fired = set()
    few = got.size < MIN_READ_VALUES
    for name, hyp in _HYPOTHESES.items():
        if name in SPECS[stage].diagnoses and name not in _LOOP_SEARCHES and not (few and name in _SEARCHES):
            with np.errstate(all="ignore"):
                new = hyp(stage, got, want, ctx, width)
            found.extend(new)
            fired.update([name] if new else [])
    if any(name in SPECS[stage].diagnoses for name in _VARIANT_BUGS_WHERE):
        with np.errstate(all="ignore"):
            variant_found = variant_bugs.variants(stage, got, want, ctx, width)
        if variant_found:
            found = [d for d in found if d.code not in _EXPLAINED_BY_VARIANT_BUGS] + variant_found
    # A cause found before (a wrong scale, the softmax's axis, a wrong mask — aligned at the other
    # corner it reads as the sequence's keys ending M − N early —, a head's or a variant's bug)
    # is named alone: the sequence readings (each a recomputation) are not tried. A causal mask a
    # few keys off is named first, and the sequence's readings that give the same rows after it.
    if sequence_bugs.applies(stage, ctx) and not sequence_bugs.caused_elsewhere(found):
        with np.errstate(all="ignore"):
            sequence_found = sequence_keys.diagnose(stage, got, want, ctx, width)
        shifts = [d.confidence for d in found if equivalent(d)]
        for d in sequence_found if shifts else ():
            d.confidence = min(d.confidence, min(shifts) - _AFTER)
        if sequence_found:
            found = [d for d in found if d.code not in _EXPLAINED_BY_SEQUENCE_BUGS] + sequence_found
    # The key loops' bugs are a search over every tile width: tried where nothing else named a
    # cause (a mask one key short, or the keys past the last tile left out, also fits a width
    # whose skipped keys carry little weight).
    if all(d.code in _NO_CAUSE_NAMED for d in found):
        for name in (n for n in _LOOP_SEARCHES if n in SPECS[stage].diagnoses):
            with np.errstate(all="ignore"):
                new = _HYPOTHESES[name](stage, got, want, ctx, width)
            found.extend(new)
            fired.update([name] if new else [])
    found = precision_bugs.settle(found + precision_bugs.diagnose(stage, got, want, ctx, found))
    return _settled(found, fired, _rounding(want))


# What is found on a whole stage without recomputing it: where it is wrong, and a result written in
# another layout (without its operands': ctx.src left out).
_PATTERNS = ("nonfinite", "unwritten", "transposed", "layout", "tile_boundary", "lse_log2")
# What a slab of rows cannot place: the whole stage's patterns say where it is wrong.
_PLACES = ("nonfinite", "unwritten", "tile_boundary", "transposed")


def _patterns_and_slab(stage, got, want, ctx: Suspect, width) -> List[Diagnosis]:
    """A head too long to recompute whole (verify/check/slab.py): the patterns of the whole stage,
    and the causes found on a slab of its rows."""
    found: List[Diagnosis] = []
    bare = replace(ctx, src={}, slab=None)
    for name in _PATTERNS:
        if name in SPECS[stage].diagnoses:
            with np.errstate(all="ignore"):
                found.extend(_HYPOTHESES[name](stage, got, want, bare, width))
    if SPECS[stage].linear:  # a factor needs no recomputation (dK and dV have no slab: this is theirs)
        found.extend(linear_factor(stage, got, want, bare, width))
    codes = {d.code for d in found}
    causes = [d for d in ctx.slab() if d.code not in codes and d.code not in _PLACES]
    # (the slab's own settling knew which hypotheses fired: here its codes stand for them)
    fired = set(_BACKWARD_HYPOTHESES) if {d.code for d in causes} & set(_BACKWARD_CODES) else set()
    return _settled(found + causes, fired, _rounding(want))


def _without(found: List[Diagnosis], codes) -> List[Diagnosis]:
    return [d for d in found if d.code not in codes]


# A candidate that reproduces got this many times less closely than another is not its explanation
# (where a stage's bound is wide somewhere, from sources that disagree, several fit loosely).
_LOOSER = 100.0


def _max_diff(d: Diagnosis):
    """How closely a candidate reproduces got (None where the finding is no candidate)."""
    diff = d.detail.get("max_diff")
    return diff if isinstance(diff, float) else None


def _rounding(want: np.ndarray) -> float:
    """One float32 rounding of the reference's largest finite entry: about how closely a candidate
    can reproduce got (got's own largest may be a stand-in for −inf, -1e9)."""
    finite = np.abs(want[np.isfinite(want)])
    return float(finite.max(initial=0.0)) * 2.0**-24


def _closest(found: List[Diagnosis], rounding: float) -> List[Diagnosis]:
    """The findings without the candidates that reproduce got _LOOSER times less closely than the
    closest one (those with a max_diff; the others stay), the closest taken as no closer than
    `rounding` (_rounding: the reference's): an exact match (max diff 0) drops no candidate that
    differs from it by a rounding."""
    diffs = [_max_diff(d) for d in found if _max_diff(d) is not None]
    if not diffs:
        return found
    best = max(min(diffs), rounding)
    return [d for d in found if _max_diff(d) is None or _max_diff(d) <= _LOOSER * best]


def _settled(found: List[Diagnosis], fired, rounding: float) -> List[Diagnosis]:
    """The findings without those another one explains, most confident first."""
    found = _closest(found, rounding)
    codes = {d.code for d in found}
    if codes & (_EMPTIES_LINES | {"overflow"}):
        # A wrong axis or mask leaves rows or columns with no visible key (0/0: NaN, or 0 where
        # guarded), and NaN written by an overflowing exp follows the large logits: those lines
        # are the cause's consequence, not a region never written nor a tile's.
        found = _without(found, ("unwritten", "tile_boundary"))
    if "transposed" in codes or codes & set(head_bugs.CODES):
        # (a head's result read transposed, or another head's: wrong everywhere, on tiles by chance)
        found = _without(found, ("tile_boundary",))
    if codes & _LOOP_CODES:
        # A key of every tile left out, a tile skipped or a tile's rescale forgotten is wrong tile by tile.
        found = _without(found, ("tile_boundary",))
    if fired & set(_BACKWARD_HYPOTHESES):
        found = _without(found, _EXPLAINED_BY_BACKWARD_BUGS)
    if codes & _FACTORS:
        found = _without(found, ("scaled",))
    codes = {d.code for d in found}
    if "nonfinite" in codes and codes & _CAUSES:
        # NaN in an unwritten region or an empty line: the cause explains it better than the count.
        for d in found:
            if d.code == "nonfinite":
                d.confidence = 0.85
    found.sort(key=lambda d: -d.confidence)
    # Equally confident candidates: the closest reproduction of got first, in the places they hold.
    for confidence in {d.confidence for d in found}:
        places = [i for i, d in enumerate(found) if d.confidence == confidence and _max_diff(d) is not None]
        for i, d in zip(places, sorted((found[i] for i in places), key=_max_diff)):
            found[i] = d
    return found
