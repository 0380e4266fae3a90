"""A decode step against a KV cache, given as arrays in flash-attn's `flash_attn_with_kvcache`
layouts (the Python API's check_kvcache), read into packed sequences: each sequence's keys gathered
from the cache (through the block table of a paged cache) after the new keys are written, so the
step is checked by the packed engine as one sequence per batch entry.

Layouts (flash-attn's): q (B, nq, H, d), its nq queries aligned bottom-right against the keys;
a dense cache (B, max_seqlen, Hk, d), or a paged one, a pool (num_blocks, page_size, Hk, d) read
through block_table (B, max_blocks_per_seq), page j of sequence b holding its keys
[j·page_size, (j+1)·page_size); cache_seqlens (B,) the keys each sequence has before the step;
k_new, v_new (B, n_new, Hk, d) written at cache_seqlens[b] before attention, so sequence b
attends to its first cache_seqlens[b] + n_new keys. A dense cache is read as a pool of B pages of
max_seqlen keys, page b sequence b's.

Every refusal is one line naming the argument and what is wrong with it.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..sequences import Sequences, packed_sequences
from ..stages import STAGES
from ..text import plural
from .arrays import as_array, native_float
from .cache_layouts import CACHE_LAYOUTS, NHD, Misread, PoolLayout, misreads, other_fits, read_after, read_pools
from .packed_arrays import offsets

# The smallest page size of a paged cache (FA3 takes 1, vLLM 8 to 32, flash-attn 2 multiples of 256).
MIN_PAGE_SIZE = 1


def decode_stage(name: str) -> bool:
    """Whether a decode step returns `name`: a forward stage with a row per query and the output's
    columns or one (output, flash_output: flash-attn's out; flash_lse: its softmax_lse)."""
    s = STAGES.get(name)
    return s is not None and s.rows == "N" and s.cols in ("DV", "1") and not (s.backward or s.dropout)


KV_CACHE_STAGES = tuple(n for n in STAGES if decode_stage(n))
LAYOUT_WORDS = "(batch, queries, heads, dim)"


@dataclass
class KVCache:
    """One decode step's arrays, validated. k_pages and v_pages are the cache with the new keys
    written (what the attention reads); k_before and v_before the cache as given."""
    q: np.ndarray
    k_before: np.ndarray
    v_before: np.ndarray
    k_pages: np.ndarray
    v_pages: np.ndarray
    table: np.ndarray          # (B, pages per sequence); a dense cache: [[0], [1], ...]
    page_size: int
    seqlens: Tuple[int, ...]   # cache_seqlens: the keys before the step
    n_new: int
    paged: bool
    # A case of sequences with their own query counts (a paged input case, verify/check/paged.py
    # diagnose_paged_case): q packed (total_q, H, d), sequence b's rows cu_q[b]..cu_q[b+1]-1.
    # None: q (B, nq, H, d), nq queries each.
    cu_q: Optional[Tuple[int, ...]] = None
    # False: q was given (B, H, d), one query a sequence (vLLM's), and the stages drop that axis too.
    query_axis: bool = True
    layout: PoolLayout = CACHE_LAYOUTS[NHD]  # the cache's as given (read here as flash-attn's)
    given: Dict[str, Tuple[int, ...]] = field(default_factory=dict)  # k_cache's, v_cache's shapes as given
    _misreads: Optional[List[Misread]] = field(default=None, repr=False)

    @property
    def batch(self) -> int:
        return self.q.shape[0] if self.cu_q is None else len(self.cu_q) - 1

    @property
    def nq(self) -> int:
        return self.q.shape[1]

    def n(self, b: int) -> int:
        """The queries of sequence b."""
        return self.nq if self.cu_q is None else self.cu_q[b + 1] - self.cu_q[b]

    def q_span(self, b: int) -> Tuple[int, int]:
        """Sequence b's rows of the packed query tokens (and of the step's stages)."""
        start = b * self.nq if self.cu_q is None else self.cu_q[b]
        return start, start + self.n(b)

    def queries(self, b: int) -> np.ndarray:
        """Sequence b's queries, (n(b), H, d)."""
        return self.q[b] if self.cu_q is None else self.q[slice(*self.q_span(b))]

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[0]

    def m(self, b: int) -> int:
        """The keys sequence b attends to."""
        return self.seqlens[b] + self.n_new

    def pages_read(self, b: int) -> int:
        """The pages that hold sequence b's keys."""
        return -(-self.m(b) // self.page_size)

    def places(self, row: np.ndarray, count: int) -> Tuple[np.ndarray, np.ndarray]:
        """(page, slot) of keys 0..count-1 of a sequence read through table row `row`."""
        keys = np.arange(count)
        return np.asarray(row)[keys // self.page_size], keys % self.page_size

    def gather(self, b: int, row: Optional[np.ndarray] = None, count: Optional[int] = None, before: bool = False
               ) -> Tuple[np.ndarray, np.ndarray]:
        """The keys and values (count, Hk, d) sequence b reads through `row` (default: its own), from
        the cache after the step (before: the cache as given, the new keys not written)."""
        pages, slots = self.places(self.table[b] if row is None else row, self.m(b) if count is None else count)
        k, v = (self.k_before, self.v_before) if before else (self.k_pages, self.v_pages)
        return k[pages, slots], v[pages, slots]

    def sequences(self, lengths: List[int], queries: Optional[List[int]] = None) -> Sequences:
        """The packing of len(lengths) sequences of these keys and `queries` queries each (default
        the step's nq)."""
        queries = [self.nq] * len(lengths) if queries is None else queries
        cu_k = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64))).tolist()
        packing = packed_sequences(np.concatenate(([0], np.cumsum(queries, dtype=np.int64))).tolist(), cu_k)
        return replace(packing, from_cache=True)

    def misreads(self) -> List[Misread]:
        """The ways a kernel may read this cache (with the new keys) in another layout than its own;
        none for a folder's pool (given empty), one file per K/V head, whose heads and slots no
        program can swap."""
        if not self.given:
            return []
        if self._misreads is None:
            x = self.given["k_cache"][-1] if self.layout.key_dims == 5 else 0
            self._misreads = misreads(self.layout, x, self.paged)
        return self._misreads

    def after(self, name: str, after) -> np.ndarray:
        """The cache after the step (`name`: k_cache_after or v_cache_after) read as the cache given
        was (flash-attn's layout); ValueError for another shape than the cache's as given."""
        got = native_float(as_array(after, name), name)
        given = self.given.get(name[:7])
        return got if given is None else read_after(name, got, given, self.layout)

    def table_key(self, b: int, page: int, slot: int) -> int:
        """The key of sequence b that (page, slot) holds (past its keys: -1)."""
        hits = np.flatnonzero(self.table[b, :self.pages_read(b)] == page)
        return int(hits[0]) * self.page_size + slot if hits.size else -1

    def owner(self, page: int) -> Optional[Tuple[int, int]]:
        """(sequence, page index) whose table names `page` among the pages it reads, or None."""
        for b in range(self.batch):
            hits = np.flatnonzero(self.table[b, :self.pages_read(b)] == page)
            if hits.size:
                return b, int(hits[0])
        return None


