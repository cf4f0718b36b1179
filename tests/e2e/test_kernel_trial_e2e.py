"""The kernel stage's trial boot on the kpro6 twin (systemd-boot, ESP listed in
/etc/kernel/proxmox-boot-uuids) and on intel2 (GRUB), without compiling: the build dir holds a finished build of
6.14.11-9-bpo12-pvegpu-pve (pve-kernel bookworm-6.14 at ad58d14, KREL_EXTRA + -pvegpu) whose .debs are stand-ins made here
(an image, config and modules dir in proxmox-kernel-<rel>, a .config in proxmox-headers-<rel>;
the kernel package's postinst runs /etc/kernel/postinst.d as pve-kernel's does, so the twin's
zz-proxmox-boot hook syncs the ESP at install). The systemd-boot trial's two cases run on
Proxmox VE 9 too (TRIXIE: the kpro6-pve9 twin, proxmox-kernel-helper 9.2.0, a build of
7.0.14-14-pvegpu-pve from pve-kernel master at 6e44995 replacing 7.0.14-14-pve).

The twin's boot follows the real loaders (tests/twin/hardware.py choose_boot): systemd-boot
takes the EFI one-shot (cleared as read), then loader.conf's default that `proxmox-boot-tool
refresh` wrote; GRUB takes grubenv's next_entry (cleared as read, unless grubenv is on LVM),
then saved_entry. A kernel on the twin's no-boot list hangs (no sshd until `runtime.reset`) or
panics (resets by itself when panic= is on its command line), and the loader chooses again:
there is no fallback of the twin's own. One trial = one boot: a trial kernel that does not
come up is left after one reset (hang) or by itself (panic), and is never the default.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from plan import kernel as plan
from spec.models import KernelSpec
from tests.e2e.harness import run_pyinfra
from tests.twin import hardware, runtime
from tests.twin import kernel_packages as kp

pytestmark = [pytest.mark.twin]

STAGES = "operations.kernel,operations.reboot"
RELEASE = "6.14.11-9-bpo12-pvegpu-pve"  # what our build of bookworm-6.14 at ad58d14 produces
DEB_VERSION = "6.14.11-9~bpo12+1"
OLD = "6.14.8-2-pve"
KERNEL: dict[str, Any] = {"version": RELEASE, "source": {"kind": "proxmox-git", "url": "git://git.proxmox.com/git/pve-kernel.git",
                                         "ref": "ad58d1445425ea4742e3470b2edbee35df0657e9"},
          "jobs": 1, "ccache": False}
ESP = "var/lib/twin/esp/5A1C-9E27"
GCC = "gcc (Debian 12.2.0-14+deb12u1) 12.2.0"


@dataclass(frozen=True)
class Case:
    """The constants of one Proxmox VE release's trial: the twin profile, the release our build
    produces (its .deb version, compiler banner and pve-kernel ref) and the kernel it replaces."""
    id: str
    profile: str
    release: str
    deb_version: str
    old: str
    kernel: dict[str, Any]
    gcc: str
    helper: str  # proxmox-kernel-helper's version in the profile (built from its source in the twin root)

    @property
    def trial_entry(self) -> str:
        return f"pvegpu-trial-{self.release}.conf"


BOOKWORM = Case("bookworm", "kpro6", RELEASE, DEB_VERSION, OLD, KERNEL, GCC, "8.1.4")
# Proxmox VE 9 (tests/twin/profiles/kpro6-pve9.yml: trixie, proxmox-kernel-helper 9.2.0 from its
# source, running 7.0.14-14-pve, gcc-14; the ESP is kpro6's). Our build of pve-kernel master at
# 6e44995: its Makefile's KVNAME 7.0.14-14 with an empty KREL_EXTRA (no -bpo on trixie branches)
# plus -pvegpu; debian/changelog's version 7.0.14-14 (no ~bpo12+1); inventories/kpro6-pve9.yml's kernel
TRIXIE_RELEASE = "7.0.14-14-pvegpu-pve"
TRIXIE = Case("trixie", "kpro6-pve9", TRIXIE_RELEASE, "7.0.14-14", "7.0.14-14-pve",
              {**KERNEL, "version": TRIXIE_RELEASE,
               "source": {**KERNEL["source"], "ref": "6e44995b70ade6101b876137b35f48a28216559d"}},
              "gcc (Debian 14.2.0-19) 14.2.0", "9.2.0")


def case_twin(twin_factory, case: Case):
    """The case's twin, its spec (inventories/twin.yml's host of the profile) with the case's kernel
    as a spec file would carry it: the release rule (plan/releases.py spec_kernel_refusal) holds."""
    from spec.load import load_spec_file
    from spec.models import HostSpec
    spec = load_spec_file(Path(__file__).resolve().parents[2] / "inventories/twin.yml")[case.profile]
    HostSpec.model_validate({**spec.model_dump(exclude_unset=True), "kernel": case.kernel})
    twin = twin_factory(case.profile, address=quiet_address())
    helper = twin_run(twin.name, "dpkg-query -W -f '${Version}' proxmox-kernel-helper")
    assert helper == case.helper, helper
    return twin


def twin_run(name: str, *command: str) -> str:
    """Run a command on the twin; an SSH connection refused right after a reboot is retried."""
    r = runtime.ssh_run(name, list(command), timeout=60)
    if r.returncode != 0:
        log = runtime.twin_dir(name) / "supervisor.log"
        raise AssertionError(f"{command} on twin {name}: exit {r.returncode}: {r.stderr[-1500:]}\n"
                             + (log.read_text()[-3000:] if log.exists() else ""))
    return r.stdout


# OpenZFS's feature table (module/zcommon/zfeature_common.c zpool_feature_init(), the GUIDs it
# registers) at zfs-2.2.7 (Proxmox VE 8's kernels) and what zfs-2.3.4 adds (facts read from the tags)
ZFS_2_2_GUIDS = (
    "com.delphix:async_destroy com.delphix:empty_bpobj org.illumos:lz4_compress com.joyent:multi_vdev_crash_dump "
    "com.delphix:spacemap_histogram com.delphix:enabled_txg com.delphix:hole_birth com.delphix:zpool_checkpoint "
    "com.delphix:spacemap_v2 com.delphix:extensible_dataset com.delphix:bookmarks com.joyent:filesystem_limits "
    "com.delphix:embedded_data com.delphix:livelist com.delphix:log_spacemap org.open-zfs:large_blocks "
    "org.zfsonlinux:large_dnode org.illumos:sha512 org.illumos:skein org.illumos:edonr com.delphix:redaction_bookmarks "
    "com.delphix:redacted_datasets com.delphix:bookmark_written com.delphix:device_removal com.delphix:obsolete_counts "
    "org.zfsonlinux:userobj_accounting com.datto:bookmark_v2 com.datto:encryption org.zfsonlinux:project_quota "
    "org.zfsonlinux:allocation_classes com.datto:resilver_defer org.openzfs:device_rebuild org.freebsd:zstd_compress "
    "org.openzfs:draid org.openzfs:zilsaxattr com.delphix:head_errlog org.openzfs:blake3 com.fudosecurity:block_cloning "
    "com.klarasystems:vdev_zaps_v2").split()
ZFS_2_3_GUIDS = ZFS_2_2_GUIDS + ("com.delphix:redaction_list_spill org.openzfs:raidz_expansion "
                                 "com.klarasystems:fast_dedup org.zfsonlinux:longname "
                                 "com.klarasystems:large_microzap").split()


def pe_image(payload: bytes) -> bytes:
    """A PE32+ image as a kernel's EFI stub makes bzImage one (what sbsign signs and shim checks):
    DOS header, PE header, optional header with 16 data directories (the 5th, the certificate
    table, empty), one section holding `payload`; file alignment 0x200, section alignment 0x1000."""
    import struct
    fa, sa = 0x200, 0x1000
    text = payload + b"\0" * (-len(payload) % fa)
    opt_size = 112 + 16 * 8
    end = 0x80 + 4 + 20 + opt_size + 40
    size_headers = end + (-end % fa)
    dos = b"MZ" + b"\0" * 0x3A + struct.pack("<I", 0x80)
    dos += b"\0" * (0x80 - len(dos))
    coff = struct.pack("<HHIIIHH", 0x8664, 1, 0, 0, 0, opt_size, 0x0206)
    opt = struct.pack("<HBBIIIII", 0x20B, 2, 0, len(text), 0, 0, sa, sa)
    opt += struct.pack("<QIIHHHHHHIIIIHHQQQQII", 0, sa, fa, 0, 0, 0, 0, 0, 0, 0, sa + len(text) + (-len(text) % sa),
                       size_headers, 0, 10, 0, 0x100000, 0x1000, 0x100000, 0x1000, 0, 16)
    opt += b"\0" * (16 * 8)
    section = struct.pack("<8sIIIIIIHHI", b".text", len(payload), sa, len(text), size_headers, 0, 0, 0, 0, 0x60000020)
    head = dos + b"PE\0\0" + coff + opt + section
    return head + b"\0" * (size_headers - len(head)) + text


def zfs_module(path: Path, guids: list[str], release: str = RELEASE) -> None:
    """A zfs.ko as depmod/modinfo read it (an ELF object with .modinfo) whose read-only data holds
    the feature table's GUID strings, as the real module's does (zfeature_common.c literals)."""
    source = path.with_suffix(".c")
    table = ", ".join(f'"{g}"' for g in guids)
    source.write_text('static const char modinfo[] __attribute__((section(".modinfo"), used, aligned(1))) = '
                      f'"license=CDDL\\0name=zfs\\0vermagic={release} SMP preempt mod_unload modversions \\0";\n'
                      f"const char *const zfeature_guids[] = {{{table}}};\n")
    subprocess.run(["gcc", "-c", "-O2", "-o", str(path), str(source)], check=True)
    source.unlink()


def zfs_root(root: Path, features: dict[str, str]) -> None:
    """The twin's / is the dataset rpool/ROOT/pve-1 of the pool rpool with `features` (zpool get's
    feature@<name>: enabled|active|disabled): profile.json's zfs (findmnt and zpool read it)."""
    data = json.loads((root / "var/lib/twin/profile.json").read_text())
    data["zfs"] = {"root": "rpool/ROOT/pve-1", "pools": {"rpool": {"features": features}}}
    (root / "var/lib/twin/profile.json").write_text(json.dumps(data))


