"""A decode step's stages and splits as check_kvcache takes them (flash-attn's layouts, or without
the queries' axis where q came as (batch, heads, dim), one query a sequence), in the packed layout
the packed engine checks: one sequence per batch entry, its queries the packed rows.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np

from ..stages import SPLIT_LSE, SPLIT_OUTPUT, STAGES, split_count
from ..text import plural
from .arrays import as_array, native_float
from .cache_layouts import VLLM
from .kv_cache import KV_CACHE_STAGES, LAYOUT_WORDS, KVCache, decode_stage
from .split_files import trailing_empty_left_out


def step_stages(kv: KVCache, stages: Dict[str, object]) -> Dict[str, np.ndarray]:
    """The step's stages in the packed layout: output and flash_output (B, nq, H, d) as (B·nq, H,
    d); flash_lse (B, H, nq) as (H, B·nq). Where q came without its query axis, (B, H, d) and (B, H)."""
    unknown = [n for n in stages if not decode_stage(n)]
    if unknown:
        raise ValueError(f"stage {unknown[0]!r}: a decode step is checked on {', '.join(KV_CACHE_STAGES)}")
    B, nq, H, _ = kv.q.shape
    out = {}
    for name, x in stages.items():
        a = native_float(as_array(x, name), name)
        lse = STAGES[name].cols == "1"
        want = (B, H, nq) if lse else (B, nq, H, kv.v_pages.shape[3])
        words = "(batch, heads, queries)" if lse else LAYOUT_WORDS
        if not kv.query_axis:  # (q as (batch, heads, dim): the stages without the queries' axis too)
            want, words = (want[:2], "(batch, heads)") if lse else (want[:1] + want[2:], "(batch, heads, dim)")
        if tuple(a.shape) != want:
            raise ValueError(f"{name} is {tuple(a.shape)}: expected {words} = {want}")
        a = a.reshape((B, H, nq) if lse else (B, nq, H, want[-1]))
        out[name] = a.transpose(1, 0, 2).reshape(H, B * nq) if lse else a.reshape(B * nq, H, want[-1])
    return out


def step_splits(kv: KVCache, splits) -> Optional[Tuple[Optional[np.ndarray], Optional[np.ndarray], int]]:
    """check_arrays' split triple (split_output, split_lse, split_size) in the packed layout, from
    flash-attn's split layouts of a decode step: out_accum (S, B, H, nq, d) as (S, B·nq, H, d) and
    lse_accum (S, B, H, nq) as (S, H, B·nq), S = ⌈most keys a sequence attends / K⌉ (where q came
    without its query axis, (S, B, H, d) and (S, B, H)); None for none."""
    if splits is None:
        return None
    if kv.layout.name == VLLM:
        return _vllm_partitions(kv, splits)
    B, nq, H, _ = kv.q.shape
    size, d = splits[2], kv.v_pages.shape[3]
    S = split_count(max(kv.m(b) for b in range(kv.batch)), size)
    out = []
    # (q given as (batch, heads, dim): the splits without the queries' axis too)
    axis, named = ((nq,), ", queries") if kv.query_axis else ((), "")
    layouts = ((SPLIT_OUTPUT, splits[0], (S, B, H) + axis + (d,), f"(num_splits, batch, heads{named}, dim)",
                "; a kernel that pads its head dimension: pass out_accum[..., :dim]",
                lambda a: a.reshape(S, B, H, nq, d).transpose(0, 1, 3, 2, 4).reshape(S, B * nq, H, d)),
               (SPLIT_LSE, splits[1], (S, B, H) + axis, f"(num_splits, batch, heads{named})", "",
                lambda a: a.reshape(S, B, H, nq).transpose(0, 2, 1, 3).reshape(S, H, B * nq)))
    for name, given, want, words, padded, packed in layouts:
        if given is None:
            out.append(None)
            continue
        a = trailing_empty_left_out(native_float(as_array(given, name), name), S, name)
        if tuple(a.shape) != want:
            raise ValueError(f"{name} is {tuple(a.shape)}: expected {words} = {want}: {plural(S, 'split')} of "
                             f"{size} keys (more splits only where the trailing ones hold no key{padded})")
        out.append(packed(a))
    return out[0], out[1], size


def _vllm_partitions(kv: KVCache, splits) -> Tuple[Optional[np.ndarray], Optional[np.ndarray], int]:
    """step_splits' triple from vLLM's paged_attention_v2 partitions: tmp_out (num_seqs, num_heads,
    max_num_partitions, head_size), each partition's output normalised by its own sum, and its lse
    (num_seqs, num_heads, max_num_partitions), max_logits + log(exp_sums). vLLM's kernel writes
    only the partitions that hold a sequence's keys and its reduce reads only those: the others are
    taken as an empty split holds them (output 0, lse −inf), whatever the arrays hold there."""
    B, nq, H, _ = kv.q.shape
    size, d = splits[2], kv.v_pages.shape[3]
    if nq != 1:
        raise ValueError(f"split_output/split_lse: vLLM's partitions hold one query a sequence; q has {nq}")
    S = split_count(max(kv.m(b) for b in range(B)), size)
    out = []
    for name, given, tail, empty in ((SPLIT_OUTPUT, splits[0], (d,), 0.0), (SPLIT_LSE, splits[1], (), -np.inf)):
        if given is None:
            out.append(None)
            continue
        a = native_float(as_array(given, name), name)
        if a.ndim != 3 + len(tail) or a.shape[:2] != (B, H) or a.shape[2] < S or a.shape[3:] != tail:
            axes, sizes = (", head_size", f", {d}") if tail else ("", "")
            raise ValueError(f"{name} is {tuple(a.shape)}: expected vLLM's (num_seqs, num_heads, max_num_partitions"
                             f"{axes}) = ({B}, {H}, {S} or more{sizes}): partitions of {size} keys")
        parts = np.moveaxis(a[:, :, :S], 2, 0).copy()  # (S, B, H, ...)
        for b in range(B):
            parts[-(-kv.m(b) // size):, b] = empty  # (never written nor read: vLLM's unused partitions)
        out.append(parts if tail else parts.transpose(0, 2, 1))
    return out[0], out[1], size


def packed_keys(kv: KVCache, keys: List[Tuple[np.ndarray, np.ndarray]]) -> Tuple[np.ndarray, np.ndarray]:
    """Sequences' gathered (keys, values), packed along the keys."""
    return (np.concatenate([k for k, _ in keys]) if keys else kv.k_pages[:0, 0],
            np.concatenate([v for _, v in keys]) if keys else kv.v_pages[:0, 0])


__all__ = ["step_stages", "step_splits", "packed_keys"]
