"""What `attnstep sweep` runs (its command: verify/cli/sweep.py): the benchmarking table over a grid of
head widths and sequence lengths.

For every d, N = M and masking of the grid, and every kernel of KERNELS, one row: the median
time, TFLOP/s by the pass's work (forward 4·B·H·N·M·d, halved when causal, the backward 2.5 times
that; the same figure for every kernel of a pass so that rows compare), the peak device memory and
a status (ok, OOM, unsupported, failed). The binary's kernels run as `main --bench --only ...
--pass ... --no-ceilings`, one process per row (so each row's memory is its own, CUDA context
included, sampled with nvidia-smi); PyTorch SDPA runs in this process (torch's own peak counter).
Results are written only once the whole grid is done.
"""
from __future__ import annotations

import csv
import io
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

from ..text import plural
from .device_memory import PeakDeviceMemory
from .measure import BenchOutOfMemory, BenchUnusable, reps_for, run_binary_bench
from .report import (BACKWARD, FLASH_BACKWARD, FLASH_DISPATCHER, FORWARD, OOM, SDPA, STAGE_PATH_BACKWARD,
                     STAGE_PATH_SKIPPED, BenchError, Row, Shape, kernel_note)
from .results_file import RESULTS_FORMAT
from .sdpa import time_sdpa, time_sdpa_backward

SWEEP_D = (16, 32, 64, 128)
SWEEP_SEQ = tuple(128 << i for i in range(8))  # 128, 256, ..., 16384
SWEEP_BATCH, SWEEP_HEADS = 8, 1
# Forward work (FLOP) above which a shape is timed with a quarter of the repetitions: the
# largest shapes of the default grid (N = 16384 from d = 32 on, N = 8192 at d = 128).
SWEEP_LARGE_FLOP = 2.5e11
MASKINGS = {"both": (False, True), "yes": (True,), "no": (False,)}
STAGE_PATH = "stages"
# SDPA runs in fp32 whatever the binary's precision: its fused backends take no TF32 setting.
SDPA_PRECISION = "fp32"
MISSING = "-"


@dataclass(frozen=True)
class SweepKernel:
    name: str
    direction: str        # FORWARD or BACKWARD: `main --bench --pass` that times it
    only: Optional[str]   # `main --bench --only` that times it; None: PyTorch SDPA in this process
    row: Optional[str] = None  # the binary's row that holds its time; None: the sum of every row

    @property
    def key(self) -> str:
        """Its name for --kernel: the forward's bare, the backward's with '-backward'."""
        return self.name if self.direction == FORWARD else f"{self.name}-{self.direction}"

    @property
    def label(self) -> str:
        """Its name in the plot, as bench names the same kernel."""
        return self.name if self.direction == FORWARD else f"{self.name}_{self.direction}"

    def flop(self, shape: Shape) -> float:
        return shape.flash_flop if self.direction == FORWARD else shape.backward_flop


# The rows of each shape, in order: the forward stage path is the sum of its stages' times; the
# backward stage path is timed as one unit by the binary.
KERNELS = (
    SweepKernel(STAGE_PATH, FORWARD, "stages"),
    SweepKernel(FLASH_DISPATCHER, FORWARD, "flash", FLASH_DISPATCHER),
    SweepKernel(SDPA, FORWARD, None),
    SweepKernel(STAGE_PATH, BACKWARD, "stages", STAGE_PATH_BACKWARD),
    SweepKernel(FLASH_DISPATCHER, BACKWARD, "flash", FLASH_BACKWARD),
    SweepKernel(SDPA, BACKWARD, None),
)
KERNEL_NAMES = tuple(k.key for k in KERNELS)
SDPA_TIMERS = {FORWARD: time_sdpa, BACKWARD: time_sdpa_backward}


@dataclass
class SweepRow:
    kernel: str
    direction: str
    d: int
    seq: int
    causal: bool
    batch: int
    heads: int
    precision: str
    status: str
    ms: Optional[float] = None
    tflops: Optional[float] = None
    peak_mib: Optional[float] = None
    note: str = ""


COLUMNS = tuple(f.name for f in fields(SweepRow))


@dataclass(frozen=True)
class Settings:
    precision: str
    warmup: int
    reps: int
    check: bool
    timeout: float


def grid(ds: Sequence[int], seqs: Sequence[int], masks: Sequence[bool], batch: int, heads: int) -> List[Shape]:
    """Every (d, masking, N = M), d outermost."""
    return [Shape(batch, heads, n, n, d, causal) for d in ds for causal in masks for n in seqs]


def _row(kernel: SweepKernel, shape: Shape, precision: str, status: str) -> SweepRow:
    return SweepRow(kernel.name, kernel.direction, shape.d, shape.seq_q, shape.causal, shape.batch, shape.heads,
                    precision, status)


def _timed(row: SweepRow, kernel: SweepKernel, shape: Shape, ms: float) -> SweepRow:
    row.ms, row.tflops = ms, kernel.flop(shape) / (ms * 1e-3) / 1e12
    return row


def _stage_path_timing(kernels: List[dict]) -> Tuple[str, Optional[float], str]:
    """The stage path's (status, ms, note): the sum of its stages' times; OOM when the binary
    skipped it for memory."""
    if any(k["status"] == STAGE_PATH_SKIPPED for k in kernels):
        return OOM, None, ""
    bad = next((k for k in kernels if k["status"] != "ok"), None)
    if bad is not None:
        return f"{bad['name']}: {bad['status']}", None, ""
    return "ok", sum(k["ms"] for k in kernels), plural(len(kernels), 'stage')


