"""output = attention_weights·V: a dot product of length M.

Isolated: the float32 sum's roundings over every summation order (verify/model/dot.py) from the
binary's own weights. Chained from Q, K, V: the softmax's errors through P·V, with the
normalization's cancellation, and the final roundings.
"""
from __future__ import annotations

import numpy as np

from ..model.attention import softmax_rows
from ..model.chain import chained_eta, chained_logits
from ..model.dot import dot_var, pv, pv_var
from ..model.kernels import SOFTMAX_FINAL_ROUNDINGS
from ..model.rounding import FLUSH, ROUND_VAR, finish, finite_abs
from ..model.softmax import mixed_output_var, rowsum_rel_var
from ..stages import KEYS, OUTPUT, QUERIES, VALUES, WEIGHTS
from .base import Problem, StageSpec
from .copies import PATTERNS


def _reference(src, problem: Problem):
    return src[WEIGHTS] @ src[VALUES]


def attention_from_inputs(src, scale, masked):
    """softmax(scale·Q·Kᵀ, -inf where masked)·V in float64: the output from the case's inputs."""
    Q, K = np.asarray(src[QUERIES], np.float64), np.asarray(src[KEYS], np.float64)
    scores = np.where(masked, -np.inf, (Q @ K.T) * scale)
    with np.errstate(invalid="ignore"):  # a row with no visible key: 0/0
        return softmax_rows(scores) @ np.asarray(src[VALUES], np.float64)


def _isolated(src, ref, problem: Problem):
    P, V = np.asarray(src[WEIGHTS], np.float64), np.asarray(src[VALUES], np.float64)
    return dot_var(P, V, problem.u), np.zeros(ref.shape)


def values_floor(V) -> np.ndarray:
    """Flushed weights and products of a P·V sum: FLUSH·(Σ_j |v_j| + 2M) per column."""
    V = finite_abs(V)
    return FLUSH * (V.sum(axis=0, keepdims=True) + 2 * V.shape[0])


def _chained(sources, problem: Problem):
    scale, causal, u, kernel, cache = problem.scale, problem.causal, problem.u, problem.kernel, problem.cache
    Q, K, V = sources
    _, p, _, _, _, _ = chained_logits(Q, K, scale, causal, u, cache)
    eta_var = chained_eta(Q, K, *problem.model_args)
    l_var = rowsum_rel_var(p, u, cache=cache)
    O = pv(p, V, cache)
    p2v2 = (p * p) @ (V * V)
    var = (pv_var(p, V, u, ROUND_VAR, cache) + mixed_output_var(p, eta_var, V, O, cache) + O * O * l_var
           + (SOFTMAX_FINAL_ROUNDINGS * ROUND_VAR + kernel.div_var) * u * u * p2v2)
    return finish(O, var, np.zeros(O.shape), values_floor(V))


def _quantization(src, q, problem: Problem):
    out = 0.0
    if WEIGHTS in q:
        out = out + q[WEIGHTS] @ np.abs(src[VALUES])
    if VALUES in q:
        out = out + np.abs(src[WEIGHTS]) @ q[VALUES]
    return out


SPECS = (
    StageSpec(OUTPUT, reference=_reference, isolated=_isolated, chained=_chained,
              floor=lambda src: values_floor(src[VALUES]), quantization=_quantization, linear=True,
              from_inputs=attention_from_inputs, diagnoses=PATTERNS + ("scaled", "mask", "keys", "overflow"),
              baseline=OUTPUT),
)
