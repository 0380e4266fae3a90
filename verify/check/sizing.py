"""What checking a head holds in memory, and what the machine has: the sizes by which
verify/check/pool.py chooses its worker processes (and refuses a head that cannot fit).

A job is a K/V head's group of query heads (one head where K/V heads are not grouped). A head of
N×M stages is held whole; one of the flash stages alone (tiled_run) in row tiles of a few MB, its
memory O((N + M)·d); a failing one of those past DIAGNOSIS_SCORES also checks a slab of its rows
whole (verify/check/slab.py).
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

from ..files.kinds import CaseError
from ..files.outputs import RunInfo
from ..model.half import is_half
from ..model.tiles import TILE_BYTES
from ..specs import upstream
from ..stages import STAGES
from ..variant import NONE
from .groups import summed


# Memory one worker holds while it checks a head, in float64 N×M matrices (the reference chain,
# the binary's stages, bounds and the error model's intermediates: docs/journal.md has the
# measured peak) and in (N + M)·d ones, plus the interpreter and numpy.
_HEAD_NM_MATRICES = 32


# And for a run with backward stages (dP, dS and their bounds), this many more N×M ones: a
# backward check of one head measured 43 in all at N = M = 2048, a forward one 27.
_BACKWARD_NM_MATRICES = 12


_HEAD_ND_MATRICES = 32


# A head whose stages hold no N×M matrix (the flash stages alone) is checked in row tiles
# (verify/model/tiles.py): this many tiles' worth of matrices at a time, besides its (N + M)·d ones
# (a quarter more than the chained pass alone held: the isolated bounds' pass shares its tiles).
_TILE_MATRICES = 60


_WORKER_BASE_BYTES = 200 << 20


# Other heads' reference stages a process keeps for the head_permuted diagnosis (one matrix each).
REF_CACHE = 8


# A failing head of more scores than this, checked in row tiles, is diagnosed on a slab of its rows
# checked whole (verify/check/slab.py), of this many scores at most: a head of N = M = 4096's.
DIAGNOSIS_SCORES = 1 << 24


def _read_int(path: str, field: int = 0) -> Optional[int]:
    try:
        with open(path) as f:
            return int(f.read().split()[field])
    except (OSError, ValueError, IndexError):
        return None  # absent, or "max" (no limit)


def _available_memory_bytes() -> Optional[int]:
    """MemAvailable, and no more than a container's memory limit leaves (cgroup v2, else v1)."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < (1 << 60):
            left = max(0, limit - usage)
            avail = left if avail is None else min(avail, left)
            break
    return avail


