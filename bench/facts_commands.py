"""How many remote commands a host's full hardware picture costs (target: at most 3).

Connects with pyinfra's own API to the running kpro6 twin (.twin/kpro6/twin.json) when there
is one, otherwise to @local, counts every command pyinfra sends through the host (a wrapper on
`Host.run_shell_command`) while it loads the batched probes (facts.hardware), then loads every
individual fact the probes cover, and checks both give identical data.

    .venv/bin/python bench/facts_commands.py [--json] [--local] [--twin NAME]
    .venv/bin/python bench/facts_commands.py --device-script out/facts-device.sh
        (writes a shell script that runs every fact command and both probes on a machine
         without pyinfra, e.g. the GPU machine; see tests/fixtures/h200-vm-facts/)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pyinfra.api import Config, Inventory, State  # noqa: E402
from pyinfra.api.connect import connect_all  # noqa: E402
from pyinfra.api.facts import get_fact  # noqa: E402

from facts.hardware import HardwareProbe, HostConfigProbe  # noqa: E402

TARGET = 3
PROBES = (HardwareProbe, HostConfigProbe)


def running_twin(name: str = "kpro6") -> dict | None:
    """A twin's description (.twin/<name>/twin.json) when its supervisor is alive."""
    path = REPO / ".twin" / name / "twin.json"
    try:
        twin = json.loads(path.read_text())
        os.kill(int(twin["pid"]), 0)
        return twin
    except (OSError, ValueError, KeyError):
        return None


def connect(twin: dict | None):
    if twin:
        name = twin["address"]
        data = {"ssh_port": twin["port"], "ssh_key": twin["key"], "ssh_user": "root",
                "ssh_known_hosts_file": "/dev/null", "ssh_strict_host_key_checking": "no"}
        inventory = Inventory(([(name, data)], {}))
    else:
        name = "@local"
        inventory = Inventory(([name], {}))
    state = State(inventory, Config())
    connect_all(state)
    host = inventory.get_host(name)
    if not host.connected:
        raise RuntimeError(f"could not connect to {name}")
    commands: list[str] = []
    run = host.run_shell_command

    def counted(command, *args, **kwargs):
        commands.append(str(command))
        return run(command, *args, **kwargs)

    host.run_shell_command = counted  # type: ignore[method-assign]  # count what this host object runs
    return state, host, commands


def measure(twin: dict | None) -> dict:
    state, host, commands = connect(twin)
    t0 = time.monotonic()
    batched = {probe.__name__: get_fact(state, host, probe) for probe in PROBES}
    batched_seconds = time.monotonic() - t0
    batched_commands = len(commands)

    commands.clear()
    t0 = time.monotonic()
    mismatches = []
    for probe in PROBES:
        for key, (fact_class, args) in probe.sections.items():
            kwargs = dict(zip(_arg_names(fact_class), args, strict=False))  # args may stop before the defaults
            single = get_fact(state, host, fact_class, kwargs=kwargs)
            if json.dumps(single, sort_keys=True, default=str) != json.dumps(
                batched[probe.__name__][key], sort_keys=True, default=str
            ):
                mismatches.append(key)
    individual_seconds = time.monotonic() - t0
    return {
        "value": batched_commands,
        "target": TARGET,
        "host": twin["address"] if twin else "@local",
        "individual_commands": len(commands),
        "batched_seconds": round(batched_seconds, 3),
        "individual_seconds": round(individual_seconds, 3),
        "identical": not mismatches,
        "mismatches": mismatches,
    }


def _arg_names(fact_class) -> list[str]:
    import inspect

    command = fact_class().command
    if not callable(command):
        return []
    return [name for name in inspect.signature(command).parameters]


def device_script() -> str:
    """A POSIX shell script running every probe section's fact command, then both probes,
    with pyinfra's own missing-command guard, into $OUT (for a machine without pyinfra)."""
    lines = ["#!/bin/sh", 'out=${OUT:-.}', ": >\"$out/facts.txt\""]
    for probe in PROBES:
        for key, (fact_class, args) in probe.sections.items():
            fact = fact_class()
            command = fact.command(*args) if callable(fact.command) else fact.command
            required = fact.requires_command(*args)
            if required:
                command = (f"if command -v {required} >/dev/null 2>&1; then ( {command} ); "
                           "else echo '##PYINFRA_NOCMD##'; fi")
            lines.append(f"echo '#### {probe.__name__} {key}' >>\"$out/facts.txt\"")
            lines.append(f"( {command} ) >>\"$out/facts.txt\" 2>/dev/null")
        lines.append(f"( {probe().command} ) >\"$out/{probe.__name__}.txt\" 2>/dev/null")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true", help="last line: the result as JSON")
    parser.add_argument("--local", action="store_true", help="measure @local even with a twin running")
    parser.add_argument("--twin", default="kpro6", help="name of the running twin to measure (.twin/<name>)")
    parser.add_argument("--device-script", help="write the device script here and exit")
    options = parser.parse_args()
    if options.device_script:
        Path(options.device_script).parent.mkdir(parents=True, exist_ok=True)
        Path(options.device_script).write_text(device_script())
        return 0
    twin = None if options.local else running_twin(options.twin)
    result = measure(twin)
    verdict = "ok" if result["value"] <= TARGET and result["identical"] else "MISSED"
    print(f"{'figure':34} {'value':>8} {'target':>8}")
    print(f"{'remote commands, full picture':34} {result['value']:>8} {'<= ' + str(TARGET):>8}  {verdict}")
    print(f"{'  same facts one by one':34} {result['individual_commands']:>8}")
    print(f"{'  seconds batched / one by one':34} {result['batched_seconds']:>8} {result['individual_seconds']:>8}")
    print(f"  host: {result['host']}; batched and individual data identical: {result['identical']}")
    if options.json:
        print(json.dumps(result))
    return 0 if verdict == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
