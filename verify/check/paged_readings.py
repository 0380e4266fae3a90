"""The readings of a paged (or dense) KV cache that a buggy program makes instead of the right one,
each a table row and a count of keys (verify/check/paged.py re-checks a failing sequence against
them): a wrong page, every page one off, the last partial page read to its end, the length off by
one key, the new keys unseen or written one key off.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..files.kv_cache import KVCache
from .new_keys import CACHE_WRITE_OFFSET

PAGED_WRONG_PAGE, PAGED_PAGE_SHIFT, PAGED_PAST_LENGTH = "paged_wrong_page", "paged_page_shift", "paged_past_length"
# A sequence's pages read through another sequence's row of the block table (a batch index off).
PAGED_WRONG_TABLE_ROW = "paged_wrong_table_row"
# A sequence's length read one key long or short (`<=` for `<`, or the count of keys taken as the
# last key's index), paged or dense.
CACHE_LENGTH_OFF = "cache_length_off_by_one"
# A decode step with new keys: attention over the cache without them (or before they were written).
NEW_KEYS_UNSEEN = "new_keys_unseen"
# The cache's pools read in another layout than their own (verify/files/cache_layouts.py misreads).
CACHE_LAYOUT_MISREAD = "cache_layout_misread"
MAX_SCREENED = 2048  # the readings screened per failing sequence and kind


@dataclass
class Reading:
    """A way to read sequence b's keys: a table row and a count of keys."""
    b: int
    row: np.ndarray
    count: int
    code: str
    message: str
    detail: dict
    before: bool = False  # read from the cache before the step's new keys are written ...
    shift: int = 0        # ... and then with the new keys written `shift` keys late (early: < 0)
    misread: Optional[int] = None  # the pools read as kv.misreads()[misread] gives them

    def keys(self, kv: KVCache) -> Tuple[np.ndarray, np.ndarray]:
        """The keys and values this reading reads."""
        if self.misread is not None:  # (only the pages it reads converted)
            m = kv.misreads()[self.misread]
            pages, slots = kv.places(self.row, self.count)
            used, at = np.unique(pages, return_inverse=True)
            k, v = kv.k_pages[used], kv.v_pages[used]
            k, v = (k if m.keys is None else m.keys(k)), (v if m.values is None else m.values(v))
            return k[at, slots], v[at, slots]
        k, v = kv.gather(self.b, self.row, self.count, self.before)
        if self.shift:
            u, n = kv.seqlens[self.b], kv.n_new
            new_k, new_v = (x[u:u + n] for x in kv.gather(self.b))
            at = np.arange(n) + u + self.shift
            keep = (at >= 0) & (at < self.count)
            k[at[keep]], v[at[keep]] = new_k[keep], new_v[keep]
        return k, v



def _valid(kv: KVCache, row: np.ndarray, pages: int) -> bool:
    return bool(((row[:pages] >= 0) & (row[:pages] < kv.num_pages)).all())


def _indexed(kv: KVCache, row: np.ndarray, pages: int) -> Tuple[Optional[np.ndarray], str]:
    """The pages a program reads for table row `row`: the row itself where every entry is a page,
    else where a negative entry (the table's −1 padding read, or page 0 − 1) is a page as Python
    and PyTorch index (−1 the pool's last page), that reading, said; else None."""
    if _valid(kv, row, pages):
        return row, ""
    wrapped = row.copy()
    wrapped[:pages] = np.where((row[:pages] < 0) & (row[:pages] >= -kv.num_pages), row[:pages] + kv.num_pages,
                               row[:pages])
    if _valid(kv, wrapped, pages):
        return wrapped, " (a −1 read as the pool's last page, as Python and PyTorch index)"
    return None, ""


def _shifts(kv: KVCache, b: int) -> List[Reading]:
    """Every page of sequence b one off: its table entries ± 1, or its table read one entry late."""
    out, table, pages, m = [], kv.table[b], kv.pages_read(b), kv.m(b)
    for s in (1, -1):
        row, how = _indexed(kv, np.where(np.arange(table.size) < pages, table + s, table), pages)
        if row is not None:
            out.append(Reading(b, row, m, PAGED_PAGE_SHIFT, f"sequence {b} read every page {s:+d}: page "
                               f"block_table[{b}, j] {'+' if s > 0 else '-'} 1 for its page j{how}", {"shift": s}))
    if pages < table.size:
        row, how = _indexed(kv, np.concatenate((table[1:], table[-1:])), pages)
        if row is not None:
            out.append(Reading(b, row, m, PAGED_PAGE_SHIFT, f"sequence {b} read block_table[{b}, j + 1] for its "
                               f"page j (the table read one entry late){how}", {"table_offset": 1}))
    return out


