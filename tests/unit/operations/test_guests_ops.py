"""operations.guests: facts in, commands out (fake host), on real config/proc fixtures."""
import base64
import logging
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from facts.guests import ContainerGpuState, VmMappingReferences
from facts.proxmox import parse_guest_config
from operations.guests import (
    container_gpu_devices,
    pci_mappings,
    vm_hostpci,
)
from operations.proxmox import PveApi, api_guest_start, api_guest_stop, api_merge_mapping, api_write
from plan.guests import MappingChange, plan_vm
from spec.models import ProxmoxApiSpec
from tests.unit.operations.oprun import run_op

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


def body(rel):
    return (FIXTURES / rel).read_text().splitlines()[2:]


JELLYFIN = "\n".join(body("lxc-conf/pve9-102-jellyfin-privileged-lxc-mount-entry-nvidia-caps-dir.txt")) + "\n"
IGPU = "\n".join(body("lxc-conf/frigate-7640-intel-igpu-no-nvidia-negative.txt")) + "\n"


def state_output(configs):
    out = []
    for ctid, text in configs.items():
        out += [f"@@ conf:/etc/pve/lxc/{ctid}.conf", *text.splitlines()]
    out += ["@@ nvidia", *body("h200-vm/driver-gpus-information.txt")]
    out += ["@@ majors", *body("h200-vm/proc-devices.txt")]
    return out


def test_container_state_fact_splits_real_outputs():
    state = ContainerGpuState().process(state_output({102: JELLYFIN, 103: IGPU}))
    assert state["configs"][102] == JELLYFIN and state["configs"][103] == IGPU
    assert state["nvidia"]["0000:00:06.0"]["minor"] == 0
    assert state["majors"]["nvidia-uvm"] == 238
    # the run state comes from facts.guest_state (one `pct list` per run), not from this command
    assert "pct" not in ContainerGpuState.command and "status" not in state


def written(command):
    """The content a write_file_command writes, and its path."""
    content = re.search(r"printf %s (\S+) \| base64 -d", command)
    target = re.search(r"&& mv -f -- \S+ (\S+?)(?: \) 9>\S+)?$", command)
    assert content and target, command
    return target.group(1), base64.b64decode(content.group(1)).decode()


def facts_for(configs, status):
    """The op's facts: CT configs and GPUs (`ContainerGpuState`), and `status` as `pct list` shows it."""
    return {"guests.ContainerGpuState": ContainerGpuState().process(state_output(configs)),
            "guest_state.GuestState": {"pct": True, "lxc": status, "qemu": {}}}


def test_ct_gets_its_gpu_by_minor_and_a_running_ct_restarts():
    facts = facts_for({102: JELLYFIN, 103: IGPU}, {102: "running", 103: "running"})
    wanted = {102: {"gpus": ["0000:00:06.0"], "gid": 44}, 103: {"gpus": [], "gid": 44}}
    commands, _ = run_op(container_gpu_devices, wanted, False, facts=facts)
    # 102 passes /dev/nvidia0 already; its whole majors (195, uvm 511, caps 236) become one allow line
    # per node on this host's numbers (uvm 238), uvm-tools and the caps dir go: rewrite, no restart
    assert len(commands) == 1
    path, text = written(commands[0])
    assert path == "/etc/pve/lxc/102.conf"
    assert "lxc.cgroup2.devices.allow: c 238:0 rwm" in text and "c 511:* rwm" not in text and ":* rwm" not in text
    assert "uvm-tools" not in text and "nvidia-caps dev/nvidia-caps" not in text
    assert "mp1: /Data-Pool/partage/streaming,mp=/media/streaming" in text


def test_new_gpu_set_on_a_running_ct_restarts_it_with_dev_entries():
    facts = facts_for({103: IGPU}, {103: "running"})
    commands, _ = run_op(container_gpu_devices, {103: {"gpus": ["0000:00:06.0"], "gid": 44}}, True, facts=facts)
    assert commands[1].startswith("pct shutdown 103 --timeout 120 || {") and commands[1].endswith("pct stop 103; }")
    assert commands[2] == "pct start 103"
    _, text = written(commands[0])
    assert "dev0: /dev/nvidia0,gid=44" in text and "lxc.cgroup2.devices.allow: c 226:0 rwm" in text


