"""Checking a paged case (docs/contract.md, "Paged KV caches"): the binary's CPU run of a generated
paged case passes at fp32 and bf16; a NumPy program (tests/helpers/paged_programs.py) passes when
right, and each planted paging bug fails at its sequence with its diagnosis named; K, V and KT are
checked over the whole pool.
"""
from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from helpers.cli import invoke
from helpers.paged_programs import run_program

CASE_ARGS = ("--heads", 4, "--kv-heads", 2, "--d-k", 16, "--d-v", 16, "--seqlens", "2,3,1", "--seqlens-k",
             "40,70,20", "--page-size", 16)


@pytest.fixture
def case(tmp_path):
    r = invoke("generate", "--out", tmp_path / "case", *CASE_ARGS)
    assert r.exit_code == 0, r.output
    return tmp_path / "case"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_the_binarys_paged_run_passes(binary, tmp_path, case, precision, causal):
    if causal:
        text = (case / "manifest.toml").read_text().replace("causal = false", "causal = true")
        (case / "manifest.toml").write_text(text)
    out = tmp_path / "out"
    ran = subprocess.run([str(binary), "--in", str(case), "--out", str(out), "--backend", "cpu", "--precision",
                          precision], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    report = tmp_path / "r.json"
    checked = invoke("check", "--in", case, "--out", out, "--json", report)
    assert checked.exit_code == 0, checked.output
    data = json.loads(report.read_text())
    assert data["sequences"]["page_size"] == 16 and len(data["sequences"]["block_table"]) == 3
    assert {r["stage"] for r in data["results"]} >= {"K", "V", "KT", "QK", "flash_output", "flash_lse"}


@pytest.mark.parametrize("fmt", ["%.9g", "%g"])  # %g: six significant digits, as printf writes them
def test_a_right_program_passes(tmp_path, case, fmt):
    checked = invoke("check", "--in", case, "--out", run_program(case, tmp_path / "out", fmt=fmt))
    assert checked.exit_code == 0, checked.output


def test_a_page_size_for_a_case_without_a_block_table_is_refused(tmp_path, case):
    out = run_program(case, tmp_path / "out")
    (case / "manifest.toml").unlink()
    (case / "block_table.txt").unlink()
    checked = invoke("check", "--in", case, "--out", out, "--page-size", 16)
    assert checked.exit_code == 2 and len(checked.output.strip().splitlines()) == 1, checked.output
    assert "a page size (16) was given, but the case has no block_table file" in checked.output


def test_a_right_program_without_a_manifest_passes_with_the_page_size_given(tmp_path, case):
    out = run_program(case, tmp_path / "out", fmt="%g")
    (case / "manifest.toml").unlink()
    checked = invoke("check", "--in", case, "--out", out, "--page-size", 16)
    assert checked.exit_code == 0, checked.output


@pytest.mark.parametrize("bug, code, words", [
    ("wrong_page", "paged_wrong_page", "sequence 1 read its page 1 (keys 16..31) from page"),
    ("page_shift", "paged_page_shift", "sequence 1 read every page"),
    ("past_length", "paged_past_length", "sequence 0 attended 48 keys, 8 past its 40 (seqused_k[0])"),
    ("length_plus_one", "cache_length_off_by_one", "sequence 1 attended 71 keys, one past its 70 (seqused_k[1]): "
     "key 70 read"),
    ("table_late", "paged_page_shift", "sequence 0 read block_table[0, j + 1] for its page j (the table read one "
     "entry late) (a −1 read as the pool's last page, as Python and PyTorch index)"),
])
@pytest.mark.parametrize("fmt", ["%.9g", "%g"])
def test_a_paging_bug_is_named(tmp_path, case, bug, code, words, fmt):
    report = tmp_path / "r.json"
    checked = invoke("check", "--in", case, "--out", run_program(case, tmp_path / "out", bug, fmt=fmt), "--json", report)
    assert checked.exit_code == 1, checked.output
    assert f"diagnosis {code}: {words}" in checked.output, checked.output
    data = json.loads(report.read_text())
    failing = [r for r in data["results"] if not r["passed"]]
    assert failing and all(r["sequence"] is not None for r in failing)
    first = [d["code"] for r in failing for d in r["diagnosis"][:1]]
    assert set(first) == {code}, first


def test_a_cause_named_in_another_sequence_of_the_head_is_in_the_verdict(tmp_path, case):
    """Sequence 0 wrong without a name (noise on its rows), sequence 1's pages read one off: the
    verdict, on sequence 0, says what sequence 1 names."""
    out = run_program(case, tmp_path / "out", "page_shift")
    rng = np.random.default_rng(0)
    for h in range(4):
        noise = rng.standard_normal((2, 16)) * 1e-3  # (sequence 0: the first 2 query rows)
        for name in ("output", "flash_output"):
            path = out / f"{name}_head_{h}.txt"
            o = np.loadtxt(path, ndmin=2)
            o[:2] += noise
            np.savetxt(path, o.astype(np.float32), fmt="%.9g")
    checked = invoke("check", "--in", case, "--out", out)
    verdict = [line for line in checked.output.splitlines() if "first failing stage" in line]
    assert verdict and "first failing stage: output (all 4 heads, sequence 0)" in verdict[0], checked.output
    assert "unnamed there; sequence 1 of the same head fails at output with paged_page_shift" in verdict[0]


@pytest.mark.parametrize("bug, code", [("length_plus_one", "cache_length_off_by_one"),
                                       ("wrong_page", "paged_wrong_page"), ("past_length", "paged_past_length")])
def test_a_paging_bug_of_a_bf16_program_is_named(tmp_path, bug, code):
    """A bf16 kernel's rows lie a few of the format's units from any reading's: the readings are
    screened against the format's rounding, not float32's (one key more moves a decode step's
    output by less than a tenth of a bf16 program's distance from the right reading)."""
    r = invoke("generate", "--out", tmp_path / "case", "--heads", 2, "--d-k", 64, "--d-v", 64, "--seqlens", "1,1,2",
               "--seqlens-k", "100,300,37", "--page-size", 16, "--seed", 102)
    assert r.exit_code == 0, r.output
    out = run_program(tmp_path / "case", tmp_path / "out", bug, half=True)
    checked = invoke("check", "--in", tmp_path / "case", "--out", out, "--precision", "bf16")
    assert checked.exit_code == 1, checked.output
    assert f"diagnosis {code}: " in checked.output, checked.output
    right = run_program(tmp_path / "case", tmp_path / "right", half=True)
    assert invoke("check", "--in", tmp_path / "case", "--out", right, "--precision", "bf16").exit_code == 0


@pytest.mark.parametrize("bug, code", [("wrong_page", "paged_wrong_page"), ("past_length", "paged_past_length")])
def test_a_paging_bug_of_a_split_kv_program_is_named_in_its_first_failing_split(tmp_path, case, bug, code):
    """Each split reads its keys through the table as the whole step does: the split that first
    fails carries the reading that explains the step's output."""
    right = run_program(case, tmp_path / "right", split_size=16)
    assert invoke("check", "--in", case, "--out", right, "--split-size", 16).exit_code == 0
    checked = invoke("check", "--in", case, "--out", run_program(case, tmp_path / "out", bug, split_size=16),
                     "--split-size", 16, "--json", tmp_path / "r.json")
    assert checked.exit_code == 1, checked.output
    failing = [r for r in json.loads((tmp_path / "r.json").read_text())["results"]
               if r["stage"] in ("split_output", "split_lse") and not r["passed"]]
    assert failing and {r["diagnosis"][0]["code"] for r in failing} == {code}, checked.output
    assert f"diagnosis {code}: " in checked.output.split("FAIL split_output", 1)[1].split("\nFAIL ", 1)[0]


def test_pages_read_in_pool_order_fail(tmp_path, case):
    """A program that ignores the table's order (the shuffled pages) fails."""
    checked = invoke("check", "--in", case, "--out", run_program(case, tmp_path / "out", "pool_order"))
    assert checked.exit_code == 1, checked.output


def test_k_is_checked_over_the_whole_pool(binary, tmp_path, case):
    """A pool row no sequence reads (a spare page) whose K echo is wrong fails K, named by page and slot."""
    out = tmp_path / "out"
    assert subprocess.run([str(binary), "--in", str(case), "--out", str(out), "--backend", "cpu"],
                          capture_output=True, text=True, timeout=300).returncode == 0
    table = np.loadtxt(case / "block_table.txt", dtype=int, ndmin=2)
    spare = sorted(set(range(13)) - set(table[table >= 0].tolist()))[0]
    k = np.loadtxt(out / "K_head_1.txt", ndmin=2)
    k[spare * 16 + 3, 5] += 1.0
    np.savetxt(tmp_path / "K_head_1.txt", k, fmt="%.9g")
    (out / "run.toml").unlink()  # another program's folder: no CRC table
    (tmp_path / "K_head_1.txt").replace(out / "K_head_1.txt")
    report = tmp_path / "r.json"
    checked = invoke("check", "--in", case, "--out", out, "--json", report)
    assert checked.exit_code == 1, checked.output
    assert "FAIL K K/V head 1" in checked.output and f"worst at [{spare * 16 + 3},5]" in checked.output
    failing = [r for r in json.loads(report.read_text())["results"] if not r["passed"]]
    assert [r["stage"] for r in failing] == ["K"], failing
    assert failing[0]["message"].startswith(f"pool row {spare * 16 + 3} (page {spare}, slot 3) is not the input's")
