#!/usr/bin/env python3
"""count_tile_passes.py [--tile-mib MIB] [--top N] --in IN --out OUT — how many passes over a row
tile the check's device path makes, and where they come from. It runs `attnstep check --in IN --out
OUT` with the flash stages' references on PyTorch's CPU tensors (the code `check --device cuda` runs
on a GPU, so no GPU is needed), in row tiles of MIB MiB of float64 scores, and counts the PyTorch
calls that take a whole tile's array (its rows × the keys): on a GPU each is at least one kernel
that reads the tile. It prints the calls per tile by operation, by file and by line of verify/
(docs/performance.md, "The flash stages' references on a GPU", quotes a run).

    python3 scripts/count_tile_passes.py --in IN --out OUT
"""
import argparse
import collections
import os
import runpy
import sys
import traceback

# What only describes or reshapes a tensor reads none of it.
_NO_PASS = {"size", "dim", "shape", "dtype", "device", "__get__", "T", "mT", "view", "reshape", "expand",
            "__getitem__", "numel", "is_floating_point", "stride", "is_contiguous", "unsqueeze", "transpose", "t",
            "permute", "contiguous", "broadcast_to", "squeeze", "__len__", "element_size", "data_ptr", "nbytes",
            "item", "__bool__", "__hash__", "__setitem__", "ndim"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--in", dest="inp", required=True, help="the input case folder")
    parser.add_argument("--out", required=True, help="the run's output folder")
    parser.add_argument("--tile-mib", type=int, default=4, help="MiB of float64 scores a row tile (default 4)")
    parser.add_argument("--top", type=int, default=40, help="lines of verify/ to list (default 40)")
    args = parser.parse_args()
    try:
        import torch
        from torch.overrides import TorchFunctionMode
    except ImportError:
        sys.exit("count_tile_passes.py: needs PyTorch (pip install torch)")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from verify.cli import check as check_cli
    from verify.files.case import load_input_case
    from verify.model import arrays, tiles

    dims = load_input_case(args.inp).dims
    tiles.DEVICE_TILE_BYTES = args.tile_mib << 20
    with arrays.on_device("torch-cpu"):
        spans = tiles.row_tiles(dims.seq_q, dims.seq_k, min(dims.d_k, dims.d_v))
    shapes = {s for a, b in spans for s in ((b - a, dims.seq_k), (dims.seq_k, b - a))}
    ops, files, lines, calls = collections.Counter(), collections.Counter(), collections.Counter(), 0

    def whole_tile(x) -> bool:
        return isinstance(x, torch.Tensor) and tuple(x.shape) in shapes

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            nonlocal calls
            kwargs = kwargs or {}
            name = getattr(func, "__name__", str(func))
            if name not in _NO_PASS and any(whole_tile(a) for a in list(args) + list(kwargs.values())):
                calls += 1
                ops[name] += 1
                ours = [f for f in traceback.extract_stack(limit=30)
                        if "/verify/" in f.filename and not f.filename.endswith("arrays.py")]
                if ours:
                    where = ours[-1].filename.split("/verify/")[-1]
                    files[where] += 1
                    lines[f"{where}:{ours[-1].lineno}  {(ours[-1].line or '')[:80]}"] += 1
            return func(*args, **kwargs)

    check_cli._device = lambda name: "torch-cpu"
    sys.argv = ["attnstep", "check", "--in", args.inp, "--out", args.out, "--quiet"]
    with Count():
        try:
            runpy.run_module("verify", run_name="__main__")
        except SystemExit as done:
            if done.code not in (0, 1, None):
                return int(done.code) if isinstance(done.code, int) else 2
    n = len(spans)
    print(f"{n} row tiles of up to {spans[0][1] - spans[0][0]} rows x {dims.seq_k} keys: {calls / n:.1f} "
          f"whole-tile calls a tile")
    for title, counter, top in (("by operation", ops, 20), ("by file", files, 20), ("by line", lines, args.top)):
        print(f"\n{title}:")
        for key, count in counter.most_common(top):
            print(f"{count / n:8.1f}  {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
