"""Keeping the verifier's hands off what is not its own: the input case and the output folder are
separate folders, a report is never written over a file the check reads, and `run` never moves
another case's inputs aside. Each test here is made before any work, so a refusal changes nothing.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator, List, Mapping, Optional

from ..stages import INPUT_MANIFEST, PREVIOUS_DIR, RUN_MANIFEST, UNFINISHED_MARKER
from ..text import plural
from .case import input_head_files
from .kinds import CaseError
from .outputs import stage_files_in
from .stage_files import pattern_regex

SAME, INSIDE, CONTAINS = "same", "inside", "contains"


def _stat(path: Path) -> Optional[os.stat_result]:
    try:
        return os.stat(path)
    except OSError:
        return None


def _lies_in(path: Path, folder: os.stat_result) -> bool:
    """Whether `path` (links resolved) lies somewhere below `folder` (compared as folders, by
    device and inode, so a bind mount of it counts too)."""
    for parent in Path(path).resolve().parents:
        st = _stat(parent)
        if st is not None and os.path.samestat(st, folder):
            return True
    return False


def folder_relation(a: Path, b: Path) -> Optional[str]:
    """SAME when `a` and `b` are one folder (through a link or a bind mount too), INSIDE when `a`
    lies inside `b`, CONTAINS when `b` lies inside `a`; None when apart or either is missing."""
    sa, sb = _stat(a), _stat(b)
    if sa is None or sb is None:
        return None
    if os.path.samestat(sa, sb):
        return SAME
    if _lies_in(a, sb):
        return INSIDE
    if _lies_in(b, sa):
        return CONTAINS
    return None


def check_folders_apart(in_dir: Path, out_dir: Path) -> None:
    """`check` compares OUT's files with references computed from IN's: one folder inside the
    other (or the same) would have it compare inputs with themselves and call that a pass."""
    relation = folder_relation(out_dir, in_dir)
    if relation is None and not os.path.lexists(out_dir):  # (a folder a run is to create: where it would be)
        there = next((p for p in Path(out_dir).absolute().parents if os.path.lexists(p)), None)
        relation = INSIDE if there is not None and folder_relation(there, in_dir) in (SAME, INSIDE) else None
    if relation is None:
        return
    what = {SAME: f"--out {out_dir} and --in {in_dir} are the same folder",
            INSIDE: f"--out {out_dir} is inside --in {in_dir}",
            CONTAINS: f"--in {in_dir} is inside --out {out_dir}"}[relation]
    raise CaseError(f"{what}: the input case and the output folder must be apart; HINT: --in is the "
                    "case your program read (Q, K, V), --out the folder it wrote its stage files into")


def same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file: by where they resolve (files not written yet too), or,
    both existing, by device and inode (a hard link)."""
    if Path(a).resolve() == Path(b).resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _listing(folder: Path, names_in) -> List[str]:
    """names_in(folder), or nothing when the folder cannot be listed (the check says why later)."""
    try:
        return names_in(folder) if Path(folder).is_dir() else []
    except OSError:
        return []


def files_check_reads(in_dir: Path, out_dir: Path, names: Mapping[str, str], names_file: Optional[Path]) -> List[Path]:
    """The files a check of OUT against IN reads (or would, once they exist): both manifests, the
    input head files, the stage files present, and the names file."""
    in_dir, out_dir = Path(in_dir), Path(out_dir)
    files = [in_dir / INPUT_MANIFEST, out_dir / RUN_MANIFEST]
    files += [in_dir / n for n in _listing(in_dir, input_head_files)]
    files += [out_dir / n for n in _listing(out_dir, lambda f: stage_files_in(f, names))]
    return files + ([Path(names_file)] if names_file else [])


def _named_by_map(path: Path, out_dir: Path, names: Mapping[str, str]) -> bool:
    """Whether `path` is a file a name-map pattern gives some head in OUT (in a subfolder too)."""
    try:
        rel = Path(path).resolve().relative_to(Path(out_dir).resolve()).as_posix()
    except ValueError:
        return False
    return any(pattern_regex(p).fullmatch(rel) for p in names.values())


def check_reports_apart(reports: Mapping[str, Optional[Path]], in_dir: Path, out_dir: Path,
                        names: Mapping[str, str], names_file: Optional[Path]) -> None:
    """A report (`{option: path}`) written over a file the check reads would destroy the user's
    data, or the next check would read the report; two reports on one file would lose one."""
    given = [(opt, Path(p)) for opt, p in reports.items() if p is not None]
    read = files_check_reads(in_dir, out_dir, names, names_file)
    for k, (opt, path) in enumerate(given):
        hit = next((f for f in read if same_file(path, f)), None)
        if hit is None and _named_by_map(path, out_dir, names):
            hit = path
        if hit is not None:
            raise CaseError(f"{opt} {path}: is {hit}, a file this check reads; HINT: write the report to "
                            "another file")
        other = next((o for o, p in given[k + 1:] if same_file(path, p)), None)
        if other is not None:
            raise CaseError(f"{opt} {path}: is also the {other} report; HINT: give each report a file of its own")


def foreign_input_case(out_dir: Path, in_dir: Optional[Path], names: Mapping[str, str]) -> Optional[str]:
    """Why OUT holds an input case that `run` must not move aside (None when it does not): it is
    IN, it has an input manifest, or it has input head files and nothing of a run (no run.toml,
    no stage file but them). An output folder echoes Q, K, V beside its other stages, so input
    names alone do not make a case."""
    if in_dir is not None and folder_relation(out_dir, in_dir) == SAME:
        return f"is the input case folder --in {in_dir}"
    if os.path.lexists(Path(out_dir) / INPUT_MANIFEST):
        return f"holds an input case (its {INPUT_MANIFEST})"
    inputs = sorted(input_head_files(out_dir))
    run_traces = (RUN_MANIFEST, UNFINISHED_MARKER, PREVIOUS_DIR)  # a run's folder, whatever a killed run left
    if not inputs or any(os.path.lexists(Path(out_dir) / n) for n in run_traces):
        return None
    if any(n not in inputs for n in stage_files_in(out_dir, names)):
        return None
    more = f" and {plural(len(inputs) - 1, 'other input file')}" if len(inputs) > 1 else ""
    return f"holds an input case ({inputs[0]}{more}, and no run.toml or other stage file)"


@contextlib.contextmanager
def removed_on_failure(folder: Path) -> Iterator[None]:
    """Within: a folder the block creates (with any parents it creates) is removed again when the
    block fails or is interrupted (Ctrl-C, or a signal the command line turns into an exception):
    a failed generate leaves nothing."""
    first_missing = None
    for p in [Path(folder), *Path(folder).parents]:
        if os.path.lexists(p):
            break
        first_missing = p
    try:
        yield
    except BaseException:
        if first_missing is not None:
            shutil.rmtree(first_missing, ignore_errors=True)
        raise
