"""output = attention_weights·V (under dropout: (P∘Z)·V/(1 − p), Z the program's keep-mask): a
dot product of length M.

Isolated: the float32 sum's roundings over every summation order (verify/model/dot.py) from the
binary's own weights; under dropout one more rounding of each product P·Z·(1/(1 − p)) and the
float32 1/(1 − p)'s relative error. Chained from Q, K, V: the softmax's errors through P·V, with
the normalization's cancellation, and the final roundings.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..model.arrays import float64
from ..model.attention import softmax_rows
from ..model.chain import chained_eta, chained_logits
from ..model.dot import dot_var, pv, pv_var
from ..model.kernels import SOFTMAX_FINAL_ROUNDINGS
from ..model.rounding import FLUSH, ROUND_VAR, finish, finite_abs
from ..model.scores import dropout_factor_error
from ..model.softmax import mixed_output_var, rowsum_rel_var
from ..stages import KEYS, OUTPUT, QUERIES, VALUES, WEIGHTS
from ..variant import Variant
from .base import Problem, StageSpec, dropout_sources, head_variant
from .copies import PATTERNS


def _reference(src, problem: Problem):
    return problem.head.dropped(src[WEIGHTS]) @ src[VALUES]


def scores_from_inputs(src, scale: float, masked: Optional[np.ndarray], variant: Variant = Variant(),
                       slope: float = 0.0, rows=None, n: Optional[int] = None) -> np.ndarray:
    """The scores the softmax reads, in float64 from the case's Q and K, under `variant`: hidden
    where `masked` (None: the variant's own mask, with the mask and bias files in src). rows: the
    head's query rows that src's Q rows are (all by default), n: the head's query count then."""
    Q, K = float64(src[QUERIES]), float64(src[KEYS])  # NumPy's or the device's (verify/model/arrays.py)
    head = head_variant(variant, slope, src)
    scaled = (Q @ K.T) * scale
    if masked is None:
        return head.scores(scaled, n, rows)
    return np.where(masked, -np.inf, head.modified(scaled, n, rows))


def attention_from_inputs(src, scale, masked, variant: Variant = Variant(), slope: float = 0.0, rows=None,
                          n: Optional[int] = None):
    """softmax(scores)·V in float64 (kept and rescaled under dropout): the output from the case's
    inputs (scores_from_inputs)."""
    scores = scores_from_inputs(src, scale, masked, variant, slope, rows, n)
    head = head_variant(variant, slope, src)
    return head.dropped(softmax_rows(scores), rows) @ float64(src[VALUES])


def _isolated(src, ref, problem: Problem):
    head, u = problem.head, problem.u
    P, V = np.asarray(head.dropped(src[WEIGHTS]), np.float64), np.asarray(src[VALUES], np.float64)
    dropout = head.dropout > 0
    det = (dropout_factor_error(head, u) + u * dropout) * np.abs(ref)
    return dot_var(P, V, u, ROUND_VAR * (1 + dropout)), det


def values_floor(V) -> np.ndarray:
    """Flushed weights and products of a P·V sum: FLUSH·(Σ_j |v_j| + 2M) per column."""
    V = finite_abs(V)
    return FLUSH * (V.sum(axis=0, keepdims=True) + 2 * V.shape[0])


def _chained(sources, problem: Problem):
    head, u, kernel, cache = problem.head, problem.u, problem.kernel, problem.cache
    Q, K, V = sources
    _, p, _, _, _, _ = chained_logits(Q, K, *problem.model_args)
    eta_var = chained_eta(Q, K, *problem.model_args)
    l_var = rowsum_rel_var(p, u, cache=cache)
    dropout = head.dropout > 0
    pz = head.dropped(p)
    O = pv(pz, V, cache)
    p2v2 = (pz * pz) @ (V * V)
    var = (pv_var(pz, V, u, ROUND_VAR, cache) + mixed_output_var(p, eta_var, V, O, cache, head.keep, head.rescale)
           + O * O * l_var + ((SOFTMAX_FINAL_ROUNDINGS + dropout) * ROUND_VAR + kernel.div_var) * u * u * p2v2)
    return finish(O, var, dropout_factor_error(head, u) * np.abs(O), values_floor(V))


def _quantization(src, q, problem: Problem):
    head = problem.head
    out = 0.0
    if WEIGHTS in q:
        out = out + head.dropped(q[WEIGHTS]) @ np.abs(src[VALUES])
    if VALUES in q:
        out = out + np.abs(head.dropped(src[WEIGHTS])) @ q[VALUES]
    return out


SPECS = (
    StageSpec(OUTPUT, reference=_reference, isolated=_isolated, chained=_chained,
              floor=lambda src: values_floor(src[VALUES]), quantization=_quantization, linear=True,
              from_inputs=attention_from_inputs,
              diagnoses=PATTERNS + ("scaled", "mask", "keys", "overflow", "mask_after_softmax", "softmax_axis",
                                    "tile_keys", "key_tile", "online_rescale", "normalization"),
              baseline=OUTPUT, variant_sources=dropout_sources, dropped=(WEIGHTS,)),
)
