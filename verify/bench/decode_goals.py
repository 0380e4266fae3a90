"""The decode bench (`attnstep bench --decode goals`, its command: verify/cli/bench.py): the binary's
split-KV paged decode kernel against the memory bandwidth it could reach and against PyTorch SDPA
on the same cache, at the goal shapes (B 64, H 32, Hk 8, d 128, bf16, one query per sequence, page
size 64, caches of 8192 and 32768 keys per sequence).

For each cache length it runs `main --bench-decode ... --json FILE` (cuda_src's decode bench: the
kernel and its combine, every kernel of the decode step, timed with CUDA events, median of REPS, on
a cache of cache_len keys per sequence in pages given out in shuffled order, and a device-to-device
copy of the same K+V bytes in the same run) and, in this process, SDPA on the gathered cache: q
(B, H, 1, d), k and v (B, Hk, L, d), bf16, contiguous (the gather done before, untimed),
enable_gqa=True, CUDA events after warm-up, median of REPS; torch's own choice of backend and each
backend forced, the fastest being the yardstick. Decode is bound by the bytes of K and V read, so
both are reported in GB/s of kv_bytes (the binary's count of the K and V bytes the step reads).

The goals, each met or missed:
* the kernel's GB/s at least COPY_FRACTION_GOAL of the copy's in the same run;
* the kernel's time at most SDPA_RATIO_GOAL times SDPA's fastest on the gathered cache.

torch is imported only to time SDPA (verify/bench/sdpa.py); everything else runs without it.
"""
from __future__ import annotations

import json
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from .measure import BenchUnusable
from .report import BenchError
from .results_file import RESULTS_FORMAT
from .sdpa import SDPA_BACKENDS, _timed, torch_available

DECODE_TOOL = "attnstep bench --decode"
GOALS_PRESET = "goals"
COPY_FRACTION_GOAL = 0.80
SDPA_RATIO_GOAL = 1.0
DECODE_TIMEOUT_S = 600
# What SDPA's torch-chosen run is called among the backends.
TORCH_CHOICE = "auto"
# The binary's JSON (the decode bench's contract): key -> type.
BINARY_KEYS = {"device": str, "batch": int, "heads": int, "kv_heads": int, "cache_len": int, "page_size": int,
               "d": int, "precision": str, "queries": int, "splits": int, "kernel_ms": float, "kv_bytes": int,
               "kernel_gbps": float, "copy_ms": float, "copy_gbps": float, "fraction_of_copy": float}


@dataclass(frozen=True)
class DecodeShape:
    batch: int
    heads: int
    kv_heads: int
    cache_len: int
    page_size: int
    d: int
    precision: str = "bf16"
    queries: int = 1

    @property
    def id(self) -> str:
        return (f"B{self.batch} H{self.heads} Hk{self.kv_heads} L{self.cache_len} P{self.page_size} d{self.d} "
                f"{self.precision}" + (f" q{self.queries}" if self.queries != 1 else ""))

    @property
    def kv_bytes(self) -> int:
        """K and V of every sequence and K/V head, in the format (2 bytes at bf16/fp16)."""
        return 2 * self.batch * self.kv_heads * self.cache_len * self.d * (4 if self.precision == "fp32" else 2)

    @property
    def flop(self) -> float:
        """4·d per score entry of each query head: Q·Kᵀ and P·V."""
        return 4.0 * self.batch * self.heads * self.queries * self.cache_len * self.d


DECODE_SHAPES = tuple(DecodeShape(64, 32, 8, cache, 64, 128) for cache in (8192, 32768))


# ---- the binary --------------------------------------------------------------------------------

def decode_binary_args(shape: DecodeShape, reps: int, json_path: Path) -> List[str]:
    return ["--bench-decode", "--batch", str(shape.batch), "--heads", str(shape.heads), "--kv-heads",
            str(shape.kv_heads), "--cache-len", str(shape.cache_len), "--page-size", str(shape.page_size),
            "--d", str(shape.d), "--precision", shape.precision, "--queries", str(shape.queries),
            "--reps", str(reps), "--json", str(json_path)]


def parse_decode_json(data, source: str) -> dict:
    """The binary's decode JSON, its keys checked (ints for ints, numbers for floats); BenchError
    naming the first key missing or of another type."""
    if not isinstance(data, dict):
        raise BenchError(f"{source}: not a JSON object")
    for key, kind in BINARY_KEYS.items():
        value = data.get(key)
        ok = (isinstance(value, (int, float)) if kind is float else isinstance(value, kind)) \
            and not isinstance(value, bool)
        if not ok:
            raise BenchError(f"{source}: '{key}' missing or not {'a number' if kind is float else kind.__name__}")
    return data


