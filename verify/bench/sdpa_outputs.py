"""PyTorch's scaled_dot_product_attention run on an input case, its results written as another
program's output folder: PyTorch's SDPA backends (flash, memory-efficient, cuDNN, math) are
independent, correct bf16/fp16 attention kernels, so `attnstep check --precision` must pass each.

    python -m verify.cli.sdpa_outputs --in data/random_test --out data/sdpa_flash --backend flash --precision bf16
    attnstep check --in data/random_test --out data/sdpa_flash --precision bf16

Inputs: the case's Q, K, V (and dO) rounded to the format as the verifier rounds them
(verify/model/half.py, nearest even, which torch's .to(torch.bfloat16) and .half() do too), so
SDPA and the references start from the same values; the scale and the causal flag are the
case's (the manifest's). One backend runs, forced with torch.nn.attention.sdpa_kernel; the
gradients come from autograd with the case's dO.

Files: one `<stage>.npy` per stage holding every head as (B, H, rows, cols), as a PyTorch user
saves a tensor: the contract's one-file form, so `check` needs no name map. The fused backends
are FlashAttention-style kernels (scores and softmax in float32, P rounded to the format before
P·V, the log-sum-exp kept), so their results are the flash stages (flash_output, flash_lse,
flash_dQ, flash_dK, flash_dV); the math backend composes matmul and softmax, so its results are
the stage path's output, dQ, dK, dV (`math`: torch's default, float32 inside; `math-half`: with
torch's fp16/bf16 reductions, each op's result in the format). bf16 values are saved as float32
(.npy has no bfloat16; the values are exact), fp16 values as float16, the lse as float32. No
run.toml: `check` assumes any correct program of the precision it is given.

Causal masking: torch's is_causal is top-left aligned (query i sees keys j <= i; its documented
mask is torch.ones(N, M).tril()), the contract's convention, so it is passed as it is, with N = M
or not. torch's flash backend refuses is_causal where N != M (FlashAttention aligns bottom-right),
which is reported as the backend being unavailable. `--mask explicit` passes the same top-left
mask as a boolean attn_mask instead (the memory-efficient, cuDNN and math backends take one).

The log-sum-exp: SDPA does not return it, so it comes from the backend's own operator
(torch.ops.aten._scaled_dot_product_{flash,efficient,cudnn}_attention, run once more on the same
inputs); none for the math backend, or with an explicit mask, or where the operator refuses.

torch is imported only when SDPA runs: the package, and everything here but run_sdpa, imports
and works without it. The command that runs it on a case: verify/cli/sdpa_outputs.py.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from ..files.case import InputCase, load_input_case
from ..files.stage_files import STACKED_SUFFIX
from ..model.half import round_to_format
from ..runs.watched import fresh_out
from ..stages import (FLASH_GRAD_KEYS, FLASH_GRAD_QUERIES, FLASH_GRAD_VALUES, FLASH_LSE,
                      FLASH_OUTPUT, GRAD_INPUT, GRAD_KEYS, GRAD_QUERIES, GRAD_VALUES, HALF_PRECISIONS, INPUT_NAMES,
                      OUTPUT, STAGES, default_scale)
from .sdpa import rejection_reason, torch_dtype


@dataclass(frozen=True)
class Backend:
    sdp: str                 # torch.nn.attention.SDPBackend's name
    fused: bool              # a FlashAttention-style kernel: its results are the flash stages, lse too
    half_math: bool = False  # torch's fp16/bf16 reductions allowed in the math backend


# The math backend computes in float32 and rounds its results (torch's default since 2.5); math-half
# allows its fp16/bf16 reductions (torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp), so each
# of its ops (Q and K scaled by √scale, Q·Kᵀ, softmax, P·V, and the backward's) rounds its result
# to the format, as eager half-precision code does.
BACKENDS = {"flash": Backend("FLASH_ATTENTION", True), "efficient": Backend("EFFICIENT_ATTENTION", True),
            "cudnn": Backend("CUDNN_ATTENTION", True), "math": Backend("MATH", False),
            "math-half": Backend("MATH", False, half_math=True)}
MASKS = ("is_causal", "explicit")

# What SDPA gives -> the stage that holds it: the fused kernels' as the flash stages, the math
# backend's as the stage path's.
_FUSED_STAGES = {"out": FLASH_OUTPUT, "lse": FLASH_LSE, "dq": FLASH_GRAD_QUERIES, "dk": FLASH_GRAD_KEYS,
                 "dv": FLASH_GRAD_VALUES}
_MATH_STAGES = {"out": OUTPUT, "dq": GRAD_QUERIES, "dk": GRAD_KEYS, "dv": GRAD_VALUES}


class BackendUnavailable(Exception):
    """torch cannot run this backend here (no GPU, a cuDNN too old, a shape or dtype the kernel
    rejects); the message is the reason torch gives."""


@dataclass
class SdpaResults:
    """What one SDPA run gave, as float32 arrays of the format's values, shaped (B, H, rows, cols)
    (lse: (B, H, N)); `notes` says what was left out and why."""
    out: np.ndarray
    lse: Optional[np.ndarray] = None
    grads: Dict[str, np.ndarray] = field(default_factory=dict)  # "dq", "dk", "dv"
    notes: List[str] = field(default_factory=list)


# A function (inputs, backend, precision, scale, causal, mask) -> SdpaResults: run_sdpa, or a
# stand-in that computes without torch (the CPU tests).
Runner = Callable[[Dict[str, np.ndarray], str, str, float, bool, str], SdpaResults]


# ----------------------------------------------------------------------------------------------
# The case's inputs, and the files (no torch).

def case_inputs(case: InputCase, precision: str) -> Dict[str, np.ndarray]:
    """Q, K, V (and dO) of every head rounded to the format as the verifier rounds them, as
    float32 (B, H, rows, cols)."""
    dims = case.dims
    out = {}
    for name in case.inputs:
        heads = [round_to_format(case.load(name, i), precision) for i in range(dims.total_heads)]
        out[name] = np.stack(heads).astype(np.float32).reshape(dims.batch, dims.heads, *heads[0].shape)
    return out


def stage_arrays(results: SdpaResults, backend: str) -> Dict[str, np.ndarray]:
    """{stage: (B, H, rows, cols) array} of what the run gave, named by the kind of kernel."""
    names = _FUSED_STAGES if BACKENDS[backend].fused else _MATH_STAGES
    given = {"out": results.out, "lse": results.lse, **results.grads}
    return {names[k]: x for k, x in given.items() if x is not None and k in names}


def write_stage_files(out_dir: Path, stages: Dict[str, np.ndarray], precision: str,
                      in_dir: Optional[Path] = None) -> List[Path]:
    """One `<stage>.npy` per stage into OUT (an earlier run's stage files moved aside first, as
    `attnstep run` does): fp16 values as float16, bf16 values and the float32 row statistics as
    float32."""
    out_dir = Path(out_dir)
    fresh_out(out_dir, in_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for stage, x in stages.items():
        half = precision == "fp16" and not STAGES[stage].float32
        path = out_dir / (stage + STACKED_SUFFIX)
        np.save(path, x.astype(np.float16 if half else np.float32))
        written.append(path)
    return written


def write_sdpa_case(in_dir: Path, out_dir: Path, backend: str, precision: str, mask: str = MASKS[0],
                    scale: Optional[float] = None, runner: Optional[Runner] = None) -> SdpaResults:
    """Runs SDPA (`runner`, default run_sdpa) on the case IN and writes its results into OUT as
    stage files. scale: the case's unless given (a wrong one shows that the check fails it)."""
    if backend not in BACKENDS or precision not in HALF_PRECISIONS or mask not in MASKS:
        raise ValueError(f"backend {backend!r}, precision {precision!r}, mask {mask!r}: expected one of "
                         f"{', '.join(BACKENDS)}; {', '.join(HALF_PRECISIONS)}; {', '.join(MASKS)}")
    case = load_input_case(in_dir)
    if scale is None:
        scale = case.scale if case.scale is not None else default_scale(case.dims.d_k)
    results = (runner or run_sdpa)(case_inputs(case, precision), backend, precision, float(scale), case.causal,
                                   mask)
    write_stage_files(out_dir, stage_arrays(results, backend), precision, in_dir)
    return results


