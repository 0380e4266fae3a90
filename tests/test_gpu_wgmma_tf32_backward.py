"""The Hopper flash backward on TF32 tensor cores (wgmma) at tf32 and at fp32 (3xTF32): which kernel
the binary takes, its gradients against float64 and the verifier, and determinism.

The wgmma kernels need compute capability 9.0 and d 64 or 128 (fp32: d 64); elsewhere the binary
takes the mma.sync backward, which these tests then check the same way (the kernel-name test skips).
"""
from __future__ import annotations

import filecmp
import json
import subprocess

import numpy as np
import pytest

from verify.files.case import read_matrix
from verify.files.generate import generate_case
from verify.files.outputs import load_run
from verify.stages import FLASH_GRAD_VALUES, Dims

from helpers.environment import compute_capability
from helpers.flash_gradients import FLASH_GRADS, FP32_GRADIENT_ERROR, flash_gradient_reference
from helpers.reports import check_verdict

pytestmark = pytest.mark.gpu

WGMMA_TF32 = "cuda-bwd-wgmma-tf32"
WGMMA_FP32 = "cuda-bwd-wgmma-fp32"



def max_error(precision: str, d: int) -> float:
    """The largest gradient error allowed, relative to the largest gradient: a few TF32 units at
    tf32; at fp32 a plain FP32 kernel's accuracy. (On these normal inputs flash_bwd.cu's mma.sync
    kernel at d128 reaches 2.0e-6, so that width is allowed twice it.)"""
    if precision == "tf32":
        return 16 * 2.0**-11
    return FP32_GRADIENT_ERROR if d == 64 else 2 * FP32_GRADIENT_ERROR


def hopper_or_skip(tiles: str, kernel: str) -> None:
    """On compute capability 9.0 the wgmma kernel must be the one taken; elsewhere the test skips."""
    if compute_capability() != "9.0":
        pytest.skip(f"the wgmma kernels need compute capability 9.0; this GPU runs {tiles}")
    assert kernel in tiles, f"compute capability 9.0 took {tiles}, not {kernel}"

# One query and one key; tails in N and M (not multiples of 32, 64 or 128) with N < M and N > M,
# which under the causal mask leave key blocks no query sees; whole tiles with enough heads for
# several blocks a kernel.
SHAPES = [Dims(1, 1, 1, 1, 64, 64), Dims(1, 2, 127, 333, 64, 64), Dims(2, 1, 300, 97, 128, 128),
          Dims(1, 3, 300, 520, 128, 128), Dims(1, 5, 256, 256, 64, 64)]
VERIFIED_MAX_HEADS = 2  # the verifier's bounds cost seconds a head


