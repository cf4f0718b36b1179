"""tests/e2e/harness.py root_manifest: a root's second manifest reuses the hashes of files not
written since (device, inode, size, mtime, ctime), and still sees every change."""

from __future__ import annotations

import os
import time

from tests.e2e import harness


def test_a_second_manifest_hashes_only_what_changed_and_sees_a_same_size_rewrite(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "RECENT_NS", 0)  # every hash may be kept (the files are seconds old otherwise)
    (tmp_path / "a").write_text("one\n")
    (tmp_path / "b").write_text("two\n")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "c").write_text("three\n")
    before = harness.root_manifest(tmp_path)
    hashed: list[str] = []
    sha256 = harness.hashlib.sha256

    def counted(*args):
        hashed.append("x")
        return sha256(*args)

    monkeypatch.setattr(harness.hashlib, "sha256", counted)
    assert harness.root_manifest(tmp_path) == before and hashed == []
    time.sleep(0.05)  # past the filesystem's clock tick: the rewrite gets a new ctime
    st = os.stat(tmp_path / "b")
    (tmp_path / "b").write_text("TWO\n")  # same size, and the old mtime put back: only ctime tells
    os.utime(tmp_path / "b", ns=(st.st_atime_ns, st.st_mtime_ns))
    after = harness.root_manifest(tmp_path)
    assert harness.manifest_diff(before, after) == [f"b: {before['b']} -> {after['b']}"] and len(hashed) == 1
