"""Matrices in the case formats as the tests write and read them: text as np.savetxt writes it (%.9g,
exact for float32; %d for the integer files of a packed or paged case) or .npy, and bf16 rounding as
the binary's bf16 pipeline applies it to its inputs."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def save(path: Path, a, fmt: str, integers: bool = False) -> None:
    """One matrix in the case format: float32 values, or whole numbers (`integers`)."""
    if fmt == "txt":
        np.savetxt(path, a, fmt="%d" if integers else "%.9g")
    else:
        np.save(path, a if integers else np.asarray(a, dtype=np.float32))


def load(path: Path) -> np.ndarray:
    """A stage file as float32 (text, `#` comments allowed, or .npy)."""
    if path.suffix == ".npy":
        return np.load(path)
    return np.loadtxt(path, dtype=np.float32, ndmin=2, comments="#")


def round_bf16(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to bf16 (nearest even), as the binary's bf16 pipeline reads its inputs."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)
