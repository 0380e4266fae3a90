"""The bugs of packed (varlen) sequences: a sequence's rows computed from the wrong rows of the
packed stream. Each hypothesis is what the program read for sequence b, as dense problems over
packed query and key rows (the case's variant within each, as the engine's reference aligns it
within a sequence): the sequence's rows recomputed from the whole packed inputs with the engine's
float64 reference chain (verify/check/reference.py), named when that explains got and the
reference does not. Tried on a failing stage of the query rows (output, flash_output, flash_lse,
D, dQ, flash_dQ) of a packed case (the Suspect's packing: verify/check/packed.py).

Codes: sequence_leak (sequence b also attends to the keys of the sequence before it, or to every
earlier key of the packed stream as a causal mask over the whole stream does, or to every packed
key as dense attention does), sequence_boundary (a boundary off by k rows: sequence b's keys start
or end k rows early or late, or its whole key range shifted; its queries' boundary moved, or its
query rows shifted), padding_read (keys of the slot past seqused_k read: the whole slot, or the
first k past m(b)), sequence_offsets_swapped (sequence b's keys read at cu_seqlens_q's offsets).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional

import numpy as np

from ..check import tolerance
from ..check.diagnosis import Diagnosis, Packing, Suspect, equivalent
from ..check.reference import reference_chain
from ..specs import SPECS
from ..stages import FLASH_LSE, FLASH_OUTPUT, INPUT_NAMES, STAGES
from ..text import plural
from ..variant import UNBOUNDED, Variant
from .base import MIN_READ_VALUES, best_within_bound, explains, width_of
from .inputs import slope_of, variant_of

PADDING_READ, OFFSETS_SWAPPED = "padding_read", "sequence_offsets_swapped"
CODES = ("sequence_leak", "sequence_boundary", PADDING_READ, OFFSETS_SWAPPED)
# A boundary off by up to this many rows is named (a larger error is another bug, or a leak).
MAX_BOUNDARY_SHIFT = 3
# What a sequence that read other rows also looks like (its rows wrong everywhere, which a factor,
# a tile pattern or a few keys read past the end only approximate): the readings are tried after
# these, and replace them where one explains got.
APPROXIMATIONS = ("scaled", "tile_boundary", "unwritten", "keys_past_end", "keys_dropped")
# The largest dense problem (query rows × keys) a candidate recomputes: the whole packed stream's
# included, which a program that ignores the packing attends over.
MAX_CANDIDATE_ENTRIES = 1 << 22


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


def _what_it_reads(reading: Reading) -> tuple:
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


# ---- the candidates -------------------------------------------------------------------------------

def _solve(stage: str, piece: Piece, inputs: Dict[str, np.ndarray], ctx: Suspect, v: Variant,
           forward: Optional[Dict[str, np.ndarray]] = None) -> np.ndarray:
    """`stage` of one dense problem (its rows), by the engine's reference chain; forward: the
    program's own flash output and lse of those rows, which the backward then starts from."""
    q = slice(piece.q.start, piece.q.stop)
    sub = {n: x[q] if STAGES[n].rows == "N" else x[piece.keys] for n, x in inputs.items()}
    return reference_chain({**sub, **(forward or {})}, ctx.scale, v.causal, [stage], variant=v,
                           slope=slope_of(ctx))[stage]


def _stored_forward(stage: str, ctx: Suspect) -> Optional[Dict[str, np.ndarray]]:
    """The sequence's flash output and lse as the program wrote them, for a flash gradient whose
    backward alone may have misread the sequence (its forward right): the flash backward recomputes
    the weights from the stored lse."""
    stored = (FLASH_OUTPUT, FLASH_LSE)
    if not set(stored) <= set(STAGES[stage].inputs) or not all(n in ctx.src for n in stored):
        return None
    return {n: np.asarray(ctx.src[n], np.float64) for n in (FLASH_OUTPUT, FLASH_LSE)}


def _candidate(stage: str, reading: Reading, packing: Packing, ctx: Suspect, cols: int,
               forward: Optional[Dict[str, np.ndarray]] = None) -> Optional[np.ndarray]:
    """The sequence's rows of `stage` as the reading has them (forward: from the program's own
    forward, the reading's pieces then being the sequence's own rows); None where it is too large."""
    seqs, b = packing.sequences, packing.sequence
    rows = seqs.q_rows(b)
    v = reading.variant or variant_of(ctx)
    if any(len(p.q) * len(p.keys) > MAX_CANDIDATE_ENTRIES for p in reading.pieces):
        return None
    if forward is not None and any((p.q.start, p.q.stop, p.at) != (rows.start, rows.stop, None)
                                   for p in reading.pieces):
        return None
    key = None if reading.shared is None or forward is not None else (reading.shared, stage, ctx.head)
    cached = packing.cache.get(key) if key is not None else None
    out = np.full((len(rows), cols), np.nan)
    for piece in reading.pieces:
        where = piece.written
        lo, hi = max(where.start, rows.start), min(where.stop, rows.stop)
        if lo >= hi:
            continue
        if not len(piece.keys):
            solved = np.full((len(piece.q), cols), SPECS[stage].keyless)
        elif cached is not None:
            solved = cached
        else:
            with np.errstate(all="ignore"):
                solved = _solve(stage, piece, packing.inputs(ctx.head), ctx, v, forward)
            if key is not None:
                packing.cache[key] = solved
        out[lo - rows.start:hi - rows.start] = solved[lo - where.start:hi - where.start]
    return out


