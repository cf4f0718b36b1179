"""plan.guests: CT device lines (both PVE syntaxes) merged into real container configs, VM
mappings and hostpci lines. Merge inputs are real configs from tests/fixtures/lxc-conf/."""

from pathlib import Path

import pytest

from facts.devices import parse_char_majors
from facts.nvidia import parse_gpu_information
from facts.proxmox import parse_guest_config, parse_pci_mappings
from plan.guests import (
    POOL_DESCRIPTION,
    config_gpu_nodes,
    mapping_id,
    mapping_references,
    merge_container_config,
    plan_mappings,
    plan_pool_mappings,
    plan_stale_mappings,
    plan_stale_pools,
    plan_vm,
    pve_supports_dev_entries,
    render_container_devices,
    vm_mappings_after,
)

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def fixture_lines(rel: str) -> list[str]:
    """Output lines of a fixture: without the `# source:`/`# machine:` header (and prompts)."""
    lines = (FIXTURES / rel).read_text().splitlines()[2:]
    return [l for l in lines if not l.startswith("root@")]


def fixture_text(rel: str) -> str:
    return "\n".join(fixture_lines(rel)) + "\n"


H200_MAJORS = parse_char_majors(fixture_lines("h200-vm/proc-devices.txt"))
# The PVE 9 host of the jellyfin/xtts fixtures allowed 195, 511 (uvm) and 236 (caps).
PVE9_MAJORS = {**{n: m for n, m in H200_MAJORS.items() if not n.startswith("nvidia")},
               "nvidia": 195, "nvidiactl": 195, "nvidia-uvm": 511, "nvidia-caps": 236}
KPRO6_MINORS = {"0000:01:00.0": 0, "0000:21:00.0": 1, "0000:41:00.0": 2, "0000:61:00.0": 3}


def test_dev_entries_syntax_follows_the_installed_pve_container():
    from facts.proxmox import parse_dpkg_versions

    assert not pve_supports_dev_entries(None) and not pve_supports_dev_entries({})
    # pve-manager 8.1.3 with a pve-container from before devN (5.0.6): raw lxc.* lines
    assert not pve_supports_dev_entries({"pve-manager": "8.1.3", "pve-container": "5.0.6"})
    assert pve_supports_dev_entries({"pve-manager": "8.0.4", "pve-container": "5.0.7"})
    assert pve_supports_dev_entries({"pve-container": "5.0.12"})  # numbers compare as numbers
    # the versions as PvePackages reads them from dpkg (recorded on the kpro6 twin), and the same
    # package versions in the form a real `pveversion -v` prints them (tests/fixtures/pveversion)
    fixtures = Path(__file__).resolve().parents[1] / "fixtures"
    packages = parse_dpkg_versions((fixtures / "twin-kpro6/pve-packages-dpkg.txt").read_text().splitlines()[2:])
    assert packages["pve-manager"] == "8.4.1" and packages["pve-container"] == "5.2.7"
    assert pve_supports_dev_entries(packages)
    real = (fixtures / "pveversion/pve-8.4.11-verbose-package-versions-ceph-reef.txt").read_text().splitlines()[2:]
    assert "pve-container: 5.3.0" in real
    # dpkg's line for what that host's pveversion -v listed: the same version string
    assert parse_dpkg_versions(["ii  pve-container 5.3.0", "rc  pve-firewall 5.1.0", "iU  qemu-server 8.3.8"]) == {
        "pve-container": "5.3.0"}


def test_dev_entries_pick_minors_by_bdf_not_by_position():
    ct = render_container_devices(200, ["0000:61:00.0", "0000:21:00.0"], KPRO6_MINORS, {}, True, 44)
    assert ct.lines == [
        ("dev0", "/dev/nvidia1,gid=44"),
        ("dev1", "/dev/nvidia3,gid=44"),
        ("dev2", "/dev/nvidiactl,gid=44"),
        ("dev3", "/dev/nvidia-uvm,gid=44"),
    ]
    assert ct.problems == []


def test_dev_entries_only_for_caps_nodes_that_exist():
    # a devN path that does not exist stops `pct start` ("Device ... does not exist")
    mig = ["mig-config", "mig-monitor"]
    none = render_container_devices(200, ["0000:21:00.0"], KPRO6_MINORS, {}, True, 44, caps_present=[], extra=mig)
    assert [v for _, v in none.lines if "caps" in v] == []
    assert len(none.problems) == 2 and "nvidia-cap1 does not exist on the host" in none.problems[0]
    one = render_container_devices(200, ["0000:21:00.0"], KPRO6_MINORS, {}, True, 44,
                                   caps_present=["/dev/nvidia-caps/nvidia-cap1"], extra=mig)
    assert [v for _, v in one.lines if "caps" in v] == ["/dev/nvidia-caps/nvidia-cap1,gid=44"]


def test_minor_from_real_driver_information():
    minors = {b: g["minor"] for b, g in parse_gpu_information(fixture_lines("h200-vm/driver-gpus-information.txt")).items()}
    ct = render_container_devices(129, ["0000:00:06.0"], minors, {}, True, 104)
    assert ct.gpu_nodes == ["/dev/nvidia0"] and ct.lines[0] == ("dev0", "/dev/nvidia0,gid=104")