def test_converged_containers_are_a_noop():
    facts = facts_for({103: IGPU}, {103: "running"})
    commands, _ = run_op(container_gpu_devices, {103: {"gpus": ["0000:00:06.0"], "gid": 44}}, True, facts=facts)
    _, text = written(commands[0])
    commands, noop = run_op(container_gpu_devices, {103: {"gpus": ["0000:00:06.0"], "gid": 44}}, True,
                            facts=facts_for({103: text}, {103: "running"}))
    assert commands == [] and noop == "every container passes exactly its GPUs"


def test_pending_boot_uses_boot_minors_and_does_not_restart():
    facts = facts_for({103: IGPU}, {103: "running"})
    commands, _ = run_op(container_gpu_devices, {103: {"gpus": ["0000:81:00.0"], "gid": 44}}, True,
                         boot_minors={"0000:01:00.0": 0, "0000:81:00.0": 1}, facts=facts)
    assert len(commands) == 1 and "dev0: /dev/nvidia1,gid=44" in written(commands[0])[1]


def test_ct_stopped_by_the_rebind_is_started_again():
    facts = facts_for({103: IGPU}, {103: "stopped"})
    commands, _ = run_op(container_gpu_devices, {103: {"gpus": ["0000:00:06.0"], "gid": 44}}, True,
                         start_after=[103], facts=facts)
    assert commands[-1] == "pct start 103"


def test_mapping_commands_quote_values():
    change = MappingChange("pvegpu-kpro6-0000-81-00-0", "merge",
                           [{"id": "10de:2bb5", "iommugroup": "40", "node": "kpro6", "path": "0000:81:00"}], "stale", "kpro6")
    commands, _ = run_op(pci_mappings, [change])
    assert len(commands) == 1 and commands[0].startswith("/bin/sh -c ")
    script = shlex.split(commands[0])[2]
    assert "id=pvegpu-kpro6-0000-81-00-0\n" in script and "node=kpro6\n" in script
    assert 'set -- "$@" --map id=10de:2bb5,iommugroup=40,node=kpro6,path=0000:81:00\n' in script
    assert run_op(pci_mappings, [])[1] == "PCI resource mappings match the hardware"


PCI = {"0000:81:00.0": {"vendor": "10de", "device": "2bb5", "iommu_group": 40},
       "0000:a1:00.0": {"vendor": "10de", "device": "2bb5", "iommu_group": 50}}


def test_vm_set_delete_and_start_after_rebind():
    config = parse_guest_config(["machine: q35", "hostpci0: mapping=pvegpu-kpro6-0000-81-00-0,pcie=1",
                                 "hostpci1: mapping=pvegpu-kpro6-0000-a1-00-0,pcie=1"], "qemu")
    plan = plan_vm(300, "kpro6", ["0000:81:00.0"], "q35", False, config, PCI, set(PCI))
    commands, _ = run_op(vm_hostpci, plan, start=True)
    assert commands == ["qm set 300 --delete hostpci1", "qm start 300"]
    plan = plan_vm(300, "kpro6", ["0000:81:00.0", "0000:a1:00.0"], "q35", False, config, PCI, set(PCI))
    commands, noop = run_op(vm_hostpci, plan, restart=True)
    assert commands == [] and noop == "VM 300 passes exactly its GPUs"


def test_stale_mapping_is_deleted_with_pvesh():
    change = MappingChange("pvegpu-kpro6-0000-81-00-0", "delete", [], "stale")
    commands, _ = run_op(pci_mappings, [change])
    assert commands == ["pvesh delete /cluster/mapping/pci/pvegpu-kpro6-0000-81-00-0"]


def test_running_vm_whose_gpus_changed_shuts_down_then_starts():
    config = parse_guest_config(["machine: q35", "hostpci0: mapping=pvegpu-kpro6-0000-81-00-0,pcie=1"], "qemu")
    plan = plan_vm(300, "kpro6", ["0000:81:00.0", "0000:a1:00.0"], "q35", False, config, PCI, set(PCI))
    commands, _ = run_op(vm_hostpci, plan, restart=True, shutdown_timeout=60)
    assert commands[0] == "qm set 300 --hostpci1 mapping=pvegpu-kpro6-0000-a1-00-0,pcie=1"
    assert commands[1].startswith("qm shutdown 300 --timeout 60 || {") and commands[2] == "qm start 300"


