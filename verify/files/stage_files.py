"""Where one stage's matrices are: a file per head (attnstep's `<stage>_head_{i}.txt|npy`, or a
name map's pattern), one `.npy` holding every head, or arrays in memory (the Python API); and
finding the stage files a folder holds."""
from __future__ import annotations

import os
import re
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

import numpy as np

from ..stages import KV_HEADS_KEY, STAGES, Dims, parse_stage_file, stage_file
from ..text import plural, printable, showable
from .case import parse_matrix, read_bytes, read_toml
from .kinds import CaseError
from .npy_bytes import NpyExpect, load_npy
from .resolution import Resolution, array_resolution, text_resolution

STACKED_SUFFIX = ".npy"             # `<stage>.npy`: every head in one array
HEAD_FIELDS = ("i", "b", "h", "j")  # placeholders of a name-map pattern ({j}: a K/V stage's {i})
STAGE_DTYPES = ("<f4", "<f8", "<f2")  # what a stage .npy may hold (inputs are float32 only)
STAGE_ITEMSIZE = 8                   # the widest of them: bounds a stage file's size before reading
# A stage .npy as _load_npy takes it (any rank: an N×1 stage may be a vector, stacked heads 3-d).
STAGE_NPY = NpyExpect(STAGE_DTYPES, "float32, float64 or float16",
                      "save with arr.astype(np.float32) (bfloat16 has no .npy dtype)", False)


# ----------------------------------------------------------------------------------------------
# Where one stage's matrices are.

@dataclass
class StageSource:
    """One stage's matrices: a file per head (`pattern` with {i}, {b}, {h}), or one file holding
    every head (`pattern` without placeholders), or arrays in memory (the Python API)."""
    stage: str
    folder: Optional[Path]
    pattern: str
    arrays: Optional[np.ndarray] = None  # (heads, rows, cols), for the Python API
    _stack: Optional[np.ndarray] = field(default=None, repr=False)

    @property
    def per_head(self) -> bool:
        return bool(_placeholders(self.pattern))

    def name(self, head: int, dims: Dims) -> str:
        """The file of `head`: a query head, or for the stages of K/V heads a K/V head (its {b}
        and {h} then count K/V heads)."""
        b, h = divmod(head, heads_per_batch(self.stage, dims))
        return self.pattern.format(i=head, j=head, b=b, h=h) if self.per_head else self.pattern

    def file(self, head: int, dims: Dims) -> Path:
        return Path(self.folder or ".") / self.name(head, dims)

    def describe(self) -> str:
        return "arrays" if self.arrays is not None else printable(self.pattern)

    def read(self, head: int, dims: Dims, data: Optional[bytes] = None
             ) -> Tuple[np.ndarray, Resolution, Optional[bytes]]:
        """(the head's matrix as float64, its resolution, the file's bytes when per head); data:
        the file's bytes when the caller has read them. Raises CaseError for a file that cannot be
        read as the stage's matrix (a head's matrix of the wrong shape is the caller's to report)."""
        shape = STAGES[self.stage].shape(dims)
        if self.arrays is not None:
            return _as_matrix(self.arrays[head], shape), array_resolution(self.arrays), None
        path = self.file(head, dims)
        if self.per_head:
            data = read_bytes(path, shape, STAGE_ITEMSIZE, STAGE_NPY) if data is None else data
            if path.suffix == ".npy":
                arr = _load_npy(data, path)
                return _as_matrix(arr, shape), array_resolution(arr), data
            mat = parse_matrix(data, path, None)
            return mat.astype(np.float64), text_resolution(data), data
        stack = self._stacked(dims, path)
        return stack[head].astype(np.float64), array_resolution(stack), None

    def _stacked(self, dims: Dims, path: Path) -> np.ndarray:
        if self._stack is None:
            heads = dims.heads_of(self.stage)
            if path.suffix != ".npy":
                if heads != 1:
                    raise CaseError(f"{path}: one text file for {plural(heads, 'head')}; HINT: name "
                                    "a file per head with {i} in the pattern, or save every head in a .npy")
                data = read_bytes(path, STAGES[self.stage].shape(dims))
                self._stack = parse_matrix(data, path, None)[None]
            else:
                r, c = STAGES[self.stage].shape(dims)
                data = read_bytes(path, (heads * r, c), STAGE_ITEMSIZE, STAGE_NPY)
                self._stack = _stack_heads(_load_npy(data, path), self.stage, dims, path)
        return self._stack


