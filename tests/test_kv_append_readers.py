"""The binary and the verifier read a decode step's new keys alike (docs/contract.md, "New keys: a
decode step"): each case here is run by the binary (CPU backend) and checked by `attnstep check`;
both refuse it with the same one line after each reader's way of naming the place (the binary adds
the manifest's line and column; its HINT follows on a line of its own), exit status 2 and nothing
written, or both accept it (the check then passes the binary's run).

The cases: 2 query heads sharing one K/V head, width 8, 3 sequences of 2, 1, 3 queries and 2 new
keys each; paged: pages of 4, keys 9, 4, 7 after the step (the cache before: 7, 2, 5; 9 pages, 3 a
row); packed: slots of 6, 4, 8 keys, 2, 1, 3 of them in the cache before the step.
"""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import pytest

from helpers.cli import assert_same_verdict, invoke
from helpers.variants import write_heads
from verify.stages import INPUT_MANIFEST, OUTPUT

HEADS, D, TOTAL_Q = 2, 8, 6
NO_MANIFEST = "no manifest"
MAX = 16777216
NOT_APPENDED_HINT = ("add new_keys = n (the keys appended to each sequence) with sequences = B to the manifest, or "
                     "remove the file")
BACKWARD_HINT = "a decode step is forward only; check the backward pass on a case without new_keys"
PAGED = ["--seqlens", "2,1,3", "--seqlens-k", "9,4,7", "--page-size", "4"]
PACKED = ["--seqlens", "2,1,3", "--seqlens-k", "6,4,8", "--seqused-k", "4,3,5"]
TABLE = "3 1 0\n4 -1 -1\n5 8 -1\n"
POOL = "(the pool holds 9 pages of 4 keys)"

# (id, layout, manifest edits (key -> value, None removes; NO_MANIFEST: none), files (name -> text,
# an array, or None to remove), the words both say after "{case}/"; None when both accept the case).
CASES: List[Tuple[str, list, object, Dict[str, object], Optional[str]]] = [
    ("new_keys-0", PAGED, {"new_keys": 0}, {}, f"manifest.toml: new_keys = 0: the new keys per sequence must be in 1..{MAX}"),
    ("unpacked", PACKED, {"sequences": None}, {},
     "manifest.toml: new_keys = 2 without sequences = B: new keys are appended to a packed case's KV cache"),
    ("not-appended", PAGED, {"new_keys": None}, {},
     "K_new_head_0.txt: exists but the case has no new keys (no new_keys = n in manifest.toml); HINT: "
     + NOT_APPENDED_HINT),
    ("no-manifest", PACKED, NO_MANIFEST, {},
     "K_new_head_0.txt: a case with new keys needs a manifest to say new_keys = n; HINT: write a manifest.toml "
     "with sequences = B and new_keys = n"),
    ("dO", PACKED, {}, {f"dO_head_{h}.txt": ("0 " * D + "\n") * TOTAL_Q for h in range(HEADS)},
     "dO_head_0.txt: the backward pass is not supported with new keys (a decode step); HINT: " + BACKWARD_HINT),
    ("no-seqused_k", PACKED, {}, {"seqused_k.txt": None},
     "seqused_k.txt: missing file (a case with new keys has seqused_k: the keys each sequence's cache holds "
     "before the step)"),
    ("no-room-slot", PACKED, {}, {"seqused_k.txt": "2\n1\n7\n"},
     "seqused_k.txt: seqused_k[2] = 7 with 2 new keys is 9 keys, more than sequence 2's key slot (8)"),
    ("no-room-pages", PAGED, {}, {"seqused_k.txt": "11\n2\n5\n"},
     "seqused_k.txt: seqused_k[0] = 11 with 2 new keys is 13 keys, more than the 3 pages of 4 keys a "
     "block_table row holds (12)"),
    ("page-outside", PAGED, {}, {"seqused_k.txt": "7\n3\n5\n"},
     f"block_table.txt: block_table[1, 1] = -1 is outside 0..8 {POOL}; sequence 1 reads it"),
    ("clash", PAGED, {}, {"block_table.txt": "3 1 0\n1 -1 -1\n5 8 -1\n"},
     "block_table.txt: block_table rows 0 and 1 both write a new key to page 1, slot 3: their new keys would overwrite "
     "each other"),
    ("missing-V_new", PAGED, {}, {"V_new_head_0.txt": None},
     "V_new_head_0.txt: missing file (manifest.toml says new_keys = 2)"),
    ("stray-npy", PAGED, {}, {"K_new_head_0.npy": np.zeros((6, D), np.float32)},
     "K_new_head_0.npy: a .npy file in a .txt case; HINT: a case holds one format; remove the stray file"),
    ("extra-head", PAGED, {}, {"K_new_head_1.txt": ("0 " * D + "\n") * 6},
     "K_new_head_1.txt: unexpected file: the case has 1 K/V head (0..0)"),
    ("good-paged", PAGED, {}, {}, None),
    # a per-sequence or per-split name is no new-key file: both readers leave it alone
    ("seq-named", PAGED, {}, {"K_new_head_0_seq_1.txt": ("0 " * D + "\n") * 2}, None),
    ("split-named", PACKED, {}, {"V_new_head_0_split_1.txt": ("0 " * D + "\n") * 6}, None),
    ("good-packed", PACKED, {}, {}, None),
]


