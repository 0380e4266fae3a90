"""The bugs of a run that splits the keys (flash-decoding), each named only when recomputing what
the bug would have written explains the program's values and the correct result does not:

* split_overlap, split_gap: a split covering keys of its neighbour, or missing keys at its boundary:
  the failing split's check passes when re-run on boundaries shifted by up to MAX_SHIFT keys
  (overlap when the range it covered reaches past its own, gap when it leaves some of its own out;
  a range shifted both ways is both). Found on split_output and split_lse.
* softmax_unnormalized (of a split): split_output not divided by the split's own row sum l_s =
  Σ exp(s − m_s) over its keys (m_s its own largest score), its lse right.
* empty_split: a split a row sees no key of, mishandled: in the split stages, anything but output
  0 and lse −inf there (NaN, lse 0 or finite); in the combine, such a split counted (its lse taken
  as 0, or as weight one), or a row whose every split is empty combined to NaN.
* split_not_rescaled: flash_output combined without each split's weight exp(lse_s − lse) (the
  outputs summed, or one split's added as it is), or with weights that do not sum to one
  (exp(lse_s − max) not divided by their sum, exp(lse_s) as they are), or with each split's own
  row sum l_s = exp(lse_s − m_s), m_s the split's own maximum, over their total: the sums never
  brought to a common maximum by exp(m_s − max) (vLLM's exp_sums without its max_logits).
* split_exp2: the combine's exponentials in base 2 of the natural-log lse (exp2 without the
  log2(e) factor a base-2 kernel multiplies its exponents by): weights 2^(lse_s − max) over their
  sum, lse = max + ln or log2 of that sum.
* split_left_out: the combine leaves splits out (the run's last split, the last split a row sees
  keys of, or every split but the first): a loop bound off by one. Found on flash_output and
  flash_lse.

The combine's candidates are computed from the program's own split files, as the combine check's
reference is (verify/check/splits.py), so they name a bug of the combine, not of the splits.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np

from ..check.diagnosis import LSE_SUM_MISSING, SOFTMAX_UNNORMALIZED, Diagnosis
from ..check.splits import EMPTY_SPLIT, FLASH_OF, SplitSuspect, combine, row_statistic
from ..specs import SPECS
from ..stages import FLASH_LSE
from .base import MATCH_WIDTHS, best_within_bound, explains, explains_closely

SPLIT_OVERLAP, SPLIT_GAP, SPLIT_NOT_RESCALED = "split_overlap", "split_gap", "split_not_rescaled"
SPLIT_EXP2, SPLIT_LEFT_OUT = "split_exp2", "split_left_out"
CODES = (SPLIT_NOT_RESCALED, SPLIT_EXP2, SPLIT_LEFT_OUT, EMPTY_SPLIT, SPLIT_OVERLAP, SPLIT_GAP)
MAX_SHIFT = 3  # keys a split boundary is searched off by, either way


def diagnose(stage: str, got: np.ndarray, want: np.ndarray, view: SplitSuspect, width: float) -> List[Diagnosis]:
    """The split bugs that explain a failing split stage or combine."""
    with np.errstate(all="ignore"):
        if view.kind == "split":
            return (_empty_in_split(stage, got, want, view) + _boundaries(stage, got, want, view, width)
                    or _unnormalized(stage, got, want, view, width))
        return _combine(stage, got, want, view, width)


# ---- a split stage ----------------------------------------------------------------------------

def split_cols(stage: str, view: SplitSuspect, got: np.ndarray) -> int:
    """The columns of one split in a split stage's matrix."""
    return got.shape[1] // max(1, len(view.references))