def _load_npy(data: bytes, path: Path) -> np.ndarray:
    arr = load_npy(data, str(path))
    if arr.dtype.str not in STAGE_DTYPES:
        raise CaseError(f"{path}: dtype {arr.dtype}, expected {STAGE_NPY.words}; HINT: {STAGE_NPY.hint}")
    return arr


def _as_matrix(arr: np.ndarray, shape: Tuple[int, int]) -> np.ndarray:
    """One head's matrix as float64; an N×1 stage may come as a vector of N, anything else 2-d
    as it is (the caller compares the shape)."""
    arr = np.asarray(arr)
    if arr.ndim == 1 and shape[1] == 1:
        arr = arr[:, None]
    elif arr.ndim != 2:
        arr = arr.reshape(arr.shape[0] if arr.ndim else 1, -1)
    return arr.astype(np.float64)


def heads_per_batch(stage: str, dims: Dims) -> int:
    """The heads of `stage` per batch element: K/V heads for the stages of K/V heads, else H."""
    return dims.kv if STAGES[stage].kv else dims.heads


def gqa_layout(stage: str, dims: Dims) -> str:
    """How a grouped case lays out a stage of K/V heads, in words (for the message of a program
    that wrote it per query head)."""
    summed = ", the sum over the query heads of its group" if STAGES[stage].backward else ""
    return (f"the case has {dims.kv} K/V heads per batch element ({KV_HEADS_KEY} = {dims.kv} of {dims.heads} heads), "
            f"so {stage} has one matrix per K/V head j = b*{dims.kv} + h // {dims.group_size}{summed}")


def _stack_heads(arr: np.ndarray, stage: str, dims: Dims, path: Path) -> np.ndarray:
    """(heads, rows, cols) from what a PyTorch or Triton user saves: (heads, r, c), (B, H, r, c),
    or for one head (r, c); an N×1 stage may drop its last axis. The stages of K/V heads have
    B·Hk heads."""
    r, c = STAGES[stage].shape(dims)
    B, H = dims.batch, heads_per_batch(stage, dims)
    accepted = [(B * H, r, c), (B, H, r, c)]
    if c == 1:
        accepted += [(B * H, r), (B, H, r)]
    if B * H == 1:
        accepted += [(r, c)] + ([(r,)] if c == 1 else [])
    # (b, h, ...) with b·h heads, batch-major, also where the input case does not say B and H
    # (no manifest: B = 1)
    head_shapes = [(r, c)] + ([(r,)] if c == 1 else [])
    four_d = arr.ndim >= 3 and arr.shape[0] * arr.shape[1] == B * H and tuple(arr.shape[2:]) in head_shapes
    if tuple(arr.shape) not in accepted and not four_d:
        per_query = STAGES[stage].kv and dims.kv != dims.heads and arr.ndim >= 3 and \
            (arr.shape[0] == B * dims.heads or arr.shape[:2] == (B, dims.heads))
        why = f": written per query head, but {gqa_layout(stage, dims)}" if per_query else ""
        raise CaseError(f"{path}: shape {tuple(arr.shape)}, expected {' or '.join(map(str, accepted[:2]))} "
                        f"(heads, {STAGES[stage].rows}, {STAGES[stage].cols}){why}")
    return arr.reshape(B * H, r, c)


# ----------------------------------------------------------------------------------------------
# Finding the stage files of a folder.

def parse_name_map(items: Mapping[str, str], where: str) -> Dict[str, str]:
    """{stage: pattern} from `--name STAGE=PATTERN` items or a names file, validated."""
    out = {}
    for stage, pattern in items.items():
        if stage not in STAGES:
            raise CaseError(f"{where}: unknown stage '{printable(stage)}'; stages are: {', '.join(STAGES)}")
        shown = printable(repr(pattern))
        if not isinstance(pattern, str) or not pattern.strip() or Path(pattern).is_absolute() \
                or ".." in Path(pattern).parts:
            raise CaseError(f"{where}: {stage}: expected a file name inside the output folder, such as "
                            f"'{stage}_{{i}}.txt', got {shown}")
        if not showable(pattern):  # it would put them into every message naming a file
            raise CaseError(f"{where}: {stage} = {shown}: control characters in a file name; HINT: "
                            "name the files with printable characters")
        if _placeholders(pattern) is None or (not STAGES[stage].kv and any(
                name == "j" for _, name, _, _ in string.Formatter().parse(pattern))):
            kv = " and, for a stage of the K/V heads, {j} (the K/V head, as {i})"
            raise CaseError(f"{where}: {stage} = {shown}: the only placeholders are {{i}} (head "
                            f"0..B·H-1), {{b}} (batch) and {{h}} (head within the batch), without formats{kv}")
        out[stage] = pattern
    return out