def test_dev_entries_skip_indices_of_other_devices():
    ct = render_container_devices(200, ["0000:01:00.0"], KPRO6_MINORS, {}, True, 44, used_dev_indices={0, 2})
    assert [k for k, _ in ct.lines] == ["dev1", "dev3", "dev4"]
    assert len(ct.lines) == 3  # one GPU, ctl, uvm


def test_gpu_without_minor_is_a_problem_not_a_guess():
    ct = render_container_devices(200, ["0000:01:00.0", "0000:81:00.0"], KPRO6_MINORS, {}, True, 44)
    assert ct.gpu_nodes == ["/dev/nvidia0"]
    assert ct.problems == ["CT 200: GPU 0000:81:00.0 has no /dev/nvidia minor (not bound to the nvidia driver)"]


def test_old_syntax_uses_majors_from_real_proc_devices():
    ct = render_container_devices(200, ["0000:41:00.0"], KPRO6_MINORS, H200_MAJORS, False, 44)
    assert ct.lines == [
        ("lxc.cgroup2.devices.allow", "c 195:2 rwm"),
        ("lxc.cgroup2.devices.allow", "c 195:255 rwm"),  # nvidiactl
        ("lxc.cgroup2.devices.allow", "c 238:0 rwm"),    # nvidia-uvm on that host
        ("lxc.mount.entry", "/dev/nvidia2 dev/nvidia2 none bind,optional,create=file"),
        ("lxc.mount.entry", "/dev/nvidiactl dev/nvidiactl none bind,optional,create=file"),
        ("lxc.mount.entry", "/dev/nvidia-uvm dev/nvidia-uvm none bind,optional,create=file"),
    ]


def test_old_syntax_without_uvm_loaded_reports_it():
    majors = {"nvidia": 195, "nvidia-caps": 241}
    ct = render_container_devices(200, ["0000:41:00.0"], KPRO6_MINORS, majors, False, 44)
    assert ("lxc.cgroup2.devices.allow", "c 195:2 rwm") in ct.lines
    assert not any("nvidia-uvm" in v for _, v in ct.lines)  # no allow line, no bind it could not open
    assert any("nvidia-uvm is not in /proc/devices" in p for p in ct.problems)


def test_merge_old_syntax_into_real_jellyfin_config_replaces_only_nvidia_lines():
    text = fixture_text("lxc-conf/pve9-102-jellyfin-privileged-lxc-mount-entry-nvidia-caps-dir.txt")
    ct = render_container_devices(102, ["0000:21:00.0"], KPRO6_MINORS, PVE9_MAJORS, False, 44)
    merged = merge_container_config(text, ct.lines, PVE9_MAJORS)
    out = merged.text.splitlines()
    # every non-GPU line, comments (incl. the escaped '#lxc.mount.entry%3A') kept in order
    others = [l for l in text.splitlines() if "nvidia" not in l or l.startswith("#")]
    others = [l for l in others if not l.startswith("lxc.cgroup2.devices.allow")]
    assert [l for l in out if l in others] == others
    assert "#lxc.mount.entry%3A /dev/nvidia-modeset dev/nvidia-modeset none bind,optional,create=file" in out
    # GPU 1 instead of GPU 0; the whole majors, uvm-tools and the caps directory give way to one
    # allow line and one bind per node
    assert merged.removed == ["lxc.cgroup2.devices.allow: c 195:* rwm", "lxc.cgroup2.devices.allow: c 511:* rwm",
                              "lxc.cgroup2.devices.allow: c 236:* rwm",
                              "lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file",
                              "lxc.mount.entry: /dev/nvidia-uvm-tools dev/nvidia-uvm-tools none bind,optional,create=file",
                              "lxc.mount.entry: /dev/nvidia-caps dev/nvidia-caps none bind,optional,create=dir"]
    assert merged.added == ["lxc.cgroup2.devices.allow: c 195:1 rwm", "lxc.cgroup2.devices.allow: c 195:255 rwm",
                            "lxc.cgroup2.devices.allow: c 511:0 rwm",
                            "lxc.mount.entry: /dev/nvidia1 dev/nvidia1 none bind,optional,create=file"]
    # our block sits where the old one was: right after "swap: 0"; the whole majors (c 195:*, the
    # uvm and caps majors) and the /dev/nvidia-caps directory bind gave way to one line per node
    assert out[out.index("swap: 0") + 1] == "lxc.cgroup2.devices.allow: c 195:1 rwm"
    assert "lxc.cgroup2.devices.allow: c 195:* rwm" in merged.removed
    assert config_gpu_nodes(merged.text) == ["/dev/nvidia1"]


def test_merge_is_idempotent_on_its_own_output():
    text = fixture_text("lxc-conf/pve-6006-gpuaas-privileged-nvidia-caps-loop.txt")
    ct = render_container_devices(6006, ["0000:01:00.0", "0000:21:00.0"], KPRO6_MINORS, PVE9_MAJORS, False, 44)
    once = merge_container_config(text, ct.lines, PVE9_MAJORS)
    twice = merge_container_config(once.text, ct.lines, PVE9_MAJORS)
    assert once.changed and not twice.changed and twice.text == once.text


