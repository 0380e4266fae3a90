"""scripts/catch_rate.py's machinery for tests/test_catch_rate.py: the script loaded as a module,
and a planted run checked the whole way (every file read, as `attnstep check` does)."""
from __future__ import annotations

import importlib.util
import shutil
import sys
import tomllib
from pathlib import Path

import numpy as np

from verify.check.compare import Options, check
from verify.files.matrix_io import crc32_hex

REPO = Path(__file__).resolve().parents[2]


def load_script():
    """scripts/catch_rate.py as a module."""
    spec = importlib.util.spec_from_file_location("catch_rate", REPO / "scripts" / "catch_rate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def whole_check_status(in_dir: Path, out_dir: Path, work: Path, stage: str, planted: np.ndarray) -> str:
    """The status `check` gives `stage` of head 0 when the run's file holds `planted` (float32
    values): a copy of the run with that file replaced and its CRC-32 in run.toml updated, so the
    check reads it as the run's own."""
    copy = work / "planted_run"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(out_dir, copy)
    path = copy / f"{stage}_head_0.npy"
    np.save(path, planted.astype(np.float32))
    key = f"crc32_{stage}_head_0"
    manifest = (copy / "run.toml").read_text()
    old = tomllib.loads(manifest)[key]
    (copy / "run.toml").write_text(manifest.replace(f'{key} = "{old}"', f'{key} = "{crc32_hex(path.read_bytes())}"'))
    report = check(in_dir, copy, Options(jobs=1))
    return next(r.status for r in report.results if r.stage == stage and r.head == 0)
