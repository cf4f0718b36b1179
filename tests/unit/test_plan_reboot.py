"""plan.reboot: a node's view of its cluster and how many of its nodes may reboot at once (issue 26)."""

from __future__ import annotations

import json

from plan.reboot import member_back, parse_cluster, roll_width

COROSYNC = """\
totem {
  cluster_name: gpu
  version: 2
}

nodelist {
  node {
    name: kpro5
    nodeid: 1
    quorum_votes: 1
    ring0_addr: 10.0.0.5
  }
  node {
    name: kpro6
    nodeid: 2
    quorum_votes: 2
    ring0_addr: 10.0.0.6
  }
  node {
    name: kpro7
    nodeid: 3
    ring0_addr: 10.0.0.7
  }
}
"""


def members(online: dict[str, int], quorate: int = 1, node: str = "kpro6") -> str:
    # pve-cluster src/pmxcfs/status.c: the layout of /etc/pve/.members in a cluster
    return json.dumps({"nodename": node, "version": 5,
                       "cluster": {"name": "gpu", "version": 3, "nodes": len(online), "quorate": quorate},
                       "nodelist": {n: {"id": i + 1, "online": up, "ip": f"10.0.0.{i + 5}"}
                                    for i, (n, up) in enumerate(online.items())}})


def test_a_single_node_has_no_roll():
    view = parse_cluster('{"nodename": "kpro6", "version": 0}\n', None)
    assert view.name is None and roll_width(view, 1) == (0, None) and member_back(view, "kpro6")


def test_votes_come_from_corosync_conf_default_one():
    view = parse_cluster(members({"kpro5": 1, "kpro6": 1, "kpro7": 1}), COROSYNC)
    assert view.votes == {"kpro5": 1, "kpro6": 2, "kpro7": 1}
    assert (view.expected_votes, view.quorum, view.online_votes) == (4, 3, 4)
    # one node at a time at most: the 2-vote node down leaves exactly the quorum
    assert roll_width(view, 3) == (0, "rebooting a node of cluster gpu would leave 2 of 4 votes, and quorum needs 3")


def test_width_is_what_quorum_spares_and_max_parallel_allows():
    five = {f"n{i}": 1 for i in range(5)}
    view = parse_cluster(members(five, node="n0"), None)
    assert (view.expected_votes, view.quorum) == (5, 3)
    assert roll_width(view, 1) == (1, None) and roll_width(view, 4) == (2, None)
    # one node already down: only one more may go
    view = parse_cluster(members(dict(five, n4=0), node="n0"), None)
    assert roll_width(view, 4) == (1, None)


def test_two_nodes_or_no_quorum_reboot_nothing():
    two = parse_cluster(members({"kpro5": 1, "kpro6": 1}), None)
    width, why = roll_width(two, 1)
    assert width == 0 and "leave 1 of 2 votes, and quorum needs 2" in (why or "")
    lost = parse_cluster(members({"kpro5": 0, "kpro6": 1, "kpro7": 0}, quorate=0), None)
    assert roll_width(lost, 1) == (0, "cluster gpu has no quorum now; pvegpu reboots none of its nodes")


def test_a_node_is_back_when_online_and_the_cluster_quorate():
    assert member_back(parse_cluster(members({"kpro5": 1, "kpro6": 1, "kpro7": 0}), None), "kpro6")
    assert not member_back(parse_cluster(members({"kpro5": 1, "kpro6": 0, "kpro7": 1}), None), "kpro6")
    assert not member_back(parse_cluster(members({"kpro5": 0, "kpro6": 1, "kpro7": 0}, quorate=0), None), "kpro6")
    assert parse_cluster("not json", None).name is None


