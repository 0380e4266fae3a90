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

A paged case (the manifest's `page_size` = P, the file `block_table`) keeps its keys in a pool of
pages of P keys: K and V hold num_pages·P rows, and key j of sequence b is pool row
block_table[b][j // P]·P + j % P (`key_rows`). It has seqused_k (the keys each sequence reads) and
no cu_seqlens_k; entries of pages a sequence does not read are ignored; pages may be shared.

A decode step (the manifest's `new_keys` = n, the files `K_new_head_{j}`, `V_new_head_{j}`, n rows
per sequence) appends n new keys to each sequence's cache before attention, as flash-attn's
`flash_attn_with_kvcache` writes its k and v: sequence b's new key t lands at its key
seqused_k[b] + t (`new_key_rows`), and the sequence attends to seqused_k[b] + n keys. Sequences
holds m(b) after the step (used_k) and the count (new_keys); the files hold the cache before it.

`cuda_src/sequences.h` is the C++ twin; docs/contract.md ("Packed sequences", "Paged KV caches")
describes both.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import numpy as np

from .stages import KEYS, MAX_DIM, VALUES
from .text import printable

# The input case's files that describe the sequences (txt or npy, as every input), and the manifest
# key whose presence makes a case packed (its value: the number of sequences B).
CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K = "cu_seqlens_q", "cu_seqlens_k", "seqused_k"
BLOCK_TABLE = "block_table"
SEQUENCE_FILES = (CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K, BLOCK_TABLE)  # in the order both readers look
SEQUENCES_KEY = "sequences"
# The manifest key whose presence makes a packed case paged (its value: the keys a page holds).
PAGE_SIZE_KEY = "page_size"

# The manifest key of a decode step's new keys (their count per sequence), and the input files that
# hold them, per K/V head (`K_new_head_{j}`: sequence b's new keys at rows b·n .. b·n + n − 1), by the
# cache they are appended to.
NEW_KEYS_KEY = "new_keys"
NEW_KEY_INPUTS = {KEYS: "K_new", VALUES: "V_new"}

# Every value of those files is a count of tokens: a whole number in 0..MAX_TOKENS (a dimension's
# largest, so the offsets and their totals fit seq_q and seq_k), and the number of sequences B is
# 1..MAX_TOKENS too.
MAX_TOKENS = MAX_DIM


@dataclass(frozen=True)
class WholeRange:
    """The values a file of whole numbers may hold, and what such a value is (the words after "is
    outside lo..hi"): the offsets and seqused_k are counts of tokens; a block_table entry is any
    int32 (flash-attn's dtype: entries of pages no sequence reads may be anything, -1 as padding)."""
    lo: int
    hi: int
    what: str


COUNT_RANGE = WholeRange(0, MAX_TOKENS, "a count of tokens")
TABLE_ENTRY_RANGE = WholeRange(-2**31, 2**31 - 1, "a block_table entry, an int32")
# A sequence file in a case that is not packed would be ignored: the words after the file's path
# (as a slopes file without ALiBi), and the hint.
# How much of a token that is not an integer the error quotes (as verify/files/matrix_io.py).
QUOTED_TOKEN_LIMIT = 40
NOT_PACKED = "exists but the case is not packed"
NOT_PACKED_HINT = f"add {SEQUENCES_KEY} = B (the number of sequences) to the manifest, or remove the file"
# A block_table in a packed case without page_size: the words after the file's path, and the hint.
NOT_PAGED = "exists but the case is not paged"
NOT_PAGED_HINT = f"add {PAGE_SIZE_KEY} = P (the keys a page holds) to the manifest, or remove the file"


@dataclass(frozen=True)
class Sequences:
    """The packing of one case: offsets of every sequence's queries and key slot, and the keys each
    uses. Built through `packed_sequences` or `paged_sequences` (which validate). A paged case has
    no cu_k (None), its used_k, page_size >= 1, block_table (a row of entries per sequence) and
    pool_rows, the rows of K and V."""
    cu_q: Tuple[int, ...]
    cu_k: Optional[Tuple[int, ...]]
    used_k: Optional[Tuple[int, ...]] = None
    page_size: int = 0
    block_table: Optional[Tuple[Tuple[int, ...], ...]] = None
    pool_rows: int = 0
    # A decode step: the new keys appended to each sequence before attention (used_k counts them).
    new_keys: int = 0
    # The keys a KV cache's sequences read, gathered into packed rows by the check itself (the user
    # packed nothing: the cache's own readings name its bugs, not the packing's).
    from_cache: bool = False

    @property
    def paged(self) -> bool:
        return self.page_size > 0

    @property
    def num_pages(self) -> int:
        return self.pool_rows // self.page_size if self.paged else 0

    @property
    def count(self) -> int:
        return len(self.cu_q) - 1

    @property
    def total_q(self) -> int:
        return self.cu_q[-1]

    @property
    def total_k(self) -> int:
        """The rows of K and V: the packed key rows, or the pool's."""
        return self.pool_rows if self.paged else self.cu_k[-1]

    def n(self, b: int) -> int:
        """Queries of sequence b."""
        return self.cu_q[b + 1] - self.cu_q[b]

    def m(self, b: int) -> int:
        """Keys sequence b reads (its slot's first m(b) keys, or its pages')."""
        if self.used_k is not None:
            return self.used_k[b]
        return self.cu_k[b + 1] - self.cu_k[b]

    def key_rows(self, b: int) -> np.ndarray:
        """The rows of K and V that hold sequence b's keys 0..m(b)-1, in its key order: through the
        table when paged, else the first m(b) of its slot. Every reader of a sequence's keys goes
        through it (cuda_src/sequences.h key_row)."""
        j = np.arange(self.m(b), dtype=np.int64)
        if not self.paged:
            return self.cu_k[b] + j
        pages = np.asarray(self.block_table[b], dtype=np.int64)
        return pages[j // self.page_size] * self.page_size + j % self.page_size

    def cache_len(self, b: int) -> int:
        """The keys sequence b's cache holds before the step (seqused_k as the files say)."""
        return self.m(b) - self.new_keys

    def new_key_rows(self, b: int) -> np.ndarray:
        """The rows of K and V that sequence b's new keys 0..new_keys-1 are written to."""
        return self.key_rows(b)[self.cache_len(b):]

    def gathered(self) -> "Sequences":
        """The packing of the same attention with each sequence's keys (key_rows, in key order)
        gathered into a slot of its own, one after another: a paged case as the packed case of its
        gathered cache."""
        lengths = [self.m(b) for b in range(self.count)]
        return packed_sequences(self.cu_q, np.concatenate(([0], np.cumsum(lengths, dtype=np.int64))).tolist())

    def q_rows(self, b: int) -> range:
        return range(self.cu_q[b], self.cu_q[b + 1])

    def k_rows(self, b: int) -> range:
        """The key rows sequence b reads (not paged: key_rows for any case)."""
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
    """The sequence file (CU_SEQLENS_Q, CU_SEQLENS_K, SEQUSED_K or BLOCK_TABLE) that a
    sequences_problem or paged_problem is about: its words start with that name."""
    return next(name for name in SEQUENCE_FILES if problem.startswith(name))


# ----------------------------------------------------------------------------------------------
# The rules of one value of a sequence file, in the words both readers say after
# "<file>:<line>:<col>: " (a text file) or "<file>:row <r>, col 0: " (an .npy file).

def integer_token_problem(token: str, rule: WholeRange = COUNT_RANGE) -> Optional[str]:
    """What is wrong with one token of a text file of whole numbers: an optional sign and decimal
    digits, whose value is in the rule's range; None when it is one."""
    digits = token[1:] if token[:1] in "+-" else token
    if not (digits and digits.isascii() and digits.isdigit()):
        return f"not an integer: '{printable(token, QUOTED_TOKEN_LIMIT)}'"
    return count_problem(int(token), token, rule)


def count_problem(value, shown: Optional[str] = None, rule: WholeRange = COUNT_RANGE) -> Optional[str]:
    """What is wrong with one value of a file of whole numbers (an .npy's number, a text token's
    value; `shown`: as the file writes it): a whole number in the rule's range, or None."""
    if value != value or value in (float("inf"), float("-inf")) or value != int(value):
        return f"not an integer: {float(value):.9g}"
    if not rule.lo <= value <= rule.hi:
        shown = str(int(value)) if shown is None else printable(shown, QUOTED_TOKEN_LIMIT)
        return f"{shown} is outside {rule.lo}..{rule.hi} ({rule.what})"
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


# ----------------------------------------------------------------------------------------------
# Paged KV caches (cuda_src/sequences.h has the twins, in the same words).

def page_size_problem(page_size: int) -> str:
    """The manifest's page_size out of range (words after the manifest's place)."""
    return f"{PAGE_SIZE_KEY} = {page_size}: the keys a page holds must be in 1..{MAX_TOKENS}"


def paged_unpacked_problem(page_size: int) -> str:
    """page_size in a manifest without sequences (words after the manifest's place)."""
    return f"{PAGE_SIZE_KEY} = {page_size} without {SEQUENCES_KEY} = B: a paged case is a packed case"


def pool_rows_problem(page_size: int) -> str:
    """seq_k (the pool's rows) not whole pages: the words after "<manifest>: seq_k = M" or
    "<K file>: M rows"."""
    return f", not a multiple of {PAGE_SIZE_KEY} = {page_size} (K and V hold the pool of pages)"


PAGED_BACKWARD = "the backward pass is not supported with paged KV caches"
PAGED_BACKWARD_HINT = "a paged case is forward only; check the backward pass on a packed case"
PAGED_CU_SEQLENS_K_HINT = "remove cu_seqlens_k, or block_table for a case without pages"
PAGED_NEEDS_SEQUSED = "a paged case has seqused_k: the keys each sequence reads"
PAGE_SIZE_UNKNOWN = f"a paged case needs its page size, and there is no manifest to say {PAGE_SIZE_KEY} = P"
PAGE_SIZE_UNKNOWN_HINT = ("write a manifest.toml with sequences = B and page_size = P (attnstep check also takes "
                          "--page-size P)")


def paged_cu_seqlens_k_problem(fmt: str) -> str:
    """A paged case has no cu_seqlens_k (words after its path)."""
    return f"a paged case ({BLOCK_TABLE}.{fmt}) reads its keys through {BLOCK_TABLE}, not {CU_SEQLENS_K}"


def paged_problem(cu_q: Sequence[int], used_k: Sequence[int], table: Sequence[Sequence[int]], cols: int,
                  page_size: int, num_pages: int) -> Optional[str]:
    """What is wrong with a paged case's sequences (words after "<file>: ", starting with the name
    of the file they are about), or None: cu_seqlens_q's offsets, seqused_k's count, block_table's
    rows (one per sequence), enough pages for each sequence's keys, and every page a sequence reads
    in the pool. `cols`: the entries of a table row."""
    if len(cu_q) < 2:
        return f"{CU_SEQLENS_Q} needs at least 2 offsets (one sequence), got {len(cu_q)}"
    if cu_q[0] != 0:
        return f"{CU_SEQLENS_Q} must start at 0, got {cu_q[0]}"
    for b in range(len(cu_q) - 1):
        if cu_q[b + 1] < cu_q[b]:
            return f"{CU_SEQLENS_Q} must not decrease: offset {b + 1} is {cu_q[b + 1]} after {cu_q[b]}"
    count = len(cu_q) - 1
    if len(used_k) != count:
        return f"{SEQUSED_K} has {len(used_k)} values for {count} sequences"
    if len(table) != count:
        return f"{BLOCK_TABLE} has {len(table)} rows for {count} sequences"
    for b, u in enumerate(used_k):
        if u > cols * page_size:
            return (f"{SEQUSED_K}[{b}] = {u} is more than the {cols} pages of {page_size} keys a {BLOCK_TABLE} row "
                    f"holds ({cols * page_size})")
    for b, u in enumerate(used_k):
        for j in range(-(-u // page_size)):
            e = table[b][j]
            if not 0 <= e < num_pages:
                return (f"{BLOCK_TABLE}[{b}, {j}] = {e} is outside 0..{num_pages - 1} (the pool holds {num_pages} "
                        f"pages of {page_size} keys); sequence {b} reads it")
    return None


def paged_sequences(cu_q: Sequence[int], used_k: Sequence[int], table: Sequence[Sequence[int]], page_size: int,
                    pool_rows: int) -> Sequences:
    """Validated paged Sequences; ValueError with paged_problem's words (or the pool's)."""
    if page_size < 1:
        raise ValueError(page_size_problem(page_size))
    if pool_rows % page_size:
        raise ValueError(f"seq_k = {pool_rows}{pool_rows_problem(page_size)}")
    table = tuple(tuple(int(e) for e in row) for row in table)
    cols = len(table[0]) if table else 0
    problem = paged_problem(cu_q, used_k, table, cols, page_size, pool_rows // page_size)
    if problem:
        raise ValueError(problem)
    return Sequences(tuple(int(x) for x in cu_q), None, tuple(int(x) for x in used_k), page_size, table, pool_rows)


# ----------------------------------------------------------------------------------------------
# A decode step's new keys (cuda_src/sequences.h has the twins, in the same words).

NEW_KEYS_BACKWARD = "the backward pass is not supported with new keys (a decode step)"
NEW_KEYS_BACKWARD_HINT = f"a decode step is forward only; check the backward pass on a case without {NEW_KEYS_KEY}"
NEW_KEYS_NEED_SEQUSED = "a case with new keys has seqused_k: the keys each sequence's cache holds before the step"
NOT_APPENDED = "exists but the case has no new keys"
NOT_APPENDED_HINT = (f"add {NEW_KEYS_KEY} = n (the keys appended to each sequence) with {SEQUENCES_KEY} = B to the "
                     "manifest, or remove the file")
NEW_KEYS_NO_MANIFEST = f"a case with new keys needs a manifest to say {NEW_KEYS_KEY} = n"
NEW_KEYS_NO_MANIFEST_HINT = f"write a manifest.toml with {SEQUENCES_KEY} = B and {NEW_KEYS_KEY} = n"


def new_keys_count_problem(count: int) -> str:
    """The manifest's new_keys out of range (words after the manifest's place)."""
    return f"{NEW_KEYS_KEY} = {count}: the new keys per sequence must be in 1..{MAX_TOKENS}"


def new_keys_unpacked_problem(count: int) -> str:
    """new_keys in a manifest without sequences (words after the manifest's place)."""
    return f"{NEW_KEYS_KEY} = {count} without {SEQUENCES_KEY} = B: new keys are appended to a packed case's KV cache"

