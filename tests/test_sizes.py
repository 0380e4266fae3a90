"""Sizes before work: generate refuses a case that cannot fit on its disk, check one that cannot fit
in memory, both in one line before they start; an .npy file is sized from its header before it is
loaded; the Python API validates its arguments as the command line does."""
from __future__ import annotations

import io
import os
import re
import resource
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import attnstep
from verify.check.pool import head_jobs
from verify.check.sizing import NO_MEMORY_EXIT, head_bytes
from verify.cli.group import cli
from verify.files.case import CaseError, load_input_case, matrix_bytes, read_matrix
from verify.files.generate import DISTRIBUTIONS, MAX_CASE_FILES, case_size, generate_case
from verify.files.outputs import open_run
from verify.files.stage_files import StageSource
from verify.stages import Dims
from verify.stages import GENERATE_STAGING_PREFIX

REPO = Path(__file__).resolve().parent.parent
f32 = np.float32


def _one_line_error(result, code=2):
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    return lines[0]


def _fake_statvfs(free_blocks=1 << 40, free_inodes=1 << 40, inodes_reported=True, block=4096):
    return lambda _path: types.SimpleNamespace(f_bavail=free_blocks, f_frsize=block, f_bsize=block,
                                               f_files=free_inodes if inodes_reported else 0,
                                               f_favail=free_inodes if inodes_reported else 0)


# ---- generate: files, bytes and inodes before the first file ----------------------------------

def test_generate_refuses_more_files_than_its_limit_before_writing(runner, tmp_path):
    out = tmp_path / "c"
    res = runner.invoke(cli, ["generate", "--out", str(out), "--heads", "16777216", "--seq-q", "1", "--seq-k", "1",
                              "--d-k", "1", "--d-v", "1"])
    line = _one_line_error(res)
    assert "50,331,649 files" in line and f"{MAX_CASE_FILES:,}" in line and "HINT: fewer heads" in line
    assert not out.exists()
    heads = MAX_CASE_FILES // 3 + 1  # one file over, in either format
    for fmt in ("txt", "npy"):
        res = runner.invoke(cli, ["generate", "--out", str(out), "--heads", str(heads), "--seq-q", "1", "--seq-k", "1",
                                  "--d-k", "1", "--d-v", "1", "--format", fmt])
        assert "fewer heads" in _one_line_error(res) and not out.exists()


def test_generate_refuses_a_case_larger_than_the_free_disk_space(runner, tmp_path, monkeypatch):
    out = tmp_path / "c"
    monkeypatch.setattr(os, "statvfs", _fake_statvfs(free_blocks=10))
    line = _one_line_error(runner.invoke(cli, ["generate", "--out", str(out)]))
    assert "disk space" in line and "0.0 MiB free" in line and "HINT" in line
    assert not out.exists()
    # into an existing folder: nothing written there either
    out.mkdir()
    _one_line_error(runner.invoke(cli, ["generate", "--out", str(out), "--format", "npy"]))
    assert list(out.iterdir()) == []


def test_generate_refuses_a_case_of_more_files_than_free_inodes(runner, tmp_path, monkeypatch):
    out = tmp_path / "c"
    monkeypatch.setattr(os, "statvfs", _fake_statvfs(free_inodes=20))  # the default case: 36 files
    line = _one_line_error(runner.invoke(cli, ["generate", "--out", str(out)]))
    assert "38 files" in line and "room for 20" in line and not out.exists()
    # a file system that reports no inode counts (f_files 0, as btrfs) is not held to them
    monkeypatch.setattr(os, "statvfs", _fake_statvfs(free_inodes=0, inodes_reported=False))
    assert runner.invoke(cli, ["generate", "--out", str(out)]).exit_code == 0


@pytest.mark.parametrize("fmt", ["txt", "npy"])
@pytest.mark.parametrize("distribution", sorted(DISTRIBUTIONS))
def test_the_size_estimate_holds_what_generate_writes_and_not_much_more(tmp_path, fmt, distribution):
    dims = Dims(batch=2, heads=1, seq_q=64, seq_k=33, d_k=24, d_v=40)
    generate_case(tmp_path, dims, fmt=fmt, distribution=distribution, backward=True, seed=5)
    written = sum(p.stat().st_size for p in tmp_path.iterdir())
    need = case_size(dims, fmt, backward=True)
    assert need.files == len(list(tmp_path.iterdir()))
    assert written <= need.bytes <= 1.5 * written


