"""`attnstep bench --check` at bf16/fp16: the binary's flash error and PyTorch SDPA's, on the same
inputs, against the same float64 reference, by the same measure.

The same inputs: `main --bench` fills Q, K, V element by element from a hash of the element's index
and a seed (cuda_src/bench/bench_inputs.h); `uniform_inputs` is its NumPy twin, so the heads the
binary checked are recomputed here without the binary writing them, and the checksum the binary
reports of those heads (its JSON's "check_sample") proves they are the same values. Both programs
convert them to the format by nearest even (the binary's kernels on the GPU; torch's `.to()`).

The same reference: float64 attention from the inputs rounded to the format (the values both
programs multiply), on the rows the binary checked. The same measure: per head, max|err| / max|ref|
over those rows; the worst head (cuda_src/bench/bench_check.cu measures the binary's so).
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..model.attention import softmax_rows
from ..model.half import round_to_format
from .report import FLASH_KERNELS, FORWARD, SDPA, SDPA_BACKENDS, BenchError, Shape

__all__ = ["half_accuracy", "head_inputs", "inputs_checksum", "normwise_error", "reference_rows",
           "uniform_inputs"]

# bench_inputs.h's constants: splitmix64's increment and finaliser, the seed's multiplier.
_INDEX_MUL, _SEED_MUL = 0x9E3779B97F4A7C15, 0xD1B54A32D192ED03
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_MASK64 = (1 << 64) - 1
# The inputs in the order of their seeds (input_seed: 3·S + 1, + 2, + 3 for Q, K, V).
INPUT_ORDER = ("Q", "K", "V")
# The checksum's weights: element j of a head's matrix counts (j mod 251 + 1) times.
CHECKSUM_MODULUS = 251
# Rows of the float64 reference computed at once (an N×M float64 block per chunk).
_REFERENCE_CHUNK = 256

# SDPA's output for float32 inputs (H, N, d), the rows, and a backend (None: torch's choice):
# (H, len(rows), d) float64, or its status string when the backend refuses.
SdpaOutput = Callable[[np.ndarray, np.ndarray, np.ndarray, Sequence[int], Optional[str]], Union[np.ndarray, str]]


def input_seed(seed: int, which: str) -> int:
    return 3 * seed + 1 + INPUT_ORDER.index(which)


def uniform_inputs(start: int, count: int, seed: int) -> np.ndarray:
    """Elements start .. start + count - 1 of the tensor `main --bench` fills from `seed`
    (bench_inputs.h's uniform_input), float32."""
    i = np.arange(start + 1, start + count + 1, dtype=np.uint64)
    z = (i * np.uint64(_INDEX_MUL)) ^ np.uint64((seed * _SEED_MUL) & _MASK64)  # uint64 arrays wrap
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
    z ^= z >> np.uint64(31)
    return ((z >> np.uint64(40)).astype(np.float64) * (2.0 / 16777216.0) - 1.0).astype(np.float32)


def head_inputs(shape: Shape, seed: int, head: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Head `head`'s Q (N×d), K and V (M×d) as `main --bench --seed SEED` generates them."""
    out = []
    for which, rows in zip(INPUT_ORDER, (shape.seq_q, shape.seq_k, shape.seq_k)):
        n = rows * shape.d
        out.append(uniform_inputs(head * n, n, input_seed(seed, which)).reshape(rows, shape.d))
    return out[0], out[1], out[2]


def inputs_checksum(heads: Sequence[Tuple[np.ndarray, ...]]) -> float:
    """bench_check.cu's inputs_checksum: over the heads, then Q, K, V of each,
    Σ_j x_j·(j mod 251 + 1) in float64."""
    total = 0.0
    for matrices in heads:
        for x in matrices:
            flat = np.asarray(x, dtype=np.float64).ravel()
            total += float(flat @ (np.arange(flat.size) % CHECKSUM_MODULUS + 1).astype(np.float64))
    return total


def reference_rows(q: np.ndarray, k: np.ndarray, v: np.ndarray, rows: Sequence[int], scale: float,
                   causal: bool) -> np.ndarray:
    """float64 softmax(scale·Q·Kᵀ)·V for the query rows `rows` of one head, from the inputs as
    given (round them first); causal: row r sees keys c <= r."""
    q64, k64, v64 = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    rows = np.asarray(rows, dtype=np.int64)
    out = np.empty((rows.size, v64.shape[1]))
    for at in range(0, rows.size, _REFERENCE_CHUNK):
        r = rows[at:at + _REFERENCE_CHUNK]
        s = (q64[r] @ k64.T) * scale
        if causal:
            s[np.arange(k64.shape[0])[None, :] > r[:, None]] = -np.inf
        out[at:at + r.size] = softmax_rows(s) @ v64
    return out


def normwise_error(got: np.ndarray, ref: np.ndarray) -> float:
    """max|got − ref| / max|ref|; inf when got holds a NaN or an infinity."""
    got = np.asarray(got, dtype=np.float64)
    if not np.all(np.isfinite(got)):
        return math.inf
    return float(np.max(np.abs(got - ref)) / max(float(np.max(np.abs(ref))), 1e-30))


def _sample(binary: dict) -> Tuple[Shape, List[int], List[int]]:
    s, sample = binary["shape"], binary.get("check_sample")
    if not isinstance(sample, dict) or not all(k in sample for k in ("heads", "rows", "inputs_checksum")):
        raise BenchError("the binary's JSON has no check_sample (was it run with --check?)")
    shape = Shape(s["batch"], s["heads"], s["seq_q"], s["seq_k"], s["d"], bool(s["causal"]))
    return shape, [int(h) for h in sample["heads"]], [int(r) for r in sample["rows"]]


def _same_inputs(binary: dict, heads: Sequence[Tuple[np.ndarray, ...]]) -> None:
    want, got = float(binary["check_sample"]["inputs_checksum"]), inputs_checksum(heads)
    if not math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9):
        raise BenchError(f"the inputs recomputed for the accuracy comparison differ from the binary's "
                         f"(checksum {got!r}, the binary's {want!r}); bench_inputs.h and its twin in "
                         f"verify/bench/accuracy.py must agree")


def _binary_errors(binary: dict) -> Dict[str, Optional[float]]:
    """The checked forward flash rows' errors, as the binary measured them."""
    return {k["name"]: k["check"].get("max_rel_err") for k in binary["kernels"]
            if k["name"] in FLASH_KERNELS and k.get("pass", FORWARD) == FORWARD and k.get("check")}


def half_accuracy(binary: dict, sdpa: SdpaOutput, backends: Sequence[str]) -> dict:
    """The accuracy comparison of one run: the binary's flash errors (from its JSON) and SDPA's on
    the heads and rows the binary checked, torch's own choice ("sdpa") and each backend forced
    (SDPA_BACKENDS: an error, or the status of a refusal). Raises BenchError when the recomputed
    inputs are not the binary's."""
    shape, heads, rows = _sample(binary)
    precision = binary["precision"]
    inputs = [head_inputs(shape, int(binary["seed"]), h) for h in heads]
    _same_inputs(binary, inputs)
    scale = float(np.float32(binary["shape"]["scale"]))  # the binary's float32 scale (printed %.9g)
    refs = [reference_rows(*(round_to_format(x, precision) for x in head), rows, scale, shape.causal)
            for head in inputs]
    q, k, v = (np.stack([head[i] for head in inputs]) for i in range(3))

    def sdpa_error(backend: Optional[str]) -> Union[float, str]:
        out = sdpa(q, k, v, rows, backend)
        if isinstance(out, str):
            return out
        return max(normwise_error(out[i], ref) for i, ref in enumerate(refs))

    return {"reference": f"float64 from the inputs rounded to {precision}", "measure": "max|err| / max|ref| per head",
            "heads": heads, "rows": len(rows), "kernels": _binary_errors(binary), SDPA: sdpa_error(None),
            SDPA_BACKENDS: {name: sdpa_error(name) for name in backends}}