def test_stale_uvm_major_after_reboot_is_replaced_loop_devices_kept():
    # 6006 allowed 235 and 510; now nvidia-uvm is 511, caps 236, and 235/510 are registered by nobody
    text = fixture_text("lxc-conf/pve-6006-gpuaas-privileged-nvidia-caps-loop.txt")
    ct = render_container_devices(6006, ["0000:01:00.0"], KPRO6_MINORS, PVE9_MAJORS, False, 44)
    merged = merge_container_config(text, ct.lines, PVE9_MAJORS)
    out = merged.text.splitlines()
    assert "lxc.cgroup2.devices.allow: c 235:* rwm" not in out
    assert "lxc.cgroup2.devices.allow: c 510:* rwm" not in out
    assert "lxc.cgroup2.devices.allow: c 511:0 rwm" in out  # nvidia-uvm's major now, its minor 0 only
    # not ours: the catch-all, block loop devices, loop-control (10:237, misc is registered)
    for line in ("lxc.cgroup2.devices.allow: a", "lxc.cgroup2.devices.allow: b 7:* rwm",
                 "lxc.cgroup2.devices.allow: c 10:237 rwm",
                 "lxc.mount.entry: /dev/loop7 dev/loop7 none bind,optional,create=file",
                 "lxc.init.cmd: /sbin/init systemd.unified_cgroup_hierarchy=0"):
        assert line in out
    assert out[:2] == ["#try running speedtest first then run the following", "#/var/lib/quickpod/update_scripts.sh"]
    # modeset and the cap1/cap2 file mounts were ours: gone (the spec asks for no MIG caps)
    assert not any("nvidia-modeset" in l or "nvidia-caps" in l or "uvm-tools" in l for l in out)


def test_non_nvidia_config_gets_dev_entries_before_raw_lxc_keys():
    text = fixture_text("lxc-conf/frigate-7640-intel-igpu-no-nvidia-negative.txt")
    ct = render_container_devices(102, ["0000:01:00.0"], KPRO6_MINORS, {}, True, 44)
    merged = merge_container_config(text, ct.lines, PVE9_MAJORS)
    out = merged.text.splitlines()
    assert merged.removed == []
    assert [l for l in out if not l.startswith("dev")] == text.splitlines()  # nothing else moved
    assert out[out.index("unprivileged: 1") + 1] == "dev0: /dev/nvidia0,gid=44"
    assert out.index("dev2: /dev/nvidia-uvm,gid=44") < out.index("lxc.cgroup2.devices.allow: c 226:0 rwm")


def test_switch_to_dev_entries_removes_raw_lines_keeps_coral_and_idmap():
    text = fixture_text("lxc-conf/frigate-8652-2051-unprivileged-2x-nvidia-coral-idmap-fragment.txt")
    ct = render_container_devices(2051, ["0000:01:00.0"], KPRO6_MINORS, {}, True, 44)
    merged = merge_container_config(text, ct.lines, PVE9_MAJORS)
    out = merged.text.splitlines()
    assert not any(l.startswith("lxc.") and "nvidia" in l for l in out)
    assert "lxc.cgroup2.devices.allow: c 195:0 rwm" not in out
    for line in ("lxc.cgroup2.devices.allow: c 120:0 rwm", "lxc.idmap: g 1001 101001 64535",
                 "lxc.mount.entry: /lxc/102010/devices/apex_1 dev/apex_1 none bind,optional,create=file"):
        assert line in out
    assert config_gpu_nodes(merged.text) == ["/dev/nvidia0"]


SNAPSHOT_CONFIG = """\
#GPU box
#dev1%3A /dev/nvidia1,gid=44
arch: amd64
dev0: /dev/nvidia0,gid=44
dev1: /dev/dri/renderD128,gid=104
dev2: /dev/nvidiactl,gid=44
hostname: gpu
parent: before-move
lxc.apparmor.profile: unconfined

[before-move]
arch: amd64
dev0: /dev/nvidia0,gid=44
lxc.cgroup2.devices.allow: c 195:* rwm
snaptime: 1700000000
"""


def test_snapshot_sections_and_disabled_entries_are_left_alone():
    ct = render_container_devices(200, ["0000:21:00.0"], KPRO6_MINORS, {}, True, 44, used_dev_indices={1})
    merged = merge_container_config(SNAPSHOT_CONFIG, ct.lines, {"nvidia": 195})
    head, _, snap = merged.text.partition("[before-move]\n")
    assert snap == SNAPSHOT_CONFIG.partition("[before-move]\n")[2]
    assert head.splitlines()[:4] == ["#GPU box", "#dev1%3A /dev/nvidia1,gid=44", "arch: amd64", "dev0: /dev/nvidia1,gid=44"]
    assert "dev1: /dev/dri/renderD128,gid=104" in head
    assert head.count("/dev/nvidia") == 3 + 1  # our 3 entries + the commented one
    assert head.endswith("lxc.apparmor.profile: unconfined\n\n")
    assert parse_guest_config(merged.text.splitlines(), "lxc")["devices"]["dev3"]["path"] == "/dev/nvidia-uvm"


def test_removing_all_gpus_removes_our_lines_only():
    text = fixture_text("lxc-conf/pve9-116-xtts-unprivileged-raw-lxc-nvidia-allow-a.txt")
    merged = merge_container_config(text, [], PVE9_MAJORS)
    assert not [l for l in merged.text.splitlines() if "nvidia" in l and not l.startswith("tags:")]
    assert "lxc.cgroup2.devices.allow: 511" not in merged.text
    assert "lxc.cgroup2.devices.allow: a" in merged.text and "timezone: America/Toronto" in merged.text


