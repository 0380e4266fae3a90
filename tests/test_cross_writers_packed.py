"""The cross-check writers on packed and paged cases, run on torch's CPU kernels and checked as
another program's output (`attnstep check`): PyTorch's SDPA sequence by sequence (its math backend,
and its flash backend with the lse) and FlexAttention uncompiled, the whole packed batch under a
document mask, pass on packed cases with the variants packing takes (both causal alignments,
windows, grouped K/V heads, sequences without queries or keys, padded key slots); with the packing
dropped (attention across the sequences) they fail, named sequence_leak. A paged case written here
by hand from the contract (a pool of pages in shuffled order, a block table padded with -1,
seqused_k) gives the same outputs as the packed case of its gathered keys, which check passes; a
page read from the wrong block fails it.

What runs and why: verify/bench/sdpa_outputs.py, verify/bench/flex_outputs.py,
verify/bench/sequence_outputs.py. Skipped with the reason where torch is not installed (the GPU
runs: tests/test_gpu_sequences.py). torch's CPU flash kernel's lse at bf16 is outside float32's
bounds (its scores are not float32 sums), so its runs here are at fp32.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Sequence

import numpy as np
import pytest
from click.testing import CliRunner

from verify.bench.flex_outputs import write_flex_case
from verify.bench.foreign_outputs import BackendUnavailable, Results, load_case_tensors
from verify.bench.sdpa_outputs import write_sdpa_case
from verify.bench.sequence_outputs import packed_results
from verify.cli.group import cli
from verify.files.kinds import CaseError
from verify.sequences import BLOCK_TABLE, CU_SEQLENS_K, PAGE_SIZE_KEY

from helpers.sequence_cases import PAGE, SEQUENCE_LEAK, drop_packing, write_gathered, write_paged, wrong_page

# The packed cases: id -> `attnstep generate` options (irregular lengths; an empty sequence, a
# sequence whose keys are all padding, slots longer than the keys used).
PACKED = {
    "causal-bottom-right-gqa": ("--heads", "4", "--kv-heads", "2", "--seqlens", "5,0,17,9", "--seqlens-k",
                                "12,3,17,20", "--seqused-k", "7,3,0,20", "--causal", "bottom-right"),
    "causal-top-left": ("--heads", "2", "--seqlens", "9,14,3", "--seqlens-k", "9,20,6", "--causal", "top-left"),
    "window-mqa": ("--heads", "3", "--kv-heads", "1", "--seqlens", "11,6,13", "--seqlens-k", "15,6,21",
                   "--window", "4,2", "--align", "bottom-right"),
}
SDPA_RUNS = [("math", "bf16"), ("math", "fp32"), ("flash", "fp32")]


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch runs these on the CPU)")


def _generate(folder: Path, options: Sequence[str], backward: bool) -> Path:
    args = ["generate", "--out", str(folder), "--d-k", "16", "--d-v", "16", "--format", "npy", "--dist", "normal",
            "--seed", "5", *options] + (["--backward"] if backward else [])
    r = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return folder


def _check(in_dir: Path, out_dir: Path, precision: str, *extra: str) -> dict:
    """`attnstep check` of OUT as another program's output: the JSON report, with its exit code."""
    report = out_dir.parent / f"{out_dir.name}.json"
    r = CliRunner().invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir), "--precision", precision,
                                 "--quiet", "--json", str(report), *extra], catch_exceptions=False)
    assert report.exists(), r.output
    return {**json.loads(report.read_text()), "exit_code": r.exit_code}


def _failures(report: dict) -> List[tuple]:
    return [(r["stage"], r["head"], r.get("sequence"), r["status"], r["message"][:200])
            for r in report["results"] if not r["passed"]]


def _codes(report: dict) -> set:
    return {d.get("code") for r in report["results"] for d in r.get("diagnosis") or []}


