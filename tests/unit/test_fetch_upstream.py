"""scripts/fetch-upstream.sh: an archive is used only when its sha256 (or its tar stream's)
is the listed one; a shared copy of that sha256 stands in for the download."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import subprocess
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "fetch-upstream.sh"


def tar_bytes() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        data = b"KREL=9\n"
        info = tarfile.TarInfo("tree/Makefile")
        info.size, info.mtime = len(data), 0
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def fetch(tmp: Path, table: str, name: str = "tree", shared: Path | None = None):
    (tmp / "sources.tsv").write_text(table)
    env = {**os.environ, "UPSTREAM_SOURCES": str(tmp / "sources.tsv"), "UPSTREAM_CACHE": str(tmp / "cache"),
           "UPSTREAM_SHARED": str(shared or tmp / "no-shared")}
    return subprocess.run([str(SCRIPT), name], capture_output=True, text=True, env=env, timeout=60)


def test_download_checked_by_sha256_or_tar_stream_and_shared_copy_used(tmp_path):
    raw = tar_bytes()
    gz = tmp_path / "tree.tar.gz"
    gz.write_bytes(gzip.compress(raw, mtime=0))
    sha, tar_sha = hashlib.sha256(gz.read_bytes()).hexdigest(), hashlib.sha256(raw).hexdigest()
    bad = fetch(tmp_path, f"tree\tfile://{gz}\t{'0' * 64}\t{'1' * 64}\n")
    assert bad.returncode == 1 and f"gave sha256 {sha}" in bad.stderr and not (tmp_path / "cache/tree.tar.gz").exists()
    # another compressor of the same tar stream passes on the tar-stream sha256
    ok = fetch(tmp_path, f"tree\tfile://{gz}\t{'0' * 64}\t{tar_sha}\n")
    assert ok.returncode == 0 and ok.stdout.strip() == str(tmp_path / "cache/tree.tar.gz")
    # no download needed when a shared file has the listed sha256
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "renamed.tar.gz").write_bytes(gz.read_bytes())
    (tmp_path / "cache/tree.tar.gz").unlink()
    (tmp_path / "cache/tree.tar.gz.verified").unlink()
    offline = fetch(tmp_path, f"tree\thttps://127.0.0.1:9/none.tar.gz\t{sha}\t\n", shared=shared)
    assert offline.returncode == 0, offline.stderr
    assert Path(offline.stdout.strip()).read_bytes() == gz.read_bytes()
    assert fetch(tmp_path, "", name="nothing").returncode == 2
