"""operations.gpus: stage facts' parsers, the binding rule file, and the rebind transaction
script run for real (sh) against a scratch sysfs tree with stub pct/qm/fuser/nvidia-smi."""

import os
import subprocess
from pathlib import Path

import pytest
from pyinfra.context import ctx_host, ctx_state
from pyinfra_testing.util import FakeState, create_host

from operations.gpus import (
    GpuHolders,
    GuestRuntime,
    binding_rules,
    parse_guest_runtime,
    rebind_gpus,
    rebind_script,
)
from plan.gpus import Bindings, Move, RebindPlan
from tests.twin.hardware import RULE_RE

PCT_LIST = """\
VMID       Status     Lock         Name
200        running                 gpu-ct
201        stopped                 spare
"""
QM_LIST = """\
      VMID NAME                 STATUS     MEM(MB)    BOOTDISK(GB) PID
       300 gpu-vm               running    65536             64.00 12345
"""


def test_guest_runtime_parses_pct_qm_and_sysfs_type():
    out = ["@@ sysfs", "sysfs", "@@ pct", *PCT_LIST.splitlines(), "@@ qm", *QM_LIST.splitlines()]
    assert parse_guest_runtime(out) == {"sysfs_live": True, "status": {
        "pct": True, "lxc": {200: "running", 201: "stopped"}, "qemu": {300: "running"}}}
    # the twin's /sys is a rendered tree on overlayfs: no live rebind there; no pct: not a PVE node
    assert parse_guest_runtime(["@@ sysfs", "overlayfs", "@@ qm"]) == {
        "sysfs_live": False, "status": {"pct": False, "lxc": {}, "qemu": {}}}


def test_guest_runtime_runs_pct_and_qm_list_in_a_real_shell(tmp_path):
    """Its one command, with stub pct/qm printing PVE's list formats (the run's guest state comes from it)."""
    for tool, listing in (("pct", PCT_LIST), ("qm", QM_LIST)):
        (tmp_path / tool).write_text(f"#!/bin/sh\n[ \"$1\" = list ] && printf %s '{listing}'\n")
        (tmp_path / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    out = subprocess.run(["sh", "-c", GuestRuntime.command], capture_output=True, text=True, env=env, check=True)
    runtime = GuestRuntime().process(out.stdout.splitlines())
    assert runtime["status"] == {"pct": True, "lxc": {200: "running", 201: "stopped"}, "qemu": {300: "running"}}
    assert runtime["sysfs_live"] is (subprocess.run(["stat", "-f", "-c", "%T", "/sys"], capture_output=True,
                                                    text=True).stdout.strip() == "sysfs")


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
    assert {(m["bdf"], m["drv"]) for m in map(RULE_RE.search, rules)} == {
        ("0000:01:00.0", "nvidia"), ("0000:81:00.0", "vfio-pci"), ("0000:81:00.1", "vfio-pci")}


# ---------------------------------------------------------------- the transaction script, run


@pytest.fixture
def scratch(tmp_path):
    """A scratch sysfs (vfio-pci GPU at 81, nvidia GPU at 01 with minor 0) and stub tools."""
    sysfs = tmp_path / "sys"
    for bdf, drv in (("0000:81:00.0", "vfio-pci"), ("0000:01:00.0", "nvidia")):
        dev = sysfs / "bus/pci/devices" / bdf
        dev.mkdir(parents=True)
        (dev / "driver_override").write_text("(null)\n")
        (sysfs / "bus/pci/drivers" / drv).mkdir(parents=True, exist_ok=True)
        (sysfs / "bus/pci/drivers" / drv / "unbind").write_text("")
        os.symlink(f"../../../bus/pci/drivers/{drv}", dev / "driver")
    (sysfs / "bus/pci/drivers_probe").write_text("")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    log = tmp_path / "calls.log"
    stubs = {
        "pct": f'echo "pct $*" >> {log}',
        "qm": f'echo "qm $*" >> {log}',
        "modprobe": f'echo "modprobe $*" >> {log}',
        "nvidia-smi": "true",
        "fuser": "exit 1",
    }
    for name, body in stubs.items():
        (bin_ / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_ / name).chmod(0o755)
    return {"sysfs": sysfs, "bin": bin_, "log": log}


PLAN = RebindPlan([Move("0000:01:00.0", "nvidia", "vfio-pci"), Move("0000:81:00.0", "vfio-pci", "nvidia")],
                  [("lxc", 200), ("qemu", 300)], [], True)
NVIDIA = {"0000:01:00.0": {"minor": 0}}


def run_script(scratch, script):
    env = {**os.environ, "PATH": f"{scratch['bin']}:{os.environ['PATH']}"}
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, env=env, timeout=60)


