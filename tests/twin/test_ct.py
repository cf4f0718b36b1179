"""LXC containers in a running kpro6 twin: own root, /dev from the config, NVIDIA user space inside.

One twin for the module (tests run in file order and build on each other: CT 200 is configured
first, the installer run inside it later). The last test stops the twin with a CT command still
running and checks nothing is left.
"""
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.twin import installer, runtime

pytestmark = pytest.mark.twin

DRIVER = "595.71.05"  # kpro6's
RUN = f"/opt/nvidia/NVIDIA-Linux-x86_64-{DRIVER}.run"
FLAGS = ("--silent --no-kernel-modules --no-kernel-module-source --no-nouveau-check --no-x-check "
         "--no-systemd --no-dkms --no-distro-scripts")


@pytest.fixture(scope="module")
def twin(twin_root_cache):
    name = f"ct-{os.getpid()}"
    twin = runtime.start(name, "kpro6", owner=os.getpid())
    try:
        yield twin
    finally:
        runtime.stop(name)  # TwinLeak when a mount or process survived (no-op when already stopped)


def sh(twin, cmd, check=True, stdin=None):
    r = subprocess.run(runtime.ssh_command(twin.name, [cmd]), capture_output=True, text=True,
                       timeout=120, input=stdin)
    if check:
        assert r.returncode == 0, (cmd, r.returncode, r.stdout, r.stderr)
    return r


def uuid_of_minor(twin, minor):
    state = json.loads((Path(twin.root) / "var/lib/twin/hw/state.json").read_text())
    return next(g for g in state["gpus"] if g["minor"] == minor)


def listed(twin, *minors):
    return "".join(f"GPU {i}: {uuid_of_minor(twin, m)['name']} (UUID: {uuid_of_minor(twin, m)['uuid']})\n"
                   for i, m in enumerate(minors))


def test_exec_runs_in_the_cts_own_root_with_its_devices(twin):
    sh(twin, "pct set 200 --dev0 /dev/nvidia2,gid=44 --dev1 /dev/nvidia5 --dev2 /dev/nvidiactl && pct start 200")
    assert 'VERSION_CODENAME=bookworm' in sh(twin, "pct exec 200 -- cat /etc/os-release").stdout
    assert sh(twin, "pct exec 200 -- ls -A /usr/local/bin /usr/local/sbin").stdout == \
        "/usr/local/bin:\n\n/usr/local/sbin:\n"  # none of the twin's stand-ins
    assert sh(twin, "pct exec 200 -- hostname").stdout == "llm\n"
    nodes = sh(twin, "pct exec 200 -- sh -c 'cd /dev && stat -c \"%n %t:%T %g %a\" nvidia*'").stdout
    # lxc-pve-prestart-hook: devN nodes are 0660 (no mode=), not the host node's 0666
    assert nodes == "nvidia2 c3:2 44 660\nnvidia5 c3:5 0 660\nnvidiactl c3:ff 0 660\n"
    r = sh(twin, "pct exec 200 -- sh -c 'cat; echo err >&2; exit 3'", check=False, stdin="in\n")
    assert (r.returncode, r.stdout, r.stderr) == (3, "in\n", "err\n")
    sh(twin, "pct exec 200 -- touch /root/made-in-ct")
    sh(twin, "for i in 1 2 3 4 5 6; do pct exec 200 -- sh -c \"echo $i > /tmp/p$i\" & done; wait")
    assert sh(twin, "pct exec 200 -- sh -c 'cat /tmp/p*'").stdout == "1\n2\n3\n4\n5\n6\n"  # parallel execs
    assert not (Path(twin.root) / "root/made-in-ct").exists()
    assert sh(twin, "test -e /root/made-in-ct", check=False).returncode == 1


