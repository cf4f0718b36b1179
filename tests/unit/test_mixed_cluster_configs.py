"""Issue 40 item 2: every line pvegpu writes into /etc/pve parses on Proxmox VE 8 and on 9.

While a cluster is upgraded node by node, nodes of both releases read the one /etc/pve. For every
shipped example inventory (inventories/*.yml) whose hosts give GPUs to guests, the lines pvegpu
writes are collected from its own plan and operation functions, on the hardware of the twin
profile of that host (tests/twin/profiles: the PCI facts through facts.pci's own command and
parser over the twin's rendered sysfs), and each key and property-string sub-key is checked
against both releases' schemas (tests/unit/pve_schema_keys.py, read from the real parsers):

- /etc/pve/mapping/pci.cfg: the mapping id, each `map` entry (plan.guests.plan_mappings,
  plan_pool_mappings; the strings operations.guests.mapping_merge_command sends) and a pool's
  `description`;
- /etc/pve/qemu-server/<id>.conf: the `qm set` options (operations.guests.vm_config_write of
  plan.guests.plan_vm): hostpciN, cpu, machine, and the keys of `--delete`;
- /etc/pve/lxc/<id>.conf: pvegpu's lines of the CT config after plan.guests.merge_container_config
  (devN or the raw lxc.cgroup2.devices.allow / lxc.mount.entry syntax, both).

Each VM is planned as its twin profile has it, as a fresh OVMF VM on i440fx with the default CPU
(so `machine` and `cpu` are written), and as a member of a GPU pool (the pool's mapping and its
description); each CT in both device syntaxes, also over a config that still carries a cgroup v1
allow line of NVIDIA's major.
"""

from __future__ import annotations

import functools
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from facts.devices import parse_char_majors
from facts.pci import PciDevices, parse_pci_devices
from facts.proxmox import parse_guest_config
from operations.guests import mapping_merge_command, vm_config_write
from plan.guests import (
    EXTRA_NODES,
    KEY_RE,
    is_unprivileged,
    map_string,
    merge_container_config,
    nvidia_majors,
    owned_line,
    plan_mappings,
    plan_pool_mappings,
    plan_vm,
    render_container_devices,
    split_config,
    used_dev_indices,
)
from spec.load import load_spec_file
from spec.models import HostSpec
from tests.twin import hardware as twin_hardware
from tests.unit import pve_schema_keys as S
from tests.unit.test_example_inventories import EXAMPLES

PROFILES = sorted(p.stem for p in twin_hardware.PROFILES_DIR.glob("*.yml"))


@dataclass(frozen=True)
class Line:
    """One thing pvegpu writes: `file` "pci.cfg", "qemu-server" or "lxc"; `key` the config key
    (pci.cfg: "id" for the section header, "map", "description"); `where` says from which case."""

    file: str
    key: str
    value: str
    where: str


# ---------------------------------------------------------------- the checker


def property_string(value: str, default_key: str | None) -> tuple[dict[str, str], list[str]]:
    """A property string as pve-common parse_property_string reads it: `k=v` items separated by
    commas, a bare item is the default key's value; and what is wrong with it."""
    parts: dict[str, str] = {}
    errors = []
    for item in value.split(","):
        if not item:
            continue
        key, sep, val = item.partition("=")
        if not sep:
            if default_key is None:
                errors.append(f"{item!r} has no key and the format has no default key")
                continue
            key, val = default_key, item
        if key in parts:
            errors.append(f"sub-key {key!r} twice")
        parts[key] = val
    return parts, errors


def _sub_keys(release: S.PveRelease, what: str, parts: dict[str, str], known: frozenset[str]) -> list[str]:
    return [f"{what}: sub-key {k!r} unknown to {release.name}" for k in sorted(set(parts) - known)]


def _check_map(release: S.PveRelease, value: str) -> list[str]:
    parts, errors = property_string(value, None)
    errors += _sub_keys(release, "map", parts, release.map_keys)
    errors += [f"map: {k!r} missing" for k in sorted(release.map_required - set(parts))]
    for key, rule in (("id", S.PCI_ID_RE), ("subsystem-id", S.PCI_ID_RE), ("path", S.MAP_PATH_RE),
                      ("node", S.NODE_RE)):
        if key in parts and not rule.match(parts[key]):
            errors.append(f"map: {key}={parts[key]!r} does not match its format")
    if "iommugroup" in parts and not re.fullmatch(r"-?\d+", parts["iommugroup"]):
        errors.append(f"map: iommugroup={parts['iommugroup']!r} is not an integer")
    return errors


