"""Progress on the terminal: bars on stderr while long work runs, only where stderr is a terminal
(pipes and CI logs stay clean)."""
from __future__ import annotations

import contextlib
import sys
import time

import click


def on_terminal() -> bool:
    return sys.stderr.isatty()


@contextlib.contextmanager
def progress_bar(total: int, label: str, wanted: bool = True):
    """A progress bar on stderr (items done, ETA), advanced by calling what this yields; nothing
    unless `wanted` and stderr is a terminal (pipes and CI logs stay clean)."""
    if not (wanted and total > 1 and on_terminal()):
        yield lambda *_: None
        return
    with click.progressbar(length=total, label=label, file=sys.stderr) as bar:
        yield lambda *_: bar.update(1)


# A run reported as (done, total) gets its bar only once it has taken this long: short runs stay
# as quiet as before.
RUN_PROGRESS_AFTER_S = 1.0


@contextlib.contextmanager
def reported_progress_bar(label: str, wanted: bool = True):
    """A progress bar on stderr for work that reports itself as update(done, total), from any
    thread; it appears once the work has taken RUN_PROGRESS_AFTER_S. Yields None unless `wanted`
    and stderr is a terminal: callers then ask for no progress reports at all."""
    if not (wanted and on_terminal()):
        yield None
        return
    start = time.monotonic()
    with contextlib.ExitStack() as stack:
        bars = []

        def update(done: int, total: int) -> None:
            if not bars:
                if time.monotonic() - start < RUN_PROGRESS_AFTER_S:
                    return
                bars.append(stack.enter_context(click.progressbar(length=total, label=label, file=sys.stderr)))
            bars[0].update(done - bars[0].pos)
        yield update
