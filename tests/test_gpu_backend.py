"""The CUDA backend, stage by stage, against the CPU backend and the float64 reference (gpu marker).

Every CUDA run uses --poison, so an element a kernel fails to write stays NaN and fails the test.
Shapes: tests/helpers/shapes.py (irregular on purpose) plus rows that take the softmax kernel's other paths
(odd M > 1024, M > 32768: the uncached version) and several flash key tiles.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from verify.check.compare import Options, check
from verify.check.reference import reference_chain
from verify.files.case import read_matrix, write_matrix
from verify.files.generate import generate_case
from verify.files.outputs import load_run
from verify.runs.runner import run_binary
from verify.stages import INPUT_NAMES, Dims, stage_file

from helpers.nan_case import ROW_STAGES, nan_case, nan_row_failures
from helpers.shapes import SHAPES, shape_id

pytestmark = pytest.mark.gpu

# Rows that reach the kernels' other paths: scalar softmax over an odd M > 1024 with d_k != d_v;
# M > 32768 (softmax without the register cache; flash over 600+ key tiles); float4 rows of
# 4100 columns with several heads.
LONG_ROW_SHAPES = [
    Dims(batch=1, heads=1, seq_q=33, seq_k=1029, d_k=8, d_v=40),
    Dims(batch=1, heads=1, seq_q=4, seq_k=40000, d_k=16, d_v=16),
    Dims(batch=1, heads=2, seq_q=70, seq_k=4100, d_k=32, d_v=32),
]
# Largest error allowed, relative to the largest magnitude of the reference stage. FP32 lands
# near 1e-6 on these shapes; TF32 (10-bit mantissa operands) near 1e-3.
FP32_TOL = 1e-4
TF32_TOL = 1e-2


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    """max |got - ref| / max |ref| over the finite reference entries; inf when the -inf entries
    (masked) differ or the shapes do, NaN when `got` holds a NaN (NaN never passes)."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if got.shape != ref.shape:
        return float("inf")
    if np.isnan(got).any():
        return float("nan")
    masked = np.isinf(ref)
    if not np.array_equal(np.isinf(got), masked) or not np.array_equal(got[masked], ref[masked]):
        return float("inf")
    finite = ~masked
    if not finite.any():
        return 0.0
    return float(np.max(np.abs(got[finite] - ref[finite])) / max(np.max(np.abs(ref[finite])), 1e-30))


def within(err: float, tol: float) -> bool:
    return bool(err <= tol)  # False for NaN


def run_case(binary: Path, in_dir: Path, out_dir: Path, backend: str, *extra: str):
    run_binary(binary, in_dir, out_dir, backend=backend, extra=list(extra))
    return load_run(out_dir)


def inputs_of(in_dir: Path, head: int):
    return {name: read_matrix(in_dir / stage_file(name, head, "npy")) for name in INPUT_NAMES}


def case_params():
    return [pytest.param(d, causal, id=shape_id(d, causal))
            for d in SHAPES + LONG_ROW_SHAPES for causal in (False, True)]


@pytest.mark.parametrize("dims, causal", case_params())
def test_cuda_matches_cpu_and_reference(binary, tmp_path, dims, causal):
    in_dir = generate_case(tmp_path / "in", dims, causal=causal, seed=11, distribution="normal", fmt="npy")
    cuda = run_case(binary, in_dir, tmp_path / "cuda", "cuda", "--poison")
    cpu = run_case(binary, in_dir, tmp_path / "cpu", "cpu")
    assert cuda.values["backend"] == "cuda" and cuda.values["poison"] is True
    assert cuda.stages == cpu.stages
    assert ("flash_output" in cuda.stages) == dims.flash_supported
    scale = float(cuda.values["scale"])
    failures = []
    for head in range(dims.total_heads):
        ref = reference_chain(inputs_of(in_dir, head), scale, causal, cuda.stages)
        for stage in cuda.stages:
            got = read_matrix(cuda.file(stage, head))
            e_ref = rel_err(got, ref[stage])
            e_cpu = rel_err(got, read_matrix(cpu.file(stage, head)))
            if not (within(e_ref, FP32_TOL) and within(e_cpu, FP32_TOL)):
                failures.append(f"{stage} head {head}: vs reference {e_ref:.3g}, vs cpu {e_cpu:.3g} "
                                f"(tol {FP32_TOL:g})")
    assert not failures, failures


