"""PyTorch's own bf16/fp16 attention as output cases: every SDPA backend must pass, planted bugs fail.

PyTorch's SDPA backends (flash, memory-efficient, cuDNN, math) are independent, correct
half-precision implementations; verify/bench/sdpa_outputs.py (its command: verify/cli/sdpa_outputs.py)
runs one of them on a generated case (inputs rounded to the format as the verifier rounds them, the
case's scale and causal flag, the gradients from its dO) and writes the results as another
program's `<stage>.npy` files. On a GPU each backend × format × shape must pass `attnstep check
--precision` at every stage (forward and backward), and a perturbed gradient or the wrong scale
must fail. A backend torch cannot run here (a cuDNN too old, a shape the flash kernel refuses) is
skipped with torch's reason.

Without torch or a GPU the same path runs with a NumPy stand-in for SDPA (float64 attention,
results rounded to the format): the inputs, the stage names, the files and the check.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from verify.bench.sdpa_outputs import (BACKENDS, BackendUnavailable, SdpaResults, stage_arrays, write_sdpa_case)
from verify.cli import sdpa_outputs as sdpa_command
from verify.cli.group import cli
from verify.files.generate import generate_case
from verify.model.half import round_to_format
from verify.stages import GRAD_INPUT, HALF_PRECISIONS, INPUT_NAMES, STAGES, Dims

f64 = np.float64

# (dims, causal): d 64 and 128, N = M and not (either longer), causal and not, several heads.
SHAPES = [
    pytest.param(Dims(1, 3, 128, 128, 64, 64), False, id="heads3-N128-M128-d64"),
    pytest.param(Dims(1, 2, 256, 256, 128, 128), True, id="heads2-N256-M256-d128-causal"),
    pytest.param(Dims(2, 2, 100, 257, 64, 64), True, id="batch2-heads2-N100-M257-d64-causal"),
    pytest.param(Dims(1, 2, 200, 77, 128, 128), True, id="heads2-N200-M77-d128-causal"),
    pytest.param(Dims(1, 4, 96, 160, 128, 128), False, id="heads4-N96-M160-d128"),
]
CONTROL = (Dims(1, 2, 128, 128, 64, 64), True)


def _case(tmp_path, dims, causal, seed=11, distribution="normal"):
    return generate_case(tmp_path / "in", dims, causal=causal, seed=seed, distribution=distribution,
                         backward=True, fmt="npy")


def _check(in_dir, out_dir, precision, tmp_path):
    """`attnstep check --precision`: (exit code, the JSON report)."""
    report = tmp_path / "report.json"
    r = CliRunner().invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir), "--precision", precision,
                                 "--quiet", "--json", str(report)], catch_exceptions=False)
    assert report.exists(), r.output
    return r.exit_code, json.loads(report.read_text())


def _failures(report) -> list:
    return [(r["stage"], r["head"], r["status"]) for r in report["results"] if not r["passed"]]


def _perturb(out_dir, stage, precision):
    """One element of the last head moved by half the head's largest magnitude and a tenth of its
    own (dozens of half ulps: the stage path's gradients at bf16, checked from the inputs alone,
    allow a fifth of the largest magnitude at places): a value no correct kernel writes."""
    path = out_dir / f"{stage}.npy"
    x = np.load(path)
    head = x.reshape((-1,) + x.shape[-2:])[-1]  # the last head (a view)
    head[3, 5] += np.sign(head[3, 5] or 1) * (0.1 * np.abs(head[3, 5]) + 0.5 * np.abs(head).max())
    np.save(path, x)


# ---- a NumPy stand-in for SDPA: the same files and checks, no torch --------------------------

def _softmax_rows(s):
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def numpy_sdpa(inputs, backend, precision, scale, causal, mask):
    """Attention in float64 from the (rounded) inputs, results rounded to the format once: a
    correct half-precision program, more accurate than any kernel."""
    q, k, v = (inputs[n].astype(f64) for n in INPUT_NAMES)
    s = scale * q @ np.swapaxes(k, -1, -2)
    if causal:
        s = np.where(np.triu(np.ones(s.shape[-2:], bool), 1), -np.inf, s)
    p = _softmax_rows(s)
    half = lambda x: round_to_format(x.astype(np.float32), precision).astype(np.float32)  # noqa: E731
    out = p @ v
    lse = (s.max(axis=-1) + np.log(np.exp(s - s.max(axis=-1, keepdims=True)).sum(axis=-1))).astype(np.float32)
    results = SdpaResults(half(out), lse if BACKENDS[backend].fused else None)
    if GRAD_INPUT in inputs:
        do = inputs[GRAD_INPUT].astype(f64)
        dp = do @ np.swapaxes(v, -1, -2)
        ds = p * (dp - (do * out).sum(axis=-1, keepdims=True))
        results.grads = {"dq": half(scale * ds @ k), "dk": half(scale * np.swapaxes(ds, -1, -2) @ q),
                         "dv": half(np.swapaxes(p, -1, -2) @ do)}
    return results


@pytest.mark.parametrize("precision", HALF_PRECISIONS)
@pytest.mark.parametrize("backend", ["flash", "math"])
def test_sdpa_files_of_a_correct_program_pass_and_a_perturbed_one_fails(tmp_path, backend, precision):
    """The path the GPU tests take, with the NumPy stand-in: the fused backends' names (flash
    stages with the lse) and the math backend's (the stage path's), every stage passes; one
    perturbed gradient element fails at that stage, and so does the wrong scale."""
    dims = Dims(2, 1, 40, 56, 64, 64)
    in_dir = _case(tmp_path, dims, True)
    out_dir = tmp_path / "out"
    results = write_sdpa_case(in_dir, out_dir, backend, precision, runner=numpy_sdpa)
    written = stage_arrays(results, backend)
    assert all(STAGES[s].flash == BACKENDS[backend].fused for s in written)
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(f"{s}.npy" for s in written)
    if precision == "fp16":
        assert {np.load(out_dir / f"{s}.npy").dtype.str for s in written if not STAGES[s].float32} == {"<f2"}
    code, report = _check(in_dir, out_dir, precision, tmp_path)
    assert code == 0 and report["passed"] and report["precision"] == precision, _failures(report)
    assert {r["stage"] for r in report["results"]} == set(written)

    dk = [s for s in written if STAGES[s].rows == "M" and STAGES[s].cols == "DK"][0]
    _perturb(out_dir, dk, precision)
    code, report = _check(in_dir, out_dir, precision, tmp_path)
    assert code == 1 and report["first_failing_stage"] == dk, _failures(report)
    assert _failures(report) == [(dk, dims.total_heads - 1, "FAIL")]

    write_sdpa_case(in_dir, out_dir, backend, precision, scale=1.25 * dims.d_k ** -0.5, runner=numpy_sdpa)
    code, report = _check(in_dir, out_dir, precision, tmp_path)
    assert code == 1 and report["first_failing_stage"] == next(iter(written)), _failures(report)


def test_the_sdpa_inputs_are_the_verifiers_rounding(tmp_path):
    """What SDPA is given is Q, K, V, dO rounded as the verifier rounds them (nearest even)."""
    dims = Dims(1, 2, 9, 11, 16, 16)
    in_dir = _case(tmp_path, dims, False, distribution="large")
    seen = {}

    def spy(inputs, *args):
        seen.update(inputs)
        return numpy_sdpa(inputs, *args)

    write_sdpa_case(in_dir, tmp_path / "out", "efficient", "bf16", runner=spy)
    q1 = np.load(in_dir / "Q_head_1.npy")
    assert seen["Q"].shape == (1, 2, 9, 16) and seen[GRAD_INPUT].shape == (1, 2, 9, 16)
    np.testing.assert_array_equal(seen["Q"][0, 1], round_to_format(q1, "bf16").astype(np.float32))
    assert not np.array_equal(seen["Q"][0, 1], q1)


def test_the_sdpa_command_says_why_a_backend_cannot_run(tmp_path, monkeypatch):
    """Without torch (or a GPU) the command is one line and exit 1, not a traceback."""
    import verify.bench.sdpa_outputs as mod

    def unavailable(*args):
        raise BackendUnavailable("PyTorch is not installed")

    monkeypatch.setattr(mod, "run_sdpa", unavailable)
    in_dir = _case(tmp_path, Dims(1, 1, 8, 8, 16, 16), False)
    r = CliRunner().invoke(sdpa_command.main,
                           ["--in", str(in_dir), "--out", str(tmp_path / "out"), "--backend", "flash"])
    assert r.exit_code == 1 and r.output.strip() == "Error: SDPA backend unavailable: PyTorch is not installed", \
        r.output


def test_a_refused_backend_is_skipped_with_torchs_own_reason():
    """torch refuses a forced backend with a warning per backend and "No available kernel": the
    reason kept is the one that says why, without where in torch it was raised."""
    import warnings

    from verify.bench.sdpa_outputs import _refused

    def refuse():
        where = " (Triggered internally at /pytorch/aten/src/ATen/native/transformers/cuda/sdp_utils.cpp:457.)"
        for message in ("Memory efficient kernel not used because:", "cuDNN attention has been runtime disabled.",
                        "Flash attention does not support the is_causal flag when seqlen_q != seqlen_k."):
            warnings.warn(message + where)
        raise RuntimeError("No available kernel. Aborting execution.")

    with pytest.raises(BackendUnavailable) as info:
        _refused(refuse, "flash")
    assert str(info.value) == ("flash: Flash attention does not support the is_causal flag when seqlen_q != "
                               "seqlen_k.")


# ---- PyTorch's SDPA on the GPU -----------------------------------------------------------------

def _sdpa_or_skip(in_dir, out_dir, backend, precision, **kwargs):
    try:
        import torch  # noqa: F401
    except ImportError:
        pytest.skip("PyTorch is not installed")
    try:
        return write_sdpa_case(in_dir, out_dir, backend, precision, **kwargs)
    except BackendUnavailable as exc:
        pytest.skip(f"torch cannot run this SDPA backend here: {exc}")


@pytest.mark.gpu
@pytest.mark.parametrize("precision", HALF_PRECISIONS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dims,causal", SHAPES)
def test_pytorch_sdpa_passes(tmp_path, dims, causal, backend, precision):
    in_dir = _case(tmp_path, dims, causal)
    results = _sdpa_or_skip(in_dir, tmp_path / "out", backend, precision)
    written = stage_arrays(results, backend)
    code, report = _check(in_dir, tmp_path / "out", precision, tmp_path)
    assert code == 0 and report["passed"], (results.notes, _failures(report))
    assert {r["stage"] for r in report["results"]} == set(written)
    assert len(written) == (5 if BACKENDS[backend].fused else 4) or results.notes, written


@pytest.mark.gpu
@pytest.mark.parametrize("precision", HALF_PRECISIONS)
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "flash"])
def test_pytorch_sdpa_with_an_explicit_causal_mask_passes(tmp_path, backend, precision):
    """The top-left causal mask as a boolean attn_mask (N < M and N > M), through the backends'
    masked paths."""
    for i, dims in enumerate((Dims(1, 2, 70, 190, 64, 64), Dims(1, 2, 190, 70, 128, 128))):
        in_dir = _case(tmp_path / str(i), dims, True)
        _sdpa_or_skip(in_dir, tmp_path / str(i) / "out", backend, precision, mask="explicit")
        code, report = _check(in_dir, tmp_path / str(i) / "out", precision, tmp_path)
        assert code == 0 and report["passed"], _failures(report)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", HALF_PRECISIONS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_pytorch_sdpa_with_a_planted_bug_fails(tmp_path, backend, precision):
    """The control: SDPA's dK with one element moved fails at dK; SDPA at 1.25 times the case's
    scale fails at its output."""
    dims, causal = CONTROL
    in_dir = _case(tmp_path, dims, causal)
    out_dir = tmp_path / "out"
    written = stage_arrays(_sdpa_or_skip(in_dir, out_dir, backend, precision), backend)
    dk = [s for s in written if STAGES[s].rows == "M" and STAGES[s].cols == "DK"][0]
    _perturb(out_dir, dk, precision)
    code, report = _check(in_dir, out_dir, precision, tmp_path)
    assert code == 1 and _failures(report) == [(dk, dims.total_heads - 1, "FAIL")], _failures(report)

    _sdpa_or_skip(in_dir, out_dir, backend, precision, scale=1.25 * dims.d_k ** -0.5)
    code, report = _check(in_dir, out_dir, precision, tmp_path)
    assert code == 1 and report["first_failing_stage"] == next(iter(written)), _failures(report)
