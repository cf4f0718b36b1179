"""plan.boot on real cmdline / boot config fixtures (tests/fixtures/cmdline)."""

from pathlib import Path

import pytest

from facts.kernel import parse_boot_loader, parse_cmdline_text
from plan.boot import (
    GRUB_DROPIN,
    cmdline_difference,
    desired_params,
    grub_configured_cmdline,
    grub_dropin_values,
    merge_cmdline,
    preflight_refusals,
    sh_double_quoted,
    vfio_modules,
)
from spec.models import HostSpec

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "cmdline"
AMD = {"vendor": "amd", "model": "AMD EPYC 9354", "flags": ["svm"], "virtualized": False, "processors": 64}
INTEL = {"vendor": "intel", "model": "Xeon", "flags": ["vmx"], "virtualized": False, "processors": 8}
SNP_ON = {"cpu_flags": ["sev", "sev_es", "sev_snp"], "kvm_sev": True, "kvm_sev_snp": True, "enabled": True}


def fixture_lines(name: str) -> list[str]:
    lines = (FIXTURES / name).read_text().splitlines()
    assert lines[0].startswith("# source:") and lines[1].startswith("# machine:")
    return [line for line in lines[2:] if not line.startswith("$ ")]


def spec(**iommu) -> HostSpec:
    return HostSpec(iommu=iommu)


def test_vendor_from_cpu_facts_and_passthrough_only_when_asked():
    assert desired_params(spec(params=["pci=realloc"]), AMD) == ["amd_iommu=on", "pci=realloc"]
    assert desired_params(spec(passthrough=True), INTEL) == ["intel_iommu=on", "iommu=pt"]
    assert desired_params(spec(vendor="intel"), AMD) == ["intel_iommu=on"]
    assert desired_params(spec(acs_override="downstream,multifunction"), AMD) == [
        "amd_iommu=on", "pcie_acs_override=downstream,multifunction"]


def test_systemd_boot_zfs_stock_line_keeps_root_and_order():
    stock, with_iommu = [l for l in fixture_lines("proxmox-etc-kernel-cmdline-zfs-default-and-iommu.txt") if l]
    merged = merge_cmdline(stock, desired_params(spec(passthrough=True, params=["pci=realloc"]), INTEL),
                           spec(passthrough=True, params=["pci=realloc"]))
    assert merged == "root=ZFS=rpool/ROOT/pve-1 boot=zfs intel_iommu=on iommu=pt pci=realloc"
    # the fixture's hand-edited "after" line is exactly our merge without pci=realloc
    assert merge_cmdline(stock, ["intel_iommu=on", "iommu=pt"], spec(passthrough=True)) == with_iommu


def test_no_change_when_the_line_already_has_everything():
    _, with_iommu = [l for l in fixture_lines("proxmox-etc-kernel-cmdline-zfs-default-and-iommu.txt") if l]
    s = spec(passthrough=True)
    assert merge_cmdline(with_iommu, desired_params(s, INTEL), s) == with_iommu


H200_VM_CMDLINE = Path(__file__).resolve().parents[1] / "fixtures" / "h200-vm" / "proc-cmdline.txt"


def test_init_arguments_after_a_lone_dashes_stay_init_arguments():
    """Issue 43 item 3: the H200 VM's /proc/cmdline (a real device run) hands `--firecracker-init --addr
    0.0.0.0:2024 …` to init after a lone `--`; they are no kernel parameters, and our words go before
    the `--`, never after it (there the kernel would hand them to init)."""
    line = H200_VM_CMDLINE.read_text().splitlines()[2]
    parsed = parse_cmdline_text(line)
    assert parsed["init_args"][:4] == ["--firecracker-init", "--addr", "0.0.0.0:2024", "--max-ws-buffer-size"]
    assert parsed["args"][-1] == "fc_dmapin=0xeebe0000,0x3000,0xeebf0000"
    assert not {"--", "--addr", "0.0.0.0:2024", "32768"} & set(parsed["params"])
    merged = merge_cmdline(line, ["intel_iommu=on"], spec())
    kernel, init = merged.split(" -- ")
    assert kernel.endswith("fc_dmapin=0xeebe0000,0x3000,0xeebf0000 intel_iommu=on")
    assert init.split() == parsed["init_args"]
    # the kernel reads a quoted "--" as the same end (lib/cmdline.c next_arg drops the quotes)
    assert parse_cmdline_text('ro "--" quiet')["init_args"] == ["quiet"]
    assert parse_cmdline_text("ro --=x -x quiet")["init_args"] == []  # a value or another word is no end


