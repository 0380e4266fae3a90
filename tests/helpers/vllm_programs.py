"""A float32 NumPy decode step written the way vLLM's paged_attention kernels read their cache (from
vLLM's documented layouts, not from verify/): key_cache (num_blocks, num_kv_heads, head_size / x,
block_size, x), x values of 16 bytes a vector; value_cache (num_blocks, num_kv_heads, head_size,
block_size); query and out (num_seqs, num_heads, head_size), one query a sequence; seq_lens counting
the keys each sequence attends, the current token's included (its key and value written into the
cache beforehand, by reshape_and_cache, at slot_mapping). A bug changes what it reads or writes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

f32 = np.float32

BUGS = {
    "wrong_block": "sequence 1's second block read from the block number after it",
    "past_length": "every sequence's last block read to its end",
    "vector_order": "each key row read with its vectors and their lanes swapped (head_size / x by x read as x by "
                    "head_size / x)",
    "keys_unsplit": "key_cache read as (num_blocks, kv_heads, block_size, head_size), its x split left out",
    "values_transposed": "value_cache read as (num_blocks, kv_heads, block_size, head_size)",
    "write_offset": "reshape_and_cache writes the new token one slot late",
    "lengths_plus_one": "every sequence attends one key past its seq_lens (a loop's <= for <)",
    "not_rescaled": "paged_attention_v2's reduce sums the partitions' exp_sums without rescaling them to the global "
                    "maximum",
}


def bf16(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), kept in float32."""
    u = np.ascontiguousarray(a, f32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(f32).reshape(np.shape(a))


@dataclass
class VllmCase:
    """seq_lens: the keys each sequence attends after the step's token is written."""
    seq_lens: Sequence[int]
    heads: int = 4
    kv_heads: int = 2
    head_size: int = 16
    block_size: int = 16
    x: int = 4           # values per 16-byte vector: 4 at float32 (8 at float16)
    seed: int = 0
    half: bool = False   # bf16 values (held in float32): inputs, the weights before P·V and the output

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        B, Hk, d, S, x = len(self.seq_lens), self.kv_heads, self.head_size, self.block_size, self.x
        per_seq = max(-(-n // S) for n in self.seq_lens) + 1
        blocks = B * per_seq + 2
        self.key_cache = rng.standard_normal((blocks, Hk, d // x, S, x)).astype(f32)
        self.value_cache = rng.standard_normal((blocks, Hk, d, S)).astype(f32)
        self.block_tables = rng.permutation(blocks)[:B * per_seq].reshape(B, per_seq).astype(np.int32)
        self.query = rng.standard_normal((B, self.heads, d)).astype(f32)
        self.key = rng.standard_normal((B, Hk, d)).astype(f32)    # the step's token, one a sequence
        self.value = rng.standard_normal((B, Hk, d)).astype(f32)
        if self.half:
            for name in ("key_cache", "value_cache", "query", "key", "value"):
                setattr(self, name, bf16(getattr(self, name)))


def reshape_and_cache(case: VllmCase, bug: Optional[str] = None):
    """The caches with each sequence's token written at its slot (seq_lens[b] − 1)."""
    k, v = case.key_cache.copy(), case.value_cache.copy()
    S, x = case.block_size, case.x
    for b, n in enumerate(case.seq_lens):
        t = n - 1 + (bug == "write_offset")
        block, off = case.block_tables[b, t // S], t % S
        k[block, :, :, off, :] = case.key[b].reshape(case.kv_heads, -1, x)
        v[block, :, :, off] = case.value[b]
    return k, v


def paged_attention(case: VllmCase, key_cache: np.ndarray, value_cache: np.ndarray, bug: Optional[str] = None):
    """out (num_seqs, num_heads, head_size) over each sequence's seq_lens[b] keys."""
    B, H, d = case.query.shape
    S, group, scale = case.block_size, H // case.kv_heads, f32(1 / np.sqrt(d))
    out = np.zeros((B, H, d), f32)
    for b, n in enumerate(case.seq_lens):
        count = -(-n // S) * S if bug == "past_length" else n + (bug == "lengths_plus_one")
        for h in range(H):
            kv = h // group
            logits = np.empty(count, f32)
            rows = []
            k_flat, v_flat = key_cache.reshape(key_cache.shape[0], -1), value_cache.reshape(value_cache.shape[0], -1)
            for t in range(count):
                block = case.block_tables[b, t // S] + (bug == "wrong_block" and b == 1 and t // S == 1)
                vectors = key_cache[block, kv, :, t % S, :]       # (head_size / x, x)
                k = (vectors.T if bug == "vector_order" else vectors).reshape(d)
                if bug == "keys_unsplit":  # the block's memory read as (kv_heads, block_size, head_size)
                    k = k_flat[block].reshape(case.kv_heads, S, d)[kv, t % S]
                logits[t] = f32(np.dot(case.query[b, h], k)) * scale
                rows.append(v_flat[block].reshape(case.kv_heads, S, d)[kv, t % S] if bug == "values_transposed"
                            else value_cache[block, kv, :, t % S])
            p = np.exp(logits - logits.max()).astype(f32)
            p = p / p.sum()
            out[b, h] = (bf16(p) if case.half else p) @ np.stack(rows)
    return bf16(out) if case.half else out


def paged_attention_v2(case: VllmCase, key_cache: np.ndarray, value_cache: np.ndarray, partition: int,
                       bug: Optional[str] = None):
    """vLLM's paged_attention_v2: each sequence's keys in partitions of `partition`, per partition
    tmp_out (num_seqs, num_heads, max_num_partitions, head_size) normalised by its own exp_sum, its
    max_logits and exp_sums (num_seqs, num_heads, max_num_partitions), then the reduce's out. The
    partitions past a sequence's keys are never written: they hold what the buffers held (garbage)."""
    B, H, d = case.query.shape
    S, group, scale = case.block_size, H // case.kv_heads, f32(1 / np.sqrt(d))
    P = -(-max(case.seq_lens) // partition)
    rng = np.random.default_rng(99)
    tmp_out = rng.standard_normal((B, H, P, d)).astype(f32) * f32(1e3)
    max_logits, exp_sums = (rng.standard_normal((B, H, P)).astype(f32) for _ in range(2))
    out = np.zeros((B, H, d), f32)
    for b, n in enumerate(case.seq_lens):
        blocks = [case.block_tables[b, t // S] + (bug == "wrong_block" and b == 1 and t // S == 1) for t in range(n)]
        keys = np.stack([key_cache[blk, :, :, t % S, :].reshape(case.kv_heads, d) for t, blk in enumerate(blocks)])
        vals = np.stack([value_cache[blk, :, :, t % S] for t, blk in enumerate(blocks)])
        used = -(-n // partition)
        for h in range(H):
            logits = (keys[:, h // group] @ case.query[b, h]).astype(f32) * scale
            for i in range(used):
                part = slice(i * partition, min(n, (i + 1) * partition))
                m = logits[part].max()
                p = np.exp(logits[part] - m).astype(f32)
                max_logits[b, h, i], exp_sums[b, h, i] = m, p.sum()
                tmp_out[b, h, i] = (p / p.sum()) @ vals[part, h // group]
            top = max_logits[b, h, :used].max()
            weights = exp_sums[b, h, :used] * (1 if bug == "not_rescaled" else np.exp(max_logits[b, h, :used] - top))
            out[b, h] = (weights / weights.sum()).astype(f32) @ tmp_out[b, h, :used]
    return tmp_out, max_logits, exp_sums, out
