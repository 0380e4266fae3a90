"""The split stages' files: a run that splits the keys K per split (flash-decoding) writes each
split of split_output and split_lse as a file of its own, `<stage>_head_{i}_split_{s}.<fmt>` (N × DV
and N × 1), s = 0..S-1 with S = ceil(M / K) (in a packed case ceil(max m(b) / K)), at least 1. The
split size comes from run.toml's `split_size` or `attnstep check --split-size`; a folder holding
split files with neither is refused, and so is a split size on both that disagree.

A head's files are read as the head's matrix of the stage table (verify/stages.py): the splits'
columns side by side, N × S·DV and N × S, as the binary holds them; each file is checked on its
own (present, readable, its shape, its CRC-32 where run.toml lists them).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

import numpy as np

from ..stages import (FORMATS, RUN_MANIFEST, SPLIT_SIZE_KEY, SPLIT_STAGES, STAGES, Dims,
                      parse_stage_file, split_columns, split_count, stage_file)
from ..text import plural
from .arrays import as_array, native_float
from .kinds import CaseError
from .matrix_io import crc32_hex, parse_matrix, read_bytes, wrong_shape
from .resolution import EXACT, array_resolution, text_resolution
from .stage_files import STAGE_ITEMSIZE, STAGE_NPY, StageSource, _as_matrix, _load_npy

# A file's state, as verify/check/results.py names it (that module sits above this one).
_MISSING, _STALE, _SHAPE, _UNREADABLE = "MISSING", "STALE", "SHAPE", "UNREADABLE"
SPLIT_SIZE_OPTION = "--split-size"
# A split no key of which a row sees has lse −inf; a kernel whose running maximum starts at −FLT_MAX
# (or −1e30) writes that instead, and anything at or below this stands in for −inf there (as for
# the scores of a row that sees no key: verify/specs/scores.py STAND_IN_CEILING).
EMPTY_LSE_CEILING = -1e3
SPLIT_SIZE_HINT = (f"pass {SPLIT_SIZE_OPTION} K (the keys per split the program used), or write "
                   f"{SPLIT_SIZE_KEY} = K in {RUN_MANIFEST}")


def split_size_problem(value) -> Optional[str]:
    """Why `value` is no split size (a whole number of keys >= 1), or None."""
    ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1
    return None if ok else "must be a number of keys >= 1"


@dataclass
class SplitSource(StageSource):
    """A split stage's files in a folder: `<stage>_head_{i}_split_{s}.<fmt>`, every head and split."""
    fmt: str = FORMATS[0]

    def split_name(self, head: int, split: int) -> str:
        return stage_file(self.stage, head, self.fmt, split=split)

    def name(self, head: int, dims: Dims) -> str:
        last = max(dims.splits - 1, 0)
        return stage_file(self.stage, head, self.fmt, split=0).replace("_split_0.", f"_split_{{0..{last}}}.")

    def file_names(self, dims: Dims) -> List[str]:
        return [self.split_name(i, s) for i in range(dims.heads_of(self.stage)) for s in range(dims.splits)]

    def load(self, run, head: int):
        """(run: the RunInfo, verify/files/outputs.py) (the head's matrix N × S·cols or None, its Resolution, a status or None, the message): each
        split's file read and checked in turn; the first that is missing, unreadable, stale or of the
        wrong shape is the head's status."""
        dims = run.dims
        rows, cols = dims.size(STAGES[self.stage].rows), split_columns(self.stage, dims)
        mats, resolutions, verified = [], [], True
        for s in range(dims.splits):
            name = self.split_name(head, s)
            path = Path(self.folder) / name
            if not path.exists():
                # (no file past it either: the program split its keys in fewer, larger splits?)
                fewer = not any(Path(self.folder, self.split_name(head, t)).exists() for t in range(s, dims.splits))
                hint = f"; HINT: the split size the program used? {SPLIT_SIZE_HINT}" if fewer and s > 0 else ""
                return None, EXACT, _MISSING, (f"{path} is missing (the run splits the keys {dims.split_size} per "
                                               f"split: {plural(dims.splits, 'split')} per head, 0..{dims.splits - 1})"
                                               + hint)
            try:
                data = read_bytes(path, (rows, cols), STAGE_ITEMSIZE, STAGE_NPY)
                if path.suffix == ".npy":
                    arr = _load_npy(data, path)
                    mat, res = _as_matrix(arr, (rows, cols)), array_resolution(arr)
                else:
                    mat, res = parse_matrix(data, path, None).astype(np.float64), text_resolution(data)
            except CaseError as exc:
                return None, EXACT, _UNREADABLE, str(exc)
            stale = _staleness(run, name, data)
            if stale:
                return None, EXACT, _STALE, stale
            verified = verified and run.verify_crc
            if mat.shape != (rows, cols):
                sym = STAGES[self.stage].rows + "x" + ("DV" if STAGES[self.stage].cols == "SDV" else "1")
                return None, EXACT, _SHAPE, wrong_shape(name, mat.shape, (rows, cols), sym)
            resolutions.append(res)
            mats.append(mat)
        # A program prints its files alike, but a split a file of which holds only 0 and -inf (no key
        # seen) shows few digits: the finest resolution found is how it prints. attnstep's binary
        # wrote them where their CRC-32 match (%.9g round-trips float32).
        resolution = EXACT if verified or not resolutions or any(r.exact for r in resolutions) else \
            max(resolutions, key=lambda r: (r.kind == "digits", r.count))
        return np.hstack(mats) if mats else np.zeros((rows, 0)), resolution, None, ""