def _named_timing(kernels: List[dict], name: str) -> Tuple[str, Optional[float], str]:
    k = next((k for k in kernels if k["name"] == name), None)
    if k is None:
        return f"failed: main --bench reported no '{name}'", None, ""
    if k["status"] == STAGE_PATH_SKIPPED:
        return OOM, None, ""
    return k["status"], k.get("ms") if k["status"] == "ok" else None, kernel_note(k)


def binary_timing(kernel: SweepKernel, data: dict) -> Tuple[str, Optional[float], str]:
    """(status, ms, note) of `kernel` from the binary's --bench JSON (its rows of kernel's pass; a
    row without "pass" is the forward's)."""
    rows = [k for k in data["kernels"] if k.get("pass", FORWARD) == kernel.direction]
    if kernel.row is None:
        return _stage_path_timing(rows)
    return _named_timing(rows, kernel.row)


class Sweep:
    """Times kernels shape by shape; `rows` holds what is done, `device` the GPU's name."""

    def __init__(self, binary: Optional[Path], settings: Settings, torch_version: Optional[str]):
        self.binary, self.settings, self.torch_version = binary, settings, torch_version
        self.device: Optional[str] = None
        self.rows: List[SweepRow] = []

    def run(self, shapes: Sequence[Shape], kernels: Sequence[SweepKernel], advance: Callable = lambda: None) -> None:
        for shape in shapes:
            for kernel in kernels:
                timer = self._time_binary if kernel.only else self._time_sdpa
                self.rows.append(timer(shape, kernel))
                advance()

    def _reps(self, shape: Shape) -> int:
        return reps_for(shape, self.settings.reps, SWEEP_LARGE_FLOP)

    def _time_binary(self, shape: Shape, kernel: SweepKernel) -> SweepRow:
        s = self.settings
        memory = PeakDeviceMemory()
        row = _row(kernel, shape, s.precision, "ok")
        try:
            data = run_binary_bench(self.binary, shape, s.precision, s.warmup, self._reps(shape), s.check,
                                    kernel.only, s.timeout, monitor=memory.watch, passes=kernel.direction,
                                    ceilings=False)
        except BenchOutOfMemory:
            row.status = OOM
        except BenchError as exc:  # one shape failing must not lose the others' rows
            # Unusable before the binary timed any row: it cannot bench at all (no GPU).
            if isinstance(exc, BenchUnusable) and self.device is None:
                raise
            row.status = f"failed: {exc}"
        else:
            self.device = self.device or data["device"]
            row.status, ms, row.note = binary_timing(kernel, data)
            if ms is not None:
                _timed(row, kernel, shape, ms)
        row.peak_mib = memory.peak_mib
        return row

    def _time_sdpa(self, shape: Shape, kernel: SweepKernel) -> SweepRow:
        result = SDPA_TIMERS[kernel.direction](shape, SDPA_PRECISION, self.settings.warmup, self._reps(shape))
        row = _row(kernel, shape, SDPA_PRECISION, result["status"])
        if result["status"] == "ok":
            _timed(row, kernel, shape, result["ms"])
            row.peak_mib = result.get("peak_mib")
            row.note = f"torch {result.get('torch', '?')}"
        return row

    def document(self) -> dict:
        s = self.settings
        return {"tool": "attnstep sweep", "format": RESULTS_FORMAT, "device": self.device or "?",
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": self.torch_version,
                "precision": s.precision, "warmup": s.warmup, "reps": s.reps, "large_flop": SWEEP_LARGE_FLOP,
                "columns": list(COLUMNS), "rows": [asdict(r) for r in self.rows]}


# ---- output --------------------------------------------------------------------------------------
def _num(x: Optional[float], fmt: str, missing: str = MISSING) -> str:
    return missing if x is None else fmt % x


def format_table(rows: Sequence[SweepRow]) -> str:
    header = (f"{'d':>4} {'N':>6} {'causal':<6} {'kernel':<8} {'pass':<8} {'prec':<5} {'ms':>10} "
              f"{'TFLOP/s':>8} {'peak MiB':>9}  status")
    lines = [header, "-" * len(header)]
    for r in rows:
        status = r.status + (f" ({r.note})" if r.note else "")
        lines.append(f"{r.d:>4} {r.seq:>6} {'yes' if r.causal else 'no':<6} {r.kernel:<8} {r.direction:<8} "
                     f"{r.precision:<5} {_num(r.ms, '%.4f'):>10} {_num(r.tflops, '%.2f'):>8} "
                     f"{_num(r.peak_mib, '%.0f'):>9}  {status}")
    return "\n".join(lines)


def csv_text(rows: Sequence[SweepRow]) -> str:
    """One line per row, the columns of SweepRow; a missing figure is an empty field."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(COLUMNS)
    for r in rows:
        writer.writerow(["" if v is None else v for v in (getattr(r, c) for c in COLUMNS)])
    return buf.getvalue()


def plot_rows(rows: Sequence[SweepRow]) -> List[Row]:
    """The rows as bench's plot draws them: TFLOP/s against N, one panel per d and masking, each
    kernel named as bench names it."""
    label = {(k.name, k.direction): k.label for k in KERNELS}
    return [Row(Shape(r.batch, r.heads, r.seq, r.seq, r.d, r.causal).id, r.seq, r.d, r.causal, r.precision,
                label.get((r.kernel, r.direction), r.kernel), "attention", r.status, r.ms, r.tflops) for r in rows]
