#!/usr/bin/python3 -IS
"""Twin stand-ins for the Proxmox CLIs, dispatched on the program name: pveversion, pct, qm, pvesh,
ha-manager, pvecm.

State lives where Proxmox keeps it: /etc/pve/nodes/<node>/{lxc,qemu-server}/<id>.conf (pct.conf(5),
qm.conf(5); [snapshot] sections preserved) and /etc/pve/mapping/pci.cfg. Guest run state is
/var/lib/twin/guests.json; start/stop/shutdown/reboot append to /var/lib/twin/guests.log.
Containers have their own root: `pct start` mounts /var/lib/twin/ct/<id>/root, an overlay of the
pristine bookworm root (/var/lib/twin/ctbase) and the CT's own files, and snapshots the /dev nodes
its config passes through (ct/<id>/devices.json); `pct exec/push/pull` run there with that /dev;
`pct stop` ends its processes and unmounts it. Layout and mounts: tests/twin/runtime.py docstring.
Refused like Proxmox: exec/push/pull on a CT that is not running.
Refused as Proxmox refuses: raw lxc.* keys through pct set / the API, starting a CT whose devN
path does not exist, starting a VM whose PCI mapping does not match the hardware (ids, path,
IOMMU group), pcie=1 without a q35 machine.
"""
import fcntl
import json
import os
import re
import shlex
import stat
import sys
import time

sys.dont_write_bytecode = True  # leave no __pycache__ in the twin (a --dry run must change nothing)
sys.path.insert(0, os.path.join(os.environ.get("TWIN_ROOT", "/"), "usr/local/lib/twin"))
import twinstate as ts  # noqa: E402

LXC_KEYS = {"arch", "cmode", "console", "cores", "cpulimit", "cpuunits", "debug", "description", "features",
            "hookscript", "hostname", "lock", "memory", "nameserver", "onboot", "ostype", "protection",
            "rootfs", "searchdomain", "startup", "swap", "tags", "template", "timezone", "tty",
            "unprivileged", "entrypoint", "env"}
LXC_INDEXED = re.compile(r"^(dev|mp|net|unused)\d+$")
KINDS = {"lxc": ("lxc", "CT"), "qemu": ("qemu-server", "VM")}


class ApiError(Exception):
    """message (with an HTTP-like status first line when Proxmox prints one)."""


def node():
    return ts.state().get("node") or ts.profile().get("node") or "localhost"


def conf_path(kind, vmid):
    return f"/etc/pve/nodes/{node()}/{KINDS[kind][0]}/{vmid}.conf"


def load(kind, vmid):
    text = ts.read(conf_path(kind, vmid))
    if text is None:
        raise ApiError(f"Configuration file 'nodes/{node()}/{KINDS[kind][0]}/{vmid}.conf' does not exist")
    return ts.parse_conf(text)


def save(kind, vmid, conf):
    ts.write(conf_path(kind, vmid), ts.format_conf(conf))


def run_state():
    return json.loads(ts.read("/var/lib/twin/guests.json", "{}") or "{}")


def set_run_state(kind, vmid, status):
    st = run_state()
    st[f"{kind}/{vmid}"] = status
    ts.write("/var/lib/twin/guests.json", json.dumps(st, indent=1, sort_keys=True))


def status_of(kind, vmid):
    return run_state().get(f"{kind}/{vmid}", "stopped")


def guest_ids(kind):
    d = ts.path(f"/etc/pve/nodes/{node()}/{KINDS[kind][0]}")
    if not os.path.isdir(d):
        return []
    return sorted(int(f[:-5]) for f in os.listdir(d) if f.endswith(".conf") and f[:-5].isdigit())


def upid(kind, action, vmid):
    t = int(time.time())
    return f"UPID:{node()}:{os.getpid():08X}:{t & 0xFFFFFFFF:08X}:{t:08X}:{'vz' if kind == 'lxc' else 'qm'}{action}:{vmid}:root@pam:"


# ---------------------------------------------------------------- config changes

# qemu-server src/PVE/QemuServer/CPUConfig.pm: the VM `cpu` option's keys (PVE 8, stable-bookworm;
# PVE 9 adds guest-phys-bits and level), the VM-specific flags it allows, parse_phys_bits.
CPU_KEYS_8 = {"_", "cputype", "reported-model", "hidden", "hv-vendor-id", "flags", "phys-bits"}
CPU_KEYS_9 = CPU_KEYS_8 | {"guest-phys-bits", "level"}
CPU_VM_FLAGS = {"pcid", "spec-ctrl", "ibpb", "ssbd", "virt-ssbd", "amd-ssbd", "amd-no-ssb", "pdpe1gb",
                "md-clear", "hv-tlbflush", "hv-evmcs", "aes"}


def cpu_errors(value):
    p = ts.prop_string(value)
    version = ((ts.profile().get("pve") or {}).get("packages") or {}).get("qemu-server", "8")
    keys = CPU_KEYS_9 if ts.version_key(version)[0] >= 9 else CPU_KEYS_8
    errors = [f"cpu: invalid format - property '{k}' is not defined in schema" for k in p if k not in keys]
    bits = p.get("phys-bits")
    if bits is not None and not (bits == "host" or (re.fullmatch(r"\d{1,2}", bits) and 8 <= int(bits) <= 64)):
        errors.append("cpu: invalid format - value must be an integer between 8 and 64 or 'host'")
    guest = p.get("guest-phys-bits")
    if guest is not None and not (guest.isdigit() and 32 <= int(guest) <= 64):
        errors.append("cpu: invalid format - guest-phys-bits: value must have a minimum value of 32 and at most 64")
    flags = p.get("flags")
    if flags is not None and not all(re.fullmatch(r"[+-](.+)", f) and f[1:] in CPU_VM_FLAGS for f in flags.split(";")):
        errors.append("cpu: VM-specific CPU flags must be a subset of: " + ", ".join(sorted(CPU_VM_FLAGS)))
    if "reported-model" in p:
        errors.append("cpu: Property 'reported-model' not allowed in VM-specific CPU config.")
    return errors


def verify_params(kind, opts):
    errors = []
    for k, v in opts:
        if kind == "lxc":
            if k.startswith("lxc.") or not (k in LXC_KEYS or LXC_INDEXED.match(k)):
                errors.append(f"{k}: property is not defined in schema and the schema does not allow additional properties")
            elif k.startswith("dev"):
                p = ts.prop_string(v)
                path = p.get("path", p.get("_", ""))
                if not path.startswith("/dev/"):
                    errors.append(f"{k}: invalid format - value does not look like a valid device path")
        elif kind == "qemu":
            if k.startswith("lxc.") or k.startswith("hookscript."):
                errors.append(f"{k}: property is not defined in schema and the schema does not allow additional properties")
            elif k == "cpu":
                errors += cpu_errors(v)
            elif re.match(r"^hostpci\d+$", k):
                p = ts.prop_string(v)
                # follows qemu-server PVE/API2/Qemu.pm update_vm (check_hostpci_perm): for root only the
                # format is checked; a mapping that does not exist fails at start (PCI.pm parse_hostpci)
                if "mapping" in p:
                    if not re.match(r"^[a-z][a-z0-9_-]+$", p["mapping"], re.I):
                        errors.append(f"{k}: invalid format - invalid configuration ID '{p['mapping']}'")
                elif not re.match(r"^([0-9a-fA-F]{4}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(\.[0-7])?$", p.get("_", "") or p.get("host", "")):
                    errors.append(f"{k}: invalid format - value does not look like a valid PCI device id")
    if errors:
        raise ApiError("400 Parameter verification failed.\n" + "\n".join(errors))


def update_config(kind, vmid, opts, delete):
    with config_lock(kind, vmid):
        conf = load(kind, vmid)
        verify_params(kind, opts)
        # follows qemu-server PVE/API2/Qemu.pm update_vm_api / pve-container API2/LXC/Config.pm: a locked config is not changed
        check_lock(kind, conf)
        if kind == "lxc":
            opts = lxc_dev_changes(vmid, conf, opts)
        _update_config(kind, vmid, conf, opts, delete)


# follows pve-container debian/changelog 6.0.4 ("implement device hotplug"; hot-unplug and editing
# an existing device are not supported)
DEV_HOTPLUG_PVE_CONTAINER = (6, 0, 4)


def pve_container_version():
    v = str(((ts.profile().get("pve") or {}).get("packages") or {}).get("pve-container") or "0")
    return tuple(int(n) for n in re.findall(r"\d+", v.split("-")[0])[:3])


def lxc_dev_changes(vmid, conf, opts):
    """`devN` options of a CT config change as pve-container handles them; returns the options
    written to the main section now. Follows src/PVE/LXC/Config.pm update_pct_config: each devN
    path must be a device node (PVE::LXC::Tools get_device_mode_and_rdev; checked here for a
    running CT only, for a stopped one at its start); on a running CT every change goes to
    [pve:pending] and vmconfig_hotplug_pending applies
    a devN whose index the config does not hold yet (pve-container >= 6.0.4:
    PVE::LXC device_passthrough_hotplug puts the node into the running CT); any other devN stays
    pending until the CT restarts."""
    dev = [(k, v) for k, v in opts if re.fullmatch(r"dev\d+", k)]
    if not dev or status_of("lxc", vmid) != "running":
        return opts  # (a stopped CT's devN paths are checked at `pct start`, check_lxc_start)
    for _k, v in dev:
        p = ts.prop_string(v)
        path = p.get("path", p.get("_"))
        if not os.path.exists(ts.path(path)):
            raise ApiError(f"Device {path} does not exist")
        if twin_char_node(path) is None:
            raise ApiError(f"{path} is not a device")
    hot = [(k, v) for k, v in dev
           if pve_container_version() >= DEV_HOTPLUG_PVE_CONTAINER and ts.conf_get(conf, k) is None]
    pending = [o for o in dev if o not in hot]
    if hot:
        ids = [(k, v) for k, v in conf["keys"] if k in ("unprivileged", "lxc.idmap")]
        added = ct_devices(vmid, {"keys": ids + hot, "description": [], "rest": ""})
        path = f"{CT_DIR}/{vmid}/devices.json"
        data = json.loads(ts.read(path, "{}") or "{}")
        have = {d["path"] for d in data.get("devices", [])}
        data["devices"] = sorted(data.get("devices", []) + [d for d in added if d["path"] not in have],
                                 key=lambda d: d["path"])
        ts.write(path, json.dumps(data, indent=1))
    if pending:
        lines = "".join(f"{k}: {v}\n" for k, v in pending)
        rest = conf["rest"]
        if rest.startswith("[pve:pending]\n"):
            conf["rest"] = "[pve:pending]\n" + lines + rest[len("[pve:pending]\n"):]
        else:
            conf["rest"] = "[pve:pending]\n" + lines + ("\n" + rest if rest else "")
    return [o for o in opts if o not in pending]


def _update_config(kind, vmid, conf, opts, delete):
    for k, v in opts:
        if k == "description":
            conf["description"] = [f"#{line}" for line in v.split("\n")]
        else:
            ts.conf_set(conf, k, v)
    for k in delete:
        if k == "description":
            conf["description"] = []
        ts.conf_delete(conf, k)
    save(kind, vmid, conf)