# ---------------------------------------------------------------- VMs

PCI = {
    "0000:81:00.0": {"vendor": "10de", "device": "2bb5", "subsystem_vendor": "10de", "subsystem_device": "204e",
                     "class": "030000", "iommu_group": 40, "driver": "vfio-pci"},
    "0000:81:00.1": {"vendor": "10de", "device": "22e8", "subsystem_vendor": "10de", "subsystem_device": "204e",
                     "class": "040300", "iommu_group": 40, "driver": "vfio-pci"},
    "0000:a1:00.0": {"vendor": "10de", "device": "2bb5", "subsystem_vendor": "10de", "subsystem_device": "204e",
                     "class": "030000", "iommu_group": 50, "driver": "vfio-pci"},
}

PCI_CFG = """\
pvegpu-kpro6-0000-81-00-0
\tmap id=10de:2bb5,iommugroup=12,node=kpro6,path=0000:81:00,subsystem-id=10de:204e
\tmap id=10de:2bb5,iommugroup=7,node=kpro5,path=0000:01:00.0,subsystem-id=10de:204e

pvegpu-kpro6-0000-a1-00-0
\tmap id=10de:2bb5,iommugroup=50,node=kpro6,path=0000:a1:00.0,subsystem-id=10de:204e
"""


def test_mapping_ids_are_proxmox_ids():
    assert mapping_id("KPro6", "0000:81:00.0") == "pvegpu-kpro6-0000-81-00-0"


def test_stale_mapping_is_corrected_current_one_left():
    # the change names only this node's entries: other nodes' are kept as they are when the
    # write runs (operations.guests mapping_commands), not as these facts saw them
    existing = parse_pci_mappings(PCI_CFG.splitlines())
    changes = plan_mappings("kpro6", ["0000:a1:00.0", "0000:81:00.0"], PCI, existing)
    assert len(changes) == 1
    (c,) = changes
    assert (c.id, c.action, c.node) == ("pvegpu-kpro6-0000-81-00-0", "merge", "kpro6")
    assert "iommugroup" in c.reason
    assert c.maps == [
        {"id": "10de:2bb5", "iommugroup": "40", "node": "kpro6", "path": "0000:81:00", "subsystem-id": "10de:204e"},
    ]


def test_missing_mapping_is_created_single_function_by_bdf():
    (c,) = plan_mappings("kpro6", ["0000:a1:00.0"], PCI, {})
    assert c.action == "merge" and c.maps[0]["path"] == "0000:a1:00.0"


def _vm(text):
    return parse_guest_config(text.splitlines(), "qemu")


def test_vm_hostpci_lines_keep_other_devices_and_drop_moved_gpus():
    config = _vm("machine: q35\nhostpci0: 0000:05:00.0,pcie=1\nhostpci1: mapping=pvegpu-kpro6-0000-81-00-0,pcie=1\n"
                 "hostpci2: mapping=pvegpu-kpro6-0000-c1-00-0,pcie=1\nmemory: 65536\n")
    plan = plan_vm(300, "kpro6", ["0000:81:00.0", "0000:a1:00.0"], "q35", False, config, PCI,
                   {"0000:81:00.0", "0000:a1:00.0", "0000:c1:00.0"})
    assert plan.set_options == {"hostpci2": "mapping=pvegpu-kpro6-0000-a1-00-0,pcie=1"}
    assert plan.delete == [] and plan.problems == []
    converged = _vm("machine: q35\nhostpci0: 0000:05:00.0,pcie=1\nhostpci1: mapping=pvegpu-kpro6-0000-81-00-0,pcie=1\n"
                    "hostpci2: mapping=pvegpu-kpro6-0000-a1-00-0,pcie=1\n")
    assert not plan_vm(300, "kpro6", ["0000:81:00.0", "0000:a1:00.0"], "q35", False, converged, PCI, set(PCI)).changed
    shrunk = plan_vm(300, "kpro6", ["0000:81:00.0"], "q35", False, converged, PCI, set(PCI))
    assert shrunk.delete == ["hostpci2"] and shrunk.set_options == {}


def test_vm_with_every_hostpci_line_taken_gets_no_hostpci16():
    config = _vm("machine: q35\n" + "".join(f"hostpci{i}: 0000:{i + 0x10:02x}:00.0\n" for i in range(16)))
    plan = plan_vm(300, "kpro6", ["0000:81:00.0"], "q35", False, config, PCI, {"0000:81:00.0"})
    assert plan.set_options == {} and "no free hostpci line for GPU 0000:81:00.0" in plan.problems[0]


def test_raw_hostpci_of_a_managed_gpu_is_replaced_by_the_mapping():
    config = _vm("machine: pc-q35-8.1\nhostpci0: 0000:81:00,pcie=1,x-vga=1\n")
    plan = plan_vm(300, "kpro6", ["0000:81:00.0"], "q35", False, config, PCI, {"0000:81:00.0"})
    assert plan.set_options == {"hostpci0": "mapping=pvegpu-kpro6-0000-81-00-0,pcie=1"}