def test_roll_checks_are_the_spec_state_and_what_the_reboot_was_for():
    from plan.reboot import roll_check_lines
    expect = {"nvidia": "595.71.05", "drivers": {"0000:81:00.0": "vfio-pci", "0000:01:00.0": "nvidia"}}
    reasons = [("cmdline", "the booted cmdline lacks amd_iommu=on"), ("nvidia", "595.71.05 not loaded")]
    lines = roll_check_lines(expect, reasons, {"missing": ["amd_iommu=on"], "extra": ["iommu=pt"]}, "6.14.8-2-pve")
    assert lines == ["nvidia 595.71.05", "gpu 0000:01:00.0 nvidia", "gpu 0000:81:00.0 vfio-pci",
                     "kernel 6.14.8-2-pve", "cmdline amd_iommu=on", "nocmdline iommu=pt"]
    # no cmdline reason: the command line is not asked of the node; no NVIDIA in the spec: not its module
    assert roll_check_lines({"nvidia": None, "drivers": {}}, [("gpu-binding", "x")],
                            {"missing": ["amd_iommu=on"], "extra": []}) == []


def test_the_roll_checks_run_through_the_trial_checks_loop_and_name_what_failed(tmp_path):
    """plan.kernel.host_checks_command: the loop TRIAL_CHECKS_COMMAND runs (one copy), over the
    roll's lines; it fails printing each check that does not hold."""
    import subprocess

    from plan.kernel import HOST_CHECKS_LOOP, TRIAL_CHECKS_COMMAND, host_checks_command
    assert HOST_CHECKS_LOOP in TRIAL_CHECKS_COMMAND
    sysfs, proc = tmp_path / "devices", tmp_path / "cmdline"
    (sysfs / "0000:81:00.0").mkdir(parents=True)
    (sysfs / "0000:81:00.0" / "driver").symlink_to("/sys/bus/pci/drivers/vfio-pci")
    (sysfs / "0000:a1:00.0").mkdir(parents=True)
    proc.write_text("BOOT_IMAGE=/vmlinuz root=ZFS=rpool amd_iommu=on pci=realloc\n")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "uname").write_text("#!/bin/sh\necho 6.14.8-2-pve\n")
    (bindir / "uname").chmod(0o755)

    def run(lines):
        command = host_checks_command(lines).replace("/sys/bus/pci/devices", str(sysfs)).replace("/proc/cmdline", str(proc))
        return subprocess.run(["sh", "-c", command], capture_output=True, text=True,
                              env={"PATH": f"{bindir}:/usr/bin:/bin"})

    good = run(["gpu 0000:81:00.0 vfio-pci", "kernel 6.14.8-2-pve", "cmdline amd_iommu=on", "nocmdline iommu=pt"])
    assert good.returncode == 0, good.stdout + good.stderr
    assert run([]).returncode == 0
    bad = run(["gpu 0000:a1:00.0 vfio-pci", "kernel 6.17.1-1-pve", "cmdline pcie_aspm=off", "nocmdline pci=realloc",
               "nvidia 595.71.05"])
    assert bad.returncode != 0
    for said in ("GPU 0000:a1:00.0 is on no driver, not vfio-pci", "the running kernel is 6.14.8-2-pve, not 6.17.1-1-pve",
                 "the booted command line lacks pcie_aspm=off", "the booted command line still has pci=realloc",
                 "nvidia 595.71.05 is not loaded"):
        assert said in bad.stdout, bad.stdout


def _reading(node: str, running: dict[int, list[str]] | None = None, reserved: dict[str, int] | None = None,
             ha: str = "", cts: dict[int, str] | None = None, pve: str | None = None) -> dict:
    """A facts.reboot.parse_node_guests reading built from the command's output: `running`
    {vmid: hostpci values} of VMs running on `node`; `cts` {ctid: devN path} of running CTs."""
    from facts.reboot import parse_node_guests
    pool = "pci: rtx6000\n\tdescription pvegpu-gpu-pool\n" + "".join(
        f"\tmap id=10de:2bb5,node={n},path=0000:{bus}:00\n" for n in ("a", "b", "c") for bus in ("81", "a1"))
    lines = ["@@ qm list", "      VMID NAME                 STATUS     MEM(MB)    BOOTDISK(GB) PID"]
    # an unnamed VM is listed as "VM <id>" (qemu-server vmstatus): two words in the NAME column
    lines += [f"{v:>10} {'VM ' + str(v):<20} running    0                  0.00 100" for v in (running or {})]
    lines += ["@@ pct list", "VMID       Status     Lock         Name"]
    lines += [f"{c:<10} running                 ct{c}" for c in (cts or {})]
    lines += ["@@ reservations", *[f"{i} {v} pid:100" for i, v in (reserved or {}).items()]]
    lines += ["@@ mappings", *pool.splitlines(), "@@ ha", *ha.splitlines(), "@@ members",
              json.dumps({"nodename": node, "cluster": {"name": "c1", "quorate": 1},
                          "nodelist": {n: {"online": 1} for n in "abc"}})]
    lines += ["@@ pve", pve] if pve else []
    for v, hostpci in (running or {}).items():
        lines += [f"@@ qemu /etc/pve/qemu-server/{v}.conf", "machine: q35",
                  *[f"hostpci{i}: {h}" for i, h in enumerate(hostpci)]]
    for c, dev in (cts or {}).items():
        lines += [f"@@ lxc /etc/pve/lxc/{c}.conf", f"dev0: {dev}"]
    return parse_node_guests(lines)


