"""One-pass kernels on a CUDA device for the model's primitives whose PyTorch composition passes
over memory many times: the same sums in float64, to its rounding (each chunk's product a float64
tensor-core dot here, a GEMM in the composition; a segment starts from a GEMM), written once in
Triton, which PyTorch's CUDA builds carry.
Where Triton cannot run (no CUDA device, PyTorch on the CPU, Triton missing or failing to compile),
the caller's composition runs instead: these are a speed-up, never a second model.

running_sums is tensor-core truncation's model (verify/model/mma.py): A @ B an MMA_K-long chunk of
its sum at a time, with the sum of the running sum's magnitudes after each chunk. Composed of
PyTorch operations, each chunk's product, its running sum and its magnitude are N×M passes of their
own; here every output element keeps both sums in registers while the chunks stream through.
"""
from __future__ import annotations

import functools
import warnings
from typing import Optional, Tuple

# Output tiles of the kernel: BLOCK_R × BLOCK_C elements a program, two float64 sums each, on
# NUM_WARPS warps (as fast as 64×64, the fastest of the others tried on an H100, and faster on Q·Kᵀ
# and P·V: docs/performance.md). BLOCK_K: the k extent of each chunk's dot, the
# shortest float64 dot Triton compiles (16): the chunk's entries and zeros after them, so the tensor
# cores do twice the products, on an H100 still 2.8-4.1× as fast as a product at a time on the
# float64 units.
BLOCK_R, BLOCK_C, NUM_WARPS = 32, 64, 4
BLOCK_K = 16

# A long sum (the keys of P·V, the queries of dK) runs in segments of its chunks when its output
# has too few tiles to fill the GPU: each segment starts from the running sum at its start (one
# GEMM a segment gives it) and adds its own magnitudes; the totals are summed over the segments.
# PROGRAMS_WANTED: enough programs that every SM holds a few; no segment shorter than
# MIN_SEGMENT_CHUNKS chunks.
PROGRAMS_WANTED = 1024
MIN_SEGMENT_CHUNKS = 64


