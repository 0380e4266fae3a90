"""Input cases of the attention variants written with NumPy directly (independent of
verify/files/generate.py), for the binary's tests: grouped K/V heads (K/V files per K/V head), the
same case expanded to one K/V head per query head, and the variant's mask, bias and slopes files.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, Tuple

import numpy as np

from helpers.matrix_files import save
from verify.stages import (ALIBI_SLOPES_INPUT, GRAD_INPUT, KEYS, QUERIES, VALUES, Dims, stage_file)


@dataclass(frozen=True)
class GqaCase:
    dims: Dims
    fmt: str = "txt"
    backward: bool = True

    @property
    def shapes(self) -> Dict[str, Tuple[int, int]]:
        d = self.dims
        return {QUERIES: (d.seq_q, d.d_k), KEYS: (d.seq_k, d.d_k), VALUES: (d.seq_k, d.d_v),
                GRAD_INPUT: (d.seq_q, d.d_v)}

    def manifest_text(self) -> str:
        """The case's manifest; kv_heads only where the dimensions set it."""
        d = self.dims
        text = (f"batch = {d.batch}\nheads = {d.heads}\nseq_q = {d.seq_q}\nseq_k = {d.seq_k}\n"
                f"d_k = {d.d_k}\nd_v = {d.d_v}\nformat = \"{self.fmt}\"\nbackward = {str(self.backward).lower()}\n")
        return text + (f"kv_heads = {d.kv_heads}\n" if d.kv_heads else "")




def write_gqa_case(path: Path, case: GqaCase, seed: int = 0, manifest: bool = True) -> None:
    """Q (and dO) per query head, K and V per K/V head, and a manifest with kv_heads."""
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    d = case.dims
    names = [QUERIES] + ([GRAD_INPUT] if case.backward else [])
    for name in names:
        for i in range(d.total_heads):
            save(path / stage_file(name, i, case.fmt), rng.standard_normal(case.shapes[name]), case.fmt)
    for name in (KEYS, VALUES):
        for j in range(d.total_kv_heads):
            save(path / stage_file(name, j, case.fmt), rng.standard_normal(case.shapes[name]), case.fmt)
    if manifest:
        (path / "manifest.toml").write_text(case.manifest_text())


def expand_to_mha(gqa: Path, mha: Path, case: GqaCase) -> None:
    """The same case with one K/V head per query head: query head i gets its K/V head's files."""
    mha.mkdir(parents=True, exist_ok=True)
    d = case.dims
    for name in [QUERIES] + ([GRAD_INPUT] if case.backward else []):
        for i in range(d.total_heads):
            shutil.copy(gqa / stage_file(name, i, case.fmt), mha / stage_file(name, i, case.fmt))
    for name in (KEYS, VALUES):
        for i in range(d.total_heads):
            shutil.copy(gqa / stage_file(name, d.kv_head_of(i), case.fmt), mha / stage_file(name, i, case.fmt))
    (mha / "manifest.toml").write_text(GqaCase(replace(d, kv_heads=0), case.fmt, case.backward).manifest_text())




def tensor_file(name: str, head, fmt: str) -> str:
    """A mask or bias file: `<name>_head_<i>` per head, `<name>` broadcast (head None)."""
    return f"{name}.{fmt}" if head is None else stage_file(name, head, fmt)


def write_mask(path: Path, dims: Dims, fmt: str, per_head: bool, seed: int = 0, keep: float = 0.7) -> None:
    """A random 0/1 mask per query head, or one broadcast over the heads."""
    rng = np.random.default_rng(seed)
    for head in (range(dims.total_heads) if per_head else [None]):
        save(path / tensor_file("mask", head, fmt), rng.random((dims.seq_q, dims.seq_k)) < keep, fmt)


def write_bias(path: Path, dims: Dims, fmt: str, per_head: bool, seed: int = 0) -> None:
    """A random additive bias per query head, or one broadcast, with a -inf entry (allowed)."""
    rng = np.random.default_rng(seed)
    for head in (range(dims.total_heads) if per_head else [None]):
        b = rng.standard_normal((dims.seq_q, dims.seq_k)).astype(np.float32)
        b[0, -1] = -np.inf
        save(path / tensor_file("bias", head, fmt), b, fmt)


def write_slopes(path: Path, slopes: np.ndarray, fmt: str) -> None:
    save(path / f"{ALIBI_SLOPES_INPUT}.{fmt}", np.atleast_2d(slopes), fmt)
