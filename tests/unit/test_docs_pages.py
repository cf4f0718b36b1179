"""Issue 42: the docs' markup the docs tests rely on, the README's shape, and the pages that are
drawn from the code (stage diagram, host checks). The blocks themselves run in
tests/e2e/test_docs_run.py."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys

import pytest

from operations import STAGES
from tests.docs_pages import DOCS, PAGES, REPO, blocks, task_pages

README = REPO / "README.md"


def test_every_task_page_runs_in_the_docs_test():
    assert sorted(PAGES) == sorted(task_pages()), "tests/docs_pages.py PAGES must list the tutorial and every how-to"
    assert PAGES[0] == "tutorial.md"  # the guides start from the twin the tutorial converged


@pytest.mark.parametrize("page", PAGES)
def test_every_shell_block_runs_or_says_why_not(page):
    found = blocks(page)
    assert found, f"docs/{page} has no sh block"
    for block in found:
        if block.mark in ("real-host-only", "not-in-ci"):
            assert len(block.reason) >= 10, f"{block.where()}: {block.mark} needs its reason (`<!-- {block.mark}: why -->`)"
            assert not block.expect, f"{block.where()}: a block that does not run checks no output"
    text = (DOCS / page).read_text()
    assert not re.search(r"^```(bash|shell|console)\b", text, re.M), f"docs/{page}: write command blocks as ```sh"


def test_the_markup_is_read_as_written():
    tutorial = blocks("tutorial.md")
    assert tutorial[0].text == "make venv debs\n" and tutorial[0].runs
    assert any("No changes" in b.expect for b in tutorial)
    assert tutorial[-1].mark == "at-end" and "twinctl stop" in tutorial[-1].text
    host_only = [b for b in blocks("howto/upgrade-8-to-9.md") if b.mark == "real-host-only"]
    assert host_only and all(b.reason for b in host_only)


def test_the_readme_is_short_and_keeps_its_two_set_up_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; the issue-42 limit is 200"
    setup = lines[lines.index("## Set up"):]
    setup = setup[:next(i for i, line in enumerate(setup[1:], 1) if line.startswith("## "))]
    commands = [line.strip() for line in setup if line.startswith("    ")]
    assert [c.split("#")[0].strip() for c in commands] == ["make demo", "make test"], commands
    figure = re.compile(r"\d+(?:[.,]\d+)?\s*(?:s|ms|min|h|%)(?:\W|$)|~\s*\d|\b20\d\d-\d\d-\d\d")
    assert not any(figure.search(c) for c in commands), f"no figures in the set-up lines: {commands}"


def test_the_readme_links_resolve():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text()):
        if not target.startswith(("http://", "https://")):
            assert (REPO / target).exists(), f"README.md links to {target}, which does not exist"


def test_the_stage_diagram_is_drawn_from_the_stages():
    gen = subprocess.run([sys.executable, "scripts/gen_docs.py", "--check"], cwd=REPO, capture_output=True, text=True)
    assert gen.returncode == 0, gen.stderr
    dot = (DOCS / "stages.dot").read_text()
    svg = (DOCS / "stages.svg").read_text()
    for name, module in STAGES:
        path = module.replace(".", "/") + ".py"
        assert f'"{name}\\n{path}"' in dot.replace("&amp;", "&")
        assert name.replace("&", "&amp;") in svg and path in svg, f"docs/stages.svg lacks {name}: run make docs-ref"


def test_the_host_checks_page_names_every_check():
    # generated from the checks' docstrings (scripts/gen_docs.py host_checks_page); --check above compares it
    gen = subprocess.run([sys.executable, "scripts/gen_docs.py", "--check"], cwd=REPO, capture_output=True, text=True)
    assert gen.returncode == 0, gen.stderr
    page = (DOCS / "reference/host-checks.md").read_text()
    named = set(re.findall(r"^- `(test_\w+)`", page, re.M))
    checks = {node.name for f in sorted((REPO / "tests/host").glob("test_*.py"))
              for node in ast.parse(f.read_text()).body
              if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}
    assert checks - named == set(), f"docs/reference/host-checks.md does not name: {sorted(checks - named)}"
    assert named - checks == set(), f"docs/reference/host-checks.md names checks that do not exist: {sorted(named - checks)}"


def test_the_host_checks_page_takes_each_checks_first_docstring_line(tmp_path, monkeypatch):
    loader = importlib.util.spec_from_file_location("gen_docs", REPO / "scripts/gen_docs.py")
    assert loader and loader.loader
    gen_docs = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(gen_docs)
    monkeypatch.setattr(gen_docs, "CHECK_FILES", [("test_a.py", "A")])
    (tmp_path / "test_a.py").write_text('def test_one(target):\n    """The one thing holds.\n\n    Why."""\n')
    page = gen_docs.host_checks_page(tmp_path)
    assert page.endswith("## A (`tests/host/test_a.py`)\n\n- `test_one`: The one thing holds.\n")
    (tmp_path / "test_a.py").write_text("def test_one(target):\n    pass\n")
    with pytest.raises(SystemExit, match="test_one has no docstring"):
        gen_docs.host_checks_page(tmp_path)
    (tmp_path / "test_b.py").write_text("")
    with pytest.raises(SystemExit, match="test_b.py"):
        gen_docs.host_checks_page(tmp_path)
