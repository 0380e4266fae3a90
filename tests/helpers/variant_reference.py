"""A float64 NumPy reference of every stage of a variant case, and the case's files, for the tests
that run a backend of the binary on the attention variants (verify/variant.py states the
conventions; its functions build the scores and the mask here, so the reference and the verifier
share one definition).

`dropout_keep` recomputes the binary's keep hash (cuda_src/variant.h) with uint64 arithmetic, so
that a test pins the contract rather than trusting the program's own mask.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional

import numpy as np

from verify.stages import (ALIBI_SLOPES_INPUT, BIAS_INPUT, CASE_INPUTS, INPUT_MANIFEST, KV_HEADS_KEY, MASK_INPUT,
                           STAGES, Dims, stage_file)
from verify.variant import BROADCAST, NONE, PER_HEAD, Variant, alibi_slopes, hidden, modified_scores

_U64 = np.uint64


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, as variant.h's mix64 (uint64 arithmetic wraps as in C++)."""
    z = z + _U64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


def dropout_keep(seed: int, head: int, n: int, m: int, p: float) -> np.ndarray:
    """The n×m keep-mask (True kept) of flat query head `head`: variant.h's dropout_keep, entry (r, c)
    kept when the top 24 bits of the hash of (seed, head, r·m + c), over 2^24, are ≥ p (float32)."""
    with np.errstate(over="ignore"):
        base = _mix64(_mix64(np.array([seed], dtype=_U64)) ^ _U64(head))
        h = _mix64(base ^ np.arange(n * m, dtype=_U64)).reshape(n, m)
    u = (h >> _U64(40)).astype(np.float64) / 2.0 ** 24  # exact: 24 bits
    return u >= np.float64(np.float32(p))


@dataclass
class VariantCase:
    """One case's inputs: Q and dO per flat query head, K and V per flat K/V head and, where the
    variant has them, each query head's mask, bias and ALiBi slope."""
    dims: Dims
    variant: Variant
    scale: float
    mats: Dict = field(default_factory=dict)       # (name, file's head) -> float32 matrix
    masks: Dict = field(default_factory=dict)      # head -> N×M 0/1
    biases: Dict = field(default_factory=dict)     # head -> N×M
    slopes: Optional[np.ndarray] = None            # flat head -> slope


def _manifest(dims: Dims, v: Variant) -> str:
    lines = [f"{k} = {getattr(dims, k)}" for k in ("batch", "heads", "seq_q", "seq_k", "d_k", "d_v")]
    if dims.kv_heads:
        lines.append(f"{KV_HEADS_KEY} = {dims.kv_heads}")
    lines += [f"causal = {str(v.causal).lower()}", f'align = "{v.align}"', f"window_left = {v.window[0]}",
              f"window_right = {v.window[1]}", f"softcap = {v.softcap!r}", f"alibi = {str(v.alibi).lower()}",
              f'bias = "{v.bias}"', f'mask = "{v.mask}"', f"dropout = {v.dropout!r}",
              f"dropout_seed = {v.dropout_seed}"]
    return "\n".join(lines) + "\n"


def _save_coverage(path: Path, name: str, coverage: str, per_head: Dict[int, np.ndarray]):
    """A mask or bias as files: one per query head, or one for all of them."""
    if coverage == PER_HEAD:
        for i, x in per_head.items():
            np.save(path / stage_file(name, i, "npy"), x.astype(np.float32))
    elif coverage == BROADCAST:
        np.save(path / f"{name}.npy", per_head[0].astype(np.float32))


