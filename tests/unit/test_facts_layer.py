"""The facts layer (issue 18): it stands on its own (no module of facts/ imports plan/ or
operations/; plan and operations read facts, never the other way round; checked on the source
by AST, so a function-level import counts too), and every fact in it has fixture cases."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CASES = Path(__file__).resolve().parent / "facts"
UPPER_LAYERS = ("plan", "operations")


def _upper(module: str | None) -> bool:
    return any(module == layer or (module or "").startswith(layer + ".") for layer in UPPER_LAYERS)


def upper_layer_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of every import of plan/ or operations/ anywhere in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and _upper(node.module):
            found.append((node.lineno, node.module or ""))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names if _upper(alias.name))
    return found


def test_the_check_sees_every_import_form():
    source = ("from plan import kernel as k\nimport operations.gpus\nfrom plan.rebind import LOCK\n"
              "def f():\n    from operations import nvidia\n"
              "from facts.sections import split_sections\nimport planner\nfrom plans import x\n")
    assert upper_layer_imports(source) == [(1, "plan"), (2, "operations.gpus"), (3, "plan.rebind"), (5, "operations")]


def test_facts_import_nothing_of_plan_or_operations():
    problems = [f"facts/{path.name}:{line} imports {module}"
                for path in sorted((ROOT / "facts").glob("*.py"))
                for line, module in upper_layer_imports(path.read_text())]
    assert problems == []


def fact_classes() -> list[str]:
    """``module.Class`` of every concrete FactBase subclass defined at the top of a facts/ module
    (abstract bases such as `ShellFact` and `SectionedProbe` left out; `combined_probe`'s class
    is made per request and lives in no module)."""
    from pyinfra.api import FactBase

    found = []
    for path in sorted((ROOT / "facts").glob("*.py")):
        if path.stem == "__init__":
            continue
        module = importlib.import_module(f"facts.{path.stem}")
        for name, value in vars(module).items():
            if (inspect.isclass(value) and issubclass(value, FactBase) and value.__module__ == module.__name__
                    and not value.__dict__.get("abstract", False)):
                found.append(f"{path.stem}.{name}")
    return sorted(found)


def test_every_fact_has_fixture_cases():
    """Every fact of facts/ has at least one pyinfra-testing case (tests/unit/facts/<module>.<Fact>/,
    run by test_facts_fixtures.py, its output traced to a real or recorded fixture by
    test_facts_traceability.py); a case folder names a fact that exists."""
    facts = fact_classes()
    cases = {p.name for p in CASES.iterdir() if p.is_dir() and "." in p.name and any(p.glob("*.yaml"))}
    assert "kernel.KernelStageFacts" in facts and "hardware.SectionedProbe" not in facts  # the walk itself
    assert [f for f in facts if f not in cases] == []
    assert sorted(cases - set(facts)) == []
