"""What `attnstep bench` runs (its command: verify/cli/bench.py): the binary's stages and flash
kernels timed, forward and backward, and PyTorch's SDPA, on a shape list.

For each shape and precision it runs `build/main --bench ... --json FILE` (device events, median of
REPS after warm-up, inputs generated on the device, ceilings measured in the same run; see
cuda_src/bench/bench.cu) and, when torch imports, times SDPA's forward and backward in fp32 on the
same shape in this process (sdpa.py); at bf16/fp16 SDPA's forward and backward at that dtype, once
per backend, the fastest of each pass being its yardstick, and under --check the errors of the
binary's flash forward and of SDPA's on the binary's own inputs (accuracy.py). collect() returns
the results document; the command prints it as one table with the goals (goals.py) as met/missed, and writes it as JSON and a PNG
plot (TFLOP/s against N, one line per kernel).

The shape list: the default case (`verify.files.generate.DEFAULT_DIMS`) and B=4, H=16, N=M in
{1024, 4096, 16384}, d in {64, 128}, causal and not. A shape may carry a variant (shape.py: grouped
K/V heads, alignment, window, softcap, ALiBi), passed to the binary; SDPA is timed on plain shapes
only (the variants' goals compare the binary with itself: variant_goals.py, whose preset is a list
of runs, each a shape, a precision and the passes: collect_runs).
"""
from __future__ import annotations

import contextlib
import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterable, List, Sequence, Tuple

import numpy as np

from ..files.generate import DEFAULT_DIMS
from ..stages import HALF_PRECISIONS
from ..variant import TOP_LEFT
from .accuracy import half_accuracy
from .goals import evaluate_goals
from .plot import write_plot
from .report import (ACCURACY, BACKWARD, FORWARD, PASSES, SDPA, SDPA_BACKENDS, SDPA_BACKWARD, SDPA_RUN_KEYS,
                     VS_SDPA, BenchError, Row, Shape, fastest_sdpa, format_table, parse_binary_json,
                     parse_shape_id, ratios_to_backends, rows_from_results)
from .results_file import RESULTS_FORMAT
from .shape import NO_WINDOW
from .sdpa import (SDPA_BACKENDS as BACKEND_NAMES, sdpa_output, time_sdpa, time_sdpa_backends,
                   time_sdpa_backward, torch_available)

__all__ = ["BenchError", "BenchOutOfMemory", "BenchUnusable", "Row", "Shape", "binary_args", "collect",
           "collect_runs", "default_shapes", "variant_args", "evaluate_goals", "format_table", "parse_binary_json",
           "parse_shape_id", "reps_for",
           "rows_from_results", "run_binary_bench", "time_sdpa", "time_sdpa_backward", "torch_available",
           "write_plot"]

# Work (FLOP) above which a shape gets fewer timed repetitions, to bound the run's length.
LARGE_WORK_FLOP = 2e12
BENCH_TIMEOUT_S = 900
# The sweep besides the default case: every N and d, causal and not, at this batch and head count.
SWEEP_BATCH, SWEEP_HEADS = 4, 16
SWEEP_SEQ = (1024, 4096, 16384)
SWEEP_D = (64, 128)
# `--pass`: one of PASSES, or both.
BOTH = "both"

class BenchUnusable(BenchError):
    """The binary refuses --bench itself (exit 2: no CUDA build or GPU, bad options): no shape can run."""


def default_shapes() -> List[Shape]:
    dd = DEFAULT_DIMS
    return [Shape(dd.batch, dd.heads, dd.seq_q, dd.seq_k, dd.d_k, False)] + [
        Shape(SWEEP_BATCH, SWEEP_HEADS, n, n, d, causal)
        for n in SWEEP_SEQ for d in SWEEP_D for causal in (False, True)]


