"""Packed and paged cases for the cross-check writers' tests (tests/test_cross_writers_packed.py on the
CPU, tests/test_gpu_sequences.py on the GPU): a paged case written by hand from docs/contract.md (a
pool of pages given out in shuffled order, a block table padded with -1, seqused_k), the packed case
of its gathered keys (the same attention, checked without the paging), and the planted bugs as changes to the writers' tensors (verify/bench/foreign_outputs.py
CaseTensors): the packing dropped (attention across the sequences) and a page read from the wrong
block."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional, Sequence

import numpy as np

from verify.files.manifests import write_toml
from verify.sequences import BLOCK_TABLE, CU_SEQLENS_K, CU_SEQLENS_Q, PAGE_SIZE_KEY, SEQUENCES_KEY, SEQUSED_K

SEQUENCE_LEAK, PAGED_WRONG_PAGE = "sequence_leak", "paged_wrong_page"


def drop_packing(t):
    """The planted bug: the packing ignored, the whole packed stream one problem (attention
    crosses every boundary: no document mask)."""
    return t.with_(sequences=None)


def wrong_page(b: int, page: Optional[int] = None):
    """The planted bug: sequence b's page `page` (default its last) read from another block of the
    pool (the next one, cyclically), written as K and V of that page's rows replaced by the other
    block's, so that any reader of the table sees it."""
    def plant(t):
        seqs = t.sequences
        size, rows = seqs.page_size, seqs.key_rows(b)
        pages = rows[::size] // size
        own = int(pages[-1 if page is None else page])
        pool = t.inputs["K"].shape[2] // size
        other = next(p for p in ((own + k) % pool for k in range(1, pool)) if p not in pages)
        inputs = dict(t.inputs)
        for name in ("K", "V"):
            x = inputs[name].copy()
            x[:, :, own * size:(own + 1) * size] = x[:, :, other * size:(other + 1) * size]
            inputs[name] = x
        return t.with_(inputs=inputs)
    return plant


PAGE = 4


def write_paged(folder: Path, seqlens_q: Sequence[int], used_k: Sequence[int], heads: int = 4, kv_heads: int = 2,
                 d: int = 16, spare: int = 3, seed: int = 0) -> Dict[str, np.ndarray]:
    """A paged case (manifest with page_size and sequences, Q, the pool's K and V, cu_seqlens_q,
    seqused_k and a block table padded with -1), its pages given out in shuffled order with spare
    pages in the pool; returns the keys each sequence reads, gathered (K_b, V_b per K/V head)."""
    rng = np.random.default_rng(seed)
    pages_of = [-(-m // PAGE) for m in used_k]
    total_pages = sum(pages_of) + spare
    order = rng.permutation(total_pages)
    width = max(max(pages_of), 1) + 1
    table = np.full((len(used_k), width), -1, np.int32)
    at = 0
    for b, count in enumerate(pages_of):
        table[b, :count] = order[at:at + count]
        at += count
    n = sum(seqlens_q)
    folder.mkdir(parents=True)
    q = rng.standard_normal((heads, n, d)).astype(np.float32)
    k, v = (rng.standard_normal((kv_heads, total_pages * PAGE, d)).astype(np.float32) for _ in range(2))
    for i in range(heads):
        np.save(folder / f"Q_head_{i}.npy", q[i])
    for j in range(kv_heads):
        np.save(folder / f"K_head_{j}.npy", k[j])
        np.save(folder / f"V_head_{j}.npy", v[j])
    np.save(folder / f"{CU_SEQLENS_Q}.npy", np.concatenate(([0], np.cumsum(seqlens_q))).astype(np.int32)[:, None])
    np.save(folder / f"{SEQUSED_K}.npy", np.asarray(used_k, np.int32)[:, None])
    np.save(folder / f"{BLOCK_TABLE}.npy", table)
    write_toml(folder / "manifest.toml", {"batch": 1, "heads": heads, "seq_q": n, "seq_k": total_pages * PAGE,
                                          "d_k": d, "d_v": d, "kv_heads": kv_heads, SEQUENCES_KEY: len(used_k),
                                          PAGE_SIZE_KEY: PAGE, "causal": True, "align": "bottom-right",
                                          "format": "npy"}, "a paged case, written by hand")
    rows = [np.concatenate([np.arange(p * PAGE, p * PAGE + PAGE) for p in table[b, :pages_of[b]]])[:m]
            if m else np.zeros(0, int) for b, m in enumerate(used_k)]
    return {"q": q, "k": k, "v": v, "rows": rows, "table": table}


def write_gathered(folder: Path, paged: Dict[str, np.ndarray], seqlens_q: Sequence[int]) -> Path:
    """The packed case of the same attention: each sequence's keys gathered into a slot of its own."""
    folder.mkdir(parents=True)
    rows, q = paged["rows"], paged["q"]
    order = np.concatenate(rows)
    for i in range(q.shape[0]):
        np.save(folder / f"Q_head_{i}.npy", q[i])
    for j in range(paged["k"].shape[0]):
        np.save(folder / f"K_head_{j}.npy", paged["k"][j][order])
        np.save(folder / f"V_head_{j}.npy", paged["v"][j][order])
    np.save(folder / f"{CU_SEQLENS_Q}.npy", np.concatenate(([0], np.cumsum(seqlens_q))).astype(np.int32)[:, None])
    np.save(folder / f"{CU_SEQLENS_K}.npy", np.concatenate(([0], np.cumsum([len(r) for r in rows]))).astype(
        np.int32)[:, None])
    write_toml(folder / "manifest.toml", {"batch": 1, "heads": q.shape[0], "seq_q": q.shape[1], "seq_k": len(order),
                                          "d_k": q.shape[2], "d_v": q.shape[2], "kv_heads": paged["k"].shape[0],
                                          SEQUENCES_KEY: len(rows), "causal": True, "align": "bottom-right",
                                          "format": "npy"}, "the gathered keys of a paged case")
    return folder
