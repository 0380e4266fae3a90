"""`attnstep run` (a program on a case) and `attnstep demo` (build, generate, run and check in one)."""
from __future__ import annotations

from pathlib import Path
from typing import List

import click

from ..check.compare import Options
from ..files.generate import DEFAULT_DIMS, generate_case
from ..files.guards import check_folders_apart
from ..runs import gpu
from ..runs.program_checks import text_lines as program_check_lines
from ..runs.runner import BINARY_NAME, ensure_built, example_names, require_cuda_backend
from ..runs.sanitizer import TOOLS as SANITIZER_TOOLS
from ..runs.sanitizer import parse_tools
from ..runs.watched import (binary_args, binary_runner, program_runner, run_any_program, run_attnstep_binary,
                            run_summary, run_with_program_checks)
from ..stages import BACKWARD_STAGES, DATA_DIR, DEFAULT_CASE, DEFAULT_RESULT, FORMATS, PRECISIONS, STAGE_NAMES
from .check import check_and_report
from .options import (GivenPath, align_option, alibi_option, backend_option, binary_option, build_option,
                      dropout_option, dropout_seed_option, force_option, given_text, in_option, json_option,
                      name_options, out_option, parse_names, quiet_option, seed_option, softcap_option, timeout_option,
                      user_errors, window_option)


def variant_run_options(fn):
    """The variant's options that `run` passes on to attnstep's binary as its own flags."""
    for option in reversed((align_option, window_option, softcap_option, alibi_option, dropout_option,
                            dropout_seed_option)):
        fn = option(fn)
    return fn


def variant_flags(align, window, softcap, alibi, dropout, dropout_seed) -> List[str]:
    """The binary's command-line flags for the variant options given (they override the manifest)."""
    flags: List[str] = []
    for flag, value in (("--align", align), ("--window", ",".join(map(str, window)) if window else None),
                        ("--softcap", None if softcap is None else repr(softcap)),
                        ("--dropout", None if dropout is None else repr(dropout)),
                        ("--dropout-seed", None if dropout_seed is None else str(dropout_seed))):
        if value is not None:
            flags += [flag, value]
    return flags + (["--alibi"] if alibi else [])


def _build(build_dir: Path, quiet: bool, target: str = BINARY_NAME) -> Path:
    """ensure_built, its compile steps shown on stderr as they go unless `quiet`."""
    show = None if quiet else (lambda line: click.echo(f"  {line}", err=True))
    return ensure_built(build_dir, target=target, progress=show)


@click.command(context_settings={"ignore_unknown_options": False})
@in_option
@out_option
@backend_option
@build_option
@binary_option
@timeout_option
@click.option("--cwd", type=GivenPath(exists=True, file_okay=False, path_type=Path),
              help="Run the program in this folder (e.g. build/ for `./main random_test`).")
@click.option("--stages", callback=given_text, help="Stages to write: all (every stage the case allows), stages (the stage path), "
              "flash (the flash stages), or a comma list of stages "
              f"({', '.join(STAGE_NAMES)}). The backward stages ({', '.join(BACKWARD_STAGES)}) need a "
              "case with dO ('attnstep generate --backward').")
@click.option("--format", "fmt", type=click.Choice(FORMATS), help="Output format [default: the input's].")
@click.option("--precision", type=click.Choice(PRECISIONS), help="fp32 (default), tf32 (GEMM operands rounded to TF32), or bf16/fp16 (inputs and "
              "stage values in the format, float32 accumulation and softmax; CPU backend).")
@click.option("--poison", is_flag=True, help="Pre-fill outputs with NaN so unwritten elements show.")
@click.option("--causal", is_flag=True, help="Force causal masking (overrides the manifest; --align says where "
              "the diagonal is).")
@variant_run_options
@click.option("--scale", type=float, help="Override the score scale.")
@click.option("--split-size", type=click.IntRange(min=1), metavar="K",
              help="Split the keys K at a time, as flash-decoding does: the binary also writes each split's "
                   "output and lse (split_output, split_lse), and flash_output, flash_lse as their combine.")
