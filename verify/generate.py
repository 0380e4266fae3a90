"""Input case generator: random Q, K, V (and the output gradient dO) per head plus the manifest the
binary reads."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable, Dict, Optional

import numpy as np

from .case import (INT64, CaseError, check_case_limits, check_scale, clear_input_files, input_head_files, read_toml,
                   validate_dims, write_matrix, write_toml)
from .stages import DIM_KEYS, FORMATS, GRAD_INPUT, INPUT_MANIFEST, INPUT_NAMES, STAGES, Dims, stage_file

# The `large` distribution scales N(0, 1) by this factor, so that scaled logits q·k/√d_k have a
# standard deviation of LARGE_STD² = 100 and reach the hundreds: exp() of them overflows float32
# (limit ≈ 88.7) unless the softmax subtracts the row maximum first.
LARGE_STD = 10.0

Sampler = Callable[[np.random.Generator, tuple], np.ndarray]

DISTRIBUTIONS: Dict[str, Sampler] = {
    "uniform": lambda rng, shape: rng.random(shape, dtype=np.float32),  # [0, 1), as the original
    "normal": lambda rng, shape: rng.standard_normal(shape, dtype=np.float32),
    "large": lambda rng, shape: rng.standard_normal(shape, dtype=np.float32) * np.float32(LARGE_STD),
}

# Seeds NumPy's generator takes (non-negative) that a manifest integer (int64) holds.
MAX_SEED = INT64 - 1

# The manifest's `generator` value. Without --force, generate replaces only a case that has it.
GENERATOR = "attnstep generate"

# The original workflow's case: 12 heads, N = M = 128, d = 64.
DEFAULT_DIMS = Dims(batch=1, heads=12, seq_q=128, seq_k=128, d_k=64, d_v=64)


def generate_case(out_dir: Path, dims: Dims, *, causal: bool = False, scale: Optional[float] = None,
                  seed: int = 0, distribution: str = "uniform", fmt: str = "txt", backward: bool = False,
                  force: bool = False, progress: Optional[Callable[[int], None]] = None) -> Path:
    """Writes Q/K/V for every head (batch-major) and manifest.toml into `out_dir`; `progress(i)` is
    called after head i is written. With `backward`, also dO for every head (same distribution,
    from a random stream of its own, so Q/K/V of a seed do not depend on it) and `backward = true`.

    Everything is written into a temporary folder inside `out_dir` first and moved into place at
    the end (the manifest last), so an interrupted generation leaves neither a mix of old and new
    heads nor a partial case that a manifest-less reader would take for a smaller complete one.
    An earlier case in `out_dir` is replaced only if this generator wrote it, or with `force`.
    """
    check_case_limits(validate_dims({k: getattr(dims, k) for k in DIM_KEYS}, "generate"), "generate", backward)
    if distribution not in DISTRIBUTIONS:
        raise CaseError(f"unknown distribution {distribution!r}; choose from {', '.join(DISTRIBUTIONS)}")
    if fmt not in FORMATS:
        raise CaseError(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")
    if scale is not None:
        check_scale(scale, "--scale")
    if not 0 <= seed <= MAX_SEED:
        raise CaseError(f"seed {seed}: must be in 0..{MAX_SEED}")
    out_dir = Path(out_dir)
    if not force:
        _refuse_foreign_case(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CaseError(f"{out_dir}: cannot create the case folder: {exc.strerror or exc}") from None
    staging = out_dir / f".attnstep-generate-{os.getpid()}"
    try:
        staging.mkdir()
        names = []
        sample = DISTRIBUTIONS[distribution]
        seeds = np.random.SeedSequence(seed)
        streams = [(INPUT_NAMES, np.random.default_rng(seeds))]
        if backward:
            streams.append(((GRAD_INPUT,), np.random.default_rng(seeds.spawn(1)[0])))
        for i in range(dims.total_heads):  # one head at a time: bounded memory
            for inputs, rng in streams:
                for name in inputs:
                    names.append(stage_file(name, i, fmt))
                    write_matrix(staging / names[-1], sample(rng, STAGES[name].shape(dims)), fmt)
            if progress is not None:
                progress(i)
        manifest = {k: getattr(dims, k) for k in DIM_KEYS}
        manifest.update(causal=causal, format=fmt, seed=seed, distribution=distribution,
                        generator=GENERATOR)
        if backward:
            manifest["backward"] = True
        if scale is not None:
            manifest["scale"] = float(scale)
        write_toml(staging / INPUT_MANIFEST, manifest, "attnstep input case (see docs/contract.md)")
        clear_input_files(out_dir)
        for name in names + [INPUT_MANIFEST]:
            os.replace(staging / name, out_dir / name)
    except OSError as exc:
        raise CaseError(f"{out_dir}: cannot write the case: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def _refuse_foreign_case(out_dir: Path) -> None:
    """Input files in `out_dir` that a manifest of this generator does not vouch for are someone's
    own case: refused, not deleted."""
    if not out_dir.is_dir():
        return
    manifest = out_dir / INPUT_MANIFEST
    files = sorted(input_head_files(out_dir))
    if not files and not manifest.exists():
        return
    try:
        ours = manifest.exists() and read_toml(manifest).get("generator") == GENERATOR
    except CaseError:
        ours = False
    if not ours:
        held = files[0] if files else INPUT_MANIFEST
        raise CaseError(f"{out_dir}: already holds an input case ({held}) that 'attnstep generate' did not "
                        "write; HINT: pass --force to replace it, or choose another folder")
