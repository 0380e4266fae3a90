"""`attnstep bench`: times the binary's stages and flash kernels, forward and backward, and PyTorch's
SDPA, on a shape list (what runs: verify/bench/measure.py), and prints the table and the goals.
The variant options apply to every shape; `--variants goals` runs the variants' goals instead
(verify/bench/variant_goals.py), `--decode goals` the paged decode kernel's (verify/bench/decode_goals.py).

    python -m verify.cli.bench --build-dir build --json bench.json --plot bench.png
    python -m verify.cli.bench --variants goals --json goals.json
    python -m verify.cli.bench --decode goals --json decode.json
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import List, Optional, Sequence

import click
from click.core import ParameterSource

from ..bench.goals import evaluate_goals, goal_records
from ..bench.measure import BENCH_TIMEOUT_S, BOTH, collect_runs, default_shapes
from ..bench.plot import write_plot
from ..bench.report import (ACCURACY, PASSES, SDPA, BenchError, Row, Shape, ceiling_lines, format_table,
                            rows_from_results)
from ..bench.results_file import load_results
from ..files.guards import same_file
from ..files.case import atomic_write_bytes
from ..report.json_file import jsonable
from ..runs.runner import ensure_built
from ..stages import FLOAT32_PRECISIONS, HALF_PRECISIONS, PRECISIONS
from ..text import plural
from ..bench.variant_goals import GOALS_PRESET, preset_runs
from ..bench import decode_goals
from .options import (GivenPath, InputError, align_option, alibi_option, binary_option, build_option, json_option,
                      output_files_apart, softcap_option, timeout_option, user_errors, window_option)

# `--precision`: one precision, or one of these groups.
PRECISION_GROUPS = {BOTH: FLOAT32_PRECISIONS, "half": HALF_PRECISIONS, "all": PRECISIONS}


def parse_shape(text: str) -> Shape:
    """`B,H,N,M,D[,causal]` -> Shape; raises click.BadParameter naming the problem."""
    parts = [p.strip() for p in text.split(",")]
    causal = False
    if parts and parts[-1] in ("causal", "c"):
        causal, parts = True, parts[:-1]
    if len(parts) != 5 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise click.BadParameter(f"'{text}': expected B,H,N,M,D[,causal] with positive integers")
    b, h, n, m, d = (int(p) for p in parts)
    return Shape(b, h, n, m, d, causal)


# The options a preset replaces: it runs its own shapes, precisions, passes and variants.
_PRESET_REPLACES = ("shape_specs", "precision", "passes", "only", "kv_heads", "align", "window", "softcap", "alibi")


def with_variant(shapes: Sequence[Shape], kv_heads=None, align=None, window=None, softcap=None,
                 alibi=None) -> List[Shape]:
    """The shapes with the variant the options give (None: not given); raises InputError naming
    the shape a value does not fit (a --kv-heads that does not divide its heads)."""
    given = dict(kv_heads=kv_heads, align=align, window=window, softcap=softcap, alibi=alibi)
    changes = {k: v for k, v in given.items() if v is not None}
    out = []
    for shape in shapes:
        try:
            out.append(dataclasses.replace(shape, **changes))
        except ValueError as exc:
            raise InputError(f"shape {shape.id}: {exc}") from None
    return out


def _refuse_with_preset(ctx: click.Context, preset: str) -> None:
    """One line naming the options given with a preset, which it would ignore."""
    given = [p.opts[0] for p in ctx.command.params
             if p.name in _PRESET_REPLACES and ctx.get_parameter_source(p.name) == ParameterSource.COMMANDLINE]
    if given:
        raise InputError(f"--variants {preset} runs its own shapes, precisions, passes and variants; "
                         f"drop {', '.join(given)}")


# The options `--decode goals` takes (the rest it would ignore).
_DECODE_TAKES = ("build_dir", "binary", "warmup", "reps", "use_torch", "timeout", "json_path", "from_json", "decode")


def _refuse_with_decode(ctx: click.Context) -> None:
    given = [p.opts[0] for p in ctx.command.params
             if p.name not in _DECODE_TAKES and ctx.get_parameter_source(p.name) == ParameterSource.COMMANDLINE]
    if given:
        raise InputError(f"--decode goals runs its own shapes (the decode kernel, bf16); drop {', '.join(given)}")


def _decode_bench(build_dir, binary, warmup: int, reps: int, use_torch: bool, timeout: float, json_path,
                  from_json) -> None:
    """`--decode goals`: the decode kernel against the copy and SDPA on the gathered cache."""
    if from_json:
        results = load_results(from_json)
    else:
        output_files_apart({"--json": json_path})  # before minutes of GPU work
        results = decode_goals.collect_decode(binary or ensure_built(build_dir), decode_goals.DECODE_SHAPES, warmup,
                                              reps, use_torch, log=lambda m: click.echo(m, err=True),
                                              timeout=timeout)
        if json_path:
            atomic_write_bytes(json_path, (json.dumps(jsonable(results), indent=1) + "\n").encode())
    click.echo(f"device: {results.get('device', '?')}  date: {results.get('date', '?')}  "
               f"torch: {results.get('torch') or 'not timed'}")
    for line in decode_goals.decode_table(results):
        click.echo(line)
    failed = [r["shape"] for r in results["runs"] if r.get("error")]
    if failed:
        click.echo(f"bench: main --bench-decode failed on {plural(len(failed), 'shape')}; see the table", err=True)
        raise SystemExit(1)


def _print_results(results: dict, rows: Sequence[Row]) -> None:
    click.echo(f"device: {results.get('device', '?')}  date: {results.get('date', '?')}  "
               f"torch: {results.get('torch') or 'not timed'}")
    click.echo(format_table(rows))
    for line in ceiling_lines(results):
        click.echo(line)
    goals = evaluate_goals(rows)
    if goals:
        click.echo("goals:")
        for line in goals:
            click.echo("  " + line)


def _failure_source(row: Row) -> str:
    """What a failed row's failure is of: the binary, SDPA, or the accuracy comparison."""
    if row.kernel == ACCURACY:
        return "the accuracy comparison"
    return "SDPA" if row.kernel.startswith(SDPA) else "main --bench"


