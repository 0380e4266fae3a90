"""Input case generator: random Q (and the output gradient dO) per query head, K and V per K/V head,
a variant's mask, bias and slopes files (verify/files/patterns.py), plus the manifest the binary
reads."""
from __future__ import annotations

import io
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np

from ..sequences import (MAX_TOKENS, NEW_KEYS_BACKWARD, NEW_KEYS_KEY, PAGE_SIZE_KEY, PAGED_BACKWARD, SEQUENCES_KEY,
                         Sequences, paged_sequences, unsupported_with_packing)
from ..stages import (ALIBI_SLOPES_INPUT, BIAS_INPUT, CASE_INPUTS, DIM_KEYS, FORMATS, GENERATE_STAGING_PREFIX,
                      GRAD_INPUT, INPUT_MANIFEST, INPUT_NAMES, KV_HEADS_KEY, MASK_INPUT, STAGES, VARIANT_INPUTS, Dims,
                      stage_file)
from ..text import mib
from ..variant import BROADCAST, NONE, Variant
from .case import (INT64, atomic_write_bytes, check_case_limits, check_scale, input_head_files, read_toml,
                   replace_case_files, validate_dims, write_matrix, write_toml)
from .guards import removed_on_failure
from .kinds import CaseError
from .manifests import CAUSAL_KEY, WINDOW_KEYS, variant_keys
from .new_keys import write_new_key_files
from .patterns import RANDOM_SLOPES, VariantInputs, check_inputs, draw_bias, draw_mask, draw_slopes
from .sequence_files import counts_bytes, sequence_file, sequence_file_values
from .unfinished import process_exists
from .variant_inputs import whole_file

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

# The classic course layout's default case: 12 heads, N = M = 128, d = 64.
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
                  force: bool = False, progress: Optional[Callable[[int], None]] = None,
                  variant: Optional[Variant] = None, inputs: VariantInputs = VariantInputs(),
                  sequences: Optional[Sequences] = None) -> Path:
    """Writes Q for every query head and K, V for every K/V head (batch-major; dims.kv_heads) and
    manifest.toml into `out_dir`; `progress(i)` is called after query head i is written. With
    `backward`, also dO for every head (same distribution, from a random stream of its own, so
    Q/K/V of a seed do not depend on it) and `backward = true`. `variant` (causal: its causal
    flag, or `causal`) is recorded in the manifest, and `inputs` says which mask, bias and slopes
    files to draw (each from a stream of its own: Q, K, V of a seed are the same without them).
    `sequences` makes a packed case: its cu_seqlens (and seqused_k) files and `sequences = B`, with
    dims of batch 1 whose seq_q and seq_k are the packed totals; a paged one (paged_case) its
    cu_seqlens_q, seqused_k and block_table and `page_size = P`, seq_k the pool's rows.

    Everything is written into a temporary folder inside `out_dir` first and moved into place at
    the end (the manifest last), so an interrupted generation leaves neither a mix of old and new
    heads nor a partial case that a manifest-less reader would take for a smaller complete one.
    An earlier case in `out_dir` is replaced only if this generator wrote it, or with `force`.
    """
    variant = _case_variant(variant, causal, inputs)
    _check_arguments(dims, scale, seed, distribution, fmt, backward, variant.dropout > 0)
    check_inputs(inputs, variant)
    _check_packing(sequences, dims, variant, backward)
    out_dir = Path(out_dir)
    if not force:
        _refuse_foreign_case(out_dir)
    remove_stale_staging(out_dir)
    check_room(out_dir, dims, fmt, backward, inputs, sequences)
    with removed_on_failure(out_dir):
        _write_case(out_dir, dims, variant, inputs, seed, distribution, fmt, backward, progress, sequences, scale)
    return out_dir


