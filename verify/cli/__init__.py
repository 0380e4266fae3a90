"""The `attnstep` command line: generate, run, check, demo, bench, sweep.

Exit statuses: 0 every stage passes; 1 a stage fails; 2 bad usage or bad input (one line, no
traceback); 3 not enough memory (one line). `run` passes on the binary's own status (3: not enough
memory; 1: a CUDA failure).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, Tuple

import click

from . import flash_attn_criterion, gpu
from .bench import bench
from .case import check_scale, load_input_case
from .compare import Options, check_run, error_ratio_map
from .generate import DEFAULT_DIMS, DISTRIBUTIONS, generate_case
from .guards import check_folders_apart, check_reports_apart
from .options import (backend_option, binary_option, build_option, force_option, in_option,
                      json_option, out_option, progress_bar, seed_option, timeout_option)
from .options import checked_path as _checked_path
from .options import report_file
from .options import user_errors as _user_errors
from .outputs import HALF_ROUNDINGS, MATH_MODES, open_run, parse_name_map, read_names_file
from .pool import MAX_MEMORY_MB
from .programs import (binary_args, binary_runner, program_runner, run_any_program, run_attnstep_binary, run_summary,
                       run_with_program_checks)
from .program_checks import text_lines as program_check_lines
from .sanitizer import TOOLS as SANITIZER_TOOLS
from .sanitizer import parse_tools
from .report import (check_plot_folder, failure_lines, header_lines, summary_lines, table_lines,
                     write_json, write_junit, write_plots)
from .runner import BINARY_NAME, ensure_built, example_names
from .stages import (BACKWARD_STAGES, CASE_INPUTS, DATA_DIR, DEFAULT_CASE, DEFAULT_INPUT_DIR, DEFAULT_RESULT,
                     FORMATS, INPUT_NAMES, PRECISIONS, STAGE_NAMES, STAGES, Dims)
from .sweep import sweep
from .words import plural

# Work (N·M·heads) above which `check` shows a progress bar, and values written above which
# `generate` does (on a terminal only).
PROGRESS_MIN_WORK = 1 << 24
GENERATE_PROGRESS_MIN_VALUES = 1 << 22
TOLERANCES_DOC = "docs/tolerances.md"


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


quiet_option = click.option("--quiet", "-q", is_flag=True, help="Print only the verdict and errors.")


def _build(build_dir: Path, quiet: bool, target: str = BINARY_NAME) -> Path:
    """ensure_built, its compile steps shown on stderr as they go unless `quiet`."""
    show = None if quiet else (lambda line: click.echo(f"  {line}", err=True))
    return ensure_built(build_dir, target=target, progress=show)


def name_options(fn):
    """--name STAGE=PATTERN (repeatable) and --names FILE: how a program names its stage files."""
    fn = click.option("--names", "names_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                      help="A file of STAGE = \"PATTERN\" lines.")(fn)
    return click.option("--name", "names", multiple=True, metavar="STAGE=PATTERN",
                        help="A stage's file names, e.g. output=O_{i}.txt ({i} head, {b} batch, {h} head in "
                             "batch).")(fn)


def dims_options(fn):
    defaults = DEFAULT_DIMS
    for name, flag, help_text in reversed((
            ("batch", "--batch", "Batch size B."), ("heads", "--heads", "Heads per batch element H."),
            ("seq_q", "--seq-q", "Query rows N."), ("seq_k", "--seq-k", "Key/value rows M."),
            ("d_k", "--d-k", "Query/key width d_k (1..256; flash needs 16, 32, 64 or 128)."),
            ("d_v", "--d-v", "Value width d_v (1..256; flash needs d_v = d_k)."))):
        fn = click.option(flag, name, type=click.IntRange(min=1), default=getattr(defaults, name),
                          show_default=True, help=help_text)(fn)
    return fn


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="attnstep", message="%(prog)s %(version)s")
def cli():
    """attnstep: find the stage where CUDA attention code goes wrong.

    Generate an input case, run the binary (CUDA or CPU backend) that writes every intermediate
    stage, and check each stage against a float64 NumPy reference.
    """


@cli.command()
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              default=DEFAULT_INPUT_DIR, show_default=True, help="Input case folder to write.")
@dims_options
@click.option("--causal/--no-causal", default=False, show_default=True,
              help="Causal (top-left aligned) masking.")
@click.option("--scale", type=float, default=None, help="Score scale [default: 1/sqrt(d_k)].")
@seed_option
@click.option("--dist", "distribution", type=click.Choice(tuple(DISTRIBUTIONS)), default="uniform",
              show_default=True, help="uniform [0,1) as the original; normal; large (logits in the hundreds).")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="txt", show_default=True,
              help="Matrix file format.")
@click.option("--backward", is_flag=True,
              help="Also write the output gradient dO_head_{i} (seq_q x d_v), for the backward stages.")
@force_option
@_user_errors
def generate(out_dir, batch, heads, seq_q, seq_k, d_k, d_v, causal, scale, seed, distribution, fmt, backward,
             force):
    """Write a random input case.

    Writes Q_head_{i}, K_head_{i}, V_head_{i} (with --backward also dO_head_{i}) for every head i
    (batch-major) and manifest.toml into OUT, replacing the case attnstep generated there before
    (with --force, any input case).
    """
    dims = Dims(batch, heads, seq_q, seq_k, d_k, d_v)
    inputs = CASE_INPUTS if backward else INPUT_NAMES
    values = dims.total_heads * sum(r * c for r, c in (STAGES[n].shape(dims) for n in inputs))
    with progress_bar(dims.total_heads, "generating heads", values >= GENERATE_PROGRESS_MIN_VALUES) as advance:
        generate_case(out_dir, dims, causal=causal, scale=scale, seed=seed, distribution=distribution,
                      fmt=fmt, backward=backward, force=force, progress=advance)
    click.echo(f"wrote {plural(dims.total_heads, 'head')} (N={seq_q} M={seq_k} d_k={d_k} d_v={d_v}, "
               f"{distribution}, seed {seed}) to {out_dir}")


@cli.command(context_settings={"ignore_unknown_options": False})
@in_option
@out_option
@backend_option
@build_option
@binary_option
@timeout_option
@click.option("--cwd", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Run the program in this folder (e.g. build/ for `./main random_test`).")
@click.option("--stages", help="Stages to write: all (every stage the case allows), stages (the stage path), "
              "flash (the flash stages), or a comma list of stages "
              f"({', '.join(STAGE_NAMES)}). The backward stages ({', '.join(BACKWARD_STAGES)}) need a "
              "case with dO ('attnstep generate --backward').")
@click.option("--format", "fmt", type=click.Choice(FORMATS), help="Output format [default: the input's].")
@click.option("--precision", type=click.Choice(PRECISIONS), help="fp32 (default), tf32 (GEMM operands rounded to TF32), or bf16/fp16 (inputs and "
              "stage values in the format, float32 accumulation and softmax; CPU backend).")
@click.option("--poison", is_flag=True, help="Pre-fill outputs with NaN so unwritten elements show.")
@click.option("--causal", is_flag=True, help="Force causal masking (overrides the manifest).")
@click.option("--scale", type=float, help="Override the score scale.")
@click.option("--max-memory-mb", type=click.IntRange(min=1), help="Cap the binary's working memory.")
@click.option("--allow-nonfinite", is_flag=True, help="Accept NaN/Inf in the inputs.")
@click.option("--sanitize", metavar="TOOLS", help="Also run the program under compute-sanitizer's TOOLS "
              f"({', '.join(SANITIZER_TOOLS)}; comma list, a run each), for check to report.")
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True, metavar="K",
              help="Run K times; check reports the stages whose values differ between runs.")
@quiet_option
@name_options
@click.argument("args", nargs=-1, type=click.UNPROCESSED, metavar="[-- ARGS...]")
@_user_errors
def run(in_dir, out_dir, backend, build_dir, binary, timeout, cwd, stages, fmt, precision, poison, causal, scale,
        max_memory_mb, allow_nonfinite, sanitize, repeat, quiet, names, names_file, args):
    """Build the binary if needed and run it on a case.

    Runs build/main on IN and writes every stage file and run.toml into OUT. With --binary PATH
    -- ARGS, runs your program as `PATH ARGS...` (in --cwd) instead, its own way, and then makes
    sure it wrote stage files into OUT (named as --name/--names say, as for check). Files of an
    earlier run in OUT are moved into OUT/.attnstep-previous, so `check` never sees them, and a run
    that fails or is stopped leaves OUT marked unfinished, which `check` refuses. With --sanitize
    and --repeat, the program also runs under compute-sanitizer and again, and `check` reports
    what they found beside the stages.
    """
    if args and binary is None:
        raise click.UsageError("program arguments after -- need --binary PATH (the program to run)")
    names = _parse_names(names, names_file)
    tools = parse_tools(sanitize) if sanitize else []
    if args:
        once = program_runner(binary, args, cwd, timeout, in_dir, quiet, names)
    else:
        ours = binary is None
        binary = binary or _build(build_dir, quiet)
        once = binary_runner(binary, in_dir, backend, timeout, cwd, ours, quiet,
                             binary_args(stages, fmt, precision, poison, causal, scale, max_memory_mb, allow_nonfinite))
    checks = run_with_program_checks(once, out_dir, in_dir, names, tools, repeat, chooses_out=not args)
    for line in program_check_lines(checks):
        click.echo(line)


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


def _parse_names(items, names_file) -> Dict[str, str]:
    out = read_names_file(names_file) if names_file else {}
    pairs = {}
    for item in items:
        stage, eq, pattern = item.partition("=")
        if not eq:
            raise click.BadParameter(f"{item!r}: expected STAGE=PATTERN, e.g. output=O_{{i}}.txt",
                                     param_hint="--name")
        pairs[stage.strip()] = pattern.strip()
    out.update(parse_name_map(pairs, "--name"))
    return out


CHECK_HELP = f"""Check every stage of a run against a float64 reference.

