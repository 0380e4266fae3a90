#!/usr/bin/env python3
"""measure.py CMD... — runs CMD and prints its wall time and peak memory, for the throughput and
memory figures in README.md and docs/performance.md. Exits with CMD's status.

Two peaks: the resident memory of the largest single process (CMD or one of its children, as the
kernel counts it), and, on Linux, the largest total over CMD's whole process tree at any moment,
as proportional set size (each page shared by k processes counted 1/k: forked workers share the
pages they inherit, so a sum of their resident sizes would count those several times). The tree's
total is what a check that runs several worker processes holds at once. Where the kernel gives no
proportional size (no /proc/PID/smaps_rollup), the total is the sum of resident sizes and says so.

Sampling: reading a process's proportional size walks its page tables (some 16 ms a GiB), so the
sampler sleeps four times as long as its last walk took, and at least 20 ms: it takes at most a
fifth of one core. Processes whose parent exits are kept in the tree (this process becomes their
parent: a child subreaper)."""
import ctypes
import os
import resource
import subprocess
import sys
import threading
import time

_SAMPLE_S = 0.02
_PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>


def _children() -> dict:
    """Parent pid -> its children's pids, of every process this one can see."""
    kids: dict = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", errors="replace") as f:
                # (the command name may hold spaces and parentheses: the fields after its last ')')
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(name))
    return kids


def _memory_kib(pid: int):
    """(pid's proportional set size in KiB, True), or (its resident size, False) where the kernel
    gives no proportional one; (0, True) once it is gone."""
    for path, field, proportional in ((f"/proc/{pid}/smaps_rollup", "Pss:", True),
                                      (f"/proc/{pid}/status", "VmRSS:", False)):
        try:
            with open(path, errors="replace") as f:
                for line in f:
                    if line.startswith(field):
                        return int(line.split()[1]), proportional
        except (OSError, ValueError, IndexError):
            continue
    return 0, True


def tree_kib(root: int):
    """(the total memory of root's descendants in KiB, whether every one gave its proportional
    size). root itself (this process) is left out."""
    kids, total, proportional = _children(), 0, True
    todo = list(kids.get(root, ()))
    while todo:
        pid = todo.pop()
        kib, exact = _memory_kib(pid)
        total, proportional = total + kib, proportional and exact
        todo.extend(kids.get(pid, ()))
    return total, proportional


def main() -> int:
    if len(sys.argv) < 2:
        sys.exit("usage: measure.py CMD [ARGS...]")
    linux = os.path.isdir("/proc/self")
    if linux:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1)
        except (OSError, AttributeError):
            pass
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(sys.argv[1:])
    except OSError as exc:  # (not found, not executable: one line, as a shell says it)
        sys.exit(f"measure.py: cannot run {sys.argv[1]}: {exc.strerror}")
    peak, proportional = [0], [True]
    done = threading.Event()

    def sample() -> None:
        pause = _SAMPLE_S
        while not done.wait(pause):
            start = time.perf_counter()
            kib, exact = tree_kib(os.getpid())
            peak[0], proportional[0] = max(peak[0], kib), proportional[0] and exact
            pause = max(_SAMPLE_S, 4 * (time.perf_counter() - start))

    sampler = threading.Thread(target=sample, daemon=True)
    if linux:
        sampler.start()
    rc = proc.wait()
    wall = time.perf_counter() - t0
    done.set()
    if linux:
        sampler.join()
    largest_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # Linux reports KiB
    how = "PSS" if proportional[0] else "the sum of resident sizes: this kernel gives no PSS"
    tree = f", the process tree's peak total {peak[0] / 1024:.0f} MiB ({how})" if peak[0] else ""
    print(f"measure: {wall:.2f} s wall, peak RSS {largest_mib:.0f} MiB{tree}, exit {rc}: {' '.join(sys.argv[1:])}",
          file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
