"""docs/INCIDENTS.md's "Where each incident is handled" table stays true when code moves.

Each row names, in backticks, `module:name` (a guard, or a FactBase class in the fact column)
and `tests/…/test_x.py::test_name`. Every name must import (`getattr` on the module), every
test must be a function of that name in that file (parsed with ast, not imported), each fact
column must name a real FactBase of facts/ or operations/, and every incident of the first
table has a row. A column with nothing to name says **missing** instead.
"""

from __future__ import annotations

import ast
import importlib
import re
from functools import cache
from pathlib import Path

import pytest
from pyinfra.api import FactBase

REPO = Path(__file__).parents[2]
DOC = REPO / "docs" / "INCIDENTS.md"
SECTION = "## Where each incident is handled"
MISSING = "**missing**"
CODE_REF = re.compile(r"^([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*):([A-Za-z_][A-Za-z0-9_]*)$")
TEST_REF = re.compile(r"^(tests/[\w/]+\.py)::(test_\w+)$")
COLUMNS = ("guard", "fact", "host check", "tests")
TEST_DIRS = {"host check": ("tests/host/",), "tests": ("tests/unit/", "tests/e2e/")}


def _table_rows(text: str) -> list[list[str]]:
    """Cells of the markdown table's body rows (header and rule lines dropped)."""
    rows: list[list[str]] = []
    for line in text.splitlines():
        if not line.startswith("|"):
            if rows:
                break  # the table ended
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == "#" or set(cells[0]) <= {"-", ":"}:
            continue
        rows.append(cells)
    return rows


def incident_numbers() -> list[int]:
    """The numbers of the incidents table (the document's first table)."""
    return [int(cells[0]) for cells in _table_rows(DOC.read_text())]


def handling_rows() -> dict[int, dict[str, str]]:
    """``{1: {"guard": "...", "fact": "...", "host check": "...", "tests": "..."}}``."""
    text = DOC.read_text()
    assert SECTION in text, f"{DOC} has no section {SECTION!r}"
    rows = {}
    for cells in _table_rows(text.split(SECTION, 1)[1]):
        assert len(cells) == 1 + len(COLUMNS), f"row {cells[0]} has {len(cells)} cells, want {1 + len(COLUMNS)}"
        number = int(cells[0])
        assert number not in rows, f"incident {number} has two rows"
        rows[number] = dict(zip(COLUMNS, cells[1:], strict=True))
    return rows


def refs(cell: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Backticked ``module:name`` and ``file::test`` references of one cell."""
    code, tests = [], []
    for token in re.findall(r"`([^`]+)`", cell):
        if (m := TEST_REF.match(token)):
            tests.append((m.group(1), m.group(2)))
        elif (m := CODE_REF.match(token)):
            code.append((m.group(1), m.group(2)))
    return code, tests


@cache
def defined_functions(path: str) -> frozenset[str]:
    """Names of every function (module level, in classes, nested) defined in a test file."""
    tree = ast.parse((REPO / path).read_text(), filename=path)
    return frozenset(n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))


ROWS = handling_rows()


def test_every_incident_has_exactly_one_row():
    assert sorted(ROWS) == incident_numbers()


def test_the_parser_sees_references_and_missing_marks():
    # the table must not pass by being unreadable: names are found in every row
    assert all(refs(row["guard"])[0] or MISSING in row["guard"] for row in ROWS.values())
    code, tests = refs("`plan.boot:preflight_refusals` and `tests/unit/test_plan_boot.py::test_x`, `iommu=pt`")
    assert code == [("plan.boot", "preflight_refusals")] and tests == [("tests/unit/test_plan_boot.py", "test_x")]


@pytest.mark.parametrize("number", sorted(ROWS))
def test_row_names_only_things_that_exist(number):
    row = ROWS[number]
    problems = []
    for column in COLUMNS:
        code, tests = refs(row[column])
        if not code and not tests and MISSING not in row[column]:
            problems.append(f"{column}: names nothing and does not say {MISSING}")
        for module_name, name in code:
            try:
                module = importlib.import_module(module_name)
            except Exception as error:  # an import error is a broken row, said in words
                problems.append(f"{column}: cannot import {module_name} ({type(error).__name__}: {error})")
                continue
            if not hasattr(module, name):
                problems.append(f"{column}: {module_name} has no {name}")
        for path, name in tests:
            if column in TEST_DIRS and not path.startswith(TEST_DIRS[column]):
                problems.append(f"{column}: {path} is not under {' or '.join(TEST_DIRS[column])}")
            if not (REPO / path).is_file():
                problems.append(f"{column}: {path} does not exist")
            elif name not in defined_functions(path):
                problems.append(f"{column}: {path} defines no {name}")
        if column in ("guard", "fact") and tests:
            problems.append(f"{column}: names tests ({', '.join(n for _, n in tests)}); they belong in the test columns")
        if column in TEST_DIRS and code:
            problems.append(f"{column}: names code ({', '.join(f'{m}:{n}' for m, n in code)}), not tests")
    assert not problems, f"incident {number}: " + "; ".join(problems)


@pytest.mark.parametrize("number", sorted(ROWS))
def test_fact_column_names_a_fact(number):
    cell = ROWS[number]["fact"]
    code, _ = refs(cell)
    facts = []
    for module_name, name in code:
        value = getattr(importlib.import_module(module_name), name, None)
        if isinstance(value, type) and issubclass(value, FactBase):
            assert module_name.split(".")[0] in ("facts", "operations"), f"{module_name}:{name} is a fact outside facts/ and operations/"
            facts.append(name)
    assert facts or MISSING in cell, f"incident {number}: the fact column names no FactBase class: {cell}"