Compares each stage file in OUT with a NumPy float64 reference computed from the input case IN,
prints a stage table and the first failing stage with a diagnosis. Exit status 0: every stage
passes; 1: a stage fails; 2: bad input. The tolerances: {TOLERANCES_DOC}.
"""


def _check_and_report(in_dir, out_dir, opts, json_path, junit_path, plot_dir, per_head, quiet=False) -> bool:
    case = load_input_case(in_dir)
    case.allow_nonfinite = opts.allow_nonfinite
    run_info = open_run(out_dir, case, opts.overrides())
    d = run_info.dims
    big = d.seq_q * d.seq_k * d.total_heads >= PROGRESS_MIN_WORK
    with progress_bar(d.total_heads, "checking heads", big and not quiet) as advance:
        report = check_run(run_info, case, opts, progress=advance)
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
    paths = write_plots(report, plot_dir, lambda s, h: error_ratio_map(report.run, report.case, s, h, opts))
    if not quiet:
        click.echo(f"wrote {plural(len(paths), 'error map')} to {plot_dir}")


@cli.command(help=CHECK_HELP)
@in_option
@out_option
@json_option
@click.option("--junit", "junit_path", type=click.Path(path_type=Path),
              callback=_checked_path(report_file), help="Write a JUnit XML report to this file.")
@click.option("--plot", "plot_dir", type=click.Path(path_type=Path),
              callback=_checked_path(check_plot_folder),
              help="Write error maps (PNG) of failing stages here (needs matplotlib).")
@click.option("--atol", type=TOLERANCE, help="Absolute tolerance, instead of the model.")
@click.option("--rtol", type=TOLERANCE, help="Relative tolerance, instead of the model.")
@click.option("--tol", "tol", multiple=True, metavar="STAGE=ATOL[,RTOL]",
              help="Tolerances of one stage; repeatable.")
@click.option("--stage", "only", multiple=True, type=click.Choice(STAGE_NAMES), metavar="STAGE",
              help="Check only this stage; repeatable.")
@click.option("--causal/--no-causal", default=None,
              help="Causal masking [default: IN's manifest, else run.toml's].")
@click.option("--scale", type=float, callback=_checked_path(lambda v: check_scale(v, "--scale")),
              help="Score scale [default: IN's, else run.toml's, else 1/sqrt(d_k)].")
@click.option("--precision", type=click.Choice(PRECISIONS),
              help="What the program computed in [default: run.toml's, else fp32].")
@click.option("--half-rounding", type=click.Choice(HALF_ROUNDINGS), metavar="MODE",
              help="bf16/fp16 rounding: nearest, toward-zero.")
@click.option("--math", type=click.Choice(MATH_MODES), default="ieee", show_default=True,
              help="fast: accept CUDA's fast-math intrinsics (__expf, ...).")
@name_options
@click.option("--per-head", is_flag=True, help="One table row per stage x head.")
@click.option("--jobs", type=click.IntRange(min=0), default=0, show_default=True, metavar="N",
              help="Processes checking heads; 0: as many as cores and memory allow.")
@click.option("--allow-nonfinite", is_flag=True, help="Accept NaN/Inf in the inputs (NaN passes where "
              "the reference has NaN).")
@click.option("--max-memory-mb", type=click.IntRange(1, MAX_MEMORY_MB), metavar="MB",
              help="Memory the check may use [default: all free].")
@quiet_option
@click.pass_context
@_user_errors
def check(ctx, in_dir, out_dir, json_path, junit_path, plot_dir, atol, rtol, tol, only, per_head, jobs,
          causal, scale, precision, half_rounding, math, names, names_file, allow_nonfinite, max_memory_mb, quiet):
    opts = Options(atol=atol, rtol=rtol, per_stage=_parse_tol(tol), only_stages=list(only) or None,
                   jobs=jobs, causal=causal, scale=scale, precision=precision, math=math, half_rounding=half_rounding,
                   names=_parse_names(names, names_file), allow_nonfinite=allow_nonfinite, max_memory_mb=max_memory_mb)
    check_folders_apart(in_dir, out_dir)
    check_reports_apart({"--json": json_path, "--junit": junit_path}, in_dir, out_dir, opts.names, names_file)
    passed = _check_and_report(in_dir, out_dir, opts, json_path, junit_path, plot_dir, per_head, quiet)
    ctx.exit(0 if passed else 1)


@cli.command()
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), default=Path(DATA_DIR),
              show_default=True, help="Where random_test/ and random_verify/ go.")
@backend_option
@build_option
@binary_option
@timeout_option
@json_option
@seed_option
@force_option
@click.option("--example", type=click.Choice(example_names()),
              help="Run a program of the examples gallery (examples/, a GPU needed) instead of the binary, "
                   "as the original workflow ran it: from BUILD_DIR, reading ../data.")
@click.option("--backward", is_flag=True,
              help="Also the backward pass: an output gradient dO in the case, and the gradients.")
@quiet_option
@click.pass_context
@_user_errors
def demo(ctx, data_dir, backend, build_dir, binary, timeout, json_path, seed, force, example, backward, quiet):
    """Build, generate the default case, run, and check.

    The original workflow in one command: 12 heads, N = M = 128, d = 64, uniform inputs, into
    DATA_DIR/random_test and DATA_DIR/random_verify. With --example NAME, the same with one of the
    gallery's programs (a classic bug each) in place of attnstep's binary.
    """
    if example:
        _demo_example(ctx, example, build_dir, timeout, json_path, seed, force, quiet)
    in_dir, out_dir = data_dir / DEFAULT_CASE, data_dir / DEFAULT_RESULT
    say = _step_printer(quiet)
    say(f"[1/4] using {binary}" if binary else f"[1/4] building the binary in {build_dir}")
    ours = binary is None
    binary = binary or _build(build_dir, quiet)
    say(f"[2/4] generating {in_dir}" + (" with the output gradient dO" if backward else ""))
    generate_case(in_dir, DEFAULT_DIMS, seed=seed, force=force, backward=backward)
    say(f"[3/4] running {binary.name} --backend {backend}")
    seconds = run_attnstep_binary(binary, in_dir, out_dir, backend, timeout, ours=ours)
    say("      " + run_summary(binary, out_dir, seconds))
    say(f"[4/4] checking {out_dir}")
    passed = _check_and_report(in_dir, out_dir, Options(), json_path, None, None, False, quiet)
    ctx.exit(0 if passed else 1)


def _step_printer(quiet: bool):
    """click.echo for the demo's step lines, or nothing with --quiet."""
    return (lambda _line: None) if quiet else click.echo


