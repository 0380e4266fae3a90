"""The checks of a decode step that the packed check of its gathered keys cannot make (the
Python API's check_kvcache; verify/files/kv_cache.py reads the cache): the cache after the step,
compared exactly (a run-level check of K or V), and the diagnoses of the classic paged-cache bugs.

A diagnosis is a reading of the cache that a buggy program makes instead of the right one (a wrong
page, every page one off, the last page read past the length, the length off by one key, the new
keys unseen: verify/check/paged_readings.py). Each reading of a failing sequence is gathered and
the sequence's stages re-checked against it with the same error model, in one packed check of
every reading at once; a reading whose check passes explains the failure.

The search is kept cheap: a sequence whose failure already has a cause that is not about paging
(a diagnosis other than the packed and paged ones, e.g. scaled) is not searched; each reading is
first screened with a float64 NumPy forward of the sequence over the reading's keys, and only one
much closer to the program's rows than the right reading goes to the re-check; the readings are
capped per kind (past-length and shifts first, then wrong pages, the last (partial) page first).

A paged input case, or a packed one with new keys (files, or check_arrays' paged packing), is
searched the same way once every sequence is checked (verify/check/paged_case.py): its pool and
table read into a KVCache, its output, flash_output and flash_lse re-checked per reading. A decode
step with new keys also has the readings that leave them out (new_keys_unseen).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from ..files.cache_layouts import CACHE_LAYOUTS, PoolLayout
from ..files.kv_cache import KVCache, cache_after_problem, decode_stage
from ..files.kv_step import packed_keys
from ..sequences import Sequences
from ..stages import FLASH_LSE, FLASH_OUTPUT, KEYS, STAGES, VALUES
from ..model.half import is_half, storage_unit
from ..model.rounding import unit_roundoff
from ..variant import Variant, hidden, modified_scores
from .diagnosis import SEARCHED_CODES, Diagnosis, equivalent, precision_convention
from .new_keys import CACHE_WRITE_OFFSET, cache_findings, pool_layout
from .paged_readings import (CACHE_LAYOUT_MISREAD, CACHE_LENGTH_OFF, NEW_KEYS_UNSEEN, PAGED_PAST_LENGTH,
                             PAGED_PAGE_SHIFT, PAGED_WRONG_PAGE, PAGED_WRONG_TABLE_ROW, Reading, readings)
from .results import Report, RunCheck
from .splits import combine

# The check's arrays read in another cache layout than the one declared pass: the cache is laid
# out so (the declared layout reads arrays of an ambiguous shape with page size and heads swapped).
CACHE_LAYOUT_DECLARED = "cache_layout_declared"

CACHE_AFTER, CACHE_AFTER_TITLE = "cache_after", "cache after the step"
PAGED_CODES = (PAGED_WRONG_PAGE, PAGED_PAGE_SHIFT, PAGED_PAST_LENGTH, CACHE_LENGTH_OFF, NEW_KEYS_UNSEEN,
               CACHE_WRITE_OFFSET, CACHE_LAYOUT_MISREAD, PAGED_WRONG_TABLE_ROW)
# The diagnoses of the packed engine that a paging bug may also show as (verify/diagnose/sequences.py).
PACKED_CODES = ("sequence_leak", "sequence_boundary", "padding_read", "sequence_offsets_swapped")
# The readings re-checked per kind after the screen.
MAX_RECHECKED = 16
# A reading goes to the re-check when its distance to the program's rows is at most this share
# of the right reading's (a reading the program made is as close as its rounding), or within
# ROUNDING_FLOOR unit roundoffs of the precision and half the right reading's distance (a bug as
# small as a half-precision program's rounding).
SCREEN_RATIO, ROUNDING_FLOOR = 0.1, 4.0
# Confidence: a reading that reproduces the program's output to the error model's bound.
READING_CONFIDENCE = 0.9

# (q, k, v, stages, sequences) -> the report of a packed check, without diagnoses.
Recheck = Callable[[np.ndarray, np.ndarray, np.ndarray, Dict[str, np.ndarray], Sequences], Report]


def cache_after_checks(kv: KVCache, k_after, v_after) -> List[RunCheck]:
    """The run-level checks of the cache after the step, one per array given."""
    out = []
    for stage, name, after in ((KEYS, "k_cache_after", k_after), (VALUES, "v_cache_after", v_after)):
        if after is None:
            continue
        after = kv.after(name, after)
        problem = cache_after_problem(kv, name, after)
        message, detail = problem or (f"{name}: the new keys at cache_seqlens, every other slot unchanged", {})
        if problem:  # (the named ways it went wrong, as a folder's K and V stages name them)
            detail = {**detail, "diagnosis": [{"code": d.code, "message": d.message, **d.detail}
                                              for d in _cache_findings(kv, name, after)]}
        out.append(RunCheck(CACHE_AFTER, stage, CACHE_AFTER_TITLE, problem is None, message, detail))
    return out


def _cache_findings(kv: KVCache, name: str, after) -> List[Diagnosis]:
    """The named ways the program's cache after the step went wrong, over every K/V head."""
    want, before = (kv.k_pages, kv.k_before) if name.startswith("k") else (kv.v_pages, kv.v_before)
    got = np.asarray(after, np.float64)
    places = [kv.places(kv.table[b], kv.m(b)) for b in range(kv.batch)]
    new = np.concatenate([want[p[u:], s[u:]] for (p, s), u in zip(places, kv.seqlens)])
    layout = pool_layout(kv.table, kv.page_size, kv.num_pages, kv.seqlens, kv.n_new)
    if not kv.paged:
        layout.where = lambda r: f"sequence {r // kv.page_size}, slot {r % kv.page_size}"
    rows = lambda x: np.asarray(x).reshape((-1,) + x.shape[2:])  # noqa: E731  (page, slot) -> pool row
    found: List[Diagnosis] = []
    for j in range(want.shape[2]):
        seen = {(f.code, f.detail.get("sequence")) for f in found}
        found += [d for d in cache_findings(rows(got)[:, j], rows(want)[:, j], rows(before)[:, j], new[:, j], layout,
                                            f"{name} K/V head {j}") if (d.code, d.detail.get("sequence")) not in seen]
    return found