def _exit_status(rows: Sequence[Row]) -> int:
    """1 when a checked result failed its float64 check or something failed to run on a shape
    (the binary, SDPA, the accuracy comparison), else 0."""
    failed = [r for r in rows if "FAIL" in r.note]
    crashed: dict = {}
    for r in rows:
        if r.status.startswith("failed:"):
            crashed.setdefault(_failure_source(r), set()).add(r.shape)
    if failed:
        click.echo(f"bench: {plural(len(failed), 'result')} failed the float64 check", err=True)
    for source, shapes in crashed.items():
        click.echo(f"bench: {source} failed on {plural(len(shapes), 'shape')}; see the table", err=True)
    return 1 if failed or crashed else 0


def _reread(from_json: Path, plot_path: Optional[Path]) -> dict:
    """The results of an earlier run, their plot's file checked first (never the file read)."""
    output_files_apart({"--plot": plot_path})
    if plot_path is not None and same_file(plot_path, from_json):
        raise BenchError(f"--plot {plot_path}: is the --from-json file; HINT: give the plot its own file")
    return load_results(from_json)


@click.command("bench")
@build_option
@binary_option.but(help="Time this prebuilt binary instead of building BUILD_DIR/main.")
@click.option("--shape", "shape_specs", multiple=True, metavar="B,H,N,M,D[,causal]",
              help="Benchmark this shape instead of the default list (repeatable).")
@click.option("--precision", type=click.Choice(PRECISIONS + tuple(PRECISION_GROUPS)), default=BOTH, show_default=True,
              help="Flash kernels and cuBLAS stages in fp32 (3xTF32 flash), tf32, bf16 or fp16 (against SDPA at "
                   "that dtype, each backend; the backward by the flash kernel alone); both: fp32 and tf32; half: "
                   "bf16 and fp16; all: the four.")
@click.option("--warmup", type=click.IntRange(min=0), default=3, show_default=True, help="Untimed runs first.")
@click.option("--reps", type=click.IntRange(min=1), default=20, show_default=True,
              help="Timed runs (median); a quarter of them, at least 3, for the largest shapes.")
@click.option("--only", type=click.Choice(("all", "stages", "flash")), default="all", show_default=True,
              help="Time the stage path, the flash kernels, or both.")
@click.option("--pass", "passes", type=click.Choice(PASSES + (BOTH,)), default=BOTH, show_default=True,
              help="Time the forward, the backward (from a generated dO), or both.")
@click.option("--check/--no-check", default=True, show_default=True,
              help="Compare sampled rows of the flash outputs and of the gradients with float64 inside the binary; "
                   "at bf16/fp16 also SDPA's output on the same inputs (needs torch).")
@click.option("--ceilings/--no-ceilings", default=True, show_default=True,
              help="Measure the ceilings (cuBLAS SGEMM, device copy, tensor-core rates) in each run.")
@click.option("--torch/--no-torch", "use_torch", default=True, show_default=True,
              help="Also time PyTorch SDPA (fp32; bf16/fp16 at those precisions) when torch imports and sees a GPU.")
@timeout_option.but(default=BENCH_TIMEOUT_S, help="Seconds before the binary is stopped on one shape.")
@json_option.but(callback=None, help="Write all results as JSON to this file.")
@click.option("--plot", "plot_path", type=GivenPath(dir_okay=False, path_type=Path),
              help="Write a PNG plot of TFLOP/s against N per kernel.")
@click.option("--from-json", "from_json", type=GivenPath(exists=True, dir_okay=False, path_type=Path),
              help="Do not run anything: print the table, goals and plot of an earlier --json file.")
@click.option("--kv-heads", type=click.IntRange(min=1), metavar="HK",
              help="K/V heads per batch element for every shape (GQA; 1: MQA; a divisor of H). The flash rows "
                   "include the copy of the K/V heads to their query heads (and the backward the sums of dK, dV).")
@align_option.but(help="Where row i's diagonal is for the causal mask and the window: top-left (default) or "
                       "bottom-right.")
