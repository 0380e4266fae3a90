"""The examples gallery (examples/): every program compiles, and on a GPU `check` passes the
correct program and names each buggy program's bug.

Each program runs as in the original workflow: from a build-like folder next to data/, reading
data/random_test and writing data/random_verify in its own text format (6 significant digits,
no run.toml).
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

import numpy as np
import pytest

from helpers.environment import GPU_PRESENT, REPO
from verify.stages import DATA_DIR, DEFAULT_CASE, DEFAULT_RESULT, stage_file

EXAMPLES_DIR = REPO / "examples"
BUILD_DIR = REPO / "build-examples"
BUILD_TIMEOUT_S = 1800
RUN_TIMEOUT_S = 300
SHAPE = ("--seq-q", "100", "--seq-k", "140", "--d-k", "64", "--d-v", "64")  # N, M not multiples of a tile
HEADS = 3


@dataclass(frozen=True)
class Expected:
    program: str
    stage: Optional[str]        # first failing stage; None: every stage passes
    code: Optional[str] = None  # a diagnosis code of that stage's failures
    causal: bool = False
    heads: int = HEADS


EXPECTED = (
    Expected("correct_seed", None),
    Expected("correct_seed", None, causal=True),
    Expected("bug_qk_leading_dim", "QK", "layout"),
    Expected("bug_missing_scale", "QK_scaled", "scaled"),
    Expected("bug_softmax_axis", "attention_weights", "softmax_axis"),
    Expected("bug_causal_off_by_one", "QK_scaled", "mask_offset", causal=True),
    Expected("bug_flash_tail", "flash_output", "unwritten"),
    Expected("bug_lse_log2", "flash_lse", "lse_log2"),
    Expected("bug_head_order", "KT", "head_permuted", heads=12),  # string order differs from 11 heads on
    Expected("bug_kv_padding", None),  # right values from uninitialised reads: only a sanitizer sees it
    Expected("bug_tf32_math", "QK", "tf32"),
)
RACE = "bug_flash_race"
RACE_RUNS = 5
# The racy and the correct program run the same arithmetic; a race corrupts whole K/V columns.
RACE_SHOWS_ABOVE = 1e-3
RACE_ABSENT_BELOW = 1e-5  # a few units in the 6th printed digit: rounding only


def _nvcc() -> Optional[str]:
    return os.environ.get("CUDACXX") or shutil.which("nvcc")


def test_every_example_has_an_expectation():
    programs = {p.stem for p in EXAMPLES_DIR.glob("*.cu")}
    assert programs == {e.program for e in EXPECTED} | {RACE}


@pytest.fixture(scope="session")
def examples() -> Dict[str, Path]:
    """The examples target, built in its own folder for one architecture: this GPU's, or sm_90
    (compile only) where there is none."""
    if _nvcc() is None:
        pytest.skip("no CUDA compiler (nvcc on PATH or CUDACXX): the examples need the CUDA toolkit")
    arch = "native" if GPU_PRESENT else "90"
    BUILD_DIR.mkdir(exist_ok=True)
    # Test processes side by side (pytest -n) each ask for the examples: one builds them, under a
    # lock, and the others of the same run take that build (two CMake configures of one folder
    # break each other, and a relink while another process runs a program fails its exec).
    test_run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    stamp = BUILD_DIR / "tests.stamp"
    with open(BUILD_DIR / "tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (test_run and stamp.exists() and stamp.read_text() == test_run):
            for cmd in (["cmake", "-S", REPO, "-B", BUILD_DIR, "-DCMAKE_BUILD_TYPE=Release", "-DATTNSTEP_CUDA=ON",
                         f"-DCMAKE_CUDA_ARCHITECTURES={arch}"],
                        ["cmake", "--build", BUILD_DIR, "--target", "examples", "--parallel", str(os.cpu_count() or 1)]):
                proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
                assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
            stamp.write_text(test_run or "")
    return {p.stem: BUILD_DIR / p.stem for p in EXAMPLES_DIR.glob("*.cu")}


# Compiling the gallery with nvcc takes about 40 s on 2 cores, for one architecture: these two
# compile-only tests are marked slow (a machine with a GPU builds it for the tests below anyway).
@pytest.mark.slow
def test_examples_build(examples):
    for name, path in examples.items():
        assert path.is_file() and os.access(path, os.X_OK), f"{name} was not built"


@pytest.mark.slow
def test_example_names_a_missing_case(examples, tmp_path):
    """Bad input is one line and exit 2, before any CUDA call (so this runs without a GPU)."""
    (tmp_path / "build").mkdir()
    proc = subprocess.run([str(examples["correct_seed"]), "no_such_test"], cwd=tmp_path / "build",
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: ../data/no_such_test: no such folder"


def _verify(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "verify", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=RUN_TIMEOUT_S)


class Workflow:
    """tmp/data/random_test generated once; programs run from tmp/build; check into a JSON report."""

    def __init__(self, root: Path, heads: int, causal: bool):
        self.root, self.causal = root, causal
        self.data = root / DATA_DIR
        self.case, self.result = self.data / DEFAULT_CASE, self.data / DEFAULT_RESULT
        (root / "build").mkdir(parents=True)
        gen = _verify("generate", "--heads", heads, *SHAPE, *(["--causal"] if causal else []), "--out", self.case)
        assert gen.returncode == 0, gen.stderr

    def run(self, program: Path) -> None:
        shutil.rmtree(self.result, ignore_errors=True)
        proc = subprocess.run([str(program), DEFAULT_CASE], cwd=self.root / "build", capture_output=True,
                              text=True, timeout=RUN_TIMEOUT_S)
        assert proc.returncode == 0, f"{program.name} exited {proc.returncode}: {proc.stderr}"

    def check(self) -> Tuple[int, dict]:
        report = self.root / "report.json"
        report.unlink(missing_ok=True)
        proc = _verify("check", "--in", self.case, "--out", self.result, "--json", report,
                       *(["--causal"] if self.causal else []))
        assert proc.returncode in (0, 1), proc.stdout + proc.stderr
        return proc.returncode, json.loads(report.read_text())

    def load(self, stage: str, head: int) -> np.ndarray:
        return np.loadtxt(self.result / stage_file(stage, head, "txt"), ndmin=2)


def _failing_codes(report: dict) -> set:
    stage = report["first_failing_stage"]
    return {d["code"] for r in report["results"] if r["stage"] == stage and not r["passed"] for d in r["diagnosis"]}


@pytest.mark.gpu
@pytest.mark.parametrize("exp", EXPECTED, ids=[f"{e.program}{'-causal' if e.causal else ''}" for e in EXPECTED])
def test_example_is_diagnosed(exp, examples, tmp_path):
    flow = Workflow(tmp_path, exp.heads, exp.causal)
    flow.run(examples[exp.program])
    status, report = flow.check()
    if exp.stage is None:
        assert status == 0 and report["passed"], report["first_failure"]
        return
    assert status == 1
    assert report["first_failing_stage"] == exp.stage, report["first_failure"]
    assert exp.code in _failing_codes(report), report["first_failure"]


@pytest.mark.gpu
def test_flash_race_is_caught_when_it_shows(examples, tmp_path):
    """The missing __syncthreads() shows under causal masking, where warps do unequal work; every
    run whose flash output differs from the correct program's must fail at the flash stages."""
    flow = Workflow(tmp_path, HEADS, causal=True)
    flow.run(examples["correct_seed"])
    correct = [flow.load("flash_output", h) for h in range(HEADS)]
    shown = 0
    for _ in range(RACE_RUNS):
        flow.run(examples[RACE])
        diff = max(float(np.abs(flow.load("flash_output", h) - correct[h]).max()) for h in range(HEADS))
        status, report = flow.check()
        if diff > RACE_SHOWS_ABOVE:
            shown += 1
            assert status == 1 and report["first_failing_stage"] == "flash_output", report["first_failure"]
        elif diff < RACE_ABSENT_BELOW:
            assert status == 0, report["first_failure"]
    assert shown, f"the race never showed in {RACE_RUNS} causal runs (flash output equal to the correct one)"