def nvidia_module(path: Path, version: str, release: str = RELEASE) -> None:
    """An nvidia.ko whose .modinfo says `version` (what modinfo and the twin's boot read from it)."""
    source = path.with_suffix(".c")
    source.write_text('static const char modinfo[] __attribute__((section(".modinfo"), used, aligned(1))) = '
                      f'"license=Dual MIT/GPL\\0version={version}\\0name=nvidia\\0vermagic={release} SMP mod_unload \\0";\n')
    subprocess.run(["gcc", "-c", "-O2", "-o", str(path), str(source)], check=True)
    source.unlink()


def stand_in_debs(out: Path, zfs_guids: list[str] | None = None, nvidia: str | None = None,
                  nvidia_dir: str = "updates/dkms", case: Case = BOOKWORM) -> list[Path]:
    """What our pve-kernel build leaves (tests/twin/kernel_packages.py): the unsigned
    proxmox-kernel-<rel> with the files the stages read (and a zfs.ko carrying `zfs_guids`, as
    pve-kernel's image carries its own ZFS module) and proxmox-headers-<rel> with a .config."""
    out.mkdir(parents=True, exist_ok=True)
    release, gcc = case.release, case.gcc
    files: dict[str, bytes | str] = {
        f"boot/vmlinuz-{release}": pe_image(b"twin stand-in kernel image\n"), f"boot/System.map-{release}": "",
        f"boot/config-{release}": (f'CONFIG_CC_VERSION_TEXT="{gcc}"\nCONFIG_BLK_DEV_INITRD=y\nCONFIG_RD_GZIP=y\n'
                                   "CONFIG_RD_ZSTD=y\nCONFIG_MODULES=y\nCONFIG_VFIO=m\nCONFIG_VFIO_PCI=m\n"
                                   "CONFIG_VFIO_IOMMU_TYPE1=m\n"),
        f"lib/modules/{release}/modules.order": "", f"lib/modules/{release}/modules.builtin": ""}
    scratch = out / "modules"
    scratch.mkdir(exist_ok=True)
    if nvidia is not None:
        nvidia_module(scratch / "nvidia.ko", nvidia, release)
        files[f"lib/modules/{release}/{nvidia_dir}/nvidia.ko"] = (scratch / "nvidia.ko").read_bytes()
    if zfs_guids is not None:
        zfs_module(scratch / "zfs.ko", zfs_guids, release)
        files[f"lib/modules/{release}/zfs/zfs.ko"] = (scratch / "zfs.ko").read_bytes()
    return [kp.image(out, release, case.deb_version, files, signed=False),
            kp.headers(out, release, case.deb_version, files={".config": f'CONFIG_CC_VERSION_TEXT="{gcc}"\n'})]