def reps_for(shape: Shape, reps: int, large_flop: float = LARGE_WORK_FLOP) -> int:
    """Fewer repetitions (a quarter, at least 3) for shapes of more than `large_flop` forward FLOP,
    so a full sweep stays short."""
    return max(3, reps // 4) if shape.flash_flop > large_flop else reps


def variant_args(shape: Shape) -> List[str]:
    """The binary's options for the shape's variant (none for a plain shape)."""
    args = ["--kv-heads", str(shape.kv_heads)] if shape.grouped else []
    if shape.causal:
        args.append("--causal")
    if shape.align != TOP_LEFT:
        args += ["--align", shape.align]
    if shape.window != NO_WINDOW:
        args += ["--window", "{},{}".format(*shape.window)]
    if shape.softcap:
        args += ["--softcap", repr(float(shape.softcap))]
    if shape.alibi:
        args.append("--alibi")
    return args


def binary_args(shape: Shape, precision: str, warmup: int, reps: int, json_path: Path,
                check: bool, only: str, passes: str = BOTH, ceilings: bool = True) -> List[str]:
    args = ["--bench", "--batch", str(shape.batch), "--heads", str(shape.heads),
            "--seq-q", str(shape.seq_q), "--seq-k", str(shape.seq_k), "--d", str(shape.d),
            "--precision", precision, "--warmup", str(warmup), "--reps", str(reps),
            "--json", str(json_path), "--only", only, "--pass", passes, *variant_args(shape)]
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
        except OSError as exc:  # no shape can run
            raise BenchUnusable(f"cannot run {binary}: {exc.strerror or exc}; HINT: is it executable (chmod +x)?")
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
    """SDPA's timings for one run, by the run's keys (SDPA_RUN_KEYS), each pass asked for: at
    fp32/tf32 torch's own choice of backend; at bf16/fp16 every backend forced in turn, the fastest
    being the pass's SDPA."""
    if prec not in HALF_PRECISIONS:
        return {name: timer(shape, prec, warmup, reps) for name, timer in (_SDPA_TIMERS[p] for p in passes_of(passes))}
    out = {}
    for pass_ in passes_of(passes):
        fastest_key, backends_key = SDPA_RUN_KEYS[pass_]
        backends = time_sdpa_backends(shape, prec, warmup, reps, pass_)
        out.update({fastest_key: fastest_sdpa(backends), backends_key: backends})
    return out


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
    """At bf16/fp16: each flash kernel's ratio to each SDPA backend of its pass and, under --check,
    the errors of the binary's flash forward and of SDPA's on the same inputs."""
    binary = run["binary"]
    timed = [(pass_, run[key]) for pass_, (_, key) in SDPA_RUN_KEYS.items() if run.get(key)]
    if timed:
        run[VS_SDPA] = {kernel: ratios for pass_, backends in timed
                        for kernel, ratios in ratios_to_backends(binary, backends, pass_).items()}
    if check and binary.get("check_sample") and run.get(SDPA_BACKENDS):
        run[ACCURACY] = _sdpa_accuracy(binary)


# One run of the binary: a shape, a precision and the passes (`--pass`).
Run = Tuple[Shape, str, str]


def collect(binary: Path, shapes: Iterable[Shape], precisions: Sequence[str], warmup: int, reps: int,
            check: bool, use_torch: bool, only: str, log=print, timeout: float = BENCH_TIMEOUT_S,
            passes: str = BOTH, ceilings: bool = True) -> dict:
    """Runs every shape × precision; returns the results document (JSON-ready)."""
    runs = [(shape, prec, passes) for shape in shapes for prec in precisions]
    return collect_runs(binary, runs, warmup, reps, check, use_torch, only, log, timeout, ceilings)


def _measure(binary: Path, run: Run, warmup: int, reps: int, check: bool, torch_version, only: str,
             timeout: float, ceilings: bool) -> dict:
    """One run of the binary, and SDPA's on the same problem (plain shapes only: SDPA is no
    yardstick of a variant here)."""
    shape, prec, passes = run
    data = run_binary_bench(binary, shape, prec, warmup, reps, check, only, timeout, passes=passes,
                            ceilings=ceilings)
    result = {"binary": data}
    if torch_version and only != "stages" and shape.plain:
        result.update(_sdpa_runs(shape, prec, passes, warmup, reps))
        if prec in HALF_PRECISIONS:
            _half_extras(result, check)
    return result


def collect_runs(binary: Path, runs: Sequence[Run], warmup: int, reps: int, check: bool, use_torch: bool,
                 only: str, log=print, timeout: float = BENCH_TIMEOUT_S, ceilings: bool = True,
                 all_reps: bool = False) -> dict:
    """Runs each (shape, precision, passes) in turn; returns the results document (JSON-ready). A
    run that fails is recorded and the others go on. `all_reps`: every run times `reps` (runs
    compared with each other), else the largest get fewer (reps_for)."""
    torch_version = torch_available() if use_torch else None
    results = []
    for shape, prec, passes in runs:
        t0 = time.monotonic()
        try:
            results.append(_measure(binary, (shape, prec, passes), warmup, reps if all_reps else reps_for(shape, reps),
                                    check, torch_version, only, timeout, ceilings))
        except BenchError as exc:  # one shape failing must not lose the others' numbers
            # Unusable before any run measured: the binary cannot bench at all. After one, only
            # this run failed (a shape the binary refuses), and the measured ones are kept.
            if isinstance(exc, BenchUnusable) and not any("binary" in r for r in results):
                raise
            results.append({"shape": shape.id, "precision": prec, "error": str(exc)})
            log(f"bench: {shape.id} {prec}: FAILED: {exc}")
            continue
        log(f"bench: {shape.id} {prec}: {time.monotonic() - t0:.1f} s")
    device = next((r["binary"]["device"] for r in results if "binary" in r), "?")
    return {"tool": "attnstep bench", "format": RESULTS_FORMAT, "device": device,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": torch_version,
            "runs": results}