def _empty_in_split(stage: str, got: np.ndarray, want: np.ndarray, view: SplitSuspect) -> List[Diagnosis]:
    """Rows that see no key of a split holding anything but 0 (output) or −inf (lse) there, while
    every entry of a row that sees keys is right (else the keys a row sees are wrong, a mask bug,
    which makes rows without keys hold values too)."""
    cols = split_cols(stage, view, got)
    keyless = np.repeat(np.stack([r.keyless for r in view.references], axis=1), cols, axis=1)
    with np.errstate(invalid="ignore"):
        bad = keyless & ~(got == SPECS[stage].keyless)
        if not bad.any():
            return []
        wrong = ~keyless & ~((np.abs(got - want) <= view.allowed) | (got == want))
    if wrong.any():
        return []
    row, col = (int(i) for i in np.argwhere(bad)[0])
    split = col // cols
    value = float(got[row, col])
    n_nan = int(np.isnan(got[bad]).sum())
    rows = int(bad.any(axis=1).sum())
    what = "NaN" if np.isnan(value) else f"{value:.6g}"
    rule = "lse −inf" if row_statistic(stage) else "output 0"
    return [Diagnosis(EMPTY_SPLIT, f"{stage}: split {split} holds {what} in row {row}, which sees no key of it (want "
                      f"{rule} exactly); {int(bad.sum())} such entries in {rows} rows ({n_nan} NaN): an empty split "
                      "mishandled", {"split": split, "row": row, "value": value, "count": int(bad.sum()),
                                     "nan": n_nan}, 0.95)]


def _unnormalized(stage: str, got: np.ndarray, want: np.ndarray, view: SplitSuspect, width: float) -> List[Diagnosis]:
    """split_output as each split's sum Σ exp(s − m_s)·v before the division by l_s: the reference
    of each split times l_s = exp(lse_s − m_s), rows without a key of the split 0."""
    if row_statistic(stage) or not view.references:
        return []
    cols, top = split_cols(stage, view, got), view.max_logits()
    cand = want.copy()
    for s, ref in enumerate(view.references):
        lse = ref.refs[FLASH_LSE][:, 0]
        l_s = np.where(np.isfinite(top[:, s]) & np.isfinite(lse), np.exp(lse - np.where(np.isfinite(top[:, s]),
                                                                                        top[:, s], 0.0)), 0.0)
        cand[:, s * cols:(s + 1) * cols] *= l_s[:, None]
    diff = explains_closely(got, cand, want, width)
    if diff is None:
        return []
    return [Diagnosis(SOFTMAX_UNNORMALIZED, f"{stage}: each split's output is not divided by its own row sum "
                      f"l_s = sum of exp(s − m_s) over its keys, m_s its largest score (max diff {diff:.2g})",
                      {"max_diff": diff}, 0.93)]


def _failing_splits(got: np.ndarray, want: np.ndarray, view: SplitSuspect, cols: int) -> List[int]:
    with np.errstate(invalid="ignore"):
        err = np.where((got == want) | (np.isnan(got) & np.isnan(want)), 0.0, np.abs(got - want))
    bad = ~(err <= view.allowed)
    per_split = bad.reshape(bad.shape[0], -1, cols).any(axis=(0, 2))
    return [int(s) for s in np.flatnonzero(per_split) if not view.references[s].keyless.all()]


def _shifts() -> List[Tuple[int, int]]:
    pairs = [(a, b) for a in range(-MAX_SHIFT, MAX_SHIFT + 1) for b in range(-MAX_SHIFT, MAX_SHIFT + 1) if (a, b) != (0, 0)]
    return sorted(pairs, key=lambda p: (abs(p[0]) + abs(p[1]), p))  # the nearest first


