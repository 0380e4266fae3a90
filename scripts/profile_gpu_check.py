#!/usr/bin/env python3
"""profile_gpu_check.py [--top N] CHECK-OPTIONS... — runs `attnstep check CHECK-OPTIONS` in this
process under PyTorch's profiler and prints how the GPU's time compares with the check's: the wall
time (longer than an unprofiled run's), the GPU's kernels and copies in all, and the kernels that
took most of it, by name. Where the GPU's total is a small part of the wall time, the check's time
goes to the host's work and to waiting for the GPU (docs/performance.md, "The flash stages'
references on a GPU", was measured with it).

    python3 scripts/profile_gpu_check.py --in IN --out OUT --device cuda --quiet
"""
import os
import runpy
import sys
import time

from cuda_torch import cuda_torch


def main() -> int:
    args = sys.argv[1:]
    top = 25
    if args[:1] == ["--top"]:
        if len(args) < 2 or not args[1].isdigit():
            sys.exit(f"profile_gpu_check.py: --top needs a count of kernels, got {args[1] if len(args) > 1 else 'nothing'}")
        top, args = int(args[1]), args[2:]
    torch = cuda_torch("profile_gpu_check.py")
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.argv = ["attnstep", "check"] + args
    t0 = time.perf_counter()
    code = 0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        try:
            runpy.run_module("verify", run_name="__main__")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    by_name = {}
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            seconds, count = by_name.get(event.name, (0.0, 0))
            by_name[event.name] = (seconds + event.device_time_total / 1e6, count + 1)
    total = sum(s for s, _ in by_name.values())
    print(f"check: {wall:.2f} s wall under the profiler, exit {code}; the GPU's kernels and copies: {total:.3f} s "
          f"({sum(c for _, c in by_name.values())} of them)")
    for name, (seconds, count) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{seconds:9.3f} s {count:7d}  {name[:140]}")
    return code


if __name__ == "__main__":
    sys.exit(main())
