"""PyTorch SDPA timed in this process, the yardstick of `attnstep bench` and `attnstep sweep`: its
forward (`torch.nn.functional.scaled_dot_product_attention`) and its backward (`torch.autograd.grad`
of that output with a fixed output gradient dO), fp32 CUDA tensors of the binary's shape, median of
CUDA-event timings after warm-up. torch is imported only here, and only when asked."""
from __future__ import annotations

import statistics
from typing import Optional

from .bench_report import MIB, OOM, Shape

__all__ = ["time_sdpa", "time_sdpa_backward", "torch_available"]


def torch_available() -> Optional[str]:
    """torch's version when it imports and sees a GPU, else None."""
    try:
        import torch  # noqa: PLC0415 (optional dependency)
    except Exception:
        return None
    return torch.__version__ if torch.cuda.is_available() else None


def _median_ms(torch, fn, warmup: int, reps: int) -> float:
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


def _inputs(torch, shape: Shape, seed: int, grad: bool):
    """Q, K, V (and dO) uniform in [-1, 1) as (B, H, rows, d) fp32 CUDA tensors."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = (shape.seq_q, shape.seq_k, shape.seq_k) + ((shape.seq_q,) if grad else ())
    return [torch.rand(shape.batch, shape.heads, n, shape.d, device="cuda", generator=gen) * 2 - 1 for n in rows]


def _timed(shape: Shape, precision: str, flop: float, setup) -> dict:
    """Runs setup(torch, F) -> fn under `precision`'s matmul setting and times fn; the result dict
    of time_sdpa. Out of memory is status OOM, any other failure a 'failed: ...' status."""
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415

    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    try:
        fn, warmup, reps = setup(torch, F)
        torch.cuda.synchronize()
        ms = _median_ms(torch, fn, warmup, reps)
        return {"status": "ok", "ms": ms, "tflops": flop / (ms * 1e-3) / 1e12,
                "peak_mib": round(torch.cuda.max_memory_allocated() / MIB, 1), "torch": torch.__version__}
    except torch.cuda.OutOfMemoryError:
        return {"status": OOM, "torch": torch.__version__}
    except RuntimeError as exc:  # out of memory, or no backend for the shape
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return {"status": f"failed: {first[:120]}", "torch": torch.__version__}
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
        torch.cuda.empty_cache()


def time_sdpa(shape: Shape, precision: str, warmup: int, reps: int, seed: int = 0) -> dict:
    """Median ms of torch SDPA on fp32 (B, H, N, d) CUDA tensors; `precision` tf32 allows TF32
    matmuls (the fused fp32 backends ignore it). Returns {"status", "ms", "tflops", "peak_mib",
    "torch"}: peak_mib is the most device memory torch held while timing (inputs included);
    status is OOM when the device runs out of memory."""
    def setup(torch, F):
        q, k, v = _inputs(torch, shape, seed, grad=False)
        torch.cuda.reset_peak_memory_stats()
        return (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal)), warmup, reps

    return _timed(shape, precision, shape.flash_flop, setup)


def time_sdpa_backward(shape: Shape, precision: str, warmup: int, reps: int, seed: int = 0) -> dict:
    """Median ms of SDPA's backward alone: torch.autograd.grad of one forward's output with a fixed
    dO for Q, K and V (the graph kept between calls, so only the backward is timed); the result
    as time_sdpa's, TFLOP/s by 2.5x the forward's FLOPs, peak_mib with the forward's saved tensors."""
    def setup(torch, F):
        q, k, v, do = _inputs(torch, shape, seed, grad=True)
        for x in (q, k, v):
            x.requires_grad_(True)
        torch.cuda.reset_peak_memory_stats()
        out = F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal)
        return (lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)), warmup, reps

    return _timed(shape, precision, shape.backward_flop, setup)
