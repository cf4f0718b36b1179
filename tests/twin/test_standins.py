"""The twin's stand-in programs, run against a tmp root through TWIN_ROOT (no chroot, no sshd)."""
import json
import os
import stat
import subprocess
import time

import pytest
from proxmoxer import ProxmoxAPI

from tests.twin import hardware


@pytest.fixture
def root(kpro6_tmp_root):
    """A fresh kpro6 root per test (tests/twin/fixtures.py)."""
    return kpro6_tmp_root


def run(root, prog, *args, check=False):
    env = dict(os.environ, TWIN_ROOT=str(root))
    for d in ("usr/local/sbin", "usr/local/bin"):
        if (root / d / prog).exists():
            r = subprocess.run([str(root / d / prog), *args], env=env, capture_output=True, text=True)
            if check:
                assert r.returncode == 0, r.stderr
            return r
    raise FileNotFoundError(prog)


def guests_log(root):
    p = root / "var/lib/twin/guests.log"
    return [line.split(" ", 1)[1] for line in p.read_text().splitlines()] if p.exists() else []


def write_ct(root, vmid, text):
    (root / f"etc/pve/lxc/{vmid}.conf").write_text(text)


# ---------------------------------------------------------------- pct

def test_pct_start_refuses_missing_device_path(root):
    run(root, "pct", "set", "200", "--dev0", "/dev/nvidia0,gid=44", "--dev1", "/dev/nvidia-uvm", check=True)
    r = run(root, "pct", "start", "200")
    assert r.returncode != 0 and "Device /dev/nvidia0 does not exist" in r.stderr
    assert run(root, "pct", "status", "200").stdout == "status: stopped\n"
    assert guests_log(root) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
def test_pct_start_with_device_nodes_present(root):
    for path, minor in (("dev/nvidia0", 0), ("dev/nvidia-uvm", 0)):
        (root / path).parent.mkdir(exist_ok=True)
        os.mknod(root / path, 0o666 | stat.S_IFCHR, os.makedev(195 if "uvm" not in path else 511, minor))
    run(root, "pct", "set", "200", "--dev0", "/dev/nvidia0,gid=44", "--dev1", "/dev/nvidia-uvm,mode=0666", check=True)
    run(root, "pct", "start", "200", check=True)
    assert run(root, "pct", "status", "200").stdout == "status: running\n"
    # lxc-pve-prestart-hook: 0660 unless mode= (not the host node's 0666); owner mapped by the
    # unprivileged CT's default idmap on the host, the CT's own ids inside
    devices = {d["path"]: d for d in json.loads((root / "var/lib/twin/ct/200/devices.json").read_text())["devices"]}
    assert (devices["/dev/nvidia0"]["mode"], devices["/dev/nvidia0"]["gid"]) == (0o660, 44)
    assert (devices["/dev/nvidia0"]["host_uid"], devices["/dev/nvidia0"]["host_gid"]) == (100000, 100044)
    assert devices["/dev/nvidia-uvm"]["mode"] == 0o666
    run(root, "pct", "reboot", "200", check=True)
    run(root, "pct", "stop", "200", check=True)
    assert guests_log(root) == ["start lxc 200", "reboot lxc 200", "stop lxc 200"]


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
@pytest.mark.parametrize("pve_container,hotplugged", [("5.2.7", False), ("6.0.4", True)])
def test_pct_set_dev_on_a_running_ct_hotplugs_from_6_0_4_else_pends(root, pve_container, hotplugged):
    """pve-container update_pct_config + vmconfig_hotplug_pending: a new devN on a running CT is
    hotplugged from 6.0.4 on; before, and for an index the config holds, it waits in [pve:pending]
    until the CT stops or starts (vm_start / the poststop hook apply it)."""
    profile = json.loads((root / "var/lib/twin/profile.json").read_text())
    profile["pve"]["packages"]["pve-container"] = pve_container
    (root / "var/lib/twin/profile.json").write_text(json.dumps(profile))
    (root / "dev").mkdir(exist_ok=True)
    for name, minor in (("nvidia0", 0), ("nvidia1", 1)):
        os.mknod(root / "dev" / name, 0o666 | stat.S_IFCHR, os.makedev(195, minor))
    run(root, "pct", "set", "200", "--dev0", "/dev/nvidia0,gid=44", check=True)
    run(root, "pct", "start", "200", check=True)
    r = run(root, "pct", "set", "200", "--dev1", "/dev/nvidia2,gid=44")  # no such node: refused while it runs
    assert r.returncode != 0 and "Device /dev/nvidia2 does not exist" in r.stderr
    run(root, "pct", "set", "200", "--dev1", "/dev/nvidia1,gid=44", "--dev0", "/dev/nvidia1", check=True)
    conf = (root / "etc/pve/lxc/200.conf").read_text()
    devices = [d["path"] for d in json.loads((root / "var/lib/twin/ct/200/devices.json").read_text())["devices"]]
    main, _, pending = conf.partition("[pve:pending]\n")
    assert "dev0: /dev/nvidia0,gid=44" in main and "dev0: /dev/nvidia1\n" in pending  # an existing devN: never hot
    if hotplugged:
        assert "dev1: /dev/nvidia1,gid=44" in main and devices == ["/dev/nvidia0", "/dev/nvidia1"]
    else:
        assert "dev1: /dev/nvidia1,gid=44" in pending and devices == ["/dev/nvidia0"]
    run(root, "pct", "stop", "200", check=True)
    conf = (root / "etc/pve/lxc/200.conf").read_text()
    assert "[pve:pending]" not in conf and "dev0: /dev/nvidia1\n" in conf and "dev1: /dev/nvidia1,gid=44" in conf


def test_pct_start_refuses_a_regular_file_as_device(root):
    (root / "dev").mkdir(exist_ok=True)
    (root / "dev/nvidia0").write_text("")
    run(root, "pct", "set", "200", "--dev0", "/dev/nvidia0", check=True)
    r = run(root, "pct", "start", "200")
    assert r.returncode != 0 and "Path /dev/nvidia0 is not a device" in r.stderr


