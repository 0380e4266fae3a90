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
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from ..sequences import (BLOCK_TABLE, COUNT_RANGE, CU_SEQLENS_K, CU_SEQLENS_Q, MAX_TOKENS, NEW_KEYS_KEY, NOT_PACKED,
                         NOT_PACKED_HINT, new_keys_count_problem, new_keys_unpacked_problem,
                         NOT_PAGED, NOT_PAGED_HINT, PACKED_VARIANTS_HINT, PAGE_SIZE_KEY, PAGE_SIZE_UNKNOWN,
                         PAGE_SIZE_UNKNOWN_HINT, PAGED_BACKWARD, PAGED_BACKWARD_HINT, PAGED_CU_SEQLENS_K_HINT,
                         PAGED_NEEDS_SEQUSED, SEQUENCE_FILES, SEQUENCES_KEY, SEQUSED_K, TABLE_ENTRY_RANGE, Sequences,
                         WholeRange, count_problem, integer_token_problem, packed_batch_problem, page_size_problem,
                         paged_cu_seqlens_k_problem, paged_problem, paged_unpacked_problem, pool_rows_problem,
                         problem_file, sequences_count_problem, sequences_problem, unsupported_with_packing)
from ..stages import BIAS_INPUT, FORMATS, GRAD_INPUT, INPUT_MANIFEST, KEYS, MASK_INPUT, QUERIES, Dims, stage_file
from ..text import plural
from ..variant import NONE, Variant
from .kinds import CaseError
from .matrix_io import char_column, check_row_length, read_bytes, text_rows
from .npy_bytes import load_npy, npy_header

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


def read_table(path: Path) -> Tuple[Tuple[int, ...], ...]:
    """A block_table: rows of whole numbers (every row as many as the first), each an int32."""
    data = read_bytes(path, (MAX_TOKENS + 1, 1), itemsize=_WIDEST_ITEM)
    if str(path).endswith(".npy"):
        return _npy_counts(data, path, column=False, rule=TABLE_ENTRY_RANGE)
    return _text_counts(data, path, column=False, rule=TABLE_ENTRY_RANGE)


def _text_counts(data: bytes, path: Path, column: bool = True, rule: WholeRange = COUNT_RANGE):
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError as exc:
        raise CaseError(f"{path}: not a text file (non-ASCII byte at offset {exc.start}); "
                        "HINT: is it a .npy file with the wrong extension?") from None
    lines = text.split("\n")
    rows = text_rows(text, str(path))
    want = 1 if column else len(rows[0][1])
    values = []
    for lineno, tokens in rows:
        check_row_length(str(path), lineno, tokens, want)
        for j, token in enumerate(tokens):
            problem = integer_token_problem(token, rule)
            if problem:
                raise CaseError(f"{path}:{lineno}:{char_column(lines[lineno - 1], tokens, j)}: {problem}")
        values.append(tuple(int(t) for t in tokens))
    return tuple(v[0] for v in values) if column else tuple(values)


def _npy_counts(data: bytes, path: Path, column: bool = True, rule: WholeRange = COUNT_RANGE):
    arr = load_npy(data, str(path))
    header = npy_header(data)
    if header["descr"] not in NPY_COUNT_DESCRS:
        raise CaseError(f"{path}: dtype {header['descr']!r}, expected an integer type or float32 holding whole "
                        "numbers; HINT: save with arr.astype(np.int32)")
    if header["fortran_order"]:
        raise CaseError(f"{path}: fortran_order arrays are not supported; HINT: save np.ascontiguousarray(arr)")
    if arr.ndim != 2 or (column and arr.shape[1] != 1):
        raise CaseError(f"{path}: shape {tuple(arr.shape)}, expected "
                        + ("a column (rows, 1); HINT: save arr.reshape(-1, 1)" if column
                           else "a matrix (rows, columns); HINT: save a 2-D array"))
    values = []
    for r, row in enumerate(arr.tolist()):
        for c, value in enumerate(row):
            problem = count_problem(value, rule=rule)
            if problem:
                raise CaseError(f"{path}:row {r}, col {c}: {problem}")
        values.append(tuple(int(v) for v in row))
    return tuple(v[0] for v in values) if column else tuple(values)


# ----------------------------------------------------------------------------------------------
# The sequences of a case.

def manifest_count(values: dict, manifest: Path) -> Optional[int]:
    """The manifest's `sequences` (its type already checked), None when absent; out of
    1..MAX_TOKENS, or with a batch other than 1, an error."""
    count, page, new = values.get(SEQUENCES_KEY), values.get(PAGE_SIZE_KEY), values.get(NEW_KEYS_KEY)
    if page is not None and count is None:
        raise CaseError(f"{manifest}: {paged_unpacked_problem(page)}")
    if new is not None and count is None:
        raise CaseError(f"{manifest}: {new_keys_unpacked_problem(new)}")
    if count is None:
        return None
    if not 1 <= count <= MAX_TOKENS:
        raise CaseError(f"{manifest}: {sequences_count_problem(count)}")
    batch = values.get("batch")
    if batch != 1:
        raise CaseError(f"{manifest}: {packed_batch_problem(batch, count)}")
    if page is not None and not 1 <= page <= MAX_TOKENS:
        raise CaseError(f"{manifest}: {page_size_problem(page)}")
    if new is not None and not 1 <= new <= MAX_TOKENS:
        raise CaseError(f"{manifest}: {new_keys_count_problem(new)}")
    return count


