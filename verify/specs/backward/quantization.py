"""How far the backward stages move when a source is known only to within its printed resolution
(a file printed with fewer digits than float32 holds): the first-order change of each stage in
its sources' quanta.
"""
from __future__ import annotations

import numpy as np

from ...stages import (FLASH_LSE, FLASH_OUTPUT, GRAD_OUTPUT, GRAD_WEIGHTS, KEYS, OUTPUT, QUERIES, ROW_DOT, VALUES,
                       WEIGHTS)
from ..base import Problem, product_quantization
from .reference import flash_backward, mask_of


def _q(q, name):
    return q.get(name, 0.0)


def d_quantization(src, q, problem: Problem):
    moved = _q(q, GRAD_OUTPUT) * np.abs(src[OUTPUT]) + np.abs(src[GRAD_OUTPUT]) * _q(q, OUTPUT)
    return moved.sum(axis=1, keepdims=True)


def dp_quantization(src, q, problem: Problem):
    return product_quantization(src, q, GRAD_OUTPUT, VALUES)


def ds_quantization(src, q, problem: Problem):
    P, dP, D = src[WEIGHTS], src[GRAD_WEIGHTS], src[ROW_DOT]
    # with the product of the two moves: P's can be as large as P itself (half-precision scores)
    moved = _q(q, GRAD_WEIGHTS) + _q(q, ROW_DOT)
    return _q(q, WEIGHTS) * (np.abs(dP - D) + moved) + np.abs(P) * moved


def gemm_quantization(a, b, transpose_a, factor):
    def quantization(src, q, problem: Problem):
        A, B = np.abs(src[a]), np.abs(src[b])
        qa, qb = q.get(a), q.get(b)
        if transpose_a:
            A, qa = A.T, (qa.T if qa is not None else None)
        out = 0.0
        if qa is not None:
            out = out + qa @ B
        if qb is not None:
            out = out + A @ qb
        return abs(problem.scale) * out if factor else out
    return quantization


def flash_quantization(index: int):
    def quantization(src, q, problem: Problem):
        scale, causal = problem.scale, problem.causal
        if not (FLASH_OUTPUT in q or FLASH_LSE in q):
            return 0.0
        Q, K = np.asarray(src[QUERIES]), np.asarray(src[KEYS])
        _, _, _, P, dP, D, dS = flash_backward(src, scale, mask_of(Q.shape[0], K.shape[0], causal))
        q_lse = _q(q, FLASH_LSE)
        q_D = (np.abs(src[GRAD_OUTPUT]) * _q(q, FLASH_OUTPUT)).sum(axis=1, keepdims=True)
        ds_q = np.abs(dS) * q_lse + P * q_D
        return [abs(scale) * ds_q @ np.abs(K), abs(scale) * ds_q.T @ np.abs(Q),
                (P * q_lse).T @ np.abs(src[GRAD_OUTPUT])][index]
    return quantization


