"""`apt full-upgrade` installs a new kernel between two runs (issue 25), on the intel2 twin (GRUB).

The host first runs Debian's 6.1.0-57-amd64 (its real headers are in the twin root) with nvidia
built by the NVIDIA stage; the converge also installs the kernel hook. Then a local apt
repository (file:/opt/repo inside the twin, nothing leaves it) offers a newer kernel the way
Proxmox's metas do: proxmox-default-kernel 2 -> proxmox-kernel-6.12 -> the kernel package of
6.12.118+deb12-amd64 (whose real headers are in the twin root too). Each kernel package is a real
.deb in pve-kernel's shape (tests/twin/kernel_packages.py: proxmox-kernel-<rel>-signed, whose
postinst runs depmod and the /etc/kernel/postinst.d hooks as debian/proxmox-kernel.postinst.in
does, so Debian's own dkms, initramfs-tools and zz-update-grub hooks run beside ours; the headers
a package of their own that runs no hook).

The NVIDIA tree is a miniature one in NVIDIA's layout (kernel-open/ with Kbuild, a Makefile
that hands KERNEL_UNAME to kbuild, and five tiny modules named like NVIDIA's, carrying the
version), compiled by real kbuild against the real headers through the stage's build template;
the real tree through that template is tests/e2e/test_driver_build.py's.

follow, builds: modules for 6.12 appear, it becomes the default and boots, dpkg is clean.
follow, fails (#error on kernels from 6.12): the default stays 6.1 (pinned), dpkg is clean,
the reason is kept, shown at login, by --dry and by the host checks.
hold: the metas are held, `apt full-upgrade` installs nothing new.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import time
from pathlib import Path

import pytest

from facts.kernel_hook import OLD_HOOK
from plan import kernel as kplan
from tests.e2e.harness import PYTEST, REPO, manifest_diff, root_manifest, run_pyinfra, spec_inventory, write_tarball
from tests.twin import kernel_packages as kp
from tests.twin import runtime

pytestmark = [pytest.mark.twin]

PROFILE = "intel2"  # GRUB, Proxmox VE 8
VERSION = "580.95.05"
OLD = "6.1.0-57-amd64"
NEW = "6.12.118+deb12-amd64"
MODULES = ("nvidia", "nvidia-uvm", "nvidia-modeset", "nvidia-drm", "nvidia-peermem")
ARCHIVE = f"/opt/src/open-gpu-kernel-modules-{VERSION}.tar.gz"
STAGE_DEPLOY = str(REPO / "tests/e2e/stage_deploy.py")
STAGES = {"PVEGPU_STAGES": "operations.nvidia,operations.kernel_hook"}
HOOK_LOG = f"/var/lib/pvegpu/kernel-hook/{NEW}.log"


# -- the miniature NVIDIA tree ---------------------------------------------------------------------

KBUILD = "".join(f"obj-m += {m}.o\n" for m in MODULES)
# NVIDIA's kernel-open/Makefile: KERNEL_UNAME names /lib/modules/<rel>/build, kbuild builds M=here
MAKEFILE = ("KERNEL_UNAME ?= $(shell uname -r)\n"
            "modules:\n\t$(MAKE) -C /lib/modules/$(KERNEL_UNAME)/build M=$(CURDIR) modules\n")


def module_source(name: str, fail_from_6_12: bool) -> str:
    guard = ("#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 12, 0)\n"
             "#error \"nvidia-mini does not support kernel 6.12 and later\"\n#endif\n") if fail_from_6_12 else ""
    firmware = "".join(f'MODULE_FIRMWARE("nvidia/{VERSION}/{f}");\n' for f in ("gsp_ga10x.bin", "gsp_tu10x.bin")) \
        if name == "nvidia" else ""
    return ("#include <linux/module.h>\n#include <linux/version.h>\n" + guard
            + f'MODULE_LICENSE("Dual MIT/GPL");\nMODULE_VERSION("{VERSION}");\n'
            + f'MODULE_DESCRIPTION("pvegpu e2e miniature of {name}");\n' + firmware)


def mini_tree(out: Path, fail_from_6_12: bool = False) -> Path:
    # version.mk: the open tree names its version there (the build template checks it)
    files = {"version.mk": f"NVIDIA_VERSION = {VERSION}\n", "kernel-open/Kbuild": KBUILD, "kernel-open/Makefile": MAKEFILE}
    for m in MODULES:
        files[f"kernel-open/{m}.c"] = module_source(m, fail_from_6_12 and m == "nvidia")
    archive = out / f"open-gpu-kernel-modules-{VERSION}{'-fails' if fail_from_6_12 else ''}.tar.gz"
    return write_tarball(archive, f"open-gpu-kernel-modules-{VERSION}", files)


# -- kernel packages the way Proxmox ships them (tests/twin/kernel_packages.py) ---------------------

def repo_debs(out: Path, root: Path, upgrade: bool) -> list[Path]:
    """What a Proxmox repository offers, in pve-kernel's and proxmox-kernel-meta's shapes:
    proxmox-default-kernel -> proxmox-kernel-X.Y -> proxmox-kernel-<rel>-signed, and the headers
    chain down to proxmox-headers-<rel>, a package of its own whose postinst runs no hook. The
    headers' files are Debian's real trees in the twin root; proxmox-headers-<NEW> brings the
    /usr/lib/modules/<rel>/build link to them (the 6.1 link is Debian's linux-headers package's)."""
    debs = [kp.pve_firmware(out)]
    for release, series in ((OLD, "6.1"), (NEW, "6.12"))[:2 if upgrade else 1]:
        version = "2" if series == "6.12" else "1"
        files = {f"boot/vmlinuz-{release}": "twin stand-in kernel image\n",
                 f"boot/config-{release}": (root / f"usr/src/linux-headers-{release}/.config").read_text(),
                 f"boot/System.map-{release}": "", f"lib/modules/{release}/modules.order": "",
                 f"lib/modules/{release}/modules.builtin": ""}
        debs += kp.release_chain(out, release, series, "1", version, files,
                                 headers_kwargs={"build_link": release == NEW})
    return debs


# -- the twin --------------------------------------------------------------------------------------

def twin_sh(twin, command: str, check: bool = True, timeout: int = 600) -> str:
    done = runtime.ssh_run(twin.name, [command], timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"in twin: {command}: exit {done.returncode}\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done.stdout + (done.stderr if not check else "")


def publish(twin, tmp: Path, upgrade: bool) -> None:
    """The local repository in the twin, and apt pointed at it alone."""
    root = Path(twin.root)
    repo = root / "opt/repo"
    if repo.exists():
        subprocess.run(["rm", "-rf", str(repo)], check=True)
    repo.mkdir(parents=True)
    out = tmp / ("debs-2" if upgrade else "debs-1")
    out.mkdir()
    for path in repo_debs(out, root, upgrade):
        (repo / path.name).write_bytes(path.read_bytes())
    twin_sh(twin, "mkdir -p /root/apt-sources && mv /etc/apt/sources.list /etc/apt/sources.list.d/* /root/apt-sources/ "
                  "2>/dev/null; echo 'deb [trusted=yes] file:/opt/repo ./' > /etc/apt/sources.list.d/pvegpu-e2e.list; "
                  "cd /opt/repo && dpkg-scanpackages -m . > Packages 2>/dev/null && apt-get -q update")
    # apt runs dpkg with PATH=DPkg::Path (apt-pkg/deb/dpkgpm.cc, default /usr/sbin:/usr/bin:/sbin:/bin);
    # the twin's stand-ins of /usr/sbin/update-grub and /usr/sbin/proxmox-boot-tool are in /usr/local/sbin
    (root / "etc/apt/apt.conf.d/99pvegpu-twin-standins").write_text(
        'DPkg::Path "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";\n')


def reboot(twin) -> None:
    boots = runtime.twin_dir(twin.name) / "boots"
    before = len(boots.read_text().splitlines())
    subprocess.run(runtime.ssh_command(twin.name, ["reboot"]), capture_output=True, timeout=60)
    deadline = time.monotonic() + 60
    while len(boots.read_text().splitlines()) == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(boots.read_text().splitlines()) > before, "the twin did not reboot"


def write_inventory(tmp: Path, twin, sha: str, updates: str, node: str = PROFILE) -> str:
    nvidia = {"version": VERSION, "open": True, "modules_source": {"url": f"file://{ARCHIVE}", "sha256": sha},
              "firmware": False, "persistenced": False}
    return spec_inventory(tmp, twin, {"node": node, "kernel_updates": updates, "nvidia": nvidia}, "upgrade")


def converge(inventory: str, *args: str):
    return run_pyinfra(inventory, STAGE_DEPLOY, *args, env=STAGES, timeout=900)


def host_checks(inventory: str) -> subprocess.CompletedProcess:
    return subprocess.run([PYTEST, "-q", "-rA", "-p", "no:cacheprovider", "tests/host/test_boot.py", "-k", "nvidia_driver",
                           "--inventory", inventory], cwd=REPO, capture_output=True, text=True, timeout=600)


def nvidia_version(twin, release: str) -> str:
    return twin_sh(twin, f"modinfo -k {release} -F version nvidia 2>/dev/null || true").strip()


def grub_default(twin) -> str:
    """The kernel the twin boots next (its GRUB model: next-boot pin, pin, else the newest)."""
    return twin_sh(twin, "head -n1 /etc/kernel/next-boot-pin 2>/dev/null || head -n1 /etc/kernel/proxmox-boot-pin "
                         "2>/dev/null || true").strip()


@pytest.fixture
def host_on_6_1(twin_factory, tmp_path):
    """A Proxmox host running 6.1.0-57-amd64 with nvidia VERSION's (miniature) modules, installed
    through apt from the local repository, before any converge."""
    def make(fail_from_6_12: bool, updates: str = "follow", profile: str = PROFILE):
        twin = twin_factory(profile)
        root = Path(twin.root)
        archive = mini_tree(tmp_path, fail_from_6_12)
        (root / "opt/src").mkdir(parents=True, exist_ok=True)
        (root / ARCHIVE.lstrip("/")).write_bytes(archive.read_bytes())
        # the profile seeds its own driver's NVML library; this host has no NVIDIA user space yet
        twin_sh(twin, "rm -f /usr/lib/x86_64-linux-gnu/libnvidia-ml.so*")
        # the root's unpacked 6.12 headers are usable once proxmox-headers-<NEW> brings their build link
        twin_sh(twin, f"rm -f /lib/modules/{NEW}/build")
        publish(twin, tmp_path, upgrade=False)
        twin_sh(twin, "DEBIAN_FRONTEND=noninteractive apt-get -q install -y proxmox-default-kernel")
        # one boot into 6.1 (on ESPs the pin reaches the loader through the refresh)
        twin_sh(twin, f"proxmox-boot-tool kernel pin {OLD} --next-boot && proxmox-boot-tool refresh")
        reboot(twin)
        assert twin_sh(twin, "uname -r").strip() == OLD
        inventory = write_inventory(tmp_path, twin, hashlib.sha256(archive.read_bytes()).hexdigest(), updates, profile)
        # converged by an older pvegpu: its hook under the old name, which ran after initramfs-tools
        # (whose update-initramfs copied the new kernel onto the ESPs before the build; issue 38 §3)
        twin_sh(twin, f"printf '#!/bin/sh\\necho older-pvegpu-hook >>/root/old-hook-ran\\n' >{OLD_HOOK} && chmod 755 {OLD_HOOK}")
        first = converge(inventory)
        assert first.rc == 0, first.output[-6000:]
        assert "remove its old name" in first.output, first.output[-3000:]
        assert twin_sh(twin, f"test -e {OLD_HOOK} || echo gone").strip() == "gone"
        assert nvidia_version(twin, OLD) == VERSION
        installed = twin_sh(twin, "dpkg-query -W -f '${Package} ${Status}\\n' 'proxmox-*headers*' 2>/dev/null || true")
        if updates == "follow":  # the headers follow the kernels from now on
            assert "Install proxmox-default-headers" in first.output, first.output[-3000:]
            assert "proxmox-default-headers install ok installed" in installed, installed
        else:
            assert "proxmox-default-headers install ok installed" not in installed, installed
        assert twin_sh(twin, "test -x /etc/kernel/postinst.d/00pvegpu-nvidia && echo yes").strip() == "yes"
        again = converge(inventory)
        assert again.rc == 0 and again.changed == 0, again.output[-4000:]
        return twin, inventory
    return make


def full_upgrade(twin, tmp_path) -> str:
    publish(twin, tmp_path, upgrade=True)
    return twin_sh(twin, "DEBIAN_FRONTEND=noninteractive apt-get -q full-upgrade -y 2>&1")


def test_follow_builds_the_new_kernel_s_modules_and_it_becomes_the_default(host_on_6_1, tmp_path):
    twin, inventory = host_on_6_1(fail_from_6_12=False)
    upgrade = full_upgrade(twin, tmp_path)
    assert f"proxmox-kernel-{NEW}" in upgrade, upgrade[-3000:]
    assert f"pvegpu: nvidia {VERSION} installed for {NEW}" in upgrade, upgrade[-4000:]
    assert f"proxmox-headers-{NEW}" in upgrade, upgrade[-3000:]  # came with proxmox-default-headers 2
    # the kernel's postinst (run-parts --verbose): our hook first, before initramfs-tools' ESP refresh;
    # the old name is gone
    hooks = re.findall(rf"^run-parts: executing /etc/kernel/postinst.d/(\S+) {re.escape(NEW)} ", upgrade, re.M)
    assert hooks[0] == "00pvegpu-nvidia" and "initramfs-tools" in hooks and "pvegpu-nvidia" not in hooks, hooks
    assert "older-pvegpu-hook" not in twin_sh(twin, "cat /root/old-hook-ran 2>/dev/null || true")
    assert twin_sh(twin, "dpkg --audit").strip() == ""
    for module in MODULES:
        info = twin_sh(twin, f"modinfo -k {NEW} -F filename {module}; modinfo -k {NEW} -F vermagic {module}").split("\n")
        assert info[0].startswith(f"/lib/modules/{NEW}/updates/pvegpu-nvidia/"), info
        assert info[1].split()[0] == NEW, info
    assert nvidia_version(twin, NEW) == VERSION
    assert grub_default(twin) == ""  # nothing pinned: the newest kernel is the default
    reboot(twin)
    assert twin_sh(twin, "uname -r").strip() == NEW
    checks = host_checks(inventory)
    assert checks.returncode == 0, checks.stdout[-3000:]


# intel2: GRUB (the pin reaches grub.cfg through update-grub); kpro6: systemd-boot on an ESP listed in
# /etc/kernel/proxmox-boot-uuids (the pin reaches loader.conf through zz-proxmox-boot, which runs after the hook)
@pytest.mark.parametrize("profile", ["intel2", "kpro6"])
def test_follow_keeps_the_old_default_when_the_new_kernel_cannot_build(host_on_6_1, tmp_path, profile):
    twin, inventory = host_on_6_1(fail_from_6_12=True, profile=profile)
    upgrade = full_upgrade(twin, tmp_path)
    assert f"proxmox-kernel-{NEW}" in upgrade, upgrade[-3000:]
    assert "nvidia-mini does not support kernel 6.12 and later" in upgrade, upgrade[-4000:]
    assert twin_sh(twin, "dpkg --audit").strip() == ""  # the kernel package is configured
    assert twin_sh(twin, f"dpkg-query -W -f '${{Status}}' proxmox-kernel-{NEW}-signed") == "install ok installed"
    assert nvidia_version(twin, NEW) == ""
    assert grub_default(twin) == OLD
    failed = twin_sh(twin, f"cat /var/lib/pvegpu/kernel-hook/{NEW}.failed")
    assert "nvidia-mini does not support kernel 6.12 and later" in failed and f"{OLD} stays the boot default" in failed
    motd = twin_sh(twin, "cat /etc/motd.d/pvegpu-kernel")
    assert NEW in motd and "nvidia-mini does not support kernel 6.12" in motd
    if profile == "kpro6":
        loader = (Path(twin.root) / "var/lib/twin/esp/5A1C-9E27/loader/loader.conf").read_text()
        assert f"default proxmox-{OLD}.conf" in loader, loader
    reboot(twin)
    assert twin_sh(twin, "uname -r").strip() == OLD

    before = root_manifest(twin.root)
    dry = converge(inventory, "--dry")
    assert dry.rc == 0, dry.output[-4000:]
    assert manifest_diff(before, root_manifest(twin.root)) == [], "--dry changed the twin"
    assert "kernel updates: follow" in dry.output
    assert f"kernel {NEW}: nvidia {VERSION} could not be built for kernel {NEW}" in dry.output, dry.output[-4000:]
    # the package installed is -signed (it only Provides proxmox-kernel-<rel>, which dpkg-reconfigure refuses)
    assert f"`dpkg-reconfigure proxmox-kernel-{NEW}-signed` runs the hook again" in dry.output, dry.output[-4000:]
    assert "nvidia-mini does not support kernel 6.12 and later" in dry.output
    checks = host_checks(inventory)
    assert checks.returncode == 1, checks.stdout[-3000:]
    assert f"kernel {NEW}: nvidia {VERSION} could not be built" in checks.stdout, checks.stdout[-3000:]
    # the pinned 6.1 boots next, and it has them
    assert "PASSED tests/host/test_boot.py::test_kernels_the_loader_boots_next_have_the_nvidia_driver" in checks.stdout, \
        checks.stdout[-3000:]

    # a one-shot entry for 6.12: the next-boot check names it. GRUB: `kernel pin --next-boot`; systemd-boot:
    # `bootctl set-oneshot`, as pvegpu's EFI default (LoaderEntryDefault, set with the hook's pin) wins over
    # a --next-boot pin's loader.conf line (systemd-boot boot.c; docs/howto/kernel-update.md)
    if profile == "kpro6":
        twin_sh(twin, f"bootctl set-oneshot {kplan.LOADER_ENTRY_PREFIX}{NEW}.conf")
    else:
        twin_sh(twin, f"proxmox-boot-tool kernel pin {NEW} --next-boot && proxmox-boot-tool refresh")
    checks = host_checks(inventory)
    # (the check reads the loader: where it looked, the kernel it picks and why, plan.loader.next_boot)
    assert f"would come up without its GPU driver: kernel {NEW} has nvidia missing, not {VERSION}" in checks.stdout, \
        checks.stdout[-3000:]
    assert f"): {NEW} by " in checks.stdout, checks.stdout[-3000:]
    twin_sh(twin, "bootctl set-oneshot ''" if profile == "kpro6"
            else "proxmox-boot-tool kernel unpin --next-boot && proxmox-boot-tool refresh")

    # the cause fixed (a tree that builds for 6.12, through the spec): the converge fetches it for the
    # hook, `dpkg-reconfigure` reruns the kernel's postinst and so the hook, which builds and drops its pin
    (tmp_path / "fixed").mkdir()
    fixed = mini_tree(tmp_path / "fixed", fail_from_6_12=False)
    (Path(twin.root) / ARCHIVE.lstrip("/")).write_bytes(fixed.read_bytes())
    inventory = write_inventory(tmp_path, twin, hashlib.sha256(fixed.read_bytes()).hexdigest(), "follow", profile)
    run = converge(inventory)
    assert run.rc == 0 and "for the kernel hook" in run.output, run.output[-4000:]
    # what the advice said before (issue 38 2.7): the name the -signed package only Provides
    wrong = twin_sh(twin, f"DEBIAN_FRONTEND=noninteractive dpkg-reconfigure proxmox-kernel-{NEW} 2>&1", check=False)
    assert f"proxmox-kernel-{NEW} is not installed" in wrong, wrong[-2000:]
    again = twin_sh(twin, f"DEBIAN_FRONTEND=noninteractive dpkg-reconfigure proxmox-kernel-{NEW}-signed 2>&1")
    assert f"pvegpu: nvidia {VERSION} installed for {NEW}" in again, again[-3000:]
    # its own pin goes where unpinned the loader boots 6.12 (intel2); on kpro6 the newest kernel is the
    # profile's 6.14.8-2-pve (other modules), so the pin moves to 6.12 instead
    assert nvidia_version(twin, NEW) == VERSION and grub_default(twin) == ("" if profile == "intel2" else NEW)
    assert twin_sh(twin, "ls /var/lib/pvegpu/kernel-hook/ /etc/motd.d/").split().count(f"{NEW}.failed") == 0
    assert twin_sh(twin, "test -e /etc/motd.d/pvegpu-kernel || echo gone").strip() == "gone"
    checks = host_checks(inventory)
    assert checks.returncode == 0, checks.stdout[-3000:]


def test_headers_installed_after_their_kernel_get_its_modules_built_without_a_converge(host_on_6_1, tmp_path):
    """Issue 38 2.7: the kernel comes in one apt run without its headers (proxmox-default-headers
    not upgraded with it), its postinst runs the hook, which cannot build and keeps 6.1 the
    default; the headers come in a later apt run (as the hook's message asks), and their postinst
    runs no kernel hook (pve-kernel debian/proxmox-headers.postinst.in). apt's DPkg::Post-Invoke
    runs the hook's --headers pass: nvidia is built for 6.12 then, with no converge."""
    twin, inventory = host_on_6_1(fail_from_6_12=False)
    publish(twin, tmp_path, upgrade=True)
    kernel = twin_sh(twin, "DEBIAN_FRONTEND=noninteractive apt-get -q install -y proxmox-default-kernel 2>&1")
    assert f"Unpacking proxmox-kernel-{NEW}-signed" in kernel and f"Unpacking proxmox-headers-{NEW}" not in kernel, \
        kernel[-3000:]
    assert f"no headers at /lib/modules/{NEW}/build (install proxmox-headers-{NEW}" in kernel, kernel[-3000:]
    assert nvidia_version(twin, NEW) == "" and grub_default(twin) == OLD
    headers = twin_sh(twin, f"DEBIAN_FRONTEND=noninteractive apt-get -q install -y proxmox-headers-{NEW} 2>&1")
    assert f"pvegpu: nvidia {VERSION} installed for {NEW}" in headers, headers[-4000:]
    assert nvidia_version(twin, NEW) == VERSION
    assert twin_sh(twin, "dpkg --audit").strip() == ""
    assert twin_sh(twin, "ls /var/lib/pvegpu/kernel-hook/").split().count(f"{NEW}.failed") == 0
    assert twin_sh(twin, "test -e /etc/motd.d/pvegpu-kernel || echo gone").strip() == "gone"
    assert grub_default(twin) == ""  # its pin of 6.1 dropped: the newest kernel, with modules, is the default
    reboot(twin)
    assert twin_sh(twin, "uname -r").strip() == NEW


def test_hold_installs_no_new_kernel(host_on_6_1, tmp_path):
    twin, inventory = host_on_6_1(fail_from_6_12=False, updates="hold")
    held = twin_sh(twin, "apt-mark showhold").split()
    assert held == ["proxmox-default-kernel", "proxmox-kernel-6.1"], held
    dry = converge(inventory, "--dry")
    assert "kernel updates: hold at 6.1" in dry.output, dry.output[-3000:]
    upgrade = full_upgrade(twin, tmp_path)
    assert "proxmox-default-kernel" in upgrade and f"proxmox-kernel-{NEW}" not in upgrade.split("kept back")[-1], upgrade
    assert not (Path(twin.root) / f"boot/vmlinuz-{NEW}").exists()
    assert twin_sh(twin, f"dpkg-query -W -f '${{Status}}' proxmox-kernel-{NEW} 2>/dev/null || true").strip() \
        in ("", "unknown ok not-installed")
    assert twin_sh(twin, "dpkg-query -W -f '${Version}' proxmox-default-kernel") == "1"

    # back to follow: pvegpu's holds go, and the next full-upgrade brings 6.12 with its modules
    follow = write_inventory(tmp_path, twin, hashlib.sha256((Path(twin.root) / ARCHIVE.lstrip("/")).read_bytes())
                             .hexdigest(), "follow")
    run = converge(follow)
    assert run.rc == 0 and "Release the kernel holds pvegpu set" in run.output, run.output[-4000:]
    assert twin_sh(twin, "apt-mark showhold").split() == []
    upgrade = twin_sh(twin, "DEBIAN_FRONTEND=noninteractive apt-get -q full-upgrade -y 2>&1")
    assert f"pvegpu: nvidia {VERSION} installed for {NEW}" in upgrade, upgrade[-3000:]
