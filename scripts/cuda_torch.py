"""What the GPU timing scripts share: PyTorch with a CUDA device it can see, or an exit in one line
naming the script and what is missing."""
from __future__ import annotations

import sys


def cuda_torch(script: str):
    """The torch module, once PyTorch imports and sees a CUDA device."""
    try:
        import torch
    except ImportError:
        sys.exit(f"{script}: needs PyTorch (pip install 'attnstep[gpu]')")
    if not torch.cuda.is_available():
        sys.exit(f"{script}: PyTorch sees no CUDA device")
    return torch
