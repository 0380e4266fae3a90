"""The FlashAttention forward's error: the online softmax's logits, weights and rescales, a common
scale factor, tensor-core truncation; with the variants' score modifications (verify/model/scores.py)
and dropout's rescaling.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import numpy as np

from .arrays import isfinite, like, namespace, put, zeros
from .dot import mma_truncation_det, pv, pv_var, qk_var
from .kernels import FLASH_LOGIT_ROUNDINGS, Kernel
from .rounding import ROUND_VAR, HeadCache, everywhere, memo
from .scores import HeadVariant, as_head, dropout_factor_error, modification_det
from .tiles import over_rows, rows_of
from .softmax import exponent_var, finite_logits, logits, mixed_output_var, p2_eta, raw_logits, rowsum_rel_var, softmax


def flash_parts(Q: np.ndarray, K: np.ndarray, scale: float, head, u: float, kernel: Kernel,
                cache: Optional[HeadCache] = None):
    """What both flash stages share: logits, weights, and the variance of each exponent. head: a
    HeadVariant or the causal bool of a plain case."""
    head = as_head(head)
    return memo(cache, "flash parts", (Q, K), (scale, head, u, kernel),
                lambda: _compute_flash_parts(Q, K, scale, head, u, kernel, cache))


def logit_magnitude(S: np.ndarray, finite: np.ndarray, head: HeadVariant) -> np.ndarray:
    """|S| as the flash logits' roundings see it: raised by slope·diag(i) under causal ALiBi
    (flash-attn's slope·j; HeadVariant.flash_shift), 0 where hidden."""
    xp = namespace(S)
    seen = everywhere(finite)  # (then the where()s are no-ops)
    mag = xp.abs(S) if seen else xp.where(finite, xp.abs(S), 0.0)
    shift = head.flash_shift(*S.shape)
    if shift is not None:
        mag = mag + like(S, np.abs(shift)) if seen else xp.where(finite, mag + like(S, np.abs(shift)), 0.0)
    return mag


def _compute_flash_parts(Q, K, scale: float, head: HeadVariant, u: float, kernel: Kernel,
                         cache: Optional[HeadCache]):
    product = once(lambda: times_transposed(Q, K, cache))  # (the logits' and their variance's, if computed)
    S = logits(Q, K, scale, head, cache, product)
    p, d, m, finite = softmax(S, cache)
    # eta_var = where(finite, scale²·var(QK)·(1 − t²)², 0) + the modifications' roundings + the
    # exponent's own
    xp = namespace(S)
    eta_var = (scale * scale) * qk_var(Q, K, u, kernel.flash_product_var, cache, product)
    slope = None
    if head.modifies:
        S0 = raw_logits(Q, K, scale, cache)
        slope = head.cap_slope(S0)
        if slope is not None:
            eta_var *= slope * slope
        eta_var += modification_det(S0, head, u, kernel, flash=True) ** 2
    eta_var = put(eta_var, 0.0, ~finite)
    eta_var += exponent_var(d, finite, u, kernel, logit_magnitude(S, finite, head), FLASH_LOGIT_ROUNDINGS)
    l_var = rowsum_rel_var(p, u, kernel.rescale_factor, cache)
    s_det = None  # (the logits' one-signed errors: none but a tensor core's truncation)
    if kernel.mma_passes:
        # |scale|: a bound is a magnitude (a negative scale made it negative: found by the GPU
        # false-alarm sweep, case 129, scale -0.74, every flash_lse element failing).
        s_det = xp.where(finite, abs(scale) * mma_truncation_det(Q, K.T, u, kernel.mma_passes), 0.0)
        if slope is not None:
            s_det *= slope
    return S, p, m, eta_var, l_var, s_det


def common_factor_logits(Q, K, scale: float, head: HeadVariant, cache: Optional[HeadCache]) -> Tuple[np.ndarray, ...]:
    """What one rounded factor common to the head may multiply: the logits (a folded log2(e),
    raised by flash-attn's causal ALiBi shift), and, where the variant modifies them, scale·QK
    before the cap, as it reaches the logits ((1 − t²)·S0). 0 where hidden or not finite (an
    infinite input's S0 under the cap, whose slope is 0), so that a row's Σ_j p_j·S_j stays finite.
    Kept in the cache: the forward's output and lse and the backward's weights each ask for them."""
    return memo(cache, "common factor logits", (Q, K), (scale, head),
                lambda: _common_factor_logits(Q, K, scale, head, cache))


def _common_factor_logits(Q, K, scale: float, head: HeadVariant, cache: Optional[HeadCache]) -> Tuple[np.ndarray, ...]:
    S = logits(Q, K, scale, head, cache)
    xp = namespace(S)
    finite = finite_logits(S, cache)
    out = [xp.where(finite, S, 0.0)]
    shift = head.flash_shift(*S.shape)
    if shift is not None:
        out[0] = xp.where(finite, out[0] + like(S, shift), 0.0)
    if head.modifies:
        S0 = raw_logits(Q, K, scale, cache)
        slope = head.cap_slope(S0)
        factor = S0 if slope is None else S0 * slope
        out.append(xp.where(finite & isfinite(factor), factor, 0.0))
    return tuple(out)  # (a tuple: the cache marks its NumPy arrays read-only, as they are shared)


def common_scale_det(S: np.ndarray, p: np.ndarray, u: float):
    """A relative error δ ≤ u of the head's one float32 scale factor moves every logit by δ·S_j:
    ΔO = δ·Σ_j p_j (S_j - S̄)(v_j - O) and Δlse = δ·S̄ (S̄ = Σ_j p_j S_j). Returns the weights
    w_j = u·p_j·|S_j - S̄| and u·|S̄|. S: common_factor_logits' (0 where hidden, so finite)."""
    xp = namespace(S)
    mean = xp.sum(p * S, axis=1, keepdims=True)
    return u * p * xp.abs(S - mean), u * xp.abs(mean)


def once(compute: Callable[[], np.ndarray]) -> Callable[[], np.ndarray]:
    """compute, computed at the first call only (a product two parts may ask for, or neither)."""
    kept: list = []

    def get():
        if not kept:
            kept.append(compute())
        return kept[0]
    return get


def times_transposed(A: np.ndarray, B: np.ndarray, cache: Optional[HeadCache]) -> np.ndarray:
    """A·Bᵀ (Q·Kᵀ, dO·Vᵀ), kept in NumPy's cache: a tile's logits, weights, dP and their variances
    ask for it, in the chain's pass and in the isolated pass that shares its tiles there (a device's
    passes are apart: its tile's product is not kept for them)."""
    return memo(cache if isinstance(A, np.ndarray) else None, "A Bt", (A, B), (), lambda: A @ B.T)


def plus(a, b):
    """a + b, where None is a zero that no array was made for (a one-signed part a kernel lacks)."""
    return b if a is None else a if b is None else a + b


def _common_dets(Q, K, scale, head, p, u, kernel, cache):
    """(Σ of common_scale_det's weights, Σ of its lse parts) over common_factor_logits; None for a
    kernel without a common factor."""
    if not kernel.common_scale:
        return None, None
    parts = [common_scale_det(S, p, u) for S in common_factor_logits(Q, K, scale, head, cache)]
    return sum(w for w, _ in parts), sum(m for _, m in parts)


def flash_output_var_det(Q: np.ndarray, K: np.ndarray, V: np.ndarray, scale: float, head, u: float,
                         kernel: Kernel, cache: Optional[HeadCache]) -> Tuple[np.ndarray, np.ndarray]:
    """(variance, one-signed part) of the error of the flash forward's output (row tile by row
    tile: verify/model/tiles.py)."""
    return over_rows(Q.shape[0], K.shape[0], min(Q.shape[1], V.shape[1]), as_head(head), cache,
                     lambda r, h, c: _output_var_det(rows_of(Q, r), K, V, scale, h, u, kernel, c))


def _output_var_det(Q, K, V, scale: float, head: HeadVariant, u: float, kernel: Kernel, cache: Optional[HeadCache]):
    S, p, m, eta_var, l_var, s_det = flash_parts(Q, K, scale, head, u, kernel, cache)
    dropout = head.dropout > 0
    pz = head.dropped(p)  # the weights as P·V sums them: kept and rescaled under dropout
    O = pv(pz, V, cache)
    # P̃·V accumulated key by key (plus the tile rescales); the final division (and, on the
    # GPU, the split-KV combine) adds kernel.final_roundings roundings of O; dropout one more
    # rounding (of each kept weight's product, or of O).
    acc_var = kernel.rescale_factor * pv_var(pz, V, u, kernel.flash_product_var + ROUND_VAR * dropout, cache)
    var = (acc_var + mixed_output_var(p, eta_var, V, O, cache, head.keep, head.rescale) + O * O * l_var
           + ((kernel.final_roundings + dropout) * ROUND_VAR + kernel.div_var) * (u * O) ** 2)
    # One-signed parts: a common scale error and tensor-core truncation of the logits move
    # O by at most Σ_j p_j·|ΔS_j|·|r·Z_j·v_j - O|; truncation in P̃·V adds its own, the rounded
    # 1/(1 − p) its relative error.
    w = plus(None if s_det is None else p * s_det, _common_dets(Q, K, scale, head, p, u, kernel, cache)[0])
    xp = namespace(O)
    if w is None:  # (none: no N×M pass or GEMM of zeros)
        det = zeros(O, O.shape)
    else:
        det = head.dropped(w) @ xp.abs(V) + xp.abs(O) * xp.sum(w, axis=1, keepdims=True)
    det = det + dropout_factor_error(head, u) * xp.abs(O)
    if kernel.mma_passes:
        det = det + mma_truncation_det(pz, V, u, kernel.mma_passes)
    return var, det


def flash_lse_sums(Q: np.ndarray, K: np.ndarray, scale: float, head, u: float, kernel: Kernel,
                   cache: Optional[HeadCache]):
    """The row sums of the log-sum-exp's bound: the row max m, Σ_j p_j²·var(η_j), the row sum's
    relative variance and the one-signed part (row tile by row tile)."""
    return over_rows(Q.shape[0], K.shape[0], Q.shape[1], as_head(head), cache,
                     lambda r, h, c: _lse_sums(rows_of(Q, r), K, scale, h, u, kernel, c))


def flash_forward_rows(Q: np.ndarray, K: np.ndarray, V: np.ndarray, scale: float, head, u: float, kernel: Kernel,
                      cache: Optional[HeadCache]):
    """(flash_output_var_det, flash_lse_sums) in one pass over the row tiles, which share each
    tile's logits and softmax (a head's cache shares them for a head of one tile)."""
    def tile(r, h, c):
        Qr = rows_of(Q, r)
        return _output_var_det(Qr, K, V, scale, h, u, kernel, c) + _lse_sums(Qr, K, scale, h, u, kernel, c)
    parts = over_rows(Q.shape[0], K.shape[0], min(Q.shape[1], V.shape[1]), as_head(head), cache, tile)
    return parts[:2], parts[2:]


def _lse_sums(Q, K, scale: float, head: HeadVariant, u: float, kernel: Kernel, cache: Optional[HeadCache]):
    S, p, m, eta_var, l_var, s_det = flash_parts(Q, K, scale, head, u, kernel, cache)
    xp = namespace(p)
    eta_sum = xp.sum(p2_eta(p, eta_var, cache), axis=1, keepdims=True)
    det = plus(None if s_det is None else xp.sum(p * s_det, axis=1, keepdims=True),
               _common_dets(Q, K, scale, head, p, u, kernel, cache)[1])
    return m, eta_sum, l_var, zeros(p, (p.shape[0], 1)) if det is None else det
