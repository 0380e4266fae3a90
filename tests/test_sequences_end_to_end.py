"""Packed sequences end to end on the CPU: `attnstep generate` writes a packed case, the binary
computes it (per-sequence N×M files, run.toml's `sequences`, a CRC-32 for every file), `attnstep
check` passes it sequence by sequence; another program's folder (no run.toml, %g text) passes from
the input case's offsets alone; and a run whose one sequence attended over its neighbour's keys too
fails at that sequence, named.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from verify.check.compare import Options, check
from verify.diagnose.hypotheses import diagnose
from verify.files.case import load_input_case
from verify.files.generate import generate_case
from verify.files.matrix_io import crc32_hex, read_matrix
from verify.files.outputs import foreign_stage_files, open_run
from verify.runs.runner import run_binary
from verify.sequences import SEQUENCES_KEY, sequences_from_lengths
from verify.stages import RUN_MANIFEST, SEQUENCE_STAGES, Dims, stage_file
from verify.variant import BOTTOM_RIGHT, Variant

from helpers.cli import invoke
from helpers.packed_programs import FLASH, PackedCase, program_stages, run_program, write_case


def _failing(report):
    return [(r.stage, r.head, r.sequence, r.status, r.message) for r in report.results if not r.passed]


def packed_run(binary, tmp_path: Path, lengths_q, lengths_k=None, used_k=None, *, heads=2, kv_heads=0, d=16,
               variant=Variant(), fmt="txt", backward=False, stages="all", seed=3):
    """generate_case -> the binary (CPU backend) on a packed case; (in_dir, out_dir, sequences)."""
    seqs = sequences_from_lengths(lengths_q, lengths_k, used_k)
    dims = Dims(1, heads, seqs.total_q, seqs.total_k, d, d, kv_heads)
    in_dir, out_dir = tmp_path / "in", tmp_path / "out"
    generate_case(in_dir, dims, variant=variant, fmt=fmt, backward=backward, seed=seed, sequences=seqs)
    run_binary(binary, in_dir, out_dir, backend="cpu", extra=("--stages", stages))
    return in_dir, out_dir, seqs


# ----------------------------------------------------------------------------------------------
# The command line, as a user runs it.

def test_generate_run_check_on_the_command_line(binary, tmp_path):
    in_dir, out_dir, report = tmp_path / "in", tmp_path / "out", tmp_path / "r.json"
    r = invoke("generate", "--out", in_dir, "--random-seqlens", "4,40", "--causal", "bottom-right", "--backward",
               "--heads", 2, "--d-k", 16, "--d-v", 16)
    assert r.exit_code == 0, r.output
    run_binary(binary, in_dir, out_dir, backend="cpu")
    r = invoke("check", "--in", in_dir, "--out", out_dir, "--json", report)
    assert r.exit_code == 0, r.output
    assert "4 packed sequences" in r.output and "not from run" not in r.output  # no file taken for a leftover
    results = json.loads(report.read_text())["results"]
    assert {res["sequence"] for res in results if res.get("sequence") is not None} == {0, 1, 2, 3}


# ----------------------------------------------------------------------------------------------
# The binary's packed runs pass.

VARIANT = Variant(causal=True, align=BOTTOM_RIGHT, window=(5, 0), softcap=8.0, alibi=True)
CASES = {
    # name: (lengths_q, lengths_k, used_k, keyword arguments)
    "plain": ((5, 17, 9), None, None, {}),
    "variants-backward": ((7, 20, 3, 12), (9, 14, 3, 20), None, {"variant": VARIANT, "backward": True}),
    "gqa-npy-backward": ((6, 11, 16), None, None, {"heads": 4, "kv_heads": 2, "fmt": "npy", "backward": True}),
    "seqused-k-padding": ((4, 8, 6), (10, 12, 9), (7, 12, 2), {"variant": Variant(causal=True, align=BOTTOM_RIGHT),
                                                                "backward": True}),
    "a-sequence-without-keys": ((5, 3, 7), (6, 0, 9), None, {"backward": True}),
    "a-sequence-without-queries": ((5, 0, 7), (6, 4, 9), None, {"backward": True}),
}


@pytest.mark.parametrize("stages", ["stages", "flash"])
@pytest.mark.parametrize("name", CASES)
def test_the_binarys_packed_runs_pass(binary, tmp_path, name, stages):
    lengths_q, lengths_k, used_k, kw = CASES[name]
    in_dir, out_dir, seqs = packed_run(binary, tmp_path, lengths_q, lengths_k, used_k, stages=stages, **kw)
    report = check(in_dir, out_dir, Options(jobs=1), diagnoser=diagnose)
    assert report.passed, _failing(report)
    assert not report.foreign_files
    checked = {r.sequence for r in report.results if r.sequence is not None}
    assert checked == {b for b in range(seqs.count) if seqs.n(b)}


def test_the_run_lists_every_per_sequence_file_with_its_crc(binary, tmp_path):
    in_dir, out_dir, seqs = packed_run(binary, tmp_path, (4, 6), (5, 0), backward=True, stages="stages")
    run = open_run(out_dir, load_input_case(in_dir))
    assert run.values[SEQUENCES_KEY] == 2
    for stage in (s for s in SEQUENCE_STAGES if s in run.stages):
        assert not (out_dir / stage_file(stage, 0, "txt")).exists()  # only the per-sequence files
        name = stage_file(stage, 1, "txt", seq=0)
        assert run.values["crc32_" + name.rpartition(".")[0]] == crc32_hex((out_dir / name).read_bytes())
        assert not (out_dir / stage_file(stage, 1, "txt", seq=1)).exists()  # sequence 1 reads no key
    assert foreign_stage_files(run) == []
    # A dense file of a per-sequence stage beside them is not this run's.
    (out_dir / stage_file("QK", 0, "txt")).write_text("0\n")
    assert foreign_stage_files(open_run(out_dir, load_input_case(in_dir))) == [stage_file("QK", 0, "txt")]


def test_a_per_sequence_file_edited_since_the_run_is_stale(binary, tmp_path):
    in_dir, out_dir, _ = packed_run(binary, tmp_path, (4, 6), stages="stages")
    path = out_dir / stage_file("QK", 1, "txt", seq=1)
    path.write_text(path.read_text().replace("\n", "\n ", 1))
    report = check(in_dir, out_dir, Options(jobs=1))
    assert [(r.stage, r.head, r.sequence, r.status) for r in report.results if not r.passed][0] == \
        ("QK", 1, 1, "STALE")


def test_a_run_of_another_packing_is_refused_in_one_line(binary, tmp_path):
    in_dir, out_dir, _ = packed_run(binary, tmp_path, (4, 6), stages="flash")
    manifest = out_dir / RUN_MANIFEST
    manifest.write_text(manifest.read_text().replace(f"{SEQUENCES_KEY} = 2", f"{SEQUENCES_KEY} = 3"))
    r = invoke("check", "--in", in_dir, "--out", out_dir)
    assert r.exit_code == 2
    assert r.output.strip().splitlines()[-1] == (
        f"Error: {manifest}: {SEQUENCES_KEY} = 3 but the input case {in_dir} has 2 packed sequences; HINT: the "
        "output was computed from another input case: run it again")


# ----------------------------------------------------------------------------------------------
# Another program's folder: no run.toml, %g text, the input case's offsets only.

def test_another_programs_flash_stages_pass(tmp_path):
    case = PackedCase((5, 9, 4), (7, 9, 6), causal=True)
    write_case(case, tmp_path / "in")
    run_program(case, tmp_path / "out", FLASH)
    report = check(tmp_path / "in", tmp_path / "out", Options(jobs=1, causal=True, variant={"align": BOTTOM_RIGHT}))
    assert report.passed, _failing(report)


def test_another_programs_per_sequence_files_alone_are_found(tmp_path):
    case = PackedCase((5, 9), (7, 9))
    write_case(case, tmp_path / "in")
    run_program(case, tmp_path / "out", ("QK", "attention_weights", "output"))
    report = check(tmp_path / "in", tmp_path / "out", Options(jobs=1))
    assert report.passed, _failing(report)
    assert set(report.stages) == {"QK", "attention_weights", "output"}


# ----------------------------------------------------------------------------------------------
# A planted bug: one sequence's flash_output attends over the previous sequence's keys too.

def _rewrite(path: Path, mat: np.ndarray, run_toml: Path) -> None:
    """Writes `mat` into the binary's text file (its header kept) and its CRC-32 into run.toml, as
    if the binary had computed it."""
    header = path.read_text().splitlines(keepends=True)[0]
    path.write_text(header + "".join(" ".join(f"{x:.9g}" for x in row) + "\n" for row in mat))
    key = "crc32_" + path.name.rpartition(".")[0]
    lines = [f'{key} = "{crc32_hex(path.read_bytes())}"' if line.startswith(key + " ") else line
             for line in run_toml.read_text().splitlines()]
    run_toml.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("causal", [False, True])
def test_a_sequence_reading_its_neighbours_keys_fails_at_that_sequence(binary, tmp_path, causal):
    lengths, leaking = (6, 9, 7), 1
    variant = Variant(causal=True, align=BOTTOM_RIGHT) if causal else Variant()
    in_dir, out_dir, seqs = packed_run(binary, tmp_path, lengths, variant=variant, stages="flash")
    case = PackedCase(lengths, lengths, causal=causal)
    case.inputs = {n: np.stack([read_matrix(in_dir / stage_file(n, i, "txt")).astype(np.float32)
                                for i in range(2)]) for n in ("Q", "K", "V")}
    case.inputs["dO"] = np.zeros_like(case.inputs["Q"])
    leaked, _ = program_stages(case, bug="leak")
    path = out_dir / stage_file("flash_output", 0, "txt")
    mat = read_matrix(path)
    rows = seqs.q_rows(leaking)
    mat[rows.start:rows.stop] = leaked["flash_output"][0, rows.start:rows.stop]
    _rewrite(path, mat, out_dir / RUN_MANIFEST)

    report = check(in_dir, out_dir, Options(jobs=1), diagnoser=diagnose)
    assert not report.passed
    failing = {(r.stage, r.head, r.sequence) for r in report.results if not r.passed}
    assert failing == {("flash_output", 0, leaking)}
    r = invoke("check", "--in", in_dir, "--out", out_dir)
    assert r.exit_code == 1
    where = re.search(rf"FAIL flash_output head 0, sequence {leaking} \(token (\d+), packed row (\d+)\)", r.output)
    assert where, r.output
    token, row = map(int, where.groups())
    assert row == seqs.cu_q[leaking] + token