# `nvidia` of seed_finished_build: the driver the twin's profile runs. On a real host the kernel hook
# (/etc/kernel/postinst.d, operations/kernel_hook.py) builds it for each kernel the package installs;
# the stand-in package ships that result, since the twin, like a real host, loads no nvidia on a
# kernel without an nvidia.ko (tests/twin/hardware.py compute)
HOST_DRIVER = "host"


def seed_finished_build(root: Path, tmp: Path, zfs_guids: list[str] | None = None,
                        nvidia: str | None = HOST_DRIVER, nvidia_dir: str = "updates/dkms", case: Case = BOOKWORM) -> None:
    if nvidia == HOST_DRIVER:
        nvidia = json.loads((root / "var/lib/twin/profile.json").read_text())["nvidia"]["version"]
    k = KernelSpec(**case.kernel)
    build = root / plan.build_dir(k, "running").lstrip("/")
    build.mkdir(parents=True)
    for deb in stand_in_debs(tmp, zfs_guids, nvidia, nvidia_dir, case):
        (build / deb.name).write_bytes(deb.read_bytes())
    (build / "build.rc").write_text("0\n")
    (build / "manifest.json").write_text(json.dumps({
        "build_id": plan.build_id(k, "running"), "version": case.release, "kind": "proxmox-git", "compiler": case.gcc,
        "source_sha": case.kernel["source"]["ref"], "config_sha256": "0" * 64, "objects": 0}))


def quiet_address() -> str | None:
    """A high 127.0.0.N that is free now: twins started elsewhere on this machine (other
    checkouts) take the lowest free address, and could grab ours while this twin reboots."""
    import os
    import socket
    for n in [200 + (os.getpid() + i) % 50 for i in range(50)]:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((f"127.0.0.{n}", runtime.SSH_PORT))
            except OSError:
                continue
        return f"127.0.0.{n}"
    return None


def loader_default(root: Path) -> str:
    lines = [line for line in (root / ESP / "loader/loader.conf").read_text().splitlines() if line.startswith("default ")]
    return lines[-1].split(None, 1)[1]


def reboot(name: str) -> None:
    boots = runtime.twin_dir(name) / "boots"
    before = len(boots.read_text().splitlines())
    subprocess.run(runtime.ssh_command(name, ["reboot"]), capture_output=True, timeout=60)
    deadline = time.monotonic() + 60
    while len(boots.read_text().splitlines()) == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(boots.read_text().splitlines()) > before, "the twin did not reboot"


def converge(name: str, reboot_allowed: bool = False, stages: str = STAGES, kernel: dict | None = None,
             case: Case = BOOKWORM):
    env = {"PVEGPU_TWINS": name, "PVEGPU_STAGES": stages, "PVEGPU_E2E_KERNEL": json.dumps(kernel or case.kernel)}
    if not reboot_allowed:
        env["PVEGPU_E2E_NO_REBOOT"] = "1"
    return run_pyinfra("inventories/twin.py", "tests/e2e/stage_deploy.py", env=env, timeout=600)


def boots(name: str) -> list[str]:
    return (runtime.twin_dir(name) / "boots").read_text().splitlines()


def press_reset(name: str) -> None:
    """The reset button (the twin may have no sshd: a hung kernel); waits for the next boot."""
    before = len(boots(name))
    runtime.reset(name)
    deadline = time.monotonic() + 60
    while len(boots(name)) == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(boots(name)) > before, "the twin did not boot after the reset"


def attempts(root: Path) -> list[str]:
    return (root / "var/lib/twin/boot/attempts").read_text().splitlines()


def oneshot(root: Path) -> str | None:
    var = root / "var/lib/twin/efivars/LoaderEntryOneShot-4a67b082-0a4c-41cf-b6c7-440b29bb8c4f"
    return var.read_bytes()[4:].decode("utf-16-le").rstrip("\x00") if var.exists() else None


