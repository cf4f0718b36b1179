"""plan.guest_control and its facts: the node name, config locks and HA resources, as Proxmox
decides them (pve-common INotify.pm nodename, pve-guest-common AbstractConfig.pm check_lock,
pve-ha-manager Config.pm vm_is_ha_managed)."""

from facts.proxmox import HaResources, NodeName, parse_guest_config, parse_ha_resources
from plan.guest_control import config_lock, ha_resource, node_refusal, stop_checks

# /etc/pve/ha/resources.cfg as pve-ha-manager writes it (PVE/HA/Resources.pm section config:
# "<type>: <name>" then tab-indented "key value" lines; a resource without state is "started")
RESOURCES_CFG = """\
vm: 300
\tgroup gpu-nodes
\tmax_restart 2

ct: 200
\tstate stopped

vm: 301
\tstate ignored

vm: 302
\tstate enabled
"""


def test_node_name_is_the_host_name_without_its_domain():
    assert NodeName().process(["kpro6.lab.example.com"]) == "kpro6"
    assert NodeName().process(["kpro6"]) == "kpro6"
    assert node_refusal("kpro6", "kpro6", "h") is None and node_refusal(None, "kpro6", "h") is None
    refusal = node_refusal("kpro6.lab", "kpro6", "twin-kpro6")
    assert refusal is not None
    assert "the spec says node 'kpro6.lab', but twin-kpro6 is Proxmox node 'kpro6'" in refusal
    assert "Set node: kpro6" in refusal


def test_ha_resources_parsed_with_default_and_alias_states():
    ha = HaResources().process(RESOURCES_CFG.splitlines())
    assert ha["vm:300"] == {"type": "vm", "id": 300, "state": "started",
                            "options": {"group": "gpu-nodes", "max_restart": "2"}}
    assert ha["ct:200"]["state"] == "stopped" and ha["vm:302"]["state"] == "started"
    assert (ha_resource(ha, "qemu", 300) or ("",))[0] == "vm:300"
    assert (ha_resource(ha, "lxc", 200) or ("",))[0] == "ct:200"
    assert ha_resource(ha, "qemu", 301) is None  # ignored: Proxmox treats it as unmanaged
    assert ha_resource(ha, "qemu", 303) is None and parse_ha_resources([]) == {}


def _conf(text, kind):
    return parse_guest_config(text.splitlines(), kind)


def test_stop_checks_refuse_locks_and_ha_started_and_wait_for_ha_stopping():
    ha = parse_ha_resources(RESOURCES_CFG.splitlines())
    lxc = {200: _conf("arch: amd64\n", "lxc"), 201: _conf("lock: backup\narch: amd64\n", "lxc")}
    qemu = {300: _conf("memory: 1024\n", "qemu"), 301: _conf("memory: 1024\n", "qemu"),
            304: _conf("memory: 1\n\n[snap]\nlock: snapshot\n", "qemu")}
    assert config_lock(lxc[201]) == "backup" and config_lock(qemu[304]) is None  # a snapshot's lock is not the VM's
    refusals, wait = stop_checks([("lxc", 200), ("lxc", 201), ("qemu", 300), ("qemu", 301), ("qemu", 304)],
                                 lxc, qemu, ha)
    assert wait == [("lxc", 200, "ct:200")]
    assert len(refusals) == 2
    assert refusals[0].startswith("CT 201 is locked (backup)") and "pct unlock 201" in refusals[0]
    assert refusals[1].startswith("VM 300 must stop for the GPU rebind but is HA resource vm:300 (requested state started)")
    assert "ha-manager set vm:300 --state stopped" in refusals[1] and "ha-manager remove vm:300" in refusals[1]