def test_generate_removes_the_staging_folders_of_dead_generations_only(runner, tmp_path):
    out = tmp_path / "c"
    out.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()  # reaped: its pid names no process now
    live = subprocess.Popen(["sleep", "60"])
    try:
        for pid in (dead.pid, live.pid, os.getppid()):
            (out / f"{GENERATE_STAGING_PREFIX}{pid}").mkdir(exist_ok=True)
            (out / f"{GENERATE_STAGING_PREFIX}{pid}" / "Q_head_0.txt").write_text("1\n")
        res = runner.invoke(cli, ["generate", "--out", str(out), "--heads", "1", "--seq-q", "2", "--seq-k", "2",
                                  "--d-k", "2", "--d-v", "2"])
        assert res.exit_code == 0, res.output
        assert not (out / f"{GENERATE_STAGING_PREFIX}{dead.pid}").exists()
        assert (out / f"{GENERATE_STAGING_PREFIX}{live.pid}" / "Q_head_0.txt").exists()
        assert (out / f"{GENERATE_STAGING_PREFIX}{os.getppid()}").exists()
    finally:
        live.kill()
        live.wait()


# ---- check: memory before work ----------------------------------------------------------------

def _output_only_run(root: Path, heads: int, n: int, m: int) -> tuple:
    """An input case and an output folder holding only the `output` stage (N x 1): the check still
    computes the N x M reference chain."""
    generate_case(root / "in", Dims(1, heads, n, m, 1, 1), fmt="npy")
    (root / "out").mkdir()
    for i in range(heads):
        np.save(root / "out" / f"output_head_{i}.npy", np.zeros((n, 1), f32))
    return root / "in", root / "out"


def _limited(limit_bytes: int):
    """preexec_fn: an address-space limit, so that an allocation beyond it is a MemoryError rather
    than the machine's out-of-memory killer."""
    return lambda: resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))


def _attnstep(args, limit_bytes, prelude=""):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    code = prelude + "from verify.cli.group import main; main()"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=120, preexec_fn=_limited(limit_bytes))


def test_check_refuses_a_head_larger_than_memory_before_starting(tmp_path):
    """N = 65536, M = 65537 is within the documented limits; one head's float64 N x M matrices are
    34 GB each. Under a 2 GiB address space, starting would end in a MemoryError."""
    in_dir, out_dir = _output_only_run(tmp_path, 1, 65536, 65537)
    res = _attnstep(["check", "--in", in_dir, "--out", out_dir], 2 << 30)
    assert res.returncode == NO_MEMORY_EXIT, res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "checking one head of 65536 x 65537 scores needs about" in res.stderr and "HINT" in res.stderr


def test_check_max_memory_mb_refuses_or_takes_fewer_jobs(runner, tmp_path):
    in_dir, out_dir = _output_only_run(tmp_path, 4, 300, 200)
    line = _one_line_error(runner.invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir),
                                               "--max-memory-mb", "10"]), NO_MEMORY_EXIT)
    assert "more than the 10.0 MiB of --max-memory-mb 10" in line
    run = open_run(out_dir, load_input_case(in_dir))
    two_heads_mb = -(-2 * head_bytes(run) // (1 << 20))
    if sys.platform == "linux":  # (elsewhere one process checks every head)
        assert head_jobs(run, 4, two_heads_mb) == 2
    res = runner.invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir), "--jobs", "4",
                              "--max-memory-mb", str(two_heads_mb)])
    assert res.exit_code == 1 and "output  0/4" in res.output, res.output  # checked (its zeros fail)


def test_check_out_of_memory_anyway_is_one_line_exit_3(tmp_path):
    """An allocation refused after the estimate let the check start (here: a low ulimit -v that
    the estimate does not know, with the available memory said to be plenty)."""
    in_dir, out_dir = _output_only_run(tmp_path, 1, 4096, 4096)
    plenty = "import verify.check.pool; verify.check.pool._available_memory_bytes = lambda: 1 << 42\n"
    res = _attnstep(["check", "--in", in_dir, "--out", out_dir, "--jobs", "1"], 600 << 20, plenty)
    assert res.returncode == NO_MEMORY_EXIT, res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "out of memory while checking the stages; HINT:" in res.stderr and "--max-memory-mb" in res.stderr


# ---- .npy files sized from their header -------------------------------------------------------

def _npy_declaring(shape, data: bytes = b"\0" * 16) -> bytes:
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": shape})
    return header.getvalue() + data


def _npz_bytes() -> bytes:
    buf = io.BytesIO()
    np.savez(buf, a=np.zeros((2, 2), f32))
    return buf.getvalue()


def test_an_npy_input_declaring_more_data_than_it_holds_is_refused_unloaded(tmp_path):
    path = tmp_path / "Q_head_0.npy"
    path.write_bytes(_npy_declaring((10**9, 10**9)))
    with pytest.raises(CaseError, match=r"header declares shape \(1000000000, 1000000000\) .* holds 16 bytes"):
        read_matrix(path)
    path.write_bytes(_npy_declaring((4, 2), b"\0" * 28))  # truncated: 4 bytes short
    with pytest.raises(CaseError, match="32 bytes of data, but the file holds 28 bytes"):
        read_matrix(path)


