"""PyTorch SDPA timed in this process, the yardstick of `attnstep bench` and `attnstep sweep`: its
forward (`torch.nn.functional.scaled_dot_product_attention`) and its backward (`torch.autograd.grad`
of that output with a fixed output gradient dO), CUDA tensors of the binary's shape (fp32, or
bf16/fp16 at those precisions), median of CUDA-event timings after warm-up; at bf16/fp16 each pass
with each backend forced in turn (SDPA_BACKENDS), and SDPA's output on given inputs for the accuracy
comparison (accuracy.py). torch is imported only here, and only when asked."""
from __future__ import annotations

import contextlib
import statistics
import warnings
from typing import Dict, Optional, Sequence, Union

import numpy as np

from ..stages import HALF_PRECISIONS
from .report import BACKWARD, FORWARD, MIB, OOM, UNSUPPORTED, Shape

__all__ = ["CUDNN", "SDPA_BACKENDS", "rejection_reason", "sdpa_output", "time_sdpa", "time_sdpa_backends",
           "time_sdpa_backward", "torch_available", "torch_dtype"]

# The backends timed one by one at bf16/fp16: the results' name -> torch.nn.attention.SDPBackend's.
# CUDNN is the one a goal names (the half-precision backward's: goals.py).
CUDNN = "cudnn"
SDPA_BACKENDS = {CUDNN: "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}
# What torch raises when no kernel of the allowed backends takes the problem.
_NO_KERNEL = "No available kernel"
# torch's warnings name the file that raised them; the reason ends before.
_TRIGGERED = "(Triggered internally"
# torch's warnings that say only that a kernel was not used, or that another backend than the one
# forced is switched off: no reason of their own.
_NO_REASON = ("because:", "has been runtime disabled.")


class _Refused(Exception):
    """A forced backend refused the problem; the message is torch's reason."""


def torch_available() -> Optional[str]:
    """torch's version when it imports and sees a GPU, else None."""
    try:
        import torch  # noqa: PLC0415 (optional dependency)
    except Exception:
        return None
    return torch.__version__ if torch.cuda.is_available() else None


def median_ms(torch, fn, warmup: int, reps: int) -> float:
    """Median device time of fn() in ms, by CUDA events, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def tensor_dtype(precision: str) -> str:
    """The tensors' format at a precision: bf16 or fp16, else fp32 (tf32 is an fp32 matmul mode)."""
    return precision if precision in HALF_PRECISIONS else "fp32"


def torch_dtype(torch, precision: str):
    """torch's dtype of a precision's tensors: bfloat16, float16, else float32."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)


def _inputs(torch, shape: Shape, seed: int, grad: bool, precision: str = "fp32"):
    """Q, K, V (and dO) uniform in [-1, 1) as (B, H, rows, d) CUDA tensors of the precision's dtype."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = (shape.seq_q, shape.seq_k, shape.seq_k) + ((shape.seq_q,) if grad else ())
    dtype = torch_dtype(torch, precision)
    return [(torch.rand(shape.batch, shape.heads, n, shape.d, device="cuda", generator=gen) * 2 - 1).to(dtype)
            for n in rows]


def _first_line(text: str, fallback: str) -> str:
    text = text.strip()
    return text.splitlines()[0] if text else fallback


def rejection_reason(messages: Sequence[str], error: str) -> str:
    """torch's reasons for refusing a forced backend, from the warnings it gave while refusing:
    without the "... not used because:" headers, the notes that some other backend is disabled and
    the "(Triggered internally at ...)" trailers; the error's first line when they say nothing."""
    reasons = []
    for message in messages:
        text = " ".join(message.split(_TRIGGERED)[0].split())
        if text and not text.endswith(_NO_REASON) and text not in reasons:
            reasons.append(text)
    return "; ".join(reasons) or _first_line(error, "refused")


@contextlib.contextmanager
def _forced(torch, backend: Optional[str]):
    """Only `backend` (a key of SDPA_BACKENDS) may run SDPA inside; None: torch's own choice."""
    if backend is None:
        yield
        return
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415
    except ImportError:
        raise _Refused(f"torch {torch.__version__} cannot force an SDPA backend (no torch.nn.attention)") from None

    member = getattr(SDPBackend, SDPA_BACKENDS[backend], None)
    if member is None:
        raise _Refused(f"torch {torch.__version__} has no {SDPA_BACKENDS[backend]}")
    with sdpa_kernel(member):
        yield


def _probe(torch, fn):
    """fn() once, its warnings kept: torch's "No available kernel" is the forced backend's
    refusal (_Refused with torch's reason); any other error, a kernel that crashed or ran out of
    memory, is raised as it is (a failure, not a refusal)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return fn()
        except RuntimeError as exc:
            if _NO_KERNEL not in str(exc):
                raise
            raise _Refused(rejection_reason([str(w.message) for w in caught], str(exc))) from None


def _timed(shape: Shape, precision: str, flop: float, setup, backend: Optional[str] = None) -> dict:
    """Runs setup(torch, F) -> fn under `precision`'s matmul setting and times fn, only `backend`
    allowed when given (setup included: the backward's forward picks the backend its backward
    runs); the result dict of time_sdpa. Out of memory is status OOM, a forced backend's refusal
    'unsupported: <torch's reason>', any other failure a 'failed: ...' status."""
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415

    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    about = {"torch": torch.__version__, "dtype": tensor_dtype(precision)}
    try:
        with _forced(torch, backend):
            if backend is None:
                fn, warmup, reps = setup(torch, F)
            else:
                fn, warmup, reps = _probe(torch, lambda: setup(torch, F))
                _probe(torch, fn)
            torch.cuda.synchronize()
            ms = median_ms(torch, fn, warmup, reps)
        return {"status": "ok", "ms": ms, "tflops": flop / (ms * 1e-3) / 1e12,
                "peak_mib": round(torch.cuda.max_memory_allocated() / MIB, 1), **about}
    except _Refused as exc:
        return {"status": f"{UNSUPPORTED}: {str(exc)[:300]}", **about}
    except torch.cuda.OutOfMemoryError:
        return {"status": OOM, **about}
    except RuntimeError as exc:  # a kernel that crashed
        return {"status": f"failed: {_first_line(str(exc), type(exc).__name__)[:120]}", **about}
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
        torch.cuda.empty_cache()


def time_sdpa(shape: Shape, precision: str, warmup: int, reps: int, seed: int = 0,
              backend: Optional[str] = None) -> dict:
    """Median ms of torch SDPA on (B, H, N, d) CUDA tensors: fp32 (`precision` tf32 allows TF32
    matmuls, which the fused fp32 backends ignore), or bf16/fp16 at those precisions; `backend` (a
    key of SDPA_BACKENDS) forces one. Returns {"status", "ms", "tflops", "peak_mib", "torch",
    "dtype"}: peak_mib is the most device memory torch held while timing (inputs included); status
    is OOM when the device runs out of memory, 'unsupported: <reason>' when the forced backend
    refuses the problem."""
    def setup(torch, F):
        q, k, v = _inputs(torch, shape, seed, grad=False, precision=precision)
        torch.cuda.reset_peak_memory_stats()
        return (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal)), warmup, reps

    return _timed(shape, precision, shape.flash_flop, setup, backend)