def run_flash(binary, in_dir, out_dir, causal, precision="tf32"):
    proc = subprocess.run([str(binary), "--in", str(in_dir), "--out", str(out_dir), "--backend", "cuda",
                           "--precision", precision, "--stages", "flash", "--poison", *(["--causal"] if causal else [])],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return load_run(out_dir)


def bench_backward_kernel(binary, tmp_path, d, precision="tf32"):
    """The flash backward's kernel as `main --bench` names it, on a small problem of width d."""
    out = tmp_path / f"bench{d}{precision}.json"
    proc = subprocess.run([str(binary), "--bench", "--pass", "backward", "--check", "--no-ceilings", "--batch", "1",
                           "--heads", "2", "--seq-q", "200", "--seq-k", "300", "--d", str(d), "--precision", precision,
                           "--warmup", "0", "--reps", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {k["name"]: k for k in json.loads(out.read_text())["kernels"]}
    flash = rows["flash_backward"]
    assert flash["check"]["passed"] is True, flash
    return flash["tiles"]


def test_hopper_takes_the_wgmma_backward_at_tf32(binary, tmp_path):
    """On compute capability 9.0 the TF32 flash backward at d64 and d128 is the wgmma one; other
    widths keep the mma.sync one."""
    tiles = bench_backward_kernel(binary, tmp_path, 64)
    hopper_or_skip(tiles, WGMMA_TF32)
    # The label: query rows streamed a tile by keys a block, each width's own.
    assert tiles == f"64x128, {WGMMA_TF32}"
    assert bench_backward_kernel(binary, tmp_path, 128) == f"32x64, {WGMMA_TF32}"
    assert WGMMA_TF32 not in bench_backward_kernel(binary, tmp_path, 32)


def test_hopper_takes_the_wgmma_backward_at_fp32_d64(binary, tmp_path):
    """fp32 (3xTF32) at d64 runs the wgmma kernels in half-width tiles (each operand's two parts);
    d128 and other widths keep the mma.sync one."""
    tiles = bench_backward_kernel(binary, tmp_path, 64, "fp32")
    hopper_or_skip(tiles, WGMMA_FP32)
    assert tiles == f"32x64, {WGMMA_FP32}"
    assert bench_backward_kernel(binary, tmp_path, 128, "fp32").endswith("cuda-bwd-3xtf32")
    assert bench_backward_kernel(binary, tmp_path, 32, "fp32").endswith("cuda-bwd-3xtf32")


@pytest.mark.parametrize("precision", ["tf32", "fp32"])
@pytest.mark.parametrize("dims", SHAPES, ids=[str(d) for d in SHAPES])
def test_the_flash_backward_matches_float64_and_passes_the_verifier(binary, tmp_path, dims, precision):
    """Each gradient within a few TF32 units (fp32: max_error) of the float64 gradients (normwise: a
    sum that cancels has a small entry with a large relative error), every element written; the
    verifier passes it under the precision's bounds."""
    in_dir = generate_case(tmp_path / "in", dims, seed=5, distribution="normal", fmt="npy", backward=True)
    for causal in (False, True):
        out = tmp_path / f"out-{causal}"
        run = run_flash(binary, in_dir, out, causal, precision)
        if dims.total_heads <= VERIFIED_MAX_HEADS:
            code, verdict = check_verdict(in_dir, out, "--causal" if causal else "--no-causal")
            assert code == 0 and verdict.startswith(f"PASS (bounds for {precision})"), verdict
        for head in range(dims.total_heads):
            ref = flash_gradient_reference(in_dir, run, head, causal)
            for name in FLASH_GRADS:
                got = read_matrix(run.file(name, head))
                assert np.isfinite(got).all(), f"{name} head {head}: an element was not written"
                if dims.seq_k == 1 and name != FLASH_GRAD_VALUES:
                    continue  # one key: dS = P·(dP − D) is 0 exactly, the kernel's TF32 noise (the verifier bounds it)
                err = np.abs(got - ref[name]).max() / max(np.abs(ref[name]).max(), 1e-3)
                assert err < max_error(precision, dims.d_k), f"causal={causal} {name} head {head}: off by {err:.3g}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("precision, d", [("tf32", 64), ("tf32", 128), ("fp32", 64)])
def test_the_flash_backward_is_deterministic(binary, tmp_path, precision, d, causal):
    """Two runs write the same bytes: every gradient element has one owner, no atomics."""
    dims = Dims(1, 4, 700, 900, d, d)
    in_dir = generate_case(tmp_path / "in", dims, seed=3, distribution="normal", fmt="npy", backward=True)
    runs = [run_flash(binary, in_dir, tmp_path / f"out{i}", causal, precision) for i in range(2)]
    for name in FLASH_GRADS:
        for head in range(dims.total_heads):
            assert filecmp.cmp(runs[0].file(name, head), runs[1].file(name, head), shallow=False), (name, head)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_fp32_flash_backward_stays_fp32_accurate_over_long_sums(binary, tmp_path, causal):
    """4096 queries and keys: each gradient sums 128 tiles of 32. The tensor cores truncate every
    addition to a running sum toward zero; summed in one chain over the tiles, that bias put the
    gradients 3e-5 to 6e-5 off here, where each tile's sums added in FP32 stay within 2e-6."""
    dims = Dims(1, 1, 4096, 4096, 64, 64)
    in_dir = generate_case(tmp_path / "in", dims, seed=9, distribution="normal", fmt="npy", backward=True)
    run = run_flash(binary, in_dir, tmp_path / "out", causal, "fp32")
    ref = flash_gradient_reference(in_dir, run, 0, causal)
    for name in FLASH_GRADS:
        got = read_matrix(run.file(name, 0))
        err = np.abs(got - ref[name]).max() / np.abs(ref[name]).max()
        assert err <= FP32_GRADIENT_ERROR, f"causal={causal} {name}: off by {err:.3g}"
