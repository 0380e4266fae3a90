"""What `attnstep bench` reads and shows: the binary's --bench JSON, the rows of the table, the
ceilings and the results file (the plot is plot.py's)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from ..stages import HALF_PRECISIONS, PRECISIONS
from .shape import BACKWARD_FLOP_FACTOR, Shape, parse_shape_id, shape_of_binary  # noqa: F401 (re-exported)

# "flash" is the binary's dispatcher (what `main` runs by default: wgmma on Hopper, else mma.sync,
# else the clean kernel); the others are the tensor-core kernels forced one by one.
FLASH_DISPATCHER = "flash"
FLASH_KERNELS = (FLASH_DISPATCHER, "flash_wgmma", "flash_fast")
SDPA = "sdpa"
# At bf16/fp16 SDPA runs once per backend (sdpa.SDPA_BACKENDS), each pass under its run key of
# SDPA_RUN_KEYS: the forward's backends under "sdpa_backends", the fastest of them being "sdpa", the
# backward's under "sdpa_backward_backends", the fastest being "sdpa_backward". VS_SDPA holds each
# flash kernel's ratio to each backend of its pass. ACCURACY holds the comparison of errors on the
# binary's own inputs (accuracy.py).
SDPA_BACKENDS = "sdpa_backends"
SDPA_BACKWARD_BACKENDS = "sdpa_backward_backends"
VS_SDPA = "vs_sdpa"
FASTEST = "fastest"
ACCURACY = "accuracy"
# The status of an SDPA backend that refuses the problem: "unsupported: <torch's reason>".
UNSUPPORTED = "unsupported"
# The backward's rows that are not stages (cuda_src/bench/bench_parts.cuh names them alike): the
# whole stage-path backward timed as one unit, the flash backward, and PyTorch's backward.
STAGE_PATH_BACKWARD = "stages_backward"
FLASH_BACKWARD = "flash_backward"
SDPA_BACKWARD = "sdpa_backward"
# The passes `main --bench --pass` times; a row without "pass" (an older run) is a forward row.
FORWARD, BACKWARD = "forward", "backward"
PASSES = (FORWARD, BACKWARD)
# Each pass's SDPA in a run: the key of its timing (at bf16/fp16 the fastest backend's) and the key
# of its backends one by one (bf16/fp16 only).
SDPA_RUN_KEYS = {FORWARD: (SDPA, SDPA_BACKENDS), BACKWARD: (SDPA_BACKWARD, SDPA_BACKWARD_BACKENDS)}
# A grouped run's rows that are not stages (bench_parts.cuh names them alike): the copy of the K/V
# heads to their query heads, and the sums of dK and dV over each group.
KV_EXPAND, KV_GROUP_SUM = "kv_expand", "kv_group_sum"
# The status of a kernel or shape that did not fit in device memory.
OOM = "OOM"
# The status main --bench gives every stage when not even one head of the stage path fits.
STAGE_PATH_SKIPPED = "skipped (memory)"
MIB = float(1 << 20)


class BenchError(Exception):
    """A malformed result file or a failed run, worded for the user."""


def _shape_of(binary: dict, source: str = "bench JSON") -> Shape:
    try:
        return shape_of_binary(binary)
    except (KeyError, TypeError, ValueError) as exc:
        raise BenchError(f"{source}: malformed 'shape' or 'variant': {exc}") from None


# ---- the binary's JSON ---------------------------------------------------------------------------
_REQUIRED = {"device": str, "shape": dict, "precision": str, "ceilings": dict, "kernels": list}
# Written by binaries that take variants; a document without it is a plain run.
_OPTIONAL = {"variant": dict}
_KERNEL_REQUIRED = {"name": str, "kind": str, "status": str}


def _rate_key(kernel: dict) -> str:
    return "gbps" if kernel["kind"] == "memory" else "tflops"


def parse_binary_json(data: dict, source: str = "bench JSON") -> dict:
    """Checks the fields bench relies on; raises BenchError naming the first missing one."""
    if not isinstance(data, dict):
        raise BenchError(f"{source}: expected a JSON object, got {type(data).__name__}")
    for key, typ in _REQUIRED.items():
        if not isinstance(data.get(key), typ):
            raise BenchError(f"{source}: missing or malformed '{key}' (expected {typ.__name__})")
    for key, typ in _OPTIONAL.items():
        if key in data and not isinstance(data[key], typ):
            raise BenchError(f"{source}: malformed '{key}' (expected {typ.__name__})")
    _shape_of(data, source)
    if data["precision"] not in PRECISIONS:
        raise BenchError(f"{source}: unknown precision '{data['precision']}'")
    for i, k in enumerate(data["kernels"]):
        for key, typ in _KERNEL_REQUIRED.items():
            if not isinstance(k, dict) or not isinstance(k.get(key), typ):
                raise BenchError(f"{source}: kernels[{i}] lacks '{key}'")
        if k["status"] == "ok":
            for key in ("ms", _rate_key(k)):
                if not isinstance(k.get(key), (int, float)):
                    raise BenchError(f"{source}: kernels[{i}] ('{k['name']}') lacks a number '{key}'")
    return data


def _check_timing(timing, source: str) -> None:
    """An SDPA timing: an object whose status is a string and, when "ok", with number ms and tflops."""
    if not isinstance(timing, dict) or not isinstance(timing.get("status", ""), str):
        raise BenchError(f"{source}: expected an object with a 'status' string")
    if timing.get("status") == "ok":
        for key in ("ms", "tflops"):
            if isinstance(timing.get(key), bool) or not isinstance(timing.get(key), (int, float)):
                raise BenchError(f"{source}: lacks a number '{key}'")


def _check_sdpa_sections(run: dict, source: str) -> None:
    """The SDPA parts of a run as bench wrote them; raises BenchError naming the first malformed one."""
    for name in (SDPA, SDPA_BACKWARD):
        if run.get(name) is not None:
            _check_timing(run[name], f"{source}.{name}")
    for _, key in SDPA_RUN_KEYS.values():
        backends = run.get(key)
        if backends is None:
            continue
        if not isinstance(backends, dict):
            raise BenchError(f"{source}.{key}: expected an object of backends")
        for name, timing in backends.items():
            _check_timing(timing, f"{source}.{key}.{name}")
    if run.get(ACCURACY) is not None and not isinstance(run[ACCURACY], dict):
        raise BenchError(f"{source}.{ACCURACY}: expected an object")


# ---- rows ----------------------------------------------------------------------------------------
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
    # bf16/fp16 flash kernels: TFLOP/s over each SDPA backend's of the same pass, by backend name
    vs_backends: Optional[Dict[str, float]] = None
    note: str = ""
    max_rel_err: Optional[float] = None  # checked rows: the binary's error against float64
    sdpa_err: Optional[float] = None     # bf16/fp16 flash rows: SDPA's, same inputs and measure

    @property
    def err_vs_sdpa(self) -> Optional[float]:
        """The row's error over SDPA's on the same inputs (None when either is unknown)."""
        if self.max_rel_err is None or self.sdpa_err is None:
            return None
        if self.sdpa_err == 0:
            return 0.0 if self.max_rel_err == 0 else math.inf
        return self.max_rel_err / self.sdpa_err


def _row(shape: Shape, precision: str, kernel: str, kind: str, status: str) -> Row:
    return Row(shape.id, shape.seq_q, shape.d, shape.causal, precision, kernel, kind, status)


def kernel_note(k: dict) -> str:
    """The kernel's tiles and, when the binary checked it, its float64 error (FAIL when too big)."""
    notes = [k["tiles"]] if k.get("tiles") else []
    chk = k.get("check")
    if chk:
        err = chk.get("max_rel_err")
        notes.append(("err %.1e" % err if err is not None else "err nan")
                     + ("" if chk.get("passed") else " FAIL"))
    return "; ".join(notes)


