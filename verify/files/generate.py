"""Input case generator: random Q, K, V (and the output gradient dO) per head plus the manifest the
binary reads."""
from __future__ import annotations

import io
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional

import numpy as np

from ..stages import (CASE_INPUTS, DIM_KEYS, FORMATS, GENERATE_STAGING_PREFIX, GRAD_INPUT, INPUT_MANIFEST,
                      INPUT_NAMES, STAGES, Dims, stage_file)
from ..text import mib
from .case import (INT64, check_case_limits, check_scale, clear_input_files, input_head_files, read_toml,
                   validate_dims, write_matrix, write_toml)
from .kinds import CaseError
from .unfinished import process_exists

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

# The most files one generated case may have. Both formats hold one file per input and head, so
# beyond this a case is refused (fewer heads) rather than left to fill a folder no tool lists
# comfortably: far more than any attention problem needs, far fewer than the 2^24 heads the
# readers accept (50 million files, one file-system block each at least).
MAX_CASE_FILES = 1_000_000

# The longest value write_matrix prints: %.9g of a float32 is at most a sign, 9 digits, a point
# and a two-digit exponent ("-1.17549435e-38"), and one separator (a space, or the line's end)
# follows each value.
TEXT_VALUE_BYTES = len("-1.17549435e-38") + 1

_STAGING_NAME = re.compile(re.escape(GENERATE_STAGING_PREFIX) + r"([0-9]+)")


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
    _check_arguments(dims, scale, seed, distribution, fmt, backward)
    out_dir = Path(out_dir)
    if not force:
        _refuse_foreign_case(out_dir)
    remove_stale_staging(out_dir)
    check_room(out_dir, dims, fmt, backward)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CaseError(f"{out_dir}: cannot create the case folder: {exc.strerror or exc}") from None
    staging = out_dir / f"{GENERATE_STAGING_PREFIX}{os.getpid()}"
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


def _check_arguments(dims: Dims, scale: Optional[float], seed: int, distribution: str, fmt: str,
                     backward: bool) -> None:
    check_case_limits(validate_dims({k: getattr(dims, k) for k in DIM_KEYS}, "generate"), "generate", backward)
    if distribution not in DISTRIBUTIONS:
        raise CaseError(f"unknown distribution {distribution!r}; choose from {', '.join(DISTRIBUTIONS)}")
    if fmt not in FORMATS:
        raise CaseError(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")
    if scale is not None:
        check_scale(scale, "--scale")
    if not 0 <= seed <= MAX_SEED:
        raise CaseError(f"seed {seed}: must be in 0..{MAX_SEED}")


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


# ----------------------------------------------------------------------------------------------
# Sizes before work: a case that cannot fit is refused before its first file is written.

@dataclass(frozen=True)
class CaseSize:
    files: int   # the case's files: every input of every head, and the manifest
    bytes: int   # on disk, each file rounded up to whole blocks of the file system


# Room for the manifest's few lines (keys and values of a dozen entries).
_MANIFEST_BYTES = 4096


def matrix_file_bytes(shape, fmt: str) -> int:
    """The most bytes write_matrix writes for a matrix of `shape` (rows, cols) in `fmt`."""
    rows, cols = shape
    if fmt == "npy":
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False,
                                                      "shape": (rows, cols)})
        return len(header.getvalue()) + 4 * rows * cols
    return TEXT_VALUE_BYTES * rows * cols


def case_size(dims: Dims, fmt: str, backward: bool, block: int = 1) -> CaseSize:
    """What generating the case takes: its files (with the staging folder) and their bytes on
    disk, each file rounded up to `block` bytes (the file system's allocation unit)."""
    inputs = CASE_INPUTS if backward else INPUT_NAMES
    per_head = sum(-(-matrix_file_bytes(STAGES[n].shape(dims), fmt) // block) * block for n in inputs)
    files = dims.total_heads * len(inputs) + 1
    # The manifest and the staging folder (a block each, at least).
    return CaseSize(files, dims.total_heads * per_head + 2 * max(block, _MANIFEST_BYTES))


def _existing_parent(path: Path) -> Path:
    """The folder whose file system `path` will be created on: itself or its nearest existing parent."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_room(out_dir: Path, dims: Dims, fmt: str, backward: bool) -> None:
    """Refuses, in one line, a case of more than MAX_CASE_FILES files, or one that needs more
    bytes or inodes than the file system of `out_dir` has free (for this user: f_bavail,
    f_favail; a file system that reports no inode counts, f_files 0, is not checked for them)."""
    try:
        fs = os.statvfs(_existing_parent(out_dir))
    except OSError:
        fs = None  # no answer: the writes themselves will say
    need = case_size(dims, fmt, backward, max(1, fs.f_frsize) if fs else 1)
    if need.files > MAX_CASE_FILES:
        raise CaseError(f"{out_dir}: the case would be {need.files:,} files, more than the {MAX_CASE_FILES:,} "
                        "'attnstep generate' writes; HINT: fewer heads (--heads, --batch): each head is one "
                        "file per input in either --format")
    if fs is None:
        return
    free = fs.f_bavail * fs.f_frsize
    if need.bytes > free:
        raise CaseError(f"{out_dir}: the case needs up to {mib(need.bytes)} of disk space, and its file system has "
                        f"{mib(free)} free; HINT: fewer heads or smaller matrices, --format npy (smaller "
                        "files), or another --out")
    if fs.f_files and need.files + 1 > fs.f_favail:  # + 1: the staging folder
        raise CaseError(f"{out_dir}: the case needs {need.files + 1:,} files, and its file system has room for "
                        f"{fs.f_favail:,} more; HINT: fewer heads (--heads, --batch), or another --out")


def remove_stale_staging(out_dir: Path) -> None:
    """Removes the staging folders that killed generations left in `out_dir` (a folder
    `.attnstep-generate-<pid>` whose process no longer exists); a live process's is its own."""
    try:
        entries = list(os.scandir(out_dir))
    except OSError:
        return  # no folder yet, or not one to list: nothing left behind in it
    for entry in entries:
        match = _STAGING_NAME.fullmatch(entry.name)
        if match and entry.is_dir(follow_symlinks=False) and not process_exists(int(match.group(1))):
            shutil.rmtree(entry.path, ignore_errors=True)
