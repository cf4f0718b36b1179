"""Issue 39 item 3: the kernel build runs the commit kernel.source.ref pins, or nothing.

kernel.source.ref is a full commit id (spec/values.py git_ref); templates/kernel-build.sh.j2
compares `git rev-parse HEAD` after its `git checkout --force <ref> --` with it. Real git, real
build script: a server whose default branch is *named* like the pinned commit (clone makes it a
local branch, and `git checkout <name>` takes a branch before an object id) and a pinned id that
is an annotated tag object's (checkout peels it to another commit) both stop the build before
anything of the tree runs; the honest server gets past the check."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from operations import kernel
from spec.models import KernelSpec

pytestmark = pytest.mark.skipif(not shutil.which("git"), reason="needs git")
RELEASE = "6.14.11-9-bpo12-pvegpu-pve"


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "GIT_CONFIG_GLOBAL": "/dev/null"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env=env).stdout.strip()


def server(tmp_path: Path) -> tuple[Path, str, str]:
    """A repository with the reviewed commit A (a Makefile that says 'reviewed') and a later B."""
    up = tmp_path / "up"
    up.mkdir()
    git(up, "init", "-q", "-b", "main")
    (up / "Makefile").write_text("all:\n\t@echo reviewed\n")
    git(up, "add", "Makefile")
    git(up, "commit", "-q", "-m", "A")
    a = git(up, "rev-parse", "HEAD")
    (up / "Makefile").write_text("all:\n\t@echo injected\n")
    git(up, "commit", "-q", "-am", "B")
    return up, a, git(up, "rev-parse", "HEAD")


def build(tmp_path: Path, url: Path, ref: str) -> tuple[int, str]:
    b = tmp_path / "b"
    b.mkdir()
    k = KernelSpec(version=RELEASE, source={"kind": "proxmox-git", "url": str(url), "ref": ref}, ccache=False)
    (b / "build.sh").write_text(kernel.build_script(k, "running", 2, str(b)))
    r = subprocess.run(["sh", str(b / "build.sh")], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "GIT_CONFIG_GLOBAL": "/dev/null"})
    return r.returncode, (b / "build.log").read_text()


def test_a_default_branch_named_like_the_pinned_commit_stops_the_build(tmp_path):
    up, a, b = server(tmp_path)
    git(up, "branch", a, b)  # a branch whose name is A's id, pointing at B
    git(up, "symbolic-ref", "HEAD", f"refs/heads/{a}")
    rc, log = build(tmp_path, up, a)
    assert rc == 8, log
    assert f"the checkout is at commit {b}, but kernel.source.ref pins {a}; nothing was built" in log
    assert "pvegpu-kvname" not in log and "injected" not in log


def test_a_pinned_tag_object_stops_the_build(tmp_path):
    up, a, _ = server(tmp_path)
    git(up, "tag", "-a", "-m", "v1", "v1", a)
    tag_object = git(up, "rev-parse", "v1")
    assert tag_object != a
    rc, log = build(tmp_path, up, tag_object)
    assert rc == 8 and f"the checkout is at commit {a}, but kernel.source.ref pins {tag_object}" in log, log


def test_the_pinned_commit_gets_past_the_check(tmp_path):
    up, a, _ = server(tmp_path)
    rc, log = build(tmp_path, up, a)
    assert "kernel.source.ref pins" not in log, log
    assert rc not in (0, 8)  # the next step (pve-kernel's Makefile, which this tree lacks) stops it
    assert (tmp_path / "b" / "src" / "Makefile").read_text() == "all:\n\t@echo reviewed\n"
