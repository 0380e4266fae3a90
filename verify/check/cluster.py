"""Checking on a Dask cluster (`check --scheduler`): the forked pool's jobs (pool.py: a K/V head's
group of query heads each) as tasks of dask.distributed.

A task carries the check's recipe (its two folders as absolute paths, its options and its
diagnoser) and a job number, never arrays: a worker opens the run once, by the code this process
runs (compare.check_run, stopped where it would hand out its jobs, so whatever that code learns
the workers learn too), keeps it for the check's later tasks (let go when the check ends), and
checks the job. The folders must therefore be at the same paths on every worker: a filesystem
they share. Results come back as tasks
end (the progress bar counts jobs as the pool's does) and are put back in job order, so the report
is a local check's. A task whose worker dies is run again on another one, up to Dask's
`distributed.scheduler.allowed-failures` times (3 by default); after that the check stops with one
line. dask is imported only here, and only when a check asks for a cluster.

Workers on GPUs: LOCAL's cluster is started when check_run hands out its jobs, so that it fits the
device check_run chose for them: heads checked on a GPU get workers_per_gpu workers a visible GPU
(--jobs N: the first N GPUs), each seeing that GPU alone and offering it to one task at a time
(GPU_TASK); heads checked by NumPy get one worker a core. A cluster of several hosts gets the like
from `CUDA_VISIBLE_DEVICES=i dask worker ADDRESS --nworkers W --nthreads 1` per GPU (its tasks ask
for no resource: a worker takes one at a time). The recipe's options say the device to check on, so
each worker checks its heads on its own GPU.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import shutil
import tempfile
import threading
import uuid
from concurrent.futures import CancelledError, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..files.case import load_input_case
from ..files.kinds import CaseError
from ..files.outputs import open_run
from ..model.arrays import device_now, gpu_memory_bytes, namespace, on_device, target, to_device, visible_gpus
from .compare import Options, check_run
from .diagnosis import Diagnoser
from .blas import one_blas_thread
from .pool import collect_head_garbage, freed_memory_kept, heads_routed
from .sizing import _available_memory_bytes, _usable_cores

LOCAL = "local"  # check --scheduler local: a cluster of this host's processes, started for the check
INSTALL_HINT = "pip install 'attnstep[cluster]'"
GPU_TASK = {"GPU": 1}  # what a task asks of a worker on a GPU: the whole GPU
# LOCAL's workers on each GPU (workers_per_gpu): a head's check alternates between the GPU's
# kernels and the host's work (NumPy's exact models, reading and comparing the stages, launching the
# kernels), so the other workers' kernels run while one's host works. 16 heads at N = M = 32768 took
# 62 s with two workers, 50 s with three and 47 s with four, on one H200 (docs/performance.md, "The
# flash stages' references on a GPU"). A worker holds its head's arrays and row tiles on the GPU
# (9 GiB at 131072 keys, the most measured) and PyTorch, the head's files and its results on the
# host (7 GB at 131072 keys): each needs WORKER_DEVICE_BYTES of its GPU, WORKER_HOST_BYTES of half
# the host's available memory (the pool's rule for its processes) and a core.
MAX_WORKERS_PER_GPU = 4
WORKER_DEVICE_BYTES = 10 << 30
WORKER_HOST_BYTES = 8 << 30
TASK_PREFIX = "attnstep-check-"  # a check's tasks' keys: the prefix, the check's token, the job
# Tasks on the cluster at a time, per worker thread: enough that a worker never waits for its next,
# few enough that the last ones go to whichever worker is free (the scheduler places a task that
# asks for a resource, a GPU, as it is submitted, by guesses of how long the tasks take).
IN_FLIGHT_PER_THREAD = 2
# How long a scheduler has to answer before the check gives up on it (Dask's own default is 30 s,
# and it retries a refused connection until then).
CONNECT_TIMEOUT_S = 10


@dataclass(frozen=True)
class Recipe:
    """What a worker needs to open a check's run by itself."""
    in_dir: str
    out_dir: str
    opts: Options
    diagnoser: Optional[Diagnoser]
    token: str  # this check's own: a worker reuses the run it opened for the same check's tasks only


def _distributed():
    try:
        import distributed
    except ImportError:
        raise CaseError("--scheduler: checking on a Dask cluster needs dask.distributed, which is not "
                        f"installed; HINT: {INSTALL_HINT}") from None
    return distributed


