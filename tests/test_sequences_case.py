"""Packed cases on disk: what `attnstep generate --seqlens/--random-seqlens` writes and how it
reads back (text and .npy, with and without a manifest), the strict reading of the sequence files
(file:line:col), every refusal of the reader and of the generator (one line, exit status 2, nothing
written), and the names of the stage files stored per sequence. No binary needed."""
from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np
import pytest

from helpers.cli import invoke
from verify.files.case import load_input_case
from verify.files.generate import case_size
from verify.files.kinds import CaseError
from verify.sequences import CU_SEQLENS_K, CU_SEQLENS_Q, SEQUENCES_KEY, SEQUSED_K, Sequences
from verify.stages import (INPUT_MANIFEST, SCORES, SEQUENCE_STAGES, STAGES, Dims, StageFileName, parse_stage_file,
                           per_sequence, stage_file)

SMALL = ("--heads", 2, "--d-k", 8, "--d-v", 8)


def generate(folder: Path, *args) -> Path:
    r = invoke("generate", "--out", folder, *SMALL, *args)
    assert r.exit_code == 0, r.output
    return folder


def refused(folder: Path, *args) -> str:
    """`generate ARGS` must fail in one line with exit status 2 and write nothing; its message."""
    r = invoke("generate", "--out", folder, *SMALL, *args)
    assert r.exit_code == 2, r.output
    assert len(r.output.strip().splitlines()) == 1, r.output
    assert not folder.exists()
    return r.output


def manifest(folder: Path) -> dict:
    return tomllib.loads((folder / INPUT_MANIFEST).read_text())


def set_manifest(folder: Path, **values) -> None:
    """Rewrites keys of the manifest (None removes one)."""
    text = [ln for ln in (folder / INPUT_MANIFEST).read_text().splitlines()
            if ln.partition(" =")[0] not in values]
    text += [f"{k} = {v}" for k, v in values.items() if v is not None]
    (folder / INPUT_MANIFEST).write_text("\n".join(text) + "\n")


def load_error(folder: Path) -> str:
    with pytest.raises(CaseError) as exc:
        load_input_case(folder)
    message = str(exc.value)
    assert "\n" not in message
    return message


# ---- generate -> read ---------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["txt", "npy"])
def test_a_packed_case_round_trips(tmp_path, fmt):
    folder = generate(tmp_path / "c", "--seqlens", "5,17,0,33", "--seqlens-k", "7,17,3,40", "--seqused-k", "5,10,2,40",
                      "--format", fmt, "--backward")
    m = manifest(folder)
    assert (m["batch"], m["seq_q"], m["seq_k"], m[SEQUENCES_KEY]) == (1, 55, 67, 4)
    case = load_input_case(folder)
    assert case.sequences == Sequences((0, 5, 22, 22, 55), (0, 7, 24, 27, 67), (5, 10, 2, 40))
    assert case.dims == Dims(1, 2, 55, 67, 8, 8)
    assert case.backward and case.load("Q", 1).shape == (55, 8) and case.load("K", 0).shape == (67, 8)
    if fmt == "npy":  # flash-attn's dtype, one column
        arr = np.load(folder / f"{CU_SEQLENS_Q}.npy")
        assert arr.dtype == np.int32 and arr.shape == (5, 1)
    else:
        assert (folder / f"{CU_SEQLENS_K}.txt").read_text() == "0\n7\n24\n27\n67\n"


def test_keys_default_to_the_queries_and_the_case_reads_back_without_a_manifest(tmp_path):
    folder = generate(tmp_path / "c", "--seqlens", "3,4")
    assert not (folder / f"{SEQUSED_K}.txt").exists()
    (folder / INPUT_MANIFEST).unlink()
    case = load_input_case(folder)
    assert case.sequences == Sequences((0, 3, 7), (0, 3, 7)) and case.dims.seq_q == case.dims.seq_k == 7


def test_random_lengths_come_from_the_seed(tmp_path):
    a = load_input_case(generate(tmp_path / "a", "--random-seqlens", "6,9", "--seed", 3)).sequences
    b = load_input_case(generate(tmp_path / "b", "--random-seqlens", "6,9", "--seed", 3)).sequences
    c = load_input_case(generate(tmp_path / "c", "--random-seqlens", "6,9", "--seed", 4)).sequences
    assert a == b != c and a.count == 6 and a.cu_k == a.cu_q
    assert all(1 <= a.n(i) <= 9 for i in range(6))


