"""The marker of a run that has not finished (docs/contract.md, "A run is complete or it is not
there"): attnstep's binary writes OUT/.attnstep-unfinished before it starts and removes it once the
whole run is in place, and `attnstep run --binary` does the same around another program. `check`
refuses a folder that carries it: its writer is still at work, or it failed or was killed, and the
files there are not that run's.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..stages import UNFINISHED_MARKER
from ..text import printable
from .kinds import CaseError
from .manifests import check_types, read_toml, write_toml
from .matrix_io import remove_own_file

MARKER_KEYS = {"run_id": str, "pid": int, "pid_start": int, "started": str, "state": str, "reason": str}
RUNNING, FAILED = "running", "failed"
REASON_LIMIT = 400  # characters of the failure shown: enough for an error naming a file deep in a folder


@dataclass(frozen=True)
class Unfinished:
    """What the marker says (fields it lacks or cannot be read as are empty)."""
    run_id: str = ""
    pid: int = 0
    pid_start: int = 0
    started: str = ""
    state: str = ""
    reason: str = ""

    def writer_alive(self) -> bool:
        """Whether the process that wrote the marker still runs (the same process: a reused
        process id has another start time)."""
        if self.state != RUNNING or not process_exists(self.pid):
            return False
        start = process_start_ticks(self.pid)
        return not (self.pid_start and start and start != self.pid_start)


def process_exists(pid: int) -> bool:
    """Whether a process `pid` exists (one of another user's included: signalling it is refused)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, OSError):
        return False  # not a process id this system could have
    return True


def process_start_ticks(pid: int) -> int:
    """A process's start time in clock ticks after boot (/proc/PID/stat, field 22); 0 where unknown."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text(errors="replace")
        return int(text[text.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def read_marker(folder: Path) -> Optional[Unfinished]:
    """The folder's marker, or None when it has none. A marker that cannot be read still marks the
    folder (an empty Unfinished)."""
    path = Path(folder) / UNFINISHED_MARKER
    if not os.path.lexists(path):
        return None
    try:
        values = read_toml(path)
        check_types(values, MARKER_KEYS, str(path))
    except (CaseError, OSError):
        return Unfinished()
    return Unfinished(**{k: values[k] for k in MARKER_KEYS if k in values})


def _still_writing(folder: Path, marker: Unfinished, hint: str) -> CaseError:
    run = f"run {printable(marker.run_id)}" if marker.run_id else "a run"
    return CaseError(f"{folder}: {run} is still writing into this folder (process {marker.pid}, started "
                     f"{printable(marker.started)}); HINT: {hint}")


def refuse_live_writer(folder: Path) -> None:
    """Raises CaseError when a run still writes into `folder` (its process alive): a second run
    there would move its files aside and clear its marker while it writes, as the binary refuses."""
    marker = read_marker(folder)
    if marker is not None and marker.writer_alive():
        raise _still_writing(folder, marker, "wait for it to finish, or write into another folder")


def refuse_unfinished(folder: Path) -> None:
    """Raises CaseError when `folder` holds a run that has not finished, saying why in one line."""
    marker = read_marker(folder)
    if marker is None:
        return
    run = f"run {printable(marker.run_id)}" if marker.run_id else "a run"
    if marker.writer_alive():
        raise _still_writing(folder, marker, "check it once that run has finished")
    why = (printable(marker.reason, REASON_LIMIT) if marker.reason else
           f"its process {marker.pid} ended before it finished" if marker.pid else "it was stopped")
    raise CaseError(f"{folder}: the last run into this folder did not finish ({run}: {why}); what the folder "
                    f"holds is not that run's output; HINT: run it again (or remove {UNFINISHED_MARKER} there to "
                    "check the files anyway)")


def mark_unfinished(folder: Path, run_id: str, state: str = RUNNING, reason: str = "") -> None:
    """Writes the marker for a run that this process stands for (another program's run)."""
    pid = os.getpid()
    write_toml(Path(folder) / UNFINISHED_MARKER,
               {"run_id": run_id, "pid": pid, "pid_start": process_start_ticks(pid),
                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "state": state,
                "reason": reason},
               "attnstep: a run into this folder has not finished (docs/contract.md); the next run removes this",
               through_links=False)


def clear_unfinished(folder: Path) -> None:
    remove_own_file(Path(folder) / UNFINISHED_MARKER, "the marker of the finished run")