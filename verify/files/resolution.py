"""How finely a stage file records its values: the printed precision of text, the dtype of .npy.

A program that prints `%g` (C's default, 6 significant digits) or `%.6f` has lost digits before
the verifier sees them: each value is known only to half a unit in its last printed place. That
quantization is folded into every comparison of the file (and propagated into the references
computed from it), so correct results printed coarsely pass, and the report says how coarse the
printing was. `%.9g` (9 significant digits) round-trips float32 exactly: nothing is lost.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..model.half import is_half, round_to_format
from ..model.rounding import UNIT_ROUNDOFF
from ..text import plural

# Significant digits from which a printed float32 round-trips exactly.
FLOAT32_ROUND_TRIP_DIGITS = 9
DEFAULT_PRINTF_DIGITS = 6  # %g and C++ ostreams
# Bytes of a text file whose tokens are analysed: a writer prints a whole file one way, and the
# first rows show it (32 KB are ~3,000 values; a 4096² file is ~150 MB).
SAMPLE_BYTES = 1 << 15
_U32 = UNIT_ROUNDOFF["fp32"]  # the reader rounds each printed decimal to float32
# A number token: sign, integer digits, '.' and fraction digits, exponent (inf/nan do not match).
_TOKENS = re.compile(rb"(?<![\w.+-])[+-]?(\d*)(\.(\d*))?([eE][+-]?\d+)?(?![\w.])")


@dataclass(frozen=True)
class Resolution:
    """exact: float32 values as they were; digits: `%.Sg`-style, S significant digits; decimals:
    `%.Df`-style, D digits after the point; half: float16 values (.npy '<f2')."""
    kind: str
    count: int = 0

    @property
    def exact(self) -> bool:
        return self.kind == "exact"

    def describe(self) -> str:
        return {"exact": "exact", "digits": plural(self.count, 'significant digit'),
                "decimals": plural(self.count, 'decimal'), "half": "float16"}[self.kind]

    def quantum(self, values: np.ndarray) -> Optional[np.ndarray]:
        """Element-wise bound on |value read - value the program held|; None when exact."""
        if self.exact:
            return None
        x = np.abs(np.where(np.isfinite(values), values, 0.0))
        if self.kind == "half":
            # half an ulp of float16: 2^(e-11), and 2^-25 in its subnormal range (0 included: a
            # value under 2^-25 rounds to 0)
            e = np.floor(np.log2(np.maximum(x, 2.0**-14)))
            return 2.0 ** (e - 11)
        if self.kind == "decimals":
            half_unit = np.full(x.shape, 0.5 * 10.0 ** -self.count)
        else:
            # The decade of the printed number: "0.01" reads as float32 0.0099999998, one decade
            # below the one it was printed in; nudging up by more than float32's rounding finds it.
            with np.errstate(divide="ignore"):
                e = np.floor(np.log10(np.where(x > 0, x * (1.0 + 2.0**-20), 1.0)))
            half_unit = np.where(x > 0, 0.5 * 10.0 ** (e - self.count + 1), 0.0)
        # the printed decimal is then rounded to float32 by the reader
        return half_unit + _U32 * x


EXACT = Resolution("exact")
HALF = Resolution("half")


def text_resolution(data: bytes) -> Resolution:
    """The printed precision of a text matrix, from a sample of its number tokens.

    `%.Df` prints every value with the same D decimals and no exponent; `%g`/`%.Sg` prints at
    most S significant digits (trailing zeros dropped), so the largest count seen is S."""
    sample = data[:SAMPLE_BYTES]
    if len(data) > SAMPLE_BYTES:
        sample = sample[:sample.rfind(b"\n") + 1] or sample
    max_sig, decimals, fixed, integers_only = 0, set(), True, True
    body = b"\n".join(line for line in sample.split(b"\n") if not line.lstrip().startswith(b"#"))
    for token in _TOKENS.finditer(body):
        whole, point, frac, exp = token.groups(b"")
        if not whole and not frac:
            continue  # an empty match, or inf/nan
        max_sig = max(max_sig, len((whole + frac).lstrip(b"0")))
        integers_only &= not point and not exp
        if exp or not point:
            fixed = False
        else:
            decimals.add(len(frac))
        if max_sig >= FLOAT32_ROUND_TRIP_DIGITS and not (fixed and len(decimals) == 1):
            return EXACT  # round-trip digits, and not %.Df: no later token changes that
    if fixed and len(decimals) == 1:  # %.Df: D decimals whatever the magnitude (%.8f of 1.64740086)
        return Resolution("decimals", decimals.pop())
    if max_sig >= FLOAT32_ROUND_TRIP_DIGITS:
        return EXACT
    if integers_only:
        # Only integers: %g prints 1.0000001 as "1" too; assume C's default of 6 digits.
        return Resolution("digits", max(max_sig, DEFAULT_PRINTF_DIGITS))
    return Resolution("digits", max(max_sig, 1))


def array_resolution(arr: np.ndarray) -> Resolution:
    return HALF if arr.dtype == np.float16 else EXACT


# ----------------------------------------------------------------------------------------------
# Half-precision values checked at fp32: a half-precision program's output (a float16 array, or a
# bfloat16 tensor's .float()) checked without its precision passes or fails for reasons the
# report must name. The sign is that every value is one of the format's while the exact results
# are not: a float32 program's results land on a bfloat16 value once in 2^16, on a float16 one
# once in 2^13, so a few such elements already rule out chance.
HALF_EVIDENCE = 8     # elements whose exact result is not in the format, at least
_SAMPLE_VALUES = 4096  # values tried first: a float32 stage fails the test within its first few
_NARROWEST_FIRST = ("bf16", "fp16")


def half_values(values: np.ndarray, exact: np.ndarray, precision: str) -> Optional[str]:
    """"bf16" or "fp16" when, checked at a float32 precision, every finite value of `values` is
    one of that format's though at least HALF_EVIDENCE of the `exact` results are not; else None.
    bf16 is tried first: its values are mostly float16 values too, not the other way round."""
    if is_half(precision):
        return None
    return next((fmt for fmt in _NARROWEST_FIRST if holds_format(values, exact, fmt)), None)


def holds_format(values: np.ndarray, exact: np.ndarray, fmt: str) -> bool:
    """Whether every finite value of `values` is one of the format's though at least HALF_EVIDENCE
    of the `exact` results are not: values stored in that format."""
    sample = values.ravel()[:_SAMPLE_VALUES]  # (a view: a float32 stage costs no copy of itself)
    return (_all_in_format(sample, fmt) and _all_in_format(values, fmt)
            and _evidence(values, exact, fmt) >= HALF_EVIDENCE)


def _in_format(x: np.ndarray, fmt: str) -> np.ndarray:
    """Whether each value (float64 holding it) is exactly a value of the format."""
    with np.errstate(over="ignore"):  # past float32's range: inf, not equal, not in the format
        return round_to_format(x.astype(np.float32), fmt) == x


def _all_in_format(x: np.ndarray, fmt: str) -> bool:
    """Every finite value is one of the format's, and there is one at least (NaN and inf say nothing)."""
    finite = np.isfinite(x)
    return bool(finite.any()) and bool(np.all(_in_format(x, fmt) | ~finite))


def _evidence(values: np.ndarray, exact: np.ndarray, fmt: str) -> int:
    """The elements that show the format: a value with mantissa bits of its own (not 0, not a
    power of two, which every format holds: a softmax that underflows to 0 or saturates at 1 says
    nothing) whose exact result, as a float32 program would round it, is not a value of the format."""
    finite = np.isfinite(values) & np.isfinite(exact)
    mantissa = np.abs(np.frexp(np.where(finite, values, 0.0))[0])
    telling = finite & (mantissa != 0.5) & (mantissa != 0.0)
    e32 = exact[telling].astype(np.float32).astype(np.float64)
    return int(np.count_nonzero(~_in_format(e32, fmt)))