@pytest.mark.parametrize("machine_line", ["", "machine: pc-i440fx-8.1\n"])
def test_i440fx_vm_is_reported_or_switched_when_allowed(machine_line):
    config = _vm(machine_line + "memory: 4096\n")
    refused = plan_vm(300, "kpro6", ["0000:81:00.0"], "q35", False, config, PCI, set(PCI))
    assert refused.problems and "needs q35" in refused.problems[0] and "allow_machine_change" in refused.problems[0]
    assert refused.set_options == {"hostpci0": "mapping=pvegpu-kpro6-0000-81-00-0"}  # no pcie=1 on i440fx
    allowed = plan_vm(300, "kpro6", ["0000:81:00.0"], "q35", True, config, PCI, set(PCI))
    assert allowed.problems == []
    assert allowed.set_options == {"machine": "q35", "hostpci0": "mapping=pvegpu-kpro6-0000-81-00-0,pcie=1"}


def test_missing_vm_is_a_problem():
    assert "does not exist" in plan_vm(300, "kpro6", ["0000:81:00.0"], "q35", False, None, PCI, set()).problems[0]


# ---------------------------------------------------------------- stale pvegpu mappings


def _mapping(*entries):
    return {"map": [dict(e) for e in entries], "description": None, "mdev": False, "options": {}}


STALE_EXISTING = {
    "pvegpu-kpro6-0000-81-00-0": _mapping({"id": "10de:2bb5", "node": "kpro6", "path": "0000:81:00"}),
    "pvegpu-kpro6-0000-a1-00-0": _mapping({"id": "10de:2bb5", "node": "kpro6", "path": "0000:a1:00"}),
    "pvegpu-kpro6-0000-c1-00-0": _mapping({"id": "10de:2bb5", "node": "kpro6", "path": "0000:c1:00"}),
    "pvegpu-pve2-0000-01-00-0": _mapping({"id": "10de:2bb5", "node": "pve2", "path": "0000:01:00.0"}),
    "pvegpu-shared": _mapping({"node": "kpro6", "path": "0000:e1:00"}, {"node": "pve2", "path": "0000:e1:00"}),
    "pvegpu-kpro6-empty": _mapping(),
    "gpu0": _mapping({"id": "10de:2bb5", "node": "kpro6", "path": "0000:81:00.0"}),
    "nic0": _mapping({"id": "15b3:1021", "node": "kpro6", "path": "0000:05:00.0"}),
}


def test_only_this_nodes_unused_unreferenced_pvegpu_mappings_are_deleted():
    refs = {"pvegpu-kpro6-0000-a1-00-0": ["a snapshot or pending change of VM 300 on kpro6"]}
    stale = plan_stale_mappings("kpro6", STALE_EXISTING, ["0000:c1:00.0"], refs,
                                {"0000:81:00.0", "0000:c1:00.0", "0000:e1:00.0"})
    assert [(c.id, c.action, c.maps) for c in stale.delete] == [
        ("pvegpu-kpro6-0000-81-00-0", "delete", []), ("pvegpu-kpro6-empty", "delete", [])]
    notes = "\n".join(stale.notes)
    # referenced by a snapshot: kept, and said why
    assert "pvegpu-kpro6-0000-a1-00-0 is not used by a VM of the spec but is referenced by a snapshot" in notes
    # another node's pvegpu mapping: not ours, not mentioned; a shared one: left, said why
    assert "pvegpu-pve2" not in notes and "pvegpu-shared is no longer used on kpro6 but also has entries for pve2" in notes
    # a mapping with another name that points at a spec GPU: reported, never deleted; nic0: silent
    assert "PCI mapping gpu0 (not created by pvegpu) points at GPU(s) 0000:81:00.0" in notes and "nic0" not in notes


def test_candidates_only_skips_the_reference_check():
    refs = {"pvegpu-kpro6-0000-81-00-0": ["VM 300 on kpro6"]}
    assert "pvegpu-kpro6-0000-81-00-0" in [c.id for c in plan_stale_mappings(
        "kpro6", STALE_EXISTING, [], refs, set(), candidates_only=True).delete]
    assert "pvegpu-kpro6-0000-81-00-0" not in [c.id for c in plan_stale_mappings(
        "kpro6", STALE_EXISTING, [], refs, set()).delete]


def test_references_use_this_runs_hostpci_changes_for_our_vms():
    config = parse_guest_config(["machine: q35", "hostpci0: mapping=pvegpu-kpro6-0000-81-00-0,pcie=1",
                                 "hostpci1: mapping=pvegpu-kpro6-0000-a1-00-0,pcie=1",
                                 "hostpci2: 0000:05:00.0"], "qemu")
    pci = {"0000:81:00.0": {"vendor": "10de", "device": "2bb5", "iommu_group": 40},
           "0000:a1:00.0": {"vendor": "10de", "device": "2bb5", "iommu_group": 50}}
    plan = plan_vm(300, "kpro6", ["0000:a1:00.0"], "q35", False, config, pci, set(pci))
    after = vm_mappings_after(config, plan)
    assert after == {"pvegpu-kpro6-0000-a1-00-0"}
    found = {("kpro6", 300): {"main": ["pvegpu-kpro6-0000-81-00-0", "pvegpu-kpro6-0000-a1-00-0"], "sections": []},
             ("pve2", 300): {"main": ["pvegpu-kpro6-0000-81-00-0"], "sections": []},
             ("kpro6", 301): {"main": [], "sections": ["pvegpu-kpro6-0000-c1-00-0"]}}
    refs = mapping_references(found, "kpro6", {300: after})
    assert refs == {"pvegpu-kpro6-0000-a1-00-0": ["VM 300 on kpro6"],
                    "pvegpu-kpro6-0000-81-00-0": ["VM 300 on pve2"],
                    "pvegpu-kpro6-0000-c1-00-0": ["a snapshot or pending change of VM 301 on kpro6"]}


