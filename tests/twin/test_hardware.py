"""The twin's hardware view: rendered into a tmp root (no root, no sshd needed).

The h200-vm profile is checked against its recording (tests/fixtures/h200-vm); kpro6/intel2 are
checked against their profiles and against what persisted config must change after a "reboot".
"""
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.twin import hardware

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "h200-vm"


def recorded(name: str) -> str:
    """A recorded output without its two header lines."""
    return "".join(FIXTURES.joinpath(name).read_text().splitlines(True)[2:])


@pytest.fixture
def twin(tmp_path):
    def make(profile):
        root = tmp_path / profile
        hardware.install(root, profile)
        return root
    return make


def hw(root, rel):
    return (root / "var/lib/twin/hw" / rel)


def smi(root, *args):
    env = dict(os.environ, TWIN_ROOT=str(root))
    return subprocess.run([str(root / "usr/local/bin/nvidia-smi"), *args], env=env, capture_output=True, text=True)


def state(root):
    return json.loads(hw(root, "state.json").read_text())


# ---------------------------------------------------------------- h200-vm == its recording

@pytest.mark.parametrize("rendered,recording", [
    ("proc/cmdline", "proc-cmdline.txt"), ("proc/version", "proc-version.txt"),
    ("proc/devices", "proc-devices.txt"), ("proc/meminfo", "meminfo.txt"),
    ("proc/driver/nvidia/version", "driver-version.txt"), ("proc/driver/nvidia/params", "driver-params.txt"),
])
def test_h200_proc_files_match_recording(twin, rendered, recording):
    root = twin("h200-vm")
    assert hw(root, rendered).read_text() == recorded(recording)


def test_h200_gpu_information_matches_recording(twin):
    root = twin("h200-vm")
    want = recorded("driver-gpus-information.txt").split("\n", 1)[1]  # drop the "== path" line
    assert hw(root, "proc/driver/nvidia/gpus/0000:00:06.0/information").read_text() == want


def test_h200_first_cpu_matches_recording(twin):
    root = twin("h200-vm")
    first = hw(root, "proc/cpuinfo").read_text().split("\n\n")[0] + "\n"
    assert first == recorded("cpuinfo-first.txt")
    assert hw(root, "proc/cpuinfo").read_text().count("processor\t:") == 16


def test_h200_sysfs_matches_recording(twin):
    root = twin("h200-vm")
    sys_root = hw(root, "sys")
    for block in recorded("sysfs-pci.txt").split("== ")[1:]:
        lines = block.splitlines()
        bdf, target = lines[0].split(" -> ")
        dev = sys_root / "bus/pci/devices" / bdf
        assert os.path.realpath(dev) == str(sys_root) + target[len("/sys"):]
        res_at = lines.index("resource:")
        for line in lines[1:res_at]:
            if " -> " in line:
                link, want = line.split(" -> ")
                assert os.readlink(dev / link) == want, (bdf, link)
            else:
                attr, want = line.split(": ", 1)
                assert (dev / attr).read_text() == want + "\n", (bdf, attr)
        assert (dev / "resource").read_text() == "\n".join(lines[res_at + 1:]) + "\n", bdf
    assert not any((sys_root / "kernel/iommu_groups").iterdir())  # the VM has none


def test_h200_uvm_params_match_recording(twin):
    root = twin("h200-vm")
    for line in recorded("uvm-params.txt").splitlines():
        path, value = line.split(":", 1)
        assert hw(root, "sys" + path[len("/sys"):]).read_text() == value + "\n"


@pytest.mark.parametrize("args,recording", [
    (["topo", "-m"], "topo-m.txt"),
    *[(["topo", "-p2p", k], f"topo-p2p-{k}.txt") for k in "rwnap"],
    (["-L"], "nvidia-smi-L.txt"),
    (["--query-gpu=index,name,pci.bus_id,uuid,driver_version,memory.total,serial,vbios_version", "--format=csv"],
     "query-gpu.txt"),
    (["--query-gpu=index,pci.bus_id,uuid", "--format=csv,noheader,nounits"], "query-gpu-noheader.txt"),
    (["--query-compute-apps=gpu_bus_id,pid,process_name", "--format=csv,noheader"], "query-compute-apps.txt"),
])
def test_h200_nvidia_smi_matches_recording(twin, args, recording):
    root = twin("h200-vm")
    r = smi(root, *args)
    assert r.returncode == 0, r.stderr
    assert r.stdout == recorded(recording)