def test_a_case_generated_again_without_packing_loses_its_sequence_files(tmp_path):
    folder = generate(tmp_path / "c", "--seqlens", "3,4", "--seqlens-k", "3,5", "--seqused-k", "2,5")
    generate(folder, "--seq-q", 4, "--seq-k", 5)
    assert load_input_case(folder).sequences is None
    assert not any(p.name.startswith(("cu_seqlens", SEQUSED_K)) for p in folder.iterdir())


def test_the_case_size_counts_the_sequence_files():
    dims = Dims(1, 2, 7, 7, 8, 8)
    plain, packed = case_size(dims, "txt", False), case_size(dims, "txt", False, sequences=Sequences((0, 3, 7), (0, 3, 7)))
    assert packed.files == plain.files + 2 and packed.bytes > plain.bytes


# ---- the generator's refusals -------------------------------------------------------------------

@pytest.mark.parametrize("args, words", [
    (("--seqlens", "5,x"), "--seqlens 5,x: 'x' is not a length"),
    (("--seqlens-k", "3"), "--seqlens-k needs --seqlens"),
    (("--seqlens", "3,4", "--seqused-k", "1,2"), "--seqused-k needs --seqlens-k"),
    (("--seqlens", "3,4", "--seqlens-k", "3"), "--seqlens-k 3: 1 length for 2 sequences"),
    (("--seqlens", "3,4", "--seqlens-k", "3,4", "--seqused-k", "4,1"),
     "--seqused-k 4,1: seqused_k[0] = 4 is outside 0..3 (sequence 0's key slot)"),
    (("--seqlens", "3,4", "--seqlens-k", "3,4", "--seqused-k", "1"), "seqused_k has 1 values for 2 sequences"),
    (("--seqlens", "3,4", "--batch", 2), "--seqlens with --batch 2: a packed case has batch 1"),
    (("--seqlens", "3,4", "--seq-q", 9), "--seq-q 9 with --seqlens: the sequences hold 7 queries in all"),
    (("--seqlens", "3,4", "--seqlens-k", "3,5", "--seq-k", 7), "--seq-k 7 with --seqlens: the sequences hold 8 keys"),
    (("--seqlens", "3,4", "--mask", "random"), "--seqlens with --mask: mask files are not supported with packed"),
    (("--seqlens", "3,4", "--bias", "random"), "--seqlens with --bias: bias files are not supported"),
    (("--random-seqlens", "2,3", "--dropout", "0.1"), "--random-seqlens with --dropout: dropout is not supported"),
    (("--seqlens", "0,0"), "--seqlens 0,0: no query in all"),
    (("--seqlens", "2,1", "--seqlens-k", "0,0"), "--seqlens-k 0,0: no key in all"),
    (("--random-seqlens", "3"), "--random-seqlens 3: expected B,MAX"),
    (("--random-seqlens", "3,0"), "--random-seqlens 3,0: '0' is not a length (a whole number >= 1)"),
    (("--random-seqlens", "3,4", "--seqlens", "1"), "--random-seqlens and --seqlens: choose one"),
    # Totals beyond a dimension: named by the option that sums to them, not as seq_q or seq_k alone.
    (("--seqlens", "20000000"), "--seqlens 20000000: 20000000 query tokens in all; seq_q, their total, is at most "
                                "16777216"),
    (("--seqlens", "99999999999999999999"), "--seqlens 99999999999999999999: 99999999999999999999 query tokens"),
    (("--seqlens", "5,17", "--seqlens-k", "16777216,1"), "--seqlens-k 16777216,1: 16777217 key tokens in all; seq_k"),
    (("--random-seqlens", "2,16777216", "--seed", 1), "--random-seqlens 2,16777216: 22842002 query tokens in all"),
])
def test_bad_packing_options_are_refused_in_one_line_before_writing(tmp_path, args, words):
    assert words in refused(tmp_path / "c", *args)


def test_a_matching_seq_q_is_accepted(tmp_path):
    assert manifest(generate(tmp_path / "c", "--seqlens", "3,4", "--seq-q", 7, "--seq-k", 7))["seq_q"] == 7


# ---- the reader's refusals ----------------------------------------------------------------------

@pytest.fixture
def packed(tmp_path) -> Path:
    """A packed text case of 3 sequences: queries 2,3,4 (9), key slots 3,3,4 (10), 2,3,4 keys used."""
    return generate(tmp_path / "c", "--seqlens", "2,3,4", "--seqlens-k", "3,3,4", "--seqused-k", "2,3,4")


