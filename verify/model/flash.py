"""The FlashAttention forward's error: the online softmax's logits, weights and rescales, a common
scale factor, tensor-core truncation.
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from .dot import mma_truncation_det, pv, pv_var, qk_var
from .kernels import FLASH_LOGIT_ROUNDINGS, Kernel
from .rounding import ROUND_VAR, HeadCache, memo
from .softmax import exponent_var, logits, mixed_output_var, p2_eta, rowsum_rel_var, softmax


def flash_parts(Q: np.ndarray, K: np.ndarray, scale: float, causal: bool, u: float, kernel: Kernel,
                cache: Optional[HeadCache] = None):
    """What both flash stages share: logits, weights, and the variance of each exponent."""
    return memo(cache, "flash parts", (Q, K), (scale, causal, u, kernel),
                lambda: _compute_flash_parts(Q, K, scale, causal, u, kernel, cache))


def _compute_flash_parts(Q, K, scale: float, causal: bool, u: float, kernel: Kernel,
                         cache: Optional[HeadCache]):
    S = logits(Q, K, scale, causal, cache)
    p, d, m, finite = softmax(S, cache)
    # eta_var = where(finite, scale²·var(QK), 0) + the exponent's own
    eta_var = np.multiply(scale * scale, qk_var(Q, K, u, kernel.flash_product_var, cache))
    np.copyto(eta_var, 0.0, where=~finite)
    eta_var += exponent_var(d, finite, u, kernel, S, FLASH_LOGIT_ROUNDINGS)
    l_var = rowsum_rel_var(p, u, kernel.rescale_factor, cache)
    s_det = np.zeros(S.shape)
    if kernel.mma_passes:
        # |scale|: a bound is a magnitude (a negative scale made it negative: found by the GPU
        # false-alarm sweep, case 129, scale -0.74, every flash_lse element failing).
        s_det = np.where(finite, abs(scale) * mma_truncation_det(Q, K.T, u, kernel.mma_passes), 0.0)
    return S, p, m, eta_var, l_var, s_det


def common_scale_det(S: np.ndarray, p: np.ndarray, u: float):
    """A relative error δ ≤ u of the head's one float32 scale factor moves every logit by δ·S_j:
    ΔO = δ·Σ_j p_j (S_j - S̄)(v_j - O) and Δlse = δ·S̄ (S̄ = Σ_j p_j S_j). Returns the weights
    w_j = u·p_j·|S_j - S̄| and u·|S̄|."""
    Sf = np.where(np.isfinite(S), S, 0.0)
    mean = (p * Sf).sum(axis=1, keepdims=True)
    return u * p * np.abs(Sf - mean), u * np.abs(mean)


def flash_output_var_det(Q: np.ndarray, K: np.ndarray, V: np.ndarray, scale: float, causal: bool, u: float,
                         kernel: Kernel, cache: Optional[HeadCache]) -> Tuple[np.ndarray, np.ndarray]:
    """(variance, one-signed part) of the error of the flash forward's output."""
    S, p, m, eta_var, l_var, s_det = flash_parts(Q, K, scale, causal, u, kernel, cache)
    O = pv(p, V, cache)
    # P̃·V accumulated key by key (plus the tile rescales); the final division (and, on the
    # GPU, the split-KV combine) adds kernel.final_roundings roundings of O.
    acc_var = kernel.rescale_factor * pv_var(p, V, u, kernel.flash_product_var, cache)
    var = (acc_var + mixed_output_var(p, eta_var, V, O, cache) + O * O * l_var
           + (kernel.final_roundings * ROUND_VAR + kernel.div_var) * (u * O) ** 2)
    # One-signed parts: a common scale error and tensor-core truncation of the logits move
    # O by at most Σ_j p_j·|ΔS_j|·|v_j - O|; truncation in P̃·V adds its own.
    w = p * s_det
    if kernel.common_scale:
        w = w + common_scale_det(S, p, u)[0]
    det = w @ np.abs(V) + np.abs(O) * w.sum(axis=1, keepdims=True)
    if kernel.mma_passes:
        det = det + mma_truncation_det(p, V, u, kernel.mma_passes)
    return var, det


def flash_lse_sums(Q: np.ndarray, K: np.ndarray, scale: float, causal: bool, u: float, kernel: Kernel,
                   cache: Optional[HeadCache]):
    """The row sums of the log-sum-exp's bound: Σ_j p_j²·var(η_j) and the one-signed part."""
    S, p, m, eta_var, l_var, s_det = flash_parts(Q, K, scale, causal, u, kernel, cache)
    eta_sum = p2_eta(p, eta_var, cache).sum(axis=1, keepdims=True)
    det = (p * s_det).sum(axis=1, keepdims=True)
    if kernel.common_scale:
        det = det + common_scale_det(S, p, u)[1]
    return m, eta_sum, l_var, det