def test_raw_lxc_keys_refused_through_pct_and_api(root):
    r = run(root, "pct", "set", "200", "--lxc.cgroup2.devices.allow", "c 195:* rwm")
    assert r.returncode != 0 and "Unknown option: lxc.cgroup2.devices.allow" in r.stderr
    r = run(root, "pvesh", "set", "/nodes/kpro6/lxc/200/config", "--lxc.mount.entry", "/dev/nvidia0 dev/nvidia0 none bind",
            "--output-format", "json")
    assert r.returncode != 0
    assert r.stderr.startswith("400 Parameter verification failed.\nlxc.mount.entry: property is not defined")
    assert "lxc." not in (root / "etc/pve/lxc/200.conf").read_text()


def test_pct_set_keeps_comments_raw_keys_and_snapshots(root):
    write_ct(root, 201, "#GPU container\narch: amd64\nhostname: a\nlxc.cgroup2.devices.allow: c 195:* rwm\n"
                        "memory: 512\n\n[snap1]\narch: amd64\nhostname: a\nsnaptime: 1700000000\n")
    run(root, "pct", "set", "201", "--dev0", "/dev/nvidia0,gid=44", "--delete", "memory", check=True)
    assert (root / "etc/pve/lxc/201.conf").read_text() == (
        "#GPU container\narch: amd64\ndev0: /dev/nvidia0,gid=44\nhostname: a\n"
        "lxc.cgroup2.devices.allow: c 195:* rwm\n\n[snap1]\narch: amd64\nhostname: a\nsnaptime: 1700000000\n")
    cfg = json.loads(run(root, "pvesh", "get", "/nodes/kpro6/lxc/201/config", "--output-format", "json").stdout)
    assert cfg["dev0"] == "/dev/nvidia0,gid=44" and cfg["lxc"] == [["lxc.cgroup2.devices.allow", "c 195:* rwm"]]
    assert cfg["description"] == "GPU container\n" and "memory" not in cfg


def test_pct_exec_refuses_a_stopped_ct(root):
    """(Running CTs: tests/twin/test_ct.py runs commands in their own roots.)"""
    r = run(root, "pct", "exec", "200", "--", "true")
    # pve-container src/PVE/CLI/pct.pm exec
    assert r.returncode != 0 and "container '200' not running!" in r.stderr


def test_qm_and_pct_list_print_what_proxmox_prints(root):
    conf = root / "etc/pve/qemu-server/300.conf"
    conf.write_text("".join(line for line in conf.read_text().splitlines(True) if not line.startswith("name:")))
    qm = run(root, "qm", "list", check=True).stdout.splitlines()
    assert qm[0].split() == ["VMID", "NAME", "STATUS", "MEM(MB)", "BOOTDISK(GB)", "PID"]
    assert qm[1].split()[:4] == ["300", "VM", "300", "stopped"]  # unnamed: "VM <vmid>"
    pct = run(root, "pct", "list", check=True).stdout.splitlines()
    assert pct[0].split() == ["VMID", "Status", "Lock", "Name"]
    # lxc's own view of the same CTs (what facts.guest_state reads instead of pct list)
    assert run(root, "lxc-ls", "-1").stdout.split() == ["200"] and run(root, "lxc-ls", "--active", "-1").stdout == ""


# ---------------------------------------------------------------- PCI mappings + qm

def gpu_map(bdf="0000:01:00.0", group=12, node="kpro6"):
    return f"node={node},path={bdf},id=10de:2bb5,subsystem-id=10de:204e,iommugroup={group}"


def test_pvesh_mapping_round_trip_and_vm_start(root):
    run(root, "pvesh", "create", "/cluster/mapping/pci", "--id", "gpu0", "--map", gpu_map(),
        "--description", "first GPU", check=True)
    listed = json.loads(run(root, "pvesh", "get", "/cluster/mapping/pci", "--output-format", "json").stdout)
    assert listed == [{"id": "gpu0", "map": [gpu_map()], "description": "first GPU"}]
    assert (root / "etc/pve/mapping/pci.cfg").read_text() == (
        f"gpu0\n\tdescription first GPU\n\tmap {gpu_map()}\n\n")
    r = run(root, "pvesh", "create", "/cluster/mapping/pci", "--id", "gpu0", "--map", gpu_map())
    assert r.returncode != 0 and "already defined" in r.stderr
    run(root, "qm", "set", "300", "--hostpci0", "mapping=gpu0,pcie=1", check=True)
    run(root, "qm", "start", "300", check=True)
    run(root, "qm", "stop", "300", check=True)
    assert guests_log(root) == ["start qemu 300", "stop qemu 300"]
    # the hardware changed under the mapping: wrong IOMMU group, then wrong path
    run(root, "pvesh", "set", "/cluster/mapping/pci/gpu0", "--map", gpu_map(group=99), check=True)
    r = run(root, "qm", "start", "300")
    assert r.returncode != 0 and r.stderr == (
        "PCI device mapping invalid (hardware probably changed): 'iommugroup' does not match for 'gpu0' (12 != 99)\n")
    run(root, "pvesh", "set", "/cluster/mapping/pci/gpu0", "--map", gpu_map(bdf="0000:02:00.0", group=12), check=True)
    r = run(root, "qm", "start", "300")
    assert r.returncode != 0 and "'id' does not match for 'gpu0'" in r.stderr
    run(root, "pvesh", "delete", "/cluster/mapping/pci/gpu0", check=True)
    assert json.loads(run(root, "pvesh", "get", "/cluster/mapping/pci", "--output-format", "json").stdout) == []


def test_every_mapping_entry_of_the_node_is_checked_and_qm_set_takes_a_missing_mapping(root):
    # qemu-server PVE/API2/Qemu.pm update_vm: no existence check for root; PCI.pm parse_hostpci at start
    run(root, "qm", "set", "300", "--hostpci0", "mapping=nope,pcie=1", check=True)
    r = run(root, "qm", "start", "300")
    assert r.returncode != 0 and "PCI device mapping not found for 'nope'" in r.stderr
    # two entries for this node: the second one no longer matches the hardware
    run(root, "pvesh", "create", "/cluster/mapping/pci", "--id", "gpu0", "--map", gpu_map(),
        "--map", gpu_map(bdf="0000:21:00.0", group=12), check=True)
    run(root, "qm", "set", "300", "--hostpci0", "mapping=gpu0,pcie=1", check=True)
    r = run(root, "qm", "start", "300")
    assert r.returncode != 0
    assert r.stderr.startswith("PCI device mapping invalid (hardware probably changed): 'iommugroup' does not match")