# ----------------------------------------------------------------------------------------------
# Reading the arguments.

def _query(q) -> Tuple[np.ndarray, Tuple[int, ...]]:
    """q as (B, nq, H, d), and its shape as given ((B, H, d): one query a sequence, vLLM's)."""
    a = native_float(as_array(q, "q"), "q")
    if a.ndim not in (3, 4):
        raise ValueError(f"q is {tuple(a.shape)}: expected {LAYOUT_WORDS}, flash-attn's layout, or (batch, heads, "
                         "dim), one query a sequence")
    return (a[:, None] if a.ndim == 3 else a), tuple(a.shape)


def _caches(q, k_cache, v_cache, paged: bool, layout: PoolLayout) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q and the two caches (read as flash-attn's layout) checked against each other."""
    q, q_shape = _query(q)
    given = [native_float(as_array(x, n), n) for x, n in ((k_cache, "k_cache"), (v_cache, "v_cache"))]
    k, v = read_pools(*given, layout, paged)
    shapes = {"q": q_shape, "k_cache": given[0].shape, "v_cache": given[1].shape}
    what = ("{} pages", "a page size of {}") if paged else ("{} sequences", "{} slots per sequence")
    # (where the two pools' axes differ, as in vLLM's, each one's as that layout has it)
    axes = "" if layout.keys == layout.values else \
        f" (cache_layout={layout.name!r}: k_cache {layout.words(paged)}, v_cache {layout.words(paged, True)})"
    for axis, words in enumerate(what + ("{} K/V heads",)):
        if k.shape[axis] != v.shape[axis]:
            raise ValueError(f"k_cache has {words.format(k.shape[axis])}, v_cache {words.format(v.shape[axis])}: "
                             f"they must match{axes}")
    H, Hk = q.shape[2], k.shape[2]
    for name, a in (("q", q), ("k_cache", k), ("v_cache", v)):
        if 0 in a.shape[2:]:
            raise ValueError(f"{name} is {shapes[name]}: needs at least one head, of a width of at least 1")
    if Hk > H or H % Hk:
        raise ValueError(f"k_cache has {plural(Hk, 'K/V head')} and q {H}: grouped K/V heads must divide the "
                         "query heads")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"q's head dimension is {q.shape[3]}, k_cache's {k.shape[3]}: Q and K share it")
    if q.shape[1] < 1:
        raise ValueError(f"q is {q_shape}: a decode step has at least one query per sequence")
    if q.shape[0] < 1:
        raise ValueError(f"q is {q_shape}: a decode step has at least one sequence (batch >= 1)")
    if not paged and k.shape[1] < 1:
        raise ValueError(f"k_cache is {shapes['k_cache']}: a dense cache holds at least one slot per sequence "
                         "(max_seqlen >= 1)")
    return q, k, v


