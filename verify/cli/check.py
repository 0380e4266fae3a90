"""`attnstep check`: every stage of a run against its float64 reference, reported on the terminal
and, when asked, as JSON, JUnit XML and error heat maps."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, Tuple

import click

from ..check import flash_attn_criterion
from ..check.cluster import LOCAL, heads_on_cluster
from ..check.compare import Options, check_run, error_ratio_map
from ..check.sizing import MAX_MEMORY_MB
from ..diagnose.hypotheses import diagnose
from ..files.case import check_scale, load_input_case
from ..files.kinds import CaseError
from ..files.guards import check_folders_apart, check_reports_apart
from ..files.outputs import HALF_ROUNDINGS, MATH_MODES, open_run
from ..model.arrays import DEVICES, DeviceError, resolve_device
from ..report.heatmaps import check_plot_folder, write_plots
from ..report.json_file import write_json
from ..report.junit import write_junit
from ..report.text import failure_lines, header_lines, summary_lines, table_lines
from ..sequences import MAX_TOKENS
from ..stages import PRECISIONS, STAGE_NAMES
from ..terminal import progress_bar
from ..text import plural
from .options import (GivenPath, align_option, causal_option, checked_path, dropout_option, in_option, json_option,
                      name_options, no_causal_option, out_option, parse_names, quiet_option, report_file, said_variant,
                      softcap_option, user_errors, window_option)

# Work (N·M·heads) above which `check` shows a progress bar (on a terminal only).
PROGRESS_MIN_WORK = 1 << 24
TOLERANCES_DOC = "docs/tolerances.md"
CLI_DOC = "docs/cli.md"


class Tolerance(click.ParamType):
    """A finite number >= 0 (NaN or inf would make every comparison fail or pass)."""
    name = "tolerance"

    def convert(self, value, param, ctx):
        try:
            x = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not 0 <= x < math.inf:
            self.fail(f"{value!r}: a tolerance must be finite and >= 0", param, ctx)
        return x


TOLERANCE = Tolerance()


def _parse_tol(values) -> Dict[str, Tuple[float, float]]:
    out = {}
    for item in values:
        stage, eq, rest = item.partition("=")
        if not eq or stage not in STAGE_NAMES:
            raise click.BadParameter(f"{item!r}: expected STAGE=ATOL[,RTOL] with STAGE one of "
                                     f"{', '.join(STAGE_NAMES)}", param_hint="--tol")
        parts = rest.split(",")
        try:
            atol = float(parts[0])
            rtol = float(parts[1]) if len(parts) > 1 else 0.0
        except ValueError:
            raise click.BadParameter(f"{item!r}: ATOL and RTOL must be numbers", param_hint="--tol")
        if len(parts) > 2 or not (0 <= atol < math.inf and 0 <= rtol < math.inf):
            raise click.BadParameter(f"{item!r}: expected STAGE=ATOL[,RTOL], both >= 0", param_hint="--tol")
        out[stage] = (atol, rtol)
    return out


CHECK_HELP = f"""Check every stage of a run against a float64 reference.

Compares OUT's stage files with float64 references from the input case IN; names the first
failing stage. Exit 0: all pass; 1: a stage fails; 2: bad input. Tolerances: {TOLERANCES_DOC}.
Overriding IN's manifest and run.toml ({CLI_DOC}): --causal [ALIGN], --no-causal, --align ALIGN,
--window LEFT,RIGHT, --softcap C, --alibi/--no-alibi, --dropout P; --split-size K, --page-size P.
A Dask cluster: --scheduler ADDRESS|local.
"""


def _device(name: str) -> str:
    """check --device's choice, checked (auto is decided per run: arrays.on_device)."""
    try:
        return resolve_device(name)
    except DeviceError as exc:
        raise CaseError(str(exc)) from None


def check_and_report(in_dir, out_dir, opts, json_path, junit_path, plot_dir, per_head, quiet=False) -> bool:
    case = load_input_case(in_dir, alibi=opts.variant.get("alibi"), page_size=opts.page_size)
    case.allow_nonfinite = opts.allow_nonfinite
    run_info = open_run(out_dir, case, opts.overrides())
    d = run_info.dims
    big = d.seq_q * d.seq_k * d.total_heads >= PROGRESS_MIN_WORK
    with progress_bar(d.total_heads, "checking heads", big and not quiet) as advance:
        report = check_run(run_info, case, opts, advance, True, diagnose)  # (this process is attnstep's own)
    if not quiet:
        for line in header_lines(report) + table_lines(report, per_head) + failure_lines(report):
            click.echo(line)
    for line in summary_lines(report) + flash_attn_criterion.text_lines(report, quiet):
        click.echo(line)
    if json_path:
        write_json(report, json_path)
    if junit_path:
        write_junit(report, junit_path)
    if plot_dir:
        _plot(report, plot_dir, opts, quiet)
    return report.passed


