"""A decode step's new keys in an input case (docs/contract.md, "New keys: a decode step"): the
manifest's `new_keys = n` and the files `K_new_head_{j}`, `V_new_head_{j}` ((B·n) × d per K/V
head), their rules, their writing into the cache (every reader of K and V reads the cache after
the step), and their generation.

The files hold the cache before the step (K, V and seqused_k); the new keys of sequence b are written
at its keys seqused_k[b] .. seqused_k[b] + n − 1 (through its block_table row when paged), as
flash-attn's `flash_attn_with_kvcache` writes its k and v, and the sequence attends to them all.
cuda_src/io/new_key_inputs.cpp (check_new_key_files) refuses the same cases in the same words.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, List, Optional

import numpy as np

from ..sequences import (BLOCK_TABLE, NEW_KEY_INPUTS, NEW_KEYS_BACKWARD, NEW_KEYS_BACKWARD_HINT, NEW_KEYS_KEY,
                         NEW_KEYS_NEED_SEQUSED, NEW_KEYS_NO_MANIFEST, NEW_KEYS_NO_MANIFEST_HINT, NOT_APPENDED,
                         NOT_APPENDED_HINT, SEQUSED_K, Sequences, paged_problem, problem_file)
from ..stages import GRAD_INPUT, INPUT_MANIFEST, STAGES, Dims, parse_stage_file, stage_file
from ..text import plural
from .kinds import CaseError
from .matrix_io import read_matrix, write_matrix


def new_key_shape(name: str, dims: Dims, seqs: Sequences):
    """The shape of a K/V head's new keys (`name`: KEYS or VALUES): n rows per sequence."""
    return seqs.count * seqs.new_keys, STAGES[name].shape(dims)[1]


def new_key_file(name: str, head: int, fmt: str) -> str:
    """`K_new_head_0.txt`: K/V head `head`'s new keys (or values) of the cache `name` (KEYS, VALUES)."""
    return stage_file(NEW_KEY_INPUTS[name], head, fmt)


def new_key_file_names(folder: Path) -> List[str]:
    """The new-key files in `folder` (either format), sorted: a head's file only (a per-sequence or
    per-split name, K_new_head_0_seq_1.txt, is no new-key file; the binary ignores it too)."""
    names = set(NEW_KEY_INPUTS.values())
    return sorted(e for e in os.listdir(folder) if (p := parse_stage_file(e)) and p[0] in names and e == p.name
                  and p.seq is None and p.split is None)


# ----------------------------------------------------------------------------------------------
# The rules.