def _check_vm_key(release: S.PveRelease, key: str) -> list[str]:
    hostpci = re.fullmatch(r"hostpci(\d+)", key)
    if hostpci:
        return [] if int(hostpci.group(1)) < release.max_hostpci else [f"{key}: {release.name} knows hostpci0-"
                                                                       f"hostpci{release.max_hostpci - 1}"]
    return [] if key in release.vm_keys else [f"VM config key {key!r} is not one checked against {release.name}"]


def _check_vm(release: S.PveRelease, key: str, value: str) -> list[str]:
    if key == "delete":
        return [e for k in value.split(",") for e in _check_vm_key(release, k)]
    errors = _check_vm_key(release, key)
    if errors:
        return errors
    if key.startswith("hostpci"):
        parts, errors = property_string(value, S.DEFAULT_KEYS["hostpci"])
        errors += _sub_keys(release, key, parts, release.hostpci_keys)
        if "mapping" in parts and not S.CONFIGID_RE.match(parts["mapping"]):
            errors.append(f"{key}: mapping={parts['mapping']!r} is not a config id")
        errors += [f"{key}: {k}={parts[k]!r} is not a boolean" for k in ("pcie", "x-vga", "rombar")
                   if k in parts and parts[k] not in ("0", "1")]
        if ("mapping" in parts) == ("host" in parts):
            errors.append(f"{key}: exactly one of host and mapping")
        return errors
    if key == "cpu":
        parts, errors = property_string(value, S.DEFAULT_KEYS["cpu"])
        errors += _sub_keys(release, key, parts, release.cpu_keys)
        for flag in filter(None, parts.get("flags", "").split(";")):
            match = S.CPU_FLAG_RE.match(flag)
            if not match or match.group(2) not in release.cpu_vm_flags:
                errors.append(f"cpu: flag {flag!r} is not a VM-specific flag of {release.name}")
        for bits in ("phys-bits", "guest-phys-bits"):
            if bits in parts and not (S.PHYS_BITS_RE.match(parts[bits]) and
                                      (parts[bits] == "host" or 8 <= int(parts[bits]) <= 64)):
                errors.append(f"cpu: {bits}={parts[bits]!r} out of range")
        return errors
    if key == "machine":
        parts, errors = property_string(value, S.DEFAULT_KEYS["machine"])
        errors += _sub_keys(release, key, parts, release.machine_keys)
        if "type" in parts and not S.MACHINE_TYPE_RE.match(parts["type"]):
            errors.append(f"machine: type {parts['type']!r} is not a machine type")
        return errors
    return []


def _check_ct(release: S.PveRelease, key: str, value: str) -> list[str]:
    dev = re.fullmatch(r"dev(\d+)", key)
    if dev:
        if int(dev.group(1)) >= release.max_devices:
            return [f"{key}: {release.name} knows dev0-dev{release.max_devices - 1}"]
        parts, errors = property_string(value, S.DEFAULT_KEYS["dev"])
        errors += _sub_keys(release, key, parts, release.dev_keys)
        if not S.DEV_PATH_RE.match(parts.get("path", "")):
            errors.append(f"{key}: path {parts.get('path')!r} is not a device path")
        errors += [f"{key}: {k}={parts[k]!r} is not an integer >= 0" for k in ("uid", "gid")
                   if k in parts and not parts[k].isdigit()]
        return errors
    if key.startswith("lxc."):
        if key in release.lxc_keys or key.startswith(release.lxc_prefixes):
            return []
        if key.startswith(release.lxc_deprecated_prefixes):
            return [f"{key}: deprecated in {release.name} (accepted with a warning, to become an error)"]
        return [f"{key}: raw LXC key unknown to {release.name}"]
    return [f"CT config key {key!r} is not one checked against {release.name}"]