def run_decode_binary(binary: Path, shape: DecodeShape, reps: int, timeout: float = DECODE_TIMEOUT_S) -> dict:
    """`binary --bench-decode` on the shape: its parsed JSON; BenchError with the binary's first
    line when it writes none."""
    with tempfile.TemporaryDirectory(prefix="attnstep-decode-") as tmp:
        json_path = Path(tmp) / "decode.json"
        cmd = [str(binary), *decode_binary_args(shape, reps, json_path)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except FileNotFoundError:
            raise BenchError(f"binary not found: {binary}") from None
        except OSError as exc:  # no shape can run
            raise BenchUnusable(f"cannot run {binary}: {exc.strerror or exc}; HINT: is it executable "
                                "(chmod +x)?") from None
        except subprocess.TimeoutExpired:
            raise BenchError(f"{shape.id}: the binary did not finish in {timeout:.0f} s") from None
        if not json_path.exists():
            lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
            error = BenchUnusable if proc.returncode == 2 else BenchError  # (2: no shape can run)
            raise error(f"{shape.id}: main --bench-decode exited {proc.returncode}: "
                        + (lines[0] if lines else "no output"))
        try:
            data = json.loads(json_path.read_text())
        except ValueError as exc:
            raise BenchError(f"{shape.id}: main --bench-decode wrote malformed JSON ({exc})") from None
    return parse_decode_json(data, f"{shape.id}: main --bench-decode")


# ---- SDPA on the gathered cache ------------------------------------------------------------------

def time_sdpa_decode(shape: DecodeShape, warmup: int, reps: int, backend: Optional[str] = None,
                     seed: int = 0) -> dict:
    """Median ms of SDPA on the gathered cache (module doc); `backend` (a key of
    sdpa.SDPA_BACKENDS) forces one. The result dict of sdpa.time_sdpa, GB/s of the K/V bytes added."""
    def setup(torch, F):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(shape.precision, torch.float32)

        def uniform(*size):
            return (torch.rand(*size, device="cuda", generator=gen) * 2 - 1).to(dtype)

        q = uniform(shape.batch, shape.heads, shape.queries, shape.d)
        k, v = (uniform(shape.batch, shape.kv_heads, shape.cache_len, shape.d) for _ in range(2))
        # One query per sequence sees every key under either causal alignment; more queries (speculative
        # decoding) see them bottom-right aligned, which SDPA's is_causal (top-left) is not.
        mask = None
        if shape.queries > 1:
            rows = torch.arange(shape.queries, device="cuda")[:, None] + shape.cache_len - shape.queries
            mask = torch.arange(shape.cache_len, device="cuda")[None, :] <= rows
        torch.cuda.reset_peak_memory_stats()
        return (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)), warmup, reps

    result = _timed(shape, shape.precision, shape.flop, setup, backend)
    if result.get("status") == "ok":
        result["gbps"] = shape.kv_bytes / (result["ms"] * 1e-3) / 1e9
    return result


def sdpa_decode_runs(shape: DecodeShape, warmup: int, reps: int, timer=time_sdpa_decode) -> Dict[str, dict]:
    """SDPA with torch's own choice (TORCH_CHOICE) and each backend forced, by name."""
    return {name: timer(shape, warmup, reps, backend) for name, backend in
            [(TORCH_CHOICE, None)] + [(b, b) for b in SDPA_BACKENDS]}


def fastest(runs: Dict[str, dict]) -> Optional[str]:
    """The name of the fastest SDPA run that ran, None when none did."""
    ok = {name: r["ms"] for name, r in runs.items() if r.get("status") == "ok"}
    return min(ok, key=ok.get) if ok else None


# ---- the goals -----------------------------------------------------------------------------------