def _placeholders(pattern: str) -> Optional[set]:
    """The head fields a pattern names ({i}, {b}, {h}; {j} as {i}), or None when it has anything
    else: another name, an index or attribute, a format or conversion, an unmatched brace."""
    try:
        parts = list(string.Formatter().parse(pattern))
    except ValueError:
        return None
    fields = set()
    for _, name, spec, conversion in parts:
        if name is None:
            continue
        if name not in HEAD_FIELDS or spec or conversion:
            return None
        fields.add("i" if name == "j" else name)
    return fields


# A head field as a program writes it through the pattern (str.format of a non-negative int):
# ASCII digits, no sign, no leading zero. Anything looser would take a user's own file (say
# `O_2024-notes.txt` for `O_{i}.txt`) for a stage file, which `run` then moves aside.
_HEAD_NUMBER = "(?:0|[1-9][0-9]*)"


def pattern_regex(pattern: str) -> "re.Pattern[str]":
    """A name-map pattern as a regex matching (fullmatch) exactly the names it gives some head."""
    out = []
    for literal, name, _, _ in string.Formatter().parse(pattern):
        out.append(re.escape(literal))
        if name is not None:
            out.append(_HEAD_NUMBER)
    return re.compile("".join(out))


def named_alike(folder: Path, pattern: str, most: int = 3) -> List[str]:
    """Files of FOLDER that the pattern would match but for upper and lower case (first `most`,
    sorted): a name map's usual slip, dK_{i} for dk_0."""
    rx = re.compile(pattern_regex(pattern).pattern, re.IGNORECASE)
    try:
        names = sorted(e.name for e in folder.iterdir() if rx.fullmatch(e.name))
    except OSError:
        return []
    return names[:most]


def _nameable(folder: Path, stage: str, pattern: str) -> None:
    """A pattern no file could have: a name past the file system's limit is said as such (not as a
    stage the program did not write)."""
    try:
        limit = os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    if len(pattern.replace("{", "").replace("}", "").encode("utf-8", "surrogateescape")) > limit:
        raise CaseError(f"the name map's {stage}={printable(pattern)}: file name too long for {folder} "
                        f"(more than {limit} bytes)")


def files_past_the_heads(folder: Path, sources: Dict[str, "StageSource"], dims: Dims) -> List[str]:
    """Files of a per-head stage in `folder` beyond the case's heads (a program run on a case of
    more heads, or a folder checked against another case): what they match of its pattern, in
    order, that no head of `dims` is named."""
    entries = sorted(os.listdir(folder))
    out = []
    for stage, src in sources.items():
        if src.arrays is not None or not src.per_head or STAGES[stage].split:
            continue
        named = {src.name(i, dims) for i in range(dims.heads_of(stage))}
        match = pattern_regex(src.pattern)
        out += [e for e in entries if match.fullmatch(e) and e not in named]
    return out


def check_heads_named(sources: Dict[str, "StageSource"], dims: Dims) -> None:
    """Each per-head pattern names every head apart: {i}, or {b} and {h} (one of them suffices when
    the other dimension is 1). Otherwise several heads would read one file."""
    for src in sources.values():
        fields = _placeholders(src.pattern) or set()
        per_batch = heads_per_batch(src.stage, dims)
        if not fields or "i" in fields or fields == {"b", "h"} or \
                (fields == {"h"} and dims.batch == 1) or (fields == {"b"} and per_batch == 1):
            continue
        raise CaseError(f"{printable(src.pattern)}: names {plural(dims.heads_of(src.stage), 'head')} "
                        f"(batch {dims.batch} x {per_batch}) with {', '.join('{' + f + '}' for f in sorted(fields))} "
                        "only: several heads would read one file; HINT: use {i}, or {b} and {h}")