@functools.lru_cache(maxsize=None)
def _kernel():
    """The compiled Triton kernel, or None where Triton cannot be imported."""
    try:
        import triton  # noqa: PLC0415 -- only on a CUDA device
        import triton.language as tl  # noqa: PLC0415
    except Exception:  # noqa: BLE001 -- any failure to load Triton leaves the composition
        return None

    @triton.jit
    def running_sums_kernel(a_ptr, b_ptr, start_ptr, partial_ptr, total_ptr, R, C, K, seg_len,
                            s_ar, s_ak, s_bk, s_bc, s_ss, s_sr, s_sc, s_ts,
                            CHUNK: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        seg = tl.program_id(2)
        in_r, in_c = rows < R, cols < C
        inside = in_r[:, None] & in_c[None, :]
        at = rows[:, None] * s_sr + cols[None, :] * s_sc
        acc = tl.load(start_ptr + seg * s_ss + at, mask=inside, other=0.0)
        total = tl.full((BR, BC), 0.0, tl.float64)
        k_end = tl.minimum(K, (seg + 1) * seg_len)
        kk = tl.arange(0, BK)
        for k0 in range(seg * seg_len, k_end, CHUNK):
            # One chunk: its CHUNK columns of A and rows of B, the rest of the BK-long block
            # loaded as zeros (nothing read), so the dot adds exactly the chunk's products.
            ks = k0 + kk
            mine = (kk < CHUNK) & (ks < k_end)
            a = tl.load(a_ptr + rows[:, None] * s_ar + ks[None, :] * s_ak, mask=in_r[:, None] & mine[None, :],
                        other=0.0)
            b = tl.load(b_ptr + ks[:, None] * s_bk + cols[None, :] * s_bc, mask=mine[:, None] & in_c[None, :],
                        other=0.0)
            acc = tl.dot(a, b, acc, out_dtype=tl.float64)
            total += tl.abs(acc)
        out = rows[:, None] * C + cols[None, :]
        tl.store(total_ptr + seg * s_ts + out, total, mask=inside)
        tl.store(partial_ptr + seg * s_ts + out, acc, mask=inside)

    return triton, running_sums_kernel


# Triton failed to compile or launch here once: the composition from now on (it would fail again).
_BROKEN = [False]


# The kernel's offsets are 32-bit: operands whose elements lie further apart take the composition.
_MAX_OFFSET = 2**31 - 1


def _usable(A, B, partial, total, chunk: int) -> bool:
    """float64 CUDA matrices, a product with something to sum, running sums of its shape, and
    elements that the kernel's offsets reach."""
    xs = (A, B, partial, total)
    if not all(x.is_cuda and x.dtype.is_floating_point and x.element_size() == 8 and len(x.shape) == 2
               for x in xs):
        return False
    (R, K), C = A.shape, B.shape[1]
    if R * C * K == 0 or tuple(partial.shape) != (R, C) or tuple(total.shape) != (R, C):
        return False
    most_segments = -(-K // (chunk * MIN_SEGMENT_CHUNKS))
    reach = max((R - 1) * A.stride(0) + (K - 1) * A.stride(1), (K - 1) * B.stride(0) + (C - 1) * B.stride(1),
                (R - 1) * partial.stride(0) + (C - 1) * partial.stride(1), most_segments * R * C)
    return reach <= _MAX_OFFSET


def running_sums(A, B, partial, total, chunk: int) -> Optional[Tuple[object, object]]:
    """(partial + A @ B, total + Σ over the chunk-long chunks of the sum of |the running sum after
    the chunk|), the running sum starting at partial, for float64 CUDA tensors; None where the
    kernel does not run (the caller's composition then computes it)."""
    if _BROKEN[0] or not _usable(A, B, partial, total, chunk) or _kernel() is None:
        return None
    try:
        return _launch(A, B, partial, total, chunk)
    except Exception as exc:  # noqa: BLE001 -- a Triton that cannot compile or launch here
        if type(exc).__name__ == "OutOfMemoryError":
            raise  # (PyTorch's, the GPU's memory: the check's own one-line error)
        _BROKEN[0] = True
        warnings.warn(f"Triton's kernel for tensor-core truncation's model failed here ({type(exc).__name__}: "
                      f"{str(exc).splitlines()[0] if str(exc) else ''}); PyTorch's operations compute it instead, "
                      "more slowly", RuntimeWarning, stacklevel=2)
        return None


def _launch(A, B, partial, total, chunk: int):
    """running_sums' kernel on A's device (any, under Triton's interpreter: the tests)."""
    triton, kernel = _kernel()
    torch = _torch()
    R, K = A.shape
    C = B.shape[1]
    tiles = triton.cdiv(R, BLOCK_R) * triton.cdiv(C, BLOCK_C)
    chunks = triton.cdiv(K, chunk)
    segments = max(1, min(triton.cdiv(PROGRAMS_WANTED, tiles), chunks // MIN_SEGMENT_CHUNKS))
    seg_len = triton.cdiv(chunks, segments) * chunk
    segments = triton.cdiv(K, seg_len) if K else 1
    starts = partial[None] if segments == 1 else _segment_starts(A, B, partial, seg_len, segments)
    partials, totals = (torch.empty((segments, R, C), dtype=torch.float64, device=A.device) for _ in range(2))
    grid = (triton.cdiv(R, BLOCK_R), triton.cdiv(C, BLOCK_C), segments)
    kernel[grid](A, B, starts, partials, totals, R, C, K, seg_len,
                 A.stride(0), A.stride(1), B.stride(0), B.stride(1),
                 starts.stride(0), starts.stride(1), starts.stride(2), R * C,
                 CHUNK=chunk, BK=triton.next_power_of_2(max(BLOCK_K, chunk)), BR=BLOCK_R, BC=BLOCK_C,
                 num_warps=NUM_WARPS)
    # The last segment's running sum is A @ B's (a copy of its own: a carry across tiles then holds
    # no other segment's).
    partial_out = partials[0] if segments == 1 else partials[-1].clone()
    return partial_out, total + (totals[0] if segments == 1 else totals.sum(dim=0))


def _segment_starts(A, B, partial, seg_len: int, segments: int):
    """The running sum at each segment's start: partial, then partial plus the GEMMs of the
    segments before (segments × R × C), from one batched GEMM of the segments and a running sum
    over them (a GEMM a segment launched one at a time cost the host more than the GPU its work)."""
    torch = _torch()
    (R, _), C = A.shape, B.shape[1]
    k = (segments - 1) * seg_len  # (the segments before the last: each holds seg_len whole)
    products = torch.bmm(A[:, :k].reshape(R, segments - 1, seg_len).transpose(0, 1),
                         B[:k].reshape(segments - 1, seg_len, C))
    return torch.cumsum(torch.cat([partial[None], products]), dim=0)


def _torch():
    import torch  # noqa: PLC0415 -- only on a CUDA device
    return torch