def _new_keys(k_new, v_new, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """k_new and v_new, (B, n_new, Hk, d) each; empty when neither is given."""
    if (k_new is None) != (v_new is None):
        given, missing = ("k_new", "v_new") if v_new is None else ("v_new", "k_new")
        raise ValueError(f"{given} without {missing}: pass both (flash-attn's k and v) or neither")
    B, Hk = q.shape[0], k.shape[2]
    if k_new is None:
        return np.zeros((B, 0) + k.shape[2:], k.dtype), np.zeros((B, 0) + v.shape[2:], v.dtype)
    out = []
    for name, x, cache in (("k_new", k_new, k), ("v_new", v_new, v)):
        given = native_float(as_array(x, name), name)
        a = given[:, None] if given.ndim == 3 else given  # (batch, kv_heads, dim): one new key each (vLLM's)
        if a.ndim != 4:
            raise ValueError(f"{name} is {tuple(given.shape)}: expected (batch, new keys, kv_heads, dim), or (batch, "
                             "kv_heads, dim) for one each")
        if a.shape[0] != B or a.shape[2:] != cache.shape[2:]:
            raise ValueError(f"{name} is {tuple(given.shape)}: expected " + (
                f"(batch, kv_heads, dim) = ({B}, {Hk}, {cache.shape[3]})" if given.ndim == 3 else
                f"(batch, new keys, kv_heads, dim) = ({B}, n, {Hk}, {cache.shape[3]})"))
        out.append(a)
    if out[0].shape[1] != out[1].shape[1]:
        raise ValueError(f"k_new has {plural(out[0].shape[1], 'new key')}, v_new {out[1].shape[1]}")
    return out[0], out[1]


def _seqlens(cache_seqlens, batch: int) -> Tuple[int, ...]:
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, (bool, np.bool_)):
        cache_seqlens = [cache_seqlens] * batch  # (flash-attn takes one int for every sequence)
    lengths = offsets("cache_seqlens", cache_seqlens)
    if lengths is None:
        raise ValueError("cache_seqlens: expected the keys each sequence holds before the step, (batch,)")
    if len(lengths) != batch:
        raise ValueError(f"cache_seqlens has {plural(len(lengths), 'value')} for a batch of {batch}")
    for b, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"cache_seqlens[{b}] = {n}: a count of keys is >= 0")
    return lengths


def _table(block_table, batch: int) -> np.ndarray:
    """The block table as given (its own integer type, so that an entry is shown as written: a
    uint64 2^64 − 1 is no −1), its shape and type checked."""
    t = as_array(block_table, "block_table")
    if t.ndim != 2 or t.dtype.kind not in "iu":
        raise ValueError(f"block_table: expected (batch, max_blocks_per_seq) of an integer type (int32, as "
                         f"flash-attn's), got {t.dtype} of shape {tuple(t.shape)}")
    if t.shape[0] != batch:
        raise ValueError(f"block_table has {plural(t.shape[0], 'row')} for a batch of {batch}")
    return t


