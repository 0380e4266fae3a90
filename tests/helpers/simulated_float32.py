"""Correct float32 attention computations simulated in NumPy, in several summation orders.

Each stage is done in float32 arithmetic, as a correct program would do it: matrix products in
index order (the CPU backend's loops), reverse, FMA, BLAS, pairwise or with 8 interleaved
accumulators; a softmax with a sequential or a pairwise row sum; a tiled online-softmax flash
forward accumulating key by key. The tolerance model must pass all of them.
"""
from __future__ import annotations

import numpy as np

f32 = np.float32
LARGE_STD = 10.0  # verify/files/generate.py's `large`: N(0,1)·10, logits reach the hundreds


def sample(rng, dist, shape):
    if dist == "uniform":
        return rng.random(shape, dtype=f32)
    x = rng.standard_normal(shape, dtype=f32)
    return x * f32(LARGE_STD) if dist == "large" else x


# --- float32 matrix products in different summation orders -----------------------------------

def mm_seq(A, B, reverse=False, fma=False):
    A, B = A.astype(f32), B.astype(f32)
    acc = np.zeros((A.shape[0], B.shape[1]), f32)
    for k in (range(A.shape[1] - 1, -1, -1) if reverse else range(A.shape[1])):
        if fma:  # the product is exact in float64; one rounding of the sum (as an FMA)
            acc = (acc.astype(np.float64) + A[:, k, None].astype(np.float64) * B[None, k, :]).astype(f32)
        else:
            acc = acc + A[:, k, None] * B[None, k, :]
    return acc


def mm_pairwise(A, B):
    t = A.astype(f32)[:, :, None] * B.astype(f32)[None, :, :]
    while t.shape[1] > 1:
        if t.shape[1] % 2:
            t = np.concatenate([t, np.zeros_like(t[:, :1])], axis=1)
        t = t[:, 0::2] + t[:, 1::2]
    return t[:, 0]


def mm_interleaved(A, B, lanes=8):
    A, B = A.astype(f32), B.astype(f32)
    acc = [np.zeros((A.shape[0], B.shape[1]), f32) for _ in range(lanes)]
    for k in range(A.shape[1]):
        acc[k % lanes] = acc[k % lanes] + A[:, k, None] * B[None, k, :]
    out = acc[0]
    for a in acc[1:]:
        out = out + a
    return out


MATMULS = {
    "seq": mm_seq,
    "reverse": lambda A, B: mm_seq(A, B, reverse=True),
    "fma": lambda A, B: mm_seq(A, B, fma=True),
    "blas": lambda A, B: A.astype(f32) @ B.astype(f32),
    "pairwise": mm_pairwise,
    "interleaved": mm_interleaved,
}


# --- the other stages in float32 ---------------------------------------------------------------

def scale_mask32(qk, scale, causal):
    s = qk.astype(f32) * f32(scale)
    if causal:
        s = np.where(np.triu(np.ones(s.shape, bool), 1), f32(-np.inf), s)
    return s


def softmax32(s, sequential=True):
    s = s.astype(f32)
    e = np.exp(s - s.max(axis=1, keepdims=True))
    if sequential:
        l = np.zeros((s.shape[0], 1), f32)
        for j in range(s.shape[1]):
            l = l + e[:, j:j + 1]
        return e / l
    return e * (f32(1) / e.sum(axis=1, keepdims=True, dtype=f32))  # pairwise sum, reciprocal


def tf32(x):
    """Round float32 to TF32 (10 explicit mantissa bits), to nearest even."""
    b = np.ascontiguousarray(x, dtype=f32).view(np.uint32)
    b = (b + np.uint32(0x0FFF) + ((b >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
    return b.view(f32)


def mm_3xtf32(A, B):
    """The fast GPU kernel's split-precision product: hi·hi + hi·lo + lo·hi, each part TF32."""
    A, B = A.astype(f32), B.astype(f32)
    Ah, Bh = tf32(A), tf32(B)
    Al, Bl = tf32(A - Ah), tf32(B - Bh)
    return (Ah @ Bl + Al @ Bh) + Ah @ Bh


def flash32(Q, K, V, scale, causal, Bc=16, sequential=True):
    """Tiled online-softmax forward in float32: (O, lse). sequential=True: P·V and l accumulate
    key by key into the running sums (the CPU backend); False: per-tile BLAS products; "3xtf32":
    per-tile split-precision products (the fast GPU kernel)."""
    Q, K, V = Q.astype(f32), K.astype(f32), V.astype(f32)
    N, M = Q.shape[0], K.shape[0]
    m = np.full((N, 1), -np.inf, f32)
    l = np.zeros((N, 1), f32)
    O = np.zeros((N, V.shape[1]), f32)
    rows = np.arange(N)[:, None]
    for j0 in range(0, M, Bc):
        Kj, Vj = K[j0:j0 + Bc], V[j0:j0 + Bc]
        mm = {True: mm_seq, False: np.matmul, "3xtf32": mm_3xtf32}[sequential]
        S = mm(Q, Kj.T) * f32(scale)                                         # S = Q Kjᵀ
        if causal:
            S = np.where(np.arange(j0, j0 + len(Kj))[None, :] > rows, f32(-np.inf), S)
        m_new = np.maximum(m, S.max(axis=1, keepdims=True))                  # m = rowmax
        P = np.exp(S - m_new)
        alpha = np.exp(np.where(np.isfinite(m), m - m_new, f32(-np.inf)))
        l, O = alpha * l, alpha * O                                          # rescale
        if sequential is True:
            for j in range(len(Kj)):
                l = l + P[:, j:j + 1]
                O = O + P[:, j:j + 1] * Vj[j][None, :]
        else:
            l = l + P.sum(axis=1, keepdims=True, dtype=f32)
            O = O + mm(P, Vj)
        m = m_new
    return O / l, m + np.log(l)


def simulate(Q, K, V, scale, causal, order="seq", seq_softmax=True):
    """Every stage-path output of a correct float32 run: {stage: float32 matrix}."""
    qk = MATMULS[order](Q, K.T)
    s = scale_mask32(qk, scale, causal)
    p = softmax32(s, seq_softmax)
    return {"QK": qk, "QK_scaled": s, "attention_weights": p, "output": MATMULS[order](p, V)}