def api_for_tests(monkeypatch):
    monkeypatch.setenv("PVEGPU_UNIT_TOKEN", "unit-secret-value")
    return PveApi(ProxmoxApiSpec(host="127.0.0.1", token_name="pvegpu", token_env="PVEGPU_UNIT_TOKEN"), "kpro6")


def test_with_the_api_vm_writes_and_power_actions_are_function_commands(monkeypatch):
    api = api_for_tests(monkeypatch)
    config = parse_guest_config(["machine: q35", "hostpci0: mapping=pvegpu-kpro6-0000-81-00-0,pcie=1",
                                 "hostpci1: mapping=pvegpu-kpro6-0000-a1-00-0,pcie=1"], "qemu")
    plan = plan_vm(300, "kpro6", ["0000:81:00.0"], "q35", False, config, PCI, set(PCI))
    commands, _ = run_op(vm_hostpci, plan, restart=True, node="kpro6", api=api, shutdown_timeout=60, render=None)
    assert [c.function for c in commands] == [api_write, api_guest_stop, api_guest_start]
    write = commands[0].args[1]
    assert (write.method, write.path, write.params) == ("set", "/nodes/kpro6/qemu/300/config", (("delete", "hostpci1"),))
    assert commands[1].args[1:] == ("qemu", 300, 60)
    mapping, _ = run_op(pci_mappings, [MappingChange("pvegpu-x", "merge", [{"id": "10de:2bb5", "node": "kpro6",
                                                                            "path": "0000:81:00"}], "new", "kpro6")],
                        api=api, render=None)
    assert mapping[0].function is api_merge_mapping
    assert mapping[0].args[1:] == ("pvegpu-x", "kpro6", ["id=10de:2bb5,node=kpro6,path=0000:81:00"])
    assert "unit-secret-value" not in " ".join(repr(c) for c in commands + mapping)


def test_with_the_api_a_ct_restart_shuts_down_then_starts_through_it(monkeypatch):
    api = api_for_tests(monkeypatch)
    facts = facts_for({103: IGPU}, {103: "running"})
    commands, _ = run_op(container_gpu_devices, {103: {"gpus": ["0000:00:06.0"], "gid": 44}}, True,
                         api=api, shutdown_timeout=15, facts=facts, render=None)
    assert "/etc/pve/lxc/103.conf" in str(commands[0])  # the config file itself is written over SSH
    assert [c.function for c in commands[1:]] == [api_guest_stop, api_guest_start]
    assert commands[1].args[1:] == ("lxc", 103, 15)


def test_mapping_references_fact_splits_main_and_snapshot_sections():
    out = ["@@ /etc/pve/nodes/kpro6/qemu-server/300.conf", "hostpci0: mapping=pvegpu-kpro6-0000-81-00-0,pcie=1",
           "[before-upgrade]", "hostpci0: mapping=pvegpu-kpro6-0000-a1-00-0,pcie=1",
           "@@ /etc/pve/nodes/pve2/qemu-server/301.conf", "hostpci1: mapping=gpu0",
           "@@ /etc/pve/nodes/pve2/qemu-server/302.conf"]
    assert VmMappingReferences().process(out) == {
        ("kpro6", 300): {"main": ["pvegpu-kpro6-0000-81-00-0"], "sections": ["pvegpu-kpro6-0000-a1-00-0"]},
        ("pve2", 301): {"main": ["gpu0"], "sections": []},
        ("pve2", 302): {"main": [], "sections": []}}


def test_ct_config_is_written_under_the_proxmox_config_lock():
    facts = facts_for({103: IGPU}, {103: "stopped"})
    commands, _ = run_op(container_gpu_devices, {103: {"gpus": ["0000:00:06.0"], "gid": 44}}, True, facts=facts)
    # pve-container PVE/LXC/Config.pm config_file_lock(): the flock pct/the GUI hold for this CT's config
    assert commands[0].startswith("{ [ -d /run/lock/lxc ] || mkdir -m 755 /run/lock/lxc; } && [ ! -L /run/lock/lxc ]")
    assert "; ( flock -w 10 9 ||" in commands[0]
    assert commands[0].endswith(") 9>/run/lock/lxc/pve-config-103.lock")
    assert "is locked (" in commands[0]  # a lock: line appearing before we hold the flock stops the write


