"""The backends every end-to-end test runs, and one case taken through generate, the binary and
check."""
from __future__ import annotations

import pytest

from verify.check.compare import check
from verify.diagnose.hypotheses import diagnose
from verify.files.generate import generate_case
from verify.runs.runner import run_binary

# (backend, extra binary arguments): the CUDA backend with each flash kernel and each precision
# (auto runs the wgmma kernel on Hopper where it has a variant, else mma.sync, else clean).
BACKENDS = [
    pytest.param(("cpu", ()), id="cpu"),
    pytest.param(("cuda", ()), id="cuda", marks=pytest.mark.gpu),
    pytest.param(("cuda", ("--flash-kernel", "fast")), id="cuda-mma-sync-flash", marks=pytest.mark.gpu),
    pytest.param(("cuda", ("--flash-kernel", "clean")), id="cuda-clean-flash", marks=pytest.mark.gpu),
    pytest.param(("cuda", ("--precision", "tf32")), id="cuda-tf32", marks=pytest.mark.gpu),
]


def run_and_check(binary, tmp_path, dims, causal, backend, **gen):
    """generate -> the binary on `backend` -> check (diagnoses included, as `attnstep check`): the report
    of a case in tmp_path/{in,out}."""
    name, extra = backend
    in_dir, out_dir = tmp_path / "in", tmp_path / "out"
    generate_case(in_dir, dims, causal=causal, **gen)
    run_binary(binary, in_dir, out_dir, backend=name, extra=extra)
    return check(in_dir, out_dir, diagnoser=diagnose)


# The binary's options that `attnstep run` passes on under the same name (docs/cli.md).
RUN_OPTIONS = ("--precision", "--split-size")


def run_command(backend, options=()) -> str:
    """The command that runs a case in IN on `backend` (with `options` more), for a failure's
    message: `attnstep run` where it takes every option, else the binary itself."""
    name, extra = backend
    args = ["--in", "IN", "--out", "OUT", "--backend", name, *extra, *options]
    known = ("--in", "--out", "--backend") + RUN_OPTIONS
    runner = ["attnstep", "run"] if all(flag in known for flag in args[::2]) else ["build/main"]
    return " ".join(runner + [str(a) for a in args])
