"""The backward pass's float64 references: D, dS, and the FlashAttention backward (P recomputed
from the logits and the saved flash_lse); and Gradients, the same computation with one part (D,
dS or the lse) replaced, which the backward diagnoses (verify/diagnose/backward.py) rebuild a
failing stage from.

Under a variant (verify/model/scores.py HeadVariant): dS = P∘(dP∘Z/(1 − p) − D) under dropout
(Z the program's keep-mask), dV = (P∘Z/(1 − p))ᵀ·dO; the gradients of Q and K go through the
softcap's derivative f = 1 − t² (t = tanh(scale·QK/C)): dQ = scale·(dS∘f)·K, dK = scale·(dS∘f)ᵀ·Q.
A row that sees no key has P, dS and its dQ row 0, as has a row whose lse is +inf, or −inf beside an
output row of 0 (a row whose sum is 0).
"""
from __future__ import annotations

import math
from functools import cached_property
from typing import Callable, Optional

import numpy as np

from ...model.arrays import float64, like, namespace, put, quiet
from ...model.scores import PLAIN, HeadVariant
from ...stages import (FLASH_GRAD_QUERIES, FLASH_LSE, FLASH_OUTPUT, GRAD_OUTPUT, GRAD_WEIGHTS, KEYS, QUERIES, ROW_DOT,
                       GRAD_SCORES, SCORES, STAGES, WEIGHTS)
from ...variant import Variant
from ..base import Problem, head_variant

FLASH_SOURCES = STAGES[FLASH_GRAD_QUERIES].inputs       # Q, K, V, dO, flash_output, flash_lse


def d_reference(dO, O):
    return namespace(dO).sum(dO * O, axis=1, keepdims=True)


def ds_reference(P, dP, D, head: HeadVariant = PLAIN):
    """P∘(dP − D), with dP kept and rescaled under dropout."""
    return P * (head.dropped(dP) - D)


def cap_factor(S0: np.ndarray, head: HeadVariant) -> Optional[np.ndarray]:
    """1 − t² from scale·QK: what dS is multiplied by on its way to dQ and dK (None: no cap)."""
    return head.cap_slope(S0)


def through_cap(dS: np.ndarray, f: Optional[np.ndarray]) -> np.ndarray:
    return dS if f is None else dS * f


def flash_terms(src, scale: float, masked: np.ndarray, D=None, lse=None, head: HeadVariant = PLAIN, qk=None,
                dp=None):
    """(P, dP, D, dS, G) of the FlashAttention backward from its sources (the rows of Q, dO, the
    output and lse it is given; head: those rows' variant), under `masked` and the head's score
    modifications and dropout (D and lse may be replaced: the diagnoses build buggy variants). dS
    is the gradient of the softmax's input, G = dS through the softcap's derivative. qk: Q·Kᵀ,
    dp: dO·Vᵀ, where the caller has them."""
    Q, K, V, dO = (float64(src[n]) for n in FLASH_SOURCES[:4])  # NumPy's or a device's (model/arrays.py)
    lse = float64(src[FLASH_LSE]) if lse is None else lse
    S0 = (Q @ K.T if qk is None else qk) * scale
    xp, masked = namespace(S0), like(S0, masked)
    # An lse of −inf with an output row of 0 says the row's sum is 0: it holds no weight, as
    # flash-attn's +inf says (a program's own wrong lse, in a row that sees keys, then gives P = 0,
    # not exp(S + inf)). With an output row that holds values, −inf is a buffer never written, and
    # stays what it is.
    O = float64(src[FLASH_OUTPUT])
    empty = lse == -math.inf
    if O.shape[0] == lse.shape[0]:
        empty = empty & namespace(O).all(O == 0, axis=1, keepdims=True)
    lse = namespace(lse).where(empty, math.inf, lse)
    hides = not (isinstance(masked, np.ndarray) and not masked.any())  # (nothing hidden: no where()s)
    S = xp.where(masked, -math.inf, head.modified(S0)) if hides else head.modified(S0)
    with quiet(xp):  # rows that see no key: −inf − lse
        P = xp.exp(S - lse)
    P = put(P, 0.0, masked) if hides else P
    D = d_reference(dO, O) if D is None else D
    dP = dO @ V.T if dp is None else dp
    dS = ds_reference(P, dP, D, head)
    return P, dP, D, dS, through_cap(dS, cap_factor(S0, head))


