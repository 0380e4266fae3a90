"""What `attnstep generate` draws for a variant case besides Q, K, V and dO: mask patterns (the
ones FlexAttention users write), a random bias, random ALiBi slopes.

Each pattern is an N×M matrix for one query head (or for all of them), built on the case's
alignment: query row i sits at key diag(i) = i + offset (verify/variant.py), so a document or a
prefix means the same with N != M as a bottom-right causal mask does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

import numpy as np

from ..stages import Dims
from ..variant import BROADCAST, TENSOR_COVERAGE, Variant
from .kinds import CaseError

# The random mask keeps each entry with this probability; the random bias hides (−inf) this
# share of its entries; with empty rows, about this share of the mask's rows hide every key.
RANDOM_MASK_KEEP = 0.8
RANDOM_BIAS_HIDDEN = 0.02
EMPTY_ROW_SHARE = 1 / 8
# Random ALiBi slopes are log-uniform over [2^MIN, 1]: the standard slopes' range (2^-8 .. 1/2).
RANDOM_SLOPE_MIN_LOG2 = -8.0
STANDARD_SLOPES, RANDOM_SLOPES = "standard", "random"
SLOPE_CHOICES = (STANDARD_SLOPES, RANDOM_SLOPES)
# The most documents a document mask cuts the keys into.
MAX_DOCUMENTS = 8
DOCUMENT, PREFIX_LM, RANDOM = "document", "prefix-lm", "random"


@dataclass(frozen=True)
class VariantInputs:
    """The inputs to draw: a mask pattern and a bias pattern (None: none), how each covers the
    heads (verify/variant.py TENSOR_COVERAGE), the ALiBi slopes (standard: no file), and whether
    the random mask may hide every key of some rows."""
    mask: Optional[str] = None
    mask_heads: str = BROADCAST
    bias: Optional[str] = None
    bias_heads: str = BROADCAST
    slopes: str = STANDARD_SLOPES
    empty_rows: bool = False


def _row_positions(v: Variant, n: int, m: int) -> np.ndarray:
    """The key each query row sits at (its diagonal), clipped into 0..m-1."""
    return np.clip(np.arange(n) + v.offset(n, m), 0, m - 1)


def _document(v: Variant, n: int, m: int, rng: np.random.Generator) -> np.ndarray:
    """Block-diagonal: the keys cut into documents of random lengths; a row sees the keys of its
    own document (combined with causal, a causal document mask)."""
    pieces = int(rng.integers(1, min(MAX_DOCUMENTS, m) + 1))
    cuts = np.sort(rng.choice(np.arange(1, m), size=pieces - 1, replace=False)) if pieces > 1 else np.array([], int)
    key_doc = np.searchsorted(cuts, np.arange(m), side="right")
    return key_doc[_row_positions(v, n, m)][:, None] == key_doc[None, :]


def _prefix_lm(v: Variant, n: int, m: int, rng: np.random.Generator) -> np.ndarray:
    """A random prefix of keys that every row sees, then causal (by the case's alignment)."""
    prefix = int(rng.integers(1, m + 1))
    j = np.arange(m)[None, :]
    return (j < prefix) | (j <= (np.arange(n) + v.offset(n, m))[:, None])


def _random(v: Variant, n: int, m: int, rng: np.random.Generator) -> np.ndarray:
    return rng.random((n, m)) < RANDOM_MASK_KEEP


MASK_PATTERNS: Dict[str, Callable[[Variant, int, int, np.random.Generator], np.ndarray]] = {
    DOCUMENT: _document, PREFIX_LM: _prefix_lm, RANDOM: _random}
BIAS_PATTERNS = (RANDOM,)


def _keep_one_key_per_row(keep: np.ndarray, v: Variant, rng: np.random.Generator) -> np.ndarray:
    """Where a row sees keys under the causal flag and window but `keep` hides all of them, one
    of those keys (at random) kept: a random pattern leaves no row empty by chance."""
    visible = v.visible(*keep.shape)
    for row in np.flatnonzero(~(keep & visible).any(axis=1) & visible.any(axis=1)):
        keep[row, rng.choice(np.flatnonzero(visible[row]))] = True
    return keep


def draw_mask(inputs: VariantInputs, v: Variant, n: int, m: int, rng: np.random.Generator) -> np.ndarray:
    """One N×M mask of the pattern (float32 1 visible, 0 hidden)."""
    keep = MASK_PATTERNS[inputs.mask](v, n, m, rng)
    if inputs.mask == RANDOM:
        keep = _keep_one_key_per_row(keep, v, rng)
        if inputs.empty_rows:  # rows that see nothing: the contract's zero output and −inf lse
            keep[rng.random(n) < EMPTY_ROW_SHARE] = False
            keep[int(rng.integers(n))] = False
    return keep.astype(np.float32)


def draw_bias(inputs: VariantInputs, v: Variant, n: int, m: int, rng: np.random.Generator) -> np.ndarray:
    """One N×M random bias: N(0, 1), a few entries −inf (masked), no row hidden by them alone."""
    bias = rng.standard_normal((n, m), dtype=np.float32)
    hidden = rng.random((n, m)) < RANDOM_BIAS_HIDDEN
    hidden = ~_keep_one_key_per_row(~hidden, v, rng)
    bias[hidden] = -np.inf
    return bias


def draw_slopes(dims: Dims, rng: np.random.Generator) -> np.ndarray:
    """Random ALiBi slopes, one per query head of each batch element (B×H)."""
    return np.exp2(rng.uniform(RANDOM_SLOPE_MIN_LOG2, 0.0, (dims.batch, dims.heads))).astype(np.float32)


def check_inputs(inputs: VariantInputs, v: Variant) -> None:
    """Refuses, in one line, a combination that cannot be drawn or means nothing."""
    if inputs.mask is not None and inputs.mask not in MASK_PATTERNS:
        raise CaseError(f"--mask {inputs.mask!r}: expected one of {', '.join(MASK_PATTERNS)}")
    if inputs.bias is not None and inputs.bias not in BIAS_PATTERNS:
        raise CaseError(f"--bias {inputs.bias!r}: expected one of {', '.join(BIAS_PATTERNS)}")
    for option, value in (("--mask-heads", inputs.mask_heads), ("--bias-heads", inputs.bias_heads)):
        if value not in TENSOR_COVERAGE:
            raise CaseError(f"{option} {value!r}: expected one of {', '.join(TENSOR_COVERAGE)}")
    if inputs.slopes not in SLOPE_CHOICES:
        raise CaseError(f"--alibi-slopes {inputs.slopes!r}: expected one of {', '.join(SLOPE_CHOICES)}")
    if inputs.mask == PREFIX_LM and v.causal:
        raise CaseError("--mask prefix-lm with --causal: a prefix-LM mask is causal after its prefix by itself, "
                        "and --causal would hide the prefix right of the diagonal; HINT: drop --causal")
    if inputs.empty_rows and inputs.mask != RANDOM:
        raise CaseError("--mask-empty-rows needs --mask random (the other patterns are drawn whole)")
    if inputs.slopes == RANDOM_SLOPES and not v.alibi:
        raise CaseError("--alibi-slopes random needs --alibi (the slopes are read only with ALiBi)")