# The rows compared with SDPA: each with SDPA's run of its own pass.
_VS_SDPA = {**{name: SDPA for name in FLASH_KERNELS}, FLASH_BACKWARD: SDPA_BACKWARD,
            STAGE_PATH_BACKWARD: SDPA_BACKWARD}


def _kernel_row(shape: Shape, precision: str, k: dict, sdpa_rates: Dict[str, float]) -> Row:
    row = _row(shape, precision, k["name"], k["kind"], k["status"])
    if k["status"] != "ok":
        row.note = k.get("reason", "")
        return row
    row.ms, row.rate, row.fraction = k["ms"], k[_rate_key(k)], k.get("fraction")
    yardstick = sdpa_rates.get(_VS_SDPA.get(k["name"], ""))
    if yardstick:
        row.vs_sdpa = row.rate / yardstick
    row.note = kernel_note(k)
    row.max_rel_err = (k.get("check") or {}).get("max_rel_err")
    return row


def sdpa_backend_row(backend: str, sdpa: str = SDPA) -> str:
    """The table's name of one SDPA backend's row: the forward's sdpa_cudnn, sdpa_flash,
    sdpa_efficient; the backward's (`sdpa` SDPA_BACKWARD) sdpa_backward_cudnn and so on."""
    return f"{sdpa}_{backend}"