@pytest.mark.parametrize("backend,precision", SDPA_RUNS, ids=[f"{b}-{p}" for b, p in SDPA_RUNS])
@pytest.mark.parametrize("case", PACKED)
def test_sdpa_sequence_by_sequence_passes_a_packed_case(torch, tmp_path, case, backend, precision):
    in_dir = _generate(tmp_path / "in", PACKED[case], backward=True)
    results = write_sdpa_case(in_dir, tmp_path / "out", backend, precision, device="cpu")
    report = _check(in_dir, tmp_path / "out", precision)
    assert report["exit_code"] == 0 and report["passed"], (results.notes, _failures(report))
    stages = {r["stage"] for r in report["results"]}
    assert stages == ({"flash_output", "flash_lse", "flash_dQ", "flash_dK", "flash_dV"} if backend == "flash"
                      else {"output", "dQ", "dK", "dV"})


@pytest.mark.parametrize("precision", ("fp32", "bf16"))
@pytest.mark.parametrize("case", PACKED)
def test_flex_with_a_document_mask_passes_a_packed_case(torch, tmp_path, case, precision):
    in_dir = _generate(tmp_path / "in", PACKED[case], backward=False)  # Flex has no backward on the CPU
    try:
        write_flex_case(in_dir, tmp_path / "out", precision, device="cpu")
    except BackendUnavailable as exc:
        pytest.skip(f"this torch runs no FlexAttention on the CPU: {exc}")
    report = _check(in_dir, tmp_path / "out", precision)
    assert report["exit_code"] == 0 and report["passed"], _failures(report)


@pytest.mark.parametrize("program", ("math", "flash", "flex"))
def test_attention_across_the_sequences_fails_named_sequence_leak(torch, tmp_path, program):
    in_dir = _generate(tmp_path / "in", PACKED["causal-bottom-right-gqa"], backward=False)
    precision = "bf16" if program == "flex" else "fp32"
    try:
        if program == "flex":
            write_flex_case(in_dir, tmp_path / "out", precision, device="cpu", plant=drop_packing)
        else:
            write_sdpa_case(in_dir, tmp_path / "out", program, precision, device="cpu", plant=drop_packing)
    except BackendUnavailable as exc:
        pytest.skip(f"this torch runs no {program} on the CPU: {exc}")
    report = _check(in_dir, tmp_path / "out", precision)
    assert report["exit_code"] == 1 and not report["passed"]
    assert report["first_failing_stage"] == ("output" if program == "math" else "flash_output")
    assert SEQUENCE_LEAK in _codes(report), _failures(report)


def test_a_sequence_without_keys_is_not_run_and_writes_zero_and_minus_infinity():
    """No torch: the packed assembly around a stand-in dense run. Rows of a sequence without keys
    (and of one without queries: none) are output 0 and lse -inf; the key rows no query reads
    (padding past seqused_k) keep dK and dV 0; each run sees its own rows only."""
    from verify.bench.foreign_outputs import CaseTensors
    from verify.sequences import sequences_from_lengths
    from verify.stages import Dims

    seqs = sequences_from_lengths([2, 3, 0, 1], [4, 2, 3, 5], [4, 0, 3, 2])
    dims = Dims(1, 2, seqs.total_q, seqs.total_k, 3, 3)
    rng = np.random.default_rng(0)
    inputs = {name: rng.standard_normal((1, 2, rows, 3)).astype(np.float32)
              for name, rows in (("Q", seqs.total_q), ("K", seqs.total_k), ("V", seqs.total_k), ("dO", seqs.total_q))}
    t = CaseTensors(dims, inputs, 0.5, sequences=seqs)
    seen = []

    def dense(one):
        _, _, n, m = one.shape
        seen.append((n, m))
        grads = {"dq": np.full_like(one.inputs["Q"], 2), "dk": np.full_like(one.inputs["K"], 3),
                 "dv": np.full_like(one.inputs["V"], 4)}
        return Results(np.ones((1, 2, n, 3), np.float32), np.full((1, 2, n), 7, np.float32), grads, [f"note {m}"])

    got = packed_results(t, dense)
    assert seen == [(2, 4), (1, 2)]  # sequence 1 has no keys, sequence 2 no queries
    np.testing.assert_array_equal(got.out[0, :, :, 0], [[1, 1, 0, 0, 0, 1]] * 2)
    np.testing.assert_array_equal(got.lse[0], [[7, 7, -np.inf, -np.inf, -np.inf, 7]] * 2)
    keys_read = np.zeros(seqs.total_k, bool)
    keys_read[list(range(0, 4)) + list(range(9, 11))] = True
    assert np.all(got.grads["dk"][0, :, keys_read] == 3) and np.all(got.grads["dk"][0, :, ~keys_read] == 0)
    assert np.all(got.grads["dq"][0, :, 2:5] == 0)
    assert got.notes == ["note 4", "note 2"]


