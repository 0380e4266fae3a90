"""The memory layouts of a KV cache that check_kvcache reads (its cache_layout=): each one's axes of
the key and the value pool, read as flash-attn's (num_blocks, page_size, kv_heads, dim), the layout
the rest of the check uses (verify/files/kv_cache.py). Paged kernels disagree on this layout more
than on anything else: flash-attn and vLLM's FlashAttention backend keep a page's slots outermost,
FlashInfer offers its heads outermost (HND), and vLLM's paged_attention kernels split each key row
into vectors of x values (16 bytes) behind the page's slots so that a thread reads one at a time.

A layout's arrays are read as views where a transpose does it (vLLM's keys, whose vectors are
joined into rows, are copied); the words name the axes as the layout's authors do, so that a
refusal reads in the user's terms.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

NHD, HND, VLLM = "nhd", "hnd", "vllm"


@dataclass(frozen=True)
class PoolLayout:
    """One cache layout: whose it is, the axes of k_cache and v_cache (paged, and dense where it
    has a dense form), the axis of k_cache that counts a page's slots, and the reads into flash-attn's
    (pages, slots, kv_heads, dim)."""
    name: str
    whose: str
    keys: str
    values: str
    dense_keys: Optional[str]      # None: paged only
    slot_axis: int
    read_keys: Callable[[np.ndarray], np.ndarray]
    read_values: Callable[[np.ndarray], np.ndarray]
    key_dims: int = 4

    def words(self, paged: bool, values: bool = False) -> str:
        """The shape `cache_layout=` asks of k_cache (values: of v_cache)."""
        if not paged:
            return self.dense_keys or ""
        return self.values if values else self.keys


def _vllm_keys(k: np.ndarray) -> np.ndarray:
    """(num_blocks, kv_heads, dim / x, block_size, x) as (num_blocks, block_size, kv_heads, dim)."""
    blocks, heads, vectors, slots, x = k.shape
    return k.transpose(0, 3, 1, 2, 4).reshape(blocks, slots, heads, vectors * x)


def _heads_first(a: np.ndarray) -> np.ndarray:
    return a.transpose(0, 2, 1, 3)


CACHE_LAYOUTS: Dict[str, PoolLayout] = {layout.name: layout for layout in (
    PoolLayout(NHD, "flash-attn's, vLLM's FlashAttention backend's, FlashInfer's NHD",
               "(num_blocks, page_size, kv_heads, dim)", "(num_blocks, page_size, kv_heads, dim)",
               "(batch, max_seqlen, kv_heads, dim)", 1, lambda k: k, lambda v: v),
    PoolLayout(HND, "FlashInfer's HND", "(num_blocks, kv_heads, page_size, dim)",
               "(num_blocks, kv_heads, page_size, dim)", "(batch, kv_heads, max_seqlen, dim)", 2,
               _heads_first, _heads_first),
    PoolLayout(VLLM, "vLLM's paged_attention kernels'", "(num_blocks, kv_heads, dim / x, block_size, x)",
               "(num_blocks, kv_heads, dim, block_size)", None, 3, _vllm_keys,
               lambda v: v.transpose(0, 3, 1, 2), key_dims=5),
)}


@dataclass(frozen=True)
class Misread:
    """A way a kernel reads a pool in a layout other than the one it is in: `what` says how; keys
    and values take pages of a pool (flash-attn's layout) to those pages as it then reads them, None
    where it reads that pool right. Every layout keeps a page's values within the page, so a
    misread page is made of that page alone: a reading converts only the pages it reads."""
    what: str
    keys: Optional[Callable[[np.ndarray], np.ndarray]]
    values: Optional[Callable[[np.ndarray], np.ndarray]]


def _as_written(layout: PoolLayout, pool: np.ndarray, values: bool, x: int) -> np.ndarray:
    """A pool in flash-attn's layout (pages, slots, kv_heads, dim) laid out in memory as `layout`
    keeps it (the inverse of its read)."""
    if layout.name == HND:
        return np.ascontiguousarray(_heads_first(pool))
    if layout.name == VLLM:
        P, S, Hk, d = pool.shape
        raw = pool.transpose(0, 2, 3, 1) if values else pool.reshape(P, S, Hk, d // x, x).transpose(0, 2, 3, 1, 4)
        return np.ascontiguousarray(raw)
    return np.ascontiguousarray(pool)


def _misreaders(layout: PoolLayout, x: int, paged: bool
                 ) -> List[Tuple[bool, str, Callable[[np.ndarray, tuple], np.ndarray]]]:
    """(values?, how, read(the pool's memory, (P, S, Hk, d)) -> the pool as the kernel reads it)."""
    as_nhd = lambda raw, shape: raw.reshape(shape)  # noqa: E731
    as_hnd = lambda raw, shape: _heads_first(raw.reshape(shape[0], shape[2], shape[1], shape[3]))  # noqa: E731
    if layout.name == NHD:
        heads_first = f"as {CACHE_LAYOUTS[HND].words(paged)}, heads before slots"
        return [(False, heads_first, as_hnd), (True, heads_first, as_hnd)]
    if layout.name == HND:
        slots_first = f"as {CACHE_LAYOUTS[NHD].words(paged)}, slots before heads"
        return [(False, slots_first, as_nhd), (True, slots_first, as_nhd)]

    def swapped(raw, shape):  # value j·(d/x) + i of a key row read from its vector i, lane j
        P, S, Hk, d = shape
        return raw.transpose(0, 3, 1, 4, 2).reshape(P, S, Hk, d)
    return [(False, f"as (num_blocks, kv_heads, block_size, head_size), without their rows' split into vectors of "
                    f"x = {x}", as_hnd),
            (False, f"with each row's vectors and their x = {x} lanes swapped (value j·(head_size / x) + i read "
                    "from vector i, lane j)", swapped),
            (True, "as (num_blocks, kv_heads, block_size, head_size), where they are (num_blocks, kv_heads, "
                   "head_size, block_size)", as_hnd)]


def misreads(layout: PoolLayout, x: int, paged: bool) -> List[Misread]:
    """The ways a kernel may read a cache of this layout (x: vLLM's values a vector) in another:
    each pool's alone, and each misread of the keys with each of the values."""
    keys, values = [], []
    for is_values, how, read in _misreaders(layout, x, paged):
        def misread(pages: np.ndarray, read=read, is_values=is_values) -> np.ndarray:
            return read(_as_written(layout, pages, is_values, x), pages.shape)
        (values if is_values else keys).append((how, misread))
    return ([Misread(f"its keys {how}", kp, None) for how, kp in keys]
            + [Misread(f"its values {how}", None, vp) for how, vp in values]
            + [Misread(f"its keys {kh} and its values {vh}", kp, vp) for kh, kp in keys for vh, vp in values])


def read_pools(k: np.ndarray, v: np.ndarray, layout: PoolLayout, paged: bool) -> Tuple[np.ndarray, np.ndarray]:
    """k_cache and v_cache (floating arrays) as flash-attn's (pages, slots, kv_heads, dim); ValueError
    naming the argument whose axes are not the layout's."""
    if not paged and layout.dense_keys is None:
        raise ValueError(f"cache_layout={layout.name!r} ({layout.whose}) is a paged cache: pass block_table=")
    tail = "" if paged else ", or pages with block_table="
    for name, a, dims, values in (("k_cache", k, layout.key_dims, False), ("v_cache", v, 4, True)):
        if a.ndim != dims:
            raise ValueError(f"{name} is {tuple(a.shape)}: expected {layout.words(paged, values)}"
                             + (" with block_table" if paged and layout.dense_keys else tail))
    return layout.read_keys(k), layout.read_values(v)


def read_after(name: str, after: np.ndarray, given: Tuple[int, ...], layout: PoolLayout) -> np.ndarray:
    """The cache after the step (`name`: k_cache_after or v_cache_after) in flash-attn's layout, read
    as the cache before it was (its shape as passed: `given`); ValueError for another shape."""
    if tuple(after.shape) != tuple(given):
        raise ValueError(f"{name} is {tuple(after.shape)}, the cache {tuple(given)}: the cache after the step "
                         "has the cache's shape")
    return layout.read_keys(after) if name.startswith("k") else layout.read_values(after)


def other_fits(fits: Callable[[PoolLayout], bool], layout: PoolLayout, paged: bool) -> str:
    """Words for the other layouts under which the arrays would be a cache (fits(layout) true),
    for a refusal under `layout`: '' when none is."""
    others = [o for o in CACHE_LAYOUTS.values() if o is not layout and (paged or o.dense_keys) and fits(o)]
    return "".join(f"; the arrays would fit cache_layout={o.name!r} ({o.whose}: k_cache {o.words(paged)})"
                   for o in others)


__all__ = ["NHD", "HND", "VLLM", "PoolLayout", "CACHE_LAYOUTS", "Misread", "misreads", "read_pools", "read_after",
           "other_fits"]
