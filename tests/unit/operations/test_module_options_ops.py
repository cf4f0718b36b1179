"""Module-options stage: the commands its operations yield, run for real where they are shell,
the rendered unit checked by systemd-analyze, and the reboot reasons from real parameters."""

import shutil
import subprocess
from pathlib import Path

import pytest

from facts.files import ManagedFiles
from facts.kernel import parse_module_parameters
from operations import module_options as mo
from plan import nvidia as nvplan
from spec.load import load_spec_file
from tests.unit.operations.oprun import run_op

ROOT = Path(__file__).resolve().parents[3]
FIXTURES = ROOT / "tests" / "fixtures"


def kpro6_spec():
    return load_spec_file(ROOT / "inventories" / "kpro6.yml")["kpro6"]


def test_link_unit_creates_the_wants_link_and_is_noop_when_present(tmp_path):
    link = str(tmp_path / "multi-user.target.wants" / "x.service")
    target = str(tmp_path / "x.service")
    commands, _ = run_op(mo.link_unit, link=link, target=target, current=None)
    assert len(commands) == 1
    subprocess.run(["sh", "-c", commands[0]], check=True)
    assert Path(link).is_symlink() and str(Path(link).readlink()) == target
    fact = ManagedFiles()  # the stage reads the link with its files, in one command
    out = subprocess.run(["sh", "-c", fact.command([link, str(tmp_path / "none")])],
                         capture_output=True, text=True).stdout.splitlines()
    assert fact.process(out) == {link: {"link": target}, str(tmp_path / "none"): None}
    commands, noop = run_op(mo.link_unit, link=link, target=target, current=target)
    assert commands == [] and noop == f"{link} -> {target}"


def test_kpro6_blackwell_gets_hmm_off_and_nvreg_options():
    spec = kpro6_spec()
    hardware = {"pci_devices": {"0000:01:00.0": {"vendor": "10de", "device": "2bb5", "class": "030200"}},
                "nvidia_gpus": {}}
    want = mo.desired(spec, hardware)
    options = [line for line in want["conf"].splitlines() if line.startswith("options")]
    assert options == ["options nvidia NVreg_EnableGpuFirmware=1", "options nvidia_uvm uvm_disable_hmm=1"]
    assert want["disable_hmm"] is True


def test_auto_hmm_stays_on_for_the_recorded_h200(tmp_path):
    spec = kpro6_spec().model_copy(update={"nvidia": kpro6_spec().nvidia.model_copy(update={"uvm_disable_hmm": "auto", "nvreg": {}})})
    lines = (FIXTURES / "h200-vm" / "driver-gpus-information.txt").read_text().splitlines()[2:]
    from facts.nvidia import parse_gpu_information
    want = mo.desired(spec, {"pci_devices": {}, "nvidia_gpus": parse_gpu_information(lines)})
    assert want["disable_hmm"] is False
    assert not [line for line in want["conf"].splitlines() if line.startswith("options")]


def test_loaded_uvm_with_hmm_on_needs_a_reboot_when_file_disables_it():
    uvm = parse_module_parameters((FIXTURES / "h200-vm" / "uvm-params.txt").read_text().splitlines()[2:])
    assert mo.loaded_differences(True, {}, uvm, {}) == [
        f"nvidia_uvm runs with uvm_disable_hmm=N, {mo.MODPROBE_CONF} sets Y"]
    assert mo.loaded_differences(False, {}, uvm, {}) == []
    assert mo.loaded_differences(True, {}, {}, {}) == []  # not loaded: the file applies at load
    params = {"EnableGpuFirmware": "18", "RegistryDwords": '""'}  # /proc/driver/nvidia/params form
    assert mo.loaded_differences(False, {"NVreg_EnableGpuFirmware": 18}, {}, params) == []
    assert mo.loaded_differences(False, {"NVreg_EnableGpuFirmware": 1}, {}, params) == [
        f"nvidia runs with NVreg_EnableGpuFirmware=18, {mo.MODPROBE_CONF} sets 1"]


def test_preflight_refuses_unquotable_nvreg_values():
    spec = kpro6_spec()
    bad = spec.model_copy(update={"nvidia": spec.nvidia.model_copy(update={"nvreg": {"NVreg_RegistryDwords": 'a="1"'}})})
    refusals = mo.preflight(bad)
    assert len(refusals) == 1 and "nvidia.nvreg.NVreg_RegistryDwords" in refusals[0] and "double quote" in refusals[0]
    assert mo.preflight(spec) == []


@pytest.mark.skipif(not shutil.which("systemd-analyze") or not Path("/lib/systemd/system/sysinit.target").exists(),
                    reason="needs systemd-analyze and systemd's units")
def test_unit_passes_systemd_analyze_verify(tmp_path):
    root = tmp_path / "root"
    shutil.copytree("/lib/systemd/system", root / "lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    (root / "etc/systemd/system" / mo.NODES_UNIT_NAME).write_text(nvplan.render_nodes_unit())
    verify = ["systemd-analyze", "verify", "--man=no", f"--root={root}", mo.NODES_UNIT]
    # without the NVIDIA tools the unit must be reported (the check can fail) ...
    missing = subprocess.run(verify, capture_output=True, text=True)
    assert missing.returncode != 0 and "nvidia-modprobe is not executable" in missing.stderr
    # ... and with them it is clean
    (root / "usr/local/bin").mkdir(parents=True)
    for tool in ("nvidia-modprobe", "nvidia-smi"):
        (root / "usr/local/bin" / tool).write_text("#!/bin/sh\n")
        (root / "usr/local/bin" / tool).chmod(0o755)
    clean = subprocess.run(verify, capture_output=True, text=True)
    assert clean.returncode == 0, clean.stderr
    assert clean.stderr == ""
