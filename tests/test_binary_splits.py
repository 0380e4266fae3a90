"""The binary's split-KV stages (flash-decoding), run as a subprocess on the CPU backend: with
`--split-size K` a run also writes, per query head and split s = 0..S-1,
`split_output_head_{i}_split_{s}` (N × d_v: split s's keys [s·K, (s+1)·K) that the row sees, the
softmax normalised by the split's own sum) and `split_lse_head_{i}_split_{s}` (N × 1), both float32 at
every precision, S = ceil(M / K) (a packed case: ceil(max m(b) / K)); flash_output and flash_lse are
then the combine of the splits. A split a row sees no key of has lse -inf and output 0 exactly.
run.toml records `split_size = K`; a run without it writes no split file. Every refusal is one
`main: error:` line, exit 2, before the output folder is touched.

Everything is compared with NumPy directly (float64 references of each split, the combine in
float64 of the files the binary wrote), not through the verifier.
"""
from __future__ import annotations

import math
import subprocess
import tomllib
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import pytest

from helpers.matrix_files import load, round_bf16, save

from verify.cli.group import cli

D = 16
SPLIT = 16


def write_case(path: Path, N: int, M: int, *, heads: int = 2, kv_heads: int = 1, d: int = D, fmt: str = "txt",
               bf16_inputs: bool = False, backward: bool = False, extra: str = "",
               packed: Optional[Dict[str, Sequence[int]]] = None, seed: int = 0) -> Dict[str, List[np.ndarray]]:
    """A case written with NumPy: Q (and dO) per query head, K and V per K/V head, causal bottom-right;
    `packed` adds cu_seqlens_q, cu_seqlens_k, seqused_k and `sequences`. Returns the inputs."""
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)

    def mats(count, rows):
        out = [rng.standard_normal((rows, d)).astype(np.float32) for _ in range(count)]
        return [round_bf16(a) for a in out] if bf16_inputs else out

    inputs = {"Q": mats(heads, N), "K": mats(kv_heads, M), "V": mats(kv_heads, M)}
    if backward:
        inputs["dO"] = mats(heads, N)
    for name, arrays in inputs.items():
        for i, a in enumerate(arrays):
            save(path / f"{name}_head_{i}.{fmt}", a, fmt)
    manifest = (f"batch = 1\nheads = {heads}\nkv_heads = {kv_heads}\nseq_q = {N}\nseq_k = {M}\nd_k = {d}\n"
                f"d_v = {d}\nformat = \"{fmt}\"\ncausal = true\nalign = \"bottom-right\"\n")
    if backward:
        manifest += "backward = true\n"
    if packed:
        for name, values in packed.items():
            save(path / f"{name}.{fmt}", np.asarray(values, dtype=np.int32).reshape(-1, 1), fmt, integers=True)
        manifest += f"sequences = {len(packed['cu_seqlens_q']) - 1}\n"
    (path / "manifest.toml").write_text(manifest + extra)
    return inputs


def run_cpu(binary, in_dir, out_dir, *extra, backend: str = "cpu"):
    return subprocess.run([str(binary), "--in", str(in_dir), "--out", str(out_dir), "--backend", backend,
                           *map(str, extra)], capture_output=True, text=True, timeout=300)


def run_ok(binary, in_dir, out_dir, *extra, backend: str = "cpu") -> Path:
    proc = run_cpu(binary, in_dir, out_dir, *extra, backend=backend)
    assert proc.returncode == 0, proc.stderr
    return Path(out_dir)


def split_files(out: Path) -> List[str]:
    return sorted(p.name for p in out.glob("split_*"))


def read_splits(out: Path, head: int, S: int, fmt: str):
    """The S split files of one head: outputs (S, N, d) and lse (S, N), as float64."""
    O = np.stack([load(out / f"split_output_head_{head}_split_{s}.{fmt}") for s in range(S)]).astype(np.float64)
    L = np.stack([load(out / f"split_lse_head_{head}_split_{s}.{fmt}")[:, 0] for s in range(S)]).astype(np.float64)
    return O, L


def combine(O: np.ndarray, L: np.ndarray):
    """flash-decoding's combine in float64: lse = log sum_s exp(lse_s), O = sum_s exp(lse_s - lse)·O_s."""
    m = L.max(axis=0)
    safe = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        lse = safe + np.log(np.exp(L - safe).sum(axis=0))
    w = np.where(np.isfinite(L), np.exp(L - np.where(np.isfinite(lse), lse, 0.0)), 0.0)
    return (w[:, :, None] * O).sum(axis=0), lse


