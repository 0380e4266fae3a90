#!/usr/bin/env python3
"""measure.py CMD... — runs CMD and prints its wall time and peak resident memory (of CMD and
its children), for the throughput and memory figures in README.md. Exits with CMD's status."""
import resource
import subprocess
import sys
import time

if len(sys.argv) < 2:
    sys.exit("usage: measure.py CMD [ARGS...]")
t0 = time.perf_counter()
rc = subprocess.call(sys.argv[1:])
wall = time.perf_counter() - t0
peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # Linux reports KiB
print(f"measure: {wall:.2f} s wall, peak RSS {peak_mib:.0f} MiB, exit {rc}: {' '.join(sys.argv[1:])}",
      file=sys.stderr)
sys.exit(rc)
