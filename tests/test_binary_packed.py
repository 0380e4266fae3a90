"""The binary's side of packed sequences (docs/contract.md, "Packed sequences"), run as a subprocess on
the CPU backend: a packed case (cu_seqlens_q, cu_seqlens_k, optionally seqused_k, and the manifest's
`sequences`) is computed as one dense problem per sequence, so every stage of a packed run must equal,
bit for bit, the same binary's run of each sequence as a dense case of its own (its rows of Q and dO,
the first m(b) keys of its slot): the stages over the packed tokens at the sequence's rows, the score
stages in their per-sequence files. What no sequence computes is fixed: padding keys' gradients 0,
their K, V and KT as read, a sequence without keys output 0 and lse -inf, one without queries no
gradient. Every refusal of a packed case is one `main: error:` line, exit 2, before the output
folder is touched.

The cases are written here with NumPy directly (not through the generator).
"""
from __future__ import annotations

import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

import numpy as np
import pytest

from helpers.matrix_files import load, round_bf16, save

from verify.sequences import CU_SEQLENS_K, CU_SEQLENS_Q, SEQUENCES_KEY, SEQUSED_K
from verify.stages import RUN_MANIFEST, STAGES, stage_file

# The stages whose shape is N×M: a packed run writes them per sequence.
SCORE_STAGES = tuple(n for n, s in STAGES.items() if (s.rows, s.cols) == ("N", "M") and not s.dropout)
# The stages over the packed tokens, and along which axis each holds a sequence's part.
PACKED_STAGES = tuple(n for n in STAGES if n not in SCORE_STAGES and not STAGES[n].dropout)
GRADIENTS_OF_KEYS = ("dK", "dV", "flash_dK", "flash_dV")


def seq_file(stage: str, head: int, seq: int, fmt: str) -> str:
    return f"{stage}_head_{head}_seq_{seq}.{fmt}"


@dataclass(frozen=True)
class Packed:
    """A packed case: the offsets, the heads and the head width."""
    cu_q: Tuple[int, ...]
    cu_k: Tuple[int, ...]
    used_k: Optional[Tuple[int, ...]] = None
    heads: int = 2
    kv_heads: int = 2
    d: int = 16
    fmt: str = "txt"

    @property
    def count(self) -> int:
        return len(self.cu_q) - 1

    def n(self, b):
        return self.cu_q[b + 1] - self.cu_q[b]

    def m(self, b):
        return self.cu_k[b + 1] - self.cu_k[b] if self.used_k is None else self.used_k[b]

    def q_rows(self, b):
        return slice(self.cu_q[b], self.cu_q[b + 1])

    def k_rows(self, b):
        return slice(self.cu_k[b], self.cu_k[b] + self.m(b))






def dims_text(heads, kv_heads, seq_q, seq_k, d, fmt) -> str:
    return (f"batch = 1\nheads = {heads}\nkv_heads = {kv_heads}\nseq_q = {seq_q}\nseq_k = {seq_k}\nd_k = {d}\n"
            f"d_v = {d}\nformat = \"{fmt}\"\nbackward = true\n")


def write_packed_case(path: Path, case: Packed, extra: str = "", seed: int = 0, manifest: bool = True,
                      offsets_dtype=np.int32):
    """The packed inputs (Q and dO per query head, K and V per K/V head, over the packed tokens), the
    offset files and a manifest with `sequences`; returns the inputs by name."""
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    total_q, total_k, f = case.cu_q[-1], case.cu_k[-1], case.fmt
    inputs = {"Q": [rng.standard_normal((total_q, case.d)).astype(np.float32) for _ in range(case.heads)],
              "dO": [rng.standard_normal((total_q, case.d)).astype(np.float32) for _ in range(case.heads)],
              "K": [rng.standard_normal((total_k, case.d)).astype(np.float32) for _ in range(case.kv_heads)],
              "V": [rng.standard_normal((total_k, case.d)).astype(np.float32) for _ in range(case.kv_heads)]}
    for name, mats in inputs.items():
        for i, a in enumerate(mats):
            save(path / stage_file(name, i, f), a, f)
    columns = {CU_SEQLENS_Q: case.cu_q, CU_SEQLENS_K: case.cu_k, SEQUSED_K: case.used_k}
    for name, values in columns.items():
        if values is not None:
            save(path / f"{name}.{f}", np.asarray(values, dtype=offsets_dtype).reshape(-1, 1), f, integers=True)
    if manifest:
        (path / "manifest.toml").write_text(dims_text(case.heads, case.kv_heads, total_q, total_k, case.d, f) +
                                            f"{SEQUENCES_KEY} = {case.count}\n" + extra)
    return inputs


