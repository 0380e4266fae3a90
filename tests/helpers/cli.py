"""The attnstep command line run in this process: generate an input case, check a folder."""
from __future__ import annotations

import contextlib
import json
import re
import signal
from pathlib import Path
from typing import Iterator, Optional

from click.testing import CliRunner, Result

from verify.cli.group import cli
from verify.stages import INPUT_MANIFEST, Dims


@contextlib.contextmanager
def time_limit(seconds: int, what: str) -> Iterator[None]:
    """Fails the block (TimeoutError) when it runs past `seconds`, instead of hanging the run."""
    def expire(signum, frame):
        raise TimeoutError(f"{what} ran past {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def invoke(*args) -> Result:
    """attnstep ARGS (each made a string); an exception propagates instead of becoming exit code 1."""
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def generate_input(folder: Path, dims: Dims, distribution: str, seed: int, causal: bool,
                   manifest: bool = True) -> Path:
    """`attnstep generate` into `folder`; manifest=False removes the input manifest (shapes inferred)."""
    r = invoke("generate", "--out", folder, "--batch", dims.batch, "--heads", dims.heads,
               "--seq-q", dims.seq_q, "--seq-k", dims.seq_k, "--d-k", dims.d_k, "--d-v", dims.d_v,
               "--dist", distribution, "--seed", seed, "--causal" if causal else "--no-causal")
    assert r.exit_code == 0, r.output
    if not manifest:
        (folder / INPUT_MANIFEST).unlink()
    return folder


def check_folder(tmp: Path, in_dir: Path, out_dir: Path, causal: bool, scale: Optional[float]):
    """`check` with causal and scale on its command line; (click result, JSON report or None)."""
    report = tmp / "r.json"
    args = ["check", "--in", in_dir, "--out", out_dir, "--json", report]
    args += ["--causal"] if causal else []
    args += ["--scale", repr(scale)] if scale is not None else []
    result = invoke(*args)
    return result, (json.loads(report.read_text()) if report.exists() else None)


def binary_line(stderr: str) -> str:
    """The binary's error and its hint as the verifier writes them: one line, "; HINT: " between."""
    lines = stderr.strip().splitlines()
    errors = [i for i, ln in enumerate(lines) if ln.startswith("main: error: ")]
    assert len(errors) == 1, stderr
    i = errors[0]
    line = lines[i][len("main: error: "):]
    if i + 1 < len(lines) and lines[i + 1].startswith("HINT: "):
        line += "; " + lines[i + 1]
    return re.sub(r"(manifest\.toml):\d+:\d+:", r"\1:", line)


def assert_same_verdict(ran, checked, out: Path, case: Path, words: Optional[str]) -> None:
    """The binary's run of `case` (`ran`, a CompletedProcess) and `attnstep check`'s (`checked`)
    agree: both accept it (words None), or both refuse it with exit 2, no traceback and nothing
    written, in one line about a file of the case that holds `words`, the same line from both."""
    if words is None:
        assert ran.returncode == 0, ran.stderr
        assert checked.exit_code == 0, checked.output
        return
    assert ran.returncode == 2 and "Traceback" not in ran.stderr, ran.stderr
    assert not out.exists(), "a refused run wrote its output folder"
    assert checked.exit_code == 2 and "Traceback" not in checked.output, checked.output
    line = binary_line(ran.stderr)
    assert line.startswith(f"{case}/") and line.count("\n") == 0, line
    assert words.format(case=case) in line, (words, line)
    python_lines = [ln for ln in checked.output.splitlines() if f"{case}/" in ln]
    assert len(python_lines) == 1, checked.output
    assert python_lines[0].endswith(line), (line, checked.output)
