"""split_output and split_lse: flash-decoding's per-split partial outputs and log-sum-exps, stages of
a run that splits the keys K per split (Dims.split_size).

Split s of a query row covers the keys [s·K, (s+1)·K) that the row sees (the variant's mask applied,
the scores modified as for flash_output): split_lse is the log-sum-exp over them, split_output the
attention over them normalised by the split's own sum. A split is the flash forward restricted to a
key range, so its reference and bounds are flash_output's and flash_lse's (verify/specs/flash.py)
under the variant with the keys outside the range hidden (restricted()): the same error model,
at the split's key count. A row that sees no key of a split: output 0 and lse −inf, exactly.

The split stages are checked split by split by verify/check/splits.py (each split of a head's matrix
against its own reference); these specs say what the rest of the engine asks of every stage.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np

from ..model.rounding import ToleranceError
from ..stages import MASK_INPUT, SPLIT_LSE, SPLIT_OUTPUT
from ..variant import NONE, PER_HEAD, Variant
from .base import Problem, StageSpec
from .output import scores_from_inputs


def key_ranges(split_size: int, splits: int, keys: int) -> List[Tuple[int, int]]:
    """[first, end) of each split's keys among `keys` (empty past the last key)."""
    return [(min(s * split_size, keys), min((s + 1) * split_size, keys)) for s in range(splits)]


def restricted(src: Dict[str, np.ndarray], variant: Variant, first: int, end: int,
               rows: int, keys: int) -> Tuple[Dict[str, np.ndarray], Variant]:
    """The sources and variant of the flash forward restricted to the keys [first, end): the keys
    outside it hidden, as a mask file hides them (with the case's own mask file, where it has one)."""
    inside = np.zeros(keys, bool)
    inside[first:end] = True
    mask = np.broadcast_to(inside, (rows, keys))
    if variant.mask != NONE and MASK_INPUT in src:
        mask = mask & (np.asarray(src[MASK_INPUT]) != 0)
    return {**src, MASK_INPUT: np.ascontiguousarray(mask)}, variant.with_(mask=PER_HEAD)


def max_logits(src: Dict[str, np.ndarray], variant: Variant, scale: float, slope: float,
               ranges: List[Tuple[int, int]]) -> np.ndarray:
    """(N, S) in float64: each split's row maximum of the scores over its keys (−inf where a row
    sees none of them), what a kernel that keeps its split's own maximum (vLLM's max_logits)
    weighs its split's sum against."""
    scores = scores_from_inputs(src, scale, None, variant, slope)
    return np.stack([np.max(scores[:, first:end], axis=1, initial=-np.inf) for first, end in ranges], axis=1)


def _per_split(src, problem: Problem):
    raise ToleranceError("the split stages are checked split by split (verify/check/splits.py), from the run's "
                         "split size")


SPECS = (
    StageSpec(SPLIT_OUTPUT, reference=_per_split, scaled=True, keyless=0.0),
    StageSpec(SPLIT_LSE, reference=_per_split, scaled=True, keyless=-np.inf, diagnoses=("lse_log2",)),
)
