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

# The input case's files that describe the sequences (txt or npy, as every input), and the manifest
# key whose presence makes a case packed (its value: the number of sequences B).
CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K = "cu_seqlens_q", "cu_seqlens_k", "seqused_k"
SEQUENCE_FILES = (CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K)
SEQUENCES_KEY = "sequences"


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
