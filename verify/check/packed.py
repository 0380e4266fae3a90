"""Checking a packed case (verify/sequences.py) sequence by sequence.

Each sequence b with queries is an ordinary dense problem: the same heads, K/V heads, d and variant,
with N = n(b) and M = m(b) (so a causal mask or window aligned bottom-right meets each sequence's own
corner), checked by the dense engine (compare.check_head, groups.check_summed) on a SequenceRun and a
SequenceCase: the row slices of the packed per-head files (Q, dO and every stage of N rows: rows
q_rows(b); K, V, dK, dV and their flash twins: rows k_rows(b); KT: those columns) and the sequence's
own N×M files, `<stage>_head_{i}_seq_{b}`. A job is still one K/V head's group: its packed matrices
are read once and sliced for every sequence.

What the dense problems cannot see is checked here, exactly: a sequence that reads no key (m(b) = 0)
outputs 0 on its rows and flash_lse −inf (+inf accepted, as for any row that sees no key); and a key
row no query reads (padding past m(b) in a slot, or the keys of a sequence without queries) has dK,
dV, flash_dK and flash_dV exactly 0, and K, V and KT (its column) echo the input as read.

A paged case (verify/sequences.py) is checked the same way, each sequence's keys gathered through its
block table (key_rows): its K and V rows of the SequenceCase are the pool rows the table names, in the
sequence's key order. K, V and KT echo the pool: they are checked over all of it once per K/V head (an
ordinary result of the K/V head), not per sequence.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, fields, replace
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from ..files.case import InputCase
from ..files.kinds import CaseError
from ..files.outputs import RunInfo, StageSource
from ..sequences import PACKED_VARIANTS_HINT, Sequences, unsupported_with_packing
from ..specs import SPECS
from ..stages import FORMATS, SEQUENCE_STAGES, STAGES, parse_stage_file, per_sequence, split_columns, stage_file
from ..variant import NONE
from ..model.half import echoed, is_half, round_to_format
from .diagnosis import Diagnoser, Diagnosis, Packing
from .invariants import NONFINITE
from .results import FAIL, HeadResult, compare_arrays, result_order
from .split_values import stand_ins_read_as_empty
from .splits import COMBINED_FROM as COMBINED, EMPTY_SPLIT
from .stage_check import STATUS_CODES, Loaded, SequenceRun, case_inputs, file_index, load_output, new_result

# The diagnosis of a key row no query reads whose gradient is not 0 or whose K, V or KT is not
# the input's.
UNREAD_KEY_ROW = "unread_key_row"


def _sequence_pattern(stage: str, fmt: str, seq: int) -> str:
    """A StageSource pattern for sequence `seq`'s files of `stage` ({i}: the head)."""
    return stage_file(stage, 0, fmt, seq=seq).replace("_head_0_", "_head_{i}_")


# ----------------------------------------------------------------------------------------------
# The N×M stages of a packed run: one file per head and sequence.

def packed_sources(run: RunInfo) -> None:
    """Puts the N×M stages a packed run holds into run.sources (table order): those listed in
    run.toml or found with the dense name keep their place; those present only as per-sequence
    files (another program's run) are found here. A name the sequence cannot be read from (a
    --name pattern, one .npy for every head, arrays) is refused in one line."""
    found: Dict[str, set] = {}
    if run.path is not None:
        for entry in os.listdir(run.path):
            parsed = parse_stage_file(entry)
            if parsed is not None and parsed.seq is not None and per_sequence(parsed[0]):
                found.setdefault(parsed[0], set()).add(parsed[2])
    sources = dict(run.sources)
    for stage in SEQUENCE_STAGES:
        fmts = sorted(found.get(stage, ()))
        if len(fmts) > 1:
            raise CaseError(f"{run.path}: {stage} has both .txt and .npy sequence files; HINT: remove one set")
        src = sources.get(stage)
        if src is None:
            if fmts:
                sources[stage] = StageSource(stage, run.path, stage_file(stage, 0, fmts[0]).replace("_head_0.",
                                                                                                   "_head_{i}."))
            continue
        if _format_of(src) is None:
            where = "arrays" if src.arrays is not None else f"'{src.describe()}'"
            raise CaseError(f"{stage} ({where}): in a packed case {stage} is one n x m matrix per head and "
                            f"sequence, {stage_file(stage, 0, 'txt', seq=0).replace('_0_seq_0', '_{i}_seq_{b}')} "
                            "(or .npy); HINT: write it per sequence, or leave it out")
    run.sources = {s: sources[s] for s in STAGES if s in sources}