def refusals(release: S.PveRelease, line: Line) -> list[str]:
    """Why `release` would not take `line` as it is (empty: it parses it without a word)."""
    if line.file == "pci.cfg":
        if line.key == "id":
            errors = [] if S.CONFIGID_RE.match(line.value) else [f"mapping id {line.value!r} is not a config id"]
        elif line.key not in release.mapping_keys:
            errors = [f"pci.cfg: key {line.key!r} unknown to {release.name}"]
        else:
            errors = _check_map(release, line.value) if line.key == "map" else []
    elif line.file == "qemu-server":
        errors = _check_vm(release, line.key, line.value)
    else:
        errors = _check_ct(release, line.key, line.value)
    return [f"{line.where}: `{line.key}: {line.value}`: {e}" for e in errors]


# ---------------------------------------------------------------- what pvegpu writes


@functools.cache
def twin_facts(name: str) -> tuple[dict, dict[str, int], dict]:
    """(PciDevices, CharDeviceMajors, profile) of twin profile `name`: its sysfs and /proc as a boot
    of it renders them, read by the facts' own command and parsers."""
    profile = twin_hardware.load_profile(name)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        state = twin_hardware.compute(root, profile)
        twin_hardware._render_sys(root / "sys", profile, state)
        twin_hardware._render_proc(root / "proc", profile, state)
        command = PciDevices.command
        assert command.count("/sys/") == 2
        listing = subprocess.run(["sh", "-c", command.replace("/sys/", f"{tmp}/sys/")], capture_output=True,
                                 text=True, check=True, timeout=60).stdout
        pci = parse_pci_devices(listing.splitlines())
        majors = parse_char_majors((root / "proc/devices").read_text().splitlines())
    return pci, majors, profile


def profile_for(host: str, spec: HostSpec) -> str:
    """The twin profile with this host's hardware: its node and Proxmox VE major, by name first."""
    major = spec.proxmox_ve or 8
    fits = [p for p in PROFILES if (prof := twin_hardware.load_profile(p)).get("node") == spec.node
            and prof.get("pve") and int(str(prof["pve"]["version"]).split(".")[0]) == major]
    assert fits, f"no twin profile of node {spec.node} on Proxmox VE {major} for {host}"
    return host if host in fits else fits[0]


def guest_hosts() -> list[tuple[str, str, HostSpec]]:
    """(example file, host, spec) of every example host that gives GPUs to guests."""
    return [(yml.name, host, spec) for yml in EXAMPLES for host, spec in load_spec_file(yml).items()
            if spec.containers or spec.vms]


def ct_lines(where: str, ctid: int, ct, text: str, pci: dict, majors: dict[str, int],
             dev_entries: bool, loaded_majors: dict[str, int]) -> list[Line]:
    """pvegpu's lines of CT `ctid`'s config after the merge (devN or raw lxc.* syntax)."""
    # minors as the loaded nvidia driver numbers the GPUs (bus order); the twin's empty root
    # loads no nvidia.ko, so its majors are added as its profile gives them to a boot that does
    gpus = sorted(b for b, d in pci.items() if d["vendor"] == "10de" and (d["class"] or "").startswith("03"))
    minors = {b: i for i, b in enumerate(gpus)}
    majors = {"nvidia": 195, "nvidiactl": 195, **loaded_majors, **majors}
    devices = render_container_devices(ctid, list(ct.gpus), minors, majors, dev_entries, ct.gid,
                                       used_dev_indices(text, nvidia_majors(majors)), extra=list(ct.extra_devices),
                                       unprivileged=is_unprivileged(text))
    assert devices.problems == [] and devices.lines, (where, devices.problems)
    merged = merge_container_config(text, devices.lines, majors)
    lines = []
    for raw in split_config(merged.text)[0]:
        match = KEY_RE.match(raw)
        if match and not raw.lstrip().startswith("#") and \
                owned_line(match.group(1), match.group(2), nvidia_majors(majors), False):
            lines.append(Line("lxc", match.group(1), match.group(2), where))
    assert {(l.key, l.value) for l in lines} == set(devices.lines), where
    return lines


