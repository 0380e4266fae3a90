"""Reports of a check: the terminal table, JSON, JUnit XML and error heat maps."""
from __future__ import annotations

import io
import json
import math
import os
import re
import stat
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import List, Optional

import numpy as np

from . import flash_attn_criterion, program_checks
from . import report_states as states
from .case import CaseError, atomic_write_bytes, file_kind, probe_writable
from .results import FAIL, FLASH_ATTN_KEY, INHERITED, PASS, Comparison, HeadResult, Report
from .resolution import EXACT
from .stages import STAGES, stage_file
from .words import number as _g
from .words import number_pair, plural, printable

MAX_DETAILED_FAILURES = 8


def stage_status(results: List[HeadResult]) -> str:
    statuses = {r.status for r in results}
    if statuses == {PASS}:
        return PASS
    own = statuses - {PASS, INHERITED}
    return sorted(own)[0] if own else INHERITED


def _worst(results: List[HeadResult]) -> Optional[HeadResult]:
    scored = [r for r in results if r.main is not None]
    return max(scored, key=lambda r: r.main.tol_used) if scored else (results[0] if results else None)


def _location(r: HeadResult, c: Comparison) -> str:
    if c.worst is None or c.max_abs == 0:
        return "-"
    return f"b{r.batch} h{r.head_in_batch} [{c.worst[0]},{c.worst[1]}]"


def arithmetic(run) -> str:
    """What the bounds assume, in words: the precision and whose arithmetic."""
    who = {None: "any IEEE float32 program"}.get(run.backend, f"attnstep's {run.backend} backend")
    return f"{_precision_words(run)}, {who}" + (", fast-math intrinsics" if run.math == "fast" else "")


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
    return [f"attnstep check: {what} ({arithmetic(run)}"
            f"{', ' + run.device if run.device else ''}), "
            f"{plural(d.total_heads, 'head')} (batch {d.batch} x {d.heads}), N={d.seq_q} M={d.seq_k} "
            f"d_k={d.d_k} d_v={d.d_v}, {'causal' if run.causal else 'not causal'}, "
            f"scale {run.scale:.6g}" + (f", flash kernel {printable(run.flash_kernel)}" if run.flash_kernel else "")]


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
            groups = [(f"{stage}[{r.head}]", [r]) for r in res]
        for label, rs in groups:
            w = _worst(rs)
            c = w.main if w else None
            ok = sum(r.passed for r in rs)
            mism = sum((r.main.mismatched if r.main else 0) for r in rs)
            total = sum((r.main.total if r.main else 0) for r in rs)
            rows.append((label, f"{ok}/{len(rs)}", stage_status(rs),
                         _g(c.max_abs) if c else "-", _g(c.max_rel) if c else "-",
                         f"{mism}/{total}", _g(c.tol_used) if c else "-",
                         _location(w, c) if c else "-",
                         _g(c.got) if c and not c.passed else "", _g(c.want) if c and not c.passed else "")
                        + ((_resolution(rs),) if printed else ()))
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*cols), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows]


def _resolution(results: List[HeadResult]) -> str:
    """The printed resolutions of a stage's files (one, or each that occurs)."""
    seen = sorted({r.resolution for r in results})
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
    for r, heads in groups[:MAX_DETAILED_FAILURES]:
        where = states.where(r, heads, report)
        c = r.main
        if r.status != FAIL or c is None:
            lines.append(f"{r.status} {where}: {r.message}")
        else:
            kind = "isolated" if c is r.isolated else "chained"
            got, want = number_pair(c.got, c.want)
            lines.append(
                f"FAIL {where}: {c.mismatched}/{c.total} elements outside the tolerance ({kind}); "
                f"worst at [{c.worst[0]},{c.worst[1]}]: got {got}, want {want}, "
                f"|diff| {_g(_diff(c))} > allowed {_g(c.allowed)} (rel {_g(_rel(c))})")
            if c.first:
                lines.append("    first mismatches: " + "; ".join(
                    "[{},{}] got {} want {}".format(m["row"], m["col"], *number_pair(m["got"], m["want"]))
                    for m in c.first))
        for d in r.diagnosis:
            lines.append(f"    diagnosis {d.code}: {d.message}")
    if len(groups) > MAX_DETAILED_FAILURES:
        more = sum(len(heads) for _, heads in groups[MAX_DETAILED_FAILURES:])
        lines.append(f"... and {more} more failing stage x head pairs (--json has them all)")
    return lines


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
        res = _resolution([r for r in report.results if r.stage in limited])
        out.append(f"{', '.join(limited)}: recorded at {res}; the file's resolution, not float32 "
                   "arithmetic, limits what can be checked there; write %.9g text or float32 .npy to "
                   "check at float32 precision")
    return out


