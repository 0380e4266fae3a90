"""The Hopper flash backward at bf16/fp16 (wgmma): its gradients against float64, the verifier's
half model, determinism, and the problems it leaves to the stage path.

The kernels need compute capability 9.0; on another GPU the half flash backward is left out and
these tests skip with the binary's own reason.
"""
from __future__ import annotations

import filecmp
import subprocess

import numpy as np
import pytest

from verify.files.case import read_matrix
from verify.files.generate import generate_case
from verify.files.outputs import load_run
from verify.model.half import round_to_format, storage_unit
from verify.stages import HALF_PRECISIONS, Dims

from helpers.flash_gradients import FLASH_GRADS, flash_gradient_reference
from helpers.reports import check_verdict

pytestmark = pytest.mark.gpu


# Tails in N and M (not multiples of 64 or 128), one query and one key, N < M and N > M under the
# causal mask (key blocks no query sees), and enough heads for several blocks in each kernel.
SHAPES = [Dims(1, 1, 1, 1, 64, 64), Dims(1, 2, 127, 333, 64, 64), Dims(2, 1, 200, 97, 128, 128),
          Dims(1, 3, 300, 520, 128, 128), Dims(1, 5, 256, 256, 64, 64)]
VERIFIED_MAX_HEADS = 2  # the verifier's exact bounds cost seconds a head at the larger shapes


def run_flash(binary, in_dir, out_dir, precision, causal, *extra):
    """The flash forward and backward on the CUDA backend at `precision`; skips where this GPU has
    no half-precision flash backward."""
    proc = subprocess.run([str(binary), "--in", str(in_dir), "--out", str(out_dir), "--backend", "cuda",
                           "--precision", precision, "--stages", "flash", "--poison",
                           *(["--causal"] if causal else []), *extra],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode == 2 and "no half-precision kernel" in proc.stderr:
        pytest.skip(f"this GPU has no half-precision flash backward: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    return load_run(out_dir)


@pytest.mark.parametrize("precision", HALF_PRECISIONS)
@pytest.mark.parametrize("dims", SHAPES, ids=[str(d) for d in SHAPES])
def test_the_wgmma_flash_backward_at_half_precision_matches_float64(binary, tmp_path, precision, dims):
    """Each gradient holds values of the format and is within a few units of the format of the
    float64 gradients of the inputs as the kernels read them (normwise: a sum that cancels has a
    small entry with a large relative error); the verifier passes it under the half model."""
    in_dir = generate_case(tmp_path / "in", dims, seed=7, distribution="normal", fmt="npy", backward=True)
    unit = storage_unit(precision)
    for causal in (False, True):
        out = tmp_path / f"out-{causal}"
        run = run_flash(binary, in_dir, out, precision, causal)
        assert run.values["flash_kernel"].startswith(f"cuda-wgmma-{precision}"), run.values["flash_kernel"]
        if dims.total_heads <= VERIFIED_MAX_HEADS:
            code, verdict = check_verdict(in_dir, out, "--causal" if causal else "--no-causal")
            assert code == 0 and verdict.startswith(f"PASS (bounds for {precision})"), verdict
        for head in range(dims.total_heads):
            # The gradients of what the kernels read: the inputs in the format, the forward's own O and lse.
            ref = flash_gradient_reference(in_dir, run, head, causal, lambda x: round_to_format(x, precision))
            for name in FLASH_GRADS:
                got = read_matrix(run.file(name, head))
                assert np.isfinite(got).all(), f"{name} head {head}: an element was not written"
                assert np.array_equal(round_to_format(got, precision), got), f"{name} head {head}: not {precision}"
                # A gradient that is 0 in exact arithmetic (one key: dS = P·(dP − D) = 0) is rounding noise.
                err = np.abs(got - ref[name]).max() / max(np.abs(ref[name]).max(), 1e-3)
                assert err < 16 * unit, f"{precision} causal={causal} {name} head {head}: off by {err:.3g}"


# The plain instantiation (top-left causal) and the variant's (a window of both sides under the
# bottom-right alignment, softcap, ALiBi).
MASKS = {"causal": ("--causal",),
         "window-softcap-alibi": ("--window", "150,40", "--align", "bottom-right", "--softcap", "6", "--alibi")}


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("precision", HALF_PRECISIONS)
def test_the_wgmma_flash_backward_is_deterministic(binary, tmp_path, precision, mask):
    """Two runs write the same bytes: every gradient element has one owner, no atomics."""
    dims = Dims(1, 4, 700, 900, 128, 128)
    in_dir = generate_case(tmp_path / "in", dims, seed=3, distribution="normal", fmt="npy", backward=True)
    runs = [run_flash(binary, in_dir, tmp_path / f"out{i}", precision, False, *MASKS[mask]) for i in range(2)]
    assert runs[0].values["flash_kernel"].startswith(f"cuda-wgmma-{precision}"), runs[0].values["flash_kernel"]
    for name in FLASH_GRADS:
        for head in range(dims.total_heads):
            assert filecmp.cmp(runs[0].file(name, head), runs[1].file(name, head), shallow=False), (name, head)


def test_the_half_flash_backward_refuses_a_variant_it_does_not_compute(binary, tmp_path):
    """Dropout at bf16: neither half flash kernel, forward or backward, takes per-element inputs
    (dropout, mask or bias files), so asking for the flash stages is one clear error naming the
    gradients among them, and nothing is written."""
    generate_case(tmp_path / "in", Dims(1, 1, 64, 64, 64, 64), backward=True)
    proc = subprocess.run([str(binary), "--in", str(tmp_path / "in"), "--out", str(tmp_path / "out"),
                           "--backend", "cuda", "--precision", "bf16", "--stages", "flash", "--dropout", "0.1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("main: error: --precision bf16"), proc.stderr
    assert "flash_dQ" in proc.stderr.splitlines()[0], proc.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
