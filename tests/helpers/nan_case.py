"""A case with NaN inputs (run with --allow-nonfinite) and the rows the NaN must reach.

A NaN in a row of Q makes every score of that query row NaN; a NaN in a row of K makes that key's
score NaN for every query row that sees the key. The reference softmax of a row holding a NaN score
is NaN throughout (its maximum is NaN), so attention_weights, output, flash_output and flash_lse
must be NaN in exactly those rows, and finite in every other row.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from verify.files.case import read_matrix, write_matrix
from verify.files.generate import generate_case
from verify.stages import Dims, stage_file

# Two heads: head 0 gets a NaN in one key, head 1 in three query rows (first, inside, last).
NAN_DIMS = Dims(batch=1, heads=2, seq_q=70, seq_k=150, d_k=16, d_v=16)
NAN_KEY = 60          # of head 0: seen by query rows >= 60 when causal, by all rows otherwise
NAN_QUERY_ROWS = (0, 37, 69)  # of head 1
# The stages whose rows a NaN score reaches whole.
ROW_STAGES = ("attention_weights", "output", "flash_output", "flash_lse")


def _plant(path: Path, row: int, col: int) -> None:
    m = read_matrix(path).astype(np.float32)
    m[row, col] = np.nan
    write_matrix(path, m, "npy")


def nan_case(in_dir: Path, causal: bool, dims: Dims = NAN_DIMS) -> tuple[Path, dict[int, np.ndarray]]:
    """Writes the case; returns it and, per head, the query rows that must come out NaN."""
    in_dir = generate_case(in_dir, dims, causal=causal, seed=13, distribution="normal", fmt="npy")
    _plant(in_dir / stage_file("K", 0, "npy"), NAN_KEY, 3)
    for r in NAN_QUERY_ROWS:
        _plant(in_dir / stage_file("Q", 1, "npy"), r, 5)
    rows = np.arange(dims.seq_q)
    return in_dir, {0: rows[rows >= NAN_KEY] if causal else rows, 1: np.array(NAN_QUERY_ROWS)}


def nan_row_failures(read, stages, nan_rows: dict[int, np.ndarray], seq_q: int) -> list[str]:
    """For each head and stage of `stages` among ROW_STAGES: the rows that must be NaN are NaN in
    every element, the others hold no NaN. read(stage, head) gives the written matrix."""
    failures = []
    for head, must in nan_rows.items():
        others = np.setdiff1d(np.arange(seq_q), must)
        for stage in ROW_STAGES:
            if stage not in stages:
                continue
            got = np.asarray(read(stage, head), dtype=np.float64).reshape(seq_q, -1)
            if not np.isnan(got[must]).all():
                bad = [int(r) for r in must if not np.isnan(got[r]).all()]
                failures.append(f"{stage} head {head}: rows {bad[:8]} not all NaN")
            if np.isnan(got[others]).any():
                bad = [int(r) for r in others if np.isnan(got[r]).any()]
                failures.append(f"{stage} head {head}: NaN leaked into rows {bad[:8]}")
    return failures
