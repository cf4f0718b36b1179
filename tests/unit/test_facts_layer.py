"""The facts layer stands on its own: no module of facts/ imports plan/ or operations/ (plan and
operations read facts, never the other way round; issue 18). Checked on the source (AST), so a
function-level import counts too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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
