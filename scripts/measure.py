#!/usr/bin/env python3
"""measure.py CMD... — runs CMD and prints its wall time and peak memory, for the throughput and
memory figures in README.md and docs/performance.md. Exits with CMD's status.

Two peaks: the resident memory of the largest single process (CMD or one of its children, as the
kernel counts it), and, on Linux, the largest total over CMD's whole process tree at any moment,
sampled every 20 ms as proportional set size (each page shared by k processes counted 1/k: forked
workers share the pages they inherit, so a sum of their resident sizes would count those several
times). The tree's total is what a check that runs several worker processes holds at once."""
import os
import resource
import subprocess
import sys
import threading
import time

_SAMPLE_S = 0.02


def _children() -> dict:
    """Parent pid -> its children's pids, of every process this one can see."""
    kids: dict = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                # (the command name may hold spaces and parentheses: the fields after its last ')')
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(name))
    return kids


def _pss_kib(pid: int) -> int:
    """The proportional set size of pid in KiB (its resident size where the kernel gives no PSS; 0
    once it is gone)."""
    for path, field in ((f"/proc/{pid}/smaps_rollup", "Pss:"), (f"/proc/{pid}/status", "VmRSS:")):
        try:
            with open(path) as f:
                for line in f:
                    if line.startswith(field):
                        return int(line.split()[1])
        except OSError:
            continue
    return 0


def tree_kib(root: int) -> int:
    """The total proportional set size of root and its descendants, in KiB."""
    kids, total, todo = _children(), 0, [root]
    while todo:
        pid = todo.pop()
        total += _pss_kib(pid)
        todo.extend(kids.get(pid, ()))
    return total


def main() -> int:
    if len(sys.argv) < 2:
        sys.exit("usage: measure.py CMD [ARGS...]")
    t0 = time.perf_counter()
    proc = subprocess.Popen(sys.argv[1:])
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(_SAMPLE_S):
            peak[0] = max(peak[0], tree_kib(proc.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    if os.path.isdir("/proc/self"):
        sampler.start()
    rc = proc.wait()
    wall = time.perf_counter() - t0
    done.set()
    largest_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # Linux reports KiB
    tree = f", the process tree's peak total {peak[0] / 1024:.0f} MiB (PSS)" if peak[0] else ""
    print(f"measure: {wall:.2f} s wall, peak RSS {largest_mib:.0f} MiB{tree}, exit {rc}: {' '.join(sys.argv[1:])}",
          file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
