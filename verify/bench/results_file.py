"""The results files that bench, sweep and bench --decode write (--json) and read back
(--from-json): their format's version, and reading one.
"""
from __future__ import annotations

import json
from pathlib import Path

from .report import BenchError

# The version of the results JSON that bench, sweep and bench --decode write (its "format").
RESULTS_FORMAT = 1


def load_results(path: Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise BenchError(f"{path}: cannot read results JSON: {exc}")
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        raise BenchError(f"{path}: not a bench results file (no 'runs' list)")
    if "format" in data and data["format"] != RESULTS_FORMAT:
        raise BenchError(f"{path}: results format {data['format']!r}, where this attnstep reads {RESULTS_FORMAT}")
    return data
