"""`attnstep bench`: times the binary's stages and flash kernels, and PyTorch's SDPA, on a shape list.

For each shape and precision it runs `build/main --bench ... --json FILE` (device events, median of
REPS after warm-up, inputs generated on the device, ceilings measured in the same run; see
cuda_src/cuda/bench.cu) and, when torch imports, times `torch.nn.functional.scaled_dot_product_attention`
in fp32 on the same shape in this process. It prints one table, the performance goals as met/missed,
and writes the results as JSON and a PNG plot (TFLOP/s against N, one line per kernel).

The shape list: the default case (`verify.generate.DEFAULT_DIMS`) and B=4, H=16, N=M in
{1024, 4096, 16384}, d in {64, 128}, causal and not.
"""
from __future__ import annotations

import json
import math
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import click

from .case import CaseError, atomic_write_bytes
from .generate import DEFAULT_DIMS
from .runner import DEFAULT_BUILD_DIR, RunnerError, ensure_built
from .stages import PRECISIONS

# "flash" is the binary's dispatcher (what `main` runs by default: wgmma on Hopper, else mma.sync,
# else the clean kernel); the others are the tensor-core kernels forced one by one.
FLASH_KERNELS = ("flash", "flash_wgmma", "flash_fast")
GOAL_KERNEL = "flash"  # the goals are about what users get by default
SDPA = "sdpa"
RESULTS_FORMAT = 1
# Work (FLOP) above which a shape gets fewer timed repetitions, to bound the run's length.
LARGE_WORK_FLOP = 2e12
BENCH_TIMEOUT_S = 900

# The performance goals: fp32 flash at least 1.5x SDPA and tf32 flash at 150 TFLOP/s at
# B4 H16 N=M=4096; the cuBLAS stages at 90% of SGEMM, the memory-bound ones at 80% of a copy.
GOAL_SHAPE = dict(batch=4, heads=16, seq_q=4096, seq_k=4096)
GOAL_FP32_VS_SDPA = 1.5
GOAL_TF32_TFLOPS = 150.0
GOAL_GEMM_FRACTION = 0.9
GOAL_MEMORY_FRACTION = 0.8
GEMM_STAGES = ("QK", "output")
MEMORY_STAGES = ("KT", "QK_scaled", "attention_weights")


class BenchError(Exception):
    """A malformed result file or a failed run, worded for the user."""


class BenchUnusable(BenchError):
    """The binary refuses --bench itself (exit 2: no CUDA build or GPU, bad options): no shape can run."""


class _UserError(click.ClickException):
    """One line on stderr and exit status 2, as every attnstep command reports bad input."""

    exit_code = 2


@dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    seq_q: int
    seq_k: int
    d: int
    causal: bool

    @property
    def id(self) -> str:
        return (f"B{self.batch}-H{self.heads}-N{self.seq_q}-M{self.seq_k}-d{self.d}"
                + ("-causal" if self.causal else ""))

    @property
    def flash_flop(self) -> float:
        """Forward FLOP: 4·B·H·N·M·d, halved when causal."""
        full = 4.0 * self.batch * self.heads * self.seq_q * self.seq_k * self.d
        return full / 2 if self.causal else full


def default_shapes() -> List[Shape]:
    dd = DEFAULT_DIMS
    shapes = [Shape(dd.batch, dd.heads, dd.seq_q, dd.seq_k, dd.d_k, False)]
    for n in (1024, 4096, 16384):
        for d in (64, 128):
            for causal in (False, True):
                shapes.append(Shape(4, 16, n, n, d, causal))
    return shapes


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