def _sdpa_row(shape: Shape, precision: str, name: str, sdpa: dict) -> Row:
    row = _row(shape, precision, name, "attention", sdpa.get("status", "?"))
    if sdpa.get("status") == "ok":
        row.ms, row.rate = sdpa["ms"], sdpa["tflops"]
        row.note = f"torch {sdpa.get('torch', '?')} {sdpa.get('dtype', 'fp32')}"
        if sdpa.get("backend"):
            row.note += f", {sdpa_backend_row(sdpa['backend'], name)} ({FASTEST})"
    return row


def fastest_sdpa(backends: Dict[str, dict]) -> dict:
    """The run's SDPA yardstick at bf16/fp16: the fastest backend's timing, named in "backend";
    an "unsupported" status when none ran."""
    ran = {name: b for name, b in backends.items() if b.get("status") == "ok"}
    if not ran:
        return {"status": f"{UNSUPPORTED}: no SDPA backend took the problem"}
    name = max(ran, key=lambda n: ran[n]["tflops"])
    return {**ran[name], "backend": name}


def ratios_to_backends(binary: dict, backends: Dict[str, dict],
                       pass_: str = FORWARD) -> Dict[str, Dict[str, float]]:
    """Each of the pass's rows compared with SDPA (the forward's flash kernels, the flash backward):
    its TFLOP/s over each SDPA backend's of that pass that ran, and over the fastest's:
    {kernel: {backend: ratio, "fastest": ratio}}."""
    rates = {name: b["tflops"] for name, b in backends.items() if b.get("status") == "ok" and b.get("tflops")}
    if not rates:
        return {}
    rates[FASTEST] = max(rates.values())
    yardstick = SDPA_RUN_KEYS[pass_][0]
    return {k["name"]: {name: k["tflops"] / rate for name, rate in rates.items()}
            for k in binary["kernels"]
            if _VS_SDPA.get(k["name"]) == yardstick and k["status"] == "ok" and k.get("pass", FORWARD) == pass_}


def _ratio_note(ratios: Dict[str, float], sdpa: str) -> str:
    return "vs " + ", ".join(f"{sdpa_backend_row(name, sdpa)} {r:.2f}x"
                             for name, r in ratios.items() if name != FASTEST)


def _error_value(err) -> Optional[float]:
    """An error of the accuracy comparison as read back: a number, or the JSON's "inf"/"nan" (an
    output with a NaN or an infinity); None for anything else (a status string)."""
    if isinstance(err, bool):
        return None
    if isinstance(err, (int, float)):
        return float(err)
    if isinstance(err, str) and err.lower() in ("inf", "nan"):
        return float(err)
    return None


def _add_error_note(row: Row, err) -> None:
    """SDPA's error on the binary's inputs, in its row's note (a status string says nothing more)."""
    err = _error_value(err)
    if err is not None and row.status == "ok":
        row.note += f"; err {err:.1e} on the binary's inputs"


