"""The words of messages: counted nouns (every count a user reads goes through plural()), sizes
(mib), a few of many places (indices), the measured values of a check's report (number,
number_pair), and text from files or names shown safely (printable, showable)."""
from __future__ import annotations

import math
from typing import Optional


def plural(n: int, noun: str, nouns: str = "") -> str:
    """`1 head`, `2 heads` (`nouns` for a plural that is not noun + s: `1 entry`, `2 entries`)."""
    return f"{n} {noun if n == 1 else (nouns or noun + 's')}"


def indices(places, shown: int = 4) -> str:
    """`15, 31, 47` or, of more than `shown`, `15, 31, 47, 63, ... 255`: the first and the last."""
    places = [int(x) for x in places]
    head = ", ".join(map(str, places[:shown]))
    return head + (f", ... {places[-1]}" if len(places) > shown else "")


def mib(n_bytes: int) -> str:
    """A size in messages: `1,536.0 MiB`, as the binary prints its memory plan."""
    return f"{n_bytes / (1 << 20):,.1f} MiB"


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


# float32 round-trips through 9 significant digits: more never tells two of its values apart.
MAX_PAIR_DIGITS = 9


def number_pair(got: Optional[float], want: Optional[float]) -> tuple:
    """got and want as number() prints them, with as many more significant digits (up to
    MAX_PAIR_DIGITS) as it takes to print two different values differently: `got 9.92 want 9.92`
    would hide the very difference a failure line reports."""
    a, b = number(got), number(want)
    if a != b or got is None or want is None or got == want or not all(map(math.isfinite, (got, want))):
        return a, b
    for digits in range(4, MAX_PAIR_DIGITS + 1):
        a, b = _digits(got, digits), _digits(want, digits)
        if a != b:
            break
    return a, b


def _digits(x: float, digits: int) -> str:
    """x with `digits` significant digits, in number()'s style (an exponent outside [1e-3, 1e5))."""
    if x == 0:
        return "0"
    return f"{x:.{digits}g}" if 1e-3 <= abs(x) < 1e5 else f"{x:.{digits - 1}e}"


# What a terminal, a log viewer or an XML reader could act on rather than show: C0 controls, DEL,
# C1 controls (0x9b is a one-byte CSI), lone surrogates (undecodable bytes of a file name), and
# the Unicode line separators and bidirectional overrides that reorder or break what is shown.
_UNSHOWABLE = frozenset(
    [*range(0x00, 0x20), *range(0x7F, 0xA0), 0x2028, 0x2029, 0x200E, 0x200F, *range(0x202A, 0x202F),
     *range(0x2066, 0x206A), *range(0xD800, 0xE000)])
PRINTABLE_LIMIT = 120
ELLIPSIS = "..."


def _shown(ch: str) -> str:
    code = ord(ch)
    if code not in _UNSHOWABLE:
        return ch
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def showable(text: str) -> bool:
    """Whether `text` has nothing printable() would escape."""
    return not any(ord(ch) in _UNSHOWABLE for ch in text)


def printable(text: object, limit: int = PRINTABLE_LIMIT) -> str:
    """A string that came from a user's file (run.toml values, name-map patterns, header fields,
    tokens quoted in errors) as messages and reports show it: every control character escaped
    (`\\x1b`, `\\x9b`, `\\u202e`), so an escape sequence in a file cannot drive the terminal (OSC 52
    writes the clipboard) or break a line of the report, and cut to `limit` characters with an
    ellipsis, so a huge value cannot flood one."""
    out, length = [], 0
    for ch in str(text):
        piece = _shown(ch)
        if length + len(piece) > limit:
            cut = limit - len(ELLIPSIS)
            while out and length > cut:  # whole pieces only: an escape is never cut in half
                length -= len(out.pop())
            return "".join(out) + ELLIPSIS
        out.append(piece)
        length += len(piece)
    return "".join(out)