def test_mapping_writes_of_many_writers_at_once_keep_every_entry(root):
    # pve-manager API2/Cluster/Mapping/PCI.pm: every write reads, changes and writes pci.cfg
    # under lock_pci_config (pve-cluster Cluster.pm cfs_lock: mkdir priv/lock/file-mapping_pci_cfg)
    env = dict(os.environ, TWIN_ROOT=str(root))
    procs = [subprocess.Popen([str(root / "usr/local/sbin/pvesh"), "create", "/cluster/mapping/pci", "--id", f"gpu{i}",
                               "--map", gpu_map(node=f"n{i}")], env=env, stderr=subprocess.PIPE, text=True)
             for i in range(8)]
    assert [p.wait() for p in procs] == [0] * 8, [p.stderr.read() for p in procs if p.stderr]
    listed = json.loads(run(root, "pvesh", "get", "/cluster/mapping/pci", "--output-format", "json").stdout)
    assert sorted(m["id"] for m in listed) == [f"gpu{i}" for i in range(8)]
    assert not (root / "etc/pve/priv/lock/file-mapping_pci_cfg").exists()


def test_mapping_set_with_an_old_digest_is_refused(root):
    # PVE::Tools::assert_if_modified: the digest a client read must still be the file's
    run(root, "pvesh", "create", "/cluster/mapping/pci", "--id", "pool", "--map", gpu_map(node="a"), check=True)
    got = json.loads(run(root, "pvesh", "get", "/cluster/mapping/pci/pool", "--output-format", "json").stdout)
    run(root, "pvesh", "set", "/cluster/mapping/pci/pool", "--digest", got["digest"],
        "--map", gpu_map(node="a"), "--map", gpu_map(node="b"), check=True)
    r = run(root, "pvesh", "set", "/cluster/mapping/pci/pool", "--digest", got["digest"], "--map", gpu_map(node="c"))
    assert r.returncode != 0 and "update hardware mapping failed: detected modified configuration" in r.stderr
    assert (root / "etc/pve/mapping/pci.cfg").read_text().count("\tmap ") == 2


def test_a_held_cluster_lock_times_out_and_an_old_one_expires(root):
    # Cluster.pm $cfs_lock: 10 s to get it, then "got lock request timeout"; pmxcfs removes a lock
    # this node has seen for more than 120 s on the next unlock request (memdb.c memdb_lock_expired)
    lock = root / "etc/pve/priv/lock/file-mapping_pci_cfg"
    lock.mkdir(parents=True)
    t0 = time.monotonic()
    r = run(root, "pvesh", "create", "/cluster/mapping/pci", "--id", "gpu0", "--map", gpu_map())
    assert r.returncode != 0 and 9 <= time.monotonic() - t0 < 20
    assert "create hardware mapping failed: cfs-lock 'file-mapping_pci_cfg' error: got lock request timeout" in r.stderr
    seen = json.loads((root / "var/lib/twin/cfs-locks.json").read_text())
    entry = seen["/etc/pve/priv/lock/file-mapping_pci_cfg"]
    entry[0] -= 121  # as if this node saw the same lock two minutes ago
    (root / "var/lib/twin/cfs-locks.json").write_text(json.dumps(seen))
    run(root, "pvesh", "create", "/cluster/mapping/pci", "--id", "gpu0", "--map", gpu_map(), check=True)
    assert not lock.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="the VM process stand-in needs root")
def test_a_pooled_mapping_gives_each_vm_a_free_device_then_none(root):
    # qemu-server PCI.pm choose_hostpci_devices + reserve_pci_usage: of a mapping's entries for
    # this node, the first no running VM holds; none free: "could not find a free device"
    groups = {}
    for b in ("0000:81:00.0", "0000:a1:00.0"):
        groups[b] = os.path.basename(os.readlink(root / f"var/lib/twin/hw/sys/bus/pci/devices/{b}/iommu_group"))
    maps = [gpu_map(bdf=b, group=int(groups[b])) for b in groups]
    run(root, "pvesh", "create", "/cluster/mapping/pci", "--id", "pool", *[a for m in maps for a in ("--map", m)],
        check=True)
    for vmid in (300, 310, 320):
        if vmid != 300:
            run(root, "qm", "create", str(vmid), "--machine", "q35", check=True)
        run(root, "qm", "set", str(vmid), "--hostpci0", "mapping=pool,pcie=1", check=True)
    try:
        run(root, "qm", "start", "300", check=True)
        run(root, "qm", "start", "310", check=True)
        held = (root / "run/qemu-server/pci-id-reservations").read_text().split()
        assert [held[i] for i in (0, 3)] == ["0000:81:00.0", "0000:a1:00.0"] and [held[1], held[4]] == ["300", "310"]
        r = run(root, "qm", "start", "320")
        assert r.returncode != 0 and "could not find a free device for 'hostpci0'" in r.stderr
        run(root, "qm", "stop", "300", check=True)
        run(root, "qm", "start", "320", check=True)  # the device 300 gave back
    finally:
        for vmid in (300, 310, 320):
            run(root, "qm", "stop", str(vmid))


def test_offline_migration_moves_the_config_when_the_target_has_the_mapping(root):
    # qemu-server API2/Qemu.pm migrate_vm and QemuMigrate.pm: a stopped VM's config moves to the
    # target node; a mapped device needs an entry for the target
    (root / "etc/pve/nodes/kpro7/qemu-server").mkdir(parents=True)
    run(root, "pvesh", "create", "/cluster/mapping/pci", "--id", "pool", "--map", gpu_map(), check=True)
    run(root, "qm", "set", "300", "--hostpci0", "mapping=pool,pcie=1", check=True)
    r = run(root, "qm", "migrate", "300", "kpro7")
    assert r.returncode != 0 and "can't migrate to 'kpro7': missing mapped devices hostpci0:pool" in r.stderr
    assert run(root, "qm", "migrate", "300", "nosuch").returncode != 0
    run(root, "pvesh", "set", "/cluster/mapping/pci/pool", "--map", gpu_map(), "--map", gpu_map(node="kpro7"), check=True)
    run(root, "qm", "migrate", "300", "kpro7", check=True)
    assert (root / "etc/pve/nodes/kpro7/qemu-server/300.conf").exists()
    assert not (root / "etc/pve/nodes/kpro6/qemu-server/300.conf").exists()
    assert run(root, "qm", "status", "300").returncode != 0  # no longer this node's


