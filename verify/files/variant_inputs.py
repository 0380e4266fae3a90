"""The inputs a variant case adds to Q, K, V and dO (verify/stages.py VARIANT_INPUTS): mask and
bias files, one per query head (`mask_head_{i}`) or one for every head (`mask.txt`), and the
ALiBi slopes (`alibi_slopes.txt`, 1×H or B×H); their names, which of them a folder holds, and
their strict reading (docs/contract.md).

A mask holds 0 (hidden) and 1 (visible) only; a bias any float but +inf and NaN (−inf masks the
entry, as in PyTorch's float attn_mask); the slopes are finite. A value that breaks the rule is an
error naming the file, line and column.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Optional, Set

import numpy as np

from ..stages import ALIBI_SLOPES_INPUT, BIAS_INPUT, FORMATS, INPUT_MANIFEST, MASK_INPUT, Dims, stage_file
from ..text import plural
from ..variant import BROADCAST, NONE, PER_HEAD, Variant
from .kinds import CaseError
from .matrix_io import element_where, parse_matrix, read_bytes

# The N×M inputs, each per query head or broadcast over the heads, and the Variant field that
# says which (both happen to be spelled as the input).
TENSOR_INPUTS = (MASK_INPUT, BIAS_INPUT)
COVERAGE_FIELD = {MASK_INPUT: "mask", BIAS_INPUT: "bias"}


# A slopes file in a case run or checked without ALiBi (which would ignore it): the words after the
# file's path, and the hint. cuda_src/io/variant_inputs.cpp kUnusedSlopes is the binary's twin.
UNUSED_SLOPES = ("exists but the run has no ALiBi (its slopes would be unused)",
                 f"turn ALiBi on to use them (alibi = true in {INPUT_MANIFEST}, or --alibi), or remove the file")


def whole_file(name: str, fmt: str) -> str:
    """The one file of an input that is not per head: `mask.txt`, `bias.npy`, `alibi_slopes.txt`."""
    return f"{name}.{fmt}"


def coverage(v: Variant, name: str) -> str:
    """How `v` covers the heads with the tensor input `name`: none, per-head or broadcast."""
    return getattr(v, COVERAGE_FIELD[name])


def whole_files(folder: Path) -> Dict[str, Set[str]]:
    """name -> the formats of `name.{fmt}` present in `folder`, for the broadcast mask and bias
    and the slopes."""
    entries = set(os.listdir(folder))
    found: Dict[str, Set[str]] = {}
    for name in TENSOR_INPUTS + (ALIBI_SLOPES_INPUT,):
        fmts = {fmt for fmt in FORMATS if whole_file(name, fmt) in entries}
        if fmts:
            found[name] = fmts
    return found


def coverage_of_files(folder: Path, name: str, per_head: Set[int], whole: Set[str], fmt: str) -> str:
    """A case without a manifest covers its heads as its files say: per-head files, one whole
    file, or neither (both at once: which one would be meant?)."""
    if per_head and whole:
        raise CaseError(f"{folder}: both {stage_file(name, min(per_head), fmt)} and "
                        f"{whole_file(name, sorted(whole)[0])}; HINT: a case has a {name} per head or one for all "
                        "heads: remove one")
    return PER_HEAD if per_head else BROADCAST if whole else NONE


# ----------------------------------------------------------------------------------------------
# Strict reading.

def _refuse(bad: np.ndarray, mat: np.ndarray, data: bytes, path: Path, what: str, rule: str) -> None:
    """A CaseError naming the first value where `bad` holds (file:line:col) and how many there are."""
    hits = np.argwhere(bad)
    if not hits.size:
        return
    r, c = (int(x) for x in hits[0])
    text = None if str(path).endswith(".npy") else data.decode("ascii")
    raise CaseError(f"{path}:{element_where(r, c, None, text)}: {mat[r, c]:.9g} in {what} "
                    f"({plural(len(hits), 'such value')}); HINT: {rule}")


def read_mask(path: Path, shape) -> np.ndarray:
    """A mask file as float64 0/1 (nonzero = visible)."""
    data = read_bytes(path, shape)
    mat = parse_matrix(data, path, shape, allow_nonfinite=True)
    _refuse((mat != 0) & (mat != 1), mat, data, path, "a mask",
            "a mask holds 0 (hidden) or 1 (visible) only; additive values go in a bias file")
    return mat.astype(np.float64)


def read_bias(path: Path, shape) -> np.ndarray:
    """A bias file as float64 (−inf allowed: it masks the entry)."""
    data = read_bytes(path, shape)
    mat = parse_matrix(data, path, shape, allow_nonfinite=True)
    _refuse(np.isnan(mat) | (mat == np.inf), mat, data, path, "a bias",
            "a bias holds finite values or -inf (which hides the entry), never +inf or NaN")
    return mat.astype(np.float64)


READERS = {MASK_INPUT: read_mask, BIAS_INPUT: read_bias}


def read_slopes(path: Path, dims: Dims) -> np.ndarray:
    """The ALiBi slopes file as float64 (rows, H): one row for every batch element, or B rows."""
    data = read_bytes(path)
    mat = parse_matrix(data, path, None, allow_nonfinite=True)
    if mat.shape[1] != dims.heads or mat.shape[0] not in (1, dims.batch):
        rows = "1" if dims.batch == 1 else f"1 or {dims.batch}"
        raise CaseError(f"{path}: shape {mat.shape[0]}x{mat.shape[1]}, expected {rows} x {dims.heads} (a slope per "
                        "query head, one row for every batch element or one per batch element)")
    _refuse(~np.isfinite(mat), mat, data, path, "the ALiBi slopes", "slopes must be finite numbers")
    return mat.astype(np.float64)


def slope_of(slopes: Optional[np.ndarray], standard: np.ndarray, dims: Dims, head: int) -> float:
    """The slope of flat query head `head` = b·H + h: from the slopes (1×H or B×H) when the case
    has them, else the standard slope of h."""
    b, h = dims.decode_head(head)
    if slopes is None:
        return float(standard[h])
    return float(slopes[b if slopes.shape[0] > 1 else 0, h])
