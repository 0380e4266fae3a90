"""The binary's side of paged KV caches (docs/contract.md, "Paged KV caches"), run as a subprocess on
the CPU backend: a paged case (the manifest's page_size, block_table, cu_seqlens_q, seqused_k; K and V
a pool of pages) is computed as the packed case whose key slots hold each sequence's keys gathered
through its table, so every stage over the query tokens and every per-sequence score stage must
equal, bit for bit, the same binary's run of that gathered packed case; K, V and KT echo the pool.
Refusals are one `main: error:` line, exit 2, before the output folder is touched.

The cases are written here with NumPy directly (not through the generator).
"""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np
import pytest

from helpers.matrix_files import load

from verify.stages import STAGES

SCORE_STAGES = tuple(n for n, s in STAGES.items() if (s.rows, s.cols) == ("N", "M") and not (s.dropout or s.backward))
QUERY_STAGES = ("Q", "output", "flash_output", "flash_lse")
HEADS, KV_HEADS, D, P = 4, 2, 16, 8


def _write(folder: Path, manifest: dict, files: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "manifest.toml").write_text("".join(f"{k} = {str(v).lower() if isinstance(v, bool) else v}\n"
                                                  for k, v in manifest.items()))
    for name, arr in files.items():
        arr = np.asarray(arr)
        fmt = "%d" if arr.dtype.kind in "iu" else "%.9g"
        np.savetxt(folder / f"{name}.txt", arr.reshape(arr.shape[0], -1) if arr.ndim > 1 else arr[:, None], fmt=fmt)
    return folder


def paged_case(folder: Path, n: Sequence[int], m: Sequence[int], table: List[List[int]], num_pages: int,
               causal: bool = False, seed: int = 0, extra: Optional[dict] = None) -> dict:
    """A paged case in `folder`; returns its arrays (q per head, the pools per K/V head)."""
    rng = np.random.default_rng(seed)
    N, M = sum(n), num_pages * P
    q = rng.standard_normal((HEADS, N, D)).astype(np.float32)
    k = rng.standard_normal((KV_HEADS, M, D)).astype(np.float32)
    v = rng.standard_normal((KV_HEADS, M, D)).astype(np.float32)
    files = {f"Q_head_{h}": q[h] for h in range(HEADS)}
    files.update({f"K_head_{j}": k[j] for j in range(KV_HEADS)})
    files.update({f"V_head_{j}": v[j] for j in range(KV_HEADS)})
    files.update(cu_seqlens_q=np.concatenate(([0], np.cumsum(n))).astype(np.int64), seqused_k=np.asarray(m, np.int64),
                 block_table=np.asarray(table, np.int64))
    manifest = dict(batch=1, heads=HEADS, seq_q=N, seq_k=M, d_k=D, d_v=D, kv_heads=KV_HEADS, causal=causal,
                    sequences=len(n), page_size=P, **(extra or {}))
    _write(folder, manifest, files)
    return {"q": q, "k": k, "v": v, "n": list(n), "m": list(m), "table": table, "causal": causal}