def test_migration_without_quorum_is_refused_and_ha_relocates_through_the_crm(root):
    # PVE::Cluster::check_cfs_quorum in migrate_vm; pve-ha-manager: `crm-command relocate` queues a CRM
    # command, the service's LRM shuts it down and migrates it offline (PVEVM.pm migrate), the
    # target's LRM starts it; an HA resource's `qm migrate` is only a request to HA
    import json
    import os
    import time
    (root / "etc/pve/nodes/kpro7/qemu-server").mkdir(parents=True)
    run(root, "pvesh", "create", "/cluster/mapping/pci", "--id", "pool", "--map", gpu_map(), "--map",
        gpu_map(node="kpro7"), check=True)
    run(root, "qm", "set", "300", "--hostpci0", "mapping=pool,pcie=1", check=True)
    def members(up: int) -> str:
        return json.dumps({"nodename": "kpro6", "cluster": {"name": "c", "quorate": up},
                           "nodelist": {"kpro6": {"online": 1}, "kpro7": {"online": up}}})
    (root / "etc/pve/.members").write_text(members(0))
    r = run(root, "qm", "migrate", "300", "kpro7")
    assert r.returncode != 0 and "cluster not ready - no quorum?" in r.stderr
    (root / "etc/pve/.members").write_text(members(1))
    (root / "etc/pve/ha").mkdir(exist_ok=True)
    (root / "etc/pve/ha/resources.cfg").write_text("vm: 300\n\tstate started\n")
    r = run(root, "ha-manager", "crm-command", "relocate", "vm:999", "kpro7")
    assert r.returncode != 0 and "resource 'vm:999' is not HA managed" in r.stderr
    assert "Requesting HA migration for VM 300 to node kpro7" in run(root, "qm", "migrate", "300", "kpro7").stdout
    assert (root / "etc/pve/nodes/kpro6/qemu-server/300.conf").exists()  # only asked
    (root / "etc/pve/ha/crm_commands").write_text("")
    run(root, "ha-manager", "crm-command", "relocate", "vm:300", "kpro7", check=True)
    run(root, "ha-manager", "status", check=True)  # the CRM has not had its round yet (delay_s)
    assert (root / "etc/pve/nodes/kpro6/qemu-server/300.conf").exists()
    old = time.time() - 5
    os.utime(root / "etc/pve/ha/crm_commands", (old, old))
    run(root, "ha-manager", "status", check=True)
    assert (root / "etc/pve/nodes/kpro7/qemu-server/300.conf").exists()
    assert not (root / "etc/pve/nodes/kpro6/qemu-server/300.conf").exists()


def test_pvecm_status_says_quorate_only_while_more_than_half_the_votes_are_online(root):
    # pve-cluster PVE/CLI/pvecm.pm status -> corosync-quorumtool -siH (show_status): a two-node
    # cluster without two_node/QDevice has quorum 2 of 2; with one node down the other is not
    # quorate (exit 2, "Activity blocked") and its membership is itself; both back: quorate again
    r = run(root, "pvecm", "status")
    assert r.returncode == 255 and "does not exist - is this node part of a cluster?" in r.stderr
    (root / "etc/pve/corosync.conf").write_text(
        "totem {\n  cluster_name: c\n  config_version: 3\n}\n\nnodelist {\n"
        "  node {\n    name: kpro6\n    nodeid: 1\n    quorum_votes: 1\n    ring0_addr: 10.0.0.1\n  }\n"
        "  node {\n    name: kpro7\n    nodeid: 2\n    quorum_votes: 1\n    ring0_addr: 10.0.0.2\n  }\n}\n")

    def members(up: int) -> str:
        return json.dumps({"nodename": "kpro6", "cluster": {"name": "c", "quorate": up},
                           "nodelist": {"kpro6": {"online": 1}, "kpro7": {"online": up}}})
    (root / "etc/pve/.members").write_text(members(0))
    r = run(root, "pvecm", "status")
    assert r.returncode == 2, r.stderr
    assert "Name:             c\nConfig Version:   3\n" in r.stdout
    assert "Quorate:          No\n" in r.stdout and "Quorum:           2 Activity blocked\n" in r.stdout
    assert "Total votes:      1\n" in r.stdout and "Expected votes:   2\n" in r.stdout
    assert r.stdout.endswith("    Nodeid      Votes Name\n0x00000001          1 10.0.0.1 (local)\n")
    (root / "etc/pve/.members").write_text(members(1))
    r = run(root, "pvecm", "status")
    assert r.returncode == 0 and "Quorate:          Yes\n" in r.stdout and "Flags:            Quorate \n" in r.stdout
    assert r.stdout.endswith("0x00000001          1 10.0.0.1 (local)\n0x00000002          1 10.0.0.2\n")
    r = run(root, "pvecm", "nodes", check=True)
    assert r.stdout.endswith("         1          1 kpro6 (local)\n         2          1 kpro7\n")


def test_qm_shutdown_of_a_stopped_vm_succeeds_pct_refuses(root):
    # qemu-server PVE/QemuServer.pm _do_vm_stop: no process, nothing to do; pve-container Status.pm: "not running"
    assert run(root, "qm", "shutdown", "300").returncode == 0
    assert run(root, "qm", "stop", "300").returncode == 0
    for action in ("shutdown", "stop"):
        r = run(root, "pct", action, "200")
        assert r.returncode != 0 and r.stderr == "CT 200 not running\n"
    assert guests_log(root) == []


