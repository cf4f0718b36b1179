"""Whether pvegpu may stop a guest or write its config, the way Proxmox decides it (pure).

Three things on a Proxmox VE node can make "stop the guest, change its config" wrong:

- The node name. Mappings and API paths are keyed by it; Proxmox's node name is the host name
  without its domain (`uname -n` up to the first dot). A spec `node` that differs is refused:
  mappings keyed by a wrong node never match.
- A config lock (`lock: backup`, `migrate`, `snapshot`, ...). Proxmox refuses to stop such a
  guest ("VM is locked (backup)") and its own tools do not change the config while it is held;
  pvegpu refuses too, naming the lock.
- HA. For a guest that is an HA resource (/etc/pve/ha/resources.cfg, state other than
  `ignored`), `qm/pct shutdown` only queues a stop request with the HA manager and returns at
  once; the guest stops when the HA stack gets to it (or never). pvegpu never sends that request
  itself: a resource whose requested state is `started` is refused with the fix (ask HA to stop
  it, or take it out of HA); one whose requested state is already `stopped`/`disabled` is
  being stopped by HA, and the rebind waits until it really is stopped (and fails, naming the
  resource, when it is not within the shutdown timeout). Guests HA keeps stopped are not
  started again by pvegpu.

Shapes: `configs` are `LxcConfigs`/`QemuConfigs` (``{"options": {"lock": "backup"}, ...}``),
`ha` is `HaResources` (``{"vm:300": {"state": "started", ...}}``).
"""

from __future__ import annotations

# follows pve-container PVE/LXC/Config.pm and qemu-server PVE/QemuConfig.pm config_file_lock(): the
# per-guest flock every Proxmox tool holds while it reads-modifies-writes a guest config
CONFIG_LOCK_FILE = {"lxc": "/run/lock/lxc/pve-config-{gid}.lock", "qemu": "/var/lock/qemu-server/lock-{gid}.conf"}
CONFIG_LOCK_TIMEOUT_S = 10  # pve-guest-common PVE/AbstractConfig.pm lock_config(): 10 s to get it
KIND_LABEL = {"lxc": "CT", "qemu": "VM"}
KIND_TOOL = {"lxc": "pct", "qemu": "qm"}
HA_TYPE = {"lxc": "ct", "qemu": "vm"}
HA_STOPPING = ("stopped", "disabled")


def node_refusal(spec_node: str | None, host_node: str | None, host_name: str) -> str | None:
    """A sentence when the spec names a node the host is not (None when they agree or the
    spec names none)."""
    if not spec_node or not host_node or spec_node == host_node:
        return None
    return (f"the spec says node {spec_node!r}, but {host_name} is Proxmox node {host_node!r} (its host "
            f"name without the domain); PCI mappings and API paths keyed by {spec_node!r} would never "
            f"match. Set node: {host_node} (or leave node out) in the spec")


def config_lock(config: dict | None) -> str | None:
    """The `lock:` value of a guest config (main section), else None."""
    return ((config or {}).get("options") or {}).get("lock") or None


def lock_refusal(kind: str, gid: int, lock: str, what: str) -> str:
    label, tool = KIND_LABEL[kind], KIND_TOOL[kind]
    return (f"{label} {gid} is locked ({lock}): Proxmox is in the middle of a {lock} on it, so pvegpu "
            f"does not {what}. Wait for the {lock} to finish and re-run (a stale lock left by a "
            f"failed task: `{tool} unlock {gid}`)")


def ha_resource(ha: dict, kind: str, gid: int) -> tuple[str, dict] | None:
    """(sid, entry) when guest `gid` is HA-managed; None when it is not or HA ignores it."""
    # follows pve-ha-manager PVE/HA/Config.pm vm_is_ha_managed(): vm:<id> or ct:<id>, "ignored" is unmanaged
    for sid in (f"{HA_TYPE[kind]}:{gid}", f"{'ct' if kind == 'qemu' else 'vm'}:{gid}"):
        entry = (ha or {}).get(sid)
        if entry is not None and entry.get("state") != "ignored":
            return sid, entry
    return None


def stop_checks(stop: list[tuple[str, int]], lxc: dict, qemu: dict, ha: dict
                ) -> tuple[list[str], list[tuple[str, int, str]]]:
    """For the running guests a rebind must stop: (refusals, HA guests to wait for).

    Refused: a locked guest; an HA resource whose requested state is `started` (a shutdown
    would only queue a request HA may act on late or never). Waited for: an HA resource HA is
    already stopping (requested state `stopped`/`disabled`): ``[("qemu", 300, "vm:300")]``.
    """
    refusals: list[str] = []
    wait: list[tuple[str, int, str]] = []
    for kind, gid in stop:
        config = (lxc if kind == "lxc" else qemu).get(gid)
        lock = config_lock(config)
        if lock:
            refusals.append(lock_refusal(kind, gid, lock, "stop it for the GPU rebind"))
            continue
        managed = ha_resource(ha, kind, gid)
        if managed is None:
            continue
        sid, entry = managed
        if entry.get("state") in HA_STOPPING:
            wait.append((kind, gid, sid))
            continue
        refusals.append(
            f"{KIND_LABEL[kind]} {gid} must stop for the GPU rebind but is HA resource {sid} (requested state "
            f"{entry.get('state')}): `{KIND_TOOL[kind]} shutdown` would only queue a stop request with the HA "
            f"manager, so pvegpu does not stop it. Ask HA to stop it (`ha-manager set {sid} --state stopped`) "
            f"or take it out of HA (`ha-manager remove {sid}`), then re-run (the rebind waits while HA stops it)")
    return refusals, wait
