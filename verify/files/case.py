"""Input cases on disk: Q/K/V (and the output gradient dO) per head (text or .npy), an optional
manifest, the layout checked.

The matrix files and manifests are read by verify/files/matrix_io.py and verify/files/manifests.py (their
names are re-exported here, where most callers look for them).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..stages import (CASE_INPUTS, FORMATS, GRAD_INPUT, INPUT_MANIFEST, INPUT_NAMES, STAGES, Dims, parse_stage_file,
                      stage_file)
from ..text import plural, printable
from .kinds import CaseError
from .manifests import (INPUT_KEYS, INT64, check_case_limits, check_scale, check_types, read_toml, validate_dims,
                        write_toml)
from .matrix_io import (atomic_write_bytes, crc32_hex, file_kind, matrix_bytes, matrix_max_bytes, output_file_target,
                        parse_matrix, parse_npy_matrix, parse_text_matrix, probe_writable, read_bytes, read_matrix,
                        text_header_fields, write_matrix)

__all__ = ["InputCase", "load_input_case", "input_head_files", "clear_input_files", "CaseError", "INPUT_KEYS",
           "INT64", "check_scale", "check_types", "read_toml", "validate_dims", "write_toml", "atomic_write_bytes",
           "crc32_hex", "file_kind", "matrix_bytes", "matrix_max_bytes", "output_file_target", "parse_matrix",
           "parse_npy_matrix", "parse_text_matrix", "probe_writable", "read_bytes", "read_matrix",
           "text_header_fields", "write_matrix"]

# ----------------------------------------------------------------------------------------------
# Input cases.

@dataclass
class InputCase:
    path: Path
    dims: Dims
    fmt: str
    causal: bool = False
    scale: Optional[float] = None  # None: 1/sqrt(d_k)
    manifest: bool = False         # the case has a manifest (which then says causal and scale)
    arrays: Optional[Dict[str, np.ndarray]] = None  # Q, K, V as (heads, rows, cols): the Python API
    allow_nonfinite: bool = False  # NaN/inf in Q/K/V load instead of being an error
    backward: bool = False         # the case has dO for every head (the backward stages exist)

    @property
    def inputs(self) -> Tuple[str, ...]:
        """The input matrices every head has: Q, K, V, and dO for a backward case."""
        return CASE_INPUTS if self.backward else INPUT_NAMES

    def file(self, name: str, head: int) -> Path:
        return self.path / stage_file(name, head, self.fmt)

    def load(self, name: str, head: int) -> np.ndarray:
        if self.arrays is not None:
            return self.arrays[name][head]
        shape = STAGES[name].shape(self.dims)
        return read_matrix(self.file(name, head), shape, allow_nonfinite=self.allow_nonfinite)


def _head_files(folder: Path) -> Dict[Tuple[str, int], List[str]]:
    """(name, head) -> the formats present, from the names <input>_head_<i>.<txt|npy> of Q, K, V,
    dO (head numbers without leading zeros, as the binary lists them)."""
    found: Dict[Tuple[str, int], List[str]] = {}
    for entry in sorted(os.listdir(folder)):
        parsed = parse_stage_file(entry)
        if parsed and parsed[0] in CASE_INPUTS and entry == stage_file(*parsed):
            found.setdefault((parsed[0], parsed[1]), []).append(parsed[2])
    return found


def _format_of_files(folder: Path, files) -> Optional[str]:
    """The format Q_head_0 is in (None when it is absent); both at once is ambiguous."""
    formats = files.get((INPUT_NAMES[0], 0), [])
    if len(formats) > 1:
        raise CaseError(f"{folder}: both Q_head_0.txt and Q_head_0.npy exist; HINT: remove one, or add "
                        f"format = \"txt\" (or \"npy\") to {INPUT_MANIFEST}")
    return formats[0] if formats else None


def load_input_case(folder: Path) -> InputCase:
    """Reads the manifest (or infers shapes from the files) and checks the layout is complete."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CaseError(f"{folder}: input case folder not found; HINT: run 'attnstep generate' first")
    files = _head_files(folder)
    manifest = folder / INPUT_MANIFEST
    if manifest.exists():
        values = read_toml(manifest)
        unknown = sorted(set(values) - set(INPUT_KEYS))
        if unknown:
            raise CaseError(f"{manifest}: unknown key '{printable(unknown[0])}'")
        check_types(values, INPUT_KEYS, str(manifest))
        dims = validate_dims(values, str(manifest))
        # Without a `format` line the files say, as the binary reads it.
        fmt = values["format"] if "format" in values else _format_of_files(folder, files) or FORMATS[0]
        if fmt not in FORMATS:
            raise CaseError(f"{manifest}: format = {printable(repr(fmt))}; expected one of {', '.join(FORMATS)}")
        scale = check_scale(values["scale"], str(manifest)) if "scale" in values else None
        case = InputCase(folder, dims, fmt, values.get("causal", False), scale, manifest=True)
        flag = values.get("backward")
    else:
        case = _infer_case(folder, files)
        flag = None
    case.backward = _has_grad(case, files, flag)
    if case.backward:  # the backward stages count too, as the binary counts them
        check_case_limits(case.dims, str(manifest if manifest.exists() else folder), backward=True)
    _check_layout(case, files, flagged=flag is not None)
    return case


