"""Which device a run's heads are checked on (check --device): the GPU where it computes what the
run checks, NumPy otherwise."""
from __future__ import annotations

from typing import Optional

from ..files.outputs import RunInfo
from ..stages import STAGES
from .sizing import tiled_run


def device_for(run: RunInfo, device: Optional[str]) -> Optional[str]:
    """The device `run`'s heads are checked on, for check --device `device`. The GPU computes only
    the flash stages' references (the split stages' aside: verify/specs/flash.py on_device_of), and not under a softcap, ALiBi, bias files or dropout: a run with
    none of those stages, or with such a variant, is NumPy's whatever was asked (its processes and
    its small row tiles). auto takes the GPU only where every checked stage is one it computes or
    needs no N×M matrix (tiled_run): with N×M stages NumPy's processes check faster."""
    if device in (None, "cpu"):
        return device
    variant = run.variant
    if (variant is not None and (variant.modifies_scores or variant.dropout > 0)) or \
            not any(STAGES[s].flash and not STAGES[s].split for s in run.stages):
        return "cpu"
    return "cpu" if device == "auto" and not tiled_run(run) else device