TRIAL_ENTRY = f"pvegpu-trial-{RELEASE}.conf"
# the systemd-boot trial on Proxmox VE 8 (kpro6) and 9 (kpro6-pve9). proxmox-kernel-helper 9.2.0
# changes nothing the trial uses: proxmox-boot-tool's `kernel pin [--next-boot]`, `refresh` and
# the loader.conf that zz-proxmox-boot's refresh writes (src/proxmox-boot/functions) are 8.1.4's;
# it adds a memtest86+ entry in init_bootloader (src/bin/proxmox-boot-tool, run by reinit) and
# mask_sd_gpt_generator in zz-proxmox-boot's postinst.d case (run at each kernel install)
CASES = pytest.mark.parametrize("case", [BOOKWORM, TRIXIE], ids=lambda c: c.id)


def assert_systemd_boot_trial_set_up(root: Path, case: Case = BOOKWORM) -> None:
    """The default stays on the old kernel; the trial is a one-shot of an entry with panic=."""
    assert (root / "etc/kernel/proxmox-boot-pin").read_text().strip() == case.old
    assert not (root / "etc/kernel/next-boot-pin").exists()
    assert loader_default(root) == f"proxmox-{case.old}.conf"
    options = [line for line in (root / ESP / "loader/entries" / case.trial_entry).read_text().splitlines()
               if line.startswith("options ")][0]
    assert options.endswith(" panic=10") and "root=ZFS=rpool/ROOT/pve-1" in options
    assert "panic=" not in (root / ESP / f"loader/entries/proxmox-{case.old}.conf").read_text()
    assert "panic=" not in (root / ESP / f"loader/entries/proxmox-{case.release}.conf").read_text()
    assert oneshot(root) == case.trial_entry


@CASES
def test_systemd_boot_trial_is_one_boot_and_made_the_default_once_it_came_up(twin_factory, tmp_path, case):
    RELEASE, OLD, TRIAL_ENTRY = case.release, case.old, case.trial_entry
    twin = case_twin(twin_factory, case)
    root = Path(twin.root)
    seed_finished_build(root, tmp_path, case=case)
    assert twin_run(twin.name, "uname", "-r").strip() == OLD

    first = converge(twin.name, case=case)
    assert first.rc == 0, first.output[-6000:]
    assert f"kernel: {RELEASE} is installed and chosen for the next boot only" in first.output
    assert_systemd_boot_trial_set_up(root, case)
    # the install ran the helper's own zz-proxmox-boot: 9.2.0's postinst.d case masks systemd's GPT
    # generator (src/proxmox-boot/zz-proxmox-boot mask_sd_gpt_generator; 8.1.4 has none)
    generator = root / "etc/systemd/system-generators/systemd-gpt-auto-generator"
    assert (generator.is_symlink() and str(generator.readlink()) == "/dev/null") == (case.helper == "9.2.0")
    assert twin_run(twin.name, "uname", "-r").strip() == OLD

    reboot(twin.name)
    assert twin_run(twin.name, "uname", "-r").strip() == RELEASE  # the trial kernel runs, once
    assert "panic=10" in twin_run(twin.name, "cat", "/proc/cmdline")
    assert oneshot(root) is None and loader_default(root) == f"proxmox-{OLD}.conf"

    second = converge(twin.name, case=case)
    assert second.rc == 0, second.output[-6000:]
    assert f"the trial boot of {RELEASE} came up; make it the default for good" in second.output
    assert (root / "etc/kernel/proxmox-boot-pin").read_text().strip() == RELEASE
    assert loader_default(root) == f"proxmox-{RELEASE}.conf"  # pinned and refreshed
    assert not (root / ESP / "loader/entries" / TRIAL_ENTRY).exists()
    assert not (root / plan.TRIAL_MARKER.lstrip("/")).exists()

    third = converge(twin.name, case=case)
    assert third.rc == 0 and third.changed == 0, third.output[-4000:]

    reboot(twin.name)
    assert twin_run(twin.name, "uname", "-r").strip() == RELEASE  # the default boot is the new kernel
    assert "panic=" not in twin_run(twin.name, "cat", "/proc/cmdline")
    assert f"vmlinuz-{OLD}" in twin_run(twin.name, "ls", "/boot").split()


@CASES
def test_systemd_boot_trial_that_hangs_is_left_after_one_reset_and_not_retried(twin_factory, tmp_path, case):
    RELEASE, OLD, TRIAL_ENTRY = case.release, case.old, case.trial_entry
    twin = case_twin(twin_factory, case)
    root = Path(twin.root)
    seed_finished_build(root, tmp_path, case=case)
    (root / "var/lib/twin/boot").mkdir(parents=True, exist_ok=True)
    (root / "var/lib/twin/boot/no-boot").write_text(f"{RELEASE} hangs\n")  # stops in the initramfs, no panic

    first = converge(twin.name, case=case)
    assert first.rc == 0, first.output[-6000:]
    assert_systemd_boot_trial_set_up(root, case)
    subprocess.run(runtime.ssh_command(twin.name, ["reboot"]), capture_output=True, timeout=60)
    deadline = time.monotonic() + 60
    while not boots(twin.name)[-1].endswith(" hung") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert boots(twin.name)[-1].endswith(" hung"), boots(twin.name)  # the trial kernel hangs: no SSH
    assert attempts(root)[-1].startswith(f"{RELEASE} {TRIAL_ENTRY} hung")
    press_reset(twin.name)  # one reset, nothing more: the one-shot is gone, the default boots
    assert twin_run(twin.name, "uname", "-r").strip() == OLD
    assert attempts(root)[-1] == f"{OLD} proxmox-{OLD}.conf up"

    second = converge(twin.name, case=case)
    assert second.rc == 0, second.output[-6000:]
    assert f"the trial boot of {RELEASE} came up on {OLD}" in second.output
    assert loader_default(root) == f"proxmox-{OLD}.conf"
    assert (root / "etc/kernel/proxmox-boot-pin").read_text().strip() == OLD
    assert not (root / ESP / "loader/entries" / TRIAL_ENTRY).exists()
    failed = json.loads((root / plan.TRIAL_FAILED.lstrip("/")).read_text())
    assert failed == {"release": RELEASE, "build_id": plan.build_id(KernelSpec(**case.kernel), "running"), "came_up_on": OLD,
                      "checks": "", "journal": f"persistent, but no boot of {RELEASE} in it (journalctl --list-boots): it "
                                               "stopped before journald wrote to /var/log/journal (initramfs)"}

    third = converge(twin.name, case=case)  # reported, not tried again
    assert third.rc == 0 and third.changed == 0, third.output[-6000:]
    assert f"the trial boot of {RELEASE} came up on {OLD}" in third.output and "not tried again" in third.output
    assert oneshot(root) is None
    # the refused kernel is the newest entry in systemd-boot's order: only the kept default holds it off
    assert hardware.strverscmp_improved(root, f"proxmox-{RELEASE}.conf", f"proxmox-{OLD}.conf") > 0
    reboot(twin.name)
    assert twin_run(twin.name, "uname", "-r").strip() == OLD


