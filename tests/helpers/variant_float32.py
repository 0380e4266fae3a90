"""Correct float32 programs of the attention variants, simulated in NumPy: the stage path, a tiled
flash forward (online softmax) and the flash backward, each in float32 arithmetic as a correct
program computes it, by several routes (the softcap as S/C or S·(1/C), ALiBi as −slope·|dist| or
flash-attn's causal slope·j, the bias before or after ALiBi, an approximate tanh). The mask is
built here from the indices, independently of verify/variant.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, Optional

import numpy as np

from verify.stages import (FLASH_GRAD_KEYS, FLASH_GRAD_QUERIES, FLASH_GRAD_VALUES, FLASH_LSE, FLASH_OUTPUT, GRAD_KEYS,
                           GRAD_QUERIES, GRAD_SCORES, GRAD_VALUES, GRAD_WEIGHTS, KEYS_T, OUTPUT, ROW_DOT,
                           SCALED_SCORES, SCORES, WEIGHTS)
from verify.variant import BOTTOM_RIGHT, Variant

f32 = np.float32
TANH_APPROX_REL = 2.0**-11  # below tanh.approx.f32's documented 2^-10.987


@dataclass
class Head:
    """One head of a variant case: float32 inputs, the scale, the variant, the head's ALiBi slope,
    its mask and bias files and the program's dropout keep-mask (float32 0/1)."""
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    do: np.ndarray
    scale: float
    variant: Variant = Variant()
    slope: float = 0.0
    mask: Optional[np.ndarray] = None
    bias: Optional[np.ndarray] = None
    keep: Optional[np.ndarray] = None

    @property
    def n(self) -> int:
        return self.q.shape[0]

    @property
    def m(self) -> int:
        return self.k.shape[0]

    def diag(self) -> np.ndarray:
        """diag(i) per row (N×1 int)."""
        off = self.m - self.n if self.variant.align == BOTTOM_RIGHT else 0
        return np.arange(self.n)[:, None] + off

    def hidden(self) -> np.ndarray:
        j = np.arange(self.m)[None, :]
        diag = self.diag()
        left, right = self.variant.window
        right = 0 if self.variant.causal else right
        out = np.zeros((self.n, self.m), bool)
        if left >= 0:
            out |= j < diag - left
        if right >= 0:
            out |= j > diag + right
        if self.mask is not None:
            out |= self.mask == 0
        if self.bias is not None:
            out |= self.bias == -np.inf
        return out

    def tensors(self) -> Dict[str, np.ndarray]:
        """The head's variant tensors as the verifier's sources name them."""
        from verify.stages import BIAS_INPUT, DROPOUT_MASK, MASK_INPUT
        out = {}
        for name, x in ((MASK_INPUT, self.mask), (BIAS_INPUT, self.bias), (DROPOUT_MASK, self.keep)):
            if x is not None:
                out[name] = x.astype(np.float64)
        return out


@dataclass(frozen=True)
class Route:
    """How the program computes the variant's scores (all correct in float32)."""
    reciprocal_cap: bool = False     # S·(1/C) instead of S/C
    approx_tanh: bool = False        # tanh with a relative error up to TANH_APPROX_REL (tanh.approx.f32)
    tanh_from_exp: bool = False      # sign(x)·(1 − 2/(e + 1)), e = exp(2|x|) 2^-22 off (ex2.approx)
    flash_attn_alibi: bool = False   # causal ALiBi as +slope·j (flash-attn's causal kernel)
    bias_first: bool = False         # the bias added before ALiBi
    plus_inf_lse: bool = False       # +inf as the lse of a row that sees no key (flash-attn)
    fold_scale: bool = False         # the scale folded into Q before the GEMM
    seed: int = field(default=0, compare=False)


def _tanh(x: np.ndarray, route: Route) -> np.ndarray:
    t = np.tanh(x.astype(np.float64))
    if route.approx_tanh:
        rng = np.random.default_rng(route.seed + 7)
        t = t * (1.0 + rng.uniform(-TANH_APPROX_REL, TANH_APPROX_REL, t.shape))
    if route.tanh_from_exp:  # near 0 it cancels: an absolute error, the half flash kernel's tanh
        a = np.abs(x).astype(f32)
        e = (np.exp(2.0 * a.astype(np.float64)) * (1.0 + 2.0**-22)).astype(f32)
        t = np.sign(x) * (f32(1) - (f32(2) / (e + f32(1))).astype(f32))
    return t.astype(f32)


def raw_scores(h: Head, route: Route) -> np.ndarray:
    """scale·QK in float32, by the route's GEMM (the scale folded into Q, or after)."""
    if route.fold_scale:
        return (h.q * f32(h.scale)) @ h.k.T
    return (h.q @ h.k.T) * f32(h.scale)


def scores(h: Head, s: np.ndarray, route: Route) -> np.ndarray:
    """The variant applied to float32 scale·QK, −inf where hidden."""
    v = h.variant
    if v.softcap > 0:
        c = f32(v.softcap)
        x = s * (f32(1) / c) if route.reciprocal_cap else s / c
        s = c * _tanh(x, route)
    if h.bias is not None and route.bias_first:
        s = s + np.where(np.isfinite(h.bias), h.bias, 0).astype(f32)
    if v.alibi:
        if route.flash_attn_alibi and v.causal:
            s = s + f32(h.slope) * np.arange(h.m, dtype=f32)[None, :]
        else:
            s = s - f32(h.slope) * np.abs(h.diag() - np.arange(h.m)[None, :]).astype(f32)
    if h.bias is not None and not route.bias_first:
        s = s + np.where(np.isfinite(h.bias), h.bias, 0).astype(f32)
    return np.where(h.hidden(), f32(-np.inf), s).astype(f32)