def test_stale_values_replaced_in_place_foreign_words_kept():
    # puget: amd_iommu=off iommu=pt pci=realloc=off + hugepages, isolcpus, …
    grub = parse_boot_loader(["@@ /etc/default/grub"] + fixture_lines("puget-wrx90-etc-default-grub-amd-iommu-off.txt"))
    before = grub["grub"]["GRUB_CMDLINE_LINUX_DEFAULT"].split()
    s = spec(params=["pci=realloc"])
    after = merge_cmdline(" ".join(before), desired_params(s, AMD), s).split()
    assert after[:3] == ["amd_iommu=on", "pci=realloc", "isolcpus=0-3"]  # iommu=pt dropped: not asked for
    assert after[2:] == before[3:]  # everything foreign, same order


def test_repeated_key_later_value_does_not_survive():
    s = spec()
    assert merge_cmdline("quiet amd_iommu=on x amd_iommu=off", ["amd_iommu=on"], s) == "quiet amd_iommu=on x"


def test_pci_options_merge_per_option():
    s = spec(params=["pci=realloc"])
    assert merge_cmdline("pci=noaer,realloc=off quiet", ["pci=realloc"], s) == "pci=noaer,realloc quiet"
    assert merge_cmdline("pci=noaer quiet", ["pci=realloc"], s) == "pci=noaer quiet pci=realloc"


def test_acs_override_dropped_when_not_in_spec():
    assert merge_cmdline("quiet pcie_acs_override=downstream", ["amd_iommu=on"], spec()) == "quiet amd_iommu=on"


def test_difference_against_booted_systemd_boot():
    booted = fixture_lines("proxmox-systemd-boot-zfs-5.4.73-proc-cmdline.txt")[0]
    assert cmdline_difference("root=ZFS=rpool/ROOT/pve-1 boot=zfs intel_iommu=on iommu=pt", booted) == {
        "missing": [], "extra": []}
    diff = cmdline_difference("root=ZFS=rpool/ROOT/pve-1 boot=zfs intel_iommu=on pci=realloc", booted)
    assert diff == {"missing": ["pci=realloc"], "extra": ["iommu=pt"]}


def test_difference_against_booted_grub_ignores_words_grub_adds():
    booted = fixture_lines("proxmox-suprox-pve-6.5.11-intel-iommu-pt.txt")[0]
    configured = "quiet intel_iommu=on iommu=pt intel_pstate=enable"
    assert cmdline_difference(configured, booted, "grub") == {"missing": [], "extra": []}
    fuji = fixture_lines("proxmox-fuji-pve-6.5.11-intel-iommu-on.txt")[0]
    assert cmdline_difference(configured, fuji, "grub") == {"missing": ["iommu=pt", "intel_pstate=enable"], "extra": []}


def test_grub_dropin_on_kamilllooo_keeps_sriov_params():
    lines = fixture_lines("proxmox-etc-default-grub-intel-sriov-kamilllooo.txt")
    s = spec(params=["pci=realloc"])
    values = grub_dropin_values([("/etc/default/grub", lines)], desired_params(s, INTEL), s)
    assert values == {"GRUB_CMDLINE_LINUX_DEFAULT": "quiet intel_iommu=on i915.enable_guc=3 i915.max_vfs=7 pci=realloc"}
    # our own drop-in (already written) does not feed back into the computation
    dropin = [f"GRUB_CMDLINE_LINUX_DEFAULT={sh_double_quoted(values['GRUB_CMDLINE_LINUX_DEFAULT'])}"]
    again = grub_dropin_values([("/etc/default/grub", lines), (GRUB_DROPIN, dropin)], desired_params(s, INTEL), s)
    assert again == values
    assert grub_configured_cmdline(values, [("/etc/default/grub", lines)]) == values["GRUB_CMDLINE_LINUX_DEFAULT"]


def test_grub_cmdline_linux_conflict_is_cleaned():
    lines = ['GRUB_CMDLINE_LINUX="amd_iommu=off console=ttyS0"', 'GRUB_CMDLINE_LINUX_DEFAULT="quiet"']
    values = grub_dropin_values([("/etc/default/grub", lines)], ["amd_iommu=on"], spec())
    assert values == {"GRUB_CMDLINE_LINUX_DEFAULT": "quiet amd_iommu=on", "GRUB_CMDLINE_LINUX": "console=ttyS0"}