def test_a_locked_guest_is_neither_changed_nor_started_nor_stopped(root):
    conf = root / "etc/pve/qemu-server/300.conf"
    conf.write_text("lock: backup\n" + conf.read_text())
    for args in (("set", "300", "--memory", "1024"), ("start", "300")):
        r = run(root, "qm", *args)
        assert r.returncode != 0 and r.stderr == "VM is locked (backup)\n"
    ct = root / "etc/pve/lxc/200.conf"
    ct.write_text(ct.read_text() + "lock: migrate\n")
    r = run(root, "pct", "set", "200", "--dev0", "/dev/nvidia0")
    assert r.returncode != 0 and r.stderr == "CT is locked (migrate)\n"
    run(root, "qm", "unlock", "300", check=True)
    run(root, "qm", "set", "300", "--memory", "1024", check=True)
    assert "lock:" not in conf.read_text() and "memory: 1024" in conf.read_text()


def test_config_writes_wait_for_the_guest_config_flock(root):
    """The flock every Proxmox tool holds while it changes /etc/pve/qemu-server/300.conf
    (qemu-server PVE/QemuConfig.pm config_file_lock): a `qm set` waits for its holder."""
    import fcntl
    import threading
    import time

    lock = root / "var/lock/qemu-server/lock-300.conf"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        threading.Timer(0.6, held.close).start()
        started = time.monotonic()
        run(root, "qm", "set", "300", "--memory", "2048", check=True)
        assert time.monotonic() - started >= 0.5


def test_ha_resource_shutdown_only_queues_a_request_and_the_crm_stops_it_later(root):
    ha = root / "etc/pve/ha"
    ha.mkdir(parents=True, exist_ok=True)
    (ha / "resources.cfg").write_text("vm: 300\n\tstate started\n\nct: 200\n\tstate ignored\n")
    (root / "var/lib/twin/ha.json").write_text('{"mode": "stalled"}')
    run(root, "qm", "start", "300", check=True)  # HA: a start request; the stalled CRM does nothing
    assert run(root, "qm", "status", "300").stdout == "status: stopped\n"
    (root / "var/lib/twin/ha.json").write_text('{"mode": "active", "delay_s": 0}')
    assert run(root, "qm", "status", "300").stdout == "status: running\n"  # the LRM started it
    (root / "var/lib/twin/ha.json").write_text('{"mode": "stalled"}')
    r = run(root, "qm", "shutdown", "300", "--timeout", "30", check=True)
    assert r.stdout == "Requesting HA stop for VM 300\n"
    assert (ha / "crm_commands").read_text() == "stop vm:300 30\n"
    assert run(root, "qm", "status", "300").stdout == "status: running\n"  # queued, not done
    (root / "var/lib/twin/ha.json").write_text('{"mode": "active", "delay_s": 0}')
    assert run(root, "qm", "status", "300").stdout == "status: stopped\n"
    assert "\tstate stopped\n" in (ha / "resources.cfg").read_text()  # PVE/HA/Manager.pm: stop -> stopped
    assert guests_log(root) == ["ha-start qemu 300", "ha-stop qemu 300"]
    # state ignored: HA leaves it alone, pct acts directly
    assert run(root, "pct", "start", "200").stdout == ""


def onboot(root):
    """What the twin runs at each boot (tests/twin/runtime.py start_guests)."""
    env = dict(os.environ, TWIN_ROOT=str(root))
    subprocess.run(["python3", "-c", f"import sys; sys.path.insert(0, {str(root / 'usr/local/lib/twin')!r}); "
                    "import proxmox; proxmox.onboot()"], env=env, check=True)


def test_at_boot_only_onboot_guests_start_by_startup_order(root):
    """pve-guests.service runs startall (pve-manager PVE/API2/Nodes.pm): every guest stopped by the
    reboot, then only `onboot: 1` ones start, by startup order then VMID; not templates, not HA
    resources (the HA stack starts those), and one whose start fails stays stopped."""
    qm = root / "etc/pve/qemu-server"
    base = (qm / "300.conf").read_text()
    (qm / "300.conf").write_text("onboot: 1\nstartup: order=2,up=0\n" + base)
    (qm / "301.conf").write_text("onboot: 1\nstartup: 1,up=0\n" + base)  # up=0: no wait (the next test waits)
    (qm / "302.conf").write_text("onboot: 1\ntemplate: 1\n" + base)
    (qm / "303.conf").write_text("onboot: 1\n" + base)  # an HA resource
    (qm / "304.conf").write_text(base)  # ran before the reboot, no onboot
    (qm / "305.conf").write_text("onboot: 1\nstartup: up=0\nhostpci0: mapping=nosuchmap\n" + base)  # its start fails
    write_ct(root, 200, "onboot: 1\n" + (root / "etc/pve/lxc/200.conf").read_text())
    (root / "etc/pve/ha").mkdir(parents=True, exist_ok=True)
    (root / "etc/pve/ha/resources.cfg").write_text("vm: 303\n\tstate started\n")
    (root / "var/lib/twin/ha.json").write_text('{"mode": "stalled"}')
    (root / "var/lib/twin/guests.json").write_text(json.dumps({"qemu/304": "running", "qemu/303": "running"}))
    onboot(root)
    assert guests_log(root) == ["onboot qemu 301", "onboot qemu 300", "onboot lxc 200", "onboot-failed qemu 305"]
    status = {vmid: run(root, "qm", "status", str(vmid)).stdout.split()[-1] for vmid in range(300, 306)}
    assert status == {300: "running", 301: "running", 302: "stopped", 303: "stopped", 304: "stopped",
                      305: "stopped"}
    assert run(root, "pct", "status", "200").stdout == "status: running\n"
    (root / "var/lib/twin/ha.json").write_text('{"mode": "active", "delay_s": 0}')
    assert run(root, "qm", "status", "303").stdout == "status: running\n"  # the HA stack started it


