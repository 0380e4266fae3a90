"""What a program that misread a packed case read for one of its sequences (the readings the
packed sequences' diagnoses recompute: verify/diagnose/sequences.py for the query rows,
verify/diagnose/sequence_keys.py for the key rows): the neighbour's keys or the whole stream, the
slot's padding, keys from the stream's start or at another sequence's offsets, and every boundary
off by a few rows; each in the sequence's own words."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, List, Optional

import numpy as np

from ..text import plural
from ..variant import UNBOUNDED, Variant

PADDING_READ, OFFSETS_SWAPPED = "padding_read", "sequence_offsets_swapped"
# A boundary off by up to this many rows is named (a larger error is another bug, or a leak).
MAX_BOUNDARY_SHIFT = 3
# How a leak from the stream's first key is said in its detail.
FROM_STREAM_START = "from the stream's first key"

@dataclass
class Piece:
    """One dense problem a buggy program solved: packed query rows `q` over packed key rows `keys`
    (in order), its first row written at packed row `at` (q.start unless its rows were shifted)."""
    q: range
    keys: np.ndarray
    at: Optional[int] = None

    @property
    def written(self) -> range:
        start = self.q.start if self.at is None else self.at
        return range(start, start + len(self.q))


@dataclass
class Reading:
    """What a buggy program read for a sequence: its code, its words, the dense problems whose rows
    make up the sequence's rows, another variant (None: the case's), and a key under which the
    candidate is shared by every sequence (the whole stream's)."""
    code: str
    words: str
    pieces: List[Piece]
    detail: dict = field(default_factory=dict)
    variant: Optional[Variant] = None
    shared: Optional[str] = None


def same_reading(reading: Reading) -> tuple:
    """The rows a reading computes from which keys, under which variant: readings alike in this are
    one reading under two names."""
    return (reading.variant, reading.shared,
            tuple((p.q.start, p.q.stop, p.at, np.asarray(p.keys, np.int64).tobytes()) for p in reading.pieces))


def _rows(lo: int, hi: int) -> np.ndarray:
    return np.arange(lo, hi)


def _span(keys: np.ndarray) -> str:
    if not len(keys):
        return "none"
    if len(keys) == keys[-1] - keys[0] + 1:
        return f"{keys[0]}-{keys[-1]}" if len(keys) > 1 else f"{keys[0]}"
    return ", ".join(_span(part) for part in np.split(keys, np.flatnonzero(np.diff(keys) != 1) + 1))


def _packed_rows(keys: np.ndarray) -> str:
    return f"packed key {'row' if len(keys) == 1 else 'rows'} {_span(keys)}"


def _dots(lo: int, hi: int, what: str) -> str:
    """Rows lo..hi (inclusive) of a sequence: "keys 1..43", "key 5"."""
    return f"{what}s {lo}..{hi}" if hi > lo else f"{what} {lo}"


def _own_terms(seqs, b: int, rows: np.ndarray, side: str = "k") -> str:
    """Packed key (side "k") or query ("q") rows in the sequences' own terms, seen from sequence b:
    "its keys 1..43", "sequence 0's keys 0..5 and its keys 0..3", "its padding keys 4..5"."""
    if not len(rows):
        return f"no {'key' if side == 'k' else 'query row'}"
    cu = np.asarray(seqs.cu_k if side == "k" else seqs.cu_q)
    owner = np.searchsorted(cu, rows, side="right") - 1
    parts, last = [], None
    for run in np.split(np.arange(len(rows)), np.flatnonzero((np.diff(rows) != 1) | (np.diff(owner) != 0)) + 1):
        c, lo, hi = int(owner[run[0]]), int(rows[run[0]]), int(rows[run[-1]])
        whose = "its" if c == b else f"sequence {c}'s"
        whose, last = ("" if c == last else whose + " "), c
        start = int(cu[c])
        if side == "q":
            parts.append(f"{whose}{_dots(lo - start, hi - start, 'row')}")
            continue
        used_end = start + seqs.m(c)
        if lo < used_end:
            parts.append(f"{whose}{_dots(lo - start, min(hi, used_end - 1) - start, 'key')}")
            whose = ""
        if hi >= used_end:
            parts.append(f"{whose}{_dots(max(lo, used_end) - start, hi - start, 'padding key')}")
    return " and ".join(parts)


def _instead(seqs, b: int, read: np.ndarray, own: np.ndarray, side: str = "k") -> str:
    """"its keys 1..43 instead of 0..43": the rows read, then the sequence's own, in its terms."""
    got, want = _own_terms(seqs, b, read, side), _own_terms(seqs, b, own, side)
    prefix = want.split(" ")[0] + " " + want.split(" ")[1] + " "   # "its keys "
    if got.startswith("its ") and " and " not in got and want.startswith(prefix):
        want = want[len(prefix):]
    return f"{got} instead of {want}"


def _direction(k: int) -> str:
    return f"{plural(abs(k), 'row')} {'late' if k > 0 else 'early'}"


def _shifts() -> List[int]:
    """1, -1, 2, -2, … MAX_BOUNDARY_SHIFT: the smallest first."""
    return [s for k in range(1, MAX_BOUNDARY_SHIFT + 1) for s in (k, -k)]


# ---- the readings ---------------------------------------------------------------------------------

def _leaks(seqs, b: int, v: Variant) -> Iterator[Reading]:
    q, own = seqs.q_rows(b), _rows(seqs.k_rows(b).start, seqs.k_rows(b).stop)
    before = [p for p in range(b) if seqs.m(p) > 0]
    if before:
        p = before[-1]
        slot, used = seqs.k_slot(p), seqs.k_rows(p)
        reads = [_rows(slot.start, own[-1] + 1)]
        if len(used) < len(slot) or slot.stop != own[0]:
            reads.append(np.concatenate([_rows(used.start, used.stop), own]))
        for keys in reads:
            yield Reading("sequence_leak", f"sequence {b}'s queries also attend to the keys of sequence {p} before it "
                          f"({_instead(seqs, b, keys, own)}; {_packed_rows(keys)} instead of {_span(own)}): "
                          "attention crosses the boundary between them",
                          [Piece(q, keys)],
                          {"sequence": b, "read_sequence": p, "key_rows": [int(keys[0]), int(keys[-1])]})
    whole = [Piece(range(0, seqs.total_q), _rows(0, seqs.total_k))]
    if v.structural:
        yield Reading("sequence_leak", f"the packing is ignored: sequence {b}'s queries attend to every earlier key "
                      f"of the packed stream, as a causal mask over all {seqs.total_q} queries and {seqs.total_k} keys "
                      "does", whole, {"sequence": b, "how": "causal over the whole stream"}, shared="whole")
    yield Reading("sequence_leak", f"the packing is ignored: sequence {b}'s queries attend to all {seqs.total_k} "
                  "packed keys, as dense attention over the whole stream does", whole,
                  {"sequence": b, "how": "dense over every key"}, v.with_(causal=False, window=(UNBOUNDED, UNBOUNDED)),
                  shared="dense")
    if before:  # (after the first sequence before it, the same keys as its leak: one reading, two rules;
        # where each sequence is square and causal, the whole stream's causal mask, named first)
        keys = _rows(0, own[-1] + 1)
        yield Reading("sequence_leak", f"sequence {b}'s queries attend to every packed key from row 0 to its own last "
                      f"({_instead(seqs, b, keys, own)}; {_packed_rows(keys)} instead of {_span(own)}): its key loop "
                      f"starts at key 0, not at cu_seqlens_k[{b}]",
                      [Piece(q, keys)], {"sequence": b, "read_sequence": 0, "key_rows": [0, int(keys[-1])],
                                         "how": FROM_STREAM_START})


def _padding(seqs, b: int) -> Iterator[Reading]:
    slot, used = seqs.k_slot(b), seqs.k_rows(b)
    if len(used) == len(slot):
        return
    pad = len(slot) - len(used)
    padding = _rows(used.stop, slot.stop)
    yield Reading(PADDING_READ, f"sequence {b} reads the {plural(pad, 'padding key')} of its slot past seqused_k = "
                  f"{len(used)} ({_own_terms(seqs, b, padding)}; {_packed_rows(padding)}): all {len(slot)} "
                  "keys of the slot attended", [Piece(seqs.q_rows(b), _rows(slot.start, slot.stop))],
                  {"sequence": b, "padding_keys": pad, "key_rows": [slot.start, slot.stop - 1]})


def _query_offsets(seqs, b: int) -> Iterator[Reading]:
    """Sequence b's keys read at cu_seqlens_q's offsets (the queries' array passed for the keys')."""
    q, used = seqs.q_rows(b), seqs.k_rows(b)
    if (q.start, q.stop) == (used.start, used.stop) or not 0 <= q.start < q.stop <= seqs.total_k:
        return
    keys = _rows(q.start, q.stop)
    yield Reading(OFFSETS_SWAPPED, f"sequence {b}'s keys read at the queries' offsets, cu_seqlens_q[{b}]..cu_seqlens_q"
                  f"[{b + 1}] ({_instead(seqs, b, keys, _rows(used.start, used.stop))}; {_packed_rows(keys)} instead "
                  f"of {_span(_rows(used.start, used.stop))}): cu_seqlens_q used for the keys",
                  [Piece(q, keys)], {"sequence": b, "key_rows": [q.start, q.stop - 1]})


def _key_boundaries(seqs, b: int, s: int) -> Iterator[Reading]:
    """Sequence b's keys with their start, their end or both moved by s rows."""
    q, used, slot = seqs.q_rows(b), seqs.k_rows(b), seqs.k_slot(b)
    lo, hi = used.start, used.stop
    for side, a, z in (("start", lo + s, hi), ("end", lo, hi + s), ("range", lo + s, hi + s)):
        if not (0 <= a < z <= seqs.total_k):
            continue
        keys = _rows(a, z)
        detail = {"sequence": b, "shift": s, "side": f"keys {side}", "key_rows": [a, z - 1]}
        if side == "end" and s > 0 and z <= slot.stop:
            yield Reading(PADDING_READ, f"sequence {b} reads {plural(s, 'padding key')} of its slot past seqused_k "
                          f"= {len(used)} ({_own_terms(seqs, b, _rows(hi, z))}; {_packed_rows(_rows(hi, z))}): "
                          f"its keys end {_direction(s)}",
                          [Piece(q, keys)], {**detail, "padding_keys": s})
            continue
        what = {"start": f"start {_direction(s)}", "end": f"end {_direction(s)}",
                "range": f"are shifted {_direction(s)}"}[side]
        yield Reading("sequence_boundary", f"sequence {b}'s keys {what} ({_instead(seqs, b, keys, _rows(lo, hi))}; "
                      f"{_packed_rows(keys)} instead of {_span(_rows(lo, hi))}): the boundary off by {s:+d}",
                      [Piece(q, keys)], detail)


def _query_boundaries(seqs, b: int, s: int) -> Iterator[Reading]:
    """The query boundary at either end of sequence b moved by s rows (the rows past it computed as
    the neighbour's), or the sequence's query rows shifted by s (written where they belong)."""
    keys = [_rows(seqs.k_rows(c).start, seqs.k_rows(c).stop) for c in range(seqs.count)]
    cu = seqs.cu_q
    for c in (b, b + 1):   # the sequence whose start is moved
        if not 1 <= c < seqs.count:
            continue
        edge = cu[c] + s
        if not cu[c - 1] <= edge <= cu[c + 1]:
            continue
        pieces = [Piece(range(cu[c - 1], edge), keys[c - 1]), Piece(range(edge, cu[c + 1]), keys[c])]
        between = _rows(min(edge, cu[c]), max(edge, cu[c]))
        yield Reading("sequence_boundary", f"sequence {c}'s queries start {_direction(s)}: "
                      f"{_own_terms(seqs, c, between, 'q')} computed as sequence {c - 1 if s > 0 else c}'s "
                      f"(at packed row {edge} instead of {cu[c]}: cu_seqlens_q[{c}] off by {s:+d})", pieces,
                      {"sequence": c, "shift": s, "side": "queries start"})
    q = seqs.q_rows(b)
    if 0 <= q.start + s and q.stop + s <= seqs.total_q:
        read = _rows(q.start + s, q.stop + s)
        yield Reading("sequence_boundary", f"sequence {b}'s query rows are shifted {_direction(s)}: its rows hold the "
                      f"result of {_instead(seqs, b, read, _rows(q.start, q.stop), 'q')} "
                      f"(packed query rows {_span(read)} instead of {q.start}-{q.stop - 1})",
                      [Piece(range(q.start + s, q.stop + s), keys[b], q.start)],
                      {"sequence": b, "shift": s, "side": "query rows"})


def readings(seqs, b: int, v: Variant) -> Iterator[Reading]:
    """What a buggy program may have read for sequence b of `seqs` (the packing: verify/sequences.py's
    Sequences, as the Suspect's packing holds it): the neighbour's keys or the whole stream, the
    slot's padding, then every boundary off by a few rows, the smallest first."""
    yield from _leaks(seqs, b, v)
    yield from _padding(seqs, b)
    yield from _query_offsets(seqs, b)
    for s in _shifts():
        yield from _key_boundaries(seqs, b, s)
        yield from _query_boundaries(seqs, b, s)