@pytest.mark.gpu
def test_a_tf32_program_passes_as_what_it_is(examples, tmp_path):
    """Named tf32 under float32 bounds, the same files pass under --precision tf32."""
    flow = Workflow(tmp_path, HEADS, causal=False)
    flow.run(examples["bug_tf32_math"])
    proc = _verify("check", "--in", flow.case, "--out", flow.result, "--precision", "tf32")
    assert proc.returncode == 0, proc.stdout[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("program,tool,culprit", [
    ("correct_seed", "memcheck,racecheck", None),
    (RACE, "racecheck", "load_kv_tile"),                  # its writes race with the reads of the tile
    ("bug_kv_padding", "initcheck", "load_padded_tile"),
], ids=["correct", "race", "padding"])
def test_the_sanitizer_finds_what_values_may_hide(examples, tmp_path, program, tool, culprit):
    """`run --sanitize` on gallery programs: the correct one is clean; the racy one and the one
    reading uninitialised padding are named by the tool, function and source line, whether or not
    their values show it (the padding's never do)."""
    flow = Workflow(tmp_path, HEADS, causal=True)
    run = _verify("run", "--in", flow.case, "--out", flow.result, "--binary", examples[program], "--cwd",
                  tmp_path / "build", "--sanitize", tool, "--", DEFAULT_CASE)
    assert run.returncode == 0, run.stdout + run.stderr
    status, report = flow.check()
    checks = {c["kind"]: c for c in report["program_checks"]}
    assert set(checks) == set(tool.split(","))
    if culprit is None:
        assert status == 0 and all(c["passed"] for c in checks.values()), checks
        return
    found = checks[tool]
    assert status == 1 and not found["passed"] and found["count"] > 0, found
    assert culprit in found["kernel"] and re.search(r"\.cuh?:\d+$", found["source"]), found
