"""A Dask worker plugin for tests/test_cluster.py: the first worker to start one of a check's
tasks dies in it (os._exit, as a worker killed for memory would), once per marker file; the
workers import it (their sys.path is the test process's)."""
from __future__ import annotations

import os

from distributed.diagnostics.plugin import WorkerPlugin

from verify.check.cluster import TASK_PREFIX


class DieInFirstTask(WorkerPlugin):
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def transition(self, key, start, finish, **kwargs) -> None:
        if finish != "executing" or not str(key).startswith(TASK_PREFIX):
            return
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))  # the first one to get here, on any worker
        except FileExistsError:
            return
        os._exit(1)
