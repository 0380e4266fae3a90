"""How far the backward stages move when a source is known only to within its printed resolution
(a file printed with fewer digits than float32 holds; a half pipeline's conversions): the
first-order change of each stage in its sources' quanta, through the variant's factors (dropout's
keep-mask and 1/(1 − p), the softcap's derivative).
"""
from __future__ import annotations

import numpy as np

from ...stages import (FLASH_LSE, FLASH_OUTPUT, GRAD_OUTPUT, GRAD_SCORES, GRAD_WEIGHTS, OUTPUT,
                       ROW_DOT, SCORES, VALUES, WEIGHTS)
from ..base import Problem, product_quantization
from .flash_tiles import flash_moves
from .reference import through_cap


def _q(q, name):
    return q.get(name, 0.0)


def d_quantization(src, q, problem: Problem):
    moved = _q(q, GRAD_OUTPUT) * np.abs(src[OUTPUT]) + np.abs(src[GRAD_OUTPUT]) * _q(q, OUTPUT)
    return moved.sum(axis=1, keepdims=True)


def dp_quantization(src, q, problem: Problem):
    return product_quantization(src, q, GRAD_OUTPUT, VALUES)


def ds_quantization(src, q, problem: Problem):
    head = problem.head
    P, dP, D = src[WEIGHTS], head.dropped(src[GRAD_WEIGHTS]), src[ROW_DOT]
    # with the product of the two moves: P's can be as large as P itself (half-precision scores)
    moved = head.dropped(_q(q, GRAD_WEIGHTS)) + _q(q, ROW_DOT)
    return _q(q, WEIGHTS) * (np.abs(dP - D) + moved) + np.abs(P) * moved


def _cap_moves(src, q, problem: Problem):
    """(f, how far f moves) for the softcap's derivative f = 1 − t² of scale·QK when QK moves by
    its quantum: |df/dS0| = 2|t|(1 − t²)/C; (None, 0) without a cap."""
    head = problem.head
    if head.cap == 0:
        return None, 0.0
    S0 = np.asarray(src[SCORES], np.float64) * problem.scale
    t = np.tanh(S0 / head.cap)
    f = 1.0 - t * t
    return f, 2 * np.abs(t) * f / head.cap * abs(problem.scale) * _q(q, SCORES)


def grad_quantization(other: str, transpose: bool):
    """dQ = scale·(dS∘f)·K (other K) or dK = scale·(dS∘f)ᵀ·Q (other Q, transpose)."""
    def quantization(src, q, problem: Problem):
        f, f_moved = _cap_moves(src, q, problem)
        dS = np.asarray(src[GRAD_SCORES], np.float64)
        qa = through_cap(np.broadcast_to(_q(q, GRAD_SCORES), dS.shape), f) + np.abs(dS) * f_moved
        A, B = np.abs(through_cap(dS, f)), np.abs(src[other])
        if transpose:
            A, qa = A.T, qa.T
        out = 0.0
        if GRAD_SCORES in q or (f is not None and SCORES in q):
            out = out + qa @ B
        if other in q:
            out = out + A @ q[other]
        return abs(problem.scale) * out
    return quantization


def dv_quantization(src, q, problem: Problem):
    """dV = (P∘Z/(1 − p))ᵀ·dO."""
    head = problem.head
    out = 0.0
    if WEIGHTS in q:
        out = out + head.dropped(np.broadcast_to(q[WEIGHTS], np.shape(src[WEIGHTS]))).T @ np.abs(src[GRAD_OUTPUT])
    if GRAD_OUTPUT in q:
        out = out + np.abs(head.dropped(src[WEIGHTS])).T @ q[GRAD_OUTPUT]
    return out


def flash_quantization(index: int):
    def quantization(src, q, problem: Problem):
        if not (FLASH_OUTPUT in q or FLASH_LSE in q):
            return 0.0
        return flash_moves(src, q, problem.scale, problem.head)[index]
    return quantization
