"""What a path is, found out before anything reads or writes it: only regular data files are read
(never a FIFO, a device, a folder, or a kernel file such as /proc/self/environ), and files are
written under names nobody else planted (never through a link or over a special file).

The user-error class lives here, at the bottom of the file modules; verify/files/matrix_io.py and
verify/files/case.py re-export it.
"""
from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path
from typing import Optional, Tuple


class CaseError(Exception):
    """Bad input: the message is one line that names what is wrong and where."""


_FILE_KINDS = ((stat.S_ISREG, "a file"), (stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


def file_kind(mode: int) -> str:
    """What an st_mode is, in words (for a message refusing it where it does not belong)."""
    return next((word for test, word in _FILE_KINDS if test(mode)), "a special file")


def not_regular(path, mode: int) -> CaseError:
    return CaseError(f"{path}: is {file_kind(mode)}, not a regular file; "
                     "HINT: only regular files are read (a symlink to one is fine)")


def own_name(path: Path) -> Path:
    """`path` as a name to put a new file under: a regular file or a symbolic link there is
    replaced (the link itself, never what it points to); anything else is refused."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return path
    except OSError as exc:
        raise CaseError(f"{path}: cannot write: {exc.strerror or exc}") from None
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
        raise CaseError(f"{path}: is {file_kind(st.st_mode)}, not a regular file; refusing to write over it")
    return path


# Tries at a temporary name before giving up (each is random: a clash means someone is racing us).
_TEMP_TRIES = 100


def new_temp_file(target: Path) -> Tuple[int, Path]:
    """A new, empty file beside `target`, opened for writing. O_EXCL: never a file or a link that
    someone planted under the temporary name (writing through it would overwrite its target)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    for _ in range(_TEMP_TRIES):
        tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(target))


# Trees of the kernel's virtual files: what a link there reads is the reading process's own state
# (/proc/self/environ: the environment), never a matrix, and it would end up quoted in errors and
# reports. /dev/shm is a RAM disk of ordinary files, as a user's /tmp is.
_KERNEL_TREES = ("/proc", "/sys", "/dev")
_RAM_DISK = "/dev/shm"
# The file systems that are nothing but kernel files, found by device wherever they are mounted
# (/dev's is not: a container may mount an ordinary tmpfs there).
_KERNEL_FILE_SYSTEMS = ("/proc", "/sys")


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root + "/")


def _kernel_file(path: Path, st: os.stat_result) -> Optional[str]:
    """Where `path` really is when that is a kernel virtual file (by where it resolves, or by
    lying on the file system of /proc or /sys, as a bind mount of them would); else None."""
    real = os.path.realpath(path)
    if any(_under(real, root) for root in _KERNEL_TREES) and not _under(real, _RAM_DISK):
        return real
    for root in _KERNEL_FILE_SYSTEMS:
        try:
            if os.stat(root).st_dev == st.st_dev:
                return real
        except OSError:
            continue
    return None


def refuse_unreadable_kind(path: Path) -> None:
    """Refuses, before anything opens it, what is not a regular data file (after links): opening a
    FIFO for reading would let a writer waiting on it through, and a kernel file is not data."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CaseError(f"{path}: missing file") from None
    except OSError as exc:
        raise CaseError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise not_regular(path, st.st_mode)
    real = _kernel_file(path, st)
    if real is not None:
        raise CaseError(f"{path}: links to {real}, a file of the kernel, not a data file; HINT: only "
                        "regular files on a disk are read")