def flash_backward(src, scale: float, masked: np.ndarray, D=None, lse=None, head: HeadVariant = PLAIN, qk=None):
    """(dQ, dK, dV, P, dP, D, dS) of the FlashAttention backward of a whole head (flash_terms; qk:
    the Q·Kᵀ its scores are recomputed from, where a diagnosis replaces it)."""
    Q, K, dO = (np.asarray(src[n], np.float64) for n in (QUERIES, KEYS, GRAD_OUTPUT))
    P, dP, D, dS, G = flash_terms(src, scale, masked, D, lse, head, qk=qk)
    return scale * G @ K, scale * G.T @ Q, head.dropped(P).T @ dO, P, dP, D, dS


def flash_with_mask(index: int):
    """The flash gradient at `index` under any mask (StageSpec.with_mask)."""
    def with_mask(src, scale, masked, variant: Variant = Variant(), slope: float = 0.0, rows=None, n=None):
        head = head_variant(variant, slope, src)
        if masked is None:
            masked = head.hidden(np.shape(src[QUERIES])[0], np.shape(src[KEYS])[0])
        return flash_backward(src, scale, masked, head=head)[index]
    return with_mask


# ---- the stage path's gradients from their sources --------------------------------------------

def _stage_cap(src, problem: Problem):
    head = problem.head
    return None if head.cap == 0 else cap_factor(np.asarray(src[SCORES], np.float64) * problem.scale, head)


def dq_reference(src, problem: Problem):
    return problem.scale * through_cap(src[GRAD_SCORES], _stage_cap(src, problem)) @ src[KEYS]


def dk_reference(src, problem: Problem):
    return problem.scale * through_cap(src[GRAD_SCORES], _stage_cap(src, problem)).T @ src[QUERIES]


def dv_reference(src, problem: Problem):
    return problem.head.dropped(src[WEIGHTS]).T @ src[GRAD_OUTPUT]


Own = Callable[[str], np.ndarray]


class Gradients:
    """What a backward stage is computed from (P, dP, D, dS, and the program's own files through
    `own`), with D, dS or the lse replaced by a bug's. Stage path: the program's own P, dP and D;
    recompute (the flash backward): P, dP and D recomputed from its saved output and lse. Each
    part is computed when first asked for (a diagnosis of D never reads dP). head: the head's
    variant (verify/model/scores.py HeadVariant; verify/specs/base.py head_variant builds one)."""

    def __init__(self, own: Own, scale: float, masked: np.ndarray, recompute: bool,
                 D: Optional[np.ndarray] = None, dS: Optional[np.ndarray] = None,
                 lse: Optional[np.ndarray] = None, head: HeadVariant = PLAIN, cap_slope: bool = True,
                 qk: Optional[np.ndarray] = None) -> None:
        self.own, self.scale, self.masked, self.recompute = own, scale, masked, recompute
        self._D, self._dS, self._lse, self.head, self.cap_slope, self._qk = D, dS, lse, head, cap_slope, qk

    def replaced(self, **parts) -> "Gradients":
        """The same computation with parts replaced (D, dS, lse, head, qk: the recomputed scores'
        Q·Kᵀ, or cap_slope=False: G = dS, the softcap's derivative left out)."""
        kw = dict(D=self._D, dS=self._dS, lse=self._lse, head=self.head, cap_slope=self.cap_slope, qk=self._qk)
        kw.update(parts)
        return Gradients(self.own, self.scale, self.masked, self.recompute, **kw)

    @cached_property
    def _flash(self):
        src = {n: self.own(n) for n in FLASH_SOURCES}
        return flash_backward(src, self.scale, self.masked, D=self._D, lse=self._lse, head=self.head, qk=self._qk)

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
        return self._flash[6] if self.recompute else ds_reference(self.P, self.dP, self.D, self.head)

    @cached_property
    def G(self) -> np.ndarray:
        """dS through the softcap's derivative (dS without a cap): what dQ and dK are made of."""
        if self.head.cap == 0 or not self.cap_slope:
            return self.dS
        QK = self.own(SCORES) if not self.recompute else \
            self._qk if self._qk is not None else self.own(QUERIES) @ self.own(KEYS).T
        return through_cap(self.dS, cap_factor(np.asarray(QK, np.float64) * self.scale, self.head))


def grad_queries(g: Gradients) -> np.ndarray:
    return g.scale * g.G @ g.own(KEYS)


def grad_keys(g: Gradients) -> np.ndarray:
    return g.scale * g.G.T @ g.own(QUERIES)


def grad_values(g: Gradients) -> np.ndarray:
    return g.head.dropped(g.P).T @ g.own(GRAD_OUTPUT)