# ----------------------------------------------------------------------------------------------
# The screen: a float64 forward of a sequence over a reading's keys.

@dataclass
class Screen:
    """What the float64 forward needs: the case's scale, variant and ALiBi slopes ((H,) or None),
    and the distance a reading within the program's rounding may have (floor)."""
    scale: float
    variant: Variant
    slopes: Optional[np.ndarray]
    floor: float

    @classmethod
    def of(cls, report: Report) -> "Screen":
        run = report.run
        # (the case's slopes: its file or array, else the standard ones)
        slopes = (np.array([report.case.alibi_slope(h) for h in range(run.dims.heads)], np.float64)
                  if run.variant.alibi else None)
        # (a bf16/fp16 program's rows are stored in the format: its unit, not float32's)
        unit = storage_unit(run.precision) if is_half(run.precision) else unit_roundoff(run.precision)
        return cls(run.scale, run.variant, slopes, ROUNDING_FLOOR * unit)

    def close(self, distance: float, right: float) -> bool:
        """Whether a reading at `distance` from the program's rows is much closer than the right one."""
        return distance <= max(SCREEN_RATIO * right, min(0.5 * right, self.floor))

    def scores(self, q: np.ndarray, k: np.ndarray, m: int, cols: slice = slice(None)) -> np.ndarray:
        """(H, nq, keys) masked scores of queries q (nq, H, d) over keys k (keys, Hk, d), keys `cols`
        of a sequence of m keys, float64."""
        nq, H, Hk = q.shape[0], q.shape[1], k.shape[1]
        qq = q.astype(np.float64).transpose(1, 0, 2).reshape(Hk, H // Hk * nq, -1)
        s = (qq @ k.astype(np.float64).transpose(1, 2, 0)).reshape(H, nq, k.shape[0]) * self.scale
        if self.variant.modifies_scores:
            s = np.stack([modified_scores(s[h], self.variant, 0.0 if self.slopes is None else self.slopes[h],
                                          cols=cols, n=nq, m=m) for h in range(H)])
        return np.where(hidden(self.variant, nq, m, cols=cols)[None], -np.inf, s)

    @staticmethod
    def weigh(s: np.ndarray, v: np.ndarray, top: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(Σ exp(s − top)·v (H, nq, dv), Σ exp(s − top) (H, nq, 1)) of scores s (H, nq, keys)."""
        H, nq, Hk = s.shape[0], s.shape[1], v.shape[1]
        p = np.exp(s - top)
        values = p.reshape(Hk, H // Hk * nq, -1) @ v.astype(np.float64).transpose(1, 0, 2)
        return values.reshape(H, nq, -1), p.sum(axis=2, keepdims=True)

    @staticmethod
    def finish(values: np.ndarray, total: np.ndarray, top: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(out (nq, H, dv), lse (H, nq)); a row that sees no key: out 0, lse -inf."""
        with np.errstate(divide="ignore"):
            lse = (top + np.log(total))[:, :, 0]
        return (values / np.where(total > 0, total, 1.0)).transpose(1, 0, 2), lse

    def forward(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(out (nq, H, dv), lse (H, nq)) of queries q (nq, H, d) over keys k, v (m, Hk, d)."""
        s = self.scores(q, k, k.shape[0])
        top = s.max(axis=2, keepdims=True)
        top = np.where(np.isfinite(top), top, 0.0)
        return self.finish(*self.weigh(s, v, top), top)


@dataclass
class Base:
    """The right reading's scores and sums, which a reading of one other page changes in place."""
    s: np.ndarray
    top: np.ndarray
    values: np.ndarray
    total: np.ndarray

    @classmethod
    def of(cls, screen: Screen, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> "Base":
        s = screen.scores(q, k, k.shape[0])
        top = s.max(axis=2, keepdims=True)
        top = np.where(np.isfinite(top), top, 0.0)
        return cls(s, top, *screen.weigh(s, v, top))

    def swap(self, screen: Screen, q: np.ndarray, v: np.ndarray, keys: slice, k_new: np.ndarray,
             v_new: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(out, lse) with keys `keys` (their values v[keys]) replaced by k_new, v_new."""
        s_new = screen.scores(q, k_new, self.s.shape[2], keys)
        top = np.maximum(self.top, np.where(np.isfinite(s_new).any(axis=2, keepdims=True),
                                            s_new.max(axis=2, keepdims=True), self.top))
        old_values, old_total = screen.weigh(self.s[:, :, keys], v[keys], self.top)
        new_values, new_total = screen.weigh(s_new, v_new, top)
        shrink = np.exp(self.top - top)
        return screen.finish((self.values - old_values) * shrink + new_values,
                             np.maximum((self.total - old_total) * shrink, 0.0) + new_total, top)


def _distance(want: Dict[str, np.ndarray], got: Dict[str, np.ndarray]) -> float:
    """The largest relative difference over the stages (an lse's against 1 + its size)."""
    worst = 0.0
    for name, g in got.items():
        w = want[name]
        same = (w == g) | (np.isinf(w) & np.isinf(g))
        diff = np.where(same, 0.0, np.abs(w - g))
        worst = max(worst, float(np.nan_to_num(diff, nan=np.inf).max(initial=0.0))
                    / (1.0 + float(np.abs(np.where(np.isfinite(g), g, 0)).max(initial=0.0))))
    return worst


def _screened(kv: KVCache, b: int, tried: List[Reading], stages: Dict[str, np.ndarray], screen: Screen,
              failing: Optional[set] = None) -> List[Reading]:
    """The readings of sequence b much closer to the program's rows than its right reading, at
    most MAX_RECHECKED of a kind (all of them when its rows are not finite: no screen). The
    distances are over the sequence's failing stages where any are given: a bf16 output that passes
    lies a few units of the format from every reading alike, and would hide the lse that tells them
    apart."""
    names = [s for s in stages if s in (failing or ())] or list(stages)
    got = {s: _rows(s, stages[s], kv.q_span(b)).astype(np.float64) for s in names}
    if not all(np.isfinite(g).all() for g in got.values()):
        return tried

    right_k, right_v = kv.gather(b)
    base = Base.of(screen, kv.queries(b), right_k, right_v)

    def distance(r: Optional[Reading]) -> float:
        if r is None:
            out, lse = screen.finish(base.values, base.total, base.top)
        elif r.code == PAGED_WRONG_PAGE:
            j = r.detail["page_index"]
            keys = slice(j * kv.page_size, min(kv.m(b), (j + 1) * kv.page_size))
            page, n = r.detail["read"], keys.stop - keys.start
            out, lse = base.swap(screen, kv.queries(b), right_v, keys, kv.k_pages[page, :n], kv.v_pages[page, :n])
        else:
            out, lse = screen.forward(kv.queries(b), *r.keys(kv))
        return _distance({s: (lse if STAGES[s].cols == "1" else out) for s in got}, got)

    right = distance(None)
    kept, kinds = [], {}
    for r in tried:
        if kinds.get(r.code, 0) < MAX_RECHECKED and screen.close(distance(r), right):
            kept.append(r)
            kinds[r.code] = kinds.get(r.code, 0) + 1
    return kept


# ----------------------------------------------------------------------------------------------
# Matching them.

def _rows(stage: str, x: np.ndarray, span: Tuple[int, int]) -> np.ndarray:
    """A sequence's part of a packed step stage (`span`: its rows): its rows, or its columns of an
    lse (H, total queries)."""
    return x[:, span[0]:span[1]] if STAGES[stage].cols == "1" else x[span[0]:span[1]]


def split_combine(splits) -> Dict[str, np.ndarray]:
    """The step's flash stages as the float64 combine of the program's splits (packed: split_output
    (S, T, H, d), split_lse (S, H, T)), what a right combine of them writes: where the program gave
    its splits alone, the readings are told apart on these. Empty unless both are given."""
    if splits is None or splits[0] is None or splits[1] is None:
        return {}
    out_s, lse_s = np.asarray(splits[0], np.float64), np.asarray(splits[1], np.float64)
    S, T, H, d = out_s.shape
    lse, out, _ = combine(lse_s.transpose(2, 1, 0).reshape(T * H, S), out_s.transpose(1, 2, 0, 3).reshape(T * H, S, d))
    return {FLASH_OUTPUT: out.reshape(T, H, d), FLASH_LSE: lse.reshape(T, H).T}


def diagnose_paged(report: Report, kv: KVCache, stages: Dict[str, np.ndarray], recheck: Recheck) -> None:
    """Adds to each failing sequence's results the readings that explain them (first): those of a
    sequence whose failure has no other cause, screened (_screened), re-checked in one packed check.
    stages: the step's flash stages (or split_combine's, where the splits alone were given)."""
    if not stages:  # (no flash stage, nor both split stages: nothing a reading could be checked on)
        return
    failing = sorted({r.sequence for r in report.results if not r.passed and r.sequence is not None})

    def other_cause(r) -> bool:
        return any(d.code not in PAGED_CODES + PACKED_CODES + SEARCHED_CODES and not equivalent(d)
                   and not precision_convention(d) for d in r.diagnosis)
    # (explained otherwise: each of its failing heads and stages, not one head's lse fitted by chance)
    decode_results = [r for r in report.results if not r.passed and decode_stage(r.stage)]
    other = {b for b in failing if all(other_cause(r) for r in decode_results if r.sequence == b)} & \
        {r.sequence for r in decode_results}
    screen = Screen.of(report)
    failing_stages = {b: {r.stage for r in report.results if r.sequence == b and not r.passed} for b in failing}
    tried = [r for b in failing if b not in other
             for r in _screened(kv, b, readings(kv, b), stages, screen, failing_stages[b])]
    if not tried:
        return
    axis = {s: 1 if STAGES[s].cols == "1" else 0 for s in stages}
    got = {s: np.concatenate([_rows(s, x, kv.q_span(r.b)) for r in tried], axis=axis[s]) for s, x in stages.items()}
    q = np.concatenate([kv.queries(r.b) for r in tried])
    k, v = packed_keys(kv, [r.keys(kv) for r in tried])
    again = recheck(q, k, v, got, kv.sequences([r.count for r in tried], [kv.n(r.b) for r in tried]))
    failed = {r.sequence for r in again.results if not r.passed}
    for b in failing:
        found = [Diagnosis(r.code, r.message, r.detail, READING_CONFIDENCE) for i, r in enumerate(tried)
                 if r.b == b and i not in failed]
        for res in report.results:
            if res.sequence == b and not res.passed and (decode_stage(res.stage) or STAGES[res.stage].split):
                if found:  # (the reading passes the whole sequence: a precision convention fitted by chance)
                    res.diagnosis = [d for d in res.diagnosis if not precision_convention(d)]
                # (a split reads its keys as the whole step does; a mask named first stays first)
                at = next((i for i, d in enumerate(res.diagnosis) if not equivalent(d)), len(res.diagnosis))
                res.diagnosis[at:at] = found


def name_declared_layout(report: Report, kv: KVCache, stages: Dict[str, np.ndarray],
                         read_as: Callable[[PoolLayout], Optional[KVCache]],
                         passes: Callable[[KVCache], bool]) -> None:
    """A failing step whose arrays another cache layout also reads (read_as(layout): None where it
    refuses them), and which passes read so (passes(that cache)): that layout named first in every
    failing result. A layout is re-checked only where a float64 forward of the first failing
    sequence read in it lies much closer to the program's rows (stages: the step's flash stages)
    than the declared one's: a failing step's whole check is not run again for nothing."""
    failing = sorted({r.sequence for r in report.results if not r.passed and r.sequence is not None})
    if report or not stages or not failing:
        return
    b, screen = failing[0], Screen.of(report)
    got = {s: _rows(s, x, kv.q_span(b)).astype(np.float64) for s, x in stages.items()}

    def distance(cache: KVCache) -> float:
        out, lse = screen.forward(cache.queries(b), *cache.gather(b))
        return _distance({s: (lse if STAGES[s].cols == "1" else out) for s in got}, got)
    declared = distance(kv)
    for other in CACHE_LAYOUTS.values():
        cache = None if other is kv.layout else read_as(other)
        if cache is None or not screen.close(distance(cache), declared) or not passes(cache):
            continue
        message = (f"the step passes with cache_layout={other.name!r} ({other.whose}: k_cache "
                   f"{other.words(kv.paged)}), not as cache_layout={kv.layout.name!r} reads the arrays")
        for res in report.results:
            if not res.passed:
                res.diagnosis.insert(0, Diagnosis(CACHE_LAYOUT_DECLARED, message, {"cache_layout": other.name}))
        return
