"""The backward pass's float64 references: D, dS, and the FlashAttention backward (P recomputed
from the logits and the saved flash_lse); and Gradients, the same computation with one part (D,
dS or the lse) replaced, which the backward diagnoses (verify/diagnose/backward.py) rebuild a
failing stage from.
"""
from __future__ import annotations

from functools import cached_property
from typing import Callable, Optional

import numpy as np

from ...model.attention import causal_mask
from ...stages import (FLASH_GRAD_QUERIES, FLASH_LSE, FLASH_OUTPUT, GRAD_OUTPUT, GRAD_WEIGHTS, KEYS, QUERIES, ROW_DOT,
                       STAGES, WEIGHTS)
from ..base import Problem

FLASH_SOURCES = STAGES[FLASH_GRAD_QUERIES].inputs       # Q, K, V, dO, flash_output, flash_lse


def mask_of(n: int, m: int, causal: bool) -> np.ndarray:
    return causal_mask(n, m) if causal else np.zeros((n, m), bool)


def d_reference(dO, O):
    return (dO * O).sum(axis=1, keepdims=True)


def ds_reference(P, dP, D):
    return P * (dP - D)


def flash_backward(src, scale: float, masked: np.ndarray, D=None, lse=None):
    """(dQ, dK, dV, P, dP, D, dS) of the FlashAttention backward from its sources, under `masked`
    (D and lse may be replaced: the diagnoses build buggy variants)."""
    Q, K, V, dO = (np.asarray(src[n], np.float64) for n in FLASH_SOURCES[:4])
    lse = np.asarray(src[FLASH_LSE], np.float64) if lse is None else lse
    S = np.where(masked, -np.inf, (Q @ K.T) * scale)
    P = np.exp(S - lse)
    P[masked] = 0.0
    D = d_reference(dO, np.asarray(src[FLASH_OUTPUT], np.float64)) if D is None else D
    dP = dO @ V.T
    dS = ds_reference(P, dP, D)
    return scale * dS @ K, scale * dS.T @ Q, P.T @ dO, P, dP, D, dS


def flash_reference(index: int):
    """The reference of the flash gradient at `index` of (dQ, dK, dV)."""
    def reference(src, problem: Problem):
        Q, K = np.asarray(src[QUERIES]), np.asarray(src[KEYS])
        return flash_backward(src, problem.scale, mask_of(Q.shape[0], K.shape[0], problem.causal))[index]
    return reference


def flash_with_mask(index: int):
    return lambda src, scale, masked: flash_backward(src, scale, masked)[index]


Own = Callable[[str], np.ndarray]


class Gradients:
    """What a backward stage is computed from (P, dP, D, dS, and the program's own files through
    `own`), with D, dS or the lse replaced by a bug's. Stage path: the program's own P, dP and D;
    recompute (the flash backward): P, dP and D recomputed from its saved output and lse. Each
    part is computed when first asked for (a diagnosis of D never reads dP)."""

    def __init__(self, own: Own, scale: float, masked: np.ndarray, recompute: bool,
                 D: Optional[np.ndarray] = None, dS: Optional[np.ndarray] = None,
                 lse: Optional[np.ndarray] = None) -> None:
        self.own, self.scale, self.masked, self.recompute = own, scale, masked, recompute
        self._D, self._dS, self._lse = D, dS, lse

    def replaced(self, **parts) -> "Gradients":
        kw = dict(D=self._D, dS=self._dS, lse=self._lse)
        kw.update(parts)
        return Gradients(self.own, self.scale, self.masked, self.recompute, **kw)

    @cached_property
    def _flash(self):
        src = {n: self.own(n) for n in FLASH_SOURCES}
        return flash_backward(src, self.scale, self.masked, D=self._D, lse=self._lse)

    @cached_property
    def P(self) -> np.ndarray:
        return self._flash[3] if self.recompute else self.own(WEIGHTS)

    @cached_property
    def dP(self) -> np.ndarray:
        return self._flash[4] if self.recompute else self.own(GRAD_WEIGHTS)

    @cached_property
    def D(self) -> np.ndarray:
        if self._D is not None:
            return self._D
        return self._flash[5] if self.recompute else self.own(ROW_DOT)

    @cached_property
    def dS(self) -> np.ndarray:
        if self._dS is not None:
            return self._dS
        return self._flash[6] if self.recompute else ds_reference(self.P, self.dP, self.D)


def grad_queries(g: Gradients) -> np.ndarray:
    return g.scale * g.dS @ g.own(KEYS)


def grad_keys(g: Gradients) -> np.ndarray:
    return g.scale * g.dS.T @ g.own(QUERIES)


def grad_values(g: Gradients) -> np.ndarray:
    return g.P.T @ g.own(GRAD_OUTPUT)