def _staleness(run, name: str, data: bytes) -> Optional[str]:
    """Why a split file is not from this run (its CRC-32 differs from run.toml's, or is not listed)."""
    if not run.verify_crc:
        return None
    want = run.values.get("crc32_" + name.rsplit(".", 1)[0])
    if want is None:
        return f"{name} is not listed in {RUN_MANIFEST}'s CRC table: not from run {run.run_id}"
    if crc32_hex(data) != str(want):
        return (f"{name} was not written by run {run.run_id}: its CRC-32 differs from {RUN_MANIFEST} (a file from "
                "an earlier run, or edited since)")
    return None


def split_files_in(folder: Path) -> Dict[str, Dict[str, List[Tuple[int, int]]]]:
    """{stage: {format: [(head, split), ...]}} of the split files in `folder`."""
    found: Dict[str, Dict[str, List[Tuple[int, int]]]] = {}
    for entry in os.listdir(folder):
        parsed = parse_stage_file(entry)
        if parsed is not None and parsed.split is not None and parsed.seq is None and parsed[0] in STAGES \
                and STAGES[parsed[0]].split:
            found.setdefault(parsed[0], {}).setdefault(parsed[2], []).append((parsed[1], parsed.split))
    return found


def run_split_size(values: dict, said: Optional[int], folder: Path) -> Optional[int]:
    """The keys per split: `check --split-size` (said) or run.toml's split_size, which must agree
    where both say; None for a run that does not split."""
    manifest = folder / RUN_MANIFEST
    ran = values.get(SPLIT_SIZE_KEY)
    if ran is not None:
        why = split_size_problem(ran)
        if why:
            raise CaseError(f"{manifest}: {SPLIT_SIZE_KEY} = {ran}: {why}")
    if said is not None and ran is not None and said != ran:
        raise CaseError(f"{manifest}: {SPLIT_SIZE_KEY} = {ran} but {SPLIT_SIZE_OPTION} {said}; HINT: the run split "
                        f"its keys {ran} per split: leave {SPLIT_SIZE_OPTION} out, or check the folder of the run "
                        f"that split them {said} per split")
    return said if said is not None else ran


def split_dims(dims: Dims, split_size: Optional[int], max_keys: int) -> Dims:
    """The run's dimensions with its split size and split count (unchanged for a run that does not split)."""
    return dims if not split_size else dims.with_splits(split_size, split_count(max_keys, split_size))


