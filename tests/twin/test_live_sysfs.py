"""A twin's /sys: read-only by default; with live_sysfs its kernel model (tests/twin/livesys.py)
rebinds PCI drivers the way a shell on a real host does it; fault knobs (slow unbind, sshd
killed) for the rebind transaction's tests."""

from __future__ import annotations

import json
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from tests.twin import runtime

GPU0, GPU1 = "0000:01:00.0", "0000:21:00.0"
S = "/sys/bus/pci"


def ssh(twin, command: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    run = subprocess.run(runtime.ssh_command(twin.name, [command]), capture_output=True, text=True,
                         timeout=timeout)
    if check and run.returncode != 0:
        raise AssertionError(f"{command!r} -> {run.returncode}\n{run.stdout}{run.stderr}")
    return run


def move(twin, bdf: str, current: str, wanted: str) -> str:
    """The product's rebind sequence, as root in sh; returns the driver read back."""
    return ssh(twin, f"set -e; modprobe {wanted.replace('-', '_')}; "
                     f"echo {wanted} > {S}/devices/{bdf}/driver_override; "
                     f"echo {bdf} > {S}/drivers/{current}/unbind; echo {bdf} > {S}/drivers_probe; "
                     f"d=$(readlink {S}/devices/{bdf}/driver); echo ${{d##*/}}").stdout.strip()


def gpus(twin) -> list[tuple[int, str, int]]:
    """(index, bus id, minor) per GPU nvidia-smi lists."""
    out = ssh(twin, "nvidia-smi --query-gpu=index,pci.bus_id,minor_number --format=csv,noheader").stdout
    return [(int(i), b.strip()[4:].lower(), int(m)) for i, b, m in (line.split(",") for line in out.splitlines())]


def sys_mount_options(twin) -> str:
    line = next(line for line in ssh(twin, "cat /proc/self/mountinfo").stdout.splitlines()
                if line.split()[4] == "/sys")
    return line.split()[5]


@pytest.mark.twin
def test_default_twin_sys_is_read_only(twin_factory):
    twin = twin_factory("kpro6")
    assert sys_mount_options(twin).startswith("ro")
    run = ssh(twin, f"echo {GPU0} > {S}/drivers/nvidia/unbind", check=False)
    assert run.returncode != 0 and "Read-only file system" in run.stderr
    assert json.loads((twin.dir / "twin.json").read_text())["live_sysfs"] is False
    assert not (Path(twin.root) / "var/lib/twin/hw/sys/bus/pci/drivers/vfio-pci").exists()


@pytest.mark.twin
def test_live_twin_rebinds_gpus_like_the_kernel(twin_factory):
    twin = twin_factory("kpro6", live_sysfs=True)
    assert sys_mount_options(twin).startswith("rw")
    before = gpus(twin)
    assert [(i, m) for i, _, m in before] == [(i, i) for i in range(8)]
    # an unbind by a driver that does not hold the device fails as in the kernel (ENODEV)
    run = ssh(twin, f"echo {GPU0} > {S}/drivers/snd_hda_intel/unbind", check=False)
    assert run.returncode != 0 and "No such device" in run.stderr
    # a container cannot rebind: its /sys is read-only, the rebind files included (lxc sys:mixed)
    run = ssh(twin, f"pct start 200 && pct exec 200 -- sh -c 'echo {GPU0} > {S}/drivers/nvidia/unbind'", check=False)
    assert run.returncode != 0 and "Read-only file system" in run.stderr, run.stderr

    assert move(twin, GPU0, "nvidia", "vfio-pci") == "vfio-pci"
    assert move(twin, GPU1, "nvidia", "vfio-pci") == "vfio-pci"
    after = gpus(twin)
    assert [b for _, b, _ in after] == [b for _, b, _ in before][2:]
    assert [(i, m) for i, _, m in after] == [(i, i + 2) for i in range(6)]  # minors stay, indices close up
    listing = ssh(twin, "ls /proc/driver/nvidia/gpus /dev/vfio; grep DRIVER "
                        f"{S}/devices/{GPU0}/uevent; cat {S}/devices/{GPU0}/enable; "
                        f"ls {S}/drivers/vfio-pci").stdout
    assert GPU0 not in listing.split("/dev/vfio")[0] and "DRIVER=vfio-pci" in listing
    groups = [n for n in ssh(twin, "ls /dev/vfio").stdout.split() if n != "vfio"]
    assert len(groups) == 2 and GPU0 in listing and GPU1 in listing

    # back to nvidia, the second one first: it takes the lowest free minor (nv.c)
    assert move(twin, GPU1, "vfio-pci", "nvidia") == "nvidia"
    assert move(twin, GPU0, "vfio-pci", "nvidia") == "nvidia"
    back = gpus(twin)
    assert back[:2] == [(0, GPU0, 1), (1, GPU1, 0)]
    info = ssh(twin, f"grep Minor /proc/driver/nvidia/gpus/{GPU1}/information; ls /dev/nvidia0 /dev/nvidia1; "
                     "ls /dev/vfio").stdout
    assert "Device Minor: \t 0" in info and info.split()[-1] == "vfio"  # the groups' nodes are gone
    state = json.loads((Path(twin.root) / "var/lib/twin/hw/state.json").read_text())
    assert state["drivers"][GPU0] == state["drivers"][GPU1] == "nvidia"

    # "none" names no driver: the device stays unbound after a probe (pci_match_device)
    ssh(twin, f"echo none > {S}/devices/{GPU0}/driver_override; echo {GPU0} > {S}/drivers/nvidia/unbind; "
              f"echo {GPU0} > {S}/drivers_probe; ! readlink {S}/devices/{GPU0}/driver")
    assert len(gpus(twin)) == 7

    # the next boot computes everything from the persisted config again (none here: all nvidia)
    ssh(twin, "reboot")
    assert _wait(lambda: _boots(twin) == 2 and not (Path(twin.root) / runtime.REBOOT_REQUEST).exists())
    assert [(i, m) for i, _, m in gpus(twin)] == [(i, i) for i in range(8)]
    assert sys_mount_options(twin).startswith("rw")  # live_sysfs survives the reboot
    assert move(twin, GPU0, "nvidia", "vfio-pci") == "vfio-pci"


@pytest.mark.twin
def test_unbind_delay_and_killed_sshd(twin_factory):
    twin = twin_factory("kpro6", live_sysfs=True)
    assert runtime.main(["fault", twin.name, "--unbind-delay", "1.5"]) == 0
    assert json.loads((Path(twin.root) / "var/lib/twin/faults.json").read_text()) == {"unbind_delay_s": 1.5}
    t0 = time.monotonic()
    ssh(twin, f"echo vfio-pci > {S}/devices/{GPU0}/driver_override; echo {GPU0} > {S}/drivers/nvidia/unbind")
    assert time.monotonic() - t0 >= 1.5

    # a process started detached survives sshd being killed; the SSH session it came from does not;
    # an unbind under way when its writer's session drops still completes, as in the kernel
    # (the detached one rebinds a third GPU after the sessions are gone)
    GPU2 = "0000:41:00.0"
    ssh(twin, "setsid sh -c 'echo $$ > /root/detached.pid; sleep 2; "
              f"echo {GPU2} > {S}/drivers/nvidia/unbind; echo $? > /root/unbind.rc; exec sleep 60' "
              "</dev/null >/root/detached.log 2>&1 &")
    session = subprocess.Popen(runtime.ssh_command(twin.name, [
        f"echo vfio-pci > {S}/devices/{GPU1}/driver_override; echo {GPU1} > {S}/drivers/nvidia/unbind; sleep 60"]),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.7)
    assert runtime.kill_sshd(twin.name)
    assert session.wait(timeout=10) != 0
    runtime.set_fault(twin.name, unbind_delay_s=0)
    t0 = time.monotonic()
    assert _wait(lambda: ssh(twin, "true", check=False, timeout=10).returncode == 0, 5)
    assert time.monotonic() - t0 < 3
    ssh(twin, "kill -0 $(cat /root/detached.pid)")
    assert _wait(lambda: ssh(twin, f"readlink {S}/devices/{GPU1}/driver", check=False).returncode != 0, 5)
    assert _wait(lambda: ssh(twin, "cat /root/unbind.rc", check=False).stdout == "0\n", 5)
    assert [b for _, b, _ in gpus(twin)][:1] == ["0000:61:00.0"]


@pytest.mark.twin
def test_stop_and_reboot_answer_a_slow_unbind(twin_factory):
    twin = twin_factory("kpro6", live_sysfs=True)
    runtime.set_fault(twin.name, unbind_delay_s=60)
    writer = subprocess.Popen(runtime.ssh_command(twin.name, [f"echo {GPU0} > {S}/drivers/nvidia/unbind"]),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(0.7)
    (Path(twin.root) / runtime.REBOOT_REQUEST).touch()
    assert _wait(lambda: _boots(twin) == 2 and not (Path(twin.root) / runtime.REBOOT_REQUEST).exists(), 20)
    writer.wait(timeout=10)
    # the boot computed the binding again: the unbind cut short by the reboot changed nothing
    assert len(gpus(twin)) == 8 and sys_mount_options(twin).startswith("rw")
    writer = subprocess.Popen(runtime.ssh_command(twin.name, [f"echo {GPU0} > {S}/drivers/nvidia/unbind"]),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    time.sleep(0.7)
    t0 = time.monotonic()
    twin_factory.stop(twin)
    assert time.monotonic() - t0 < 8
    assert runtime.leftovers(twin.name) == {"mounts": [], "processes": []}
    writer.wait(timeout=10)


def _boots(twin) -> int:
    try:
        return len((twin.dir / "boots").read_text().splitlines())
    except OSError:
        return 0


def _wait(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


@pytest.mark.twin
def test_the_products_rebind_script_runs_on_a_live_twin(twin_factory):
    """operations.gpus.rebind_script (the detached runner, run here in the foreground) moves a GPU
    and its audio function to vfio-pci and back; with a slow unbind it gives up after its timeout,
    says so in its journal and rolls back (the abandoned unbind still completes in the "kernel")."""
    from operations.gpus import rebind_script
    from plan.gpus import Move, RebindPlan

    twin = twin_factory("kpro6", live_sysfs=True)
    audio = "0000:01:00.1"
    journal = "/root/rebind.journal"

    def runner(plan, **kw) -> tuple[subprocess.CompletedProcess, list[str]]:
        ssh(twin, f"rm -f {journal}")
        script = rebind_script(plan, nvidia, "t", stop_guests=False, journal=journal, **kw)
        run = ssh(twin, f"sh -c {shlex.quote(script)}", check=False)
        return run, [" ".join(line.split()[1:]) for line in ssh(twin, f"cat {journal}").stdout.splitlines()]

    nvidia = {b: {"minor": m} for _, b, m in gpus(twin)}
    there = RebindPlan([Move(GPU0, "nvidia", "vfio-pci"), Move(audio, "snd_hda_intel", "vfio-pci")], [], [], True)
    run, lines = runner(there)
    assert run.returncode == 0 and lines[-3:] == [f"bound {GPU0} vfio-pci", f"bound {audio} vfio-pci", "done"]
    assert ssh(twin, "ls /dev/vfio").stdout.split() == ["12", "vfio"] and len(gpus(twin)) == 7
    back = RebindPlan([Move(GPU0, "vfio-pci", "nvidia"), Move(audio, "vfio-pci", "snd_hda_intel")], [], [], True)
    run, lines = runner(back)
    assert run.returncode == 0 and lines[-1] == "done"
    assert gpus(twin)[0] == (0, GPU0, 0) and ssh(twin, "ls /dev/vfio").stdout.split() == ["vfio"]

    runtime.set_fault(twin.name, unbind_delay_s=3)
    run, lines = runner(there, timeout_s=1)
    assert run.returncode == 1
    assert any(line.startswith("failed ") and "did not finish in 1 s" in line for line in lines), lines
    assert f"bound {GPU0} nvidia" in lines and lines[-1] == "rolledback"
    # the abandoned unbind still completes in the "kernel"
    assert _wait(lambda: ssh(twin, f"readlink {S}/devices/{GPU0}/driver", check=False).returncode != 0, 5)
