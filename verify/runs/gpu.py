"""Whether this machine has an NVIDIA GPU a CUDA program can use: asked of nvidia-smi, without
loading CUDA (the command line and the tests' collection run on machines without it). The tests
skip their GPU tests by it, and `demo --example` refuses to start without one."""
from __future__ import annotations

import os
import shutil
import subprocess
from typing import Optional

from ..files.kinds import CaseError

SMI_TIMEOUT_S = 20


def no_gpu_reason() -> Optional[str]:
    """Why a CUDA program would find no GPU here, or None when `nvidia-smi -L` lists one that
    CUDA_VISIBLE_DEVICES leaves visible (empty, or an invalid first index such as -1, hides every
    GPU from CUDA while nvidia-smi still lists them)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and (not visible.strip() or visible.strip().startswith("-")):
        return f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
    smi = shutil.which("nvidia-smi")
    if not smi:
        return "no nvidia-smi on PATH (no NVIDIA driver)"
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=SMI_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi -L did not answer ({type(exc).__name__})"
    if out.returncode != 0 or "GPU" not in out.stdout:
        return "nvidia-smi -L lists no GPU"
    return None


def require_gpu_for_example(example: str) -> None:
    """The examples gallery's programs call CUDA and cuBLAS with no CPU fallback: without a GPU
    they would build and then end in a CUDA error, so that is said first, in one line."""
    why = no_gpu_reason()
    if why:
        raise CaseError(f"demo --example {example} needs an NVIDIA GPU: the examples gallery's programs run on "
                        f"CUDA only, and here {why}; HINT: 'attnstep demo' runs attnstep's own binary, which "
                        "falls back to its CPU backend")
