"""The float64 NumPy reference for every stage.

`compute_stage` computes one stage from the matrices named in its table entry
(verify.stages.STAGES[name].inputs) by its spec's reference (verify/specs/); the verifier calls it
twice per stage: with the reference chain
(from the original inputs) and with the binary's own upstream outputs (isolated checking).
"""
from __future__ import annotations

from typing import Dict, Iterable

import numpy as np

from ..model.attention import causal_mask, log_sum_exp_rows, scaled_scores, softmax_rows
from ..specs import SPECS
from ..specs.base import Problem
from ..stages import STAGES

__all__ = ["compute_stage", "reference_chain", "causal_mask", "scaled_scores", "softmax_rows",
           "log_sum_exp_rows"]


def compute_stage(name: str, src: Dict[str, np.ndarray], scale: float, causal: bool) -> np.ndarray:
    """float64 reference of stage `name` from its inputs `src` (float64 or float32 arrays)."""
    src64 = {k: np.asarray(v, dtype=np.float64) for k, v in src.items()}
    # A faulty binary's upstream may hold NaN/Inf: the reference then holds them too, quietly;
    # the comparison reports them.
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        return np.ascontiguousarray(SPECS[name].reference(src64, Problem(scale, causal)))


def reference_chain(inputs: Dict[str, np.ndarray], scale: float, causal: bool,
                    needed: Iterable[str]) -> Dict[str, np.ndarray]:
    """Every stage in `needed` (and what it depends on) computed from the original Q, K, V."""
    out: Dict[str, np.ndarray] = {k: np.asarray(v, dtype=np.float64) for k, v in inputs.items()}
    needed = set(needed)

    def want(name: str) -> np.ndarray:
        if name not in out:
            out[name] = compute_stage(name, {d: want(d) for d in STAGES[name].inputs}, scale, causal)
        return out[name]

    for name in STAGES:  # table order: dependencies first
        if name in needed:
            want(name)
    return {k: out[k] for k in needed}