@pytest.mark.skipif(os.geteuid() != 0, reason="the lock dir must be root's: run as root")
@pytest.mark.parametrize("plant", ["chown 65534 {d}", "chmod 1777 {d}", "rmdir {d} && mkdir -m 755 {d}.real && ln -s {d}.real {d}"])
def test_a_lock_dir_that_is_not_roots_alone_stops_the_write(tmp_path, plant):
    """Issue 39: Proxmox's lock dir lies in the 1777 /run/lock; a local user who made it first (or a
    symlink there) could have the config lock opened through a planted file: refused, nothing written."""
    from operations import guests
    d = tmp_path / "lock"
    d.mkdir(mode=0o755)
    subprocess.run(["sh", "-c", plant.format(d=d)], check=True)
    conf = tmp_path / "103.conf"
    conf.write_text("arch: amd64\n")
    lock_file = guests.CONFIG_LOCK_FILE["lxc"].format(gid=103)
    command = guests.locked_config_write("lxc", 103, str(conf), "arch: amd64\nmemory: 1\n").replace(
        lock_file.rsplit("/", 1)[0], str(d))
    r = subprocess.run(["sh", "-c", command], capture_output=True, text=True)
    assert r.returncode == 1
    assert "is not root's alone" in r.stderr
    assert conf.read_text() == "arch: amd64\n"


def test_locked_ct_is_neither_written_nor_restarted():
    import pytest
    from pyinfra.api import OperationError

    facts = facts_for({103: "lock: backup\n" + IGPU}, {103: "running"})
    with pytest.raises(OperationError, match=r"CT 103 is locked \(backup\).*pct unlock 103"):
        run_op(container_gpu_devices, {103: {"gpus": ["0000:00:06.0"], "gid": 44}}, True, facts=facts)
    # nothing to change: a lock is no reason to fail
    converged = facts_for({103: "lock: backup\n" + IGPU}, {103: "running"})
    assert run_op(container_gpu_devices, {103: {"gpus": [], "gid": 44}}, True, facts=converged)[0] == []


def test_running_ha_managed_ct_is_not_restarted_through_pct():
    import pytest
    from pyinfra.api import OperationError

    facts = facts_for({103: IGPU}, {103: "running"})
    ha = {"ct:103": {"type": "ct", "id": 103, "state": "started", "options": {}}}
    with pytest.raises(OperationError, match=r"CT 103 needs a restart .* HA resource ct:103.*ha-manager remove ct:103"):
        run_op(container_gpu_devices, {103: {"gpus": ["0000:00:06.0"], "gid": 44}}, True, ha=ha, facts=facts)
    # HA ignores it: pct restarts it as usual
    ignored = {"ct:103": dict(ha["ct:103"], state="ignored")}
    commands, _ = run_op(container_gpu_devices, {103: {"gpus": ["0000:00:06.0"], "gid": 44}}, True, ha=ignored,
                         facts=facts)
    assert commands[2] == "pct start 103"


def test_locked_or_ha_managed_vm_is_refused_at_preflight_only_when_it_would_change():
    from facts.proxmox import parse_guest_config
    from operations.guests import locked_vm_refusals
    from plan.gpus import RebindPlan
    from spec.load import validate_spec

    spec = validate_spec({"hosts": {"kpro6": {"gpus": {"0000:81:00.0": "vm:300"},
                                              "vms": {300: {"gpus": ["0000:81:00.0"]}}}}}, "site.yml")["kpro6"]
    pci = {"0000:81:00.0": {"vendor": "10de", "device": "2bb5", "class": "030200", "iommu_group": 40}}
    converged = "machine: q35\nhostpci0: mapping=pvegpu-kpro6-0000-81-00-0,pcie=1\n"

    def facts(text, running="running", ha=None):
        return {"cfg": {"qemu_configs": {300: parse_guest_config(text.splitlines(), "qemu")}},
                "hw": {"pci_devices": pci}, "node": "kpro6", "ha": ha or {},
                "runtime": {"status": {"qemu": {300: running}}}, "rebind": RebindPlan([], [], [], True)}

    assert locked_vm_refusals(spec, facts("lock: backup\n" + converged)) == []  # nothing to change
    (refusal,) = locked_vm_refusals(spec, facts("lock: backup\nmachine: q35\n"))
    assert refusal.startswith("VM 300 is locked (backup)") and "qm unlock 300" in refusal
    ha = {"vm:300": {"type": "vm", "id": 300, "state": "started", "options": {}}}
    (refusal,) = locked_vm_refusals(spec, facts("machine: q35\n", ha=ha))
    assert "VM 300 needs a restart for its new GPUs but is HA resource vm:300" in refusal
    assert locked_vm_refusals(spec, facts("machine: q35\n", running="stopped", ha=ha)) == []