def _width(stage: str, ctx: Suspect, width: float) -> float:
    """The width to match a candidate from the inputs with: a stage whose isolated reference starts
    from upstream stages (output from the weights) carries the whole chain's error."""
    hc = ctx.head_ctx
    if hc is not None and set(STAGES[stage].inputs) - set(INPUT_NAMES) and stage in hc.chain:
        chained = tolerance.chained_bound(stage, hc.chain, **hc.bound_args())
        width = max(width, width_of(chained, hc.chain[stage]))
    return width


def caused_elsewhere(found: List[Diagnosis]) -> bool:
    """Whether a finding the hypotheses made before names another cause than the sequences' (a
    wrong scale, the softmax's axis, a wrong mask, a head's or a variant's bug): anything but an
    approximation or non-finite values, and a factor that is one of the named scales (an unnamed
    one only approximates keys read whose values are zero). The readings are then not tried."""
    return any((d.code not in APPROXIMATIONS + ("nonfinite",) and not equivalent(d))
               or (d.code == "scaled" and d.detail.get("names")) for d in found)


def applies(stage: str, ctx: Suspect) -> bool:
    """A stage of a packed case's query rows, computed from its inputs (not an echo: Q and dO), of
    a query head. Not in a paged case, whose keys are no slots: its readings are the paged ones
    (verify/check/paged.py, searched once the whole case is checked)."""
    st = STAGES[stage]
    return (ctx.packing is not None and not ctx.packing.sequences.paged and not ctx.packing.sequences.from_cache
            and ctx.head_ctx is not None
            and ctx.head is not None and st.rows == "N" and st.cols != "M" and not SPECS[stage].echo)


def sequences(stage, got, want, ctx, width) -> List[Diagnosis]:
    """The first reading of the sequence's rows that explains got and, after it, its padding read
    where that explains got too (where the weights are near one-hot, reading the padding keys and
    a broader reading give the same rows); where none does, the reading got lies closest to within
    its bounds (best_within_bound: a half-precision output, which a misread sequence moves by some
    ten of its bounds). Not on a stage of one value (a one-query sequence's lse), which some reading
    fits by chance."""
    if not applies(stage, ctx) or got.size < MIN_READ_VALUES:
        return []
    packing = ctx.packing
    seqs, b = packing.sequences, packing.sequence
    if got.shape[0] != seqs.n(b) or seqs.m(b) == 0:
        return []
    width = _width(stage, ctx, width)
    found: List[Diagnosis] = []
    seen = set()
    tried = []  # (reading, candidate): every reading computed, for the closest fit where none explains
    for reading in readings(seqs, b, variant_of(ctx)):
        same = _what_it_reads(reading)
        if same in seen or (found and (reading.code != PADDING_READ or reading.code in {d.code for d in found})):
            continue  # (two names for the same keys; after a match, only the padding read is tried)
        seen.add(same)
        try:
            cand = _candidate(stage, reading, packing, ctx, got.shape[1])
        except (KeyError, ValueError):
            continue
        if cand is None:
            continue
        tried.append((reading, cand))
        diff = explains(got, cand, want, width)
        if diff is not None:
            found.append(_named(stage, reading, diff))
    forward = None if found else _stored_forward(stage, ctx)
    for reading, _ in tried if forward is not None else []:  # (the backward alone misread it)
        try:
            cand = _candidate(stage, reading, packing, ctx, got.shape[1], forward)
        except (KeyError, ValueError):
            continue
        diff = None if cand is None else explains(got, cand, want, width)
        if diff is not None:
            found.append(_named(stage, Reading(reading.code, f"{reading.words}, in the backward alone (from the "
                                               "forward's output and lse as written)", reading.pieces,
                                               {**reading.detail, "backward_only": True}), diff))
            break
    best = None if found else best_within_bound(got, want, ctx.bound, tried)
    if best is not None:
        found.append(_named(stage, *best))
    return sorted(found, key=lambda d: d.detail["max_diff"])


def _named(stage: str, reading: Reading, diff: float) -> Diagnosis:
    return Diagnosis(reading.code, f"{stage}: {reading.words} (max diff {diff:.2g})",
                     {**reading.detail, "max_diff": diff}, 0.95)