def _plot(report, plot_dir: Path, opts: Options, quiet: bool) -> None:
    """Error maps of the failing stages into PLOT_DIR; on a passing run, one line saying so."""
    if report.passed:
        if not quiet:
            click.echo(f"no stage failed: no error map written to {plot_dir}")
        return
    paths = write_plots(report, plot_dir, lambda s, h, seq: error_ratio_map(report.run, report.case, s, h, opts, seq))
    if not quiet:
        click.echo(f"wrote {plural(len(paths), 'error map')} to {plot_dir}")


@click.command(help=CHECK_HELP)
@in_option
@out_option
@json_option
@click.option("--junit", "junit_path", type=GivenPath(path_type=Path),
              callback=checked_path(report_file), help="Write a JUnit XML report to this file.")
@click.option("--plot", "plot_dir", type=GivenPath(path_type=Path),
              callback=checked_path(check_plot_folder),
              help="Write error maps (PNG) of failing stages here (needs matplotlib).")
@click.option("--atol", type=TOLERANCE, help="Absolute tolerance, instead of the model.")
@click.option("--rtol", type=TOLERANCE, help="Relative tolerance, instead of the model.")
@click.option("--tol", "tol", multiple=True, metavar="STAGE=ATOL[,RTOL]",
              help="Tolerances of one stage; repeatable.")
@click.option("--stage", "only", multiple=True, type=click.Choice(STAGE_NAMES), metavar="STAGE",
              help="Check only this stage; repeatable.")
@causal_option.but(hidden=True)  # listed in the description: the help fits a screen
@no_causal_option.but(hidden=True)
@align_option.but(hidden=True)
@window_option.but(hidden=True)
@softcap_option.but(hidden=True)
@click.option("--alibi/--no-alibi", default=None, hidden=True)
@dropout_option.but(hidden=True)
@click.option("--scale", type=float, callback=checked_path(lambda v: check_scale(v, "--scale")),
              help="Score scale [default: IN's, else run.toml's, else 1/sqrt(d_k)].")
@click.option("--precision", type=click.Choice(PRECISIONS),
              help="What the program computed in [default: run.toml's, else fp32].")
@click.option("--split-size", type=click.IntRange(min=1), metavar="K", hidden=True,
              help="Keys per split of a split-KV run [default: run.toml's].")
@click.option("--half-rounding", type=click.Choice(HALF_ROUNDINGS), metavar="MODE",
              help="bf16/fp16 rounding: nearest, toward-zero.")
@click.option("--math", type=click.Choice(MATH_MODES), default="ieee", show_default=True,
              help="fast: accept CUDA's fast-math intrinsics (__expf, ...).")
@name_options
@click.option("--per-head", is_flag=True, help="One table row per stage x head.")
@click.option("--jobs", type=click.IntRange(min=0), default=0, show_default=True, metavar="N",
              help="Processes checking heads; 0: as many as cores and memory allow.")
@click.option("--device", type=click.Choice(DEVICES), default="auto", metavar="DEVICE",
              help="Flash references on cuda, cpu or auto.")
@click.option("--scheduler", metavar="ADDRESS", hidden=True,  # (docs/cli.md: the help fits a screen)
              help=f"Check heads on a Dask cluster: its scheduler's tcp://HOST:PORT, or '{LOCAL}' to start "
              "one here of --jobs processes (docs/check.md).")
@click.option("--allow-nonfinite", is_flag=True, help="Accept NaN/Inf in the inputs (NaN passes where "
              "the reference has NaN).")
@click.option("--max-memory-mb", type=click.IntRange(1, MAX_MEMORY_MB), metavar="MB",
              help="Memory the check may use [default: all free].")
@click.option("--page-size", type=click.IntRange(1, MAX_TOKENS), metavar="P", hidden=True,
              help="The page size of a paged case without a manifest (docs/cli.md).")
@quiet_option
@click.pass_context
@user_errors
def check(ctx, in_dir, out_dir, json_path, junit_path, plot_dir, atol, rtol, tol, only, per_head, jobs, device,
          causal, no_causal, align, window, softcap, alibi, dropout, scale, precision, split_size, half_rounding, math,
          names, names_file, allow_nonfinite, max_memory_mb, page_size, quiet, scheduler):
    variant = said_variant(causal, no_causal, align, window, softcap, alibi, dropout)
    opts = Options(atol=atol, rtol=rtol, per_stage=_parse_tol(tol), only_stages=list(only) or None,
                   jobs=jobs, causal=variant.pop("causal", None), scale=scale, precision=precision, math=math,
                   half_rounding=half_rounding, names=parse_names(names, names_file), allow_nonfinite=allow_nonfinite,
                   max_memory_mb=max_memory_mb, variant=variant, page_size=page_size, split_size=split_size,
                   device=_device(device))
    check_folders_apart(in_dir, out_dir)
    check_reports_apart({"--json": json_path, "--junit": junit_path}, in_dir, out_dir, opts.names, names_file)
    with heads_on_cluster(scheduler, jobs, in_dir, out_dir, opts, diagnose):
        passed = check_and_report(in_dir, out_dir, opts, json_path, junit_path, plot_dir, per_head, quiet)
    ctx.exit(0 if passed else 1)