def _format_of(src: StageSource) -> Optional[str]:
    """The format of a stage's per-head files named as attnstep names them; None for anything else."""
    if src.arrays is not None:
        return None
    for fmt in FORMATS:
        if src.pattern == stage_file(src.stage, 0, fmt).replace("_head_0.", "_head_{i}."):
            return fmt
    return None


# ----------------------------------------------------------------------------------------------
# One sequence as a dense case.

@dataclass
class SequenceCase(InputCase):
    """One sequence of a packed input case: `rows` gives a head's input rows (Q and dO: its
    queries; K and V: the keys it reads), `slope` the packed case's ALiBi slope of a head."""
    rows: Optional[Callable[[str, int], np.ndarray]] = None
    slope: Optional[Callable[[int], float]] = None

    def load(self, name: str, head: int) -> np.ndarray:
        return self.rows(name, head)

    def variant_input(self, name: str, head: int) -> Optional[np.ndarray]:
        return None  # a packed case has no mask or bias files (refused when it is read)

    def alibi_slope(self, head: int) -> float:
        return self.slope(head)


def _keyless_nonfinite(stage: str, got: np.ndarray, want: np.ndarray, b: int, splits_keys: bool) -> List[Diagnosis]:
    """NaN or Inf in the rows of a sequence that reads no key, named: in a run that splits the keys,
    every split of those rows is empty (empty_split: −inf − (−inf) in a combine, 0/0 in a split);
    elsewhere, the stage's nonfinite values."""
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(got) & (got != want)
    if not bad.any():
        return []
    nan, inf = int(np.isnan(got).sum()), int(bad.sum() - np.isnan(got).sum())
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    held = f"{nan} NaN and {inf} Inf where it reads no key (m = 0); first at {list(first)} = {float(got[first])}"
    if splits_keys and (STAGES[stage].split or stage in COMBINED):
        return [Diagnosis(EMPTY_SPLIT, f"{stage}: sequence {b} holds {held}: every split of its rows is empty, "
                          "and an empty split mishandled", {"sequence": b, "nan": nan, "count": nan + inf}, 0.95)]
    return [Diagnosis(NONFINITE, f"{stage}: sequence {b} holds {held}", {"count": nan + inf})]