@pytest.mark.parametrize("name, text, words", [
    (CU_SEQLENS_Q, "0\n2\n5.0\n9\n", "cu_seqlens_q.txt:3:1: not an integer: '5.0'"),
    (CU_SEQLENS_Q, "0\n2\n  x5\n9\n", "cu_seqlens_q.txt:3:3: not an integer: 'x5'"),
    (CU_SEQLENS_Q, "# offsets\n0\n2\n5\n99999999999999999999\n",
     "cu_seqlens_q.txt:5:1: 99999999999999999999 is outside 0..16777216 (a count of tokens)"),
    (CU_SEQLENS_K, "0\n-3\n6\n10\n", "cu_seqlens_k.txt:2:1: -3 is outside 0..16777216"),
    (CU_SEQLENS_Q, "0 2\n5\n9\n", "cu_seqlens_q.txt:1: extra values: 2 values on this row, expected 1"),
    (CU_SEQLENS_Q, "0\n\n2\n5\n9\n", "cu_seqlens_q.txt:2: blank line inside the matrix"),
    (CU_SEQLENS_Q, "0\n2\n9\n", "cu_seqlens_q.txt: 3 offsets, but "),
    (CU_SEQLENS_K, "0\n3\n6\n", "cu_seqlens_k.txt: cu_seqlens_k has 3 offsets, cu_seqlens_q 4: both need B + 1"),
    (CU_SEQLENS_Q, "1\n2\n5\n9\n", "cu_seqlens_q.txt: cu_seqlens_q must start at 0, got 1"),
    (CU_SEQLENS_K, "0\n6\n3\n10\n", "cu_seqlens_k.txt: cu_seqlens_k must not decrease: offset 2 is 3 after 6"),
    (SEQUSED_K, "2\n4\n4\n", "seqused_k.txt: seqused_k[1] = 4 is outside 0..3 (sequence 1's key slot)"),
    (SEQUSED_K, "2\n3\n", "seqused_k.txt: seqused_k has 2 values for 3 sequences"),
    (CU_SEQLENS_Q, "0\n2\n5\n8\n", "cu_seqlens_q.txt: ends at 8 (the packed queries), but "),
    (CU_SEQLENS_K, "0\n3\n6\n11\n", "cu_seqlens_k.txt: ends at 11 (the packed keys), but "),
])
def test_the_sequence_files_are_read_strictly(packed, name, text, words):
    (packed / f"{name}.txt").write_text(text)
    message = load_error(packed)
    assert words in message
    if "ends at" in message:  # names both sides
        assert "manifest.toml says seq_" in message


@pytest.mark.parametrize("arr, words", [
    (np.array([[0], [2], [5], [9]], dtype=np.int64), None),
    (np.array([[0], [2], [5], [9]], dtype=np.uint8), None),
    (np.array([[0], [2], [5], [9]], dtype=np.float32), None),
    (np.array([[0], [2.5], [5], [9]], dtype=np.float32), "cu_seqlens_q.npy:row 1, col 0: not an integer: 2.5"),
    (np.array([[0], [2], [5], [np.inf]], dtype=np.float32), "row 3, col 0: not an integer: inf"),
    (np.array([[0], [2], [5], [9]], dtype=np.float64), "dtype '<f8', expected an integer type or float32"),
    (np.array([[0], [2], [5], [9]], dtype=">i4"), "dtype '>i4'"),
    (np.array([0, 2, 5, 9], dtype=np.int32), "shape (4,), expected a column (rows, 1)"),
    (np.array([[0], [-2], [5], [9]], dtype=np.int32), "row 1, col 0: -2 is outside 0..16777216"),
])
def test_npy_sequence_files_take_any_integer_type_or_float32_holding_integers(tmp_path, arr, words):
    folder = generate(tmp_path / "c", "--seqlens", "2,3,4", "--format", "npy")
    np.save(folder / f"{CU_SEQLENS_Q}.npy", arr)
    if words is None:
        assert load_input_case(folder).sequences.cu_q == (0, 2, 5, 9)
    else:
        assert words in load_error(folder)


