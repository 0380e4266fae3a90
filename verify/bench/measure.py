"""`attnstep bench`: times the binary's stages and flash kernels, forward and backward, and PyTorch's
SDPA, on a shape list.

For each shape and precision it runs `build/main --bench ... --json FILE` (device events, median of
REPS after warm-up, inputs generated on the device, ceilings measured in the same run; see
cuda_src/bench/bench.cu) and, when torch imports, times SDPA's forward and backward in fp32 on the
same shape in this process (sdpa.py); at bf16/fp16 SDPA's forward at that dtype, once per
backend, the fastest being the yardstick, and under --check the errors of the binary's flash and of
SDPA on the binary's own inputs (accuracy.py). It prints one table, the goals (goals.py)
as met/missed, and writes the results as JSON and a PNG plot (TFLOP/s against N, one line per kernel).

The shape list: the default case (`verify.files.generate.DEFAULT_DIMS`) and B=4, H=16, N=M in
{1024, 4096, 16384}, d in {64, 128}, causal and not.
"""
from __future__ import annotations

import contextlib
import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterable, List, Sequence, Tuple

import click
import numpy as np

from ..cli.options import InputError, binary_option, build_option, json_option, timeout_option, user_errors
from ..files.case import atomic_write_bytes
from ..files.generate import DEFAULT_DIMS
from ..report.json_file import jsonable
from ..runs.runner import ensure_built
from ..stages import FLOAT32_PRECISIONS, HALF_PRECISIONS, PRECISIONS
from ..text import plural
from .accuracy import half_accuracy
from .goals import evaluate_goals
from .plot import write_plot
from .report import (ACCURACY, BACKWARD, FORWARD, PASSES, SDPA, SDPA_BACKENDS, SDPA_BACKWARD, VS_SDPA,
                     BenchError, Row, Shape, ceiling_lines, fastest_sdpa, format_table, load_results,
                     parse_binary_json, parse_shape_id, ratios_to_backends, rows_from_results)
from .sdpa import (SDPA_BACKENDS as BACKEND_NAMES, sdpa_output, time_sdpa, time_sdpa_backends,
                   time_sdpa_backward, torch_available)

__all__ = ["BenchError", "BenchOutOfMemory", "BenchUnusable", "Row", "Shape", "bench", "binary_args", "collect",
           "default_shapes", "evaluate_goals", "format_table", "parse_binary_json", "parse_shape", "parse_shape_id",
           "reps_for", "rows_from_results", "run_binary_bench", "time_sdpa", "time_sdpa_backward", "torch_available",
           "write_plot"]

RESULTS_FORMAT = 1
# Work (FLOP) above which a shape gets fewer timed repetitions, to bound the run's length.
LARGE_WORK_FLOP = 2e12
BENCH_TIMEOUT_S = 900
# The sweep besides the default case: every N and d, causal and not, at this batch and head count.
SWEEP_BATCH, SWEEP_HEADS = 4, 16
SWEEP_SEQ = (1024, 4096, 16384)
SWEEP_D = (64, 128)
# `--pass`: one of PASSES, or both.
BOTH = "both"
# `--precision`: one precision, or one of these groups.
PRECISION_GROUPS = {BOTH: FLOAT32_PRECISIONS, "half": HALF_PRECISIONS, "all": PRECISIONS}


class BenchUnusable(BenchError):
    """The binary refuses --bench itself (exit 2: no CUDA build or GPU, bad options): no shape can run."""


def default_shapes() -> List[Shape]:
    dd = DEFAULT_DIMS
    return [Shape(dd.batch, dd.heads, dd.seq_q, dd.seq_k, dd.d_k, False)] + [
        Shape(SWEEP_BATCH, SWEEP_HEADS, n, n, d, causal)
        for n in SWEEP_SEQ for d in SWEEP_D for causal in (False, True)]


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