def test_at_boot_each_start_is_followed_by_its_startup_up_delay(root):
    """startall (pve-manager PVE/API2/Nodes.pm) waits after each start before the next: the
    guest's `startup: up=` seconds when set (0 included), else 3 s for a VM and none for a CT; a
    start that fails is followed by its delay too (the start's checks run in its task)."""
    import datetime

    qm = root / "etc/pve/qemu-server"
    base = (qm / "300.conf").read_text()
    write_ct(root, 200, "onboot: 1\nstartup: order=1,up=1\n" + (root / "etc/pve/lxc/200.conf").read_text())
    (qm / "301.conf").write_text("onboot: 1\nstartup: order=2\n" + base)  # a VM without up: 3 s
    (qm / "300.conf").write_text("onboot: 1\nstartup: order=3,up=0\n" + base)
    (qm / "305.conf").write_text("onboot: 1\nstartup: order=4,up=1\nhostpci0: mapping=nosuchmap\n" + base)
    onboot(root)
    done = datetime.datetime.now(datetime.UTC)
    lines = (root / "var/lib/twin/guests.log").read_text().splitlines()
    assert [line.split(" ", 1)[1] for line in lines] == [
        "onboot lxc 200", "onboot qemu 301", "onboot qemu 300", "onboot-failed qemu 305"]
    at = [datetime.datetime.fromisoformat(line.split(" ", 1)[0]) for line in lines] + [done]
    gaps = [(b - a).total_seconds() for a, b in zip(at, at[1:], strict=False)]
    # each gap: the delay after one start, then the next start itself (quick; 1.5 s of slack)
    assert 1 <= gaps[0] < 2.5 and 3 <= gaps[1] < 4.5 and gaps[2] < 1.5 and 1 <= gaps[3] < 2.5, gaps


def timed_onboot(root) -> tuple[float, float, str]:
    """onboot() as the boot runs it: (seconds from its start to the first guest start logged,
    its whole run in seconds, its stderr)."""
    import datetime

    env = dict(os.environ, TWIN_ROOT=str(root))
    t0 = datetime.datetime.now(datetime.UTC)
    r = subprocess.run(["python3", "-c", f"import sys; sys.path.insert(0, {str(root / 'usr/local/lib/twin')!r}); "
                        "import proxmox; proxmox.onboot()"], env=env, check=True, capture_output=True, text=True)
    took = (datetime.datetime.now(datetime.UTC) - t0).total_seconds()
    first = (root / "var/lib/twin/guests.log").read_text().splitlines()[0]
    assert first.endswith(" onboot lxc 200"), first
    return (datetime.datetime.fromisoformat(first.split(" ", 1)[0]) - t0).total_seconds(), took, r.stderr


def test_at_boot_the_nodes_startall_onboot_delay_comes_before_the_starts(root):
    """pve-guests.service runs pve-manager bin/pve-startall-delay before startall: with the node's
    `startall-onboot-delay: N` (its own /etc/pve/nodes/<node>/config, PVE/NodeConfig.pm) it warns
    and sleeps N s, and only then is the first onboot guest started."""
    write_ct(root, 200, "onboot: 1\n" + (root / "etc/pve/lxc/200.conf").read_text())
    (root / "etc/pve/nodes/kpro6/config").write_text("#a node note\nstartall-onboot-delay: 2\n")
    first, took, stderr = timed_onboot(root)
    assert 2 <= first < 3.5 and took < 4, (first, took)
    assert "Delaying on-boot 'startall' command for 2 second(s)." in stderr
    assert run(root, "pct", "status", "200").stdout == "status: running\n"


@pytest.mark.parametrize("own, other", [
    (None, None),                                   # no node config: the default, 0
    ("startall-onboot-delay: 0\n", None),           # 0: pve-startall-delay sleeps only for a non-zero value
    ("#startall-onboot-delay: 2\n", None),          # a comment (the node's description)
    ("startall-onboot-delay: 301\n", None),         # over the schema's 300: dropped by parse_config
    ("startall-onboot-delay: 2.5\n", None),         # not an integer: dropped
    ("startall-onboot-delay: 2\nstartall-onboot-delay: 0\n", None),  # the last line of a key counts
    (None, "startall-onboot-delay: 2\n"),           # another node's file: not this node's delay
])
def test_at_boot_no_startall_onboot_delay_unless_the_nodes_config_sets_one(root, own, other):
    write_ct(root, 200, "onboot: 1\n" + (root / "etc/pve/lxc/200.conf").read_text())
    if own is not None:
        (root / "etc/pve/nodes/kpro6/config").write_text(own)
    if other is not None:
        (root / "etc/pve/nodes/kpro7").mkdir(parents=True)
        (root / "etc/pve/nodes/kpro7/config").write_text(other)
    first, took, stderr = timed_onboot(root)
    assert first < 1.5 and "Delaying" not in stderr, (first, took, stderr)


def test_qm_refuses_pcie_without_q35_and_busy_gpu(root):
    conf = root / "etc/pve/qemu-server/300.conf"
    conf.write_text(conf.read_text().replace("machine: q35\n", ""))
    run(root, "qm", "set", "300", "--hostpci0", "0000:01:00.0,pcie=1", check=True)
    r = run(root, "qm", "start", "300")
    assert r.returncode != 0 and "q35 machine model is not enabled" in r.stderr
    run(root, "qm", "set", "300", "--machine", "q35", check=True)
    hardware.mark_busy(root, "0000:01:00.0", "python3")
    r = run(root, "qm", "start", "300")
    assert r.returncode != 0 and "in use by python3" in r.stderr
    hardware.clear_busy(root)
    run(root, "qm", "start", "300", check=True)


def test_qm_config_keeps_snapshot_sections(root):
    conf = root / "etc/pve/qemu-server/300.conf"
    conf.write_text(conf.read_text() + "\n[before-gpu]\nmemory: 1024\nsnaptime: 1700000000\n")
    run(root, "qm", "set", "300", "--hostpci0", "0000:21:00.0,pcie=1", check=True)
    text = conf.read_text()
    assert text.endswith("\n\n[before-gpu]\nmemory: 1024\nsnaptime: 1700000000\n")
    assert "hostpci0: 0000:21:00.0,pcie=1\n" in text.split("[before-gpu]")[0]