def _write_case(out_dir: Path, dims: Dims, variant: Variant, inputs: VariantInputs, seed: int, distribution: str,
                fmt: str, backward: bool, progress, sequences: Optional[Sequences], scale: Optional[float]) -> None:
    """The case's files into a staging folder inside out_dir, then moved into place (replace_case_files)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CaseError(f"{out_dir}: cannot create the case folder: {exc.strerror or exc}") from None
    staging = out_dir / f"{GENERATE_STAGING_PREFIX}{os.getpid()}"
    try:
        staging.mkdir()
        names = _write_inputs(staging, dims, variant, inputs, seed, distribution, fmt, backward, progress)
        manifest = {k: getattr(dims, k) for k in DIM_KEYS}
        if dims.kv_heads:
            manifest[KV_HEADS_KEY] = dims.kv
        if sequences is not None:
            names += _write_sequences(staging, dims, sequences, fmt, DISTRIBUTIONS[distribution], seed, manifest)
        manifest.update(_variant_manifest(variant))
        manifest.update(format=fmt, seed=seed, distribution=distribution, generator=GENERATOR)
        if backward:
            manifest["backward"] = True
        if scale is not None:
            manifest["scale"] = float(scale)
        write_toml(staging / INPUT_MANIFEST, manifest, "attnstep input case (see docs/contract.md)")
        replace_case_files(staging, out_dir, names)
    except OSError as exc:
        raise CaseError(f"{out_dir}: cannot write the case: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _case_variant(variant: Optional[Variant], causal: bool, inputs: VariantInputs) -> Variant:
    """The variant the manifest records: `variant` (or textbook attention) made causal by `causal`,
    with the coverage of the mask and bias that `inputs` draws."""
    v = variant or Variant()
    try:
        return v.with_(causal=v.causal or causal, mask=inputs.mask_heads if inputs.mask else NONE,
                       bias=inputs.bias_heads if inputs.bias else NONE)
    except ValueError as exc:  # causal with a window that reaches right of the diagonal
        raise CaseError(f"--causal with --window: {exc}") from None


def _check_packing(sequences: Optional[Sequences], dims: Dims, variant: Variant, backward: bool = False) -> None:
    """A packed case is one batch element whose query and key rows are the sequences' totals, and
    has no mask or bias files and no dropout; a paged one has no dO."""
    if sequences is None:
        return
    if sequences.paged and backward:
        raise CaseError(f"paged sequences: {PAGED_BACKWARD}")
    if sequences.new_keys and backward:
        raise CaseError(f"new keys: {NEW_KEYS_BACKWARD}")
    packed = Dims(1, dims.heads, sequences.total_q, sequences.total_k, dims.d_k, dims.d_v, dims.kv_heads)
    if dims != packed:
        raise CaseError(f"packed sequences of {sequences.total_q} queries and {sequences.total_k} keys in all need "
                        f"batch 1, seq_q {sequences.total_q} and seq_k {sequences.total_k} (got batch {dims.batch}, "
                        f"seq_q {dims.seq_q}, seq_k {dims.seq_k})")
    problem = unsupported_with_packing(variant.mask != NONE, variant.bias != NONE, variant.dropout > 0)
    if problem:
        raise CaseError(f"packed sequences: {problem}")


def _write_sequences(staging: Path, dims: Dims, sequences: Sequences, fmt: str, sample, seed: int,
                     manifest: dict) -> List[str]:
    """The cu_seqlens (and seqused_k, block_table) files of a packed case into `staging`, and a
    decode step's new keys (drawn by `sample` from a stream of their own); their names. Their
    manifest keys go into `manifest`."""
    names = []
    for name, values in sequence_file_values(sequences).items():
        names.append(sequence_file(name, fmt))
        atomic_write_bytes(staging / names[-1], counts_bytes(values, fmt))
    manifest[SEQUENCES_KEY] = sequences.count
    if sequences.paged:
        manifest[PAGE_SIZE_KEY] = sequences.page_size
    if sequences.new_keys:
        names += write_new_key_files(staging, dims, sequences, fmt, sample, seed)
        manifest[NEW_KEYS_KEY] = sequences.new_keys
    return names


# The seed's children 0..3 are the streams of dO, the mask, the bias and the slopes.
_SEQLENS_STREAM = 4


# ... and of the pages of a paged case.
_PAGES_STREAM = 5
# The pages a paged case's pool holds beyond those its sequences read (no sequence reads them).
SPARE_PAGES = 3


def paged_case(seqlens_q: List[int], keys: List[int], page_size: int, seed: int) -> Sequences:
    """The paging of sequences of `seqlens_q` queries reading `keys` keys each (seqused_k): a pool
    of ceil(keys/P) pages per sequence and SPARE_PAGES more, the pages dealt to the sequences in
    an order shuffled from the case's seed (a program that reads pages in pool order fails), each
    table row padded with -1 past the pages its sequence reads. ValueError naming what is wrong."""
    pages = [-(-m // page_size) for m in keys]
    num_pages = sum(pages) + SPARE_PAGES
    if num_pages * page_size > MAX_TOKENS:
        raise ValueError(f"a pool of {num_pages} pages of {page_size} keys is {num_pages * page_size} rows, more than "
                         f"{MAX_TOKENS}")
    rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(_PAGES_STREAM + 1)[_PAGES_STREAM])
    order = rng.permutation(num_pages).tolist()
    cols = max(1, max(pages, default=0))
    table, at = [], 0
    for n in pages:
        table.append(order[at:at + n] + [-1] * (cols - n))
        at += n
    cu_q = np.concatenate(([0], np.cumsum(seqlens_q, dtype=np.int64))).tolist()
    return paged_sequences(cu_q, keys, table, page_size, num_pages * page_size)


def random_seqlens(count: int, most: int, seed: int) -> List[int]:
    """`count` sequence lengths, each 1..`most`, drawn from the case's seed in a stream of their own."""
    rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(_SEQLENS_STREAM + 1)[_SEQLENS_STREAM])
    return rng.integers(1, most, size=count, endpoint=True).tolist()


