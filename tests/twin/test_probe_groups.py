"""The first prefetch round of a kpro6 converge (every stage's `prefetch(spec)` and the upgrade
check's, as deploy.py builds it) on the kpro6 twin, its CT 200 running: the probe whose sections
run in groups at once (facts.hardware._grouped) prints the same bytes as the same sections one
after another, so every fact gets the same value."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from facts import hardware
from facts.hardware import combined_probe
from tests.twin import runtime

pytestmark = [pytest.mark.twin]

REPO = Path(__file__).resolve().parents[2]


def kpro6_prefetch() -> list:
    """deploy.py's first prefetch round for inventories/twin.yml's kpro6 host."""
    from operations import load_stages, upgrade
    from spec.load import inventory_hosts

    spec = dict(inventory_hosts(REPO / "inventories" / "twin.yml"))["kpro6"]["pvegpu_spec"]
    return [request for _, module in load_stages() if hasattr(module, "prefetch")
            for request in module.prefetch(spec)] + upgrade.prefetch(spec)


def run_in(twin, command: str) -> bytes:
    proc = subprocess.run(runtime.ssh_command(twin.name, ["sh -c " + shlex.quote(command)]), capture_output=True,
                          stdin=subprocess.DEVNULL, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_the_grouped_probe_gives_the_serial_probes_bytes_and_values_on_the_twin(twin_factory, monkeypatch):
    twin = twin_factory("kpro6", name="s14p")
    run_in(twin, "pct start 200")  # as on a serving host: the CT facts look into its root
    requests = kpro6_prefetch()
    probe = combined_probe(requests)
    grouped = str(probe().command)  # a str property (facts.hardware)
    monkeypatch.setattr(hardware, "PROBE_GROUPS", 1)
    serial = str(probe().command)
    monkeypatch.undo()
    assert grouped.count("3<&0") == hardware.PROBE_GROUPS - 1 and "3<&0" not in serial
    assert grouped.count("@@pvegpu-section") == serial.count("@@pvegpu-section") >= 30

    serial_out, grouped_out = run_in(twin, serial), run_in(twin, grouped)
    assert grouped_out == serial_out
    values = probe().process(grouped_out.decode().splitlines())
    assert values == probe().process(serial_out.decode().splitlines())
    # a real reading, not defaults: the twin's GPUs, its topology and CT 200's root
    hw = next(v for (fc, _), v in zip(requests, values, strict=True) if fc is hardware.HardwareProbe)
    assert hw["nvidia_gpus"] and hw["topology"] and hw["p2p_read"]
    assert b"@@ ct 200\nroot " in grouped_out