def test_proxmoxer_command_backend_against_the_stand_ins(root, monkeypatch):
    """proxmoxer's local backend sends the same `pvesh <cmd> <path> -k v --output-format json`
    command lines as its SSH backends (both are CommandBaseSession)."""
    monkeypatch.setenv("TWIN_ROOT", str(root))
    monkeypatch.setenv("PATH", f"{root}/usr/local/sbin:{root}/usr/local/bin:" + os.environ["PATH"])
    px = ProxmoxAPI(backend="local", service="PVE")
    assert px.version.get()["version"] == "8.4.1"
    assert [n["node"] for n in px.nodes.get()] == ["kpro6"]
    assert {c["vmid"] for c in px.nodes("kpro6").lxc.get()} == {200}
    px.nodes("kpro6").lxc(200).config.put(dev0="/dev/nvidia0,gid=44")
    assert px.nodes("kpro6").lxc(200).config.get()["dev0"] == "/dev/nvidia0,gid=44"
    px.cluster.mapping.pci.post(id="gpu1", map=gpu_map("0000:21:00.0", 15))
    assert px.cluster.mapping.pci("gpu1").get()["map"] == [gpu_map("0000:21:00.0", 15)]
    px.nodes("kpro6").qemu(300).config.put(hostpci0="mapping=gpu1,pcie=1")
    task = px.nodes("kpro6").qemu(300).status.start.post()
    assert task.startswith("UPID:kpro6:")
    assert px.nodes("kpro6").qemu(300).status.current.get()["status"] == "running"
    with pytest.raises(Exception, match="400"):
        px.nodes("kpro6").lxc(200).config.put(**{"lxc.cgroup2.devices.allow": "c 195:* rwm"})


def test_pveversion_reports_profile_version_and_booted_kernel(root):
    assert run(root, "pveversion").stdout == "pve-manager/8.4.1/2a5fa54a8503f96d (running kernel: 6.14.8-2-pve)\n"
    assert run(root, "pveversion", "-v").stdout.startswith("proxmox-ve: 8.4.0 (running kernel: 6.14.8-2-pve)\n"
                                                           "pve-manager: 8.4.1 (running version: 8.4.1/")


# ---------------------------------------------------------------- boot tools

def test_reboot_stand_ins_request_a_reboot(root):
    import time

    request = root / "var/lib/twin/reboot-request"
    run(root, "reboot", check=True)
    deadline = time.monotonic() + 5
    while not request.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert request.exists()
    (root / "var/lib/twin/reboot-request").unlink()
    run(root, "shutdown", "-r", "now", check=True)
    run(root, "systemctl", "reboot", check=True)
    assert len((root / "var/lib/twin/reboot.log").read_text().splitlines()) == 3
    assert os.path.realpath(root / "usr/sbin/reboot") == str(root / "usr/sbin/reboot")  # not a link to systemctl


def test_busy_gpu_seen_by_fuser_and_nvidia_smi(root):
    hardware.mark_busy(root, "0000:41:00.0", "nvidia-persistenced")
    apps = run(root, "nvidia-smi", "--query-compute-apps=gpu_bus_id,pid,process_name", "--format=csv,noheader").stdout
    pid = apps.split(", ")[1]
    assert apps == f"00000000:41:00.0, {pid}, nvidia-persistenced\n"
    (root / "dev").mkdir(exist_ok=True)
    for n in range(3):
        (root / f"dev/nvidia{n}").write_text("")
    r = run(root, "fuser", "-v", "/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia2")
    assert r.returncode == 0
    assert r.stderr.splitlines() == ["                     USER        PID ACCESS COMMAND",
                                     f"/dev/nvidia2:        root      {pid:>5} F.... nvidia-persiste"]
    assert "/dev/nvidia0:" not in r.stderr
    assert run(root, "fuser", "/dev/nvidia0").returncode == 1


def test_nvidia_modprobe_records_uvm_nodes(root):
    run(root, "nvidia-modprobe", "-u", "-c=0", check=True)
    rec = json.loads((root / "var/lib/twin/nvidia-modprobe.log").read_text().splitlines()[-1])
    assert rec["nodes"] == [{"path": "/dev/nvidia-uvm", "major": 511, "minor": 0},
                            {"path": "/dev/nvidia-uvm-tools", "major": 511, "minor": 1}]
    if os.geteuid() == 0:
        assert stat.S_ISCHR(os.stat(root / "dev/nvidia-uvm").st_mode)
        assert os.major(os.stat(root / "dev/nvidia-uvm").st_rdev) == 511


# ---------------------------------------------------------------- in a running twin (root, sshd)

@pytest.mark.twin
def test_live_twin_rebinding_survives_reboot(twin_factory):
    """Over SSH in a real twin: stand-ins answer, then a persisted binding + reboot changes the view."""
    import time

    from tests.twin import runtime

    twin = twin_factory("kpro6")

    def sh(cmd, check=True):
        r = subprocess.run(runtime.ssh_command(twin.name, [cmd]), capture_output=True, text=True,
                           timeout=60)
        if check:
            assert r.returncode == 0, (cmd, r.stdout, r.stderr)
        return r

    assert sh("nvidia-smi -L | wc -l").stdout.strip() == "8"
    assert sh("uname -r").stdout == "6.14.8-2-pve\n"
    assert sh("pveversion").stdout.startswith("pve-manager/8.4.1/")
    assert sh("readlink /sys/bus/pci/devices/0000:21:00.0/driver").stdout.endswith("/nvidia\n")
    assert sh("grep -c . /proc/driver/nvidia/gpus/*/information | wc -l").stdout.strip() == "8"
    assert sh("test -c /dev/nvidia7 && ! test -e /dev/nvidia-uvm && echo ok").stdout == "ok\n"
    r = sh("pct set 200 --dev0 /dev/nvidia-uvm && pct start 200", check=False)
    assert "Device /dev/nvidia-uvm does not exist" in r.stderr
    sh("nvidia-modprobe -u -c=0 && pct start 200 && pct status 200 && ls -l /dev/nvidia-uvm")
    sh("mkdir -p /etc/udev/rules.d /etc/modules-load.d && printf '%s\\n' "
       "'ACTION==\"add\", SUBSYSTEM==\"pci\", KERNEL==\"0000:21:00.0\", ATTR{driver_override}=\"vfio-pci\"' "
       "> /etc/udev/rules.d/60-pvegpu-gpu-binding.rules && echo vfio-pci > /etc/modules-load.d/vfio.conf")
    sh("reboot", check=False)  # the supervisor may cut this very session
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(1)
        r = sh("readlink /sys/bus/pci/devices/0000:21:00.0/driver", check=False)
        if r.returncode == 0 and r.stdout.endswith("/vfio-pci\n"):
            break
    else:
        pytest.fail("twin did not come back with 21:00.0 on vfio-pci")
    assert sh("nvidia-smi -L | wc -l").stdout.strip() == "7"
    assert sh("test -c /dev/vfio/15 && ! test -e /dev/nvidia7 && ! test -e /dev/nvidia-uvm && echo ok").stdout == "ok\n"
    assert sh("cat /proc/driver/nvidia/gpus/0000:41:00.0/information").stdout.count("Device Minor: \t 1\n") == 1