def summary_lines(report: Report) -> List[str]:
    lines = [f"note: {n}" for n in notes(report)] + program_checks.text_lines(report.program_checks)
    first, verdict = states.culprit(report), f"FAIL ({bounds_words(report.run)}):"
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
        n, h = len(report.stages), report.run.dims.total_heads
        lines.append(f"PASS ({bounds_words(report.run)}): all {plural(n, 'stage')} x {plural(h, 'head')}; "
                     f"largest fraction of tolerance used {_g(used)} (headroom {_g(max(0.0, 1 - used))})")
        return lines
    inherited = [s for s in report.stages
                 if stage_status(report.stage_results(s)) == INHERITED]
    half = states.half_hint(report)
    lines.append(f"{verdict} first failing stage: {first.stage} "
                 f"({states.culprit_heads(report, first)})"
                 + (f"; {first.diagnosis[0].code}: {first.diagnosis[0].message}" if first.diagnosis else "")
                 + (f"; {half}" if half else ""))
    if inherited:
        lines.append(f"      inherited downstream (pass in isolation): {', '.join(inherited)}")
    return lines


def jsonable(x):
    """x with its non-finite floats as strings ("inf", "nan"): JSON has no Infinity or NaN."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if hasattr(x, "item"):
        return jsonable(x.item())
    return x


def to_json(report: Report) -> dict:
    run, d = report.run, report.run.dims
    first = report.first_failure
    stages = []
    for stage in report.stages:
        rs = report.stage_results(stage)
        w = _worst(rs)
        stages.append({"stage": stage, "status": stage_status(rs), "passed": all(r.passed for r in rs),
                       "heads_passed": sum(r.passed for r in rs), "heads": len(rs),
                       "tol_used": w.main.tol_used if w and w.main else None,
                       "max_abs": w.main.max_abs if w and w.main else None,
                       "worst_head": w.head if w else None, "resolution": _resolution(rs),
                       "print_limited": any(r.print_limited for r in rs),
                       "source": run.sources[stage].describe()})
    return jsonable({
        "passed": report.passed, "first_failing_stage": report.first_failing_stage,
        "first_failure": first.to_json() if first else None,
        "run_id": run.run_id, "backend": run.backend, "device": run.device,
        "precision": run.precision, "math": run.math, "arithmetic": arithmetic(run),
        "causal": run.causal, "scale": run.scale,
        "mismatches": [m.message() for m in run.mismatches], "notes": notes(report),
        "dims": {k: getattr(d, k) for k in ("batch", "heads", "seq_q", "seq_k", "d_k", "d_v")},
        FLASH_ATTN_KEY: flash_attn_criterion.json_block(report),
        "stages": stages, "results": [r.to_json() for r in report.results],
        "foreign_files": report.foreign_files, "timings_ms": report.run.timings(),
        "program_checks": program_checks.json_block(report.program_checks)})


def write_json(report: Report, path: Path) -> None:
    atomic_write_bytes(Path(path), (json.dumps(to_json(report), indent=2) + "\n").encode())


# Characters XML 1.0 cannot carry, not even as character references (a message may quote a file
# name with control characters or undecodable bytes): written as Python escapes instead.
_NOT_XML = re.compile("[^\u0009\u000a\u000d\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _xml_text(text: str) -> str:
    return _NOT_XML.sub(lambda m: m.group().encode("unicode_escape", "backslashreplace").decode(), text)


def _junit_failure(r: HeadResult) -> ET.Element:
    c = r.main
    msg = r.message or (f"{c.mismatched}/{c.total} elements outside the tolerance; worst "
                        f"got {_g(c.got)} want {_g(c.want)}" if c else r.status)
    failure = ET.Element("failure", type=_xml_text(r.status), message=_xml_text(msg))
    failure.text = _xml_text("\n".join([msg] + [f"{d.code}: {d.message}" for d in r.diagnosis]))
    return failure


def write_junit(report: Report, path: Path) -> None:
    """One testcase per stage and head; a failing one carries its message and diagnosis."""
    root = ET.Element("testsuites")
    checks = report.program_checks
    suite = ET.SubElement(root, "testsuite", name="attnstep", tests=str(len(report.results) + len(checks)),
                          failures=str(sum(not r.passed for r in report.results) + sum(not c.passed for c in checks)),
                          errors="0")
    suite_props = ET.SubElement(suite, "properties")  # what the bounds assume: a CI job sees a loosened check
    for name, value in (("precision", report.run.precision), ("math", report.run.math),
                        ("arithmetic", arithmetic(report.run)), *flash_attn_criterion.junit_properties(report)):
        ET.SubElement(suite_props, "property", name=name, value=_xml_text(str(value)))
    for name, failure in program_checks.junit_cases(report.program_checks):
        case = ET.SubElement(suite, "testcase", classname="attnstep.program", name=name)
        if failure:
            ET.SubElement(case, "failure", type=name, message=_xml_text(failure)).text = _xml_text(failure)
    for r in report.results:
        case = ET.SubElement(suite, "testcase", classname=f"attnstep.{r.stage}", name=f"head_{r.head}")
        props = ET.SubElement(case, "properties")
        ET.SubElement(props, "property", name="resolution", value=_xml_text(r.resolution))
        if not r.passed:
            case.append(_junit_failure(r))
    ET.indent(root)
    buf = io.BytesIO()
    ET.ElementTree(root).write(buf, encoding="UTF-8", xml_declaration=True)
    atomic_write_bytes(Path(path), buf.getvalue() + b"\n")


def check_plot_folder(folder: Path) -> None:
    """The plot folder is a folder, or nothing yet (it is created): anything else is refused, and
    so is a place no file can be written (the maps come after the whole check)."""
    folder = Path(folder)
    try:
        st = os.stat(folder)
    except FileNotFoundError:
        parent = next((p for p in folder.absolute().parents if p.exists()), None)
        if parent is None or not parent.is_dir():
            raise CaseError(f"{folder}: cannot create the plot folder under {parent}") from None
        probe_writable(parent, folder)
        return
    except OSError as exc:
        raise CaseError(f"{folder}: cannot use as the plot folder: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise CaseError(f"{folder}: is {file_kind(st.st_mode)}, not a folder for the plots")
    probe_writable(folder, folder)


# What a tile of a stage's rows or columns is, by the stage table's dimension symbol: the
# columns of QK, QK_scaled and attention_weights are keys, those of output are value columns.
_TILE_NAMES = {"N": "query tile", "M": "key tile", "DK": "{axis} tile", "DV": "{axis} tile", "1": None}


def tile_axis_name(stage: str, axis: str) -> Optional[str]:
    """The label of the tile grid's `axis` ("row" or "column") for `stage`; None for a one-wide axis."""
    sym = getattr(STAGES[stage], "rows" if axis == "row" else "cols")
    name = _TILE_NAMES[sym]
    return name.format(axis=axis) if name else None


