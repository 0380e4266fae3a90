#!/usr/bin/env python3
"""peak_device_memory.py --max-mib MIB CMD... — runs CMD, samples its device memory with nvidia-smi
every 20 ms (what the driver charges to the process, its CUDA context included) and states the
peak against the bound. Exit status: CMD's when it fails, else 1 when the peak exceeds the bound or
nvidia-smi never listed the process, else 0."""
import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from verify.bench.device_memory import PeakDeviceMemory  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--max-mib", type=float, required=True, help="the bound on the peak, in MiB")
parser.add_argument("cmd", nargs=argparse.REMAINDER, help="the command to run")
args = parser.parse_args()
if not args.cmd:
    parser.error("no command given")
memory = PeakDeviceMemory()
if not memory.smi:
    sys.exit("peak_device_memory: nvidia-smi not found; no figure to state")
proc = subprocess.Popen(args.cmd)
with memory.watch(proc.pid):
    rc = proc.wait()
peak = memory.peak_mib
verdict = "no figure (nvidia-smi never listed the process)" if peak is None else (
    f"{peak} MiB, {'under' if peak < args.max_mib else 'OVER'} the bound of {args.max_mib:g} MiB")
print(f"peak device memory: {verdict}: {' '.join(args.cmd)}", file=sys.stderr)
if rc:
    sys.exit(rc)
sys.exit(0 if peak is not None and peak < args.max_mib else 1)
