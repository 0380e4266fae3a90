"""The text report's account of states that span many results, each told once instead of per
stage × head: files written over an earlier run (their CRC-32 no longer matches run.toml), a
failure that several heads share, stages that cannot be checked for want of what they are
checked against (the program's dropout keep-mask), and stages holding half-precision values
checked at a float32 precision. The JSON and JUnit reports keep one entry per stage × head. A
stage of a grouped case's K/V heads (HeadResult.kv) is told by its K/V heads."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from ..check.results import FAIL, INHERITED, MISSING, PASS, STALE, UNCHECKABLE, HeadResult, Report, result_order
from ..files.resolution import HALF
from ..stages import RUN_MANIFEST, STAGES
from ..text import plural

# Stale files from this many on: files written over an earlier run, told in one line. A single
# stale file keeps its own message (a file from an earlier run, or edited since).
OVERWRITTEN_FROM = 2

# What the report calls each half-precision format (NumPy's and PyTorch's names for it).
FORMAT_WORDS = {"bf16": "bfloat16", "fp16": "float16"}


# ---- files written over an earlier run ----------------------------------------------------------

def stale_results(report: Report) -> List[HeadResult]:
    return [r for r in report.results if r.status == STALE]


def overwritten(report: Report) -> bool:
    """Whether several files no longer match run.toml's CRC-32 (told in one line, not per file)."""
    return len(stale_results(report)) >= OVERWRITTEN_FROM


def overwritten_line(report: Report) -> str:
    """The likely cause of many stale files, and the fix."""
    folder = report.run.path
    files = sum(r.status != MISSING for r in report.results)
    return (f"{len(stale_results(report))} of {files} files differ from {RUN_MANIFEST}'s CRC-32: "
            f"files written over an earlier run of attnstep's binary? HINT: remove {folder / RUN_MANIFEST} "
            "(the files are then checked as your program's), or write into a fresh --out")


def culprit(report: Report) -> Optional[HeadResult]:
    """The first failing stage × head the verdict names: a stale file is not blamed as a stage's
    fault when many are (the overwritten line says why they fail)."""
    if not overwritten(report):
        return report.first_failure
    own = [r for r in report.results if r.status not in (PASS, INHERITED, STALE)]
    return min(own, key=result_order) if own else None


# ---- one failure shared by several heads --------------------------------------------------------

def _pattern(r: HeadResult) -> Tuple:
    """What makes two heads' failures of one stage the same: status, which comparison failed, and
    the diagnosis codes (the numbers and places differ from head to head)."""
    kind = "isolated" if r.main is not None and r.main is r.isolated else "chained"
    return r.stage, r.status, kind, tuple(d.code for d in r.diagnosis)


def failure_groups(report: Report) -> List[Tuple[HeadResult, List[HeadResult]]]:
    """The stage × head results that fail on their own, as (the first head's result, every result
    failing alike): a FAIL that several heads (in a packed case, heads and sequences) share is one
    group. Stale files are left out when many are (the overwritten line covers them), and the
    stages that cannot be checked (unchecked_line covers them); other statuses name a file each,
    one per group (a packed file's every sequence one)."""
    groups: Dict[Tuple, List[HeadResult]] = {}
    for r in report.results:
        if r.status in (PASS, INHERITED, UNCHECKABLE) or (r.status == STALE and overwritten(report)):
            continue
        key = _pattern(r) if r.status == FAIL else (r.stage, r.head)
        groups.setdefault(key, []).append(r)
    return [(rs[0], rs) for rs in groups.values()]


def head_ranges(heads: Sequence[int]) -> str:
    """Head numbers as ranges: "0-3, 7"."""
    ranges, start = [], heads[0]
    for prev, h in zip(heads, list(heads[1:]) + [None]):
        if h != prev + 1:
            ranges.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = h
    return ", ".join(ranges)


def heads_words(heads: Sequence[int], total: int, noun: str = "head") -> str:
    """"all 12 heads", or the heads as ranges: "heads 0-3, 7" (noun: "K/V head" for a stage of
    the K/V heads)."""
    if len(heads) == total:
        return f"both {noun}s" if total == 2 else f"all {plural(total, noun)}"
    return f"{noun} {heads[0]}" if len(heads) == 1 else f"{noun}s {head_ranges(heads)}"


def noun(r: HeadResult) -> str:
    """What the result's head numbers: a query head, or a K/V head."""
    return "K/V head" if r.kv else "head"


def serves(r: HeadResult) -> str:
    """The query heads a K/V head's result serves, in words ("" for a query head's)."""
    if not r.kv:
        return ""
    return f"; query head{'s' if len(r.query_heads) > 1 else ''} {head_ranges(list(r.query_heads))}"


def one_head(r: HeadResult) -> str:
    """"head 4 (batch 0, head 4)", or "K/V head 1 (batch 0, K/V head 1; query heads 3-5)"; in a
    packed case "head 3, sequence 2 (token 17, packed row 245)"."""
    if r.packed:
        return packed_place(r)
    return f"{noun(r)} {r.head} (batch {r.batch}, {noun(r)} {r.head_in_batch}{serves(r)}){split_place(r)}"


