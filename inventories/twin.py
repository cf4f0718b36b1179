"""Inventory for the digital twins on this machine; their specs live in twin.yml.

    tests/twin/twinctl start kpro6 --profile kpro6
    pyinfra inventories/twin.py deploy.py --dry

Each running twin N (`.twin/N/twin.json`, written by the twin runtime: loopback address,
port, per-run key) is a host; its spec is twin.yml's host N, else the host named like its profile. Hosts whose twin is not running are left
out; with none running, the run stops with a hint. PVEGPU_TWINS=a,b limits the hosts.
"""

import json
import os
import sys
from pathlib import Path

from spec.load import inventory_hosts

_REPO = Path(__file__).resolve().parent.parent


def _twin_connection(name: str) -> dict | None:
    path = _REPO / ".twin" / name / "twin.json"
    if not path.exists():
        return None
    twin = json.loads(path.read_text())
    try:
        os.kill(int(twin["pid"]), 0)  # a stopped twin may leave its twin.json behind
    except (OSError, KeyError, ValueError, TypeError):  # stopped, or still starting (no pid yet)
        return None
    return {
        "ssh_hostname": twin["address"],
        "ssh_port": int(twin["port"]),
        "ssh_user": "root",
        "ssh_key": twin["key"],
        "ssh_known_hosts_file": "/dev/null",
        "ssh_strict_host_key_checking": "no",
        "pvegpu_twin": twin,
    }


def _parent_profile(profile: str | None) -> str | None:
    """The profile a twin profile `extends` (tests/twin/profiles/<profile>.yml), if any."""
    import yaml

    path = _REPO / "tests" / "twin" / "profiles" / f"{profile}.yml"
    if not profile or not path.is_file():
        return None
    return (yaml.safe_load(path.read_text()) or {}).get("extends")


def _twin_hosts():
    """One inventory host per running twin; its spec is twin.yml's host of the same name, else
    the host named like the twin's profile (so a fleet of kpro6 twins shares the kpro6 spec), else
    like the profile that one extends, and so on (kpro6-grubesp: kpro6's hardware and spec, another
    boot loader)."""
    wanted = [n for n in os.environ.get("PVEGPU_TWINS", "").split(",") if n]
    specs = dict(inventory_hosts(Path(__file__).with_suffix(".yml")))
    hosts = []
    for twin_file in sorted((_REPO / ".twin").glob("*/twin.json")):
        name = twin_file.parent.name
        conn = _twin_connection(name)
        if conn is None or (wanted and name not in wanted):
            continue
        profile = conn["pvegpu_twin"].get("profile")
        base = specs.get(name)
        while base is None and profile:
            base, profile = specs.get(profile), _parent_profile(profile)
        if base is None:
            continue
        data = dict(base)
        data.update(conn)
        data["pvegpu_node"] = conn["pvegpu_twin"].get("node") or base["pvegpu_node"]
        hosts.append((name, data))
    if not hosts:
        print("pvegpu: no twin is running; start one with: tests/twin/twinctl start kpro6 --profile kpro6", file=sys.stderr)
        raise SystemExit(2)
    return hosts


gpu_hosts = _twin_hosts()
