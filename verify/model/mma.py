"""Tensor-core truncation: the one-signed error of a GEMM accumulated by mma instructions that
truncate, each MMA_K-long chunk of a sum at a time (verify/model/kernels.py's kernels with
mma_passes).
"""
from __future__ import annotations

import numpy as np

from .arrays import add_magnitude, add_product, namespace, zeros
from .fused import running_sums
from .kernels import MMA_K
from .rounding import ULP_IN_U


def mma_truncation_det(A: np.ndarray, B: np.ndarray, u: float, passes: int) -> np.ndarray:
    """Bound on the one-signed error of A @ B accumulated by tensor-core mma (truncating): each of
    `passes` mma per MMA_K-long chunk loses < 1 ulp (≤ 2u·|running sum|)."""
    start = zeros(A, (A.shape[0], B.shape[1]))
    _, total = mma_running_sums(A, B, start, start)
    return passes * ULP_IN_U * u * total


# Elements of a batch of the MMA_K-long chunks' products (chunks × A's rows × B's columns) on a
# device: one batched GEMM replaces hundreds of small ones and their launches.
_MMA_BATCH_ELEMS = 1 << 25


def mma_running_sums(A, B, partial, total):
    """(partial, total) after adding A @ B an MMA_K-long chunk of its sum at a time: the running
    sum partial + Σ of the chunks so far, and total + the sum of the running sums' magnitudes after
    each chunk. NumPy's a chunk at a time; a CUDA device's in one kernel (verify/model/fused.py);
    elsewhere a device's chunks in batches, one batched GEMM each,
    their running sums a cumulative sum whose first term holds partial (the same additions in the
    same order, to the float64 rounding of the device's scan)."""
    if not isinstance(A, np.ndarray):
        fused = running_sums(A, B, partial, total, MMA_K)  # (a CUDA device's: one pass, where Triton runs)
        if fused is not None:
            return fused
    R, K = A.shape
    C = B.shape[1]
    per = _MMA_BATCH_ELEMS // max(1, R * C)  # chunks per batch
    xp = namespace(A, B)
    partial, total = partial * 1.0, total * 1.0  # (copies of their own: added into in place)
    if isinstance(A, np.ndarray) or per < 2:
        # A chunk at a time: NumPy's (a batched GEMM of 8-long sums is slower than BLAS's loop),
        # and a device's whose result alone fills a batch (Q·Kᵀ: few chunks, each a large GEMM).
        for k0 in range(0, K, MMA_K):
            partial = add_product(partial, A[:, k0:k0 + MMA_K], B[k0:k0 + MMA_K])
            total = add_magnitude(total, partial)
        return partial, total
    for k0 in range(0, K, per * MMA_K):
        k1 = min(K, k0 + per * MMA_K)
        whole = (k1 - k0) // MMA_K * MMA_K
        if whole:
            n = whole // MMA_K
            a = xp.permute_dims(xp.reshape(A[:, k0:k0 + whole], (R, n, MMA_K)), (1, 0, 2))
            run = a @ xp.reshape(B[k0:k0 + whole], (n, MMA_K, C))  # (n, R, C): each chunk's product
            run[0, ...] = run[0, ...] + partial
            run = xp.cumulative_sum(run, axis=0)
            total = total + xp.linalg.vector_norm(run, axis=0, ord=1)  # (Σ |run| in one pass)
            partial = run[-1, ...]
        if k1 - k0 > whole:  # a last chunk shorter than MMA_K
            partial = add_product(partial, A[:, k0 + whole:k1], B[k0 + whole:k1])
            total = add_magnitude(total, partial)
    return partial, total


__all__ = ["mma_truncation_det", "mma_running_sums"]