# ----------------------------------------------------------------------------------------------
# SDPA on the GPU (torch imported here only).

def _torch():
    try:
        import torch  # noqa: PLC0415 (optional dependency)
    except ImportError:
        raise BackendUnavailable("PyTorch is not installed") from None
    if not torch.cuda.is_available():
        raise BackendUnavailable(f"torch {torch.__version__} sees no CUDA device")
    return torch


def _refused(call: Callable[[], object], backend: str):
    """call() under the forced backend; torch's refusal (its warnings say why the kernel was not
    used, then "No available kernel") or a kernel's failure becomes BackendUnavailable, with the
    reason bench reports for a refused backend (sdpa.rejection_reason)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return call()
        except RuntimeError as exc:
            why = rejection_reason([str(w.message) for w in caught], str(exc) or type(exc).__name__)
            raise BackendUnavailable(f"{backend}: {why}") from None


def _to_numpy(x) -> np.ndarray:
    return x.detach().float().cpu().numpy()


def _lse(torch, backend: str, q, k, v, scale: float, causal: bool) -> np.ndarray:
    """The backend's log-sum-exp (natural log, float32) of each query row, from its own operator:
    flash's is (B, H, N), the memory-efficient one's padded to a multiple of 32 rows, cuDNN's
    (B, H, N, 1); each cut to (B, H, N)."""
    aten = torch.ops.aten
    ops = {"flash": lambda: aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale),
           "efficient": lambda: aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                             scale=scale),
           "cudnn": lambda: aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                     scale=scale)}
    with torch.no_grad():
        lse = ops[backend]()[1]
    batch, heads, n = q.shape[0], q.shape[1], q.shape[2]
    return _to_numpy(lse.reshape(batch, heads, -1)[..., :n])


def run_sdpa(inputs: Dict[str, np.ndarray], backend: str, precision: str, scale: float, causal: bool,
             mask: str = MASKS[0]) -> SdpaResults:
    """SDPA of the inputs ((B, H, rows, cols) float32 arrays holding values of the format) on the
    GPU, at the format, under `backend` alone; the gradients too when dO is given."""
    torch = _torch()
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415
    except ImportError:
        raise BackendUnavailable(f"torch {torch.__version__} cannot force an SDPA backend "
                                 "(no torch.nn.attention)") from None
    from torch.nn.functional import scaled_dot_product_attention  # noqa: PLC0415

    dtype = torch_dtype(torch, precision)
    q, k, v = (torch.from_numpy(inputs[n]).cuda().to(dtype).requires_grad_() for n in INPUT_NAMES)
    explicit = causal and mask == "explicit"
    # Top-left, as the contract and torch's is_causal: query i sees keys 0..i.
    attn_mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device="cuda").tril() if explicit else None
    with sdpa_kernel(getattr(SDPBackend, BACKENDS[backend].sdp)), _math_reductions(torch, BACKENDS[backend]):
        out = _refused(lambda: scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                                            is_causal=causal and not explicit, scale=scale), backend)
        results = SdpaResults(_to_numpy(out))
        grad_output = inputs.get(GRAD_INPUT)  # the case's dO, when it has one
        if grad_output is not None:
            do = torch.from_numpy(grad_output).cuda().to(dtype)
            grads = _refused(lambda: torch.autograd.grad(out, (q, k, v), do), backend)
            results.grads = dict(zip(("dq", "dk", "dv"), map(_to_numpy, grads)))
    results.lse, note = _lse_or_note(torch, backend, explicit, q, k, v, scale, causal)
    if note:
        results.notes.append(note)
    return results


@contextlib.contextmanager
def _math_reductions(torch, backend: Backend):
    """torch's fp16/bf16 reductions in the math backend allowed for math-half, and the setting
    restored after."""
    if not backend.half_math:
        yield
        return
    cuda = torch.backends.cuda
    if not hasattr(cuda, "allow_fp16_bf16_reduction_math_sdp"):
        raise BackendUnavailable(f"torch {torch.__version__} has no allow_fp16_bf16_reduction_math_sdp")
    before = cuda.fp16_bf16_reduction_math_sdp_allowed()
    cuda.allow_fp16_bf16_reduction_math_sdp(True)
    try:
        yield
    finally:
        cuda.allow_fp16_bf16_reduction_math_sdp(before)


def _lse_or_note(torch, backend, explicit, q, k, v, scale, causal) -> Tuple[Optional[np.ndarray], str]:
    if not BACKENDS[backend].fused:
        return None, "no flash_lse: the math backend computes no log-sum-exp"
    if explicit:
        return None, "no flash_lse: the backends' own operators are called without a mask"
    try:
        return _lse(torch, backend, q.detach(), k.detach(), v.detach(), scale, causal), ""
    except (RuntimeError, TypeError) as exc:  # refused here, or another signature in this torch
        return None, f"no flash_lse: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}"
