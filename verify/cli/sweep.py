"""`attnstep sweep`: the benchmarking table over a grid of head widths and sequence lengths (what
runs: verify/bench/sweep.py), printed and written as CSV, JSON and a plot.
"""
from __future__ import annotations

import importlib.util
import json
import signal
from pathlib import Path
from typing import List, Optional, Sequence

import click

from ..bench.measure import BENCH_TIMEOUT_S, BOTH
from ..bench.plot import write_plot
from ..bench.report import PASSES, BenchError
from ..bench.sdpa import torch_available
from ..bench.sweep import (KERNEL_NAMES, KERNELS, MASKINGS, SWEEP_BATCH, SWEEP_D, SWEEP_HEADS, SWEEP_LARGE_FLOP,
                           SWEEP_SEQ, Settings, Sweep, SweepKernel, SweepRow, csv_text, format_table, grid, plot_rows)
from ..files.matrix_io import atomic_write_bytes
from ..runs.runner import ensure_built
from ..stages import FLOAT32_PRECISIONS, MAX_DIM
from ..terminal import progress_bar
from ..text import plural
from .options import (GivenPath, InputError, Interrupted, binary_option, build_option, output_files_apart,
                      timeout_option, user_errors)


def _check_outputs(csv_path: Optional[Path], json_path: Optional[Path], plot_path: Optional[Path]) -> None:
    """Refuses, before minutes of GPU work, an output that could not be written at the end."""
    output_files_apart({"--csv": csv_path, "--json": json_path, "--plot": plot_path})
    if plot_path is not None and importlib.util.find_spec("matplotlib") is None:
        raise InputError(f"--plot {plot_path}: needs matplotlib (pip install matplotlib)")


def _write_outputs(sweep: Sweep, csv_path, json_path, plot_path) -> None:
    if csv_path:
        atomic_write_bytes(csv_path, csv_text(sweep.rows).encode())
    if json_path:
        atomic_write_bytes(json_path, (json.dumps(sweep.document(), indent=1) + "\n").encode())
    if plot_path:
        write_plot(plot_rows(sweep.rows), plot_path, f"attnstep sweep on {sweep.device or '?'}")


def _kernels(names: Sequence[str], passes: str, torch_version: Optional[str]) -> List[SweepKernel]:
    """The kernels asked for (all of the passes asked for by default); SDPA only when torch sees a GPU."""
    wanted = [k for k in KERNELS if (not names or k.key in names) and passes in (BOTH, k.direction)]
    if not wanted:
        raise InputError(f"--pass {passes}: none of the kernels asked for ({', '.join(names)}) has that pass")
    usable = [k for k in wanted if k.only or torch_version]
    if not usable:
        keys = "/".join(k.key for k in wanted)
        raise InputError(f"--kernel {keys}: needs PyTorch with a CUDA GPU, and torch did not import or sees none")
    return usable


def _exit_status(rows: Sequence[SweepRow]) -> int:
    """1 when a run failed or a checked result failed its float64 check; OOM rows are results."""
    failed = [r for r in rows if r.status.startswith("failed") or "FAIL" in r.note]
    if failed:
        click.echo(f"sweep: {plural(len(failed), 'row')} failed; see the table", err=True)
    return 1 if failed else 0


GRID_SHAPES = len(SWEEP_D) * len(SWEEP_SEQ) * len(MASKINGS["both"])
SWEEP_HELP = f"""Time attention over a grid of head widths d and sequence lengths N = M.

For each d, N and masking, forward and backward: the binary's stage path (the forward as the
sum of its stages), its flash kernel, and PyTorch SDPA when torch sees a GPU; one row each with
the median time, TFLOP/s (by 4·B·H·N·M·d, halved when causal, for every kernel; 2.5 times that
for the backward) and the peak device memory. The binary's memory is sampled with nvidia-smi and
includes its CUDA context ('-' without nvidia-smi); SDPA's is what torch allocated (inputs
included; the backward's with the forward's saved tensors). A shape that does not fit in device
memory is an OOM row.

The default grid (B={SWEEP_BATCH}, H={SWEEP_HEADS}, d in {', '.join(map(str, SWEEP_D))}, N from {SWEEP_SEQ[0]} to
{SWEEP_SEQ[-1]}, causal and not: {GRID_SHAPES} shapes, {len(KERNELS)} rows each) times the largest shapes with fewer
repetitions to stay short; on a terminal a progress bar shows the rows done and the ETA.
The files are written once every row is done (none on Ctrl-C). Exit status 1 when a run failed
or a checked result (flash output, gradients) failed its float64 check.
"""