def split_place(r: HeadResult) -> str:
    """A split stage's failing split and row in words (", split 2 (row 5)"; "" for another stage or
    a pass)."""
    c = r.main
    if not r.split_cols or c is None or c.worst is None or c.passed:
        return ""
    return f", split {r.split} (row {c.worst[0]})"


def packed_place(r: HeadResult) -> str:
    """A packed case's result in words: its head, its sequence and where in it the worst element
    is, by the sequence's own numbering and the packed files' ("head 3, sequence 2 (token 17,
    packed row 245)"); for the key rows no query reads, the packed row."""
    head = f"{noun(r)} {r.head}" + (f" (query head{'s' if len(r.query_heads) > 1 else ''} "
                                    f"{head_ranges(list(r.query_heads))})" if r.kv else "")
    c = r.main
    at = c.worst if c is not None and c.total and not c.passed else None
    if r.padding_rows:
        # KT holds the keys as its columns
        key = None if at is None else at[1] if STAGES[r.stage].cols == "M" else at[0]
        return f"{head}, key rows no query reads" + (f": packed row {key}" if at else "")
    if at is None and c is not None and c.total:
        at = c.worst
    where = ""
    if at is not None and r.split_cols:
        split = r.split_position(at[1])[0]
        row = r.packed_position(*at)[0]
        where = f", split {split} (token {at[0]}, packed row {row})"
        return f"{head}, sequence {r.sequence}{where}"
    if at is not None:
        row, col = r.packed_position(*at)
        st = STAGES[r.stage]
        if st.rows in _ROW_WORDS:
            where = f" ({_ROW_WORDS[st.rows]} {at[0]}, packed row {row})"
        elif st.cols in _ROW_WORDS:
            where = f" ({_ROW_WORDS[st.cols]} {at[1]}, packed column {col})"
    return f"{head}, sequence {r.sequence}{where}"


# What a row (or a column) of a packed stage is, by the stage table's dimension symbol.
_ROW_WORDS = {"N": "token", "M": "key"}


def _sequences_words(rs: Sequence[HeadResult]) -> str:
    seqs = sorted({r.sequence for r in rs if r.sequence is not None})
    if not seqs:
        return "key rows no query reads"
    return f"sequence{'s' if len(seqs) > 1 else ''} {head_ranges(seqs)}"


def _heads_of_stage(report: Report, stage: str) -> int:
    return len({r.head for r in report.stage_results(stage)})


def where(r: HeadResult, rs: Sequence[HeadResult], report: Report) -> str:
    """A failure block's subject: one head, or the heads that fail alike (the first one shown)."""
    if len(rs) == 1:
        return f"{r.stage} {one_head(r)}"
    return f"{r.stage}, {alike_words(rs, report)} alike; {one_head(r)} shown"


def alike_words(rs: Sequence[HeadResult], report: Report) -> str:
    """The heads (and in a packed case the sequences) of results that fail alike. Where those are
    not every pairing of their heads and sequences, the sequences that share their heads are named
    together ("heads 0, 2, sequence 1; all 8 heads, sequences 2-3"): no pair is claimed that is not
    in the block."""
    r = rs[0]
    total = _heads_of_stage(report, r.stage)
    if not r.packed:
        return heads_words(sorted({x.head for x in rs}), total, noun(r))
    by_sequence: Dict[Optional[int], set] = {}
    for x in rs:
        by_sequence.setdefault(x.sequence, set()).add(x.head)
    shared: Dict[Tuple[int, ...], List[HeadResult]] = {}
    for seq, heads in by_sequence.items():
        shared.setdefault(tuple(sorted(heads)), []).extend(x for x in rs if x.sequence == seq)
    return "; ".join(f"{heads_words(list(heads), total, noun(r))}, {_sequences_words(group)}"
                     for heads, group in sorted(shared.items(), key=lambda kv: min(x.head for x in kv[1])))


def culprit_heads(report: Report, first: HeadResult) -> str:
    """The verdict's words for the culprit's head, or for every head that fails alike with it."""
    for r, rs in failure_groups(report):
        if r is first and len(rs) > 1:
            return alike_words(rs, report)
    if first.packed:
        return packed_place(first)
    return f"{noun(first)} {first.head}: batch {first.batch}, {noun(first)} {first.head_in_batch}{serves(first)}"


# ---- a cause named on a later stage ---------------------------------------------------------------

# Codes that say where a stage is wrong or which invariant it breaks, not why: no cause to lend.
_NOT_CAUSES = {"nonfinite", "unwritten", "tile_boundary", "negative_weights", "row_sum", "not_transpose",
               "echo_mismatch", "flash_vs_output", "lse_vs_scores", "column_sum", "flash_vs_stages"}


def names_no_cause(r: HeadResult) -> bool:
    """Whether r's findings say only where it is wrong or which check it breaks (none a cause)."""
    return all(d.code in _NOT_CAUSES for d in r.diagnosis)