def test_fp32_is_true_fp32_and_tf32_is_opt_in(binary, tmp_path):
    dims = Dims(batch=1, heads=2, seq_q=127, seq_k=333, d_k=64, d_v=64)
    in_dir = generate_case(tmp_path / "in", dims, seed=5, distribution="normal", fmt="npy")
    errs = {}
    for precision in ("fp32", "tf32"):
        run = run_case(binary, in_dir, tmp_path / precision, "cuda", "--precision", precision,
                       "--stages", "QK")
        assert run.values["precision"] == precision
        ref = reference_chain(inputs_of(in_dir, 0), float(run.values["scale"]), False, ["QK"])
        errs[precision] = rel_err(read_matrix(run.file("QK", 0)), ref["QK"])
    # FP32 GEMMs (CUBLAS_DEFAULT_MATH) are ~1e-7 here; TF32 tensor-core math rounds operands to a
    # 10-bit mantissa and lands orders of magnitude higher.
    assert errs["fp32"] < 1e-5, errs
    assert errs["tf32"] <= TF32_TOL and errs["tf32"] > 10 * errs["fp32"], errs


def test_several_groups_match_one_group(binary, tmp_path):
    # --max-memory-mb 1 forces groups of a few heads; the device arena is then reused across groups.
    dims = Dims(batch=2, heads=6, seq_q=128, seq_k=96, d_k=64, d_v=64)
    in_dir = generate_case(tmp_path / "in", dims, causal=True, seed=3, distribution="normal", fmt="npy")
    whole = run_case(binary, in_dir, tmp_path / "whole", "cuda", "--poison")
    parts = run_case(binary, in_dir, tmp_path / "parts", "cuda", "--poison", "--max-memory-mb", "1")
    for head in range(dims.total_heads):
        for stage in whole.stages:
            e = rel_err(read_matrix(parts.file(stage, head)), read_matrix(whole.file(stage, head)))
            assert within(e, 1e-6), f"{stage} head {head}: {e:.3g}"


def test_run_manifest_names_device_tiles_and_timings(binary, tmp_path):
    dims = Dims(batch=1, heads=2, seq_q=65, seq_k=70, d_k=64, d_v=64)
    in_dir = generate_case(tmp_path / "in", dims, seed=1, fmt="npy")
    run = run_case(binary, in_dir, tmp_path / "out", "cuda")
    assert run.values["device"] and run.values["device"] != "host CPU"
    # auto: the wgmma kernel on Hopper (the GPU machines), else mma.sync.
    assert run.values["flash_kernel"].startswith(("cuda-wgmma", "cuda-fast"))
    clean = run_case(binary, in_dir, tmp_path / "clean", "cuda", "--flash-kernel", "clean")
    assert clean.flash_tiles == (64, 64) and clean.values["flash_kernel"] == "cuda-clean"
    times = run.timings()
    for stage in ("KT", "QK", "QK_scaled", "attention_weights", "output", "flash_output"):
        assert stage in times and times[stage] > 0.0, (stage, times)


# Each tensor-core flash kernel forced in turn, on shapes that reach its paths: tails in N and M,
# causal tiles that cross the diagonal, one block per head (the KV loop is then split and merged),
# and enough heads that it is not. Inner dimensions 64 and 128: the wgmma kernel's widths.
FLASH_KERNEL_SHAPES = [
    Dims(batch=1, heads=1, seq_q=1, seq_k=1, d_k=64, d_v=64),
    Dims(batch=1, heads=2, seq_q=127, seq_k=333, d_k=64, d_v=64),
    Dims(batch=2, heads=1, seq_q=200, seq_k=97, d_k=128, d_v=128),
    Dims(batch=1, heads=20, seq_q=520, seq_k=200, d_k=128, d_v=128),
]


# The verifier's bound costs seconds a head at these sizes (its exact dot-product variance); the
# many-head shape (32 runs × 20 heads would take most of the device budget) is compared with the
# float64 reference only, at a tolerance tighter than the verifier's for fp32.
VERIFIED_MAX_HEADS = 2


@pytest.mark.parametrize("kernel", ["wgmma", "fast"])
@pytest.mark.parametrize("precision", ["fp32", "tf32"])
@pytest.mark.parametrize("dims", FLASH_KERNEL_SHAPES, ids=[shape_id(d, False) for d in FLASH_KERNEL_SHAPES])
def test_each_tensor_core_flash_kernel_matches_float64(binary, tmp_path, kernel, precision, dims):
    in_dir = generate_case(tmp_path / "in", dims, seed=5, distribution="normal", fmt="npy")
    for causal in (False, True):
        out = tmp_path / f"out-{causal}"
        res = run_binary(binary, in_dir, out, backend="cuda", check=False,
                         extra=["--poison", "--stages", "flash", "--flash-kernel", kernel,
                                "--precision", precision] + (["--causal"] if causal else []))
        if res.returncode == 2 and f"no {kernel} variant" in res.stderr:
            pytest.skip(f"this GPU has no {kernel} kernel: {res.stderr.strip()}")
        assert res.returncode == 0, res.stderr
        run = load_run(out)
        assert run.values["flash_kernel"].startswith(f"cuda-{kernel}"), run.values["flash_kernel"]
        if dims.total_heads <= VERIFIED_MAX_HEADS:
            report = check(in_dir, out, Options(causal=causal))  # at the run's precision and mask
            assert report.passed, [(r.stage, r.head, r.status, r.message)
                                   for r in report.results if not r.passed]
        tol = FP32_TOL / 10 if precision == "fp32" else TF32_TOL
        for head in range(dims.total_heads):
            ref = reference_chain(inputs_of(in_dir, head), float(run.values["scale"]), causal,
                                  ["flash_output", "flash_lse"])
            for stage in ("flash_output", "flash_lse"):
                e = rel_err(read_matrix(run.file(stage, head)), ref[stage])
                assert within(e, tol), f"{kernel} {precision} causal={causal} {stage} head {head}: {e:.3g}"


