"""Rounding: the unit roundoff per precision, the variance of one rounding, the head cache.

Each float32 operation rounds to nearest: its result carries an error uniform in ±ulp/2, at most
u·|x| and with a standard deviation at most u·|x|/√3 (u = 2⁻²⁴ for fp32; UNIT_ROUNDOFF gives u per
computing precision, the only thing precision changes). A stage's error is a sum of many such
independent roundings, so the model computes, per element, the VARIANCE of that sum from the
actual data, and allows LAMBDA standard deviations (verify/check/tolerance.py puts the pieces together).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence

import numpy as np

from . import arrays
from .arrays import namespace


# The unit roundoff of the arithmetic: the half pipelines (bf16, fp16) multiply half values and
# accumulate in float32, so their arithmetic is float32's; the conversions to the half format are
# verify/model/half.py's (the storage roundings), carried by verify/check/half_rounding.py.
UNIT_ROUNDOFF = {"fp32": 2.0**-24, "tf32": 2.0**-11, "bf16": 2.0**-24, "fp16": 2.0**-24}


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


# float32's smallest normal number: a result below it may be flushed to zero (FTZ on the GPU, exp
# of logits ~87 below the row max) or lose precision. Each stage's floor counts the results that
# can flush (its spec's floor): a bug at any magnitude the data has fails, and a correct result is
# not blamed for underflow (a fixed floor of 2^-110 let a zeroed QK of 1e-18-scaled inputs pass).
FLUSH = 2.0**-126


class ToleranceError(ValueError):
    """A request the model cannot answer (unknown stage or precision, missing input)."""


def unit_roundoff(precision: str) -> float:
    if precision not in UNIT_ROUNDOFF:
        raise ToleranceError(f"unknown precision {precision!r}; the tolerance model knows "
                             f"{', '.join(UNIT_ROUNDOFF)}")
    return UNIT_ROUNDOFF[precision]


# The exponent bits of float64 and float32, and the unsigned integers of their width.
_EXPONENT_BITS = {np.dtype(np.float64): (np.uint64, np.uint64(0x7FF0000000000000)),
                  np.dtype(np.float32): (np.uint32, np.uint32(0x7F800000))}


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

    def peek(self, what: str, sources: Sequence[np.ndarray], params: tuple):
        """The value get() would return from the cache, or None where it holds none."""
        hit = self._memo.get((what, tuple(id(a) for a in sources), params))
        return None if hit is None else hit[1]


def memo(cache: Optional[HeadCache], what: str, sources: Sequence[np.ndarray], params: tuple,
          compute: Callable):
    """compute(), or its value memoized in `cache` under (what, sources by identity, params)."""
    return compute() if cache is None else cache.get(what, sources, params, compute)


def binade(x: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
    """2^e for each x in ±[2^e, 2^(e+1)) (0 for 0 and subnormals): x with its sign and mantissa
    bits cleared. float32 stays float32, anything else is float64. Into out (x's dtype and shape)
    when given."""
    x = np.ascontiguousarray(x, dtype=np.float32 if np.asarray(x).dtype == np.float32 else np.float64)
    uint, mask = _EXPONENT_BITS[x.dtype]
    out = np.empty(x.shape, x.dtype) if out is None else out
    np.bitwise_and(x.view(uint), mask, out=out.view(uint))
    return out


def binade_sq(x: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
    """4^e for each x in ±[2^e, 2^(e+1)): binade(x)², into out when given."""
    out = binade(x, out)
    return np.multiply(out, out, out=out)


def rounding_var(x: np.ndarray, u: float) -> np.ndarray:
    """Variance of rounding x to nearest: uniform within ±ulp(x)/2, ulp(x) = 2u·2^e for x in
    [2^e, 2^(e+1)): ulp²/12 = (u²/3)·4^e (at most (u·x)²/3, on average ROUND_VAR·(u·x)²)."""
    out = binade_sq(np.asarray(x, dtype=np.float64))
    out *= u * u / 3.0
    return out


def step_var(partial: np.ndarray, t: np.ndarray, u: float,
              t2: Optional[np.ndarray] = None) -> np.ndarray:
    """Variance bound of the rounding of each addition s_k = s_(k-1) + t_k: ulp(s_k)²/12 from the
    binade the partial sum lies in, and never more than min(|t_k|, |s_(k-1)|)²: round to nearest
    picks the closer of the floats next to the sum, and both addends are floats at distance
    |s_(k-1)| and |t_k| from it. This keeps a sum dominated by one term (the softmax of large
    logits) tight. t2 (= t·t) may be passed when the caller has it already."""
    if not isinstance(partial, np.ndarray):  # a device's: out of place, its binades by arrays.binade_sq
        xp = namespace(partial)
        prev = xp.minimum((partial - t) ** 2, t * t if t2 is None else t2)
        return xp.minimum(arrays.binade_sq(partial) * (u * u / 3.0), prev)
    prev = partial - t
    np.multiply(prev, prev, out=prev)
    np.minimum(prev, t * t if t2 is None else t2, out=prev)
    # Into the C-ordered rounding variance: the caller's sum over an axis adds in memory order,
    # and partial may be laid out otherwise (products with Kᵀ).
    rv = rounding_var(partial, u)
    return np.minimum(rv, prev, out=rv)


def finish(ref: np.ndarray, var: np.ndarray, det: np.ndarray, floor) -> np.ndarray:
    bound = np.sqrt(var)                       # LAMBDA·√var + det + floor, 0 where ref is ±inf
    bound *= LAMBDA
    bound += det
    bound += floor
    np.copyto(bound, 0.0, where=~np.isfinite(ref))
    return bound


def everywhere(mask) -> bool:
    """Whether mask is a NumPy array that is true everywhere (a head with nothing hidden or
    non-finite: its where()s would copy it whole). A device's mask is not asked: the answer would
    wait for the device."""
    return isinstance(mask, np.ndarray) and bool(mask.all())


_FLOAT64_MAX = float(np.finfo(np.float64).max)


def finite_abs(x: np.ndarray) -> np.ndarray:
    """|x| with non-finite entries (inputs accepted with --allow-nonfinite) as 0: a floor must
    stay finite, or an Inf would let every value of its row or column pass."""
    x = namespace(x).abs(arrays.float64(x))
    return namespace(x).where(x <= _FLOAT64_MAX, x, 0.0)  # (NaN and inf fail the test: one pass, as isfinite)
