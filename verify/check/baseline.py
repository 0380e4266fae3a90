"""The baseline of FlashAttention's own tests: plain attention run eagerly in the half format.

flash-attn's tests (tests/test_flash_attn.py) measure a kernel's error against a reference and
accept it when that error is at most a few times the error of a plain PyTorch attention in the
same half format: `attention_ref(q, k, v, causal=..., upcast=False, reorder_ops=True)` for the
output, autograd through it for dQ, dK, dV. That baseline is eager PyTorch on bf16/fp16 tensors:
each op's result is stored in the format, its GEMMs multiply half values and accumulate in
float32, its softmax computes in float32. This module computes the same values with NumPy (no
torch): float32 arithmetic, each op's result rounded to the format by h (verify/model/half.py's
round_to_format32: nearest even), in flash-attn's order of operations.

Forward:
    Ks = h(K·scale)       reorder_ops scales K, not Q (`k / sqrt(d)`, which PyTorch computes as K
                          times the float32 reciprocal; here the case's scale, in float32)
    S  = h(Q·Ksᵀ)         float32 accumulation, the scores stored in the format; -inf where masked
    P  = h(softmax(S))    float32 inside (exp(S - rowmax) / rowsum), stored in the format
    O  = h(P·V)
Backward, autograd from dO (every gradient an op's result, so stored in the format too):
    dP = h(dO·Vᵀ), dV = h(Pᵀ·dO)           the backward of O = P·V
    G  = h(P∘dP)                           softmax's backward at half: the product is an op of its
    dS = h(G - P∘rowsum(G))                own, stored in the format; its row sums and the rest are
                                           float32 (as measured against PyTorch on a GPU, bit for bit)
    dQ = h(dS·Ks), dKs = h(dSᵀ·Q)          the backward of S = Q·Ksᵀ
    dK = h(dKs·scale)                      the backward of Ks = K·scale
Under a variant (verify/model/scores.py HeadVariant), as flash-attn's attention_ref: the softcap
in the format op by op (h(h(tanh(h(S/C)))·C)), ALiBi and a bias file added in float32 (a float32
bias tensor promotes the sum), −inf where hidden (a row that sees no key: weights 0), dropout as
masked_fill of the weights and V·h(1/(1 − p)); autograd backward through each.
The inputs (Q, K, V, dO) are the case's values rounded to the format, as the verifier's references
use them. Summation orders are NumPy's (BLAS); PyTorch's on a GPU differ, by float32 roundings far
below one half-format rounding.
"""
from __future__ import annotations

from typing import Dict, Optional

import numpy as np

from ..model.attention import softmax_rows
from ..model.half import round_to_format32
from ..model.scores import as_head
from ..stages import GRAD_KEYS, GRAD_QUERIES, GRAD_VALUES, OUTPUT

f32 = np.float32


def eager_half_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, do: Optional[np.ndarray], scale: float,
                         causal, precision: str) -> Dict[str, np.ndarray]:
    """The baseline's output and, given dO, its dQ, dK, dV from inputs holding values of the
    format: float32 arrays of half values, keyed by the stage-path stage each equals. causal: the
    causal bool of a plain case, or the head's HeadVariant."""
    h = lambda x: round_to_format32(x, precision)  # noqa: E731: an op's result, stored
    head = as_head(causal)
    q, k, v = (np.asarray(x, f32) for x in (q, k, v))
    s32 = f32(scale)
    ks = h(k * s32)
    raw = h(q @ ks.T)
    s, t = raw, None
    if head.cap > 0:
        c32 = f32(head.cap)
        t = h(np.tanh(h(raw / c32)))
        s = h(t * c32)
    s = _added_terms(s, head)
    s[head.hidden(*s.shape)] = -np.inf
    p = h(softmax_rows(s))  # float32 scores: float32 inside, as PyTorch's softmax of a half tensor
    keep = np.ones(p.shape, f32) if head.dropout == 0 else head.keep.astype(f32)
    r = h(np.asarray(head.rescale, f32))
    vr = v if head.dropout == 0 else h(v * r)
    out = {OUTPUT: h((p * keep) @ vr)}
    if do is not None:
        do = np.asarray(do, f32)
        dp = h(do @ vr.T) * keep
        dvr = h((p * keep).T @ do)
        out[GRAD_VALUES] = dvr if head.dropout == 0 else h(dvr * r)
        g = h(p * dp)
        ds = h(g - p * g.sum(axis=1, keepdims=True, dtype=f32))
        if t is not None:  # through ·C, tanh, /C
            ds = h(h(h(ds * c32) * (f32(1) - t * t)) / c32)
        out[GRAD_QUERIES] = h(ds @ ks)
        out[GRAD_KEYS] = h(h(ds.T @ q) * s32)
    return out


def _added_terms(s: np.ndarray, head) -> np.ndarray:
    """ALiBi's and the bias file's terms added to the half scores, in float32 (flash-attn's test
    builds both as float32 tensors)."""
    terms = head.alibi_terms(*s.shape)
    if head.bias is not None:
        bias = np.where(np.isfinite(head.bias), head.bias, 0.0)
        terms = bias if terms is None else terms + bias
    return s if terms is None else (s + terms.astype(f32)).astype(f32)
