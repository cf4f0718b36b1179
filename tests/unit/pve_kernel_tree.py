"""The real pve-kernel tree (branch bookworm-6.14 at ad58d14, through scripts/fetch-upstream.sh)
as a git repository whose HEAD is that content: what the kernel stage's build clones from."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def bookworm_git_tree(tmp_path_factory) -> Path:
    """Unpack the archive into a fresh git repository with one commit; skips the test when the
    archive is not available."""
    out = subprocess.run([str(REPO / "scripts/fetch-upstream.sh"), "pve-kernel-bookworm-6.14"],
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        pytest.skip(f"pve-kernel tree not available: {out.stderr[-300:]}")
    tree = tmp_path_factory.mktemp("pve-kernel") / "repo"
    tree.mkdir()
    subprocess.run(["tar", "-xf", out.stdout.strip(), "-C", str(tree), "--strip-components=1"], check=True)
    git = ["git", "-C", str(tree), "-c", "user.email=t@example.invalid", "-c", "user.name=t"]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "pve-kernel bookworm-6.14 at ad58d14"], check=True)
    return tree