def test_systemd_boot_trial_that_panics_comes_back_by_itself(twin_factory, tmp_path):
    twin = twin_factory("kpro6", address=quiet_address())
    root = Path(twin.root)
    seed_finished_build(root, tmp_path)
    (root / "var/lib/twin/boot").mkdir(parents=True, exist_ok=True)
    (root / "var/lib/twin/boot/no-boot").write_text(f"{RELEASE} panics\n")  # e.g. its ZFS cannot import the pool

    first = converge(twin.name, reboot_allowed=True)  # trial, reboot, then the check after it fails
    assert first.rc != 0, first.output[-6000:]
    assert f"the trial boot of {RELEASE} came up on {OLD}" in first.output
    assert attempts(root)[-2:] == [f"{RELEASE} {TRIAL_ENTRY} panic, reset after 10 s (panic=10)",
                                   f"{OLD} proxmox-{OLD}.conf up"]
    assert twin_run(twin.name, "uname", "-r").strip() == OLD
    assert loader_default(root) == f"proxmox-{OLD}.conf" and oneshot(root) is None
    assert not (root / ESP / "loader/entries" / TRIAL_ENTRY).exists()

    second = converge(twin.name)
    assert second.rc == 0 and second.changed == 0, second.output[-6000:]
    assert f"the trial boot of {RELEASE} came up on {OLD}" in second.output


def test_a_kernel_whose_zfs_lacks_the_root_pools_features_is_not_tried(twin_factory, tmp_path):
    """kpro6's / on ZFS, the pool upgraded under OpenZFS 2.3 (fast_dedup active, the rest of 2.3's
    features enabled); the new kernel carries 2.2's module: its ZFS would not import the pool
    (zfeature.c spa_features_check), so no trial is set up and the features are named; with a
    module of 2.3 the same kernel is tried."""
    twin = twin_factory("kpro6", address=quiet_address())
    root = Path(twin.root)
    features = {g.split(":")[1]: "active" for g in ZFS_2_2_GUIDS[:12]}
    features.update({g.split(":")[1]: "enabled" for g in ZFS_2_3_GUIDS[12:]})
    features["fast_dedup"] = "active"
    zfs_root(root, features)
    assert twin_run(twin.name, "findmnt", "-n", "-o", "FSTYPE", "/").strip() == "zfs"
    seed_finished_build(root, tmp_path, ZFS_2_2_GUIDS)

    run = converge(twin.name)
    assert run.rc != 0, run.output[-6000:]
    assert ("does not support these features of the root pool rpool: redaction_list_spill raidz_expansion fast_dedup "
            "longname large_microzap") in run.output, run.output[-6000:]
    assert oneshot(root) is None and loader_default(root) == f"proxmox-{OLD}.conf"
    assert not (root / ESP / "loader/entries" / TRIAL_ENTRY).exists()
    assert not (root / plan.TRIAL_MARKER.lstrip("/")).exists()
    assert twin_run(twin.name, "uname", "-r").strip() == OLD

    # the same release built again with OpenZFS 2.3 (another build; the twin's build dir is replaced)
    build = root / plan.build_dir(KernelSpec(**KERNEL), "running").lstrip("/")
    subprocess.run(["rm", "-rf", str(build)], check=True)
    twin_run(twin.name, "dpkg", "--purge", f"proxmox-kernel-{RELEASE}", f"proxmox-headers-{RELEASE}")
    twin_run(twin.name, "rm", "-f", f"{plan.STATE_DIR}/{RELEASE}.json")
    seed_finished_build(root, tmp_path / "2.3", ZFS_2_3_GUIDS)
    again = converge(twin.name)
    assert again.rc == 0, again.output[-6000:]
    assert_systemd_boot_trial_set_up(root)


GRUB_STAGES = "operations.boot,operations.kernel,operations.reboot"


def grub_twin(twin_factory, abstraction: str, fs: str = "ext2"):
    """intel2 with /boot/grub on `abstraction` ('': a /boot partition of its own; the profile says
    lvm) and a file system `fs` as grub-probe names it: the twin's profile (profile.yml for its
    boots, profile.json for its stand-ins) edited."""
    import yaml
    twin = twin_factory("intel2", address=quiet_address())
    root = Path(twin.root)
    profile = yaml.safe_load((root / "var/lib/twin/profile.yml").read_text())
    profile["boot"]["grubenv_abstraction"] = abstraction
    profile["boot"]["grubenv_fs"] = fs
    (root / "var/lib/twin/profile.yml").write_text(yaml.safe_dump(profile))
    data = json.loads((root / "var/lib/twin/profile.json").read_text())
    data["boot"]["grubenv_abstraction"] = abstraction
    data["boot"]["grubenv_fs"] = fs
    (root / "var/lib/twin/profile.json").write_text(json.dumps(data))
    (root / "var/lib/twin/boot").mkdir(parents=True, exist_ok=True)
    return twin, root