def test_an_npz_archive_under_an_npy_name_is_named(tmp_path):
    path = tmp_path / "Q_head_0.npy"
    path.write_bytes(_npz_bytes())
    with pytest.raises(CaseError, match="an .npz archive, not an .npy file"):
        read_matrix(path)


@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("content", ["huge", "npz", "extra"])
def test_stage_npy_files_are_sized_from_their_header_before_loading(tmp_path, per_head, content):
    dims = Dims(1, 1, 3, 2, 4, 4)
    data = {"huge": _npy_declaring((10**9, 10**9)), "npz": _npz_bytes(),
            "extra": matrix_bytes(np.zeros((3, 4), f32), "npy") + b"\0" * 8}[content]
    name = "output_head_{i}.npy" if per_head else "output.npy"
    (tmp_path / name.format(i=0)).write_bytes(data)
    words = {"huge": "header declares shape", "npz": "an .npz archive, not an .npy file",
             "extra": "8 bytes after the array data"}[content]
    with pytest.raises(CaseError, match=words):
        StageSource("output", tmp_path, name).read(0, dims)


@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("array, words", [
    (np.full((3000, 4), 0.5, dtype=object), "holds Python objects (dtype '|O': a pickled array)"),
    (np.zeros((3000, 4), np.complex128), "dtype complex128, expected float32, float64 or float16; HINT: "),
    (np.zeros((2, 3000, 4), f32), "is more than a npy matrix of 3 x 4 values may take"),
], ids=["pickled", "complex", "another-layout"])
def test_a_stage_npy_too_large_says_what_it_holds_where_that_is_sure(tmp_path, per_head, array, words):
    """Python objects and a dtype a stage file never takes are named from the header; its shape is
    not (stacked heads may be 3-d, an N x 1 stage a vector), so a large file of another layout keeps
    the size's refusal."""
    name = "output_head_{i}.npy" if per_head else "output.npy"
    np.save(tmp_path / name.format(i=0), array, allow_pickle=True)
    with pytest.raises(CaseError) as exc:
        StageSource("output", tmp_path, name).read(0, Dims(1, 1, 3, 2, 4, 4))
    assert words in str(exc.value), exc.value


def test_a_transposed_stage_file_is_named_as_such(runner, tmp_path):
    """A program that wrote N x d as d x N (a column-major write) is told so; another wrong shape is
    only a wrong shape."""
    generate_case(tmp_path / "in", Dims(1, 2, 6, 5, 4, 3), fmt="npy")
    (tmp_path / "out").mkdir()
    np.save(tmp_path / "out" / "output_head_0.npy", np.zeros((3, 6), f32))
    np.save(tmp_path / "out" / "output_head_1.npy", np.zeros((6, 2), f32))
    res = runner.invoke(cli, ["check", "--in", str(tmp_path / "in"), "--out", str(tmp_path / "out"), "--per-head"])
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    assert "output_head_0.npy is 3x6, expected 6x3 (NxDV); it is the transpose (written column-major?)" in res.output
    assert "output_head_1.npy is 6x2, expected 6x3 (NxDV)\n" in res.output, res.output


def test_a_g_text_output_with_a_number_past_float64_is_named_an_overflow(runner, tmp_path):
    """Another program's `%g` text, no run.toml: a value printed as 1e400 is no infinity to judge
    but an overflow of float32, placed by line and character column."""
    generate_case(tmp_path / "in", Dims(1, 1, 3, 5, 4, 2), fmt="txt")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "output_head_0.txt").write_text("0.5 0.25\n0.125 1e400\n1 2\n")
    res = runner.invoke(cli, ["check", "--in", str(tmp_path / "in"), "--out", str(tmp_path / "out")])
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    assert "output_head_0.txt:2:7: value '1e400' overflows float32" in res.output, res.output


def test_check_reports_a_huge_or_npz_stage_file_as_unreadable(runner, tmp_path):
    in_dir, out_dir = _output_only_run(tmp_path, 2, 3, 2)
    (out_dir / "output_head_0.npy").write_bytes(_npy_declaring((10**9, 10**9)))
    (out_dir / "output_head_1.npy").write_bytes(_npz_bytes())
    res = runner.invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir), "--per-head"])
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    assert "header declares shape" in res.output and "an .npz archive" in res.output


# ---- the Python API validates as the command line does ----------------------------------------

