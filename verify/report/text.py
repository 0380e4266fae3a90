"""A check's report on the terminal: the header, the stage table, the failures and the summary."""
from __future__ import annotations

import math
from typing import List, Optional

from ..check.results import FAIL, INHERITED, PASS, UNCHECKABLE, Comparison, HeadResult, Report
from ..files.resolution import EXACT
from ..runs import program_checks
from ..stages import HALF_PRECISIONS
from ..text import number as _g
from ..text import number_pair, plural, printable
from ..variant import NONE, TOP_LEFT, Variant
from . import states

MAX_DETAILED_FAILURES = 8


def stage_status(results: List[HeadResult]) -> str:
    statuses = {r.status for r in results}
    if statuses == {PASS}:
        return PASS
    own = statuses - {PASS, INHERITED}
    return sorted(own)[0] if own else INHERITED


def worst_result(results: List[HeadResult]) -> Optional[HeadResult]:
    scored = [r for r in results if r.main is not None]
    return max(scored, key=lambda r: r.main.tol_used) if scored else (results[0] if results else None)


def _location(r: HeadResult, c: Comparison) -> str:
    if c.worst is None or c.max_abs == 0:
        return "-"
    at = _at(r, *c.worst)
    if r.packed:  # the sequence's own row and column (the failure lines add the packed row)
        seq = "pad" if r.sequence is None else f"s{r.sequence}"
        return f"{'kv' if r.kv else 'h'}{r.head} {seq} {at}"
    return f"b{r.batch} {'kv' if r.kv else 'h'}{r.head_in_batch} {at}"


def _at(r: HeadResult, row: int, col: int) -> str:
    """An element's place: [row,col], or for a split stage its split and [row,col] within it."""
    if r.split_cols:
        split, col = r.split_position(col)
        return f"split {split} [{row},{col}]"
    return f"[{row},{col}]"


def arithmetic(run) -> str:
    """What the bounds assume, in words: the precision and whose arithmetic."""
    who = f"attnstep's {run.backend} backend" if run.backend is not None else _any_program(run.precision)
    return f"{_precision_words(run)}, {who}" + (", fast-math intrinsics" if run.math == "fast" else "")


def _any_program(precision: str) -> str:
    """Whose arithmetic the bounds of another program's run assume."""
    if precision in HALF_PRECISIONS:
        return f"any program storing {precision}, accumulating in IEEE float32"
    return "any program, its GEMMs on TF32 tensor cores" if precision == "tf32" else "any IEEE float32 program"


def bounds_words(run) -> str:
    """The verdict's qualifier: the precision the bounds assume (a looser claim shows in every verdict)."""
    return f"bounds for {_precision_words(run)}" + (", fast-math intrinsics" if run.math == "fast" else "")


def _precision_words(run) -> str:
    """The precision, and a conversion that truncates (a looser claim than rounding to nearest)."""
    rounding = getattr(run, "half_rounding", "nearest")
    return run.precision + ("" if rounding == "nearest" else f", {rounding} conversions")


def header_lines(report: Report) -> List[str]:
    run, d = report.run, report.run.dims
    what = f"run {run.run_id}" if run.run_id else str(run.path or "arrays")
    kv = f" sharing {plural(d.total_kv_heads, 'K/V head')} (kv_heads {d.kv})" if d.kv_heads else ""
    seqs = getattr(report.case, "sequences", None)
    if seqs is not None:  # N and M count the packed tokens and keys
        kv += f", {plural(seqs.count, 'packed sequence')} (each checked as a case of its own)"
    return [f"attnstep check: {what} ({arithmetic(run)}"
            f"{', ' + run.device if run.device else ''}), "
            f"{plural(d.total_heads, 'head')} (batch {d.batch} x {d.heads}){kv}, N={d.seq_q} M={d.seq_k} "
            f"d_k={d.d_k} d_v={d.d_v}, {variant_words(run)}, "
            + (f"split-KV in splits of {plural(d.split_size, 'key')}, " if d.split_size else "") +
            f"scale {run.scale:.6g}" + (f", flash kernel {printable(run.flash_kernel)}" if run.flash_kernel else "")]


