"""What a program's split stage may hold besides float32 values near its reference (docs/contract.md,
"Split-KV stages"): a finite stand-in for an empty split's −inf lse, and partial outputs stored in
the run's half format.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..files.resolution import holds_format
from ..files.split_files import EMPTY_LSE_CEILING
from ..specs.scores import STAND_IN_GAP
from ..model.half import is_half


def stored_in_half_format(mat: np.ndarray, want: np.ndarray, precision: str) -> bool:
    """Whether a bf16/fp16 run stored a split stage in its format (vLLM's paged attention keeps its
    partial outputs in the query's dtype, where flash-attn's accumulators are float32): every
    finite value is one of the format's, where the exact results are not."""
    return is_half(precision) and holds_format(mat, want, precision)


def stand_ins_read_as_empty(mat: np.ndarray, keyless: np.ndarray, want: Optional[np.ndarray] = None) -> np.ndarray:
    """split_lse with a finite stand-in for −inf (a running maximum started at −FLT_MAX or −1e30)
    read as −inf where the row sees no key of the split: at or below EMPTY_LSE_CEILING, and
    STAND_IN_GAP below the row's log-sum-exp over every split (want: the splits' references), so
    that its weight exp(lse_s − lse) in the combine is 0 in float32, as −inf's is."""
    limit = np.full((mat.shape[0], 1), EMPTY_LSE_CEILING)
    if want is not None:
        with np.errstate(invalid="ignore", divide="ignore"):
            row = np.logaddexp.reduce(np.where(keyless, -np.inf, want), axis=1, keepdims=True)
        limit = np.minimum(limit, np.where(np.isfinite(row), row - STAND_IN_GAP, EMPTY_LSE_CEILING))
    with np.errstate(invalid="ignore"):
        return np.where(keyless & np.isfinite(mat) & (mat <= limit), -np.inf, mat)
