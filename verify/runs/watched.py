"""Running a program for `run` and `demo`: attnstep's binary or anyone's, its earlier outputs moved
aside first, and what it wrote told apart from what was there (a program that writes nothing is
an error, not a silent success)."""
from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import List, Mapping, Optional, Sequence

import click

from ..files.case import read_toml
from ..files.guards import foreign_input_case
from ..files.kinds import CaseError
from ..files.outputs import stage_files_in
from ..files.stage_files import STACKED_SUFFIX, pattern_regex
from ..files.unfinished import FAILED, clear_unfinished, mark_unfinished, refuse_live_writer
from ..stages import RUN_MANIFEST, STAGE_NAMES, parse_stage_file
from ..terminal import reported_progress_bar
from ..text import plural, printable
from .program_checks import ProgramCheck, clear_findings, files_digest, write_findings
from .repeats import RunOnce, repeated_runs, sanitized_runs
from .runner import NothingWritten, run_binary, run_program, set_aside_previous


def run_attnstep_binary(binary: Path, in_dir: Path, out_dir: Path, backend: str, timeout: float,
                         cwd: Optional[Path] = None, extra=(), progress=None, ours: bool = True,
                         under: Sequence[str] = ()) -> float:
    """Runs attnstep's binary (or, `ours` False, a program taking its arguments) into OUT, passing
    on its notices and output; returns its wall time in seconds. `progress(done, total)`, when
    given, follows the binary's work. attnstep's binary puts a finished run in place of the
    previous one itself; another program is watched (watched_run). `under`: a tool to run it
    under (compute-sanitizer)."""
    t0 = time.monotonic()
    with watched_run(out_dir, in_dir, {}, binary if not ours else None):
        result = run_binary(binary, in_dir, out_dir, backend=backend, timeout=timeout, cwd=cwd, extra=extra,
                            progress=progress, under=under)
        seconds = time.monotonic() - t0
        for line in result.notices:
            click.echo(line, err=True)
        if result.stdout.strip():
            click.echo(result.stdout.rstrip())
        require_written(binary, out_dir)
    return seconds


def run_summary(binary: Path, out_dir: Path, seconds: float) -> str:
    """One line on what attnstep's binary did, from the run.toml it wrote: backend and device,
    flash kernel, heads, stages, time, and where."""
    try:
        info = read_toml(Path(out_dir) / RUN_MANIFEST)
    except (CaseError, OSError):
        info = {}
    parts = [f"{printable(info.get('backend', '?'))} backend"
             + (f" ({printable(info['device'])})" if info.get("device") else "")]
    if info.get("flash_kernel"):
        parts.append(f"flash kernel {printable(info['flash_kernel'])}")
    if isinstance(info.get("batch"), int) and isinstance(info.get("heads"), int):
        parts.append(plural(info["batch"] * info["heads"], "head"))
    stages = [s for s in str(info.get("stages", "")).split(",") if s]
    if stages:
        parts.append(plural(len(stages), "stage"))
    return f"{Path(binary).name}: {seconds:.2f} s; {', '.join(parts)}; written to {out_dir}"


def refuse_input_case(out_dir: Path, in_dir: Optional[Path] = None, names: Mapping[str, str] = {}) -> None:
    """An OUT that holds an input case (IN itself, another case's manifest, or input files and no
    run's) is refused before anything moves: its Q/K/V files would be replaced or moved away."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return
    why = foreign_input_case(out_dir, in_dir, names)
    if why:
        raise CaseError(f"--out {out_dir}: {why}; HINT: write the outputs to another folder")


def fresh_out(out_dir: Path, in_dir: Optional[Path] = None, names: Mapping[str, str] = {}) -> None:
    """Moves an earlier run's files in OUT aside (refuse_input_case first)."""
    refuse_input_case(out_dir, in_dir, names)
    if Path(out_dir).is_dir():
        set_aside_previous(out_dir, stage_files_in(out_dir, names))


@contextlib.contextmanager
def watched_run(out_dir: Path, in_dir: Optional[Path], names: Mapping[str, str], program: Optional[Path]):
    """Around a run into OUT. attnstep's binary (`program` None) keeps the run protocol itself;
    another program's earlier files are moved aside first and OUT carries the unfinished-run marker
    until the program has exited 0 and its files are found, so that `check` refuses what a failed,
    killed or still running program left."""
    refuse_input_case(out_dir, in_dir, names)
    if program is None:
        yield
        return
    run_id = f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}-{Path(program).name}"
    try:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CaseError(f"--out {out_dir}: cannot create the folder: {exc.strerror or exc}") from None
    refuse_live_writer(out_dir)
    mark_unfinished(out_dir, run_id)  # before anything moves: a move cut short is marked too
    try:
        set_aside_previous(out_dir, stage_files_in(out_dir, names))
        yield
    except BaseException as exc:
        mark_unfinished(out_dir, run_id, FAILED, str(exc) or type(exc).__name__)
        raise
    clear_unfinished(out_dir)


