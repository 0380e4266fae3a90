#!/usr/bin/env python3
"""time_running_sums.py [--rows R] [--keys M] [--d D] [--tiles R,C,WARPS ...] — times the one-pass
kernel of tensor-core truncation's model (verify/model/fused.py) on the products of one row tile of
a flash check on a CUDA device: Q·Kᵀ (R × D × M: a short sum, a long output), P·V (R × M × D: a
long sum, run in segments) and dK's Xᵀ·Y (M × R × D, X given transposed). Each product is timed
with CUDA events, the mean of five calls after two (the segments' starting GEMM included: all a
check's call runs), and compared with the PyTorch composition that runs where the kernel does not
(the largest difference, relative to the magnitudes' sum). --tiles: output tiles and warps to try
instead of the module's (docs/performance.md quotes the ones tried). Needs PyTorch with CUDA and
Triton.

    python3 scripts/time_running_sums.py --tiles 32,32,4 32,64,4 64,64,4
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from verify.model import fused, mma  # noqa: E402
from verify.model.kernels import MMA_K  # noqa: E402

from cuda_torch import cuda_torch  # noqa: E402 (this folder's)

CALLS, WARM_CALLS = 5, 2


def _tile(text: str):
    try:
        r, c, w = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a tile is ROWS,COLUMNS,WARPS (three integers), got {text!r}") from None
    return r, c, w


def operands(torch, rows: int, keys: int, d: int):
    """Each product's (A, B, partial, total), random normal float64 on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, dtype=torch.float64, device="cuda", generator=g)

    out = {}
    for name, (a, b, transposed) in {"Q·Kᵀ": ((rows, d), (d, keys), False),
                                      "P·V": ((rows, keys), (keys, d), False),
                                      "dK's Xᵀ·Y": ((keys, rows), (rows, d), True)}.items():
        A = randn(*a[::-1]).T if transposed else randn(*a)
        partial = randn(a[0], b[1])
        out[name] = (A, randn(*b), partial, partial.abs())
    return out


def time_one(torch, A, B, partial, total) -> float:
    """Mean milliseconds of a call of the kernel."""
    for _ in range(WARM_CALLS):
        fused.running_sums(A, B, partial, total, MMA_K)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(CALLS):
        fused.running_sums(A, B, partial, total, MMA_K)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / CALLS


def difference(A, B, partial, total) -> float:
    """The kernel's largest difference from the composition, relative to the magnitudes' sum."""
    got = fused.running_sums(A, B, partial, total, MMA_K)
    if got is None:
        sys.exit("time_running_sums.py: the kernel did not run here (Triton missing or failing; see the warning)")
    fused._BROKEN[0] = True  # (the composition's turn)
    try:
        want = mma.mma_running_sums(A, B, partial, total)
    finally:
        fused._BROKEN[0] = False
    return max(float(((g - w).abs() / want[1]).max()) for g, w in zip(got, want))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1024, help="query rows of the tile [1024]")
    ap.add_argument("--keys", type=int, default=32768, help="keys M [32768]")
    ap.add_argument("--d", type=int, default=128, help="head dimension [128]")
    ap.add_argument("--tiles", type=_tile, nargs="+", default=[None],
                    help="output tiles and warps to try, ROWS,COLUMNS,WARPS [the module's]")
    args = ap.parse_args()
    torch = cuda_torch("time_running_sums.py")
    ops = operands(torch, args.rows, args.keys, args.d)
    print(f"{args.rows} query rows, {args.keys} keys, d {args.d}, float64 ({torch.cuda.get_device_name()})")
    for tile in args.tiles:
        if tile is not None:
            fused.BLOCK_R, fused.BLOCK_C, fused.NUM_WARPS = tile
        cells = []
        for name, (A, B, partial, total) in ops.items():
            diff = difference(A, B, partial, total)
            ms = time_one(torch, A, B, partial, total)
            cells.append(f"{name} {ms:.2f} ms ({2 * A.shape[0] * A.shape[1] * B.shape[1] / ms / 1e9:.1f} TFLOP/s, "
                         f"within {diff:.1e})")
        print(f"tile {fused.BLOCK_R}×{fused.BLOCK_C}, {fused.NUM_WARPS} warps: " + "; ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
