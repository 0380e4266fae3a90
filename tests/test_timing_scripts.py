"""The GPU timing scripts' user errors (scripts/window_cost.py, flex_variant_ratios.py,
ab_half_forward.sh): each a one-line message and a non-zero exit, never a traceback, where no GPU is
needed to see them."""
from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPTS / script), *args], capture_output=True, text=True, timeout=120)


def _one_line_error(done: subprocess.CompletedProcess, words: str) -> None:
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("usage:")]
    assert len(lines) == 1 and words in lines[0], done.stderr


@pytest.mark.parametrize("script", ["window_cost.py", "flex_variant_ratios.py"])
def test_reps_below_one_are_refused(script):
    _one_line_error(_run(script, "--reps", "0"), "--reps must be at least 1")


def test_a_missing_binary_is_named(tmp_path):
    _one_line_error(_run("window_cost.py", "--binary", str(tmp_path / "main")), "cannot run")


def _fake_bench(tmp_path: Path, body: str) -> Path:
    """A stand-in for `main --bench` that writes its --json as `body` and exits 0."""
    fake = tmp_path / "main"
    fake.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = "--json" ] && out=$2; shift; done\n'
                    f"echo '{body}' > \"$out\"\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    return fake


def test_a_kernel_the_bench_skipped_is_named(tmp_path):
    fake = _fake_bench(tmp_path, '{"kernels": [{"name": "flash", "ms": 1.0, "status": "ok"}, '
                                 '{"name": "flash_backward", "status": "skipped (memory)"}]}')
    _one_line_error(_run("window_cost.py", "--binary", str(fake)), "flash_backward skipped (memory)")


def test_results_it_cannot_read_are_named(tmp_path):
    _one_line_error(_run("window_cost.py", "--binary", str(_fake_bench(tmp_path, "not json"))),
                    "wrote no readable results")


@pytest.mark.parametrize("args, words", [
    ((), "usage: scripts/ab_half_forward.sh PATCH [ROUNDS]"),
    (("no_such.patch",), "no_such.patch: no such patch file"),
    (("README.md",), "README.md does not apply to this tree"),
    (("docs/experiments/persistent_half_forward.patch", "0"), "ROUNDS must be a whole number >= 1, got '0'"),
])
def test_the_ab_scripts_user_errors_are_one_line_before_any_build(args, words):
    existed = (SCRIPTS.parent / "build-ab").exists()
    done = subprocess.run(["bash", str(SCRIPTS / "ab_half_forward.sh"), *args], capture_output=True, text=True,
                          timeout=60, cwd=SCRIPTS.parent)
    _one_line_error(done, words)
    assert done.returncode == 2 and (SCRIPTS.parent / "build-ab").exists() == existed  # (refused before building)