def _backend_rows(shape: Shape, prec: str, run: dict, binary: dict, rows: List[Row], pass_: str) -> List[Row]:
    """One pass at bf16/fp16: each SDPA backend's row (its speed over the fastest's), the pass's
    flash rows' ratio to each backend in their note and vs_backends."""
    sdpa, key = SDPA_RUN_KEYS[pass_]
    backends = run.get(key) or {}
    ratios = ratios_to_backends(binary, backends, pass_)
    for row in rows:
        if row.kernel in ratios:
            row.note = "; ".join(n for n in (row.note, _ratio_note(ratios[row.kernel], sdpa)) if n)
            row.vs_backends = {name: r for name, r in ratios[row.kernel].items() if name != FASTEST}
    extra = [_sdpa_row(shape, prec, sdpa_backend_row(name, sdpa), b) for name, b in backends.items()]
    fastest = (run.get(sdpa) or {}).get("tflops")
    for row in extra:
        row.vs_sdpa = row.rate / fastest if row.rate and fastest else None
    return extra


def _half_rows(shape: Shape, prec: str, run: dict, binary: dict, rows: List[Row]) -> List[Row]:
    """At bf16/fp16: each pass's SDPA backend rows and ratios (_backend_rows); the forward flash
    rows' and backends' errors on the same inputs in their notes (or the accuracy comparison's
    failure as a row)."""
    by_pass = {pass_: _backend_rows(shape, prec, run, binary, rows, pass_) for pass_ in PASSES}
    accuracy = run.get(ACCURACY) or {}
    sdpa_err = _error_value(accuracy.get(SDPA))
    for row in rows:
        if row.kernel in FLASH_KERNELS and row.status == "ok" and sdpa_err is not None:
            row.sdpa_err = sdpa_err
            row.note += f"; SDPA's err {sdpa_err:.1e}"
    for row, name in zip(by_pass[FORWARD], run.get(SDPA_BACKENDS) or {}):
        _add_error_note(row, (accuracy.get(SDPA_BACKENDS) or {}).get(name))
    extra = by_pass[FORWARD] + by_pass[BACKWARD]
    if accuracy.get("error"):
        extra.append(_row(shape, prec, ACCURACY, "attention", f"failed: {accuracy['error']}"))
    return extra


def _run_rows(i: int, run: dict) -> List[Row]:
    if "error" in run:  # the binary failed on this shape; the sweep went on
        try:
            shape = parse_shape_id(str(run.get("shape", "B0-H0-N0-M0-d0")))
        except ValueError as exc:
            raise BenchError(f"runs[{i}]: {exc}") from None
        return [_row(shape, run.get("precision", "?"), "main --bench", "attention", f"failed: {run['error']}")]
    binary = parse_binary_json(run.get("binary"), f"runs[{i}].binary")
    _check_sdpa_sections(run, f"runs[{i}]")
    shape, prec = _shape_of(binary, f"runs[{i}].binary"), binary["precision"]
    # The run's SDPA timings by row name: "sdpa" the forward, "sdpa_backward" the backward.
    sdpa = {name: run[name] for name in (SDPA, SDPA_BACKWARD) if run.get(name)}
    rates = {name: s["tflops"] for name, s in sdpa.items() if s.get("status") == "ok"}
    rows = [_kernel_row(shape, prec, k, rates) for k in binary["kernels"]]
    sdpa_rows = [_sdpa_row(shape, prec, name, s) for name, s in sdpa.items()]
    for row in sdpa_rows:
        row.vs_sdpa = 1.0 if row.status == "ok" else None
    return rows + sdpa_rows + _half_rows(shape, prec, run, binary, rows)


def _annotate_variant_rows(rows: Sequence[Row]) -> None:
    """Each ok row of a shape with a variant whose shape without it (shape.base) ran too, with the
    same kernel and precision: its time over that one's, in its note."""
    ok = {(r.shape, r.kernel, r.precision): r for r in rows if r.status == "ok" and r.ms}
    for row in rows:
        try:
            shape = parse_shape_id(row.shape)
        except ValueError:
            continue
        base = None if shape.plain else ok.get((shape.base.id, row.kernel, row.precision))
        if base is not None and row.status == "ok" and row.ms:
            row.note = "; ".join(n for n in (row.note, f"{row.ms / base.ms:.3f}x the time without the variant") if n)