def _other_rows(kv: KVCache, b: int) -> List[Reading]:
    """Sequence b's keys read through a neighbour's row of the block table (b ± 1, wrapping: the
    table indexed by a batch index off by one), its own count of keys. Only the neighbours: each
    reading is screened by a whole forward of the sequence, and a batch of 64 would make 63."""
    out, pages, m = [], kv.pages_read(b), kv.m(b)
    for c in sorted({(b + 1) % kv.batch, (b - 1) % kv.batch} - {b}):
        row, how = _indexed(kv, kv.table[c].copy(), pages)
        if row is not None:
            out.append(Reading(b, row, m, PAGED_WRONG_TABLE_ROW, f"sequence {b} read its pages through sequence "
                               f"{c}'s row of the block table (block_table[{c}, j] for its page j){how}",
                               {"sequence": b, "table_row": c}))
    return out


def _wrong_pages(kv: KVCache, b: int) -> List[Reading]:
    """One page j of sequence b read from another page: the pool's page before or after it, or
    what another sequence's row holds at j: its page j, or past its pages the table's padding
    (0, or −1 read as the pool's last page)."""
    out, table, m = [], kv.table[b], kv.m(b)
    for j in range(kv.pages_read(b)):
        right = int(table[j])
        others = {right - 1: "the page before it in the pool", right + 1: "the page after it in the pool"}
        for c in range(kv.batch):
            if c != b and j < kv.table.shape[1]:
                others.setdefault(*_entry(kv, c, j))
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


def _entry(kv: KVCache, c: int, j: int) -> Tuple[int, str]:
    """(the page, in words) that block_table[c, j] names: sequence c's page j, or past its pages
    a padding entry (a negative one indexed as Python and PyTorch do)."""
    entry = int(kv.table[c, j])
    if j < kv.pages_read(c):
        return entry, f"sequence {c}'s page {j}"
    wrapped = entry + kv.num_pages if -kv.num_pages <= entry < 0 else entry
    how = f" ({entry} read as the pool's page {wrapped}, as Python and PyTorch index)" if wrapped != entry else ""
    return wrapped, f"the padding entry block_table[{c}, {j}] past sequence {c}'s pages{how}"


def _past_length(kv: KVCache, b: int) -> List[Reading]:
    """Sequence b's last page read to its end, past the sequence's keys."""
    m, whole = kv.m(b), kv.pages_read(b) * kv.page_size
    if whole == m or m == 0:
        return []
    where = "its last page read to its end" if kv.paged else "its cache slot read to its end"
    said = f"cache_seqlens[{b}] + the new keys" if kv.cu_q is None else f"seqused_k[{b}]"
    return [Reading(b, kv.table[b], whole, PAGED_PAST_LENGTH,
                    f"sequence {b} attended {whole} keys, {whole - m} past its {m} ({said}): {where}",
                    {"sequence": b, "keys": whole, "valid": m})]


def _off_by_one(kv: KVCache, b: int) -> List[Reading]:
    """Sequence b's keys counted one too many (the key after its last: in its last page, the next
    table entry's page, or its slot; past the end of its table row or its cache slot, the next
    sequence's first, which follows it in memory) or one too few (its last key left out)."""
    m, said = kv.m(b), (f"cache_seqlens[{b}] + the new keys" if kv.cu_q is None else f"seqused_k[{b}]")
    out = []
    if m > 1:
        out.append(Reading(b, kv.table[b], m - 1, CACHE_LENGTH_OFF, f"sequence {b} attended {m - 1} keys, not its {m} "
                           f"({said}): its last key, {m - 1}, left out", {"sequence": b, "keys": m - 1, "valid": m}))
    row, page = kv.table[b], m // kv.page_size
    if page >= row.size and b + 1 < kv.batch:  # (past its row: what follows it in memory, the next row's first)
        row = np.concatenate((row, kv.table[b + 1][:1]))
    if m and page < row.size and 0 <= int(row[page]) < kv.num_pages:
        out.append(Reading(b, row, m + 1, CACHE_LENGTH_OFF, f"sequence {b} attended {m + 1} keys, one past its "
                           f"{m} ({said}): key {m} read", {"sequence": b, "keys": m + 1, "valid": m}))
    return out