def vm_lines(where: str, node: str, vmid: int, vm, config: dict, pci: dict, spec: HostSpec) -> tuple[list[Line], list]:
    """The `qm set` options pvegpu sends for VM `vmid`, and the mapping changes it needs."""
    gpus = [b for b in vm.gpus if b in pci]
    plan = plan_vm(vmid, node, gpus, vm.machine, vm.allow_machine_change, config, pci, set(spec.gpus),
                   host_phys_bits=64 - 12, pool=vm.pool, pools={vm.pool} if vm.pool else frozenset())
    assert plan.problems == [], (where, plan.problems)
    write, shell = vm_config_write(node, plan)
    lines = [Line("qemu-server", k, v, where) for k, v in write.params]
    assert shell.startswith(f"qm set {vmid} ") and all(f"--{k} " in shell for k, _ in write.params)
    if vm.pool:
        changes = plan_pool_mappings(node, {vm.pool: gpus}, pci, {})
    else:
        changes = plan_mappings(node, gpus, pci, {})
    return lines, changes


def mapping_lines(where: str, changes: list) -> list[Line]:
    lines = []
    for change in changes:
        script = mapping_merge_command(change)
        lines.append(Line("pci.cfg", "id", change.id, where))
        for entry in change.maps:
            assert map_string(entry) in script, (where, change.id)
            lines.append(Line("pci.cfg", "map", map_string(entry), where))
        if change.description:
            assert change.description in script
            lines.append(Line("pci.cfg", "description", change.description, where))
    return lines


FRESH_VM = {"bios": "ovmf", "memory": "262144"}  # on i440fx (no machine), the default CPU (no cpu)
V1_ALLOW = "lxc.cgroup.devices.allow: c 195:* rwm"  # an older recipe's cgroup v1 line of NVIDIA's major


@functools.cache
def written() -> tuple[Line, ...]:
    """Every line pvegpu writes into /etc/pve for the example hosts that give GPUs to guests."""
    lines: list[Line] = []
    for yml, host, spec in guest_hosts():
        profile_name = profile_for(host, spec)
        pci, majors, profile = twin_facts(profile_name)
        node = spec.node or host
        case = f"{yml} {host} (twin {profile_name})"
        for ctid, ct in sorted(spec.containers.items()):
            text = profile["guests"]["lxc"][ctid]
            for dev_entries in (True, False):
                facts = (pci, majors, dev_entries, profile["char_majors"])
                syntax = "devN" if dev_entries else "raw lxc.*"
                lines += ct_lines(f"{case} CT {ctid} {syntax}", ctid, ct, text, *facts)
                lines += ct_lines(f"{case} CT {ctid} {syntax}, with a cgroup v1 allow", ctid, ct,
                                  text.rstrip("\n") + "\n" + V1_ALLOW + "\n", *facts)
                privileged = "".join(f"{l}\n" for l in text.splitlines() if not l.startswith("unprivileged:"))
                lines += ct_lines(f"{case} CT {ctid} {syntax}, privileged with every extra device", ctid,
                                  ct.model_copy(update={"extra_devices": list(EXTRA_NODES)}), privileged, *facts)
        for vmid, vm in sorted(spec.vms.items()):
            profiled = parse_guest_config(profile["guests"]["qemu"][vmid].splitlines(), "qemu")
            fresh = parse_guest_config([f"{k}: {v}" for k, v in FRESH_VM.items()], "qemu")
            for label, config, want in (("as its twin profile has it", profiled, vm),
                                        ("fresh on i440fx, default CPU", fresh,
                                         vm.model_copy(update={"allow_machine_change": True})),
                                        ("in GPU pool gpupool", profiled, vm.model_copy(update={"pool": "gpupool"}))):
                where = f"{case} VM {vmid} {label}"
                vm_written, changes = vm_lines(where, node, vmid, want, config, pci, spec)
                lines += vm_written + mapping_lines(where, changes)
    return tuple(lines)


# ---------------------------------------------------------------- the tests


def test_every_example_with_guests_is_collected():
    cases = {(yml, host, profile_for(host, spec)) for yml, host, spec in guest_hosts()}
    assert cases >= {("kpro6.yml", "kpro6", "kpro6"), ("kpro6-pve9.yml", "kpro6", "kpro6-pve9"),
                     ("twin.yml", "kpro6", "kpro6"), ("twin.yml", "kpro6-pve9", "kpro6-pve9"),
                     ("twin.yml", "intel2", "intel2")}
    # the examples without guests write nothing into /etc/pve
    assert not any(s.containers or s.vms for s in load_spec_file(Path(EXAMPLES[0]).parent / "h200-vm.yml").values())


