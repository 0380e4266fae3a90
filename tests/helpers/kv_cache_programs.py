"""A float32 NumPy decode step against a KV cache, written from flash-attn's flash_attn_with_kvcache
semantics (not from verify/): the new keys written into the cache at cache_seqlens[b] (through the
block table of a paged cache), then each sequence's nq queries attend to its first
cache_seqlens[b] + n_new keys, aligned bottom-right (query i sees keys j <= i + m - nq when causal).
It returns what flash-attn returns: out (B, nq, H, d), softmax_lse (B, H, nq), and the cache after
the step. A bug changes what it reads or writes (BUGS names each).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import numpy as np

f32 = np.float32

BUGS = {
    "wrong_page": "sequence 1's page 1 read from the pool's next page",
    "other_sequence_page": "sequence 1's page 0 read from sequence 0's page 0",
    "page_shift": "every page of sequence 1 read one page further in the pool",
    "other_sequence_row": "sequence 1's pages read through sequence 2's row of the block table",
    "other_sequence_entry": "sequence 1's last page read through sequence 2's row at the same index (past "
                            "sequence 2's pages: its padding entry)",
    "past_length": "each sequence's last page read to its end (keys past cache_seqlens + n_new attended)",
    "past_length_0": "sequence 0's last page read to its end (the other sequences right)",
    "page_before": "sequence 1's page 0 read from the pool's page before it",
    "length_plus_one": "sequence 1 attends one key past its length (its length taken as one more)",
    "length_minus_one": "sequence 1 leaves its last key out (its length taken as one less)",
    "lengths_plus_one": "every sequence attends one key past its length (a loop's <= for <)",
    "new_keys_unseen": "sequence 1 attends its cache's keys only, not the step's new ones",
    "scaled": "every output 1.01 times the right one (lse right)",
    "lse_log2": "the lse in base 2 (the output right)",
    "noise": "sequence 0's output off by 1% noise (lse right)",
    "write_offset": "the new keys written one slot late in the cache",
    "write_other_slot": "an unrelated slot of the cache overwritten",
}


@dataclass
class DecodeCase:
    """A decode step: sequences' cached keys, new keys, queries; a dense cache when page_size is None."""
    seqlens: Sequence[int]
    n_new: int = 0
    nq: int = 1
    heads: int = 4
    kv_heads: int = 2
    d: int = 16
    page_size: Optional[int] = 16
    spare_pages: int = 3
    causal: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        B, Hk, d = len(self.seqlens), self.kv_heads, self.d
        m = [n + self.n_new for n in self.seqlens]
        if self.page_size is None:
            slots = max(m) + 5
            self.k_cache = rng.standard_normal((B, slots, Hk, d)).astype(f32)
            self.block_table = None
        else:
            per_seq = max(-(-x // self.page_size) for x in m) + 1
            pages = B * per_seq + self.spare_pages
            self.k_cache = rng.standard_normal((pages, self.page_size, Hk, d)).astype(f32)
            self.block_table = rng.permutation(pages)[:B * per_seq].reshape(B, per_seq).astype(np.int32)
        self.v_cache = rng.standard_normal(self.k_cache.shape).astype(f32)
        self.q = rng.standard_normal((B, self.nq, self.heads, d)).astype(f32)
        self.k_new = rng.standard_normal((B, self.n_new, Hk, d)).astype(f32) if self.n_new else None
        self.v_new = rng.standard_normal((B, self.n_new, Hk, d)).astype(f32) if self.n_new else None

    @property
    def batch(self) -> int:
        return len(self.seqlens)

    def arguments(self) -> Dict[str, object]:
        """check_kvcache's keyword arguments for this case."""
        return dict(cache_seqlens=np.asarray(self.seqlens, np.int32), block_table=self.block_table,
                    k_new=self.k_new, v_new=self.v_new, causal=self.causal)


def _where(case: DecodeCase, table, b: int, key: int):
    """(page, slot) of key `key` of sequence b; past the end of its slot or table row, what follows
    in memory (the next sequence's slot, or the next row's entries), as a read out of bounds is."""
    if table is None:
        slots = case.k_cache.shape[1]
        return b + key // slots, key % slots
    width = np.shape(table)[1]
    return int(np.asarray(table).reshape(-1)[b * width + key // case.page_size]), key % case.page_size


def _write(case: DecodeCase, bug: Optional[str]):
    k, v = case.k_cache.copy(), case.v_cache.copy()
    late = 1 if bug == "write_offset" else 0
    for b in range(case.batch):
        for t in range(case.n_new):
            at = _where(case, case.block_table, b, case.seqlens[b] + t + late)
            k[at], v[at] = case.k_new[b, t], case.v_new[b, t]
    if bug == "write_other_slot":
        k[-1, -1, 0, 0] += 1.0
    return k, v


def _table_read(case: DecodeCase, bug: Optional[str]):
    """The table the program reads through (a paged bug changes sequence 1's row)."""
    if case.block_table is None:
        return None
    t = case.block_table.astype(np.int64).copy()
    if bug == "wrong_page":
        t[1, 1] += 1
    elif bug == "other_sequence_page":
        t[1, 0] = t[0, 0]
    elif bug == "page_shift":
        t[1] += 1
    elif bug == "page_before":
        t[1, 0] -= 1
    elif bug == "other_sequence_row":
        t[1] = t[2]
    elif bug == "other_sequence_entry":
        last = (case.seqlens[1] + case.n_new - 1) // case.page_size
        t[1, last] = t[2, last]
    return t


def _read(case: DecodeCase, k_pool, v_pool, table, b: int, bug: Optional[str]):
    """(keys (count, Hk, d), values, m, count) sequence b attends: its m keys, or count read."""
    m = case.seqlens[b] + case.n_new
    count = m
    if (bug == "past_length" or bug == "past_length_0" and b == 0) and case.page_size is not None:
        count = -(-m // case.page_size) * case.page_size
    if (b == 1 and bug in ("length_plus_one", "length_minus_one")) or bug == "lengths_plus_one":
        m = count = m + (1 if bug in ("length_plus_one", "lengths_plus_one") else -1)
    if b == 1 and bug == "new_keys_unseen":
        m = count = case.seqlens[b]
    places = [_where(case, table, b, j) for j in range(count)]
    return np.stack([k_pool[p] for p in places]), np.stack([v_pool[p] for p in places]), m, count


def _scores(case: DecodeCase, b: int, h: int, keys: np.ndarray, m: int, count: int) -> np.ndarray:
    """Query head h's scaled scores over the keys read, masked bottom-right when causal."""
    nq, group = case.q.shape[1], case.heads // case.kv_heads
    s = (case.q[b, :, h] @ keys[:, h // group].T) * f32(1 / np.sqrt(case.d))
    if case.causal:
        i, j = np.arange(nq)[:, None], np.arange(count)[None, :]
        s = np.where(j <= i + m - nq, s, -np.inf).astype(f32)
    return s


def _attend(s: np.ndarray, vals: np.ndarray):
    """(output, lse) over the scores' keys; a row that sees none: 0 and −inf."""
    mx = s.max(axis=1, keepdims=True, initial=-np.inf)
    safe = np.where(np.isfinite(mx), mx, f32(0))
    p = np.exp(s - safe).astype(f32)
    total = p.sum(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(total > 0, (p / np.where(total > 0, total, 1)) @ vals, f32(0))
        return out, np.where(total > 0, safe + np.log(total), -np.inf)[:, 0]


def decode(case: DecodeCase, bug: Optional[str] = None):
    """(out, lse, k_cache_after, v_cache_after) as the program computes them."""
    k_pool, v_pool = _write(case, bug)
    table = _table_read(case, bug)
    B, nq, H, d = case.q.shape
    group = H // case.kv_heads
    out = np.zeros((B, nq, H, d), f32)
    lse = np.zeros((B, H, nq), f32)
    for b in range(B):
        keys, vals, m, count = _read(case, k_pool, v_pool, table, b, bug)
        for h in range(H):
            out[b, :, h], lse[b, h] = _attend(_scores(case, b, h, keys, m, count), vals[:, h // group])
    if bug == "scaled":
        out *= f32(1.01)
    elif bug == "lse_log2":
        lse /= f32(np.log(2))
    elif bug == "noise":
        out[0] += (0.01 * np.abs(out[0]).max() * np.random.default_rng(1).standard_normal(out[0].shape)).astype(f32)
    return out, lse, k_pool, v_pool


def decode_splits(case: DecodeCase, split_size: int, bug: Optional[str] = None):
    """A flash-decoding step's splits as flash-attn lays them out: out_accum (S, B, H, nq, d), each
    split's output over the keys [s·K, (s+1)·K) it read, normalised by its own sum, and lse_accum
    (S, B, H, nq); S = ⌈most keys / K⌉; a row that sees no key of a split: 0 and −inf."""
    k_pool, v_pool = _write(case, bug)
    table = _table_read(case, bug)
    B, nq, H, d = case.q.shape
    group = H // case.kv_heads
    S = max(1, -(-max(n + case.n_new for n in case.seqlens) // split_size))
    out = np.zeros((S, B, H, nq, d), f32)
    lse = np.full((S, B, H, nq), -np.inf, f32)
    for b in range(B):
        keys, vals, m, count = _read(case, k_pool, v_pool, table, b, bug)
        for h in range(H):
            s = _scores(case, b, h, keys, m, count)
            for sp in range(S):
                cols = slice(sp * split_size, min(count, (sp + 1) * split_size))
                if cols.start < cols.stop:
                    out[sp, b, h], lse[sp, b, h] = _attend(s[:, cols], vals[cols, h // group])
    return out, lse