@pytest.mark.twin
def test_live_proxmoxer_over_ssh(twin_factory):
    """proxmoxer's paramiko SSH backend runs `pvesh ... --output-format json` in the twin."""
    twin = twin_factory("kpro6")
    px = ProxmoxAPI(twin.address, backend="ssh_paramiko", user="root", private_key_file=str(twin.key),
                    port=twin.port, service="PVE", timeout=30)
    assert px.version.get()["release"] == "8.4"
    assert [c["vmid"] for c in px.nodes("kpro6").lxc.get()] == [200]
    px.cluster.mapping.pci.post(id="gpu0", map=gpu_map())
    px.nodes("kpro6").qemu(300).config.put(hostpci0="mapping=gpu0,pcie=1")
    assert px.nodes("kpro6").qemu(300).status.start.post().startswith("UPID:kpro6:")
    assert px.nodes("kpro6").qemu(300).status.current.get()["status"] == "running"


def test_qm_set_cpu_follows_qemu_servers_schema_of_the_installed_version(root):
    """qemu-server CPUConfig.pm: phys-bits 8-64 or host (PVE 8 and 9), guest-phys-bits only from
    PVE 9, VM-specific flags from its short list; the kpro6 twin runs qemu-server 8.3."""
    conf = root / "etc/pve/qemu-server/300.conf"
    run(root, "qm", "set", "300", "--cpu", "kvm64,phys-bits=43,flags=+pdpe1gb", check=True)
    assert "cpu: kvm64,phys-bits=43,flags=+pdpe1gb" in conf.read_text()
    for bad, message in (("kvm64,phys-bits=70", "between 8 and 64 or 'host'"),
                         ("host,guest-phys-bits=43", "'guest-phys-bits' is not defined"),
                         ("kvm64,flags=+avx512f", "must be a subset of")):
        r = run(root, "qm", "set", "300", "--cpu", bad)
        assert r.returncode != 0 and message in r.stderr, r.stderr
    assert "cpu: kvm64,phys-bits=43,flags=+pdpe1gb" in conf.read_text()


def test_zpool_get_prints_feature_states_as_openzfs_does_and_findmnt_the_zfs_root(root):
    """zpool_main.c zpool_do_get -H: tab-separated, no header; libzfs_pool.c zpool_prop_get_feature:
    disabled / enabled (refcount 0) / active. findmnt of / says zfs only where the profile's root is a dataset."""
    import json
    data = json.loads((root / "var/lib/twin/profile.json").read_text())
    data["zfs"] = {"root": "rpool/ROOT/pve-1",
                   "pools": {"rpool": {"features": {"async_destroy": "enabled", "fast_dedup": "active",
                                                    "longname": "disabled"}}}}
    (root / "var/lib/twin/profile.json").write_text(json.dumps(data))
    r = run(root, "zpool", "get", "-H", "-o", "property,value", "all", "rpool", check=True)
    assert [line for line in r.stdout.splitlines() if line.startswith("feature@")] == [
        "feature@async_destroy\tenabled", "feature@fast_dedup\tactive", "feature@longname\tdisabled"]
    r = run(root, "zpool", "get", "-H", "-o", "property,value", "all", "tank")
    assert r.returncode == 1 and "cannot open 'tank': no such pool" in r.stderr
    assert run(root, "findmnt", "-n", "-o", "FSTYPE", "/", check=True).stdout == "zfs\n"
    assert run(root, "findmnt", "-n", "-o", "SOURCE", "/", check=True).stdout == "rpool/ROOT/pve-1\n"


def test_is_system_running_says_starting_while_the_boot_jobs_run(root):
    """systemd's `systemctl is-system-running` (src/systemctl/systemctl-is-system-running.c):
    the manager's state, exit 0 only for "running"; `--wait` blocks while it is still starting.
    The twin's boot jobs are its onboot guest starts (tests/twin/runtime.py Supervisor.boot)."""
    import threading

    marker = root / "run/twin/boot-jobs"
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text("pve-guests.service\n")
    r = run(root, "systemctl", "is-system-running")
    assert (r.returncode, r.stdout) == (1, "starting\n")
    assert run(root, "systemctl", "is-system-running", "--quiet").stdout == ""
    threading.Timer(0.5, marker.unlink).start()
    t0 = time.monotonic()
    r = run(root, "systemctl", "is-system-running", "--wait")
    assert (r.returncode, r.stdout) == (0, "running\n") and time.monotonic() - t0 >= 0.5
    r = run(root, "systemctl", "is-system-running")
    assert (r.returncode, r.stdout) == (0, "running\n")


# ---------------------------------------------------------------- pve8to9

def test_pve8to9_in_its_format(root):
    """pve-manager PVE/CLI/pve8to9.pm's format, read by pvegpu's preflight (plan/upgrade_perform.py)."""
    from plan.upgrade_perform import pve8to9_fails

    r = run(root, "pve8to9", "--full", check=True)
    assert r.stdout.startswith("= CHECKING VERSION INFORMATION FOR PVE PACKAGES =\n\n"), r.stdout
    assert "\n= SUMMARY =\n\nTOTAL:    " in r.stdout and "NOTE: Expensive checks" not in r.stdout
    before = pve8to9_fails(r.stdout.splitlines())
    assert before[1] is not None, r.stdout
    (root / "var/lib/twin/faults.json").write_text(json.dumps({"pve8to9_fails": ["corosync is not healthy"]}))
    r = run(root, "pve8to9", check=True)  # exit 0 whatever it finds
    fails, count = pve8to9_fails(r.stdout.splitlines())
    assert fails == [*before[0], "corosync is not healthy"] and count == (before[1] or 0) + 1, r.stdout
    assert "Try to solve the problems one at a time" in r.stdout
    assert "SKIP: NOTE: Expensive checks, like CT cgroupv2 compat, not performed without '--full' parameter" in r.stdout