def write_sequence_case(path: Path, case: Packed, inputs, b: int, extra: str = "") -> None:
    """Sequence b of a packed case as a dense case of its own."""
    path.mkdir(parents=True, exist_ok=True)
    rows = {"Q": case.q_rows(b), "dO": case.q_rows(b), "K": case.k_rows(b), "V": case.k_rows(b)}
    for name, mats in inputs.items():
        for i, a in enumerate(mats):
            save(path / stage_file(name, i, case.fmt), a[rows[name]], case.fmt)
    (path / "manifest.toml").write_text(dims_text(case.heads, case.kv_heads, case.n(b), case.m(b), case.d, case.fmt) +
                                        extra)


def run_cpu(binary, in_dir, out_dir, *extra):
    return subprocess.run([str(binary), "--in", str(in_dir), "--out", str(out_dir), "--backend", "cpu",
                           *map(str, extra)], capture_output=True, text=True, timeout=300)


def run_ok(binary, in_dir, out_dir, *extra) -> Path:
    proc = run_cpu(binary, in_dir, out_dir, *extra)
    assert proc.returncode == 0, proc.stderr
    return Path(out_dir)


def heads_of(stage: str, case: Packed) -> int:
    return case.kv_heads if STAGES[stage].kv else case.heads


def part(stage: str, a: np.ndarray, case: Packed, b: int) -> np.ndarray:
    """Sequence b's part of a stage over the packed tokens."""
    spec = STAGES[stage]
    if spec.rows == "N":
        return a[case.q_rows(b)]
    if spec.rows == "M":
        return a[case.k_rows(b)]
    return a[:, case.k_rows(b)]  # KT: d_k × M


def check_against_sequences(binary, tmp_path: Path, case: Packed, extra: str = "", *args) -> Path:
    """Runs the packed case and every sequence with queries and keys as a dense case; the packed
    run's stages must hold the dense runs' bit for bit. Returns the packed run's folder."""
    inputs = write_packed_case(tmp_path / "packed", case, extra)
    out = run_ok(binary, tmp_path / "packed", tmp_path / "packed_out", *args)
    packed = {(s, i): load(out / stage_file(s, i, case.fmt)) for s in PACKED_STAGES for i in range(heads_of(s, case))
              if (out / stage_file(s, i, case.fmt)).exists()}
    compared = 0
    for b in range(case.count):
        if case.n(b) == 0 or case.m(b) == 0:
            for s in SCORE_STAGES:
                assert not (out / seq_file(s, 0, b, case.fmt)).exists(), (s, b)
            continue
        write_sequence_case(tmp_path / f"seq{b}", case, inputs, b, extra)
        dense = run_ok(binary, tmp_path / f"seq{b}", tmp_path / f"seq{b}_out", *args)
        for (s, i), a in packed.items():
            want = load(dense / stage_file(s, i, case.fmt))
            assert np.array_equal(part(s, a, case, b), want), f"{s} head {i}, sequence {b}"
            compared += 1
        for s in SCORE_STAGES:
            if not (dense / stage_file(s, 0, case.fmt)).exists():
                assert not list(out.glob(f"{s}_head_*")), s
                continue
            for i in range(case.heads):
                got = load(out / seq_file(s, i, b, case.fmt))
                want = load(dense / stage_file(s, i, case.fmt))
                assert got.shape == (case.n(b), case.m(b)) and np.array_equal(got, want, equal_nan=True), \
                    f"{s} head {i}, sequence {b}"
                compared += 1
    assert compared
    check_rows_no_sequence_computes(out, case, inputs, bf16="bf16" in args)
    return out