def test_h200_device_nodes_match_recording(twin):
    root = twin("h200-vm")
    nodes = {n["path"]: (n["major"], n["minor"]) for n in json.loads(hw(root, "dev.json").read_text())}
    for line in recorded("ls-dev-nvidia.txt").splitlines():
        m = re.match(r"c\S+ \d+ \S+ \S+ +(\d+), +(\d+) \S+ +\d+ [\d:]+ (\S+)$", line)
        if m:
            name = m.group(3) if m.group(3).startswith("/") else "/dev/nvidia-caps/" + m.group(3)
            assert nodes[name] == (int(m.group(1)), int(m.group(2)))


# ---------------------------------------------------------------- kpro6 / intel2 agree with their profiles

def test_kpro6_sysfs_agrees_with_profile(twin):
    root = twin("kpro6")
    prof = hardware.load_profile("kpro6")
    sys_root = hw(root, "sys")
    for dev in prof["pci"]:
        d = sys_root / "bus/pci/devices" / dev["bdf"]
        assert (d / "vendor").read_text() == f"0x{dev['vendor']}\n"
        assert (d / "device").read_text() == f"0x{dev['device']}\n"
        assert (d / "class").read_text() == f"0x{dev['class']}\n"
        assert (d / "numa_node").read_text() == f"{dev['numa_node']}\n"
        lines = (d / "resource").read_text().splitlines()
        assert len(lines) == (17 if dev["class"].startswith("0604") else 13)
        assert all(re.fullmatch(r"0x[0-9a-f]{16} 0x[0-9a-f]{16} 0x[0-9a-f]{16}", x) for x in lines)
        grp = os.path.realpath(d / "iommu_group")
        assert grp == str(sys_root / f"kernel/iommu_groups/{dev['iommu_group']}")
        assert (Path(grp) / "type").read_text() == "DMA\n"
        assert os.path.realpath(Path(grp) / "devices" / dev["bdf"]) == os.path.realpath(d)
        if dev["driver"]:
            assert os.path.basename(os.readlink(d / "driver")) == dev["driver"]
            assert os.path.realpath(d / "driver") == str(sys_root / "bus/pci/drivers" / dev["driver"])
        if dev.get("gpu"):
            # each GPU sits on its own root complex, behind one root port
            assert Path(os.path.realpath(d)).parent.parent.name.startswith("pci0000:")
            start, end, flags = (int(x, 16) for x in lines[1].split())
            assert end - start + 1 == 128 << 30 and flags == 0x14220C  # 128G 64-bit prefetchable BAR1
            assert (d / "current_link_speed").read_text() == "32.0 GT/s PCIe\n"
    assert hw(root, "sys/module/kvm_amd/parameters/sev_snp").read_text() == "Y\n"
    assert hw(root, "sys/module/nvidia_uvm/parameters/uvm_disable_hmm").read_text() == "N\n"
    assert "sev_snp" in hw(root, "proc/cpuinfo").read_text().split("\n\n")[0]


@pytest.mark.parametrize("profile", ["kpro6", "intel2", "kpro6-pve9"])
def test_bridges_config_carries_the_acs_the_kernel_enabled(twin, profile):
    """Each bridge's sysfs `config` holds the ACS capability of the profile (root ports, switch
    downstream ports), with the control bits the kernel turns on with the IOMMU on (SV, RR, CR,
    UF), read by PciAcs's own command; a bridge without one (a switch upstream port) has none."""
    from facts.pci import PciAcs

    root = twin(profile)
    prof = hardware.load_profile(profile)
    sys_root = hw(root, "sys")
    command = PciAcs().command.replace("/sys/", f"{sys_root}/")
    run = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=60)
    read = PciAcs().process(run.stdout.splitlines())
    # NVIDIA display functions come with their GPUDirect clique (issue 43 item 7): none on a host
    gpus = {bdf: v for bdf, v in read.items() if v["status"] == "gpu"}
    acs = {bdf: v for bdf, v in read.items() if v["status"] != "gpu"}
    assert gpus and all(v["clique"] is None for v in gpus.values()), gpus
    bridges = {dev["bdf"]: dev for dev in prof["pci"] if dev["class"].startswith("0604")}
    assert bridges and set(acs) == set(bridges)
    for bdf, dev in bridges.items():
        assert len((sys_root / "bus/pci/devices" / bdf / "config").read_bytes()) == 4096
        if "acs_cap" not in dev:
            assert acs[bdf]["status"] == "absent"
            continue
        assert acs[bdf]["status"] == "enabled" and acs[bdf]["redirect"] is True
        on = [flag for flag, value in acs[bdf]["ctl"].items() if value]
        assert on == ["SrcValid", "ReqRedir", "CmpltRedir", "UpstreamFwd"]