def new_keys_problem(seqs: Sequences, count: int) -> Optional[str]:
    """What is wrong with appending `count` new keys to each sequence of `seqs` (the cache before
    the step: m(b) is seqused_k), in words after "<file>: " that start with the file's name; None
    when nothing: room for them in the slot or the table row, every page they reach in the pool,
    and no pool slot written by two sequences (cuda_src/sequences.h new_keys_problem)."""
    for b in range(seqs.count):
        u = seqs.m(b)
        if seqs.paged:
            cols = len(seqs.block_table[b])
            room, words = cols * seqs.page_size, f"the {cols} pages of {seqs.page_size} keys a {BLOCK_TABLE} row holds"
        else:
            room, words = len(seqs.k_slot(b)), f"sequence {b}'s key slot"
        if u + count > room:
            return f"{SEQUSED_K}[{b}] = {u} with {count} new keys is {u + count} keys, more than {words} ({room})"
    if not seqs.paged:
        return None
    after = [seqs.m(b) + count for b in range(seqs.count)]
    problem = paged_problem(seqs.cu_q, after, seqs.block_table, len(seqs.block_table[0]), seqs.page_size,
                            seqs.num_pages)
    if problem:
        return problem
    writer = {}
    for b in range(seqs.count):
        for j in range(seqs.m(b), after[b]):
            row = seqs.block_table[b][j // seqs.page_size] * seqs.page_size + j % seqs.page_size
            if writer.setdefault(row, b) != b:
                return (f"{BLOCK_TABLE} rows {writer[row]} and {b} both write a new key to page "
                        f"{row // seqs.page_size}, slot {row % seqs.page_size}: their new keys would overwrite each other")
    return None


def appended(seqs: Sequences, count: int) -> Sequences:
    """The sequences after `count` new keys are appended to each (new_keys_problem already None)."""
    used = tuple(seqs.m(b) + count for b in range(seqs.count))
    return Sequences(seqs.cu_q, seqs.cu_k, used, seqs.page_size, seqs.block_table, seqs.pool_rows, count)


def case_new_keys(folder: Path, fmt: str, dims: Dims, seqs: Optional[Sequences], count: Optional[int],
                  manifest: bool, backward: Optional[bool]) -> Optional[Sequences]:
    """The case's sequences with its new keys appended (`count`: the manifest's new_keys), checked
    in the binary's order and words; `seqs` as they are for a case without new keys."""
    files = new_key_file_names(folder)
    if not manifest:
        if files:
            raise CaseError(f"{folder / files[0]}: {NEW_KEYS_NO_MANIFEST}; HINT: {NEW_KEYS_NO_MANIFEST_HINT}")
        return seqs
    if count is None:
        if files:
            raise CaseError(f"{folder / files[0]}: {NOT_APPENDED} (no {NEW_KEYS_KEY} = n in {INPUT_MANIFEST}); HINT: "
                            f"{NOT_APPENDED_HINT}")
        return seqs
    grad = folder / stage_file(GRAD_INPUT, 0, fmt)  # (every head has one when any has: the layout's rule)
    if backward or (backward is None and grad.exists()):
        where = f"{folder / INPUT_MANIFEST}: backward = true" if backward else str(grad)
        raise CaseError(f"{where}: {NEW_KEYS_BACKWARD}; HINT: {NEW_KEYS_BACKWARD_HINT}")
    if seqs.used_k is None:
        raise CaseError(f"{folder / f'{SEQUSED_K}.{fmt}'}: missing file ({NEW_KEYS_NEED_SEQUSED})")
    problem = new_keys_problem(seqs, count)
    if problem:
        raise CaseError(f"{folder / f'{problem_file(problem)}.{fmt}'}: {problem}")
    for j in range(dims.total_kv_heads):
        for name in NEW_KEY_INPUTS:
            if new_key_file(name, j, fmt) not in files:
                raise CaseError(f"{folder / new_key_file(name, j, fmt)}: missing file ({INPUT_MANIFEST} says "
                                f"{NEW_KEYS_KEY} = {count})")
    wanted = {new_key_file(n, j, fmt) for n in NEW_KEY_INPUTS for j in range(dims.total_kv_heads)}
    for entry in (e for e in files if e not in wanted):
        other = entry.rpartition(".")[2]
        if other != fmt:
            raise CaseError(f"{folder / entry}: a .{other} file in a .{fmt} case; HINT: a case holds one format; remove "
                            "the stray file")
        raise CaseError(f"{folder / entry}: unexpected file: the case has {plural(dims.total_kv_heads, 'K/V head')} "
                        f"(0..{dims.total_kv_heads - 1})")
    seqs = appended(seqs, count)
    for j in range(dims.total_kv_heads):  # small (n rows per sequence): read now, as the binary does
        for name in NEW_KEY_INPUTS:
            read_new_keys(folder, fmt, name, j, dims, seqs)
    return seqs


# ----------------------------------------------------------------------------------------------
# The cache after the step.

def read_new_keys(folder: Path, fmt: str, name: str, head: int, dims: Dims, seqs: Sequences,
                  allow_nonfinite: bool = True) -> np.ndarray:
    """K/V head `head`'s new keys (or values: `name`), (B·n) × d."""
    return read_matrix(folder / new_key_file(name, head, fmt), new_key_shape(name, dims, seqs), allow_nonfinite)


def write_new_keys(pool: np.ndarray, new: np.ndarray, seqs: Sequences) -> np.ndarray:
    """The pool (a K/V head's K or V) with each sequence's new keys written at its new key rows."""
    out = np.array(pool, copy=True)
    n = seqs.new_keys
    for b in range(seqs.count):
        out[seqs.new_key_rows(b)] = new[b * n:(b + 1) * n]
    return out


# ----------------------------------------------------------------------------------------------
# Writing them (the generator).

def new_keys_for(seqs: Sequences, count: int) -> Sequences:
    """The generator's decode step: sequences whose keys (m(b), what they attend to) count `count`
    new keys, the cache holding the others; ValueError when a sequence attends to fewer keys."""
    for b in range(seqs.count):
        if seqs.m(b) < count:
            raise ValueError(f"sequence {b} attends to {plural(seqs.m(b), 'key')}, fewer than its {count} new keys")
    return Sequences(seqs.cu_q, seqs.cu_k, tuple(seqs.m(b) for b in range(seqs.count)), seqs.page_size,
                     seqs.block_table, seqs.pool_rows, count)


def write_new_key_files(staging: Path, dims: Dims, seqs: Sequences, fmt: str,
                        sample: Callable[[np.random.Generator, tuple], np.ndarray], seed: int) -> List[str]:
    """Every K/V head's new keys and values into `staging`, from a stream of their own; their names."""
    rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(_NEW_KEYS_STREAM + 1)[_NEW_KEYS_STREAM])
    names = []
    for j in range(dims.total_kv_heads):
        for name in NEW_KEY_INPUTS:
            names.append(new_key_file(name, j, fmt))
            write_matrix(staging / names[-1], sample(rng, new_key_shape(name, dims, seqs)), fmt)
    return names


# The seed's children 0..5 are dO's, the mask's, the bias's, the slopes', the lengths' and the pages'.
_NEW_KEYS_STREAM = 6