# Decode-like: one query (or a few: speculative decoding) per sequence, keys filling part of the last
# page, a sequence without keys.
SEQLENS_Q, USED_K = [1, 3, 1, 2, 1], [13, 8, 0, 21, 1]


def test_the_paged_case_reads_its_keys_through_the_table(tmp_path):
    paged = write_paged(tmp_path / "paged", SEQLENS_Q, USED_K)
    t = load_case_tensors(tmp_path / "paged", "fp32")
    assert t.shape == (1, 4, sum(SEQLENS_Q), paged["k"].shape[1])
    for b, rows in enumerate(paged["rows"]):
        np.testing.assert_array_equal(t.sequences.key_rows(b), rows)


@pytest.mark.parametrize("backend,precision", SDPA_RUNS, ids=[f"{b}-{p}" for b, p in SDPA_RUNS])
def test_sdpa_on_the_gathered_cache_passes_and_a_wrong_page_fails(torch, tmp_path, backend, precision):
    paged = write_paged(tmp_path / "paged", SEQLENS_Q, USED_K)
    gathered = write_gathered(tmp_path / "gathered", paged, SEQLENS_Q)
    write_sdpa_case(tmp_path / "paged", tmp_path / "out", backend, precision, device="cpu")
    report = _check(gathered, tmp_path / "out", precision)
    assert report["exit_code"] == 0 and report["passed"], _failures(report)

    write_sdpa_case(tmp_path / "paged", tmp_path / "wrong", backend, precision, device="cpu", plant=wrong_page(3))
    report = _check(gathered, tmp_path / "wrong", precision)
    assert report["exit_code"] == 1
    assert {f[2] for f in _failures(report)} == {3}, _failures(report)  # sequence 3 alone


def test_flex_on_the_gathered_cache_passes(torch, tmp_path):
    paged = write_paged(tmp_path / "paged", SEQLENS_Q, USED_K)
    gathered = write_gathered(tmp_path / "gathered", paged, SEQLENS_Q)
    try:
        write_flex_case(tmp_path / "paged", tmp_path / "out", "bf16", device="cpu")
    except BackendUnavailable as exc:
        pytest.skip(f"this torch runs no FlexAttention on the CPU: {exc}")
    report = _check(gathered, tmp_path / "out", "bf16")
    assert report["exit_code"] == 0 and report["passed"], _failures(report)


@pytest.mark.parametrize("change,words", [
    (lambda f: (f / "manifest.toml").write_text((f / "manifest.toml").read_text().replace(
        f"{PAGE_SIZE_KEY} = {PAGE}", f"{PAGE_SIZE_KEY} = 0")), "page_size = 0: the keys a page holds must be in 1.."),
    (lambda f: np.save(f / f"{BLOCK_TABLE}.npy", np.load(f / f"{BLOCK_TABLE}.npy") + 100), "(the pool holds"),
    (lambda f: np.save(f / f"{CU_SEQLENS_K}.npy", np.zeros((6, 1), np.int32)),
     "reads its keys through block_table, not cu_seqlens_k"),
    (lambda f: (f / "manifest.toml").write_text((f / "manifest.toml").read_text().replace(
        f"{PAGE_SIZE_KEY} = {PAGE}", f"{PAGE_SIZE_KEY} = 5")), "not a multiple of page_size = 5"),
], ids=["page-size-0", "page-outside-the-pool", "cu-seqlens-k", "pool-not-whole-pages"])
def test_a_bad_paged_case_is_refused_in_one_line(tmp_path, change, words):
    write_paged(tmp_path / "paged", SEQLENS_Q, USED_K)
    change(tmp_path / "paged")
    with pytest.raises(CaseError) as info:
        load_case_tensors(tmp_path / "paged", "fp32")
    assert words in str(info.value) and "\n" not in str(info.value), str(info.value)