def _boundaries(stage: str, got: np.ndarray, want: np.ndarray, view: SplitSuspect, width: float) -> List[Diagnosis]:
    """A failing split's boundaries off by a few keys: its check passes over the shifted range."""
    cols = split_cols(stage, view, got)
    failing = _failing_splits(got, want, view, cols)
    if not failing:
        return []
    s = failing[0]
    ref = view.references[s]
    cut = slice(s * cols, (s + 1) * cols)
    allowed = np.broadcast_to(np.asarray(view.allowed, dtype=np.float64), got.shape)
    found = _shifted_range(stage, got[:, cut], want[:, cut], allowed[:, cut], view, ref.first, ref.end, width)
    if found is None:
        return []
    (a, b), diff = found
    first, end = max(0, ref.first + a), min(view.keys, ref.end + b)
    alike = [s]
    for t in failing[1:]:
        r = view.references[t]
        f2, e2 = max(0, r.first + a), min(view.keys, r.end + b)
        cut_t = slice(t * cols, (t + 1) * cols)
        cand = view.recompute(FLASH_OF[stage], f2, e2)
        if _split_explains(got[:, cut_t], cand, want[:, cut_t], allowed[:, cut_t], width) is not None:
            alike.append(t)
    extra, missed = _outside(first, end, ref.first, ref.end), _outside(ref.first, ref.end, first, end)
    detail = {"split": s, "keys": [ref.first, ref.end], "covered": [first, end], "splits_alike": alike,
              "max_diff": diff}
    others = f"; {len(alike)} of the {len(failing)} failing splits alike" if len(failing) > 1 else ""
    out = []
    if extra:
        out.append(Diagnosis(SPLIT_OVERLAP, f"{stage}: split {s} covers keys [{first}, {end}) instead of its "
                             f"[{ref.first}, {ref.end}): {_keys_words(extra)} of its neighbour too{others} "
                             f"(max diff {diff:.2g})", {**detail, "extra_keys": extra}, 0.93))
    if missed:
        out.append(Diagnosis(SPLIT_GAP, f"{stage}: split {s} covers keys [{first}, {end}) instead of its "
                             f"[{ref.first}, {ref.end}): {_keys_words(missed)} left out at its boundary{others} "
                             f"(max diff {diff:.2g})", {**detail, "missed_keys": missed}, 0.93))
    return out


def _outside(first: int, end: int, own_first: int, own_end: int) -> List[int]:
    """The keys of [first, end) outside [own_first, own_end)."""
    return [j for j in range(first, end) if not own_first <= j < own_end]


def _keys_words(keys: List[int]) -> str:
    return f"key {keys[0]}" if len(keys) == 1 else f"keys {keys[0]}..{keys[-1]}"


def _split_explains(got: np.ndarray, cand: np.ndarray, want: np.ndarray, allowed: np.ndarray,
                    width: float) -> Optional[float]:
    """explains(), or at half precision (a bound wide beside a few keys' weight) the candidate taken
    by best_within_bound() against the split's own allowance (alone: no other to tell it from)."""
    diff = explains(got, cand, want, width)
    if diff is not None:
        return diff
    best = best_within_bound(got, want, allowed, [(0, cand)])
    return None if best is None else best[1]


def _shifted_range(stage: str, got: np.ndarray, want: np.ndarray, allowed: np.ndarray, view: SplitSuspect,
                   first: int, end: int, width: float) -> Optional[Tuple[Tuple[int, int], float]]:
    """The split's range shifted by a few keys that explains got, the nearest first; where none does,
    the shift got lies closest to within its bounds (best_within_bound)."""
    tried = []
    for a, b in _shifts():
        f2, e2 = max(0, first + a), min(view.keys, end + b)
        if f2 >= e2 or (f2, e2) == (first, end) or any(r == (f2, e2) for r, _ in tried):
            continue
        cand = view.recompute(FLASH_OF[stage], f2, e2)
        tried.append(((f2, e2), cand))
        diff = explains(got, cand, want, width)
        if diff is not None:
            return (f2 - first, e2 - end), diff
    best = best_within_bound(got, want, allowed, tried)
    if best is None:
        return None
    (f2, e2), diff = best
    return (f2 - first, e2 - end), diff


# ---- the combine ------------------------------------------------------------------------------

