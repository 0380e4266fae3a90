"""The bugs of packed (varlen) sequences: a sequence's rows computed from the wrong rows of the
packed stream. Each hypothesis is what the program read for sequence b, as dense problems over
packed query and key rows (the case's variant within each, as the engine's reference aligns it
within a sequence): the sequence's rows recomputed from the whole packed inputs with the engine's
float64 reference chain (verify/check/reference.py), named when that explains got and the
reference does not. Tried on a failing stage of the query rows (output, flash_output, flash_lse,
D, dQ, flash_dQ) of a packed case (the Suspect's packing: verify/check/packed.py); the key rows'
stages are verify/diagnose/sequence_keys.py's, the readings verify/diagnose/sequence_readings.py's.

Codes: sequence_leak (sequence b also attends to the keys of the sequence before it, or to every
earlier key of the packed stream as a causal mask over the whole stream does, or to every packed
key as dense attention does, or to every key from the stream's first), sequence_boundary (a
boundary off by k rows: sequence b's keys start or end k rows early or late, or its whole key
range shifted; its queries' boundary moved, or its query rows shifted), padding_read (keys of the
slot past seqused_k read: the whole slot, or the first k past m(b)), sequence_offsets_swapped
(sequence b's keys read at cu_seqlens_q's offsets).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np

from ..check import tolerance
from ..check.diagnosis import Diagnosis, Packing, Suspect, equivalent
from ..check.reference import reference_chain
from ..specs import SPECS
from ..stages import FLASH_LSE, FLASH_OUTPUT, INPUT_NAMES, STAGES
from ..variant import Variant
from .base import MIN_READ_VALUES, best_within_bound, explains, width_of
from .inputs import slope_of, variant_of
from .sequence_readings import OFFSETS_SWAPPED, PADDING_READ, Piece, Reading, readings, same_reading

CODES = ("sequence_leak", "sequence_boundary", PADDING_READ, OFFSETS_SWAPPED)
# What a sequence that read other rows also looks like (its rows wrong everywhere, which a factor,
# a tile pattern or a few keys read past the end only approximate): the readings are tried after
# these, and replace them where one explains got.
APPROXIMATIONS = ("scaled", "tile_boundary", "unwritten", "keys_past_end", "keys_dropped")
# The largest dense problem (query rows × keys) a candidate recomputes: the whole packed stream's
# included, which a program that ignores the packing attends over.
MAX_CANDIDATE_ENTRIES = 1 << 22


# ---- the candidates -------------------------------------------------------------------------------

def solve(stage: str, piece: Piece, inputs: Dict[str, np.ndarray], ctx: Suspect, v: Variant,
          forward: Optional[Dict[str, np.ndarray]] = None, slope: Optional[float] = None) -> np.ndarray:
    """`stage` of one dense problem (its query rows, or its keys for a stage of the key rows), by
    the engine's reference chain; forward: the program's own flash output and lse of those rows,
    which the backward then starts from; slope: the query head's ALiBi slope (the Suspect's head's
    by default)."""
    q = slice(piece.q.start, piece.q.stop)
    sub = {n: x[q] if STAGES[n].rows == "N" else x[piece.keys] for n, x in inputs.items()}
    return reference_chain({**sub, **(forward or {})}, ctx.scale, v.causal, [stage], variant=v,
                           slope=slope_of(ctx) if slope is None else slope)[stage]


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
                solved = solve(stage, piece, packing.inputs(ctx.head), ctx, v, forward)
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
    a query head; or of its key rows (dK, dV: verify/diagnose/sequence_keys.py). Not in a paged
    case, whose keys are no slots: its readings are the paged ones (verify/check/paged.py,
    searched once the whole case is checked)."""
    st = STAGES[stage]
    return (ctx.packing is not None and not ctx.packing.sequences.paged and not ctx.packing.sequences.from_cache
            and ctx.head is not None and st.cols != "M" and not SPECS[stage].echo
            and ((st.rows == "N" and ctx.head_ctx is not None) or (st.rows == "M" and ctx.dims is not None)))


def sequence_of(stage: str, got: np.ndarray, ctx: Suspect) -> bool:
    """Whether the readings apply to got, a failing stage of one packed sequence: its rows are the
    sequence's queries (or keys, for dK and dV), the sequence reads keys (or has queries), and got
    holds more than one value (some reading fits a single value by chance)."""
    if not applies(stage, ctx) or got.size < MIN_READ_VALUES:
        return False
    seqs, b = ctx.packing.sequences, ctx.packing.sequence
    rows, other = (seqs.n(b), seqs.m(b)) if STAGES[stage].rows == "N" else (seqs.m(b), seqs.n(b))
    return got.shape[0] == rows and other > 0


def sequences(stage, got, want, ctx, width) -> List[Diagnosis]:
    """The first reading of the sequence's rows that explains got and, after it, its padding read
    where that explains got too (where the weights are near one-hot, reading the padding keys and
    a broader reading give the same rows); where none does, the reading got lies closest to within
    its bounds (best_within_bound: a half-precision output, which a misread sequence moves by some
    ten of its bounds). Not on a stage of one value (a one-query sequence's lse), which some reading
    fits by chance."""
    if not sequence_of(stage, got, ctx):
        return []
    packing = ctx.packing
    seqs, b = packing.sequences, packing.sequence
    width = _width(stage, ctx, width)
    found: List[Diagnosis] = []
    seen = set()
    tried = []  # (reading, candidate): every reading computed, for the closest fit where none explains
    for reading in readings(seqs, b, variant_of(ctx)):
        same = same_reading(reading)
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
            found.append(named_reading(stage, reading, diff))
    forward = None if found else _stored_forward(stage, ctx)
    for reading, _ in tried if forward is not None else []:  # (the backward alone misread it)
        try:
            cand = _candidate(stage, reading, packing, ctx, got.shape[1], forward)
        except (KeyError, ValueError):
            continue
        diff = None if cand is None else explains(got, cand, want, width)
        if diff is not None:
            found.append(named_reading(stage, Reading(reading.code, f"{reading.words}, in the backward alone (from the "
                                               "forward's output and lse as written)", reading.pieces,
                                               {**reading.detail, "backward_only": True}), diff))
            break
    best = None if found else best_within_bound(got, want, ctx.bound, tried)
    if best is not None:
        found.append(named_reading(stage, *best))
    return sorted(found, key=lambda d: d.detail["max_diff"])


def named_reading(stage: str, reading: Reading, diff: float) -> Diagnosis:
    return Diagnosis(reading.code, f"{stage}: {reading.words} (max diff {diff:.2g})",
                     {**reading.detail, "max_diff": diff}, 0.95)
