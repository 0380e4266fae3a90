"""What a variant adds to a stage's sources (verify/variant.py's tensors of one head), and the
HeadVariant (verify/model/scores.py) a stage's sources describe.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np

from ..model.scores import HeadVariant
from ..stages import BIAS_INPUT, DROPOUT_MASK, MASK_INPUT, SCORES
from ..variant import NONE, Variant

Src = Dict[str, np.ndarray]

# The head's tensors a variant adds to a stage's sources (verify/stages.py): its mask and bias
# files (inputs of the case) and the program's dropout keep-mask (a stage it writes; every check
# uses the program's own, never a re-drawn one).
VARIANT_SOURCES = (MASK_INPUT, BIAS_INPUT, DROPOUT_MASK)


def resolve_variant(variant: Optional[Variant], causal: bool) -> Variant:
    """The variant a check runs under: `variant` with its causal flag set to `causal` (the flag
    wins, as --causal overrides a manifest); a plain causal or non-causal case without one."""
    if variant is None:
        return Variant(causal=bool(causal))
    return variant if variant.causal == bool(causal) else variant.with_(causal=bool(causal))


def head_variant(variant: Variant, slope: float, src: Src) -> HeadVariant:
    """The HeadVariant of a stage's sources: the variant, the head's slope, and its mask, bias and
    dropout keep-mask where `src` holds them."""
    return HeadVariant(variant, slope, src.get(MASK_INPUT), src.get(BIAS_INPUT), src.get(DROPOUT_MASK))


# What each stage reads besides its table inputs (Stage.inputs) under a variant: StageSpec's
# variant_sources.
def no_variant_sources(v: Variant) -> Tuple[str, ...]:
    return ()


def score_sources(v: Variant) -> Tuple[str, ...]:
    """The files that shape the scores: the mask and the bias."""
    return tuple(name for name, cover in ((MASK_INPUT, v.mask), (BIAS_INPUT, v.bias)) if cover != NONE)


def dropout_sources(v: Variant) -> Tuple[str, ...]:
    """The program's keep-mask, under dropout."""
    return (DROPOUT_MASK,) if v.dropout > 0 else ()


def cap_sources(v: Variant) -> Tuple[str, ...]:
    """QK, from which a gradient through the softcap takes its derivative 1 − t²."""
    return (SCORES,) if v.softcap > 0 else ()


def flash_sources(v: Variant) -> Tuple[str, ...]:
    return score_sources(v) + dropout_sources(v)