def _has_grad(case: InputCase, files, flag: Optional[bool]) -> bool:
    """Whether the case has dO: the manifest's `backward` when it says, else whether any dO file of
    the case's format exists (then every head needs one), as the binary decides."""
    grads = sorted(i for (name, i), formats in files.items() if name == GRAD_INPUT and case.fmt in formats)
    if flag is None:
        return bool(grads)
    if not flag and grads:
        raise CaseError(f"{case.file(GRAD_INPUT, grads[0])}: exists but {case.path / INPUT_MANIFEST} says "
                        "backward = false; HINT: remove the dO files, or set backward = true")
    return flag


def _infer_case(folder: Path, files) -> InputCase:
    heads = 0
    Q, K, V = INPUT_NAMES
    while (Q, heads) in files:
        heads += 1
    if heads == 0:
        raise CaseError(f"{folder}: no {stage_file(Q, 0, 'txt')} or {stage_file(Q, 0, 'npy')} and no "
                        f"{INPUT_MANIFEST}; HINT: is this an input case folder?")
    fmt = _format_of_files(folder, files)
    missing = [n for n in (K, V) if (n, 0) not in files]
    if missing:
        raise CaseError(f"{folder / stage_file(missing[0], 0, fmt)}: missing file ({stage_file(Q, 0, fmt)} exists)")
    q, k, v = (read_matrix(folder / stage_file(n, 0, fmt)) for n in INPUT_NAMES)
    if k.shape[1] != q.shape[1]:
        raise CaseError(f"{folder / stage_file(K, 0, fmt)}: {plural(k.shape[1], 'column')} but {stage_file(Q, 0, fmt)} "
                        f"has {q.shape[1]}; HINT: Q and K must share d_k")
    if v.shape[0] != k.shape[0]:
        raise CaseError(f"{folder / stage_file(V, 0, fmt)}: {plural(v.shape[0], 'row')} but {stage_file(K, 0, fmt)} has "
                        f"{k.shape[0]}; HINT: K and V must share seq_k")
    values = dict(batch=1, heads=heads, seq_q=q.shape[0], seq_k=k.shape[0], d_k=q.shape[1], d_v=v.shape[1])
    return InputCase(folder, validate_dims(values, str(folder)), fmt)


def _check_layout(case: InputCase, files, flagged: bool) -> None:
    """Every head's inputs in the case's format; no head beyond the case; no file of the other
    format (which one would be meant?), as the binary checks. `flagged`: the manifest says
    `backward` (which then is why dO is required)."""
    total = case.dims.total_heads
    for i in range(total):
        for name in case.inputs:
            if case.fmt in files.get((name, i), ()):
                continue
            if name == GRAD_INPUT:
                why = "the manifest says backward = true" if flagged else "the case has dO files, so every head needs one"
                raise CaseError(f"{case.file(name, i)}: missing file ({why}); HINT: regenerate the case with "
                                "'attnstep generate --backward'")
            raise CaseError(f"{case.file(name, i)}: missing file ({plural(total, 'head')} expected)")
    for (name, i), formats in sorted(files.items(), key=lambda kv: kv[0][::-1]):
        other = [f for f in formats if f != case.fmt]
        if other:
            raise CaseError(f"{case.path / stage_file(name, i, other[0])}: a .{other[0]} file in a .{case.fmt} "
                            "case; HINT: a case holds one format; remove the stray file")
        if i >= total:
            raise CaseError(f"{case.path / stage_file(name, i, formats[0])}: unexpected file: the case has "
                            f"{plural(total, 'head')} (0..{total - 1})")


def input_head_files(folder: Path) -> List[str]:
    """The names of the input head files (Q, K, V, dO) in `folder`."""
    return [stage_file(name, i, fmt) for (name, i), formats in _head_files(folder).items() for fmt in formats]


def clear_input_files(folder: Path) -> None:
    """Removes an earlier case's input head files and manifest, so no stale head survives."""
    for name in input_head_files(folder):
        (folder / name).unlink()
    (folder / INPUT_MANIFEST).unlink(missing_ok=True)