def variant_words(run) -> str:
    """The variant the run is checked against, in words: "not causal" for textbook attention."""
    v = getattr(run, "variant", None) or Variant(causal=run.causal)
    mask = ("causal" + (f" ({v.align})" if v.align != TOP_LEFT else "")) if v.causal else "not causal"
    words = [mask]
    if v.window != Variant().window:
        words.append(f"window ({v.left}, {v.window[1]})")
    if v.softcap:
        words.append(f"softcap {v.softcap:g}")
    words += ["ALiBi"] * v.alibi + [f"{name} file ({getattr(v, name)})" for name in ("mask", "bias")
                                    if getattr(v, name) != NONE]
    if v.dropout:
        words.append(f"dropout {v.dropout:g}")
    return ", ".join(words)


def table_lines(report: Report, per_head: bool = False) -> List[str]:
    cols = ("stage", "heads ok", "status", "max abs", "max rel", "mismatched", "tol used",
            "worst at", "got", "want")
    printed = any(r.resolution != EXACT.describe() for r in report.results)
    if printed:
        cols += ("resolution",)
    rows = []
    for stage in report.stages:
        res = report.stage_results(stage)
        groups = [(f"{stage}", res)]
        if per_head:
            groups = [(f"{stage}[{r.head}]" + _sequence_label(r), [r]) for r in res]
        for label, rs in groups:
            w = worst_result(rs)
            c = w.main if w else None
            heads = {r.head for r in rs}  # (a packed case's head passes when every sequence of it does)
            ok, count = len(heads - {r.head for r in rs if not r.passed}), len(heads)
            mism = sum((r.main.mismatched if r.main else 0) for r in rs)
            total = sum((r.main.total if r.main else 0) for r in rs)
            rows.append((label, f"{ok}/{count}", stage_status(rs),
                         _g(c.max_abs) if c else "-", _g(c.max_rel) if c else "-",
                         f"{mism}/{total}", _g(c.tol_used) if c else "-",
                         _location(w, c) if c else "-",
                         _g(c.got) if c and not c.passed else "", _g(c.want) if c and not c.passed else "")
                        + ((resolution_words(rs),) if printed else ()))
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*cols), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows]


def _sequence_label(r: HeadResult) -> str:
    """A per-head row's sequence in a packed case ("/s2"; "/pad": the key rows no query reads)."""
    if not r.packed:
        return ""
    return "/pad" if r.sequence is None else f"/s{r.sequence}"


def resolution_words(results: List[HeadResult]) -> str:
    """The printed resolutions of a stage's files (one, or each that occurs), of the files read: a
    missing or unreadable file has none."""
    seen = sorted({r.resolution for r in results if r.isolated is not None or r.chained is not None})
    return ", ".join(seen)


def _diff(c: Comparison) -> float:
    """|got - want| at the comparison's worst element (NaN against a value: inf)."""
    d = abs(c.got - c.want) if not (c.got == c.want) else 0.0
    return math.inf if math.isnan(d) else d


def _rel(c: Comparison) -> float:
    return _diff(c) / abs(c.want) if c.want not in (0.0,) and math.isfinite(c.want) else math.inf


def failure_lines(report: Report) -> List[str]:
    lines = []
    groups = states.failure_groups(report)  # a failure several heads share is one block
    for r, alike in groups[:MAX_DETAILED_FAILURES]:
        where = states.where(r, alike, report)
        c = r.main
        if r.status != FAIL or c is None:
            lines.append(f"{r.status} {where}: {r.message}")
        elif c.mismatched == 0:  # failed by a check of its own (an invariant, another stage it must agree with)
            lines.append(f"FAIL {where}: every element within the tolerance, but a check of the stage fails (below)")
        else:
            kind = "isolated" if c is r.isolated else "chained"
            got, want = number_pair(c.got, c.want)
            lines.append(
                f"FAIL {where}: {c.mismatched}/{c.total} elements outside the tolerance ({kind}); "
                f"worst at {_at(r, *c.worst)}: got {got}, want {want}, "
                f"|diff| {_g(_diff(c))} > allowed {_g(c.allowed)} (rel {_g(_rel(c))})")
            if c.first:
                lines.append("    first mismatches: " + "; ".join(
                    "{} got {} want {}".format(_at(r, m["row"], m["col"]), *number_pair(m["got"], m["want"]))
                    for m in c.first))
        for d in r.diagnosis:
            lines.append(f"    diagnosis {d.code}: {d.message}")
    if len(groups) > MAX_DETAILED_FAILURES:
        more = sum(len(alike) for _, alike in groups[MAX_DETAILED_FAILURES:])
        lines.append(f"... and {more} more failing stage x head pairs (--json has them all)")
    unchecked = states.unchecked_line(report)
    return lines + ([unchecked] if unchecked else [])