def _rebind_like_the_kernel(sysfs: Path, bdf: str, drv: str):
    link = sysfs / "bus/pci/devices" / bdf / "driver"
    link.unlink()
    os.symlink(f"../../../bus/pci/drivers/{drv}", link)


def test_transaction_stops_guests_then_writes_override_unbind_probe(scratch):
    script = rebind_script(PLAN, NVIDIA, sysfs=str(scratch["sysfs"]))
    result = run_script(scratch, script)
    # the scratch tree has no kernel behind it: the first verify must fail and say where each GPU is
    assert result.returncode == 1
    assert "0000:01:00.0 is not bound to vfio-pci after the rebind" in result.stderr
    assert "pvegpu: 0000:01:00.0 is bound to nvidia" in result.stderr
    # guests shut down cleanly (the stubs succeed: no hard stop)
    assert scratch["log"].read_text().splitlines() == ["pct shutdown 200 --timeout 120", "qm shutdown 300 --timeout 120",
                                                       "modprobe vfio_pci"]
    dev = scratch["sysfs"] / "bus/pci/devices/0000:01:00.0"
    assert (dev / "driver_override").read_text() == "vfio-pci\n"
    assert (scratch["sysfs"] / "bus/pci/drivers/nvidia/unbind").read_text() == "0000:01:00.0\n"
    assert (scratch["sysfs"] / "bus/pci/drivers_probe").read_text() == "0000:01:00.0\n"
    # nothing more after the failure: the second GPU was not touched
    assert (scratch["sysfs"] / "bus/pci/devices/0000:81:00.0/driver_override").read_text() == "(null)\n"


def test_transaction_succeeds_when_the_kernel_binds(scratch):
    _rebind_like_the_kernel(scratch["sysfs"], "0000:01:00.0", "vfio-pci")
    _rebind_like_the_kernel(scratch["sysfs"], "0000:81:00.0", "nvidia")
    result = run_script(scratch, rebind_script(PLAN, NVIDIA, sysfs=str(scratch["sysfs"])))
    assert result.returncode == 0, result.stderr
    assert "pvegpu: 0000:81:00.0 is bound to nvidia" in result.stderr


def test_guest_that_ignores_shutdown_is_stopped_hard_and_the_log_says_so(scratch):
    (scratch["bin"] / "qm").write_text(f'#!/bin/sh\necho "qm $*" >> {scratch["log"]}\n[ "$1" != shutdown ]\n')
    script = rebind_script(PLAN, NVIDIA, sysfs=str(scratch["sysfs"]), shutdown_timeout=9)
    result = run_script(scratch, script)
    assert scratch["log"].read_text().splitlines()[:4] == [
        "pct shutdown 200 --timeout 9", "qm shutdown 300 --timeout 9", "qm stop 300", "modprobe vfio_pci"]
    assert "pvegpu: VM 300 did not shut down within 9 s; stopping it" in result.stderr


def test_guest_that_cannot_be_stopped_ends_the_transaction(scratch):
    (scratch["bin"] / "qm").write_text(f'#!/bin/sh\necho "qm $*" >> {scratch["log"]}\nexit 1\n')
    result = run_script(scratch, rebind_script(PLAN, NVIDIA, sysfs=str(scratch["sysfs"])))
    assert result.returncode == 1 and "rebind stopped: could not stop qemu 300" in result.stderr
    assert "modprobe" not in scratch["log"].read_text()
    assert (scratch["sysfs"] / "bus/pci/devices/0000:01:00.0/driver_override").read_text() == "(null)\n"


def test_held_gpu_stops_before_any_sysfs_write(scratch):
    (scratch["bin"] / "fuser").write_text(
        "#!/bin/sh\n[ \"$1\" = -s ] && exit 0\n"
        "echo '                     USER        PID ACCESS COMMAND' >&2\n"
        "echo '/dev/nvidia0:        root        812 F.... nvidia-persistenced' >&2\n")
    result = run_script(scratch, rebind_script(PLAN, NVIDIA, sysfs=str(scratch["sysfs"])))
    assert result.returncode == 1
    assert "/dev/nvidia0 is held" in result.stderr and "nvidia-persistenced" in result.stderr
    assert (scratch["sysfs"] / "bus/pci/devices/0000:01:00.0/driver_override").read_text() == "(null)\n"
    assert (scratch["sysfs"] / "bus/pci/drivers/nvidia/unbind").read_text() == ""