def split_sources(folder: Path, sources: Mapping[str, StageSource], dims: Dims, listed: bool,
                  names: Mapping[str, str], notes: Optional[List[str]] = None) -> Dict[str, StageSource]:
    """The run's sources with its split stages read from their split files: those present (or, where
    run.toml lists the stages, those it lists). Files of splits past the split count that hold no key
    (a kernel that launches a fixed number of splits writes such trailing ones) are left out, said in
    `notes`. Refused in one line: split files and no split size, both .txt and .npy for one stage, a
    split past the split count holding keys (another split size), a name map for a split stage, and
    split files in a run with dropout (checked by the caller)."""
    found = split_files_in(folder)
    out = {s: src for s, src in sources.items() if not STAGES[s].split}
    named = [s for s in SPLIT_STAGES if s in names]
    if named:
        raise CaseError(f"--name {named[0]}: a split stage is read from its split files, "
                        f"{stage_file(named[0], 0, 'txt', split=0).replace('_0_split_0', '_{i}_split_{s}')} (or .npy); "
                        "HINT: write them under those names")
    stages = [s for s in SPLIT_STAGES if (s in sources if listed else s in found)]
    if stages and not dims.split_size:
        example = sorted(stage_file(stages[0], head, fmt, split=split)
                         for fmt, pairs in found.get(stages[0], {}).items() for head, split in pairs)
        shown = example[0] if example else stages[0]
        raise CaseError(f"{folder}: holds {shown} (a split stage) but no split size is known; HINT: {SPLIT_SIZE_HINT}")
    for stage in stages:
        fmts = sorted(found.get(stage, {}))
        if len(fmts) > 1:
            raise CaseError(f"{folder}: {stage} has both .txt and .npy split files; HINT: remove one set")
        fmt = fmts[0] if fmts else _listed_format(sources.get(stage))
        beyond = sorted(p for p in found.get(stage, {}).get(fmt, []) if p[1] >= dims.splits)
        for head, split in beyond:
            path = folder / stage_file(stage, head, fmt, split=split)
            why = _why_not_empty(path, stage, dims)
            if why:
                raise CaseError(f"{path}: split {split} {why}, but {dims.split_size} keys per split makes "
                                f"{plural(dims.splits, 'split')} (0..{dims.splits - 1}) of the longest row's keys; "
                                f"HINT: the split size the program used? {SPLIT_SIZE_HINT}")
        if beyond and notes is not None:
            past = sorted({split for _, split in beyond})
            which = f"split {past[0]}" if len(past) == 1 else f"splits {', '.join(str(x) for x in past)}"
            notes.append(f"{stage}: the files of {which} hold no key (lse −inf, output 0): "
                         f"past the {plural(dims.splits, 'split')} that {dims.split_size} keys per split makes, "
                         "left out")
        out[stage] = SplitSource(stage, folder, stage_file(stage, 0, fmt, split=0), fmt=fmt)
    return {s: out[s] for s in STAGES if s in out}


def _why_not_empty(path: Path, stage: str, dims: Dims) -> Optional[str]:
    """None where a split file holds what a split no row sees a key of holds, every entry (split_lse
    −inf or a finite stand-in at or below EMPTY_LSE_CEILING, split_output 0, in the stage's shape);
    else what it holds instead."""
    shape = (dims.size(STAGES[stage].rows), split_columns(stage, dims))
    try:
        data = read_bytes(path, shape, STAGE_ITEMSIZE, STAGE_NPY)
        mat = _load_npy(data, path) if path.suffix == ".npy" else parse_matrix(data, path, None)
    except CaseError as exc:
        return f"cannot be read ({exc})"
    mat = np.asarray(mat, dtype=np.float64)
    if mat.shape != shape:
        return f"is {'x'.join(str(n) for n in mat.shape) or 'one value'}, not {shape[0]}x{shape[1]}"
    if np.isnan(mat).any():
        return "holds NaN"
    held = ~_keyless_values(mat, stage)
    return f"holds keys (e.g. {mat[held].flat[0]:g})" if held.any() else None


def _keyless_values(values: np.ndarray, stage: str) -> np.ndarray:
    """Where a split stage holds what a split no row sees a key of holds: a log-sum-exp (one column
    a split) −inf or at or below EMPTY_LSE_CEILING, an output 0."""
    return values <= EMPTY_LSE_CEILING if STAGES[stage].cols == "S" else values == 0.0


def _listed_format(src: Optional[StageSource]) -> str:
    if src is not None and src.pattern.endswith(".npy"):
        return "npy"
    return FORMATS[0]


def refuse_split_variants(dims: Dims, stages, dropout: float, where: str) -> None:
    """Split stages in a case with dropout: flash-decoding has no dropout (it is an inference path)."""
    split = [s for s in stages if STAGES[s].split]
    if split and dropout:
        raise CaseError(f"{where}: holds {split[0]} (a split of the keys) but the case has dropout {dropout:g}; "
                        "HINT: a split-KV (flash-decoding) run is an inference path without dropout")


__all__ = ["SplitSource", "split_sources", "run_split_size", "split_dims", "split_size_problem", "SPLIT_SIZE_OPTION",
           "split_arguments", "split_run", "split_arrays",
           "refuse_split_variants"]


# ----------------------------------------------------------------------------------------------
# The Python API's split arrays (flash-attn's out_accum and lse_accum).