def notes(report: Report) -> List[str]:
    """What the reader should know about how the run was checked."""
    out = list(report.run.notes)
    if report.foreign_files:
        whose = f"run {report.run.run_id}" if report.run.run_id else "the stages run.toml lists"
        out.append(f"{plural(len(report.foreign_files), 'stage file')} in {report.run.path} "
                   f"{'is' if len(report.foreign_files) == 1 else 'are'} not from {whose} and "
                   f"{'was' if len(report.foreign_files) == 1 else 'were'} ignored (e.g. {report.foreign_files[0]})")
    out += states.half_notes(report)  # (says what the float16 storage's resolution allows)
    limited = [s for s in report.stages if any(r.print_limited for r in report.stage_results(s))
               and s not in states.half_stages(report)]
    if limited:
        res = resolution_words([r for r in report.results if r.stage in limited])
        out.append(f"{', '.join(limited)}: recorded at {res}; the file's resolution, not float32 "
                   "arithmetic, limits what can be checked there; write %.9g text or float32 .npy to "
                   "check at float32 precision")
    return out


def run_check_lines(report: Report) -> List[str]:
    """The run-level checks (dropout's keep rate, the cache after a decode step), one line each,
    passed or not, and the named ways a failing one went wrong."""
    out = []
    for c in report.run_checks:
        out.append(f"{'PASS' if c.passed else 'FAIL'} {c.stage} {c.title}: {c.message}")
        out += [f"    diagnosis {d['code']}: {d['message']}" for d in _run_check_causes(c)]
    return out


def _run_check_causes(check) -> List[dict]:
    return [] if check.passed else list(check.detail.get("diagnosis", []))


def summary_lines(report: Report) -> List[str]:
    lines = [f"note: {n}" for n in notes(report)] + program_checks.text_lines(report.program_checks) \
        + run_check_lines(report)
    first, verdict = states.culprit(report), f"FAIL ({bounds_words(report.run)}):"
    failed_run = [c for c in report.run_checks if not c.passed]
    if failed_run and (first is None or report.first_failing_stage != first.stage):
        c = failed_run[0]
        cause = next((f"; {d['code']}: {d['message']}" for d in _run_check_causes(c)), "")
        lines.append(f"{verdict} first failing stage: {c.stage} ({c.title}, over the whole run): {c.message}{cause}")
        return lines
    if first is not None and first.status == UNCHECKABLE:
        lines.append(f"{verdict} {states.unchecked_stages(report)} {first.message}")
        return lines
    if states.overwritten(report):  # one line for the files, not a stage blamed for them
        lines.append(f"{verdict} {states.overwritten_line(report)}")
        if first is None:
            return lines
        verdict = "      and among the files that match it:"
    failed_checks = [c for c in report.program_checks if not c.passed]
    if first is None and failed_checks:
        lines.append(f"FAIL: every stage passes its bounds ({bounds_words(report.run)}), but "
                     + "; ".join(c.line() for c in failed_checks))
        return lines
    if first is None:
        used = max((r.main.tol_used for r in report.results if r.main), default=0.0)
        n, d = len(report.stages), report.run.dims
        kv = f" ({plural(d.total_kv_heads, 'K/V head')})" if d.kv_heads else ""
        lines.append(f"PASS ({bounds_words(report.run)}): all {plural(n, 'stage')} x "
                     f"{plural(d.total_heads, 'head')}{kv}; "
                     f"largest fraction of tolerance used {_g(used)} (headroom {_g(max(0.0, 1 - used))})")
        return lines
    inherited = [s for s in report.stages
                 if stage_status(report.stage_results(s)) == INHERITED]
    half = states.half_hint(report)
    elsewhere = states.cause_elsewhere(report, first)
    lines.append(f"{verdict} first failing stage: {first.stage} "
                 f"({states.culprit_heads(report, first)})"
                 + (f"; {first.diagnosis[0].code}: {first.diagnosis[0].message}" if first.diagnosis else "")
                 + (" (a symptom: no cause named)" if first.diagnosis and states.names_no_cause(first)
                    and not elsewhere else "")
                 + (f"; unnamed there; {states.where_else(first, elsewhere)} "
                    f"{elsewhere.diagnosis[0].code}: {elsewhere.diagnosis[0].message}" if elsewhere else "")
                 + (f"; {half}" if half else ""))
    if inherited:
        lines.append(f"      inherited downstream (pass in isolation): {', '.join(inherited)}")
    return lines
