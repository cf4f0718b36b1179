"""scripts/lint.sh (the first step of `make test`): each of ruff, mypy and shellcheck fails the
run on a finding, and each one runs even when another failed. The repo itself being clean is
checked by `make test` running the script."""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("shellcheck") is None, reason="needs shellcheck (make debs)")


def _tree(tmp_path: Path) -> Path:
    """A minimal copy of the repo's layout: the script, the settings, the venv, clean code."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "lint.sh", tmp_path / "scripts" / "lint.sh")
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / ".venv").symlink_to(REPO / ".venv")
    for path in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]["files"]:  # mypy's paths
        if path.endswith(".py"):
            (tmp_path / path).write_text("")
        else:
            (tmp_path / path).mkdir(exist_ok=True)  # scripts/ is made above
            (tmp_path / path / "__init__.py").write_text("")
    shutil.copy(REPO / "plan" / "render.py", tmp_path / "plan" / "render.py")
    shutil.copy(REPO / "facts" / "shell.py", tmp_path / "facts" / "shell.py")  # render's shell words
    shutil.copytree(REPO / "templates", tmp_path / "templates")
    for script in (".ci/run", "bench/x.sh", "tests/twin/twinctl"):
        (tmp_path / script).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / script).write_text('#!/bin/sh\necho "$1"\n')
    return tmp_path


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "VENV": str(REPO / ".venv")}
    return subprocess.run(["bash", "scripts/lint.sh"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)


def test_clean_tree_passes_and_says_what_ran(tmp_path):
    run = _lint(_tree(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr
    for tool in ("ruff", "mypy", "shellcheck", "shell-templates"):
        assert f"pvegpu lint: {tool}: clean" in run.stdout


def test_each_tool_fails_the_run_and_all_of_them_run(tmp_path):
    root = _tree(tmp_path)
    (root / "spec" / "unused.py").write_text("import os\n")  # pyflakes F401
    (root / "plan" / "typed.py").write_text("def f() -> int:\n    return 'x'\n")  # mypy return-value
    (root / "bench" / "x.sh").write_text("#!/bin/sh\ncd $1\n")  # SC2086 and SC2164
    install = root / "templates" / "nvidia-install.sh.j2"  # a value left unquoted where it lands
    install.write_text(install.read_text().replace('mkdir -m 755 "$D.new"', "mkdir -m 755 $(echo {{ module_subdir }}).new"))
    run = _lint(root)
    assert run.returncode != 0
    for tool in ("ruff", "mypy", "shellcheck", "shell-templates"):
        assert f"pvegpu lint: {tool}: FAILED" in run.stdout, run.stdout
    assert "F401" in run.stdout and "return-value" in run.stdout and "SC2086" in run.stdout
    assert "nvidia-install.sh.j2 (example 0, rendered)" in run.stdout and "[SC2046]" in run.stdout
    assert "pvegpu lint: failed: ruff mypy shellcheck shell-templates" in run.stderr


def test_a_shell_template_without_representative_values_fails(tmp_path):
    root = _tree(tmp_path)
    (root / "templates" / "new-step.sh.j2").write_text("echo {{ value | q }}\n")
    run = _lint(root)
    assert run.returncode != 0 and "pvegpu lint: shell-templates: FAILED" in run.stdout
    assert "new-step.sh.j2: no representative values in plan/render.py SHELL_EXAMPLES" in run.stdout
