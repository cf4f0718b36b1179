"""pvegpu performs the 8 -> 9 upgrade when the spec opts in (issue 40 item 1), on a kpro6 twin on
Proxmox VE 8 (fast lane: no real dist-upgrade; the job stops where apt would fetch trixie).

- preflight: with pve8to9 reporting a FAIL (the twin's pve8to9 stand-in, set_fault) and a Ceph
  Reef repository, the run refuses, names both, and changes nothing;
- the start: the preflight passes; the run records the GPU guests it stops (guests-stopped), backs
  up /etc/pve (a tarball) and the guest configs into root-only dirs and starts the job detached (the twin runs no systemd: a setsid'd process);
  the job waits for dpkg's lock, which the test holds as another apt run would;
- a second run while the job runs reports it (its step, its log) and changes nothing;
- the lock released, the job moves the sources to trixie in each file's own format (one-line
  .list, deb822 .sources) and fails at `dpkg --configure -a` on a package whose postinst fails
  (a real dpkg failure); the next run refuses with the log's tail and how to start again.

Fails on main: `proxmox_ve_upgrade` is not a spec field there (the spec is refused)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.e2e.harness import REPO, manifest_diff, root_manifest, run_pyinfra
from tests.twin import runtime

pytestmark = [pytest.mark.twin]

NAME = "s21-upg"
PVE_LIST = "etc/apt/sources.list.d/pve-install-repo.list"
CEPH_LIST = "etc/apt/sources.list.d/ceph.list"
STATE = "var/lib/pvegpu/upgrade"


def inventory(tmp: Path, twin) -> str:
    spec = yaml.safe_load((REPO / "inventories/twin.yml").read_text())["hosts"]["kpro6"]
    spec = dict(spec, ssh={"hostname": twin.address, "port": twin.port, "user": "root", "key": twin.key},
                proxmox_ve=9, proxmox_ve_upgrade="perform")
    yml = tmp / "site.yml"
    yml.write_text(json.dumps({"hosts": {NAME: spec}}))
    inv = tmp / "site_inventory.py"
    overrides = {NAME: {"ssh_known_hosts_file": "/dev/null", "ssh_strict_host_key_checking": "off"}}
    inv.write_text("from spec.load import inventory_hosts\n"
                   f"hosts = inventory_hosts({str(yml)!r}, overrides={overrides!r})\n")
    return str(inv)


def ssh(command: str) -> str:
    done = runtime.ssh_run(NAME, [command])
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def wait_for(predicate, timeout: float = 30, step: float = 0.2) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


# a package whose postinst fails: dpkg leaves it half-configured, and `dpkg --configure -a` fails on it
BROKEN_DEB = r"""set -e
d=$(mktemp -d) && mkdir -p "$d/DEBIAN"
printf 'Package: pvegpu-test-broken\nVersion: 1\nArchitecture: all\nMaintainer: t <t@example.org>\nDescription: t\n' \
  > "$d/DEBIAN/control"