def split_arrays(out_accum, lse_accum, dims: Dims, packed: bool) -> Dict[str, np.ndarray]:
    """{stage: (heads, rows, S·cols)} from flash-attn's split layouts, as the check reads a head's
    matrix (the splits side by side): out_accum (num_splits, batch, heads, seqlen_q, d) and lse_accum
    (num_splits, batch, heads, seqlen_q); packed (thd): (num_splits, total_q, heads, d) and
    (num_splits, heads, total_q). Either may be None. Raises ValueError naming the argument."""
    S, B, H, N, D = dims.splits, dims.batch, dims.heads, dims.seq_q, dims.d_v
    out: Dict[str, np.ndarray] = {}
    layouts = {
        "split_output": ((S, N, H, D), "(num_splits, total_q, heads, d)") if packed else
        ((S, B, H, N, D), "(num_splits, batch, heads, seqlen_q, d)"),
        "split_lse": ((S, H, N), "(num_splits, heads, total_q)") if packed else
        ((S, B, H, N), "(num_splits, batch, heads, seqlen_q)"),
    }
    for stage, given in (("split_output", out_accum), ("split_lse", lse_accum)):
        if given is None:
            continue
        arr = trailing_empty_left_out(native_float(as_array(given, stage), stage), S, stage)
        shape, words = layouts[stage]
        if tuple(arr.shape) != shape:
            raise ValueError(f"{stage}: shape {tuple(arr.shape)}, expected {shape} {words}: {plural(S, 'split')} of "
                             f"{dims.split_size} keys")
        arr = arr.astype(np.float64)
        if STAGES[stage].cols == "SDV":
            heads = arr.transpose(2, 1, 0, 3) if packed else arr.transpose(1, 2, 3, 0, 4).reshape(B * H, N, S, D)
            out[stage] = np.ascontiguousarray(heads).reshape(B * H, N, S * D)
        else:
            heads = arr.transpose(1, 2, 0) if packed else arr.transpose(1, 2, 3, 0).reshape(B * H, N, S)
            out[stage] = np.ascontiguousarray(heads)
    return out


def trailing_empty_left_out(arr: np.ndarray, splits: int, stage: str) -> np.ndarray:
    """A split stage's array (the splits on its first axis) without its splits past `splits` where
    each of them holds no key (_keyless_values): a kernel that launches a fixed number of splits
    (flash-attn's num_splits heuristic) fills its trailing ones so."""
    if arr.ndim == 0 or arr.shape[0] <= splits:
        return arr
    return arr[:splits] if _keyless_values(np.asarray(arr[splits:], dtype=np.float64), stage).all() else arr


def split_arguments(split_output, split_lse, split_size, stages) -> Optional[Tuple[object, object, int]]:
    """check_arrays' (split_output, split_lse, split_size), checked as far as they go alone (None:
    none given), and no split stage among its stages: a TypeError or ValueError naming the argument."""
    refuse_split_stages(stages)
    if split_output is None and split_lse is None and split_size is None:
        return None
    if split_size is None:
        raise ValueError("split_output/split_lse: pass split_size= too (the keys per split the program used)")
    if not isinstance(split_size, (int, np.integer)) or isinstance(split_size, (bool, np.bool_)):
        raise TypeError(f"split_size: expected a whole number of keys >= 1, got {type(split_size).__name__} "
                        f"{split_size!r}")
    why = split_size_problem(int(split_size))
    if why:
        raise ValueError(f"split_size = {split_size!r}: {why}")
    if split_output is None and split_lse is None:
        raise ValueError(f"split_size={split_size}: pass split_output= and/or split_lse= (the split stages it splits)")
    return split_output, split_lse, int(split_size)


def split_run(splits, dims: Dims, seqs, dropout: float, sources: Dict[str, StageSource]
              ) -> Tuple[Dims, Dict[str, StageSource]]:
    """The run's dimensions and sources with check_arrays' split arrays (splits: split_arguments'
    triple, or None for a run that does not split)."""
    if splits is None:
        return dims, sources
    out_accum, lse_accum, split_size = splits
    if dropout:
        raise ValueError(f"split_output/split_lse with dropout_p={dropout}: a split-KV (flash-decoding) program is "
                         "an inference path without dropout")
    keys = dims.seq_k if seqs is None else max((seqs.m(b) for b in range(seqs.count)), default=0)
    run_dims = split_dims(dims, split_size, keys)
    arrays = split_arrays(out_accum, lse_accum, run_dims, seqs is not None)
    sources = {**sources, **{n: StageSource(n, None, n, arrays=a) for n, a in arrays.items()}}
    return run_dims, {n: sources[n] for n in STAGES if n in sources}


def refuse_split_stages(stages) -> None:
    """check_arrays' stages holding a split stage: they come as split_output=, split_lse=."""
    split = [n for n in stages if n in STAGES and STAGES[n].split]
    if split:
        raise ValueError(f"stages[{split[0]!r}]: pass the split stages as {split[0]}= (flash-attn's layout, with "
                         "split_size=), not among the stages")
