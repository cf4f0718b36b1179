"""The Proxmox VE 9 twin profile (kpro6-pve9): kpro6's hardware on a debootstrapped trixie root
(GCC 14), with what the 9.x programs print (issue 29 part 1)."""

from __future__ import annotations

import subprocess

import pytest

from tests.twin import hardware, runtime


def test_profile_extends_kpro6_and_names_trixie():
    base, pve9 = hardware.load_profile("kpro6"), hardware.load_profile("kpro6-pve9")
    assert pve9["pci"] == base["pci"] and pve9["cpu"] == base["cpu"] and pve9["guests"] == base["guests"]
    assert pve9["nvidia"]["version"] == base["nvidia"]["version"] and pve9["nvidia"]["params"] == base["nvidia"]["params"]
    assert "extends" not in pve9
    # pve-kernel master at 6e44995 / trixie-6.17 at 74c6afb: no -bpo suffix on trixie branches
    assert pve9["kernel"]["release"] == "7.0.14-14-pve" and "6.17.13-21-pve" in pve9["kernel"]["installed"]
    assert pve9["kernel"]["pci_iov"] is True  # kept from kpro6 (mappings merge key by key)
    assert hardware.profile_suite("kpro6-pve9") == "trixie" and hardware.profile_suite("kpro6") == "bookworm"


def test_proxmox_repository_file_follows_the_version(tmp_path):
    """pve-manager installs the enterprise repository: a one-line .list on 8, deb822 .sources on 9
    (configs/Makefile of stable-8 and master)."""
    for profile, name, words in (("kpro6", "pve-enterprise.list", "deb https://enterprise.proxmox.com/debian/pve bookworm"),
                                 ("kpro6-pve9", "pve-enterprise.sources", "Suites: trixie\nComponents: pve-enterprise")):
        root = tmp_path / profile
        hardware.install(root, profile)
        files = sorted(p.name for p in (root / "etc/apt/sources.list.d").iterdir())
        assert files == [name] and words in (root / "etc/apt/sources.list.d" / name).read_text()


def test_overlay_merges_mappings_and_replaces_lists():
    assert hardware._overlay({"a": {"x": 1, "y": [1]}, "b": 2}, {"a": {"y": [2]}, "c": 3}) == \
        {"a": {"x": 1, "y": [2]}, "b": 2, "c": 3}


@pytest.mark.twin
def test_pve9_twin_runs_trixie_gcc14_and_prints_9x_versions(twin_factory):
    twin = twin_factory("kpro6-pve9", name="s29-pve9")

    def sh(command: str) -> str:
        run = subprocess.run(runtime.ssh_command(twin.name, [command]), capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        return run.stdout

    assert "VERSION_CODENAME=trixie" in sh("cat /etc/os-release")
    assert sh("gcc --version | head -n 1") == "gcc (Debian 14.2.0-19) 14.2.0\n"
    assert sh("g++-14 --version | head -n 1") == "g++-14 (Debian 14.2.0-19) 14.2.0\n"
    # pve-manager bin/pveversion: the same shape on 9 (package/version/repoid, running kernel)
    assert sh("pveversion") == "pve-manager/9.2.11/3c1e0d8a5f7b2e94 (running kernel: 7.0.14-14-pve)\n"
    assert sh("dpkg-query -W -f '${Version}' pve-container") == "6.1.10"
    assert "(gcc (Debian 14.2.0-19) 14.2.0, GNU ld (GNU Binutils for Debian) 2.44)" in sh("cat /proc/version")
    # the driver the host runs was built by its GCC 14 (the module's .comment), as the kernel was
    assert "gcc version 14.2.0 (Debian 14.2.0-19)" in sh("cat /proc/driver/nvidia/version")
    # Debian trixie's own headers (the driver build's second release) were built with gcc-14 too
    assert "x86_64-linux-gnu-gcc-14 (Debian 14.2.0-19) 14.2.0" in sh(
        "grep -h '^CONFIG_CC_VERSION_TEXT' /usr/src/linux-headers-*-amd64/include/config/auto.conf")