def grubenv(name: str) -> dict:
    out = twin_run(name, "grub-editenv", "/boot/grub/grubenv", "list")
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def test_grub_trial_that_hangs_is_left_after_one_reset_and_a_good_one_becomes_the_default(twin_factory, tmp_path):
    twin, root = grub_twin(twin_factory, "")
    seed_finished_build(root, tmp_path)
    (root / "var/lib/twin/boot/no-boot").write_text(f"{RELEASE} hangs\n")
    old = twin_run(twin.name, "uname", "-r").strip()  # intel2 runs 6.8.12-11-pve

    first = converge(twin.name, stages=GRUB_STAGES)
    assert first.rc == 0, first.output[-6000:]
    cfg = (root / "boot/grub/grub.cfg").read_text()
    assert 'set default="${saved_entry}"' in cfg  # GRUB_DEFAULT=saved from the boot stage's drop-in
    env = grubenv(twin.name)
    assert f">gnulinux-{old}-advanced-" in env["saved_entry"]
    assert env["next_entry"] == f"pvegpu-trial-{RELEASE}"
    assert_grub_trial_entry(root, old)
    subprocess.run(runtime.ssh_command(twin.name, ["reboot"]), capture_output=True, timeout=60)
    deadline = time.monotonic() + 60
    while not boots(twin.name)[-1].endswith(" hung") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert boots(twin.name)[-1].endswith(" hung"), boots(twin.name)
    press_reset(twin.name)
    assert twin_run(twin.name, "uname", "-r").strip() == old
    assert not grubenv(twin.name).get("next_entry")
    assert attempts(root)[-2].startswith(f"{RELEASE} pvegpu-trial-{RELEASE} hung")

    second = converge(twin.name, stages=GRUB_STAGES)
    assert second.rc == 0, second.output[-6000:]
    assert f"the trial boot of {RELEASE} came up on {old}" in second.output
    assert f">gnulinux-{old}-advanced-" in grubenv(twin.name)["saved_entry"]
    assert "pvegpu-trial-" not in (root / "boot/grub/grub.cfg").read_text()  # the trial entry is gone
    assert not (root / plan.GRUB_TRIAL_SCRIPT.lstrip("/")).exists()
    third = converge(twin.name, stages=GRUB_STAGES)
    assert third.rc == 0 and third.changed == 0, third.output[-6000:]

    # the spec's kernel that does come up: a retry needs the record gone (or another spec)
    (root / "var/lib/twin/boot/no-boot").write_text("")
    (root / plan.TRIAL_FAILED.lstrip("/")).unlink()
    fourth = converge(twin.name, reboot_allowed=True, stages=GRUB_STAGES)
    assert fourth.rc == 0, fourth.output[-6000:]
    assert twin_run(twin.name, "uname", "-r").strip() == RELEASE
    assert f">gnulinux-{RELEASE}-advanced-" in grubenv(twin.name)["saved_entry"]  # the default for good
    assert "pvegpu-trial-" not in (root / "boot/grub/grub.cfg").read_text()
    reboot(twin.name)
    assert twin_run(twin.name, "uname", "-r").strip() == RELEASE
    assert "panic=" not in twin_run(twin.name, "cat", "/proc/cmdline")


def assert_grub_trial_entry(root: Path, old: str) -> None:
    """grub.cfg holds the trial entry (10_linux's entry of the release, panic= added) and no
    other entry has panic=; saved_entry stays on the old kernel."""
    cfg = (root / "boot/grub/grub.cfg").read_text()
    trial = cfg.split(f"$menuentry_id_option 'pvegpu-trial-{RELEASE}' {{", 1)[1].split("\n}", 1)[0]
    linux = [line.strip() for line in trial.splitlines() if line.strip().startswith("linux")]
    assert linux and linux[0].startswith(f"linux\t/boot/vmlinuz-{RELEASE} root=") and linux[0].endswith(" panic=10")
    assert sum("panic=" in line for line in cfg.splitlines() if line.strip().startswith("linux")) == 1


def test_grub_trial_that_panics_comes_back_by_itself(twin_factory, tmp_path):
    """GRUB's trial entry carries panic=: a trial kernel that panics resets by itself, and GRUB,
    whose next_entry it cleared as it read it, boots saved_entry: the old kernel, with no one at
    the console (before, the GRUB trial had no panic= and waited at the console for a reset)."""
    twin, root = grub_twin(twin_factory, "")
    seed_finished_build(root, tmp_path)
    (root / "var/lib/twin/boot/no-boot").write_text(f"{RELEASE} panics\n")
    old = twin_run(twin.name, "uname", "-r").strip()

    first = converge(twin.name, reboot_allowed=True, stages=GRUB_STAGES)  # trial, reboot, check fails
    assert first.rc != 0, first.output[-6000:]
    assert f"the trial boot of {RELEASE} came up on {old}" in first.output
    assert attempts(root)[-2:] == [f"{RELEASE} pvegpu-trial-{RELEASE} panic, reset after 10 s (panic=10)",
                                   f"{old} {grubenv(twin.name)['saved_entry'].split('>')[-1]} up"]
    assert twin_run(twin.name, "uname", "-r").strip() == old
    env = grubenv(twin.name)
    assert not env.get("next_entry") and f">gnulinux-{old}-advanced-" in env["saved_entry"]
    assert "pvegpu-trial-" not in (root / "boot/grub/grub.cfg").read_text()

    second = converge(twin.name, stages=GRUB_STAGES)
    assert second.rc == 0 and second.changed == 0, second.output[-6000:]
    assert f"the trial boot of {RELEASE} came up on {old}" in second.output