def reference_splits(q, k, v, scale: float, S: int, split: int = SPLIT):
    """Each split's float64 attention under the bottom-right causal mask: (S, n, d) outputs and
    (S, n) lse; -inf and 0 where the row sees no key of the split."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    n, m = q.shape[0], k.shape[0]
    scores = scale * q @ k.T
    visible = np.arange(m)[None, :] <= np.arange(n)[:, None] + m - n
    O = np.zeros((S, n, v.shape[1]))
    L = np.full((S, n), -np.inf)
    for s in range(S):
        for r in range(n):
            keys = [c for c in range(s * split, min((s + 1) * split, m)) if visible[r, c]]
            if not keys:
                continue
            x = scores[r, keys]
            mx = x.max()
            e = np.exp(x - mx)
            L[s, r] = mx + math.log(e.sum())
            O[s, r] = e / e.sum() @ v[keys]
    return O, L


def check_split_run(out: Path, inputs, heads: int, kv_heads: int, S: int, fmt: str, rows, keys,
                    out_tol: float, lse_tol: float, combine_rtol: float = 2e-6) -> int:
    """Every head's split files against the float64 references of each (rows, keys) sequence, and
    flash_output / flash_lse against the float64 combine of the written splits (flash_output within
    combine_rtol: the combine's float32 arithmetic, and at bf16 the rounding to the format). Returns
    the number of empty splits seen (each checked to be exactly lse -inf, output 0)."""
    scale = 1.0 / math.sqrt(D)
    empty = 0
    for h in range(heads):
        O, L = read_splits(out, h, S, fmt)
        j = h // (heads // kv_heads)
        for q_rows, k_rows in zip(rows, keys):
            want_O, want_L = reference_splits(inputs["Q"][h][q_rows], inputs["K"][j][k_rows], inputs["V"][j][k_rows],
                                              scale, S)
            got_O, got_L = O[:, q_rows], L[:, q_rows]
            hidden = np.isneginf(want_L)
            empty += int(hidden.sum())
            assert np.array_equal(np.isneginf(got_L), hidden), f"head {h}: the empty splits differ"
            assert (got_O[hidden] == 0).all() and not np.signbit(got_O[hidden]).any(), f"head {h}: output of an empty split"
            np.testing.assert_allclose(got_L[~hidden], want_L[~hidden], rtol=0, atol=lse_tol, err_msg=f"head {h} lse")
            np.testing.assert_allclose(got_O[~hidden], want_O[~hidden], rtol=0, atol=out_tol, err_msg=f"head {h} O")
        flash_O = load(out / f"flash_output_head_{h}.{fmt}").astype(np.float64)
        flash_L = load(out / f"flash_lse_head_{h}.{fmt}")[:, 0].astype(np.float64)
        want_O, want_L = combine(O, L)
        assert np.array_equal(np.isneginf(flash_L), np.isneginf(want_L))
        finite = np.isfinite(want_L)
        np.testing.assert_allclose(flash_L[finite], want_L[finite], rtol=2e-6, atol=1e-6)
        np.testing.assert_allclose(flash_O, want_O, rtol=combine_rtol, atol=1e-6)
    return empty


# The CPU backend, and the CUDA backend's split-KV decode kernel where a GPU is present.
BACKENDS = pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])


def dense_slices(N: int, M: int):
    return [slice(0, N)], [slice(0, M)]


# ---- dense cases ---------------------------------------------------------------------------------

@BACKENDS
def test_dense_fp32_split_files_hold_each_split_and_combine_to_flash_output(binary, tmp_path, backend):
    N, M = 40, 48  # bottom-right: row r sees keys <= r + 8, so rows 0..7 see nothing of splits 1, 2
    inputs = write_case(tmp_path / "in", N, M)
    out = run_ok(binary, tmp_path / "in", tmp_path / "out", "--split-size", SPLIT, backend=backend)
    S = 3
    assert split_files(out) == sorted(f"split_{k}_head_{h}_split_{s}.txt" for k in ("output", "lse")
                                      for h in range(2) for s in range(S))
    for h in range(2):
        for s in range(S):
            assert load(out / f"split_output_head_{h}_split_{s}.txt").shape == (N, D)
            assert load(out / f"split_lse_head_{h}_split_{s}.txt").shape == (N, 1)
    rows, keys = dense_slices(N, M)
    empty = check_split_run(out, inputs, 2, 1, S, "txt", rows, keys, out_tol=2e-6, lse_tol=4e-6)
    assert empty > 0
    run = tomllib.loads((out / "run.toml").read_text())
    assert run["split_size"] == SPLIT
    stages = run["stages"].split(",")
    assert stages.index("split_output") + 1 == stages.index("split_lse") == stages.index("flash_output") - 1
    assert all(f"crc32_split_output_head_{h}_split_{s}" in run for h in range(2) for s in range(S))


@BACKENDS
def test_bf16_split_stages_stay_float32_and_flash_output_is_the_rounded_combine(binary, tmp_path, backend):
    N, M = 33, 70
    inputs = write_case(tmp_path / "in", N, M, fmt="npy", bf16_inputs=True)
    out = run_ok(binary, tmp_path / "in", tmp_path / "out", "--split-size", SPLIT, "--precision", "bf16",
                 backend=backend)
    S = 5  # ceil(70 / 16)
    assert len(split_files(out)) == 2 * 2 * S
    O, _ = read_splits(out, 0, S, "npy")
    assert load(out / "split_output_head_0_split_0.npy").dtype == np.float32
    assert not np.array_equal(O, round_bf16(O.astype(np.float32))), "split_output rounded to bf16"
    flash = load(out / "flash_output_head_0.npy")
    assert np.array_equal(flash, round_bf16(flash)), "flash_output not rounded to bf16"
    rows, keys = dense_slices(N, M)
    # P is rounded to bf16 before P·V, as FlashAttention does: 2^-9 of each weight
    check_split_run(out, inputs, 2, 1, S, "npy", rows, keys, out_tol=2e-2, lse_tol=4e-6, combine_rtol=2.0 ** -8)


def test_a_split_size_past_the_keys_is_one_split(binary, tmp_path):
    inputs = write_case(tmp_path / "in", 5, 20)
    out = run_ok(binary, tmp_path / "in", tmp_path / "out", "--split-size", 1000)
    assert split_files(out) == sorted(f"split_{k}_head_{h}_split_0.txt" for k in ("output", "lse") for h in range(2))
    O, L = read_splits(out, 1, 1, "txt")
    np.testing.assert_allclose(O[0], load(out / "flash_output_head_1.txt"), rtol=0, atol=1e-6)
    np.testing.assert_allclose(L[0], load(out / "flash_lse_head_1.txt")[:, 0], rtol=0, atol=1e-6)
    assert tomllib.loads((out / "run.toml").read_text())["split_size"] == 1000
    assert inputs


# ---- a packed case -------------------------------------------------------------------------------

@BACKENDS
def test_packed_splits_use_the_longest_sequence_and_leave_rows_without_keys_empty(binary, tmp_path, backend):
    cu_q, cu_k, used_k = [0, 3, 5, 9, 11], [0, 40, 52, 92, 100], [40, 10, 33, 0]
    packed = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "seqused_k": used_k}
    inputs = write_case(tmp_path / "in", cu_q[-1], cu_k[-1], packed=packed)
    out = run_ok(binary, tmp_path / "in", tmp_path / "out", "--split-size", SPLIT, backend=backend)
    S = 3  # ceil(max m(b) / 16) = ceil(40 / 16), not ceil(100 / 16)
    assert split_files(out) == sorted(f"split_{k}_head_{h}_split_{s}.txt" for k in ("output", "lse")
                                      for h in range(2) for s in range(S))
    computed = [b for b in range(4) if used_k[b] > 0 and cu_q[b + 1] > cu_q[b]]
    rows = [slice(cu_q[b], cu_q[b + 1]) for b in computed]
    keys = [slice(cu_k[b], cu_k[b] + used_k[b]) for b in computed]
    empty = check_split_run(out, inputs, 2, 1, S, "txt", rows, keys, out_tol=2e-6, lse_tol=4e-6)
    assert empty > 0
    for h in range(2):  # sequence 3 has no keys: its rows see no key of any split
        O, L = read_splits(out, h, S, "txt")
        assert np.isneginf(L[:, 9:11]).all() and (O[:, 9:11] == 0).all()
    assert tomllib.loads((out / "run.toml").read_text())["split_size"] == SPLIT


# ---- what a run writes, and what it refuses ---------------------------------------------------------

def test_a_run_without_split_size_writes_no_split_file_and_replaces_a_split_run(binary, tmp_path):
    write_case(tmp_path / "in", 8, 40)
    out = run_ok(binary, tmp_path / "in", tmp_path / "out", "--split-size", 8)
    assert len(split_files(out)) == 2 * 2 * 5
    run_ok(binary, tmp_path / "in", tmp_path / "out")
    assert split_files(out) == []
    run = tomllib.loads((out / "run.toml").read_text())
    assert "split_size" not in run and "split" not in run["stages"]
    assert (out / "flash_output_head_0.txt").exists()


def test_stage_lists_with_a_split_size(binary, tmp_path):
    write_case(tmp_path / "in", 8, 40)
    out = run_ok(binary, tmp_path / "in", tmp_path / "a", "--split-size", 16, "--stages", "flash_output")
    names = {p.name for p in out.glob("*_head_*")}
    assert names == {"flash_output_head_0.txt", "flash_output_head_1.txt"} | set(split_files(out))
    assert len(split_files(out)) == 2 * 2 * 3
    out = run_ok(binary, tmp_path / "in", tmp_path / "b", "--split-size", 16, "--stages", "split_lse")
    assert {p.name for p in out.glob("*_head_*")} == {f"split_lse_head_{h}_split_{s}.txt" for h in range(2)
                                                     for s in range(3)}


def error_line(proc) -> str:
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("main: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return errors[0]


@pytest.mark.parametrize("value, words", [("0", "is not a positive integer"), ("-3", "is not a positive integer"),
                                          ("x", "is not a positive integer"), ("1.5", "is not a positive integer"),
                                          ("16777217", "exceeds 16777216")])
def test_bad_split_sizes_are_one_line_errors(binary, tmp_path, value, words):
    write_case(tmp_path / "in", 4, 8)
    line = error_line(run_cpu(binary, tmp_path / "in", tmp_path / "out", "--split-size", value))
    assert f"--split-size: '{value}'" in line and words in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, words", [
    (["--split-size", "4", "--stages", "stages"], "--split-size 4: the split stages come with the flash forward"),
    (["--split-size", "4", "--stages", "flash_dQ,dV"], "which --stages flash_dQ,dV does not select"),
    (["--stages", "split_output"], "split_output exists only in a run that splits the keys"),
    (["--stages", "QK,split_lse,split_output"], "split_output,split_lse exist only in a run that splits"),
    (["--split-size", "4", "--dropout", "0.1"], "--split-size 4: the split stages have no dropout"),
])
def test_split_stage_selections_that_cannot_be_are_refused(binary, tmp_path, args, words):
    write_case(tmp_path / "in", 4, 8, backward=True)
    line = error_line(run_cpu(binary, tmp_path / "in", tmp_path / "out", *args))
    assert words in line, line
    assert not (tmp_path / "out").exists()


def test_a_split_size_without_a_flash_head_size_is_refused(binary, tmp_path):
    write_case(tmp_path / "in", 4, 8, d=20)
    line = error_line(run_cpu(binary, tmp_path / "in", tmp_path / "out", "--split-size", "4"))
    assert line.startswith("main: error: --split-size 4: flash stages need d_k = d_v in"), line
    assert not (tmp_path / "out").exists()


def test_a_run_that_does_not_split_names_no_split_stage_it_skips(binary, tmp_path):
    """A head size without flash kernels: the default run leaves the flash stages out, and says so;
    the split stages, written only by a run that splits, are not among them."""
    write_case(tmp_path / "in", 4, 8, d=20)
    proc = run_cpu(binary, tmp_path / "in", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stderr.splitlines() if "skipping" in ln)
    assert line.endswith("skipping flash_output,flash_lse"), line


def test_attnstep_run_passes_the_split_size_on(binary, tmp_path, runner):
    write_case(tmp_path / "in", 6, 30)
    res = runner.invoke(cli, ["run", "--in", str(tmp_path / "in"), "--out", str(tmp_path / "out"), "--backend", "cpu",
                              "--binary", str(binary), "--split-size", "10", "--quiet"])
    assert res.exit_code == 0, res.output
    assert tomllib.loads((tmp_path / "out" / "run.toml").read_text())["split_size"] == 10
    assert len(split_files(tmp_path / "out")) == 2 * 2 * 3
    res = runner.invoke(cli, ["run", "--in", str(tmp_path / "in"), "--binary", str(binary), "--split-size", "0"])
    assert res.exit_code == 2 and "--split-size" in res.output
