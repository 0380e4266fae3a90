"""`attnstep generate --page-size P` writes a paged case (docs/contract.md, "Paged KV caches"): the
manifest's sequences and page_size, cu_seqlens_q, seqused_k the key lengths, block_table (a row per
sequence, -1 past the pages it reads), K and V a pool of ceil(m/P) pages per sequence plus a few
spare pages dealt in an order shuffled from the seed; what does not make a paged case is refused in
one line. The case reads back as the same paging.
"""
from __future__ import annotations

import tomllib

import numpy as np
import pytest

from helpers.cli import invoke
from verify.files.case import load_input_case
from verify.files.generate import SPARE_PAGES


def _generate(folder, *args):
    r = invoke("generate", "--out", folder, "--heads", 2, "--d-k", 8, "--d-v", 8, *args)
    assert r.exit_code == 0, r.output
    return folder


def test_generate_writes_a_paged_case(tmp_path):
    case = _generate(tmp_path / "case", "--seqlens", "1,1,4", "--seqlens-k", "100,200,37", "--page-size", 64)
    manifest = tomllib.loads((case / "manifest.toml").read_text())
    pages = [2, 4, 1]
    num_pages = sum(pages) + SPARE_PAGES
    assert manifest["sequences"] == 3 and manifest["page_size"] == 64
    assert manifest["seq_q"] == 6 and manifest["seq_k"] == num_pages * 64
    assert not (case / "cu_seqlens_k.txt").exists()
    assert np.loadtxt(case / "seqused_k.txt").tolist() == [100, 200, 37]
    assert np.loadtxt(case / "cu_seqlens_q.txt").tolist() == [0, 1, 2, 6]
    table = np.loadtxt(case / "block_table.txt", dtype=int, ndmin=2)
    assert table.shape == (3, 4)
    read = [table[b, :n] for b, n in enumerate(pages)]
    for b, n in enumerate(pages):
        assert (table[b, n:] == -1).all()
    used = np.concatenate(read)
    assert len(set(used.tolist())) == len(used) and ((used >= 0) & (used < num_pages)).all()
    assert used.tolist() != sorted(used.tolist()), "pages dealt in pool order"
    assert np.loadtxt(case / "K_head_0.txt").shape == (num_pages * 64, 8)
    seqs = load_input_case(case).sequences
    assert seqs.paged and seqs.page_size == 64 and seqs.num_pages == num_pages
    assert seqs.key_rows(0).tolist() == [table[0, j // 64] * 64 + j % 64 for j in range(100)]


def test_the_pages_follow_the_seed(tmp_path):
    tables = []
    for seed in (0, 0, 1):
        case = _generate(tmp_path / f"case{len(tables)}", "--seqlens", "2,2", "--seqlens-k", "40,40", "--page-size",
                         4, "--seed", seed)
        tables.append(np.loadtxt(case / "block_table.txt", dtype=int).tolist())
    assert tables[0] == tables[1] and tables[0] != tables[2]


def test_random_seqlens_and_npy(tmp_path):
    case = _generate(tmp_path / "case", "--random-seqlens", "5,30", "--page-size", 16, "--format", "npy")
    table = np.load(case / "block_table.npy")
    assert table.dtype == np.int32 and table.shape[0] == 5
    seqs = load_input_case(case).sequences
    assert seqs.paged and [seqs.m(b) for b in range(5)] == [seqs.n(b) for b in range(5)]


@pytest.mark.parametrize("args, words", [
    (["--page-size", 16], "--page-size 16 needs --seqlens or --random-seqlens (a paged case is packed)"),
    (["--seqlens", "2,2", "--page-size", 16, "--backward"],
     "--page-size with --backward: the backward pass is not supported with paged KV caches"),
    (["--seqlens", "2,2", "--seqlens-k", "4,4", "--seqused-k", "2,2", "--page-size", 16],
     "--page-size with --seqused-k: a paged case's sequences read all their keys"),
    (["--seqlens", "2,2", "--page-size", 16, "--mask", "random"], "mask files are not supported with packed sequences"),
    (["--seqlens", "2,2", "--page-size", 0], "Invalid value for '--page-size'"),
])
def test_generate_refuses_what_makes_no_paged_case(tmp_path, args, words):
    r = invoke("generate", "--out", tmp_path / "case", "--heads", 2, "--d-k", 8, "--d-v", 8, *args)
    assert r.exit_code == 2 and words in r.output, r.output
    assert not (tmp_path / "case" / "manifest.toml").exists()
