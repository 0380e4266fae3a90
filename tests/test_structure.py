"""The Python side's shape: a stage is named in one table (verify/stages.py), files hold one job
(at most MAX_FILE_LINES lines), functions stay readable (at most MAX_FUNCTION_LINES lines), the
modules import each other without a cycle and only at the top (optional dependencies aside), and
the packages depend on each other in one direction (LAYERS).
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Set, Tuple

from verify import stages

VERIFY = Path(__file__).resolve().parent.parent / "verify"
STAGE_TABLE = VERIFY / "stages.py"
MAX_STAGE_LITERALS = 15
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60

# Imports inside a function: only of optional dependencies, imported where they are needed so
# that everything else works without them.
OPTIONAL_IMPORTS = {
    "torch": "PyTorch, for bench's SDPA timings and the SDPA outputs (pip install torch)",
    "matplotlib": "plots: check --plot's heat maps and bench/sweep --plot (pip install matplotlib)",
    "distributed": "Dask's distributed scheduler: check --scheduler (pip install 'attnstep[cluster]')",
    "dask": "Dask's configuration, for the cluster check --scheduler local starts (pip install 'attnstep[cluster]')",
    "array_api_compat": "check --device cuda: the flash references through PyTorch (pip install 'attnstep[gpu]')",
    "triton": "check --device cuda: one-pass kernels of the model's sums (comes with PyTorch's CUDA builds)",
}

# The parts of verify/ (a package, or a module at the top), lowest first, each with the parts it
# may import besides itself: only parts listed before it (layer_table_problems), so the packages
# depend on each other one way. The check engine sits below the diagnoses: they build their
# candidates with its references and bounds, and it runs them on a failing stage through the
# Diagnoser the command line and the Python API hand it (verify/check/diagnosis.py); the commands
# of bench and sweep are cli's (verify/cli/bench.py, sweep.py), over the bench library.
LAYERS: Tuple[Tuple[str, Set[str]], ...] = (
    ("__init__", set()),
    ("stages", set()), ("variant", set()), ("text", set()), ("terminal", set()),
    ("sequences", {"stages", "text"}),
    ("model", {"variant"}),
    ("specs", {"stages", "variant", "text", "model"}),
    ("files", {"stages", "sequences", "variant", "text", "model"}),
    ("runs", {"stages", "variant", "text", "terminal", "files"}),
    ("check", {"stages", "sequences", "variant", "text", "model", "specs", "files", "runs"}),
    ("diagnose", {"stages", "variant", "text", "model", "specs", "check"}),
    ("report", {"stages", "variant", "text", "files", "runs", "check"}),
    ("bench", {"stages", "variant", "text", "terminal", "model", "files", "runs", "report"}),
    ("cli", {"stages", "sequences", "variant", "text", "terminal", "model", "specs", "files", "runs", "check", "diagnose",
             "report", "bench"}),
    ("api_arguments", {"stages", "variant", "model", "files", "check"}),
    ("api", {"stages", "variant", "text", "model", "specs", "files", "check", "diagnose", "report", "api_arguments"}),
    ("__main__", {"cli"}),
)


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


# ---- the import graph -------------------------------------------------------------------------

def _modules() -> Dict[str, Tuple[Path, bool]]:
    """Every module of verify/ by dotted name (a package by its __init__), and whether a package."""
    out = {}
    for path in sorted(VERIFY.rglob("*.py")):
        parts = path.relative_to(VERIFY.parent).with_suffix("").parts
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


class _Imports(ast.NodeVisitor):
    """(imported name, line, inside a function) for each import of one module; relative imports
    resolved, `from P import m` naming the module P.m where m is one."""

    def __init__(self, name: str, package: bool, modules: Dict[str, Tuple[Path, bool]]):
        self.here = name if package else name.rpartition(".")[0]
        self.modules, self.depth, self.found = modules, 0, []

    def visit_FunctionDef(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Import(self, node):
        for alias in node.names:
            self.found.append((alias.name, node.lineno, self.depth > 0))

    def visit_ImportFrom(self, node):
        if node.level:
            base = self.here.split(".")[:len(self.here.split(".")) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        for alias in node.names:
            sub = f"{target}.{alias.name}"
            self.found.append((sub if sub in self.modules else target, node.lineno, self.depth > 0))


def import_graph() -> Tuple[Dict[str, Set[str]], Dict[str, List[Tuple[str, int, bool]]]]:
    """The modules each verify/ module imports (importing a.b.c runs the __init__ of a.b too, unless
    the importer is inside a.b already), and every import with its line."""
    modules = _modules()
    graph, imports = {}, {}
    for name, (path, package) in modules.items():
        visitor = _Imports(name, package, modules)
        visitor.visit(ast.parse(path.read_text(encoding="utf-8")))
        imports[name] = visitor.found
        edges = set()
        for target, _, _ in visitor.found:
            if target not in modules:
                continue
            edges.add(target)
            parts = target.split(".")
            for i in range(1, len(parts)):
                parent = ".".join(parts[:i])
                if parent in modules and not (name == parent or name.startswith(parent + ".")):
                    edges.add(parent)
        edges.discard(name)
        graph[name] = edges
    return graph, imports


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One import cycle (its modules, the first repeated at the end), or None."""
    state: Dict[str, int] = {}
    path: List[str] = []

    def visit(node: str) -> Optional[List[str]]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def test_no_import_cycle():
    cycle = find_cycle(import_graph()[0])
    assert cycle is None, "an import cycle in verify/:\n  " + "\n  -> ".join(cycle)


