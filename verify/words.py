"""Counted nouns and numbers in messages: every count a user reads goes through plural(), the
measured values of a check's report through number()."""
from __future__ import annotations

import math
from typing import Optional


def plural(n: int, noun: str, nouns: str = "") -> str:
    """`1 head`, `2 heads` (`nouns` for a plural that is not noun + s: `1 entry`, `2 entries`)."""
    return f"{n} {noun if n == 1 else (nouns or noun + 's')}"


def number(x: Optional[float]) -> str:
    """A measured value as the reports print it: 3 significant digits, an exponent outside
    [1e-3, 1e5), `-` for none."""
    if x is None:
        return "-"
    if x == 0:
        return "0"
    if math.isinf(x) or math.isnan(x):
        return str(x)
    return f"{x:.3g}" if 1e-3 <= abs(x) < 1e5 else f"{x:.2e}"


def printable(text: object, limit: int = 120) -> str:
    """A string read from a file, safe to print: control characters escaped, cut to `limit`."""
    s = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in str(text))
    return s if len(s) <= limit else s[:limit - 1] + "…"