def cause_elsewhere(report: Report, first: HeadResult) -> Optional[HeadResult]:
    """Where the first failing stage names no cause (no finding, or only where it is wrong): the
    first later failing stage of the same head (and sequence, in a packed case) that does (a bug
    moves a float32 lse by many of its widths where a bf16 output's own rounding hides it among
    its widths); in a packed case without one, the first failing stage of another sequence of the
    head that does (a paging bug that shows plainest in another sequence: a page index past the
    pool in one, a page of another in the next). None where nothing of the head names a cause."""
    if any(d.code not in _NOT_CAUSES for d in first.diagnosis):
        return None

    def same_head(r: HeadResult) -> bool:  # (a K/V head's stage, dK or dV, serves its group's query heads)
        if r.kv and not first.kv:
            return report.run.dims.kv_head_of(first.head) == r.head
        return (r.head, r.kv) == (first.head, first.kv)

    def names_a_cause(r: HeadResult) -> bool:
        return (r.status == FAIL and same_head(r) and bool(r.diagnosis)
                and r.diagnosis[0].code not in _NOT_CAUSES)

    same = [r for r in report.results if names_a_cause(r) and r.sequence == first.sequence and r.stage != first.stage]
    if same or first.sequence is None:
        return min(same, key=result_order) if same else None
    other = [r for r in report.results if names_a_cause(r) and r.sequence is not None]
    return min(other, key=result_order) if other else None


def where_else(first: HeadResult, elsewhere: HeadResult) -> str:
    """Where cause_elsewhere found its cause, as the verdict says it: another stage of the head, or
    another sequence (whose cause may be its own: said as that sequence's)."""
    if elsewhere.sequence is not None and elsewhere.sequence != first.sequence:
        return f"sequence {elsewhere.sequence} of the same head fails at {elsewhere.stage} with"
    if elsewhere.kv and not first.kv:
        return f"{elsewhere.stage}, failing on its K/V head {elsewhere.head}, names"
    return f"{elsewhere.stage}, failing on the same head, names"


# ---- stages that cannot be checked ---------------------------------------------------------------

def unchecked(report: Report) -> List[HeadResult]:
    return [r for r in report.results if r.status == UNCHECKABLE]


def unchecked_stages(report: Report) -> str:
    """The stages that cannot be checked, and on which heads ("output, dS (all 6 heads)")."""
    rs = unchecked(report)
    stages = [s for s in report.stages if any(r.stage == s for r in rs)]
    query = sorted({r.head for r in rs if not r.kv})
    on = heads_words(query, report.run.dims.total_heads) if query else \
        heads_words(sorted({r.head for r in rs}), report.run.dims.total_kv_heads, "K/V head")
    return f"{', '.join(stages)} ({on})"


def unchecked_line(report: Report) -> Optional[str]:
    """One line for every stage × head that cannot be checked (their reason is one: the first)."""
    rs = unchecked(report)
    return f"UNCHECKABLE {unchecked_stages(report)}: {rs[0].message}" if rs else None


# ---- half-precision values checked at a float32 precision ---------------------------------------

def _half_stages(report: Report) -> Dict[str, List[str]]:
    """{format: the stages whose every head holds its values}, in stage order."""
    out: Dict[str, List[str]] = {}
    for stage in report.stages:
        formats = {r.half_values for r in report.stage_results(stage)}
        if len(formats) == 1 and None not in formats:
            out.setdefault(formats.pop(), []).append(stage)
    return out


def half_stages(report: Report) -> List[str]:
    return [s for stages in _half_stages(report).values() for s in stages]


def _fix(report: Report, fmt: str) -> str:
    """How to check it at the format: the Python API's argument, or the command line's option."""
    return f"pass precision='{fmt}'" if report.run.path is None else f"check with --precision {fmt}"


def half_notes(report: Report) -> List[str]:
    """Why a stage of half-precision values passes or fails at a float32 precision. A float16 file
    or array is read as float32 results stored in float16: half a float16 unit is allowed per value
    as the storage's resolution (as coarse printing is), the arithmetic before it is held to the
    float32 bounds. A float32 array of bfloat16 values has no such resolution: its rounding to
    bfloat16 is an error at float32."""
    out = []
    for fmt, stages in _half_stages(report).items():
        stored = all(r.resolution == HALF.describe() for s in stages for r in report.stage_results(s))
        why = ("checked as float32 arithmetic stored in float16 (half a float16 unit allowed per value, as "
               "the storage's resolution; store float32 to check at float32 precision), not as a "
               "half-precision program's arithmetic" if stored else
               f"each value is exactly a {FORMAT_WORDS[fmt]} though the exact results are not; checked at "
               f"{report.run.precision}, where that rounding is an error")
        out.append(f"{', '.join(stages)} {'holds' if len(stages) == 1 else 'hold'} {FORMAT_WORDS[fmt]} "
                   f"values: {why}; a half-precision program? {_fix(report, fmt)}")
    return out


def half_hint(report: Report) -> Optional[str]:
    """The failure line's words on half-precision values, or None."""
    for fmt, stages in _half_stages(report).items():
        return f"{stages[0]} holds {FORMAT_WORDS[fmt]} values: a half-precision program? {_fix(report, fmt)}"
    return None
