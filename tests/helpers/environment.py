"""The repository root and whether this machine has an NVIDIA GPU (asked once per test process)."""
from __future__ import annotations

from pathlib import Path

from verify.runs.gpu import no_gpu_reason

REPO = Path(__file__).resolve().parents[2]

_WHY_NO_GPU = no_gpu_reason()  # the command line asks the same (demo --example)
GPU_PRESENT = _WHY_NO_GPU is None
NO_GPU_REASON = f"no NVIDIA GPU found ({_WHY_NO_GPU}); CUDA backend tests need one"
