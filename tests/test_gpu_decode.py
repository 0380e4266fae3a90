"""The split-KV decode kernel on the GPU (gpu marker): the same bits whichever way its keys arrive.

A paged case's split run on the CUDA backend is one launch of the decode kernel over every
sequence, reading the keys through the block table. At bf16 and fp16 it computes on tensor cores,
each warp taking chunks of 16 keys (d 128) or 32 (d 64). On Hopper a chunk that lies in one page is
copied by tensor memory access; a chunk that spans pages (a page size that is not a multiple of the
chunk) is copied key by key with cp.async, as on every other GPU. Both do the same arithmetic, so
one cache laid out in pages of 16, 24, 64 and 256 keys must give identical outputs and split
stages, and each must pass `check`. The case has partial chunks at both ends (a sliding window that
starts mid-chunk, a sequence of 37 keys), where keys outside the rows' range share a chunk with
keys inside.

    python3 -m pytest -q -m gpu -rs tests/test_gpu_decode.py      (on the GPU machine)
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Dict, Sequence

import numpy as np
import pytest
from click.testing import CliRunner

from verify.cli.group import cli
from verify.files.manifests import read_toml, write_toml
from verify.runs.runner import run_binary
from verify.sequences import BLOCK_TABLE, CU_SEQLENS_Q, PAGE_SIZE_KEY, SEQUSED_K

pytestmark = pytest.mark.gpu

KV_HEADS = 2
# Partial chunks at both ends of a row's keys: a window that starts mid-chunk, sequences of 37 and 2
# keys, splits of 40 keys (a chunk straddles each split's first key); a sequence without queries;
# one with more queries than keys (bottom-right: its first row sees no key).
CASE = ("--heads", "8", "--kv-heads", str(KV_HEADS), "--seqlens", "1,2,4,0,3", "--seqlens-k", "100,37,300,5,2",
        "--causal", "bottom-right", "--window", "50,0", "--format", "npy", "--dist", "normal", "--seed", "5")
SPLIT = 40
# A warp's chunk is 16 keys at d 128, 32 at d 32 and d 64: pages of 16 hold a chunk only at d 128,
# pages of 24 never, 64 and 256 always. On Hopper the bf16/fp16 kernel copies a chunk in one page by
# tensor memory access at d 64 and d 128, by cp.async otherwise.
PAGE_SIZES = (16, 24, 64, 256)
OUTPUTS = ("flash_output", "flash_lse", "split_output", "split_lse")
BACKEND = "cuda"


def _generate(folder: Path, d: int, page_size: int) -> Path:
    args = ["generate", "--out", str(folder), "--d-k", str(d), "--d-v", str(d), "--page-size", str(page_size), *CASE]
    r = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return folder


def _repage(src: Path, dst: Path, page_size: int, seed: int) -> Path:
    """src's paged cache laid out again in pages of page_size keys, dealt in a shuffled order: the
    same keys for every sequence, another pool and block table."""
    manifest = read_toml(src / "manifest.toml")
    old = int(manifest[PAGE_SIZE_KEY])
    table = np.load(src / f"{BLOCK_TABLE}.npy")
    used = [int(m) for m in np.load(src / f"{SEQUSED_K}.npy").ravel()]
    pages_of = [-(-m // page_size) for m in used]
    order = np.random.default_rng(seed).permutation(sum(pages_of))
    new_table = np.full((len(used), max(pages_of)), -1, np.int32)
    dst.mkdir(parents=True)
    for j in range(KV_HEADS):
        for name in ("K", "V"):
            pool = np.load(src / f"{name}_head_{j}.npy")
            out = np.zeros((len(order) * page_size, pool.shape[1]), pool.dtype)
            at = 0
            for b, m in enumerate(used):
                rows = [int(table[b, k // old]) * old + k % old for k in range(m)]
                for p in range(pages_of[b]):
                    new_table[b, p] = order[at + p]
                    keys = rows[p * page_size:(p + 1) * page_size]
                    out[order[at + p] * page_size:order[at + p] * page_size + len(keys)] = pool[keys]
                at += pages_of[b]
            np.save(dst / f"{name}_head_{j}.npy", out)
    for f in src.iterdir():
        if f.name.startswith("Q_head_") or f.name in (f"{CU_SEQLENS_Q}.npy", f"{SEQUSED_K}.npy"):
            (dst / f.name).write_bytes(f.read_bytes())
    np.save(dst / f"{BLOCK_TABLE}.npy", new_table)
    write_toml(dst / "manifest.toml", {**manifest, PAGE_SIZE_KEY: page_size, "seq_k": len(order) * page_size},
               "the same case in pages of another size")
    return dst


def _run(binary, in_dir: Path, out_dir: Path, precision: str, split: int, stages: Sequence[str] = OUTPUTS
         ) -> Dict[str, np.ndarray]:
    """The binary's split run at `precision`: its npy outputs of OUTPUTS by file name."""
    res = run_binary(binary, in_dir, out_dir, backend=BACKEND, check=False,
                     extra=["--precision", precision, "--split-size", str(split), "--stages", ",".join(stages),
                            "--format", "npy", "--poison"])
    assert res.returncode == 0, res.stderr
    return {f.stem: np.load(f) for f in sorted(out_dir.glob("*.npy")) if f.stem.startswith(OUTPUTS)}