def test_installer_inside_and_nvidia_smi_sees_exactly_the_cts_gpus(twin):
    assert sh(twin, "pct exec 200 -- nvidia-smi -L", check=False).returncode == 127  # not installed yet
    sh(twin, f"pct push 200 {RUN} /root/NVIDIA.run --perms 0700")
    assert sh(twin, "pct exec 200 -- stat -c %a /root/NVIDIA.run").stdout == "700\n"
    sh(twin, f"pct exec 200 -- sh /root/NVIDIA.run {FLAGS}")
    assert sh(twin, "pct exec 200 -- nvidia-smi -L").stdout == listed(twin, 2, 5)
    assert sh(twin, "nvidia-smi -L | wc -l").stdout == "8\n"  # the host's view is unchanged
    libs = sh(twin, "pct exec 200 -- ls /usr/lib/x86_64-linux-gnu").stdout.split()
    assert [x for x in libs if x.startswith(("libnvidia", "libcuda"))] == [
        "libcuda.so", "libcuda.so.1", f"libcuda.so.{DRIVER}", "libnvidia-ml.so.1", f"libnvidia-ml.so.{DRIVER}"]
    log = sh(twin, "pct exec 200 -- cat /var/log/nvidia-installer.log").stdout
    assert f"(version: {DRIVER}) is now complete." in log
    query = sh(twin, "pct exec 200 -- nvidia-smi --query-gpu=index,minor_number,driver_version "
                     "--format=csv,noheader").stdout
    assert query == f"0, 2, {DRIVER}\n1, 5, {DRIVER}\n"
    # the installer brings the GSP firmware of its version too (in a CT as on the host)
    assert sh(twin, f"pct exec 200 -- ls /lib/firmware/nvidia/{DRIVER}").stdout == "gsp_ga10x.bin\ngsp_tu10x.bin\n"


def test_devices_follow_the_config_at_start_and_files_survive_restart(twin):
    sh(twin, "pct set 200 --dev3 /dev/nvidia6")
    assert sh(twin, "pct exec 200 -- nvidia-smi -L").stdout == listed(twin, 2, 5)  # needs a restart
    sh(twin, "pct exec 200 -- sleep 600 >/dev/null 2>&1 &")
    sh(twin, "pct stop 200")
    for cmd, message in (("exec 200 -- true", "container '200' not running!"),  # pct.pm exec
                         ("push 200 /etc/hostname /root/x", "can only push files to a running CT"),
                         ("pull 200 /etc/hostname /tmp/x", "can only pull files from a running CT")):
        r = sh(twin, f"pct {cmd}", check=False)
        assert r.returncode != 0 and message in r.stderr
    in_ct = "for p in /proc/[0-9]*; do readlink $p/root; done | grep -c /var/lib/twin/ct/200/root"
    assert sh(twin, in_ct, check=False).stdout == "0\n"  # pct stop ended the CT's sleep
    sh(twin, "pct start 200")
    assert sh(twin, "pct exec 200 -- nvidia-smi -L").stdout == listed(twin, 2, 5, 6)
    assert sh(twin, "pct exec 200 -- ls /root").stdout == "NVIDIA.run\nmade-in-ct\n"
    sh(twin, "pct pull 200 /var/log/nvidia-installer.log /tmp/ct-installer.log && grep -q complete /tmp/ct-installer.log")
    sh(twin, "pct set 200 --delete dev3 && pct reboot 200")
    assert sh(twin, "pct exec 200 -- nvidia-smi -L").stdout == listed(twin, 2, 5)


def test_installer_of_another_version_gives_the_nvml_mismatch(twin, tmp_path):
    other = installer.build("570.172.08", tmp_path)
    subprocess.run(runtime.scp_command(twin.name, str(other), "/root/"), check=True, timeout=60)
    sh(twin, f"pct push 200 /root/{other.name} /root/other.run && pct exec 200 -- sh /root/other.run {FLAGS}")
    r = sh(twin, "pct exec 200 -- nvidia-smi -L", check=False)
    assert (r.returncode, r.stdout) == (
        18, "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 570.172\n")
    libs = sh(twin, "pct exec 200 -- sh -c 'ls /usr/lib/x86_64-linux-gnu | grep nvidia-ml'").stdout
    assert libs == "libnvidia-ml.so.1\nlibnvidia-ml.so.570.172.08\n"  # the previous driver's are gone
    sh(twin, f"pct exec 200 -- sh /root/NVIDIA.run {FLAGS}")
    assert sh(twin, "pct exec 200 -- nvidia-smi -L").stdout == listed(twin, 2, 5)