def time_sdpa_backends(shape: Shape, precision: str, warmup: int, reps: int, pass_: str = FORWARD,
                       seed: int = 0) -> Dict[str, dict]:
    """The pass's timer (time_sdpa, or time_sdpa_backward for BACKWARD) with each of SDPA_BACKENDS
    forced, by backend name."""
    timer = time_sdpa_backward if pass_ == BACKWARD else time_sdpa
    return {name: timer(shape, precision, warmup, reps, seed, backend=name) for name in SDPA_BACKENDS}


def sdpa_output(q: np.ndarray, k: np.ndarray, v: np.ndarray, rows: Sequence[int], scale: float, causal: bool,
                precision: str, backend: Optional[str] = None) -> Union[np.ndarray, str]:
    """SDPA's output rows `rows` of each head, (H, len(rows), d) float64, for float32 inputs (H, N, d)
    converted to the precision's dtype on the GPU (nearest even, as the binary converts them);
    torch's own choice of backend, or `backend` forced. A refusal or failure is returned as the
    status string ('unsupported: <reason>', 'failed: ...')."""
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415

    dtype = torch_dtype(torch, precision)
    try:
        q_t, k_t, v_t = (torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).cuda().to(dtype)[None]
                         for x in (q, k, v))
        with _forced(torch, backend):
            out = _probe(torch, lambda: F.scaled_dot_product_attention(q_t, k_t, v_t, scale=scale, is_causal=causal))
    except _Refused as exc:
        return f"{UNSUPPORTED}: {str(exc)[:300]}"
    except RuntimeError as exc:  # out of memory (torch's OutOfMemoryError is one), or a crash
        return f"failed: {_first_line(str(exc), type(exc).__name__)[:120]}"
    index = torch.as_tensor(list(rows), device=out.device, dtype=torch.long)
    return out[0].index_select(1, index).double().cpu().numpy()


def time_sdpa_backward(shape: Shape, precision: str, warmup: int, reps: int, seed: int = 0,
                       backend: Optional[str] = None) -> dict:
    """Median ms of SDPA's backward alone: torch.autograd.grad of one forward's output with a fixed
    dO for Q, K and V (the graph kept between calls, so only the backward is timed); `backend`
    forces the forward's backend, whose own backward then runs. The result as time_sdpa's, TFLOP/s
    by 2.5x the forward's FLOPs, peak_mib with the forward's saved tensors."""
    def setup(torch, F):
        q, k, v, do = _inputs(torch, shape, seed, grad=True, precision=precision)
        for x in (q, k, v):
            x.requires_grad_(True)
        torch.cuda.reset_peak_memory_stats()
        out = F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal)
        return (lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)), warmup, reps

    return _timed(shape, precision, shape.backward_flop, setup, backend)
