"""The driver x kernel gate of the kernel stage (issue 25 part 4) on the kpro6 twin (systemd-boot,
ESP listed in /etc/kernel/proxmox-boot-uuids), without compiling a kernel: the build dir holds a
finished build of 6.12.118+deb12-amd64 (spec kind tarball) whose image package is a stand-in and
whose headers package carries the real build tree of Debian's 6.12.118+deb12 headers (the -amd64
output tree and its kbuild scripts; its `source` link names the -common tree, already on the host,
as Debian's split headers do). Before the stage installs the kernel or sets up its trial, the NVIDIA
stage's build script compiles nvidia for it with real kbuild against that unpacked tree.

The NVIDIA tree is a miniature in NVIDIA's layout whose kernel-open/Makefile takes SYSSRC/SYSOUT
as NVIDIA's does; one variant stops with an #error on kernels from 6.12 (the real tree's way of
failing on a kernel it cannot build for: tests/fixtures/nvidia-build-log/). Refused: nothing is
installed, the default stays, the trial is not armed, the run says why quoting the first compile
error, and so do the next --dry (which changes nothing) and the host check. Then a driver source
that builds for 6.12 passes the gate and the kernel is installed and chosen for its trial.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from plan import kernel as plan
from spec.models import KernelSpec
from tests.e2e.harness import PYTEST, REPO, manifest_diff, root_manifest, run_pyinfra, spec_inventory, write_tarball
from tests.e2e.test_kernel_trial_e2e import ESP, OLD, loader_default, quiet_address, twin_run
from tests.twin import kernel_packages as kp

pytestmark = [pytest.mark.twin]

RELEASE = "6.12.118+deb12-amd64"
VERSION = "580.95.05"
ARCHIVE = f"/opt/src/open-gpu-kernel-modules-{VERSION}.tar.gz"
KERNEL: dict[str, Any] = {"version": RELEASE, "source": {"kind": "tarball", "url": "file:///opt/src/linux-6.12.118.tar.xz",
                                         "sha256": hashlib.sha256(b"linux-6.12.118").hexdigest()},
          "jobs": 1, "ccache": False}
MODULES = ("nvidia", "nvidia-uvm", "nvidia-modeset", "nvidia-drm", "nvidia-peermem")
ERROR = 'kernel-open/nvidia.c:4:2: error: #error "nvidia-mini does not support kernel 6.12 and later"'
STAGE_DEPLOY = str(REPO / "tests/e2e/stage_deploy.py")

# NVIDIA's kernel-open/Makefile: SYSSRC names the kernel's sources (else /lib/modules/<KERNEL_UNAME>/
# build), a SYSOUT that differs is handed to kbuild as KBUILD_OUTPUT, and kbuild builds M=here
MAKEFILE = """KERNEL_UNAME ?= $(shell uname -r)
ifdef SYSSRC
KERNEL_SOURCES := $(SYSSRC)
else
KERNEL_SOURCES := /lib/modules/$(KERNEL_UNAME)/build
endif
KBUILD_PARAMS :=
ifdef SYSOUT
ifneq ($(SYSOUT),$(KERNEL_SOURCES))
KBUILD_PARAMS := KBUILD_OUTPUT=$(SYSOUT)
endif
endif
modules:
\t$(MAKE) -C $(KERNEL_SOURCES) $(KBUILD_PARAMS) M=$(CURDIR) modules
"""


def mini_tree(out: Path, fail_from_6_12: bool) -> Path:
    files = {"version.mk": f"NVIDIA_VERSION = {VERSION}\n", "kernel-open/Makefile": MAKEFILE,
             "kernel-open/Kbuild": "".join(f"obj-m += {m}.o\n" for m in MODULES)}
    for m in MODULES:
        guard = ("#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 12, 0)\n"
                 "#error \"nvidia-mini does not support kernel 6.12 and later\"\n#endif\n"
                 if fail_from_6_12 and m == "nvidia" else "")
        firmware = "".join(f'MODULE_FIRMWARE("nvidia/{VERSION}/{f}");\n' for f in ("gsp_ga10x.bin", "gsp_tu10x.bin")) \
            if m == "nvidia" else ""
        files[f"kernel-open/{m}.c"] = ("#include <linux/module.h>\n#include <linux/version.h>\n" + guard
                                       + f'MODULE_LICENSE("Dual MIT/GPL");\nMODULE_VERSION("{VERSION}");\n' + firmware)
    archive = out / f"open-gpu-kernel-modules-{VERSION}{'-fails' if fail_from_6_12 else ''}.tar.gz"
    return write_tarball(archive, f"open-gpu-kernel-modules-{VERSION}", files)


def build_deb(tree: Path, out: Path) -> None:
    # Debian's bindeb-pkg shapes (a tarball build: linux-image-<rel>, linux-headers-<rel>), not Proxmox's
    kp.build_deb(tree, out, compression="none")


def seed_finished_build(root: Path, tmp: Path) -> None:
    """The build dir of KERNEL with its two packages, as a finished bindeb-pkg build leaves them."""
    k = KernelSpec(**KERNEL)
    build = root / plan.build_dir(k, "running").lstrip("/")
    build.mkdir(parents=True)
    image = tmp / "image"
    (image / "DEBIAN").mkdir(parents=True)
    (image / "boot").mkdir()
    (image / f"boot/vmlinuz-{RELEASE}").write_bytes(b"twin stand-in kernel image\n")
    (image / f"boot/config-{RELEASE}").write_bytes((root / f"usr/src/linux-headers-{RELEASE}/.config").read_bytes())
    (image / f"lib/modules/{RELEASE}").mkdir(parents=True)
    (image / f"lib/modules/{RELEASE}/modules.order").write_text("")
    (image / "DEBIAN/control").write_text(
        f"Package: linux-image-{RELEASE}\nVersion: 1\nArchitecture: amd64\n"
        "Maintainer: pvegpu tests <tests@example.invalid>\nDescription: twin stand-in kernel image\n")
    # as a kernel package's postinst: the kernel hooks with version and image (zz-proxmox-boot syncs the ESP)
    (image / "DEBIAN/postinst").write_text(
        "#!/bin/sh\nset -e\n[ \"$1\" = configure ] || exit 0\n"
        f"run-parts --verbose --exit-on-error --arg={RELEASE} --arg=/boot/vmlinuz-{RELEASE} /etc/kernel/postinst.d\n")
    (image / "DEBIAN/postinst").chmod(0o755)
    build_deb(image, build / f"linux-image-{RELEASE}_1_amd64.deb")
    # the headers package: Debian's real -amd64 tree and the kbuild scripts its links name (relative,
    # ../../lib/linux-kbuild-6.12.118+deb12), the build/source links as Debian's packages have them
    headers = tmp / "headers"
    (headers / "DEBIAN").mkdir(parents=True)
    (headers / "usr/src").mkdir(parents=True)
    (headers / "usr/lib").mkdir(parents=True)
    shutil.copytree(root / f"usr/src/linux-headers-{RELEASE}", headers / f"usr/src/linux-headers-{RELEASE}", symlinks=True)
    shutil.copytree(root / "usr/lib/linux-kbuild-6.12.118+deb12", headers / "usr/lib/linux-kbuild-6.12.118+deb12",
                    symlinks=True)
    (headers / f"lib/modules/{RELEASE}").mkdir(parents=True)
    os.symlink(f"/usr/src/linux-headers-{RELEASE}", headers / f"lib/modules/{RELEASE}/build")
    os.symlink("/usr/src/linux-headers-6.12.118+deb12-common", headers / f"lib/modules/{RELEASE}/source")
    (headers / "DEBIAN/control").write_text(
        f"Package: linux-headers-{RELEASE}\nVersion: 1\nArchitecture: amd64\n"
        "Maintainer: pvegpu tests <tests@example.invalid>\nDescription: Debian's 6.12.118 build tree\n")
    build_deb(headers, build / f"linux-headers-{RELEASE}_1_amd64.deb")
    (build / "build.rc").write_text("0\n")
    (build / "manifest.json").write_text(json.dumps({
        "build_id": plan.build_id(k, "running"), "version": RELEASE, "kind": "tarball",
        "compiler": "gcc-12 (Debian 12.2.0-14+deb12u1) 12.2.0", "source_sha": KERNEL["source"]["sha256"],
        "config_sha256": "0" * 64, "objects": 0}))


def write_inventory(tmp: Path, twin, sha: str) -> str:
    nvidia = {"version": VERSION, "open": True, "modules_source": {"url": f"file://{ARCHIVE}", "sha256": sha},
              "firmware": False, "persistenced": False}
    return spec_inventory(tmp, twin, {"node": "kpro6", "kernel": KERNEL, "nvidia": nvidia}, "gate")


def put_archive(root: Path, archive: Path) -> str:
    (root / "opt/src").mkdir(parents=True, exist_ok=True)
    (root / ARCHIVE.lstrip("/")).write_bytes(archive.read_bytes())
    return hashlib.sha256(archive.read_bytes()).hexdigest()


def converge(inventory: str, *args: str):
    return run_pyinfra(inventory, STAGE_DEPLOY, *args, env={"PVEGPU_STAGES": "operations.kernel",
                                                            "PVEGPU_E2E_NO_REBOOT": "1"}, timeout=900)


def test_a_kernel_the_driver_cannot_build_for_is_refused_before_it_is_installed(twin_factory, tmp_path):
    twin = twin_factory("kpro6", name=f"s25g-{os.getpid()}", address=quiet_address())
    root = Path(twin.root)
    seed_finished_build(root, tmp_path)
    inventory = write_inventory(tmp_path, twin, put_archive(root, mini_tree(tmp_path, fail_from_6_12=True)))
    assert twin_run(twin.name, "uname", "-r").strip() == OLD
    default = loader_default(root)

    run = converge(inventory)
    assert run.rc != 0, run.output[-4000:]
    assert f"nvidia {VERSION} could not be built for kernel {RELEASE}: the build failed (exit 1): {ERROR}" in run.output, \
        run.output[-6000:]
    # neither installed nor pinned nor armed: the loader boots what it booted
    assert not (root / f"boot/vmlinuz-{RELEASE}").exists()
    assert twin_run(twin.name, "sh", "-c", f"dpkg-query -W -f '${{Status}}' linux-image-{RELEASE} 2>/dev/null; true") \
        in ("", "unknown ok not-installed")
    assert loader_default(root) == default
    assert not (root / plan.TRIAL_MARKER.lstrip("/")).exists()
    assert not list((root / ESP / "loader/entries").glob("pvegpu-trial-*"))
    record = (root / f"var/lib/pvegpu/kernel/nvidia-gate/{RELEASE}.refused").read_text().splitlines()
    assert record[1].endswith(ERROR) and record[2] == f"nvidia {VERSION} {hashlib.sha256((root / ARCHIVE.lstrip('/')).read_bytes()).hexdigest()}"

    before = root_manifest(root)
    dry = converge(inventory, "--dry")
    assert manifest_diff(before, root_manifest(root)) == [], "--dry changed the twin"
    assert dry.rc != 0
    assert f"kernel {RELEASE} (kernel.version) is refused: nvidia {VERSION} could not be built for kernel {RELEASE}: " \
        f"the build failed (exit 1): {ERROR}" in dry.output, dry.output[-4000:]
    checks = subprocess.run([PYTEST, "-q", "-rA", "-p", "no:cacheprovider", "tests/host/test_boot.py", "-k", "gate",
                             "--inventory", inventory], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert checks.returncode == 1, checks.stdout[-3000:]
    assert f"kernel {RELEASE} (kernel.version) is refused" in checks.stdout and ERROR in checks.stdout, checks.stdout[-3000:]

    # a driver source that builds for 6.12 (a new sha256 in the spec): the gate runs again and passes,
    # the kernel is installed and chosen for the next boot only
    (tmp_path / "fixed").mkdir()
    inventory = write_inventory(tmp_path, twin, put_archive(root, mini_tree(tmp_path / "fixed", fail_from_6_12=False)))
    run = converge(inventory)
    assert run.rc == 0, run.output[-6000:]
    assert "Driver x kernel gate: build nvidia" in run.output, run.output[-4000:]
    assert (root / f"boot/vmlinuz-{RELEASE}").exists()
    assert (root / plan.TRIAL_MARKER.lstrip("/")).read_text().strip() == RELEASE
    assert not (root / f"var/lib/pvegpu/kernel/nvidia-gate/{RELEASE}.refused").exists()
    gate_log = (root / f"var/lib/pvegpu/kernel/nvidia-gate/{RELEASE}.log").read_text()
    assert f"pvegpu: building nvidia {VERSION} for {RELEASE}" in gate_log and "gate passed" in gate_log, gate_log[-3000:]
    assert loader_default(root) == f"proxmox-{OLD}.conf"
    checks = subprocess.run([PYTEST, "-q", "-rA", "-p", "no:cacheprovider", "tests/host/test_boot.py", "-k", "gate",
                             "--inventory", inventory], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert checks.returncode == 0, checks.stdout[-3000:]
