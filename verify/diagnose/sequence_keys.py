"""The packed sequences' bugs on the key rows' gradients (dK, dV and their flash twins): what a
program that misread the packing wrote there. A key row's gradient sums what every query that read
it gave it, so a misread sequence moves its own key rows and its neighbour's (the key of sequence
b + 1 that sequence b read one row late gets b's share too). Each reading of sequences.py is taken
as a rule the program applies to every sequence alike: every sequence's dense problems as the rule
reads them, solved by the engine's float64 reference chain over each query head of the K/V head's
group, their key gradients added at the packed key rows they read; the sequence's rows of that sum
are the candidate. Where the program wrote its forward, the rule is also tried in the backward alone
(each sequence's gradients from its own output and lse as written), the flash backward's misread.
The query rows' stages are sequences.py's own.
"""
from __future__ import annotations

from typing import Iterator, List, Optional, Tuple

import numpy as np

from ..check.diagnosis import Diagnosis, Packing, Suspect
from ..stages import FLASH_LSE, FLASH_OUTPUT, STAGES
from ..variant import Variant
from .base import MIN_READ_VALUES, explains, explains_closely, maxdiff
from .inputs import slope_of, variant_of
from .sequence_readings import Piece, Reading, readings
from .sequences import MAX_CANDIDATE_ENTRIES, applies, named_reading, sequences, solve

# The stored forward a flash backward starts from (the program's own, where it wrote it).
_FORWARD = (FLASH_OUTPUT, FLASH_LSE)


def diagnose(stage, got, want, ctx: Suspect, width) -> List[Diagnosis]:
    """The packed sequences' readings that explain a failing stage of a sequence: of its query
    rows (sequences.py), or of its key rows (below)."""
    if STAGES[stage].rows != "M":
        return sequences(stage, got, want, ctx, width)
    if not applies(stage, ctx) or got.size < MIN_READ_VALUES:
        return []
    packing = ctx.packing
    seqs, b = packing.sequences, packing.sequence
    if got.shape[0] != seqs.m(b) or seqs.n(b) == 0:
        return []
    rows = seqs.k_rows(b)
    stored = _FORWARD if set(_FORWARD) <= set(STAGES[stage].inputs) and packing.outputs_of_head else None
    best: Optional[Tuple[float, Reading, bool]] = None
    for forward in (False, True) if stored else (False,):
        for rule, reading in _rules(seqs, b, variant_of(ctx)):
            total = _summed(stage, rule, packing, ctx, got.shape[1], forward)
            if total is None:
                continue
            cand = total[rows.start:rows.stop]
            if explains_closely(got, cand, want, width) is not None and maxdiff(got, cand) <= width:
                return [named_reading(stage, _as_key_reading(reading, forward), maxdiff(got, cand))]
            diff = explains(got, cand, want, width)
            if diff is not None and (best is None or diff < best[0]):
                best = (diff, reading, forward)
    # (no reading reproduced got to its own rounding: the closest that explains it, where one does;
    # a neighbour's reading differs from the right one in a row or two of the key rows)
    return [] if best is None else [named_reading(stage, _as_key_reading(best[1], best[2]), best[0])]


def _as_key_reading(reading: Reading, forward: bool) -> Reading:
    words = reading.words + ("; each key row's gradient summed over every sequence read so"
                             + (", in the backward alone (from the forward's output and lse as written)"
                                if forward else ""))
    return Reading(reading.code, words, reading.pieces, {**reading.detail, "key_rows_summed": True,
                                                         **({"backward_only": True} if forward else {})})


# ---- a reading as a rule over every sequence ----------------------------------------------------

def _rule(seqs, reading: Reading) -> Optional[tuple]:
    """What a reading does to any sequence (None: a reading of the query rows, which moves whole
    queries between sequences, not tried on the key rows)."""
    if reading.shared is not None:
        return ("whole", reading.shared)
    d = reading.detail
    side = d.get("side")
    if side is not None:
        return (reading.code, side, d["shift"]) if side.startswith("keys") else None
    if "read_sequence" in d:  # (a leak: from the stream's start, the neighbour's slot or its used keys)
        return (reading.code, d.get("how"), d["key_rows"][0] == seqs.k_slot(d["read_sequence"]).start)
    return (reading.code,)


