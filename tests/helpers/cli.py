"""The attnstep command line run in this process: generate an input case, check a folder."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from click.testing import CliRunner

from verify.cli.group import cli
from verify.stages import INPUT_MANIFEST, Dims


def invoke(*args) -> "click.testing.Result":
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
