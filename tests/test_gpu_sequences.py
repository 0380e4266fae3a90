"""Packed and paged cases on the GPU (gpu marker): the binary's CUDA backend and PyTorch's own paths
checked as other programs' output, and planted bugs named.

* Packed cases (causal bottom-right, a window, grouped K/V heads; sequences without queries or
  keys, padded key slots): `attnstep run --backend cuda` passes `check`; so do SDPA sequence by
  sequence (its math backend, and each fused backend that takes the case) and FlexAttention
  compiled, the whole packed batch under a document mask (create_block_mask of a mask_mod comparing
  the sequences of query and key). With the packing dropped (attention across the sequences) the
  check fails, named sequence_leak.
* Paged cases: SDPA and Flex on the gathered cache of a paged case written from the contract
  (tests/helpers/sequence_cases.py) give the outputs of the packed case of the same keys, which
  check passes. On paged cases of `generate --page-size` (and a decode step appending new keys,
  `--new-keys`, on the binary): the binary on CUDA passes, the writers
  pass on the paged case itself, and a page read from the wrong block fails, named
  paged_wrong_page.

    python3 -m pytest -q -m gpu -rs tests/test_gpu_sequences.py      (on the GPU machine)

What the writers run: verify/bench/sdpa_outputs.py, verify/bench/flex_outputs.py,
verify/bench/sequence_outputs.py. torch is imported only inside the tests; without a GPU
(conftest.py) or torch each test skips with the reason.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Sequence

import numpy as np
import pytest
from click.testing import CliRunner

from verify.bench.flex_outputs import FLEX, write_flex_case
from verify.bench.foreign_outputs import BackendUnavailable
from verify.bench.sdpa_outputs import write_sdpa_case
from verify.cli.group import cli
from verify.files.case import load_input_case
from verify.runs.runner import run_binary

from helpers.sequence_cases import (PAGED_WRONG_PAGE, SEQUENCE_LEAK, drop_packing, write_gathered, write_paged,
                                    wrong_page)

pytestmark = pytest.mark.gpu

D = 64  # a width every flash kernel, SDPA backend and Flex takes
# id -> `attnstep generate` options: irregular lengths, an empty sequence, a sequence whose keys are
# all padding, rows that see no key (bottom-right, n(b) > m(b)).
PACKED = {
    "causal-bottom-right": ("--heads", "4", "--seqlens", "37,0,130,9,64", "--seqlens-k", "50,7,130,3,200",
                            "--seqused-k", "50,7,100,0,177", "--causal", "bottom-right"),
    "window": ("--heads", "2", "--seqlens", "90,33,128", "--seqlens-k", "120,33,70", "--window", "24,8",
               "--align", "bottom-right"),
    "gqa-causal": ("--heads", "8", "--kv-heads", "2", "--random-seqlens", "6,150", "--causal", "bottom-right"),
}
SDPA_BACKENDS = ("math", "efficient", "flash", "cudnn")
FUSED = ("efficient", "flash", "cudnn")
FLASH_STAGES = ("flash_output", "flash_lse", "flash_dQ", "flash_dK", "flash_dV")
# The packed cases with a sequence whose rows see no key (bottom-right, n(b) > m(b), or no keys).
ROWS_WITHOUT_KEYS = ("causal-bottom-right", "window")
PRECISION = "bf16"
# Paged cases through the generator (docs/contract.md: decode-like, one query or a few per sequence).
PAGED = {
    "decode-gqa": ("--heads", "8", "--kv-heads", "2", "--seqlens", "1,1,4", "--seqlens-k", "100,2000,37",
                   "--page-size", "64", "--causal", "bottom-right"),
    "pages-of-16": ("--heads", "4", "--seqlens", "1,2,1,1", "--seqlens-k", "300,17,1,64", "--page-size", "16",
                    "--causal", "bottom-right"),
}
# A decode step that appends two new keys per sequence into the cache's pages before attention.
NEW_KEYS = {"new-keys": ("--heads", "4", "--kv-heads", "2", "--seqlens", "1,3,1", "--seqlens-k", "100,40,64",
                         "--page-size", "16", "--new-keys", "2", "--causal", "bottom-right")}


def _generate(folder: Path, options: Sequence[str], backward: bool = False) -> Path:
    args = ["generate", "--out", str(folder), "--d-k", str(D), "--d-v", str(D), "--format", "npy", "--dist",
            "normal", "--seed", "11", *options] + (["--backward"] if backward else [])
    r = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return folder


def _check(in_dir: Path, out_dir: Path, *extra: str) -> dict:
    """`attnstep check` of OUT (JSON report, with the exit code); another program's folder is
    checked at bf16 unless `extra` says otherwise."""
    report = out_dir.parent / f"{out_dir.name}.json"
    r = CliRunner().invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir), "--quiet", "--json",
                                 str(report), *extra], catch_exceptions=False)
    assert report.exists(), r.output
    return {**json.loads(report.read_text()), "exit_code": r.exit_code}


def _failures(report: dict) -> List[tuple]:
    return [(r["stage"], r["head"], r.get("sequence"), r["status"], r["message"][:200])
            for r in report["results"] if not r["passed"]]


def _named(report: dict, code: str) -> bool:
    """Whether the report names `code` anywhere (a diagnosis of a stage, or a run-level one)."""
    return f'"{code}"' in json.dumps(report)


def _write(program: str, in_dir: Path, out_dir: Path, precision: str = PRECISION, plant=None):
    """SDPA's `program` backend or Flex on CUDA; skips where a fused SDPA backend refuses the case
    (the math backend and Flex must run it)."""
    try:
        if program == FLEX:
            return write_flex_case(in_dir, out_dir, precision, plant=plant)
        return write_sdpa_case(in_dir, out_dir, program, precision, plant=plant)
    except BackendUnavailable as exc:
        if program in ("math", FLEX) and "has no FlexAttention" not in str(exc):
            raise
        pytest.skip(f"{program} does not run this case here: {exc}")


# ---- packed cases ----------------------------------------------------------------------------------

# Packed cases the CUDA backend computes in one launch at a half precision on Hopper (the flash
# forward's stages alone, keys in slots, no mask or the causal one within every sequence): long and
# one-token sequences, GQA, keys padded past seqused_k, sequences without queries or keys, a
# bottom-right mask where every sequence has as many keys as queries (padded slots, so the totals
# differ). --poison leaves NaN in any row the launch does not write.
ONE_LAUNCH = {
    "causal-d128-bf16": ("bf16", ("--heads", "4", "--kv-heads", "2", "--random-seqlens", "9,700", "--causal",
                                  "--d-k", "128", "--d-v", "128")),
    "no-mask-padded-fp16": ("fp16", ("--heads", "2", "--seqlens", "0,130,1,257,40", "--seqlens-k", "5,200,0,300,40",
                                     "--seqused-k", "5,150,0,300,31", "--no-causal")),
    "bottom-right-square-bf16": ("bf16", ("--heads", "3", "--seqlens", "64,1,200,129", "--causal", "bottom-right")),
    "bottom-right-padded-bf16": ("bf16", ("--heads", "2", "--seqlens", "64,0,150", "--seqlens-k", "80,5,160",
                                          "--seqused-k", "64,5,150", "--causal", "bottom-right")),
}


def _run_one_launch(binary, in_dir: Path, out_dir: Path, precision: str):
    res = run_binary(binary, in_dir, out_dir, backend="cuda", check=False,
                     extra=["--precision", precision, "--stages", "flash", "--poison"])
    if res.returncode == 2 and "half precision on this GPU" in res.stderr:
        pytest.skip(f"this GPU has no half-precision flash kernel: {res.stderr.strip()}")
    assert res.returncode == 0, res.stderr

@pytest.mark.parametrize("case", PACKED)
def test_the_cuda_backend_passes_a_packed_case(binary, tmp_path, case):
    in_dir = _generate(tmp_path / "in", PACKED[case], backward=True)
    res = run_binary(binary, in_dir, tmp_path / "out", backend="cuda", check=False, extra=["--poison"])
    assert res.returncode == 0, res.stderr
    report = _check(in_dir, tmp_path / "out")  # the run's precision and variant from its run.toml
    assert report["exit_code"] == 0 and report["passed"], _failures(report)


@pytest.mark.parametrize("case", ONE_LAUNCH)
def test_the_cuda_backend_passes_a_packed_case_in_one_launch(binary, tmp_path, case):
    precision, options = ONE_LAUNCH[case]
    in_dir = _generate(tmp_path / "in", options)
    _run_one_launch(binary, in_dir, tmp_path / "out", precision)
    report = _check(in_dir, tmp_path / "out")
    assert report["exit_code"] == 0 and report["passed"], _failures(report)


def test_values_past_fp16_in_padding_keys_do_not_reach_the_outputs(binary, tmp_path):
    """Padding keys no sequence reads hold 1e5, infinite in fp16: a launch over the whole batch
    reads them in a key tile with weight 0, and 0 * inf is NaN; the run must give every row the
    attention over its own keys all the same."""
    in_dir = _generate(tmp_path / "in", ONE_LAUNCH["no-mask-padded-fp16"][1])
    for v_file in sorted(in_dir.glob("V_head_*.npy")):
        v = np.load(v_file)
        v[5 + 150:5 + 200] = 1e5  # sequence 1's slot is rows 5..204, of which it reads 150
        np.save(v_file, v)
    _run_one_launch(binary, in_dir, tmp_path / "out", "fp16")
    report = _check(in_dir, tmp_path / "out")
    assert report["exit_code"] == 0 and report["passed"], _failures(report)


@pytest.mark.parametrize("program", SDPA_BACKENDS + (FLEX,))
@pytest.mark.parametrize("case", PACKED)
def test_pytorch_passes_a_packed_case(cuda_torch, tmp_path, case, program):
    in_dir = _generate(tmp_path / "in", PACKED[case], backward=True)
    results = _write(program, in_dir, tmp_path / "out")
    report = _check(in_dir, tmp_path / "out", "--precision", PRECISION)
    if report["exit_code"] and any(r["stage"] in ("flash_output", "flash_lse", "output") and not r["passed"]
                                   and "nan" in r["message"].lower() for r in report["results"]):
        pytest.xfail(f"{program} writes NaN in rows that see no key (the contract: output 0, lse -inf): "
                     f"{_failures(report)[:2]}")
    if (report["exit_code"] and program in FUSED and case in ROWS_WITHOUT_KEYS
            and {f[0] for f in _failures(report)} <= set(FLASH_STAGES)):
        # A fused backend's own choice for a sequence's rows that see no key (a finite lse there,
        # and gradients from it), as in the dense cross-checks of tests/test_gpu_cross_checks.py.
        pytest.xfail(f"SDPA {program} writes its own values in the rows that see no key (the contract: output 0, "
                     f"lse -inf): {_failures(report)[:2]}")
    assert report["exit_code"] == 0 and report["passed"], (results.notes, _failures(report))


@pytest.mark.parametrize("program", ("efficient", FLEX))
def test_attention_across_the_sequences_is_named_sequence_leak(cuda_torch, tmp_path, program):
    in_dir = _generate(tmp_path / "in", PACKED["causal-bottom-right"])
    _write(program, in_dir, tmp_path / "out", plant=drop_packing)
    report = _check(in_dir, tmp_path / "out", "--precision", PRECISION)
    assert report["exit_code"] == 1 and report["first_failing_stage"] == "flash_output", _failures(report)
    assert _named(report, SEQUENCE_LEAK), _failures(report)


# ---- paged cases -----------------------------------------------------------------------------------

SEQLENS_Q, USED_K = [1, 1, 4, 2], [100, 2000, 37, 0]


@pytest.mark.parametrize("program", ("math", "efficient", FLEX))
def test_pytorch_on_the_gathered_cache_of_a_hand_written_paged_case(cuda_torch, tmp_path, program):
    """The writers' output checked as the packed case of the gathered keys (no paging in the check)."""
    paged = write_paged(tmp_path / "paged", SEQLENS_Q, USED_K, heads=8, kv_heads=2, d=D)
    gathered = write_gathered(tmp_path / "gathered", paged, SEQLENS_Q)
    _write(program, tmp_path / "paged", tmp_path / "out")
    report = _check(gathered, tmp_path / "out", "--precision", PRECISION)
    assert report["exit_code"] == 0 and report["passed"], _failures(report)