def require_written(binary: Path, out_dir: Path, names: Mapping[str, str] = {}) -> List[str]:
    """The stage files the program just wrote into OUT; none is an error, not a silent success."""
    written = [n for n in stage_files_in(out_dir, names) if n != RUN_MANIFEST] if Path(out_dir).is_dir() else []
    if not written:
        raise NothingWritten(Path(binary).name, out_dir)
    return written


def run_any_program(binary: Path, args, cwd: Optional[Path], out_dir: Path, timeout: float,
                    in_dir: Optional[Path] = None, quiet: bool = False, names: Mapping[str, str] = {},
                    under: Sequence[str] = ()) -> None:
    """Runs `binary ARGS...` its own way; `names`: the name map of the files it writes."""
    with watched_run(out_dir, in_dir, names, binary):
        seconds = run_program(binary, args, cwd, timeout, under)
        written = require_written(binary, out_dir, names)
    stages = [s for s in STAGE_NAMES if any(_written_stage(n, names) == s for n in written)]
    if not quiet:
        click.echo(f"{binary.name}: {seconds:.2f} s; wrote {plural(len(written), 'stage file')} "
                   f"({', '.join(stages)}) to {out_dir}")


def _written_stage(name: str, names: Mapping[str, str]) -> Optional[str]:
    """The stage a written file holds: by attnstep's naming, or by the name map."""
    parsed = parse_stage_file(name)
    if parsed:
        return parsed[0]
    if name.endswith(STACKED_SUFFIX) and name[:-len(STACKED_SUFFIX)] in STAGE_NAMES:
        return name[:-len(STACKED_SUFFIX)]
    return next((s for s, p in names.items() if pattern_regex(p).fullmatch(name)), None)


# ----------------------------------------------------------------------------------------------
# Checks of the program beside its values: under compute-sanitizer, and run again to compare.

def program_runner(binary: Path, args, cwd: Optional[Path], timeout: float, in_dir: Path, quiet: bool,
                   names: Mapping[str, str]) -> RunOnce:
    """Runs `binary ARGS...` its own way (it writes where its arguments say)."""
    def once(under: Sequence[str], out_dir: Path) -> None:
        run_any_program(binary, args, cwd, out_dir, timeout, in_dir, quiet, names, under)
    return once


def binary_args(stages, fmt, precision, poison, causal, scale, max_memory_mb, allow_nonfinite,
                split_size: Optional[int] = None) -> List[str]:
    """The binary's options for what `attnstep run` was given (None / False: not given)."""
    args = []
    if stages:
        args += ["--stages", stages]
    if fmt:
        args += ["--format", fmt]
    if precision:
        args += ["--precision", precision]
    if poison:
        args.append("--poison")
    if causal:
        args.append("--causal")
    if scale is not None:
        args += ["--scale", repr(scale)]
    if max_memory_mb:
        args += ["--max-memory-mb", str(max_memory_mb)]
    if allow_nonfinite:
        args.append("--allow-nonfinite")
    if split_size:
        args += ["--split-size", str(split_size)]
    return args


def binary_runner(binary: Path, in_dir: Path, backend: str, timeout: float, cwd: Optional[Path], ours: bool,
                  quiet: bool, extra: Sequence[str]) -> RunOnce:
    """Runs attnstep's binary (`ours`) or one taking its arguments into the folder given. Progress
    reports are asked only of the binary built here (a --binary taking attnstep's arguments need
    not know --progress), and never under a tool."""
    def once(under: Sequence[str], out_dir: Path) -> None:
        with reported_progress_bar("running", ours and not quiet and not under) as progress:
            seconds = run_attnstep_binary(binary, in_dir, out_dir, backend, timeout, cwd, extra, progress, ours,
                                           under)
        if not quiet:
            click.echo(run_summary(binary, out_dir, seconds))
    return once


def run_with_program_checks(run_once: RunOnce, out_dir: Path, in_dir: Path, names: Mapping[str, str],
                            sanitize: Sequence[str], repeat: int, chooses_out: bool) -> List[ProgramCheck]:
    """The sanitizer runs, the run `check` will read, and its repeats; the findings are written
    into OUT for `check` (an earlier run's findings are removed first, so none outlives its run)."""
    clear_findings(out_dir)
    checks = sanitized_runs(run_once, sanitize, out_dir, chooses_out) if sanitize else []
    run_once((), out_dir)
    if repeat > 1:
        checks.append(repeated_runs(run_once, repeat, out_dir, in_dir, names))
    if checks:
        write_findings(out_dir, checks, files_digest(out_dir, stage_files_in(out_dir, names)))
    return checks
