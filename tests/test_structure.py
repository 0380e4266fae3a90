"""The Python side's shape: a stage is named in one table (verify/stages.py), files hold one job
(at most MAX_FILE_LINES lines), and functions stay readable (at most MAX_FUNCTION_LINES lines).
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import Iterator, List, Tuple

from verify import stages

VERIFY = Path(__file__).resolve().parent.parent / "verify"
STAGE_TABLE = VERIFY / "stages.py"
MAX_STAGE_LITERALS = 15
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def _sources() -> Iterator[Tuple[Path, str]]:
    for path in sorted(VERIFY.rglob("*.py")):
        yield path, path.read_text(encoding="utf-8")


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(VERIFY.parent)}:{line}"


def stage_literals() -> List[str]:
    """Every string constant outside the stage table that equals a stage's name."""
    names = set(stages.STAGES)
    found = []
    for path, text in _sources():
        if path == STAGE_TABLE:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                found.append(f"{_where(path, node.lineno)}: {node.value!r}")
    return found


def test_stages_are_named_in_the_stage_table():
    found = stage_literals()
    assert len(found) <= MAX_STAGE_LITERALS, (
        f"{len(found)} stage names written as literals outside verify/stages.py (at most "
        f"{MAX_STAGE_LITERALS}); use its constants:\n" + "\n".join(found))


def test_files_and_functions_are_short():
    long_files, long_functions = [], []
    for path, text in _sources():
        lines = len(text.splitlines())
        if lines > MAX_FILE_LINES:
            long_files.append(f"{path.relative_to(VERIFY.parent)}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{_where(path, node.lineno)}: {node.name}, {length} lines")
    assert not long_files, f"files over {MAX_FILE_LINES} lines:\n" + "\n".join(long_files)
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long_functions)


def _stage_constants(module_path: Path) -> set:
    """The module's global names that hold a stage's name or a subset of the stages (its own
    aliases included: `DS = GRAD_SCORES`); every stage at once is a validity check, not a branch."""
    module = importlib.import_module(".".join(module_path.relative_to(VERIFY.parent).with_suffix("").parts)
                                     .removesuffix(".__init__"))
    out = set()
    for name, value in vars(module).items():
        if isinstance(value, str) and value in stages.STAGES:
            out.add(name)
        elif isinstance(value, tuple) and value and all(isinstance(v, str) and v in stages.STAGES for v in value) \
                and set(value) != set(stages.STAGES):
            out.add(name)
    return out


def _names_a_stage(node: ast.AST, constants: set) -> bool:
    if isinstance(node, ast.Name):
        return node.id in constants
    if isinstance(node, ast.Attribute):
        return node.attr in constants
    if isinstance(node, ast.Constant):
        return node.value in stages.STAGES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_stage(e, constants) for e in node.elts)
    return False


# The specs hold what differs between stages; the input case's reader knows its optional dO file;
# __main__ runs the command line when imported.
BRANCHING_ALLOWED = (STAGE_TABLE, VERIFY / "specs", VERIFY / "files" / "case.py", VERIFY / "__main__.py")


def test_no_branch_on_a_stage_name():
    """The engine, the diagnoses and the reports ask a stage's spec or table entry, never its name."""
    found = []
    for path, text in _sources():
        if any(path == p or p in path.parents for p in BRANCHING_ALLOWED):
            continue
        constants = _stage_constants(path)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Compare) and any(
                    isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) and _names_a_stage(right, constants)
                    for op, right in zip(node.ops, node.comparators)) or (
                    isinstance(node, ast.Compare) and _names_a_stage(node.left, constants)):
                found.append(f"{_where(path, node.lineno)}: {ast.unparse(node)}")
    assert not found, "branches on a stage name (move the knowledge into its spec):\n" + "\n".join(found)
