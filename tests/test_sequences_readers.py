"""The binary and the verifier read a packed case alike (docs/contract.md, "Packed sequences"): each
case here is run by the binary (CPU backend) and checked by `attnstep check` on the same folder; both
refuse it with the same one line after each reader's own way of naming the place (the binary adds
the manifest's line and column; its HINT is the text after "; HINT: " of the verifier's line), exit
status 2 and nothing written, or both accept it (the check then passes the binary's run).

The case: 2 heads of width 8, 3 sequences of 2, 3, 4 queries (9) and key slots of 3, 3, 4 keys
(10), of which 2, 3, 4 are used.
"""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import pytest

from helpers.cli import assert_same_verdict, binary_line, invoke
from helpers.variants import write_heads
from verify.sequences import BLOCK_TABLE, CU_SEQLENS_K, CU_SEQLENS_Q, SEQUSED_K
from verify.stages import INPUT_MANIFEST, OUTPUT

HEADS, D, TOTAL_Q = 2, 8, 9
NO_MANIFEST = "no manifest"
MAX = 16777216
VARIANTS_HINT = ("packed sequences take causal, windows, softcap, ALiBi and grouped K/V heads; run a sequence that "
                 "needs a mask, a bias or dropout as a case of its own")
NOT_PACKED_HINT = "add sequences = B (the number of sequences) to the manifest, or remove the file"
TOTAL_HINT = "is the total of the sequences' lengths"


def col(values, dtype) -> np.ndarray:
    return np.asarray(values, dtype=dtype).reshape(-1, 1)


