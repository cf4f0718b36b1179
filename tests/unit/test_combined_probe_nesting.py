"""A fact that marks its own parts with the probe marker (facts.kernel.KernelStageFacts:
``@@pvegpu-section kernels``/``build``/``source``/``needs``) read in deploy.py's batched prefetch
(facts.hardware.combined_probe) gets its whole output, as when it runs alone.

Found by tests/e2e/test_example_inventories_e2e.py: `--dry` of inventories/kpro6.yml (a spec with
`kernel:`) ended in a traceback in operations/kernel.py preflight, because the batch cut at the
kernel fact's own markers and handed it no lines (its value None). Fails on the old code."""

from __future__ import annotations

from pathlib import Path

from facts.hardware import SECTION_MARKER, combined_probe
from facts.kernel import KernelStageFacts, ProxmoxKernels
from facts.sections import split_sections

REPO = Path(__file__).resolve().parents[2]
RECORDED = REPO / "tests/fixtures/twin-kpro6/kernel-stage-facts-no-build.txt"  # the fact's own output, on the twin
KWARGS = {"build_dir": "/var/lib/pvegpu/kernel-build/6.14.11-9-bpo12-pve-3f0c2a9e", "release": "6.14.11-9-bpo12-pve",
          "url": "git://git.proxmox.com/git/pve-kernel.git", "ref": "bookworm-6.14"}


def recorded() -> list[str]:
    return [line for line in RECORDED.read_text().splitlines() if not line.startswith("# ")]


def test_the_kernel_stage_fact_in_a_batch_reads_as_it_reads_alone():
    alone = KernelStageFacts().process(recorded())
    assert alone["kernels"]["running"] and alone["build"] is not None
    probe = combined_probe([(ProxmoxKernels, {}), (KernelStageFacts, KWARGS)])
    kernels_alone = [line for line in recorded()[recorded().index(f"{SECTION_MARKER}kernels") + 1:
                                                 recorded().index(f"{SECTION_MARKER}build")]]
    # the batch's output: its own markers c0, c1 before each fact's output, as _probe_command prints them
    output = [f"{SECTION_MARKER}c0", *kernels_alone, f"{SECTION_MARKER}c1", *recorded()]
    kernels, stage = probe().process(output)
    assert stage == alone
    assert kernels == ProxmoxKernels().process(kernels_alone)


def test_the_batch_command_marks_only_its_own_sections():
    probe = combined_probe([(ProxmoxKernels, {}), (KernelStageFacts, KWARGS)])
    command = str(probe().command)  # a str-valued property (SectionedProbe)
    assert f"{SECTION_MARKER}c0" in command and f"{SECTION_MARKER}c1" in command
    assert set(split_sections(recorded(), SECTION_MARKER, names=["c0", "c1"])) == set()  # no cut inside the fact
