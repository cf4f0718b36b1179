"""Inventory for the digital twins on this machine; their specs live in twin.yml.

    tests/twin/twinctl start kpro6 --profile kpro6
    pyinfra inventories/twin.py deploy.py --dry

A host of twin.yml named N connects to the running twin N (`.twin/N/twin.json`, written by the
twin runtime: loopback address, port, per-run key). Hosts whose twin is not running are left
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
    return {
        "ssh_hostname": twin["address"],
        "ssh_port": int(twin["port"]),
        "ssh_user": "root",
        "ssh_key": twin["key"],
        "ssh_known_hosts_file": "/dev/null",
        "ssh_strict_host_key_checking": "no",
        "pvegpu_twin": twin,
    }


def _twin_hosts():
    wanted = [n for n in os.environ.get("PVEGPU_TWINS", "").split(",") if n]
    hosts = []
    for name, data in inventory_hosts(Path(__file__).with_suffix(".yml")):
        conn = _twin_connection(name)
        if conn is None or (wanted and name not in wanted):
            continue
        data.update(conn)
        hosts.append((name, data))
    if not hosts:
        print("pvegpu: no twin is running; start one with: tests/twin/twinctl start kpro6 --profile kpro6", file=sys.stderr)
        raise SystemExit(2)
    return hosts


gpu_hosts = _twin_hosts()
