"""Small programs of the kinds users write, each with one real bug, in float32 NumPy.

Each function computes the stages of every head the way such a program would (a naive softmax, a
tiled kernel without bounds checks, a mask of another alignment, …) from the input case's Q, K, V,
and returns one {stage: matrix} per head, ready for tests/helpers/foreign_routes.py's writers. The bug is the
program's own doing; everything after it is computed from the bugged value, as the program would.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np

from helpers import foreign_routes as foreign
from helpers.foreign_routes import f32, mm_blas

Head = Dict[str, np.ndarray]


def _stage_path(q, k, v, scale: float, masked: Optional[np.ndarray], softmax, fill: float = -np.inf) -> Head:
    """QK, QK_scaled, attention_weights, output in float32, `masked` set to `fill` (-inf, or a finite
    stand-in: masked_fill(-1e9)) before the softmax."""
    qk = mm_blas(q, np.ascontiguousarray(k.T))
    s = (qk * f32(scale)).astype(f32)
    if masked is not None:
        s = np.where(masked, f32(fill), s).astype(f32)
    with np.errstate(over="ignore", invalid="ignore"):
        p = softmax(s).astype(f32)
        o = mm_blas(p, v)
    return {"Q": q, "K": k, "V": v, "QK": qk, "QK_scaled": s, "attention_weights": p, "output": o}


def naive_softmax(s: np.ndarray) -> np.ndarray:
    """exp(s) / Σ exp(s) without the row max subtracted: exp overflows float32 past s ≈ 88.7."""
    e = np.exp(s)
    return e / e.sum(axis=1, keepdims=True, dtype=f32)


def stable_softmax(s: np.ndarray) -> np.ndarray:
    e = np.exp(s - s.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True, dtype=f32)


def max_from_zero_softmax(s: np.ndarray) -> np.ndarray:
    """The row maximum found by a loop that starts it at 0 (`float mx = 0;`), not −inf."""
    e = np.exp(s - np.maximum(s.max(axis=1, keepdims=True), f32(0)))
    return e / e.sum(axis=1, keepdims=True, dtype=f32)


def causal_program(inputs: Sequence[Head], scale: float, softmax=stable_softmax) -> List[Head]:
    """The causal stage path with the softmax given."""
    return [_stage_path(x["Q"], x["K"], x["V"], scale, shifted_mask(x["Q"].shape[0], x["K"].shape[0], 0), softmax)
            for x in inputs]


def softmax_program(inputs: Sequence[Head], scale: float, subtract_max: bool) -> List[Head]:
    """The textbook stage path; without the max subtracted when asked (the overflow bug)."""
    softmax = stable_softmax if subtract_max else naive_softmax
    return [_stage_path(x["Q"], x["K"], x["V"], scale, None, softmax) for x in inputs]


def shifted_mask(n: int, m: int, offset: int) -> np.ndarray:
    """Masked where key c > query r + offset (offset M - N: the bottom-right aligned mask)."""
    return np.arange(m)[None, :] > np.arange(n)[:, None] + offset


def masked_program(inputs: Sequence[Head], scale: float, offset: int, fill: float = -np.inf) -> List[Head]:
    """A causal program whose mask is aligned at `offset` (0: the top-left mask the case asks for),
    masking with `fill`."""
    out = []
    for x in inputs:
        masked = shifted_mask(x["Q"].shape[0], x["K"].shape[0], offset)
        out.append(_stage_path(x["Q"], x["K"], x["V"], scale, masked, stable_softmax, fill))
    return out


def scaled_program(inputs: Sequence[Head], scale: float) -> List[Head]:
    """The stage path with the given scale (1/d_k where 1/√d_k belongs: the 1/d bug)."""
    return [_stage_path(x["Q"], x["K"], x["V"], scale, None, stable_softmax) for x in inputs]


def _flash_rows(q, k, v, scale: float, tile: int) -> np.ndarray:
    """Attention of the rows of q over k, v by key tiles of `tile` (online softmax, float32)."""
    o, _ = foreign.flash_forward(q, k, v, scale, False, tile, False)
    return o


def _padded(x: np.ndarray, rows: int, after: Optional[np.ndarray]) -> np.ndarray:
    """x followed by `rows` rows of what lies after it in memory (zeros past the last buffer)."""
    tail = after[:rows] if after is not None else np.zeros((rows, x.shape[1]), f32)
    return np.concatenate([x, tail]).astype(f32)


def flash_minimal_program(inputs: Sequence[Head], scale: float, tile: int) -> List[Head]:
    """flash-attention-minimal's forward at N not a multiple of its tile: Q, K, V, O of all heads lie
    in one buffer, head after head; the last tile reads the next head's first rows (zeros past the
    buffer's end) as keys and queries, unmasked, and writes its rows past the end into the next
    head's first output rows, after that head's own block wrote them."""
    heads = len(inputs)
    n = inputs[0]["Q"].shape[0]
    extra = -n % tile
    full = []
    for h, x in enumerate(inputs):
        nxt = inputs[h + 1] if h + 1 < heads else None
        q, k, v = (_padded(x[name], extra, nxt[name] if nxt else None) for name in ("Q", "K", "V"))
        full.append(_flash_rows(q, k, v, scale, tile))
    out = []
    for h, x in enumerate(inputs):
        o = full[h][:n].copy()
        if h > 0:
            o[:extra] = full[h - 1][n:]  # the previous head's overrun landed last
        out.append({"Q": x["Q"], "K": x["K"], "V": x["V"], "flash_output": o})
    return out


def dropped_tail_program(inputs: Sequence[Head], scale: float, tile: int) -> List[Head]:
    """A tiled kernel that runs N // tile query tiles and M // tile key tiles: the keys past the last
    full tile are left out of every row, and the rows past it never written (zeros)."""
    out = []
    for x in inputs:
        n, m = x["Q"].shape[0], x["K"].shape[0]
        kept = m - m % tile
        o = np.zeros((n, x["V"].shape[1]), f32)
        rows = n - n % tile
        o[:rows] = _flash_rows(x["Q"][:rows], x["K"][:kept], x["V"][:kept], scale, tile)
        out.append({"Q": x["Q"], "K": x["K"], "V": x["V"], "flash_output": o})
    return out


def mask_after_softmax_program(inputs: Sequence[Head], scale: float, masked_scores: bool = False) -> List[Head]:
    """A causal program that takes the softmax over every key, then zeroes the hidden weights
    (the mask applied to the weights, not to the scores), and writes its scores unmasked (or,
    masked_scores, masked: what it meant to take the softmax of)."""
    out = []
    for x in inputs:
        head = _stage_path(x["Q"], x["K"], x["V"], scale, None, stable_softmax)
        masked = shifted_mask(x["Q"].shape[0], x["K"].shape[0], 0)
        if masked_scores:
            head["QK_scaled"] = np.where(masked, -np.inf, head["QK_scaled"]).astype(f32)
        head["attention_weights"] = np.where(masked, f32(0), head["attention_weights"]).astype(f32)
        head["output"] = mm_blas(head["attention_weights"], x["V"])
        out.append(head)
    return out


def online_program(inputs: Sequence[Head], scale: float, tile: int, rescale_sum: bool = True,
                   rescale_output: bool = True, skip: Optional[str] = None, fold_log2e: bool = True,
                   causal: bool = False, max_from: float = -np.inf, ftz: bool = False) -> List[Head]:
    """A flash forward in float32 with exp2 (log2 e folded into the scale) over key tiles of `tile`:
    its running sum or output not rescaled when a tile raises the row maximum (the online softmax's
    bug), its key loop leaving out the "last" or "first" key of every tile or the second "tile" whole,
    log2 e left out, or its running maximum started at `max_from` (0: the bug); ftz: subnormal
    weights flushed to 0, as a GPU's fast exp2 does."""
    out = []
    for x in inputs:
        q, k, v = x["Q"], x["K"], x["V"]
        n, m = q.shape[0], k.shape[0]
        mx, total = np.full((n, 1), max_from, f32), np.zeros((n, 1), f32)
        acc = np.zeros((n, v.shape[1]), f32)
        for c0 in (c for c in range(0, m, tile) if not (skip == "tile" and c == tile)):
            cols = slice(c0, min(c0 + tile, m) - (skip == "last"))
            cols = slice(cols.start + (skip == "first"), cols.stop)
            factor = f32(scale * (1.4426950408889634 if fold_log2e else 1.0))
            s = (mm_blas(q, np.ascontiguousarray(k[cols].T)) * factor).astype(f32)
            if causal:
                s = np.where(np.arange(cols.start, cols.stop)[None, :] > np.arange(n)[:, None], f32(-np.inf), s)
            new = np.maximum(mx, s.max(axis=1, keepdims=True))
            p = np.where(np.isneginf(s), f32(0), np.exp2(s - new)).astype(f32)
            if ftz:
                p = np.where(p < np.finfo(f32).tiny, f32(0), p)
            alpha = np.exp2(mx - new).astype(f32)
            total = (alpha * total if rescale_sum else total) + p.sum(axis=1, keepdims=True, dtype=f32)
            acc = (alpha * acc if rescale_output else acc) + mm_blas(p, v[cols])
            mx = new
        with np.errstate(divide="ignore", invalid="ignore"):  # (a sum of 0: the running maximum's bug)
            lse = (mx * f32(0.6931471805599453) + np.log(total)).astype(f32)
            o = (acc / total).astype(f32)
        out.append({"Q": q, "K": k, "V": v, "flash_output": o, "flash_lse": lse})
    return out