def test_imports_are_at_the_top():
    """No import inside a function (one that dodges a cycle hides it) but of an optional dependency."""
    modules = _modules()
    found = []
    for name, imports in import_graph()[1].items():
        for target, line, inside in imports:
            if inside and target.split(".")[0] not in OPTIONAL_IMPORTS:
                found.append(f"{_where(modules[name][0], line)}: {target}")
    assert not found, ("imports inside a function (move them to the top; only the optional dependencies "
                       f"{', '.join(OPTIONAL_IMPORTS)} may be imported where used):\n" + "\n".join(found))


def _part(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_table_problems(layers: Sequence[Tuple[str, Set[str]]]) -> List[str]:
    """What keeps a layer table from stating one order: a part listed twice, or allowed to import
    itself, a part listed after it (a mutual pair, a cycle) or one not listed at all."""
    problems, seen = [], []
    for part, allowed in layers:
        if part in seen:
            problems.append(f"{part} is listed twice")
        for other in sorted(allowed):
            if other not in seen:
                where = "itself" if other == part else ("listed after it" if any(p == other for p, _ in layers)
                                                         else "not listed")
                problems.append(f"{part} may import {other}: {where}")
        seen.append(part)
    return problems


def layering_violations(imports: Dict[str, List[Tuple[str, int, bool]]],
                        layers: Sequence[Tuple[str, Set[str]]]) -> List[Tuple[str, int, str]]:
    """(module, line, imported module) of each import of one part of verify/ by another that the
    layer table does not allow; a module of a part missing from the table counts as (module, 0, "")."""
    allowed = dict(layers)
    found = []
    for name, targets in sorted(imports.items()):
        if _part(name) not in allowed:
            found.append((name, 0, ""))
            continue
        for target, line, _ in targets:
            if target.split(".")[0] != "verify" or _part(target) == _part(name):
                continue
            if _part(target) not in allowed[_part(name)]:
                found.append((name, line, target))
    return found


def test_the_layer_table_states_one_order():
    problems = layer_table_problems(LAYERS)
    assert not problems, "LAYERS does not state one order:\n" + "\n".join(problems)


def test_packages_depend_one_way():
    modules = _modules()
    found = []
    for name, line, target in layering_violations(import_graph()[1], LAYERS):
        found.append(f"{_where(modules[name][0], line)}: {name} imports {target}" if target
                     else f"{_where(modules[name][0], 1)}: {_part(name)} is missing from LAYERS")
    assert not found, "imports against the layering (LAYERS in this file):\n" + "\n".join(found)


def test_the_layering_checks_catch_a_back_edge_a_mutual_pair_and_an_unlisted_part():
    """The checks given planted graphs and tables, so that their power does not rest on today's code."""
    planted = {
        "verify.model.dot": [("numpy", 1, False), ("verify.model.half", 2, False), ("verify.cli.options", 3, False)],
        "verify.check.compare": [("verify.check.pool", 5, False), ("verify.diagnose.hypotheses", 6, False)],
        "verify.diagnose.hypotheses": [("verify.check.reference", 7, False)],
        "verify.bench.measure": [("verify.cli.options", 8, True)],
        "verify.cli.group": [("verify.bench.measure", 9, False), ("verify.check.compare", 10, False)],
        "verify.plugins.extra": [("verify.stages", 11, False)],
    }
    assert layering_violations(planted, LAYERS) == [
        ("verify.bench.measure", 8, "verify.cli.options"),
        ("verify.check.compare", 6, "verify.diagnose.hypotheses"),
        ("verify.model.dot", 3, "verify.cli.options"),
        ("verify.plugins.extra", 0, ""),
    ]
    mutual = tuple((part, allowed | {"diagnose"} if part == "check" else allowed) for part, allowed in LAYERS)
    assert layer_table_problems(mutual) == ["check may import diagnose: listed after it"]
    assert layering_violations(planted, mutual)[:2] == [("verify.bench.measure", 8, "verify.cli.options"),
                                                        ("verify.model.dot", 3, "verify.cli.options")]
    assert layer_table_problems(LAYERS + (("model", set()), ("plugins", {"plugins", "nowhere"}))) == [
        "model is listed twice", "plugins may import nowhere: not listed", "plugins may import plugins: itself"]


# ---- no branch on a stage's name ---------------------------------------------------------------

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