def gathered_case(folder: Path, case: dict) -> Path:
    """The packed case of the same sequences, each key slot its keys gathered through the table."""
    rows = [np.asarray([case["table"][b][j // P] * P + j % P for j in range(mb)], np.int64)
            for b, mb in enumerate(case["m"])]
    idx = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    k, v = case["k"][:, idx], case["v"][:, idx]
    files = {f"Q_head_{h}": case["q"][h] for h in range(HEADS)}
    files.update({f"K_head_{j}": k[j] for j in range(KV_HEADS)})
    files.update({f"V_head_{j}": v[j] for j in range(KV_HEADS)})
    files.update(cu_seqlens_q=np.concatenate(([0], np.cumsum(case["n"]))).astype(np.int64),
                 cu_seqlens_k=np.concatenate(([0], np.cumsum(case["m"]))).astype(np.int64))
    manifest = dict(batch=1, heads=HEADS, seq_q=sum(case["n"]), seq_k=len(idx), d_k=D, d_v=D, kv_heads=KV_HEADS,
                    causal=case["causal"], sequences=len(case["n"]))
    return _write(folder, manifest, files)


def run(binary: Path, case: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(binary), "--in", str(case), "--out", str(out), "--backend", "cpu", *extra],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("causal", [False, True])
def test_a_paged_run_equals_the_run_of_its_gathered_packed_case(binary, tmp_path, causal):
    # sequence 0 shares its first page with sequence 2 (prefix caching); sequence 1 reads no key;
    # sequence 3 has no query; the pool's pages 5 and 7 are read by no sequence.
    n, m = [3, 2, 4, 0], [19, 0, 9, 5]
    table = [[4, 0, 6, -1], [-1, -1, -1, -1], [4, 3, -7, 99], [1, -1, -1, -1]]
    case = paged_case(tmp_path / "paged", n, m, table, num_pages=8, causal=causal)
    gathered = gathered_case(tmp_path / "gathered", case)
    for folder, out in ((tmp_path / "paged", tmp_path / "out_paged"), (gathered, tmp_path / "out_gathered")):
        ran = run(binary, folder, out, "--stages", "all")
        assert ran.returncode == 0, ran.stderr
    a, b = tmp_path / "out_paged", tmp_path / "out_gathered"
    for h in range(HEADS):
        for stage in QUERY_STAGES:
            np.testing.assert_array_equal(load(a / f"{stage}_head_{h}.txt"), load(b / f"{stage}_head_{h}.txt"),
                                          err_msg=f"{stage} head {h}")
        for seq in range(len(n)):
            for stage in SCORE_STAGES:
                name = f"{stage}_head_{h}_seq_{seq}.txt"
                assert (a / name).exists() == (n[seq] > 0 and m[seq] > 0), name
                if (a / name).exists():
                    np.testing.assert_array_equal(load(a / name), load(b / name), err_msg=name)
    for j in range(KV_HEADS):  # K, V, KT over the pool, as read
        for stage, want in (("K", case["k"][j]), ("V", case["v"][j]), ("KT", case["k"][j].T)):
            np.testing.assert_array_equal(load(a / f"{stage}_head_{j}.txt").astype(np.float32), want, err_msg=stage)


def test_the_page_order_matters(binary, tmp_path):
    """The same pool read through a table in another order gives other outputs (the table is read)."""
    n, m = [2], [24]
    outs = []
    for name, table in (("a", [[2, 0, 1]]), ("b", [[0, 1, 2]])):
        paged_case(tmp_path / name, n, m, table, num_pages=3)
        assert run(binary, tmp_path / name, tmp_path / f"out_{name}").returncode == 0
        outs.append(load(tmp_path / f"out_{name}" / "flash_output_head_0.txt"))
    assert not np.array_equal(*outs)


def _refused(binary, tmp_path, case: Path, words: str) -> None:
    out = tmp_path / "out"
    ran = run(binary, case, out)
    assert ran.returncode == 2 and "Traceback" not in ran.stderr, ran.stderr
    assert not out.exists(), "a refused run wrote its output folder"
    errors = [ln for ln in ran.stderr.splitlines() if ln.startswith("main: error: ")]
    assert len(errors) == 1 and words in errors[0], ran.stderr


@pytest.mark.parametrize("edit, words", [
    ("dO", "dO_head_0.txt: the backward pass is not supported with paged KV caches"),
    ("cu_seqlens_k", "cu_seqlens_k.txt: a paged case (block_table.txt) reads its keys through block_table, not "
                     "cu_seqlens_k"),
    ("no-manifest", "block_table.txt: a paged case needs its page size"),
    ("outside", "block_table.txt: block_table[1, 0] = 3 is outside 0..2 (the pool holds 3 pages of 8 keys); "
                "sequence 1 reads it"),
    ("seq_k", "seq_k = 20, not a multiple of page_size = 8 (K and V hold the pool of pages)"),
    ("no-seqused", "seqused_k.txt: missing file (a paged case has seqused_k: the keys each sequence reads)"),
])
def test_the_binary_refuses_a_bad_paged_case(binary, tmp_path, edit, words):
    case = tmp_path / "case"
    paged_case(case, [2, 1], [10, 5], [[0, 1], [3 if edit == "outside" else 2, -1]], num_pages=3)
    if edit == "dO":
        for h in range(HEADS):
            np.savetxt(case / f"dO_head_{h}.txt", np.ones((3, D)))
    elif edit == "cu_seqlens_k":
        (case / "cu_seqlens_k.txt").write_text("0\n10\n15\n")
    elif edit == "no-manifest":
        (case / "manifest.toml").unlink()
    elif edit == "seq_k":
        for name in ("K", "V"):
            for j in range(KV_HEADS):
                np.savetxt(case / f"{name}_head_{j}.txt", np.ones((20, D)))
        text = (case / "manifest.toml").read_text().replace("seq_k = 24", "seq_k = 20")
        (case / "manifest.toml").write_text(text)
    elif edit == "no-seqused":
        (case / "seqused_k.txt").unlink()
    _refused(binary, tmp_path, case, words)