def test_kpro6_nvidia_views_agree(twin):
    root = twin("kpro6")
    prof = hardware.load_profile("kpro6")
    gpus = sorted((d for d in prof["pci"] if d.get("gpu")), key=lambda d: d["bdf"])
    info_dir = hw(root, "proc/driver/nvidia/gpus")
    assert sorted(p.name for p in info_dir.iterdir()) == [g["bdf"] for g in gpus]
    rows = smi(root, "--query-gpu=index,pci.bus_id,uuid,minor_number", "--format=csv,noheader").stdout.splitlines()
    for i, (g, row) in enumerate(zip(gpus, rows, strict=True)):
        info = (info_dir / g["bdf"] / "information").read_text()
        assert f"Device Minor: \t {i}\n" in info and f"GPU UUID: \t {g['gpu']['uuid']}\n" in info
        assert row == f"{i}, 0000{g['bdf'].upper()}, {g['gpu']['uuid']}, {i}"
    topo = smi(root, "topo", "-m").stdout
    assert topo.startswith("\t\x1b[4mGPU0\tGPU1\t") and "GPU NUMA ID\x1b[0m\n" in topo
    assert "GPU0\t X \tNODE\tNODE\tNODE\tSYS\tSYS\tSYS\tSYS\t0-31,64-95\t0\t\tN/A\n" in topo
    assert "NIC Legend" not in topo  # PCIe only, no RDMA NICs
    devices = hw(root, "proc/devices").read_text()
    chars, blocks = devices.split("\n\nBlock devices:\n")
    assert chars.startswith("Character devices:\n  1 mem\n") and "\n511 nvidia-uvm" in chars
    assert "nvidia-uvm" not in blocks and "259 blkext" in blocks


