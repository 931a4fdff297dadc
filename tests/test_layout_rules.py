"""The layout of tests/: test modules share code only through tests/support (helpers, doubles,
fixtures) and conftest.py, never by importing one another, so that moving or deleting a test
module breaks nothing else; and pytest can import every module by its package name.

Every import counts, at any depth (module level, inside a function, under ``TYPE_CHECKING``),
absolute or relative."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SHARED = "tests.support"


def _modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def _name(path: Path) -> str:
    """``tests/service/serving/test_x.py`` -> ``tests.service.serving.test_x``."""
    parts = path.relative_to(TESTS.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path, text: str | None = None) -> list[tuple[int, str]]:
    """Every module ``path`` (or ``text`` as if it were that file) imports, absolute, with its
    line; ``from P import N`` counts as ``P.N`` too, since N may be a module."""
    package = _name(path) if path.name == "__init__.py" else _name(path).rpartition(".")[0]
    source = path.read_text() if text is None else text
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: up level - 1 packages from this one
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def _is_test_code(module: str) -> bool:
    """A module of tests/ that is not shared code: a test module, conftest, or a package of
    them. Importing ``tests.support`` (or from it) is the way to share."""
    if module != "tests" and not module.startswith("tests."):
        return False
    return not (module == SHARED or module.startswith(SHARED + "."))


def test_no_test_module_imports_another() -> None:
    offences = []
    for path in _modules():
        for line, module in _imported(path):
            # ``from tests import support`` reads as tests and tests.support: the package
            # itself is fine, what counts is the name imported from it.
            if module == "tests":
                continue
            if _is_test_code(module) and _has_module(module):
                offences.append(f"{path.relative_to(TESTS.parent)}:{line} imports {module}")
    assert not offences, "share code through tests/support or a conftest.py fixture:\n" + (
        "\n".join(offences)
    )


def _has_module(module: str) -> bool:
    """Whether ``module`` names a module file of tests/ (``from tests.x import name`` also
    yields ``tests.x.name``, which names nothing when ``name`` is a function; the packages
    themselves are empty)."""
    return (TESTS / Path(*module.split(".")[1:])).with_suffix(".py").exists()


def test_every_folder_of_tests_is_a_package_and_names_are_unique() -> None:
    """Each folder holding modules has ``__init__.py`` (so a module's name is its path, and
    ``from tests.support ...`` resolves from anywhere); no two test modules share a basename
    (``pytest path/to/test_x.py`` and ``-k`` name one file)."""
    modules = _modules()
    missing = sorted(
        {p.parent for p in modules if not (p.parent / "__init__.py").exists()} - {TESTS.parent}
    )
    assert not missing, f"folders without __init__.py: {missing}"
    counts = Counter(p.name for p in modules if p.name.startswith("test_"))
    assert not [name for name, n in counts.items() if n > 1], counts.most_common(3)


def test_the_rule_sees_what_it_forbids() -> None:
    """The walker finds the imports the rule is about, in each form they take."""
    sample = TESTS / "client" / "test_sample_for_the_rule.py"
    text = (
        "from tests.service.test_security import root\n"
        "from tests.client import test_pull\n"
        "from .test_pull import x\n"
        "def f():\n    import tests.e2e.test_faults\n"
        "from tests.support.commands import run_cli\n"
    )
    found = {m for _, m in _imported(sample, text) if _is_test_code(m) and _has_module(m)}
    assert found == {
        "tests.service.test_security",
        "tests.client.test_pull",
        "tests.e2e.test_faults",
    }