@window_option.but(help="Sliding window for every shape: row i sees keys diag(i)-LEFT .. diag(i)+RIGHT; -1 unbounded.")
@softcap_option.but(help="Cap the scaled scores of every shape: C*tanh(S/C).")
@alibi_option.but(help="ALiBi (the standard slopes) for every shape.")
@click.option("--variants", type=click.Choice((GOALS_PRESET,)),
              help="goals: run exactly what the variants' goals compare, each against the same kernel without "
                   "the variant (the flash rows only): GQA H=32 Hk=8 N=M=8192 d128 bf16 against MHA; window "
                   "(1024, 0) against full causal at N=M=16384 bf16, forward and backward; softcap 50 against none "
                   "at B4 H16 N=M=4096 d128, forward and backward at bf16 and fp32. Replaces --shape, --precision, "
                   "--pass, --only and the variant options.")
@click.option("--decode", type=click.Choice((decode_goals.GOALS_PRESET,)),
              help="goals: time the paged decode kernel (split-KV and its combine, main --bench-decode) at B=64 H=32 "
                   "Hk=8 d128 bf16, one query per sequence, pages of 64, caches of 8192 and 32768 keys: its GB/s of "
                   "K/V read against a device copy of the same bytes in the same run (goal >= 0.80), and its time "
                   "against PyTorch SDPA on the gathered cache (enable_gqa, the gather untimed; goal <= 1.0x). Takes "
                   "--binary, --build-dir, --warmup (SDPA), --reps, --torch, --timeout, --json and --from-json.")
@user_errors
@click.pass_context
def bench(ctx, build_dir, binary, shape_specs, precision, warmup, reps, only, passes, check, ceilings, use_torch,
          timeout, json_path, plot_path, from_json, kv_heads, align, window, softcap, alibi, variants, decode):
    """Time every stage and flash kernel of the binary, forward and backward, and PyTorch SDPA,
    over a shape list.

    Runs `main --bench` (built in BUILD_DIR) for each shape of the default list or each --shape,
    in each precision; prints a table of ms, TFLOP/s or GB/s, the fraction of the ceilings the
    binary measured in the same run (cuBLAS SGEMM, device copy) and the flash kernels' speed over
    SDPA's (the backward's over SDPA's backward; at bf16/fp16 over SDPA's fastest backend at that
    dtype, pass by pass, and over each); then the goals as met/missed, at bf16/fp16 with --check the flash
    error against float64 beside SDPA's on the same inputs. Backward TFLOP/s count 2.5x the
    forward's FLOPs; every FLOP count counts the score entries the mask leaves visible.

    A variant (--kv-heads, --align, --window, --softcap, --alibi) applies to every shape; SDPA is
    timed on plain shapes only, and a variant's rows note their time over the same shape's without
    it when that ran too. --variants goals runs the variants' goals in one invocation and reports
    each ratio beside its goal (and in the JSON's "goals"), every run timed --reps times. --decode
    goals times the paged decode kernel against the copy and SDPA on the gathered cache (its own
    table and goals). Exit status 1 when a checked result fails its float64 check, or the binary
    fails on a shape.
    """
    try:
        if decode or (from_json and decode_goals.is_decode_results(load_results(from_json))):
            _refuse_with_decode(ctx)
            _decode_bench(build_dir, binary, warmup, reps, use_torch, timeout, json_path, from_json)
            return
        if from_json:
            results = _reread(from_json, plot_path)
        else:
            output_files_apart({"--json": json_path, "--plot": plot_path})  # before minutes of GPU work
            if variants:
                _refuse_with_preset(ctx, variants)
                runs, only = preset_runs(), "flash"
            else:
                shapes = with_variant([parse_shape(s) for s in shape_specs] or default_shapes(), kv_heads, align,
                                      window, softcap, alibi)
                runs = [(sh, p, passes) for sh in shapes for p in PRECISION_GROUPS.get(precision, (precision,))]
            # A preset's runs are compared with each other: each is timed as often.
            results = collect_runs(binary or ensure_built(build_dir), runs, warmup, reps, check, use_torch, only,
                                   log=lambda m: click.echo(m, err=True), timeout=timeout, ceilings=ceilings,
                                   all_reps=bool(variants))
        rows = rows_from_results(results)
        if json_path and not from_json:
            results["goals"] = goal_records(rows)
            atomic_write_bytes(json_path, (json.dumps(jsonable(results), indent=1) + "\n").encode())
        _print_results(results, rows)
        if plot_path:
            write_plot(rows, plot_path, f"attnstep bench on {results.get('device', '?')}")
    except BenchError as exc:
        raise InputError(str(exc)) from None
    except (TypeError, KeyError, ValueError, AttributeError, IndexError) as exc:
        if not from_json:
            raise
        raise InputError(f"{from_json}: not a results file as attnstep bench writes it (edited by hand?): "
                         f"{type(exc).__name__}: {exc}") from None
    status = _exit_status(rows)
    if status:
        raise SystemExit(status)


if __name__ == "__main__":
    bench()
