"""A float32 NumPy program that computes every stage of a variant case (GQA/MQA, either alignment, a
sliding window, softcap, ALiBi, mask and bias files, dropout), correct or with one classic bug of
a variant planted, and writes its stage files as a user's program would (.npy, no run.toml).

It is written from docs/contract.md's semantics, not from verify/: the diagonal of row i is key
i + (M − N if aligned bottom-right), key j is visible when diag − left ≤ j ≤ diag + right (causal:
right 0), the scores are scale·QK capped, minus slope·|diag − j|, plus the bias, −inf where hidden;
the keep-mask Z is the program's own draw (1 kept), output = (P∘Z)·V/(1 − p); dS = P∘(dP∘Z/(1 − p)
− D), dQ = scale·(dS∘(1 − t²))·K, dK = scale·(dS∘(1 − t²))ᵀ·Q; dK and dV of a K/V head summed over
its group in float32. A bug changes what the program computes and everything after it, as the
program would (BUGS names each).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

from verify.files.case import InputCase
from verify.stages import (BIAS_INPUT, DROPOUT_MASK, FLASH_GRAD_KEYS, FLASH_GRAD_QUERIES, FLASH_GRAD_VALUES,
                           FLASH_LSE, FLASH_OUTPUT, GRAD_KEYS, GRAD_OUTPUT, GRAD_QUERIES, GRAD_SCORES,
                           GRAD_VALUES, GRAD_WEIGHTS, KEYS, KEYS_T, MASK_INPUT, OUTPUT, QUERIES, ROW_DOT,
                           SCALED_SCORES, SCORES, STAGES, VALUES, WEIGHTS, default_scale, stage_file)

f32 = np.float32

# Each bug a variant's program makes (Program.bug), with what it does.
BUGS = {
    "kv_modulo": "query head h reads K/V head h % Hk instead of h // (H/Hk)",
    "kv_unshared": "query head i reads K/V head i (clamped to the last): no sharing",
    "group_first": "dK, dV of a K/V head hold its first query head's part only",
    "group_last": "dK, dV of a K/V head hold its last query head's part only (overwritten)",
    "group_twice": "dK, dV of a K/V head summed twice",
    "align_swapped": "the mask aligned at the other corner (top-left <-> bottom-right)",
    "window_left": "the window's left bound off by `by` keys",
    "window_right": "the window's right bound off by `by` keys",
    "window_ignored": "the window not applied (the causal mask kept)",
    "window_left_ignored": "the window's left bound not applied",
    "window_swapped": "the window's left and right bounds swapped",
    "softcap_missing": "no softcap",
    "softcap_before_scale": "C·tanh(QK/C)·scale",
    "softcap_grad_missing": "dQ, dK from dS without the softcap's derivative 1 - t²",
    "alibi_reversed": "the ALiBi slopes in reverse head order",
    "alibi_next_head": "the next head's ALiBi slope",
    "alibi_sign": "+slope·|diag - j|",
    "alibi_missing": "no ALiBi",
    "alibi_other_alignment": "the ALiBi distance from the other alignment's diagonal than the mask's",
    "mask_transposed": "the mask file read with transposed strides",
    "mask_ignored": "the mask file ignored",
    "mask_inverted": "the mask file read inverted (1: hidden)",
    "bias_ignored": "the bias file ignored",
    "bias_transposed": "the bias file read with transposed strides",
    "dropout_unscaled": "the kept weights not divided by 1 - p",
    "dropout_not_applied": "the keep-mask written but not applied (nor the rescale)",
    "dropout_inverted": "1 - Z applied instead of Z",
}

Head = Dict[str, np.ndarray]


@dataclass(frozen=True)
class Program:
    """The program: which bug it has (None: correct), by how many keys (the window's), and the
    seed of its dropout draws."""
    bug: Optional[str] = None
    by: int = 1
    seed: int = 1234

    def __post_init__(self):
        assert self.bug is None or self.bug in BUGS, self.bug

    @staticmethod
    def scale(case: InputCase) -> np.float32:
        return f32(default_scale(case.dims.d_k) if case.scale is None else case.scale)

    # ---- what it reads ------------------------------------------------------------------------
    def kv_head(self, case: InputCase, head: int) -> int:
        d = case.dims
        b, h = divmod(head, d.heads)
        if self.bug == "kv_modulo":
            return b * d.kv + h % d.kv
        if self.bug == "kv_unshared":
            return min(head, d.total_kv_heads - 1)
        return b * d.kv + h // d.group_size

    def slope(self, case: InputCase, head: int) -> float:
        d = case.dims
        b, h = divmod(head, d.heads)
        if self.bug == "alibi_reversed":
            h = d.heads - 1 - h
        elif self.bug == "alibi_next_head":
            h = (h + 1) % d.heads
        s = case.alibi_slope(b * d.heads + h)
        return -s if self.bug == "alibi_sign" else s

    def tensor(self, case: InputCase, name: str, head: int) -> Optional[np.ndarray]:
        x = case.variant_input(name, head)
        if x is None or self.bug == f"{name}_ignored":
            return None
        if self.bug == f"{name}_transposed":
            n, m = x.shape
            return np.ascontiguousarray(x).reshape(m, n).T  # the N×M buffer read as M×N column-major
        if self.bug == f"{name}_inverted":
            return (x == 0).astype(x.dtype)  # True taken as the keys to hide
        return x

    # ---- the mask and the scores ---------------------------------------------------------------
    def hidden(self, case: InputCase, head: int) -> np.ndarray:
        v, n, m = case.variant, case.dims.seq_q, case.dims.seq_k
        bottom_right = (v.align == "bottom-right") != (self.bug == "align_swapped")
        diag = np.arange(n)[:, None] + (m - n if bottom_right else 0)
        j = np.arange(m)[None, :]
        left, right = v.window
        right = 0 if v.causal else right
        if self.bug == "window_left":
            left += self.by
        if self.bug == "window_right":
            right += self.by
        if self.bug == "window_ignored":
            left, right = -1, (0 if v.causal else -1)
        if self.bug == "window_left_ignored":
            left = -1
        if self.bug == "window_swapped":
            left, right = right, left
        out = np.zeros((n, m), bool)
        if left >= 0:
            out |= j < diag - left
        if right >= 0:
            out |= j > diag + right
        mask, bias = self.tensor(case, MASK_INPUT, head), self.tensor(case, BIAS_INPUT, head)
        if mask is not None:
            out |= mask == 0
        if bias is not None:
            out |= bias == -np.inf
        return out

    def scores(self, case: InputCase, head: int, qk: np.ndarray, hidden: np.ndarray) -> np.ndarray:
        v, scale = case.variant, self.scale(case)
        cap = f32(v.softcap)
        if cap > 0 and self.bug == "softcap_before_scale":
            s = (cap * np.tanh(qk / cap)) * scale
        else:
            s = qk * scale
            if cap > 0 and self.bug != "softcap_missing":
                s = cap * np.tanh(s / cap)
        if v.alibi and self.bug != "alibi_missing":
            n, m = hidden.shape
            bottom_right = (v.align == "bottom-right") != (self.bug == "alibi_other_alignment")
            diag = np.arange(n)[:, None] + (m - n if bottom_right else 0)
            s = s - f32(self.slope(case, head)) * np.abs(diag - np.arange(m)[None, :]).astype(f32)
        bias = self.tensor(case, BIAS_INPUT, head)
        if bias is not None:
            s = s + np.where(np.isfinite(bias), bias, 0).astype(f32)
        return np.where(hidden, f32(-np.inf), s).astype(f32)

    # ---- one query head -----------------------------------------------------------------------
    def query_head(self, case: InputCase, head: int, rng) -> Head:
        v = case.variant
        j = self.kv_head(case, head)
        q, k, vv = (case.load(QUERIES, head).astype(f32), case.load(KEYS, j).astype(f32),
                    case.load(VALUES, j).astype(f32))
        qk = (q @ k.T).astype(f32)
        hidden = self.hidden(case, head)
        s = self.scores(case, head, qk, hidden)
        empty = hidden.all(axis=1, keepdims=True)
        mx = np.where(empty, f32(0), s.max(axis=1, keepdims=True))
        e = np.where(hidden, f32(0), np.exp(s - mx)).astype(f32)
        total = e.sum(axis=1, keepdims=True, dtype=f32)
        p = np.where(empty, f32(0), e / np.where(empty, f32(1), total)).astype(f32)
        with np.errstate(divide="ignore"):
            lse = np.where(empty, f32(-np.inf), mx + np.log(total)).astype(f32)
        out = {SCORES: qk, SCALED_SCORES: s, WEIGHTS: p, FLASH_LSE: lse}
        pz = p
        if v.dropout > 0:
            z = (rng.random(p.shape) >= v.dropout).astype(f32)
            out[DROPOUT_MASK] = z
            applied = {"dropout_not_applied": np.ones_like(z), "dropout_inverted": 1 - z}.get(self.bug, z)
            unscaled = self.bug in ("dropout_unscaled", "dropout_not_applied")
            rescale = f32(1) if unscaled else f32(1 / (1 - f32(v.dropout)))
            pz = (p * applied * rescale).astype(f32)
        out[OUTPUT] = out[FLASH_OUTPUT] = (pz @ vv).astype(f32)
        if case.backward:
            out.update(self._backward(case, head, q, k, vv, qk, out, pz))
        return out

    def _backward(self, case: InputCase, head: int, q, k, vv, qk, out: Head, pz) -> Head:
        v, scale = case.variant, self.scale(case)
        dO = case.load(GRAD_OUTPUT, head).astype(f32)
        p = out[WEIGHTS]
        D = (dO * out[OUTPUT]).sum(axis=1, keepdims=True, dtype=f32)
        dP = (dO @ vv.T).astype(f32)
        dPz = dP
        if v.dropout > 0:
            dPz = (dP * out[DROPOUT_MASK] * f32(1 / (1 - f32(v.dropout)))).astype(f32)
        dS = (p * (dPz - D)).astype(f32)
        g = dS
        if v.softcap > 0 and self.bug != "softcap_grad_missing":
            t = np.tanh(qk * scale / f32(v.softcap))
            g = (dS * (1 - t * t)).astype(f32)
        grads = {ROW_DOT: D, GRAD_WEIGHTS: dP, GRAD_SCORES: dS, GRAD_QUERIES: (scale * (g @ k)).astype(f32),
                 GRAD_KEYS: (scale * (g.T @ q)).astype(f32), GRAD_VALUES: (pz.T @ dO).astype(f32)}
        for flash, stage in ((FLASH_GRAD_QUERIES, GRAD_QUERIES), (FLASH_GRAD_KEYS, GRAD_KEYS),
                             (FLASH_GRAD_VALUES, GRAD_VALUES)):
            grads[flash] = grads[stage]
        return grads

    # ---- every head -----------------------------------------------------------------------------
    def run(self, case: InputCase):
        """(the query heads' stages, the K/V heads' stages)."""
        d = case.dims
        rng = np.random.default_rng(self.seed)
        heads = [self.query_head(case, i, rng) for i in range(d.total_heads)]
        kv_heads = []
        for j in range(d.total_kv_heads):
            k = case.load(KEYS, j).astype(f32)
            kv = {KEYS: k, VALUES: case.load(VALUES, j).astype(f32), KEYS_T: np.ascontiguousarray(k.T)}
            if case.backward:
                readers = [i for i in range(d.total_heads) if self.kv_head(case, i) == j]
                for stage in (GRAD_KEYS, GRAD_VALUES, FLASH_GRAD_KEYS, FLASH_GRAD_VALUES):
                    kv[stage] = self._group_sum([heads[i][stage] for i in readers], k.shape[0], heads[0][stage])
            kv_heads.append(kv)
        for i, h in enumerate(heads):
            h[QUERIES] = case.load(QUERIES, i).astype(f32)
            if case.backward:
                h[GRAD_OUTPUT] = case.load(GRAD_OUTPUT, i).astype(f32)
        return heads, kv_heads

    def _group_sum(self, parts: List[np.ndarray], rows: int, like: np.ndarray) -> np.ndarray:
        """The float32 sum of a K/V head's parts, in order of query head (as the bug has it)."""
        if not parts:
            return np.zeros((rows, like.shape[1]), f32)
        if self.bug == "group_first":
            return parts[0]
        if self.bug == "group_last":
            return parts[-1]
        acc = np.zeros_like(parts[0])
        for _ in range(2 if self.bug == "group_twice" else 1):
            for x in parts:
                acc = (acc + x).astype(f32)
        return acc


def write_run(folder: Path, case: InputCase, program: Program, only: Optional[Sequence[str]] = None) -> None:
    """Runs `program` on `case` and writes its stage files (`only` those stages, else all it has)
    into `folder` as .npy (float32), one file per query head or per K/V head, no run.toml."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    heads, kv_heads = program.run(case)
    for stage in STAGES:
        if only is not None and stage not in only:
            continue
        owners = kv_heads if STAGES[stage].kv else heads
        if stage not in owners[0]:
            continue
        for i, h in enumerate(owners):
            np.save(folder / stage_file(stage, i, "npy"), np.asarray(h[stage], "<f4"))
