"""The checks of a decode step that the packed check of its gathered keys cannot make (the
Python API's check_kvcache; verify/files/kv_cache.py reads the cache): the cache after the step,
compared exactly (a run-level check of K or V), and the diagnoses of the classic paged-cache bugs.

A diagnosis is a reading of the cache that a buggy program makes instead of the right one: a wrong
page (one page of the sequence read from the page before or after it in the pool, or from another
sequence's page at the same index), every page of the sequence shifted (each entry of its table
plus or minus one, or the table read one entry late), or the last partial page read past the
sequence's length (to the page's end). Each reading of a failing sequence is gathered and the
sequence's stages re-checked against it with the same error model, in one packed check of every
reading at once; a reading whose check passes explains the failure.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from ..files.kv_cache import KVCache, cache_after_problem, packed_keys
from ..sequences import Sequences
from ..stages import KEYS, STAGES, VALUES
from .diagnosis import Diagnosis
from .results import Report, RunCheck

PAGED_WRONG_PAGE, PAGED_PAGE_SHIFT, PAGED_PAST_LENGTH = "paged_wrong_page", "paged_page_shift", "paged_past_length"
CACHE_AFTER, CACHE_AFTER_TITLE = "cache_after", "cache after the step"
# The readings tried per failing sequence (a long sequence has many pages that could be wrong).
MAX_READINGS = 256
# Confidence: a reading that reproduces the program's output to the error model's bound.
READING_CONFIDENCE = 0.9

# (q, k, v, stages, sequences) -> the report of a packed check, without diagnoses.
Recheck = Callable[[np.ndarray, np.ndarray, np.ndarray, Dict[str, np.ndarray], Sequences], Report]


@dataclass
class Reading:
    """A way to read sequence b's keys: a table row and a count of keys."""
    b: int
    row: np.ndarray
    count: int
    code: str
    message: str
    detail: dict


def cache_after_checks(kv: KVCache, k_after, v_after) -> List[RunCheck]:
    """The run-level checks of the cache after the step, one per array given."""
    out = []
    for stage, name, after in ((KEYS, "k_cache_after", k_after), (VALUES, "v_cache_after", v_after)):
        if after is None:
            continue
        problem = cache_after_problem(kv, name, after)
        message, detail = problem or (f"{name}: the new keys at cache_seqlens, every other slot unchanged", {})
        out.append(RunCheck(CACHE_AFTER, stage, CACHE_AFTER_TITLE, problem is None, message, detail))
    return out


# ----------------------------------------------------------------------------------------------
# The readings of a buggy program.

def _valid(kv: KVCache, row: np.ndarray, pages: int) -> bool:
    return bool(((row[:pages] >= 0) & (row[:pages] < kv.num_pages)).all())


def _shifts(kv: KVCache, b: int) -> List[Reading]:
    """Every page of sequence b one off: its table entries ± 1, or its table read one entry late."""
    out, table, pages, m = [], kv.table[b], kv.pages_read(b), kv.m(b)
    for s in (1, -1):
        row = table.copy()
        row[:pages] += s
        if _valid(kv, row, pages):
            out.append(Reading(b, row, m, PAGED_PAGE_SHIFT, f"sequence {b} read every page {s:+d}: page "
                               f"block_table[{b}, j] {'+' if s > 0 else '-'} 1 for its page j", {"shift": s}))
    if pages < table.size:
        row = np.concatenate((table[1:], table[-1:]))
        if _valid(kv, row, pages):
            out.append(Reading(b, row, m, PAGED_PAGE_SHIFT, f"sequence {b} read block_table[{b}, j + 1] for its "
                               "page j (the table read one entry late)", {"table_offset": 1}))
    return out


def _wrong_pages(kv: KVCache, b: int) -> List[Reading]:
    """One page j of sequence b read from another page: the pool's page before or after it, or
    another sequence's page j."""
    out, table, m = [], kv.table[b], kv.m(b)
    for j in range(kv.pages_read(b)):
        right = int(table[j])
        others = {right - 1: "the page before it in the pool", right + 1: "the page after it in the pool"}
        for c in range(kv.batch):
            if c != b and j < kv.table.shape[1] and j < kv.pages_read(c):
                others.setdefault(int(kv.table[c, j]), f"sequence {c}'s page {j}")
        for page, words in others.items():
            if page == right or not 0 <= page < kv.num_pages:
                continue
            row = table.copy()
            row[j] = page
            out.append(Reading(b, row, m, PAGED_WRONG_PAGE, f"sequence {b} read its page {j} (keys "
                               f"{j * kv.page_size}..{min(m, (j + 1) * kv.page_size) - 1}) from page {page}, {words}, "
                               f"instead of page {right} (block_table[{b}, {j}])",
                               {"sequence": b, "page_index": j, "read": page, "expected": right}))
    return out


def _past_length(kv: KVCache, b: int) -> List[Reading]:
    """Sequence b's last page read to its end, past the sequence's keys."""
    m, whole = kv.m(b), kv.pages_read(b) * kv.page_size
    if whole == m or m == 0:
        return []
    where = "its last page read to its end" if kv.paged else "its cache slot read to its end"
    return [Reading(b, kv.table[b], whole, PAGED_PAST_LENGTH,
                    f"sequence {b} attended {whole} keys, {whole - m} past its {m} (cache_seqlens[{b}] + the new "
                    f"keys): {where}", {"sequence": b, "keys": whole, "valid": m})]


def readings(kv: KVCache, b: int) -> List[Reading]:
    """The readings of sequence b a buggy program may make, each of keys other than the right ones."""
    found = (_shifts(kv, b) + _wrong_pages(kv, b) if kv.paged else []) + _past_length(kv, b)
    right_k, right_v = kv.gather(b)
    out = []
    for r in found:
        k, v = kv.gather(b, r.row, r.count)
        if k.shape != right_k.shape or not (np.array_equal(k, right_k) and np.array_equal(v, right_v)):
            out.append(r)
    return out[:MAX_READINGS]


# ----------------------------------------------------------------------------------------------
# Matching them.

def _rows(stage: str, x: np.ndarray, b: int, nq: int) -> np.ndarray:
    """Sequence b's part of a packed step stage: its rows, or its columns of an lse (H, B·nq)."""
    return x[:, b * nq:(b + 1) * nq] if STAGES[stage].cols == "1" else x[b * nq:(b + 1) * nq]


def diagnose_paged(report: Report, kv: KVCache, stages: Dict[str, np.ndarray], recheck: Recheck) -> None:
    """Adds to each failing sequence's results the readings that explain them (first)."""
    failing = sorted({r.sequence for r in report.results if not r.passed and r.sequence is not None})
    tried = [r for b in failing for r in readings(kv, b)]
    if not tried:
        return
    axis = {s: 1 if STAGES[s].cols == "1" else 0 for s in stages}
    got = {s: np.concatenate([_rows(s, x, r.b, kv.nq) for r in tried], axis=axis[s]) for s, x in stages.items()}
    q = np.concatenate([kv.q[r.b] for r in tried])
    k, v = packed_keys(kv, [kv.gather(r.b, r.row, r.count) for r in tried])
    again = recheck(q, k, v, got, kv.sequences([r.count for r in tried]))
    failed = {r.sequence for r in again.results if not r.passed}
    for b in failing:
        found = [Diagnosis(r.code, r.message, r.detail, READING_CONFIDENCE) for i, r in enumerate(tried)
                 if r.b == b and i not in failed]
        for res in report.results:
            if res.sequence == b and not res.passed:
                res.diagnosis[:0] = found
