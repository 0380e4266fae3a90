"""Attention's building blocks: the mask, the scores, row softmax, log-sum-exp; float64 for the
references, and in the input's own type otherwise (the flash-attn baseline's softmax runs on
float32 scores in float32). Every mask comes from verify/variant.py (through HeadVariant)."""
from __future__ import annotations

import numpy as np

from ..variant import Variant, hidden
from .arrays import isfinite, namespace, quiet
from .scores import as_head

_CAUSAL = Variant(causal=True)


def causal_mask(n: int, m: int) -> np.ndarray:
    """True where masked: top-left aligned, query r sees keys c <= r."""
    return hidden(_CAUSAL, n, m)


# In place on one temporary each: a head's matrices are 128 MB at 4096², and every fresh one is
# memory the OS must hand out and zero.
def scaled_scores(qk: np.ndarray, scale: float, head) -> np.ndarray:
    """The scores the softmax reads from QK: scale·QK, modified by the head's variant (softcap,
    ALiBi, bias), −inf where hidden. head: a HeadVariant, or the causal bool of a plain case."""
    head = as_head(head)
    if not isinstance(qk, np.ndarray):  # a device's (verify/model/arrays.py): its masking there
        return head.scores(qk * scale)
    s = np.multiply(qk, scale)
    if head.modifies:
        return head.scores(s)
    if head.variant.structural or head.mask is not None:
        np.copyto(s, -np.inf, where=head.hidden(*s.shape))
    return s


def _exp_shifted(s):
    """(exp(s - m), m) with m the row max (0 for rows without a finite entry); s: any array
    namespace's (verify/model/arrays.py)."""
    xp = namespace(s)
    m = xp.max(s, axis=1, keepdims=True)
    m = xp.where(isfinite(m), m, 0.0)
    if xp is np:
        e = np.subtract(s, m)
        return np.exp(e, out=e), m
    return xp.exp(s - m), m


def softmax_rows(s):
    """Row softmax; a row that sees no key (all −inf) is all 0."""
    e, _ = _exp_shifted(s)
    xp = namespace(e)
    total = xp.sum(e, axis=1, keepdims=True)
    # NaN stays NaN: a faulty upstream's
    return e / xp.where(total == 0, 1.0, total)


def softmax_and_lse(s):
    """(softmax_rows(s), log_sum_exp_rows(s)) from one exponentiation of s (the same values)."""
    e, m = _exp_shifted(s)
    xp = namespace(e)
    total = xp.sum(e, axis=1, keepdims=True)
    with quiet(xp):
        lse = m + xp.log(total)
    return e / xp.where(total == 0, 1.0, total), lse


def log_sum_exp_rows(s):
    """log Σ_j exp(s_j) per row; −inf for a row that sees no key."""
    e, m = _exp_shifted(s)
    xp = namespace(e)
    with quiet(xp):
        return m + xp.log(xp.sum(e, axis=1, keepdims=True))
