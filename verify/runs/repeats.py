"""Running a program more than once for `attnstep run --sanitize/--repeat`: once under each
compute-sanitizer tool, and K times to compare its values bit for bit (verify/runs/program_checks.py
holds the findings; the last plain run's files are the ones `check` reads)."""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable, List, Mapping, Sequence

from ..files.case import load_input_case
from ..files.kinds import CaseError
from ..files.outputs import Overrides, open_run
from .program_checks import ProgramCheck, repeat_check, value_digests
from .runner import NothingWritten, RunnerError
from .sanitizer import find_sanitizer, read_log, sanitized_command

# Runs the program once: under a tool (a command prefix, () for none), writing into a folder
# (the program's own output folder when it chooses where it writes).
RunOnce = Callable[[Sequence[str], Path], None]
SCRATCH_PREFIX = ".attnstep-sanitize-"


def sanitized_runs(run_once: RunOnce, tools: Sequence[str], out_dir: Path, chooses_out: bool) -> List[ProgramCheck]:
    """One run under each tool. A program that takes --out (`chooses_out`) writes into a scratch
    folder inside OUT, removed afterwards; another writes where it writes (OUT), and the plain run
    that follows replaces those files. A run that fails under the tool is reported, not raised:
    the tool's log says why (an out-of-bounds access often ends the program). One that exits 0 but
    writes no stage file stops everything with the line a plain run gives (NothingWritten)."""
    sanitizer = find_sanitizer()
    checks = []
    for tool in tools:
        try:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(prefix=SCRATCH_PREFIX, dir=out_dir) as scratch:
                checks.append(_sanitized_run(run_once, sanitizer, tool, Path(scratch), out_dir, chooses_out))
        except OSError as exc:
            raise CaseError(f"{out_dir}: cannot hold the {tool} run's scratch folder: {exc.strerror or exc}") from None
    return checks


def _sanitized_run(run_once: RunOnce, sanitizer: Path, tool: str, scratch: Path, out_dir: Path,
                   chooses_out: bool) -> ProgramCheck:
    log = scratch / "sanitizer.log"
    code = 0
    try:
        run_once(sanitized_command(sanitizer, tool, log, ()), scratch / "out" if chooses_out else out_dir)
    except NothingWritten as exc:  # the program's use, not the tool's finding: stops as a plain run does
        raise NothingWritten(exc.program, out_dir) from None  # named by the OUT the scratch folder stands for
    except RunnerError as exc:
        if exc.stopped:  # by the user or --timeout: the run says nothing, and nothing more runs
            raise
        code = exc.exit_code
    return read_log(tool, log.read_text(errors="replace") if log.exists() else "", code)


def repeated_runs(run_once: RunOnce, repeat: int, out_dir: Path, in_dir: Path,
                  names: Mapping[str, str]) -> ProgramCheck:
    """The program's values after the run just made and `repeat - 1` more, compared bit for bit."""
    case = load_input_case(in_dir)

    def digests():
        return value_digests(open_run(out_dir, case, Overrides(names=names)))
    seen = [digests()]
    for _ in range(repeat - 1):
        run_once((), out_dir)
        seen.append(digests())
    return repeat_check(seen)
