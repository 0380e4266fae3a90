"""scripts/measure.py, which the memory figures of README.md and docs/performance.md come from: the
largest process's peak and the whole process tree's peak total (a check's forked workers hold their
heads at once; the largest one alone understates what the check needs)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "measure.py"

# Three forked children, each touching 64 MiB of its own and holding it for a while.
_THREE_CHILDREN = r"""
import os, sys, time
kids = []
for _ in range(3):
    pid = os.fork()
    if pid == 0:
        block = bytearray(64 << 20)
        for i in range(0, len(block), 4096):
            block[i] = 1
        time.sleep(0.6)
        os._exit(0)
    kids.append(pid)
for pid in kids:
    os.waitpid(pid, 0)
sys.exit(3)
"""


def _measure(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *cmd], capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux's /proc/PID/smaps_rollup")
def test_the_tree_total_counts_every_child_the_largest_one_alone():
    done = _measure(sys.executable, "-c", _THREE_CHILDREN)
    assert done.returncode == 3, done.stderr  # (the command's own status)
    found = re.search(r"peak RSS (\d+) MiB, the process tree's peak total (\d+) MiB", done.stderr)
    assert found, done.stderr
    largest, total = (int(x) for x in found.groups())
    assert 64 <= largest < 128, done.stderr
    assert total >= 3 * 64, done.stderr


# A parent of 256 MiB and three forked children that touch nothing: the pages are shared.
_SHARED_PAGES = r"""
import os, time
block = bytearray(256 << 20)
for i in range(0, len(block), 4096):
    block[i] = 1
kids = []
for _ in range(3):
    pid = os.fork()
    if pid == 0:
        time.sleep(0.6)
        os._exit(0)
    kids.append(pid)
for pid in kids:
    os.waitpid(pid, 0)
"""

# A grandchild of 128 MiB whose parent exits at once: still the command's memory.
_ORPHAN = r"""
import os, time
if os.fork() == 0:
    if os.fork() == 0:
        block = bytearray(128 << 20)
        for i in range(0, len(block), 4096):
            block[i] = 1
        time.sleep(0.8)
        os._exit(0)
    os._exit(0)
time.sleep(1.0)
"""


def _tree_total(done: subprocess.CompletedProcess) -> int:
    found = re.search(r"the process tree's peak total (\d+) MiB \(PSS\)", done.stderr)
    assert found, done.stderr
    return int(found.group(1))


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux's /proc/PID/smaps_rollup")
def test_pages_forked_children_share_count_once():
    """Proportional sizes: a sum of resident sizes would count the parent's 256 MiB four times."""
    assert 256 <= _tree_total(_measure(sys.executable, "-c", _SHARED_PAGES)) < 2 * 256


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux's /proc/PID/smaps_rollup")
def test_a_process_whose_parent_exits_stays_in_the_tree():
    assert _tree_total(_measure(sys.executable, "-c", _ORPHAN)) >= 128


def test_without_a_command_it_says_how_to_call_it():
    done = _measure()
    assert done.returncode != 0 and "usage: measure.py CMD" in done.stderr


def test_a_command_that_cannot_run_is_one_line(tmp_path):
    done = _measure(str(tmp_path / "no-such-program"))
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [f"measure.py: cannot run {tmp_path / 'no-such-program'}: "
                                               "No such file or directory"]