def causal_tiles_program(inputs: Sequence[Head], scale: float, query_tile: int, key_tile: int,
                         skip_by: str = "last") -> List[Head]:
    """A causal flash forward in float32 over query tiles × key tiles that skips a key tile lying
    wholly past the diagonal: tested at the query tile's last row (right), or its "first" (the bug:
    the tile's later rows lose the keys of the tiles it skipped)."""
    out = []
    for x in inputs:
        q, k, v = x["Q"], x["K"], x["V"]
        n, m = q.shape[0], k.shape[0]
        o, lse = np.zeros((n, v.shape[1]), f32), np.zeros((n, 1), f32)
        for r0 in range(0, n, query_tile):
            rows = np.arange(r0, min(r0 + query_tile, n))
            test_row = rows[-1] if skip_by == "last" else rows[0]
            mx, total = np.full((len(rows), 1), -np.inf, f32), np.zeros((len(rows), 1), f32)
            acc = np.zeros((len(rows), v.shape[1]), f32)
            for c0 in range(0, min(m, test_row + 1), key_tile):
                cols = np.arange(c0, min(c0 + key_tile, m))
                s = (mm_blas(q[rows], np.ascontiguousarray(k[cols].T)) * f32(scale)).astype(f32)
                s = np.where(cols[None, :] > rows[:, None], f32(-np.inf), s)
                new = np.maximum(mx, s.max(axis=1, keepdims=True))
                p = np.exp(s - new).astype(f32)
                alpha = np.exp(mx - new).astype(f32)
                total = alpha * total + p.sum(axis=1, keepdims=True, dtype=f32)
                acc = alpha * acc + mm_blas(p, v[cols])
                mx = new
            o[rows], lse[rows] = acc / total, mx + np.log(total)
        out.append({"Q": q, "K": k, "V": v, "flash_output": o, "flash_lse": lse})
    return out