@click.option("--max-memory-mb", type=click.IntRange(min=1), help="Cap the binary's working memory.")
@click.option("--allow-nonfinite", is_flag=True, help="Accept NaN/Inf in the inputs.")
@click.option("--sanitize", metavar="TOOLS", callback=given_text, help="Also run the program under compute-sanitizer's TOOLS "
              f"({', '.join(SANITIZER_TOOLS)}; comma list, a run each), for check to report.")
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True, metavar="K",
              help="Run K times; check reports the stages whose values differ between runs.")
@quiet_option
@name_options
@click.argument("args", nargs=-1, type=click.UNPROCESSED, metavar="[-- ARGS...]")
@user_errors
def run(in_dir, out_dir, backend, build_dir, binary, timeout, cwd, stages, fmt, precision, poison, causal, align,
        window, softcap, alibi, dropout, dropout_seed, scale, split_size, max_memory_mb, allow_nonfinite, sanitize,
        repeat, quiet, names, names_file, args):
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
    flags = variant_flags(align, window, softcap, alibi, dropout, dropout_seed)
    if args and flags:
        raise click.UsageError(f"{flags[0]} is an option of attnstep's binary; your program (-- ARGS) takes its own: "
                               "pass the variant in ARGS, and to check with --align, --window, ...")
    if args and split_size:
        raise click.UsageError("--split-size is an option of attnstep's binary; your program (-- ARGS) takes its own: "
                               "pass the split size in ARGS, and to check with --split-size")
    check_folders_apart(in_dir, out_dir)  # (check refuses them: a run there could never be checked)
    names = parse_names(names, names_file)
    tools = parse_tools(sanitize) if sanitize else []
    if args:
        once = program_runner(binary, args, cwd, timeout, in_dir, quiet, names)
    else:
        ours = binary is None
        binary = binary or _build(build_dir, quiet)
        extra = binary_args(stages, fmt, precision, poison, causal, scale, max_memory_mb, allow_nonfinite, split_size)
        extra += variant_flags(align, window, softcap, alibi, dropout, dropout_seed)
        once = binary_runner(binary, in_dir, backend, timeout, cwd, ours, quiet, extra)
    checks = run_with_program_checks(once, out_dir, in_dir, names, tools, repeat, chooses_out=not args)
    for line in program_check_lines(checks):
        click.echo(line)


@click.command()
@click.option("--data-dir", type=GivenPath(file_okay=False, path_type=Path), default=Path(DATA_DIR),
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
                   "as such a program runs: from BUILD_DIR, reading ../data.")
@click.option("--backward", is_flag=True,
              help="Also the backward pass: an output gradient dO in the case, and the gradients.")
@quiet_option
@click.pass_context
@user_errors
def demo(ctx, data_dir, backend, build_dir, binary, timeout, json_path, seed, force, example, backward, quiet):
    """Build, generate the default case, run, and check.

    One command from nothing to a verdict: 12 heads, N = M = 128, d = 64, uniform inputs, into
    DATA_DIR/random_test and DATA_DIR/random_verify. With --example NAME, the same with one of the
    gallery's programs (a classic bug each) in place of attnstep's binary.
    """
    if example:
        _demo_example(ctx, example, build_dir, timeout, json_path, seed, force, quiet)
    in_dir, out_dir = data_dir / DEFAULT_CASE, data_dir / DEFAULT_RESULT
    say = _step_printer(quiet)
    if backend == "cuda":
        require_cuda_backend()  # (no GPU: said before minutes of building)
    say(f"[1/4] using {binary}" if binary else f"[1/4] building the binary in {build_dir}")
    ours = binary is None
    binary = binary or _build(build_dir, quiet)
    if backend == "cuda" and ours:
        require_cuda_backend(build_dir)
    say(f"[2/4] generating {in_dir}" + (" with the output gradient dO" if backward else ""))
    generate_case(in_dir, DEFAULT_DIMS, seed=seed, force=force, backward=backward)
    say(f"[3/4] running {binary.name} --backend {backend}")
    seconds = run_attnstep_binary(binary, in_dir, out_dir, backend, timeout, ours=ours)
    say("      " + run_summary(binary, out_dir, seconds))
    say(f"[4/4] checking {out_dir}")
    passed = check_and_report(in_dir, out_dir, Options(), json_path, None, None, False, quiet)
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
    passed = check_and_report(in_dir, out_dir, Options(), json_path, None, None, False, quiet)
    ctx.exit(0 if passed else 1)
