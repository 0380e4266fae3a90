"""The files of a packed case (verify/sequences.py): `cu_seqlens_q`, `cu_seqlens_k` ((B + 1) × 1
offsets each) and the optional `seqused_k` (B × 1), in the case's format; their strict reading
(whole numbers only, errors naming file:line:col), the manifest's `sequences` key and the rules
that tie them to the case (docs/contract.md, "Packed sequences"), and their writing.

Which case is packed: one whose manifest has `sequences = B`; without a manifest, one that has
the cu_seqlens files. A sequence file anywhere else is an error, as is a packed case with a batch
above 1, totals that are not seq_q and seq_k, mask or bias files, or dropout.
"""
from __future__ import annotations

import io
import os
import tokenize
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from ..sequences import (CU_SEQLENS_K, CU_SEQLENS_Q, MAX_TOKENS, NOT_PACKED, NOT_PACKED_HINT, PACKED_VARIANTS_HINT,
                         SEQUENCE_FILES, SEQUENCES_KEY, SEQUSED_K, Sequences, count_problem, integer_token_problem,
                         packed_batch_problem, problem_file, sequences_count_problem, sequences_problem,
                         unsupported_with_packing)
from ..stages import BIAS_INPUT, FORMATS, INPUT_MANIFEST, KEYS, MASK_INPUT, QUERIES, Dims, stage_file
from ..text import plural
from ..variant import NONE, Variant
from .kinds import CaseError
from .matrix_io import (char_column, check_npy_size, check_row_length, npy_header, npy_header_span, read_bytes,
                        text_rows)

# The dtypes an .npy sequence file may have (little-endian, or one byte): every integer type, and
# float32 holding whole numbers (what a matrix-only writer produces).
NPY_COUNT_DESCRS = ("|i1", "|u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8", "<f4")
_WIDEST_ITEM = 8


def sequence_file(name: str, fmt: str) -> str:
    """`cu_seqlens_q.txt`, `seqused_k.npy`: one file for the whole case."""
    return f"{name}.{fmt}"


def sequence_files(folder: Path) -> Dict[str, Set[str]]:
    """name -> the formats of the sequence file `name.{fmt}` present in `folder`."""
    entries = set(os.listdir(folder))
    found = {name: {fmt for fmt in FORMATS if sequence_file(name, fmt) in entries} for name in SEQUENCE_FILES}
    return {name: fmts for name, fmts in found.items() if fmts}


# ----------------------------------------------------------------------------------------------
# Strict reading of one file: a column of whole numbers.

def read_counts(path: Path, rows: Optional[int] = None) -> Tuple[int, ...]:
    """The values of one sequence file, a column of whole numbers 0..MAX_TOKENS; `rows`, when
    known, bounds the file's size before it is read (the count is compared by the caller)."""
    data = read_bytes(path, (MAX_TOKENS + 1 if rows is None else max(rows, 1), 1), itemsize=_WIDEST_ITEM)
    return _npy_counts(data, path) if str(path).endswith(".npy") else _text_counts(data, path)


def _text_counts(data: bytes, path: Path) -> Tuple[int, ...]:
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError as exc:
        raise CaseError(f"{path}: not a text file (non-ASCII byte at offset {exc.start}); "
                        "HINT: is it a .npy file with the wrong extension?") from None
    lines = text.split("\n")
    values = []
    for lineno, tokens in text_rows(text, str(path)):
        check_row_length(str(path), lineno, tokens, 1)
        problem = integer_token_problem(tokens[0])
        if problem:
            raise CaseError(f"{path}:{lineno}:{char_column(lines[lineno - 1], tokens, 0)}: {problem}")
        values.append(int(tokens[0]))
    return tuple(values)


