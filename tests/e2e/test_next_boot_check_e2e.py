"""Issue 38 item 2.6 on the kpro6 twin (systemd-boot on a proxmox-boot-tool ESP, the real
proxmox-boot-tool and bootctl): the host check "what boots next has the NVIDIA modules" reads the
loader, not pin files. Once the host is converged, the loader is made to choose a kernel without
NVIDIA modules (6.8.12-11-pve, installed and on the ESP) by means the pin files do not show: the
one-shot and default EFI variables (bootctl) and a loader.conf edit. The check fails naming that
kernel each time, agrees with the twin's firmware model (tests/twin/hardware.py esp_boot_entry,
systemd-boot's choice), and passes again once the loader's choice is the kernel with the modules."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.e2e.harness import PYTEST, REPO, run_pyinfra
from tests.twin import hardware, runtime

pytestmark = [pytest.mark.twin]

GOOD = "6.14.8-2-pve"  # the profile's running kernel, with nvidia 595.71.05
BARE = "6.8.12-11-pve"  # installed, on the ESP, no NVIDIA modules
ESP = "var/lib/twin/esp/5A1C-9E27"


def twin_sh(name: str, command: str) -> str:
    done = subprocess.run(runtime.ssh_command(name, [command]), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{command}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
    return done.stdout


def next_boot_check(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([PYTEST, "-q", "-rA", "-p", "no:cacheprovider", "tests/host/test_boot.py", "-k",
                           "loader_boots_next", "--inventory", "inventories/twin.py"],
                          cwd=REPO, capture_output=True, text=True, env={**os.environ, **env}, timeout=300)


def firmware_choice(root: Path) -> str:
    entry = hardware.esp_boot_entry(root)
    assert entry is not None
    return entry["version"]


def test_the_next_boot_check_reads_the_loaders_choice(twin_factory):
    twin = twin_factory("kpro6", name="nextboot-kpro6")
    root = Path(twin.root)
    env = {"PVEGPU_TWINS": twin.name}
    converge = run_pyinfra("inventories/twin.py", "deploy.py", env=env)
    assert converge.rc == 0, converge.output[-4000:]
    assert (root / ESP / f"loader/entries/proxmox-{BARE}.conf").is_file()  # refresh keeps it on the ESP
    ok = next_boot_check(env)
    assert ok.returncode == 0 and "1 passed" in ok.stdout, ok.stdout[-3000:]
    pins = twin_sh(twin.name, "cat /etc/kernel/proxmox-boot-pin /etc/kernel/next-boot-pin 2>/dev/null; true")

    nvram = root / hardware.EFIVARS
    for choose in (
        f"bootctl set-oneshot proxmox-{BARE}.conf",
        f"bootctl set-default proxmox-{BARE}.conf",
        # loader.conf's default glob (what a reinit or a hand edit leaves), no EFI default
        f"bootctl set-default ''; sed -i 's/^default .*/default proxmox-6.8*/' /{ESP}/loader/loader.conf",
    ):
        saved = {p.name: p.read_bytes() for p in nvram.iterdir()}
        conf = (root / ESP / "loader/loader.conf").read_text()
        twin_sh(twin.name, choose)
        assert firmware_choice(root) == BARE, choose  # systemd-boot would boot it
        assert twin_sh(twin.name, "cat /etc/kernel/proxmox-boot-pin /etc/kernel/next-boot-pin 2>/dev/null; true") == pins
        bad = next_boot_check(env)
        assert bad.returncode == 1, (choose, bad.stdout[-3000:])
        assert f"kernel {BARE} has nvidia missing, not 595.71.05" in bad.stdout, (choose, bad.stdout[-3000:])
        assert "Traceback" not in bad.stdout, bad.stdout[-3000:]
        # the loader's choice put back: the kernel with the modules boots next, the check passes
        for p in nvram.iterdir():
            if p.name not in saved:
                p.unlink()
        for name, data in saved.items():
            (nvram / name).write_bytes(data)
        (root / ESP / "loader/loader.conf").write_text(conf)
        assert firmware_choice(root) == GOOD
        good = next_boot_check(env)
        assert good.returncode == 0 and "1 passed" in good.stdout, (choose, good.stdout[-3000:])