def check_rows_no_sequence_computes(out: Path, case: Packed, inputs, bf16: bool = False) -> None:
    f = case.fmt
    if bf16:
        inputs = {name: [round_bf16(a) for a in mats] for name, mats in inputs.items()}
    def stage(name, head):
        path = out / stage_file(name, head, f)
        return load(path) if path.exists() else None

    for b in range(case.count):
        slot = slice(case.cu_k[b] + case.m(b), case.cu_k[b + 1])  # padding keys
        keys = slice(case.cu_k[b], case.cu_k[b + 1]) if case.n(b) == 0 else slot
        for j in range(case.kv_heads):
            for s in GRADIENTS_OF_KEYS:
                if (a := stage(s, j)) is not None:
                    assert not a[keys].any(), f"{s} head {j}, sequence {b}"
            for s, want in (("K", inputs["K"][j][slot]), ("V", inputs["V"][j][slot])):
                if (a := stage(s, j)) is not None:
                    assert np.array_equal(a[slot], want), f"{s} head {j}, sequence {b}"
            if (a := stage("KT", j)) is not None:
                assert np.array_equal(a[:, slot], inputs["K"][j][slot].T)
        if case.m(b) == 0 and case.n(b) > 0:
            rows = case.q_rows(b)
            for i in range(case.heads):
                for s in ("output", "flash_output", "D", "dQ", "flash_dQ"):
                    if (a := stage(s, i)) is not None:
                        assert not a[rows].any(), f"{s} head {i}, sequence {b}"
                assert np.all(stage("flash_lse", i)[rows] == -np.inf)


# b0: 5 queries, 7 keys; b1: no queries, 4 keys; b2: 3 queries, no keys; b3: 6 queries, a slot of 9
# with 5 used; b4: 4 queries, 6 keys.
EMPTY_AND_PADDED = Packed(cu_q=(0, 5, 5, 8, 14, 18), cu_k=(0, 7, 11, 11, 20, 26), used_k=(7, 4, 0, 5, 6))
GQA = Packed(cu_q=(0, 9, 10, 23), cu_k=(0, 4, 21, 33), heads=4, kv_heads=2)
VARIANTS = {"plain": "", "causal-bottom-right": 'causal = true\nalign = "bottom-right"\n',
            "causal-top-left": "causal = true\n",
            "window-softcap-alibi": 'window_left = 3\nwindow_right = 1\nsoftcap = 5.0\nalibi = true\n'}


@pytest.mark.parametrize("variant", VARIANTS, ids=list(VARIANTS))
def test_packed_equals_each_sequence_alone(binary, tmp_path, variant):
    check_against_sequences(binary, tmp_path, EMPTY_AND_PADDED, VARIANTS[variant])


def test_grouped_heads_causal_bottom_right(binary, tmp_path):
    check_against_sequences(binary, tmp_path, GQA, VARIANTS["causal-bottom-right"])


def test_npy_case_with_int64_offsets_and_bf16(binary, tmp_path):
    case = Packed(cu_q=(0, 3, 11), cu_k=(0, 8, 12), used_k=(6, 4), fmt="npy")
    check_against_sequences(binary, tmp_path, case, "", "--precision", "bf16")


def test_bottom_right_alignment_is_per_sequence(binary, tmp_path):
    """A sequence of 2 queries and 6 keys, causal bottom-right: its first query sees 5 keys, however
    far into the packing it sits (aligned to the packed totals it would see all of them or none)."""
    case = Packed(cu_q=(0, 7, 9), cu_k=(0, 3, 9), heads=1, kv_heads=1)
    out = check_against_sequences(binary, tmp_path, case, VARIANTS["causal-bottom-right"])
    weights = load(out / seq_file("attention_weights", 0, 1, "txt"))
    assert weights.shape == (2, 6) and (weights[0] > 0).sum() == 5 and (weights[1] > 0).sum() == 6