class PackedRun:
    """A packed run and its input case, seen sequence by sequence. Holds the packed matrices of
    the heads one job reads (a K/V head's group; a few more for the diagnoses), read once each."""

    def __init__(self, run: RunInfo, case: InputCase, stages) -> None:
        self.run, self.case, self.seqs, self.stages = run, case, case.sequences, list(stages)
        v = run.variant
        # In the readers' words (a run's variant comes from the case, run.toml or check's options).
        problem = unsupported_with_packing(v.mask != NONE, v.bias != NONE, v.dropout > 0)
        if problem:
            raise CaseError(f"{run.path or 'the run'}: {problem}; HINT: {PACKED_VARIANTS_HINT}")
        self._whole: "OrderedDict[tuple, object]" = OrderedDict()
        self._candidates: dict = {}  # the diagnoses' candidates over several sequences, per job
        self._keep = (len(STAGES) + 4) * (run.dims.group_size + 1) + 16
        self._unread = self._unread_key_rows()

    @property
    def sequences(self) -> Sequences:
        return self.seqs

    # ---- the packed matrices, read once per job -------------------------------------------------

    def forget(self) -> None:
        """Drops the packed matrices held (a new job reads other heads)."""
        self._whole.clear()
        self._candidates.clear()

    def _cached(self, key: tuple, read: Callable[[], object]):
        if key in self._whole:
            self._whole.move_to_end(key)
            return self._whole[key]
        value = self._whole[key] = read()
        while len(self._whole) > self._keep:
            self._whole.popitem(last=False)
        return value

    def whole_output(self, stage: str, index: int) -> Loaded:
        return self._cached(("out", stage, index), lambda: load_output(self.run, stage, index))

    def whole_input(self, name: str, head: int) -> np.ndarray:
        return self._cached(("in", name, head), lambda: self.case.load(name, head))

    # ---- the rows of a sequence -----------------------------------------------------------------

    def _span(self, sym: str, b: int):
        """The rows (or columns) of sequence b along a dimension of the stage table: a slice, or
        along the keys of a paged case the pool rows its table names, in its key order."""
        if sym == "N":
            r = self.seqs.q_rows(b)
        elif sym == "M":
            if self.seqs.paged:
                return self.seqs.key_rows(b)
            r = self.seqs.k_rows(b)
        else:
            return slice(None)
        return slice(r.start, r.stop)

    def offsets(self, stage: str, b: int) -> Tuple[int, int]:
        """The packed row and column of sequence b's [0, 0] in `stage`'s matrices."""
        st = STAGES[stage]
        key = 0 if self.seqs.paged else self.seqs.cu_k[b]  # (paged: no key stage is checked per sequence)
        return tuple({"N": self.seqs.cu_q[b], "M": key}.get(sym, 0) for sym in (st.rows, st.cols))

    def _output_rows(self, b: int, stage: str, index: int) -> Loaded:
        mat, resolution, status, msg = self.whole_output(stage, index)
        if mat is None:
            return mat, resolution, status, msg
        st = STAGES[stage]
        return mat[self._span(st.rows, b), self._span(st.cols, b)].copy(), resolution, None, ""

    def _input_rows(self, b: int, name: str, head: int) -> np.ndarray:
        return self.whole_input(name, head)[self._span(STAGES[name].rows, b)]

    def packed_inputs(self, head: int) -> Dict[str, np.ndarray]:
        """Query head `head`'s whole packed Q, K, V (and dO), float64, rounded to the run's half
        format where it has one: what the dense engine reads, over every token."""
        run = self.run
        out = {n: self.whole_input(n, file_index(run, n, head)).astype(np.float64) for n in case_inputs(run)}
        if is_half(run.precision):
            out = {n: round_to_format(x, run.precision, run.half_rounding) for n, x in out.items()}
        return out

    def packed_output(self, stage: str, head: int) -> Optional[np.ndarray]:
        """The program's whole packed `stage` of query head `head` (None where it wrote none)."""
        return self.whole_output(stage, file_index(self.run, stage, head))[0] if stage in self.run.sources else None

    def _diagnoser(self, b: int, diagnoser: Optional[Diagnoser]) -> Optional[Diagnoser]:
        """The diagnoser of sequence b's dense check: `diagnoser`, shown the packing around it."""
        if diagnoser is None:
            return None
        packing = Packing(self.seqs, b, self.packed_inputs, self._candidates, self.packed_output)
        return lambda stage, got, want, suspect: diagnoser(stage, got, want, replace(suspect, packing=packing))

    def sequence(self, b: int) -> Tuple[SequenceRun, SequenceCase]:
        """Sequence b as a dense run and case of its own."""
        run, case, seqs = self.run, self.case, self.seqs
        dims = replace(run.dims, seq_q=seqs.n(b), seq_k=seqs.m(b))
        own = {s: _sequence_pattern(s, _format_of(src), b) for s, src in run.sources.items() if per_sequence(s)}
        sources = {s: StageSource(s, run.path, own[s]) if s in own else src for s, src in run.sources.items()
                   if not (seqs.paged and STAGES[s].kv)}  # (paged: K, V, KT are the pool's, checked whole)
        crc = {s: "crc32_" + p.rsplit(".", 1)[0] for s, p in own.items()}
        values = {f.name: getattr(run, f.name) for f in fields(RunInfo)}
        sub_run = SequenceRun(**{**values, "dims": dims, "sources": sources, "sequences": None},
                              rows=lambda stage, index: self._output_rows(b, stage, index), crc_names=crc)
        values = {f.name: getattr(case, f.name) for f in fields(InputCase) if f.init}
        sub_case = SequenceCase(**{**values, "dims": dims, "sequences": None, "_whole": {}},
                                rows=lambda name, head: self._input_rows(b, name, head), slope=case.alibi_slope)
        return sub_run, sub_case

    # ---- a job ----------------------------------------------------------------------------------

    def check(self, kv_head: int,
              check_dense: Callable[[SequenceRun, SequenceCase, Optional[Diagnoser]], List[HeadResult]],
              diagnoser: Optional[Diagnoser] = None) -> List[HeadResult]:
        """Every sequence of K/V head `kv_head`'s group (check_dense: the dense engine's check of
        the group on one sequence, with `diagnoser` shown the packing), then its key rows no query
        reads."""
        self.forget()
        out: List[HeadResult] = []
        try:
            for b in range(self.seqs.count):
                if self.seqs.n(b) == 0:
                    continue  # no query: nothing but its keys' gradients (unread rows) to check
                results = self._keyless(kv_head, b) if self.seqs.m(b) == 0 else \
                    check_dense(*self.sequence(b), self._diagnoser(b, diagnoser))
                for r in results:
                    r.sequence, r.offsets = b, self.offsets(r.stage, b)
                out += results
            out += self._unread_rows(kv_head)
        finally:
            self.forget()
        return sorted(out, key=result_order)

    def _keyless(self, kv_head: int, b: int) -> List[HeadResult]:
        """Sequence b reads no key: its queries' rows are exactly 0 (flash_lse −inf, or +inf), Q
        and dO echo their input (at bf16/fp16 rounded to the format, or as read), within the file's
        printed resolution."""
        out = []
        for head in self.run.dims.query_heads_of(kv_head):
            for stage in self.stages:
                if STAGES[stage].rows != "N" or STAGES[stage].cols == "M":
                    continue  # (an N×M stage of no key has no file; K, V, dK ...: no row of this sequence)
                res = new_result(self.run, stage, head)
                res.split_cols = split_columns(stage, self.run.dims) if STAGES[stage].split else 0
                mat, resolution, status, msg = self._output_rows(b, stage, head)
                if mat is None:
                    res.status, res.message = status, msg
                    res.diagnosis.append(Diagnosis(STATUS_CODES[status], msg, {}))
                    out.append(res)
                    continue
                keyless = SPECS[stage].keyless
                if SPECS[stage].echo:
                    # a half-precision echo: the input in its format (or as read)
                    want = echoed(mat, self._input_rows(b, stage, head), self.run.precision, self.run.half_rounding)
                else:
                    if keyless == -np.inf and not STAGES[stage].split:  # (a split's lse is −inf: contract.md)
                        mat = np.where(mat == np.inf, -np.inf, mat)  # flash-attn's +inf for a row without keys
                    elif keyless == -np.inf:  # (or a finite stand-in for it: split_values.py)
                        mat = stand_ins_read_as_empty(mat, np.ones(mat.shape, bool))
                    want = np.full(mat.shape, keyless)
                quantum = resolution.quantum(mat)
                allowed = np.zeros(mat.shape) if quantum is None else quantum
                res.resolution = resolution.describe()
                res.chained = res.isolated = compare_arrays(mat, want, allowed)
                if not res.chained.passed:
                    res.status = FAIL
                    res.message = (f"sequence {b} reads no key (m = 0): its rows are "
                                   + ("the input as read" if SPECS[stage].echo else
                                      "-inf (or +inf)" if keyless == -np.inf else f"{keyless:g}"))
                    res.diagnosis += _keyless_nonfinite(stage, mat, want, b, self.run.dims.split_size > 0)
                out.append(res)
        return out

    def _unread_key_rows(self) -> np.ndarray:
        """Each packed key row: whether no query reads it (past m(b) in its slot, or of a
        sequence without queries); in a paged case every pool row (K, V and KT are checked over
        the whole pool)."""
        seqs = self.seqs
        if seqs.paged:
            return np.ones(seqs.total_k, bool)
        unread = np.zeros(seqs.total_k, bool)
        for b in range(seqs.count):
            slot, used = seqs.k_slot(b), seqs.k_rows(b)
            unread[slot.start:slot.stop] = True
            if seqs.n(b) > 0:
                unread[used.start:used.stop] = False
        return unread

    def _why_unread(self, row: int) -> str:
        seqs, b = self.seqs, self.seqs.sequence_of_key(row)
        return (f"a key of sequence {b}, which has no queries" if seqs.n(b) == 0 else
                f"padding of sequence {b}: key {row - seqs.cu_k[b]} of its slot of {len(seqs.k_slot(b))}, past the "
                f"{seqs.m(b)} it uses")

    def _unread_rows(self, kv_head: int) -> List[HeadResult]:
        """K/V head `kv_head`'s stages on the key rows no query reads: dK, dV, flash_dK, flash_dV
        exactly 0; K, V echo the input as read and KT's columns are K's rows (within the file's
        printed resolution, as every echo)."""
        rows = self._unread
        if not rows.any():
            return []
        out, paged = [], self.seqs.paged
        for stage in (s for s in self.stages if STAGES[s].kv):
            st = STAGES[stage]
            res = new_result(self.run, stage, self.run.dims.query_heads_of(kv_head)[0])
            res.padding_rows = not paged  # (paged: the whole pool, a K/V head's ordinary result)
            mat, resolution, status, msg = self.whole_output(stage, kv_head)
            if mat is None:
                res.status, res.message = status, msg
                res.diagnosis.append(Diagnosis(STATUS_CODES[status], msg, {}))
                out.append(res)
                continue
            # KT holds the keys as columns: the unread keys are its columns there.
            unread = rows[None, :] if st.cols == "M" else rows[:, None]
            if st.backward:
                want, allowed = np.zeros(mat.shape), np.zeros(mat.shape)
                rule = "is not 0: no query reads it, so its {stage} is exactly 0"
            else:
                # K and V echo their input; KT is its one input (K), transposed (keys along its columns)
                want = self.whole_input(st.inputs[0] if st.inputs else stage, kv_head).astype(np.float64)
                want = want.T if st.cols == "M" else want
                if want.shape == mat.shape:
                    # a half-precision program's echo is the input rounded to its format (or as read)
                    want = echoed(mat, want, self.run.precision, self.run.half_rounding)
                quantum = resolution.quantum(mat)
                allowed = np.zeros(mat.shape) if quantum is None else quantum
                rule = ("is not the input's: no query reads it, but its {stage} is still " +
                        (f"{st.meaning}, as read" if st.inputs else "the input as read"))
                if paged:
                    rule = "is not the input's: {stage} is " + (f"{st.meaning}, as read" if st.inputs else
                                                                 "the input as read") + ", over the whole pool"
            res.resolution = resolution.describe()
            mask = np.broadcast_to(unread, mat.shape)
            comparison = compare_arrays(np.where(mask, mat, 0.0), np.where(mask, want, 0.0),
                                        np.where(mask, allowed, 0.0))
            comparison.total = int(mask.sum())
            res.chained = res.isolated = comparison
            if not comparison.passed:
                row = comparison.worst[1] if st.cols == "M" else comparison.worst[0]
                res.status = FAIL
                if paged:
                    P = self.seqs.page_size
                    res.message = f"pool row {row} (page {row // P}, slot {row % P}) " + rule.format(stage=stage)
                else:
                    res.message = f"packed key row {row} ({self._why_unread(row)}) " + rule.format(stage=stage)
                    res.diagnosis.append(Diagnosis(UNREAD_KEY_ROW, res.message,
                                                   {"row": row, "sequence": self.seqs.sequence_of_key(row)}))
            out.append(res)
        return out

    # ---- what a job holds -----------------------------------------------------------------------

    def sizing_run(self) -> RunInfo:
        """The run as the memory plan sees one job: its largest sequence's scores (one at a time)."""
        seqs = self.seqs
        n = max((seqs.n(b) for b in range(seqs.count)), default=0)
        m = max((seqs.m(b) for b in range(seqs.count)), default=0)
        return replace(self.run, dims=replace(self.run.dims, seq_q=max(n, 1), seq_k=max(m, 1)))

    def held_bytes(self) -> int:
        """The packed matrices a job holds: every stage and input of its heads, float64."""
        d = self.run.dims
        per_head = sum(STAGES[s].shape(d)[0] * STAGES[s].shape(d)[1] for s in self.run.stages
                       if not per_sequence(s))
        per_head += (d.seq_q * (d.d_k + d.d_v) + d.seq_k * (d.d_k + d.d_v))
        return 8 * per_head * (d.group_size + 1)
