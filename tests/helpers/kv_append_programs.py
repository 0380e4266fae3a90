"""A float32 NumPy decode step with new keys, written from the file contract (docs/contract.md, "New
keys: a decode step"), not from verify/: it reads the manifest's new_keys (and page_size), the
sequence files, the cache (K_head_j, V_head_j) and the new keys (K_new_head_j, V_new_head_j),
writes each sequence's new keys into its copy of the cache at seqused_k[b] (through block_table when
paged), attends over seqused_k[b] + new_keys keys (causal as the manifest says), and writes output, flash_output and flash_lse of
every head and the cache after the step (K, V per K/V head) as text, as another program's folder (no
run.toml). A bug changes where the new keys go or what attention reads (BUGS names each).
"""
from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from helpers.paged_programs import read_column

f32 = np.float32

BUGS = {
    "one_late": "every new key written one slot late (at seqused_k[b] + t + 1); attention reads that cache",
    "wrong_page": "the new keys written to the page after the right one in the pool (a paged case)",
    "unseen": "the new keys written, but attention over the cache's seqused_k[b] keys only",
    "stale": "attention before the new keys are written (their slots' old values read)",
    "not_written": "the cache after the step is the cache before it (attention right)",
    "clobber": "the slot after each sequence's new keys overwritten with zeros",
}


def _rows(case: Path, manifest: dict):
    """(key_row(b, j): the cache row of key j of sequence b, None past its table row; the page size)."""
    if "page_size" in manifest:
        P = manifest["page_size"]
        table = np.loadtxt(case / "block_table.txt", dtype=np.int64, comments="#", ndmin=2)
        return lambda b, j: int(table[b][j // P] * P + j % P) if j < table.shape[1] * P and table[b][j // P] >= 0 \
            else None, P
    cu_k = read_column(case / "cu_seqlens_k.txt")
    return lambda b, j: int(cu_k[b] + j), None


def _append(cache: np.ndarray, new: np.ndarray, used, n: int, key_row, page: Optional[int], bug: Optional[str]):
    """The cache with each sequence's new keys written (as the bug writes them)."""
    out = cache.copy()
    if bug == "not_written":
        return out
    for b, u in enumerate(used):
        for t in range(n):
            row = key_row(b, int(u) + t + (1 if bug == "one_late" else 0))
            if row is None:
                continue  # (a slot past the table row: nowhere to write)
            if bug == "wrong_page":
                row = (row + page) % cache.shape[0]
            out[row] = new[b * n + t]
        if bug == "clobber":
            out[key_row(b, int(u) + n)] = 0
    return out


def run_program(case: Path, out: Path, bug: Optional[str] = None, fmt: str = "%.9g",
                stages: Sequence[str] = ("output", "flash_output", "flash_lse", "K", "V")) -> Path:
    """Computes the step of the case in `case` into `out` (created), its text written with `fmt`,
    only `stages`; returns `out`."""
    manifest = tomllib.loads((case / "manifest.toml").read_text())
    H, Hk, n = manifest["heads"], manifest.get("kv_heads", manifest["heads"]), manifest["new_keys"]
    scale = manifest.get("scale", 1 / np.sqrt(manifest["d_k"]))
    cu_q, used = read_column(case / "cu_seqlens_q.txt"), read_column(case / "seqused_k.txt")
    load = lambda name: np.loadtxt(case / f"{name}.txt", dtype=f32, comments="#", ndmin=2)  # noqa: E731
    out.mkdir(parents=True, exist_ok=True)
    caches = {}
    for j in range(Hk):
        for name in ("K", "V"):
            before = load(f"{name}_head_{j}")
            key_row, page = _rows(case, manifest)
            after = _append(before, load(f"{name}_new_head_{j}"), used, n, key_row, page, bug)
            caches[name, j] = (before, after)
            if name in stages:
                np.savetxt(out / f"{name}_head_{j}.txt", after, fmt=fmt)
    for h in range(H):
        q = load(f"Q_head_{h}")
        (k0, k1), (v0, v1) = caches["K", h // (H // Hk)], caches["V", h // (H // Hk)]
        k, v = (k0, v0) if bug == "stale" else (k1, v1)
        o = np.zeros((q.shape[0], v.shape[1]), f32)
        lse = np.full((q.shape[0], 1), -np.inf, f32)
        for b in range(len(used)):
            m = int(used[b]) + (0 if bug == "unseen" else n)
            if m == 0:
                continue
            rows = [key_row(b, j) for j in range(m)]
            s = (q[cu_q[b]:cu_q[b + 1]] @ k[rows].T) * f32(scale)
            if manifest.get("causal"):  # the diagonal at the sequence's corner the alignment names
                nb = cu_q[b + 1] - cu_q[b]
                diag = np.arange(nb)[:, None] + (m - nb if manifest.get("align") == "bottom-right" else 0)
                s = np.where(np.arange(m)[None, :] <= diag, s, -np.inf).astype(f32)
            top = s.max(axis=1, keepdims=True)
            e = np.exp(s - top)
            total = e.sum(axis=1, keepdims=True)
            o[cu_q[b]:cu_q[b + 1]] = (e / total) @ v[rows]
            lse[cu_q[b]:cu_q[b + 1]] = top + np.log(total)
        for name, x in (("output", o), ("flash_output", o), ("flash_lse", lse)):
            if name in stages:
                np.savetxt(out / f"{name}_head_{h}.txt", x, fmt=fmt)
    return out
