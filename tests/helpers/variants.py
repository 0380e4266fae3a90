"""What the variant tests share: a stand-in for a PyTorch tensor (torch is not needed to test how
the API converts one) and small writers of case and output files."""
from __future__ import annotations

from pathlib import Path
from typing import Dict

import numpy as np

from verify.stages import stage_file


class FakeTensor:
    """Duck-types the part of torch.Tensor that attnstep uses: .detach(), .is_floating_point(),
    .float(), .double(), .cpu(), .numpy(), .dtype, .shape; records the calls made."""

    def __init__(self, values: np.ndarray, dtype: str = "torch.float32", device: str = "cpu", calls=None):
        self.values, self.dtype, self.device = np.asarray(values), dtype, device
        self.calls = [] if calls is None else calls

    def _then(self, call: str, values=None, dtype=None, device=None) -> "FakeTensor":
        self.calls.append(call)
        return FakeTensor(self.values if values is None else values, dtype or self.dtype, device or self.device,
                          self.calls)

    @property
    def shape(self):
        return self.values.shape

    def detach(self):
        return self._then("detach")

    def is_floating_point(self) -> bool:
        return self.dtype in ("torch.float16", "torch.bfloat16", "torch.float32", "torch.float64")

    def float(self):
        return self._then("float", self.values.astype(np.float32), "torch.float32")

    def double(self):
        return self._then("double", self.values.astype(np.float64), "torch.float64")

    def cpu(self):
        return self._then("cpu", device="cpu")

    def numpy(self) -> np.ndarray:
        if self.device != "cpu":
            raise TypeError("can't convert cuda:0 device type tensor to numpy")
        if self.dtype == "torch.bfloat16":
            raise TypeError("Got unsupported ScalarType BFloat16")
        return self.values


def bf16_values(x: np.ndarray) -> np.ndarray:
    """x rounded to bfloat16 (to nearest even), held in float32: what a bf16 tensor holds."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).astype(np.uint32)
    return rounded.view(np.float32)


def write_heads(folder: Path, matrices: Dict[str, list], fmt: str = "txt") -> Path:
    """{stage: [matrix per head]} into `folder` as `<stage>_head_{i}.<fmt>` (%.9g or float32 .npy)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, heads in matrices.items():
        for i, m in enumerate(heads):
            path = folder / stage_file(name, i, fmt)
            if fmt == "npy":
                np.save(path, np.asarray(m, np.float32))
            else:
                np.savetxt(path, np.asarray(m, np.float64), fmt="%.9g")
    return folder


def set_manifest(folder: Path, **values) -> None:
    """Adds or replaces `key = value` lines of folder/manifest.toml (values already in TOML syntax)."""
    path = folder / "manifest.toml"
    lines = [ln for ln in path.read_text().splitlines() if ln.split(" =")[0] not in values]
    path.write_text("\n".join(lines + [f"{k} = {v}" for k, v in values.items()]) + "\n")