@contextlib.contextmanager
def _client(scheduler: str, jobs: int, gpus: Sequence[str]):
    """A client of the scheduler at `scheduler` (tcp://HOST:PORT), or of a cluster of `jobs`
    processes of one thread each started on this host for LOCAL (jobs 0: one per core; one per GPU
    of `gpus` when given)."""
    distributed = _distributed()
    if scheduler == LOCAL:
        with local_cluster(jobs or _usable_cores(), gpus) as cluster, distributed.Client(cluster) as client:
            yield client
        return
    hint = f"HINT: start one with 'dask scheduler' and give its address (tcp://HOST:PORT), or use --scheduler {LOCAL}"
    try:
        _is_scheduler(scheduler, distributed)
        client = distributed.Client(scheduler, timeout=CONNECT_TIMEOUT_S)  # (and to reconnect, once lost)
    except (OSError, TimeoutError, ValueError, TypeError) as exc:
        why = f"no Dask scheduler answered within {CONNECT_TIMEOUT_S} s" if isinstance(exc, OSError) else \
            f"not a scheduler's address ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
        raise CaseError(f"--scheduler {scheduler}: {why}; {hint}") from None
    except NotAScheduler as exc:
        raise CaseError(f"--scheduler {scheduler}: {exc}; {hint}") from None
    with client:
        yield client


class NotAScheduler(Exception):
    """Something answered at the address, but not as a Dask scheduler does."""


def _is_scheduler(address: str, distributed) -> None:
    """Asks the process at `address` who it is, through Dask's own messages, all of it within
    CONNECT_TIMEOUT_S: the Client's own timeout covers the connection alone, and a port that
    accepts it and then stays silent (another server) would hold the check for ever. OSError where
    nothing listens; NotAScheduler where what answers is not a Dask scheduler."""
    distributed.comm.get_address_host_port(address)  # ValueError: not an address
    # The connection as the Client makes it (TLS where Dask's configuration sets it up).
    connection_args = distributed.Security().get_connection_args("client")

    async def identity():
        comm = await distributed.comm.connect(address, timeout=CONNECT_TIMEOUT_S, **connection_args)
        try:
            await comm.write({"op": "identity", "reply": True})
            return await comm.read()
        finally:
            comm.abort()

    # On a thread of its own: asyncio.run cannot start inside a running event loop (a notebook's).
    with ThreadPoolExecutor(1) as thread:
        answer = thread.submit(lambda: asyncio.run(asyncio.wait_for(identity(), CONNECT_TIMEOUT_S)))
        try:
            reply = answer.result()
        except OSError:  # nothing listens, it closed, or the time is up (a silent server)
            raise
        except (ValueError, TypeError, KeyError, IndexError, MemoryError):  # bytes that are not Dask's messages
            raise NotAScheduler("what answers there does not speak Dask's protocol") from None
    if not isinstance(reply, dict):
        raise NotAScheduler("what answers there is not a Dask scheduler")
    if reply.get("type") in ("Worker", "Nanny"):
        raise NotAScheduler(f"a Dask {str(reply['type']).lower()} answers there, not its scheduler")


@contextlib.contextmanager
def _dask_quiet():
    """None of Dask's log lines in this process while it checks (a lost scheduler's reconnection
    attempts, their tracebacks): the check says what went wrong in its own one line."""
    names = ["distributed"] + [n for n in list(logging.root.manager.loggerDict) if n.startswith("distributed.")]
    loggers = [logging.getLogger(n) for n in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _worker_on(gpu: str, distributed) -> dict:
    """The spec of a local worker that sees GPU `gpu` alone and offers GPU_TASK's resource."""
    return {"cls": distributed.Nanny, "options": {"nthreads": 1, "memory_limit": 0, "resources": GPU_TASK,
                                                   "env": {"CUDA_VISIBLE_DEVICES": gpu},
                                                   "silence_logs": logging.CRITICAL}}


@contextlib.contextmanager
def local_cluster(workers: int, gpus: Sequence[str] = ()):
    """_local_cluster, its Dask scratch space (the workers' folders and locks, which Dask puts in
    the system's temporary folder and leaves there) in a folder of its own, removed when it closes."""
    scratch = tempfile.mkdtemp(prefix="attnstep-dask-")
    try:
        import dask  # noqa: PLC0415 -- (with distributed, only here)
        with dask.config.set({"temporary-directory": scratch}):
            started = _local_cluster(workers, gpus)
        with started as cluster:
            yield cluster
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _local_cluster(workers: int, gpus: Sequence[str] = ()):
    """A Dask cluster of `workers` processes of one thread each on this host, as --scheduler local
    starts it: no dashboard (its HTTP endpoints on a free port), no memory limit of Dask's (the
    workers hold what the pool's would), none of Dask's own log lines (the check's errors are its
    one-line messages). gpus: workers_per_gpu workers on each GPU instead, each seeing its GPU alone
    (CUDA_VISIBLE_DEVICES) and offering GPU_TASK's resource. Its workers run without Dask's
    sampling profiler (which stops a worker's threads every 10 ms to read their stacks, for a
    dashboard this cluster does not have: about 5% of a head's time, measured on one core)."""
    distributed = _distributed()
    import dask  # noqa: PLC0415 -- (with distributed, only here)
    with dask.config.set({"distributed.worker.profile.enabled": False}):  # (the nannies pass it on)
        if not gpus:
            return distributed.LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                            dashboard_address=None, scheduler_kwargs={"dashboard_address": ":0"},
                                            memory_limit=0, silence_logs=logging.CRITICAL)
        per_gpu = workers_per_gpu(gpus)
        return distributed.SpecCluster(workers={f"gpu{gpu}-{k}": _worker_on(gpu, distributed)
                                                for gpu in gpus for k in range(per_gpu)},
                                       scheduler={"cls": distributed.Scheduler,
                                                  "options": {"dashboard": False, "dashboard_address": ":0"}},
                                       silence_logs=logging.CRITICAL)