def test_intel2_switch_and_nics_in_topology(twin):
    root = twin("intel2")
    topo = smi(root, "topo", "-m").stdout
    assert "GPU0\t X \tPIX\tNODE\tNODE\t0-63\t0\t\tN/A\n" in topo
    assert "NIC0\tNODE\tNODE\t X \tPIX\t\t\t\t\n" in topo
    assert topo.endswith("NIC Legend:\n\n  NIC0: mlx5_0\n  NIC1: mlx5_1\n")
    assert hw(root, "proc/driver/nvidia/version").read_text().startswith(
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.172.08  Release Build  (dvs-builder@")
    assert not hw(root, "sys/module/kvm_amd").exists()
    assert hw(root, "sys/kernel/iommu_groups/23/type").read_text() == "DMA-FQ\n"


# ---------------------------------------------------------------- hardware reacts to persisted config

RULES = "etc/udev/rules.d/60-pvegpu-gpu-binding.rules"


def bind(root, bdfs, driver="vfio-pci"):
    p = root / RULES
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join(f'ACTION=="add", SUBSYSTEM=="pci", KERNEL=="{b}", ATTR{{driver_override}}="{driver}"\n'
                         for b in bdfs))


def test_rebinding_to_vfio_changes_sysfs_minors_and_nvidia_smi(twin):
    root = twin("kpro6")
    uuid_41 = next(g["uuid"] for g in state(root)["gpus"] if g["bdf"] == "0000:41:00.0")
    bind(root, ["0000:21:00.0", "0000:21:00.1"])
    (root / "etc/modules-load.d").mkdir(parents=True, exist_ok=True)
    (root / "etc/modules-load.d/vfio.conf").write_text("vfio\nvfio_iommu_type1\nvfio-pci\n")
    hardware.render(root)
    dev = hw(root, "sys/bus/pci/devices/0000:21:00.0")
    assert os.readlink(dev / "driver").endswith("bus/pci/drivers/vfio-pci")
    assert (dev / "driver_override").read_text() == "vfio-pci\n"
    assert os.readlink(hw(root, "sys/bus/pci/devices/0000:21:00.1/driver")).endswith("/vfio-pci")
    assert not hw(root, "proc/driver/nvidia/gpus/0000:21:00.0").exists()
    # minors shift: 41:00.0 was minor 2, now 1
    assert "Device Minor: \t 1\n" in hw(root, "proc/driver/nvidia/gpus/0000:41:00.0/information").read_text()
    listed = smi(root, "-L").stdout.splitlines()
    assert len(listed) == 7 and listed[1] == f"GPU 1: NVIDIA RTX PRO 6000 Blackwell Server Edition (UUID: {uuid_41})"
    nodes = {n["path"] for n in json.loads(hw(root, "dev.json").read_text())}
    assert "/dev/nvidia6" in nodes and "/dev/nvidia7" not in nodes
    assert {"/dev/vfio/vfio", "/dev/vfio/15"} <= nodes  # group of 21:00.x
    # back to nvidia: the view follows again
    bind(root, ["0000:21:00.0"], "nvidia")
    hardware.render(root)
    assert len(smi(root, "-L").stdout.splitlines()) == 8


def test_vfio_override_without_vfio_at_boot_leaves_gpu_unbound(twin):
    root = twin("kpro6")
    bind(root, ["0000:e1:00.0"])
    hardware.render(root)
    dev = hw(root, "sys/bus/pci/devices/0000:e1:00.0")
    assert not (dev / "driver").exists() and (dev / "driver_override").read_text() == "vfio-pci\n"
    assert len(smi(root, "-L").stdout.splitlines()) == 7


def test_module_option_takes_effect_after_reboot(twin):
    root = twin("kpro6")
    (root / "etc/modprobe.d").mkdir(parents=True, exist_ok=True)
    (root / "etc/modprobe.d/nvidia-uvm.conf").write_text("options nvidia_uvm uvm_disable_hmm=1\n")
    assert hw(root, "sys/module/nvidia_uvm/parameters/uvm_disable_hmm").read_text() == "N\n"
    hardware.render(root)
    assert hw(root, "sys/module/nvidia_uvm/parameters/uvm_disable_hmm").read_text() == "Y\n"


def test_grub_cmdline_follows_update_grub(twin):
    root = twin("intel2")
    grub = root / "etc/default/grub"
    grub.write_text(grub.read_text().replace('GRUB_CMDLINE_LINUX_DEFAULT="quiet"',
                                             'GRUB_CMDLINE_LINUX_DEFAULT="quiet intel_iommu=on iommu=pt"'))
    hardware.render(root)
    assert "iommu=pt" not in hw(root, "proc/cmdline").read_text()
    env = dict(os.environ, TWIN_ROOT=str(root))
    subprocess.run([str(root / "usr/local/sbin/update-grub")], env=env, check=True, capture_output=True)
    hardware.render(root)
    assert hw(root, "proc/cmdline").read_text() == (
        "BOOT_IMAGE=/boot/vmlinuz-6.8.12-11-pve root=/dev/mapper/pve-root ro quiet intel_iommu=on iommu=pt\n")
    assert hw(root, "sys/kernel/iommu_groups/23/type").read_text() == "identity\n"


def add_kernel(root, rel, config_cc=None):
    (root / "boot").mkdir(exist_ok=True)
    (root / f"boot/vmlinuz-{rel}").write_text("")
    (root / f"boot/initrd.img-{rel}").write_text("")
    (root / f"lib/modules/{rel}").mkdir(parents=True, exist_ok=True)
    if config_cc:
        hdr = root / f"usr/src/linux-headers-{rel}/include/config"
        hdr.mkdir(parents=True)
        (hdr / "auto.conf").write_text(f'CONFIG_CC_VERSION_TEXT="{config_cc}"\n')


def no_boot(root, line):
    (root / "var/lib/twin/boot").mkdir(parents=True, exist_ok=True)
    (root / "var/lib/twin/boot/no-boot").write_text(line + "\n")


def set_grubenv_abstraction(root, value):
    profile = yaml.safe_load((root / "var/lib/twin/profile.yml").read_text())
    profile["boot"]["grubenv_abstraction"] = value
    (root / "var/lib/twin/profile.yml").write_text(yaml.safe_dump(profile))


def test_grub_boots_next_entry_once_then_saved_entry_unless_grubenv_is_on_lvm(twin):
    """util/grub.d/00_header.in: next_entry boots once (save_env clears it), else the default,
    ${saved_entry} with GRUB_DEFAULT=saved; GRUB cannot write grubenv on LVM."""
    root = twin("intel2")
    set_grubenv_abstraction(root, "")  # intel2's /boot is on LVM; first a /boot partition of its own
    env = dict(os.environ, TWIN_ROOT=str(root))
    add_kernel(root, "6.14.11-1-pve")
    (root / "etc/default/grub.d").mkdir(parents=True, exist_ok=True)
    (root / "etc/default/grub.d/pvegpu.cfg").write_text("GRUB_DEFAULT=saved\n")
    subprocess.run([str(root / "usr/local/sbin/update-grub")], env=env, check=True, capture_output=True)
    cfg = (root / "boot/grub/grub.cfg").read_text()
    assert 'set default="${saved_entry}"' in cfg
    found = re.search(r"gnulinux-advanced-(\S+)' \{", cfg)
    assert found
    dev = found.group(1)
    hardware.render(root)
    assert state(root)["boot"]["release"] == "6.14.11-1-pve"  # no saved_entry: entry 0, the newest
    old = f"gnulinux-advanced-{dev}>gnulinux-6.8.12-11-pve-advanced-{dev}"
    new = f"gnulinux-advanced-{dev}>gnulinux-6.14.11-1-pve-advanced-{dev}"
    hardware._write_grubenv(root, {"saved_entry": old, "next_entry": new})
    no_boot(root, "6.14.11-1-pve hangs")
    hardware.render(root)
    assert state(root)["boot"]["hung"] and state(root)["boot"]["release"] == "6.14.11-1-pve"
    hardware.render(root)  # the reset: next_entry was cleared as GRUB read it
    assert not state(root)["boot"]["hung"] and state(root)["boot"]["release"] == "6.8.12-11-pve"
    # grubenv on LVM: GRUB cannot clear next_entry, the hanging kernel comes back at every reset
    set_grubenv_abstraction(root, "lvm")
    hardware._write_grubenv(root, {"saved_entry": old, "next_entry": new})
    for _ in range(2):
        hardware.render(root)
        assert state(root)["boot"]["hung"] and state(root)["boot"]["release"] == "6.14.11-1-pve"
    # the same on a btrfs /boot (loadenv.c: save_env fails; Debian's 00_header check_writable)
    set_grubenv_abstraction(root, "")
    profile = yaml.safe_load((root / "var/lib/twin/profile.yml").read_text())
    profile["boot"]["grubenv_fs"] = "btrfs"
    (root / "var/lib/twin/profile.yml").write_text(yaml.safe_dump(profile))
    hardware._write_grubenv(root, {"saved_entry": old, "next_entry": new})
    for _ in range(2):
        hardware.render(root)
        assert state(root)["boot"]["hung"] and state(root)["boot"]["release"] == "6.14.11-1-pve"


def test_nvidia_module_of_booted_kernel_sets_driver_version(twin):
    root = twin("kpro6")
    ko = root / "lib/modules/6.14.8-2-pve/updates/dkms/nvidia.ko"
    ko.parent.mkdir(parents=True)
    ko.write_bytes(b"\x7fELF....\x00license=Dual MIT/GPL\x00version=535.216.01\x00srcversion=X\x00"
                   b"GCC: (Debian 12.2.0-14) 12.2.0\x00")
    hardware.render(root)
    assert hw(root, "proc/driver/nvidia/version").read_text().splitlines() == [
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  535.216.01  Release Build  "
        "(root@kpro6)  Thu Apr 16 09:41:07 UTC 2026",
        "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14) "]
    assert "535.216.01" in smi(root, "--query-gpu=driver_version", "--format=csv,noheader").stdout


def test_uvm_nodes_exist_only_with_a_boot_unit(twin):
    root = twin("kpro6")
    nodes = lambda: {n["path"]: n for n in json.loads(hw(root, "dev.json").read_text())}  # noqa: E731
    assert "/dev/nvidia-uvm" not in nodes()
    unit = root / "etc/systemd/system/nvidia-uvm-nodes.service"
    unit.parent.mkdir(parents=True, exist_ok=True)
    unit.write_text("[Service]\nType=oneshot\nExecStart=/usr/bin/nvidia-modprobe -u -c=0\n")
    hardware.render(root)
    assert "/dev/nvidia-uvm" not in nodes()  # written but not enabled
    wants = root / "etc/systemd/system/multi-user.target.wants"
    wants.mkdir(parents=True)
    os.symlink("/etc/systemd/system/nvidia-uvm-nodes.service", wants / "nvidia-uvm-nodes.service")
    hardware.render(root)
    assert nodes()["/dev/nvidia-uvm"]["major"] == 511 and nodes()["/dev/nvidia-uvm-tools"]["minor"] == 1


def test_busy_marks_and_clears(twin):
    root = twin("kpro6")
    hardware.mark_busy(root, "0000:41:00.0", "nvidia-persistenced")
    assert json.loads((root / "var/lib/twin/busy.json").read_text()) == {"0000:41:00.0": "nvidia-persistenced"}
    hardware.clear_busy(root, "0000:41:00.0")
    assert json.loads((root / "var/lib/twin/busy.json").read_text()) == {}