def _case():
    rng = np.random.default_rng(3)
    q, k, v = (rng.random(s, dtype=f32) for s in ((4, 16), (5, 16), (5, 16)))
    p = np.exp((q.astype(np.float64) @ k.T.astype(np.float64)) * 0.25)
    return q, k, v, {"output": (p / p.sum(1, keepdims=True)) @ v.astype(np.float64)}


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(causal="no"), TypeError, "causal: expected True or False, got str 'no'"),
    (dict(causal=1), TypeError, "causal: expected True or False"),
    (dict(scale=True), TypeError, "scale: expected a number, got bool True"),
    (dict(scale="0.25"), TypeError, "scale: expected a number, got str '0.25'"),
    (dict(scale=0.0), ValueError, "scale = 0.0: must be finite and non-zero"),
    (dict(scale=float("inf")), ValueError, "scale = inf"),
    (dict(atol=-1), ValueError, "atol = -1: a tolerance must be finite and >= 0"),
    (dict(rtol=float("nan")), ValueError, "rtol = nan: a tolerance must be finite and >= 0"),
    (dict(atol="0.1"), TypeError, "atol: expected a number"),
    (dict(jobs=-1), ValueError, "jobs = -1: expected 0"),
    (dict(jobs=2.0), TypeError, "jobs: expected a whole number"),
    (dict(jobs=True), TypeError, "jobs: expected a whole number"),
    (dict(precision="fp64"), ValueError, "precision 'fp64': expected one of fp32, tf32, bf16, fp16"),
    (dict(precision=None), TypeError, "precision: expected one of"),
    (dict(math="slow"), ValueError, "math 'slow': expected one of ieee, fast"),
    (dict(allow_nonfinite="yes"), TypeError, "allow_nonfinite: expected True or False"),
    (dict(atol=10**400), ValueError, "atol: a number beyond a float's range"),
    (dict(scale=-10**5000), ValueError, "scale: a number beyond a float's range"),
])
def test_the_python_api_refuses_bad_arguments_in_one_line(kwargs, error, words):
    q, k, v, stages = _case()
    with pytest.raises(error) as exc:
        attnstep.check_arrays(q, k, v, stages, **kwargs)
    assert words in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize("change, words", [
    (lambda a: {**a, "q": [[0.0], [1.0, 2.0]]}, "q: cannot be read as an array of values"),
    (lambda a: {**a, "stages": {"output": [[0.0], [1.0, 2.0]]}}, "output: cannot be read as an array of values"),
    (lambda a: {**a, "attn_mask": [[1], [1, 0]]}, "attn_mask: cannot be read as an array of values"),
    (lambda a: {**a, "q": np.zeros((0, 16), f32)}, "q is (0, 16): every axis needs at least one element"),
    (lambda a: {**a, "k": np.zeros((0, 5, 16), f32), "v": np.zeros((0, 5, 16), f32), "q": a["q"][None]},
     "k is (0, 5, 16): every axis needs at least one element"),
], ids=["ragged-q", "ragged-stage", "ragged-mask", "no-rows", "no-kv-heads"])
def test_the_python_api_names_an_argument_that_is_no_array(change, words):
    """Lists of unequal rows, or an axis of length 0: ValueError naming the argument, one line."""
    q, k, v, stages = _case()
    a = change({"q": q, "k": k, "v": v, "stages": stages})
    with pytest.raises(ValueError) as exc:
        attnstep.check_arrays(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("stages"), **a)
    assert words in str(exc.value) and "\n" not in str(exc.value)


def test_the_python_api_wants_stages_as_a_mapping():
    q, k, v, stages = _case()
    with pytest.raises(TypeError, match="stages: expected a mapping of stage name to array"):
        attnstep.check_arrays(q, k, v, [stages["output"]])


def test_the_python_api_takes_numpy_scalars_and_big_endian_arrays():
    q, k, v, stages = _case()
    report = attnstep.check_arrays(q.astype(">f4"), k.astype(">f8"), v.astype(">f4"),
                                   {"output": stages["output"].astype(">f8")}, causal=np.bool_(False),
                                   scale=np.float32(0.25), atol=np.float64(1e-5), jobs=np.int64(1),
                                   allow_nonfinite=np.bool_(False))
    assert report.passed


@pytest.mark.parametrize("dtype, words", [(np.int32, "dtype int32 (integer)"),
                                          (np.complex64, "dtype complex64 (complex)"),
                                          (object, "dtype object (Python objects)")])
def test_the_python_api_names_a_dtype_it_cannot_take(dtype, words):
    q, k, v, stages = _case()
    with pytest.raises(ValueError, match=rf"output: {re.escape(words)}"):
        attnstep.check_arrays(q, k, v, {"output": stages["output"].astype(dtype)})
    with pytest.raises(ValueError, match=rf"q: {re.escape(words)}"):
        attnstep.check_arrays(q.astype(dtype), k, v, stages)

