"""The half-precision formats: rounding to them, and the error of storing a value in them.

Under `--precision bf16|fp16` the inputs are rounded to the format (the verifier rounds them the
same way, so its references start from the values the program computed with), the GEMMs multiply
half values and accumulate in float32 (the float32 model, verify/model/dot.py), the softmax runs in
float32, and each stored value is converted to the format once: an error of at most half a unit in
its last place, ≤ STORAGE_UNIT·|x| for a normal value and half the subnormal step below (fp16).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np

# Per format: significant bits p (the unit roundoff is 2^-p) and the exponent of the smallest
# normal value; below it the step is fixed (subnormals).
HALF_FORMATS: Dict[str, Tuple[int, int]] = {"bf16": (8, -126), "fp16": (11, -14)}

# How a program converts float32 to the format: to nearest, ties to even (a conversion instruction,
# __float2bfloat16), or toward zero (the `bits >> 16` shortcut of hand-written bf16 code), which
# errs by up to one unit in the last place, always shrinking |x|.
NEAREST, TOWARD_ZERO = "nearest", "toward-zero"
HALF_ROUNDINGS = (NEAREST, TOWARD_ZERO)
# The largest conversion error in units of the format's unit roundoff (half an ulp, or one).
_ROUNDING_UNITS = {NEAREST: 1.0, TOWARD_ZERO: 2.0}


def is_half(precision: str) -> bool:
    return precision in HALF_FORMATS


def rounding_refusal(precision: str, rounding: Optional[str], option: str) -> Optional[str]:
    """Why a conversion rounding asked for (`option` names it to the user) cannot apply at
    `precision`, or None: only the half formats convert values."""
    if rounding is None or is_half(precision):
        return None
    return (f"{option} {rounding} applies to half-precision checks only (--precision bf16 or fp16); "
            f"the bounds assume {precision}, which stores no value in a half format")


def storage_unit(precision: str) -> float:
    """The unit roundoff of storing a value in the format (2^-8 bf16, 2^-11 fp16)."""
    return 2.0 ** -HALF_FORMATS[precision][0]


def round_mantissa32(x: np.ndarray, dropped: int, toward_zero: bool = False) -> np.ndarray:
    """float32 values with their `dropped` low mantissa bits rounded off in float32's own bits:
    nearest even (add half a unit of the last kept place, less one where that place's bit is 0:
    ties to even), or toward zero (the bits cleared); ±inf and NaN stay as they are. 16 bits make
    bf16, 13 TF32's operands."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    keep = np.uint32((0xFFFFFFFF << dropped) & 0xFFFFFFFF)
    if toward_zero:
        out = bits & keep
    else:
        out = np.right_shift(bits, dropped)
        out &= 1
        out += (1 << (dropped - 1)) - 1
        out += bits       # at most 0xFF800000 + half a unit for a finite value: no wrap-around
        out &= keep
    np.copyto(out, bits, where=(bits & 0x7F800000) == 0x7F800000)
    return out.view(np.float32)


# The float32 mantissa bits a bf16 value drops.
BF16_DROPPED_BITS = 16


def round_to_format32(x: np.ndarray, precision: str, rounding: str = NEAREST) -> np.ndarray:
    """x (float32 values) rounded to the format, nearest even, as a float32->bf16/fp16 conversion
    does (fp16: ±inf past 65504, subnormals below 2^-14); returned as float32 holding the values.
    bf16 in float32's own bits (round_mantissa32). rounding TOWARD_ZERO: the nearest value of the
    format no farther from zero than x."""
    x32 = np.ascontiguousarray(x, dtype=np.float32)
    if rounding == TOWARD_ZERO:
        return _toward_zero32(x32, precision)
    if precision == "fp16":
        with np.errstate(over="ignore"):
            return x32.astype(np.float16).astype(np.float32)
    return round_mantissa32(x32, BF16_DROPPED_BITS)


def _toward_zero32(x32: np.ndarray, precision: str) -> np.ndarray:
    """x32 truncated to the format: bf16 keeps float32's 16 high bits; fp16 steps a nearest result
    that grew in magnitude back by one value (65504 past the largest finite value, not inf)."""
    if precision == "fp16":
        with np.errstate(over="ignore"):
            y = x32.astype(np.float16)
        grew = np.abs(y.astype(np.float32)) > np.abs(x32)
        y[grew] = np.nextafter(y[grew], np.float16(0))
        return y.astype(np.float32)
    return round_mantissa32(x32, BF16_DROPPED_BITS, toward_zero=True)


def round_to_format(x: np.ndarray, precision: str, rounding: str = NEAREST) -> np.ndarray:
    """round_to_format32 returned as float64 holding the values."""
    return round_to_format32(x, precision, rounding).astype(np.float64)


def echoed(got: np.ndarray, want: np.ndarray, precision: str, rounding: str = NEAREST) -> np.ndarray:
    """What a program's echo of `want` (an input it copies, such as K or V) may hold, float64: at
    bf16/fp16 each entry as read where `got` has it so, else rounded to the format (a program that
    stores its inputs in the format echoes them rounded; one that copies the text echoes them as
    read); `want` itself at other precisions. `want` broadcasts against `got`."""
    want = np.asarray(want, np.float64)
    if not is_half(precision):
        return want
    return np.where(got == want, want, round_to_format(want, precision, rounding))


def storage_bound(ref: np.ndarray, precision: str, rounding: str = NEAREST) -> np.ndarray:
    """Bound on the error of converting a float32 value near ref to the format: half an ulp, at
    most u_h·|x| (the value computed lies within a few float32 ulps of ref: 2^-20 covers them)
    plus half the subnormal step; twice that toward zero (a whole ulp); 0 where ref is not finite
    (masked entries match exactly)."""
    p, emin = HALF_FORMATS[precision]
    units = _ROUNDING_UNITS[rounding]
    a = np.abs(np.asarray(ref, dtype=np.float64))
    out = a * (units * 2.0 ** -p * (1.0 + 2.0 ** -20))
    out += units * 2.0 ** (emin - p)
    np.copyto(out, 0.0, where=~np.isfinite(a))
    return out
