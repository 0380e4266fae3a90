"""The layout of the tests: what several modules share lives in tests/helpers/, and no module
imports a test module or conftest.py (a test module imported by another runs its module-level
code twice and ties the two together; a moved helper is then found in one place)."""
from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
HELPERS = TESTS / "helpers"


def _imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at any depth (inside functions too), by its dotted name."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _is_test_module(name: str) -> bool:
    last = name.split(".")[-1]
    return last.startswith("test_") or last == "conftest"


def test_only_test_modules_and_conftest_sit_beside_the_tests():
    loose = sorted(p.name for p in TESTS.glob("*.py") if not _is_test_module(p.stem))
    assert loose == [], f"helpers belong in tests/helpers/: {loose}"


def test_helpers_are_a_package_of_plain_modules():
    assert (HELPERS / "__init__.py").is_file()
    named_as_tests = sorted(p.name for p in HELPERS.rglob("*.py") if _is_test_module(p.stem))
    assert named_as_tests == [], f"pytest would collect these as tests: {named_as_tests}"


def test_no_module_imports_a_test_module():
    offenders = {}
    for path in sorted([*TESTS.glob("*.py"), *HELPERS.rglob("*.py")]):
        bad = sorted(n for n in _imported_modules(path) if _is_test_module(n))
        if bad:
            offenders[str(path.relative_to(TESTS))] = bad
    assert offenders == {}, f"move what is shared to tests/helpers/: {offenders}"