def _variant_manifest(v: Variant) -> dict:
    """The manifest's variant keys: causal always (as before variants), the others where they
    differ from textbook attention (a window's both sides)."""
    plain, keys = variant_keys(Variant()), variant_keys(v)
    windowed = any(keys[k] != plain[k] for k in WINDOW_KEYS)
    return {k: value for k, value in keys.items()
            if k == CAUSAL_KEY or value != plain[k] or (windowed and k in WINDOW_KEYS)}


def _write_inputs(staging: Path, dims: Dims, variant: Variant, inputs: VariantInputs, seed: int,
                  distribution: str, fmt: str, backward: bool, progress) -> List[str]:
    """Every input file of the case into `staging`, one head at a time (bounded memory); their names."""
    sample = DISTRIBUTIONS[distribution]
    seeds = np.random.SeedSequence(seed)
    main = np.random.default_rng(seeds)
    # Children of the seed, each a stream of its own (the first is dO's, as before variants).
    grad_rng, mask_rng, bias_rng, slope_rng = (np.random.default_rng(s) for s in seeds.spawn(4))
    draws = {MASK_INPUT: (inputs.mask, inputs.mask_heads, draw_mask, mask_rng),
             BIAS_INPUT: (inputs.bias, inputs.bias_heads, draw_bias, bias_rng)}
    names: List[str] = []

    def write(name: str, arr: np.ndarray) -> None:
        names.append(name)
        write_matrix(staging / name, arr, fmt)

    n, m = (dims.size(sym) for sym in VARIANT_INPUTS[MASK_INPUT])
    for name, (pattern, heads, draw, rng) in draws.items():
        if pattern and heads == BROADCAST:
            write(whole_file(name, fmt), draw(inputs, variant, n, m, rng))
    if inputs.slopes == RANDOM_SLOPES:
        write(whole_file(ALIBI_SLOPES_INPUT, fmt), draw_slopes(dims, slope_rng))
    Q, K, V = INPUT_NAMES
    for i in range(dims.total_heads):
        # Q, then K and V where head i is the first of its group: without grouping, the order
        # (and so the values) of a seed as before.
        write(stage_file(Q, i, fmt), sample(main, STAGES[Q].shape(dims)))
        j = dims.kv_head_of(i)
        if dims.query_heads_of(j)[0] == i:
            for name in (K, V):
                write(stage_file(name, j, fmt), sample(main, STAGES[name].shape(dims)))
        if backward:
            write(stage_file(GRAD_INPUT, i, fmt), sample(grad_rng, STAGES[GRAD_INPUT].shape(dims)))
        for name, (pattern, heads, draw, rng) in draws.items():
            if pattern and heads != BROADCAST:
                write(stage_file(name, i, fmt), draw(inputs, variant, n, m, rng))
        if progress is not None:
            progress(i)
    return names


