"""operations.boot: facts in, commands out (both boot loaders, foreign params kept, noop reasons)."""

import base64
import re
import subprocess
from pathlib import Path

import pytest

from facts import boot as facts_boot
from facts.kernel import parse_boot_loader, parse_proc_cmdline
from operations import boot
from operations.files import sha256_text
from spec.models import HostSpec
from tests.unit.operations.oprun import run_op

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "cmdline"
AMD = {"vendor": "amd", "model": "AMD EPYC 9354", "flags": ["svm", "sev_snp"], "virtualized": False, "processors": 64}
INTEL = {"vendor": "intel", "model": "Xeon", "flags": ["vmx"], "virtualized": False, "processors": 8}
PVE8 = {"version": "8.4.1", "major": 8, "minor": 4, "running_kernel": "6.8.12-1-pve"}


def fixture_lines(name):
    return [l for l in (FIXTURES / name).read_text().splitlines()[2:] if not l.startswith("$ ")]


def systemd_boot_facts(kernel_cmdline, booted, files=None, modules=()):
    return {
        "boot_loader": parse_boot_loader([
            "@@ proxmox-boot-tool status",
            "Re-executing '/usr/sbin/proxmox-boot-tool' in new private mount namespace..",
            "System currently booted with uefi",
            "5E1A-0D2B is configured with: uefi (versions: 6.8.12-1-pve)",
            "@@ firmware", "uefi", "@@ /etc/kernel/cmdline", kernel_cmdline, "@@ /etc/default/grub",
        ]),
        "cmdline": parse_proc_cmdline([booted]),
        "sev_snp": {"enabled": False},
        "cpu": INTEL,
        "pve_version": PVE8,
        "grub_files": [],
        "modules": list(modules),
        "files": files or {},
    }


def grub_facts(grub_lines, booted, files=None, extra_files=()):
    return {
        "boot_loader": parse_boot_loader(["@@ firmware", "bios", "@@ /etc/default/grub"] + grub_lines),
        "cmdline": parse_proc_cmdline([booted]),
        "sev_snp": {"enabled": False},
        "cpu": INTEL,
        "pve_version": PVE8,
        "grub_files": [["/etc/default/grub", grub_lines], *extra_files],
        "modules": ["vfio", "vfio_iommu_type1", "vfio_pci"],
        "files": files or {},
    }


def test_systemd_boot_writes_etc_kernel_cmdline_keeping_zfs_root_then_refreshes():
    stock = "root=ZFS=rpool/ROOT/pve-1 boot=zfs"
    booted = fixture_lines("proxmox-systemd-boot-zfs-6.8.12-dmesg-command-line.txt")[0].split("Command line: ", 1)[1]
    spec = HostSpec(iommu={"passthrough": True, "params": ["pci=realloc"]})
    p = boot.boot_plan(spec, systemd_boot_facts(stock, booted))
    assert p["cmdline_path"] == "/etc/kernel/cmdline"
    assert p["cmdline_content"] == "root=ZFS=rpool/ROOT/pve-1 boot=zfs intel_iommu=on iommu=pt pci=realloc\n"
    # booted line has quiet and the i915 params the new config lacks, and lacks pci=realloc
    assert p["difference"]["missing"] == ["pci=realloc"]
    assert "quiet" in p["difference"]["extra"]
    commands, noop = run_op(boot.kernel_cmdline, p["cmdline_path"], p["cmdline_content"], None)
    assert len(commands) == 1 and noop is None
    assert "/etc/kernel/cmdline" in commands[0] and "base64 -d" in commands[0]
    assert "refresh" not in commands[0]  # the BOOT_REFRESH handler does it once, at the end
    assert p["refresh_command"] == "proxmox-boot-tool refresh"
    found = re.search(r"printf %s (\S+) \| base64 -d", commands[0])
    assert found, commands[0]
    written = found.group(1)
    assert base64.b64decode(written).decode() == p["cmdline_content"]


