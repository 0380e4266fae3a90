"""Packed sequences (flash-attn's varlen convention), on the Python side: B sequences of different
lengths packed along the token axis of every per-head matrix, described by `cu_seqlens_q` and
`cu_seqlens_k` (B + 1 offsets each) and optionally `seqused_k` (the keys each sequence uses, for a
KV cache padded to a fixed slot per sequence).

Conventions (flash-attn's `flash_attn_varlen_func`, so a program written for it checks untranslated):
* Sequence b owns query rows [cu_seqlens_q[b], cu_seqlens_q[b+1]) and the key slot
  [cu_seqlens_k[b], cu_seqlens_k[b+1]); it reads the first m_b keys of its slot, m_b = seqused_k[b]
  when given, else the slot's length. Keys of a slot past m_b are padding: never read, their dK and
  dV rows exactly 0.
* Attention is block-diagonal: a query of sequence b sees only keys of sequence b. The causal mask,
  the window and ALiBi apply within each sequence, with its own lengths n_b, m_b (so a bottom-right
  alignment puts each sequence's diagonal at its own bottom-right corner).
* A sequence may have no queries (n_b = 0) or no keys (m_b = 0: its rows see no key, output 0, lse
  −inf).

`cuda_src/sequences.h` is the C++ twin; docs/contract.md ("Packed sequences") describes both.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import numpy as np

from .stages import MAX_DIM
from .text import printable

# The input case's files that describe the sequences (txt or npy, as every input), and the manifest
# key whose presence makes a case packed (its value: the number of sequences B).
CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K = "cu_seqlens_q", "cu_seqlens_k", "seqused_k"
SEQUENCE_FILES = (CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K)
SEQUENCES_KEY = "sequences"

# Every value of those files is a count of tokens: a whole number in 0..MAX_TOKENS (a dimension's
# largest, so the offsets and their totals fit seq_q and seq_k), and the number of sequences B is
# 1..MAX_TOKENS too.
MAX_TOKENS = MAX_DIM
# A sequence file in a case that is not packed would be ignored: the words after the file's path
# (as a slopes file without ALiBi), and the hint.
# How much of a token that is not an integer the error quotes (as verify/files/matrix_io.py).
QUOTED_TOKEN_LIMIT = 40
NOT_PACKED = "exists but the case is not packed"
NOT_PACKED_HINT = f"add {SEQUENCES_KEY} = B (the number of sequences) to the manifest, or remove the file"


@dataclass(frozen=True)
class Sequences:
    """The packing of one case: offsets of every sequence's queries and key slot, and the keys each
    uses. Built through `packed_sequences` (which validates)."""
    cu_q: Tuple[int, ...]
    cu_k: Tuple[int, ...]
    used_k: Optional[Tuple[int, ...]] = None

    @property
    def count(self) -> int:
        return len(self.cu_q) - 1

    @property
    def total_q(self) -> int:
        return self.cu_q[-1]

    @property
    def total_k(self) -> int:
        return self.cu_k[-1]

    def n(self, b: int) -> int:
        """Queries of sequence b."""
        return self.cu_q[b + 1] - self.cu_q[b]

    def m(self, b: int) -> int:
        """Keys sequence b reads (its slot's first m(b) keys)."""
        slot = self.cu_k[b + 1] - self.cu_k[b]
        return slot if self.used_k is None else self.used_k[b]

    def q_rows(self, b: int) -> range:
        return range(self.cu_q[b], self.cu_q[b + 1])

    def k_rows(self, b: int) -> range:
        """The key rows sequence b reads."""
        return range(self.cu_k[b], self.cu_k[b] + self.m(b))

    def k_slot(self, b: int) -> range:
        """Sequence b's whole key slot, padding included."""
        return range(self.cu_k[b], self.cu_k[b + 1])

    def sequence_of_query(self, row: int) -> int:
        """The sequence that packed query row `row` belongs to."""
        return int(np.searchsorted(np.asarray(self.cu_q), row, side="right")) - 1

    def sequence_of_key(self, row: int) -> int:
        """The sequence whose key slot holds packed key row `row`."""
        return int(np.searchsorted(np.asarray(self.cu_k), row, side="right")) - 1


def sequences_problem(cu_q: Sequence[int], cu_k: Sequence[int], used_k: Optional[Sequence[int]] = None
                      ) -> Optional[str]:
    """What is wrong with the packing (words after "<file>: "), or None. cuda_src/sequences.h's
    sequences_problem is the C++ twin, in the same words."""
    if len(cu_q) < 2:
        return f"{CU_SEQLENS_Q} needs at least 2 offsets (one sequence), got {len(cu_q)}"
    if len(cu_k) != len(cu_q):
        return (f"{CU_SEQLENS_K} has {len(cu_k)} offsets, {CU_SEQLENS_Q} {len(cu_q)}: "
                f"both need B + 1 for B sequences")
    for name, cu in ((CU_SEQLENS_Q, cu_q), (CU_SEQLENS_K, cu_k)):
        if cu[0] != 0:
            return f"{name} must start at 0, got {cu[0]}"
        for b in range(len(cu) - 1):
            if cu[b + 1] < cu[b]:
                return f"{name} must not decrease: offset {b + 1} is {cu[b + 1]} after {cu[b]}"
    if used_k is not None:
        if len(used_k) != len(cu_q) - 1:
            return f"{SEQUSED_K} has {len(used_k)} values for {len(cu_q) - 1} sequences"
        for b, u in enumerate(used_k):
            slot = cu_k[b + 1] - cu_k[b]
            if not 0 <= u <= slot:
                return f"{SEQUSED_K}[{b}] = {u} is outside 0..{slot} (sequence {b}'s key slot)"
    return None


def packed_sequences(cu_q: Sequence[int], cu_k: Sequence[int], used_k: Optional[Sequence[int]] = None
                     ) -> Sequences:
    """Validated Sequences; ValueError with sequences_problem's words."""
    problem = sequences_problem(cu_q, cu_k, used_k)
    if problem:
        raise ValueError(problem)
    return Sequences(tuple(int(x) for x in cu_q), tuple(int(x) for x in cu_k),
                     None if used_k is None else tuple(int(x) for x in used_k))


def sequences_from_lengths(seqlens_q: Sequence[int], seqlens_k: Optional[Sequence[int]] = None,
                           used_k: Optional[Sequence[int]] = None) -> Sequences:
    """The packing of sequences of `seqlens_q` queries and key slots of `seqlens_k` (default: as
    many keys as queries), each reading `used_k` keys of its slot (default: all); ValueError with
    sequences_problem's words (a negative length makes its offsets decrease)."""
    slots = list(seqlens_q) if seqlens_k is None else list(seqlens_k)
    if len(slots) != len(seqlens_q):
        raise ValueError(f"{len(slots)} key lengths for {len(seqlens_q)} sequences")
    return packed_sequences(np.concatenate(([0], np.cumsum(seqlens_q, dtype=np.int64))).tolist(),
                            np.concatenate(([0], np.cumsum(slots, dtype=np.int64))).tolist(), used_k)


def problem_file(problem: str) -> str:
    """The sequence file (CU_SEQLENS_Q, CU_SEQLENS_K or SEQUSED_K) that a sequences_problem is
    about: its words start with that name."""
    return next(name for name in SEQUENCE_FILES if problem.startswith(name))


# ----------------------------------------------------------------------------------------------
# The rules of one value of a sequence file, in the words both readers say after
# "<file>:<line>:<col>: " (a text file) or "<file>:row <r>, col 0: " (an .npy file).

def integer_token_problem(token: str) -> Optional[str]:
    """What is wrong with one token of a text sequence file: an optional sign and decimal digits,
    whose value is 0..MAX_TOKENS; None when it is a valid count."""
    digits = token[1:] if token[:1] in "+-" else token
    if not (digits and digits.isascii() and digits.isdigit()):
        return f"not an integer: '{printable(token, QUOTED_TOKEN_LIMIT)}'"
    return count_problem(int(token), token)


def count_problem(value, shown: Optional[str] = None) -> Optional[str]:
    """What is wrong with one value of a sequence file (an .npy's number, a text token's value;
    `shown`: as the file writes it): a whole number in 0..MAX_TOKENS, or None."""
    if value != value or value in (float("inf"), float("-inf")) or value != int(value):
        return f"not an integer: {float(value):.9g}"
    if not 0 <= value <= MAX_TOKENS:
        return f"{int(value) if shown is None else printable(shown, QUOTED_TOKEN_LIMIT)} is outside 0..{MAX_TOKENS} (a count of tokens)"
    return None


# The hint of those refusals (cuda_src/sequences.h kPackedVariantsHint).
PACKED_VARIANTS_HINT = ("packed sequences take causal, windows, softcap, ALiBi and grouped K/V heads; run a sequence "
                        "that needs a mask, a bias or dropout as a case of its own")


def sequences_count_problem(count: int) -> str:
    """The manifest's `sequences` out of 1..MAX_TOKENS (words after the manifest's place)."""
    return f"{SEQUENCES_KEY} = {count}: the number of sequences must be in 1..{MAX_TOKENS}"


def packed_batch_problem(batch: int, count: int) -> str:
    """A batch other than 1 in a packed case (words after the manifest's place)."""
    return f"batch = {batch} with {SEQUENCES_KEY} = {count}: a packed case has batch = 1 (its sequences are the batch)"


def unsupported_with_packing(mask: bool, bias: bool, dropout: bool) -> Optional[str]:
    """What a packed case asks for that packing does not support (mask or bias files, dropout), in
    both readers' words; None when nothing."""
    for asked, words in ((mask, "mask files are"), (bias, "bias files are"), (dropout, "dropout is")):
        if asked:
            return f"{words} not supported with packed sequences"
    return None
