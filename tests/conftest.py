"""Shared fixtures: the built binary, GPU detection, and markers.

Nothing here touches CUDA at import time, so collection works on a CPU-only machine.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from verify.runs.gpu import no_gpu_reason

REPO = Path(__file__).resolve().parent.parent

_WHY_NO_GPU = no_gpu_reason()  # the command line asks the same (demo --example)
GPU_PRESENT = _WHY_NO_GPU is None
NO_GPU_REASON = f"no NVIDIA GPU found ({_WHY_NO_GPU}); CUDA backend tests need one"


def pytest_collection_modifyitems(config, items):
    if GPU_PRESENT:
        return
    skip = pytest.mark.skip(reason=NO_GPU_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def binary() -> Path:
    """The binary under test: $ATTNSTEP_BINARY when set (a prebuilt or your own binary), else
    build/main, configured and built once per test session (incremental)."""
    import os

    from verify.runs.runner import ensure_built

    given = os.environ.get("ATTNSTEP_BINARY")
    if given:
        path = Path(given).resolve()
        if not path.is_file():
            pytest.exit(f"ATTNSTEP_BINARY={given}: no such file", returncode=2)
        return path
    return ensure_built(REPO / "build")


@pytest.fixture
def runner():
    """Click's runner, for invoking the CLI in this process."""
    from click.testing import CliRunner
    return CliRunner()


@pytest.fixture
def no_hang():
    """Fails a test that blocks (a FIFO read) instead of hanging the run."""
    import signal

    def expire(signum, frame):
        raise TimeoutError("blocked for 10 s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)
