"""dropout_mask: the program's keep-mask under dropout (1 kept, 0 dropped), and its keep rate.

The verifier never draws a mask of its own: the program's is what every stage that reads it is
checked against (their specs name it among their variant_sources and read src[DROPOUT_MASK]; the
check engine hands it to them), so the stage's reference is itself and its comparisons are exact. What
can be checked without a reference: every entry is exactly 0 or 1; and, over the whole run (the
engine sums each head's keep_counts), the share of the visible entries kept is within
verify.variant.dropout_keep_tolerance of 1 − p (or of the rate of flash-attn's 8-bit threshold,
(⌊255·(1 − p)⌋ + 1)/256).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np

from ..stages import DROPOUT_MASK
from ..variant import dropout_keep_band, dropout_keep_rates, dropout_keep_tolerance
from .base import HeadContext, StageSpec, Violation, violation

# Violation and run-check codes.
NOT_BINARY = "dropout_not_binary"      # an entry of the mask is neither 0 nor 1
KEEP_RATE = "dropout_keep_rate"        # the run keeps too many or too few entries for its p

KEPT, DROPPED = 1.0, 0.0


def _binary_check(stage: str, got: np.ndarray, ctx: HeadContext) -> List[Violation]:
    """Every entry exactly 0 or 1: a mask of other values (a scaled mask 1/(1 − p), a bit pattern,
    NaN) is not a keep-mask, and the stages that read it would be checked against nonsense."""
    bad = ~((got == KEPT) | (got == DROPPED))
    if not bad.any():
        return []
    v = violation(NOT_BINARY, stage, bad, "are neither 0 (dropped) nor 1 (kept)")
    where = v.where
    v.message += f" = {float(got[where]):.9g}"
    return [v]


def keep_counts(got: np.ndarray, ctx: HeadContext) -> Tuple[int, int]:
    """(kept, visible) of one head's mask: the entries the head's scores can see (its variant's
    mask, the mask file's ones, the bias file's finite entries), and those of them that hold 1.
    (Each entry is drawn independently of the others, so any set fixed before the draw tests the
    rate.)"""
    visible = ~ctx.hidden(*got.shape)
    return int(np.count_nonzero(visible & (got == KEPT))), int(np.count_nonzero(visible))


KEEP_RATE_TITLE = "keep rate"


def keep_rate(kept: int, total: int, p: float) -> Tuple[bool, str]:
    """(whether the run's keep count is plausible for dropout p, the one line that says so)."""
    problem: Optional[str] = dropout_keep_tolerance(kept, total, p)
    if problem:
        return False, f"{problem} of the visible entries"
    if not total:
        return True, "no visible entry: not tested"
    rates = " or ".join(f"{r:.4%}" for r in dropout_keep_rates(p))
    return True, (f"kept {kept} of {total} visible entries ({kept / total:.4%}); dropout {p} keeps "
                  f"{rates} ± {dropout_keep_band(total):.4%}")


SPECS = (
    StageSpec(DROPOUT_MASK, reference=lambda src, problem: src[DROPOUT_MASK], invariants=(_binary_check,)),
)