def _weighted(out_s: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Σ_s w_s·O_s, a zero weight contributing nothing (whatever the split's output holds)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return np.where((w != 0)[:, :, None], w[:, :, None] * out_s, 0.0).sum(axis=1)


def _combine(stage: str, got: np.ndarray, want: np.ndarray, view: SplitSuspect, width: float) -> List[Diagnosis]:
    lse_s, out_s = view.split_lse, view.split_output
    if lse_s is None:
        return []
    # Rows whose combine of the program's own splits is NaN (a split holding NaN, named on the split
    # stages) are no evidence: any candidate that treats the NaN its own way "explains" a program
    # that guards against it. The rows judged are the others.
    judged = ~np.isnan(want).reshape(want.shape[0], -1).any(axis=1)
    if not judged.any():
        return []
    if not judged.all():
        got, want = got[judged], want[judged]
        lse_s, out_s = lse_s[judged], None if out_s is None else out_s[judged]
    empty = np.isneginf(lse_s)
    found: List[Diagnosis] = []
    with np.errstate(all="ignore"):
        for how, cand in _empty_candidates(stage, lse_s, out_s, empty):
            diff = _explains(got, cand, want, width)
            if diff is not None:
                found.append(Diagnosis(EMPTY_SPLIT, f"{stage}: the combine {how} (max diff {diff:.2g}): an empty "
                                       "split (lse −inf) mishandled", {"how": how, "max_diff": diff}, 0.93))
                break
        use_out = None if row_statistic(stage) else out_s
        if use_out is None and not row_statistic(stage):
            return found
        rescaled = _rescale_candidates(lse_s, out_s, empty, view, judged) if use_out is not None else ()
        for code, candidates in ((SPLIT_NOT_RESCALED, rescaled),
                                 (LSE_SUM_MISSING, _lse_max_candidates(stage, lse_s, empty)),
                                 (SPLIT_EXP2, _exp2_candidates(stage, lse_s, use_out, empty)),
                                 (SPLIT_LEFT_OUT, _left_out_candidates(stage, lse_s, use_out, empty))):
            if found:
                break
            for how, cand, detail in candidates:
                diff = _explains(got, cand, want, width)
                if diff is not None:
                    found.append(Diagnosis(code, f"{stage}: the combine {how} (max diff {diff:.2g})",
                                           {"how": how, "max_diff": diff, **detail}, 0.93))
                    break
    return found


def _explains(got, cand, want, width) -> Optional[float]:
    """explains_closely(), with NaN where the candidate has it matching NaN: a combine's candidate
    is computed from the program's own splits, so a bug's reading reproduces got to its rounding,
    however small the bug's effect against the bound (a left-out split of one key)."""
    return explains_closely(got, cand, want, width, nan_evidence=True) if cand is not None else None


def _empty_candidates(stage: str, lse_s: np.ndarray, out_s: Optional[np.ndarray], empty: np.ndarray):
    every = empty.all(axis=1, keepdims=True)
    if every.any():
        lse, out, _ = combine(lse_s, out_s)
        nan_rows = lse if row_statistic(stage) else out
        yield ("gave NaN to rows that see no key of any split (−inf − (−inf)): a row with every split empty",
               np.where(every, np.nan, nan_rows))
    if not empty.any():
        return
    for how, value in (("counted the splits a row sees no key of with lse 0 instead of −inf", 0.0),
                       ("counted the splits a row sees no key of with weight one", None)):
        lse2 = lse_s.copy()
        if value is None:
            m = np.max(np.where(empty, -np.inf, lse_s), axis=1, keepdims=True)
            lse2 = np.where(empty, np.broadcast_to(m, lse_s.shape), lse_s)
        else:
            lse2 = np.where(empty, value, lse_s)
        outs = None if out_s is None else np.where(empty[:, :, None] & ~np.isfinite(out_s), 0.0, out_s)
        lse, out, _ = combine(lse2, outs)
        yield how, (lse if row_statistic(stage) else out)


def _lse_max_candidates(stage: str, lse_s: np.ndarray, empty: np.ndarray):
    """The combine's lse as the largest split lse alone: max_s lse_s, the log of Σ_s exp(lse_s − max)
    left out (rows whose every split is empty: −inf)."""
    if row_statistic(stage) and lse_s.shape[1] > 1:
        yield ("took the largest split lse for the lse: max over s of lse_s, the log of the sum of exp(lse_s − max) "
               "left out (the lse is max + log of that sum)"), np.max(np.where(empty, -np.inf, lse_s), axis=1,
                                                                      keepdims=True), {}


def _exp2_candidates(stage: str, lse_s: np.ndarray, out_s: Optional[np.ndarray], empty: np.ndarray):
    """The combine in base 2 of a natural-log lse: weights 2^(lse_s − m) / Σ, lse = m + ln Σ or
    m + log2 Σ (m the largest lse_s)."""
    m = np.max(np.where(empty, -np.inf, lse_s), axis=1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.where(empty, 0.0, np.exp2(lse_s - m))
    total = e.sum(axis=1, keepdims=True)
    none = ~(total > 0)
    words = "took 2^(lse_s − max) for exp(lse_s − max) (exp2 of the natural-log lse, without the log2(e) factor)"
    if not row_statistic(stage):
        yield words, np.where(none, 0.0, _weighted(out_s, e / np.where(none, 1.0, total))), {}
        return
    for log, name in ((np.log, "ln"), (np.log2, "log2")):
        lse = np.where(none, -np.inf, m + log(np.where(none, 1.0, total)))
        yield f"{words}, lse = max + {name} of their sum", lse, {"log": name}


def _left_out_candidates(stage: str, lse_s: np.ndarray, out_s: Optional[np.ndarray], empty: np.ndarray):
    """The combine over fewer splits: the loop one split short (the run's last split left out of
    every row, or each row's own last split), or the first split a row sees alone. A candidate that
    leaves a row that sees keys with no split is not one (an unwritten output would match it), nor
    one that changes no row."""
    seen, count = ~empty, lse_s.shape[1]
    if count < 2:
        return
    index = np.arange(count)[None, :]
    several = seen.sum(axis=1, keepdims=True) > 1
    last = np.where(seen, index, -1).max(axis=1, keepdims=True)
    first = np.where(seen, index, count).min(axis=1, keepdims=True)
    for how, keep, detail in ((f"left out its last split, {count - 1} (a loop bound one short)",
                               index != count - 1, {"split": count - 1}),
                              ("left out the last split each row sees keys of (a loop bound one short)",
                               (index != last) | ~several, {"split": "last"}),
                              ("took only the first split a row sees keys of", (index == first) | ~several,
                               {"split": "first"})):
        kept = keep & seen
        if (kept == seen).all() or not kept.any(axis=1)[seen.any(axis=1)].all():
            continue
        lse, out, _ = combine(np.where(keep, lse_s, -np.inf), out_s)
        yield how, (lse if row_statistic(stage) else out), detail


def _rescale_candidates(lse_s: np.ndarray, out_s: np.ndarray, empty: np.ndarray, view: SplitSuspect,
                        judged: np.ndarray):
    seen = ~empty
    lse, _, w = combine(lse_s, out_s)
    m = np.max(np.where(empty, -np.inf, lse_s), axis=1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    yield ("summed the splits' outputs without their weights exp(lse_s − lse)", _weighted(out_s, seen * 1.0), {})
    yield ("weighted the splits by exp(lse_s − max), not divided by their sum (the weights do not sum to one)",
           _weighted(out_s, np.where(seen, np.exp(lse_s - m), 0.0)), {})
    yield ("weighted the splits by exp(lse_s), without subtracting the combined lse (the weights do not sum to "
           "one)", _weighted(out_s, np.where(seen, np.exp(lse_s), 0.0)), {})
    count = np.maximum(seen.sum(axis=1, keepdims=True), 1)
    yield ("averaged the splits' outputs (weights 1/S, not exp(lse_s − lse))", _weighted(out_s, seen / count), {})
    last = np.where(seen.any(axis=1), (seen * np.arange(lse_s.shape[1])[None, :]).argmax(axis=1), -1)
    w2 = w.copy()
    rows = np.flatnonzero(last >= 0)
    w2[rows, last[rows]] = 1.0
    yield ("added the last split a row sees keys of without its weight exp(lse_s − lse)", _weighted(out_s, w2),
           {"split": "last"})
    for t in range(lse_s.shape[1]):
        if not seen[:, t].any():
            continue
        w2 = w.copy()
        w2[:, t] = np.where(seen[:, t], 1.0, 0.0)
        yield (f"added split {t}'s output without its weight exp(lse_{t} − lse)", _weighted(out_s, w2), {"split": t})
    if lse_s.shape[1] > 1:
        own = view.max_logits()[judged]
        sums = np.where(seen & np.isfinite(own), np.exp(lse_s - np.where(np.isfinite(own), own, 0.0)), 0.0)
        total = sums.sum(axis=1, keepdims=True)
        yield ("weighted each split by its own row sum l_s = exp(lse_s − m_s) over their total, m_s the split's own "
               "maximum: the sums not brought to the common maximum by exp(m_s − max) (a split not rescaled)",
               _weighted(out_s, sums / np.where(total > 0, total, 1.0)), {"own_maximum": True})


__all__ = ["diagnose", "CODES", "MAX_SHIFT", "MATCH_WIDTHS"]