POOLED = ["mapping=rtx6000,pcie=1", "mapping=rtx6000,pcie=1"]


def test_a_pooled_vm_goes_to_the_first_node_with_free_devices_of_its_pool():
    from plan.reboot import free_devices, plan_guest_moves
    mine = _reading("a", {300: POOLED}, {"0000:81:00.0": 300, "0000:a1:00.0": 300})
    # b: one of its two pooled GPUs is held by a running VM; c: both free
    b = _reading("b", {301: ["mapping=rtx6000,pcie=1"]}, {"0000:81:00.0": 301})
    c = _reading("c")
    assert free_devices("b", b) == {"rtx6000": 1} and free_devices("c", c) == {"rtx6000": 2}
    # a reservation of a VM that no longer runs is a leftover: the device is free
    assert free_devices("b", _reading("b", {}, {"0000:81:00.0": 301})) == {"rtx6000": 2}
    assert plan_guest_moves("a", mine, {"b": b, "c": c}) == {"migrate": [(300, "c")], "relocate": [], "stop": [],
                                                            "refusals": []}
    # a GPU container is stopped (no live migration of containers); a VM on a per-node address too
    mine = _reading("a", {300: POOLED, 310: ["0000:c1:00.0,pcie=1"], 320: []}, cts={200: "/dev/nvidia0"})
    assert plan_guest_moves("a", mine, {"b": b, "c": c}) == {
        "migrate": [(300, "c")], "relocate": [], "stop": [("qemu", 310), ("lxc", 200)], "refusals": []}


def test_a_guest_never_moves_to_an_older_release():
    """A mixed cluster during the 8 -> 9 upgrade: from a node on 9 a pooled VM goes to another node
    on 9, never to one still on 8 (migration from newer to older is not supported); from 8, either."""
    from plan.reboot import plan_guest_moves
    assert _reading("a", pve="9.1.1")["pve_major"] == 9 and _reading("a")["pve_major"] is None
    mine = _reading("a", {300: POOLED}, pve="9.1.1")
    b8, c9 = _reading("b", pve="8.4.14"), _reading("c", pve="9.0.3")
    assert plan_guest_moves("a", mine, {"b": b8, "c": c9})["migrate"] == [(300, "c")]
    (why,) = plan_guest_moves("a", mine, {"b": b8})["refusals"]
    assert "on an older Proxmox VE than this node, so not a target: b" in why, why
    on_8 = _reading("a", {300: POOLED}, pve="8.4.14")
    assert plan_guest_moves("a", on_8, {"b": b8})["migrate"] == [(300, "b")]
    assert plan_guest_moves("a", on_8, {"c": c9})["migrate"] == [(300, "c")]


def test_no_node_with_free_devices_refuses_or_stops_as_the_spec_says():
    from plan.reboot import plan_guest_moves
    mine = _reading("a", {300: POOLED})
    b = _reading("b", {301: POOLED}, {"0000:81:00.0": 301, "0000:a1:00.0": 301})
    moves = plan_guest_moves("a", mine, {"b": b}, absent=("c",))
    assert moves["migrate"] == [] and moves["stop"] == []
    (why,) = moves["refusals"]
    assert why.startswith("VM 300 needs 2 of rtx6000 free on another node, and no online node of the run has them "
                          "(b: 0 of rtx6000; not in the run, so not known: c)"), why
    assert "reboot.migrate_fallback: stop" in why
    assert plan_guest_moves("a", mine, {"b": b}, "stop") == {"migrate": [], "relocate": [], "stop": [("qemu", 300)],
                                                            "refusals": []}
    # two VMs, room for one: the second is refused
    two = _reading("a", {300: POOLED, 302: POOLED})
    moves = plan_guest_moves("a", two, {"c": _reading("c")})
    assert moves["migrate"] == [(300, "c")] and len(moves["refusals"]) == 1 and "VM 302" in moves["refusals"][0]