def run_flash(binary: Path, in_dir: Path, out_dir: Path, kernel: str, *extra: str):
    """Runs the flash stages with `kernel` forced; skips where this GPU has no such kernel."""
    res = run_binary(binary, in_dir, out_dir, backend="cuda", check=False,
                     extra=["--poison", "--stages", "flash", "--flash-kernel", kernel, *extra])
    if res.returncode == 2 and f"no {kernel} variant" in res.stderr:
        pytest.skip(f"this GPU has no {kernel} kernel: {res.stderr.strip()}")
    assert res.returncode == 0, res.stderr
    return load_run(out_dir)


@pytest.fixture(scope="module")
def past_grid_y_case(tmp_path_factory):
    """One head of 5 queries against M = 65535·64 + 65 keys (d 64), and its float64 reference."""
    dims = Dims(batch=1, heads=1, seq_q=5, seq_k=65535 * 64 + 65, d_k=64, d_v=64)
    in_dir = generate_case(tmp_path_factory.mktemp("past-grid-y") / "in", dims, seed=7, fmt="npy")
    ref = reference_chain(inputs_of(in_dir, 0), 1.0 / np.sqrt(dims.d_k), False, ["flash_output", "flash_lse"])
    return in_dir, ref


# The wgmma kernel's preparation pass puts K's tiles of 64 keys (d64) on one grid dimension: past
# 65535 tiles (M = 4,194,240) it must be x, the only one that holds more. The other kernels walk
# the keys inside a block (the mma.sync one splits this single block's KV loop 16 ways and merges):
# each must take such an M too.
@pytest.mark.parametrize("kernel, precision", [("wgmma", "fp32"), ("wgmma", "tf32"), ("fast", "fp32"),
                                               ("clean", "fp32")])
def test_flash_takes_more_key_tiles_than_grid_y_holds(binary, tmp_path, past_grid_y_case, kernel, precision):
    in_dir, ref = past_grid_y_case
    run = run_flash(binary, in_dir, tmp_path / "out", kernel, "--precision", precision)
    assert run.values["flash_kernel"].startswith(f"cuda-{kernel}"), run.values["flash_kernel"]
    assert float(run.values["scale"]) == np.float32(1.0 / np.sqrt(64))
    # The verdict: the error model's bound for this kernel's summation over M keys. A fixed
    # tolerance does not fit every kernel here: the clean kernel adds 4 million terms one by one
    # (about 1e-3 relative error), the tensor-core kernels in tiles and splits (about 1e-6).
    report = check(in_dir, tmp_path / "out")
    assert report.passed, [(r.stage, r.message) for r in report.results if not r.passed]
    if kernel != "clean":
        tol = FP32_TOL if precision == "fp32" else TF32_TOL
        for stage in ("flash_output", "flash_lse"):
            e = rel_err(read_matrix(run.file(stage, 0)), ref[stage])
            assert within(e, tol), f"{kernel} {precision} {stage}: {e:.3g}"


# Rows of Q that get a NaN: the first and last rows and one inside; one head of several.
NAN_ROWS = (0, 37, -1)
NAN_SHAPES = [
    Dims(batch=1, heads=1, seq_q=70, seq_k=300, d_k=64, d_v=64),    # few blocks: the KV loop is split
    Dims(batch=1, heads=3, seq_q=130, seq_k=97, d_k=128, d_v=128),
]