# ---------------------------------------------------------------- Proxmox VE 9 (issue 29)

def test_hotplug_needs_pve_container_6_0_4():
    # pve-container debian/changelog 6.0.4: "implement device hotplug" (add only)
    from plan.guests import pve_hotplugs_dev_entries

    assert pve_hotplugs_dev_entries({"pve-container": "6.0.4"})
    assert pve_hotplugs_dev_entries({"pve-container": "6.1.10"})
    assert not pve_hotplugs_dev_entries({"pve-container": "6.0.3"})
    assert not pve_hotplugs_dev_entries({"pve-container": "5.2.7"})
    assert not pve_hotplugs_dev_entries({}) and not pve_hotplugs_dev_entries(None)


def test_a_gpu_added_to_a_ct_only_adds_dev_entries():
    """Entries the config holds keep their index; the new GPU takes the lowest free one, so the
    change is only added lines, which pve-container >= 6.0.4 hotplugs (an edited devN is not)."""
    from plan.guests import current_dev_entries, hotplug_additions

    one = render_container_devices(200, ["0000:21:00.0"], KPRO6_MINORS, {}, True, 44)
    text = merge_container_config("arch: amd64\nhostname: llm\n", one.lines, {}).text
    two = render_container_devices(200, ["0000:21:00.0", "0000:61:00.0"], KPRO6_MINORS, {}, True, 44,
                                   current=current_dev_entries(text, {195}))
    merged = merge_container_config(text, two.lines, {})
    assert merged.removed == [] and merged.added == ["dev3: /dev/nvidia3,gid=44"]
    assert hotplug_additions(merged) == [("dev3", "/dev/nvidia3,gid=44")]
    # a GPU taken away is a removal: no hotplug (hot-unplug is not supported), a restart applies it
    back = render_container_devices(200, ["0000:21:00.0"], KPRO6_MINORS, {}, True, 44,
                                    current=current_dev_entries(merged.text, {195}))
    assert hotplug_additions(merge_container_config(merged.text, back.lines, {})) is None
    # the old syntax never hotplugs
    old = render_container_devices(200, ["0000:21:00.0"], KPRO6_MINORS, PVE9_MAJORS, False, 44)
    assert hotplug_additions(merge_container_config("arch: amd64\n", old.lines, PVE9_MAJORS)) is None


def test_kept_indices_leave_the_converged_config_unchanged():
    from plan.guests import current_dev_entries

    ct = render_container_devices(200, ["0000:61:00.0", "0000:21:00.0"], KPRO6_MINORS, {}, True, 44)
    text = merge_container_config("arch: amd64\n", ct.lines, {}).text
    again = render_container_devices(200, ["0000:61:00.0", "0000:21:00.0"], KPRO6_MINORS, {}, True, 44,
                                     current=current_dev_entries(text, {195}))
    assert again.lines == ct.lines and not merge_container_config(text, again.lines, {}).changed


LEGACY_CGROUP = """\
arch: amd64
hostname: llm
lxc.cgroup.devices.allow: c 226:* rwm
lxc.cgroup.memory.limit_in_bytes: 8G
lxc.cgroup2.devices.allow: c 10:200 rwm

[snap]
lxc.cgroup.devices.allow: c 4:* rwm
"""


def test_cgroup_v1_keys_are_reported_with_their_fix_and_never_written():
    """pve-container 6.1.6 (src/PVE/LXC/Config.pm is_valid_lxc_conf_key) warns about every raw
    `lxc.cgroup.` key and lxc >= 7.0 ignores it: each is reported with the lxc.cgroup2 form;
    snapshot sections are not the running config."""
    from plan.guests import legacy_cgroup_keys

    found = legacy_cgroup_keys(200, LEGACY_CGROUP)
    assert len(found) == 2
    assert found[0].startswith("CT 200: `lxc.cgroup.devices.allow: c 226:* rwm` is a cgroup v1 key")
    assert found[0].endswith("write it as `lxc.cgroup2.devices.allow: c 226:* rwm`")
    assert "cgroup v2 renames 'memory.limit_in_bytes'" in found[1]
    # our own v1 lines (an NVIDIA major) are replaced, in either syntax, by cgroup2/devN ones
    text = "arch: amd64\nlxc.cgroup.devices.allow: c 195:* rwm\n"
    for dev_entries in (True, False):
        ct = render_container_devices(200, ["0000:21:00.0"], KPRO6_MINORS, PVE9_MAJORS, dev_entries, 44)
        merged = merge_container_config(text, ct.lines, PVE9_MAJORS)
        assert "lxc.cgroup." not in merged.text and legacy_cgroup_keys(200, merged.text) == []


# ---------------------------------------------------------------- GPU pools (issue 26)

POOL_CFG = """\
rtx6000
\tmap id=10de:2bb5,iommugroup=7,node=kpro5,path=0000:01:00.0,subsystem-id=10de:204e
\tmap id=10de:2bb5,iommugroup=40,node=kpro6,path=0000:81:00,subsystem-id=10de:204e
"""