def test_grub_with_grubenv_on_lvm_refuses_the_trial_before_any_change(twin_factory, tmp_path):
    """intel2 as recorded: /boot on the LVM root; GRUB cannot clear next_entry there."""
    twin, root = grub_twin(twin_factory, "lvm")
    seed_finished_build(root, tmp_path)
    run = converge(twin.name, stages="operations.kernel,operations.reboot")
    assert run.rc != 0 and "/boot/grub/grubenv is on lvm" in run.output, run.output[-4000:]
    assert "kernel.trial_boot: false" in run.output
    assert f"vmlinuz-{RELEASE}" not in twin_run(twin.name, "ls", "/boot").split()


def test_grub_with_grubenv_on_btrfs_refuses_the_trial_before_any_change(twin_factory, tmp_path):
    """A /boot on btrfs (Proxmox's installer offers it, with GRUB): GRUB cannot save_env there, so a
    grub-reboot one-shot would stay set and a hanging trial kernel would boot at every reset."""
    twin, root = grub_twin(twin_factory, "", fs="btrfs")
    seed_finished_build(root, tmp_path)
    before = grubenv(twin.name)
    run = converge(twin.name, stages="operations.kernel,operations.reboot")
    assert run.rc != 0 and "/boot/grub/grubenv is on btrfs" in run.output, run.output[-4000:]
    assert "kernel.trial_boot: false" in run.output
    assert f"vmlinuz-{RELEASE}" not in twin_run(twin.name, "ls", "/boot").split()
    assert grubenv(twin.name) == before and not (root / plan.GRUB_TRIAL_SCRIPT.lstrip("/")).exists()


def test_secure_boot_refuses_the_unsigned_build_before_any_change(twin_factory, tmp_path):
    """shim/GRUB verify the kernel under Secure Boot; the stage does not sign its build."""
    from tests.twin import hardware
    twin = twin_factory("kpro6", address=quiet_address())
    root = Path(twin.root)
    hardware.set_secure_boot(root, True)
    reboot(twin.name)
    seed_finished_build(root, tmp_path)
    run = converge(twin.name)
    assert run.rc != 0 and "Secure Boot is on" in run.output and "would not boot" in run.output, run.output[-4000:]
    assert f"vmlinuz-{RELEASE}" not in twin_run(twin.name, "ls", "/boot").split()
    assert loader_default(root) == "proxmox-*" and oneshot(root) is None


def test_secure_boot_grub_shim_kernel_is_signed_with_an_enrolled_mok_or_refused(twin_factory, tmp_path):
    """intel2 booting with UEFI through shim + GRUB with Secure Boot on (as Proxmox boots a Secure
    Boot host). The build is refused while kernel.signing is unset and while its cert is not
    enrolled (nothing installed); once enrolled, the image is signed (sbsign), the twin's shim
    verifies it, the trial comes up and becomes the default. An image that loses its signature (a
    package reinstalled) is refused by the twin's shim: never kinder than shim."""
    import yaml

    from tests.twin import hardware
    twin, root = grub_twin(twin_factory, "")
    profile = yaml.safe_load((root / "var/lib/twin/profile.yml").read_text())
    profile["boot"]["uefi"] = True
    (root / "var/lib/twin/profile.yml").write_text(yaml.safe_dump(profile))
    data = json.loads((root / "var/lib/twin/profile.json").read_text())
    data["boot"]["uefi"] = True
    (root / "var/lib/twin/profile.json").write_text(json.dumps(data))
    hardware.set_secure_boot(root, True)
    reboot(twin.name)
    old = twin_run(twin.name, "uname", "-r").strip()
    assert twin_run(twin.name, "mokutil", "--sb-state").strip() == "SecureBoot enabled"
    subprocess.run(["openssl", "req", "-new", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(root / "root/mok.pem"), "-outform", "DER", "-out", str(root / "root/mok.der"), "-days", "3650",
                    "-subj", "/CN=pvegpu twin kernel MOK"], check=True, capture_output=True)
    seed_finished_build(root, tmp_path)
    signed = {**KERNEL, "signing": {"key": "/root/mok.pem", "cert": "/root/mok.der"}}

    run = converge(twin.name, stages=GRUB_STAGES)
    assert run.rc != 0 and "Secure Boot is on" in run.output and "Set kernel.signing" in run.output, run.output[-4000:]
    run = converge(twin.name, stages=GRUB_STAGES, kernel=signed)
    assert run.rc != 0 and "kernel.signing.cert /root/mok.der is not enrolled" in run.output, run.output[-4000:]
    assert f"vmlinuz-{RELEASE}" not in twin_run(twin.name, "ls", "/boot").split()

    hardware.enroll_mok(root, (root / "root/mok.der").read_bytes())
    run = converge(twin.name, reboot_allowed=True, stages=GRUB_STAGES, kernel=signed)
    assert run.rc == 0, run.output[-6000:]
    assert twin_run(twin.name, "uname", "-r").strip() == RELEASE
    assert attempts(root)[-1] == f"{RELEASE} pvegpu-trial-{RELEASE} up"
    twin_run(twin.name, "openssl x509 -inform DER -in /root/mok.der -out /tmp/mok.pem && "
                        f"sbverify --cert /tmp/mok.pem /boot/vmlinuz-{RELEASE}")  # signed with the MOK
    assert f">gnulinux-{RELEASE}-advanced-" in grubenv(twin.name)["saved_entry"]
    again = converge(twin.name, stages=GRUB_STAGES, kernel=signed)
    assert again.rc == 0 and again.changed == 0, again.output[-4000:]

    # the image without its signature (the package installed again): shim refuses it
    (root / f"boot/vmlinuz-{RELEASE}").write_bytes(pe_image(b"twin stand-in kernel image\n"))
    subprocess.run(runtime.ssh_command(twin.name, ["reboot"]), capture_output=True, timeout=60)
    deadline = time.monotonic() + 60
    while not boots(twin.name)[-1].endswith(" hung") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert boots(twin.name)[-1].endswith(" hung"), boots(twin.name)
    assert attempts(root)[-1].endswith("hung (Secure Boot: error: bad shim signature)"), attempts(root)
    assert old != RELEASE


