"""Attention's building blocks: the causal mask, scaled scores, row softmax, log-sum-exp; float64 for
the references, and in the input's own type otherwise (the flash-attn baseline's softmax runs on
float32 scores in float32)."""
from __future__ import annotations

import numpy as np


def causal_mask(n: int, m: int) -> np.ndarray:
    """True where masked: top-left aligned, query r sees keys c <= r."""
    return np.triu(np.ones((n, m), dtype=bool), k=1)


# In place on one temporary each: a head's matrices are 128 MB at 4096², and every fresh one is
# memory the OS must hand out and zero.
def scaled_scores(qk: np.ndarray, scale: float, causal: bool) -> np.ndarray:
    s = np.multiply(qk, scale)
    if causal:
        np.copyto(s, -np.inf, where=causal_mask(*s.shape))
    return s


def _exp_shifted(s: np.ndarray):
    """(exp(s - m), m) with m the row max (0 for rows without a finite entry)."""
    m = np.max(s, axis=1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.subtract(s, m)
    return np.exp(e, out=e), m


def softmax_rows(s: np.ndarray) -> np.ndarray:
    e, _ = _exp_shifted(s)
    e /= np.sum(e, axis=1, keepdims=True)
    return e


def log_sum_exp_rows(s: np.ndarray) -> np.ndarray:
    e, m = _exp_shifted(s)
    return m + np.log(np.sum(e, axis=1, keepdims=True))