def _demo_example(ctx, example, build_dir, timeout, json_path, seed, force, quiet) -> None:
    """The demo with a gallery program: it reads ../data/random_test from BUILD_DIR."""
    gpu.require_gpu_for_example(example)  # before minutes of building a program that could not run
    data_dir = Path(build_dir).absolute().parent / DATA_DIR
    in_dir, out_dir = data_dir / DEFAULT_CASE, data_dir / DEFAULT_RESULT
    say = _step_printer(quiet)
    say(f"[1/4] building {example} in {build_dir}")
    program = _build(build_dir, quiet, target=example)
    say(f"[2/4] generating {in_dir}")
    generate_case(in_dir, DEFAULT_DIMS, seed=seed, force=force)
    say(f"[3/4] running {example} {DEFAULT_CASE} in {build_dir}")
    run_any_program(program, [DEFAULT_CASE], Path(build_dir), out_dir, timeout, in_dir, quiet)
    say(f"[4/4] checking {out_dir}")
    passed = _check_and_report(in_dir, out_dir, Options(), json_path, None, None, False, quiet)
    ctx.exit(0 if passed else 1)


cli.add_command(bench)  # verify/bench.py: GPU timings against ceilings and PyTorch SDPA
cli.add_command(sweep)  # verify/sweep.py: the d × N grid of the stage path, flash and SDPA


def main() -> None:  # console-script entry point
    cli(prog_name="attnstep")


if __name__ == "__main__":
    main()
