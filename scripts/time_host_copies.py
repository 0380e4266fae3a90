#!/usr/bin/env python3
"""time_host_copies.py [--mib N ...] [--count K] — how fast a GPU's float64 arrays come back to
the host: PyTorch's own copy (`.cpu().numpy()`) against a copy into an array NumPy allocates (what
the check's device path does: verify/model/arrays.py to_numpy), K fresh arrays of each size, each
way twice, alternating. The host memory of each copy is new, as a check's results are, so its page
faults are part of the copy's time. Needs PyTorch and a CUDA GPU.

    python3 scripts/time_host_copies.py --mib 32 --mib 128
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from cuda_torch import cuda_torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, action="append", help="an array's size in MiB (repeatable)")
    parser.add_argument("--count", type=int, default=8, help="arrays of each size")
    args = parser.parse_args()
    if args.count < 1 or any(m < 1 for m in args.mib or []):
        parser.error("--count and --mib take positive numbers")
    torch = cuda_torch("time_host_copies.py")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from verify.model.arrays import to_numpy

    ways = (("PyTorch's .cpu().numpy()", lambda x: x.cpu().numpy()), ("into NumPy's memory (to_numpy)", to_numpy))
    print(torch.cuda.get_device_name(0))
    for mib in args.mib or [32, 128]:
        xs = [torch.rand(mib << 17, dtype=torch.float64, device="cuda") for _ in range(args.count)]
        torch.cuda.synchronize()
        for _ in range(2):
            for name, copy in ways:
                t0 = time.perf_counter()
                kept = [copy(x) for x in xs]
                seconds = time.perf_counter() - t0
                if not all(np.array_equal(k[:8], x[:8].cpu().numpy()) for k, x in zip(kept, xs)):
                    sys.exit("time_host_copies.py: a copy does not hold its array's values")
                del kept
                print(f"{args.count} arrays of {mib} MiB, {name}: {seconds * 1e3:.1f} ms, "
                      f"{args.count * mib / 1024 / seconds:.2f} GiB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
