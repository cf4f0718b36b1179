"""operations.gpus: stage facts' parsers, the binding rule file, and the rebind operation's
commands. The runner script itself runs for real in tests/unit/operations/test_rebind_runner.py."""

import subprocess
import sys
from pathlib import Path

from facts.rebind import GpuHolders, GuestRuntime, parse_guest_runtime
from operations.gpus import binding_rules, close_rebind_journal, rebind_gpus
from plan.gpus import Bindings, Move, RebindPlan
from plan.rebind import Journal
from tests.twin.hardware import RULE_RE
from tests.unit.operations.fake_node import NODE, FakeNode
from tests.unit.operations.oprun import run_op

# what facts.guest_state.GUEST_STATE_COMMAND prints: this node's CT configs, lxc's running CTs,
# then each VM config's id and state from its pid file
PCT_LIST = """\
200
201
@@ lxc-active
200
"""
QM_LIST = """\
300 running
"""


def test_guest_runtime_parses_guests_and_how_sys_is_mounted():
    out = ["@@ sysfs", "rw,nosuid,nodev,noexec,relatime", "@@ lxc", *PCT_LIST.splitlines(), "@@ qemu",
           *QM_LIST.splitlines()]
    assert parse_guest_runtime(out) == {"sysfs_live": True, "status": {
        "pct": True, "lxc": {200: "running", 201: "stopped"}, "qemu": {300: "running"}}}
    # a read-only /sys (a container; the twin without its kernel model): no live rebind; no pct: not PVE
    assert parse_guest_runtime(["@@ sysfs", "ro,nosuid,nodev,noexec,relatime", "@@ qemu"]) == {
        "sysfs_live": False, "status": {"pct": False, "lxc": {}, "qemu": {}}}
    assert parse_guest_runtime(["@@ sysfs", "@@ qemu"])["sysfs_live"] is False  # no /sys mount at all


def test_guest_runtime_reads_configs_lxc_and_vm_pid_files_in_a_real_shell(tmp_path):
    """Its one command in a real shell on a fake node (tests/unit/operations/fake_node.py): the
    guests are this node's configs, the CTs' state lxc's, the VMs' their pid files with real
    processes (only a live process whose argv[0] ends in kvm and whose -pidfile is that file runs);
    no Proxmox CLI starts (each stub logs its call)."""
    node = FakeNode(tmp_path)
    node.ct(200)
    node.ct(201)
    (node.dir / "active").write_text("200\n")  # lxc's running CTs
    confs, run = node.dir / "pve/nodes" / NODE / "qemu-server", node.dir / "qemu-server"
    for vmid in (300, 301, 302, 303, 304):
        (confs / f"{vmid}.conf").write_text("memory: 2048\n")
    (node.dir / "pve/nodes/other/qemu-server").mkdir(parents=True)
    (node.dir / "pve/nodes/other/qemu-server/400.conf").write_text("")  # another node's VM
    (node.dir / "pve/nodes/other/lxc").mkdir(parents=True)
    (node.dir / "pve/nodes/other/lxc/500.conf").write_text("")  # another node's CT
    sleeper = "import time; time.sleep(60)"

    procs: list[subprocess.Popen] = []

    def spawn(argv0: str, pidfile: Path) -> int:  # a real process whose argv[0] is argv0
        p = subprocess.Popen([argv0, "-c", sleeper, "-id", "x", "-pidfile", str(pidfile)], executable=sys.executable)
        procs.append(p)
        return p.pid

    try:
        (run / "300.pid").write_text(f"{spawn('/usr/bin/kvm', run / '300.pid')}\n")        # running
        (run / "301.pid").write_text(f"{spawn('/usr/bin/kvm', run / 'other.pid')}\n")      # another pid file
        (run / "302.pid").write_text(f"{spawn('/usr/bin/python3', run / '302.pid')}\n")    # not a kvm
        (run / "303.pid").write_text("999999999\n")                                         # no such process
        out = subprocess.run(["sh", "-c", node.rewrite(GuestRuntime.command)], capture_output=True, text=True,
                             env=node.env, check=True)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert node.calls() == []
    runtime = GuestRuntime().process(out.stdout.splitlines())
    assert runtime["status"] == {"pct": True, "lxc": {200: "running", 201: "stopped"},
                                 "qemu": {300: "running", 301: "stopped", 302: "stopped", 303: "stopped",
                                          304: "stopped"}}
    # the options of the /sys mount this process sees, read here without awk
    sys_opts = [line.split()[5] for line in Path("/proc/self/mountinfo").read_text().splitlines()
                if line.split()[4] == "/sys"]
    assert runtime["sysfs_live"] is (bool(sys_opts) and sys_opts[-1].split(",")[0] == "rw")


def test_holders_fact_splits_both_sources_and_quotes_nodes():
    fact = GpuHolders()
    assert "fuser -v /dev/nvidia0 /dev/nvidia2 2>&1" in fact.command(["/dev/nvidia0", "/dev/nvidia2"])
    out = fact.process(["@@ apps", "00000000:81:00.0, 77, nvidia-persistenced", "@@ fuser",
                        "/dev/nvidia0:        root        812 F.... python3"])
    assert out == {"compute_apps": {"0000:81:00.0": ["nvidia-persistenced (pid 77)"]},
                   "fuser": {"/dev/nvidia0": ["python3 (pid 812)"]}}