def softmax32(s: np.ndarray) -> np.ndarray:
    """Row softmax in float32; a row without a visible key is 0."""
    finite = np.isfinite(s)
    mx = np.max(np.where(finite, s, f32(-np.inf)), axis=1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, f32(0))
    e = np.where(finite, np.exp(np.where(finite, s - mx, f32(0))), f32(0)).astype(f32)
    total = e.sum(axis=1, keepdims=True, dtype=f32)
    return (e * (f32(1) / np.where(total > 0, total, f32(1)))).astype(f32)


def rescale32(h: Head) -> f32:
    """1/(1 − p) in float32, as the program computes it from its float32 p."""
    return f32(1) / (f32(1) - f32(h.variant.dropout))


def dropped32(h: Head, x: np.ndarray) -> np.ndarray:
    return x if h.keep is None else (x * h.keep * rescale32(h)).astype(f32)


def cap_factor32(h: Head, route: Route, qk: Optional[np.ndarray] = None) -> Optional[np.ndarray]:
    """1 − t² in float32 from the program's float32 scale·QK (from its stored QK when given; None
    without a cap)."""
    if h.variant.softcap == 0:
        return None
    s = raw_scores(h, route) if qk is None else qk * f32(h.scale)
    t = _tanh(s / f32(h.variant.softcap), route)
    return (f32(1) - t * t).astype(f32)


def stage_path(h: Head, route: Route = Route(), backward: bool = True) -> Dict[str, np.ndarray]:
    """Every stage-path stage in float32."""
    qk = h.q @ h.k.T
    s = scores(h, raw_scores(h, route) if route.fold_scale else qk * f32(h.scale), route)
    p = softmax32(s)
    out = {KEYS_T: h.k.T.copy(), SCORES: qk, SCALED_SCORES: s, WEIGHTS: p, OUTPUT: dropped32(h, p) @ h.v}
    if backward:
        out.update(_backward(h, p, out[OUTPUT], route))
    return out


def _backward(h: Head, p, o, route: Route) -> Dict[str, np.ndarray]:
    d = (h.do * o).sum(axis=1, keepdims=True, dtype=f32)
    dp = h.do @ h.v.T
    ds = (p * (dropped32(h, dp) - d)).astype(f32)
    f = cap_factor32(h, route)
    g = ds if f is None else (ds * f).astype(f32)
    sc = f32(h.scale)
    return {ROW_DOT: d, GRAD_WEIGHTS: dp, GRAD_SCORES: ds, GRAD_QUERIES: (g * sc) @ h.k,
            GRAD_KEYS: (g * sc).T @ h.q, GRAD_VALUES: dropped32(h, p).T @ h.do}


def flash_forward(h: Head, route: Route = Route(), block: int = 16):
    """(O, lse) by a tiled online softmax in float32 (the scores as `scores` computes them)."""
    s = scores(h, raw_scores(h, route), route)
    n = h.n
    m_run = np.full((n, 1), -np.inf, f32)
    l_run = np.zeros((n, 1), f32)
    acc = np.zeros((n, h.v.shape[1]), f32)
    vz_all = h.v
    for c0 in range(0, h.m, block):
        st = s[:, c0:c0 + block]
        m_new = np.maximum(m_run, np.max(st, axis=1, keepdims=True))
        safe = np.where(np.isfinite(m_new), m_new, f32(0))
        alpha = np.where(np.isfinite(m_run), np.exp(m_run - safe), f32(0)).astype(f32)
        e = np.where(np.isfinite(st), np.exp(np.where(np.isfinite(st), st - safe, f32(0))), f32(0)).astype(f32)
        l_run = (l_run * alpha + e.sum(axis=1, keepdims=True, dtype=f32)).astype(f32)
        ez = e if h.keep is None else (e * h.keep[:, c0:c0 + block]).astype(f32)
        acc = (acc * alpha + ez @ vz_all[c0:c0 + block]).astype(f32)
        m_run = m_new
    empty = l_run == 0
    o = (acc / np.where(empty, f32(1), l_run)).astype(f32)
    if h.keep is not None:
        o = (o * rescale32(h)).astype(f32)
    with np.errstate(divide="ignore"):
        lse = (np.where(np.isfinite(m_run), m_run, f32(0)) + np.log(l_run)).astype(f32)
    lse = np.where(empty, f32(np.inf) if route.plus_inf_lse else f32(-np.inf), lse).astype(f32)
    return np.where(empty, f32(0), o).astype(f32), lse


def flash_backward(h: Head, o, lse, route: Route = Route()) -> Dict[str, np.ndarray]:
    """flash_dQ, flash_dK, flash_dV from the saved output and lse, P recomputed, in float32."""
    s = scores(h, raw_scores(h, route), route)
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.where(np.isfinite(s) & np.isfinite(lse), np.exp(s - lse), f32(0)).astype(f32)
    g = _backward(replace(h), p, o, route)
    return {FLASH_GRAD_QUERIES: g[GRAD_QUERIES], FLASH_GRAD_KEYS: g[GRAD_KEYS], FLASH_GRAD_VALUES: g[GRAD_VALUES]}


def flash_stages(h: Head, route: Route = Route(), backward: bool = True, block: int = 16) -> Dict[str, np.ndarray]:
    o, lse = flash_forward(h, route, block)
    out = {FLASH_OUTPUT: o, FLASH_LSE: lse}
    if backward:
        out.update(flash_backward(h, o, lse, route))
    return out
