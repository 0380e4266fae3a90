"""The float64 NumPy reference for every stage.

`compute_stage` computes one stage from the matrices named in its table entry
(verify.stages.STAGES[name].inputs); the verifier calls it twice per stage: with the reference chain
(from the original inputs) and with the binary's own upstream outputs (isolated checking).
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable

import numpy as np

from .stages import STAGES


def causal_mask(n: int, m: int) -> np.ndarray:
    """True where masked: top-left aligned, query r sees keys c <= r."""
    return np.triu(np.ones((n, m), dtype=bool), k=1)


def scaled_scores(qk: np.ndarray, scale: float, causal: bool) -> np.ndarray:
    s = qk * scale
    if causal:
        s = np.where(causal_mask(*s.shape), -np.inf, s)
    return s


def softmax_rows(s: np.ndarray) -> np.ndarray:
    m = np.max(s, axis=1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    return e / np.sum(e, axis=1, keepdims=True)


def log_sum_exp_rows(s: np.ndarray) -> np.ndarray:
    m = np.max(s, axis=1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    return m + np.log(np.sum(np.exp(s - m), axis=1, keepdims=True))


_Compute = Callable[[Dict[str, np.ndarray], float, bool], np.ndarray]

_COMPUTE: Dict[str, _Compute] = {
    "Q": lambda src, scale, causal: src["Q"],
    "K": lambda src, scale, causal: src["K"],
    "V": lambda src, scale, causal: src["V"],
    "KT": lambda src, scale, causal: src["K"].T,
    "QK": lambda src, scale, causal: src["Q"] @ src["K"].T,
    "QK_scaled": lambda src, scale, causal: scaled_scores(src["QK"], scale, causal),
    "attention_weights": lambda src, scale, causal: softmax_rows(src["QK_scaled"]),
    "output": lambda src, scale, causal: src["attention_weights"] @ src["V"],
    "flash_output": lambda src, scale, causal:
        softmax_rows(scaled_scores(src["Q"] @ src["K"].T, scale, causal)) @ src["V"],
    "flash_lse": lambda src, scale, causal:
        log_sum_exp_rows(scaled_scores(src["Q"] @ src["K"].T, scale, causal)),
}
assert set(_COMPUTE) == set(STAGES), "reference.py must cover every stage of verify/stages.py"


def compute_stage(name: str, src: Dict[str, np.ndarray], scale: float, causal: bool) -> np.ndarray:
    """float64 reference of stage `name` from its inputs `src` (float64 or float32 arrays)."""
    src64 = {k: np.asarray(v, dtype=np.float64) for k, v in src.items()}
    # A faulty binary's upstream may hold NaN/Inf: the reference then holds them too, quietly;
    # the comparison reports them.
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        return np.ascontiguousarray(_COMPUTE[name](src64, scale, causal))


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
