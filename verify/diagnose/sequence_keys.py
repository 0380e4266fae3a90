"""The packed sequences' bugs on the key rows' gradients (dK, dV and their flash twins): what a
program that misread the packing wrote there. A key row's gradient sums what every query that read
it gave it, so a misread sequence moves its own key rows and its neighbour's (the key of sequence
b + 1 that sequence b read one row late gets b's share too). Each reading of sequences.py is taken
as a rule the program applies to every sequence alike: every sequence's dense problems as the rule
reads them, solved by the engine's float64 reference chain over each query head of the K/V head's
group, their key gradients added at the packed key rows they read; the sequence's rows of that sum
are the candidate. Where the program wrote its forward, the rule is also tried in the backward alone
(each sequence's gradients from its own output and lse as written), the flash backward's misread.
Only the readings of keys near each sequence's own are tried (the whole stream's, and keys read from
the stream's first, reach every sequence's rows from all the sequences after it), every rule on a
few failing sequences of a job, then the rule found alone. The query rows' stages are
sequences.py's own.
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from ..check.diagnosis import Diagnosis, Packing, Suspect
from ..stages import FLASH_LSE, FLASH_OUTPUT, STAGES
from ..variant import Variant
from .base import explains, explains_closely, maxdiff
from .inputs import slope_of, variant_of
from .sequence_readings import FROM_STREAM_START, Piece, Reading, readings
from .sequences import MAX_CANDIDATE_ENTRIES, named_reading, sequence_of, sequences, solve

# The stored forward a flash backward starts from (the program's own, where it wrote it).
_FORWARD = (FLASH_OUTPUT, FLASH_LSE)
# A job (a K/V head's group) searches every rule on the key rows of this many failing sequences at
# most; once one rule names them, the others' are tried with it alone. Each rule recomputes the
# dense problems around the sequence: a stream of many sequences wrong otherwise (noise, a factor)
# would pay every rule on each.
MAX_KEY_ROW_SEARCHES = 4
_NAMED, _SEARCHES, _SOLVED = "key rows: named", "key rows: searches", "key rows: solved"
# The solved problems kept for the next sequences' rows, at most.
MEMO_BYTES = 1 << 26


def diagnose(stage, got, want, ctx: Suspect, width) -> List[Diagnosis]:
    """The packed sequences' readings that explain a failing stage of a sequence: of its query
    rows (sequences.py), or of its key rows (below)."""
    if STAGES[stage].rows != "M":
        return sequences(stage, got, want, ctx, width)
    if not sequence_of(stage, got, ctx):
        return []
    packing = ctx.packing
    seqs, b = packing.sequences, packing.sequence
    rows = seqs.k_rows(b)
    stored = _FORWARD if set(_FORWARD) <= set(STAGES[stage].inputs) and packing.outputs_of_head else None
    table = _table(packing, variant_of(ctx))
    # A rule found on this job's key rows before is tried alone; else every rule, on the job's
    # first MAX_KEY_ROW_SEARCHES failing sequences' key rows only.
    rules = list(_rules(table, seqs, b))
    named = [r for r in rules if r[0] == packing.cache.get(_NAMED)]
    if not named:
        if packing.cache.get(_SEARCHES, 0) >= MAX_KEY_ROW_SEARCHES:
            return []
        packing.cache[_SEARCHES] = packing.cache.get(_SEARCHES, 0) + 1
    rules = named or rules
    best: Optional[Tuple[float, tuple, Reading, bool]] = None
    for forward in (False, True) if stored else (False,):
        for rule, reading in rules:
            cand = _candidate(stage, rule, table, packing, ctx, got.shape[1], forward, rows)
            if cand is None:
                continue
            if explains_closely(got, cand, want, width) is not None and maxdiff(got, cand) <= width:
                best = (maxdiff(got, cand), rule, reading, forward)
                break
            diff = explains(got, cand, want, width)
            if diff is not None and (best is None or diff < best[0]):
                best = (diff, rule, reading, forward)
        else:
            continue
        break
    # (no reading reproduced got to its own rounding: the closest that explains it, where one does;
    # a neighbour's reading differs from the right one in a row or two of the key rows)
    if best is None:
        return []
    packing.cache[_NAMED] = best[1]
    return [named_reading(stage, _as_key_reading(best[2], best[3]), best[0])]


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


def _local(rule: Optional[tuple]) -> bool:
    """Whether a rule reads each sequence's keys near its own: the whole stream's readings, and keys
    read from the stream's first, reach every sequence's rows from all the sequences after it (as
    many dense problems as sequences for each sequence's rows): those are named on the query rows."""
    return rule is not None and rule[0] != "whole" and FROM_STREAM_START not in rule


def _table(packing: Packing, v: Variant) -> Dict[int, List[Tuple[tuple, Reading]]]:
    """Each sequence's local readings as rules, in order (each sequence's readings built once a job)."""
    key = ("key rules", v)
    if key not in packing.cache:
        seqs = packing.sequences
        packing.cache[key] = {c: [(r, reading) for reading in readings(seqs, c, v) if _local(r := _rule(seqs, reading))]
                              for c in range(seqs.count) if seqs.n(c) and seqs.m(c)}
    return packing.cache[key]


def _rules(table, seqs, b: int) -> Iterator[Tuple[tuple, Reading]]:
    """(rule, its reading in words) of every reading of sequence b, then of its neighbours' that b
    has none of (a rule that moves only a neighbour's keys into b's rows: b's first key read by
    the sequence before it), each rule once."""
    seen = set()
    for c in (b, b - 1, b + 1):
        for rule, reading in table.get(c, ()):
            if rule not in seen:
                seen.add(rule)
                yield rule, reading


def _problems(table, seqs, rule: tuple, v: Variant) -> List[Tuple[Piece, Variant]]:
    """Every sequence's dense problems under `rule`: its reading of that rule, or its own rows
    where it has none (a leak has no sequence before the first)."""
    out = []
    for c in range(seqs.count):
        if not seqs.n(c):
            continue
        reading = next((r for ru, r in table.get(c, ()) if ru == rule), None)
        if reading is None:
            own = seqs.k_rows(c)
            out.append((Piece(seqs.q_rows(c), np.arange(own.start, own.stop)), v))
        else:
            out += [(p, reading.variant or v) for p in reading.pieces]
    return out


def _heads(ctx: Suspect) -> range:
    """The query heads whose gradients the stage's key rows hold (a K/V head's group, or the head)."""
    if ctx.head_ctx is None and ctx.dims is not None:
        return ctx.dims.query_heads_of(ctx.head)
    return range(ctx.head, ctx.head + 1)


def _candidate(stage: str, rule: tuple, table, packing: Packing, ctx: Suspect, cols: int, forward: bool,
               rows: range) -> Optional[np.ndarray]:
    """The key rows `rows` of `stage` as a program reading every sequence by `rule` writes them: the
    key gradients of the dense problems that read those rows, over the group's query heads (None
    where one is too large to recompute, or the forward it starts from was not written). Each
    problem's gradients are kept while a later sequence's rows may still need them."""
    seqs = packing.sequences
    key = ("key problems", rule, variant_of(ctx))
    if key not in packing.cache:
        packing.cache[key] = _problems(table, seqs, rule, variant_of(ctx))
    memo = packing.cache.setdefault(_SOLVED, {})
    for k in [k for k, (last, _) in memo.items() if last < rows.start]:
        del memo[k]  # (sequences are diagnosed in order: no later sequence's rows lie before these)
    out = np.zeros((len(rows), cols))
    for i, (p, v) in enumerate(packing.cache[key]):
        inside = (p.keys >= rows.start) & (p.keys < rows.stop)
        if not len(p.q) or not inside.any():
            continue
        if len(p.q) * len(p.keys) > MAX_CANDIDATE_ENTRIES:
            return None
        at = (rule, i, stage, ctx.head, forward)
        solved = memo[at][1] if at in memo else _solved(stage, p, v, packing, ctx, forward, cols)
        if solved is None:
            return None
        if at not in memo and sum(x.nbytes for _, x in memo.values()) + solved.nbytes <= MEMO_BYTES:
            memo[at] = (int(p.keys.max()), solved)
        np.add.at(out, p.keys[inside] - rows.start, solved[inside])
    return out


def _solved(stage: str, p: Piece, v: Variant, packing: Packing, ctx: Suspect, forward: bool,
            cols: int) -> Optional[np.ndarray]:
    """One dense problem's key gradients (its keys' rows), summed over the group's query heads."""
    total = np.zeros((len(p.keys), cols))
    for h in _heads(ctx):
        stored = {n: packing.outputs_of_head(n, h) for n in _FORWARD} if forward else {}
        if any(x is None for x in stored.values()):
            return None
        slope = ctx.slope_of_head(h) if ctx.slope_of_head is not None else slope_of(ctx)
        rows = {n: np.asarray(x, np.float64)[p.q.start:p.q.stop] for n, x in stored.items()}
        with np.errstate(all="ignore"):
            total += solve(stage, p, packing.inputs(h), ctx, v, rows or None, slope)
    return total