def case_sequences(folder: Path, fmt: str, dims: Dims, variant: Variant, count: Optional[int],
                   manifest: bool, page_size: Optional[int] = None, backward: Optional[bool] = None
                   ) -> Optional[Sequences]:
    """The packing of the case in `folder`, read and checked, or None for a case that is not
    packed (then no sequence file may be there). `count`: the manifest's `sequences`; without a
    manifest the cu_seqlens files (or block_table) make the case packed, and its seq_q and seq_k
    come from Q and K. `page_size`: the manifest's (its presence makes the case paged), or without
    a manifest check's --page-size (block_table makes the case paged). `backward`: the manifest's
    flag (None: the dO files say)."""
    present = sequence_files(folder)
    packed = count is not None if manifest else bool(present.keys() & {CU_SEQLENS_Q, CU_SEQLENS_K, BLOCK_TABLE})
    paged = page_size is not None if manifest else BLOCK_TABLE in present
    if not manifest and page_size is not None and not paged:
        raise CaseError(f"{folder}: a page size ({page_size}) was given, but the case has no {BLOCK_TABLE} file, so it "
                        f"is not paged; HINT: give no page size for it, or add its {BLOCK_TABLE}")
    for name, fmts in present.items():  # in SEQUENCE_FILES' order, as the binary looks
        shown = folder / sequence_file(name, sorted(fmts)[0])
        if not packed:
            why = (f"no {SEQUENCES_KEY} = B in {INPUT_MANIFEST}" if manifest
                   else f"no {CU_SEQLENS_Q} and {CU_SEQLENS_K} files")
            raise CaseError(f"{shown}: {NOT_PACKED} ({why}); HINT: {NOT_PACKED_HINT}")
        if name == BLOCK_TABLE and not paged:
            raise CaseError(f"{shown}: {NOT_PAGED} (no {PAGE_SIZE_KEY} = P in {INPUT_MANIFEST}); HINT: {NOT_PAGED_HINT}")
        other = sorted(fmts - {fmt})
        if other:
            raise CaseError(f"{folder / sequence_file(name, other[0])}: a .{other[0]} file in a .{fmt} case; HINT: a "
                            "case holds one format; remove the stray file")
    if not packed:
        return None
    _refuse_unsupported(folder, variant, manifest)
    if paged:
        return _paged_sequences(folder, fmt, dims, count, manifest, page_size, backward, present)
    for name in (CU_SEQLENS_Q, CU_SEQLENS_K):
        if name not in present:
            why = (f"{INPUT_MANIFEST} says {SEQUENCES_KEY} = {count}" if manifest
                   else "a packed case has both cu_seqlens files")
            raise CaseError(f"{folder / sequence_file(name, fmt)}: missing file ({why})")
    paths = {name: folder / sequence_file(name, fmt) for name in SEQUENCE_FILES}
    cu_q = _offsets(paths[CU_SEQLENS_Q], count, folder)
    cu_k = read_counts(paths[CU_SEQLENS_K], len(cu_q))
    used = read_counts(paths[SEQUSED_K], len(cu_q) - 1) if SEQUSED_K in present else None
    problem = sequences_problem(cu_q, cu_k, used)
    if problem:
        raise CaseError(f"{paths[problem_file(problem)]}: {problem}")
    seqs = Sequences(cu_q, cu_k, used)
    _check_totals(seqs, dims, paths, folder, fmt, manifest)
    return seqs