def test_ha_vms_are_relocated_by_ha_and_locked_or_other_ha_guests_refused():
    from plan.reboot import plan_guest_moves
    mine = _reading("a", {300: POOLED}, ha="vm: 300\n\tstate started\n")
    assert plan_guest_moves("a", mine, {"c": _reading("c")}) == {
        "migrate": [], "relocate": [(300, "vm:300", "c")], "stop": [], "refusals": []}
    # no room: refused even with fallback stop (a shutdown of an HA resource only asks HA)
    (why,) = plan_guest_moves("a", mine, {}, "stop")["refusals"]
    assert why.startswith("VM 300 needs 2 of rtx6000 free on another node"), why
    # an HA VM on a per-node address, or one HA is stopping: refused with the fix
    other = _reading("a", {310: ["0000:c1:00.0,pcie=1"]}, ha="vm: 310\n\tstate started\n")
    (why,) = plan_guest_moves("a", other, {"c": _reading("c")}, "stop")["refusals"]
    assert "VM 310 is HA resource vm:310 (requested state started)" in why
    assert "ha-manager crm-command relocate vm:310" in why
    mine["configs"]["qemu"][300]["options"]["lock"] = "backup"
    mine["ha"] = {}
    (why,) = plan_guest_moves("a", mine, {"c": _reading("c")})["refusals"]
    assert why.startswith("VM 300 is locked (backup)")


def test_the_guests_a_boot_leaves_stopped_are_the_running_ones_without_onboot():
    # pve-manager PVE/API2/Nodes.pm startall: only onboot guests, no template, no HA resource
    from plan.reboot import Guest, not_started_at_boot

    guests = {"pct": True, "qemu": {300: "running", 301: "running", 302: "stopped", 303: "running", 304: "running"},
              "lxc": {200: "running", 201: "running"}}
    configs: dict[str, dict[int, dict]] = {
        "qemu": {300: {"options": {"onboot": "1"}}, 301: {"options": {}}, 302: {"options": {}},
                 303: {"options": {"onboot": "1"}}, 304: {"options": {"onboot": "yes", "template": "1"}}},
        "lxc": {200: {"options": {"onboot": "0"}}, 201: {"options": {"onboot": "on"}}}}
    ha = {"vm:303": {"type": "vm", "id": 303, "state": "started", "options": {}}}
    left = not_started_at_boot(guests, configs, ha)
    assert left == [Guest("qemu", 301), Guest("qemu", 304), Guest("lxc", 200)]
    assert [g.label for g in left] == ["VM 301", "VM 304", "CT 200"]
    # an HA resource is HA's to start (even without onboot); one HA ignores is not
    ha = {"vm:301": {"type": "vm", "id": 301, "state": "started", "options": {}},
          "ct:200": {"type": "ct", "id": 200, "state": "ignored", "options": {}}}
    assert not_started_at_boot(guests, configs, ha) == [Guest("qemu", 304), Guest("lxc", 200)]


def test_the_boot_wait_is_bounded_and_only_a_state_still_booting_is_a_problem():
    from plan.reboot import boot_wait_command, boot_wait_problem

    assert boot_wait_command(300) == "timeout 300 systemctl is-system-running --wait || true"
    # systemd's states after its boot transaction (systemctl is-system-running): done, whichever
    for state in ("running", "degraded", "maintenance", "stopping"):
        assert boot_wait_problem([state]) is None
    assert boot_wait_problem(["starting"]) == "systemd says 'starting'"
    assert boot_wait_problem(["initializing"]) == "systemd says 'initializing'"
    assert boot_wait_problem([]) == "no state from systemd"  # timeout killed the wait
