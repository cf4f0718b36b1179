"""scripts/lint.sh covers every Python file of the repo: ruff checks each one (the paths lint.sh
gives it, less pyproject's excludes, as ruff itself lists them) and mypy's `files`
(pyproject.toml [tool.mypy]) hold each one. A new file or folder outside them fails here."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUFF = Path(sys.executable).parent / "ruff"


def repo_python_files() -> list[str]:
    """Tracked and new (not ignored) files that are Python: *.py, or a python shebang."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                            cwd=REPO, capture_output=True, check=True).stdout.decode().split("\0")
    found = []
    for name in filter(None, listed):
        path = REPO / name
        if not path.is_file():
            continue  # deleted in the work tree
        if name.endswith(".py"):
            found.append(name)
        else:
            with open(path, "rb") as f:
                first = f.readline(200)
            if first.startswith(b"#!") and b"python" in first:
                found.append(name)
    return sorted(found)


def lint_ruff_paths() -> list[str]:
    """The PY_PATHS array of scripts/lint.sh, and a check that ruff runs on it."""
    text = (REPO / "scripts/lint.sh").read_text()
    m = re.search(r"^PY_PATHS=\(([^)]*)\)", text, re.M)
    assert m, "scripts/lint.sh has no PY_PATHS=(...) line"
    assert re.search(r'^step ruff .*check.*"\$\{PY_PATHS\[@\]\}"', text, re.M), "lint.sh does not run ruff on PY_PATHS"
    return shlex.split(m.group(1), comments=True)


def test_ruff_checks_every_python_file():
    checked = subprocess.run([str(RUFF), "check", "--show-files", *lint_ruff_paths()], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.splitlines()
    checked_rel = {str(Path(p).resolve().relative_to(REPO)) for p in checked if p.startswith("/")}
    missing = [f for f in repo_python_files() if f not in checked_rel]
    assert not missing, f"scripts/lint.sh's ruff does not check: {missing}"


def test_mypy_files_hold_every_python_file():
    text = (REPO / "scripts/lint.sh").read_text()
    assert re.search(r'^step mypy "\$VENV/bin/mypy"\s*(#.*)?$', text, re.M), \
        "lint.sh runs mypy with paths of its own; this test reads them from pyproject.toml"
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]
    roots = [Path(p).as_posix().rstrip("/") for p in config["files"]]
    exclude = config.get("exclude")
    excluded = re.compile(exclude if isinstance(exclude, str) else "|".join(exclude)) if exclude else None

    def covered(name: str) -> bool:
        if excluded and excluded.search(name):
            return False
        # mypy walks a folder for *.py only; a file of another name must be listed itself
        return any(name == r or (name.endswith(".py") and (r == "." or name.startswith(r + "/"))) for r in roots)

    missing = [f for f in repo_python_files() if not covered(f)]
    assert not missing, f"pyproject.toml [tool.mypy] files leave out: {missing}"