def write_case(folder: Path, layout: list, manifest, files: Dict[str, object]) -> Path:
    r = invoke("generate", "--out", folder, "--heads", HEADS, "--kv-heads", 1, "--d-k", D, "--d-v", D, *layout,
               "--new-keys", 2)
    assert r.exit_code == 0, r.output
    if "block_table.txt" in {p.name for p in folder.iterdir()}:
        (folder / "block_table.txt").write_text(TABLE)
    if manifest == NO_MANIFEST:
        (folder / INPUT_MANIFEST).unlink()
    else:
        lines = [ln for ln in (folder / INPUT_MANIFEST).read_text().splitlines() if ln.partition(" =")[0] not in manifest]
        (folder / INPUT_MANIFEST).write_text("\n".join(lines + [f"{k} = {v}" for k, v in manifest.items()
                                                                if v is not None]) + "\n")
    for name, value in files.items():
        if value is None:
            (folder / name).unlink()
        elif isinstance(value, str):
            (folder / name).write_text(value)
        else:
            np.save(folder / name, value)
    return folder


@pytest.mark.parametrize("layout, manifest, files, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_the_binary_and_the_check_refuse_and_accept_the_same_new_key_cases(binary, tmp_path, layout, manifest, files,
                                                                            words):
    case = write_case(tmp_path / "case", layout, manifest, files)
    out = tmp_path / "out"
    ran = subprocess.run([str(binary), "--in", str(case), "--out", str(out), "--backend", "cpu"],
                         capture_output=True, text=True, timeout=300)
    stand_in = tmp_path / "stand_in"
    if ran.returncode != 0:  # a program's output without run.toml: the refusal must come from the case
        write_heads(stand_in, {OUTPUT: [np.zeros((TOTAL_Q, D))] * HEADS})
    checked = invoke("check", "--in", case, "--out", out if ran.returncode == 0 else stand_in)
    assert_same_verdict(ran, checked, out, case, words)


@pytest.mark.parametrize("text", ["0 0 0\n" * 6, ("0 " * D + "\n") * 5], ids=["columns", "rows"])
def test_a_new_key_file_of_the_wrong_shape_is_refused_before_anything_is_written(binary, tmp_path, text):
    case = write_case(tmp_path / "case", PAGED, {}, {"V_new_head_0.txt": text})
    out = tmp_path / "out"
    ran = subprocess.run([str(binary), "--in", str(case), "--out", str(out), "--backend", "cpu"],
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode == 2 and not out.exists() and f"{case}/V_new_head_0.txt" in ran.stderr, ran.stderr
    stand_in = tmp_path / "stand_in"
    write_heads(stand_in, {OUTPUT: [np.zeros((TOTAL_Q, D))] * HEADS})
    checked = invoke("check", "--in", case, "--out", stand_in)
    assert checked.exit_code == 2 and f"{case}/V_new_head_0.txt" in checked.output, checked.output
