"""Helpers for tests that interrupt, limit or watch a run of the binary: a folder's files as bytes,
and a run stopped at the moment its staging folder holds a file."""
from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from verify.stages import PREVIOUS_DIR, STAGING_PREFIX, UNFINISHED_MARKER

from helpers.environment import REPO


def snapshot(folder: Path) -> Dict[str, bytes]:
    """Every file of a run in `folder` (not the protocol's hidden entries), by name."""
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir())
            if p.is_file() and not p.name.startswith(".attnstep-")}


def staging_folders(folder: Path) -> List[Path]:
    return [p for p in Path(folder).iterdir() if p.name.startswith(STAGING_PREFIX)]


def leftovers(folder: Path) -> List[str]:
    """Temporary files and staging folders: what a run that stopped cleanly never leaves."""
    return sorted(p.name for p in Path(folder).iterdir()
                  if ".tmp-" in p.name or p.name.startswith(STAGING_PREFIX))


def staged_a_file(folder: Path) -> bool:
    return any(any(s.iterdir()) for s in staging_folders(folder)) if Path(folder).is_dir() else False


def binary_command(binary: Path, in_dir: Path, out_dir: Path, *extra: str) -> List[str]:
    return [str(binary), "--in", str(in_dir), "--out", str(out_dir), "--backend", "cpu", *extra]


def signal_when(cmd: Sequence[str], seen: Callable[[], bool], sig: int, pid_of: Optional[Callable] = None,
                tries: int = 5):
    """Runs `cmd` and sends `sig` at a moment `seen()` holds: the process is stopped (SIGSTOP)
    before each look, so what was seen is still so when the signal lands (on a busy 2-core machine
    a plain poll sees it too late). `pid_of(proc)`: the process to stop and signal, default the
    one started. Retried when the run ends first. Returns (signalled, returncode, stderr)."""
    for _ in range(tries):
        proc = subprocess.Popen(list(cmd), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        signalled = False
        try:
            while proc.poll() is None:
                target = (pid_of or (lambda p: p.pid))(proc)
                if target is None:
                    time.sleep(0.001)
                    continue
                _send(target, signal.SIGSTOP)
                if seen():
                    _send(target, sig)
                    signalled = True
                    _send(target, signal.SIGCONT)
                    break
                _send(target, signal.SIGCONT)
                time.sleep(0.0005)
            _, err = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=60)
        if signalled:
            return True, proc.returncode, err
    return False, proc.returncode, err


@contextlib.contextmanager
def paused_while_staging(cmd: Sequence[str], out_dir: Path):
    """Runs `cmd` and yields it stopped (SIGSTOP) once its staging folder holds a file, so that
    something can be tried against a run that is writing; it goes on (and is waited for) after."""
    proc = subprocess.Popen(list(cmd), stderr=subprocess.PIPE, text=True)
    try:
        while proc.poll() is None:
            proc.send_signal(signal.SIGSTOP)
            if staged_a_file(out_dir):
                break
            proc.send_signal(signal.SIGCONT)
            time.sleep(0.0005)
        assert proc.poll() is None, "the run ended before a file was staged"
        yield proc
    finally:
        _send(proc.pid, signal.SIGCONT)
        proc.communicate(timeout=300)


def _send(pid: int, sig: int) -> None:
    import os
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def check(in_dir: Path, out_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    """`attnstep check` as a user runs it, in a process of its own."""
    return subprocess.run([sys.executable, "-m", "verify", "check", "--in", str(in_dir), "--out", str(out_dir),
                           "--jobs", "1", *extra], capture_output=True, text=True, cwd=REPO, timeout=600)


__all__ = ["snapshot", "staging_folders", "leftovers", "staged_a_file", "binary_command", "signal_when", "check",
           "paused_while_staging",
           "PREVIOUS_DIR", "UNFINISHED_MARKER"]