def _npy_counts(data: bytes, path: Path) -> Tuple[int, ...]:
    check_npy_size(data, str(path))
    if b"#" in data[slice(*npy_header_span(data))]:
        raise CaseError(f"{path}: not a valid .npy file (a '#' in its header)")
    try:
        arr = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise CaseError(f"{path}: not a valid .npy file ({str(exc).splitlines()[0]})") from None
    except (SyntaxError, tokenize.TokenError):  # numpy parses the header dict as Python source
        raise CaseError(f"{path}: not a valid .npy file (its header is not a dict literal)") from None
    header = npy_header(data)
    if header["descr"] not in NPY_COUNT_DESCRS:
        raise CaseError(f"{path}: dtype {header['descr']!r}, expected an integer type or float32 holding whole "
                        "numbers; HINT: save with arr.astype(np.int32)")
    if header["fortran_order"]:
        raise CaseError(f"{path}: fortran_order arrays are not supported; HINT: save np.ascontiguousarray(arr)")
    if arr.ndim != 2 or arr.shape[1] != 1:
        raise CaseError(f"{path}: shape {tuple(arr.shape)}, expected a column (rows, 1); HINT: save "
                        "arr.reshape(-1, 1)")
    values = []
    for r, value in enumerate(arr[:, 0].tolist()):
        problem = count_problem(value)
        if problem:
            raise CaseError(f"{path}:row {r}, col 0: {problem}")
        values.append(int(value))
    return tuple(values)


# ----------------------------------------------------------------------------------------------
# The sequences of a case.

def manifest_count(values: dict, manifest: Path) -> Optional[int]:
    """The manifest's `sequences` (its type already checked), None when absent; out of
    1..MAX_TOKENS, or with a batch other than 1, an error."""
    count = values.get(SEQUENCES_KEY)
    if count is None:
        return None
    if not 1 <= count <= MAX_TOKENS:
        raise CaseError(f"{manifest}: {sequences_count_problem(count)}")
    batch = values.get("batch")
    if batch != 1:
        raise CaseError(f"{manifest}: {packed_batch_problem(batch, count)}")
    return count


def case_sequences(folder: Path, fmt: str, dims: Dims, variant: Variant, count: Optional[int],
                   manifest: bool) -> Optional[Sequences]:
    """The packing of the case in `folder`, read and checked, or None for a case that is not
    packed (then no sequence file may be there). `count`: the manifest's `sequences`; without a
    manifest the cu_seqlens files make the case packed, and its seq_q and seq_k come from Q and K."""
    present = sequence_files(folder)
    packed = count is not None if manifest else bool(present.keys() & {CU_SEQLENS_Q, CU_SEQLENS_K})
    for name, fmts in present.items():  # in SEQUENCE_FILES' order, as the binary looks
        if not packed:
            why = (f"no {SEQUENCES_KEY} = B in {INPUT_MANIFEST}" if manifest
                   else f"no {CU_SEQLENS_Q} and {CU_SEQLENS_K} files")
            raise CaseError(f"{folder / sequence_file(name, sorted(fmts)[0])}: {NOT_PACKED} ({why}); "
                            f"HINT: {NOT_PACKED_HINT}")
        other = sorted(fmts - {fmt})
        if other:
            raise CaseError(f"{folder / sequence_file(name, other[0])}: a .{other[0]} file in a .{fmt} case; HINT: a "
                            "case holds one format; remove the stray file")
    if not packed:
        return None
    _refuse_unsupported(folder, variant, manifest)
    for name in (CU_SEQLENS_Q, CU_SEQLENS_K):
        if name not in present:
            why = (f"{INPUT_MANIFEST} says {SEQUENCES_KEY} = {count}" if manifest
                   else "a packed case has both cu_seqlens files")
            raise CaseError(f"{folder / sequence_file(name, fmt)}: missing file ({why})")
    paths = {name: folder / sequence_file(name, fmt) for name in SEQUENCE_FILES}
    cu_q = read_counts(paths[CU_SEQLENS_Q], None if count is None else count + 1)
    if count is not None and len(cu_q) != count + 1:
        raise CaseError(f"{paths[CU_SEQLENS_Q]}: {plural(len(cu_q), 'offset')}, but {folder / INPUT_MANIFEST} says "
                        f"{SEQUENCES_KEY} = {count}, which takes {count + 1} (B + 1)")
    cu_k = read_counts(paths[CU_SEQLENS_K], len(cu_q))
    used = read_counts(paths[SEQUSED_K], len(cu_q) - 1) if SEQUSED_K in present else None
    problem = sequences_problem(cu_q, cu_k, used)
    if problem:
        raise CaseError(f"{paths[problem_file(problem)]}: {problem}")
    seqs = Sequences(cu_q, cu_k, used)
    _check_totals(seqs, dims, paths, folder, fmt, manifest)
    return seqs