def config_dict(kind, vmid):
    text = ts.read(conf_path(kind, vmid))
    if text is None:
        load(kind, vmid)  # raises
    conf = ts.parse_conf(text)
    out = {}
    raw = []
    for k, v in conf["keys"]:
        if k.startswith("lxc."):
            raw.append([k, v])
        else:
            out[k] = int(v) if re.fullmatch(r"-?\d+", v) else v
    if conf["description"]:
        out["description"] = "\n".join(line[1:] for line in conf["description"]) + "\n"
    if raw:
        out["lxc"] = raw
    out["digest"] = ts.digest(text)
    return out


# ---------------------------------------------------------------- start checks

def check_lxc_start(conf):
    for k, v in conf["keys"]:
        if re.match(r"^dev\d+$", k):
            p = ts.prop_string(v)
            path = p.get("path", p.get("_"))
            full = ts.path(path)
            if not os.path.exists(full):
                raise ApiError(f"Device {path} does not exist")
            mode = os.stat(full).st_mode
            if not (stat.S_ISCHR(mode) or stat.S_ISBLK(mode)):
                raise ApiError(f"Path {path} is not a device")


def sysfs_dev(bdf):
    base = f"/var/lib/twin/hw/sys/bus/pci/devices/{bdf}"
    if not os.path.isdir(ts.path(base)):
        return None
    attr = lambda a: (ts.read(f"{base}/{a}") or "").strip()  # noqa: E731
    grp = os.path.join(ts.path(base), "iommu_group")
    drv = os.path.join(ts.path(base), "driver")
    return {"vendor": attr("vendor")[2:], "device": attr("device")[2:],
            "subsystem_vendor": attr("subsystem_vendor")[2:], "subsystem_device": attr("subsystem_device")[2:],
            "iommugroup": os.path.basename(os.readlink(grp)) if os.path.islink(grp) else None,
            "driver": os.path.basename(os.readlink(drv)) if os.path.islink(drv) else None}


def assert_mapping_valid(name, entry, mapping_cfg=None):
    """One map entry of this node against the hardware: id, subsystem-id, the first device's IOMMU
    group and (given the mapping's own config) mdev must match."""
    # follows pve-guest-common src/PVE/Mapping/PCI.pm assert_valid() (5.2.x: mdev checked too)
    for idx, path in enumerate(entry.get("path", "").split(";")):
        if not re.search(r"\.[0-9a-f]", path, re.I):
            path += ".0"  # a whole device: its function 0 must exist
        bdf = path if path.count(":") == 2 else "0000:" + path
        info = sysfs_dev(bdf)
        if info is None:
            raise ApiError(f"pci device '{path}' not found")
        correct = {"id": f"{info['vendor']}:{info['device']}", "iommugroup": info["iommugroup"],
                   "subsystem-id": (f"{info['subsystem_vendor']}:{info['subsystem_device']}"
                                    if info["subsystem_vendor"] and info["subsystem_device"] else None)}
        configured = {k: entry.get(k) for k in correct}
        if mapping_cfg is not None:
            mdev_dir = ts.path(f"/var/lib/twin/hw/sys/bus/pci/devices/{bdf}/mdev_supported_types")
            correct["mdev"] = "1" if os.path.isdir(mdev_dir) else "0"
            configured["mdev"] = "1" if mapping_cfg.get("mdev") in ("1", "true") else "0"
        for prop in sorted(correct):
            if prop == "iommugroup" and idx > 0:
                continue
            want, have = correct[prop], configured[prop]
            if want is None and have is None:
                continue
            if want is not None and have is None:
                raise ApiError(f"missing expected property '{prop}' for device '{path}'")
            if want is None:
                raise ApiError(f"unexpected property '{prop}' configured for device '{path}'")
            if want.replace("0x", "") != have.replace("0x", ""):
                raise ApiError(f"'{prop}' does not match for '{name}' ({want.replace('0x', '')} != {have.replace('0x', '')})")


PCI_RESERVATIONS = "/run/qemu-server/pci-id-reservations"  # qemu-server PVE/QemuServer/PCI.pm


def pci_reservations():
    """{pci id: vmid} of VMs running now (qemu-server PCI.pm reserve_pci_usage: `<id> <vmid> pid:<pid>`
    lines; a reservation whose VM no longer runs is a leftover that may be taken)."""
    out = {}
    for line in (ts.read(PCI_RESERVATIONS) or "").splitlines():
        m = re.match(r"^(\S+)\s(\d+)\s(?:time|pid):(\d+)$", line)
        if m and status_of("qemu", int(m.group(2))) == "running":
            out[m.group(1)] = int(m.group(2))
    return out


def write_reservations(vmid, ids):
    """Drop `vmid`'s reservations and add `ids` for it (with its kvm pid)."""
    pid = (ts.read(kvm_pidfile(vmid)) or "0").strip() or "0"
    lines = [line for line in (ts.read(PCI_RESERVATIONS) or "").splitlines() if line.split()[1:2] != [str(vmid)]]
    lines += [f"{i} {vmid} pid:{pid}" for i in ids]
    ts.write(PCI_RESERVATIONS, "".join(f"{line}\n" for line in sorted(lines)))  # sorted by id, as PCI.pm writes it


def path_ids(path):
    """The PCI functions a hostpci path names (a slot without function: every function of it)."""
    bdf = path if path.count(":") == 2 else "0000:" + path
    if re.search(r"\.[0-7]$", bdf):
        return [bdf]
    base = ts.path("/var/lib/twin/hw/sys/bus/pci/devices")
    found = sorted(d for d in (os.listdir(base) if os.path.isdir(base) else []) if d.startswith(bdf + "."))
    return found or [bdf + ".0"]


def check_qemu_start(conf, vmid=None):
    """Refuses what qemu-server refuses at start; the PCI functions chosen for the VM."""
    machine = ts.conf_get(conf, "machine") or ""
    groups = ts.path("/var/lib/twin/hw/sys/kernel/iommu_groups")
    busy = ts.busy()
    reserved = {i: v for i, v in pci_reservations().items() if v != vmid}
    chosen = []
    for k, v in sorted(conf["keys"], key=lambda kv: int(kv[0][7:]) if re.match(r"^hostpci\d+$", kv[0]) else -1):
        if not re.match(r"^hostpci\d+$", k):
            continue
        p = ts.prop_string(v)
        if p.get("pcie") == "1" and "q35" not in machine:
            raise ApiError("q35 machine model is not enabled")
        if not (os.path.isdir(groups) and os.listdir(groups)):
            raise ApiError("IOMMU not present")
        if "mapping" in p:
            maps = read_mappings().get(p["mapping"])
            mine = [ts.prop_string(m) for m in (maps or {}).get("map", [])]
            mine = [m for m in mine if m.get("node") == node()]
            if not mine:
                raise ApiError(f"PCI device mapping not found for '{p['mapping']}'")
            # follows qemu-server PVE/QemuServer/PCI.pm parse_hostpci(): every entry of this node is checked
            for m in mine:
                try:
                    assert_mapping_valid(p["mapping"], m, maps)
                except ApiError as e:
                    raise ApiError(f"PCI device mapping invalid (hardware probably changed): {e}") from e
            alternatives = [[i for path in m["path"].split(";") for i in path_ids(path)] for m in mine]
        else:
            alternatives = [[i for path in (p.get("_") or p.get("host") or "").split(";") for i in path_ids(path)]]
        # follows qemu-server PCI.pm choose_hostpci_devices(): one alternative is taken as it is (its
        # reservation fails when another VM holds it); of several, the first one neither this VM's
        # other hostpci lines nor a running VM (reserve_pci_usage) hold, else no free device
        free = [a for a in alternatives if not any(i in reserved or i in chosen for i in a)]
        if len(alternatives) == 1 and not free:
            held = next(i for i in alternatives[0] if i in reserved)
            raise ApiError(f"PCI device '{held}' already in use by VMID '{reserved[held]}'")
        if not free:
            raise ApiError(f"could not find a free device for '{k}'")
        for bdf in free[0]:
            info = sysfs_dev(bdf)
            if info is None:
                raise ApiError(f"no PCI device found for '{bdf}'")
            if info["driver"] == "nvidia" and bdf in busy:
                raise ApiError(f"unable to unbind PCI device {bdf} from nvidia: in use by "
                               f"{busy[bdf]['holder']} (pid {busy[bdf]['pid']})")
        chosen += free[0]
    return chosen


def migrate(vmid, target, opts):
    """qm migrate <vmid> <target> of a stopped VM (offline): its config moves to the target node's
    directory (pmxcfs: the guest now belongs to that node), after qemu-server's checks."""
    conf = load("qemu", vmid)
    # follows qemu-server PVE/API2/Qemu.pm migrate_vm: a running VM needs --online, the target a known other node
    if status_of("qemu", vmid) == "running" and "online" not in dict(opts):
        raise ApiError("can't migrate running VM without --online")
    if target == node():
        raise ApiError("target is local node.")
    # PVE::Cluster::check_cfs_quorum(): refused while this node's cluster is not quorate
    members = json.loads(ts.read("/etc/pve/.members") or "{}")
    if members.get("cluster") and not members["cluster"].get("quorate"):
        raise ApiError("cluster not ready - no quorum?")
    if not os.path.isdir(ts.path(f"/etc/pve/nodes/{target}")):
        raise ApiError(f"no such cluster node '{target}'")
    check_lock("qemu", conf)
    sid = ha_sid("qemu", vmid)
    if sid:
        # migrate_vm: an HA resource's migration is only requested from HA (`ha-manager migrate`,
        # queued as a CRM command); the twin's HA stack does not carry it out
        print(f"Requesting HA migration for VM {vmid} to node {target}")
        ha_queue(f"migrate {sid} {target}")
        return
    # PVE/QemuMigrate.pm prepare + QemuMigrate/Helpers.pm check_local_resources: every mapped hostpci
    # needs an entry of its mapping for the target node
    maps = read_mappings()
    missing = [f"{k}:{ts.prop_string(v)['mapping']}" for k, v in conf["keys"]
               if re.match(r"^hostpci\d+$", k) and "mapping" in ts.prop_string(v)
               and not any(ts.prop_string(m).get("node") == target
                           for m in maps.get(ts.prop_string(v)["mapping"], {}).get("map", []))]
    if missing:
        raise ApiError(f"can't migrate to '{target}': missing mapped devices {', '.join(sorted(missing))}")
    with config_lock("qemu", vmid):
        os.rename(ts.path(conf_path("qemu", vmid)), ts.path(f"/etc/pve/nodes/{target}/qemu-server/{vmid}.conf"))
    if ts.read("/etc/pve/.vmlist") is not None:
        ts.write("/etc/pve/.vmlist", json.dumps({"version": 1, "ids": vmlist()}, indent=1) + "\n")
    print(f"migration finished successfully (VM {vmid} to node {target})")


