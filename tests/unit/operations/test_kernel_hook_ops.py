"""The kernel hook script (templates/kernel-postinst-nvidia.sh.j2) run for real with the paths
moved into a temp dir: whatever stops the build, it exits 0 (pve-kernel's postinst runs the hooks
with run-parts --exit-on-error), keeps the reason and the login notice."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

from operations import kernel_hook
from plan.render import render_template
from spec.models import HostSpec

RELEASE = "6.14.11-1-pve"


def hook(tmp: Path, archive: Path, sha: str, cc: str = "gcc-12") -> str:
    spec = HostSpec(nvidia={"version": "580.95.05", "open": True,
                            "modules_source": {"url": f"file://{archive}", "sha256": sha}})
    context = kernel_hook.hook_context(spec, cc, None, 2, False)
    context.update(archive=str(archive), state_dir=str(tmp / "state"), pin_file=str(tmp / "pin"),
                   motd_dir=str(tmp / "motd.d"), motd_file=str(tmp / "motd.d/pvegpu-kernel"),
                   modules_dir=str(tmp / "modules"), build_root=str(tmp / "build"),
                   build_parent=str(tmp / "build/580.95.05"))
    return render_template("kernel-postinst-nvidia.sh.j2", **context)


def run(tmp: Path, script: str) -> subprocess.CompletedProcess:
    path = tmp / "pvegpu-nvidia"
    path.write_text(script)
    env = {**os.environ, "PATH": f"{tmp / 'bin'}:/usr/bin:/bin"}  # no proxmox-boot-tool here
    return subprocess.run(["sh", str(path), RELEASE, f"/boot/vmlinuz-{RELEASE}"], capture_output=True, text=True,
                          env=env, timeout=60)


def test_a_missing_archive_is_kept_as_the_reason_and_the_hook_exits_0(tmp_path):
    done = run(tmp_path, hook(tmp_path, tmp_path / "none.tar.gz", hashlib.sha256(b"none").hexdigest()))
    assert done.returncode == 0, done.stderr
    record = (tmp_path / f"state/{RELEASE}.failed").read_text().splitlines()
    assert record[1] == (f"nvidia 580.95.05 could not be built for kernel {RELEASE}: its source archive "
                         f"{tmp_path}/none.tar.gz is not on this host (the converge fetches it)")
    assert "no proxmox-boot-tool" in record[2] or "no installed kernel has nvidia" in record[2]
    assert RELEASE in (tmp_path / "motd.d/pvegpu-kernel").read_text()


def test_another_compiler_than_the_kernel_s_is_refused_before_any_build(tmp_path):
    archive = tmp_path / "tree.tar.gz"
    archive.write_bytes(b"tree")
    build = tmp_path / "modules" / RELEASE / "build"
    build.mkdir(parents=True)
    (build / "Makefile").write_text("")
    (build / ".config").write_text('CONFIG_CC_VERSION_TEXT="gcc-14 (Debian 14.2.0-19) 14.2.0"\n')
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin/gcc-12").write_text("#!/bin/sh\necho 'gcc-12 (Debian 12.2.0-14+deb12u1) 12.2.0'\n")
    (tmp_path / "bin/gcc-12").chmod(0o755)
    done = run(tmp_path, hook(tmp_path, archive, hashlib.sha256(b"tree").hexdigest()))
    assert done.returncode == 0, done.stderr
    reason = (tmp_path / f"state/{RELEASE}.failed").read_text().splitlines()[1]
    assert reason.endswith("it was built with 'gcc-14 (Debian 14.2.0-19) 14.2.0', this host's gcc-12 is "
                           "'gcc-12 (Debian 12.2.0-14+deb12u1) 12.2.0' (modules of another compiler left a host unbootable)")
    assert not (tmp_path / "build").exists(), "nothing was built"


def test_a_changed_archive_is_refused(tmp_path):
    archive = tmp_path / "tree.tar.gz"
    archive.write_bytes(b"tree, changed")
    done = run(tmp_path, hook(tmp_path, archive, hashlib.sha256(b"tree").hexdigest()))
    assert done.returncode == 0
    assert "does not have sha256" in (tmp_path / f"state/{RELEASE}.failed").read_text()