# (id, the case's format, manifest edits (key -> value, None removes; NO_MANIFEST: none), files
# (name -> text, an array, or None to remove), options for both, the words both say after "{case}/"
# (the manifest's place without line and column); None when both accept the case).
CASES: List[Tuple[str, str, object, Dict[str, object], list, Optional[str]]] = [
    # The manifest.
    ("batch-2", "txt", {"batch": 2}, {}, [],
     "manifest.toml: batch = 2 with sequences = 3: a packed case has batch = 1 (its sequences are the batch)"),
    ("sequences-0", "txt", {"sequences": 0}, {}, [],
     f"manifest.toml: sequences = 0: the number of sequences must be in 1..{MAX}"),
    ("sequences-4", "txt", {"sequences": 4}, {}, [],
     "cu_seqlens_q.txt: 4 offsets, but {case}/manifest.toml says sequences = 4, which takes 5 (B + 1)"),
    ("seq_q-10", "txt", {"seq_q": 10}, {}, [],
     "cu_seqlens_q.txt: ends at 9 (the packed queries), but {case}/manifest.toml says seq_q = 10; HINT: seq_q "
     + TOTAL_HINT),
    ("seq_k-11", "txt", {"seq_k": 11}, {}, [],
     "cu_seqlens_k.txt: ends at 10 (the packed keys), but {case}/manifest.toml says seq_k = 11; HINT: seq_k "
     + TOTAL_HINT),
    ("not-packed", "txt", {"sequences": None}, {}, [],
     "cu_seqlens_q.txt: exists but the case is not packed (no sequences = B in manifest.toml); HINT: "
     + NOT_PACKED_HINT),
    ("mask", "txt", {"mask": '"broadcast"'}, {}, [],
     'manifest.toml: mask = "broadcast": mask files are not supported with packed sequences; HINT: ' + VARIANTS_HINT),
    ("bias", "txt", {"bias": '"per-head"'}, {}, [],
     'manifest.toml: bias = "per-head": bias files are not supported with packed sequences; HINT: ' + VARIANTS_HINT),
    ("dropout", "txt", {"dropout": 0.1}, {}, [],
     "manifest.toml: dropout = 0.1: dropout is not supported with packed sequences; HINT: " + VARIANTS_HINT),
    # The files' presence.
    ("missing-cu_seqlens_k", "txt", {}, {CU_SEQLENS_K: None}, [],
     "cu_seqlens_k.txt: missing file (manifest.toml says sequences = 3)"),
    ("stray-npy", "txt", {}, {f"{SEQUSED_K}.npy": col([2, 3, 4], np.int32)}, [],
     "seqused_k.npy: a .npy file in a .txt case; HINT: a case holds one format; remove the stray file"),
    ("no-manifest-seqused_k-alone", "txt", NO_MANIFEST, {CU_SEQLENS_Q: None, CU_SEQLENS_K: None}, [],
     "seqused_k.txt: exists but the case is not packed (no cu_seqlens_q and cu_seqlens_k files); HINT: "
     + NOT_PACKED_HINT),
    ("no-manifest-missing-cu_seqlens_q", "txt", NO_MANIFEST, {CU_SEQLENS_Q: None}, [],
     "cu_seqlens_q.txt: missing file (a packed case has both cu_seqlens files)"),
    ("no-manifest-total", "txt", NO_MANIFEST, {CU_SEQLENS_Q: "0\n2\n5\n8\n"}, [],
     "cu_seqlens_q.txt: ends at 8 (the packed queries), but Q_head_0.txt has 9 rows; HINT: seq_q " + TOTAL_HINT),
    ("no-manifest-mask", "txt", NO_MANIFEST, {"mask.txt": "\n".join(" ".join(["1"] * 10) for _ in range(9)) + "\n"},
     [], "mask.txt: mask files are not supported with packed sequences; HINT: " + VARIANTS_HINT),
    # Text values.
    ("5.0", "txt", {}, {CU_SEQLENS_Q: "0\n2\n5.0\n9\n"}, [], "cu_seqlens_q.txt:3:1: not an integer: '5.0'"),
    ("3e0", "txt", {}, {CU_SEQLENS_Q: "0\n2\n  3e0\n9\n"}, [], "cu_seqlens_q.txt:3:3: not an integer: '3e0'"),
    ("control-char", "txt", {}, {CU_SEQLENS_Q: "0\n2\n5\x1b\n9\n"}, [],
     "cu_seqlens_q.txt:3:1: not an integer: '5\\x1b'"),
    ("long-token", "txt", {}, {CU_SEQLENS_Q: "0\n2\n" + "x" * 60 + "\n9\n"}, [],
     "cu_seqlens_q.txt:3:1: not an integer: '" + "x" * 37 + "...'"),
    ("huge", "txt", {}, {CU_SEQLENS_Q: "# offsets\n0\n2\n5\n99999999999999999999\n"}, [],
     f"cu_seqlens_q.txt:5:1: 99999999999999999999 is outside 0..{MAX} (a count of tokens)"),
    ("negative", "txt", {}, {CU_SEQLENS_K: "0\n-3\n6\n10\n"}, [],
     f"cu_seqlens_k.txt:2:1: -3 is outside 0..{MAX} (a count of tokens)"),
    ("max-plus-1", "txt", {}, {SEQUSED_K: f"2\n+{MAX + 1}\n4\n"}, [],
     f"seqused_k.txt:2:1: +{MAX + 1} is outside 0..{MAX} (a count of tokens)"),
    ("two-values", "txt", {}, {CU_SEQLENS_Q: "0 2\n5\n9\n"}, [],
     "cu_seqlens_q.txt:1: extra values: 2 values on this row, expected 1; HINT: a ragged or truncated row"),
    ("blank-line", "txt", {}, {CU_SEQLENS_Q: "0\n\n2\n5\n9\n"}, [],
     "cu_seqlens_q.txt:2: blank line inside the matrix; HINT: one matrix row per line, no empty lines"),
    ("empty", "txt", {}, {CU_SEQLENS_Q: "# nothing\n"}, [], "cu_seqlens_q.txt: empty file: no matrix rows"),
    ("non-ascii", "txt", {}, {CU_SEQLENS_Q: "0\n2\n5\xe9\n9\n"}, [],
     "cu_seqlens_q.txt: not a text file (non-ASCII byte at offset 5); HINT: is it a .npy file with the wrong "
     "extension?"),
    # The offsets' rules.
    ("k-count", "txt", {}, {CU_SEQLENS_K: "0\n3\n6\n"}, [],
     "cu_seqlens_k.txt: cu_seqlens_k has 3 offsets, cu_seqlens_q 4: both need B + 1 for B sequences"),
    ("start", "txt", {}, {CU_SEQLENS_Q: "1\n2\n5\n9\n"}, [], "cu_seqlens_q.txt: cu_seqlens_q must start at 0, got 1"),
    ("decrease", "txt", {}, {CU_SEQLENS_K: "0\n6\n3\n10\n"}, [],
     "cu_seqlens_k.txt: cu_seqlens_k must not decrease: offset 2 is 3 after 6"),
    ("used-beyond-slot", "txt", {}, {SEQUSED_K: "2\n4\n4\n"}, [],
     "seqused_k.txt: seqused_k[1] = 4 is outside 0..3 (sequence 1's key slot)"),
    ("used-count", "txt", {}, {SEQUSED_K: "2\n3\n"}, [], "seqused_k.txt: seqused_k has 2 values for 3 sequences"),
    # .npy values.
    ("npy-1d", "npy", {}, {CU_SEQLENS_Q: np.array([0, 2, 5, 9], np.int32)}, [],
     "cu_seqlens_q.npy: shape (4,), expected a column (rows, 1); HINT: save arr.reshape(-1, 1)"),
    ("npy-2-columns", "npy", {}, {CU_SEQLENS_Q: np.array([[0, 2], [5, 9]], np.int32)}, [],
     "cu_seqlens_q.npy: shape (2, 2), expected a column (rows, 1); HINT: save arr.reshape(-1, 1)"),
    ("npy-float64", "npy", {}, {CU_SEQLENS_Q: col([0, 2, 5, 9], np.float64)}, [],
     "cu_seqlens_q.npy: dtype '<f8', expected an integer type or float32 holding whole numbers; HINT: save with "
     "arr.astype(np.int32)"),
    ("npy-big-endian", "npy", {}, {CU_SEQLENS_Q: col([0, 2, 5, 9], ">i4")}, [], "cu_seqlens_q.npy: dtype '>i4', expected"),
    ("npy-2.5", "npy", {}, {CU_SEQLENS_Q: col([0, 2.5, 5, 9], np.float32)}, [],
     "cu_seqlens_q.npy:row 1, col 0: not an integer: 2.5"),
    ("npy-nan", "npy", {}, {CU_SEQLENS_Q: col([0, 2, 5, np.nan], np.float32)}, [],
     "cu_seqlens_q.npy:row 3, col 0: not an integer: nan"),
    ("npy-float-huge", "npy", {}, {CU_SEQLENS_Q: col([0, 2, 5, 1e20], np.float32)}, [],
     f"cu_seqlens_q.npy:row 3, col 0: 100000002004087734272 is outside 0..{MAX} (a count of tokens)"),
    ("npy-negative", "npy", {}, {CU_SEQLENS_K: col([0, -2, 6, 10], np.int8)}, [],
     f"cu_seqlens_k.npy:row 1, col 0: -2 is outside 0..{MAX} (a count of tokens)"),
    ("npy-uint64-huge", "npy", {}, {SEQUSED_K: col([2, 2**64 - 1, 4], np.uint64)}, [],
     f"seqused_k.npy:row 1, col 0: 18446744073709551615 is outside 0..{MAX} (a count of tokens)"),
    # Accepted.
    ("good-txt", "txt", {}, {CU_SEQLENS_Q: "# offsets\n+0\n 2\n005\n9\t\n\n"}, [], None),
    ("good-no-manifest", "txt", NO_MANIFEST, {}, [], None),
    ("good-causal-no-seqused", "txt", {"causal": "true"}, {SEQUSED_K: None}, ["--align", "bottom-right"], None),
    ("good-npy-float32-uint8", "npy", {}, {CU_SEQLENS_Q: col([0, 2, 5, 9], np.float32),
                                           SEQUSED_K: col([2, 0, 4], np.uint8)}, [], None),
]


