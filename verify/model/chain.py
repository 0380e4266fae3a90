"""The stage path's errors from the original inputs: QK's dot-product error through the scale and
the variant's score modifications, the softmax's exponents and row sum, and P·V (the chained
bounds of verify/specs/ build on these)."""
from __future__ import annotations

from typing import Optional

import numpy as np

from .arrays import namespace, put
from .dot import qk_var
from .kernels import Kernel
from .rounding import ROUND_VAR, HeadCache, memo
from .scores import as_head, modification_det
from .softmax import exponent_var, logits, raw_logits, softmax


def chained_logits(Q, K, scale: float, head, u: float, kernel: Kernel, cache: Optional[HeadCache]):
    """Logits, softmax parts, and the error of the binary's scores: QK's dot product, scaled
    (variance), plus ≤ 2u|scale·QK| of their own (det), both through the softcap's derivative, and
    the modifications' own roundings (det; verify/model/scores.py). head: a HeadVariant or the
    causal bool of a plain case."""
    head = as_head(head)

    def compute():
        S = logits(Q, K, scale, head, cache)
        p, d, _, finite = softmax(S, cache)
        xp = namespace(S)
        masked = ~finite if not bool(xp.all(finite)) else None  # an unmasked head skips every where()
        s_var = (scale * scale) * qk_var(Q, K, u, ROUND_VAR, cache)
        if head.modifies:
            S0 = raw_logits(Q, K, scale, cache)
            s_det = 2.0 * u * np.abs(S0)
            slope = head.cap_slope(S0)
            if slope is not None:
                s_var = s_var * (slope * slope)
                s_det *= slope
            s_det += modification_det(S0, head, u, kernel)
        else:
            s_det = xp.abs(S if masked is None else xp.where(finite, S, 0.0))
            s_det *= 2.0 * u
        if masked is not None:
            s_var, s_det = put(s_var, 0.0, masked), put(s_det, 0.0, masked)
        return S, p, d, finite, s_var, s_det
    return memo(cache, "chained logits", (Q, K), (scale, head, u, kernel), compute)


def chained_eta(Q, K, scale: float, head, u: float, kernel: Kernel,
                cache: Optional[HeadCache]) -> np.ndarray:
    """Variance of each exponent's relative error along the chain: the logit's error (its bounded
    part enters as variance, at most its square) and exp's own."""
    head = as_head(head)
    S, p, d, finite, s_var, s_det = chained_logits(Q, K, scale, head, u, kernel, cache)

    def compute():
        eta = s_det * s_det
        eta += s_var
        eta += exponent_var(d, finite, u, kernel)
        return eta
    return memo(cache, "chained eta", (Q, K), (scale, head, u, kernel), compute)