def _passes(in_dir: Path, out_dir: Path) -> None:
    report = out_dir.parent / f"{out_dir.name}.json"
    r = CliRunner().invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir), "--quiet", "--json",
                                 str(report)], catch_exceptions=False)
    results = json.loads(report.read_text())["results"]
    assert r.exit_code == 0, [(x["stage"], x["head"], x["message"][:200]) for x in results if not x["passed"]]


def _same(a: Dict[str, np.ndarray], b: Dict[str, np.ndarray], what: Sequence[str]) -> None:
    assert sorted(a) == sorted(b) and a, (sorted(a), sorted(b))
    for name in a:
        assert np.array_equal(a[name], b[name], equal_nan=True), f"{name} differs: {what}"


@pytest.mark.parametrize("precision", ("fp32", "bf16", "fp16"))
@pytest.mark.parametrize("d", (32, 64, 128))
def test_every_page_size_gives_the_same_bits(binary, tmp_path, d, precision):
    base = _generate(tmp_path / "case", d, PAGE_SIZES[0])
    first = None
    for p in PAGE_SIZES:
        in_dir = base if p == PAGE_SIZES[0] else _repage(base, tmp_path / f"case{p}", p, seed=p)
        outs = _run(binary, in_dir, tmp_path / f"out{p}", precision, split=SPLIT)
        _passes(in_dir, tmp_path / f"out{p}")
        if first is None:
            first = outs
        else:
            _same(first, outs, (f"pages of {PAGE_SIZES[0]}", f"pages of {p}"))


# The decode bench's step: one split (the default for 200 keys here), whose blocks store the output
# and lse themselves without the combine, and splits of 64 keys with the combine; every sequence's
# outputs checked against float64 by the bench itself (exit 1 past the format's tolerance).
@pytest.mark.parametrize("precision", ("fp32", "bf16", "fp16"))
@pytest.mark.parametrize("page_size", (16, 24))
@pytest.mark.parametrize("split", (None, 64), ids=("one split", "splits of 64"))
def test_the_decode_step_passes_its_float64_check(binary, precision, page_size, split):
    args = [str(binary), "--bench-decode", "--batch", "3", "--heads", "8", "--kv-heads", "2", "--cache-len", "200",
            "--page-size", str(page_size), "--d", "128", "--precision", precision, "--queries", "2",
            "--warmup", "1", "--reps", "2", "--check-sequences", "3", *(["--split-size", str(split)] if split else [])]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"splits {1 if split is None else 4} " in proc.stdout and ": passed" in proc.stdout, proc.stdout