def write_variant_case(path: Path, dims: Dims, v: Variant, *, seed: int = 0, q_spread: float = 1.0,
                       masks: Optional[np.ndarray] = None, biases: Optional[np.ndarray] = None,
                       slopes: Optional[np.ndarray] = None) -> VariantCase:
    """An .npy case for `v` with a manifest naming every variant key (and kv_heads when `dims` has
    grouped K/V heads: K and V then have one file per K/V head). `masks`/`biases`: one N×M per
    query head (per-head) or a single N×M (broadcast); `slopes`: a B×H or 1×H slopes file (else the
    standard slopes). Q is multiplied by `q_spread` (a softcap bites only on large scores)."""
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    case = VariantCase(dims, v, 1.0 / np.sqrt(dims.d_k))
    for name in CASE_INPUTS:
        for i in range(dims.heads_of(name)):
            x = rng.standard_normal(STAGES[name].shape(dims)) * (q_spread if name == "Q" else 1.0)
            case.mats[name, i] = x.astype(np.float32)
            np.save(path / stage_file(name, i, "npy"), case.mats[name, i])
    heads = range(dims.total_heads)
    for coverage, given, store, name in ((v.mask, masks, case.masks, MASK_INPUT),
                                         (v.bias, biases, case.biases, BIAS_INPUT)):
        if coverage == NONE:
            continue
        store.update({i: np.asarray(given[i] if coverage == PER_HEAD else given, np.float32) for i in heads})
        _save_coverage(path, name, coverage, store)
    if v.alibi:
        if slopes is not None:
            np.save(path / f"{ALIBI_SLOPES_INPUT}.npy", np.asarray(slopes, np.float32))
            rows = np.broadcast_to(np.asarray(slopes, np.float32), (dims.batch, dims.heads))
            case.slopes = rows.reshape(-1).astype(np.float64)
        else:
            case.slopes = np.tile(alibi_slopes(dims.heads), dims.batch)
    (path / INPUT_MANIFEST).write_text(_manifest(dims, v))
    return case


def _softmax(s: np.ndarray):
    """Row softmax and log-sum-exp; a row with no finite score has weights 0 and lse -inf."""
    mx = s.max(axis=1, keepdims=True)
    empty = np.isneginf(mx)
    e = np.exp(s - np.where(empty, 0.0, mx))
    total = e.sum(axis=1, keepdims=True)
    p = np.where(empty, 0.0, e / np.where(empty, 1.0, total))
    lse = np.where(empty, -np.inf, mx + np.log(np.where(empty, 1.0, total)))
    return p, lse


def reference(case: VariantCase, head: int) -> Dict[str, np.ndarray]:
    """Every stage of flat query head `head` in float64 (K, V and the gradients dK, dV: this query
    head's part of its K/V head's), and `hidden` (the masked entries)."""
    v, n, m = case.variant, case.dims.seq_q, case.dims.seq_k
    q, k, vv, do = (case.mats[x, case.dims.kv_head_of(head) if STAGES[x].kv else head].astype(np.float64)
                    for x in CASE_INPUTS)
    qk = q @ k.T
    bias = case.biases.get(head)
    slope = 0.0 if case.slopes is None else float(case.slopes[head])
    s = modified_scores(qk * case.scale, v, slope, None if bias is None else bias.astype(np.float64))
    masked = hidden(v, n, m, case.masks.get(head)) | np.isneginf(s)
    s = np.where(masked, -np.inf, s)
    p, lse = _softmax(s)
    z = dropout_keep(v.dropout_seed, head, n, m, v.dropout).astype(np.float64) if v.dropout > 0 else np.ones((n, m))
    dropped = p * z / (1.0 - v.dropout)
    o = dropped @ vv
    D = (do * o).sum(axis=1, keepdims=True)
    dp = do @ vv.T
    ds = np.where(masked, 0.0, p * (dp * z / (1.0 - v.dropout) - D))
    cap = 1.0 - np.tanh(qk * case.scale / v.softcap) ** 2 if v.softcap > 0 else 1.0
    grads = {"dQ": case.scale * (ds * cap) @ k, "dK": case.scale * (ds * cap).T @ q, "dV": dropped.T @ do}
    ref = {"Q": q, "K": k, "V": vv, "KT": k.T, "QK": qk, "QK_scaled": s, "attention_weights": p,
           "output": o, "flash_output": o, "flash_lse": lse, "dO": do, "D": D, "dP": dp, "dS": ds, **grads,
           **{f"flash_{g}": x for g, x in grads.items()}, "hidden": masked}
    if v.dropout > 0:
        ref["dropout_mask"] = z
    return ref


def kv_reference(refs: Dict[int, Dict[str, np.ndarray]], dims: Dims, stage: str, kv_head: int) -> np.ndarray:
    """A stage indexed by K/V head from the query heads' references: the gradients summed over the
    K/V head's group, K, V and KT as any of its query heads read them."""
    group = dims.query_heads_of(kv_head)
    if STAGES[stage].backward:
        return sum(refs[h][stage] for h in group)
    return refs[group[0]][stage]