def workers_per_gpu(gpus: Sequence[str]) -> int:
    """LOCAL's workers on each of `gpus` (the first len(gpus) this process sees): MAX_WORKERS_PER_GPU,
    fewer where the smallest of those GPUs' memory, half the host's available memory or its cores do
    not have room for them; at least one."""
    count = max(1, len(gpus))
    device = gpu_memory_bytes(count)
    host = _available_memory_bytes()
    by_device = MAX_WORKERS_PER_GPU if device is None else device // WORKER_DEVICE_BYTES
    by_host = MAX_WORKERS_PER_GPU if host is None else host // 2 // (WORKER_HOST_BYTES * count)
    return max(1, min(MAX_WORKERS_PER_GPU, by_device, by_host, _usable_cores() // count))


def local_gpus(jobs: int) -> List[str]:
    """The GPUs LOCAL starts its workers on, for jobs check_run hands out now: every visible GPU
    (jobs > 0: the first `jobs`) where they are checked on a GPU, none (a worker a core) elsewhere."""
    if target() != "cuda":
        return []
    gpus = visible_gpus()
    return gpus[:jobs] if jobs > 0 else gpus


# What a route submits its tasks through: a Dask client and what each task asks of a worker.
Connection = Tuple[object, Optional[Dict[str, float]]]


class DaskRoute:
    """pool.HeadRoute over a Dask client: one task per job, results as they end. `connect` gives the
    client when the jobs are handed out (LOCAL's cluster is started then, for their device)."""

    def __init__(self, connect: Callable[[], Connection], recipe: Recipe, scheduler: str) -> None:
        self.connect, self.recipe, self.scheduler = connect, recipe, scheduler

    def map(self, check: Callable[[int], list], heads: int, progress: Optional[Callable[[int], None]]) -> List:
        distributed = _distributed()
        client, resources = self.connect()
        jobs = {f"{TASK_PREFIX}{self.recipe.token}-{job}": job for job in range(heads)}
        waiting, futures, running = iter(jobs.items()), [], distributed.as_completed()
        done: Dict[int, list] = {}

        def submit() -> None:  # up to IN_FLIGHT_PER_THREAD tasks a worker thread on the cluster now
            workers = client.scheduler_info().get("workers", {}).values()  # (the client's copy: no call)
            threads = max(1, sum(w.get("nthreads", 1) for w in workers))
            room = IN_FLIGHT_PER_THREAD * threads - (len(futures) - len(done))
            for key, job in itertools.islice(waiting, max(0, room)):
                futures.append(client.submit(check_job, self.recipe, job, key=key, resources=resources))
                running.add(futures[-1])
        try:
            submit()
            for future in running:
                job = jobs[future.key]
                done[job] = future.result()  # (a task's error is raised here, as in this process)
                if progress:
                    progress(job)
                submit()
        except distributed.KilledWorker:
            raise CaseError("the cluster's workers died each time they checked one of this check's heads "
                            "(killed for memory?); HINT: start fewer workers a machine (each holds one head's "
                            "matrices at a time), or check without --scheduler to see what a head needs") from None
        except CancelledError:  # (what Dask makes of the tasks of a client that lost its scheduler)
            raise CaseError(f"--scheduler {self.scheduler}: the connection to the scheduler was lost during the "
                            "check; HINT: see that it still runs, then check again") from None
        finally:
            with contextlib.suppress(Exception):  # (a client that lost its scheduler cancels nothing)
                client.cancel([f for f in futures if not f.done()])
            with contextlib.suppress(Exception):  # (a worker lost meanwhile has nothing to let go)
                client.run(forget_check, self.recipe.token)
        return [r for job in range(heads) for r in done[job]]


@contextlib.contextmanager
def heads_on_cluster(scheduler: Optional[str], jobs: int, in_dir: Path, out_dir: Path, opts: Options,
                     diagnoser: Optional[Diagnoser], gpus: Sequence[str] = ()):
    """The check run inside (of in_dir and out_dir with opts: check_run's first call) checks its jobs
    on the cluster of `scheduler` (LOCAL: started here when the jobs are handed out, with `jobs`
    workers, or workers on each GPU where they are checked on GPUs: local_gpus); nothing without one.
    gpus: a task a GPU (LOCAL: workers_per_gpu workers on each of these, whatever the device)."""
    if scheduler is None:
        yield
        return
    recipe = Recipe(str(Path(in_dir).resolve()), str(Path(out_dir).resolve()), opts, diagnoser, uuid.uuid4().hex)
    _distributed()  # (imported before it is quieted: the import sets its loggers' levels)
    with _dask_quiet(), contextlib.ExitStack() as stack:
        connected: List[Connection] = []

        def connect() -> Connection:
            if not connected:
                on = list(gpus) or (local_gpus(jobs) if scheduler == LOCAL else [])
                connected.append((stack.enter_context(_client(scheduler, jobs, on)), GPU_TASK if on else None))
            return connected[0]

        if scheduler != LOCAL:
            connect()  # (a scheduler that does not answer is told before the run is opened)
        with heads_routed(DaskRoute(connect, recipe, scheduler)):
            yield


# ---- on a worker ---------------------------------------------------------------------------------

# The checker of the check this worker last worked for, and the device it checks on.
_OPENED: Dict[str, Tuple[Callable[[int], list], str]] = {}
_OPENING = threading.Lock()


def check_job(recipe: Recipe, job: int) -> list:
    """A task: job `job` of the check `recipe` describes, in a worker's process, on the device the
    worker's check_run chose (--device: auto takes this worker's GPU where it has one)."""
    check, device = _checker(recipe)
    with freed_memory_kept(), on_device(device):
        try:
            return check(job)
        finally:
            collect_head_garbage()


def forget_check(token: str) -> None:
    """Lets go of the run of check `token` where a worker holds it (the check is over)."""
    with _OPENING:
        _let_go(token)


def _let_go(token: str) -> None:
    if _OPENED.pop(token, None) is not None:
        gc.unfreeze()
        collect_head_garbage()


def _checker(recipe: Recipe) -> Tuple[Callable[[int], list], str]:
    with _OPENING:
        if recipe.token not in _OPENED:
            if _OPENED:  # an earlier check's run is let go
                _let_go(next(iter(_OPENED)))
            one_blas_thread()  # one process a core, as the pool's workers
            opened = _open_checker(recipe)
            if opened[1] != "cpu":
                with on_device(opened[1]):
                    namespace(to_device(np.zeros(1)))  # PyTorch and its array API loaded before the freeze
            # What the process holds now (its libraries, the opened run) is frozen out of the
            # garbage collector, as in attnstep's own process: every collection during a head, and
            # the one after it, then walks the head's own objects only, not all of PyTorch's.
            gc.collect()
            gc.freeze()
            _OPENED[recipe.token] = opened
        return _OPENED[recipe.token]


class _Captured(BaseException):
    """Carries a check's job checker, and the device check_run chose for it, out of check_run
    (never an error: BaseException, so no handler of errors on the way takes it)."""

    def __init__(self, check: Callable[[int], list], device: str) -> None:
        super().__init__()
        self.check, self.device = check, device


class _Capture:
    """A route that keeps the checker check_run hands out, and checks nothing."""

    def map(self, check, heads, progress):
        raise _Captured(check, device_now())


def _open_checker(recipe: Recipe) -> Tuple[Callable[[int], list], str]:
    opts = recipe.opts
    try:
        case = load_input_case(Path(recipe.in_dir), alibi=opts.variant.get("alibi"), page_size=opts.page_size)
        case.allow_nonfinite = opts.allow_nonfinite
        run = open_run(Path(recipe.out_dir), case, opts.overrides())
    except CaseError as exc:
        raise CaseError(f"a cluster worker could not open the check's folders: {exc}; HINT: every worker must "
                        f"see {recipe.in_dir} and {recipe.out_dir} at these paths (a filesystem they share)") from None
    try:
        with heads_routed(_Capture()):
            check_run(run, case, opts, diagnoser=recipe.diagnoser)
    except _Captured as captured:
        return captured.check, captured.device
    raise RuntimeError("check_run handed out no jobs")