# ---------------------------------------------------------------- hotplug (pve-container >= 6.0.4, issue 29)

def test_running_ct_gets_added_gpus_hotplugged_not_restarted():
    facts = facts_for({103: IGPU}, {103: "running"})
    commands, _ = run_op(container_gpu_devices, {103: {"gpus": ["0000:00:06.0"], "gid": 44}}, True,
                         hotplug=True, facts=facts)
    assert commands[0].startswith("{\n# pvegpu_dir DIR MODE")  # the backup, its dir root's alone (issue 39)
    assert "if [ -f /etc/pve/lxc/103.conf ]; then pvegpu_dir /var/lib/pvegpu/backup 700 && " in commands[0]
    assert commands[1] == ("pct set 103 --dev0 /dev/nvidia0,gid=44 --dev1 /dev/nvidiactl,gid=44 "
                           "--dev2 /dev/nvidia-uvm,gid=44")
    assert len(commands) == 2 and not any("pct shutdown" in c or "pct start" in c for c in commands)
    # without hotplug (pve-container < 6.0.4) the same change is a file write and a restart
    commands, _ = run_op(container_gpu_devices, {103: {"gpus": ["0000:00:06.0"], "gid": 44}}, True,
                         hotplug=False, facts=facts)
    assert commands[-1] == "pct start 103" and commands[1].startswith("pct shutdown 103")


def test_hotplug_through_the_api_and_not_for_a_stopped_ct():
    api = PveApi(ProxmoxApiSpec(host="127.0.0.1", token_name="pvegpu", token_env="PVEGPU_UNIT_TOKEN"), "kpro6")
    facts = facts_for({103: IGPU}, {103: "running"})
    commands, _ = run_op(container_gpu_devices, {103: {"gpus": ["0000:00:06.0"], "gid": 44}}, True,
                         hotplug=True, api=api, node="kpro6", facts=facts, render=None)
    write = commands[1].args[1]
    assert commands[1].function is api_write and write.method == "set" and write.path == "/nodes/kpro6/lxc/103/config"
    assert write.params[0] == ("dev0", "/dev/nvidia0,gid=44")
    # a stopped CT just gets its file (it starts with the new entries)
    commands, _ = run_op(container_gpu_devices, {103: {"gpus": ["0000:00:06.0"], "gid": 44}}, True,
                         hotplug=True, facts=facts_for({103: IGPU}, {103: "stopped"}))
    assert len(commands) == 1 and written(commands[0])[0] == "/etc/pve/lxc/103.conf"


def test_ha_managed_ct_needs_no_stop_when_its_gpus_are_hotplugged():
    facts = facts_for({103: IGPU}, {103: "running"})
    ha = {"ct:103": {"state": "started"}}
    commands, _ = run_op(container_gpu_devices, {103: {"gpus": ["0000:00:06.0"], "gid": 44}}, True,
                         hotplug=True, ha=ha, facts=facts)
    assert commands[1].startswith("pct set 103 --dev0 /dev/nvidia0,gid=44")


def test_a_cts_extra_devices_reach_its_config_and_narrowing_waits_for_its_next_start(caplog):
    """issue 39 item 7: the spec's extra_devices become exact lines; a running CT whose device set
    only narrows is not restarted (pve-container takes nothing from a running CT), and is told so."""
    facts = facts_for({102: JELLYFIN}, {102: "running"})
    want = {102: {"gpus": ["0000:00:06.0"], "gid": 44, "extra": ["uvm-tools"]}}
    with caplog.at_level(logging.INFO, logger="pyinfra"):
        commands, _ = run_op(container_gpu_devices, want, False, facts=facts)
    _, text = written(commands[0])
    assert "lxc.cgroup2.devices.allow: c 238:1 rwm" in text  # uvm-tools: the uvm major's minor 1
    assert "lxc.mount.entry: /dev/nvidia-uvm-tools dev/nvidia-uvm-tools none bind,optional,create=file" in text
    assert len(commands) == 1 and not any("pct shutdown" in c or "pct start" in c for c in commands)
    assert "CT 102 runs: its device entries change without a GPU change" in caplog.text