@pytest.mark.parametrize("edit, words", [
    ({SEQUENCES_KEY: 0}, "manifest.toml: sequences = 0: the number of sequences must be in 1..16777216"),
    ({SEQUENCES_KEY: '"3"'}, "'sequences' must be an integer"),
    ({"batch": 2}, "batch = 2 with sequences = 3: a packed case has batch = 1"),
    ({SEQUENCES_KEY: 4}, "cu_seqlens_q.txt: 4 offsets, but"),
    ({"seq_q": 10}, "cu_seqlens_q.txt: ends at 9 (the packed queries), but"),
    ({"mask": '"broadcast"'}, 'manifest.toml: mask = "broadcast": mask files are not supported with packed sequences'),
    ({"bias": '"per-head"'}, 'manifest.toml: bias = "per-head": bias files are not supported'),
    ({"dropout": 0.1}, "manifest.toml: dropout = 0.1: dropout is not supported with packed sequences"),
    ({SEQUENCES_KEY: None}, "cu_seqlens_q.txt: exists but the case is not packed (no sequences = B in manifest.toml)"),
])
def test_the_manifest_and_the_sequence_files_agree(packed, edit, words):
    set_manifest(packed, **edit)
    assert words in load_error(packed)


def test_a_missing_or_stray_sequence_file_is_named(packed):
    (packed / f"{CU_SEQLENS_K}.txt").rename(packed / f"{CU_SEQLENS_K}.npy")
    assert "cu_seqlens_k.npy: a .npy file in a .txt case" in load_error(packed)
    (packed / f"{CU_SEQLENS_K}.npy").unlink()
    assert "cu_seqlens_k.txt: missing file (manifest.toml says sequences = 3)" in load_error(packed)


def test_without_a_manifest_the_files_make_the_case_packed_and_must_agree_with_q_and_k(packed):
    (packed / INPUT_MANIFEST).unlink()
    assert load_input_case(packed).sequences == Sequences((0, 2, 5, 9), (0, 3, 6, 10), (2, 3, 4))
    (packed / f"{CU_SEQLENS_Q}.txt").write_text("0\n2\n5\n8\n")
    assert "cu_seqlens_q.txt: ends at 8 (the packed queries), but Q_head_0.txt has 9 rows" in load_error(packed)
    (packed / f"{CU_SEQLENS_Q}.txt").unlink()
    assert "cu_seqlens_q.txt: missing file (a packed case has both cu_seqlens files)" in load_error(packed)
    (packed / f"{CU_SEQLENS_K}.txt").unlink()
    assert ("seqused_k.txt: exists but the case is not packed (no cu_seqlens_q and cu_seqlens_k files)"
            in load_error(packed))


def test_without_a_manifest_a_mask_file_is_refused_in_a_packed_case(packed):
    (packed / INPUT_MANIFEST).unlink()
    (packed / "mask.txt").write_text("\n".join(" ".join(["1"] * 10) for _ in range(9)) + "\n")
    assert "mask.txt: mask files are not supported with packed sequences" in load_error(packed)


def test_a_cu_seqlens_file_in_a_case_that_is_not_packed_is_refused(tmp_path):
    folder = generate(tmp_path / "c", "--seq-q", 4, "--seq-k", 4)
    (folder / f"{CU_SEQLENS_Q}.txt").write_text("0\n4\n")
    assert "cu_seqlens_q.txt: exists but the case is not packed" in load_error(folder)


# ---- stage files per sequence -------------------------------------------------------------------

def test_the_n_by_m_stages_are_stored_per_sequence():
    assert SEQUENCE_STAGES == tuple(n for n in STAGES if STAGES[n].rows == "N" and STAGES[n].cols == "M")
    assert {"QK", "QK_scaled", "attention_weights", "dP", "dS"} <= set(SEQUENCE_STAGES)
    assert per_sequence(SCORES) and not per_sequence("output") and not per_sequence("flash_lse")


def test_per_sequence_stage_file_names_are_built_and_parsed():
    assert stage_file("QK_scaled", 3, "txt", seq=2) == "QK_scaled_head_3_seq_2.txt"
    parsed = parse_stage_file("QK_scaled_head_3_seq_2.txt")
    assert (parsed.stage, parsed.head, parsed.fmt, parsed.seq) == ("QK_scaled", 3, "txt", 2)
    assert parsed.name == "QK_scaled_head_3_seq_2.txt"
    stage, head, fmt = parsed  # three values, as every caller unpacks
    assert (stage, head, fmt) == ("QK_scaled", 3, "txt")
    assert parsed != ("QK_scaled", 3, "txt")  # a sequence's file is not the head's
    plain = parse_stage_file("QK_head_12.npy")
    assert plain == ("QK", 12, "npy") and plain.seq is None and hash(plain) == hash(("QK", 12, "npy"))
    assert plain != StageFileName("QK", 12, "npy", 0)
    for name in ("QK_head_3_seq_.txt", "QK_head_3_seq_x.txt", "QK_head_3_seq_\u00b2.txt", "QK_head__seq_1.txt"):
        assert parse_stage_file(name) is None, name