def _refuse_unsupported(folder: Path, variant: Variant, manifest: bool) -> None:
    """Mask and bias files and dropout in a packed case: an error naming where the case asks for
    them (the manifest's key, or the file)."""
    mask, bias = variant.mask != NONE, variant.bias != NONE
    problem = unsupported_with_packing(mask, bias, variant.dropout > 0)
    if not problem:
        return
    if manifest:
        key = "mask" if mask else "bias" if bias else "dropout"
        value = f'"{getattr(variant, key)}"' if key != "dropout" else f"{variant.dropout!r}"
        raise CaseError(f"{folder / INPUT_MANIFEST}: {key} = {value}: {problem}; HINT: {PACKED_VARIANTS_HINT}")
    name = MASK_INPUT if mask else BIAS_INPUT
    held = sorted(e for e in os.listdir(folder) if e.startswith(name) and e.rpartition(".")[2] in FORMATS)
    raise CaseError(f"{folder / (held[0] if held else name)}: {problem}; HINT: {PACKED_VARIANTS_HINT}")


def _check_totals(seqs: Sequences, dims: Dims, paths, folder: Path, fmt: str, manifest: bool) -> None:
    """seq_q and seq_k are the packed tokens: the offsets' last values."""
    for name, total, key, stage, what in ((CU_SEQLENS_Q, seqs.total_q, "seq_q", QUERIES, "queries"),
                                          (CU_SEQLENS_K, seqs.total_k, "seq_k", KEYS, "keys")):
        want = getattr(dims, key)
        if total != want:
            said = (f"{folder / INPUT_MANIFEST} says {key} = {want}" if manifest
                    else f"{stage_file(stage, 0, fmt)} has {plural(want, 'row')}")
            raise CaseError(f"{paths[name]}: ends at {total} (the packed {what}), but {said}; HINT: {key} is the "
                            "total of the sequences' lengths")


# ----------------------------------------------------------------------------------------------
# Writing (the generator).

def counts_bytes(values: Sequence[int], fmt: str) -> bytes:
    """A sequence file's bytes: one integer per line, or an int32 (rows, 1) .npy (flash-attn's
    dtype for cu_seqlens)."""
    if fmt == "npy":
        buf = io.BytesIO()
        np.save(buf, np.asarray(values, dtype="<i4").reshape(-1, 1), allow_pickle=False)
        return buf.getvalue()
    return "".join(f"{int(v)}\n" for v in values).encode("ascii")


def sequence_file_values(seqs: Sequences) -> Dict[str, Tuple[int, ...]]:
    """The files a packed case has, name -> values: the offsets, and seqused_k when given."""
    out = {CU_SEQLENS_Q: seqs.cu_q, CU_SEQLENS_K: seqs.cu_k}
    if seqs.used_k is not None:
        out[SEQUSED_K] = seqs.used_k
    return out


def sequence_file_names(folder: Path) -> List[str]:
    """The sequence files in `folder`, every format (what replacing a case removes)."""
    return [sequence_file(name, fmt) for name, fmts in sequence_files(folder).items() for fmt in sorted(fmts)]