def _check_arguments(dims: Dims, scale: Optional[float], seed: int, distribution: str, fmt: str,
                     backward: bool, dropout: bool) -> None:
    values = {k: getattr(dims, k) for k in DIM_KEYS}
    values[KV_HEADS_KEY] = dims.kv
    check_case_limits(validate_dims(values, "generate"), "generate", backward, dropout)
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


def case_size(dims: Dims, fmt: str, backward: bool, block: int = 1,
              inputs: VariantInputs = VariantInputs(), sequences: Optional[Sequences] = None) -> CaseSize:
    """What generating the case takes: its files (with the staging folder) and their bytes on
    disk, each file rounded up to `block` bytes (the file system's allocation unit)."""
    def on_disk(shape) -> int:
        return -(-matrix_file_bytes(shape, fmt) // block) * block
    counts = {name: dims.heads_of(name) for name in (CASE_INPUTS if backward else INPUT_NAMES)}
    shapes = {name: STAGES[name].shape(dims) for name in counts}
    for name, pattern, heads in ((MASK_INPUT, inputs.mask, inputs.mask_heads),
                                 (BIAS_INPUT, inputs.bias, inputs.bias_heads)):
        if pattern:
            counts[name] = 1 if heads == BROADCAST else dims.total_heads
            shapes[name] = tuple(dims.size(sym) for sym in VARIANT_INPUTS[name])
    if inputs.slopes == RANDOM_SLOPES:
        counts[ALIBI_SLOPES_INPUT], shapes[ALIBI_SLOPES_INPUT] = 1, (dims.batch, dims.heads)
    files = sum(counts.values()) + 1
    # The manifest and the staging folder (a block each, at least).
    size = sum(counts[n] * on_disk(shapes[n]) for n in counts) + 2 * max(block, _MANIFEST_BYTES)
    if sequences is not None:  # the offsets' files, a few bytes a sequence
        written = [len(counts_bytes(v, fmt)) for v in sequence_file_values(sequences).values()]
        files, size = files + len(written), size + sum(-(-b // block) * block for b in written)
    return CaseSize(files, size)


def _existing_parent(path: Path) -> Path:
    """The folder whose file system `path` will be created on: itself or its nearest existing parent."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_room(out_dir: Path, dims: Dims, fmt: str, backward: bool, inputs: VariantInputs = VariantInputs(),
               sequences: Optional[Sequences] = None) -> None:
    """Refuses, in one line, a case of more than MAX_CASE_FILES files, or one that needs more
    bytes or inodes than the file system of `out_dir` has free (for this user: f_bavail,
    f_favail; a file system that reports no inode counts, f_files 0, is not checked for them)."""
    try:
        fs = os.statvfs(_existing_parent(out_dir))
    except OSError:
        fs = None  # no answer: the writes themselves will say
    need = case_size(dims, fmt, backward, max(1, fs.f_frsize) if fs else 1, inputs, sequences)
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