def test_a_trial_kernel_that_comes_up_without_its_nvidia_module_is_not_made_the_default(twin_factory, tmp_path):
    """Issue 27 part 1: pinned for good only after it booted and the host checks that matter pass.
    kpro6 runs nvidia 595.71.05 on the old kernel; the trial kernel comes up with an NVIDIA module
    of another version (its own build went wrong): the check after the reboot fails naming it,
    the default stays on the old kernel, and the next run reports it (with what the journal kept:
    the twin's journal is not persistent) instead of pinning the running kernel."""
    twin = twin_factory("kpro6", address=quiet_address())
    root = Path(twin.root)
    seed_finished_build(root, tmp_path, nvidia="590.44.01")
    assert "595.71.05" in twin_run(twin.name, "cat", "/proc/driver/nvidia/version")

    first = converge(twin.name, reboot_allowed=True)
    assert first.rc != 0, first.output[-6000:]
    assert f"the trial boot of {RELEASE} came up on {RELEASE}, but the host checks failed: nvidia 595.71.05 is not " \
        "loaded" in first.output, first.output[-6000:]
    assert twin_run(twin.name, "uname", "-r").strip() == RELEASE
    assert loader_default(root) == f"proxmox-{OLD}.conf" and oneshot(root) is None
    assert (root / "etc/kernel/proxmox-boot-pin").read_text().strip() == OLD
    failed = json.loads((root / plan.TRIAL_FAILED.lstrip("/")).read_text())
    assert failed["came_up_on"] == RELEASE and "590.44.01" in failed["checks"]

    second = converge(twin.name)
    assert second.rc == 0 and second.changed == 0, second.output[-6000:]
    assert "but the host checks failed: nvidia 595.71.05 is not loaded" in second.output
    assert "journal: the trial kernel is running" in second.output
    assert (root / "etc/kernel/proxmox-boot-pin").read_text().strip() == OLD
    reboot(twin.name)
    assert twin_run(twin.name, "uname", "-r").strip() == OLD


def test_a_failed_trial_is_reported_with_what_the_journal_kept(twin_factory, tmp_path):
    """A trial kernel that panics in the initramfs: the next run names the kernel that came up and
    what the journal kept of the trial boot. Debian 12's systemd keeps the journal in
    /var/log/journal (persistent, the twin's root has it), but a boot that stopped in the
    initramfs never reached journald: no boot of the trial kernel in it (the twin runs no journald:
    journalctl finds none)."""
    twin = twin_factory("kpro6", address=quiet_address())
    root = Path(twin.root)
    seed_finished_build(root, tmp_path)
    (root / "var/lib/twin/boot").mkdir(parents=True, exist_ok=True)
    (root / "var/lib/twin/boot/no-boot").write_text(f"{RELEASE} panics\n")
    assert (root / "var/log/journal").is_dir()
    first = converge(twin.name, reboot_allowed=True)
    assert first.rc != 0, first.output[-6000:]
    second = converge(twin.name)
    assert second.rc == 0 and second.changed == 0, second.output[-6000:]
    assert f"the trial boot of {RELEASE} came up on {OLD};" in second.output, second.output[-4000:]
    assert f"journal: persistent, but no boot of {RELEASE} in it" in second.output, second.output[-4000:]
    (root / "var/log/journal").rmdir()  # Storage=auto without the directory: volatile
    (root / plan.TRIAL_FAILED.lstrip("/")).unlink()
    (root / "var/lib/twin/boot/no-boot").write_text(f"{RELEASE} panics\n")
    third = converge(twin.name, reboot_allowed=True)
    assert third.rc != 0 and "came up on" in third.output, third.output[-6000:]
    fourth = converge(twin.name)
    assert "journal: not persistent (no /var/log/journal)" in fourth.output, fourth.output[-4000:]


@pytest.mark.parametrize("profile", ["intel2-lvm", "kpro6"])
def test_trial_boot_off_installs_the_kernel_without_making_it_the_default(twin_factory, tmp_path, profile):
    """Issue 38 2.3: kernel.trial_boot: false installs the kernel and the running one stays the
    loader's default, by name: on the stock LVM/GRUB install (whose saved_entry the boot stage
    sets to the old GRUB_DEFAULT, `0`: the first entry, the newest kernel) and on an ESP with no
    pin (zz-proxmox-boot writes `default proxmox-*`, the newest). Before, both booted the new one."""
    off = {**KERNEL, "trial_boot": False}
    if profile == "kpro6":
        twin = twin_factory("kpro6", address=quiet_address())
        root = Path(twin.root)
        stages = STAGES
    else:
        twin, root = grub_twin(twin_factory, "lvm")
        stages = GRUB_STAGES
    seed_finished_build(root, tmp_path)
    old = twin_run(twin.name, "uname", "-r").strip()
    run = converge(twin.name, stages=stages, kernel=off)
    assert run.rc == 0, run.output[-6000:]
    assert f"vmlinuz-{RELEASE}" in twin_run(twin.name, "ls", "/boot").split()
    if profile == "kpro6":
        assert loader_default(root) == f"proxmox-{old}.conf" and oneshot(root) is None
    else:
        env = grubenv(twin.name)
        assert f">gnulinux-{old}-advanced-" in env["saved_entry"] and not env.get("next_entry"), env
    again = converge(twin.name, stages=stages, kernel=off)
    assert again.rc == 0 and again.changed == 0, again.output[-4000:]
    assert "trial_boot is off; not made the default" in again.output
    reboot(twin.name)
    assert twin_run(twin.name, "uname", "-r").strip() == old