def _tile_grid(shown: np.ndarray, br: int, bc: int) -> np.ndarray:
    """The maximum of `shown` over each br x bc tile."""
    tr, tc = -(-shown.shape[0] // br), -(-shown.shape[1] // bc)
    grid = np.zeros((tr, tc))
    for i in range(tr):
        for j in range(tc):
            grid[i, j] = shown[i * br:(i + 1) * br, j * bc:(j + 1) * bc].max()
    return grid


def error_figure(stage: str, head: int, ratio: np.ndarray, tiles):
    """The figure of one stage x head: log10(|error| / allowed) per element, and its maximum per
    tile (`tiles` = (rows, cols) of a tile), with integer ticks and axes named after what they hold."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    br, bc = tiles
    shown = np.log10(np.clip(np.where(np.isfinite(ratio), ratio, 1e6), 1e-3, 1e6))
    row_name, col_name = tile_axis_name(stage, "row"), tile_axis_name(stage, "column")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    im = axes[0].imshow(shown, aspect="auto", cmap="magma", vmin=-3, vmax=6, interpolation="nearest")
    axes[0].set_title(f"{stage} head {head}: log10(|err| / allowed)")
    axes[0].set_xlabel("column")
    axes[0].set_ylabel("row")
    fig.colorbar(im, ax=axes[0])
    im2 = axes[1].imshow(_tile_grid(shown, br, bc), aspect="auto", cmap="magma", vmin=-3, vmax=6,
                         interpolation="nearest")
    axes[1].set_title(f"max per {br}x{bc} tile" if col_name else f"max per {plural(br, 'row')}")
    axes[1].set_ylabel(row_name or "")
    axes[1].set_xlabel(col_name or "")
    for ax in axes:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    if col_name is None:
        axes[1].set_xticks([])
    fig.colorbar(im2, ax=axes[1])
    fig.tight_layout()
    return fig


def write_plots(report: Report, folder: Path, error_map) -> List[Path]:
    """One PNG per failing stage × head: |error| / allowed as a heat map, and its per-tile maximum.
    `error_map(stage, head)` returns that ratio array (compare.error_ratio_map)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CaseError("--plot needs matplotlib: pip install 'attnstep[plot]' (or pip install matplotlib)")
    folder = Path(folder)
    check_plot_folder(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CaseError(f"{folder}: cannot create the plot folder: {exc.strerror or exc}") from None
    tiles = report.run.flash_tiles or (64, 64)
    written = []
    for r in report.results:
        if r.status != FAIL and r.status != INHERITED:
            continue
        fig = error_figure(r.stage, r.head, error_map(r.stage, r.head), tiles)
        path = folder / stage_file(r.stage, r.head, "png")
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=90)
        plt.close(fig)
        atomic_write_bytes(path, png.getvalue(), through_links=False)  # a link planted there is replaced, not followed
        written.append(path)
    return written
