"""Checking heads in parallel: forked worker processes, as many as the cores and the memory allow.

A job is a K/V head's group of query heads (one head where K/V heads are not grouped: see
verify/check/groups.py). Each process checks one query head at a time, so memory stays bounded by
one head's matrices (and its group's sums) per process.
Workers are forked: they inherit the loaded run and case (nothing large is pickled to them), and
die with the check that forked them.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import multiprocessing
import os
import signal
import sys
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Callable, List, Optional, Protocol, Tuple

from ..files.kinds import CaseError
from ..files.outputs import RunInfo
from ..model.half import is_half
from ..model.tiles import TILE_BYTES, tile_workers
from ..specs import upstream
from ..stages import STAGES
from ..text import mib
from ..variant import NONE
from .blas import blas_on_one_thread, one_blas_thread
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


# Below this many multiply-adds over all heads (the default 12×128×128 case has 25 M) one process
# checks faster than a pool can start.
_PARALLEL_MIN_MACS = 1 << 23


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
    while it loads)."""
    d = run.dims
    nd = _HEAD_ND_MATRICES + (REF_CACHE if tiled_run(run) else 0)
    matrices = 8 * (_nm_matrices(run) * d.seq_q * d.seq_k + nd * (d.seq_q + d.seq_k) * max(d.d_k, d.d_v))
    tiles = _TILE_MATRICES * min(TILE_BYTES, 8 * d.seq_q * d.seq_k) if tiled_run(run) else 0
    return matrices + tiles + _group_bytes(run) + _WORKER_BASE_BYTES + 2 * _stacked_file_bytes(run)


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