def reps_for(shape: Shape, reps: int, large_flop: float = LARGE_WORK_FLOP) -> int:
    """Fewer repetitions (a quarter, at least 3) for shapes of more than `large_flop` forward FLOP,
    so a full sweep stays short."""
    return max(3, reps // 4) if shape.flash_flop > large_flop else reps


def binary_args(shape: Shape, precision: str, warmup: int, reps: int, json_path: Path,
                check: bool, only: str, passes: str = BOTH, ceilings: bool = True) -> List[str]:
    args = ["--bench", "--batch", str(shape.batch), "--heads", str(shape.heads),
            "--seq-q", str(shape.seq_q), "--seq-k", str(shape.seq_k), "--d", str(shape.d),
            "--precision", precision, "--warmup", str(warmup), "--reps", str(reps),
            "--json", str(json_path), "--only", only, "--pass", passes]
    if shape.causal:
        args.append("--causal")
    if check:
        args.append("--check")
    if not ceilings:
        args.append("--no-ceilings")
    return args


def passes_of(passes: str) -> Tuple[str, ...]:
    """The passes a `--pass` value times."""
    return PASSES if passes == BOTH else (passes,)


class BenchOutOfMemory(BenchError):
    """The binary ran out of device memory on this shape."""


# The binary's exit statuses that say something about the run as a whole: 2 no CUDA build or
# GPU (or bad options), 3 not enough memory.
_EXIT_ERRORS = {2: BenchUnusable, 3: BenchOutOfMemory}
# How a CUDA allocation that failed reads in the binary's one-line error (exit 1: CUDA's own
# error name and string, cuda_src/cuda/cuda_check.cuh).
_OUT_OF_MEMORY_WORDS = ("cudaErrorMemoryAllocation", "out of memory")


def _bench_error(returncode: int, output: str):
    """The BenchError class for a failed `main --bench`."""
    if returncode == 1 and any(w in output for w in _OUT_OF_MEMORY_WORDS):
        return BenchOutOfMemory
    return _EXIT_ERRORS.get(returncode, BenchError)


def _run_watched(cmd: List[str], timeout: float, monitor) -> Tuple[int, str]:
    """Runs cmd inside `monitor(pid)` (a context manager, or None) and returns its exit status and
    output (stderr first). The process is killed when anything interrupts the wait."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with monitor(proc.pid) if monitor else contextlib.nullcontext():
            out, err = proc.communicate(timeout=timeout)
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    return proc.returncode, err + out


def run_binary_bench(binary: Path, shape: Shape, precision: str, warmup: int, reps: int,
                     check: bool, only: str = "all", timeout: float = BENCH_TIMEOUT_S, monitor=None,
                     passes: str = BOTH, ceilings: bool = True) -> dict:
    """Runs `binary --bench` for one shape and returns its parsed JSON. A failed --check still
    returns the JSON (with passed = false); any other failure raises BenchError (BenchUnusable,
    BenchOutOfMemory by the binary's exit status). `monitor(pid)`, when given, is entered while
    the binary runs (e.g. to sample its device memory)."""
    with tempfile.TemporaryDirectory(prefix="attnstep-bench-") as tmp:
        json_path = Path(tmp) / "bench.json"
        cmd = [str(binary), *binary_args(shape, precision, warmup, reps, json_path, check, only, passes, ceilings)]
        try:
            returncode, output = _run_watched(cmd, timeout, monitor)
        except FileNotFoundError:
            raise BenchError(f"binary not found: {binary}")
        except subprocess.TimeoutExpired:
            raise BenchError(f"{shape.id} {precision}: the binary did not finish in {timeout:.0f} s")
        if not json_path.exists():
            lines = [ln for ln in output.splitlines() if ln.strip()]
            error = _bench_error(returncode, output)
            raise error(f"{shape.id} {precision}: main --bench exited {returncode}: "
                        + (lines[0] if lines else "no output"))
        data = json.loads(json_path.read_text())
    return parse_binary_json(data, f"{shape.id} {precision}")


# ---- the sweep -----------------------------------------------------------------------------------
# SDPA's timing of each pass, under the run's key of the same name.
_SDPA_TIMERS = {FORWARD: (SDPA, time_sdpa), BACKWARD: (SDPA_BACKWARD, time_sdpa_backward)}


def _sdpa_runs(shape: Shape, prec: str, passes: str, warmup: int, reps: int) -> dict:
    """SDPA's timings for one run, by the run's keys: each pass asked for at fp32/tf32; at bf16/fp16
    the forward alone (the binary times no half backward), every backend forced in turn, the
    fastest being the run's SDPA."""
    if prec not in HALF_PRECISIONS:
        return {name: timer(shape, prec, warmup, reps) for name, timer in (_SDPA_TIMERS[p] for p in passes_of(passes))}
    if FORWARD not in passes_of(passes):
        return {}
    backends = time_sdpa_backends(shape, prec, warmup, reps)
    return {SDPA: fastest_sdpa(backends), SDPA_BACKENDS: backends}


def _sdpa_accuracy(binary: dict) -> dict:
    """The accuracy comparison on the binary's inputs; a failure of it is kept as its 'error'."""
    prec = binary["precision"]
    shape = binary["shape"]

    scale = float(np.float32(shape["scale"]))  # the binary's float32 scale, as the reference takes it

    def sdpa(q, k, v, rows, backend):
        return sdpa_output(q, k, v, rows, scale, bool(shape["causal"]), prec, backend)

    try:
        return half_accuracy(binary, sdpa, tuple(BACKEND_NAMES))
    except BenchError as exc:
        return {"error": str(exc)}


def _half_extras(run: dict, check: bool) -> None:
    """At bf16/fp16: each flash kernel's ratio to each SDPA backend and, under --check, the errors
    of the binary's flash and of SDPA on the same inputs."""
    binary = run["binary"]
    if run.get(SDPA_BACKENDS):
        run[VS_SDPA] = ratios_to_backends(binary, run[SDPA_BACKENDS])
    if check and binary.get("check_sample") and run.get(SDPA_BACKENDS):
        run[ACCURACY] = _sdpa_accuracy(binary)


def collect(binary: Path, shapes: Iterable[Shape], precisions: Sequence[str], warmup: int, reps: int,
            check: bool, use_torch: bool, only: str, log=print, timeout: float = BENCH_TIMEOUT_S,
            passes: str = BOTH, ceilings: bool = True) -> dict:
    """Runs every shape × precision; returns the results document (JSON-ready)."""
    torch_version = torch_available() if use_torch else None
    runs = []
    for shape in shapes:
        for prec in precisions:
            r = reps_for(shape, reps)
            t0 = time.monotonic()
            try:
                data = run_binary_bench(binary, shape, prec, warmup, r, check, only, timeout,
                                        passes=passes, ceilings=ceilings)
            except BenchUnusable:
                raise
            except BenchError as exc:  # one shape failing must not lose the others' numbers
                runs.append({"shape": shape.id, "precision": prec, "error": str(exc)})
                log(f"bench: {shape.id} {prec}: FAILED: {exc}")
                continue
            run = {"binary": data}
            if torch_version and only != "stages":
                run.update(_sdpa_runs(shape, prec, passes, warmup, r))
                if prec in HALF_PRECISIONS:
                    _half_extras(run, check)
            runs.append(run)
            log(f"bench: {shape.id} {prec}: {time.monotonic() - t0:.1f} s")
    device = next((r["binary"]["device"] for r in runs if "binary" in r), "?")
    return {"tool": "attnstep bench", "format": RESULTS_FORMAT, "device": device,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": torch_version,
            "runs": runs}


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


@click.command("bench")
@build_option
@binary_option.but(help="Time this prebuilt binary instead of building BUILD_DIR/main.")
@click.option("--shape", "shape_specs", multiple=True, metavar="B,H,N,M,D[,causal]",
              help="Benchmark this shape instead of the default list (repeatable).")
@click.option("--precision", type=click.Choice(PRECISIONS + tuple(PRECISION_GROUPS)), default=BOTH, show_default=True,
              help="Flash kernels and cuBLAS stages in fp32 (3xTF32 flash), tf32, bf16 or fp16 (the forward "
                   "alone, against SDPA at that dtype, each backend); both: fp32 and tf32; half: bf16 and fp16; "
                   "all: the four.")
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
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write a PNG plot of TFLOP/s against N per kernel.")
@click.option("--from-json", "from_json", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Do not run anything: print the table, goals and plot of an earlier --json file.")
@user_errors
def bench(build_dir, binary, shape_specs, precision, warmup, reps, only, passes, check, ceilings, use_torch, timeout,
          json_path, plot_path, from_json):
    """Time every stage and flash kernel of the binary, forward and backward, and PyTorch SDPA,
    over a shape list.

    Runs `main --bench` (built in BUILD_DIR) for each shape of the default list or each --shape,
    in each precision; prints a table of ms, TFLOP/s or GB/s, the fraction of the ceilings the
    binary measured in the same run (cuBLAS SGEMM, device copy) and the flash kernels' speed over
    SDPA's (the backward's over SDPA's backward; at bf16/fp16 over SDPA's fastest backend at that
    dtype, and over each); then the goals as met/missed, at bf16/fp16 with --check the flash
    error against float64 beside SDPA's on the same inputs. Backward TFLOP/s count 2.5x the
    forward's FLOPs. Exit status 1 when a checked result fails its float64 check.
    """
    try:
        if from_json:
            results = load_results(from_json)
        else:
            for path in (json_path, plot_path):  # before minutes of GPU work, not after
                if path is not None and not path.resolve().parent.is_dir():
                    raise BenchError(f"{path}: its folder does not exist")
            shapes = [parse_shape(s) for s in shape_specs] or default_shapes()
            precisions = PRECISION_GROUPS.get(precision, (precision,))
            results = collect(binary or ensure_built(build_dir), shapes, precisions, warmup, reps, check,
                              use_torch, only, log=lambda m: click.echo(m, err=True), timeout=timeout,
                              passes=passes, ceilings=ceilings)
            if json_path:
                atomic_write_bytes(json_path, (json.dumps(jsonable(results), indent=1) + "\n").encode())
        rows = rows_from_results(results)
        _print_results(results, rows)
        if plot_path:
            write_plot(rows, plot_path, f"attnstep bench on {results.get('device', '?')}")
    except BenchError as exc:
        raise InputError(str(exc)) from None
    status = _exit_status(rows)
    if status:
        raise SystemExit(status)


if __name__ == "__main__":
    bench()
