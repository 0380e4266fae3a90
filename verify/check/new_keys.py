"""The cache after a decode step that appends new keys (docs/contract.md, "New keys: a decode
step"): what a program's K or V (the cache after the step) holds, compared exactly with the cache
before it with each sequence's new keys written at its cache length, and the named ways it went
wrong. One classifier serves the Python API (check_kvcache's k_cache_after, v_cache_after,
through verify/check/paged.py cache_after_checks) and a folder's K and V stages (diagnose_cache_after).

The diagnoses, per sequence (the first that explains its new keys' slots):
* `cache_write_offset`: every new key written k keys late (k > 0) or early (k < 0), up to
  MAX_OFFSET, through the sequence's block_table (so across its pages);
* `cache_write_page`: a new key found whole on another page (or another sequence's slot) than the
  one the table names;
* `cache_not_written`: the new keys' slots still hold the cache before the step;
and once per K/V head `cache_clobbered`: an entry outside every new key's slot changed (a slot the
bugs above explain is not counted again). A folder's values compare as its K/V echo check does (at
bf16/fp16 rounded to the format or as read: verify/model/half.py echoed); the search for a new key
on another page looks only at the rows whose first entry can match it (_KeyScan).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import numpy as np

from .diagnosis import Diagnosis

CACHE_NOT_WRITTEN, CACHE_WRITE_OFFSET = "cache_not_written", "cache_write_offset"
CACHE_WRITE_PAGE, CACHE_CLOBBERED = "cache_write_page", "cache_clobbered"
CACHE_CODES = (CACHE_NOT_WRITTEN, CACHE_WRITE_OFFSET, CACHE_WRITE_PAGE, CACHE_CLOBBERED)
# The offsets a new key's slot is searched at, either way.
MAX_OFFSET = 3
# A finding reproduces the program's cache exactly (the cache is a copy).
CACHE_CONFIDENCE = 0.95


@dataclass
class CacheLayout:
    """Where one K/V head's cache keeps each sequence's keys: `key_row(b, key)` the row of a
    sequence's key (None past its slot or its table row), cache_len[b] the keys before the step,
    n_new the new keys each appends, `where(row)` the words of a row (its page and slot)."""
    count: int
    cache_len: Tuple[int, ...]
    n_new: int
    key_row: Callable[[int, int], Optional[int]]
    where: Callable[[int], str]
    page_of: Callable[[int], int]

    def new_rows(self, b: int) -> List[int]:
        return [self.key_row(b, self.cache_len[b] + t) for t in range(self.n_new)]


def pool_layout(table: np.ndarray, page_size: int, num_pages: int, cache_len, n_new: int) -> CacheLayout:
    """A paged cache's layout: key j of sequence b at row table[b][j // P]·P + j % P."""
    def key_row(b: int, key: int) -> Optional[int]:
        if not 0 <= key < table.shape[1] * page_size:
            return None
        page = int(table[b][key // page_size])
        return page * page_size + key % page_size if 0 <= page < num_pages else None
    return CacheLayout(len(cache_len), tuple(cache_len), n_new, key_row,
                       lambda r: f"page {r // page_size}, slot {r % page_size}", lambda r: r // page_size)


def slot_layout(cu_k, cache_len, n_new: int) -> CacheLayout:
    """A packed case's layout: key j of sequence b at row cu_k[b] + j, within its slot."""
    def key_row(b: int, key: int) -> Optional[int]:
        return cu_k[b] + key if 0 <= key < cu_k[b + 1] - cu_k[b] else None
    owner = lambda r: int(np.searchsorted(np.asarray(cu_k), r, side="right")) - 1  # noqa: E731
    return CacheLayout(len(cache_len), tuple(cache_len), n_new, key_row,
                       lambda r: f"packed key row {r} (sequence {owner(r)}'s key {r - cu_k[owner(r)]})", owner)


# A program's copy of an expected value: (got, want) -> what got may hold (verify/model/half.py echoed).
Echo = Callable[[np.ndarray, np.ndarray], np.ndarray]


def _as_is(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return want


def _equal(a: np.ndarray, b: np.ndarray, allowed) -> np.ndarray:
    """Per row: whether a and b agree within `allowed` (equal infinities and NaN with NaN agree)."""
    with np.errstate(invalid="ignore"):
        same = (a == b) | (np.abs(a - b) <= allowed) | (np.isnan(a) & np.isnan(b))
    return same.all(axis=-1)


def cache_findings(got: np.ndarray, want: np.ndarray, before: np.ndarray, new: np.ndarray, layout: CacheLayout,
                   name: str, allowed=0.0, echo: Echo = _as_is) -> List[Diagnosis]:
    """The diagnoses of one K/V head's cache after the step, `got` (rows × d), against `want` (the
    cache before it, `before`, with `new` (B·n × d) written); [] when got is want. `echo`: what
    got may hold for a value (at bf16/fp16 rounded to the format or as read)."""
    got, want, before, new = (np.asarray(x, np.float64) for x in (got, want, before, new))
    allowed = np.broadcast_to(np.asarray(allowed, np.float64), got.shape)  # (the printed resolution of got's values)
    same = lambda a, b, tol: _equal(a, echo(a, b), tol)  # noqa: E731
    ok = same(got, want, allowed)
    if ok.all():
        return []
    found, explained = [], set()
    scan = _KeyScan(got, allowed, echo)
    for b in range(layout.count):
        rows = layout.new_rows(b)
        keys = new[b * layout.n_new:(b + 1) * layout.n_new]
        if all(ok[r] for r in rows):
            continue
        finding = _sequence_finding(got, before, keys, layout, b, rows, name, allowed, same, scan)
        if finding is not None:
            found.append(finding[0])
            explained.update(finding[1])
    outside = set(range(got.shape[0])) - {r for b in range(layout.count) for r in layout.new_rows(b)}
    changed = sorted(r for r in outside - explained if not ok[r])
    if changed:
        r = changed[0]
        found.append(Diagnosis(CACHE_CLOBBERED, f"{name}: {layout.where(r)} changed from the cache before the step "
                               f"({len(changed)} such rows); only the new keys' slots change",
                               {"row": r, "rows": len(changed)}, CACHE_CONFIDENCE))
    return found


class _KeyScan:
    """The rows of got that hold a key (within `allowed`, as `echo` rounds it): got's first column
    sorted once, so that a key is compared whole only with the rows whose first entry can match
    it, not with every row of the pool for every new key."""

    def __init__(self, got: np.ndarray, allowed: np.ndarray, echo: Echo):
        self.got, self.allowed, self.echo = got, allowed, echo
        first = got[:, 0] if got.shape[1] else np.zeros(got.shape[0])
        self.order = np.argsort(first, kind="stable")  # (NaN last)
        self.sorted = first[self.order]
        self.span = float(allowed[:, 0].max()) if got.size else 0.0

    def hits(self, key: np.ndarray) -> List[int]:
        """The rows of got equal to `key` (within their allowed), ascending."""
        if not self.got.size or not np.isfinite(self.span):
            candidates = np.arange(self.got.shape[0])
        elif np.isnan(key[0]):
            candidates = self.order[np.isnan(self.sorted)]
        else:
            # a first entry that matches is near the key's, or the key's as echoed (a row not holding it as read)
            values = np.concatenate([key[:1], self.echo(np.full(1, np.nan), key[:1])])
            start = np.searchsorted(self.sorted, np.nanmin(values) - self.span, side="left")
            stop = np.searchsorted(self.sorted, np.nanmax(values) + self.span, side="right")
            candidates = np.sort(self.order[start:stop])
        matched = _equal(self.got[candidates], self.echo(self.got[candidates], key[None]), self.allowed[candidates])
        return [int(h) for h in candidates[matched]]


def _sequence_finding(got, before, keys, layout: CacheLayout, b: int, rows: List[int], name: str, allowed, same,
                      scan: _KeyScan) -> Optional[Tuple[Diagnosis, List[int]]]:
    """What a sequence's new keys' slots say happened to them: (the diagnosis, the rows it
    explains outside those slots), or None."""
    u, n = layout.cache_len[b], layout.n_new
    span = f"keys {u}..{u + n - 1}" if n > 1 else f"key {u}"
    for k in sorted(range(-MAX_OFFSET, MAX_OFFSET + 1), key=abs):
        at = [layout.key_row(b, u + t + k) for t in range(n)]
        if k == 0 or any(r is None for r in at) or not same(got[at], keys, allowed[at]).all():
            continue
        late = f"{abs(k)} {'key' if abs(k) == 1 else 'keys'} {'late' if k > 0 else 'early'}"
        return Diagnosis(CACHE_WRITE_OFFSET, f"{name}: sequence {b}'s new keys were written {late}: at its keys "
                         f"{u + k}..{u + k + n - 1} ({layout.where(at[0])} first) instead of {span}",
                         {"sequence": b, "offset": k, "row": at[0]}, CACHE_CONFIDENCE), at
    for t, r in enumerate(rows):
        moved = [h for h in scan.hits(keys[t]) if h != r and layout.page_of(h) != layout.page_of(r)]
        if moved:
            return Diagnosis(CACHE_WRITE_PAGE, f"{name}: sequence {b}'s new key {t} (its key {u + t}) was written to "
                             f"{layout.where(moved[0])} instead of {layout.where(r)}",
                             {"sequence": b, "new_key": t, "row": moved[0], "expected_row": r}, CACHE_CONFIDENCE), moved
    if same(got[rows], before[rows], allowed[rows]).all():
        return Diagnosis(CACHE_NOT_WRITTEN, f"{name}: sequence {b}'s new keys were not written: {layout.where(rows[0])} "
                         f"and the rest of its {span} hold the cache before the step",
                         {"sequence": b, "row": rows[0]}, CACHE_CONFIDENCE), []
    return None