def test_pool_mapping_carries_this_nodes_gpus_only():
    existing = parse_pci_mappings(POOL_CFG.splitlines())
    # kpro6 has its entry already: nothing to write
    assert plan_pool_mappings("kpro6", {"rtx6000": ["0000:81:00.0"]}, PCI, existing) == []
    # a second GPU of kpro6 joins: kpro6's two entries, kpro5's left to kpro5 (merge)
    (c,) = plan_pool_mappings("kpro6", {"rtx6000": ["0000:a1:00.0", "0000:81:00.0"]}, PCI, existing)
    assert (c.id, c.action, c.node) == ("rtx6000", "merge", "kpro6")
    assert [m["path"] for m in c.maps] == ["0000:81:00", "0000:a1:00.0"] and all(m["node"] == "kpro6" for m in c.maps)
    (new,) = plan_pool_mappings("kpro6", {"h200": ["0000:a1:00.0"]}, PCI, existing)
    assert new.id == "h200" and "no mapping yet" in new.reason


def test_pooled_vm_references_the_pool_once_stopped_and_keeps_per_node_lines_while_running():
    config = _vm("machine: q35\nhostpci0: mapping=pvegpu-kpro6-0000-81-00-0,pcie=1\n"
                 "hostpci1: mapping=pvegpu-kpro6-0000-a1-00-0,pcie=1\n")
    gpus = ["0000:81:00.0", "0000:a1:00.0"]
    stopped = plan_vm(300, "kpro6", gpus, "q35", False, config, PCI, set(PCI), pool="rtx6000")
    assert stopped.set_options == {"hostpci0": "mapping=rtx6000,pcie=1", "hostpci1": "mapping=rtx6000,pcie=1"}
    assert not stopped.delete and not stopped.per_node_kept
    running = plan_vm(300, "kpro6", gpus, "q35", False, config, PCI, set(PCI), pool="rtx6000", running=True)
    assert not running.changed and running.per_node_kept and "once it is stopped" in running.notes[0]
    # already on the pool: nothing to do, running or not; a GPU less drops its line
    pooled = _vm("machine: q35\nhostpci0: mapping=rtx6000,pcie=1\nhostpci1: mapping=rtx6000,pcie=1\n")
    assert not plan_vm(300, "kpro6", gpus, "q35", False, pooled, PCI, set(PCI), pool="rtx6000", running=True).changed
    fewer = plan_vm(300, "kpro6", gpus[:1], "q35", False, pooled, PCI, set(PCI), pool="rtx6000")
    assert fewer.delete == ["hostpci1"] and not fewer.set_options


def test_the_specs_pools_are_not_reported_as_foreign_mappings():
    existing = parse_pci_mappings(POOL_CFG.splitlines())
    assert plan_stale_mappings("kpro6", existing, [], {}, {"0000:81:00.0"}).notes  # without the pool: reported
    stale = plan_stale_mappings("kpro6", existing, [], {}, {"0000:81:00.0"}, pools={"rtx6000"})
    assert stale.notes == [] and stale.delete == []


def test_a_pool_pvegpu_made_that_left_the_spec_loses_this_nodes_entries_only():
    text = POOL_CFG.replace("rtx6000\n", f"rtx6000\n\tdescription {POOL_DESCRIPTION}\n") + \
        "other\n\tmap id=10de:2bb5,iommugroup=50,node=kpro6,path=0000:a1:00.0,subsystem-id=10de:204e\n"
    existing = parse_pci_mappings(text.splitlines())
    (c,) = plan_stale_pools("kpro6", set(), existing)  # a mapping without pvegpu's description is not ours
    assert (c.id, c.action, c.maps, c.node) == ("rtx6000", "merge", [], "kpro6")
    assert plan_stale_pools("kpro6", {"rtx6000"}, existing) == []  # still a pool of the spec
    assert plan_stale_pools("kpro7", set(), existing) == []  # kpro7 has no entry in it
    (created,) = plan_pool_mappings("kpro6", {"h200": ["0000:a1:00.0"]}, PCI, existing)
    assert created.description == POOL_DESCRIPTION
    # and it is not reported as someone else's mapping
    assert plan_stale_mappings("kpro6", existing, [], {}, {"0000:81:00.0"}).notes == []


def test_a_vm_that_leaves_a_pool_gets_per_node_lines_in_place_of_the_pools():
    pooled = _vm("machine: q35\nhostpci0: mapping=rtx6000,pcie=1\nhostpci1: mapping=rtx6000,pcie=1\n"
                 "hostpci2: mapping=nic,pcie=1\n")
    gpus = ["0000:81:00.0", "0000:a1:00.0"]
    plan = plan_vm(300, "kpro6", gpus, "q35", False, pooled, PCI, set(PCI), pools={"rtx6000"})
    assert plan.set_options == {"hostpci0": "mapping=pvegpu-kpro6-0000-81-00-0,pcie=1",
                                "hostpci1": "mapping=pvegpu-kpro6-0000-a1-00-0,pcie=1"}
    assert plan.delete == []  # hostpci2 (someone else's mapping) is kept
    # without knowing rtx6000 is a pool, its lines would stay beside new ones (the bug this guards)
    unknown = plan_vm(300, "kpro6", gpus, "q35", False, pooled, PCI, set(PCI))
    assert set(unknown.set_options) == {"hostpci3", "hostpci4"}