def refuse_query_head_kv_files(sources: Dict[str, "StageSource"], dims: Dims) -> None:
    """A stage of K/V heads written per query head in a grouped case (a file for K/V head B·Hk,
    beyond the last): one line naming the layout the case has, rather than stale or extra files."""
    if dims.kv == dims.heads:
        return
    for src in sources.values():
        fields = _placeholders(src.pattern) or set()
        if not (STAGES[src.stage].kv and src.folder is not None and fields & {"i", "h"}):
            continue
        # The first file past the K/V heads: {i} = B·Hk, or {b} = 0 and {h} = Hk.
        beyond = Path(src.folder) / src.pattern.format(i=dims.total_kv_heads, j=dims.total_kv_heads, b=0,
                                                       h=dims.kv)
        if beyond.exists():
            raise CaseError(f"{beyond}: one {src.stage} file per query head, but {gqa_layout(src.stage, dims)} "
                            f"({src.name(0, dims)} .. {src.name(dims.total_kv_heads - 1, dims)}); HINT: write "
                            f"{src.stage} per K/V head")


def read_names_file(path: Path) -> Dict[str, str]:
    """A names file: flat `STAGE = "PATTERN"` lines (the manifests' TOML subset)."""
    try:
        return parse_name_map(read_toml(path, "names file"), str(path))
    except CaseError as exc:
        if "not a valid names file" not in str(exc):
            raise
        # (the usual slip: a pattern written bare, as on the command line)
        raise CaseError(f'{exc}; HINT: each line is STAGE = "PATTERN", the pattern in double quotes '
                        '(flash_output = "o_{i}.txt")') from None


def discover_sources(folder: Path, names: Mapping[str, str], unmatched: Optional[List[str]] = None
                     ) -> Dict[str, StageSource]:
    """The stages present in `folder`, table order: a name-map entry, `<stage>_head_{i}.txt|npy`
    (a packed run's `<stage>_head_{i}_seq_{b}` files count as their stage's: the check reads them
    per sequence, verify/check/packed.py), or `<stage>.npy`. Both of the last two for one stage
    is ambiguous: an error. A name-map entry that names no file of the folder is a stage the
    program did not write (one names file serves runs of different stages; a typo shows in the
    note): its stage goes into `unmatched`."""
    entries = set(os.listdir(folder))
    per_head: Dict[str, set] = {}
    for entry in entries:
        parsed = parse_stage_file(entry)
        # (a split stage's files, `<stage>_head_{i}_split_{s}`, are verify/files/split_files.py's)
        if parsed and parsed[0] in STAGES and parsed.split is None and not STAGES[parsed[0]].split:
            per_head.setdefault(parsed[0], set()).add(parsed[2])
    found: Dict[str, StageSource] = {}
    for stage in STAGES:
        if stage in names:
            pattern = names[stage]
            if "/" in pattern or any(pattern_regex(pattern).fullmatch(e) for e in entries):
                found[stage] = StageSource(stage, folder, pattern)
            elif unmatched is not None:
                _nameable(folder, stage, pattern)
                if stage in per_head or stage + STACKED_SUFFIX in entries:  # (its files are there, named otherwise)
                    raise CaseError(f"the name map's {stage}={printable(pattern)} matches no file in {folder}, but "
                                    f"{stage}'s own files are there; HINT: correct the pattern, or leave it out to "
                                    "check those")
                unmatched.append(stage)
            continue
        fmts = sorted(per_head.get(stage, ()))
        stacked = stage + STACKED_SUFFIX in entries
        if len(fmts) > 1:
            raise CaseError(f"{folder}: {stage} has both .txt and .npy head files; HINT: remove one set")
        if fmts and stacked:
            raise CaseError(f"{folder}: both {stage}_head_*.{fmts[0]} and {stage}{STACKED_SUFFIX}; "
                            "HINT: remove one, or name the one to check with --name")
        if fmts:
            found[stage] = StageSource(stage, folder, stage_file(stage, 0, fmts[0]).replace("_head_0.", "_head_{i}."))
        elif stacked:
            found[stage] = StageSource(stage, folder, stage + STACKED_SUFFIX)
    return found