def write_case(folder: Path, fmt: str, manifest, files: Dict[str, object], generated: bool = False) -> Path:
    """The packed case (unless `generated`: one in `folder` already) with the manifest and files edited."""
    if not generated:
        r = invoke("generate", "--out", folder, "--heads", HEADS, "--d-k", D, "--d-v", D, "--format", fmt,
                   "--seqlens", "2,3,4", "--seqlens-k", "3,3,4", "--seqused-k", "2,3,4")
        assert r.exit_code == 0, r.output
    if manifest == NO_MANIFEST:
        (folder / INPUT_MANIFEST).unlink()
    else:
        lines = [ln for ln in (folder / INPUT_MANIFEST).read_text().splitlines()
                 if ln.partition(" =")[0] not in manifest]
        lines += [f"{k} = {v}" for k, v in manifest.items() if v is not None]
        (folder / INPUT_MANIFEST).write_text("\n".join(lines) + "\n")
    for name, value in files.items():
        path = folder / (name if "." in name else f"{name}.{fmt}")
        if value is None:
            path.unlink()
        elif isinstance(value, str):
            path.write_bytes(value.encode("latin1"))
        else:
            np.save(path, value)
    return folder


@pytest.mark.parametrize("fmt, manifest, files, options, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_the_binary_and_the_check_refuse_and_accept_the_same_packed_cases(binary, tmp_path, fmt, manifest, files,
                                                                           options, words):
    case = write_case(tmp_path / "case", fmt, manifest, files)
    _both_readers(binary, tmp_path, case, options, words)


