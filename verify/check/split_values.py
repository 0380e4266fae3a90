"""What a program's split stage may hold besides float32 values near its reference (docs/contract.md,
"Split-KV stages"): a finite stand-in for an empty split's −inf lse, and partial outputs stored in
the run's half format.
"""
from __future__ import annotations

import numpy as np

from ..files.resolution import half_values
from ..files.split_files import EMPTY_LSE_CEILING
from ..model.half import is_half


def stored_in_format(mat: np.ndarray, want: np.ndarray, precision: str) -> bool:
    """Whether a bf16/fp16 run stored a split stage in its format (vLLM's paged attention keeps its
    partial outputs in the query's dtype, where flash-attn's accumulators are float32): every
    finite value is one of the format's, where the exact results are not."""
    return is_half(precision) and half_values(mat, want, "fp32") == precision


def stand_ins_read_as_empty(mat: np.ndarray, keyless: np.ndarray) -> np.ndarray:
    """split_lse with a finite stand-in for −inf (at or below EMPTY_LSE_CEILING: a running maximum
    started at −FLT_MAX) read as −inf where the row sees no key of the split; the combine reads it so
    too (its weight exp(lse_s − lse) is 0 either way)."""
    with np.errstate(invalid="ignore"):
        return np.where(keyless & np.isfinite(mat) & (mat <= EMPTY_LSE_CEILING), -np.inf, mat)