def head_jobs(run: RunInfo, requested: int = 0, max_memory_mb: Optional[int] = None, held_bytes: int = 0) -> int:
    """Worker processes for checking the K/V heads' groups of `run` (its heads, where K/V heads
    are not grouped): `requested` if positive, else as many as there are cores, limited so that
    the workers' groups fit in half the available memory, and 1 for small runs. 1 off Linux: the
    workers are forked (they inherit the loaded case). Either way no more than
    memory_budget(max_memory_mb) holds, and NotEnoughMemory when one group does not fit. held_bytes:
    what a job holds besides (a packed case's matrices, sliced per sequence)."""
    d = run.dims
    per_job, jobs = head_bytes(run) + held_bytes, d.total_kv_heads
    avail = _available_memory_bytes()
    budget, source = memory_budget(max_memory_mb, avail)
    if budget is not None and per_job > budget:
        what = f"one head of {d.seq_q} x {d.seq_k} scores" if d.group_size == 1 else \
            f"one K/V head's group ({d.group_size} query heads of {d.seq_q} x {d.seq_k} scores, one at a time)"
        raise NotEnoughMemory(f"checking {what} needs about {mib(per_job)}, more "
                              f"than the {mib(budget)} of {source}; HINT: check a case with fewer query or key rows "
                              f"(a head's check holds some {_nm_matrices(run)} float64 N x M matrices), or free memory")
    fits = jobs if budget is None else max(1, budget // per_job)
    if jobs <= 1 or sys.platform != "linux":
        return 1
    if requested > 0:
        return min(requested, jobs, fits)
    if d.total_heads * d.seq_q * d.seq_k * (d.d_k + d.d_v) < _PARALLEL_MIN_MACS:
        return 1  # starting workers would cost more than the checking
    # Of what is available, half: the machine's other work keeps the rest.
    by_memory = fits if avail is None else min(fits, max(1, (avail // 2) // per_job))
    return max(1, min(_usable_cores(), by_memory, jobs))


def _die_with_parent() -> None:
    """Pool initializer: a worker gets SIGTERM when the check that forked it dies (a plain kill of
    the parent would otherwise leave it waiting on its queue for ever), and dies of it (the command
    line's handler, inherited by the fork, would raise it in the worker's loop instead)."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the parent died before the line above took effect
        os._exit(1)


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


# glibc's mallopt parameters (<malloc.h>) and its defaults for them.
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_DEFAULT_TRIM_THRESHOLD, _DEFAULT_MMAP_MAX = 128 * 1024, 65536


def keep_freed_memory(keep: bool) -> bool:
    """glibc's malloc maps every block over 32 MB (a 4096² float64 matrix is 128 MB) from the OS
    and unmaps it when freed, and hands the free top of its heap back too, so each of the hundreds
    of temporaries one head's bounds allocate arrives as fresh pages the kernel must zero. keep:
    every block comes from the heap, which is never trimmed (-1 is the largest size_t), and freed blocks are reused; not keep: glibc's
    defaults, and the free heap returned to the OS. False where the C library is not glibc."""
    libc = ctypes.CDLL(None)
    if not (hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim")):
        return False
    if keep:
        return bool(libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, -1))
    libc.mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
    libc.mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD)
    libc.malloc_trim(0)
    return True


@contextlib.contextmanager
def freed_memory_kept():
    kept = keep_freed_memory(True)
    try:
        yield
    finally:
        if kept:
            keep_freed_memory(False)


def tile_threads():
    """A head's row tiles on as many threads as the cores this process may use (one head at a time
    in this process: the cores are its); on this thread under a profiler, which sees no other."""
    return tile_workers(1 if sys.getprofile() is not None else _usable_cores(), blas_on_one_thread)


def _init_worker() -> None:
    _die_with_parent()
    one_blas_thread()
    keep_freed_memory(True)


_CHECK: Optional[Callable[[int], list]] = None  # the parent's head checker, inherited by forked workers


def _check_in_worker(head: int) -> list:
    assert _CHECK is not None, "worker started without a checker"
    try:
        return _CHECK(head)
    finally:
        collect_head_garbage()


def collect_head_garbage() -> None:
    """After a head: its matrices are freed now, not when the cyclic garbage collector next runs
    (reference cycles among its cached bounds would keep them alive into the next head). The
    objects that were there before the heads are frozen (_heads_garbage_only): only a head's own
    are looked at, so a small head's check does not pay for walking the whole interpreter."""
    gc.collect()


@contextlib.contextmanager
def _heads_garbage_only():
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class HeadRoute(Protocol):
    """Somewhere else to check a run's jobs than forked workers (a Dask cluster: cluster.py)."""

    def map(self, check: Callable[[int], list], heads: int, progress: Optional[Callable[[int], None]]) -> List:
        """What map_heads returns for the same jobs: results in job order, progress(i) once per job."""


# The route the next map_heads call takes instead of its own processes. That call takes it (and
# leaves none): the checks a check makes of its own afterwards (a paged case's diagnosis, with
# other files than the workers can open) stay in this process.
_ROUTE: Optional[HeadRoute] = None


@contextlib.contextmanager
def heads_routed(route: HeadRoute):
    """The check run inside sends its jobs along `route`."""
    global _ROUTE
    _ROUTE = route
    try:
        yield
    finally:
        _ROUTE = None


def map_heads(check: Callable[[int], list], heads: int, jobs: int,
              progress: Optional[Callable[[int], None]] = None, tune_process: bool = False) -> List:
    """check(i) for every job i < heads (a K/V head's group: compare's checker), in `jobs` forked
    processes (in this one for jobs <= 1; along the route of heads_routed when there is one),
    results concatenated in order; progress(i) after each. tune_process: this process is the
    command's own, so its allocator and garbage collector may be set for checking (never in a
    caller's process: the Python API's)."""
    global _ROUTE
    route, _ROUTE = _ROUTE, None
    if route is not None:
        return route.map(check, heads, progress)
    results: List = []
    if jobs <= 1:
        tuned = (freed_memory_kept(), _heads_garbage_only(), tile_threads()) if tune_process else ()
        with contextlib.ExitStack() as stack:
            for ctx in tuned:
                stack.enter_context(ctx)
            for head in range(heads):
                results.extend(check(head))
                collect_head_garbage()
                if progress:
                    progress(head)
        return results
    global _CHECK
    _CHECK = check  # forked workers inherit it: nothing large is pickled to them
    try:
        with _heads_garbage_only(), ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork"),
                                                        initializer=_init_worker) as pool:
            try:
                for head, head_results in enumerate(pool.map(_check_in_worker, range(heads))):
                    results.extend(head_results)
                    if progress:
                        progress(head)
            except BaseException:  # (Ctrl-C, a signal, a head's error): stop now, not after the heads begun
                workers = list((getattr(pool, "_processes", None) or {}).values())  # (its own: no public list)
                pool.shutdown(wait=False, cancel_futures=True)
                for worker in workers:
                    worker.terminate()
                for worker in workers:
                    worker.join(10)
                raise
    except BrokenProcessPool:
        raise CaseError(f"a checking process of {jobs} died (killed for memory?); HINT: run check "
                        "with --jobs 1, or fewer") from None
    finally:
        _CHECK = None
    return results