def _both_readers(binary, tmp_path: Path, case: Path, options: list, words: Optional[str]) -> None:
    """The binary runs the case and check checks it (the binary's run, or a stand-in output when
    it refused): both refuse it in the same words (`words`, after "{case}/") or both accept it."""
    out = tmp_path / "out"
    ran = subprocess.run([str(binary), "--in", str(case), "--out", str(out), "--backend", "cpu", *options],
                         capture_output=True, text=True, timeout=300)
    stand_in = tmp_path / "stand_in"
    if ran.returncode != 0:  # a program's output without run.toml: the refusal must come from the case
        write_heads(stand_in, {OUTPUT: [np.zeros((TOTAL_Q, D))] * HEADS})
    checked = invoke("check", "--in", case, "--out", out if ran.returncode == 0 else stand_in, *options)
    assert_same_verdict(ran, checked, out, case, words)


def test_dropout_on_the_command_line_is_refused_for_a_packed_case(binary, tmp_path):
    """--dropout: the binary names the option, the check the run it checks; the same words after."""
    case = write_case(tmp_path / "case", "txt", {}, {})
    words = "dropout is not supported with packed sequences; HINT: " + VARIANTS_HINT
    ran = subprocess.run([str(binary), "--in", str(case), "--out", str(tmp_path / "refused"), "--backend", "cpu",
                          "--dropout", "0.5"], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 2 and not (tmp_path / "refused").exists(), ran.stderr
    assert binary_line(ran.stderr) == "--dropout 0.5: " + words
    out = tmp_path / "out"
    assert subprocess.run([str(binary), "--in", str(case), "--out", str(out), "--backend", "cpu"],
                          capture_output=True, text=True, timeout=300).returncode == 0
    checked = invoke("check", "--in", case, "--out", out, "--dropout", "0.5")
    assert checked.exit_code == 2 and f"{out}: {words}" in checked.output, checked.output


# ----------------------------------------------------------------------------------------------
# Paged folders (docs/contract.md, "Paged KV caches"): the same 3 sequences of 2, 3, 4 queries
# reading 10, 3, 20 keys from a pool of pages of 4 keys (12 pages: 48 rows), through block_table.

PAGE = 4
PAGED_HINT = "add page_size = P (the keys a page holds) to the manifest, or remove the file"
SIZE_HINT = "write a manifest.toml with sequences = B and page_size = P (attnstep check also takes --page-size P)"
BACKWARD_HINT = "a paged case is forward only; check the backward pass on a packed case"
TABLE = "0 1 2 -1 -1\n3 -1 -1 -1 -1\n4 5 6 7 8\n"
INT32 = "-2147483648..2147483647 (a block_table entry, an int32)"

PAGED_CASES: List[Tuple[str, str, object, Dict[str, object], list, Optional[str]]] = [
    ("page_size-0", "txt", {"page_size": 0}, {}, [],
     f"manifest.toml: page_size = 0: the keys a page holds must be in 1..{MAX}"),
    ("page_size-unpacked", "txt", {"sequences": None}, {}, [],
     "manifest.toml: page_size = 4 without sequences = B: a paged case is a packed case"),
    ("not-paged", "txt", {"page_size": None}, {CU_SEQLENS_K: "0\n10\n13\n33\n"}, [],
     "block_table.txt: exists but the case is not paged (no page_size = P in manifest.toml); HINT: " + PAGED_HINT),
    ("cu_seqlens_k", "txt", {}, {CU_SEQLENS_K: "0\n10\n13\n33\n"}, [],
     "cu_seqlens_k.txt: a paged case (block_table.txt) reads its keys through block_table, not cu_seqlens_k; "
     "HINT: remove cu_seqlens_k, or block_table for a case without pages"),
    ("no-manifest", "txt", NO_MANIFEST, {}, [],
     "block_table.txt: a paged case needs its page size, and there is no manifest to say page_size = P; HINT: "
     + SIZE_HINT),
    ("missing-block_table", "txt", {}, {BLOCK_TABLE: None}, [],
     "block_table.txt: missing file (manifest.toml says page_size = 4)"),
    ("missing-seqused_k", "txt", {}, {SEQUSED_K: None}, [],
     "seqused_k.txt: missing file (a paged case has seqused_k: the keys each sequence reads)"),
    ("seq_k-46", "txt", {"seq_k": 46}, {}, [],
     "manifest.toml: seq_k = 46, not a multiple of page_size = 4 (K and V hold the pool of pages)"),
    ("mask", "txt", {"mask": '"broadcast"'}, {}, [],
     'manifest.toml: mask = "broadcast": mask files are not supported with packed sequences; HINT: ' + VARIANTS_HINT),
    ("outside", "txt", {}, {BLOCK_TABLE: "0 1 12 -1 -1\n3 -1 -1 -1 -1\n4 5 6 7 8\n"}, [],
     "block_table.txt: block_table[0, 2] = 12 is outside 0..11 (the pool holds 12 pages of 4 keys); sequence 0 "
     "reads it"),
    ("negative-read", "txt", {}, {BLOCK_TABLE: "0 1 2 -1 -1\n-1 -1 -1 -1 -1\n4 5 6 7 8\n"}, [],
     "block_table.txt: block_table[1, 0] = -1 is outside 0..11 (the pool holds 12 pages of 4 keys); sequence 1 "
     "reads it"),
    ("rows", "txt", {}, {BLOCK_TABLE: "0 1 2 -1 -1\n3 -1 -1 -1 -1\n"}, [],
     "block_table.txt: block_table has 2 rows for 3 sequences"),
    ("too-few-pages", "txt", {}, {BLOCK_TABLE: "0 1 2\n3 -1 -1\n4 5 6\n"}, [],
     "seqused_k.txt: seqused_k[2] = 20 is more than the 3 pages of 4 keys a block_table row holds (12)"),
    ("used-count", "txt", {}, {SEQUSED_K: "10\n3\n"}, [], "seqused_k.txt: seqused_k has 2 values for 3 sequences"),
    ("not-an-integer", "txt", {}, {BLOCK_TABLE: "0 1  x -1 -1\n3 -1 -1 -1 -1\n4 5 6 7 8\n"}, [],
     "block_table.txt:1:6: not an integer: 'x'"),
    ("int32", "txt", {}, {BLOCK_TABLE: "0 1 2 -1 -1\n3 -1 -1 -1 3000000000\n4 5 6 7 8\n"}, [],
     f"block_table.txt:2:12: 3000000000 is outside {INT32}"),
    ("ragged", "txt", {}, {BLOCK_TABLE: "0 1 2 -1 -1\n3\n4 5 6 7 8\n"}, [],
     "block_table.txt:2: missing values: 1 value on this row, expected 5; HINT: a ragged or truncated row"),
    ("npy-1d", "npy", {}, {BLOCK_TABLE: np.arange(5, dtype=np.int32)}, [],
     "block_table.npy: shape (5,), expected a matrix (rows, columns); HINT: save a 2-D array"),
    ("npy-2.5", "npy", {}, {BLOCK_TABLE: np.array([[0, 1, 2.5], [3, 0, 0], [4, 5, 6]], np.float32)}, [],
     "block_table.npy:row 0, col 2: not an integer: 2.5"),
    ("npy-int64-huge", "npy", {}, {BLOCK_TABLE: np.array([[0, 1, 2, -1, -2**40], [3, 0, 0, 0, 0], [4, 5, 6, 7, 8]])},
     [], f"block_table.npy:row 0, col 4: -1099511627776 is outside {INT32}"),
    # Accepted.
    ("good-txt", "txt", {}, {BLOCK_TABLE: "# pages\n0 1 2 -1 -7\n3 99 -1 -1 -1\n4 5 6 7 8\n"}, [], None),
    ("good-shared-page", "txt", {}, {BLOCK_TABLE: "4 1 2 -1 -1\n4 -1 -1 -1 -1\n4 5 6 7 8\n"}, [], None),
    ("good-npy-causal", "npy", {"causal": "true"}, {BLOCK_TABLE: np.array([[0, 1, 2, -1, -1], [3, -1, -1, -1, -1],
                                                                          [4, 5, 6, 7, 8]], np.int64)},
     ["--align", "bottom-right"], None),
]


def write_paged_case(folder: Path, fmt: str, manifest, files: Dict[str, object]) -> Path:
    r = invoke("generate", "--out", folder, "--heads", HEADS, "--d-k", D, "--d-v", D, "--format", fmt,
               "--seqlens", "2,3,4", "--seqlens-k", "10,3,20", "--page-size", PAGE)
    assert r.exit_code == 0, r.output
    (folder / f"{BLOCK_TABLE}.{fmt}").write_text(TABLE) if fmt == "txt" else \
        np.save(folder / f"{BLOCK_TABLE}.npy", np.array([[0, 1, 2, -1, -1], [3, -1, -1, -1, -1], [4, 5, 6, 7, 8]]))
    return write_case(folder, fmt, manifest, files, generated=True)


@pytest.mark.parametrize("fmt, manifest, files, options, words", [c[1:] for c in PAGED_CASES],
                         ids=[c[0] for c in PAGED_CASES])
def test_the_binary_and_the_check_refuse_and_accept_the_same_paged_cases(binary, tmp_path, fmt, manifest, files,
                                                                          options, words):
    case = write_paged_case(tmp_path / "case", fmt, manifest, files)
    _both_readers(binary, tmp_path, case, options, words)


def test_a_paged_case_with_do_is_refused_by_both(binary, tmp_path):
    case = write_paged_case(tmp_path / "case", "txt", {}, {})
    for h in range(HEADS):
        np.savetxt(case / f"dO_head_{h}.txt", np.ones((TOTAL_Q, D)))
    _both_readers(binary, tmp_path, case, [], "dO_head_0.txt: the backward pass is not supported with paged KV "
                                             "caches; HINT: " + BACKWARD_HINT)


def test_check_page_size_reads_a_paged_folder_without_a_manifest(binary, tmp_path):
    """Another program's paged folder has no manifest: check --page-size P gives the page size, and
    must agree with a manifest where there is one."""
    case = write_paged_case(tmp_path / "case", "txt", {}, {})
    out = tmp_path / "out"
    assert subprocess.run([str(binary), "--in", str(case), "--out", str(out), "--backend", "cpu"],
                          capture_output=True, text=True, timeout=300).returncode == 0
    wrong = invoke("check", "--in", case, "--out", out, "--page-size", 8)
    assert wrong.exit_code == 2 and "--page-size 8: " in wrong.output and "page_size = 4" in wrong.output, wrong.output
    (case / INPUT_MANIFEST).unlink()
    for f in out.glob("run.toml"):
        f.unlink()
    refused = invoke("check", "--in", case, "--out", out)
    assert refused.exit_code == 2 and "a paged case needs its page size" in refused.output, refused.output
    checked = invoke("check", "--in", case, "--out", out, "--page-size", PAGE)
    assert checked.exit_code == 0, checked.output
