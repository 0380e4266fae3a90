"""Attention's float64 building blocks: the causal mask, scaled scores, row softmax, log-sum-exp."""
from __future__ import annotations

import numpy as np


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
