"""compute-sanitizer around a program's run: finding the tool, the command that runs a program
under it, and reading its log into a ProgramCheck (how many errors, and the first one: its kind,
kernel and source line where the program was built with line information, e.g. nvcc -lineinfo).

Values computed right can still come from a kernel that reads out of bounds, races or reads
uninitialised memory: the result was right this time. These are what `attnstep run --sanitize`
folds into the report next to the stage verdicts.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import List, Optional, Sequence

from ..files.kinds import CaseError
from ..text import plural, printable
from .program_checks import ProgramCheck

SANITIZER = "compute-sanitizer"
TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
# The most error records the tool prints: the count in its summary is exact regardless.
PRINT_LIMIT = 100
# Where the CUDA toolkit puts the tool when its bin folder is not on PATH.
_TOOLKIT_BINS = ("CUDA_HOME", "CUDA_PATH")
_DEFAULT_TOOLKIT = Path("/usr/local/cuda")

_PREFIX = re.compile(r"^=+ ?")
_SUMMARY = re.compile(r"^(ERROR|RACECHECK|LEAK) SUMMARY:")
_ERRORS = re.compile(r"^ERROR SUMMARY: (\d+) errors?")
_HAZARDS = re.compile(r"^RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)")
# "at flash_fwd(const float *, int)+0x2a0 in /src/flash.cu:57" (no " in file:line" without line
# information); the kernel's name is the part before its parameter list.
_AT = re.compile(r"\bat (?P<func>.+?)(?:\+0x[0-9a-fA-F]+)?(?: in (?P<file>[^\s:]+):(?P<line>\d+))?(?:\s*\[.*\])?$")
_NOT_ERRORS = ("COMPUTE-SANITIZER", "Target application returned", "Internal Sanitizer Error")


def parse_tools(text: str) -> List[str]:
    """`memcheck,racecheck` -> the tools, each once, in the order given; CaseError naming a bad one."""
    tools = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in tools if t not in TOOLS]
    if bad or not tools:
        raise CaseError(f"--sanitize {printable(text)}: expected a comma list of {', '.join(TOOLS)}")
    return list(dict.fromkeys(tools))


def find_sanitizer() -> Path:
    """The compute-sanitizer to run: on PATH, else in the CUDA toolkit's bin folder."""
    found = shutil.which(SANITIZER)
    if found:
        return Path(found)
    homes = [Path(os.environ[v]) for v in _TOOLKIT_BINS if os.environ.get(v)] + [_DEFAULT_TOOLKIT]
    for home in homes:
        candidate = home / "bin" / SANITIZER
        if os.access(candidate, os.X_OK):
            return candidate
    raise CaseError(f"--sanitize: {SANITIZER} not found on PATH or in the CUDA toolkit (CUDA_HOME); HINT: it "
                    "comes with the CUDA toolkit: add its bin folder to PATH")


def sanitized_command(sanitizer: Path, tool: str, log: Path, cmd: Sequence[str]) -> List[str]:
    """`cmd` run under `tool`, its findings written to `log` (the program's own output stays its own)."""
    return [str(sanitizer), "--tool", tool, "--print-limit", str(PRINT_LIMIT), "--log-file", str(log), *cmd]


def _lines(log_text: str) -> List[str]:
    return [_PREFIX.sub("", ln.rstrip()) for ln in log_text.splitlines() if ln.startswith("=")]


def _first_error(lines: List[str]) -> Optional[int]:
    """Index of the first record's head line: not indented, not a banner or a summary."""
    for i, ln in enumerate(lines):
        if ln and not ln[0].isspace() and not _SUMMARY.match(ln) and not ln.startswith(_NOT_ERRORS):
            return i
    return None


def _where(lines: List[str], i: int) -> tuple:
    """(kernel, file:line or '') of the record starting at line i: on its head line (racecheck's
    "Race reported between Write access at ...") or the first indented `at ...` line below it."""
    for ln in lines[i:i + 4]:
        m = _AT.search(ln.strip())
        if m:
            return _function_name(m["func"]), (f"{Path(m['file']).name}:{m['line']}" if m["file"] else "")
    return "", ""


def _function_name(signature: str) -> str:
    """`void seed::load<(int)64>(float *, int)` -> `seed::load<(int)64>`: the parameter list (the
    last top-level parentheses) and the return type dropped, template arguments kept whole."""
    text = signature.strip()
    if text.endswith(")"):
        depth = 0
        for i in range(len(text) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(text[i], 0)
            if depth == 0:
                text = text[:i]
                break
    depth, start = 0, 0
    for i, ch in enumerate(text):
        depth += {"<": 1, ">": -1, "(": 1, ")": -1}.get(ch, 0)
        if ch == " " and depth == 0:
            start = i + 1
    return text[start:].strip()


def read_log(tool: str, log_text: str, exit_code: int) -> ProgramCheck:
    """The tool's verdict from its log: PASS when its summary counts nothing."""
    lines = _lines(log_text)
    errors = warnings = None
    for ln in lines:
        if (m := _ERRORS.match(ln)):
            errors = int(m[1])
        elif (m := _HAZARDS.match(ln)):
            errors, warnings = int(m[2]), int(m[3])
    if errors is None:
        tail = printable(" ".join(lines[-3:]) or f"exit status {exit_code}", 300)
        return ProgramCheck(tool, False, f"{SANITIZER} printed no summary ({tail})")
    count = errors + (warnings or 0)
    first = _first_error(lines) if count else None
    what = (plural(count, "hazard") + f" ({plural(errors, 'error')}, {plural(warnings, 'warning')})"
            if warnings is not None else plural(errors, "error"))
    if first is None and exit_code != 0:  # the tool looked at a run that failed: it vouches for nothing
        return ProgramCheck(tool, False, f"{what}, but the program exited with status {exit_code} under it",
                            count=count)
    if first is None:
        return ProgramCheck(tool, count == 0, what, count=count)
    kernel, source = _where(lines, first)
    return ProgramCheck(tool, False, what, count=count, first=printable(lines[first].strip(), 200),
                        kernel=printable(kernel, 120), source=printable(source, 120))
