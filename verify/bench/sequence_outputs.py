"""Packed and paged cases for PyTorch's attention functions: a case's sequences as problems of their
own and a paged case's keys gathered, what verify/bench/sdpa_outputs.py (SDPA) and
verify/bench/flex_outputs.py (FlexAttention) share. No torch here.

A packed case (verify/sequences.py: cu_seqlens_q, cu_seqlens_k, seqused_k): each sequence is a problem
of its own, as flash-attn's varlen functions compute it: its query rows against the first m(b) keys
of its slot, the case's variant within it (so a bottom-right causal mask aligns at each sequence's
own corner), run once per sequence, its results written back at the sequence's packed rows
(packed_results). Rows of a sequence without keys: output 0, lse -inf (nothing is run on it); the key
rows no query reads (a slot's padding, a sequence without queries): dK, dV 0. A paged case (its keys
in a pool of pages read through `block_table`, `page_size` in the manifest, `seqused_k` the keys
each sequence reads): the same, each sequence's keys gathered through its table row first (key j of
sequence b is pool row block_table[b][j // P]·P + j % P: Sequences.key_rows), as PyTorch users check
a paged decode kernel: attention on the gathered cache (gathered_keys). A paged case is forward only.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import numpy as np

from ..stages import KEYS, QUERIES, STAGES, VALUES
from .foreign_outputs import CaseTensors, Results


def sequence_tensors(t: CaseTensors, b: int) -> CaseTensors:
    """Sequence b of a packed case as a dense case of its own: its query rows (and dO's), the keys
    it reads (K and V rows, gathered through the table in a paged case)."""
    seqs = t.sequences
    q, keys = slice(seqs.cu_q[b], seqs.cu_q[b + 1]), seqs.key_rows(b)
    inputs = {name: x[:, :, keys] if STAGES[name].kv else x[:, :, q] for name, x in t.inputs.items()}
    return t.with_(inputs=inputs, sequences=None, dims=replace(t.dims, seq_q=seqs.n(b), seq_k=len(keys)))


def gathered_keys(t: CaseTensors) -> CaseTensors:
    """A paged case as the packed case of the same attention: each sequence's keys gathered
    through its table into a slot of its own (forward only: a paged case has no dO)."""
    seqs = t.sequences
    rows = [seqs.key_rows(b) for b in range(seqs.count)]
    order = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    inputs = {name: x[:, :, order] if STAGES[name].kv else x for name, x in t.inputs.items()}
    return t.with_(inputs=inputs, sequences=seqs.gathered(), dims=replace(t.dims, seq_k=max(1, len(order))))


def packed_results(t: CaseTensors, dense: Callable[[CaseTensors], Results]) -> Results:
    """dense() of every sequence with queries and keys, its results written back at the
    sequence's packed rows: output 0 and lse -inf in the rows of a sequence without keys, dK and dV
    0 in the key rows no query reads. The lse is left out when a sequence's run has none."""
    seqs = t.sequences
    batch, heads, n, _ = t.shape
    q_in, v_in = t.inputs[QUERIES], t.inputs[VALUES]
    results = Results(np.zeros((batch, heads, n, v_in.shape[-1]), np.float32),
                      np.full((batch, heads, n), -np.inf, np.float32))
    if t.backward:
        results.grads = {"dq": np.zeros_like(q_in), "dk": np.zeros_like(t.inputs[KEYS]), "dv": np.zeros_like(v_in)}
    lse = True
    for b in range(seqs.count):
        keys = seqs.key_rows(b)
        if seqs.n(b) == 0 or len(keys) == 0:
            continue
        one = dense(sequence_tensors(t, b))
        q = slice(seqs.cu_q[b], seqs.cu_q[b + 1])
        results.out[:, :, q] = one.out
        if one.lse is None:
            lse = False
        else:
            results.lse[:, :, q] = one.lse
        for name, x in one.grads.items():
            if name == "dq":
                results.grads[name][:, :, q] = x
            else:  # keys a sequence shares with another (a shared page) sum their gradients
                np.add.at(results.grads[name], (slice(None), slice(None), keys), x)
        results.notes += [note for note in one.notes if note not in results.notes]
    if not lse:
        results.lse = None
    return results
