"""facts.hardware.combined_probe / facts.once.prefetch: several stages' facts in one remote
command, each value exactly what the fact gives on its own, shared sections run once."""

from __future__ import annotations

import os
import re
import subprocess

from pyinfra.api import FactBase

from facts.boot import BootStageFacts
from facts.cpu import CpuInfo
from facts.files import ManagedFiles
from facts.hardware import SECTION_MARKER, HardwareProbe, HostConfigProbe, combined_probe
from facts.kernel import KernelCmdline

PATHS = ["/etc/hostname", "/etc/pvegpu-does-not-exist"]
REQUESTS = [(BootStageFacts, {}), (HardwareProbe, {}), (HostConfigProbe, {}), (ManagedFiles, {"paths": PATHS}),
            (KernelCmdline, {})]


def _run(command: str) -> list[str]:
    return subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=120).stdout.splitlines()


def _command(fact: FactBase) -> str:
    """The command of a fact whose `command` is a str (facts/base.py; pyinfra types it as a method)."""
    assert isinstance(fact.command, str), fact.command
    return fact.command


def _alone(fact_class, kwargs):
    fact = fact_class()
    command = fact.command(**kwargs) if callable(fact.command) else fact.command
    lines = _run(str(command))
    return fact.process(lines) if lines else fact.default()


def test_shared_sections_run_once():
    command = _command(combined_probe(REQUESTS)())
    cpu_command = str(CpuInfo().command)
    assert command.count(cpu_command) == 1  # CpuInfo is in BootStageFacts and in HardwareProbe
    assert command.count(str(KernelCmdline().command)) == 1  # in both probes and asked for alone
    sections = re.findall(f"echo '{SECTION_MARKER}c\\d+'", command)
    unique = {(fc, repr(a)) for probe in (BootStageFacts, HardwareProbe, HostConfigProbe)
              for fc, a in probe.sections.values()}
    assert len(sections) == len(unique) + 1  # + ManagedFiles; the lone KernelCmdline is shared


def test_values_equal_each_fact_read_alone():
    probe = combined_probe(REQUESTS)
    values = probe().process(_run(_command(probe())))
    assert len(values) == len(REQUESTS)
    for (fact_class, kwargs), value in zip(REQUESTS, values, strict=True):
        assert value == _alone(fact_class, kwargs), fact_class.__name__
    files = values[3]
    assert files["/etc/pvegpu-does-not-exist"] is None and files["/etc/hostname"]["sha256"]


def test_shared_values_are_separate_copies():
    probe = combined_probe([(BootStageFacts, {}), (HardwareProbe, {})])
    boot, hardware = probe().process(_run(_command(probe())))
    assert boot["cpu"] == hardware["cpu"] and boot["cpu"] is not hardware["cpu"]
    boot["cpu"]["mutated"] = True
    assert "mutated" not in hardware["cpu"]


def test_no_output_gives_each_default():
    probe = combined_probe(REQUESTS)
    values = probe().process([])
    assert values[0] == BootStageFacts.default() and values[1] == HardwareProbe.default()
    assert values[3] == ManagedFiles().default() and values[4] == KernelCmdline().default()


def test_prefetch_reads_once_and_fact_once_finds_every_value():
    """On a host whose facts run in a local shell: one command for all requests, none after."""
    from pyinfra.context import ctx_host, ctx_state
    from pyinfra_testing.util import FakeState

    from facts.once import fact_once, prefetch
    from tests.unit.operations.test_nccl_ops import ShellHost

    shell_host = ShellHost(dict(os.environ))
    with ctx_state.use(FakeState()), ctx_host.use(shell_host):
        assert prefetch(REQUESTS) == 1
        assert len(shell_host.commands) == 1
        values = [fact_once(fact_class, **kwargs) for fact_class, kwargs in REQUESTS]
        assert len(shell_host.commands) == 1  # all found in the memo
        assert prefetch(REQUESTS) == 0  # nothing left to read
        assert prefetch([(ManagedFiles, {"paths": ["/etc/hostname"]})]) == 1  # new args: one plain read
        assert shell_host.commands[-1] == ManagedFiles().command(paths=["/etc/hostname"])
    for (fact_class, kwargs), value in zip(REQUESTS, values, strict=True):
        assert value == _alone(fact_class, kwargs), fact_class.__name__


def test_on_the_gpu_machine_the_combined_probe_equals_each_probe_of_the_same_run():
    """Recorded on the H200 VM in one device run (tests/fixtures/h200-vm-probe/): the combined
    command of the boot stage's probe and both hardware probes, and each probe's own command."""
    from pathlib import Path

    recorded = Path(__file__).resolve().parents[1] / "fixtures" / "h200-vm-probe"

    def lines(name):
        return [line for line in (recorded / name).read_text().splitlines()[2:]]

    probe = combined_probe([(BootStageFacts, {}), (HardwareProbe, {}), (HostConfigProbe, {})])
    boot, hardware, config = probe().process(lines("combined-probe.txt"))
    assert hardware == HardwareProbe().process(lines("hardware-probe.txt"))
    assert config == HostConfigProbe().process(lines("host-config-probe.txt"))
    assert list(hardware["nvidia_gpus"]) == ["0000:00:06.0"] and hardware["pci_devices"]["0000:00:06.0"]["driver"] == "nvidia"
    # the boot stage's sections it shares with the hardware probe: read once, the same values
    assert boot["cpu"] == hardware["cpu"] and boot["cmdline"] == hardware["cmdline"] and boot["sev_snp"] == hardware["sev_snp"]
    assert _command(probe()).count(str(CpuInfo().command)) == 1


def test_a_probe_hands_its_whole_output_over_in_one_write():
    """The sections print in many small writes (each would be its own SSH packet for pyinfra to
    decrypt and wake a reader for); the probe's command collects them and writes once, at the end:
    nothing arrives before the script's last line was printed (here: after its pause)."""
    import time

    from facts.hardware import _one_write

    script = "i=0; while [ $i -lt 200 ]; do echo \"line $i of the probe, padded to some length\"; " \
             "[ $i = 100 ] && sleep 0.5; i=$((i+1)); done"
    t0 = time.monotonic()
    proc = subprocess.Popen(["sh", "-c", _one_write(script)], stdout=subprocess.PIPE)
    assert proc.stdout is not None  # stdout=PIPE
    os.set_blocking(proc.stdout.fileno(), True)  # gevent's Popen (once pyinfra_cli was imported) makes it non-blocking
    first = os.read(proc.stdout.fileno(), 1 << 20)  # blocks until the first write
    waited = time.monotonic() - t0
    rest = proc.stdout.read()
    proc.wait(timeout=30)
    assert waited >= 0.5 and first  # unbuffered, lines 0-100 would arrive before the pause
    assert (first + rest).decode().splitlines() == [f"line {i} of the probe, padded to some length" for i in range(200)]
    assert "dd bs=4M iflag=fullblock" in _command(combined_probe(REQUESTS)()) and "dd " in HardwareProbe().command