def _rules(seqs, b: int, v) -> Iterator[Tuple[tuple, Reading]]:
    """(rule, its reading in words) of every reading of sequence b, then of its neighbours' that b
    has none of (a rule that moves only a neighbour's keys into b's rows: b's first key read by
    the sequence before it), each rule once; the whole stream's last (on the last sequence's rows a
    causal mask over the whole stream and its neighbour's keys ending late can be the same)."""
    seen, shared = set(), []
    for c in (b, b - 1, b + 1):
        if not 0 <= c < seqs.count or seqs.n(c) == 0 or seqs.m(c) == 0:
            continue
        for reading in readings(seqs, c, v):
            rule = _rule(seqs, reading)
            if rule is None or rule in seen:
                continue
            seen.add(rule)
            if rule[0] == "whole":
                shared.append((rule, reading))
            else:
                yield rule, reading
    yield from shared


def _pieces(seqs, c: int, rule: tuple, v: Variant) -> Tuple[List[Piece], Variant]:
    """Sequence c's dense problems under `rule` and the variant it solves them under: its reading of
    that rule, or its own rows where it has none (a leak has no sequence before the first; a
    sequence without keys is not read otherwise here)."""
    for reading in readings(seqs, c, v) if seqs.m(c) else ():
        if _rule(seqs, reading) == rule:
            return reading.pieces, reading.variant or v
    own = seqs.k_rows(c)
    return [Piece(seqs.q_rows(c), np.arange(own.start, own.stop))], v


def _problems(seqs, rule: tuple, v: Variant) -> List[Tuple[Piece, Variant]]:
    """Every dense problem the program solves under `rule`: one over the whole stream, or each
    sequence's."""
    parts = [_pieces(seqs, 0, rule, v)] if rule[0] == "whole" else \
        [_pieces(seqs, c, rule, v) for c in range(seqs.count) if seqs.n(c)]
    return [(p, pv) for pieces, pv in parts for p in pieces]


def _heads(ctx: Suspect) -> range:
    """The query heads whose gradients the stage's key rows hold (a K/V head's group, or the head)."""
    if ctx.head_ctx is None and ctx.dims is not None:
        return ctx.dims.query_heads_of(ctx.head)
    return range(ctx.head, ctx.head + 1)


def _summed(stage: str, rule: tuple, packing: Packing, ctx: Suspect, cols: int,
            forward: bool) -> Optional[np.ndarray]:
    """Every packed key row of `stage` as a program reading by `rule` writes it (None where a
    problem is too large to recompute); held in the job's cache for the other sequences."""
    key = ("key rows", rule, stage, ctx.head, forward)
    if key in packing.cache:
        return packing.cache[key]
    seqs = packing.sequences
    problems = _problems(seqs, rule, variant_of(ctx))
    total = None
    if all(len(p.q) * len(p.keys) <= MAX_CANDIDATE_ENTRIES for p, _ in problems):
        total = np.zeros((seqs.total_k, cols))
        for h in _heads(ctx):
            inputs = packing.inputs(h)
            stored = {n: packing.outputs_of_head(n, h) for n in _FORWARD} if forward else {}
            if any(x is None for x in stored.values()):
                return None
            slope = ctx.slope_of_head(h) if ctx.slope_of_head is not None else slope_of(ctx)
            for p, v in problems:
                if len(p.q) and len(p.keys):
                    rows = {n: np.asarray(x, np.float64)[p.q.start:p.q.stop] for n, x in stored.items()}
                    with np.errstate(all="ignore"):
                        total[p.keys] += solve(stage, p, inputs, ctx, v, rows or None, slope)
    packing.cache[key] = total
    return total