def decode_goal_records(run: dict) -> List[dict]:
    """The two goals of one cache length's run (module doc): each {"goal", "shape", "value",
    "threshold", "comparison", "met", "line"}; value None (missed) where a measure is missing."""
    shape, binary, sdpa = run["shape"], run.get("binary"), run.get("sdpa") or {}
    best = fastest(sdpa)
    records = []
    fraction = None
    if binary:
        fraction = binary["kernel_gbps"] / binary["copy_gbps"] if binary["copy_gbps"] > 0 else None
    ratio = binary["kernel_ms"] / sdpa[best]["ms"] if binary and best else None
    for goal, value, threshold, comparison, figure in (
            ("GB/s of the copy", fraction, COPY_FRACTION_GOAL, ">=",
             lambda: f"{binary['kernel_gbps']:.0f} GB/s vs copy {binary['copy_gbps']:.0f} GB/s"),
            ("time vs SDPA", ratio, SDPA_RATIO_GOAL, "<=",
             lambda: f"{binary['kernel_ms']:.4f} ms vs SDPA {best} {sdpa[best]['ms']:.4f} ms")):
        met = value is not None and (value >= threshold if comparison == ">=" else value <= threshold)
        if value is None:
            why = run.get("error") or ("SDPA did not run" if binary else "the binary did not run")
            line = f"MISSED decode {goal} ({comparison} {threshold:.2f}) at {shape}: {why}"
        else:
            line = (f"{'met   ' if met else 'MISSED'} decode {goal} ({comparison} {threshold:.2f}) at {shape}: "
                    f"{value:.3f}x, {figure()}")
        records.append({"goal": goal, "shape": shape, "value": value, "threshold": threshold,
                        "comparison": comparison, "met": met, "line": line})
    return records


def collect_decode(binary: Path, shapes: Sequence[DecodeShape], warmup: int, reps: int, use_torch: bool,
                   log: Callable[[str], None] = print, timeout: float = DECODE_TIMEOUT_S,
                   run_binary=run_decode_binary, sdpa_timer=time_sdpa_decode,
                   torch_version: Optional[str] = None) -> dict:
    """Every shape: the binary's run and SDPA's; the results document (JSON-ready), goals included.
    A shape that fails is recorded with its error and the others go on."""
    torch_version = torch_version or (torch_available() if use_torch else None)
    runs = []
    for shape in shapes:
        t0 = time.monotonic()
        run: dict = {"shape": shape.id, "params": asdict(shape)}
        try:
            run["binary"] = run_binary(binary, shape, reps, timeout)
        except BenchError as exc:
            # Unusable before any shape ran: the binary cannot bench at all. After one it measured,
            # only this shape failed, and the measured ones are kept.
            if isinstance(exc, BenchUnusable) and not any("binary" in r for r in runs):
                raise
            run["error"] = str(exc)
            log(f"bench --decode: {shape.id}: FAILED: {exc}")
        if torch_version:
            run["sdpa"] = sdpa_decode_runs(shape, warmup, reps, sdpa_timer)
        run["goals"] = decode_goal_records(run)
        runs.append(run)
        log(f"bench --decode: {shape.id}: {time.monotonic() - t0:.1f} s")
    device = next((r["binary"]["device"] for r in runs if "binary" in r), "?")
    return {"tool": DECODE_TOOL, "format": RESULTS_FORMAT, "device": device,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": torch_version, "runs": runs,
            "goals": [g for r in runs for g in r["goals"]]}


def _cell(x: Optional[float], fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def decode_table(results: dict) -> List[str]:
    """The table `bench --decode` prints: one row per cache length, then the goals."""
    header = ("cache", "splits", "kernel ms", "kernel GB/s", "copy GB/s", "of copy", "SDPA ms", "SDPA", "kernel/SDPA")
    rows = []
    for run in results["runs"]:
        b, sdpa = run.get("binary"), run.get("sdpa") or {}
        best = fastest(sdpa)
        sdpa_ms = sdpa[best]["ms"] if best else None
        rows.append((str(run["params"]["cache_len"]), str(b["splits"]) if b else "-",
                     _cell(b and b["kernel_ms"], ".4f"), _cell(b and b["kernel_gbps"], ".0f"),
                     _cell(b and b["copy_gbps"], ".0f"),
                     _cell(b and b["copy_gbps"] and b["kernel_gbps"] / b["copy_gbps"], ".3f"),
                     _cell(sdpa_ms, ".4f"), best or ("not timed" if not sdpa else "none ran"),
                     _cell(b and sdpa_ms and b["kernel_ms"] / sdpa_ms, ".3f")))
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip(), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    for run in results["runs"]:
        for name, r in (run.get("sdpa") or {}).items():
            if r.get("status") != "ok":
                lines.append(f"note: {run['shape']}: SDPA {name}: {r.get('status')}")
    lines.append("goals:")
    lines += ["  " + g["line"] for g in results.get("goals", [])]
    return lines


def is_decode_results(results: dict) -> bool:
    return isinstance(results, dict) and results.get("tool") == DECODE_TOOL


__all__ = ["COPY_FRACTION_GOAL", "DECODE_SHAPES", "DecodeShape", "GOALS_PRESET", "SDPA_RATIO_GOAL", "collect_decode",
           "decode_binary_args", "decode_goal_records", "decode_table", "is_decode_results", "parse_decode_json", "run_decode_binary", "sdpa_decode_runs", "time_sdpa_decode"]