@click.command("sweep", help=SWEEP_HELP)
@build_option
@binary_option.but(help="Time this prebuilt binary instead of building BUILD_DIR/main.")
@click.option("--d", "ds", multiple=True, type=click.IntRange(1, 256), metavar="D",
              help=f"Head width d (repeatable) [default: {', '.join(map(str, SWEEP_D))}].")
@click.option("--seq", "seqs", multiple=True, type=click.IntRange(1, MAX_DIM), metavar="N",
              help=f"Sequence length N = M (repeatable) [default: {SWEEP_SEQ[0]}, {SWEEP_SEQ[1]}, ..., "
                   f"{SWEEP_SEQ[-1]}].")
@click.option("--causal", "masking", type=click.Choice(tuple(MASKINGS)), default="both", show_default=True,
              help="Causal masking, none, or both.")
@click.option("--batch", type=click.IntRange(1, MAX_DIM), default=SWEEP_BATCH, show_default=True, help="Batch size B.")
@click.option("--heads", type=click.IntRange(1, MAX_DIM), default=SWEEP_HEADS, show_default=True, help="Heads H.")
@click.option("--kernel", "kernel_names", multiple=True, type=click.Choice(KERNEL_NAMES),
              help="Time only this kernel (repeatable; '-backward': its backward pass) [default: all].")
@click.option("--pass", "passes", type=click.Choice(PASSES + (BOTH,)), default=BOTH, show_default=True,
              help="The forward rows, the backward rows, or both.")
@click.option("--precision", type=click.Choice(FLOAT32_PRECISIONS), default=FLOAT32_PRECISIONS[0], show_default=True,
              help="The binary's GEMMs and flash kernel (SDPA always runs in fp32).")
@click.option("--warmup", type=click.IntRange(min=0), default=3, show_default=True, help="Untimed runs first.")
@click.option("--reps", type=click.IntRange(min=1), default=20, show_default=True,
              help=f"Timed runs (median); a quarter of them, at least 3, above {SWEEP_LARGE_FLOP:.2g} FLOP.")
@click.option("--check/--no-check", default=True, show_default=True,
              help="Compare sampled rows of the flash outputs and of the gradients with float64 inside the binary.")
@timeout_option.but(default=BENCH_TIMEOUT_S, help="Seconds before the binary is stopped on one row.")
@click.option("--csv", "csv_path", type=GivenPath(dir_okay=False, path_type=Path),
              help="Write the rows as CSV to this file.")
@click.option("--json", "json_path", type=GivenPath(dir_okay=False, path_type=Path),
              help="Write the rows and the settings as JSON to this file.")
@click.option("--plot", "plot_path", type=GivenPath(dir_okay=False, path_type=Path),
              help="Write a PNG plot of TFLOP/s against N, a panel per d and masking (needs matplotlib).")
@user_errors
def sweep(build_dir, binary, ds, seqs, masking, batch, heads, kernel_names, passes, precision, warmup, reps, check,
          timeout, csv_path, json_path, plot_path):
    try:
        _check_outputs(csv_path, json_path, plot_path)
        torch_version = torch_available()
        kernels = _kernels(kernel_names, passes, torch_version)
        needs_binary = any(k.only for k in kernels)
        sweep_ = Sweep(binary or (ensure_built(build_dir) if needs_binary else None),
                       Settings(precision, warmup, reps, check, timeout), torch_version)
        shapes = grid(ds or SWEEP_D, seqs or SWEEP_SEQ, MASKINGS[masking], batch, heads)
        total = len(shapes) * len(kernels)
        try:
            with progress_bar(total, "sweep") as advance:
                sweep_.run(shapes, kernels, advance)
        except (KeyboardInterrupt, Interrupted) as exc:  # (Ctrl-C, SIGTERM, SIGHUP)
            click.echo(f"sweep: interrupted after {len(sweep_.rows)} of {total} rows; nothing written", err=True)
            raise SystemExit(128 + getattr(exc, "signum", signal.SIGINT))
        click.echo(f"device: {sweep_.device or '?'}  torch: {torch_version or 'not timed'}  "
                   f"B={batch} H={heads} {precision}")
        click.echo(format_table(sweep_.rows))
        _write_outputs(sweep_, csv_path, json_path, plot_path)
    except BenchError as exc:
        raise InputError(str(exc)) from None
    status = _exit_status(sweep_.rows)
    if status:
        raise SystemExit(status)