def test_every_kind_of_line_pvegpu_writes_is_collected():
    """The cases reach every key and sub-key pvegpu's plans produce, so none is left unchecked."""
    keys = {(l.file, re.sub(r"\d+$", "N", l.key)) for l in written()}
    assert keys == {("pci.cfg", "id"), ("pci.cfg", "map"), ("pci.cfg", "description"),
                    ("qemu-server", "hostpciN"), ("qemu-server", "cpu"), ("qemu-server", "machine"),
                    ("lxc", "devN"), ("lxc", "lxc.cgroup2.devices.allow"), ("lxc", "lxc.mount.entry")}
    subs: dict[str, set[str]] = {}
    for line in written():
        kind = {"map": "map", "cpu": "cpu", "machine": "machine"}.get(line.key) or re.sub(r"\d+$", "", line.key)
        default = {"map": None, "hostpci": "host", "dev": "path", "cpu": "cputype", "machine": "type"}
        if kind in default:
            subs.setdefault(kind, set()).update(property_string(line.value, default[kind])[0])
    assert subs == {"map": {"id", "iommugroup", "node", "path", "subsystem-id"}, "hostpci": {"mapping", "pcie"},
                    "cpu": {"cputype", "flags", "phys-bits"}, "machine": {"type"}, "dev": {"path", "gid"}}


@pytest.mark.parametrize("release", S.RELEASES, ids=["pve8", "pve9"])
def test_every_line_pvegpu_writes_parses_on(release):
    found = [e for line in written() for e in refusals(release, line)]
    assert found == [], "\n".join(found)


def test_no_cgroup_v1_key_survives_pvegpu():
    """A CT config with NVIDIA's cgroup v1 allow line leaves the merge without it (9 warns on
    `lxc.cgroup.*` and its lxc ignores it: the GPU would be denied on a 9 node)."""
    cases = [l for l in written() if l.file == "lxc" and "cgroup v1" in l.where]
    assert cases and not any(l.key.startswith("lxc.cgroup.") for l in cases)


# ---------------------------------------------------------------- negative controls


def test_the_checker_reports_what_one_release_does_not_know():
    def line(file, key, value):
        return Line(file, key, value, "control")

    v1 = line("lxc", "lxc.cgroup.devices.allow", "c 195:* rwm")
    assert refusals(S.PVE8, v1) == []
    assert refusals(S.PVE9, v1) == ["control: `lxc.cgroup.devices.allow: c 195:* rwm`: lxc.cgroup.devices.allow: "
                                    "deprecated in Proxmox VE 9 (trixie) (accepted with a warning, to become an error)"]
    driver = line("qemu-server", "hostpci0", "mapping=gpupool,pcie=1,driver=vfio")  # 9.1's hostpci driver
    assert refusals(S.PVE9, driver) == [] and "sub-key 'driver' unknown to Proxmox VE 8" in refusals(S.PVE8, driver)[0]
    guest_bits = line("qemu-server", "cpu", "host,guest-phys-bits=46")
    assert refusals(S.PVE9, guest_bits) == [] and refusals(S.PVE8, guest_bits)
    nested = line("qemu-server", "cpu", "kvm64,flags=+nested-virt")
    assert refusals(S.PVE9, nested) == [] and refusals(S.PVE8, nested)
    for release in S.RELEASES:  # wrong for both
        assert refusals(release, line("qemu-server", "hostpci16", "mapping=gpupool"))
        assert refusals(release, line("pci.cfg", "map", "id=10de:2bb5,path=0000:81:00"))  # no node
        assert refusals(release, line("pci.cfg", "map", "node=kpro6,id=10de:2bb5,path=0000:81:00,vendor=10de"))
        assert refusals(release, line("lxc", "dev0", "/dev/nvidia0,gid=44,owner=root"))
        assert refusals(release, line("lxc", "lxc.rootfs.path", "/x"))


def test_the_collected_lines_fail_when_pvegpu_would_write_a_9_only_key():
    """The same collection, with what 9.1 allows on each hostpci line added: 8 refuses every one."""
    hostpci = [l for l in written() if l.key.startswith("hostpci")]
    assert hostpci
    changed = [Line(l.file, l.key, l.value + ",driver=vfio", l.where) for l in hostpci]
    assert all(refusals(S.PVE9, l) == [] for l in changed)
    assert all(refusals(S.PVE8, l) for l in changed)