def test_binding_rules_follow_the_twin_contract_format():
    text = binding_rules(Bindings({"0000:81:00.0": "vfio-pci", "0000:81:00.1": "vfio-pci",
                                   "0000:01:00.0": "nvidia", "0000:e1:00.0": None}))
    rules = [l for l in text.splitlines() if l and not l.startswith("#")]
    assert rules[0] == 'ACTION=="add", SUBSYSTEM=="pci", KERNEL=="0000:01:00.0", ATTR{driver_override}="nvidia"'
    assert {(m["bdf"], m["drv"]) if m else None for m in map(RULE_RE.search, rules)} == {
        ("0000:01:00.0", "nvidia"), ("0000:81:00.0", "vfio-pci"), ("0000:81:00.1", "vfio-pci")}


# ---------------------------------------------------------------- operations: commands out


PLAN = RebindPlan([Move("0000:01:00.0", "nvidia", "vfio-pci"), Move("0000:81:00.0", "vfio-pci", "nvidia")],
                  [("lxc", 200), ("qemu", 300)], [], True)
NVIDIA = {"0000:01:00.0": {"minor": 0}}


def test_rebind_op_is_one_detached_start_or_a_noop():
    commands, _ = run_op(rebind_gpus, PLAN, NVIDIA, shutdown_timeout=45, txid="tx-1", render=None)
    assert len(commands) == 1
    text = str(commands[0])
    assert "qm shutdown 300 --timeout 45 ||" in text  # inside the runner
    assert "setsid flock /run/pvegpu/rebind.lock /bin/sh /var/lib/pvegpu/rebind/run.sh" in text
    assert "systemd-run" not in text
    commands, _ = run_op(rebind_gpus, PLAN, NVIDIA, systemd=True, txid="tx-1", render=None)
    assert "systemd-run --unit pvegpu-rebind --collect --quiet flock /run/pvegpu/rebind.lock" in str(commands[0])
    commands, noop = run_op(rebind_gpus, RebindPlan([], [], [], True), NVIDIA, render=None)
    assert commands == [] and "every GPU is bound" in (noop or "")


def test_carried_guests_are_recorded_in_the_new_journal():
    commands, _ = run_op(rebind_gpus, PLAN, NVIDIA, carried=[("lxc", 201)], txid="tx-1", render=None)
    assert "note stopped lxc 201 carried" in str(commands[0])


def test_with_the_api_guests_shut_down_through_it_before_the_runner(monkeypatch):
    from pyinfra.api import FunctionCommand

    from operations.proxmox import PveApi, api_guest_stop
    from spec.models import ProxmoxApiSpec

    monkeypatch.setenv("PVEGPU_UNIT_TOKEN", "unit-secret-value")
    api = PveApi(ProxmoxApiSpec(host="127.0.0.1", token_name="pvegpu", token_env="PVEGPU_UNIT_TOKEN"), "kpro6")
    commands, _ = run_op(rebind_gpus, PLAN, NVIDIA, api=api, shutdown_timeout=30, render=None)
    assert [type(c).__name__ for c in commands] == ["FunctionCommand", "FunctionCommand", "StringCommand"]
    assert [c.args[1:] for c in commands[:2]] == [("lxc", 200, 30), ("qemu", 300, 30)]
    assert all(c.function is api_guest_stop for c in commands[:2] if isinstance(c, FunctionCommand))
    script = str(commands[2])
    assert " shutdown " not in script and "drivers_probe" in script
    # the runner records them as stopped by pvegpu (a rollback starts them again)
    assert "note stopped lxc 200 api" in script and "note stopped qemu 300 api" in script
    assert "unit-secret-value" not in " ".join(repr(c) for c in commands)


def test_close_journal_only_when_there_is_one():
    commands, noop = run_op(close_rebind_journal, Journal(), False, render=None)
    assert commands == [] and "no rebind journal" in (noop or "")
    commands, _ = run_op(close_rebind_journal, Journal(lines=["t begin x pid=1"]), False, render=None)
    assert "mv /var/lib/pvegpu/rebind/journal /var/lib/pvegpu/rebind/history/" in str(commands[0])
    commands, _ = run_op(close_rebind_journal, Journal(), True, render=None)
    assert len(commands) == 1


def test_guest_runtime_on_the_h200_machine_s_real_mountinfo():
    """Recorded on the device (tests/fixtures/h200-vm-probe/rebind-facts.txt): /sys is a read-write
    sysfs there, and GuestRuntime's awk prints the options of that mount."""
    text = (Path(__file__).resolve().parents[2] / "fixtures/h200-vm-probe/rebind-facts.txt").read_text()
    section = text.split("== GuestRuntime sysfs section\n")[1].split("== ")[0].splitlines()
    assert section == ["@@ sysfs", "rw,relatime"]
    assert parse_guest_runtime(section)["sysfs_live"] is True
    # the same line as the kernel wrote it, through the fact's own awk
    mountinfo = [line for line in text.splitlines() if " /sys " in line and line[0].isdigit()]
    assert mountinfo == ["23 27 0:22 / /sys rw,relatime - sysfs sysfs rw"]
    out = subprocess.run(["awk", '$5 == "/sys" {o = $6} END {print o}'], input="\n".join(mountinfo) + "\n",
                         capture_output=True, text=True, check=True).stdout
    assert out == "rw,relatime\n"
    assert "awk '$5 == \"/sys\" {o = $6} END {print o}' /proc/self/mountinfo" in GuestRuntime.command