def test_run_toml_records_sequences_and_every_file(binary, tmp_path):
    write_packed_case(tmp_path / "in", EMPTY_AND_PADDED)
    out = run_ok(binary, tmp_path / "in", tmp_path / "out")
    rec = tomllib.loads((out / RUN_MANIFEST).read_text())
    assert rec[SEQUENCES_KEY] == EMPTY_AND_PADDED.count
    assert (rec["seq_q"], rec["seq_k"], rec["batch"]) == (18, 26, 1)
    files = {p.name for p in out.iterdir() if p.name != RUN_MANIFEST}
    assert files == {name.removeprefix("crc32_") + ".txt" for name in rec if name.startswith("crc32_")}
    computed = [b for b in range(EMPTY_AND_PADDED.count) if EMPTY_AND_PADDED.n(b) and EMPTY_AND_PADDED.m(b)]
    assert computed == [0, 3, 4]
    for s in SCORE_STAGES:
        assert not (out / stage_file(s, 0, "txt")).exists()
        assert {p.name for p in out.glob(f"{s}_head_*_seq_*.txt")} == {
            seq_file(s, i, b, "txt") for i in range(2) for b in computed}
    header = (out / seq_file("QK", 1, 3, "txt")).read_text().splitlines()[0]
    assert header == f"# attnstep stage=QK head=1 seq=3 rows=6 cols=5 run={rec['run_id']}"


def test_a_dense_run_replaces_a_packed_one(binary, tmp_path):
    """The per-sequence files are the run's files: the next run into the folder moves them aside."""
    write_packed_case(tmp_path / "in", EMPTY_AND_PADDED)
    out = run_ok(binary, tmp_path / "in", tmp_path / "out")
    inputs = write_packed_case(tmp_path / "in2", EMPTY_AND_PADDED)
    write_sequence_case(tmp_path / "dense", EMPTY_AND_PADDED, inputs, 0)
    run_ok(binary, tmp_path / "dense", out)
    assert not list(out.glob("*_seq_*")) and list((out / ".attnstep-previous").glob("QK_head_0_seq_0.txt"))


def test_case_without_manifest_is_packed_by_its_files(binary, tmp_path):
    case = Packed(cu_q=(0, 4, 9), cu_k=(0, 6, 8), heads=1, kv_heads=1)
    write_packed_case(tmp_path / "in", case, manifest=False)
    out = run_ok(binary, tmp_path / "in", tmp_path / "out")
    assert tomllib.loads((out / RUN_MANIFEST).read_text())[SEQUENCES_KEY] == 2
    assert load(out / seq_file("QK", 0, 1, "txt")).shape == (5, 2)


def test_flash_stages_only(binary, tmp_path):
    out = check_against_sequences(binary, tmp_path, EMPTY_AND_PADDED, "", "--stages", "flash")
    assert sorted(p.name for p in out.glob("*_head_0.txt")) == [
        f"{s}_head_0.txt" for s in ("flash_dK", "flash_dQ", "flash_dV", "flash_lse", "flash_output")]