def rows_from_results(results: dict) -> List[Row]:
    """Flattens a results document (see bench.collect) into one row per shape × precision × kernel;
    a variant's rows note their time over the same shape's without it, when it ran."""
    rows = [row for i, run in enumerate(results.get("runs", [])) for row in _run_rows(i, run)]
    _annotate_variant_rows(rows)
    return rows


# ---- printing ------------------------------------------------------------------------------------
def _num(x: Optional[float], fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt % x


def format_table(rows: Sequence[Row]) -> str:
    """The table; the kernel column fits the longest row name, sdpa_backward_efficient."""
    header = f"{'shape':<28} {'prec':<5} {'kernel':<23} {'ms':>10} {'rate':>15} {'ceiling':>8} {'vs sdpa':>8}  note"
    lines = [header, "-" * len(header)]
    for r in rows:
        if r.status != "ok":
            status = f"{r.status}: {r.note}" if r.note else r.status
            lines.append(f"{r.shape:<28} {r.precision:<5} {r.kernel:<23} {'-':>10} {'-':>15} {'-':>8} {'-':>8}  {status}")
            continue
        unit = "GB/s" if r.kind == "memory" else "TFLOP/s"
        rate = f"{r.rate:.0f} {unit}" if r.kind == "memory" else f"{r.rate:.2f} {unit}"
        frac = _num(None if r.fraction is None else 100 * r.fraction, "%.0f%%")
        ratio = _num(r.vs_sdpa, "%.2fx")
        lines.append(f"{r.shape:<28} {r.precision:<5} {r.kernel:<23} {r.ms:>10.4f} {rate:>15} {frac:>8} {ratio:>8}  {r.note}")
    return "\n".join(lines)


# The ceilings a run may carry, in the order printed: (JSON key, label, number format, unit, always):
# cuBLAS SGEMM and copy always (nan when missing), the tensor-core rates only when measured.
_CEILINGS = (("sgemm_tflops", "cuBLAS SGEMM", "%.1f", "TFLOP/s", True), ("copy_gbps", "copy", "%.0f", "GB/s", True),
             ("mma_tf32_tflops", "mma.sync TF32", "%.0f", "TFLOP/s", False),
             ("mma_bf16_tflops", "mma.sync BF16", "%.0f", "TFLOP/s", False),
             ("wgmma_tf32_tflops", "wgmma TF32", "%.0f", "TFLOP/s", False))


def _run_size(run: dict) -> int:
    sh = (run.get("binary") or {}).get("shape") or {}
    return sh.get("seq_q", 0) * sh.get("seq_k", 0) * sh.get("d", 0)


def _ceiling_parts(c: dict, precision: str) -> List[str]:
    """The ceilings' figures; at bf16/fp16 cuBLAS's is its GEMM of half operands, not SGEMM."""
    def named(label: str) -> str:
        return f"cuBLAS GEMM {precision}" if label == _CEILINGS[0][1] and precision in HALF_PRECISIONS else label

    return [f"{named(label)} {fmt % c.get(key, float('nan'))} {unit}"
            for key, label, fmt, unit, always in _CEILINGS if always or c.get(key)]


def ceiling_lines(results: dict) -> List[str]:
    """The ceilings measured by the largest run of each precision (the SGEMM ceiling is on that
    run's QK shape; the copy and mma.sync ceilings do not depend on the shape). Per-run values
    are in the JSON."""
    lines, seen = [], set()
    for run in sorted(results.get("runs", []), key=_run_size, reverse=True):
        b = run.get("binary") or {}
        c, prec = b.get("ceilings") or {}, b.get("precision")
        if prec in seen or not c:
            continue
        seen.add(prec)
        where = _shape_of(b).id if isinstance(b.get("shape"), dict) else "?"
        lines.append(f"ceilings ({prec}, {where}): " + ", ".join(_ceiling_parts(c, prec)))
    return lines
