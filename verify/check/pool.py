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
from ..model.tiles import tile_workers
from ..text import mib
from .blas import blas_on_one_thread, one_blas_thread
from .sizing import (NotEnoughMemory, _available_memory_bytes, _nm_matrices, _usable_cores, head_bytes,
                     memory_budget, slab_bytes)


# Below this many multiply-adds over all heads (the default 12×128×128 case has 25 M) one process
# checks faster than a pool can start.
_PARALLEL_MIN_MACS = 1 << 23


def head_jobs(run: RunInfo, requested: int = 0, max_memory_mb: Optional[int] = None, held_bytes: int = 0) -> int:
    """Worker processes for checking the K/V heads' groups of `run` (its heads, where K/V heads
    are not grouped): `requested` if positive, else as many as there are cores, limited so that
    the workers' groups fit in half the available memory, and 1 for small runs. 1 off Linux: the
    workers are forked (they inherit the loaded case). Either way no more than
    memory_budget(max_memory_mb) holds, and NotEnoughMemory when one group does not fit. held_bytes:
    what a job holds besides (a packed case's matrices, sliced per sequence). The slabs of failing
    long heads share what the workers leave (_SLABS_AT_ONCE)."""
    global _SLABS_AT_ONCE
    jobs, per_job, memory = _workers(run, requested, max_memory_mb, held_bytes)
    extra = slab_bytes(run)
    _SLABS_AT_ONCE = None if jobs <= 1 or not extra or memory is None else \
        max(1, (memory - jobs * per_job) // extra)
    return jobs


def _workers(run: RunInfo, requested: int, max_memory_mb: Optional[int], held_bytes: int
             ) -> Tuple[int, int, Optional[int]]:
    """(head_jobs' workers, the memory each holds, the memory they may use together)."""
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
        return 1, per_job, None
    if requested > 0:
        return min(requested, jobs, fits), per_job, budget
    if d.total_heads * d.seq_q * d.seq_k * (d.d_k + d.d_v) < _PARALLEL_MIN_MACS:
        return 1, per_job, None  # starting workers would cost more than the checking
    # Of what is available, half: the machine's other work keeps the rest.
    by_memory = fits if avail is None else min(fits, max(1, (avail // 2) // per_job))
    usable = budget if avail is None else avail // 2 if budget is None else min(budget, avail // 2)
    return max(1, min(_usable_cores(), by_memory, jobs)), per_job, usable


# How many slabs of failing long heads (verify/check/slab.py) the next map_heads call's workers
# check at once (None: no limit). The workers are sized by their tiled heads; a slab holds a dense
# check of DIAGNOSIS_SCORES scores besides, so where memory has room for fewer slabs than workers,
# a worker's slab waits for a slot.
_SLABS_AT_ONCE: Optional[int] = None
_SLAB_SLOTS = None  # the semaphore the forked workers share


@contextlib.contextmanager
def slab_slot():
    """Within: a slab is checked, never more at once across the workers than memory has room for."""
    if _SLAB_SLOTS is None:
        yield
        return
    with _SLAB_SLOTS:
        yield


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
    caller's process: the Python API's). The workers check no more slabs at once than the last
    head_jobs found room for."""
    global _ROUTE, _SLABS_AT_ONCE
    route, _ROUTE = _ROUTE, None
    slots, _SLABS_AT_ONCE = _SLABS_AT_ONCE, None
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
    global _CHECK, _SLAB_SLOTS
    _CHECK = check  # forked workers inherit it: nothing large is pickled to them
    context = multiprocessing.get_context("fork")
    _SLAB_SLOTS = context.Semaphore(slots) if slots is not None and slots < jobs else None
    try:
        with _heads_garbage_only(), ProcessPoolExecutor(jobs, mp_context=context, initializer=_init_worker) as pool:
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
        _CHECK, _SLAB_SLOTS = None, None
    return results