def start(kind, vmid):
    conf = load(kind, vmid)
    label = KINDS[kind][1]
    sid = ha_sid(kind, vmid)
    if sid:
        # follows qemu-server PVE/API2/Qemu.pm vm_start / pve-container API2/LXC/Status.pm vm_start:
        # an HA resource is only asked to start (`ha-manager set <sid> --state started`)
        print(f"Requesting HA start for {label} {vmid}")
        ha_set_state(sid, "started")
        return
    with config_lock(kind, vmid):
        conf = load(kind, vmid)
        if status_of(kind, vmid) == "running":
            raise ApiError(f"{label} {vmid} already running")
        check_lock(kind, conf)
        if kind == "lxc":
            conf = apply_pending(vmid, conf)
        devices = check_lxc_start(conf) if kind == "lxc" else check_qemu_start(conf, vmid)
        boot_guest(kind, vmid, conf, devices=devices)


def apply_pending(vmid, conf):
    """A CT's [pve:pending] keys moved into its config (follows pve-container src/PVE/LXC.pm
    vm_start: "apply pending changes while starting", vmconfig_apply_pending; the poststop hook
    does the same when a CT stops)."""
    rest = conf["rest"]
    if not rest.startswith("[pve:pending]\n"):
        return conf
    section, _, others = rest[len("[pve:pending]\n"):].partition("\n[")
    for line in section.splitlines():
        k, sep, v = line.partition(":")
        if sep and k.strip():
            ts.conf_set(conf, k.strip(), v.strip())
    conf["rest"] = ("[" + others) if others else ""
    save("lxc", vmid, conf)
    return conf


def boot_guest(kind, vmid, conf, action="start", devices=None):
    if kind == "lxc":
        ct_boot(vmid, conf)
    else:
        kvm_spawn(vmid)
        write_reservations(vmid, devices or [])
    set_run_state(kind, vmid, "running")
    ts.log_guest(action, kind, vmid)


def stop(kind, vmid, action="stop", timeout=None):
    load(kind, vmid)  # refuses a guest without a config
    label = KINDS[kind][1]
    running = status_of(kind, vmid) == "running"
    if kind == "lxc" and not running:
        # follows pve-container src/PVE/API2/LXC/Status.pm vm_stop/vm_shutdown: refused for a stopped CT
        raise ApiError(f"CT {vmid} not running")
    sid = ha_sid(kind, vmid)
    if sid:
        # follows qemu-server PVE/API2/Qemu.pm vm_shutdown/vm_stop and pve-container's: an HA resource
        # is not stopped here, a stop request is queued for the HA manager (ha-manager crm-command stop)
        print(f"Requesting HA stop for {label} {vmid}")
        ha_queue(f"stop {sid} {0 if action == 'stop' else (timeout if timeout is not None else 60)}")
        return
    if not running:
        return  # follows qemu-server PVE/QemuServer.pm _do_vm_stop(): no process, nothing to do, success
    with config_lock(kind, vmid):
        check_lock(kind, load(kind, vmid))
        halt_guest(kind, vmid, action)
        if kind == "lxc":  # src/lxc-pve-poststop-hook applies pending changes
            apply_pending(vmid, load(kind, vmid))


def halt_guest(kind, vmid, action):
    if kind == "lxc":
        ct_halt(vmid)
    else:
        kvm_kill(vmid)
        write_reservations(vmid, [])  # qemu-server vm_stop_cleanup: remove_pci_reservation
    set_run_state(kind, vmid, "stopped")
    ts.log_guest(action, kind, vmid)


# ---------------------------------------------------------------- config locks

# follows pve-container PVE/LXC/Config.pm / qemu-server PVE/QemuConfig.pm config_file_lock()
CONFIG_LOCK = {"lxc": "/run/lock/lxc/pve-config-{}.lock", "qemu": "/var/lock/qemu-server/lock-{}.conf"}