def test_grub_writes_a_dropin_and_runs_update_grub():
    lines = fixture_lines("proxmox-etc-default-grub-intel-sriov-kamilllooo.txt")
    booted = fixture_lines("proxmox-fuji-pve-6.5.11-intel-iommu-on.txt")[0]
    spec = HostSpec(iommu={"params": ["pci=realloc"]})
    p = boot.boot_plan(spec, grub_facts(lines, booted))
    assert p["loader"] == "grub" and p["cmdline_path"] == "/etc/default/grub.d/pvegpu.cfg"
    assert 'GRUB_CMDLINE_LINUX_DEFAULT="quiet intel_iommu=on i915.enable_guc=3 i915.max_vfs=7 pci=realloc"\n' in p["cmdline_content"]
    assert p["difference"] == {"missing": ["i915.enable_guc=3", "i915.max_vfs=7", "pci=realloc"], "extra": []}
    commands, _ = run_op(boot.kernel_cmdline, p["cmdline_path"], p["cmdline_content"], None)
    assert p["refresh_command"] == "update-grub" and "/etc/default/grub.d/pvegpu.cfg" in commands[0]
    assert "update-grub" not in commands[0]  # the BOOT_REFRESH handler runs it once, at the end


def test_grub_dropin_makes_grubenv_the_default_keeping_the_entry_configured_before(tmp_path):
    """GRUB_DEFAULT=saved (the kernel stage's grub-set-default / grub-reboot need it); the old
    GRUB_DEFAULT, a Proxmox pin snippet's included, becomes saved_entry where there is none."""
    lines = fixture_lines("proxmox-etc-default-grub-intel-sriov-kamilllooo.txt")
    pin = ["/etc/default/grub.d/proxmox-kernel-pin.cfg", ['GRUB_DEFAULT="gnulinux-advanced-ab>gnulinux-6.8.12-4-pve-advanced-ab"']]
    p = boot.boot_plan(HostSpec(), grub_facts(lines, "BOOT_IMAGE=/boot/vmlinuz-6.8 ro quiet", extra_files=[pin]))
    assert p["cmdline_content"].rstrip().endswith("\nGRUB_DEFAULT=saved")
    assert p["grub_default"] == "gnulinux-advanced-ab>gnulinux-6.8.12-4-pve-advanced-ab"
    commands, _ = run_op(boot.kernel_cmdline, p["cmdline_path"], p["cmdline_content"], None, p["grub_default"])
    assert commands[0] == boot.grub_keep_default_command("gnulinux-advanced-ab>gnulinux-6.8.12-4-pve-advanced-ab")
    assert "/etc/default/grub.d/pvegpu.cfg" in commands[1]
    # run it: grubenv with a saved_entry keeps it; without one gets the old default
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "grub-set-default").write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/set\n')
    (bin_dir / "grub-editenv").write_text(f"#!/bin/sh\ncat {tmp_path}/env\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    (tmp_path / "env").write_text("saved_entry=1\n")
    subprocess.run(["sh", "-c", commands[0]], env=env, check=True)
    assert not (tmp_path / "set").exists()
    (tmp_path / "env").write_text("next_entry=2\n")
    subprocess.run(["sh", "-c", commands[0]], env=env, check=True)
    assert (tmp_path / "set").read_text() == "gnulinux-advanced-ab>gnulinux-6.8.12-4-pve-advanced-ab\n"
    p = boot.boot_plan(HostSpec(), grub_facts(['GRUB_DEFAULT=saved'], "BOOT_IMAGE=/boot/vmlinuz-6.8 ro quiet"))
    commands, _ = run_op(boot.kernel_cmdline, p["cmdline_path"], p["cmdline_content"], None, p["grub_default"])
    assert len(commands) == 1  # already saved: nothing to carry over


def test_grub_on_esps_keeps_proxmoxs_pin_as_grub_default(tmp_path):
    """Issue 38 2.4: GRUB on proxmox-boot-tool's ESPs (legacy BIOS + ZFS) reads the ESP's grubenv,
    never the root's /boot/grub/grubenv: a GRUB_DEFAULT=saved drop-in (sourced after Proxmox's
    proxmox-kernel-pin.cfg) would override the pin with a saved_entry that GRUB never sees, and it
    would boot the first entry, the newest kernel. The drop-in leaves GRUB_DEFAULT to the pin."""
    lines = fixture_lines("proxmox-etc-default-grub-intel-sriov-kamilllooo.txt")
    pin = ["/etc/default/grub.d/proxmox-kernel-pin.cfg", ['GRUB_DEFAULT="gnulinux-advanced-ab>gnulinux-6.8.12-4-pve-advanced-ab"']]
    facts = grub_facts(lines, "BOOT_IMAGE=/vmlinuz-6.8 root=ZFS=rpool/ROOT/pve-1 boot=zfs", extra_files=[pin])
    facts["boot_loader"] = parse_boot_loader([
        "@@ proxmox-boot-tool status", "System currently booted with legacy bios",
        "2A4C-77E1 is configured with: grub (versions: 6.8.12-4-pve, 6.8.12-9-pve)",
        "@@ firmware", "bios", "@@ /etc/default/grub", *lines])
    p = boot.boot_plan(HostSpec(), facts)
    assert p["loader"] == "grub" and p["refresh_command"] == "proxmox-boot-tool refresh"
    assert "GRUB_DEFAULT" not in "".join(line for line in p["cmdline_content"].splitlines(True)
                                         if not line.startswith("#"))
    assert p["grub_default"] is None
    commands, _ = run_op(boot.kernel_cmdline, p["cmdline_path"], p["cmdline_content"], None, p["grub_default"])
    assert len(commands) == 1 and "grub-set-default" not in commands[0]
    # what grub-mkconfig sources, in order: the pin stays GRUB_DEFAULT
    (tmp_path / "grub").write_text("\n".join(lines) + "\n")
    (tmp_path / "pin.cfg").write_text(pin[1][0] + "\n")
    (tmp_path / "pvegpu.cfg").write_text(p["cmdline_content"])
    got = subprocess.run(["sh", "-c", f". {tmp_path}/grub; . {tmp_path}/pin.cfg; . {tmp_path}/pvegpu.cfg; "
                          'printf %s "$GRUB_DEFAULT"'], capture_output=True, text=True, check=True).stdout
    assert got == "gnulinux-advanced-ab>gnulinux-6.8.12-4-pve-advanced-ab"


def test_grub_dropin_is_sourced_by_sh_after_the_admins_file(tmp_path):
    """What grub-mkconfig does: `. /etc/default/grub; for x in grub.d/*.cfg; . $x`."""
    lines = fixture_lines("puget-wrx90-etc-default-grub-amd-iommu-off.txt")
    spec = HostSpec(iommu={"params": ["pci=realloc"]})
    facts = grub_facts(lines, "BOOT_IMAGE=/boot/vmlinuz-6.8 root=/dev/sda ro quiet")
    facts["cpu"] = AMD
    p = boot.boot_plan(spec, facts)
    (tmp_path / "grub").write_text("\n".join(l for l in lines if not l.startswith("GRUB_DISTRIBUTOR")) + "\n")
    (tmp_path / "pvegpu.cfg").write_text(p["cmdline_content"])
    out = subprocess.run(["sh", "-c", f'. {tmp_path}/grub; . {tmp_path}/pvegpu.cfg; printf %s "$GRUB_CMDLINE_LINUX_DEFAULT"'],
                         capture_output=True, text=True, check=True).stdout
    assert out == p["configured"]
    assert out.split()[:3] == ["amd_iommu=on", "pci=realloc", "isolcpus=0-3"]
    assert out.endswith("default_hugepagesz=1G hugepagesz=1G hugepages=8")


def test_no_change_is_a_noop_with_a_reason_and_no_reboot_reason():
    configured = "root=ZFS=rpool/ROOT/pve-1 boot=zfs intel_iommu=on iommu=pt"
    booted = fixture_lines("proxmox-systemd-boot-zfs-5.4.73-proc-cmdline.txt")[0]
    spec = HostSpec(iommu={"passthrough": True})
    facts = systemd_boot_facts(configured, booted, modules=["vfio", "vfio_iommu_type1", "vfio_pci"])
    p = boot.boot_plan(spec, facts)
    facts["files"] = {boot.KERNEL_CMDLINE: {"mode": "644", "sha256": sha256_text(configured + "\n")}}
    facts["files"].update({path: {"mode": "644", "sha256": sha256_text(text)} for path, text in p["modules"].items()})
    commands, noop = run_op(boot.kernel_cmdline, p["cmdline_path"], p["cmdline_content"],
                            facts["files"][boot.KERNEL_CMDLINE])
    assert commands == [] and noop == "/etc/kernel/cmdline already has the kernel command line"
    commands, noop = run_op(boot.early_modules, p["modules"], facts["files"])
    assert commands == [] and noop == "vfio early load and the nouveau blacklist are up to date"
    assert p["difference"] == {"missing": [], "extra": []} and p["modules_pending"] == []


def test_admin_mode_of_etc_kernel_cmdline_is_kept():
    content = "root=/dev/sda intel_iommu=on\n"
    commands, noop = run_op(boot.kernel_cmdline, "/etc/kernel/cmdline", content,
                            {"mode": "600", "sha256": sha256_text(content)})
    assert commands == [] and noop
    commands, _ = run_op(boot.kernel_cmdline, "/etc/kernel/cmdline", content,
                         {"mode": "600", "sha256": "0" * 64})
    assert "chmod 600" in commands[0]


def test_early_modules_writes_only_the_changed_files_and_leaves_the_initramfs_to_the_handler():
    spec = HostSpec()
    p = boot.boot_plan(spec, systemd_boot_facts("root=/dev/sda", "root=/dev/sda"))
    assert p["modules"][boot.VFIO_CONF].splitlines()[-3:] == ["vfio", "vfio_iommu_type1", "vfio_pci"]
    assert "blacklist nouveau" in p["modules"][boot.NOUVEAU_CONF]
    states: dict[str, dict | None] = {boot.NOUVEAU_CONF: {"mode": "644", "sha256": sha256_text(p["modules"][boot.NOUVEAU_CONF])}}
    commands, noop = run_op(boot.early_modules, p["modules"], states)
    assert len(commands) == 1 and boot.VFIO_CONF in commands[0] and boot.NOUVEAU_CONF not in commands[0]
    assert "update-initramfs" not in commands[0]
    assert boot.changed_modules(p["modules"], states) == [boot.VFIO_CONF]
    assert p["modules_pending"] == [f"{m} is not loaded yet" for m in ("vfio", "vfio_iommu_type1", "vfio_pci")]


def test_pve7_lists_vfio_virqfd():
    facts = systemd_boot_facts("root=/dev/sda", "root=/dev/sda")
    facts["pve_version"] = {"version": "7.4", "major": 7, "minor": 4, "running_kernel": "5.15.0-1-pve"}
    assert "vfio_virqfd" in boot.boot_plan(HostSpec(), facts)["modules"][boot.VFIO_CONF].split()


def test_grub_files_fact_lists_files_in_sourcing_order(tmp_path):
    out = ["@@ /etc/default/grub", "GRUB_DEFAULT=0", "@@ /etc/default/grub.d/init-select.cfg", "X=1",
           "@@ /etc/default/grub.d/pvegpu.cfg", "GRUB_CMDLINE_LINUX_DEFAULT=\"q\""]
    assert facts_boot.GrubFiles().process(out) == [
        ["/etc/default/grub", ["GRUB_DEFAULT=0"]], ["/etc/default/grub.d/init-select.cfg", ["X=1"]],
        ["/etc/default/grub.d/pvegpu.cfg", ['GRUB_CMDLINE_LINUX_DEFAULT="q"']]]


def test_stage_probe_is_one_command_with_every_section():
    command = facts_boot.BootStageFacts().command
    for key in facts_boot.BootStageFacts.sections:
        assert f"@@pvegpu-section {key}" in command
    result = facts_boot.BootStageFacts().process(
        ["@@pvegpu-section modules", "vfio", "@@pvegpu-section files", "==> pvegpu-file /etc/kernel/cmdline", "MISSING"])
    assert result["modules"] == ["vfio"] and result["files"] == {"/etc/kernel/cmdline": None}


@pytest.mark.parametrize("loader", ["grub", "systemd-boot"])
def test_sev_snp_host_refuses_passthrough_in_preflight(loader, monkeypatch):
    facts = systemd_boot_facts("root=/dev/sda", "root=/dev/sda") if loader == "systemd-boot" else grub_facts(
        ['GRUB_CMDLINE_LINUX_DEFAULT="quiet"'], "root=/dev/sda")
    facts["cpu"] = AMD
    facts["sev_snp"] = {"cpu_flags": ["sev_snp"], "kvm_sev": True, "kvm_sev_snp": True, "enabled": True}
    monkeypatch.setattr(boot, "stage_facts", lambda: facts)
    refusals = boot.preflight(HostSpec(iommu={"passthrough": True}))
    assert len(refusals) == 1 and "SEV-SNP" in refusals[0]
    assert boot.preflight(HostSpec()) == []


MIXED_ESPS: dict = {"firmware": "uefi", "efivars": {}, "esp_list": ["5A1C-9E27", "7B2D-1F30"], "grub_cfg": None,
              "grubenv": None, "esps": [
                  {"uuid": "5A1C-9E27", "mounted": True, "has": ["EFI/proxmox/grubx64.efi", "grub"]},
                  {"uuid": "7B2D-1F30", "mounted": True, "has": ["loader/loader.conf"]}]}


def test_esps_of_both_loaders_are_refused_before_the_cmdline_is_written(monkeypatch):
    """Issue 38: proxmox-boot-tool refresh keeps GRUB's mode for the ESPs after a GRUB one
    (zz-proxmox-boot update_esp_func), so with ESPs of both loaders the stage refuses."""
    facts = systemd_boot_facts("root=/dev/sda", "root=/dev/sda")
    monkeypatch.setattr(boot, "stage_facts", lambda: {**facts, "loader_state": MIXED_ESPS})
    refusals = boot.preflight(HostSpec())
    assert len(refusals) == 1 and "5A1C-9E27 (grub), 7B2D-1F30 (systemd-boot)" in refusals[0]
    assert "proxmox-boot-tool init /dev/disk/by-uuid/7B2D-1F30 grub" in refusals[0]
    one_mode = {**MIXED_ESPS, "esps": [MIXED_ESPS["esps"][0], {**MIXED_ESPS["esps"][0], "uuid": "7B2D-1F30"}]}
    monkeypatch.setattr(boot, "stage_facts", lambda: {**facts, "loader_state": one_mode})
    assert boot.preflight(HostSpec()) == []


def test_the_loader_state_is_read_only_with_more_than_one_esp(monkeypatch):
    """One ESP has one mode: no extra remote read (test_boot_e2e counts a no-change stage's)."""
    from facts.loader import LoaderState
    one = systemd_boot_facts("root=/dev/sda", "root=/dev/sda")
    two = {**one, "boot_loader": {**one["boot_loader"], "esps": one["boot_loader"]["esps"] * 2}}
    for facts, reads in ((one, False), (two, True)):
        read: list = []
        monkeypatch.setattr(boot, "fact_once", lambda cls, facts=facts, read=read:
                            read.append(cls) or (MIXED_ESPS if cls is LoaderState else facts))
        got = boot.stage_facts()
        assert (LoaderState in read) == reads and ("loader_state" in got) == reads