@pytest.mark.parametrize("kernel", ["wgmma", "fast"])
@pytest.mark.parametrize("precision", ["fp32", "tf32"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dims", NAN_SHAPES, ids=[shape_id(d, False) for d in NAN_SHAPES])
def test_nan_in_q_gives_nan_rows_in_each_tensor_core_kernel(binary, tmp_path, kernel, precision, causal, dims):
    in_dir = generate_case(tmp_path / "in", dims, causal=causal, seed=9, distribution="normal", fmt="npy")
    head = 1 if dims.total_heads > 1 else 0
    q_file = in_dir / stage_file("Q", head, "npy")
    q = read_matrix(q_file).astype(np.float32)
    rows = sorted({r % dims.seq_q for r in NAN_ROWS})
    q[rows, 5] = np.nan
    write_matrix(q_file, q, "npy")
    run = run_flash(binary, in_dir, tmp_path / "out", kernel, "--allow-nonfinite", "--precision", precision)
    ref = reference_chain(inputs_of(in_dir, head), float(run.values["scale"]), causal,
                          ["flash_output", "flash_lse"])
    out = read_matrix(run.file("flash_output", head))
    lse = read_matrix(run.file("flash_lse", head)).reshape(-1)
    assert np.isnan(out[rows]).all(), f"{kernel} {precision}: rows {rows} of flash_output not all NaN"
    assert np.isnan(lse[rows]).all(), f"{kernel} {precision}: flash_lse {lse[rows]}"
    others = np.setdiff1d(np.arange(dims.seq_q), rows)
    tol = FP32_TOL if precision == "fp32" else TF32_TOL
    assert within(rel_err(out[others], ref["flash_output"][others]), tol)
    assert within(rel_err(lse[others], ref["flash_lse"].reshape(-1)[others]), tol)


# NaN in a key of head 0 and in three query rows of head 1 (tests/helpers/nan_case.py), at a width every
# flash kernel has; two heads of 70 rows against 5 key tiles leave the tensor-core kernels' KV loop
# split in two and merged, so a NaN part meets a finite one in the combine.
NAN_EVERY_KERNEL_DIMS = Dims(batch=1, heads=2, seq_q=70, seq_k=300, d_k=64, d_v=64)


@pytest.mark.parametrize("kernel", ["clean", "fast", "wgmma"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_nan_input_reaches_its_rows_in_every_stage_and_kernel(binary, tmp_path, kernel, causal):
    # Every row that sees a NaN score is NaN throughout in attention_weights (the stage path's
    # softmax: also when the row's other scores are finite), output, flash_output and flash_lse;
    # no other row is; the verifier passes the run under --allow-nonfinite; and the finite rows
    # match the CPU backend's.
    dims = NAN_EVERY_KERNEL_DIMS
    in_dir, nan_rows = nan_case(tmp_path / "in", causal, dims)
    out = tmp_path / "cuda"
    res = run_binary(binary, in_dir, out, backend="cuda", check=False,
                     extra=["--poison", "--allow-nonfinite", "--flash-kernel", kernel])
    if res.returncode == 2 and f"no {kernel} variant" in res.stderr:
        pytest.skip(f"this GPU has no {kernel} kernel: {res.stderr.strip()}")
    assert res.returncode == 0, res.stderr
    run = load_run(out)
    assert run.values["flash_kernel"].startswith(f"cuda-{kernel}"), run.values["flash_kernel"]
    failures = nan_row_failures(lambda s, h: read_matrix(run.file(s, h)), run.stages, nan_rows, dims.seq_q)
    assert not failures, failures
    report = check(in_dir, out, Options(causal=causal, allow_nonfinite=True))
    assert report.passed, [(r.stage, r.head, r.status, r.message) for r in report.results if not r.passed]
    cpu = run_case(binary, in_dir, tmp_path / "cpu", "cpu", "--allow-nonfinite")
    for head, rows in nan_rows.items():
        others = np.setdiff1d(np.arange(dims.seq_q), rows)
        for stage in ROW_STAGES:
            got = read_matrix(run.file(stage, head)).reshape(dims.seq_q, -1)[others]
            want = read_matrix(cpu.file(stage, head)).reshape(dims.seq_q, -1)[others]
            e = rel_err(got, want)
            assert within(e, FP32_TOL), f"{kernel} {stage} head {head}: {e:.3g} vs the CPU backend"


def test_tensor_core_kernels_take_more_heads_than_one_launch_holds(binary, tmp_path):
    # The tensor-core kernels put heads on grid.y (at most 65535): more heads go in several
    # launches. `--bench --check` compares the first and the last head with float64.
    out = tmp_path / "bench.json"
    res = subprocess.run([str(binary), "--bench", "--batch", "1", "--heads", "65537", "--seq-q", "16",
                          "--seq-k", "16", "--d", "64", "--only", "flash", "--check", "--warmup", "0",
                          "--reps", "1", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    kernels = {k["name"]: k for k in json.loads(out.read_text())["kernels"]}
    assert {"flash", "flash_fast"} <= set(kernels), kernels
    for name, k in kernels.items():
        assert k["status"] == "ok" and k["check"]["passed"] is True, (name, k)