# ---------------------------------------------------------------- a CT's device list (issue 39, item 7)


def test_a_cts_device_list_is_exactly_its_gpus_ctl_and_uvm():
    """Each CT gets its GPUs' /dev/nvidiaN, /dev/nvidiactl and /dev/nvidia-uvm: no uvm-tools, no
    MIG config/monitor caps unless its spec asks (libnvidia-container gives MIG caps only on request)."""
    from plan.guests import config_device_nodes

    ct = render_container_devices(200, ["0000:61:00.0", "0000:21:00.0"], KPRO6_MINORS, {}, True, 44)
    text = merge_container_config("arch: amd64\n", ct.lines, {}).text
    assert config_device_nodes(text) == ["/dev/nvidia-uvm", "/dev/nvidia1", "/dev/nvidia3", "/dev/nvidiactl"]
    assert "uvm-tools" not in text and "nvidia-caps" not in text


def test_a_cts_device_list_with_the_extra_nodes_it_asks_for():
    both = ["/dev/nvidia-caps/nvidia-cap1", "/dev/nvidia-caps/nvidia-cap2"]
    ct = render_container_devices(200, ["0000:21:00.0"], KPRO6_MINORS, {}, True, 44, caps_present=both,
                                  extra=["mig-monitor", "uvm-tools"])
    assert [v for _, v in ct.lines] == ["/dev/nvidia1,gid=44", "/dev/nvidiactl,gid=44", "/dev/nvidia-uvm,gid=44",
                                        "/dev/nvidia-uvm-tools,gid=44", "/dev/nvidia-caps/nvidia-cap2,gid=44"]
    assert ct.problems == []
    # raw syntax: the exact numbers of each (uvm-tools is the uvm major's minor 1, mig/monitor caps minor 2)
    raw = render_container_devices(200, ["0000:21:00.0"], KPRO6_MINORS, PVE9_MAJORS, False, 44,
                                   extra=["uvm-tools", "mig-config", "mig-monitor"])
    assert [v for k, v in raw.lines if k == "lxc.cgroup2.devices.allow"] == [
        "c 195:1 rwm", "c 195:255 rwm", "c 511:0 rwm", "c 511:1 rwm", "c 236:1 rwm", "c 236:2 rwm"]
    assert ("lxc.mount.entry", "/dev/nvidia-caps/nvidia-cap1 dev/nvidia-caps/nvidia-cap1 none bind,optional,create=file") \
        in raw.lines
    # an unprivileged CT gets no MIG management caps (NVIDIA's runtime hook refuses them there too)
    unpriv = render_container_devices(200, ["0000:21:00.0"], KPRO6_MINORS, {}, True, 44, caps_present=both,
                                      extra=["mig-config", "uvm-tools"], unprivileged=True)
    assert [v for _, v in unpriv.lines][-1] == "/dev/nvidia-uvm-tools,gid=44"
    assert not any("caps" in v for _, v in unpriv.lines)
    assert unpriv.problems and "unprivileged" in unpriv.problems[0]


def test_a_cts_device_list_raw_syntax_allows_each_node_not_whole_majors():
    """Raw lxc syntax: one `c 195:N rwm` per GPU minor, nvidiactl's 195:255, the uvm major's minor 0;
    no `c 195:* rwm`, no whole uvm or caps major, no bind of the whole /dev/nvidia-caps."""
    from plan.guests import config_device_allows, config_device_nodes, nvidia_majors

    ct = render_container_devices(6006, ["0000:01:00.0", "0000:61:00.0"], KPRO6_MINORS, PVE9_MAJORS, False, 44)
    text = merge_container_config(fixture_text("lxc-conf/pve-6006-gpuaas-privileged-nvidia-caps-loop.txt"),
                                  ct.lines, PVE9_MAJORS).text
    assert config_device_allows(text, nvidia_majors(PVE9_MAJORS)) == [
        "c 195:0 rwm", "c 195:3 rwm", "c 195:255 rwm", "c 511:0 rwm"]
    assert config_device_nodes(text) == ["/dev/nvidia-uvm", "/dev/nvidia0", "/dev/nvidia3", "/dev/nvidiactl"]
    assert not any(l.endswith(":* rwm") and (" 195:" in l or " 511:" in l or " 236:" in l) for l in text.splitlines())
    assert "dev/nvidia-caps none" not in text


def test_a_cts_old_broad_lines_are_replaced_once_then_no_change():
    """A real config with the old broad lines (whole majors, uvm-tools, the caps directory): the
    converge replaces them; a second converge changes nothing."""
    text = fixture_text("lxc-conf/pve9-102-jellyfin-privileged-lxc-mount-entry-nvidia-caps-dir.txt")
    for dev_entries in (False, True):
        ct = render_container_devices(102, ["0000:01:00.0"], KPRO6_MINORS, PVE9_MAJORS, dev_entries, 44)
        once = merge_container_config(text, ct.lines, PVE9_MAJORS)
        assert once.changed
        assert not any(s in once.text for s in (":* rwm", "uvm-tools", "nvidia-caps dev/nvidia-caps"))
        assert not merge_container_config(once.text, ct.lines, PVE9_MAJORS).changed