def reps_for(shape: Shape, reps: int) -> int:
    """Fewer repetitions for the largest shapes (at least 3), so a full sweep stays short."""
    return max(3, reps // 4) if shape.flash_flop > LARGE_WORK_FLOP else reps


def binary_args(shape: Shape, precision: str, warmup: int, reps: int, json_path: Path,
                check: bool, only: str) -> List[str]:
    args = ["--bench", "--batch", str(shape.batch), "--heads", str(shape.heads),
            "--seq-q", str(shape.seq_q), "--seq-k", str(shape.seq_k), "--d", str(shape.d),
            "--precision", precision, "--warmup", str(warmup), "--reps", str(reps),
            "--json", str(json_path), "--only", only]
    if shape.causal:
        args.append("--causal")
    if check:
        args.append("--check")
    return args


# ---- the binary's JSON ---------------------------------------------------------------------------
_REQUIRED = {"device": str, "shape": dict, "precision": str, "ceilings": dict, "kernels": list}
_KERNEL_REQUIRED = {"name": str, "kind": str, "status": str}


def parse_binary_json(data: dict, source: str = "bench JSON") -> dict:
    """Checks the fields verify/bench.py relies on; raises BenchError naming the first missing one."""
    if not isinstance(data, dict):
        raise BenchError(f"{source}: expected a JSON object, got {type(data).__name__}")
    for key, typ in _REQUIRED.items():
        if not isinstance(data.get(key), typ):
            raise BenchError(f"{source}: missing or malformed '{key}' (expected {typ.__name__})")
    if data["precision"] not in PRECISIONS:
        raise BenchError(f"{source}: unknown precision '{data['precision']}'")
    for i, k in enumerate(data["kernels"]):
        for key, typ in _KERNEL_REQUIRED.items():
            if not isinstance(k, dict) or not isinstance(k.get(key), typ):
                raise BenchError(f"{source}: kernels[{i}] lacks '{key}'")
        if k["status"] == "ok":
            rate_key = "gbps" if k["kind"] == "memory" else "tflops"
            for key in ("ms", rate_key):
                if not isinstance(k.get(key), (int, float)):
                    raise BenchError(f"{source}: kernels[{i}] ('{k['name']}') lacks a number '{key}'")
    return data


def run_binary_bench(binary: Path, shape: Shape, precision: str, warmup: int, reps: int,
                     check: bool, only: str = "all", timeout: float = BENCH_TIMEOUT_S) -> dict:
    """Runs `binary --bench` for one shape and returns its parsed JSON. A failed --check still
    returns the JSON (with passed = false); any other failure raises BenchError."""
    with tempfile.TemporaryDirectory(prefix="attnstep-bench-") as tmp:
        json_path = Path(tmp) / "bench.json"
        cmd = [str(binary), *binary_args(shape, precision, warmup, reps, json_path, check, only)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except FileNotFoundError:
            raise BenchError(f"binary not found: {binary}")
        except subprocess.TimeoutExpired:
            raise BenchError(f"{shape.id} {precision}: the binary did not finish in {timeout:.0f} s")
        if not json_path.exists():
            lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
            error = BenchUnusable if proc.returncode == 2 else BenchError
            raise error(f"{shape.id} {precision}: main --bench exited {proc.returncode}: "
                        + (lines[0] if lines else "no output"))
        data = json.loads(json_path.read_text())
    return parse_binary_json(data, f"{shape.id} {precision}")


# ---- PyTorch SDPA --------------------------------------------------------------------------------
def torch_available() -> Optional[str]:
    """torch's version when it imports and sees a GPU, else None."""
    try:
        import torch  # noqa: PLC0415 (optional dependency)
    except Exception:
        return None
    return torch.__version__ if torch.cuda.is_available() else None


def time_sdpa(shape: Shape, precision: str, warmup: int, reps: int, seed: int = 0) -> dict:
    """Median ms of torch SDPA on fp32 (B, H, N, d) CUDA tensors; `precision` tf32 allows TF32
    matmuls (the fused fp32 backends ignore it). Returns {"status", "ms", "tflops", "torch"}."""
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415

    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    try:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        q = torch.rand(shape.batch, shape.heads, shape.seq_q, shape.d, device="cuda", generator=gen) * 2 - 1
        k = torch.rand(shape.batch, shape.heads, shape.seq_k, shape.d, device="cuda", generator=gen) * 2 - 1
        v = torch.rand(shape.batch, shape.heads, shape.seq_k, shape.d, device="cuda", generator=gen) * 2 - 1

        def once():
            F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal)

        for _ in range(warmup):
            once()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            once()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        ms = statistics.median(times)
        return {"status": "ok", "ms": ms, "tflops": shape.flash_flop / (ms * 1e-3) / 1e12,
                "torch": torch.__version__}
    except RuntimeError as exc:  # out of memory, or no backend for the shape
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return {"status": f"failed: {first[:120]}", "torch": torch.__version__}
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
        torch.cuda.empty_cache()


# ---- results: rows, table, goals, plot -----------------------------------------------------------
@dataclass
class Row:
    shape: str
    n: int
    d: int
    causal: bool
    precision: str
    kernel: str
    kind: str
    status: str
    ms: Optional[float] = None
    rate: Optional[float] = None      # TFLOP/s (gemm, attention) or GB/s (memory)
    fraction: Optional[float] = None  # of the ceiling measured in the same run
    vs_sdpa: Optional[float] = None   # flash kernels: TFLOP/s over SDPA's on the same shape
    note: str = ""


def _shape_of(run: dict) -> Shape:
    s = run["shape"]
    return Shape(s["batch"], s["heads"], s["seq_q"], s["seq_k"], s["d"], bool(s["causal"]))


def rows_from_results(results: dict) -> List[Row]:
    """Flattens a results document (see `collect`) into one row per shape × precision × kernel."""
    rows: List[Row] = []
    for i, run in enumerate(results.get("runs", [])):
        if "error" in run:  # the binary failed on this shape; the sweep went on
            shape = _parse_id(run.get("shape", "B0-H0-N0-M0-d0"))
            rows.append(Row(shape.id, shape.seq_q, shape.d, shape.causal, run.get("precision", "?"),
                            "main --bench", "attention", f"failed: {run['error']}"))
            continue
        binary = parse_binary_json(run.get("binary"), f"runs[{i}].binary")
        shape = _shape_of(binary)
        prec = binary["precision"]
        sdpa = run.get("sdpa") or {}
        sdpa_rate = sdpa.get("tflops") if sdpa.get("status") == "ok" else None
        for k in binary["kernels"]:
            row = Row(shape.id, shape.seq_q, shape.d, shape.causal, prec, k["name"], k["kind"], k["status"])
            if k["status"] == "ok":
                row.ms = k["ms"]
                row.rate = k["gbps"] if k["kind"] == "memory" else k["tflops"]
                row.fraction = k.get("fraction")
                if k["name"] in FLASH_KERNELS and sdpa_rate:
                    row.vs_sdpa = row.rate / sdpa_rate
                notes = [k["tiles"]] if k.get("tiles") else []
                chk = k.get("check")
                if chk:
                    err = chk.get("max_rel_err")
                    notes.append(("err %.1e" % err if err is not None else "err nan")
                                 + ("" if chk.get("passed") else " FAIL"))
                row.note = "; ".join(notes)
            rows.append(row)
        if sdpa:
            row = Row(shape.id, shape.seq_q, shape.d, shape.causal, prec, SDPA, "attention",
                      sdpa.get("status", "?"))
            if sdpa.get("status") == "ok":
                row.ms, row.rate, row.vs_sdpa = sdpa["ms"], sdpa["tflops"], 1.0
                row.note = f"torch {sdpa.get('torch', '?')} fp32"
            rows.append(row)
    return rows


def _num(x: Optional[float], fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt % x


def format_table(rows: Sequence[Row]) -> str:
    header = f"{'shape':<28} {'prec':<5} {'kernel':<18} {'ms':>10} {'rate':>15} {'ceiling':>8} {'vs sdpa':>8}  note"
    lines = [header, "-" * len(header)]
    for r in rows:
        if r.status != "ok":
            lines.append(f"{r.shape:<28} {r.precision:<5} {r.kernel:<18} {'-':>10} {'-':>15} {'-':>8} {'-':>8}  {r.status}")
            continue
        unit = "GB/s" if r.kind == "memory" else "TFLOP/s"
        rate = f"{r.rate:.0f} {unit}" if r.kind == "memory" else f"{r.rate:.2f} {unit}"
        frac = _num(None if r.fraction is None else 100 * r.fraction, "%.0f%%")
        ratio = _num(r.vs_sdpa, "%.2fx")
        lines.append(f"{r.shape:<28} {r.precision:<5} {r.kernel:<18} {r.ms:>10.4f} {rate:>15} {frac:>8} {ratio:>8}  {r.note}")
    return "\n".join(lines)


def ceiling_lines(results: dict) -> List[str]:
    """The ceilings measured by the largest run of each precision (the SGEMM ceiling is on that
    run's QK shape; the copy and mma.sync ceilings do not depend on the shape). Per-run values
    are in the JSON."""
    lines, seen = [], set()

    def size(run):
        sh = (run.get("binary") or {}).get("shape") or {}
        return sh.get("seq_q", 0) * sh.get("seq_k", 0) * sh.get("d", 0)

    for run in sorted(results.get("runs", []), key=size, reverse=True):
        b = run.get("binary") or {}
        c, prec = b.get("ceilings") or {}, b.get("precision")
        if prec in seen or not c:
            continue
        seen.add(prec)
        where = _shape_of(b).id if isinstance(b.get("shape"), dict) else "?"
        parts = [f"cuBLAS SGEMM {c.get('sgemm_tflops', float('nan')):.1f} TFLOP/s",
                 f"copy {c.get('copy_gbps', float('nan')):.0f} GB/s"]
        if c.get("mma_tf32_tflops"):
            parts.append(f"mma.sync TF32 {c['mma_tf32_tflops']:.0f} TFLOP/s")
        if c.get("mma_bf16_tflops"):
            parts.append(f"mma.sync BF16 {c['mma_bf16_tflops']:.0f} TFLOP/s")
        if c.get("wgmma_tf32_tflops"):
            parts.append(f"wgmma TF32 {c['wgmma_tf32_tflops']:.0f} TFLOP/s")
        lines.append(f"ceilings ({prec}, {where}): " + ", ".join(parts))
    return lines


def _is_goal_shape(r: Row, results_shape: Dict[str, Shape]) -> bool:
    s = results_shape[r.shape]
    return (s.batch, s.heads, s.seq_q, s.seq_k) == tuple(GOAL_SHAPE.values())


def evaluate_goals(rows: Sequence[Row]) -> List[str]:
    """One line per performance goal that these rows can decide: 'met'/'MISSED' with the figure."""
    shapes = {r.shape: _parse_id(r.shape) for r in rows}
    lines: List[str] = []
    ok = [r for r in rows if r.status == "ok"]
    for r in ok:
        if r.kernel != GOAL_KERNEL or not _is_goal_shape(r, shapes):
            continue
        if r.precision == "fp32" and r.vs_sdpa is not None:
            met = r.vs_sdpa >= GOAL_FP32_VS_SDPA
            lines.append(f"{'met   ' if met else 'MISSED'} fp32 {GOAL_KERNEL} >= {GOAL_FP32_VS_SDPA}x SDPA at {r.shape}: "
                         f"{r.vs_sdpa:.2f}x ({r.rate:.1f} TFLOP/s)")
        if r.precision == "tf32" and r.d == 64:
            met = r.rate >= GOAL_TF32_TFLOPS
            lines.append(f"{'met   ' if met else 'MISSED'} tf32 {GOAL_KERNEL} >= {GOAL_TF32_TFLOPS:.0f} TFLOP/s at {r.shape}: "
                         f"{r.rate:.1f} TFLOP/s")
    for r in ok:
        if r.precision != "fp32" or r.fraction is None or not _is_goal_shape(r, shapes) or r.d != 64 or r.causal:
            continue
        if r.kernel in GEMM_STAGES:
            met = r.fraction >= GOAL_GEMM_FRACTION
            lines.append(f"{'met   ' if met else 'MISSED'} {r.kernel} >= {GOAL_GEMM_FRACTION:.0%} of cuBLAS SGEMM at {r.shape}: {r.fraction:.0%}")
        elif r.kernel in MEMORY_STAGES:
            met = r.fraction >= GOAL_MEMORY_FRACTION
            lines.append(f"{'met   ' if met else 'MISSED'} {r.kernel} >= {GOAL_MEMORY_FRACTION:.0%} of copy bandwidth at {r.shape}: {r.fraction:.0%}")
    return lines


def _parse_id(shape_id: str) -> Shape:
    """Inverse of Shape.id."""
    parts = shape_id.split("-")
    vals = {p[0]: int(p[1:]) for p in parts if p[:1] in "BHNMd" and p[1:].isdigit()}
    return Shape(vals["B"], vals["H"], vals["N"], vals["M"], vals["d"], parts[-1] == "causal")


def write_plot(rows: Sequence[Row], path: Path, title: str = "") -> None:
    """TFLOP/s against N, one line per kernel and precision; one panel per (d, causal)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    # SDPA always runs in fp32: one line for it, from the fp32 runs.
    attention = [r for r in rows if r.status == "ok" and r.kind in ("attention", "gemm") and r.rate
                 and not (r.kernel == SDPA and r.precision != "fp32")]
    panels = sorted({(r.d, r.causal) for r in attention})
    if not panels:
        raise BenchError("nothing to plot: no kernel with a TFLOP/s figure")
    # One colour per kernel in every panel, one line style per precision: a dozen lines stay
    # tellable apart (the default colour cycle repeats after ten). SDPA, the yardstick, in black.
    kernels = sorted({r.kernel for r in attention if r.kernel != SDPA})
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colour = {k: cycle[i % len(cycle)] for i, k in enumerate(kernels)}
    colour[SDPA] = "black"
    style = {"fp32": "-", "tf32": ":"}
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    for ax, (d, causal) in zip(axes[0], panels):
        series: Dict[Tuple[str, str], List[Row]] = {}
        for r in attention:
            if (r.d, r.causal) == (d, causal):
                series.setdefault((r.kernel, r.precision), []).append(r)
        for (kernel, precision), pts in sorted(series.items()):
            pts = sorted(pts, key=lambda r: r.n)
            label = kernel if kernel == SDPA else f"{kernel} {precision}"
            ax.plot([p.n for p in pts], [p.rate for p in pts], marker="o", markersize=3, label=label,
                    color=colour[kernel], linestyle="--" if kernel == SDPA else style.get(precision, "-"))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N = M")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"d={d} {'causal' if causal else 'non-causal'}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def collect(binary: Path, shapes: Iterable[Shape], precisions: Sequence[str], warmup: int, reps: int,
            check: bool, use_torch: bool, only: str, log=print) -> dict:
    """Runs every shape × precision; returns the results document (JSON-ready)."""
    torch_version = torch_available() if use_torch else None
    runs = []
    for shape in shapes:
        for prec in precisions:
            r = reps_for(shape, reps)
            t0 = time.monotonic()
            try:
                data = run_binary_bench(binary, shape, prec, warmup, r, check, only)
            except BenchUnusable:
                raise
            except BenchError as exc:  # one shape failing must not lose the others' numbers
                runs.append({"shape": shape.id, "precision": prec, "error": str(exc)})
                log(f"bench: {shape.id} {prec}: FAILED: {exc}")
                continue
            run = {"binary": data}
            if torch_version and only != "stages":
                run["sdpa"] = time_sdpa(shape, prec, warmup, r)
            runs.append(run)
            log(f"bench: {shape.id} {prec}: {time.monotonic() - t0:.1f} s")
    device = next((r["binary"]["device"] for r in runs if "binary" in r), "?")
    return {"tool": "attnstep bench", "format": RESULTS_FORMAT, "device": device,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": torch_version,
            "runs": runs}


def load_results(path: Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise BenchError(f"{path}: cannot read results JSON: {exc}")
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        raise BenchError(f"{path}: not a bench results file (no 'runs' list)")
    return data


@click.command("bench")
@click.option("--build-dir", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_BUILD_DIR,
              show_default=True, help="CMake build folder; built incrementally when needed.")
@click.option("--binary", type=click.Path(exists=True, dir_okay=False, resolve_path=True, path_type=Path),
              help="Time this prebuilt binary instead of building BUILD_DIR/main.")
@click.option("--shape", "shape_specs", multiple=True, metavar="B,H,N,M,D[,causal]",
              help="Benchmark this shape instead of the default list (repeatable).")
@click.option("--precision", type=click.Choice(PRECISIONS + ("both",)), default="both", show_default=True,
              help="Flash kernels and cuBLAS stages in fp32 (3xTF32 flash), tf32, or both.")
@click.option("--warmup", type=click.IntRange(min=0), default=3, show_default=True, help="Untimed runs first.")
@click.option("--reps", type=click.IntRange(min=1), default=20, show_default=True,
              help="Timed runs (median); a quarter of them, at least 3, for the largest shapes.")
@click.option("--only", type=click.Choice(("all", "stages", "flash")), default="all", show_default=True,
              help="Time the stage path, the flash kernels, or both.")
@click.option("--check/--no-check", default=True, show_default=True,
              help="Compare sampled flash rows with float64 inside the binary.")
@click.option("--torch/--no-torch", "use_torch", default=True, show_default=True,
              help="Also time PyTorch SDPA (fp32) when torch imports and sees a GPU.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write all results as JSON to this file.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write a PNG plot of TFLOP/s against N per kernel.")
@click.option("--from-json", "from_json", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Do not run anything: print the table, goals and plot of an earlier --json file.")
def bench(build_dir, binary, shape_specs, precision, warmup, reps, only, check, use_torch, json_path, plot_path,
          from_json):
    """Time every stage and flash kernel of the binary, and PyTorch SDPA, over a shape list.

    Runs `main --bench` (built in BUILD_DIR) for each shape of the default list (the demo's case;
    B=4, H=16, N=M of 1024, 4096 and 16384, d of 64 and 128, causal and not) or each --shape, in
    each precision; prints a table of ms, TFLOP/s or GB/s, the fraction of the ceilings the binary
    measured in the same run (cuBLAS SGEMM, device copy) and the flash kernels' speed over SDPA's;
    then the performance goals as met/missed. Exit status 1 when a flash kernel fails its float64
    check.
    """
    try:
        if from_json:
            results = load_results(from_json)
        else:
            for path in (json_path, plot_path):  # before minutes of GPU work, not after
                if path is not None and not path.resolve().parent.is_dir():
                    raise BenchError(f"{path}: its folder does not exist")
            shapes = [parse_shape(s) for s in shape_specs] or default_shapes()
            binary = binary or ensure_built(build_dir, progress=lambda m: click.echo(f"  {m}", err=True))
            precisions = PRECISIONS if precision == "both" else (precision,)
            results = collect(binary, shapes, precisions, warmup, reps, check, use_torch, only,
                              log=lambda m: click.echo(m, err=True))
            if json_path:
                atomic_write_bytes(json_path, (json.dumps(results, indent=1) + "\n").encode())
        rows = rows_from_results(results)
        click.echo(f"device: {results.get('device', '?')}  date: {results.get('date', '?')}  "
                   f"torch: {results.get('torch') or 'not timed'}")
        click.echo(format_table(rows))
        for line in ceiling_lines(results):
            click.echo(line)
        goals = evaluate_goals(rows)
        if goals:
            click.echo("performance goals:")
            for line in goals:
                click.echo("  " + line)
        if plot_path:
            write_plot(rows, plot_path, f"attnstep bench on {results.get('device', '?')}")
    except (BenchError, RunnerError, CaseError) as exc:
        raise _UserError(str(exc)) from None
    failed = [r for r in rows if "FAIL" in r.note]
    crashed = [r for r in rows if r.status.startswith("failed:")]
    if failed:
        click.echo(f"bench: {len(failed)} flash result(s) failed the float64 check", err=True)
    if crashed:
        click.echo(f"bench: main --bench failed on {len(crashed)} shape(s); see the table", err=True)
    if failed or crashed:
        raise SystemExit(1)


if __name__ == "__main__":
    bench()