# ------------------------------------------------------------------ refusals: one line, exit 2, nothing written
def refused(binary, in_dir: Path, out_dir: Path, *extra) -> str:
    proc = run_cpu(binary, in_dir, out_dir, *extra)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("main: error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert not out_dir.exists(), "a refused run created the output folder"
    return lines[0]


SMALL = Packed(cu_q=(0, 3, 7), cu_k=(0, 5, 9), used_k=None, heads=1, kv_heads=1)


def small(tmp_path: Path, extra: str = "", case: Packed = SMALL, **kw) -> Path:
    write_packed_case(tmp_path / "in", case, extra, **kw)
    return tmp_path / "in"


def replace_line(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


def test_refuses_batch_other_than_1(binary, tmp_path):
    in_dir = small(tmp_path)
    replace_line(in_dir / "manifest.toml", "batch = 1", "batch = 2")
    line = refused(binary, in_dir, tmp_path / "out")
    assert line.endswith("manifest.toml:1:9: batch = 2 with sequences = 2: a packed case has batch = 1 (its "
                         "sequences are the batch)")


@pytest.mark.parametrize("name, words", [
    (CU_SEQLENS_Q, "cu_seqlens_q.txt: ends at 7 (the packed queries), but {case}/manifest.toml says seq_q = 8"),
    (CU_SEQLENS_K, "cu_seqlens_k.txt: ends at 9 (the packed keys), but {case}/manifest.toml says seq_k = 10")])
def test_refuses_totals_other_than_seq_q_and_seq_k(binary, tmp_path, name, words):
    # Inputs and a manifest one token longer than the offsets say.
    longer = Packed(cu_q=(0, 3, 8) if name == CU_SEQLENS_Q else SMALL.cu_q,
                    cu_k=(0, 5, 10) if name == CU_SEQLENS_K else SMALL.cu_k, heads=1, kv_heads=1)
    in_dir = small(tmp_path, case=longer)
    offsets = SMALL.cu_q if name == CU_SEQLENS_Q else SMALL.cu_k
    np.savetxt(in_dir / f"{name}.txt", np.array(offsets).reshape(-1, 1), fmt="%d")
    assert refused(binary, in_dir, tmp_path / "out").endswith(words.format(case=in_dir))


@pytest.mark.parametrize("name", [CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K])
def test_refuses_a_sequence_file_in_a_case_not_packed(binary, tmp_path, name):
    in_dir = small(tmp_path, case=Packed(cu_q=SMALL.cu_q, cu_k=SMALL.cu_k, used_k=(5, 4), heads=1, kv_heads=1))
    replace_line(in_dir / "manifest.toml", f"{SEQUENCES_KEY} = 2\n", "")
    for other in {CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K} - {name}:
        (in_dir / f"{other}.txt").unlink()
    line = refused(binary, in_dir, tmp_path / "out")
    assert line.endswith(f"{name}.txt: exists but the case is not packed (no sequences = B in manifest.toml)")


def test_refuses_a_missing_offsets_file(binary, tmp_path):
    in_dir = small(tmp_path)
    (in_dir / f"{CU_SEQLENS_K}.txt").unlink()
    line = refused(binary, in_dir, tmp_path / "out")
    assert line.endswith(f"{CU_SEQLENS_K}.txt: missing file (manifest.toml says sequences = 2)")


@pytest.mark.parametrize("text, words", [
    ("0\n2.5\n7\n", ":2:1: not an integer: '2.5'"),
    ("0\n3e0\n7\n", ":2:1: not an integer: '3e0'"),
    ("0\n3 4\n7\n", ":2: extra values: 2 values on this row, expected 1"),
    ("0\n99999999999999999999\n7\n", ":2:1: 99999999999999999999 is outside 0..16777216 (a count of tokens)"),
])
def test_refuses_offsets_that_are_not_integers(binary, tmp_path, text, words):
    in_dir = small(tmp_path)
    (in_dir / f"{CU_SEQLENS_Q}.txt").write_text(text)
    line = refused(binary, in_dir, tmp_path / "out")
    assert f"{CU_SEQLENS_Q}.txt{words}" in line


def test_refuses_float32_npy_offsets_that_are_not_integers(binary, tmp_path):
    in_dir = small(tmp_path, case=Packed(cu_q=SMALL.cu_q, cu_k=SMALL.cu_k, heads=1, kv_heads=1, fmt="npy"))
    np.save(in_dir / f"{CU_SEQLENS_K}.npy", np.array([[0], [4.5], [9]], np.float32))
    line = refused(binary, in_dir, tmp_path / "out")
    assert line.endswith(f"{CU_SEQLENS_K}.npy:row 1, col 0: not an integer: 4.5")


def test_accepts_float32_and_uint8_npy_offsets(binary, tmp_path):
    case = Packed(cu_q=SMALL.cu_q, cu_k=SMALL.cu_k, used_k=(5, 2), heads=1, kv_heads=1, fmt="npy")
    in_dir = small(tmp_path, case=case, offsets_dtype=np.float32)
    np.save(in_dir / f"{SEQUSED_K}.npy", np.array([[5], [2]], np.uint8))
    out = run_ok(binary, in_dir, tmp_path / "out")
    assert load(out / seq_file("QK", 0, 1, "npy")).shape == (4, 2)


@pytest.mark.parametrize("files, words", [
    ({CU_SEQLENS_Q: (1, 3, 7)}, "cu_seqlens_q.txt: cu_seqlens_q must start at 0, got 1"),
    ({CU_SEQLENS_K: (0, 5, 4, 9)}, "cu_seqlens_k.txt: cu_seqlens_k has 4 offsets, cu_seqlens_q 3: both need B + 1 "
                                   "for B sequences"),
    ({CU_SEQLENS_Q: (0, 8, 7), CU_SEQLENS_K: (0, 5, 9)},
     "cu_seqlens_q.txt: cu_seqlens_q must not decrease: offset 2 is 7 after 8"),
    ({SEQUSED_K: (5, 5)}, "seqused_k.txt: seqused_k[1] = 5 is outside 0..4 (sequence 1's key slot)"),
    ({SEQUSED_K: (5,)}, "seqused_k.txt: seqused_k has 1 values for 2 sequences"),
    ({CU_SEQLENS_Q: (0, 3, 5, 7)}, "cu_seqlens_q.txt: 4 offsets, but {case}/manifest.toml says sequences = 2, "
                                   "which takes 3 (B + 1)"),
])
def test_refuses_offsets_that_break_the_rules(binary, tmp_path, files, words):
    in_dir = small(tmp_path)
    for name, values in files.items():
        np.savetxt(in_dir / f"{name}.txt", np.array(values).reshape(-1, 1), fmt="%d")
    assert refused(binary, in_dir, tmp_path / "out").endswith(words.format(case=in_dir))


def test_refuses_sequences_below_1(binary, tmp_path):
    in_dir = small(tmp_path)
    replace_line(in_dir / "manifest.toml", f"{SEQUENCES_KEY} = 2", f"{SEQUENCES_KEY} = 0")
    assert refused(binary, in_dir, tmp_path / "out").endswith(
        f"{SEQUENCES_KEY} = 0: the number of sequences must be in 1..16777216")


@pytest.mark.parametrize("name, extra", [("mask", 'mask = "broadcast"\n'), ("bias", 'bias = "per-head"\n')])
def test_refuses_mask_and_bias_files(binary, tmp_path, name, extra):
    in_dir = small(tmp_path, extra)
    n, m = SMALL.cu_q[-1], SMALL.cu_k[-1]
    values = np.ones((n, m), np.float32)
    save(in_dir / (f"{name}.txt" if name == "mask" else f"{name}_head_0.txt"), values, "txt")
    cov = "broadcast" if name == "mask" else "per-head"
    assert refused(binary, in_dir, tmp_path / "out").endswith(
        f'manifest.toml:11:{len(name) + 4}: {name} = "{cov}": {name} files are not supported with packed sequences')


def test_refuses_dropout_from_the_manifest_and_the_command_line(binary, tmp_path):
    in_dir = small(tmp_path, "dropout = 0.25\n")
    assert refused(binary, in_dir, tmp_path / "out").endswith(
        "manifest.toml:11:11: dropout = 0.25: dropout is not supported with packed sequences")
    replace_line(in_dir / "manifest.toml", "dropout = 0.25\n", "")
    assert refused(binary, in_dir, tmp_path / "out", "--dropout", "0.5").endswith(
        "main: error: --dropout 0.5: dropout is not supported with packed sequences")


def test_refuses_an_offsets_file_of_the_other_format(binary, tmp_path):
    in_dir = small(tmp_path)
    np.save(in_dir / f"{SEQUSED_K}.npy", np.array([[5], [4]], np.int64))
    assert refused(binary, in_dir, tmp_path / "out").endswith(f"{SEQUSED_K}.npy: a .npy file in a .txt case")


def test_head_groups_under_a_memory_cap(binary, tmp_path):
    """With --max-memory-mb small enough for one head at a time (the K/V group split over head groups),
    the packed run writes what it writes in one group."""
    case = Packed(cu_q=(0, 300, 500), cu_k=(0, 300, 560), used_k=(300, 250), heads=3, kv_heads=1, d=32)
    write_packed_case(tmp_path / "in", case)
    whole = run_ok(binary, tmp_path / "in", tmp_path / "whole")
    # About 3.5 MiB a head (the packed stages, the largest sequence's 300 x 300 score stages) and 0.5 MiB
    # for the K/V head's sums: 4 MiB holds one head, 3 MiB none.
    proc = run_cpu(binary, tmp_path / "in", tmp_path / "capped", "--max-memory-mb", "4", "--progress")
    assert proc.returncode == 0, proc.stderr
    progress = [ln.split()[-1] for ln in proc.stderr.splitlines() if ln.startswith("main: progress:")]
    done, total = progress[-1].split("/")
    assert done == total
    assert run_cpu(binary, tmp_path / "in", tmp_path / "none", "--max-memory-mb", "3").returncode == 3
    names = sorted(p.name for p in whole.iterdir() if p.name != RUN_MANIFEST)
    assert names == sorted(p.name for p in (tmp_path / "capped").iterdir() if p.name != RUN_MANIFEST)
    for name in names:
        assert np.array_equal(load(whole / name), load(tmp_path / "capped" / name), equal_nan=True), name