def test_raw_lxc_syntax_of_older_pve(twin):
    conf = Path(twin.root) / "etc/pve/lxc/201.conf"
    conf.write_text(
        "arch: amd64\nhostname: old\nostype: debian\nunprivileged: 1\n"
        "lxc.cgroup2.devices.allow: c 195:3 rwm\n"
        "lxc.cgroup2.devices.allow: c 195:255 rwm\n"
        "lxc.mount.entry: /dev/nvidia3 dev/nvidia3 none bind,optional,create=file\n"
        "lxc.mount.entry: /dev/nvidia4 dev/nvidia4 none bind,optional,create=file\n"  # cgroup denies it
        "lxc.mount.entry: /dev/nvidiactl dev/nvidiactl none bind,optional,create=file\n"
        "lxc.mount.entry: /dev/nvidia-uvm dev/nvidia-uvm none bind,optional,create=file\n")  # absent: optional
    sh(twin, "pct start 201")
    assert sh(twin, "pct exec 201 -- sh -c 'ls /dev | grep nvidia'").stdout == "nvidia3\nnvidiactl\n"
    sh(twin, f"pct push 201 {RUN} /root/NVIDIA.run && pct exec 201 -- sh /root/NVIDIA.run {FLAGS}")
    assert sh(twin, "pct exec 201 -- nvidia-smi -L").stdout == listed(twin, 3)
    r = sh(twin, "pct exec 201 -- sh -c 'rm /dev/nvidiactl && nvidia-smi -L'", check=False)
    assert (r.returncode, r.stdout) == (9, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA "
                                           "driver. Make sure that the latest NVIDIA driver is installed and running.\n\n")
    assert sh(twin, "pct exec 200 -- ls /root").stdout == "NVIDIA.run\nmade-in-ct\nother.run\n"  # 200 untouched
    sh(twin, "pct stop 201")
    conf.write_text(conf.read_text() + "lxc.mount.entry: /dev/nvidia-uvm dev/nvidia-uvm none bind,create=file\n")
    r = sh(twin, "pct start 201", check=False)
    assert r.returncode != 0 and "startup for container '201' failed" in r.stderr


def test_ct_files_survive_a_twin_reboot_and_its_dev_follows_the_boot(twin):
    sh(twin, "pct set 200 --dev3 /dev/nvidia6")  # while running: the next boot's start applies it
    sh(twin, "pct set 200 --onboot 1")  # started at boot (pve-guests.service: onboot guests only)
    boots = Path(runtime.TWINS_DIR / twin.name / "boots")
    before = len(boots.read_text().splitlines())
    sh(twin, "reboot", check=False)
    deadline = time.monotonic() + 60
    while len(boots.read_text().splitlines()) == before:
        assert time.monotonic() < deadline, "the twin did not reboot"
        time.sleep(0.2)
    # sshd answers before the boot's onboot starts are done (as on a real node): wait for them
    assert sh(twin, "systemctl is-system-running --wait").stdout == "running\n"
    assert sh(twin, "pct status 200").stdout == "status: running\n"
    assert sh(twin, "pct exec 200 -- nvidia-smi -L").stdout == listed(twin, 2, 5, 6)
    assert sh(twin, "pct exec 200 -- ls /root").stdout == "NVIDIA.run\nmade-in-ct\nother.run\n"
    assert (runtime.twin_dir(twin.name) / "ct/200/upper/root/other.run").is_file()  # the CT's own files


def test_twin_stop_leaves_nothing_with_a_ct_command_running(twin):
    sh(twin, "pct exec 200 -- sleep 600 >/dev/null 2>&1 &")
    assert sh(twin, "pgrep -c -x -f 'sleep 600'").stdout == "1\n"  # (the CT's init sleeps too)
    runtime.stop(twin.name)  # raises TwinLeak otherwise
    assert runtime.leftovers(twin.name) == {"mounts": [], "processes": []}
    assert not (runtime.TWINS_DIR / twin.name).exists()
