"""The tolerance model: an element-wise bound on |got - ref| for every stage, from rounding analysis.

Each float32 operation rounds to nearest: its result carries an error uniform in ±ulp/2, at most
u·|x| and with a standard deviation at most u·|x|/√3 (u = 2⁻²⁴ for fp32; UNIT_ROUNDOFF gives u per
computing precision, the only thing precision changes). A stage's error is a sum of many such
independent roundings, so the model computes, per element, the VARIANCE of that sum from the
actual data (the partial sums the computation passes through), and allows LAMBDA standard
deviations: a probabilistic bound in the sense of Higham & Mary (2019), but with the exact partial
sums instead of the worst-case Σ|a_i b_i|, so it stays within ~10× the typical error of a correct
computation (a worst-case γ_K·Σ|a_i b_i| bound is 50-200× looser for K = 64..1024 and lets real
bugs through). Errors that are bounded but one-signed (the scale's own rounding, tensor-core
truncation in the GPU flash kernel) enter as their bound (det). Per backend (run.toml's
`backend`) the arithmetic differs (KERNELS); without one the model takes the looser of each.
describe_model() is the text `check --help` shows; tests/test_tolerance.py calibrates it.

Masked entries (-inf in the reference) get bound 0: they must match exactly.
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass, replace
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np

from .stages import INPUT_NAMES, STAGES

UNIT_ROUNDOFF = {"fp32": 2.0**-24, "tf32": 2.0**-11, "bf16": 2.0**-8}

# Standard deviations allowed. The modeled errors are sums of independent bounded roundings, close
# to Gaussian: P(|Z| > 6.5) ≈ 8e-11 per element. Calibrated by tests/test_tolerance.py (zero false
# failures over hundreds of simulated correct runs; a 10×-typical single-element error fails).
LAMBDA = 6.5
# Variance of one rounding, in units of (u·|x|)². Round to nearest errs uniformly within
# ±ulp(x)/2 = ±u·2^e (2^e ≤ |x| < 2^(e+1)): variance (u·2^e)²/3 ≤ (u·x)²/3. Over the many
# roundings of a sum the mantissas of the partial sums are spread log-uniformly (Benford), and
# E[(2^e/|x|)²] = 3/(8 ln 2) ≈ 0.541, so a sum of roundings has variance 0.541/3 ≈ 0.18 (u·x)²
# per rounding; single roundings use their bound instead (QK_scaled, the det terms).
ROUND_VAR = 3.0 / (8.0 * np.log(2.0)) / 3.0
ULP_IN_U = 2.0               # one ulp of a normal float is at most 2u·|x|
LOG_ULPS = 1.0               # CUDA logf/log2f: ≤ 1 ulp (CUDA C Programming Guide)


# The online softmax rescales its running sums (O and l) by exp(m_old - m_new) once per key tile
# (Bc ≥ 8 keys): at most one more rounding of the partial sum per 8 keys.
FLASH_RESCALE_FACTOR = 1.0 + 1.0 / 8.0


@dataclass(frozen=True)
class Kernel:
    """What the model assumes of the binary's arithmetic, per backend (run.toml's `backend`)."""
    exp_var: float        # variance of exp's relative error, in units of u²
    flash_product_var: float  # variance of one product in the flash GEMMs, in units of (u·ab)²
    common_scale: bool    # the flash logits carry one rounded scale factor common to the head
    lse_roundings: int    # roundings of lse's magnitude: m + log l, log2-domain conversions
    final_roundings: int  # roundings of each flash_output element after the accumulation
    mma_passes: int = 0   # flash GEMMs on tensor cores: mma.sync per 8-long chunk of the sum
    rescale_factor: float = FLASH_RESCALE_FACTOR
    exp_slope_var: float = 0.0  # exp's error growing with its argument (fast math), u² per unit²
    log_ulps: float = 1.0       # log's error in ulps of log l
    log_abs: float = 0.0        # and an absolute part (fast math near l = 1)
    div_var: float = 0.0        # extra variance of the softmax's final division, in u²


# Measured on an H200 (see the report of issue 3): expf errs 0.48 ulp RMS (max 1.86), exp2f 0.75
# ulp RMS (max 2.06); logf/log2f 0.30 ulp RMS. One ulp is 2^(e-23), so a relative variance of
# (0.75 ulp)² is 0.75²·4·0.541 ≈ 1.2 u² (Benford mantissas); λ·√1.2 u = 6.6u > 2 ulp, the max.
_GPU_EXP_VAR = 0.75**2 * 4 * (3.0 / (8.0 * np.log(2.0)))
# The fast flash kernel multiplies in 3xTF32: a·b ≈ a_hi·b_hi + a_hi·b_lo + a_lo·b_hi, each part
# TF32 (u_tf32 = 2⁻¹¹). The low parts are TF32 roundings of a TF32 rounding error and the dropped
# a_lo·b_lo is a product of two: three terms of variance (2⁻¹¹)⁴·ROUND_VAR² = 16u²·ROUND_VAR².
_GPU_FLASH_PRODUCT_VAR = 3 * 16.0 * ROUND_VAR**2
KERNELS = {
    # cuda: expf/exp2f as measured, 3xTF32 flash, scale·log2e rounded once for the whole head.
    # Tensor-core mma.sync accumulates with truncation, not rounding: each of the 3 (3xTF32)
    # mma per 8-long chunk can lose up to one ulp of the running sum, all in the same direction
    # (measured on an H100: flash_lse of uniform data off by ~26u, one-signed). A bias does not
    # average out, so it enters the bound as det: 3·2u·Σ_chunks |partial sum|. Four final
    # roundings of O: the division by l and the split-KV combine (rescale, add, divide).
    "cuda": Kernel(_GPU_EXP_VAR, _GPU_FLASH_PRODUCT_VAR, True, 4, 4, mma_passes=3),
    # cpu (cuda_src/cpu/backend_cpu.cpp): std::exp correctly rounded in practice (one rounding),
    # plain float32 products (no FMA without -march), the float32 scale exactly as run.toml says.
    # lse = m + log(l) with m an exact float32 logit: one rounding of lse's magnitude (log's own
    # is the LOG_ULPS term). O·(1/l): two final roundings (the reciprocal and the product).
    "cpu": Kernel(ROUND_VAR, ROUND_VAR, False, 1, 2),
}
# Unknown backend: the larger of each.
ANY_KERNEL = Kernel(*(max(getattr(k, f) for k in KERNELS.values())
                      for f in ("exp_var", "flash_product_var", "common_scale", "lse_roundings",
                                "final_roundings", "mma_passes")))
# A program other than the project's binary: any correct IEEE float32 route. expf/exp2f within
# the 2 ulp the CUDA C++ Programming Guide documents (uniform within ±2 ulp: (2·2u)²/3), logf within
# 1 ulp, online softmax with any tile width (a rescale rounding per key), and the looser of both
# backends otherwise (tensor-core products and truncation, a folded scale·log2e, split combines).
DOCUMENTED_EXP_ULPS = 2.0
FOREIGN_KERNEL = replace(ANY_KERNEL, exp_var=max(ANY_KERNEL.exp_var, (DOCUMENTED_EXP_ULPS * ULP_IN_U) ** 2 / 3),
                         rescale_factor=2.0)
# CUDA's fast-math intrinsics (-use_fast_math, __expf, __logf, __fdividef), by the maximum errors
# the CUDA C++ Programming Guide documents: __expf(x) 2 + floor(1.173·|x|) ulp (here uniform within
# that maximum, its two parts bounded by twice their squares), __logf 3 ulp or 2^-21.41 absolute
# for x in [0.5, 2], __fdividef 2 ulp.
FAST_EXP_ULPS, FAST_EXP_SLOPE, FAST_LOG_ULPS, FAST_LOG_ABS, FAST_DIV_ULPS = 2.0, 1.173, 3.0, 2.0**-21.41, 2.0
FAST_KERNEL = replace(FOREIGN_KERNEL,
                      exp_var=2 * (FAST_EXP_ULPS * ULP_IN_U) ** 2 / 3,
                      exp_slope_var=2 * (FAST_EXP_SLOPE * ULP_IN_U) ** 2 / 3,
                      log_ulps=FAST_LOG_ULPS, log_abs=FAST_LOG_ABS,
                      div_var=(FAST_DIV_ULPS * ULP_IN_U) ** 2 / 3)
MMA_K = 8  # the k extent of one mma.sync m16n8k8
# Per key element, the flash kernels round the logit once before exp (S·scale, or S·scale·log2e
# in the fast kernel).
FLASH_LOGIT_ROUNDINGS = 1
# Final per-element roundings after the accumulation: the softmax's 1/l and ·(1/l) (flash's are
# per kernel: Kernel.final_roundings).
SOFTMAX_FINAL_ROUNDINGS = 2
# float32's smallest normal number: a result below it may be flushed to zero (FTZ on the GPU, exp
# of logits ~87 below the row max) or lose precision. Each stage's floor counts the results that
# can flush (underflow_floor): a bug at any magnitude the data has fails, and a correct result is
# not blamed for underflow (a fixed floor of 2^-110 let a zeroed QK of 1e-18-scaled inputs pass).
FLUSH = 2.0**-126
# Above this many multiply-adds per head the exact partial-sum energy (chunked cumsum) costs too
# much; the model then uses its expectation over random summation orders, inflated by
# ENERGY_FALLBACK_FACTOR to cover orders whose partial sums wander further than average.
# 1 << 24 since dot_var enumerates ~20 summation orders for K = 4096 (was 1 << 27 with 2: a
# 512×4096×64 head took 68 s instead of 7.6 s; 64×4096×64 now ~9 s).
ENERGY_EXACT_MAX_MACS = 1 << 24
ENERGY_FALLBACK_FACTOR = 8.0
_CHUNK_ELEMS = 1 << 21


class ToleranceError(ValueError):
    """A request the model cannot answer (unknown stage or precision, missing input)."""


def unit_roundoff(precision: str) -> float:
    if precision not in UNIT_ROUNDOFF:
        raise ToleranceError(f"unknown precision {precision!r}; the tolerance model knows "
                             f"{', '.join(UNIT_ROUNDOFF)}")
    return UNIT_ROUNDOFF[precision]


# ---------------------------------------------------------------------------------------------
# Dot products: the partial-sum energy
# ---------------------------------------------------------------------------------------------

_EXPONENT_BITS = np.uint64(0x7FF0000000000000)


class HeadCache:
    """The quantities several bounds of one head share (logits, softmax parts, dot-product
    variances, the flash parts, whole chained bounds), computed once per head: the chained and
    isolated checks, both flash stages and the invariants ask for them again and again.

    Entries are keyed by the IDENTITY of their source arrays, not their contents (hashing a 4096²
    matrix costs about as much as what it saves). The cache keeps each source array alive, so its
    id cannot be reused, and the caller promises not to modify a source while the cache lives:
    compare.check_head makes one per head and drops it when the head is done."""

    def __init__(self) -> None:
        self._memo: Dict[tuple, tuple] = {}

    def get(self, what: str, sources: Sequence[np.ndarray], params: tuple, compute: Callable):
        key = (what, tuple(id(a) for a in sources), params)
        hit = self._memo.get(key)
        if hit is None:
            value = compute()
            for a in value if isinstance(value, tuple) else (value,):
                if isinstance(a, np.ndarray):
                    a.setflags(write=False)  # shared: a consumer must not modify it
            hit = (tuple(sources), value)
            self._memo[key] = hit
        return hit[1]


def _memo(cache: Optional[HeadCache], what: str, sources: Sequence[np.ndarray], params: tuple,
          compute: Callable):
    """compute(), or its value memoized in `cache` under (what, sources by identity, params)."""
    return compute() if cache is None else cache.get(what, sources, params, compute)


def _rounding_var(x: np.ndarray, u: float) -> np.ndarray:
    """Variance of rounding x to nearest: uniform within ±ulp(x)/2, ulp(x) = 2u·2^e for x in
    [2^e, 2^(e+1)): ulp²/12 (at most (u·x)²/3, on average ROUND_VAR·(u·x)²). 2^e is x with its
    mantissa bits cleared."""
    p2 = (np.ascontiguousarray(x, dtype=np.float64).view(np.uint64) & _EXPONENT_BITS).view(np.float64)
    out = np.multiply(p2, u * u / 3.0)   # (u²/3)·p2·p2, in place on one temporary
    return np.multiply(out, p2, out=out)


def _step_var(partial: np.ndarray, t: np.ndarray, u: float,
              t2: Optional[np.ndarray] = None) -> np.ndarray:
    """Variance bound of the rounding of each addition s_k = s_(k-1) + t_k: ulp(s_k)²/12 from the
    binade the partial sum lies in, and never more than min(|t_k|, |s_(k-1)|)²: round to nearest
    picks the closer of the floats next to the sum, and both addends are floats at distance
    |s_(k-1)| and |t_k| from it. This keeps a sum dominated by one term (the softmax of large
    logits) tight. t2 (= t·t) may be passed when the caller has it already."""
    prev = partial - t
    np.multiply(prev, prev, out=prev)
    np.minimum(prev, t * t if t2 is None else t2, out=prev)
    # Into the C-ordered rounding variance: the caller's sum over an axis adds in memory order,
    # and partial may be laid out otherwise (products with Kᵀ).
    rv = _rounding_var(partial, u)
    return np.minimum(rv, prev, out=rv)


# Structured summation orders dot_var covers besides index and reverse order (measured with
# tests/test_tolerance.py's float32 simulations, 192 random QK/output cases × 17 orders, max
# err/bound): with index/reverse/random orders only, numpy's OpenBLAS sgemm (Haswell kernel: some
# row tiles accumulate even and odd k in two FMA accumulators, then add them) reached 1.00 on QK
# and index-order blocks of 16 restarted from 0 (split-K style) 0.97: where the index-order walk
# of partial sums cancels early (one half of the products undoing the other), a strided or blocked
# order keeps summing at the magnitude of one half, with up to ~2× the variance. The mean over
# random orders cannot stand in for them: inflating it 2× (enough for 0.72) halves the tightness
# (10×-typical catch of QK 0.92 → 0.80, output uniform 1.00 → 0.69). With these orders
# enumerated: QK blas 1.00 → 0.69, blocked 0.97 → 0.64, max over all orders 0.69 (the index
# order's own Gaussian tail: 6.5σ ≈ 0.69 of 4.5σ over ~10⁶ elements); catch 1.00/0.91/0.91.
DOT_LANES = (2, 4, 8, 16, 32)   # L interleaved accumulators (SIMD lanes, unrolled FMA chains)
DOT_MIN_BLOCK = 8               # index-order blocks of 8, 16, … K/2 (k-tiles restarted, split-K)
DOT_SPLITS = (2, 3, 4, 5, 6, 7, 8)  # split-K into n equal chunks (blocks of ⌈K/n⌉): 3 splits reached 0.78


def _strided_var(t: np.ndarray, L: int, u: float, blocked: bool) -> np.ndarray:
    """Σ var(rounding) of the sum over axis 1 of t (r, K, C) done as L interleaved accumulators
    (k ≡ i mod L), or (blocked) as blocks of L consecutive terms each summed from 0; then the L
    lane totals (the K/L block totals) added in order."""
    r, K, C = t.shape
    Kp = -(-K // L) * L
    if Kp > K:
        t = np.concatenate([t, np.zeros((r, Kp - K, C))], axis=1)
    tr = t.reshape(r, Kp // L, L, C)
    axis = 2 if blocked else 1
    part = np.cumsum(tr, axis=axis)
    var = _step_var(part, tr, u).sum(axis=(1, 2))
    totals = part[:, :, -1] if blocked else part[:, -1]
    var += _step_var(np.cumsum(totals, axis=1), totals, u).sum(axis=1)
    return var


def dot_var(A: np.ndarray, B: np.ndarray, u: float, product_var: float = ROUND_VAR) -> np.ndarray:
    """Variance of the float32 error of each element of A @ B (R×K times K×C), from its products
    t_k and partial sums s_k: Σ_k var(rounding of s_k), the largest over the summation orders
    float32 GEMMs use: index order, reverse order, DOT_LANES interleaved accumulators, index-order
    blocks of every power of two from DOT_MIN_BLOCK to K/2 and of ⌈K/n⌉ (split-K, n in DOT_SPLITS;
    each block summed from 0, then the block sums), and the expectation over random orders (for the orders not enumerated); plus
    product_var·u²·Σ_k t_k² for the products' own rounding (an upper bound when FMA fuses them:
    an FMA's one rounding is that of the new partial sum, counted above)."""
    A = np.asarray(A, dtype=np.float64)
    B = np.asarray(B, dtype=np.float64)
    R, K = A.shape
    C = B.shape[1]
    if R * K * C > ENERGY_EXACT_MAX_MACS:
        return _expected_var(A, B, u, product_var)
    blocks = {DOT_MIN_BLOCK << j for j in range(K.bit_length()) if DOT_MIN_BLOCK << j <= K // 2}
    blocks |= {-(-K // n) for n in DOT_SPLITS if DOT_MIN_BLOCK <= -(-K // n) < K}
    structured = [(L, False) for L in DOT_LANES if L < K] + [(L, True) for L in sorted(blocks)]
    out = np.empty((R, C))
    rows = max(1, _CHUNK_ELEMS // max(1, K * C))
    for r0 in range(0, R, rows):
        t = A[r0:r0 + rows, :, None] * B[None, :, :]          # (r, K, C) products
        s = np.cumsum(t, axis=1)                               # index-order partial sums
        total = s[:, -1:, :].copy()  # a copy: s is overwritten below
        t2 = t * t
        var = _step_var(s, t, u, t2).sum(axis=1)
        # Reverse order: t_K, t_K + t_(K-1), …, i.e. total - s + t (s is not needed after this).
        np.subtract(total, s, out=s)
        s += t
        np.maximum(var, _step_var(s, t, u, t2).sum(axis=1), out=var)
        del s
        for L, blocked in structured:
            np.maximum(var, _strided_var(t, L, u, blocked), out=var)
        # Random order: E[s_k²] averaged over k is Σt²/6 + S²/3 (sampling without replacement).
        mean_s2 = t2.sum(axis=1, keepdims=True) / 6.0 + total * total / 3.0
        np.maximum(var, np.minimum(ROUND_VAR * u * u * mean_s2, t2).sum(axis=1), out=var)
        # Products: one rounding each (its binade's ulp²/12), scaled for split-precision kernels.
        var += _rounding_var(t, u).sum(axis=1) * (product_var / ROUND_VAR)
        out[r0:r0 + rows] = var
    return out


def _expected_var(A: np.ndarray, B: np.ndarray, u: float, product_var: float) -> np.ndarray:
    """For very large heads: E[Σ_k s_k²] over random orders, (K+1)(Σt²/6 + S²/3), inflated by
    ENERGY_FALLBACK_FACTOR for orders whose partial sums wander further than average."""
    K = A.shape[1]
    S = A @ B
    T2 = (A * A) @ (B * B)
    # In place, in this grouping: u·u·(ROUND_VAR·energy + product_var·T2),
    # energy = ENERGY_FALLBACK_FACTOR·(K + 1)·(T2/6 + S·S/3).
    var = np.divide(T2, 6.0)
    np.multiply(S, S, out=S)
    S /= 3.0
    var += S
    var *= ENERGY_FALLBACK_FACTOR * (K + 1)
    var *= ROUND_VAR
    T2 *= product_var
    var += T2
    var *= u * u
    return var


# ---------------------------------------------------------------------------------------------
# Softmax and its propagation
# ---------------------------------------------------------------------------------------------
# The N×M arithmetic below works in place on fresh temporaries, in the very order of the plain
# formulas in the comments (a·b = b·a exactly, so only the grouping matters): the bound of a
# 4096² head must come out bit for bit as from the formulas themselves.

# Rows per block of the row-sum variance: a block's temporaries stay in the CPU cache.
_ROW_BLOCK_ELEMS = 1 << 16


def _softmax_parts(S: np.ndarray):
    """p = softmax rows of S (masked -inf -> 0), d = S - rowmax (0 where masked), finite mask."""
    finite = np.isfinite(S)
    masked = None if finite.all() else ~finite  # an unmasked head skips every where()
    m = np.max(S if masked is None else np.where(finite, S, -np.inf), axis=1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    d = S - m                                  # where(finite, S - m, 0)
    if masked is not None:
        np.copyto(d, 0.0, where=masked)
    e = np.exp(d)                              # where(finite, exp(d), 0)
    if masked is not None:
        np.copyto(e, 0.0, where=masked)
    l = e.sum(axis=1, keepdims=True)
    p = np.divide(e, np.where(l > 0, l, 1.0), out=e)
    return p, d, m, finite


def _softmax(S: np.ndarray, cache: Optional[HeadCache]):
    return _memo(cache, "softmax", (S,), (), lambda: _softmax_parts(S))


def _exponent_var(d: np.ndarray, finite: np.ndarray, u: float, kernel: Kernel,
                  S: Optional[np.ndarray] = None, logit_roundings: int = 0) -> np.ndarray:
    """Variance of the relative error η_j of e_j = exp(d_j): the subtraction S_j - m rounds
    (u|d_j|), exp errs (kernel.exp_var), and each rounding of the logit itself adds u|S_j|."""
    # var = ROUND_VAR·(u·d)² + exp_var·u·u
    var = np.multiply(d, u)
    np.multiply(var, var, out=var)
    var *= ROUND_VAR
    var += kernel.exp_var * u * u
    if kernel.exp_slope_var:
        var += kernel.exp_slope_var * (u * d) ** 2
    if S is not None and logit_roundings:
        # var += logit_roundings·ROUND_VAR·(u·S)², S taken as 0 where masked
        s2 = np.where(finite, S, 0.0)
        s2 *= u
        np.multiply(s2, s2, out=s2)
        s2 *= logit_roundings * ROUND_VAR
        var += s2
    np.copyto(var, 0.0, where=~finite)         # where(finite, var, 0)
    return var


def _f32_subtraction_error(S: np.ndarray, m: np.ndarray, d: np.ndarray, u: float) -> np.ndarray:
    """|fl(S - m) - (S - m)| for float32 S and m (IEEE subtraction, the same on CPU and GPU);
    bounded by u|d| in precisions whose inputs are not float32."""
    if u != UNIT_ROUNDOFF["fp32"]:
        return u * np.abs(d)
    with np.errstate(invalid="ignore", over="ignore"):
        err = (S.astype(np.float32) - m.astype(np.float32)).astype(np.float64)
    inexact = ~np.isfinite(err)           # where(isfinite(d32), |d32 - d|, u|d|)
    err -= d
    np.abs(err, out=err)
    if inexact.any():
        np.copyto(err, u * np.abs(d), where=inexact)
    return err


def _rowsum_step_var(p: np.ndarray, u: float) -> np.ndarray:
    """max(index order, reverse order) of Σ_k var(rounding of s_k)/l² for each row's sum
    l = Σ_k e_k (N,), block by block of rows (each row's sums are its own, so blocking changes no
    bit). The binary sums e_k = exp(S_k - m), not p_k: e = p·l with e = 1 at the row max (exp(0)
    is exact), so l = 1/max(p). The roundings are those of the e-sums' binades: the p-sums lie
    in [1/l, 1), a binade below the e-sums in [1, l) whenever l < 2, and their ulp is half
    (found by the false-alarm suite: a row of `large` data whose ~100 keys add to l ≈ 1.009
    rounded 8.7u off, twice the σ the p-sums gave)."""
    N, M = p.shape
    out = np.empty(N)
    rows = max(1, _ROW_BLOCK_ELEMS // max(1, M))
    for r0 in range(0, N, rows):
        top = p[r0:r0 + rows].max(axis=1, keepdims=True)
        l = 1.0 / np.where(top > 0, top, 1.0)  # a wholly masked row (p = 0) sums nothing
        eb = p[r0:r0 + rows] * l
        s = np.cumsum(eb, axis=1)
        t2 = eb * eb
        fwd = _step_var(s, eb, u, t2).sum(axis=1)
        np.subtract(l, s, out=s)               # reverse order's partial sums: l - s + e
        s += eb
        bwd = _step_var(s, eb, u, t2).sum(axis=1)
        out[r0:r0 + rows] = np.maximum(fwd, bwd) / (l[:, 0] * l[:, 0])
    return out


def _rowsum_rel_var(p: np.ndarray, u: float, extra_roundings: float = 1.0,
                    cache: Optional[HeadCache] = None) -> np.ndarray:
    """Relative variance of l = Σ_j e_j (N×1), from the partial sums of e in index or reverse
    order (positive terms: any other order's partial sums are no larger on average)."""
    steps = _memo(cache, "rowsum", (p,), (u,), lambda: _rowsum_step_var(p, u))
    return (extra_roundings * steps)[:, None]


def _p2_eta(p: np.ndarray, eta_var: np.ndarray, cache: Optional[HeadCache]) -> np.ndarray:
    """p²·var(η): the exponent errors' weight in the weights, the output and lse."""
    return _memo(cache, "p2 eta", (p, eta_var), (), lambda: np.multiply(np.multiply(p, p), eta_var))


def _weights_var(p: np.ndarray, eta_var: np.ndarray, l_var: np.ndarray, u: float,
                 cache: Optional[HeadCache] = None, div_var: float = 0.0) -> np.ndarray:
    """Variance of Δp_j = p_j[(η_j - Σ_k p_k η_k) - ε_l] + final roundings, with independent η."""
    w = _p2_eta(p, eta_var, cache)
    others = np.subtract(w.sum(axis=1, keepdims=True), w)     # Σ_k p_k²η_k - p_j²η_j
    np.maximum(others, 0.0, out=others)
    var = np.subtract(1.0, p)                                 # own = (1 - p)²·η
    np.multiply(var, var, out=var)
    var *= eta_var
    var += others                                             # p²·(own + others + l + final)
    var += l_var
    var += (SOFTMAX_FINAL_ROUNDINGS * ROUND_VAR + div_var) * u * u
    var *= np.multiply(p, p)
    return var


def _mixed_output_var(p: np.ndarray, eta_var: np.ndarray, V: np.ndarray, O: np.ndarray,
                      cache: Optional[HeadCache] = None) -> np.ndarray:
    """Variance of Σ_j p_j η_j (v_j - O) (the exponent errors after normalization: a common error
    of all η cancels), for independent η_j: Σ_j w_j (v_j - O)² with w = p²·var(η), by three GEMMs."""
    w = _p2_eta(p, eta_var, cache)
    var = w @ (V * V) - 2.0 * O * (w @ V) + O * O * w.sum(axis=1, keepdims=True)
    return np.maximum(var, 0.0)


# ---------------------------------------------------------------------------------------------
# Per-stage variances (isolated: the inputs are exactly what the binary read)
# ---------------------------------------------------------------------------------------------

def _need(src: Dict[str, np.ndarray], stage: str, *names: str) -> Tuple[np.ndarray, ...]:
    missing = [n for n in names if n not in src]
    if missing:
        raise ToleranceError(f"stage {stage}: the tolerance model needs input(s) "
                             f"{', '.join(missing)}; got {', '.join(sorted(src)) or 'none'}")
    return tuple(np.asarray(src[n], dtype=np.float64) for n in names)


def _scaled_logits(Q: np.ndarray, K: np.ndarray, scale: float, causal: bool) -> np.ndarray:
    S = Q @ K.T
    S *= scale
    if causal:
        np.copyto(S, -np.inf, where=np.triu(np.ones(S.shape, dtype=bool), k=1))
    return S


def _logits(Q: np.ndarray, K: np.ndarray, scale: float, causal: bool,
            cache: Optional[HeadCache]) -> np.ndarray:
    return _memo(cache, "logits", (Q, K), (scale, causal), lambda: _scaled_logits(Q, K, scale, causal))


def _qk_var(Q: np.ndarray, K: np.ndarray, u: float, product_var: float,
            cache: Optional[HeadCache]) -> np.ndarray:
    """dot_var of Q·Kᵀ (keyed on Q and K: K.T is a new view object at every call)."""
    return _memo(cache, "QK var", (Q, K), (u, product_var), lambda: dot_var(Q, K.T, u, product_var))


def _pv_var(p: np.ndarray, V: np.ndarray, u: float, product_var: float,
            cache: Optional[HeadCache]) -> np.ndarray:
    return _memo(cache, "PV var", (p, V), (u, product_var), lambda: dot_var(p, V, u, product_var))


def _pv(p: np.ndarray, V: np.ndarray, cache: Optional[HeadCache]) -> np.ndarray:
    return _memo(cache, "PV", (p, V), (), lambda: p @ V)


def _flash_parts(src, scale: float, causal: bool, u: float, kernel: Kernel,
                 cache: Optional[HeadCache] = None):
    """What both flash stages share: logits, weights, and the variance of each exponent."""
    Q, K = _need(src, "flash", "Q", "K")
    return _memo(cache, "flash parts", (Q, K), (scale, causal, u, kernel),
                 lambda: _compute_flash_parts(Q, K, scale, causal, u, kernel, cache))


def _compute_flash_parts(Q, K, scale: float, causal: bool, u: float, kernel: Kernel,
                         cache: Optional[HeadCache]):
    S = _logits(Q, K, scale, causal, cache)
    p, d, m, finite = _softmax(S, cache)
    # eta_var = where(finite, scale²·var(QK), 0) + the exponent's own
    eta_var = np.multiply(scale * scale, _qk_var(Q, K, u, kernel.flash_product_var, cache))
    np.copyto(eta_var, 0.0, where=~finite)
    eta_var += _exponent_var(d, finite, u, kernel, S, FLASH_LOGIT_ROUNDINGS)
    l_var = _rowsum_rel_var(p, u, kernel.rescale_factor, cache)
    s_det = np.zeros(S.shape)
    if kernel.mma_passes:
        # |scale|: a bound is a magnitude (a negative scale made it negative: found by the GPU
        # false-alarm sweep, case 129, scale -0.74, every flash_lse element failing).
        s_det = np.where(finite, abs(scale) * _mma_truncation_det(Q, K.T, u, kernel.mma_passes), 0.0)
    return S, p, m, eta_var, l_var, s_det


def _common_scale_det(S: np.ndarray, p: np.ndarray, u: float):
    """A relative error δ ≤ u of the head's one float32 scale factor moves every logit by δ·S_j:
    ΔO = δ·Σ_j p_j (S_j - S̄)(v_j - O) and Δlse = δ·S̄ (S̄ = Σ_j p_j S_j). Returns the weights
    w_j = u·p_j·|S_j - S̄| and u·|S̄|."""
    Sf = np.where(np.isfinite(S), S, 0.0)
    mean = (p * Sf).sum(axis=1, keepdims=True)
    return u * p * np.abs(Sf - mean), u * np.abs(mean)


def _mma_truncation_det(A: np.ndarray, B: np.ndarray, u: float, passes: int) -> np.ndarray:
    """Bound on the one-signed error of A @ B accumulated by tensor-core mma (truncating): each of
    `passes` mma per MMA_K-long chunk loses < 1 ulp (≤ 2u·|running sum|)."""
    partial = np.zeros((A.shape[0], B.shape[1]))
    total = np.zeros_like(partial)
    for k0 in range(0, A.shape[1], MMA_K):
        partial += A[:, k0:k0 + MMA_K] @ B[k0:k0 + MMA_K]
        total += np.abs(partial)
    return passes * ULP_IN_U * u * total


def _flash_output_var_det(src, scale: float, causal: bool, u: float, kernel: Kernel,
                          cache: Optional[HeadCache]) -> Tuple[np.ndarray, np.ndarray]:
    (V,) = _need(src, "flash_output", "V")
    S, p, m, eta_var, l_var, s_det = _flash_parts(src, scale, causal, u, kernel, cache)
    O = _pv(p, V, cache)
    # P̃·V accumulated key by key (plus the tile rescales); the final division (and, on the
    # GPU, the split-KV combine) adds kernel.final_roundings roundings of O.
    pv_var = kernel.rescale_factor * _pv_var(p, V, u, kernel.flash_product_var, cache)
    var = (pv_var + _mixed_output_var(p, eta_var, V, O, cache) + O * O * l_var
           + (kernel.final_roundings * ROUND_VAR + kernel.div_var) * (u * O) ** 2)
    # One-signed parts: a common scale error and tensor-core truncation of the logits move
    # O by at most Σ_j p_j·|ΔS_j|·|v_j - O|; truncation in P̃·V adds its own.
    w = p * s_det
    if kernel.common_scale:
        w = w + _common_scale_det(S, p, u)[0]
    det = w @ np.abs(V) + np.abs(O) * w.sum(axis=1, keepdims=True)
    if kernel.mma_passes:
        det = det + _mma_truncation_det(p, V, u, kernel.mma_passes)
    return var, det


def _flash_lse_sums(src, scale: float, causal: bool, u: float, kernel: Kernel,
                    cache: Optional[HeadCache]):
    """The row sums of flash_lse's bound: Σ_j p_j²·var(η_j) and the one-signed part."""
    S, p, m, eta_var, l_var, s_det = _flash_parts(src, scale, causal, u, kernel, cache)
    eta_sum = _p2_eta(p, eta_var, cache).sum(axis=1, keepdims=True)
    det = (p * s_det).sum(axis=1, keepdims=True)
    if kernel.common_scale:
        det = det + _common_scale_det(S, p, u)[1]
    return m, eta_sum, l_var, det


def _variance_and_det(stage: str, src, ref: np.ndarray, scale: float, causal: bool, u: float,
                      kernel: Kernel, cache: Optional[HeadCache] = None
                      ) -> Tuple[np.ndarray, np.ndarray]:
    """(variance, deterministic part) of the error of one head of `stage`, isolated."""
    zero = np.zeros(ref.shape)
    if STAGES[stage].inputs == () or stage == "KT":
        return zero, zero  # echoes and the transpose copy bits: they must be exact
    if stage == "QK":
        Q, K = _need(src, stage, "Q", "K")
        return _qk_var(Q, K, u, ROUND_VAR, cache), zero
    if stage == "QK_scaled":
        # One rounding of the product plus the float32 scale's own rounding (when the given scale
        # is the float64 1/√d_k rather than the value the binary used): ≤ 2u|ref|.
        return zero, np.where(np.isfinite(ref), 2.0 * u * np.abs(ref), 0.0)
    if stage == "attention_weights":
        (S,) = _need(src, stage, "QK_scaled")
        p, d, m, finite = _softmax_parts(S)
        # The softmax reads the very float32 QK_scaled the isolated reference starts from, so the
        # input's rounding is not this stage's error (chained_bound propagates upstream errors),
        # and its float32 subtraction S - m is known exactly: its error replaces the u|d| model.
        # (The binary's own QK_scaled: nothing else shares these, so they are not cached.)
        eta_var = _exponent_var(np.zeros(d.shape), finite, u, kernel)
        if kernel.exp_slope_var:  # exp's own error grows with its argument d (fast math)
            eta_var = eta_var + np.where(finite, kernel.exp_slope_var * (u * d) ** 2, 0.0)
        eta_var = eta_var + np.where(finite, _f32_subtraction_error(S, m, d, u) ** 2, 0.0)
        return _weights_var(p, eta_var, _rowsum_rel_var(p, u), u, div_var=kernel.div_var), zero
    if stage == "output":
        P, V = _need(src, stage, "attention_weights", "V")
        return dot_var(P, V, u), zero
    if stage == "flash_output":
        Q, K, V = _need(src, stage, "Q", "K", "V")
        return _memo(cache, "flash_output var", (Q, K, V), (scale, causal, u, kernel),
                     lambda: _flash_output_var_det(src, scale, causal, u, kernel, cache))
    if stage == "flash_lse":
        Q, K = _need(src, stage, "Q", "K")
        m, eta_sum, l_var, det = _memo(
            cache, "flash_lse sums", (Q, K), (scale, causal, u, kernel),
            lambda: _flash_lse_sums(src, scale, causal, u, kernel, cache))
        # Δlse = Σ_j p_j η_j + Δl/l, then log (≤ LOG_ULPS ulp of log l) and the roundings of
        # values of lse's magnitude (m + log l; on the GPU the log2-domain conversions).
        log_l = ref - m
        var = (eta_sum + l_var
               + ROUND_VAR * u * u * ((kernel.log_ulps * ULP_IN_U * log_l) ** 2
                                      + kernel.lse_roundings * (np.abs(m) + np.abs(ref)) ** 2 / 4)
               + kernel.log_abs ** 2 / 3)
        return var, det
    raise ToleranceError(f"no tolerance model for stage {stage!r}")


def _finish(ref: np.ndarray, var: np.ndarray, det: np.ndarray, floor) -> np.ndarray:
    bound = np.sqrt(var)                       # LAMBDA·√var + det + floor, 0 where ref is ±inf
    bound *= LAMBDA
    bound += det
    bound += floor
    np.copyto(bound, 0.0, where=~np.isfinite(ref))
    return bound


def _finite_abs(x: np.ndarray) -> np.ndarray:
    """|x| with non-finite entries (inputs accepted with --allow-nonfinite) as 0: a floor must
    stay finite, or an Inf would let every value of its row or column pass."""
    x = np.abs(np.asarray(x, np.float64))
    return np.where(np.isfinite(x), x, 0.0)


def _flush_sum(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """Bound on what flushing tiny products and partial sums of A @ B to zero can cost: none when
    no product of non-zero entries comes near float32's normal range, else min(Σ|a·b|, K·FLUSH)."""
    A, B = _finite_abs(A), _finite_abs(B)

    def smallest(x):
        nz = x[x != 0]
        return float(nz.min()) if nz.size else np.inf
    if smallest(A) * smallest(B) >= FLUSH * 2.0**24:
        return np.zeros((1, 1))
    return np.minimum(A @ B, A.shape[1] * FLUSH)


def underflow_floor(stage: str, src: Dict[str, np.ndarray]):
    """What float32 underflow may cost each element of `stage` (broadcastable to its shape):
    FLUSH for every rounding of the result and of each term that can fall below float32's normal
    range (flushed exp terms weigh at most FLUSH·|v_j| in a P·V sum)."""
    qk_max = 0.0
    if stage in ("QK", "flash_lse", "flash_output") and "Q" in src and "K" in src:
        qk = _flush_sum(src["Q"], np.asarray(src["K"]).T)
        if stage == "QK":
            return qk + FLUSH
        qk_max = float(np.max(qk)) if qk.size else 0.0
    if stage in ("output", "flash_output") and "V" in src:
        V = _finite_abs(src["V"])
        return FLUSH * (V.sum(axis=0, keepdims=True) + 2 * V.shape[0]) + qk_max * V.max(initial=0.0)
    if stage == "flash_lse":
        return FLUSH * 2 * np.asarray(src["K"]).shape[0] + qk_max
    return 2 * FLUSH


def kernel_for(backend: Optional[str], math: str = "ieee") -> Kernel:
    """The arithmetic assumed: the project's backend as run.toml names it, any correct IEEE float32
    implementation for other programs (backend None), CUDA's fast-math intrinsics on request."""
    if math not in ("ieee", "fast"):
        raise ToleranceError(f"unknown math mode {math!r}; the tolerance model knows ieee, fast")
    if backend is None:
        return FAST_KERNEL if math == "fast" else FOREIGN_KERNEL
    if backend not in KERNELS:
        raise ToleranceError(f"unknown backend {backend!r}; the tolerance model knows "
                             f"{', '.join(KERNELS)}")
    return FAST_KERNEL if math == "fast" else KERNELS[backend]


def stage_bound(stage: str, src: Dict[str, np.ndarray], ref: np.ndarray, *, scale: float,
                causal: bool, precision: str = "fp32", backend: Optional[str] = None,
                math: str = "ieee", cache: Optional[HeadCache] = None) -> np.ndarray:
    """Element-wise bound on |got - ref| for one head of `stage` computed from `src` (isolated).

    src holds the float64 values of the stage's inputs (verify.stages.STAGES[stage].inputs); the
    flash stages use Q, K (and V for flash_output). Q, K, V and KT get 0 (bit-exact copies);
    entries where ref is ±inf (masked) get 0 and must match exactly. backend (run.toml's
    `backend`, "cpu" or "cuda") picks the arithmetic assumed; None: any correct IEEE float32
    implementation; math "fast": CUDA's fast-math intrinsics (kernel_for).
    cache (a HeadCache for this head) shares the intermediate results of the head's bounds.
    """
    if stage not in STAGES:
        raise ToleranceError(f"unknown stage {stage!r}")
    u = unit_roundoff(precision)
    kernel = kernel_for(backend, math)
    ref = np.asarray(ref, dtype=np.float64)
    if STAGES[stage].inputs == () or stage == "KT":
        return np.zeros(ref.shape)
    var, det = _variance_and_det(stage, src, ref, scale, causal, u, kernel, cache)
    return _finish(ref, var, det, underflow_floor(stage, src))


def quantization_bound(stage: str, src: Dict[str, np.ndarray], quanta: Dict[str, np.ndarray],
                       scale: float):
    """How far the isolated reference of `stage` can move when its sources are known only to
    within `quanta` (a file's printed resolution; absent: exact): |∂stage/∂source|·quantum, to
    first order. 0 when every source is exact."""
    q = {n: np.asarray(v, np.float64) for n, v in quanta.items() if v is not None and n in src}
    if not q:
        return 0.0
    x = {n: np.asarray(v, np.float64) for n, v in src.items()}
    zero = 0.0
    if stage == "KT":
        return q["K"].T if "K" in q else zero
    if stage in ("QK", "flash_output", "flash_lse"):
        dS = zero
        if "Q" in q:
            dS = dS + q["Q"] @ np.abs(x["K"]).T
        if "K" in q:
            dS = dS + np.abs(x["Q"]) @ q["K"].T
        if stage == "QK":
            return dS
        S = _scaled_logits(x["Q"], x["K"], scale, False)
        p = _softmax_parts(S)[0]
        dS = np.abs(scale) * np.broadcast_to(dS, S.shape)
        if stage == "flash_lse":
            return (p * dS).sum(axis=1, keepdims=True)
        O = p @ x["V"]
        moved = (p * dS) @ np.abs(x["V"]) + np.abs(O) * (p * dS).sum(axis=1, keepdims=True)
        return moved + (p @ q["V"] if "V" in q else zero)
    if stage == "QK_scaled":
        return abs(scale) * np.where(np.isfinite(x["QK"]), q.get("QK", zero), 0.0)
    if stage == "attention_weights":
        S = x["QK_scaled"]
        p = _softmax_parts(S)[0]
        qs = np.where(np.isfinite(S), q.get("QK_scaled", zero), 0.0)
        return p * (qs + (p * qs).sum(axis=1, keepdims=True))
    if stage == "output":
        out = zero
        if "attention_weights" in q:
            out = out + q["attention_weights"] @ np.abs(x["V"])
        if "V" in q:
            out = out + np.abs(x["attention_weights"]) @ q["V"]
        return out
    return zero


# ---------------------------------------------------------------------------------------------
# Chained: the error accumulated along the stage path from the original inputs
# ---------------------------------------------------------------------------------------------

# The stages whose chained bound propagates upstream errors; every other stage's chained bound is
# its isolated bound on the chain's sources (so equal sources give equal bounds).
PROPAGATED_STAGES = ("QK_scaled", "attention_weights", "output")


def chained_bound(stage: str, chain: Dict[str, np.ndarray], *, scale: float, causal: bool,
                  precision: str = "fp32", backend: Optional[str] = None, math: str = "ieee",
                  cache: Optional[HeadCache] = None) -> np.ndarray:
    """Bound on |got - chain[stage]| where chain holds the float64 reference chain from the
    original inputs (Q, K, V and every stage up to `stage`): each stage's own error plus the
    upstream errors propagated through it (QK's dot-product error through the scale and the
    softmax Jacobian, the softmax's errors through P·V with the normalization's cancellation).
    stage_bound() alone would cry wolf here: QK's rounding reaches QK_scaled and beyond.
    cache (a HeadCache for this head) shares the intermediate results of the head's bounds."""
    if stage not in STAGES:
        raise ToleranceError(f"unknown stage {stage!r}")
    u = unit_roundoff(precision)
    kernel = kernel_for(backend, math)
    if stage not in PROPAGATED_STAGES:
        src = {n: chain[n] for n in INPUT_NAMES if n in chain}
        src.update({n: chain[n] for n in STAGES[stage].inputs if n in chain})
        return stage_bound(stage, src, chain[stage], scale=scale, causal=causal,
                           precision=precision, backend=backend, math=math, cache=cache)
    Q, K = _need(chain, stage, "Q", "K")
    sources = (Q, K) if stage != "output" else (Q, K) + _need(chain, stage, "V")
    return _memo(cache, "chained " + stage, sources, (scale, causal, u, kernel),
                 lambda: _chained(stage, sources, scale, causal, u, kernel, cache))


def _chained_logits(Q, K, scale: float, causal: bool, u: float, cache: Optional[HeadCache]):
    """Logits, softmax parts, and the error of the binary's QK_scaled: QK's dot product, scaled
    (variance), plus ≤ 2u|S| of its own (det)."""
    S = _logits(Q, K, scale, causal, cache)
    p, d, _, finite = _softmax(S, cache)
    s_var = np.where(finite, scale * scale * _qk_var(Q, K, u, ROUND_VAR, cache), 0.0)
    s_det = np.where(finite, 2.0 * u * np.abs(np.where(finite, S, 0.0)), 0.0)
    return S, p, d, finite, s_var, s_det


def _chained(stage: str, sources, scale: float, causal: bool, u: float, kernel: Kernel,
             cache: Optional[HeadCache]) -> np.ndarray:
    Q, K = sources[:2]
    S, p, d, finite, s_var, s_det = _memo(cache, "chained logits", (Q, K), (scale, causal, u),
                                          lambda: _chained_logits(Q, K, scale, causal, u, cache))
    if stage == "QK_scaled":
        return _finish(S, s_var, s_det, abs(scale) * underflow_floor("QK", {"Q": Q, "K": K}) + FLUSH)

    def eta() -> np.ndarray:
        # The bounded part of the logit error enters the softmax as variance (at most its square).
        return s_var + s_det ** 2 + _exponent_var(d, finite, u, kernel)

    eta_var = _memo(cache, "chained eta", (Q, K), (scale, causal, u, kernel), eta)
    l_var = _rowsum_rel_var(p, u, cache=cache)
    if stage == "attention_weights":
        return _finish(S, _weights_var(p, eta_var, l_var, u, cache, kernel.div_var), np.zeros(S.shape),
                       underflow_floor(stage, {}))
    V = sources[2]
    O = _pv(p, V, cache)
    final = SOFTMAX_FINAL_ROUNDINGS * ROUND_VAR * u * u * ((p * p) @ (V * V))
    var = (_pv_var(p, V, u, ROUND_VAR, cache) + _mixed_output_var(p, eta_var, V, O, cache)
           + O * O * l_var + final + kernel.div_var * u * u * ((p * p) @ (V * V)))
    return _finish(O, var, np.zeros(O.shape), underflow_floor(stage, {"V": V}))


def describe_model() -> str:
    """The tolerance model, for `attnstep check --help`."""
    text = f"""
    Tolerance model (per element; --atol/--rtol override it): bound = {LAMBDA:g}·σ + det + floor.
    σ² is the variance of the stage's float32 rounding errors, computed from the data: a rounding
    of x errs uniformly within ±u|x| (variance ≈ 0.18·(u·x)² for Benford-spread mantissas);
    u = 2^-24 fp32, 2^-11 tf32, 2^-8 bf16 (the precision only changes u). Q, K, V, KT: 0.
    QK, output (dot products of length K): σ² = Σ_k var(rounding of partial sum s_k) + the
    products' roundings; the largest over index and reverse order, 2-32 interleaved
    accumulators (SIMD/FMA lanes, OpenBLAS), blocks of 8, 16, ... K/2 and split-K in 2-8
    chunks, and the mean over random orders (a worst-case K·u·Σ|a·b| bound is 50-200x looser
    and lets bugs through); a rounding never errs by more than the smaller addend. Above 2^24
    multiply-adds per head: 8x the random-order mean. QK_scaled: det = 2u|ref|.
    attention_weights: the relative error η_j of exp(S_j - m) (the subtraction u|S_j - m|, exp's
    error as measured on the GPU) propagated through the normalization: Δp_j = p_j[(1-p_j)η_j -
    Σ_k≠j p_k η_k - ε_l], ε_l the rounding of the row sum of exp(S - m) (in its own binades,
    1 ≤ l ≤ M); then 1/l and the multiply.
    flash_output: logit errors (the QK dot product, 3xTF32 products on the GPU, the logit's
    rounding, exp) enter as Σ_j p_j η_j (v_j - O); the online P·V and l sums (a rounding per
    tile rescale); the final 1/l and product (on the GPU the division and split-KV combine);
    on the GPU the scale·log2e factor's rounding and the tensor cores' truncating accumulation
    (≤ 1 ulp per mma, one-signed: det).
    flash_lse: Σ_j p_j η_j + ε_l + log ({LOG_ULPS:g} ulp) + roundings of m + log l (one on the
    CPU; the log2-domain conversions too on the GPU).
    Masked entries (-inf) must match exactly; NaN never passes; a floor of 2^-126 (float32
    underflow, FTZ) per result and per term that can underflow. Chained checking adds each
    upstream stage's error propagated through it.
    """
    return textwrap.dedent(text).strip("\n")
