"""What a run's values cannot show, checked on the program itself and reported beside the stage
verdicts: compute-sanitizer's tools (verify/runs/sanitizer.py) and repeatability (the same case run K
times must give the same values, bit for bit; races and floating-point atomics break it).

`attnstep run --sanitize/--repeat` writes the findings into OUT/program_checks.toml with a digest
of the stage files the run left; `check` folds them into its report, JSON and JUnit when the
files it reads are still those (a later run's files make them stale: a note, not a verdict).
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..files.kinds import CaseError
from ..files.manifests import check_types, read_toml, write_toml
from ..files.matrix_io import remove_own_file
from ..stages import PROGRAM_CHECKS, RUN_MANIFEST
from ..text import plural, printable

REPEAT = "repeat"
_KEYS = ("passed", "summary", "count", "first", "kernel", "source")
_TYPES = {"passed": bool, "summary": str, "count": int, "first": str, "kernel": str, "source": str}


@dataclass(frozen=True)
class ProgramCheck:
    """One check of the program: a sanitizer tool, or the repeat comparison."""
    kind: str              # memcheck, racecheck, initcheck, synccheck, repeat
    passed: bool
    summary: str           # "30 errors", "3 runs, bit-identical"
    count: int = 0         # errors, hazards, or values that differ across runs
    first: str = ""        # the first finding, as the tool words it
    kernel: str = ""       # where it was found, when known
    source: str = ""       # file:line, when the program has line information

    def line(self) -> str:
        where = " ".join(p for p in (f"in {self.kernel}" if self.kernel else "",
                                     f"at {self.source}" if self.source else "") if p)
        first = f"; first: {self.first}" + (f" ({where})" if where else "") if self.first else ""
        return f"{self.kind}: {self.summary}{first}"


# ----------------------------------------------------------------------------------------------
# The files the findings are about.

def files_digest(folder: Path, names: List[str]) -> str:
    """Which files the findings describe: each stage file's name, size and modification time (run.toml
    aside). Read from the file system alone, never from the files (a FIFO or a device among them
    must not block or flood this), and changed by any rewrite, even of the same bytes."""
    h = hashlib.sha256()
    for name in sorted(n for n in names if n != RUN_MANIFEST):
        try:
            st = os.stat(Path(folder) / name)
            h.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        except OSError:
            h.update(f"{name}\0-\n".encode())
    return h.hexdigest()[:16]


def value_digests(run) -> Dict[Tuple[str, int], str]:
    """(stage, head) -> a digest of the values the run wrote (parsed, so that a header naming the
    run, or another printing of the same float32, does not count as a difference)."""
    out = {}
    for stage in run.stages:
        for head in range(run.dims.heads_of(stage)):
            try:
                values = run.read(stage, head)[0]
                data = values.tobytes() if values is not None else b"-"
            except (CaseError, OSError):
                data = b"unreadable"
            out[stage, head] = hashlib.sha256(data).hexdigest()[:16]
    return out


def repeat_check(digests: List[Dict[Tuple[str, int], str]]) -> ProgramCheck:
    """The runs' value digests compared with the first run's: which stages and heads differ."""
    runs = len(digests)
    first = digests[0]
    differ: Dict[str, List[int]] = {}
    for d in digests[1:]:
        for key in sorted(set(first) | set(d)):
            if first.get(key) != d.get(key) and key[1] not in differ.setdefault(key[0], []):
                differ[key[0]].append(key[1])
    differ = {s: sorted(h) for s, h in differ.items() if h}
    if not differ:
        return ProgramCheck(REPEAT, True, f"{runs} runs, bit-identical")
    parts = [f"{s} ({plural(len(h), 'head')}: {_heads(h)})" for s, h in differ.items()]
    count = sum(len(h) for h in differ.values())
    return ProgramCheck(REPEAT, False, f"{runs} runs, not bit-identical in {plural(len(differ), 'stage')}",
                        count=count, first="differ: " + "; ".join(parts))


def _heads(heads: List[int]) -> str:
    shown = ", ".join(map(str, heads[:8]))
    return shown + (", ..." if len(heads) > 8 else "")


# ----------------------------------------------------------------------------------------------
# The findings file.

def write_findings(folder: Path, checks: List[ProgramCheck], digest: str) -> None:
    values = {"digest": digest, "checks": ",".join(c.kind for c in checks)}
    for c in checks:
        values.update({f"{c.kind}_{k}": v for k, v in asdict(c).items() if k in _KEYS})
    write_toml(Path(folder) / PROGRAM_CHECKS, values,
               "attnstep run: checks of the program beside its values (docs/contract.md); check reads this",
               through_links=False)


def clear_findings(folder: Path) -> None:
    remove_own_file(Path(folder) / PROGRAM_CHECKS, "the findings of the run before")


def read_findings(folder: Optional[Path], digest: str) -> Tuple[List[ProgramCheck], Optional[str]]:
    """(the checks OUT's findings file holds, a note) when it describes the files `digest` names;
    ([], note) when it describes other files; ([], None) when there is none."""
    if folder is None or not (Path(folder) / PROGRAM_CHECKS).is_file():
        return [], None
    path = Path(folder) / PROGRAM_CHECKS
    values = read_toml(path)
    check_types(values, {"digest": str, "checks": str}, str(path))
    if values.get("digest") != digest:
        return [], (f"{PROGRAM_CHECKS} describes other files than these (an earlier run): its sanitizer and "
                    "repeat findings are left out")
    checks = []
    for kind in filter(None, str(values.get("checks", "")).split(",")):
        fields = {k: values[f"{kind}_{k}"] for k in _KEYS if f"{kind}_{k}" in values}
        check_types(fields, _TYPES, str(path))
        checks.append(ProgramCheck(printable(kind), **{k: printable(v, 300) if isinstance(v, str) else v
                                                       for k, v in fields.items()}))
    return checks, None


# ----------------------------------------------------------------------------------------------
# In the report.

def text_lines(checks: List[ProgramCheck]) -> List[str]:
    return [f"{'PASS' if c.passed else 'FAIL'} {c.line()}" for c in checks]


def json_block(checks: List[ProgramCheck]) -> List[dict]:
    return [asdict(c) for c in checks]


def junit_cases(checks: List[ProgramCheck]) -> List[Tuple[str, Optional[str]]]:
    """(testcase name, failure message or None) per check."""
    return [(c.kind, None if c.passed else c.line()) for c in checks]
