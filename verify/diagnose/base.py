"""The vocabulary of bug diagnosis: how a candidate explanation is matched against a failing result
(within a few tolerance widths of got, far from the reference). A Diagnosis and the Suspect it is
found on are the check engine's (verify/check/diagnosis.py)."""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np


# A candidate explains got when every element is within MATCH_WIDTHS tolerance widths of it (the
# candidate is float64, got carries its own rounding), and it is a real alternative when it
# differs from want by more than DISTINCT_WIDTHS widths somewhere.
MATCH_WIDTHS = 8.0
DISTINCT_WIDTHS = 100.0
# A candidate that reproduces got this many times more closely than want does, element by element
# at worst, is evidence for it (explains_closely): a correct result lies as close to any other
# candidate as to want. Half of DISTINCT_WIDTHS: a half-precision gradient's own rounding is about
# a hundredth of a bug a few of its widths wide.
CLOSER = 50.0
# Values a poisoned or uninitialised buffer shows (besides NaN and 0): float32 max and its kin.
POISON_VALUES = (3.4028234663852886e38, -3.4028234663852886e38, 1e30, -1e30)
UNWRITTEN_DENSITY = 0.9      # fraction of the region's entries that must be zero/NaN/poison
TILE_DENSITY = 0.5           # fraction of a wrong tile's entries that must be wrong
MAX_HEADS_SEARCHED = 64
# Beyond the heads next to it, the first and the last: another head's operand an offset this far
# off reads (each candidate a head's whole forward recomputed: a few, not every head).
MAX_HEAD_OFFSET = 4
MAX_MASK_OFFSET = 8
# Tile sizes tried besides the run's own (run.toml's flash_block_q/k): the widths kernels tile and
# vectorize by; a period of 2 is what any alternating error pattern shows by chance.
TILE_PERIODS = (4, 8, 16, 32, 64, 128, 256)
SCALE_NAME_RTOL = 2e-3
# The key tile widths kernels use: a kernel that drops the keys past its last full tile, or reads
# past the end to fill it, does so for one of these.
KEY_TILES = (16, 32, 64, 128)
MIN_KEY_TILE = 8  # the narrowest key tile a dropped tail is also named for
# A stage of fewer values than this (a decode step's lse: one per head) fits some candidate of a
# search over hundreds of readings (every tile width) by chance.
MIN_SEARCHED_VALUES = 8
# The same for a search over a few dozen readings (every operand's layouts, every other head, every
# mask offset, a sequence's boundaries): one value fits some reading by chance; two that no reading
# made do not.
MIN_READ_VALUES = 2
# The widest key tile of the run's own (run.toml's flash_block_k) that the diagnoses try: kernels
# tile keys by at most a few hundred, and a wider one would extend the keys by up to its width.
MAX_RUN_KEY_TILE = 1024
# exp overflows float32 past log(FLT_MAX); a row's sum of exps past the same. The slack covers
# exp2-based and fast-math exponentials, whose overflow points differ by far less.
LOG_FLOAT32_MAX = float(np.log(np.finfo(np.float32).max))
OVERFLOW_SLACK = 0.5
# Fitting a mask's offset row by row recomputes one sampled row under every visible-key count:
# MASK_FIT_ROWS rows, each a MAX_MASK_FIT_KEYS² problem at most.
MASK_FIT_ROWS = 4
MAX_MASK_FIT_KEYS = 1024
# A K/V head's summed dK or dV is recomputed under each of a few dozen masks as its group's whole
# backward from the inputs: searched where N·M·(its query heads) is at most this (the query heads'
# own stages, checked first, name a wrong mask at any size).
MAX_GROUP_MASK_VALUES = 2**16
LOG2_E = 1.0 / np.log(2.0)
# A candidate arithmetic (a precision's) explains got "far better" when it leaves at most this
# fraction of the error the float32 reference leaves; its diagnoses' confidence.
FAR_BETTER = 0.25
PRECISION_CONFIDENCE = 0.8


