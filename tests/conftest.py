"""Shared fixtures: the built binary, GPU detection, and markers (`gpu` skipped without a GPU,
`slow` left out unless asked for).

Nothing here touches CUDA at import time, so collection works on a CPU-only machine.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from helpers.environment import GPU_PRESENT, NO_GPU_REASON, REPO


def _runs_slow_tests(config) -> bool:
    """The long sweeps (marker `slow`) run when a marker expression is given (`-m slow`,
    `-m "slow or not slow"`, `-m gpu`) or a test is named by its id (path::name)."""
    return bool(config.option.markexpr) or any("::" in str(arg) for arg in config.args)


_LEFT_OUT = pytest.StashKey[int]()


def pytest_collection_modifyitems(config, items):
    if not _runs_slow_tests(config):
        slow = [item for item in items if "slow" in item.keywords]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if "slow" not in item.keywords]
            config.stash[_LEFT_OUT] = len(slow)
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
    import fcntl
    import os

    from verify.runs.runner import ensure_built

    given = os.environ.get("ATTNSTEP_BINARY")
    if given:
        path = Path(given).resolve()
        if not path.is_file():
            pytest.exit(f"ATTNSTEP_BINARY={given}: no such file", returncode=2)
        return path
    build = REPO / "build"
    build.mkdir(exist_ok=True)
    # Under `-n 2` each worker process asks for the binary: one builds, the others wait for it
    # (two CMake builds of one folder at once would race).
    with open(build / ".tests-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return ensure_built(build)


@pytest.fixture(scope="session")
def cuda_torch():
    """PyTorch with a CUDA device, for the GPU tests that run PyTorch's attention as another
    program; skips with the reason where it is not installed or sees no device."""
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        pytest.skip("PyTorch is not installed")
    if not torch.cuda.is_available():
        pytest.skip(f"torch {torch.__version__} sees no CUDA device")
    return torch


@pytest.fixture
def runner():
    """Click's runner, for invoking the CLI in this process."""
    from click.testing import CliRunner
    return CliRunner()


@pytest.fixture
def no_hang():
    """Fails a test that blocks (a FIFO read) instead of hanging the run."""
    from helpers.cli import time_limit  # noqa: PLC0415 -- the CLI's imports only where used

    with time_limit(10, "the test"):
        yield


def pytest_sessionfinish(session):
    """Under pytest-xdist each worker collects and leaves out the slow tests: it tells the
    controller how many, for the summary line."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["slow_left_out"] = session.config.stash.get(_LEFT_OUT, 0)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """(pytest-xdist, on the controller) A worker's count of the slow tests it left out; every
    worker collects every test, so each count is the whole run's."""
    left_out = getattr(node, "workeroutput", {}).get("slow_left_out", 0)
    node.config.stash[_LEFT_OUT] = max(left_out, node.config.stash.get(_LEFT_OUT, 0))


def pytest_terminal_summary(terminalreporter, config):
    left_out = config.stash.get(_LEFT_OUT, 0)
    if left_out:
        what = "test marked slow (a long sweep) was" if left_out == 1 else "tests marked slow (the long sweeps) were"
        terminalreporter.write_line(f"{left_out} {what} left out; "
                                    "run them with: python3 -m pytest -q -m slow")