def _fits(seqlens: Tuple[int, ...], n_new: int, capacity: int, where: str) -> None:
    for b, n in enumerate(seqlens):
        if n + n_new > capacity:
            raise ValueError(f"cache_seqlens[{b}] = {n} with {plural(n_new, 'new key')}: {n + n_new} keys, more "
                             f"than {where} ({capacity})")


def _table_entries(table: np.ndarray, seqlens, n_new: int, page_size: int, num_pages: int) -> None:
    """Every entry of the table that names a page a sequence reads is a page of the pool."""
    for b, n in enumerate(seqlens):
        for j in range(-(-(n + n_new) // page_size)):
            if not 0 <= table[b, j] < num_pages:
                raise ValueError(f"block_table[{b}, {j}] = {table[b, j]} is outside 0..{num_pages - 1} (k_cache "
                                 f"holds {plural(num_pages, 'page')}); sequence {b} reads it")


def _layout(k: np.ndarray, q: np.ndarray, block_table, seqlens, n_new: int, layout: PoolLayout
            ) -> Tuple[np.ndarray, int]:
    """The table and page size: a paged cache's, checked; a dense cache's, one page per sequence."""
    B, slots = q.shape[0], f"k_cache.shape[{layout.slot_axis}]"
    if block_table is None:
        if k.shape[0] != B:
            raise ValueError(f"k_cache holds {plural(k.shape[0], 'sequence')}, q {B}: a dense cache is "
                             f"{layout.dense_keys}; pass block_table= for a paged one")
        _fits(seqlens, n_new, k.shape[1], f"the cache's slots ({slots})")
        return np.arange(B, dtype=np.int64)[:, None], k.shape[1]
    table, page_size = _table(block_table, B), k.shape[1]
    if page_size < MIN_PAGE_SIZE:
        raise ValueError(f"k_cache's page size is {page_size} ({slots}): a page holds at least "
                         f"{plural(MIN_PAGE_SIZE, 'key')}")
    _fits(seqlens, n_new, table.shape[1] * page_size,
          f"the {plural(table.shape[1], 'page')} of {page_size} that block_table gives each sequence")
    _table_entries(table, seqlens, n_new, page_size, k.shape[0])
    return table.astype(np.int64), page_size  # (an entry no sequence reads may wrap: it is never used)


def kv_cache(q, k_cache, v_cache, cache_seqlens, block_table=None, k_new=None, v_new=None, layout: str = NHD
             ) -> KVCache:
    """The step's arrays validated, and the cache as the attention reads it (the new keys written);
    the cache in CACHE_LAYOUTS[layout]. A refusal of arrays that another layout would take says so."""
    paged = block_table is not None
    # (tensors read into NumPy once, whichever layouts the arrays are tried in)
    q, k_cache, v_cache, k_new, v_new = (x if x is None else native_float(as_array(x, name), name) for x, name in
                                         ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache"), (k_new, "k_new"),
                                          (v_new, "v_new")))

    def read(pools: PoolLayout, check_only: bool = False) -> KVCache:
        return _read(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, pools, check_only)

    def fits(other: PoolLayout) -> bool:
        try:
            read(other, check_only=True)
        except (ValueError, TypeError):
            return False
        return True
    try:
        return read(CACHE_LAYOUTS[layout])
    except ValueError as e:
        raise ValueError(f"{e}{other_fits(fits, CACHE_LAYOUTS[layout], paged)}") from None


def _read(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, layout: PoolLayout,
          check_only: bool = False) -> KVCache:
    """kv_cache's KVCache in `layout`; check_only: the arrays checked, the cache not copied nor the
    new keys written (its pools are then the arrays as given)."""
    q_axis = np.ndim(q) != 3
    q, k, v = _caches(q, k_cache, v_cache, block_table is not None, layout)
    k_add, v_add = _new_keys(k_new, v_new, q, k, v)
    seqlens = _seqlens(cache_seqlens, q.shape[0])
    table, page_size = _layout(k, q, block_table, seqlens, k_add.shape[1], layout)
    if not any(seqlens) and not k_add.shape[1]:
        raise ValueError("cache_seqlens are all 0 and there are no new keys (k_new): no sequence has a key to "
                         "attend to")
    given = {"k_cache": np.shape(k_cache), "v_cache": np.shape(v_cache), "k_new": np.shape(k_new)}
    kv = KVCache(q, k, v, k if check_only else k.copy(), v if check_only else v.copy(), table, page_size, seqlens,
                 k_add.shape[1], block_table is not None, query_axis=q_axis, layout=layout, given=given)
    _no_shared_slot(kv)
    if check_only:
        return kv
    for b in range(kv.batch):
        pages, slots = kv.places(table[b], kv.m(b))
        pages, slots = pages[seqlens[b]:], slots[seqlens[b]:]
        kv.k_pages[pages, slots], kv.v_pages[pages, slots] = k_add[b], v_add[b]
    return kv


def _no_shared_slot(kv: KVCache) -> None:
    """No two sequences write their new keys to one slot (a table that aliases pages)."""
    owner: Dict[Tuple[int, int], Tuple[int, int]] = {}
    for b in range(kv.batch):
        pages, slots = kv.places(kv.table[b], kv.m(b))
        for t in range(kv.seqlens[b], kv.m(b)):
            at = (int(pages[t]), int(slots[t]))
            if at in owner and owner[at][0] != b:
                c, u = owner[at]
                raise ValueError(f"block_table: sequences {c} and {b} both write a new key to page {at[0]}, slot "
                                 f"{at[1]} (block_table[{c}, {u // kv.page_size}] = block_table[{b}, "
                                 f"{t // kv.page_size}] = {at[0]}): their new keys would overwrite each other")
            owner[at] = (b, t)


# ----------------------------------------------------------------------------------------------
# The cache after the step: the new keys written at cache_seqlens[b] through the table, every
# other slot as it was.

def _place(kv: KVCache, page: int, slot: int) -> Tuple[Optional[int], str]:
    """(the sequence, the words) of a slot of the cache."""
    if not kv.paged:
        return page, f"sequence {page}, slot {slot}"
    own = kv.owner(page)
    if own is None:
        return None, f"page {page} (no sequence reads it), slot {slot}"
    b, j = own
    return b, f"sequence {b}, page {page} (block_table[{b}, {j}]), slot {slot} (key {j * kv.page_size + slot})"


def cache_after_problem(kv: KVCache, name: str, after) -> Optional[Tuple[str, dict]]:
    """What is wrong with the program's cache after the step (`name`: k_cache_after or
    v_cache_after), compared exactly with the cache given and the new keys written; None when it
    is right. ValueError for a shape that is not the cache's."""
    want = kv.k_pages if name.startswith("k") else kv.v_pages
    before = kv.k_before if name.startswith("k") else kv.v_before
    got = native_float(as_array(after, name), name)
    if got.shape != want.shape:
        raise ValueError(f"{name} is {tuple(got.shape)}, the cache {tuple(want.shape)}: the cache after the step "
                         "has the cache's shape")
    g, w = got.astype(np.float64), want.astype(np.float64)
    bad = ~((g == w) | (np.isnan(g) & np.isnan(w)))
    if not bad.any():
        return None
    page, slot, head, col = (int(i) for i in np.argwhere(bad)[0])
    b, where = _place(kv, page, slot)
    written = b is not None and kv.seqlens[b] <= kv.table_key(b, page, slot) < kv.m(b)
    at = (page, slot, head, col)
    if written:
        t = kv.table_key(b, page, slot) - kv.seqlens[b]
        index = f"{b}, {head}, {col}" if len(kv.given.get("k_new", ())) == 3 else f"{b}, {t}, {head}, {col}"
        why = f"holds {g[at]:.9g}, the new key written there is {w[at]:.9g} ({name[0]}_new[{index}])"
    else:
        why = f"changed from {float(before[at]):.9g} to {g[at]:.9g}; only the new keys' slots change"
    count = int(bad.sum())
    more = f" ({plural(count, 'entry', 'entries')} differ)" if count > 1 else ""
    return (f"{name}: {where}, K/V head {head}, column {col}: {why}{more}",
            {"sequence": b, "page": page, "slot": slot, "kv_head": head, "col": col, "mismatched": count})
