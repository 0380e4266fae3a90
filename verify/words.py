"""Counted nouns in messages: every count a user reads goes through plural()."""
from __future__ import annotations


def plural(n: int, noun: str, nouns: str = "") -> str:
    """`1 head`, `2 heads` (`nouns` for a plural that is not noun + s: `1 entry`, `2 entries`)."""
    return f"{n} {noun if n == 1 else (nouns or noun + 's')}"
