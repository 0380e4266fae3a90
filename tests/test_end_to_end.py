"""End to end: generate -> binary -> check, on every shape of tests/shapes.py.

The CPU backend runs everywhere (CI included); the CUDA backend runs where a GPU is found.
"""
from __future__ import annotations

import pytest

from verify.check.compare import check
from verify.files.generate import generate_case
from verify.runs.runner import run_binary
from verify.stages import BACKWARD_STAGES, STAGES

from shapes import shape_params

# (backend, extra binary arguments): the CUDA backend with each flash kernel and each precision
# (auto runs the wgmma kernel on Hopper where it has a variant, else mma.sync, else clean).
BACKENDS = [
    pytest.param(("cpu", ()), id="cpu"),
    pytest.param(("cuda", ()), id="cuda", marks=pytest.mark.gpu),
    pytest.param(("cuda", ("--flash-kernel", "fast")), id="cuda-mma-sync-flash", marks=pytest.mark.gpu),
    pytest.param(("cuda", ("--flash-kernel", "clean")), id="cuda-clean-flash", marks=pytest.mark.gpu),
    pytest.param(("cuda", ("--precision", "tf32")), id="cuda-tf32", marks=pytest.mark.gpu),
]


def _run_and_check(binary, tmp_path, dims, causal, backend, **gen):
    name, extra = backend
    in_dir, out_dir = tmp_path / "in", tmp_path / "out"
    generate_case(in_dir, dims, causal=causal, **gen)
    run_binary(binary, in_dir, out_dir, backend=name, extra=extra)
    return check(in_dir, out_dir)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dims, causal", shape_params())
def test_all_stages_pass(binary, tmp_path, dims, causal, backend):
    report = _run_and_check(binary, tmp_path, dims, causal, backend, seed=7)
    failing = [(r.stage, r.head, r.status, r.message) for r in report.results if not r.passed]
    assert report.passed, failing
    written = set(report.stages)
    assert {"Q", "K", "V", "KT", "QK", "QK_scaled", "attention_weights", "output"} <= written
    assert ("flash_output" in written) == dims.flash_supported


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dims, causal", shape_params())
def test_all_stages_pass_with_the_backward(binary, tmp_path, dims, causal, backend):
    report = _run_and_check(binary, tmp_path, dims, causal, backend, seed=9, backward=True)
    failing = [(r.stage, r.head, r.status, r.message) for r in report.results if not r.passed]
    assert report.passed, failing
    assert set(BACKWARD_STAGES) - set(report.stages) == (set() if dims.flash_supported else
                                                         {n for n in BACKWARD_STAGES if STAGES[n].flash})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("distribution", ["uniform", "normal", "large"])
def test_correct_runs_never_fail_across_seeds(binary, tmp_path, distribution, backend):
    from verify.stages import Dims
    for seed in range(6):
        dims = Dims(1, 2, 37 + seed * 11, 61 - seed * 5, 64, 64)
        report = _run_and_check(binary, tmp_path / str(seed), dims, seed % 2 == 1, backend,
                                seed=seed, distribution=distribution)
        assert report.passed, [(r.stage, r.head, r.main.tol_used if r.main else None)
                               for r in report.results if not r.passed]