class config_lock:
    """The guest's config flock, waited for up to 10 s (pve-guest-common PVE/AbstractConfig.pm
    lock_config() over PVE::Tools lock_file_full())."""

    def __init__(self, kind, vmid, timeout=10):
        self.name = CONFIG_LOCK[kind].format(vmid)
        self.timeout = timeout

    def __enter__(self):
        full = ts.path(self.name)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        self.fh = open(full, "a")
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(self.fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    self.fh.close()
                    raise ApiError(f"can't lock file '{self.name}' - got timeout") from None
                time.sleep(0.05)

    def __exit__(self, *exc):
        self.fh.close()


def check_lock(kind, conf):
    """pve-guest-common PVE/AbstractConfig.pm check_lock(): a `lock:` in the config refuses."""
    lock = ts.conf_get(conf, "lock")
    if lock:
        raise ApiError(f"{KINDS[kind][1]} is locked ({lock})")


# ---------------------------------------------------------------- pvecm (pve-cluster)

COROSYNC_CONF = "/etc/pve/corosync.conf"


def corosync_nodelist(text):
    """[(nodeid, name, votes, ring0_addr)] of corosync.conf's nodelist, by node id."""
    nodes = []
    for block in re.findall(r"node\s*\{([^{}]*)\}", text):
        kv = dict(re.findall(r"^\s*(\w+):\s*(\S+)", block, re.M))
        nodes.append((int(kv.get("nodeid", 0)), kv.get("name", ""), int(kv.get("quorum_votes", 1)),
                      kv.get("ring0_addr", "")))
    return sorted(nodes)


def pvecm(argv):
    """`pvecm status` and `pvecm nodes`: this node's view of its cluster, from /etc/pve/corosync.conf
    (its nodelist) and /etc/pve/.members (who is online now: the twin's corosync membership).
    pve-cluster src/PVE/CLI/pvecm.pm status/nodes (the totem lines, then exec corosync-quorumtool
    -siH / -l) and corosync tools/corosync-quorumtool.c show_status/display_quorum_data/
    display_nodes_data: the layout, votequorum's numbers (expected = the nodelist's votes, quorum =
    more than half of them) and the exit status, 2 while not quorate."""
    cmd = argv[0] if argv else ""
    if cmd not in ("status", "nodes"):
        ts.die(f"ERROR: unknown command 'pvecm {' '.join(argv)}'", 255)
    conf = ts.read(COROSYNC_CONF)
    if conf is None:  # PVE::Corosync::check_conf_exists
        ts.die(f"Error: Corosync config '{COROSYNC_CONF}' does not exist - is this node part of a cluster?", 255)
    members = json.loads(ts.read("/etc/pve/.members") or "{}")
    me = members.get("nodename") or os.uname().nodename
    online = {n for n, v in (members.get("nodelist") or {}).items() if v.get("online")}
    nodes = corosync_nodelist(conf)
    # the membership corosync sees from this node: the nodes online now (a node alone sees itself)
    seen = [n for n in nodes if n[1] in online] or [n for n in nodes if n[1] == me]
    mine = next((n for n in nodes if n[1] == me), (0, me, 1, ""))
    expected = sum(n[2] for n in nodes)
    total = sum(n[2] for n in seen)
    quorum = expected // 2 + 1
    quorate = total >= quorum
    out = []
    if cmd == "status":
        totem = dict(re.findall(r"^\s*(\w+):\s*(\S+)", (re.search(r"totem\s*\{([^{}]*)\}", conf) or ["", ""])[1], re.M))
        out += ["Cluster information", "-------------------"]
        for label, key, default in (("Name", "cluster_name", "UNKOWN?"), ("Config Version", "config_version", "-1"),
                                    ("Transport", "transport", "knet"), ("Secure auth", "secauth", "off")):
            out.append(f"{label + ':':<17} {totem.get(key, default)}")
        # the twin keeps no totem ring sequence: the ring's number is its members' count
        out += ["", "Quorum information", "------------------", f"Date:             {time.ctime()}",
                "Quorum provider:  corosync_votequorum", f"Nodes:            {len(seen)}",
                f"Node ID:          0x{mine[0]:08x}", f"Ring ID:          {seen[0][0]:x}.{len(seen):x}",
                f"Quorate:          {'Yes' if quorate else 'No'}", "",
                "Votequorum information", "----------------------",
                f"Expected votes:   {expected}", f"Highest expected: {expected}", f"Total votes:      {total}",
                f"Quorum:           {quorum} {' ' if quorate else 'Activity blocked'}",
                f"Flags:            {'Quorate ' if quorate else ''}"]
    out += ["", "Membership information", "----------------------", f"{'Nodeid':>10} {'Votes':>10} Name"]
    for nodeid, name, votes, addr in seen:
        shown = (f"0x{nodeid:08x}" if cmd == "status" else f"{nodeid:>10}") + f" {votes:>10} "
        out.append(shown + (addr if cmd == "status" else name) + (" (local)" if name == me else ""))
    print("\n".join(out))
    return 0 if quorate or cmd == "nodes" else 2


# ---------------------------------------------------------------- HA (pve-ha-manager)

HA_RESOURCES = "/etc/pve/ha/resources.cfg"
HA_COMMANDS = "/etc/pve/ha/crm_commands"
HA_DAEMON = "/var/lib/twin/ha.json"  # the twin's CRM/LRM: {"mode": "active"|"stalled", "delay_s": 1}
# the CRM's state (pve-ha-manager PVE/HA/Manager.pm, ha/manager_status); the twin keeps only the
# service_status of services being moved: {"service_status": {sid: {"state", "node", "target"}}}
HA_MANAGER_STATUS = "/etc/pve/ha/manager_status"


def ha_read():
    """resources.cfg as [(type, name, {key: value})] in file order."""
    out: list[tuple[str, str, dict[str, str]]] = []
    for line in (ts.read(HA_RESOURCES) or "").splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = re.match(r"^(\S+):\s*(\S+)\s*$", line)
        if m and not line[0].isspace():
            out.append((m.group(1).lower(), m.group(2), {}))
        elif out:
            k, _, v = line.strip().partition(" ")
            out[-1][2][k] = v.strip()
    return out


def ha_write(resources):
    ts.write(HA_RESOURCES, "\n".join(f"{t}: {n}\n" + "".join(f"\t{k} {v}\n" for k, v in opts.items())
                                     for t, n, opts in resources))


def ha_sid(kind, vmid):
    """`vm:300`/`ct:200` when the guest is an HA resource HA does not ignore, else None."""
    # follows pve-ha-manager src/PVE/HA/Config.pm vm_is_ha_managed(): vm:<id> or ct:<id>, state "ignored" = unmanaged
    if not os.path.exists(ts.path(HA_RESOURCES)):
        return None
    for t, n, opts in ha_read():
        if n == str(vmid) and t in ("vm", "ct") and opts.get("state") != "ignored":
            return f"{t}:{n}"
    return None


def ha_set_state(sid, state):
    resources = ha_read()
    for t, n, opts in resources:
        if f"{t}:{n}" == sid:
            opts["state"] = state
            ha_write(resources)
            return
    raise ApiError(f"resource '{sid}' is not HA managed")


def ha_queue(command):
    """pve-ha-manager PVE/HA/Config.pm queue_crm_commands(): one line appended to ha/crm_commands."""
    ts.write(HA_COMMANDS, (ts.read(HA_COMMANDS) or "") + command + "\n")


def ha_age(p):
    try:
        return time.time() - os.stat(ts.path(p)).st_mtime
    except FileNotFoundError:
        return None


def ha_step():
    """What the HA stack would have done by now, run lazily by every pct/qm/pvesh/ha-manager call
    (and lxc-ls/lxc-info, which the facts run instead of pct list).
    The CRM takes queued commands after `delay_s` (a `stop` sets the resource's requested state to
    stopped: pve-ha-manager PVE/HA/Manager.pm), and the LRM brings each guest to its requested
    state `delay_s` after resources.cfg last changed. mode "stalled" (no quorum, dead CRM): never."""
    if not os.path.exists(ts.path(HA_RESOURCES)):
        return
    daemon = json.loads(ts.read(HA_DAEMON, "{}") or "{}")
    if daemon.get("mode", "active") != "active":
        return
    delay = float(daemon.get("delay_s", 1))
    commands = (ts.read(HA_COMMANDS) or "").split("\n")
    status = json.loads(ts.read(HA_MANAGER_STATUS) or "{}").get("service_status", {})
    moving = dict(status)
    if any(c.strip() for c in commands) and (ha_age(HA_COMMANDS) or 0) >= delay:
        ts.write(HA_COMMANDS, "")
        for c in commands:
            words = c.split()
            if words[:1] == ["stop"] and len(words) >= 2:
                try:
                    ha_set_state(words[1], "stopped")
                except ApiError:
                    pass
            elif words[:1] in (["migrate"], ["relocate"]) and len(words) >= 3:
                # Manager.pm update_crm_commands + next_state_started: a target that is online and
                # not the service's node puts a started service into state migrate/relocate
                sid, target = words[1], words[2]
                where = vmlist().get(sid.partition(":")[2], {}).get("node")
                online = json.loads(ts.read("/etc/pve/.members") or "{}").get("nodelist", {}).get(target, {})
                wanted = {f"{t}:{n}": o.get("state", "started") for t, n, o in ha_read()}
                if where and where != target and online.get("online") and wanted.get(sid) in ("started", "enabled"):
                    moving[sid] = {"state": words[0], "node": where, "target": target}
    for sid, st in list(moving.items()):
        t, _, n = sid.partition(":")
        kind = "lxc" if t == "ct" else "qemu"
        if st.get("node") != node() or not n.isdigit() or ts.read(conf_path(kind, int(n))) is None:
            continue  # the LRM of the service's node does the move
        if st["state"] == "relocate":
            # PVE/HA/Resources/PVEVM.pm migrate(): not online (relocate): shut down if running, then
            # migrate_vm offline with force (local resources not checked); the target's LRM starts it
            if status_of(kind, int(n)) == "running":
                halt_guest(kind, int(n), "ha-relocate")
            target_dir = ts.path(f"/etc/pve/nodes/{st['target']}/{KINDS[kind][0]}")
            os.makedirs(target_dir, exist_ok=True)
            os.rename(ts.path(conf_path(kind, int(n))), os.path.join(target_dir, f"{n}.conf"))
            if ts.read("/etc/pve/.vmlist") is not None:
                ts.write("/etc/pve/.vmlist", json.dumps({"version": 1, "ids": vmlist()}, indent=1) + "\n")
        # an online migrate: the twin does no live migration; Manager.pm next_state_migrate_relocate
        # keeps the service on its node when the LRM reports the failure
        del moving[sid]
    if moving != status:
        ts.write(HA_MANAGER_STATUS, json.dumps({"service_status": moving}) + "\n")
    if (ha_age(HA_RESOURCES) or 0) < delay:
        return
    for t, n, opts in ha_read():
        kind = "lxc" if t == "ct" else "qemu"
        if not n.isdigit() or ts.read(conf_path(kind, int(n))) is None:
            continue
        want, have = opts.get("state", "started"), status_of(kind, int(n))
        if want in ("stopped", "disabled") and have == "running":
            halt_guest(kind, int(n), "ha-stop")
        elif want in ("started", "enabled") and have != "running":
            try:
                conf = load(kind, int(n))
                devices = check_lxc_start(conf) if kind == "lxc" else check_qemu_start(conf, int(n))
                boot_guest(kind, int(n), conf, "ha-start", devices=devices)
            except ApiError:
                pass  # real HA retries and then sets the service to "error"


def ha_manager(argv):
    """ha-manager crm-command stop <sid> <timeout> | set <sid> --state S | remove <sid> | status."""
    try:
        ha_step()
        if argv[:2] in (["crm-command", "migrate"], ["crm-command", "relocate"]) and len(argv) >= 4:
            # PVE/API2/HA/Resources.pm migrate/relocate: service_is_ha_managed, then the request is
            # queued for the CRM (PVE::HA::Config::queue_crm_commands); the target is checked by the CRM
            if argv[2] not in {f"{t}:{n}" for t, n, _ in ha_read()}:
                raise ApiError(f"resource '{argv[2]}' is not HA managed")
            ha_queue(f"{argv[1]} {argv[2]} {argv[3]}")
            return 0
        if argv[:2] == ["crm-command", "stop"] and len(argv) >= 4:
            if argv[2] not in {f"{t}:{n}" for t, n, _ in ha_read()}:
                raise ApiError(f"resource '{argv[2]}' is not HA managed")
            ha_queue(f"stop {argv[2]} {argv[3]}")
            return 0
        if argv[:1] == ["set"] and len(argv) >= 2:
            opts, _ = parse_opts(argv[2:])
            for k, v in opts:
                if k == "state":
                    ha_set_state(argv[1], v)
            return 0
        if argv[:1] == ["remove"] and len(argv) >= 2:
            rest = [r for r in ha_read() if f"{r[0]}:{r[1]}" != argv[1]]
            ha_write(rest)
            return 0
        if argv[:1] == ["status"]:
            for t, n, opts in ha_read():
                kind = "lxc" if t == "ct" else "qemu"
                print(f"service {t}:{n} ({node()}, {opts.get('state', 'started')}) {status_of(kind, int(n))}")
            return 0
    except ApiError as e:
        ts.die(str(e), 255)
    ts.die("ERROR: unknown command 'ha-manager " + " ".join(argv[:1]) + "'", 255)


def reboot(kind, vmid):
    load(kind, vmid)
    if status_of(kind, vmid) != "running":
        raise ApiError(f"{KINDS[kind][1]} {vmid} not running")
    conf = load(kind, vmid)
    if kind == "lxc":  # stop (the poststop hook) and start both apply pending changes
        conf = apply_pending(vmid, conf)
        check_lxc_start(conf)
    else:
        check_qemu_start(conf, vmid)
    if kind == "lxc":
        ct_kill(vmid)
        ct_boot(vmid, conf)
    ts.log_guest("reboot", kind, vmid)


def vmlist():
    """{vmid: {"node", "type"}} of every node, what pmxcfs's .vmlist holds (status.c), from the
    configs under /etc/pve/nodes/ (a cluster twin shares them)."""
    out = {}
    base = ts.path("/etc/pve/nodes")
    for n in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        for kind, (sub, _) in KINDS.items():
            d = os.path.join(base, n, sub)
            for f in sorted(os.listdir(d)) if os.path.isdir(d) else []:
                if f.endswith(".conf") and f[:-5].isdigit():
                    out[f[:-5]] = {"node": n, "type": kind, "version": 1}
    return out


def create_guest(kind, vmid, opts):
    # pve-cluster Cluster.pm check_vmid_unused: a guest id is the cluster's, whatever its node
    other = vmlist().get(str(vmid))
    if other is not None:
        raise ApiError(f"{'VM' if other['type'] == 'qemu' else 'CT'} {vmid} already exists on node '{other['node']}'")
    ts.write(conf_path(kind, vmid), "")
    if ts.read("/etc/pve/.vmlist") is not None:
        ts.write("/etc/pve/.vmlist", json.dumps({"version": 1, "ids": vmlist()}, indent=1) + "\n")
    verify_params(kind, [(k, v) for k, v in opts if k not in ("ostemplate", "storage", "password")])
    update_config(kind, vmid, [(k, v) for k, v in opts if k not in ("ostemplate", "storage", "password", "start")], [])


# ---------------------------------------------------------------- VMs: a process per running VM

QEMU_RUN = "/var/run/qemu-server"


def kvm_pidfile(vmid):
    # follows qemu-server PVE/QemuServer/Helpers.pm pidfile_name(): <var_run_tmpdir>/<vmid>.pid
    return f"{QEMU_RUN}/{vmid}.pid"


def daemon(program, argv):
    """Start `program` (argv[0] as given) detached, as a daemon is (a new session, its parent
    gone, stdio on /dev/null); its pid as text. QEMU with -daemonize and lxc's monitor/init run
    so; here the twin's VM processes and CT inits."""
    r, w = os.pipe()
    first = os.fork()
    if first == 0:
        try:
            os.close(r)
            os.setsid()
            if os.fork():
                os._exit(0)
            null = os.open("/dev/null", os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.write(w, str(os.getpid()).encode())
            os.close(w)
            os.execvp(program, argv)
        finally:
            os._exit(1)
    os.close(w)
    os.waitpid(first, 0)
    with os.fdopen(r) as f:
        return f.read().strip()


def kvm_spawn(vmid):
    """A running VM is a process, as on a real node: argv[0] ends in `kvm` and `-pidfile` names
    its pid file, which holds its pid (qemu-server PVE/QemuServer.pm config_to_command passes
    `-id`, `-pidfile` and `-daemonize`; QEMU writes the file). The process only sleeps; it dies
    with the twin (its PID namespace); at the next boot it starts again only with `onboot: 1` (onboot())."""
    if ts.ROOT != "/":
        return  # a TWIN_ROOT run on the build machine starts no process
    kvm_kill(vmid)
    pidfile = kvm_pidfile(vmid)
    os.makedirs(QEMU_RUN, exist_ok=True)
    pid = daemon("/usr/bin/python3", ["/usr/bin/kvm", "-ISc", "import signal\nwhile True: signal.pause()",
                                      "-id", str(vmid), "-name", f"VM{vmid}", "-pidfile", pidfile, "-daemonize"])
    if pid:
        ts.write(pidfile, pid + "\n")


def kvm_kill(vmid):
    """qm stop: the VM's process ends and its pid file goes (qemu-server vm_stop)."""
    if ts.ROOT != "/":
        return
    pidfile = kvm_pidfile(vmid)
    try:
        pid = int((ts.read(pidfile) or "").strip())
    except ValueError:
        pid = 0
    if pid and f"-pidfile\0{pidfile}\0" in _cmdline(pid):
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
        for _ in range(100):
            if not _cmdline(pid):
                break
            time.sleep(0.01)
    try:
        os.unlink(pidfile)
    except FileNotFoundError:
        pass


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read()
    except OSError:
        return ""


def startall_onboot_delay():
    """The node's `startall-onboot-delay` (seconds, 0 = none) from this node's own config,
    /etc/pve/nodes/<node>/config (a cluster twin's other nodes have their own files)."""
    # pve-manager PVE/NodeConfig.pm load_config/config_file: /etc/pve/nodes/<node>/config; a
    # missing or unreadable file is an empty config
    text = ts.read(f"/etc/pve/nodes/{node()}/config") or ""
    value = None
    # pve-common PVE/JSONSchema.pm parse_config: each line trimmed, `#` lines are the node's
    # description, else `key: value` (the last one of a key counts)
    for line in text.splitlines():
        line = line.strip()
        m = re.match(r"(\S+?):\s*(.*)$", line)
        if line and not line.startswith("#") and m and m.group(1) == "startall-onboot-delay":
            value = m.group(2)
    # PVE/NodeConfig.pm schema: an integer 0..300 (JSONSchema is_integer: optional sign, digits);
    # parse_config drops a key that fails it (a warning only), leaving the default 0
    if value is None or not re.fullmatch(r"[+-]?\d+", value) or not 0 <= int(value) <= 300:
        return 0
    return int(value)


def onboot():
    """At the twin's boot (tests/twin/runtime.py), as pve-guests.service does on a real node: no
    guest survives the reboot (every one is stopped now); then the node's `startall-onboot-delay`
    seconds pass (startall_onboot_delay()); then only the guests whose config says `onboot: 1`
    start again, by `startup: order=` and then VMID, each start followed by its
    `startup: up=` seconds (3 for a VM without `up`, none for a CT) before the next. A template or
    an HA resource is not started here (the HA stack starts the latter: ha_step); a start qm/pct
    would refuse fails and leaves the guest stopped (the delay still follows it)."""
    # pve-manager services/pve-guests.service: at boot `pvesh create /nodes/localhost/startall`
    # pve-manager PVE/API2/Nodes.pm startall + get_start_stop_list(): without force only onboot=1
    # guests of this node, HA-managed and templates skipped, ascending startup order then vmid
    for key in sorted(run_state()):
        kind, _, vmid = key.partition("/")
        set_run_state(kind, int(vmid), "stopped")
    # pve-guests.service's ExecStartPre, pve-manager bin/pve-startall-delay (PVE 8 and 9 alike):
    # a set, non-zero node delay is warned about on stderr (the journal) and slept before startall
    delay = startall_onboot_delay()
    if delay:
        sys.stderr.write(f"Delaying on-boot 'startall' command for {delay} second(s).\n")
        sys.stderr.flush()
        time.sleep(delay)
    todo = []
    for kind in ("qemu", "lxc"):
        for vmid in guest_ids(kind):
            try:
                conf = load(kind, vmid)
            except ApiError:
                continue
            # a boolean key: 1|on|yes|true (pve-common PVE/JSONSchema.pm parse_boolean; qemu-server check_type)
            on = {k: (ts.conf_get(conf, k) or "").lower() in ("1", "on", "yes", "true") for k in ("onboot", "template")}
            if not on["onboot"] or on["template"] or ha_sid(kind, vmid):
                continue
            startup = ts.prop_string(ts.conf_get(conf, "startup") or "")  # "[order=]N[,up=S][,down=S]"
            order = startup.get("order", startup.get("_", ""))
            up = startup.get("up", "")
            # startall: the wait after a start is `up` when set (0 included), else 3 s for a VM
            # (spreading the load of the starts) and none for a CT
            delay = int(up) if up.isdigit() else 3 if kind == "qemu" else 0
            todo.append((int(order) if order.isdigit() else sys.maxsize, vmid, kind, delay))
    for _, vmid, kind, delay in sorted(todo):
        try:
            conf = load(kind, vmid)
            if kind == "lxc":
                conf = apply_pending(vmid, conf)
            devices = check_lxc_start(conf) if kind == "lxc" else check_qemu_start(conf, vmid)
            boot_guest(kind, vmid, conf, "onboot", devices=devices)
        except ApiError:
            # startall warns 'Starting VM <vmid> failed' and goes on with the next guest
            ts.log_guest("onboot-failed", kind, vmid)
        # startall waits after every start it hands to a worker, one that fails in it included
        # (qemu-server PVE/API2/Qemu.pm and pve-container PVE/API2/LXC/Status.pm vm_start do their
        # checks in the forked task); the twin's start is done before it waits, never sooner
        time.sleep(delay)


# ---------------------------------------------------------------- containers: own root, own /dev

CT_DIR = "/var/lib/twin/ct"  # host-fs dir the runtime bind-mounts rw (overlay upper/work live here)
CT_BASE = "/var/lib/twin/ctbase"  # the pristine bookworm root, ro: every CT's lowerdir
BASIC_NODES = (("null", 1, 3), ("zero", 1, 5), ("full", 1, 7), ("random", 1, 8), ("urandom", 1, 9),
               ("tty", 5, 0))


def twin_char_node(path):
    """(major, minor, mode) of the char node `path` in the twin's /dev, else None."""
    try:
        st = os.stat(ts.path(path))
        if stat.S_ISCHR(st.st_mode):
            return os.major(st.st_rdev), os.minor(st.st_rdev), stat.S_IMODE(st.st_mode)
    except OSError:
        pass
    for n in json.loads(ts.read("/var/lib/twin/hw/dev.json", "[]") or "[]"):  # TWIN_ROOT runs
        if n["path"] == path and os.path.exists(ts.path(path)):
            mode = n.get("mode", 0o666)
            return n["major"], n["minor"], int(mode, 8) if isinstance(mode, str) else mode
    return None


def twin_nodes_below(path):
    """Char nodes at or below `path` in the twin's /dev: [(path, major, minor, mode)]."""
    full = ts.path(path)
    if os.path.isdir(full) and not os.path.islink(full):
        out = []
        for name in sorted(os.listdir(full)):
            out += twin_nodes_below(f"{path.rstrip('/')}/{name}")
        return out
    node = twin_char_node(path)
    return [(path, *node)] if node else []


def cgroup_allows(rules, major, minor):
    """lxc.cgroup2.devices.allow rules ('a', 'c 195:* rwm', 'c 511:0 rw') cover char major:minor."""
    for rule in rules:
        words = rule.split()
        if words[:1] == ["a"]:
            return True
        if len(words) >= 2 and words[0] in ("c", "a"):
            want_major, _, want_minor = words[1].partition(":")
            if want_major in ("*", str(major)) and want_minor in ("*", str(minor)):
                return True
    return False


def ct_devices(vmid, conf):
    """The nodes a start of CT `vmid` creates in its /dev, from both config syntaxes:
    [{"path": "/dev/nvidia0", "major": 195, "minor": 0, "mode": 438, "uid": 0, "gid": 44}].

    devN: <path>[,gid=,uid=,mode=]  (PVE >= 8.1: node plus cgroup access). Raw (older PVE):
    lxc.mount.entry: /dev/X dev/X none bind,optional,create=file|dir  makes nodes; only those an
    lxc.cgroup2.devices.allow rule covers are kept (the cgroup denies the others: NVML cannot open
    them either, so they are left out rather than modelled as unopenable).
    """
    out = {}
    rules = [v for k, v in conf["keys"] if k in ("lxc.cgroup2.devices.allow", "lxc.cgroup.devices.allow")]
    for k, v in conf["keys"]:
        if re.fullmatch(r"dev\d+", k):
            p = ts.prop_string(v)
            path = p.get("path", p.get("_"))
            node = twin_char_node(path)
            if node is None:
                raise ApiError(f"Device {path} does not exist")
            major, minor, _host_mode = node
            uid, gid = int(p.get("uid", 0)), int(p.get("gid", 0))
            # follows pve-container src/lxc-pve-prestart-hook (passthrough devices): mode 0660 unless
            # mode= is given (never the host node's), owner uid=/gid= (default 0) mapped through the CT's
            # idmap on the host; inside the CT (here: no user namespace) the node shows the CT's own ids
            out[path] = {"path": path, "major": major, "minor": minor,
                         "mode": int(p["mode"], 8) if "mode" in p else 0o660,
                         "uid": uid, "gid": gid,
                         "host_uid": map_ct_id(conf, "u", uid), "host_gid": map_ct_id(conf, "g", gid)}
        elif k == "lxc.mount.entry":
            words = v.split()
            if len(words) < 4 or "bind" not in words[3].split(","):
                continue
            src, dst, opts = words[0], words[1].strip("/"), words[3].split(",")
            if not (src.startswith("/dev/") and (dst == "dev" or dst.startswith("dev/"))):
                continue  # only /dev binds are modelled
            nodes = twin_nodes_below(src)
            if not nodes and "optional" not in opts:
                raise ApiError(f"startup for container '{vmid}' failed")
            for path, major, minor, mode in nodes:
                inside = "/" + dst + path[len(src):]
                if cgroup_allows(rules, major, minor):
                    out[inside] = {"path": inside, "major": major, "minor": minor, "mode": mode,
                                   "uid": 0, "gid": 0}
    return sorted(out.values(), key=lambda d: d["path"])


def map_ct_id(conf, which, ct_id):
    """A CT uid/gid as the host sees it: lxc.idmap lines, else an unprivileged CT's default map
    (0 -> 100000, 65536 ids), else (privileged) itself (pve-container PVE/LXC.pm map_ct_uid_to_host)."""
    maps = [v.split() for k, v in conf["keys"] if k == "lxc.idmap"]
    if not maps and ts.conf_get(conf, "unprivileged") == "1":
        maps = [[which, "0", "100000", "65536"]]
    if not maps:
        return ct_id
    for m in maps:
        if len(m) == 4 and m[0] == which and int(m[1]) <= ct_id < int(m[1]) + int(m[3]):
            return int(m[2]) + ct_id - int(m[1])
    return 65534  # unmapped: nobody/nogroup


def ct_boot(vmid, conf):
    """pct start: the CT's dirs exist, its /dev is decided now (a config change needs a restart)."""
    base = ts.path(f"{CT_DIR}/{vmid}")
    for sub in ("upper", "work", "root"):
        os.makedirs(os.path.join(base, sub), exist_ok=True)
    hostname = ts.conf_get(conf, "hostname") or f"CT{vmid}"
    ts.write(f"{CT_DIR}/{vmid}/devices.json",
             json.dumps({"vmid": vmid, "hostname": hostname, "booted_at": ts.state().get("booted_at"),
                         "devices": ct_devices(vmid, conf)}, indent=1))
    ct_mount(vmid)
    ct_init(vmid)


def ct_init(vmid):
    """The CT's init: one process that lives as long as the CT runs, in the CT's root with its
    own /dev (the same enter script as `pct exec`), detached from the caller. Its pid is what
    `lxc-info -n <vmid> -p` answers (pve-container PVE/LXC.pm find_lxc_pid asks lxc-info), and
    /proc/<pid>/root is the CT's root as its processes see it. `pct stop` ends it (ct_kill)."""
    if ts.ROOT != "/":
        return  # a TWIN_ROOT run on the build machine starts no process
    snapshot = json.loads(ts.read(f"{CT_DIR}/{vmid}/devices.json"))
    script = ct_enter_script(vmid, snapshot)
    # unshare, sh and chroot exec in turn: the pid stays the init's
    pid = daemon("unshare", ["unshare", "--mount", "--uts", "--propagation", "private", "--",
                             "sh", "-c", script, "ct-init", "sleep", "infinity"])
    ts.write(f"{CT_DIR}/{vmid}/init.pid", pid + "\n")
    root = f"{CT_DIR}/{vmid}/root"
    for _ in range(200):  # up once its root is the CT's (the enter script has run)
        try:
            if os.readlink(f"/proc/{pid}/root").endswith(root) and _cmdline(pid).startswith("sleep\0"):
                return
        except OSError:
            return  # it died: lxc-info will say so
        time.sleep(0.01)


def ct_init_pid(vmid):
    """The pid of CT `vmid`'s init while it lives, else None."""
    if ts.ROOT != "/":
        return None
    try:
        pid = int((ts.read(f"{CT_DIR}/{vmid}/init.pid") or "").strip())
        alive = os.readlink(f"/proc/{pid}/root").endswith(f"{CT_DIR}/{vmid}/root")
    except (ValueError, OSError):
        return None
    return pid if alive else None


def ct_active():
    """The CTs lxc counts as running. Follows lxc src/lxc/lxccontainer.c list_active_containers
    (what lxc-ls --active prints, and what pve-container PVE/LXC.pm list_active_containers reads
    the same way): a CT runs while its monitor's command socket exists. Here: a CT marked running
    whose init lives (on the build machine without processes: the mark alone)."""
    ids = [int(k.split("/")[1]) for k, v in run_state().items() if k.startswith("lxc/") and v == "running"]
    return sorted(i for i in ids if ts.ROOT != "/" or ct_init_pid(i) is not None)


def lxc_ls(argv):
    """lxc-ls [--active] [-1]: CT names (the vmids on Proxmox VE), one per line with -1."""
    # follows lxc src/lxc/tools/lxc_ls.c: --active lists the running ones; -1 one name per line
    ha_step()  # the twin's HA acts lazily, at each call of its programs (lxc-ls too: facts call it)
    names = [str(i) for i in (ct_active() if "--active" in argv else guest_ids("lxc"))]
    if names:
        print("\n".join(names) if "-1" in argv or "--line" in argv else "  ".join(names))
    return 0


def lxc_info(argv):
    """lxc-info -n <name> [-p] [-s] [-H]: follows lxc src/lxc/tools/lxc_info.c print_info (one
    filter and -H: the bare value; a stopped CT has no PID line)."""
    name: str = ""
    flags: set[str] = set()
    rest = list(argv)
    while rest:
        a = rest.pop(0)
        if a in ("-n", "--name") and rest:
            name = rest.pop(0)
        elif a.startswith("--name="):
            name = a.split("=", 1)[1]
        elif a in ("--pid", "--state", "--no-humanize"):
            flags.add({"--pid": "p", "--state": "s", "--no-humanize": "H"}[a])
        elif re.fullmatch(r"-[psH]+", a):
            flags.update(a[1:])
        else:
            ts.die(f"lxc-info: unrecognized option '{a}'", 1)
    if not name:
        ts.die("lxc-info: missing container name, use --name option", 1)
    vmid = int(name) if name.isdigit() else None
    if vmid is None or vmid not in guest_ids("lxc"):
        ts.die(f"{name} doesn't exist", 1)
    raw, state, want_pid = "H" in flags, "s" in flags, "p" in flags
    ha_step()
    pid = ct_init_pid(vmid) if vmid in ct_active() else None
    count = int(state) + int(want_pid)
    if state:
        value = "RUNNING" if pid or vmid in ct_active() else "STOPPED"
        print(value if raw and count == 1 else f"{'State:':<15} {value}")
    if want_pid and pid:
        print(pid if raw and count == 1 else f"{'PID:':<15} {pid}")
    return 0


def ct_halt(vmid):
    """pct stop/shutdown: every process of the CT ends, its root is unmounted, its /dev snapshot goes."""
    ct_kill(vmid)
    ct_umount(vmid)
    try:
        os.unlink(ts.path(f"{CT_DIR}/{vmid}/devices.json"))
    except FileNotFoundError:
        pass


def ct_mount(vmid):
    """Mount the CT's root once, in the twin, while it runs (as LXC does). Every exec shares this
    overlay: two overlays on one upper/work dir corrupt each other (seen: parallel execs)."""
    if ts.ROOT != "/":
        return  # a TWIN_ROOT run on the build machine mounts nothing
    d = f"{CT_DIR}/{vmid}"
    with open(f"{d}/.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.ismount(f"{d}/root"):
            return
        if not (os.path.isdir(f"{CT_BASE}/usr") and os.path.ismount(CT_DIR)):
            raise ApiError(f"twin: {CT_DIR} and {CT_BASE} are not mounted (the twin runtime mounts them at boot)")
        import subprocess  # here, not at the top: pct list / qm list / pveversion run on every converge

        r = subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                            f"lowerdir={CT_BASE},upperdir={d}/upper,workdir={d}/work", f"{d}/root"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise ApiError(f"startup for container '{vmid}' failed: {r.stderr.strip()}")


def ct_umount(vmid):
    root = f"{CT_DIR}/{vmid}/root"
    if ts.ROOT == "/" and os.path.ismount(root):
        import subprocess

        if subprocess.run(["umount", root], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", root], check=True)  # a dying exec's namespace still holds it


def ct_kill(vmid):
    """SIGKILL the processes chrooted in CT `vmid`'s root (what `pct exec` left running)."""
    if ts.ROOT != "/":
        return  # a TWIN_ROOT run on the build machine: this /proc is not the twin's
    suffix = f"{CT_DIR}/{vmid}/root"
    for _ in range(100):
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                try:
                    if os.readlink(f"/proc/{entry}/root").endswith(suffix):
                        pids.append(int(entry))
                except OSError:  # gone, or a zombie
                    pass
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


def ct_enter_script(vmid, snapshot):
    """sh script (run under unshare --mount --uts) that completes CT `vmid`'s mounted root with its
    own /dev, /proc, /sys, /run (private to this exec) and execs "$@" in it."""
    r, q = f"{CT_DIR}/{vmid}/root", shlex.quote
    lines = [
        "set -e",
        f"mountpoint -q {r} || {{ echo 'twin: the root of CT {vmid} is not mounted' >&2; exit 255; }}",
        f"hostname {q(snapshot['hostname'])} 2>/dev/null || true",
        f"mount -t tmpfs -o mode=755,size=16m,nosuid dev {r}/dev",
    ]
    for name, major, minor in BASIC_NODES:
        lines.append(f"mknod -m 666 {r}/dev/{name} c {major} {minor}")
    lines += [f"mkdir {r}/dev/pts {r}/dev/shm",
              f"mount -t devpts -o newinstance,ptmxmode=0666,mode=620,gid=5 devpts {r}/dev/pts",
              f"ln -s pts/ptmx {r}/dev/ptmx",
              f"mount -t tmpfs -o mode=1777,nosuid,nodev shm {r}/dev/shm",
              f"ln -s /proc/self/fd {r}/dev/fd"]
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        lines.append(f"ln -s /proc/self/fd/{fd} {r}/dev/{name}")
    for dev in snapshot["devices"]:
        node = q(r + dev["path"])
        lines.append(f"mkdir -p $(dirname {node}) && mknod -m {dev['mode']:o} {node} c {dev['major']} {dev['minor']}"
                     f" && chown {dev['uid']}:{dev['gid']} {node}")
    tw = f"{r}/run/twin/root"
    lines += [
        f"mount --rbind /proc {r}/proc",
        f"mount --rbind /sys {r}/sys && mount -o remount,bind,ro {r}/sys",
        # sub-mounts too (a live twin's rebind files): follows lxc's sys:mixed default, where a CT
        # cannot write the PCI bus files
        f"for m in $(awk -v p={r}/sys/ 'index($5, p) == 1 {{print $5}}' /proc/self/mountinfo); do "
        "mount -o remount,bind,ro \"$m\"; done",
        f"mount -t tmpfs -o mode=755,size=16m,nosuid,nodev run {r}/run",
        # the twin's state and nvidia-smi stand-in for the CT's /usr/bin/nvidia-smi (installer.py)
        f"mkdir -p {tw}/var/lib/twin {tw}/usr/local/lib/twin {tw}/usr/local/bin",
        f"mount --bind -o ro /var/lib/twin {tw}/var/lib/twin",
        f"mount --bind -o ro /usr/local/lib/twin {tw}/usr/local/lib/twin",
        f"touch {tw}/usr/local/bin/nvidia-smi && mount --bind -o ro /usr/local/bin/nvidia-smi {tw}/usr/local/bin/nvidia-smi",
        f"echo '{{\"vmid\": {vmid}}}' > {r}/run/twin/ct.json",
        # follows pve-container src/PVE/CLI/pct.pm exec: keep-env defaults to 1 on PVE 8 (lxc-attach
        # --keep-env), only SSL_CERT_FILE/SSL_CERT_DIR are dropped (clean_environment)
        f"exec chroot {r} /usr/bin/env -u SSL_CERT_FILE -u SSL_CERT_DIR container=lxc \"$@\"",
    ]
    return "\n".join(lines) + "\n"


def ct_cli(cmd, rest):
    """pct exec <id> [--] CMD... | pct push <id> <file> <dest> [--perms M] [--user U] [--group G]
    | pct pull <id> <path> <dest> [--perms M] [--user U] [--group G]: exec()s, exit status and
    output are the command's."""
    if not rest:
        raise ApiError(f"400 not enough arguments\npct {cmd} <vmid>")
    vmid = int(rest[0])
    load("lxc", vmid)
    if status_of("lxc", vmid) != "running":
        raise ApiError(f"container '{vmid}' not running!" if cmd == "exec"
                       else f"can only {cmd} files {'to' if cmd == 'push' else 'from'} a running CT")
    if cmd == "exec":
        command = rest[1:]
        if command[:1] == ["--"]:
            command = command[1:]
        if not command:
            raise ApiError("missing command")
        return ct_execvp(vmid, command)
    opts, pos = parse_opts(rest[1:])
    if len(pos) != 2:
        raise ApiError(f"400 wrong number of arguments\npct {cmd} <vmid> <file> <destination> [OPTIONS]")
    opts = dict(opts)
    src, dest = pos
    owner = f"{opts.get('user', '')}:{opts.get('group', '')}" if "user" in opts or "group" in opts else ""
    perms = opts.get("perms")
    if perms is not None:
        perms = f"{int(perms, 16 if perms.startswith('0x') else 8):o}"
    if cmd == "push":
        try:
            fd = os.open(src, os.O_RDONLY)
        except OSError as e:
            raise ApiError(f"unable to open file '{src}' - {e.strerror}") from e
        perms = perms or f"{stat.S_IMODE(os.fstat(fd).st_mode):o}"
        script = 'cat > "$1" && chmod "$2" "$1" && { [ -z "$3" ] || chown "$3" "$1"; }'
        os.dup2(fd, 0)
        return ct_execvp(vmid, ["sh", "-c", script, "push", dest, perms, owner])
    try:
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, int(perms or "644", 8))
    except OSError as e:
        raise ApiError(f"unable to open file '{dest}' - {e.strerror}") from e
    os.dup2(fd, 1)
    return ct_execvp(vmid, ["cat", "--", src])


def ct_execvp(vmid, command):
    snapshot = json.loads(ts.read(f"{CT_DIR}/{vmid}/devices.json", "null") or "null")
    if snapshot is None or snapshot.get("booted_at") != ts.state().get("booted_at"):
        # running, but its /dev is from an earlier boot (it was started again at boot: onboot), so
        # its /dev follows the config and the nodes of this boot
        ct_boot(vmid, apply_pending(vmid, load("lxc", vmid)))
        snapshot = json.loads(ts.read(f"{CT_DIR}/{vmid}/devices.json"))
    ct_mount(vmid)
    script = ct_enter_script(vmid, snapshot)
    sys.stdout.flush()
    os.execvp("unshare", ["unshare", "--mount", "--uts", "--propagation", "private", "--",
                          "sh", "-c", script, "pct-exec", *command])


# ---------------------------------------------------------------- PCI mappings

PCI_CFG = "mapping/pci.cfg"  # under /etc/pve; pve-guest-common src/PVE/Mapping/PCI.pm $FILENAME


def read_mappings(raw=None):
    """{id: {"map": [str], "description": str?, ...}} from /etc/pve/mapping/pci.cfg."""
    out: dict[str, dict] = {}
    cur = None
    for line in (ts.read("/etc/pve/" + PCI_CFG) or "" if raw is None else raw).splitlines():
        if not line.strip():
            cur = None
            continue
        if not line[0].isspace():
            cur = line.strip()
            out[cur] = {"map": []}
        elif cur:
            k, _, v = line.strip().partition(" ")
            if k == "map":
                out[cur]["map"].append(v)
            else:
                out[cur][k] = v
    return out


def write_mappings(maps):
    text = ""
    for mid, entry in maps.items():
        text += f"{mid}\n"
        for k in sorted(entry):
            if k == "map":
                text += "".join(f"\tmap {m}\n" for m in entry["map"])
            else:
                text += f"\t{k} {entry[k]}\n"
        text += "\n"
    ts.write("/etc/pve/" + PCI_CFG, text)


def locked_mappings(errmsg, code):
    """`code(maps, digest)` under the cluster lock of pci.cfg, reading the file inside it, as
    pve-guest-common PVE/Mapping/PCI.pm lock_pci_config (cfs_lock_file, 10 s) and pve-manager
    PVE/API2/Cluster/Mapping/PCI.pm do; an error is prefixed with `errmsg`. `digest`: sha1 of
    the raw file (pve-common SectionConfig parse_config)."""
    def locked():
        raw = ts.read("/etc/pve/" + PCI_CFG) or ""
        return code(read_mappings(raw), ts.digest(raw))
    try:
        return ts.cfs_lock(ts.cfs_file_lockid(PCI_CFG), locked)
    except (ApiError, TimeoutError) as e:
        raise ApiError(f"{errmsg}: {e}") from e


def check_map_strings(maps):
    for m in maps:
        p = ts.prop_string(m)
        missing = [k for k in ("node", "path", "id") if k not in p]
        if missing:
            raise ApiError("400 Parameter verification failed.\nmap: invalid format - missing property '"
                           + missing[0] + "'")


# ---------------------------------------------------------------- pvesh

def api(method, path, opts):
    parts = [p for p in path.strip("/").split("/") if p]
    single: dict[str, str] = {}
    for k, v in opts:
        single.setdefault(k, v)
    if parts == ["version"] and method == "get":
        pve = ts.profile().get("pve") or {}
        return {"release": pve.get("release"), "repoid": pve.get("repoid"), "version": pve.get("version")}
    if parts == ["nodes"] and method == "get":
        return [{"node": node(), "status": "online", "type": "node", "id": f"node/{node()}", "level": "",
                 "maxcpu": cpu_count(), "maxmem": mem_bytes(), "uptime": 5}]
    if parts[:1] == ["nodes"] and len(parts) >= 2:
        if parts[1] not in (node(), "localhost"):
            raise ApiError(f"hostname lookup '{parts[1]}' failed - failed to get address info for: {parts[1]}: "
                           "Name or service not known")
        rest = parts[2:]
        if not rest and method == "get":
            return [{"name": n} for n in ("lxc", "qemu", "status", "version")]
        if rest == ["status"] and method == "get":
            return node_status()
        if rest == ["version"] and method == "get":
            return api("get", "/version", [])
        if rest and rest[0] in KINDS:
            return guest_api(method, rest[0], rest[1:], opts, single)
        if len(rest) == 3 and rest[0] == "tasks" and rest[2] == "status" and method == "get":
            return task_status(rest[1])
    if parts[:3] == ["cluster", "mapping", "pci"]:
        return mapping_api(method, parts[3:], opts, single)
    raise ApiError(f"No '{method}' handler defined for '{path}'")


def task_status(upid):
    """Tasks run synchronously here (a failing one fails its request), so every task of this
    node has ended with OK by the time a client asks."""
    fields = upid.split(":")
    if len(fields) < 8 or fields[0] != "UPID" or fields[1] != node():
        raise ApiError(f"400 Parameter verification failed.\nupid: unable to parse worker upid '{upid}'")
    return {"upid": upid, "node": fields[1], "pid": int(fields[2], 16), "starttime": int(fields[4], 16),
            "type": fields[5], "id": fields[6], "user": fields[7], "status": "stopped", "exitstatus": "OK"}


def guest_api(method, kind, rest, opts, single):
    if not rest:
        if method == "get":
            out = []
            for vmid in guest_ids(kind):
                c = config_dict(kind, vmid)
                out.append({"vmid": vmid, "status": status_of(kind, vmid), "type": kind,
                            "name": c.get("hostname") or c.get("name") or f"{'CT' if kind == 'lxc' else 'VM'}{vmid}",
                            "cpus": c.get("cores", 1), "maxmem": int(c.get("memory", 512)) * 1048576})
            return out
        if method == "create":
            vmid = single.get("vmid")
            if not vmid:
                raise ApiError("400 Parameter verification failed.\nvmid: property is missing and it is not optional")
            create_guest(kind, int(vmid), [(k, v) for k, v in opts if k != "vmid"])
            return upid(kind, "create", vmid)
    vmid = int(rest[0])
    sub = rest[1:]
    if not sub and method == "get":
        load(kind, vmid)
        return [{"subdir": s} for s in ("config", "status", "snapshot")]
    if sub == ["config"]:
        if method == "get":
            return config_dict(kind, vmid)
        if method in ("set", "create"):
            delete = [d for k, v in opts if k == "delete" for d in re.split(r"[,;\s]+", v) if d]
            update_config(kind, vmid, [(k, v) for k, v in opts if k not in ("delete", "digest")], delete)
            return None if method == "set" else upid(kind, "config", vmid)
    if sub == ["status", "current"] and method == "get":
        c = config_dict(kind, vmid)
        return {"vmid": vmid, "status": status_of(kind, vmid), "type": kind,
                "name": c.get("hostname") or c.get("name")}
    if len(sub) == 2 and sub[0] == "status" and method == "create":
        action = sub[1]
        if action == "start":
            start(kind, vmid)
        elif action in ("stop", "shutdown"):
            stop(kind, vmid, action, int(single["timeout"]) if "timeout" in single else None)
        elif action == "reboot":
            reboot(kind, vmid)
        else:
            raise ApiError(f"No 'create' handler defined for 'status/{action}'")
        return upid(kind, action, vmid)
    raise ApiError(f"No '{method}' handler defined for '/nodes/{node()}/{kind}/{'/'.join(rest)}'")


def mapping_api(method, rest, opts, single):
    if not rest:
        if method == "get":
            return [dict(entry, id=mid) for mid, entry in read_mappings().items()]
        if method == "create":
            mid = single.get("id")
            if not mid:
                raise ApiError("400 Parameter verification failed.\nid: property is missing and it is not optional")
            new = [v for k, v in opts if k == "map"]
            check_map_strings(new)

            def create(maps, _digest):
                if mid in maps:
                    raise ApiError(f"pci ID '{mid}' already defined")
                maps[mid] = {"map": new}
                for k, v in opts:
                    if k not in ("id", "map"):
                        maps[mid][k] = v
                write_mappings(maps)
            return locked_mappings("create hardware mapping failed", create)
    else:
        mid = rest[0]
        if method == "get":
            raw = ts.read("/etc/pve/" + PCI_CFG) or ""
            maps = read_mappings(raw)
            if mid not in maps:
                raise ApiError(f"mapping '{mid}' not found")
            return dict(maps[mid], id=mid, digest=ts.digest(raw))  # the API's get adds the file's digest
        if method == "set":
            new = [v for k, v in opts if k == "map"]
            if new:
                check_map_strings(new)

            def update(maps, digest):
                # PVE::Tools::assert_if_modified: a given digest must be the file's
                if single.get("digest") and single["digest"] != digest:
                    raise ApiError("detected modified configuration - file changed by other user? Try again.")
                if mid not in maps:
                    raise ApiError(f"pci ID '{mid}' does not exist")
                if new:
                    maps[mid]["map"] = new  # the given maps replace every node's (all of `map`)
                for k, v in opts:
                    if k == "delete":
                        for d in v.split(","):
                            maps[mid].pop(d, None)
                    elif k not in ("map", "digest", "id"):
                        maps[mid][k] = v
                if "map" not in maps[mid]:
                    maps[mid]["map"] = []
                write_mappings(maps)
            return locked_mappings("update hardware mapping failed", update)
        if method == "delete":
            def delete(maps, _digest):
                maps.pop(mid, None)  # the API deletes an id that does not exist without error
                write_mappings(maps)
            return locked_mappings("delete pci mapping failed", delete)
    raise ApiError(f"No '{method}' handler defined for '/cluster/mapping/pci/{'/'.join(rest)}'")


def cpu_count():
    c = ts.profile().get("cpu") or {}
    return c.get("sockets", 1) * c.get("cores_per_socket", 1) * c.get("threads_per_core", 1)


def mem_bytes():
    return int(ts.profile().get("memory_kib") or 0) * 1024


def node_status():
    st = ts.state()
    pve = ts.profile().get("pve") or {}
    boot = st.get("boot") or {}
    kver = (ts.read("/var/lib/twin/hw/proc/version") or "").split()
    return {"pveversion": f"pve-manager/{pve.get('version')}/{pve.get('repoid')}",
            "kversion": f"Linux {boot.get('release')} {' '.join(kver[-4:])}",
            "current-kernel": {"sysname": "Linux", "release": boot.get("release"), "machine": "x86_64"},
            "boot-info": {"mode": "efi" if boot.get("loader") == "systemd-boot" else "legacy-bios", "secureboot": 0},
            "cpuinfo": {"cpus": cpu_count(), "model": (ts.profile().get("cpu") or {}).get("model_name")},
            "memory": {"total": mem_bytes()}, "uptime": 5}


def parse_opts(args):
    """['--key', 'v', '-k2', 'v2', '--k3=v3'] -> ([(key, v), ...], positionals)."""
    opts, pos = [], []
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("-") and len(a) > 1 and not re.fullmatch(r"-\d+", a):
            key = a.lstrip("-")
            if "=" in key:
                key, val = key.split("=", 1)
            elif i + 1 < len(args):
                val = args[i + 1]
                i += 1
            else:
                val = "1"
            opts.append((key, val))
        else:
            pos.append(a)
        i += 1
    return opts, pos


def emit(result, fmt):
    if result is None:
        return
    if fmt in ("json", "json-pretty"):
        indent = 4 if fmt == "json-pretty" else None
        sys.stdout.write(json.dumps(result, indent=indent, sort_keys=True,
                                    separators=None if indent else (",", ":")) + "\n")
    elif isinstance(result, str):
        sys.stdout.write(result + "\n")
    else:
        sys.stdout.write(json.dumps(result, indent=2, sort_keys=True) + "\n")


def pvesh(argv):
    if not argv or argv[0] not in ("get", "set", "create", "delete", "ls"):
        ts.die("ERROR: unknown command 'pvesh " + " ".join(argv[:1]) + "'", 255)
    method = "get" if argv[0] == "ls" else argv[0]
    if len(argv) < 2:
        ts.die("400 not enough arguments", 255)
    opts, _ = parse_opts(argv[2:])
    fmt = "text"
    keep = []
    for k, v in opts:
        if k == "output-format":
            fmt = v
        elif k in ("noborder", "noheader", "human-readable", "quiet"):
            continue
        else:
            keep.append((k, v))
    try:
        ha_step()
        emit(api(method, argv[1], keep), fmt)
    except ApiError as e:
        ts.die(str(e), 255)
    return 0


# ---------------------------------------------------------------- pct / qm

def guest_cli(kind, argv):
    label = KINDS[kind][1]
    prog = "pct" if kind == "lxc" else "qm"
    if not argv:
        ts.die(f"ERROR: no command specified\nUSAGE: {prog} <COMMAND> [ARGS] [OPTIONS]", 255)
    cmd, rest = argv[0], argv[1:]
    try:
        ha_step()
        if cmd == "list":
            ids = guest_ids(kind)
            if not ids:
                return 0  # no guests: not even the header (pct.pm / qm.pm list)
            if kind == "lxc":
                # follows pve-container PVE/CLI/pct.pm list: "%-10s %-10s %-12s %-20s", name defaults to CT<id>
                print(f"{'VMID':<10} {'Status':<10} {'Lock':<12} {'Name':<20}")
                for vmid in ids:
                    c = config_dict(kind, vmid)
                    print(f"{vmid:<10} {status_of(kind, vmid):<10} {str(c.get('lock', '')):<12} "
                          f"{str(c.get('hostname') or f'CT{vmid}'):<20}")
            else:
                # follows qemu-server PVE/CLI/qm.pm list ("%10s %-20s %-10s %-10s %12.2f %-10s") and
                # PVE/QemuServer.pm vmstatus(): an unnamed VM is "VM <vmid>"
                print(f"{'VMID':>10} {'NAME':<20} {'STATUS':<10} {'MEM(MB)':<10} {'BOOTDISK(GB)':>12} {'PID':<10}")
                for vmid in ids:
                    c = config_dict(kind, vmid)
                    print(f"{vmid:>10} {str(c.get('name') or f'VM {vmid}'):<20} {status_of(kind, vmid):<10} "
                          f"{str(c.get('memory', 512)):<10} {0.0:>12.2f} {0:<10}")
            return 0
        if cmd in ("exec", "push", "pull") and kind == "lxc":
            return ct_cli(cmd, rest)
        if not rest:
            ts.die(f"400 not enough arguments\n{prog} {cmd} <vmid>", 255)
        vmid = int(rest[0])
        opts, _ = parse_opts(rest[1:])
        if cmd == "config":
            conf = load(kind, vmid)
            for k, v in ts.parse_conf(ts.format_conf(conf))["keys"]:
                print(f"{k}: {v}")
            if conf["description"]:
                print("description: " + "%0A".join(line[1:] for line in conf["description"]))
            return 0
        if cmd == "set":
            delete = [d for k, v in opts if k == "delete" for d in re.split(r"[,;\s]+", v) if d]
            raw = [k for k, _ in opts if k.startswith("lxc.")]
            if raw:
                raise ApiError(f"Unknown option: {raw[0]}\n400 unable to parse option\n{prog} set <vmid> [OPTIONS]")
            update_config(kind, vmid, [(k, v) for k, v in opts if k not in ("delete", "digest")], delete)
            return 0
        if cmd == "create":
            create_guest(kind, vmid, opts)
            return 0
        if cmd == "start":
            start(kind, vmid)
            return 0
        if cmd == "migrate" and kind == "qemu":
            if len(rest) < 2:
                raise ApiError("400 not enough arguments\nqm migrate <vmid> <target> [OPTIONS]")
            migrate(vmid, rest[1], opts)
            return 0
        if cmd in ("stop", "shutdown"):
            timeout = dict(opts).get("timeout")
            stop(kind, vmid, cmd, int(timeout) if timeout is not None else None)
            return 0
        if cmd == "unlock":  # qm/pct unlock: drop the config's lock: line
            with config_lock(kind, vmid):
                conf = load(kind, vmid)
                ts.conf_delete(conf, "lock")
                save(kind, vmid, conf)
            return 0
        if cmd == "reboot":
            reboot(kind, vmid)
            return 0
        if cmd == "status":
            load(kind, vmid)
            print(f"status: {status_of(kind, vmid)}")
            return 0
        if cmd == "destroy":
            load(kind, vmid)
            if status_of(kind, vmid) == "running":
                raise ApiError(f"{label} {vmid} is running - destroy failed")
            os.unlink(ts.path(conf_path(kind, vmid)))
            if ts.read("/etc/pve/.vmlist") is not None:  # pmxcfs drops it from the vmlist with its config
                ts.write("/etc/pve/.vmlist", json.dumps({"version": 1, "ids": vmlist()}, indent=1) + "\n")
            if kind == "lxc":  # its root filesystem goes with it
                ct_umount(vmid)
                import shutil

                shutil.rmtree(ts.path(f"{CT_DIR}/{vmid}"), ignore_errors=True)
            return 0
    except ApiError as e:
        ts.die(str(e), 255)
    ts.die(f"unknown command '{prog} {cmd}'", 255)


def pveversion(argv):
    pve = ts.profile().get("pve") or {}
    rel = (ts.state().get("boot") or {}).get("release")
    head = f"pve-manager/{pve.get('version')}/{pve.get('repoid')} (running kernel: {rel})"
    if "-v" in argv or "--verbose" in argv:
        pk = pve.get("packages") or {}
        print(f"proxmox-ve: {pk.get('proxmox-ve', pve.get('version'))} (running kernel: {rel})")
        print(f"pve-manager: {pve.get('version')} (running version: {pve.get('version')}/{pve.get('repoid')})")
        for name, ver in pk.items():
            if name != "proxmox-ve":
                print(f"{name}: {ver}")
        return 0
    print(head)
    return 0


def pve8to9(argv):
    """pve-manager's upgrade checklist (PVE/CLI/pve8to9.pm, stable-8), in its output format:
    print_header `= NAME =` sections, `$log_line`'s `LEVEL: text` lines (uc of pass, info, skip,
    notice, warn, fail), the SUMMARY's counters; exit status 0 whatever it finds (its checklist
    code returns undef). Of its checks the twin can answer: check_pve_packages' proxmox-ve
    version against 8.4-0 (dpkg's version, as $get_pkg reads it), check_virtual_guests' running
    guests; plus each FAIL the test asked for (var/lib/twin/faults.json "pve8to9_fails", set by
    tests/twin/runtime.py set_fault). Term::ANSIColor's colours are left out (NO_COLOR)."""
    import subprocess  # here, not at the top (see `pct list`)

    counters = {"pass": 0, "skip": 0, "notice": 0, "warn": 0, "fail": 0}

    def log(level, line):
        counters[level] += 1
        print(f"{level.upper()}: {line}")

    print("= CHECKING VERSION INFORMATION FOR PVE PACKAGES =\n")
    print("Checking proxmox-ve package version..")
    done = subprocess.run(["dpkg-query", f"--admindir={ts.path('/var/lib/dpkg')}", "-W", "-f", "${Version}",
                           "proxmox-ve"], capture_output=True, text=True)
    m = re.match(r"^(\d+)\.(\d+)[.-](\d+)", done.stdout.strip())
    if not m:
        log("fail", "proxmox-ve package not found!")
    elif int(m.group(1)) > 8:
        log("pass", "already upgraded to Proxmox VE 9")
    elif tuple(int(g) for g in m.groups()) >= (8, 4, 0):  # pve8to9.pm: $maj >= 8 && $min >= 4 && $pkgrel >= 0
        log("pass", "proxmox-ve package has version >= 8.4-0")
    else:
        log("fail", "proxmox-ve package is too old, please upgrade to >= 8.4-0!")
    print("\n= VIRTUAL GUEST CHECKS =\n")
    print("INFO: Checking for running guests..")
    running = sum(1 for kind in ("lxc", "qemu") for status in (run_state().get(kind) or {}).values()
                  if status == "running")
    if running:
        log("warn", f"{running} running guest(s) detected - consider migrating or stopping them.")
    else:
        log("pass", "no running guest detected.")
    faults = json.loads(ts.read("/var/lib/twin/faults.json", "{}") or "{}")
    if faults.get("pve8to9_fails"):
        print("\n= MISCELLANEOUS CHECKS =\n")
        for line in faults["pve8to9_fails"]:
            log("fail", line)
    if "--full" not in argv:
        log("skip", "NOTE: Expensive checks, like CT cgroupv2 compat, not performed without '--full' parameter")
    print("\n= SUMMARY =\n")
    print(f"TOTAL:    {sum(counters.values())}")
    print(f"PASSED:   {counters['pass']}")
    print(f"SKIPPED:  {counters['skip']}")
    print(f"WARNINGS: {counters['warn']}")
    print(f"FAILURES: {counters['fail']}")
    if counters["warn"] or counters["fail"]:
        print("\nATTENTION: Please check the output for detailed information!")
        if counters["fail"]:
            print("Try to solve the problems one at a time and then run this checklist tool again.")
    return 0


HANDLERS = {"pct": lambda a: guest_cli("lxc", a), "qm": lambda a: guest_cli("qemu", a),
            "pvesh": pvesh, "pveversion": pveversion, "ha-manager": ha_manager, "pvecm": pvecm,
            "lxc-ls": lxc_ls, "lxc-info": lxc_info, "pve8to9": pve8to9}
PROGRAMS, main = ts.standin(HANDLERS, "proxmox")

if __name__ == "__main__":
    ts.run_program(main)