def _usable_cores() -> int:
    """The cores this process may run on, and no more than a container's CPU quota (cgroup v2)."""
    cores = len(os.sched_getaffinity(0))
    quota, period = _read_int("/sys/fs/cgroup/cpu.max", 0), _read_int("/sys/fs/cgroup/cpu.max", 1)
    if quota is not None and period:
        cores = min(cores, max(1, -(-quota // period)))
    return cores


# The largest --max-memory-mb, as the binary's (kMaxMemoryMb in cuda_src/cli.h: 1 PiB).
MAX_MEMORY_MB = 1 << 30

# The exit status of a command that does not have the memory it needs, as the binary's.
NO_MEMORY_EXIT = 3


class NotEnoughMemory(CaseError):
    """The check would need more memory than it may use: one line, exit status NO_MEMORY_EXIT."""
    exit_code = NO_MEMORY_EXIT


# What a K/V head's group holds besides one query head's matrices (verify/check/groups.py), in
# M×d float64 matrices: per summed stage its running sums and bounds, and each query head's part
# (for the diagnoses); and the K/V head's K, V and KT, lent to its query heads.
_GROUP_SUMS_MD_MATRICES = 10
_GROUP_COPIES_MD_MATRICES = 3


def head_bytes(run: RunInfo) -> int:
    """The most memory one process holds while it checks a K/V head's group of `run` (a head, where
    K/V heads are not grouped): one query head's N×M and (N + M)·d float64 matrices at a time, the
    other heads' reference stages of REF_CACHE, what the group keeps across its query heads, the
    interpreter, and every one-file stage the process reads whole (held, and its file's bytes
    while it loads). A failing long head's slab holds more (slab_bytes)."""
    d = run.dims
    nd = _HEAD_ND_MATRICES + (REF_CACHE if tiled_run(run) else 0)
    matrices = 8 * (_nm_matrices(run) * d.seq_q * d.seq_k + nd * (d.seq_q + d.seq_k) * max(d.d_k, d.d_v))
    tiles = _TILE_MATRICES * min(TILE_BYTES, 8 * d.seq_q * d.seq_k) if tiled_run(run) else 0
    return matrices + tiles + _group_bytes(run) + _WORKER_BASE_BYTES + 2 * _stacked_file_bytes(run)


def slab_bytes(run: RunInfo) -> int:
    """What checking a failing long head's slab holds besides its head (0 where the run is not long)."""
    return 8 * _dense_nm_matrices(run) * DIAGNOSIS_SCORES if long_run(run) else 0


def long_run(run: RunInfo) -> bool:
    """Whether a failing stage of `run` is diagnosed on slabs (verify/check/slab.py): its heads are
    checked in row tiles and hold more than DIAGNOSIS_SCORES scores."""
    d = run.dims
    return run.sequences is None and d.seq_q * d.seq_k > DIAGNOSIS_SCORES and tiled_run(run)


def tiled_run(run: RunInfo) -> bool:
    """Whether a head of `run` is sized as checked in row tiles: it has stages, none of them nor
    what they are computed from is an N×M matrix (nor a split stage, whose wide files are sized as
    before), and its precision is float32's (the half pipelines' roundings are bounded on the
    whole head)."""
    stages = set(run.stages).union(*(upstream(s) for s in run.stages))
    return bool(stages) and not is_half(run.precision) and \
        not any((STAGES[s].rows, STAGES[s].cols) == ("N", "M") or STAGES[s].split for s in stages)


def _group_bytes(run: RunInfo) -> int:
    """What a K/V head's group keeps while its query heads are checked one by one (0 ungrouped)."""
    d = run.dims
    if d.group_size == 1:
        return 0
    summed_stages = sum(1 for s in run.stages if summed(s))
    per_matrix = 8 * d.seq_k * max(d.d_k, d.d_v)
    return per_matrix * (summed_stages * (_GROUP_SUMS_MD_MATRICES + d.group_size) + _GROUP_COPIES_MD_MATRICES)


def _nm_matrices(run: RunInfo) -> int:
    """The float64 N×M matrices one process holds at most while it checks a head of `run`: in row
    tiles, the head's mask and bias files (and their bool mask) alone."""
    if tiled_run(run):
        return (run.variant.mask != NONE) + (run.variant.bias != NONE)
    return _dense_nm_matrices(run)


def _dense_nm_matrices(run: RunInfo) -> int:
    """The float64 N×M matrices of a head of `run` checked whole."""
    backward = any(STAGES[s].backward for s in run.stages)
    return _HEAD_NM_MATRICES + REF_CACHE + (_BACKWARD_NM_MATRICES if backward else 0)


def _stacked_file_bytes(run: RunInfo) -> int:
    """The bytes of the run's one-file stages (every head in one .npy): each process loads them whole."""
    total = 0
    for src in run.sources.values():
        if src.arrays is None and not src.per_head:
            try:
                total += os.stat(src.file(0, run.dims)).st_size
            except OSError:
                pass  # missing: reported as such when its heads are checked
    return total


def memory_budget(max_memory_mb: Optional[int], avail: Optional[int]) -> Tuple[Optional[int], str]:
    """(the bytes a check may use, what sets them): `avail` (MemAvailable, a container's limit),
    and no more than `max_memory_mb` MiB when given; None when neither is known."""
    cap = None if max_memory_mb is None else max_memory_mb << 20
    if cap is not None and (avail is None or cap <= avail):
        return cap, f"--max-memory-mb {max_memory_mb}"
    return avail, "the memory available"