# ---------------------------------------------------------------------------------------------
# Matching helpers
# ---------------------------------------------------------------------------------------------

def width_of(bound: Optional[np.ndarray], want: np.ndarray) -> float:
    """One tolerance width: the largest finite bound (a scalar keeps reshaped candidates simple)."""
    if bound is not None:
        b = np.asarray(bound, dtype=np.float64)
        b = b[np.isfinite(b)]
        if b.size and b.max() > 0:
            return float(b.max())
    w = np.abs(want[np.isfinite(want)])
    return float(max(w.max() if w.size else 1.0, 1e-30) * 2.0**-20)


def maxdiff(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b|, with equal infinities equal and any other non-finite mismatch infinite."""
    if a.shape != b.shape:
        return np.inf
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    fin = np.isfinite(a) & np.isfinite(b)
    if (~same & ~fin).any():
        return np.inf
    with np.errstate(invalid="ignore"):  # (inf − inf where both are the same infinity: taken as 0)
        d = np.abs(np.where(same, 0.0, a - b))
    return float(d.max()) if d.size else 0.0


def differs(got: np.ndarray, cand: np.ndarray, want: np.ndarray, limit: float, nan_evidence: bool = False) -> bool:
    """Whether cand differs from want by more than `limit` where it counts as evidence: where got
    is not NaN, unless the hypothesis itself puts NaN there (nan_evidence: a row's 0/0 it names).
    Anything computed from a NaN is NaN, so a candidate built from the program's own files, NaN
    where they are, matches a NaN of got whatever bug it stands for."""
    if not nan_evidence:
        seen = ~np.isnan(got)
        if not seen.all():
            cand, want = cand[seen], want[seen]
    return maxdiff(cand, want) > limit


def match_width(cand: np.ndarray, want: np.ndarray, width: float) -> float:
    """How far got may lie from a candidate that explains it: MATCH_WIDTHS of the stage's widths,
    times how much larger the candidate's values are than the reference's. A program's rounding
    grows with the values it computes, and a bug that inflates them (dS without P: gradients a
    hundred times too large, each rounded to bf16) rounds them by as much more than a correct run's
    bound allows."""
    top = float(np.max(np.abs(want[np.isfinite(want)]), initial=0.0))
    big = float(np.max(np.abs(cand[np.isfinite(cand)]), initial=0.0))
    return MATCH_WIDTHS * width * (max(1.0, big / top) if top > 0 else 1.0)


def explains(got: np.ndarray, cand: np.ndarray, want: np.ndarray, width: float,
             nan_evidence: bool = False) -> Optional[float]:
    """max|got - cand| when cand explains got and is a real alternative to want, else None
    (nan_evidence: differs())."""
    if cand.shape != got.shape:
        return None
    diff = maxdiff(got, cand)
    if not diff <= match_width(cand, want, width):
        return None
    if not differs(got, cand, want, DISTINCT_WIDTHS * width, nan_evidence):
        return None
    return diff


def explains_closely(got: np.ndarray, cand: np.ndarray, want: np.ndarray, width: float,
                     nan_evidence: bool = False) -> Optional[float]:
    """explains(), where a candidate that reproduces got far more closely than a width is a real
    alternative when it differs from want by CLOSER times that closeness: a bound much wider than
    the program's own error (a gradient's through a softcap, a half-precision pipeline's) otherwise
    hides a bug whose effect is a few hundred widths or less. A candidate that got lies CLOSER
    times closer to than to want is evidence for it whatever it was built from (the program's own
    files, where its distance to got is the program's rounding, or the reference chain, where it is
    that rounding and the chain's own error)."""
    diff = maxdiff(got, cand)  # (inf for another shape)
    if not diff <= match_width(cand, want, width):
        return None
    close = max(diff, float(np.max(np.abs(want[np.isfinite(want)]), initial=0.0)) * 2.0**-20)
    # (the limit is at most DISTINCT_WIDTHS·width: every candidate explains() takes is taken)
    return diff if differs(got, cand, want, min(DISTINCT_WIDTHS * width, CLOSER * close), nan_evidence) else None


# best_within_bound: got may lie this many of its bounds from a candidate the program computed at
# its own precision (the candidate's reading sums other terms than the reference's, with roundings
# of their own), and the candidate must lie SEPARATED_BOUNDS of them from the reference at
# MIN_SEPARATED elements or more: a result within its bound of the reference is then at least
# SEPARATED_BOUNDS − BOUND_SLACK bounds from the candidate there, never within BOUND_SLACK of it.
# Another candidate that fits within AMBIGUOUS of the best's fit is one the values cannot tell from it.
BOUND_SLACK = 2.0
SEPARATED_BOUNDS = 4.0
MIN_SEPARATED = 4
AMBIGUOUS = 1.5


def _bound_fit(got: np.ndarray, cand: np.ndarray, want: np.ndarray, b: np.ndarray) -> Tuple[float, int, float]:
    """(max |got − cand| in bounds, elements where cand lies SEPARATED_BOUNDS from want, max
    |got − cand|); an infinite fit where a non-finite value or an exact entry (bound 0) differs."""
    fin = np.isfinite(got) & np.isfinite(cand) & np.isfinite(want) & np.isfinite(b)
    if maxdiff(got[~fin & np.isfinite(b)], cand[~fin & np.isfinite(b)]) > 0:
        return np.inf, 0, np.inf
    d, bf = np.abs(got[fin] - cand[fin]), b[fin]
    if np.any(d[bf == 0] > 0):
        return np.inf, 0, np.inf
    with np.errstate(divide="ignore", invalid="ignore"):
        fit = float(np.max(np.where(bf > 0, d / bf, 0.0), initial=0.0))
    separated = int(np.count_nonzero(np.abs(cand[fin] - want[fin]) > SEPARATED_BOUNDS * bf))
    return fit, separated, float(d.max(initial=0.0))


def best_within_bound(got: np.ndarray, want: np.ndarray, bound: Optional[np.ndarray],
                      tried: Sequence[Tuple[object, Optional[np.ndarray]]]) -> Optional[Tuple[object, float]]:
    """(its key, max|got − cand|) of the candidate got lies closest to in its bounds (per element:
    the stage's allowance), where got lies within BOUND_SLACK of them everywhere, the candidate lies
    SEPARATED_BOUNDS of them from want at MIN_SEPARATED elements or more, and no other candidate
    fits within AMBIGUOUS of it; else None. The program computed that reading as precisely as the
    check asks of the reference, and the elements it moves tell it from the reference. For a stage
    whose bound is wide beside the bug's effect (a half-precision pipeline's output, a bug that
    moves it by ten bounds), where explains() asks for a difference of many widths; the best fit,
    not the first, since over a few bounds a neighbouring reading may fit too."""
    if bound is None or np.shape(bound) != got.shape:
        return None
    b = np.asarray(bound, dtype=np.float64)
    fits = sorted(((_bound_fit(got, cand, want, b), key) for key, cand in tried
                   if cand is not None and cand.shape == got.shape), key=lambda fk: fk[0][0])
    if not fits or fits[0][0][0] > BOUND_SLACK:
        return None
    (fit, separated, diff), key = fits[0]
    # (the runner-up counts whether or not it is within BOUND_SLACK itself: 1.9 and 2.05 bounds are alike)
    if separated < MIN_SEPARATED or (len(fits) > 1 and fits[1][0][0] <= AMBIGUOUS * max(fit, 1e-3)):
        return None
    return key, diff


def gap(got: np.ndarray, cand: np.ndarray, beyond=0.0) -> float:
    """max |got − cand| beyond `beyond` (a conversion's half unit: how far a correct value may lie)."""
    d = np.maximum(np.abs(got - cand) - beyond, 0.0)
    d = d[np.isfinite(d)]
    return float(d.max()) if d.size else np.inf


def loc(idx) -> str:
    return "[" + ", ".join(str(int(i)) for i in idx) + "]"