printf '#!/bin/sh\necho "pvegpu-test-broken: postinst fails"\nexit 1\n' > "$d/DEBIAN/postinst"
chmod 755 "$d/DEBIAN/postinst"
dpkg-deb -b "$d" /root/broken.deb >/dev/null
dpkg -i /root/broken.deb >/dev/null 2>&1 || true
dpkg-query -W -f='${Status}' pvegpu-test-broken
"""
# dpkg's frontend lock held as apt holds it (fcntl F_SETLK on /var/lib/dpkg/lock-frontend), until
# /root/release appears
HOLD_LOCK = ("rm -f /root/release; setsid python3 -c \"import fcntl, os, time\n"
             "f = open('/var/lib/dpkg/lock-frontend', 'w'); fcntl.lockf(f, fcntl.LOCK_EX)\n"
             "open('/root/locked', 'w').close()\n"
             "while not os.path.exists('/root/release'): time.sleep(0.1)\n\" >/dev/null 2>&1 < /dev/null &")


def test_perform_preflight_start_running_failed(twin_factory, tmp_path):
    twin = twin_factory("kpro6", name=NAME)
    root = Path(twin.root)
    upper = root.parent / "upper"
    inv = inventory(tmp_path, twin)
    (root / PVE_LIST).write_text("deb http://download.proxmox.com/debian/pve bookworm pve-no-subscription\n")
    (root / CEPH_LIST).write_text("deb http://download.proxmox.com/debian/ceph-reef bookworm no-subscription\n")
    runtime.set_fault(NAME, pve8to9_fails=("corosync.conf: totem.config_version is missing",))

    # preflight: refused before any change, each reason named
    before = root_manifest(upper)
    refused = run_pyinfra(inv, "deploy.py")
    assert refused.rc != 0, refused.output[-4000:]
    assert "[upgrade] pve8to9 --full reports 1 FAILURE(S): corosync.conf: totem.config_version is missing" \
        in refused.output, refused.output[-4000:]
    assert "a Ceph repository before Squid is configured: ceph-reef (/etc/apt/sources.list.d/ceph.list:1)" \
        in refused.output
    assert "nothing was changed" in refused.output
    assert manifest_diff(before, root_manifest(upper)) == []
    assert not (root / STATE).exists()

    runtime.set_fault(NAME)
    (root / CEPH_LIST).unlink()
    assert "half-configured" in ssh(BROKEN_DEB)
    ssh(HOLD_LOCK)
    assert wait_for(lambda: (root / "root/locked").exists())

    ssh("pct start 200")  # a running GPU CT: the start stops it and records it
    # the start: backups, the job detached (no systemd in the twin: setsid), waiting for dpkg's lock
    started = run_pyinfra(inv, "deploy.py")
    assert started.rc == 0, started.output[-4000:]
    assert "the Proxmox VE 8 -> 9 upgrade starts detached on the host" in started.output
    state_dir = root / STATE
    assert oct(state_dir.stat().st_mode & 0o777) == "0o700" and oct((root / "var/lib/pvegpu").stat().st_mode & 0o777) == "0o700"
    tarballs = list(state_dir.glob("etc-pve-*.tar.gz"))
    assert len(tarballs) == 1
    names = subprocess.run(["tar", "-tzf", str(tarballs[0])], capture_output=True, text=True, check=True).stdout
    assert "etc/pve/nodes/kpro6/lxc/200.conf" in names and "etc/pve/nodes/kpro6/qemu-server/300.conf" in names, names
    assert list((root / "var/lib/pvegpu/backup/etc/pve/lxc/200.conf").iterdir())
    assert wait_for(lambda: "step=wait-for-dpkg" in (state_dir / "state").read_text())
    # the GPU guests it stopped are recorded (root's, 0600) to be started again once the host runs 9's kernel
    stopped = [line for line in ssh("pct list; qm list").splitlines() if "stopped" in line]
    record = state_dir / "guests-stopped"
    assert "GPU guests stopped" in started.output and any(line.split()[:2] == ["200", "stopped"] for line in stopped)
    assert oct(record.stat().st_mode & 0o777) == "0o600" and record.read_text() == "lxc 200\n"

    # a second run while it runs: reported, nothing changed, the run stops
    before = root_manifest(upper)
    running = run_pyinfra(inv, "deploy.py")
    assert running.rc != 0, running.output[-4000:]
    assert "the 8 -> 9 upgrade runs on the host (unit pvegpu-upgrade, or its process where no systemd runs), step " \
           "wait-for-dpkg" in running.output, running.output[-4000:]
    assert "run again when it is over" in running.output
    assert manifest_diff(before, root_manifest(upper)) == []
    assert "bookworm" in (root / PVE_LIST).read_text()  # the sources wait for the job

    # the lock released: sources moved in their own formats, `dpkg --configure -a` fails for real
    (root / "root/release").touch()
    assert wait_for(lambda: "status=failed" in (state_dir / "state").read_text(), timeout=60), \
        (state_dir / "upgrade.log").read_text()[-3000:]
    assert (root / PVE_LIST).read_text() == "deb http://download.proxmox.com/debian/pve trixie pve-no-subscription\n"
    debian = (root / "etc/apt/sources.list.d/debian.sources").read_text()
    assert "Suites: trixie" in debian and "bookworm" not in debian, debian
    assert (state_dir / "sources-before/pve-install-repo.list").read_text().endswith("bookworm pve-no-subscription\n")

    failed = run_pyinfra(inv, "deploy.py")
    assert failed.rc != 0, failed.output[-4000:]
    assert "the 8 -> 9 upgrade pvegpu started failed at step configure-pending" in failed.output, failed.output[-4000:]
    assert "pvegpu-test-broken: postinst fails" in failed.output  # the log's tail
    assert "rm /var/lib/pvegpu/upgrade/state and run again" in failed.output
