"""The tests' layout: no test module imports another (or a test function from anywhere),
so that each test is collected once, from its own module, and what test modules share lives
in the helper modules of tests/ (helpers.py, cache_cases.py, modifier_cases.py,
paged_cases.py, tiny_models.py)."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imports_of_tests(path: Path) -> list:
    """The ``line: statement`` of each import in ``path``, at any depth, of a module any part
    of whose dotted name starts with ``test_``, or of a name that does."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [alias.name for alias in node.names]
        else:
            continue
        if any(part.startswith("test_") for name in names for part in name.split(".")):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_test_module_imports_another():
    """Every tests/test_*.py, its imports inside functions included (test_draws.py loads
    the property tests' modules by name, with importlib, to run them: that is no import
    statement)."""
    offending = [f"tests/{path.name}:{line}" for path in sorted(TESTS.glob("test_*.py"))
                 for line in imports_of_tests(path)]
    assert not offending, "\n".join(offending)