def test_hanging_unbind_is_abandoned_after_the_timeout(scratch):
    unbind = scratch["sysfs"] / "bus/pci/drivers/nvidia/unbind"
    unbind.unlink()
    os.mkfifo(unbind)  # a write blocks forever, like an unbind waiting on a holder
    result = run_script(scratch, rebind_script(PLAN, NVIDIA, timeout_s=1, sysfs=str(scratch["sysfs"])))
    assert result.returncode == 1
    assert "did not finish in 1 s" in result.stderr and "pvegpu: 0000:01:00.0 is bound to nvidia" in result.stderr


# ---------------------------------------------------------------- operations: commands out


def _run_op(op, *args, **kwargs):
    host = create_host(FakeState())
    with ctx_state.use(FakeState()), ctx_host.use(host):
        commands = list(op._inner(*args, **kwargs))
    return commands, host.noop_description


def test_rebind_op_is_one_command_or_a_noop():
    commands, _ = _run_op(rebind_gpus, PLAN, NVIDIA, shutdown_timeout=45)
    assert len(commands) == 1 and "qm shutdown 300 --timeout 45 ||" in str(commands[0])
    commands, noop = _run_op(rebind_gpus, RebindPlan([], [], [], True), NVIDIA)
    assert commands == [] and "every GPU is bound" in noop


def test_with_the_api_guests_shut_down_through_it_before_the_script(monkeypatch):
    from pyinfra.api import FunctionCommand

    from operations.proxmox import PveApi, api_guest_stop
    from spec.models import ProxmoxApiSpec

    monkeypatch.setenv("PVEGPU_UNIT_TOKEN", "unit-secret-value")
    api = PveApi(ProxmoxApiSpec(host="127.0.0.1", token_name="pvegpu", token_env="PVEGPU_UNIT_TOKEN"), "kpro6")
    commands, _ = _run_op(rebind_gpus, PLAN, NVIDIA, api=api, shutdown_timeout=30)
    assert [type(c).__name__ for c in commands] == ["FunctionCommand", "FunctionCommand", "StringCommand"]
    assert [c.args[1:] for c in commands[:2]] == [("lxc", 200, 30), ("qemu", 300, 30)]
    assert all(c.function is api_guest_stop for c in commands[:2] if isinstance(c, FunctionCommand))
    script = str(commands[2])
    assert "shutdown" not in script and " stop " not in script and "drivers_probe" in script
    assert "unit-secret-value" not in " ".join(repr(c) for c in commands)


def test_ha_resource_being_stopped_by_ha_is_waited_for_not_shut_down(scratch):
    """plan.guest_control: VM 300 is HA resource vm:300 with requested state stopped: no `qm shutdown`
    (it would only queue another HA request); the script waits until `qm status` says stopped."""
    polls = scratch["bin"] / "polls"
    (scratch["bin"] / "qm").write_text(
        f'#!/bin/sh\necho "qm $*" >> {scratch["log"]}\n'
        f'[ "$1" = status ] || exit 0\necho x >> {polls}\n'
        f'[ $(wc -l < {polls}) -ge 2 ] && echo "status: stopped" || echo "status: running"\n')
    _rebind_like_the_kernel(scratch["sysfs"], "0000:01:00.0", "vfio-pci")
    _rebind_like_the_kernel(scratch["sysfs"], "0000:81:00.0", "nvidia")
    script = rebind_script(PLAN, NVIDIA, sysfs=str(scratch["sysfs"]), ha_wait=[("qemu", 300, "vm:300")])
    result = run_script(scratch, script)
    assert result.returncode == 0, result.stderr
    log = scratch["log"].read_text().splitlines()
    assert log[:3] == ["pct shutdown 200 --timeout 120", "qm status 300", "qm status 300"]
    assert not any(line.startswith("qm shutdown") or line.startswith("qm stop") for line in log)


def test_ha_resource_that_ha_never_stops_ends_the_transaction_naming_it(scratch):
    (scratch["bin"] / "qm").write_text(f'#!/bin/sh\necho "qm $*" >> {scratch["log"]}\necho "status: running"\n')
    script = rebind_script(PLAN, NVIDIA, sysfs=str(scratch["sysfs"]), shutdown_timeout=1,
                           ha_wait=[("qemu", 300, "vm:300")])
    result = run_script(scratch, script)
    assert result.returncode == 1
    assert "VM 300 is still running: HA resource vm:300 did not stop it within 1 s" in result.stderr
    assert "modprobe" not in scratch["log"].read_text()
    assert (scratch["sysfs"] / "bus/pci/devices/0000:01:00.0/driver_override").read_text() == "(null)\n"