@pytest.mark.parametrize("case", {**PAGED, **NEW_KEYS})
def test_the_cuda_backend_passes_a_paged_case(binary, tmp_path, case):
    in_dir = _generate(tmp_path / "in", {**PAGED, **NEW_KEYS}[case])
    res = run_binary(binary, in_dir, tmp_path / "out", backend="cuda", check=False, extra=["--poison"])
    assert res.returncode == 0, res.stderr
    report = _check(in_dir, tmp_path / "out")
    assert report["exit_code"] == 0 and report["passed"], _failures(report)


@pytest.mark.parametrize("program", ("math", "efficient", FLEX))
@pytest.mark.parametrize("case", PAGED)
def test_pytorch_passes_a_paged_case(cuda_torch, tmp_path, case, program):
    in_dir = _generate(tmp_path / "in", PAGED[case])
    _write(program, in_dir, tmp_path / "out")
    report = _check(in_dir, tmp_path / "out", "--precision", PRECISION)
    assert report["exit_code"] == 0 and report["passed"], _failures(report)


def _page_before_an_unread_one(in_dir: Path, b: int) -> int:
    """The last page of sequence b whose next page in the pool b does not read: the planted bug
    reads it from that next page, one of the wrong pages the diagnosis tries (the page after it in
    the pool)."""
    seqs = load_input_case(in_dir).sequences
    pages = [int(p) for p in seqs.block_table[b][:-(-seqs.m(b) // seqs.page_size)]]
    return max(j for j, p in enumerate(pages) if p + 1 < seqs.num_pages and p + 1 not in pages)


# Flex's run of the same wrong page fails too, but its bf16 values do not single out the reading:
# the planted bug is named through SDPA's.
@pytest.mark.parametrize("program", ("efficient",))
def test_a_page_read_from_the_wrong_block_is_named(cuda_torch, tmp_path, program):
    in_dir = _generate(tmp_path / "in", PAGED["decode-gqa"])
    page = _page_before_an_unread_one(in_dir, 1)  # sequence 1: 2000 keys, 32 pages
    _write(program, in_dir, tmp_path / "out", plant=wrong_page(1, page))
    report = _check(in_dir, tmp_path / "out", "--precision", PRECISION)
    assert report["exit_code"] == 1 and not report["passed"], _failures(report)
    assert {f[2] for f in _failures(report)} == {1}, _failures(report)
    assert _named(report, PAGED_WRONG_PAGE), _failures(report)
