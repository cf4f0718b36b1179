"""Issue 42: the documentation site builds in strict mode (a broken link, a missing anchor or a
page left out of the navigation fails), offline, as `make docs` builds it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MKDOCS = Path(sys.executable).with_name("mkdocs")


def test_the_site_builds_in_strict_mode(tmp_path):
    out = subprocess.run([str(MKDOCS), "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "site/tutorial.html").exists() and (tmp_path / "site/reference/spec.html").exists()
    assert (tmp_path / "site/stages.svg").exists() and (tmp_path / "site/topology-kpro6.png").exists()


def test_a_broken_link_fails_the_build(tmp_path):
    docs = tmp_path / "docs"
    subprocess.run(["cp", "-a", str(REPO / "docs"), str(docs)], check=True)
    (docs / "index.md").write_text((docs / "index.md").read_text() + "\n[gone](howto/gone.md)\n")
    config = (REPO / "mkdocs.yml").read_text().replace("docs_dir: docs", f"docs_dir: {docs}")
    (tmp_path / "mkdocs.yml").write_text(config)
    out = subprocess.run([str(MKDOCS), "build", "--strict", "-f", str(tmp_path / "mkdocs.yml"),
                          "--site-dir", str(tmp_path / "site")], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "howto/gone.md" in out.stdout + out.stderr