def test_sh_double_quoted_round_trips_through_the_grub_parser():
    from facts.kernel import parse_grub_defaults
    value = 'quiet x="a b" $HOME `id` back\\slash'
    assert parse_grub_defaults([f"GRUB_CMDLINE_LINUX_DEFAULT={sh_double_quoted(value)}"]) != {}
    # the parser expands $VARS like sh; an escaped dollar must stay literal in sh itself
    import subprocess
    out = subprocess.run(["sh", "-c", ". /dev/stdin; printf %s \"$V\""], input=f"V={sh_double_quoted(value)}\n",
                         capture_output=True, text=True, check=True).stdout
    assert out == value


def test_sev_snp_with_passthrough_is_refused():
    loader = {"loader": "systemd-boot", "config_file": "/etc/kernel/cmdline"}
    refusals = preflight_refusals(spec(passthrough=True), loader, AMD, SNP_ON)
    assert len(refusals) == 1 and "SEV-SNP" in refusals[0] and "iommu=pt" in refusals[0]
    assert preflight_refusals(spec(passthrough=False), loader, AMD, SNP_ON) == []
    assert preflight_refusals(spec(passthrough=True), loader, AMD, {"enabled": False}) == []


@pytest.mark.parametrize("spec_loader,host_loader", [("grub", "systemd-boot"), ("systemd-boot", "grub")])
def test_boot_loader_mismatch_is_refused(spec_loader, host_loader):
    s = HostSpec(boot_loader=spec_loader)
    refusals = preflight_refusals(s, {"loader": host_loader, "config_file": "/x"}, AMD, None)
    assert len(refusals) == 1 and f"boots with {host_loader}" in refusals[0]
    assert preflight_refusals(HostSpec(boot_loader=host_loader), {"loader": host_loader}, AMD, None) == []


def test_unknown_cpu_or_loader_refused():
    assert "CPU vendor" in preflight_refusals(spec(), {"loader": "grub"}, {"vendor": "HygonGenuine"}, None)[0]
    assert "no file where" in preflight_refusals(spec(), {"loader": "unknown"}, AMD, None)[0]


def test_vfio_virqfd_only_before_pve8():
    assert vfio_modules(8) == ["vfio", "vfio_iommu_type1", "vfio_pci"]
    assert vfio_modules(7)[-1] == "vfio_virqfd"
    assert "vfio_virqfd" not in vfio_modules(None)


def test_truenas_both_vendor_flags_foreign_one_kept():
    line = fixture_lines("truenas-scale-zfs-root-amd-and-intel-iommu.txt")[0]
    s = spec()
    merged = merge_cmdline(line, desired_params(s, AMD), s)
    assert "intel_iommu=on" in merged.split() and "iommu=pt" not in merged.split()
    assert parse_cmdline_text(merged)["params"]["amd_iommu"] == "on"


@pytest.mark.parametrize("pve_major,kept", [(8, True), (None, True), (9, False)])
def test_legacy_cgroup_switch_is_dropped_from_the_line_we_write_on_9(pve_major, kept):
    """Proxmox VE 9 removed the hybrid cgroup layout (pve-manager PVE/CLI/pve8to9.pm checklist fails
    on systemd.unified_cgroup_hierarchy=0): on 9 the boot stage drops it; on 8 it stays (on main it
    stayed on 9 too, silently)."""
    line = "root=ZFS=rpool/ROOT/pve-1 boot=zfs systemd.unified_cgroup_hierarchy=0 quiet"
    merged = merge_cmdline(line, ["amd_iommu=on"], spec(), pve_major)
    assert ("systemd.unified_cgroup_hierarchy=0" in merged.split()) is kept
    assert merged.split()[:2] == ["root=ZFS=rpool/ROOT/pve-1", "boot=zfs"] and "amd_iommu=on" in merged.split()
    grub = ['GRUB_CMDLINE_LINUX="systemd.unified_cgroup_hierarchy=0"', 'GRUB_CMDLINE_LINUX_DEFAULT="quiet"']
    values = grub_dropin_values([("/etc/default/grub", grub)], ["amd_iommu=on"], spec(), pve_major)
    written = " ".join(values.get("GRUB_CMDLINE_LINUX", "systemd.unified_cgroup_hierarchy=0").split()
                       + values["GRUB_CMDLINE_LINUX_DEFAULT"].split())
    assert ("systemd.unified_cgroup_hierarchy=0" in written.split()) is kept
