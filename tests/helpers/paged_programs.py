"""A float32 NumPy program for a paged input case, written from the file contract (docs/contract.md,
"Paged KV caches"), not from verify/: it reads the manifest's page_size, cu_seqlens_q, seqused_k
and block_table, gathers each sequence's keys and values from the pool (K_head_j, V_head_j) through
its table row, and writes output, flash_output and flash_lse of every head as %.9g text, as another
program's folder (no run.toml). A bug changes which pool rows it reads (BUGS names each).
"""
from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Optional

import numpy as np

from helpers.packed_programs import bf16  # (the same rounding a bf16 kernel does)

f32 = np.float32

BUGS = {
    "wrong_page": "sequence 1's page 1 read from the pool's page after it (before it at the pool's end)",
    "page_shift": "every page of sequence 1 read one page further in the pool (one back at the pool's end)",
    "past_length": "each sequence's last page read to its end (keys past seqused_k attended)",
    "length_plus_one": "sequence 1 attends one key past seqused_k",
    "pool_order": "each sequence's pages read in pool order from its first page (the table's order ignored)",
    "table_late": "sequence 0 reads block_table[0, j + 1] for its page j: its last page from the table's −1 "
                  "padding, which NumPy indexes as the pool's last page",
}


def read_column(path: Path) -> np.ndarray:
    """A file of whole numbers written as text (cu_seqlens, seqused_k), one value a line."""
    return np.loadtxt(path, dtype=np.int64, comments="#", ndmin=1)


def _table_row(table: np.ndarray, b: int, pages: int, num_pages: int, bug: Optional[str]) -> np.ndarray:
    row = table[b].copy()
    if bug == "wrong_page" and b == 1:
        row[1] = row[1] + 1 if row[1] + 1 < num_pages else row[1] - 1
    if bug == "page_shift" and b == 1:
        step = 1 if (row[:pages] + 1 < num_pages).all() else -1
        row[:pages] += step
    if bug == "table_late" and b == 0:
        row = np.concatenate((row[1:], row[-1:]))
    if bug == "pool_order":
        row[:pages] = row[0] + np.arange(pages)
        row[:pages] %= num_pages
    return row


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, half: bool = False):
    """(output, lse) of float32 attention; a row of no key: 0 and −inf (a split's, contract.md).
    half: a bf16 kernel's (the operands and the unnormalised weights rounded to bf16 before their
    products, the output rounded after the division)."""
    if k.shape[0] == 0:
        return np.zeros((q.shape[0], v.shape[1]), f32), np.full((q.shape[0], 1), -np.inf, f32)
    if half:
        q, k, v = bf16(q), bf16(k), bf16(v)
    s = (q @ k.T) * f32(scale)
    top = s.max(axis=1, keepdims=True)
    e = np.exp(s - top)
    total = e.sum(axis=1, keepdims=True)
    out = bf16((bf16(e) @ v) / total) if half else (e / total) @ v
    return out, top + np.log(total)


def run_program(case: Path, out: Path, bug: Optional[str] = None, fmt: str = "%.9g",
                split_size: Optional[int] = None, half: bool = False) -> Path:
    """Computes the case in `case` into `out` (created), its text written with `fmt`; returns `out`.
    With split_size K, also each split's output and lse over the keys [s·K, (s+1)·K) it read;
    half: as a bf16 kernel computes it (_attend)."""
    manifest = tomllib.loads((case / "manifest.toml").read_text())
    P, H, Hk = manifest["page_size"], manifest["heads"], manifest.get("kv_heads", manifest["heads"])
    scale = manifest.get("scale", 1 / np.sqrt(manifest["d_k"]))
    cu_q = read_column(case / "cu_seqlens_q.txt")
    used = read_column(case / "seqused_k.txt")
    table = np.loadtxt(case / "block_table.txt", dtype=np.int64, comments="#", ndmin=2)
    out.mkdir(parents=True, exist_ok=True)
    for h in range(H):
        q = np.loadtxt(case / f"Q_head_{h}.txt", dtype=f32, comments="#", ndmin=2)
        k = np.loadtxt(case / f"K_head_{h // (H // Hk)}.txt", dtype=f32, comments="#", ndmin=2)
        v = np.loadtxt(case / f"V_head_{h // (H // Hk)}.txt", dtype=f32, comments="#", ndmin=2)
        num_pages = k.shape[0] // P
        o = np.zeros((q.shape[0], v.shape[1]), f32)
        lse = np.full((q.shape[0], 1), -np.inf, f32)
        splits = -(-int(used.max()) // split_size) if split_size else 0
        split_o = np.zeros((splits, q.shape[0], v.shape[1]), f32)
        split_lse = np.full((splits, q.shape[0], 1), -np.inf, f32)
        for b in range(len(used)):
            m, pages = int(used[b]), -(-int(used[b]) // P)
            count = pages * P if bug == "past_length" else m + (bug == "length_plus_one" and b == 1)
            if count == 0:
                continue
            row = _table_row(table, b, pages, num_pages, bug)
            j = np.arange(count)
            rows = row[j // P] * P + j % P
            span = slice(cu_q[b], cu_q[b + 1])
            o[span], lse[span] = _attend(q[span], k[rows], v[rows], scale, half)
            for sp in range(splits):
                part = rows[sp * split_size:(sp + 1) * split_size]
                split_o[sp, span], split_lse[sp, span] = _attend(q[span], k[part], v[part], scale)
        for name, x in (("output", o), ("flash_output", o), ("flash_lse", lse)):
            np.savetxt(out / f"{name}_head_{h}.txt", x, fmt=fmt)
        for sp in range(splits):
            np.savetxt(out / f"split_output_head_{h}_split_{sp}.txt", split_o[sp], fmt=fmt)
            np.savetxt(out / f"split_lse_head_{h}_split_{sp}.txt", split_lse[sp], fmt=fmt)
    return out