def _paged_sequences(folder: Path, fmt: str, dims: Dims, count: Optional[int], manifest: bool,
                     page_size: Optional[int], backward: Optional[bool], present) -> Sequences:
    """A paged case (docs/contract.md, "Paged KV caches"): cu_seqlens_q, seqused_k and block_table,
    no cu_seqlens_k; forward only; K and V hold whole pages. In the binary's order and words
    (cuda_src/io/sequence_inputs.cpp check_paged_files); without a manifest (the binary refuses
    it), page_size from check's --page-size."""
    paths = {name: folder / sequence_file(name, fmt) for name in SEQUENCE_FILES}
    if CU_SEQLENS_K in present:
        shown = folder / sequence_file(CU_SEQLENS_K, sorted(present[CU_SEQLENS_K])[0])
        raise CaseError(f"{shown}: {paged_cu_seqlens_k_problem(fmt)}; HINT: {PAGED_CU_SEQLENS_K_HINT}")
    if page_size is None:
        raise CaseError(f"{paths[BLOCK_TABLE]}: {PAGE_SIZE_UNKNOWN}; HINT: {PAGE_SIZE_UNKNOWN_HINT}")
    for name, why in ((CU_SEQLENS_Q, f"{INPUT_MANIFEST} says {SEQUENCES_KEY} = {count}" if manifest
                       else "a paged case has cu_seqlens_q"),
                      (BLOCK_TABLE, f"{INPUT_MANIFEST} says {PAGE_SIZE_KEY} = {page_size}"),
                      (SEQUSED_K, PAGED_NEEDS_SEQUSED)):
        if name not in present:
            raise CaseError(f"{paths[name]}: missing file ({why})")
    grads = (folder / stage_file(GRAD_INPUT, 0, fmt)).exists() or any(
        e.startswith(f"{GRAD_INPUT}_head_") and e.endswith(f".{fmt}") for e in os.listdir(folder))
    if backward or (backward is None and grads):
        where = f"{folder / INPUT_MANIFEST}: backward = true" if backward else str(folder / stage_file(GRAD_INPUT, 0, fmt))
        raise CaseError(f"{where}: {PAGED_BACKWARD}; HINT: {PAGED_BACKWARD_HINT}")
    cu_q = _offsets(paths[CU_SEQLENS_Q], count, folder)
    used = read_counts(paths[SEQUSED_K], len(cu_q) - 1)
    table = read_table(paths[BLOCK_TABLE])
    if dims.seq_k % page_size:
        said = (f"{folder / INPUT_MANIFEST}: seq_k = {dims.seq_k}" if manifest
                else f"{folder / stage_file(KEYS, 0, fmt)}: {plural(dims.seq_k, 'row')}")
        raise CaseError(f"{said}{pool_rows_problem(page_size)}")
    cols = len(table[0]) if table else 0
    problem = paged_problem(cu_q, used, table, cols, page_size, dims.seq_k // page_size)
    if problem:
        raise CaseError(f"{paths[problem_file(problem)]}: {problem}")
    seqs = Sequences(cu_q, None, used, page_size, table, dims.seq_k)
    _check_totals(seqs, dims, paths, folder, fmt, manifest)
    return seqs


def _offsets(path: Path, count: Optional[int], folder: Path) -> Tuple[int, ...]:
    """cu_seqlens_q, its count of offsets the manifest's B + 1."""
    cu_q = read_counts(path, None if count is None else count + 1)
    if count is not None and len(cu_q) != count + 1:
        raise CaseError(f"{path}: {plural(len(cu_q), 'offset')}, but {folder / INPUT_MANIFEST} says "
                        f"{SEQUENCES_KEY} = {count}, which takes {count + 1} (B + 1)")
    return cu_q


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
    totals = ((CU_SEQLENS_Q, seqs.total_q, "seq_q", QUERIES, "queries"),
              (CU_SEQLENS_K, seqs.total_k, "seq_k", KEYS, "keys"))
    for name, total, key, stage, what in totals[:1 if seqs.paged else 2]:
        want = getattr(dims, key)
        if total != want:
            said = (f"{folder / INPUT_MANIFEST} says {key} = {want}" if manifest
                    else f"{stage_file(stage, 0, fmt)} has {plural(want, 'row')}")
            raise CaseError(f"{paths[name]}: ends at {total} (the packed {what}), but {said}; HINT: {key} is the "
                            "total of the sequences' lengths")


# ----------------------------------------------------------------------------------------------
# Writing (the generator).

def counts_bytes(values: Sequence, fmt: str) -> bytes:
    """A sequence file's bytes: one integer per line, or an int32 (rows, 1) .npy (flash-attn's
    dtype for cu_seqlens); a block table (rows of entries): a row per line, or an int32 matrix."""
    table = bool(values) and isinstance(values[0], (tuple, list))
    arr = np.asarray(values, dtype="<i4")
    arr = arr.reshape(len(values), -1) if table else arr.reshape(-1, 1)
    if fmt == "npy":
        buf = io.BytesIO()
        np.save(buf, arr, allow_pickle=False)
        return buf.getvalue()
    return "".join(" ".join(str(int(v)) for v in row) + "\n" for row in arr).encode("ascii")


def sequence_file_values(seqs: Sequences) -> Dict[str, Tuple]:
    """The files a packed case has, name -> values: the offsets, seqused_k when given; a paged
    case's cu_seqlens_q, seqused_k and block_table (rows). With new keys seqused_k is the cache
    before the step."""
    used = seqs.used_k if not seqs.new_keys else tuple(seqs.cache_len(b) for b in range(seqs.count))
    if seqs.paged:
        return {CU_SEQLENS_Q: seqs.cu_q, SEQUSED_K: used, BLOCK_TABLE: seqs.block_table}
    out = {CU_SEQLENS_Q: seqs.cu_q, CU_SEQLENS_K: seqs.cu_k}
    if used is not None:
        out[SEQUSED_K] = used
    return out


def sequence_file_names(folder: Path) -> List[str]:
    """The sequence files in `folder`, every format (what replacing a case removes)."""
    return [sequence_file(name, fmt) for name, fmts in sequence_files(folder).items() for fmt in sorted(fmts)]