def _unseen(kv: KVCache, b: int) -> List[Reading]:
    """Sequence b's new keys left out of its attention: its cache's keys only, or all its keys read
    before the new ones were written (their slots' old values)."""
    u, n = kv.seqlens[b], kv.n_new
    if not n:
        return []
    detail = {"sequence": b, "cache_keys": u, "new_keys": n}
    new = "new key" if n == 1 else f"{n} new keys"
    places = f"key {u} holding" if n == 1 else f"keys {u}..{u + n - 1} holding"
    out = [Reading(b, kv.table[b], kv.m(b), NEW_KEYS_UNSEEN, f"sequence {b} attended its {kv.m(b)} keys before its "
                   f"{new} {'was' if n == 1 else 'were'} written ({places} the cache's old values)", detail,
                   before=True)]
    if u:
        out.append(Reading(b, kv.table[b], u, NEW_KEYS_UNSEEN, f"sequence {b} attended its cache's {u} keys without "
                           f"its {new}", detail))
    for k in (1, -1):
        out.append(Reading(b, kv.table[b], kv.m(b), CACHE_WRITE_OFFSET, f"sequence {b} attended its keys with its new "
                           f"keys written one key {'late' if k > 0 else 'early'} (at keys {u + k}..{u + k + n - 1})",
                           {**detail, "offset": k}, before=True, shift=k))
    return out


def _misread(kv: KVCache, b: int) -> List[Reading]:
    """Sequence b's keys read from the cache's pools laid out in another way than they are."""
    return [Reading(b, kv.table[b], kv.m(b), CACHE_LAYOUT_MISREAD, f"sequence {b} read {m.what}",
                    {"sequence": b, "read_as": m.what}, misread=i) for i, m in enumerate(kv.misreads())]


def _read_key(kv: KVCache, r: Reading) -> Tuple:
    """The pages a reading reads and its count of keys: two readings with one key read the same."""
    return tuple(int(p) for p in r.row[:-(-r.count // kv.page_size)]), r.count, r.before, r.shift, r.misread


def _same_keys(kv: KVCache, b: int, r: Reading, right_k: np.ndarray, right_v: np.ndarray) -> bool:
    """Whether a reading reads sequence b's right keys and values (a wrong page: that page's)."""
    if r.code == PAGED_WRONG_PAGE:
        n = min(kv.m(b), (r.detail["page_index"] + 1) * kv.page_size) - r.detail["page_index"] * kv.page_size
        at, right = r.detail["read"], r.detail["expected"]
        return (np.array_equal(kv.k_pages[at, :n], kv.k_pages[right, :n])
                and np.array_equal(kv.v_pages[at, :n], kv.v_pages[right, :n]))
    k, v = r.keys(kv)
    return k.shape == right_k.shape and np.array_equal(k, right_k) and np.array_equal(v, right_v)


def readings(kv: KVCache, b: int) -> List[Reading]:
    """The readings of sequence b a buggy program may make, each of keys other than the right ones,
    each read once (a wrong page kept over a shift that reads the same pages), at most MAX_SCREENED
    of a kind: past-length, a length off by one, shifts and other sequences' table rows first, then
    wrong pages, the last (partial) page first, then the pools read in other layouts."""
    wrong = sorted(_wrong_pages(kv, b), key=lambda r: -r.detail["page_index"]) if kv.paged else []
    rows = _shifts(kv, b) + _other_rows(kv, b) if kv.paged else []
    found = _unseen(kv, b) + _past_length(kv, b) + _off_by_one(kv, b) + rows + wrong + _misread(kv, b)
    right_k, right_v = kv.gather(b)
    out: Dict[Tuple, Reading] = {}
    kinds: Dict[str, int] = {}
    for r in found:
        key = _read_key(kv, r)
        if key in out:
            if r.code == PAGED_WRONG_PAGE and out[key].code != PAGED_WRONG_PAGE:
                out[key] = r
            continue
        if kinds.get(r.code, 0) >= MAX_SCREENED:
            continue
        if not _same_keys(kv, b, r, right_k, right_v):
            out[key] = r
            kinds[r.code] = kinds.get(r.code, 0) + 1
    return list(out.values())
