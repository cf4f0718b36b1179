"""Every fact case's output is real: it equals the named fixture file's lines (section markers
the fact's own command prints aside), and every fixture of the folders the facts read is used
by a case or skipped with a written reason."""

import fnmatch
from functools import cache
from pathlib import Path

import pytest
import yaml

CASES = Path(__file__).parent / "facts"
FIXTURES = Path(__file__).parents[1] / "fixtures"
CASE_FILES = sorted(CASES.glob("*.*/*.yaml"))
# Fixture folders whose every file must feed a fact case (or be skipped with a reason).
COVERED_FOLDERS = ("topo-m", "topo-p2p", "driver-version", "proc-devices", "iommu-groups", "lxc-conf", "lspci", "h200-vm", "h200-vm-probe", "debian-headers", "pveversion",
                   "proxmox-boot-tool", "twin-kpro6")
SKIPPED_WITH_REASON = {
    # from tests/unit/facts/generate_cases.py SKIPPED, plus h200-vm outputs no fact reads
    "proc-devices/ls-dev-char-nvidia-symlinks-uvm-234-caps-237.txt",
    "lspci/*-lspci-tv.txt",
    "h200-vm/nvidia-smi*.txt",  # the default nvidia-smi table and -L/-q: no fact parses them
    "h200-vm/query-*.txt",  # --query-gpu CSV: read by host checks, not facts
    "h200-vm/meminfo.txt",
    "h200-vm/modinfo-nvidia.txt",
    "h200-vm/proc-modules.txt",
    "h200-vm/sysfs-pci-tree.txt",  # the same tree PciDevices reads from sysfs-pci-fact.txt
    # scripts/record-gpu-host.sh's per-function form of the same sysfs: tests/unit/test_pci_forms.py
    "h200-vm/sysfs-pci.txt",
    # lspci -D -vvv / -D -n -vvv of one run: both headers read the same, tests/unit/test_pci_forms.py
    # (the fact's own command on that run is h200-vm/pci-acs-fact.txt)
    "h200-vm/lspci-D-vvv.txt",
    "h200-vm/lspci-D-n-vvv.txt",
    "h200-vm/torch-peer.txt",
    "h200-vm/uname.txt",
    "h200-vm-probe/facts.txt",  # each fact's own command on the same run: tests/unit/test_facts_probe.py
    "h200-vm-probe/combined-probe.txt",  # the same run's first prefetch round: tests/unit/test_prefetch.py
    # real `pveversion` outputs: the facts read the same versions from dpkg now (facts/proxmox.py,
    # twin-kpro6/pve-*-dpkg.txt); tests/unit/test_plan_guests.py compares the two
    "pveversion/*.txt",
}


@cache
def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _fixture_lines(name: str, ranges: list) -> list[str]:
    lines = (FIXTURES / name).read_text().splitlines()
    return [line for start, end in ranges for line in lines[start - 1:end]]


@pytest.mark.parametrize("path", CASE_FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_case_output_is_the_fixture(path):
    case = _load(path)
    assert (FIXTURES / case["fixture"]).is_file(), case["fixture"]
    if "sections" in case:
        expected = [line for section in case["sections"]
                    for line in _fixture_lines(section["fixture"], section["fixture_lines"])]
        markers = [line for line in case["output"] if line.startswith("@@ ")]
        assert [line for line in case["output"] if not line.startswith("@@ ")] == expected
        assert {s["marker"] for s in case["sections"]} <= set(markers)
    else:
        assert case["output"] == _fixture_lines(case["fixture"], case["fixture_lines"])
    assert case["output"], "a case must feed some real output"


def test_every_relevant_fixture_is_used_or_skipped_with_reason():
    used = {_load(p)["fixture"] for p in CASE_FILES}
    for case in CASE_FILES:
        for section in _load(case).get("sections", []):
            used.add(section["fixture"])
    missing = []
    for folder in COVERED_FOLDERS:
        for path in sorted((FIXTURES / folder).glob("*.txt")):
            name = f"{folder}/{path.name}"
            if name in used or any(fnmatch.fnmatch(name, pattern) for pattern in SKIPPED_WITH_REASON):
                continue
            missing.append(name)
    assert missing == []
