"""The peak device memory of a running process, sampled with nvidia-smi on a thread.

nvidia-smi reports what the driver charges to the process, its CUDA context (a few hundred MiB)
included. Without nvidia-smi, or when it never lists the process, there is no figure (None).
"""
from __future__ import annotations

import contextlib
import shutil
import subprocess
import threading
from typing import Optional

SMI = "nvidia-smi"
SMI_QUERY = ("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")
POLL_S = 0.02
SMI_TIMEOUT_S = 5.0


def used_mib(listing: str, pid: int) -> Optional[int]:
    """The MiB that `nvidia-smi --query-compute-apps=pid,used_memory` lines give `pid` (summed over
    its lines, one per GPU), or None when it is not listed or its figure is not a number."""
    total, seen = 0, False
    for line in listing.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0] == str(pid) and fields[1].isdigit():
            total, seen = total + int(fields[1]), True
    return total if seen else None


class PeakDeviceMemory:
    """`with sampler.watch(pid): ...` polls nvidia-smi every POLL_S while the block runs;
    `peak_mib` is the most the process was seen to use, or None."""

    def __init__(self, smi: Optional[str] = None, poll_s: float = POLL_S):
        self.smi = smi or shutil.which(SMI)
        self.poll_s = poll_s
        self.peak_mib: Optional[int] = None

    @contextlib.contextmanager
    def watch(self, pid: int):
        if not self.smi:
            yield self
            return
        stop = threading.Event()
        thread = threading.Thread(target=self._poll, args=(pid, stop), daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()

    def _poll(self, pid: int, stop: threading.Event) -> None:
        while not stop.is_set():
            self._sample(pid)
            stop.wait(self.poll_s)

    def _sample(self, pid: int) -> None:
        try:
            proc = subprocess.run([self.smi, *SMI_QUERY], capture_output=True, text=True, timeout=SMI_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            return
        used = used_mib(proc.stdout, pid) if proc.returncode == 0 else None
        if used is not None and (self.peak_mib is None or used > self.peak_mib):
            self.peak_mib = used
