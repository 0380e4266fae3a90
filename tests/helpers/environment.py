"""The repository root, whether this machine has an NVIDIA GPU (asked once per test process), and
its compute capability."""
from __future__ import annotations

import subprocess
from pathlib import Path

from verify.runs.gpu import no_gpu_reason

REPO = Path(__file__).resolve().parents[2]

_WHY_NO_GPU = no_gpu_reason()  # the command line asks the same (demo --example)
GPU_PRESENT = _WHY_NO_GPU is None
NO_GPU_REASON = f"no NVIDIA GPU found ({_WHY_NO_GPU}); CUDA backend tests need one"


def compute_capability() -> str:
    """The first GPU's compute capability as nvidia-smi gives it ("9.0"), or "?" where it cannot say."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return "?"
    return out[0] if out else "?"
